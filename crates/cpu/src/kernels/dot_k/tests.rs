use super::*;
use crate::quant::codec;

/// The weight types of this module with their bytes per super-block and the byte offsets
/// of their f16 scale fields.
const TYPES: [(DType, usize, &[usize]); 6] = [
    (DType::Q2_K, Q2_K_BYTES, &[80, 82]),
    (DType::Q3_K, Q3_K_BYTES, &[108]),
    (DType::Q4_K, Q4_K_BYTES, &[0, 2]),
    (DType::Q5_K, Q5_K_BYTES, &[0, 2]),
    (DType::Q6_K, Q6_K_BYTES, &[208]),
    (DType::IQ4_XS, IQ4_XS_BYTES, &[0]),
];

/// The super-block counts of the tests (1, 2, 3, 7, 17: odd and even, short and longer).
const COUNTS: [usize; 5] = [1, 2, 3, 7, 17];

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next() as u8).collect()
    }
    /// Uniform in [-1, 1).
    fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
    /// A finite f16 bit pattern: mostly moderate normals, sometimes subnormal, zero or large.
    fn f16_bits(&mut self) -> u16 {
        let sign = (self.below(2) as u16) << 15;
        let mant = self.below(0x400) as u16;
        match self.below(10) {
            0 => sign | mant,
            1 => sign,
            2 => sign | ((24 + self.below(7) as u16) << 10) | mant,
            _ => sign | ((5 + self.below(13) as u16) << 10) | mant,
        }
    }
    /// A finite f32 scale of moderate size with a random sign (as a q8_K `d`).
    fn f32_scale(&mut self) -> f32 {
        let e = self.below(30) as i32 - 20;
        self.unit() * 2f32.powi(e)
    }
}

/// `nb` random weight super-blocks: every byte random, then finite f16 scales.
fn random_weights(rng: &mut Rng, size: usize, f16s: &[usize], nb: usize) -> Vec<u8> {
    let mut w = rng.bytes(nb * size);
    for b in 0..nb {
        for &at in f16s {
            let bits = rng.f16_bits();
            w[b * size + at..b * size + at + 2].copy_from_slice(&bits.to_le_bytes());
        }
    }
    w
}

/// How a q8_K activation row is made.
#[derive(Clone, Copy, Debug)]
enum Act {
    /// By the quantizer from random f32 values.
    Quantized,
    /// Random quants (−128 included), a random finite scale, bsums recomputed.
    RawConsistent,
    /// Random quants, scale and bsums (bsums unrelated to the quants).
    RawInconsistent,
    /// Every quant −128, bsums consistent (−2048).
    AllMin,
}

fn activations(rng: &mut Rng, kind: Act, nb: usize) -> Vec<u8> {
    match kind {
        Act::Quantized => {
            let x: Vec<f32> = (0..nb * QK_K).map(|_| rng.unit() * 3.0).collect();
            let mut out = vec![0u8; nb * Q8_K_BYTES];
            (codec(DType::Q8_K).unwrap().from_f32.unwrap())(&x, &mut out);
            out
        }
        Act::RawConsistent | Act::RawInconsistent | Act::AllMin => {
            let mut out = rng.bytes(nb * Q8_K_BYTES);
            for b in out.chunks_exact_mut(Q8_K_BYTES) {
                let d = rng.f32_scale();
                b[..4].copy_from_slice(&d.to_le_bytes());
                if matches!(kind, Act::AllMin) {
                    b[4..260].fill(0x80);
                }
                if !matches!(kind, Act::RawInconsistent) {
                    for g in 0..16 {
                        let s: i32 = b[4 + 16 * g..20 + 16 * g]
                            .iter()
                            .map(|&q| i32::from(q as i8))
                            .sum();
                        b[260 + 2 * g..262 + 2 * g].copy_from_slice(&(s as i16).to_le_bytes());
                    }
                }
            }
            out
        }
    }
}

/// Every family this CPU runs.
fn isas() -> Vec<Isa> {
    Isa::available()
}

#[test]
fn dot_fn_covers_exactly_these_types() {
    for dt in DType::ALL {
        let mine = TYPES.iter().any(|&(t, _, _)| t == dt);
        for isa in isas() {
            assert_eq!(dot_fn(dt, isa).is_some(), mine, "{dt} {isa:?}");
        }
        // Every type with an activation partner has a product, and no other type has one.
        assert_eq!(
            super::super::block_dot::dot_fn_with(dt, Isa::Portable).is_some(),
            super::super::block_dot::vec_dot_type(dt).is_some(),
            "{dt}"
        );
    }
}

/// Every family gives the portable bits on random rows (every byte random, finite scales)
/// against every kind of activation row.
#[test]
fn every_isa_matches_portable_bits() {
    let mut rng = Rng(0x0123_4567_89AB_CDEF);
    for (dtype, size, f16s) in TYPES {
        let portable = dot_fn(dtype, Isa::Portable).unwrap();
        for nb in COUNTS {
            for kind in [
                Act::Quantized,
                Act::RawConsistent,
                Act::RawInconsistent,
                Act::AllMin,
            ] {
                for _ in 0..4 {
                    let w = random_weights(&mut rng, size, f16s, nb);
                    let a = activations(&mut rng, kind, nb);
                    let want = portable(&w, &a);
                    assert!(want.is_finite(), "{dtype} {kind:?}: {want}");
                    for isa in isas() {
                        let got = dot_fn(dtype, isa).unwrap()(&w, &a);
                        assert_eq!(
                            got.to_bits(),
                            want.to_bits(),
                            "{dtype} {isa:?} {nb} super-blocks, {kind:?}: {got} vs {want}"
                        );
                    }
                }
            }
        }
    }
}

/// Extreme weight bytes (all bits set / clear, with the largest f16 scales) against
/// extreme activations, and unaligned rows.
#[test]
fn extremes_and_alignment() {
    let mut rng = Rng(77);
    for (dtype, size, f16s) in TYPES {
        for fill in [0x00u8, 0xFF, 0x80, 0x7F, 0x55] {
            for d16 in [0x7BFFu16, 0xFBFF, 0x0001, 0x3C00] {
                let nb = 3;
                let mut w = vec![fill; nb * size];
                for b in 0..nb {
                    for &at in f16s {
                        w[b * size + at..b * size + at + 2].copy_from_slice(&d16.to_le_bytes());
                    }
                }
                for kind in [Act::AllMin, Act::RawInconsistent, Act::Quantized] {
                    let a = activations(&mut rng, kind, nb);
                    let want = dot_fn(dtype, Isa::Portable).unwrap()(&w, &a);
                    for isa in isas() {
                        let dot = dot_fn(dtype, isa).unwrap();
                        let got = dot(&w, &a);
                        assert!(
                            got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()),
                            "{dtype} {isa:?} fill {fill:#x} d {d16:#x} {kind:?}: {got} vs {want}"
                        );
                        // Unaligned copies of both rows give the same bits.
                        let mut wb = vec![0u8; 1 + w.len()];
                        wb[1..].copy_from_slice(&w);
                        let mut ab = vec![0u8; 3 + a.len()];
                        ab[3..].copy_from_slice(&a);
                        let got = dot(&wb[1..], &ab[3..]);
                        assert!(got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()));
                    }
                }
            }
        }
    }
}

/// Non-finite scales (possible in hostile bytes) neither panic nor disagree beyond NaN
/// payloads.
#[test]
fn non_finite_scales() {
    let mut rng = Rng(99);
    for (dtype, size, _) in TYPES {
        for _ in 0..32 {
            let nb = 1 + rng.below(4) as usize;
            let w = rng.bytes(nb * size);
            let a = rng.bytes(nb * Q8_K_BYTES);
            let want = dot_fn(dtype, Isa::Portable).unwrap()(&w, &a);
            for isa in isas() {
                let got = dot_fn(dtype, isa).unwrap()(&w, &a);
                assert!(got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()));
            }
        }
    }
}

/// Rows of different lengths use the shorter row's whole super-blocks; empty rows give 0.
#[test]
fn lengths() {
    let mut rng = Rng(5);
    for (dtype, size, f16s) in TYPES {
        let w = random_weights(&mut rng, size, f16s, 3);
        let a = activations(&mut rng, Act::Quantized, 3);
        for isa in isas() {
            let dot = dot_fn(dtype, isa).unwrap();
            assert_eq!(dot(&[], &[]), 0.0);
            let two = dot(&w[..2 * size], &a[..2 * Q8_K_BYTES]);
            assert_eq!(dot(&w[..2 * size], &a).to_bits(), two.to_bits());
            assert_eq!(dot(&w, &a[..2 * Q8_K_BYTES + 5]).to_bits(), two.to_bits());
        }
    }
}

/// The portable product is the f64 dot product of the dequantized rows, within the f32
/// rounding bound of the module docs (consistent bsums).
#[test]
fn portable_matches_dequantized_f64_dot() {
    let mut rng = Rng(0xDEAD_BEEF);
    for (dtype, size, f16s) in TYPES {
        let to_f32 = codec(dtype).unwrap().to_f32;
        let q8_to_f32 = codec(DType::Q8_K).unwrap().to_f32;
        for nb in COUNTS {
            for kind in [Act::Quantized, Act::RawConsistent, Act::AllMin] {
                let w = random_weights(&mut rng, size, f16s, nb);
                let a = activations(&mut rng, kind, nb);
                let mut xv = vec![0f32; nb * QK_K];
                let mut yv = vec![0f32; nb * QK_K];
                to_f32(&w, &mut xv);
                q8_to_f32(&a, &mut yv);
                let exact: f64 = xv
                    .iter()
                    .zip(&yv)
                    .map(|(&p, &q)| f64::from(p) * f64::from(q))
                    .sum();
                // S bounds every product and both terms of each super-block's step.
                let s: f64 = magnitudes(dtype, &w)
                    .iter()
                    .zip(&yv)
                    .map(|(&m, &q)| m * f64::from(q).abs())
                    .sum();
                let tol = (4 * nb + 16) as f64 * 2f64.powi(-24) * s + 1e-30;
                let got = f64::from(dot_fn(dtype, Isa::Portable).unwrap()(&w, &a));
                assert!(
                    (got - exact).abs() <= tol,
                    "{dtype} {nb} {kind:?}: {got} vs {exact} (tolerance {tol})"
                );
            }
        }
    }
}

/// Per value, `|d·sc·q| + |dmin·m|` in f64 (the size of both terms of its decoding).
fn magnitudes(dtype: DType, w: &[u8]) -> Vec<f64> {
    use crate::quant::kquants::f16_at as h;
    let size = dtype.type_size();
    let mut out = Vec::new();
    for b in w.chunks_exact(size) {
        let vals: Vec<f64> = match dtype {
            DType::Q2_K => {
                let q = unpack_2bit(&b[16..80]);
                (0..QK_K)
                    .map(|v| {
                        let s = b[v / 16];
                        (f64::from(h(b, 80)) * f64::from(s & 15) * f64::from(q[v])).abs()
                            + (f64::from(h(b, 82)) * f64::from(s >> 4)).abs()
                    })
                    .collect()
            }
            DType::Q3_K => {
                let q = q3_k_quants(&b[0..32], &b[32..96]);
                let sc = q3_k_scales(&b[96..108]);
                (0..QK_K)
                    .map(|v| (f64::from(h(b, 108)) * f64::from(sc[v / 16]) * f64::from(q[v])).abs())
                    .collect()
            }
            DType::Q4_K | DType::Q5_K => {
                let q = if dtype == DType::Q4_K {
                    unpack_4bit(&b[16..144])
                } else {
                    q5_k_quants(&b[16..48], &b[48..176])
                };
                let (sc, m) = k4_scales_mins(&b[4..16]);
                (0..QK_K)
                    .map(|v| {
                        (f64::from(h(b, 0)) * f64::from(sc[v / 32]) * f64::from(q[v])).abs()
                            + (f64::from(h(b, 2)) * f64::from(m[v / 32])).abs()
                    })
                    .collect()
            }
            DType::Q6_K => {
                let q = q6_k_quants(&b[0..128], &b[128..192]);
                (0..QK_K)
                    .map(|v| {
                        let sc = f64::from(b[192 + v / 16] as i8);
                        (f64::from(h(b, 208)) * sc * f64::from(q[v])).abs()
                    })
                    .collect()
            }
            DType::IQ4_XS => {
                let q = iq4_xs_quants(&b[8..136]);
                let sc = iq4_xs_scales(u16::from_le_bytes([b[2], b[3]]), &b[4..8]);
                (0..QK_K)
                    .map(|v| (f64::from(h(b, 0)) * f64::from(sc[v / 32]) * f64::from(q[v])).abs())
                    .collect()
            }
            _ => unreachable!(),
        };
        out.extend(vals);
    }
    out
}

/// Quantized rows: the K-quant · q8_K product tracks the f32 dot product of the original
/// rows (ggml's `test-quantize-fns` allows 0.02 on its synthetic rows; 2-bit 0.04).
#[test]
fn quantized_rows_track_f32_dot() {
    let n = 4096;
    let x: Vec<f32> = (0..n).map(|i| 0.1 + 2.0 * (i as f32).cos()).collect();
    let yv: Vec<f32> = (0..n).map(|i| 0.1 + 2.0 * (i as f32 + 1.0).cos()).collect();
    let mut a = vec![0u8; n / QK_K * Q8_K_BYTES];
    (codec(DType::Q8_K).unwrap().from_f32.unwrap())(&yv, &mut a);
    let exact: f64 = x
        .iter()
        .zip(&yv)
        .map(|(&p, &q)| f64::from(p) * f64::from(q))
        .sum();
    for (dtype, size, _) in TYPES {
        let mut w = vec![0u8; n / QK_K * size];
        (codec(dtype).unwrap().from_f32.unwrap())(&x, &mut w);
        let limit = if dtype == DType::Q2_K { 0.04 } else { 0.02 };
        for isa in isas() {
            let got = f64::from(dot_fn(dtype, isa).unwrap()(&w, &a));
            // ggml's measure: |a − b| / n.
            let err = (got - exact).abs() / n as f64;
            assert!(err < limit, "{dtype} {isa:?}: {got} vs {exact} ({err})");
        }
    }
}

/// Single-thread throughput on a 4096 × 14336 weight (rows streamed one after another)
/// against a plain streaming read of the same bytes, in GB/s of weight bytes, best of five
/// passes. Times are the thread's CPU time (so other processes on a shared machine do not
/// count) and wall time. Run with
/// `cargo test --release --lib kernels::dot_k::tests::bench -- --ignored --nocapture`.
#[test]
#[ignore]
fn bench_mat_vec_bandwidth() {
    let (rows, k) = (4096usize, 14336usize);
    let nb = k / QK_K;
    let mut rng = Rng(1234);
    let act = activations(&mut rng, Act::Quantized, nb);
    for (dtype, size, f16s) in TYPES {
        let row_bytes = nb * size;
        let w = random_weights(&mut rng, size, f16s, rows * nb);
        let gb = w.len() as f64 / 1e9;
        let rate = |(cpu, wall): (f64, f64)| format!("{:5.1} ({:4.1})", gb / cpu, gb / wall);
        let mut line = format!(
            "{:6} {:5.1} MB  stream {}",
            dtype.name(),
            gb * 1e3,
            rate(best_time(&|| stream_read(&w)))
        );
        for isa in isas() {
            let dot = dot_fn(dtype, isa).unwrap();
            let t = best_time(&|| {
                w.chunks_exact(row_bytes)
                    .map(|row| dot(row, &act))
                    .fold(0f32, |s, v| s + v)
            });
            line += &format!("  {isa:?} {}", rate(t));
        }
        // The kernels' own speed: the first 32 rows (at most 242 KB, inside L2) 128 times.
        let hot = &w[..32 * row_bytes];
        for isa in isas() {
            let dot = dot_fn(dtype, isa).unwrap();
            let (cpu, _) = best_time(&|| {
                (0..128)
                    .flat_map(|_| hot.chunks_exact(row_bytes))
                    .map(|row| dot(row, &act))
                    .fold(0f32, |s, v| s + v)
            });
            line += &format!(
                "  in-cache {isa:?} {:5.1}",
                128.0 * hot.len() as f64 / 1e9 / cpu
            );
        }
        println!("{line}   GB/s: thread CPU time (wall)");
    }
}

/// The best (thread CPU seconds, wall seconds) of five runs of `f`.
fn best_time(f: &dyn Fn() -> f32) -> (f64, f64) {
    let cpu_now = || {
        let mut ts = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: `ts` is a valid timespec to write; the clock id is a constant libc defines.
        unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
        ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
    };
    let (mut cpu, mut wall) = (f64::INFINITY, f64::INFINITY);
    let mut sink = 0f32;
    for _ in 0..5 {
        let (c, t) = (cpu_now(), std::time::Instant::now());
        sink += f();
        wall = wall.min(t.elapsed().as_secs_f64());
        cpu = cpu.min(cpu_now() - c);
    }
    std::hint::black_box(sink);
    (cpu, wall)
}

/// Reads every byte of `w` once (XOR-folded in 8 independent lanes, which the compiler
/// vectorizes) and returns something that depends on all of them.
fn stream_read(w: &[u8]) -> f32 {
    let mut acc = [0u64; 8];
    let mut chunks = w.chunks_exact(64);
    for c in &mut chunks {
        for (a, word) in acc.iter_mut().zip(c.chunks_exact(8)) {
            *a ^= u64::from_le_bytes(word.try_into().unwrap());
        }
    }
    let x = acc.iter().fold(0u64, |s, &v| s ^ v) ^ chunks.remainder().len() as u64;
    (x & 0xFFFF) as f32
}

/// End to end: MUL_MAT of K-quant weights with one or two f32 activation columns on the CPU
/// backend (which then quantizes the activations to q8_K and calls these products; more
/// columns go through f32 paths) gives, for every output, the bits of this module's product of
/// the weight row with the q8_K-quantized activation column.
#[test]
fn mul_mat_uses_these_products() {
    use crate::backend::CpuBackend;
    use ferrograph_base::alloc::GraphAllocator;
    use ferrograph_base::backend::Backend;
    use ferrograph_base::buffer::CpuBufferType;
    use ferrograph_base::context::Context;
    use ferrograph_base::graph::Graph;
    use ferrograph_base::ops;
    let mut rng = Rng(2024);
    let (k, m, n) = (512usize, 5usize, 2usize);
    for (dtype, size, f16s) in TYPES {
        let w_bytes = random_weights(&mut rng, size, f16s, m * k / QK_K);
        let x: Vec<f32> = (0..k * n).map(|_| rng.unit()).collect();
        let ctx = Context::new(true);
        let w = ctx.new_tensor(dtype, &[k, m]).unwrap();
        let xt = ctx.new_tensor(DType::F32, &[k, n]).unwrap();
        let y = ops::mul_mat(&ctx, &w, &xt).unwrap();
        let graph = Graph::build(std::slice::from_ref(&y));
        GraphAllocator::new(CpuBufferType::shared())
            .alloc_graph(&graph)
            .unwrap();
        w.write_bytes(0, &w_bytes).unwrap();
        xt.set_f32(&x).unwrap();
        CpuBackend::new(2).unwrap().graph_compute(&graph).unwrap();
        let out = y.to_f32_vec().unwrap();
        let dot = dot_fn(dtype, Isa::best()).unwrap();
        for j in 0..n {
            let mut q8 = vec![0u8; k / QK_K * Q8_K_BYTES];
            (codec(DType::Q8_K).unwrap().from_f32.unwrap())(&x[j * k..(j + 1) * k], &mut q8);
            for i in 0..m {
                let row = &w_bytes[i * (k / QK_K) * size..(i + 1) * (k / QK_K) * size];
                let want = dot(row, &q8);
                assert_eq!(
                    out[j * m + i].to_bits(),
                    want.to_bits(),
                    "{dtype} ({i}, {j})"
                );
            }
        }
    }
}
