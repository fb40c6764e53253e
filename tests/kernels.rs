//! CPU kernels against naive f64 references (NMSE limits as ggml's test-backend-ops), in-place
//! runs, thread-count independence, guard bytes, and error paths.
#![allow(clippy::needless_range_loop)] // references index like the math they mirror

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use ferrograph::buffer::alloc_cpu_buffer;
use ferrograph::context::Context;
use ferrograph::cpu::{compute_graph, compute_node, supports_op, work_size, ComputeOptions};
use ferrograph::dtype::DType;
use ferrograph::error::{Error, Result, Status};
use ferrograph::graph::Graph;
use ferrograph::ops::{self, CustomOp, GluOp, RopeMode, RopeParams, UnaryOp};
use ferrograph::pool::{Threadpool, ThreadpoolParams};
use ferrograph::tensor::Tensor;
use half::f16;

// ----- helpers -----

struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn uniform(&mut self, lo: f32, hi: f32) -> f32 {
        let u = (self.next() >> 40) as f32 / (1u64 << 24) as f32;
        lo + (hi - lo) * u
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

fn pool(threads: usize) -> std::sync::Arc<Threadpool> {
    Threadpool::new(&ThreadpoolParams::new(threads)).expect("thread pool")
}

/// Fills a float tensor with uniform values and returns them as stored (rounded to its dtype).
fn fill(t: &Tensor, rng: &mut Rng, lo: f32, hi: f32) -> Vec<f32> {
    let values: Vec<f32> = (0..t.nelements()).map(|_| rng.uniform(lo, hi)).collect();
    t.set_f32(&values).unwrap();
    t.to_f32_vec().unwrap()
}

fn fill_i32(t: &Tensor, values: &[i32]) {
    let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_ne_bytes()).collect();
    t.write_bytes(0, &bytes).unwrap();
}

/// Thread counts every kernel result is computed at.
const THREAD_COUNTS: [usize; 3] = [1, 2, 3];

fn bytes_of(t: &Tensor) -> Option<Vec<u8>> {
    let mut bytes = vec![0u8; t.nbytes()];
    t.read_bytes(0, &mut bytes).ok().map(|()| bytes)
}

/// Computes `graph` once per count of [`THREAD_COUNTS`], restoring every leaf's bytes before each
/// run (in-place ops overwrite their inputs), and asserts that every node's bytes are identical
/// for all thread counts. Returns the first error or the common status; the results of the last
/// run stay in the tensors.
fn compute_graph_all_threads(graph: &Graph, reference: bool) -> Result<Status> {
    let options = ComputeOptions {
        use_reference: reference,
        ..Default::default()
    };
    let inputs: Vec<(Tensor, Vec<u8>)> = graph
        .leafs()
        .iter()
        .filter_map(|t| bytes_of(t).map(|b| (t.clone(), b)))
        .collect();
    let mut first: Option<(Status, Vec<Option<Vec<u8>>>)> = None;
    for threads in THREAD_COUNTS {
        for (t, bytes) in &inputs {
            t.write_bytes(0, bytes).unwrap();
        }
        let status = compute_graph(graph, &pool(threads), &options, None)?;
        let results: Vec<Option<Vec<u8>>> = graph.nodes().iter().map(bytes_of).collect();
        match &first {
            None => first = Some((status, results)),
            Some((status1, results1)) => {
                assert_eq!(status, *status1, "status at {threads} threads vs 1");
                for ((node, got), want) in graph.nodes().iter().zip(&results).zip(results1) {
                    assert!(
                        got == want,
                        "{node:?}: bits at {threads} threads differ from 1 thread"
                    );
                }
            }
        }
    }
    Ok(first.expect("at least one thread count").0)
}

/// Computes the graph of `out` at every thread count (see [`compute_graph_all_threads`]).
fn compute_with(out: &Tensor, reference: bool) -> Result<Status> {
    compute_graph_all_threads(&Graph::build(std::slice::from_ref(out)), reference)
}

fn compute(out: &Tensor) {
    assert_eq!(compute_with(out, false).unwrap(), Status::Success);
}

fn nmse(got: &[f32], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len(), "element counts differ");
    let mut err = 0f64;
    let mut norm = 0f64;
    for (&g, &w) in got.iter().zip(want) {
        if w.is_infinite() || g.is_infinite() {
            assert_eq!(g as f64, w, "infinities differ");
            continue;
        }
        assert!(!g.is_nan() && !w.is_nan(), "NaN: got {g}, want {w}");
        err += (g as f64 - w) * (g as f64 - w);
        norm += w * w;
    }
    if norm == 0.0 {
        err
    } else {
        err / norm
    }
}

#[track_caller]
fn check(what: &str, got: &[f32], want: &[f64], limit: f64) {
    let e = nmse(got, want);
    assert!(e <= limit, "{what}: NMSE {e:e} > {limit:e}");
}

fn idx(ne: [usize; 4], i0: usize, i1: usize, i2: usize, i3: usize) -> usize {
    i0 + ne[0] * (i1 + ne[1] * (i2 + ne[2] * i3))
}

fn coords(ne: [usize; 4], k: usize) -> [usize; 4] {
    [
        k % ne[0],
        (k / ne[0]) % ne[1],
        (k / (ne[0] * ne[1])) % ne[2],
        k / (ne[0] * ne[1] * ne[2]),
    ]
}

fn round_to(dtype: DType, v: f64) -> f64 {
    match dtype {
        DType::F16 => f16::from_f64(v).to_f64(),
        DType::BF16 => half::bf16::from_f64(v).to_f64(),
        _ => v as f32 as f64,
    }
}

// Test-side q8_0 / q4_0 codecs (ggml's reference layout) so quantized tests do not depend on
// `crate::quant`.
fn quantize_q8_0(x: &[f32]) -> Vec<u8> {
    let mut out = Vec::new();
    for xs in x.chunks(32) {
        let amax = xs.iter().fold(0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        out.extend_from_slice(&f16::from_f32(d).to_bits().to_ne_bytes());
        out.extend(xs.iter().map(|v| ((v * id).round() as i8) as u8));
    }
    out
}

fn dequantize_q8_0(b: &[u8]) -> Vec<f32> {
    b.chunks(34)
        .flat_map(|blk| {
            let d = f16::from_bits(u16::from_ne_bytes([blk[0], blk[1]])).to_f32();
            blk[2..].iter().map(move |&q| q as i8 as f32 * d)
        })
        .collect()
}

fn quantize_q4_0(x: &[f32]) -> Vec<u8> {
    let mut out = Vec::new();
    for xs in x.chunks(32) {
        let mut amax = 0f32;
        let mut max = 0f32;
        for &v in xs {
            if amax < v.abs() {
                amax = v.abs();
                max = v;
            }
        }
        let d = max / -8.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        out.extend_from_slice(&f16::from_f32(d).to_bits().to_ne_bytes());
        for j in 0..16 {
            let a = ((xs[j] * id + 8.5) as i8).min(15) as u8;
            let b = ((xs[j + 16] * id + 8.5) as i8).min(15) as u8;
            out.push(a | (b << 4));
        }
    }
    out
}

fn dequantize_q4_0(b: &[u8]) -> Vec<f32> {
    let mut out = Vec::new();
    for blk in b.chunks(18) {
        let d = f16::from_bits(u16::from_ne_bytes([blk[0], blk[1]])).to_f32();
        let mut vals = [0f32; 32];
        for j in 0..16 {
            vals[j] = ((blk[2 + j] & 15) as i32 - 8) as f32 * d;
            vals[j + 16] = ((blk[2 + j] >> 4) as i32 - 8) as f32 * d;
        }
        out.extend_from_slice(&vals);
    }
    out
}

/// Fills a (contiguous) quantized tensor and returns its dequantized values.
fn fill_quant(t: &Tensor, rng: &mut Rng) -> Vec<f32> {
    let values: Vec<f32> = (0..t.nelements()).map(|_| rng.uniform(-1.0, 1.0)).collect();
    let (bytes, back) = match t.dtype() {
        DType::Q8_0 => {
            let b = quantize_q8_0(&values);
            let back = dequantize_q8_0(&b);
            (b, back)
        }
        _ => {
            let b = quantize_q4_0(&values);
            let back = dequantize_q4_0(&b);
            (b, back)
        }
    };
    t.write_bytes(0, &bytes).unwrap();
    back
}

fn read_quant(t: &Tensor) -> Vec<f32> {
    let mut bytes = vec![0u8; t.nbytes()];
    t.read_bytes(0, &mut bytes).unwrap();
    match t.dtype() {
        DType::Q8_0 => dequantize_q8_0(&bytes),
        _ => dequantize_q4_0(&bytes),
    }
}

fn fill_any(t: &Tensor, rng: &mut Rng) -> Vec<f32> {
    if t.dtype().is_quantized() {
        fill_quant(t, rng)
    } else {
        fill(t, rng, -1.0, 1.0)
    }
}

/// Rebinds `out` to `src`'s memory so the op runs in place.
fn make_inplace(out: &Tensor, src: &Tensor) {
    let storage = src.storage().unwrap();
    out.bind(&storage.buffer, storage.offset).unwrap();
}

/// Rebinds `out` into a fresh buffer with 64 guard bytes on each side filled with a pattern;
/// returns a checker.
fn guard(out: &Tensor) -> impl Fn() {
    let size = out.nbytes();
    let buffer = alloc_cpu_buffer(size + 128).unwrap();
    buffer.clear(0xA5).unwrap();
    out.bind(&buffer, 64).unwrap();
    move || {
        let mut head = vec![0u8; 64];
        let mut tail = vec![0u8; 64];
        buffer.read(0, &mut head).unwrap();
        buffer.read(64 + size, &mut tail).unwrap();
        assert!(head.iter().all(|&b| b == 0xA5), "write before the output");
        assert!(tail.iter().all(|&b| b == 0xA5), "write after the output");
    }
}

fn ctx() -> Context {
    Context::new(false)
}

// ----- binary -----

fn binary_ref(kind: &str, a: &[f32], ane: [usize; 4], b: &[f32], bne: [usize; 4]) -> Vec<f64> {
    (0..a.len())
        .map(|k| {
            let c = coords(ane, k);
            let bi = idx(
                bne,
                c[0] % bne[0],
                c[1] % bne[1],
                c[2] % bne[2],
                c[3] % bne[3],
            );
            let (x, y) = (a[k] as f64, b[bi] as f64);
            match kind {
                "add" => x + y,
                "sub" => x - y,
                "mul" => x * y,
                _ => x / y,
            }
        })
        .collect()
}

type BinaryBuilder = fn(&Context, &Tensor, &Tensor) -> Result<Tensor>;

#[test]
fn binary_ops_broadcast_by_modulo() {
    let ops: [(&str, BinaryBuilder); 4] = [
        ("add", ops::add),
        ("sub", ops::sub),
        ("mul", ops::mul),
        ("div", ops::div),
    ];
    let ane = [33, 7, 3, 2];
    let shapes = [
        [33, 7, 3, 2],
        [33, 1, 3, 1],
        [1, 7, 1, 2],
        [11, 7, 1, 1],
        [1, 1, 1, 1],
    ];
    let mut rng = Rng::new(1);
    for (name, build) in ops {
        for bne in shapes {
            for dtype in [DType::F32, DType::F16, DType::BF16] {
                let c = ctx();
                let a = c.new_tensor(dtype, &ane).unwrap();
                let b = c.new_tensor(DType::F32, &bne).unwrap();
                let av = fill(&a, &mut rng, -1.0, 1.0);
                let bv = fill(&b, &mut rng, 0.5, 1.5);
                let out = build(&c, &a, &b).unwrap();
                let check_guard = guard(&out);
                compute(&out);
                check_guard();
                let want: Vec<f64> = binary_ref(name, &av, ane, &bv, bne)
                    .into_iter()
                    .map(|v| round_to(dtype, v))
                    .collect();
                let limit = if dtype == DType::F32 { 1e-7 } else { 1e-6 };
                check(
                    &format!("{name} {dtype} b{bne:?}"),
                    &out.to_f32_vec().unwrap(),
                    &want,
                    limit,
                );
            }
        }
    }
}

#[test]
fn binary_with_permuted_operands_and_same_dtype_src1() {
    let mut rng = Rng::new(2);
    let c = ctx();
    let base = c.new_tensor(DType::F32, &[7, 33, 5]).unwrap();
    let bv0 = fill(&base, &mut rng, -1.0, 1.0);
    let a = ops::permute(&c, &base, [1, 0, 2, 3]).unwrap(); // [33, 7, 5]
    let b = c.new_tensor(DType::F32, &[33, 7, 1]).unwrap();
    let bv = fill(&b, &mut rng, -1.0, 1.0);
    let out = ops::mul(&c, &a, &b).unwrap();
    compute(&out);
    let ane = a.ne();
    let av: Vec<f32> = (0..a.nelements())
        .map(|k| {
            let [i0, i1, i2, _] = coords(ane, k);
            bv0[idx(base.ne(), i1, i0, i2, 0)]
        })
        .collect();
    check(
        "mul permuted",
        &out.to_f32_vec().unwrap(),
        &binary_ref("mul", &av, ane, &bv, b.ne()),
        1e-7,
    );

    let a16 = c.new_tensor(DType::F16, &[65, 3]).unwrap();
    let b16 = c.new_tensor(DType::F16, &[65, 1]).unwrap();
    let av = fill(&a16, &mut rng, -1.0, 1.0);
    let bv = fill(&b16, &mut rng, -1.0, 1.0);
    let out = ops::add(&c, &a16, &b16).unwrap();
    compute(&out);
    let want: Vec<f64> = binary_ref("add", &av, a16.ne(), &bv, b16.ne())
        .into_iter()
        .map(|v| round_to(DType::F16, v))
        .collect();
    check("add f16+f16", &out.to_f32_vec().unwrap(), &want, 1e-6);
}

#[test]
fn add1_and_acc() {
    let mut rng = Rng::new(3);
    let c = ctx();
    let a = c.new_tensor(DType::F32, &[17, 5, 2]).unwrap();
    let s = c.new_tensor(DType::F32, &[1]).unwrap();
    let av = fill(&a, &mut rng, -1.0, 1.0);
    let sv = fill(&s, &mut rng, -1.0, 1.0);
    let out = ops::add1(&c, &a, &s).unwrap();
    compute(&out);
    let want: Vec<f64> = av.iter().map(|&x| x as f64 + sv[0] as f64).collect();
    check("add1", &out.to_f32_vec().unwrap(), &want, 1e-7);

    // ACC: b [4, 3] into a [17, 5, 2] at row stride 17, plane stride 85, offset (1 row + 2).
    let b = c.new_tensor(DType::F32, &[4, 3]).unwrap();
    let bv = fill(&b, &mut rng, -1.0, 1.0);
    let (nb1, nb2, nb3) = (17 * 4, 85 * 4, 170 * 4);
    let offset = (17 + 2) * 4;
    let out = ops::acc(&c, &a, &b, nb1, nb2, nb3, offset).unwrap();
    let check_guard = guard(&out);
    compute(&out);
    check_guard();
    let mut want: Vec<f64> = av.iter().map(|&x| x as f64).collect();
    for i1 in 0..3 {
        for i0 in 0..4 {
            want[(offset + i1 * nb1) / 4 + i0] += bv[i1 * 4 + i0] as f64;
        }
    }
    check("acc", &out.to_f32_vec().unwrap(), &want, 1e-7);
}

// ----- element-wise -----

fn unary_ref(op: UnaryOp, x: f64) -> f64 {
    match op {
        UnaryOp::Abs => x.abs(),
        UnaryOp::Sgn => {
            if x > 0.0 {
                1.0
            } else if x < 0.0 {
                -1.0
            } else {
                0.0
            }
        }
        UnaryOp::Neg => -x,
        UnaryOp::Step => (x > 0.0) as i32 as f64,
        UnaryOp::Tanh => x.tanh(),
        UnaryOp::Elu => {
            if x > 0.0 {
                x
            } else {
                x.exp_m1()
            }
        }
        UnaryOp::Relu => x.max(0.0),
        UnaryOp::Sigmoid => 1.0 / (1.0 + (-x).exp()),
        UnaryOp::Gelu => {
            0.5 * x
                * (1.0
                    + ((2.0 / std::f64::consts::PI).sqrt() * x * (1.0 + 0.044715 * x * x)).tanh())
        }
        UnaryOp::GeluErf => 0.5 * x * (1.0 + erf64(x / std::f64::consts::SQRT_2)),
        UnaryOp::GeluQuick => x / (1.0 + (-1.702 * x).exp()),
        UnaryOp::Silu => x / (1.0 + (-x).exp()),
        UnaryOp::Hardswish => x * ((x + 3.0) / 6.0).clamp(0.0, 1.0),
        UnaryOp::Hardsigmoid => ((x + 3.0) / 6.0).clamp(0.0, 1.0),
        UnaryOp::Exp => x.exp(),
    }
}

/// erf by its Taylor series (|x| ≤ 3) or asymptotic complement: accurate to ~1e-12 here.
fn erf64(x: f64) -> f64 {
    if x.abs() > 5.0 {
        return x.signum();
    }
    let mut sum = 0.0f64;
    let mut term = x;
    let mut n = 0.0;
    while term.abs() > 1e-17 * sum.abs().max(1e-300) || n < 3.0 {
        sum += term / (2.0 * n + 1.0);
        n += 1.0;
        term *= -x * x / n;
        if n > 200.0 {
            break;
        }
    }
    sum * 2.0 / std::f64::consts::PI.sqrt()
}

#[test]
fn unary_ops_f32_and_f16() {
    let mut rng = Rng::new(4);
    for dtype in [DType::F32, DType::F16] {
        for op in UnaryOp::ALL {
            let c = ctx();
            let a = c.new_tensor(dtype, &[65, 7, 3]).unwrap();
            let av = fill(&a, &mut rng, -4.0, 4.0);
            let out = ops::unary(&c, &a, op).unwrap();
            compute(&out);
            let want: Vec<f64> = av
                .iter()
                .map(|&x| round_to(dtype, unary_ref(op, x as f64)))
                .collect();
            let limit = if dtype == DType::F32 { 1e-7 } else { 1e-6 };
            check(
                &format!("{} {dtype}", op.name()),
                &out.to_f32_vec().unwrap(),
                &want,
                limit,
            );
        }
    }
}

#[test]
fn simple_elementwise_ops() {
    let mut rng = Rng::new(5);
    type Case = (
        &'static str,
        fn(&Context, &Tensor) -> Result<Tensor>,
        fn(f64) -> f64,
        f32,
        f32,
    );
    let cases: [Case; 9] = [
        ("sqr", ops::sqr, |x| x * x, -2.0, 2.0),
        ("sqrt", ops::sqrt, f64::sqrt, 0.0, 4.0),
        ("log", ops::log, f64::ln, 0.1, 4.0),
        ("sin", ops::sin, f64::sin, -3.0, 3.0),
        ("cos", ops::cos, f64::cos, -3.0, 3.0),
        (
            "scale",
            |c, a| ops::scale(c, a, 2.5, -0.5),
            |x| x * 2.5 - 0.5,
            -1.0,
            1.0,
        ),
        (
            "clamp",
            |c, a| ops::clamp(c, a, -0.3, 0.4),
            |x| x.clamp(-0.3, 0.4),
            -1.0,
            1.0,
        ),
        (
            "leaky_relu",
            |c, a| ops::leaky_relu(c, a, 0.1),
            |x| if x > 0.0 { x } else { 0.1 * x },
            -1.0,
            1.0,
        ),
        ("cont", ops::cont, |x| x, -1.0, 1.0),
    ];
    for (name, build, reference, lo, hi) in cases {
        for dtype in [DType::F32, DType::BF16] {
            let c = ctx();
            let a = c.new_tensor(dtype, &[1, 33, 2]).unwrap();
            let av = fill(&a, &mut rng, lo, hi);
            let out = build(&c, &a).unwrap();
            compute(&out);
            let want: Vec<f64> = av
                .iter()
                .map(|&x| round_to(dtype, reference(x as f64)))
                .collect();
            let limit = if dtype == DType::F32 { 1e-7 } else { 1e-5 };
            check(
                &format!("{name} {dtype}"),
                &out.to_f32_vec().unwrap(),
                &want,
                limit,
            );
        }
    }
}

#[test]
fn glu_fused_swapped_and_split() {
    let mut rng = Rng::new(6);
    for op in [GluOp::Reglu, GluOp::Geglu, GluOp::Swiglu] {
        for swapped in [false, true] {
            let c = ctx();
            let a = c.new_tensor(DType::F32, &[66, 5, 2]).unwrap();
            let av = fill(&a, &mut rng, -3.0, 3.0);
            let out = ops::glu(&c, &a, op, swapped).unwrap();
            compute(&out);
            let nc = 33;
            let want: Vec<f64> = (0..out.nelements())
                .map(|k| {
                    let (row, i) = (k / nc, k % nc);
                    let (x, g) = (av[row * 66 + i] as f64, av[row * 66 + nc + i] as f64);
                    let (x, g) = if swapped { (g, x) } else { (x, g) };
                    unary_ref(op.activation(), x) * g
                })
                .collect();
            check(
                &format!("{} swapped={swapped}", op.name()),
                &out.to_f32_vec().unwrap(),
                &want,
                1e-7,
            );
        }
        let c = ctx();
        let a = c.new_tensor(DType::F16, &[33, 4]).unwrap();
        let b = c.new_tensor(DType::F16, &[33, 4]).unwrap();
        let av = fill(&a, &mut rng, -3.0, 3.0);
        let bv = fill(&b, &mut rng, -3.0, 3.0);
        let out = ops::glu_split(&c, &a, &b, op).unwrap();
        compute(&out);
        let want: Vec<f64> = av
            .iter()
            .zip(&bv)
            .map(|(&x, &g)| round_to(DType::F16, unary_ref(op.activation(), x as f64) * g as f64))
            .collect();
        check(
            &format!("{} split", op.name()),
            &out.to_f32_vec().unwrap(),
            &want,
            1e-6,
        );
    }
}

// ----- reductions -----

#[test]
fn sums_means_and_argmax() {
    let mut rng = Rng::new(7);
    let c = ctx();
    let a = c.new_tensor(DType::F32, &[65, 7, 3, 2]).unwrap();
    let av = fill(&a, &mut rng, -1.0, 1.0);
    let total = ops::sum(&c, &a).unwrap();
    let rows = ops::sum_rows(&c, &a).unwrap();
    let means = ops::mean(&c, &a).unwrap();
    let graph = Graph::build(&[total.clone(), rows.clone(), means.clone()]);
    compute_graph_all_threads(&graph, false).unwrap();
    let row_sums: Vec<f64> = av
        .chunks(65)
        .map(|r| r.iter().map(|&x| x as f64).sum())
        .collect();
    check(
        "sum",
        &total.to_f32_vec().unwrap(),
        &[row_sums.iter().sum()],
        1e-7,
    );
    check("sum_rows", &rows.to_f32_vec().unwrap(), &row_sums, 1e-7);
    let mean: Vec<f64> = row_sums.iter().map(|s| s / 65.0).collect();
    check("mean", &means.to_f32_vec().unwrap(), &mean, 1e-7);

    let m = c.new_tensor(DType::F32, &[33, 9]).unwrap();
    let mut mv = fill(&m, &mut rng, -1.0, 1.0);
    mv[33 + 5] = 3.0;
    mv[33 + 20] = 3.0; // a tie: the last wins, as in ggml
    m.set_f32(&mv).unwrap();
    let out = ops::argmax(&c, &m).unwrap();
    compute(&out);
    let got = out.to_f32_vec().unwrap();
    for (r, row) in mv.chunks(33).enumerate() {
        let mut best = 0;
        for i in 0..33 {
            if row[i] >= row[best] {
                best = i;
            }
        }
        assert_eq!(got[r] as usize, best, "argmax row {r}");
    }
}

#[test]
fn repeat_and_concat_are_exact() {
    let mut rng = Rng::new(8);
    let c = ctx();
    let a = c.new_tensor(DType::F16, &[3, 2, 1, 2]).unwrap();
    let av = fill(&a, &mut rng, -1.0, 1.0);
    let like = c.new_tensor(DType::F16, &[6, 4, 3, 2]).unwrap();
    let out = ops::repeat(&c, &a, &like).unwrap();
    compute(&out);
    let got = out.to_f32_vec().unwrap();
    for k in 0..got.len() {
        let [i0, i1, _, i3] = coords(out.ne(), k);
        assert_eq!(got[k], av[idx(a.ne(), i0 % 3, i1 % 2, 0, i3 % 2)]);
    }
    for dim in 0..4 {
        for dtype in [DType::F32, DType::I32] {
            let mut ne_a = [5, 3, 2, 2];
            let mut ne_b = ne_a;
            ne_b[dim] = 1 + dim;
            ne_a[dim] = 2;
            let a = c.new_tensor(dtype, &ne_a).unwrap();
            let b = c.new_tensor(dtype, &ne_b).unwrap();
            let av: Vec<f32> = (0..a.nelements()).map(|i| i as f32).collect();
            let bv: Vec<f32> = (0..b.nelements()).map(|i| -(i as f32) - 1.0).collect();
            a.set_f32(&av).unwrap();
            b.set_f32(&bv).unwrap();
            let out = ops::concat(&c, &a, &b, dim).unwrap();
            compute(&out);
            let got = out.to_f32_vec().unwrap();
            for (k, &g) in got.iter().enumerate() {
                let mut p = coords(out.ne(), k);
                let want = if p[dim] < ne_a[dim] {
                    av[idx(ne_a, p[0], p[1], p[2], p[3])]
                } else {
                    p[dim] -= ne_a[dim];
                    bv[idx(ne_b, p[0], p[1], p[2], p[3])]
                };
                assert_eq!(g, want, "concat dim {dim} {dtype} at {k}");
            }
        }
    }
}

// ----- norms -----

#[test]
fn norms() {
    let mut rng = Rng::new(9);
    for n in [1usize, 7, 33, 260] {
        let c = ctx();
        let a = c.new_tensor(DType::F32, &[n, 5, 3]).unwrap();
        let av = fill(&a, &mut rng, -10.0, 10.0);
        let eps = 1e-5f32;
        let norm = ops::norm(&c, &a, eps).unwrap();
        let rms = ops::rms_norm(&c, &a, eps).unwrap();
        let l2 = ops::l2_norm(&c, &a, eps).unwrap();
        let graph = Graph::build(&[norm.clone(), rms.clone(), l2.clone()]);
        compute_graph_all_threads(&graph, false).unwrap();
        let (mut wn, mut wr, mut wl) = (vec![], vec![], vec![]);
        for row in av.chunks(n) {
            let x: Vec<f64> = row.iter().map(|&v| v as f64).collect();
            let mean = x.iter().sum::<f64>() / n as f64;
            let var = x.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / n as f64;
            let ms = x.iter().map(|v| v * v).sum::<f64>() / n as f64;
            let l = (ms * n as f64).sqrt().max(eps as f64);
            wn.extend(x.iter().map(|v| (v - mean) / (var + eps as f64).sqrt()));
            wr.extend(x.iter().map(|v| v / (ms + eps as f64).sqrt()));
            wl.extend(x.iter().map(|v| v / l));
        }
        check(&format!("norm {n}"), &norm.to_f32_vec().unwrap(), &wn, 1e-7);
        check(
            &format!("rms_norm {n}"),
            &rms.to_f32_vec().unwrap(),
            &wr,
            1e-7,
        );
        check(
            &format!("l2_norm {n}"),
            &l2.to_f32_vec().unwrap(),
            &wl,
            1e-7,
        );
    }
    // GROUP_NORM: 5 channels in 2 groups of 3 (the last has 2).
    let c = ctx();
    let ne = [4usize, 3, 5, 2];
    let a = c.new_tensor(DType::F32, &ne).unwrap();
    let av = fill(&a, &mut rng, -2.0, 2.0);
    let out = ops::group_norm(&c, &a, 2, 1e-6).unwrap();
    compute(&out);
    let mut want = vec![0f64; av.len()];
    for i3 in 0..2 {
        for (start, end) in [(0usize, 3usize), (3, 5)] {
            let members: Vec<usize> = (start..end)
                .flat_map(|i2| (0..12).map(move |j| idx(ne, j % 4, j / 4, i2, i3)))
                .collect();
            let mean = members.iter().map(|&k| av[k] as f64).sum::<f64>() / members.len() as f64;
            let var = members
                .iter()
                .map(|&k| (av[k] as f64 - mean).powi(2))
                .sum::<f64>()
                / members.len() as f64;
            for &k in &members {
                want[k] = (av[k] as f64 - mean) / (var + 1e-6).sqrt();
            }
        }
    }
    check("group_norm", &out.to_f32_vec().unwrap(), &want, 1e-7);
}

// ----- matrix products -----

fn mul_mat_ref(a: &[f32], ane: [usize; 4], b: &[f32], bne: [usize; 4]) -> Vec<f64> {
    let (r2, r3) = (bne[2] / ane[2], bne[3] / ane[3]);
    let ne = [ane[1], bne[1], bne[2], bne[3]];
    let mut out = vec![0f64; ne.iter().product()];
    for i3 in 0..ne[3] {
        for i2 in 0..ne[2] {
            for j in 0..ne[1] {
                for i in 0..ne[0] {
                    let mut s = 0f64;
                    for k in 0..ane[0] {
                        s += a[idx(ane, k, i, i2 / r2, i3 / r3)] as f64
                            * b[idx(bne, k, j, i2, i3)] as f64;
                    }
                    out[idx(ne, i, j, i2, i3)] = s;
                }
            }
        }
    }
    out
}

#[test]
fn mul_mat_float_weights_with_batch_broadcast() {
    let mut rng = Rng::new(10);
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        for (k, m, n, bs, nr) in [
            (65usize, 7usize, 33usize, [2usize, 1usize], [2usize, 3usize]),
            (1, 5, 1, [1, 1], [1, 1]),
            (128, 33, 1, [3, 2], [1, 1]),
            (64, 17, 16, [1, 1], [1, 1]),
            // Register tiles of 2 and 3 columns (4 = 2+2, 7 = 3+2+2, 13 = 3+3+3+2+2), leftover
            // rows (18 = 4·4 + 2, 9 = 2·4 + 1) and row tails (k not a multiple of 8).
            (37, 18, 13, [1, 1], [1, 1]),
            (40, 9, 7, [2, 1], [1, 1]),
            (9, 6, 4, [1, 1], [1, 2]),
            // GEMM path with converted weights split into per-thread panels (m ≥ 128).
            (40, 300, 33, [1, 1], [1, 1]),
            // One full activation panel (15-16 columns: f32 weights take the GEMM on AVX2),
            // several weight micro-panels (each prefetching the next), k past one block.
            (70, 40, 15, [1, 1], [1, 1]),
            (800, 131, 16, [2, 1], [1, 1]),
            // 14-31 columns (f32 weights take the GEMM on AVX-512): one activation vector
            // (14), a second, partly filled one (23, 31).
            (96, 45, 14, [1, 1], [1, 1]),
            (130, 70, 23, [1, 2], [1, 1]),
            (64, 29, 31, [1, 1], [1, 1]),
            // Weight rows split over tasks sharing one activation block packed once (f32 on
            // AVX-512 at 14-31 columns, every weight type from 32), over two `k` blocks, with
            // a partial last panel.
            (1000, 200, 20, [1, 1], [1, 1]),
            (800, 300, 40, [1, 1], [1, 1]),
        ] {
            let c = ctx();
            let a = c.new_tensor(dtype, &[k, m, bs[0], bs[1]]).unwrap();
            let b = c
                .new_tensor(DType::F32, &[k, n, bs[0] * nr[0], bs[1] * nr[1]])
                .unwrap();
            let av = fill(&a, &mut rng, -1.0, 1.0);
            let bv = fill(&b, &mut rng, -1.0, 1.0);
            let out = ops::mul_mat(&c, &a, &b).unwrap();
            let check_guard = guard(&out);
            compute(&out);
            check_guard();
            let want = mul_mat_ref(&av, a.ne(), &bv, b.ne());
            check(
                &format!("mul_mat {dtype} k{k} m{m} n{n}"),
                &out.to_f32_vec().unwrap(),
                &want,
                5e-4,
            );
            assert_eq!(compute_with(&out, true).unwrap(), Status::Success);
            check("reference path", &out.to_f32_vec().unwrap(), &want, 5e-4);
        }
    }
}

/// f16 and bf16 weights with 3-13 columns (register tiles widening the rows as they load
/// them) give the bits of the same product with the weights widened to f32 first (f32 rows
/// take the same tiles there), including leftover rows and a partial last vector.
#[test]
fn mul_mat_half_tiles_equal_widened_f32_weights() {
    let mut rng = Rng::new(31);
    for dtype in [DType::F16, DType::BF16] {
        for (k, m, n) in [
            (37usize, 18usize, 3usize),
            (64, 21, 4),
            (130, 40, 7),
            (384, 35, 13),
        ] {
            let c = ctx();
            let a = c.new_tensor(dtype, &[k, m]).unwrap();
            let wide = c.new_tensor(DType::F32, &[k, m]).unwrap();
            let b = c.new_tensor(DType::F32, &[k, n]).unwrap();
            let av = fill(&a, &mut rng, -1.0, 1.0);
            wide.set_f32(&av).unwrap();
            fill(&b, &mut rng, -1.0, 1.0);
            let half_out = ops::mul_mat(&c, &a, &b).unwrap();
            let f32_out = ops::mul_mat(&c, &wide, &b).unwrap();
            compute(&half_out);
            compute(&f32_out);
            let bits = |t: &Tensor| -> Vec<u32> {
                t.to_f32_vec()
                    .unwrap()
                    .iter()
                    .map(|x| x.to_bits())
                    .collect()
            };
            assert_eq!(bits(&half_out), bits(&f32_out), "{dtype} k{k} m{m} n{n}");
        }
    }
}

#[test]
fn mul_mat_permuted_and_transposed_operands() {
    let mut rng = Rng::new(11);
    let c = ctx();
    // a: permuted 0213 of a [k, 3, m, 1] tensor → [k, m, 3, 1] with strided rows.
    let (k, m, n) = (40usize, 9usize, 6usize);
    let a0 = c.new_tensor(DType::F16, &[k, 3, m]).unwrap();
    let a0v = fill(&a0, &mut rng, -1.0, 1.0);
    let a = ops::permute(&c, &a0, [0, 2, 1, 3]).unwrap();
    // b: transposed [n, k] → [k, n] (non-contiguous rows).
    let b0 = c.new_tensor(DType::F32, &[n, k, 3]).unwrap();
    let b0v = fill(&b0, &mut rng, -1.0, 1.0);
    let b = ops::transpose(&c, &b0).unwrap();
    let out = ops::mul_mat(&c, &a, &b).unwrap();
    compute(&out);
    let ane = a.ne();
    let av: Vec<f32> = (0..a.nelements())
        .map(|q| {
            let [i0, i1, i2, _] = coords(ane, q);
            a0v[idx(a0.ne(), i0, i2, i1, 0)]
        })
        .collect();
    let bne = b.ne();
    let bv: Vec<f32> = (0..b.nelements())
        .map(|q| {
            let [i0, i1, i2, _] = coords(bne, q);
            b0v[idx(b0.ne(), i1, i0, i2, 0)]
        })
        .collect();
    check(
        "mul_mat permuted/transposed",
        &out.to_f32_vec().unwrap(),
        &mul_mat_ref(&av, ane, &bv, bne),
        5e-4,
    );
}

#[test]
fn mul_mat_quantized_weights() {
    let mut rng = Rng::new(12);
    for dtype in [DType::Q8_0, DType::Q4_0] {
        for (k, m, n, nr) in [
            (64usize, 7usize, 5usize, 1usize),
            (96, 33, 1, 2),
            (224, 37, 2, 1),
            (160, 19, 2, 2),
            (256, 16, 9, 1),
            (64, 200, 40, 1),
        ] {
            let c = ctx();
            let a = c.new_tensor(dtype, &[k, m, 2]).unwrap();
            let b = c.new_tensor(DType::F32, &[k, n, 2 * nr]).unwrap();
            let av = fill_quant(&a, &mut rng);
            let bv = fill(&b, &mut rng, -1.0, 1.0);
            let out = ops::mul_mat(&c, &a, &b).unwrap();
            let graph = Graph::build(std::slice::from_ref(&out));
            assert!(work_size(&graph, 2) >= 2 * nr * n * (k / 32) * 34);
            let check_guard = guard(&out);
            compute(&out);
            check_guard();
            let want = mul_mat_ref(&av, a.ne(), &bv, b.ne());
            check(
                &format!("mul_mat {dtype} k{k}"),
                &out.to_f32_vec().unwrap(),
                &want,
                5e-4,
            );
            assert_eq!(compute_with(&out, true).unwrap(), Status::Success);
            check(
                &format!("mul_mat {dtype} reference"),
                &out.to_f32_vec().unwrap(),
                &want,
                5e-4,
            );
        }
    }
}

/// The low-precision GEMM paths (q8_0 / q4_0 weights × activations quantized to q8_0 as
/// integer block products; bf16 weights × activations rounded to bf16): partial weight panels
/// (m not a multiple of 32), several activation tiles and passes (n up to 70), odd block
/// counts, k = 1024, broadcast batches — against the f64 product of the dequantized weights
/// with the f32 activations (the limit covers the activations' own rounding: q8_0 steps of
/// amax/127, bf16's 8-bit significand), with identical bits at 1, 2 and 3 threads and no write
/// outside the output.
#[test]
fn mul_mat_low_precision_gemm_paths() {
    let mut rng = Rng::new(31);
    for (dtype, limit) in [
        (DType::Q8_0, 1e-4),
        (DType::Q4_0, 1e-4),
        (DType::BF16, 2e-5),
    ] {
        for (k, m, n, batches, bcast) in [
            (96usize, 33usize, 3usize, 1usize, 1usize),
            (160, 65, 70, 2, 2),
            (32, 100, 7, 1, 3),
            (1024, 40, 37, 1, 1),
        ] {
            let c = ctx();
            let a = c.new_tensor(dtype, &[k, m, batches]).unwrap();
            let b = c.new_tensor(DType::F32, &[k, n, batches * bcast]).unwrap();
            let av = fill_any(&a, &mut rng);
            let bv = fill(&b, &mut rng, -1.0, 1.0);
            let out = ops::mul_mat(&c, &a, &b).unwrap();
            let check_guard = guard(&out);
            compute(&out);
            check_guard();
            check(
                &format!("mul_mat {dtype} k{k} m{m} n{n}"),
                &out.to_f32_vec().unwrap(),
                &mul_mat_ref(&av, a.ne(), &bv, b.ne()),
                limit,
            );
        }
    }
}

#[test]
fn mul_mat_id_and_out_prod() {
    let mut rng = Rng::new(13);
    // Experts with 3 or more tokens take the register tiles (16-bit weights widened in them).
    for dtype in [DType::F32, DType::F16, DType::BF16, DType::Q8_0] {
        let c = ctx();
        let (k, m, n_expert, n_used, n_b, n_tokens) =
            (64usize, 9usize, 4usize, 2usize, 1usize, 5usize);
        let experts = c.new_tensor(dtype, &[k, m, n_expert]).unwrap();
        let ev = fill_any(&experts, &mut rng);
        let b = c.new_tensor(DType::F32, &[k, n_b, n_tokens]).unwrap();
        let bv = fill(&b, &mut rng, -1.0, 1.0);
        let ids = c.new_tensor(DType::I32, &[n_used, n_tokens]).unwrap();
        let idv: Vec<i32> = (0..n_used * n_tokens)
            .map(|_| rng.below(n_expert) as i32)
            .collect();
        fill_i32(&ids, &idv);
        let out = ops::mul_mat_id(&c, &experts, &b, &ids).unwrap();
        compute(&out);
        let mut want = vec![0f64; out.nelements()];
        for t in 0..n_tokens {
            for e in 0..n_used {
                let x = idv[e + n_used * t] as usize;
                for i in 0..m {
                    let mut s = 0f64;
                    for kk in 0..k {
                        s += ev[idx(experts.ne(), kk, i, x, 0)] as f64
                            * bv[idx(b.ne(), kk, e % n_b, t, 0)] as f64;
                    }
                    want[idx(out.ne(), i, e, t, 0)] = s;
                }
            }
        }
        check(
            &format!("mul_mat_id {dtype}"),
            &out.to_f32_vec().unwrap(),
            &want,
            5e-4,
        );
    }
    let c = ctx();
    let a = c.new_tensor(DType::F32, &[7, 5, 2]).unwrap();
    let b = c.new_tensor(DType::F32, &[3, 5, 4]).unwrap();
    let av = fill(&a, &mut rng, -1.0, 1.0);
    let bv = fill(&b, &mut rng, -1.0, 1.0);
    let out = ops::out_prod(&c, &a, &b).unwrap();
    compute(&out);
    let ne = out.ne();
    let mut want = vec![0f64; out.nelements()];
    for i2 in 0..4 {
        for i1 in 0..3 {
            for i0 in 0..7 {
                want[idx(ne, i0, i1, i2, 0)] = (0..5)
                    .map(|kk| {
                        av[idx(a.ne(), i0, kk, i2 / 2, 0)] as f64
                            * bv[idx(b.ne(), i1, kk, i2, 0)] as f64
                    })
                    .sum();
            }
        }
    }
    check("out_prod", &out.to_f32_vec().unwrap(), &want, 5e-4);
}

// ----- softmax, masks, rope, attention -----

fn alibi_slope(max_bias: f64, n_head: usize, h: usize) -> f64 {
    if max_bias <= 0.0 {
        return 1.0;
    }
    let n_head_log2 = 1usize << (usize::BITS - 1 - n_head.leading_zeros());
    let m0 = 2f64.powf(-max_bias / n_head_log2 as f64);
    let m1 = 2f64.powf(-(max_bias / 2.0) / n_head_log2 as f64);
    if h < n_head_log2 {
        m0.powi(h as i32 + 1)
    } else {
        m1.powi(2 * (h - n_head_log2) as i32 + 1)
    }
}

#[test]
fn soft_max_with_masks_scale_and_alibi() {
    let mut rng = Rng::new(14);
    for (mask_type, max_bias, scale) in [
        (None, 0.0f32, 1.0f32),
        (Some(DType::F32), 0.0, 0.1),
        (Some(DType::F16), 8.0, 1.0),
        (Some(DType::F32), 8.0, 0.5),
    ] {
        let c = ctx();
        let ne = [33usize, 7, 6, 2];
        let a = c.new_tensor(DType::F32, &ne).unwrap();
        let av = fill(&a, &mut rng, -5.0, 5.0);
        let mne = [33usize, 8, 3, 1];
        let mask = mask_type.map(|t| c.new_tensor(t, &mne).unwrap());
        let mv = mask.as_ref().map(|m| {
            let mut v = fill(m, &mut rng, -1.0, 1.0);
            v[3] = f32::NEG_INFINITY;
            m.set_f32(&v).unwrap();
            v
        });
        let out = ops::soft_max(&c, &a, mask.as_ref(), scale, max_bias).unwrap();
        compute(&out);
        let mut want = vec![0f64; av.len()];
        for i3 in 0..ne[3] {
            for i2 in 0..ne[2] {
                let slope = alibi_slope(max_bias as f64, ne[2], i2);
                for i1 in 0..ne[1] {
                    let row: Vec<f64> = (0..ne[0])
                        .map(|i0| {
                            let m = mv.as_ref().map_or(0.0, |mv| {
                                mv[idx(mne, i0, i1, i2 % mne[2], i3 % mne[3])] as f64
                            });
                            av[idx(ne, i0, i1, i2, i3)] as f64 * scale as f64 + slope * m
                        })
                        .collect();
                    let max = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                    let sum: f64 = row.iter().map(|v| (v - max).exp()).sum();
                    for i0 in 0..ne[0] {
                        want[idx(ne, i0, i1, i2, i3)] = (row[i0] - max).exp() / sum;
                    }
                }
            }
        }
        check(
            &format!("soft_max mask={mask_type:?} bias={max_bias}"),
            &out.to_f32_vec().unwrap(),
            &want,
            1e-6,
        );
    }
}

#[test]
fn diag_mask_inf_masks_future_columns() {
    let mut rng = Rng::new(15);
    let c = ctx();
    let a = c.new_tensor(DType::F32, &[9, 5, 2]).unwrap();
    let av = fill(&a, &mut rng, -1.0, 1.0);
    let out = ops::diag_mask_inf(&c, &a, 2).unwrap();
    compute(&out);
    let got = out.to_f32_vec().unwrap();
    for (k, &g) in got.iter().enumerate() {
        let [i0, i1, _, _] = coords(a.ne(), k);
        if i0 > 2 + i1 {
            assert_eq!(g, f32::NEG_INFINITY);
        } else {
            assert_eq!(g, av[k]);
        }
    }
}

fn rope_ref(
    x: &[f32],
    ne: [usize; 4],
    pos: &[i32],
    ff: Option<&[f32]>,
    p: &RopeParams,
) -> Vec<f64> {
    let mut out: Vec<f64> = x.iter().map(|&v| v as f64).collect();
    let pi = std::f64::consts::PI;
    let corr = |n_rot: f64| {
        p.n_dims as f64 * (p.n_ctx_orig as f64 / (n_rot * 2.0 * pi)).ln()
            / (2.0 * (p.freq_base as f64).ln())
    };
    let low = corr(p.beta_fast as f64).floor().max(0.0);
    let high = corr(p.beta_slow as f64).ceil().min(p.n_dims as f64 - 1.0);
    for i3 in 0..ne[3] {
        for i2 in 0..ne[2] {
            for i1 in 0..ne[1] {
                for i in 0..p.n_dims / 2 {
                    let i0 = 2 * i;
                    let theta_extrap = pos[i2] as f64
                        * (p.freq_base as f64).powf(-(i0 as f64) / p.n_dims as f64)
                        / ff.map_or(1.0, |f| f[i] as f64);
                    let theta_interp = p.freq_scale as f64 * theta_extrap;
                    let (mut theta, mut mscale) = (theta_interp, p.attn_factor as f64);
                    if p.ext_factor != 0.0 {
                        let y = (i as f64 - low) / (high - low).max(0.001);
                        let ramp = (1.0 - y.clamp(0.0, 1.0)) * p.ext_factor as f64;
                        theta = theta_interp * (1.0 - ramp) + theta_extrap * ramp;
                        mscale *= 1.0 + 0.1 * (1.0 / p.freq_scale as f64).ln();
                    }
                    let (j0, j1) = match p.mode {
                        RopeMode::Normal => (i0, i0 + 1),
                        RopeMode::Neox => (i, i + p.n_dims / 2),
                    };
                    let a = x[idx(ne, j0, i1, i2, i3)] as f64;
                    let b = x[idx(ne, j1, i1, i2, i3)] as f64;
                    out[idx(ne, j0, i1, i2, i3)] = (a * theta.cos() - b * theta.sin()) * mscale;
                    out[idx(ne, j1, i1, i2, i3)] = (a * theta.sin() + b * theta.cos()) * mscale;
                }
            }
        }
    }
    out
}

#[test]
fn rope_modes_yarn_and_freq_factors() {
    let mut rng = Rng::new(16);
    for mode in [RopeMode::Normal, RopeMode::Neox] {
        for (dtype, yarn, factors) in [
            (DType::F32, false, false),
            (DType::F32, true, true),
            (DType::F16, false, true),
        ] {
            let c = ctx();
            let ne = [34usize, 3, 5, 1];
            let a = c.new_tensor(dtype, &ne).unwrap();
            let av = fill(&a, &mut rng, -1.0, 1.0);
            let pos = c.new_tensor(DType::I32, &[5]).unwrap();
            let pv = [0, 3, 17, 100, 4095];
            fill_i32(&pos, &pv);
            let mut p = RopeParams::new(32, mode);
            if yarn {
                p.n_ctx_orig = 4096;
                p.freq_scale = 0.25;
                p.ext_factor = 1.0;
                p.attn_factor = 0.9;
            }
            let ff = c.new_tensor(DType::F32, &[16]).unwrap();
            let ffv = fill(&ff, &mut rng, 1.0, 4.0);
            let out = ops::rope(&c, &a, &pos, factors.then_some(&ff), p).unwrap();
            compute(&out);
            let want: Vec<f64> = rope_ref(&av, ne, &pv, factors.then_some(&ffv[..]), &p)
                .into_iter()
                .map(|v| round_to(dtype, v))
                .collect();
            let limit = if dtype == DType::F32 { 1e-7 } else { 1e-6 };
            check(
                &format!("rope {mode:?} {dtype} yarn={yarn} ff={factors}"),
                &out.to_f32_vec().unwrap(),
                &want,
                limit,
            );
        }
    }
}

#[test]
fn flash_attn_ext_matches_naive_attention() {
    let mut rng = Rng::new(17);
    // n_q = 70: several query blocks per head, the last one partial.
    for (kv_type, max_bias, softcap, mask_on, n_q) in [
        (DType::F32, 0.0f32, 0.0f32, false, 3usize),
        (DType::F16, 0.0, 0.0, true, 3),
        (DType::F16, 8.0, 0.0, true, 3),
        (DType::F32, 0.0, 30.0, true, 3),
        (DType::F32, 0.0, 0.0, true, 70),
        (DType::F16, 0.0, 0.0, false, 70),
    ] {
        let c = ctx();
        let (d, dv, n_head, n_head_kv, n_kv) = (40usize, 24usize, 4usize, 2usize, 37usize);
        let q = c.new_tensor(DType::F32, &[d, n_q, n_head, 1]).unwrap();
        let k = c.new_tensor(kv_type, &[d, n_kv, n_head_kv, 1]).unwrap();
        let v = c.new_tensor(kv_type, &[dv, n_kv, n_head_kv, 1]).unwrap();
        let qv = fill(&q, &mut rng, -1.0, 1.0);
        let kv = fill(&k, &mut rng, -1.0, 1.0);
        let vv = fill(&v, &mut rng, -1.0, 1.0);
        let mask = c.new_tensor(DType::F16, &[n_kv, n_q.max(4)]).unwrap();
        let mut mv = fill(&mask, &mut rng, -1.0, 0.0);
        for (i, m) in mv.iter_mut().enumerate() {
            if i % 7 == 3 {
                *m = f32::NEG_INFINITY;
            }
        }
        mask.set_f32(&mv).unwrap();
        let scale = 1.0 / (d as f32).sqrt();
        let out = ops::flash_attn_ext(
            &c,
            &q,
            &k,
            &v,
            mask_on.then_some(&mask),
            scale,
            max_bias,
            softcap,
        )
        .unwrap();
        let check_guard = guard(&out);
        compute(&out);
        check_guard();
        let mut want = vec![0f64; out.nelements()];
        for h in 0..n_head {
            let hk = h / (n_head / n_head_kv);
            let slope = alibi_slope(max_bias as f64, n_head, h);
            for iq in 0..n_q {
                let logits: Vec<f64> = (0..n_kv)
                    .map(|ic| {
                        let mut s: f64 = (0..d)
                            .map(|i| {
                                qv[idx(q.ne(), i, iq, h, 0)] as f64
                                    * kv[idx(k.ne(), i, ic, hk, 0)] as f64
                            })
                            .sum::<f64>()
                            * scale as f64;
                        if softcap != 0.0 {
                            s = softcap as f64 * (s / softcap as f64).tanh();
                        }
                        if mask_on {
                            s += slope * mv[idx(mask.ne(), ic, iq, 0, 0)] as f64;
                        }
                        s
                    })
                    .collect();
                let max = logits.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let w: Vec<f64> = logits.iter().map(|s| (s - max).exp()).collect();
                let sum: f64 = w.iter().sum();
                for j in 0..dv {
                    want[idx(out.ne(), j, h, iq, 0)] = (0..n_kv)
                        .map(|ic| w[ic] * vv[idx(v.ne(), j, ic, hk, 0)] as f64)
                        .sum::<f64>()
                        / sum;
                }
            }
        }
        check(
            &format!("flash_attn {kv_type} bias={max_bias} softcap={softcap} mask={mask_on}"),
            &out.to_f32_vec().unwrap(),
            &want,
            5e-4,
        );
    }
}

// ----- copies -----

#[test]
fn cpy_between_float_and_int_types() {
    let mut rng = Rng::new(18);
    let types = [DType::F32, DType::F16, DType::BF16, DType::I32];
    for &from in &types {
        for &to in &types {
            let c = ctx();
            let a = c.new_tensor(from, &[7, 5, 3]).unwrap();
            let values: Vec<f32> = (0..a.nelements())
                .map(|_| (rng.uniform(-50.0, 50.0)).round())
                .collect();
            a.set_f32(&values).unwrap();
            let av = a.to_f32_vec().unwrap();
            let b = c.new_tensor(to, &[7, 5, 3]).unwrap();
            let out = ops::cpy(&c, &a, &b).unwrap();
            compute(&out);
            let want: Vec<f64> = av.iter().map(|&x| round_to(to, x as f64)).collect();
            let limit = if from == to { 0.0 } else { 1e-6 };
            check(
                &format!("cpy {from}->{to}"),
                &b.to_f32_vec().unwrap(),
                &want,
                limit,
            );
        }
    }
    // i32 values beyond f32 precision survive a same-type copy exactly.
    let c = ctx();
    let a = c.new_tensor(DType::I32, &[3]).unwrap();
    fill_i32(&a, &[16_777_217, -2_000_000_001, 7]);
    let out = ops::dup(&c, &a).unwrap();
    compute(&out);
    let mut bytes = [0u8; 12];
    out.read_bytes(0, &mut bytes).unwrap();
    let mut src = [0u8; 12];
    a.read_bytes(0, &mut src).unwrap();
    assert_eq!(bytes, src);
}

/// A row long enough that its f16/bf16 conversions are split over the computing pool (at least
/// `convert::PARALLEL_MIN_ELEMS` elements, not a multiple of the chunk alignment; one row, so
/// the computing thread converts it outside any chunk): ADD loads and stores whole rows, and
/// every element must come out as the scalar conversions give it, at 1, 2 and 3 threads.
#[test]
fn add_of_a_row_long_enough_to_split_its_conversion() {
    let n = ferrograph::convert::PARALLEL_MIN_ELEMS + 1000 + 7;
    let mut rng = Rng::new(41);
    let round = |dtype: DType, x: f32| match dtype {
        DType::F16 => half::f16::from_f32(x).to_f32(),
        _ => half::bf16::from_f32(x).to_f32(),
    };
    for dtype in [DType::F16, DType::BF16] {
        let c = ctx();
        let a = c.new_tensor(dtype, &[n]).unwrap();
        let b = c.new_tensor(dtype, &[n]).unwrap();
        fill(&a, &mut rng, -1000.0, 1000.0);
        fill(&b, &mut rng, -1000.0, 1000.0);
        let (av, bv) = (a.to_f32_vec().unwrap(), b.to_f32_vec().unwrap());
        let out = ops::add(&c, &a, &b).unwrap();
        let graph = Graph::build(std::slice::from_ref(&out));
        for threads in THREAD_COUNTS {
            // A stale result from the previous count must not pass for this one's.
            out.write_bytes(0, &vec![0u8; out.nbytes()]).unwrap();
            let status = compute_graph(&graph, &pool(threads), &ComputeOptions::default(), None);
            assert_eq!(status.unwrap(), Status::Success);
            let got = out.to_f32_vec().unwrap();
            let wrong = (0..av.len())
                .filter(|&i| got[i].to_bits() != round(dtype, av[i] + bv[i]).to_bits())
                .count();
            assert_eq!(
                wrong, 0,
                "{dtype} ADD, {n}-element row, {threads} threads: {wrong} differ"
            );
        }
    }
}

#[test]
fn cpy_into_transposed_and_strided_destinations() {
    let mut rng = Rng::new(19);
    let c = ctx();
    let a = c.new_tensor(DType::F32, &[6, 4, 3]).unwrap();
    let av = fill(&a, &mut rng, -1.0, 1.0);
    // Destination: the transpose of a [4, 6, 3] f16 tensor.
    let base = c.new_tensor(DType::F16, &[4, 6, 3]).unwrap();
    let dst = ops::transpose(&c, &base).unwrap();
    let out = ops::cpy(&c, &a, &dst).unwrap();
    compute(&out);
    let got = base.to_f32_vec().unwrap();
    for (k, &g) in got.iter().enumerate() {
        let [i0, i1, i2, _] = coords(base.ne(), k);
        assert_eq!(g, f16::from_f32(av[idx(a.ne(), i1, i0, i2, 0)]).to_f32());
    }
    // Strided destination: every other row of an [6, 8] tensor.
    let big = c.new_tensor(DType::F32, &[6, 8]).unwrap();
    big.set_f32(&[9.0; 48]).unwrap();
    let rows = ops::view(&c, &big, &[6, 4], &[48], 0).unwrap();
    let src = c.new_tensor(DType::F32, &[6, 4]).unwrap();
    let sv = fill(&src, &mut rng, -1.0, 1.0);
    let out = ops::cpy(&c, &src, &rows).unwrap();
    compute(&out);
    let got = big.to_f32_vec().unwrap();
    for r in 0..8 {
        for i in 0..6 {
            let want = if r % 2 == 0 { sv[(r / 2) * 6 + i] } else { 9.0 };
            assert_eq!(got[r * 6 + i], want);
        }
    }
    // CONT of a permuted tensor and CONT to a new shape.
    let p = ops::permute(&c, &a, [2, 0, 1, 3]).unwrap();
    let cont = ops::cont(&c, &p).unwrap();
    let reshaped = ops::cont_shape(&c, &p, &[12, 6]).unwrap();
    let graph = Graph::build(&[cont.clone(), reshaped.clone()]);
    compute_graph_all_threads(&graph, false).unwrap();
    let logical = p.to_f32_vec().unwrap();
    assert_eq!(cont.to_f32_vec().unwrap(), logical);
    assert_eq!(reshaped.to_f32_vec().unwrap(), logical);
}

/// CONT of transposed and strided views moves the exact bytes for every element size (1, 2,
/// 4 and 8 bytes: each has its own typed copy loop), at 1, 2 and 3 threads.
#[test]
fn cont_of_transposed_views_is_exact_for_every_element_size() {
    for dtype in [
        DType::I8,
        DType::F16,
        DType::BF16,
        DType::F32,
        DType::I32,
        DType::I64,
    ] {
        let c = ctx();
        let size = dtype.type_size();
        let a = c.new_tensor(dtype, &[37, 9, 2]).unwrap();
        let bytes: Vec<u8> = (0..a.nbytes()).map(|i| (i * 131 % 251) as u8).collect();
        a.write_bytes(0, &bytes).unwrap();
        let t = ops::transpose(&c, &a).unwrap(); // [9, 37, 2]
        let out = ops::cont(&c, &t).unwrap();
        compute(&out);
        let mut got = vec![0u8; out.nbytes()];
        out.read_bytes(0, &mut got).unwrap();
        for i2 in 0..2 {
            for i1 in 0..37 {
                for i0 in 0..9 {
                    let d = ((i2 * 37 + i1) * 9 + i0) * size;
                    let s = ((i2 * 9 + i0) * 37 + i1) * size;
                    assert_eq!(
                        got[d..d + size],
                        bytes[s..s + size],
                        "{dtype} ({i0},{i1},{i2})"
                    );
                }
            }
        }
    }
}

#[test]
fn cpy_to_and_from_quantized() {
    let mut rng = Rng::new(20);
    for qt in [DType::Q8_0, DType::Q4_0] {
        for from in [DType::F32, DType::F16] {
            let c = ctx();
            let a = c.new_tensor(from, &[64, 3]).unwrap();
            let av = fill(&a, &mut rng, -1.0, 1.0);
            let q = c.new_tensor(qt, &[64, 3]).unwrap();
            let out = ops::cpy(&c, &a, &q).unwrap();
            compute(&out);
            let expected = if qt == DType::Q8_0 {
                quantize_q8_0(&av)
            } else {
                quantize_q4_0(&av)
            };
            let mut bytes = vec![0u8; q.nbytes()];
            q.read_bytes(0, &mut bytes).unwrap();
            assert_eq!(bytes, expected, "quantized bytes {from}->{qt}");
            // Back to f32 (dequantize).
            let back = c.new_tensor(DType::F32, &[64, 3]).unwrap();
            let out = ops::cpy(&c, &q, &back).unwrap();
            compute(&out);
            let want: Vec<f64> = read_quant(&q).iter().map(|&x| x as f64).collect();
            check("dequantize", &back.to_f32_vec().unwrap(), &want, 0.0);
            let limit = if qt == DType::Q8_0 { 1e-4 } else { 1e-2 };
            check(
                "round trip",
                &back.to_f32_vec().unwrap(),
                &av.iter().map(|&x| x as f64).collect::<Vec<_>>(),
                limit,
            );
        }
    }
}

#[test]
fn get_rows_and_set_rows() {
    let mut rng = Rng::new(21);
    for dtype in [
        DType::F32,
        DType::F16,
        DType::BF16,
        DType::Q8_0,
        DType::Q4_0,
        DType::I32,
    ] {
        let c = ctx();
        let table = c.new_tensor(dtype, &[64, 10, 2]).unwrap();
        let tv = if dtype == DType::I32 {
            let v: Vec<f32> = (0..table.nelements()).map(|i| i as f32).collect();
            table.set_f32(&v).unwrap();
            v
        } else {
            fill_any(&table, &mut rng)
        };
        let ids = c.new_tensor(DType::I32, &[5, 2]).unwrap();
        let idv: Vec<i32> = (0..10).map(|_| rng.below(10) as i32).collect();
        fill_i32(&ids, &idv);
        let out = ops::get_rows(&c, &table, &ids).unwrap();
        compute(&out);
        let mut want = vec![0f64; out.nelements()];
        for i11 in 0..2 {
            for i10 in 0..5 {
                let row = idv[i10 + 5 * i11] as usize;
                for i0 in 0..64 {
                    want[idx(out.ne(), i0, i10, i11, 0)] =
                        tv[idx(table.ne(), i0, row, i11, 0)] as f64;
                }
            }
        }
        check(
            &format!("get_rows {dtype}"),
            &out.to_f32_vec().unwrap(),
            &want,
            0.0,
        );
    }
    // An index out of range is an error, not a crash.
    let c = ctx();
    let table = c.new_tensor(DType::F32, &[4, 3]).unwrap();
    let ids = c.new_tensor(DType::I32, &[1]).unwrap();
    fill_i32(&ids, &[3]);
    let out = ops::get_rows(&c, &table, &ids).unwrap();
    assert!(matches!(
        compute_with(&out, false),
        Err(Error::OutOfRange { .. })
    ));

    for (dtype, index_type) in [
        (DType::F16, DType::I32),
        (DType::F32, DType::I64),
        (DType::Q8_0, DType::I32),
    ] {
        let c = ctx();
        let dst = c.new_tensor(dtype, &[32, 9, 2]).unwrap();
        let zeros = vec![0f32; dst.nelements()];
        if dtype.is_quantized() {
            dst.write_bytes(0, &quantize_q8_0(&zeros)).unwrap();
        } else {
            dst.set_f32(&zeros).unwrap();
        }
        let rows = c.new_tensor(DType::F32, &[32, 3, 2]).unwrap();
        let rv = fill(&rows, &mut rng, -1.0, 1.0);
        let ids = c.new_tensor(index_type, &[3, 1]).unwrap();
        let idv = [7i64, 0, 4];
        let bytes: Vec<u8> = if index_type == DType::I64 {
            idv.iter().flat_map(|v| v.to_ne_bytes()).collect()
        } else {
            idv.iter().flat_map(|&v| (v as i32).to_ne_bytes()).collect()
        };
        ids.write_bytes(0, &bytes).unwrap();
        let out = ops::set_rows(&c, &dst, &rows, &ids).unwrap();
        compute(&out);
        let got = if dtype.is_quantized() {
            read_quant(&dst)
        } else {
            dst.to_f32_vec().unwrap()
        };
        let mut want = vec![0f64; dst.nelements()];
        for i2 in 0..2 {
            for (i, &row) in idv.iter().enumerate() {
                let src: Vec<f32> = (0..32).map(|i0| rv[idx(rows.ne(), i0, i, i2, 0)]).collect();
                let stored = if dtype.is_quantized() {
                    dequantize_q8_0(&quantize_q8_0(&src))
                } else {
                    src.iter()
                        .map(|&x| round_to(dtype, x as f64) as f32)
                        .collect()
                };
                for i0 in 0..32 {
                    want[idx(dst.ne(), i0, row as usize, i2, 0)] = stored[i0] as f64;
                }
            }
        }
        check(&format!("set_rows {dtype} {index_type}"), &got, &want, 0.0);
    }

    // Many rows (a parallel split) onto distinct targets, then onto repeated ones: the rows
    // land where their indices say, and of rows naming one target the last one stays. The
    // destination is much larger than the rows written (a cache and one decoding step).
    for repeated in [false, true] {
        let c = ctx();
        let dst = c.new_tensor(DType::F32, &[64, 16384]).unwrap();
        dst.set_f32(&vec![0f32; dst.nelements()]).unwrap();
        let n = 8192;
        let rows = c.new_tensor(DType::F32, &[64, n]).unwrap();
        let rv = fill(&rows, &mut rng, -1.0, 1.0);
        let idv: Vec<i32> = (0..n)
            .map(|r| {
                if repeated {
                    (r % 7) as i32 * 3
                } else {
                    (16383 - 2 * r) as i32
                }
            })
            .collect();
        let ids = c.new_tensor(DType::I32, &[n]).unwrap();
        fill_i32(&ids, &idv);
        compute(&ops::set_rows(&c, &dst, &rows, &ids).unwrap());
        let mut want = vec![0f64; dst.nelements()];
        for (r, &row) in idv.iter().enumerate() {
            for i0 in 0..64 {
                want[i0 + 64 * row as usize] = rv[i0 + 64 * r] as f64;
            }
        }
        let label = format!(
            "set_rows onto {} targets",
            if repeated { "repeated" } else { "distinct" }
        );
        check(&label, &dst.to_f32_vec().unwrap(), &want, 0.0);
    }
}

// ----- in place, threads, errors -----

#[test]
fn inplace_ops_match_out_of_place() {
    let mut rng = Rng::new(22);
    type Build = Box<dyn Fn(&Context, &Tensor, &Tensor, &Tensor) -> Tensor>;
    let builders: Vec<(&str, Build)> = vec![
        ("add", Box::new(|c, a, b, _| ops::add(c, a, b).unwrap())),
        ("mul", Box::new(|c, a, b, _| ops::mul(c, a, b).unwrap())),
        (
            "scale",
            Box::new(|c, a, _, _| ops::scale(c, a, 0.5, 1.0).unwrap()),
        ),
        (
            "silu",
            Box::new(|c, a, _, _| ops::unary(c, a, UnaryOp::Silu).unwrap()),
        ),
        (
            "rms_norm",
            Box::new(|c, a, _, _| ops::rms_norm(c, a, 1e-6).unwrap()),
        ),
        (
            "soft_max",
            Box::new(|c, a, _, _| ops::soft_max(c, a, None, 0.7, 0.0).unwrap()),
        ),
        (
            "diag_mask_inf",
            Box::new(|c, a, _, _| ops::diag_mask_inf(c, a, 1).unwrap()),
        ),
        (
            "rope",
            Box::new(|c, a, _, pos| {
                ops::rope(c, a, pos, None, RopeParams::new(32, RopeMode::Neox)).unwrap()
            }),
        ),
    ];
    for (name, build) in builders {
        let c = ctx();
        let a = c.new_tensor(DType::F32, &[33, 9, 4]).unwrap();
        let b = c.new_tensor(DType::F32, &[33, 1, 4]).unwrap();
        let pos = c.new_tensor(DType::I32, &[4]).unwrap();
        fill_i32(&pos, &[0, 1, 5, 9]);
        let av = fill(&a, &mut rng, -1.0, 1.0);
        fill(&b, &mut rng, 0.5, 1.5);
        let reference = build(&c, &a, &b, &pos);
        compute(&reference);
        let want: Vec<f64> = reference
            .to_f32_vec()
            .unwrap()
            .iter()
            .map(|&x| x as f64)
            .collect();
        a.set_f32(&av).unwrap();
        let inplace = build(&c, &a, &b, &pos);
        make_inplace(&inplace, &a);
        compute(&inplace);
        check(
            &format!("{name} in place"),
            &a.to_f32_vec().unwrap(),
            &want,
            0.0,
        );
    }
}

#[test]
fn results_do_not_depend_on_thread_count() {
    let mut rng = Rng::new(23);
    let c = ctx();
    let a = c.new_tensor(DType::F32, &[300, 200]).unwrap();
    let w = c.new_tensor(DType::F16, &[300, 130]).unwrap();
    fill(&a, &mut rng, -1.0, 1.0);
    fill(&w, &mut rng, -1.0, 1.0);
    let n = ops::rms_norm(&c, &a, 1e-6).unwrap();
    let y = ops::mul_mat(&c, &w, &n).unwrap();
    let s = ops::soft_max(&c, &y, None, 1.0, 0.0).unwrap();
    let total = ops::sum(&c, &s).unwrap();
    let graph = Graph::build(&[s.clone(), total.clone()]);
    // Bit-identical at 1, 2 and 3 threads (asserted by the helper).
    compute_graph_all_threads(&graph, false).unwrap();
    let got = total.to_f32_vec().unwrap()[0];
    assert!((got - 200.0).abs() < 1e-2, "softmax rows sum to one");
}

/// Products with many columns (from 256 the AVX-512 GEMM packs the weights and stores output
/// rows straight from its registers): partial weight panels (m not a multiple of 32), partial
/// activation slivers (n not a multiple of 12), several weight blocks (m > 256) and `k` blocks
/// (k > 384, resumed from the output), batches with broadcast weights, and strided
/// activations. Every weight type against the f64 reference (NMSE ≤ 5e-4, the bound of the
/// other product tests), with guard bytes around the output and identical bits at 1, 2 and 3
/// threads; f32 weights also bit for bit against one fused multiply-add chain over `k` per
/// element (the order every GEMM path promises).
#[test]
fn mul_mat_many_columns_matches_reference_and_fma_chain() {
    let mut rng = Rng::new(31);
    for dtype in [DType::F32, DType::F16, DType::BF16, DType::Q8_0] {
        for (k, m, n, batches, transposed) in [
            (800usize, 300usize, 263usize, 1usize, false),
            (64, 7, 256, 1, false),
            (384, 40, 300, 2, false),
            (96, 33, 270, 1, true),
        ] {
            let c = ctx();
            let a = c.new_tensor(dtype, &[k, m, 1]).unwrap();
            let (b, bv) = if transposed {
                // Activations stored n-major and transposed by a view: packed before the
                // product.
                let raw = c.new_tensor(DType::F32, &[n, k, batches]).unwrap();
                let rv = fill(&raw, &mut rng, -1.0, 1.0);
                let view = ops::transpose(&c, &raw).unwrap();
                let mut bv = vec![0f32; k * n * batches];
                for t in 0..batches {
                    for j in 0..n {
                        for kk in 0..k {
                            bv[kk + k * (j + n * t)] = rv[j + n * (kk + k * t)];
                        }
                    }
                }
                (view, bv)
            } else {
                let b = c.new_tensor(DType::F32, &[k, n, batches]).unwrap();
                let bv = fill(&b, &mut rng, -1.0, 1.0);
                (b, bv)
            };
            let av = fill_any(&a, &mut rng);
            let out = ops::mul_mat(&c, &a, &b).unwrap();
            let check_guard = guard(&out);
            compute(&out);
            check_guard();
            let got = out.to_f32_vec().unwrap();
            let what = format!("mul_mat {dtype} k{k} m{m} n{n}×{batches}");
            check(
                &what,
                &got,
                &mul_mat_ref(&av, a.ne(), &bv, [k, n, batches, 1]),
                5e-4,
            );
            if dtype == DType::F32 {
                for (e, &g) in got.iter().enumerate() {
                    let (i, j) = (e % m, e / m);
                    let mut acc = 0f32;
                    for kk in 0..k {
                        acc = bv[j * k + kk].mul_add(av[i * k + kk], acc);
                    }
                    assert_eq!(g.to_bits(), acc.to_bits(), "{what}: element {i},{j}");
                }
            }
        }
    }
}

/// The shapes whose results used to change with the thread count: f16 weights with few
/// columns (the path depended on each tile's column count) and converted-weight GEMM panels
/// (split per thread), plus products with many small batches and a large SUM.
#[test]
fn mul_mat_bits_do_not_depend_on_thread_count() {
    let mut rng = Rng::new(25);
    let weight_types = [
        DType::F32,
        DType::F16,
        DType::BF16,
        DType::Q8_0,
        DType::Q4_0,
    ];
    for dtype in weight_types {
        for (k, m, n, batches) in [
            (64usize, 19usize, 5usize, 1usize),
            (96, 513, 40, 1),
            (800, 131, 16, 1),
            (96, 200, 15, 2),
            (64, 300, 33, 3),
            (32, 40, 64, 12),
            (128, 130, 3, 2),
            (224, 70, 2, 1),
            (160, 33, 2, 3),
        ] {
            let c = ctx();
            let a = c.new_tensor(dtype, &[k, m, batches]).unwrap();
            let b = c.new_tensor(DType::F32, &[k, n, batches]).unwrap();
            let av = fill_any(&a, &mut rng);
            let bv = fill(&b, &mut rng, -1.0, 1.0);
            let out = ops::mul_mat(&c, &a, &b).unwrap();
            compute(&out);
            check(
                &format!("mul_mat {dtype} k{k} m{m} n{n}"),
                &out.to_f32_vec().unwrap(),
                &mul_mat_ref(&av, a.ne(), &bv, b.ne()),
                5e-4,
            );
        }
    }
    let c = ctx();
    let big = c.new_tensor(DType::F32, &[1000, 300]).unwrap();
    fill(&big, &mut rng, -1.0, 1.0);
    compute(&ops::sum(&c, &big).unwrap());
}

/// A product's rows do not depend on the rows computed beside them: the product of a block
/// of weight rows starting at any offset (a view: other tile boundaries, other 4-row groups,
/// a partial last group) gives those rows of the whole product bit for bit, on every path
/// (direct dots, register tiles, GEMM) and at 1, 2 and 3 threads.
#[test]
fn mul_mat_rows_do_not_depend_on_their_neighbours() {
    let mut rng = Rng::new(31);
    // (type, row length): the block types besides q8_0/q4_0 cover the several-column dot
    // products (q4_1 and the K-quants up to 8 columns), the affine GEMM beyond them and the
    // integer GEMM's grouped sources (mxfp4, iq3_s, tq1_0).
    for (dtype, k) in [
        (DType::F32, 96usize),
        (DType::F16, 96),
        (DType::BF16, 96),
        (DType::Q8_0, 96),
        (DType::Q4_0, 96),
        (DType::Q4_1, 96),
        (DType::Q5_0, 96),
        (DType::IQ4_NL, 96),
        (DType::Q4_K, 256),
        (DType::Q6_K, 256),
        // grouped sources of the integer GEMM (from 2 or 3 columns)
        (DType::MXFP4, 96),
        (DType::IQ3_S, 256),
        (DType::TQ1_0, 256),
    ] {
        for n in [1usize, 2, 3, 5, 13, 40, 64, 96] {
            let m = 45usize;
            let c = ctx();
            let a = c.new_tensor(dtype, &[k, m]).unwrap();
            let b = c.new_tensor(DType::F32, &[k, n]).unwrap();
            if matches!(
                dtype,
                DType::F32 | DType::F16 | DType::BF16 | DType::Q8_0 | DType::Q4_0
            ) {
                fill_any(&a, &mut rng);
            } else if !dtype.has_quantizer() {
                fill_block(&a, &mut rng);
            } else {
                let x: Vec<f32> = (0..k * m).map(|_| rng.uniform(-1.0, 1.0)).collect();
                let mut bytes = vec![0u8; a.nbytes()];
                dtype.row_from_f32(&x, &mut bytes).unwrap();
                a.write_bytes(0, &bytes).unwrap();
            }
            fill(&b, &mut rng, -1.0, 1.0);
            let whole = ops::mul_mat(&c, &a, &b).unwrap();
            compute(&whole);
            let whole = whole.to_f32_vec().unwrap();
            for (first, rows) in [(1usize, 30usize), (5, 37), (6, 3), (13, 32)] {
                let part = ops::view(&c, &a, &[k, rows], &[a.nb()[1]], first * a.nb()[1]).unwrap();
                let out = ops::mul_mat(&c, &part, &b).unwrap();
                compute(&out);
                let got = out.to_f32_vec().unwrap();
                for j in 0..n {
                    for i in 0..rows {
                        let (g, w) = (got[j * rows + i], whole[j * m + first + i]);
                        assert_eq!(
                            g.to_bits(),
                            w.to_bits(),
                            "{dtype} n {n} rows {first}..{}: [{j}, {i}] {g} vs {w}",
                            first + rows
                        );
                    }
                }
            }
        }
    }
}

struct Double(AtomicUsize);

impl CustomOp for Double {
    fn name(&self) -> &str {
        "double"
    }
    fn compute(&self, dst: &Tensor, srcs: &[Tensor]) -> Result<()> {
        self.0.fetch_add(1, Ordering::SeqCst);
        let v: Vec<f32> = srcs[0].to_f32_vec()?.iter().map(|x| 2.0 * x).collect();
        dst.set_f32(&v)
    }
}

#[test]
fn custom_ops_abort_and_errors() {
    let c = ctx();
    let a = c.new_tensor(DType::F32, &[5]).unwrap();
    a.set_f32(&[1.0, 2.0, 3.0, 4.0, 5.0]).unwrap();
    let op = Arc::new(Double(AtomicUsize::new(0)));
    let out = ops::custom(&c, op.clone(), std::slice::from_ref(&a), DType::F32, &[5]).unwrap();
    let next = ops::scale(&c, &out, 1.0, 1.0).unwrap();
    compute(&next);
    assert_eq!(next.to_f32_vec().unwrap(), vec![3.0, 5.0, 7.0, 9.0, 11.0]);
    // Once per thread count.
    let runs = THREAD_COUNTS.len();
    assert_eq!(op.0.load(Ordering::SeqCst), runs);

    // Abort before the first node: nothing runs.
    let graph = Graph::build(std::slice::from_ref(&next));
    let abort = || true;
    let status = compute_graph(&graph, &pool(2), &ComputeOptions::default(), Some(&abort)).unwrap();
    assert_eq!(status, Status::Aborted);
    assert_eq!(op.0.load(Ordering::SeqCst), runs);
    // Abort after the first node.
    let calls = AtomicUsize::new(0);
    let abort_second = || calls.fetch_add(1, Ordering::SeqCst) >= 1;
    let status = compute_graph(
        &graph,
        &pool(2),
        &ComputeOptions::default(),
        Some(&abort_second),
    )
    .unwrap();
    assert_eq!(status, Status::Aborted);
    assert_eq!(op.0.load(Ordering::SeqCst), runs + 1);

    // A tensor without memory reports its storage error.
    let lazy = Context::new(true);
    let x = lazy.new_tensor(DType::F32, &[4]).unwrap();
    let y = ops::sqr(&lazy, &x).unwrap();
    let mut scratch = Vec::new();
    let err = compute_node(&y, &pool(1), &ComputeOptions::default(), &mut scratch).unwrap_err();
    assert!(matches!(err, Error::NotAllocated(_)), "{err}");

    // Every builder-made node in these tests has a kernel.
    for t in c.tensors() {
        assert!(supports_op(&t), "{t:?}");
    }
}

#[test]
fn no_op_writes_outside_its_output() {
    let mut rng = Rng::new(24);
    let c = ctx();
    let a = c.new_tensor(DType::F32, &[33, 7, 4]).unwrap();
    let h = c.new_tensor(DType::F16, &[64, 5, 4]).unwrap();
    let pos = c.new_tensor(DType::I32, &[4]).unwrap();
    let ids = c.new_tensor(DType::I32, &[3]).unwrap();
    fill(&a, &mut rng, -1.0, 1.0);
    fill(&h, &mut rng, -1.0, 1.0);
    fill_i32(&pos, &[1, 2, 3, 4]);
    fill_i32(&ids, &[4, 0, 2]);
    let table = c.new_tensor(DType::Q4_0, &[64, 5]).unwrap();
    fill_quant(&table, &mut rng);
    let outputs = vec![
        ops::soft_max(&c, &a, None, 1.0, 0.0).unwrap(),
        ops::rope(&c, &h, &pos, None, RopeParams::new(64, RopeMode::Normal)).unwrap(),
        ops::get_rows(&c, &table, &ids).unwrap(),
        ops::cont(&c, &ops::permute(&c, &a, [1, 2, 0, 3]).unwrap()).unwrap(),
        ops::norm(&c, &a, 1e-5).unwrap(),
        ops::glu(&c, &h, GluOp::Swiglu, true).unwrap(),
        ops::concat(&c, &a, &a, 2).unwrap(),
        ops::sum_rows(&c, &a).unwrap(),
        ops::argmax(&c, &ops::view(&c, &a, &[33, 7], &[132], 0).unwrap()).unwrap(),
        ops::repeat(&c, &a, &c.new_tensor(DType::F32, &[66, 7, 8]).unwrap()).unwrap(),
        ops::unary(&c, &h, UnaryOp::Gelu).unwrap(),
        ops::sum(&c, &h).unwrap(),
        ops::dup(&c, &table).unwrap(),
    ];
    for out in outputs {
        let check_guard = guard(&out);
        compute(&out);
        check_guard();
    }
    // Copies into a guarded leaf destination (CPY and SET_ROWS write through views of it).
    let dst = c.new_tensor(DType::Q8_0, &[64, 5, 4]).unwrap();
    let check_guard = guard(&dst);
    let src = c.new_tensor(DType::F32, &[64, 5, 4]).unwrap();
    fill(&src, &mut rng, -1.0, 1.0);
    compute(&ops::cpy(&c, &src, &dst).unwrap());
    check_guard();
    let rows = c.new_tensor(DType::F32, &[64, 3, 4]).unwrap();
    fill(&rows, &mut rng, -1.0, 1.0);
    let idx = c.new_tensor(DType::I32, &[3, 1]).unwrap();
    fill_i32(&idx, &[4, 0, 2]);
    compute(&ops::set_rows(&c, &dst, &rows, &idx).unwrap());
    check_guard();
}

// ----- ggml's other block types (q4_1 .. q1_0) -----

/// Every block type a product can use as weights beyond q8_0/q4_0 (which have tests of
/// their own), in `DType::ALL` order: derived, so a new block type is covered when it is added.
fn gguf_weight_types() -> Vec<DType> {
    DType::ALL
        .into_iter()
        .filter(|d| d.is_quantized() && d.is_weight_type())
        .filter(|d| !matches!(d, DType::Q8_0 | DType::Q4_0))
        .collect()
}

/// The hand list this replaced: the derived one must not lose a type silently.
#[test]
fn gguf_weight_types_cover_ggml_block_types() {
    let types = gguf_weight_types();
    assert_eq!(types.len(), 23, "{types:?}");
    for d in [
        DType::Q4_1,
        DType::Q2_K,
        DType::IQ1_M,
        DType::MXFP4,
        DType::Q2_0,
    ] {
        assert!(types.contains(&d), "{d}");
    }
}

/// Random blocks of a type without a quantizer (the i-quants below 4 bits): every byte random
/// but the f16 super-block scale, set to a small finite value (at the block's start, or for
/// iq1_m spread over the top nibbles of its four scale words, the block's last 8 bytes).
fn random_blocks(dtype: DType, n_values: usize, rng: &mut Rng) -> Vec<u8> {
    let size = dtype.type_size();
    let mut bytes: Vec<u8> = (0..dtype.row_size(n_values).unwrap())
        .map(|_| (rng.uniform(0.0, 256.0) as u32).min(255) as u8)
        .collect();
    for block in bytes.chunks_exact_mut(size) {
        let scale = half::f16::from_f32(rng.uniform(0.001, 0.02)).to_bits();
        if dtype == DType::IQ1_M {
            for (i, word) in block[size - 8..].chunks_exact_mut(2).enumerate() {
                let nibble = (scale >> (4 * i)) & 0xf;
                word[1] = (word[1] & 0x0f) | ((nibble as u8) << 4);
            }
        } else {
            block[..2].copy_from_slice(&scale.to_le_bytes());
        }
    }
    bytes
}

/// Fills a contiguous block-type tensor through the library's own quantizer (random blocks for
/// a type without one) and returns the dequantized values it holds.
fn fill_block(t: &Tensor, rng: &mut Rng) -> Vec<f32> {
    let dtype = t.dtype();
    let values: Vec<f32> = (0..t.nelements()).map(|_| rng.uniform(-1.0, 1.0)).collect();
    let mut bytes = vec![0u8; dtype.row_size(values.len()).unwrap()];
    if dtype.has_quantizer() {
        dtype.row_from_f32(&values, &mut bytes).unwrap();
    } else {
        bytes = random_blocks(dtype, values.len(), rng);
    }
    t.write_bytes(0, &bytes).unwrap();
    let mut back = vec![0f32; values.len()];
    dtype.row_to_f32(&bytes, &mut back).unwrap();
    back
}

/// MUL_MAT with every block type as weights: few columns (integer block dots against the
/// partner activation type), many columns (the integer GEMM against q8_0 activations for
/// q8_0, q4_0, q5_0, iq4_nl, iq4_xs, the K-quants and the grouped low-bit and grid types;
/// dequantized tiles and the f32 GEMM for the rest), partial row
/// tiles, broadcast batches and a transposed activation view — against the f64 product of the
/// dequantized weights, identical bits at 1, 2 and 3 threads, no write outside the output. With
/// at most `direct_dot_max_cols(dtype)` columns in the product (2; up to 8 for the types with
/// minimums or scales per 16) the portable kernels (the reference switch) and the SIMD kernels
/// give identical bits: the portable code defines the arithmetic.
#[test]
fn mul_mat_gguf_block_types() {
    let mut rng = Rng::new(41);
    for dtype in gguf_weight_types() {
        let unit = dtype.block_size();
        for (blocks, m, n, batches, bcast) in [
            (1usize, 5usize, 1usize, 1usize, 1usize),
            (3, 67, 2, 1, 2),
            (2, 19, 3, 2, 1),
            (4, 33, 40, 1, 1),
            (1, 130, 1, 3, 1),
            (2, 70, 5, 1, 1),
            (1, 41, 8, 1, 1),
        ] {
            let k = blocks * unit;
            let c = ctx();
            let a = c.new_tensor(dtype, &[k, m, batches]).unwrap();
            let b = c.new_tensor(DType::F32, &[k, n, batches * bcast]).unwrap();
            let av = fill_block(&a, &mut rng);
            let bv = fill(&b, &mut rng, -1.0, 1.0);
            let out = ops::mul_mat(&c, &a, &b).unwrap();
            let check_guard = guard(&out);
            compute(&out);
            check_guard();
            let want = mul_mat_ref(&av, a.ne(), &bv, b.ne());
            let what = format!("mul_mat {dtype} k{k} m{m} n{n}");
            let fast = out.to_f32_vec().unwrap();
            check(&what, &fast, &want, 2e-4);
            assert_eq!(compute_with(&out, true).unwrap(), Status::Success);
            let portable = out.to_f32_vec().unwrap();
            check(&format!("{what} reference"), &portable, &want, 2e-4);
            // (a single weight matrix shared by every batch is one product of all columns)
            let columns = if batches == 1 { n * bcast } else { n };
            if columns <= ferrograph::cpu::direct_dot_max_cols(dtype) {
                let same = fast
                    .iter()
                    .zip(&portable)
                    .all(|(x, y)| x.to_bits() == y.to_bits());
                assert!(same, "{what}: SIMD and portable bits differ");
            }
        }
        // Activations read through a transposed view (packed before quantization).
        let k = 2 * unit;
        let c = ctx();
        let a = c.new_tensor(dtype, &[k, 9]).unwrap();
        let bt = c.new_tensor(DType::F32, &[2, k]).unwrap();
        let av = fill_block(&a, &mut rng);
        let btv = fill(&bt, &mut rng, -1.0, 1.0);
        let b = ops::transpose(&c, &bt).unwrap();
        let out = ops::mul_mat(&c, &a, &b).unwrap();
        compute(&out);
        let mut bv = vec![0f32; k * 2];
        for j in 0..2 {
            for i in 0..k {
                bv[i + k * j] = btv[j + 2 * i];
            }
        }
        check(
            &format!("mul_mat {dtype} transposed activations"),
            &out.to_f32_vec().unwrap(),
            &mul_mat_ref(&av, a.ne(), &bv, [k, 2, 1, 1]),
            2e-4,
        );
    }
}

/// MUL_MAT_ID (mixture-of-experts products) with every block type as the experts' weights:
/// experts that get one or two tokens take the block dot products, others the dequantized
/// tiles; against the f64 product of the dequantized weights, at 1, 2 and 3 threads.
#[test]
fn mul_mat_id_gguf_block_types() {
    let mut rng = Rng::new(44);
    for dtype in gguf_weight_types() {
        let c = ctx();
        let k = 2 * dtype.block_size().max(32);
        let (m, n_expert, n_used, n_tokens) = (9usize, 4usize, 2usize, 5usize);
        let experts = c.new_tensor(dtype, &[k, m, n_expert]).unwrap();
        let ev = fill_block(&experts, &mut rng);
        let b = c.new_tensor(DType::F32, &[k, 1, n_tokens]).unwrap();
        let bv = fill(&b, &mut rng, -1.0, 1.0);
        let ids = c.new_tensor(DType::I32, &[n_used, n_tokens]).unwrap();
        // expert 0 twice, expert 1 once, experts 2 and 3 the rest
        let idv: Vec<i32> = vec![0, 2, 1, 3, 0, 2, 3, 2, 3, 2];
        fill_i32(&ids, &idv);
        let out = ops::mul_mat_id(&c, &experts, &b, &ids).unwrap();
        compute(&out);
        let mut want = vec![0f64; out.nelements()];
        for t in 0..n_tokens {
            for e in 0..n_used {
                let x = idv[e + n_used * t] as usize;
                for i in 0..m {
                    want[idx(out.ne(), i, e, t, 0)] = (0..k)
                        .map(|kk| {
                            ev[idx(experts.ne(), kk, i, x, 0)] as f64
                                * bv[idx(b.ne(), kk, 0, t, 0)] as f64
                        })
                        .sum();
                }
            }
        }
        check(
            &format!("mul_mat_id {dtype}"),
            &out.to_f32_vec().unwrap(),
            &want,
            2e-4,
        );
    }
}

/// Whether the integer GEMM takes every type it has kernels for here: AVX-512 VNNI present and
/// the kernels not capped below it (`FERROGRAPH_MAX_ISA`).
fn vnni_uncapped() -> bool {
    let capped = std::env::var("FERROGRAPH_MAX_ISA").is_ok_and(|v| v == "avx2" || v == "portable");
    #[cfg(target_arch = "x86_64")]
    let vnni =
        std::is_x86_feature_detected!("avx512vnni") && std::is_x86_feature_detected!("avx512bw");
    #[cfg(not(target_arch = "x86_64"))]
    let vnni = false;
    vnni && !capped
}

/// An expert given more tokens than its type's dot products take runs the integer GEMM on its
/// gathered columns: each output equals, bit for bit, the MUL_MAT of that expert's matrix
/// with the same columns (at 1, 2 and 3 threads; with VNNI, where every listed type takes
/// the GEMM), tokens of two experts interleaved.
#[test]
fn mul_mat_id_experts_with_many_tokens_equal_their_mul_mat() {
    let mut rng = Rng::new(45);
    for dtype in [
        DType::Q8_0,
        DType::Q4_0,
        DType::Q4_K,
        DType::MXFP4,
        DType::IQ2_XS,
    ] {
        let c = ctx();
        let k = 2 * dtype.block_size().max(32);
        let (m, n_expert, n_tokens) = (40usize, 3usize, 13usize);
        let experts = c.new_tensor(dtype, &[k, m, n_expert]).unwrap();
        fill_block(&experts, &mut rng);
        let b = c.new_tensor(DType::F32, &[k, 1, n_tokens]).unwrap();
        let bv = fill(&b, &mut rng, -1.0, 1.0);
        let ids = c.new_tensor(DType::I32, &[1, n_tokens]).unwrap();
        // tokens alternate between experts 1 and 2 (7 and 6 tokens), expert 0 gets none
        let idv: Vec<i32> = (0..n_tokens).map(|t| 1 + (t % 2) as i32).collect();
        fill_i32(&ids, &idv);
        let out = ops::mul_mat_id(&c, &experts, &b, &ids).unwrap();
        compute(&out);
        let got = out.to_f32_vec().unwrap();
        for x in 1..3usize {
            let tokens: Vec<usize> = (0..n_tokens).filter(|&t| idv[t] as usize == x).collect();
            let a = ops::view(
                &c,
                &experts,
                &[k, m],
                &[experts.nb()[1]],
                x * experts.nb()[2],
            )
            .unwrap();
            let cols = c.new_tensor(DType::F32, &[k, tokens.len()]).unwrap();
            let colv: Vec<f32> = tokens
                .iter()
                .flat_map(|&t| bv[t * k..(t + 1) * k].to_vec())
                .collect();
            cols.set_f32(&colv).unwrap();
            let want = ops::mul_mat(&c, &a, &cols).unwrap();
            compute(&want);
            let want = want.to_f32_vec().unwrap();
            let mut got_x = Vec::new();
            for (j, &t) in tokens.iter().enumerate() {
                for i in 0..m {
                    let (g, w) = (got[t * m + i], want[j * m + i]);
                    if vnni_uncapped() {
                        assert_eq!(
                            g.to_bits(),
                            w.to_bits(),
                            "{dtype} expert {x} token {t} row {i}"
                        );
                    }
                    got_x.push(g);
                }
            }
            // elsewhere (no VNNI: some types keep dots or tiles) the same values to rounding
            let want64: Vec<f64> = want.iter().map(|&v| f64::from(v)).collect();
            check(
                &format!("mul_mat_id {dtype} expert {x}"),
                &got_x,
                &want64,
                2e-4,
            );
        }
    }
}

/// CPY f32 → block type quantizes with the type's reference quantizer (the bytes of
/// `DType::row_from_f32`), CPY back dequantizes exactly, and GET_ROWS of block rows
/// dequantizes the chosen rows — for every block type, activation-only q8_1/q8_K included.
#[test]
fn cpy_and_get_rows_of_gguf_block_types() {
    let mut rng = Rng::new(42);
    for dtype in gguf_weight_types()
        .into_iter()
        .chain([DType::Q8_1, DType::Q8_K])
    {
        let k = 2 * dtype.block_size();
        if !dtype.has_quantizer() {
            no_quantizer_refuses_cpy_and_reads_rows(dtype, &mut rng);
            continue;
        }
        let c = ctx();
        let a = c.new_tensor(DType::F32, &[k, 3]).unwrap();
        let av = fill(&a, &mut rng, -1.0, 1.0);
        let q = c.new_tensor(dtype, &[k, 3]).unwrap();
        let out = ops::cpy(&c, &a, &q).unwrap();
        compute(&out);
        let mut expected = vec![0u8; q.nbytes()];
        dtype.row_from_f32(&av, &mut expected).unwrap();
        let mut bytes = vec![0u8; q.nbytes()];
        q.read_bytes(0, &mut bytes).unwrap();
        assert_eq!(bytes, expected, "CPY f32 -> {dtype}");
        reads_decode_exactly(&c, &q, &bytes, &[2, 0, 2, 1]);
    }
}

/// CPY out of the `(k, 3)` block tensor `q` (holding `bytes`) gives its decoded values, and
/// GET_ROWS of rows `ids` the decoded rows, exactly.
fn reads_decode_exactly(c: &Context, q: &Tensor, bytes: &[u8], ids: &[i32]) {
    let (dtype, k) = (q.dtype(), q.ne()[0]);
    let mut deq = vec![0f32; 3 * k];
    dtype.row_to_f32(bytes, &mut deq).unwrap();
    let back = c.new_tensor(DType::F32, &[k, 3]).unwrap();
    let out = ops::cpy(c, q, &back).unwrap();
    compute(&out);
    let want: Vec<f64> = deq.iter().map(|&x| x as f64).collect();
    check(
        &format!("CPY {dtype} -> f32"),
        &back.to_f32_vec().unwrap(),
        &want,
        0.0,
    );
    let id_tensor = c.new_tensor(DType::I32, &[ids.len()]).unwrap();
    fill_i32(&id_tensor, ids);
    let rows = ops::get_rows(c, q, &id_tensor).unwrap();
    compute(&rows);
    let mut want = Vec::new();
    for &r in ids {
        let r = r as usize;
        want.extend(deq[r * k..(r + 1) * k].iter().map(|&x| x as f64));
    }
    check(
        &format!("GET_ROWS {dtype}"),
        &rows.to_f32_vec().unwrap(),
        &want,
        0.0,
    );
}

/// A type without a quantizer: CPY and SET_ROWS into it are unsupported (a clear error, as in
/// ggml, whose CPU backend has no `from_float` for it); CPY out of it and GET_ROWS decode.
fn no_quantizer_refuses_cpy_and_reads_rows(dtype: DType, rng: &mut Rng) {
    let k = 2 * dtype.block_size();
    let c = ctx();
    let a = c.new_tensor(DType::F32, &[k, 3]).unwrap();
    fill(&a, rng, -1.0, 1.0);
    let q = c.new_tensor(dtype, &[k, 3]).unwrap();
    let into = ops::cpy(&c, &a, &q).unwrap();
    let err = compute_with(&into, false).unwrap_err();
    assert!(
        matches!(err, Error::OpUnsupported { .. }),
        "CPY f32 -> {dtype}: {err}"
    );
    let bytes = random_blocks(dtype, 3 * k, rng);
    q.write_bytes(0, &bytes).unwrap();
    reads_decode_exactly(&c, &q, &bytes, &[2, 0]);
}

/// FLASH_ATTN_EXT with keys and values of every KV-cache type (bf16 and the 32-value block
/// types) equals the same attention over the decoded f32 keys and values, bit for bit (rows are
/// decoded, then the f32 kernels run), with grouped heads and a mask.
#[test]
fn flash_attn_ext_with_low_precision_keys_and_values() {
    let mut rng = Rng::new(43);
    let (d, n_q, n_kv, heads, heads_kv) = (64usize, 3usize, 40usize, 4usize, 2usize);
    let cache_types = [
        DType::BF16,
        DType::Q8_0,
        DType::Q4_0,
        DType::Q4_1,
        DType::Q5_0,
        DType::Q5_1,
        DType::IQ4_NL,
    ];
    for dtype in cache_types {
        assert!(ops::is_attention_kv_type(dtype), "{dtype}");
        let c = ctx();
        let q = c.new_tensor(DType::F32, &[d, n_q, heads]).unwrap();
        fill(&q, &mut rng, -1.0, 1.0);
        let kq = c.new_tensor(dtype, &[d, n_kv, heads_kv]).unwrap();
        let vq = c.new_tensor(dtype, &[d, n_kv, heads_kv]).unwrap();
        let kv = fill_block(&kq, &mut rng);
        let vv = fill_block(&vq, &mut rng);
        let kf = c.new_tensor(DType::F32, &[d, n_kv, heads_kv]).unwrap();
        let vf = c.new_tensor(DType::F32, &[d, n_kv, heads_kv]).unwrap();
        kf.set_f32(&kv).unwrap();
        vf.set_f32(&vv).unwrap();
        let mask = c.new_tensor(DType::F32, &[n_kv, n_q]).unwrap();
        let mv: Vec<f32> = (0..n_kv * n_q)
            .map(|i| {
                if i % n_kv > 30 + i / n_kv {
                    f32::NEG_INFINITY
                } else {
                    0.0
                }
            })
            .collect();
        mask.set_f32(&mv).unwrap();
        let low = ops::flash_attn_ext(&c, &q, &kq, &vq, Some(&mask), 0.125, 0.0, 0.0).unwrap();
        let float = ops::flash_attn_ext(&c, &q, &kf, &vf, Some(&mask), 0.125, 0.0, 0.0).unwrap();
        compute(&low);
        compute(&float);
        let (a, b) = (low.to_f32_vec().unwrap(), float.to_f32_vec().unwrap());
        assert!(
            a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()),
            "{dtype}"
        );
    }
    // activation-only and K-quant types are refused with a dtype error
    let c = ctx();
    let q = c.new_tensor(DType::F32, &[256, 1, 1]).unwrap();
    for dtype in [DType::Q8_K, DType::Q4_K, DType::I32] {
        let k = c.new_tensor(dtype, &[256, 4, 1]).unwrap();
        let err = ops::flash_attn_ext(&c, &q, &k, &k, None, 1.0, 0.0, 0.0).unwrap_err();
        assert!(matches!(err, Error::DType(_)), "{dtype}: {err}");
    }
}
