//! CPU kernel and graph-compute benches on MiniLM shapes (hidden 384, 12 heads, intermediate
//! 1536): whole encoder graphs (batch 1 × 16 and 128 tokens: per-node overhead), a chain of
//! tiny nodes (the per-node floor), and single ops at 32 × 128 tokens (GELU_ERF, SOFT_MAX,
//! NORM, broadcast ADD, attention products, GEMM with f32/f16/q8_0 weights) plus one-column
//! products of a 4096 × 4096 weight matrix (memory bound).
//!
//! Every bench computes through `compute_graph` on a pool of all available threads.

use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use ferrograph::context::Context;
use ferrograph::cpu::backend::default_n_threads;
use ferrograph::cpu::{compute_graph, ComputeOptions};
use ferrograph::dtype::DType;
use ferrograph::graph::Graph;
use ferrograph::ops::{self, UnaryOp};
use ferrograph::pool::{Threadpool, ThreadpoolParams};
use ferrograph::tensor::Tensor;
use ferrograph::Result;

const LAYERS: usize = 6;
const HIDDEN: usize = 384;
const HEADS: usize = 12;
const HEAD_DIM: usize = HIDDEN / HEADS;
const INTERMEDIATE: usize = 1536;

fn ok<T>(r: Result<T>, what: &str) -> T {
    match r {
        Ok(v) => v,
        Err(e) => panic!("{what}: {e}"),
    }
}

/// Deterministic pseudo-random values in [-1, 1).
fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        })
        .collect()
}

fn tensor(ctx: &Context, dtype: DType, ne: &[usize], seed: u64, scale: f32) -> Tensor {
    let t = ok(ctx.new_tensor(dtype, ne), "tensor");
    let v: Vec<f32> = values(t.nelements(), seed)
        .into_iter()
        .map(|x| x * scale)
        .collect();
    ok(t.set_f32(&v), "set");
    t
}

struct Layer {
    w: [Tensor; 6], // q, k, v, o, ff1, ff2
    b: [Tensor; 6],
    ln: [Tensor; 4],
}

/// The MiniLM encoder (as `python/ferrograph/models/minilm.py` builds it, from the embeddings
/// on) for `batch` × `seq` tokens with `wtype` weights.
fn encoder(ctx: &Context, wtype: DType, batch: usize, seq: usize) -> Result<Graph> {
    let mut seed = 1;
    let mut t = |dtype: DType, ne: &[usize], scale: f32| {
        seed += 1;
        tensor(ctx, dtype, ne, seed, scale)
    };
    let layers: Vec<Layer> = (0..LAYERS)
        .map(|_| {
            let wscale = 0.08;
            Layer {
                w: [
                    t(wtype, &[HIDDEN, HIDDEN], wscale),
                    t(wtype, &[HIDDEN, HIDDEN], wscale),
                    t(wtype, &[HIDDEN, HIDDEN], wscale),
                    t(wtype, &[HIDDEN, HIDDEN], wscale),
                    t(wtype, &[HIDDEN, INTERMEDIATE], wscale),
                    t(wtype, &[INTERMEDIATE, HIDDEN], wscale),
                ],
                b: [
                    t(DType::F32, &[HIDDEN], 0.1),
                    t(DType::F32, &[HIDDEN], 0.1),
                    t(DType::F32, &[HIDDEN], 0.1),
                    t(DType::F32, &[HIDDEN], 0.1),
                    t(DType::F32, &[INTERMEDIATE], 0.1),
                    t(DType::F32, &[HIDDEN], 0.1),
                ],
                ln: [
                    t(DType::F32, &[HIDDEN], 1.0),
                    t(DType::F32, &[HIDDEN], 0.1),
                    t(DType::F32, &[HIDDEN], 1.0),
                    t(DType::F32, &[HIDDEN], 0.1),
                ],
            }
        })
        .collect();
    let mut x = t(DType::F32, &[HIDDEN, seq, batch], 1.0);
    let mask = t(DType::F32, &[seq, seq, 1, batch], 0.0);
    let pool_w = t(DType::F32, &[seq, 1, batch], 1.0 / seq as f32);
    let scale = 1.0 / (HEAD_DIM as f32).sqrt();
    for l in &layers {
        let proj = |i: usize, x: &Tensor| -> Result<Tensor> {
            ops::add(ctx, &ops::mul_mat(ctx, &l.w[i], x)?, &l.b[i])
        };
        let heads = |t: Tensor| -> Result<Tensor> {
            let t = ops::reshape(ctx, &t, &[HEAD_DIM, HEADS, seq, batch])?;
            ops::permute(ctx, &t, [0, 2, 1, 3])
        };
        let q = heads(proj(0, &x)?)?;
        let k = heads(proj(1, &x)?)?;
        let v = ops::reshape(ctx, &proj(2, &x)?, &[HEAD_DIM, HEADS, seq, batch])?;
        let v = ops::cont(ctx, &ops::permute(ctx, &v, [1, 2, 0, 3])?)?;
        let kq = ops::mul_mat(ctx, &k, &q)?;
        let kq = ops::soft_max(ctx, &kq, Some(&mask), scale, 0.0)?;
        let kqv = ops::mul_mat(ctx, &v, &kq)?;
        let merged = ops::permute(ctx, &kqv, [0, 2, 1, 3])?;
        let merged = ops::cont_shape(ctx, &merged, &[HIDDEN, seq, batch])?;
        let h = ops::add(ctx, &proj(3, &merged)?, &x)?;
        let h = ops::norm(ctx, &h, 1e-12)?;
        let h = ops::add(ctx, &ops::mul(ctx, &h, &l.ln[0])?, &l.ln[1])?;
        let ff = ops::unary(ctx, &proj(4, &h)?, UnaryOp::GeluErf)?;
        let out = ops::add(ctx, &proj(5, &ff)?, &h)?;
        let out = ops::norm(ctx, &out, 1e-12)?;
        x = ops::add(ctx, &ops::mul(ctx, &out, &l.ln[2])?, &l.ln[3])?;
    }
    let states_t = ops::cont(ctx, &ops::transpose(ctx, &x)?)?;
    let pooled = ops::mul_mat(ctx, &states_t, &pool_w)?;
    let pooled = ops::reshape(ctx, &pooled, &[HIDDEN, batch])?;
    let out = ops::l2_norm(ctx, &pooled, 1e-12)?;
    Ok(Graph::build(&[out]))
}

fn pool() -> std::sync::Arc<Threadpool> {
    ok(
        Threadpool::new(&ThreadpoolParams::new(default_n_threads())),
        "pool",
    )
}

fn run(graph: &Graph, pool: &Threadpool) {
    let options = ComputeOptions::default();
    ok(compute_graph(graph, pool, &options, None), "compute");
}

fn bench_graphs(c: &mut Criterion) {
    let pool = pool();
    let mut group = c.benchmark_group("graph");
    group
        .sample_size(10)
        .measurement_time(Duration::from_secs(2))
        .warm_up_time(Duration::from_millis(500));
    for (wtype, batch, seq) in [
        (DType::F32, 1, 16),
        (DType::F16, 1, 16),
        (DType::F32, 1, 128),
    ] {
        let ctx = Context::new(false);
        let graph = ok(encoder(&ctx, wtype, batch, seq), "graph");
        let n = graph.n_nodes();
        group.bench_function(format!("minilm_{wtype}_{batch}x{seq}_{n}nodes"), |b| {
            b.iter(|| run(&graph, &pool))
        });
    }
    // The per-node floor: 200 chained SCALE nodes on 384 × 16 activations.
    let ctx = Context::new(false);
    let mut x = tensor(&ctx, DType::F32, &[HIDDEN, 16], 7, 1.0);
    for _ in 0..200 {
        x = ok(ops::scale(&ctx, &x, 1.0, 0.0), "scale");
    }
    let chain = Graph::build(&[x]);
    group.bench_function("chain_200_scale_384x16", |b| b.iter(|| run(&chain, &pool)));
    group.finish();
}

/// Benches `out` (a one-op graph) with a throughput of `bytes`.
fn bench_op(c: &mut Criterion, pool: &Threadpool, name: &str, out: &Tensor, bytes: u64) {
    let graph = Graph::build(std::slice::from_ref(out));
    let mut group = c.benchmark_group("op");
    group
        .sample_size(10)
        .measurement_time(Duration::from_secs(2))
        .warm_up_time(Duration::from_millis(500))
        .throughput(Throughput::Bytes(bytes));
    group.bench_function(name, |b| b.iter(|| run(&graph, pool)));
    group.finish();
}

fn bench_ops(c: &mut Criterion) {
    let pool = pool();
    let (batch, seq) = (32usize, 128usize);
    let tokens = batch * seq;
    let ctx = Context::new(false);
    let f = |ne: &[usize], seed: u64| tensor(&ctx, DType::F32, ne, seed, 1.0);

    // element-wise: bytes read + written
    let x = f(&[INTERMEDIATE, tokens], 1);
    let bytes = (x.nbytes() * 2) as u64;
    let y = ok(ops::unary(&ctx, &x, UnaryOp::GeluErf), "gelu_erf");
    bench_op(c, &pool, "gelu_erf_1536x4096", &y, bytes);
    let y = ok(ops::unary(&ctx, &x, UnaryOp::Gelu), "gelu");
    bench_op(c, &pool, "gelu_1536x4096", &y, bytes);

    // attention scores: softmax with mask and scale
    let kq = f(&[seq, seq, HEADS, batch], 2);
    let mask = tensor(&ctx, DType::F32, &[seq, seq, 1, batch], 3, 0.0);
    let y = ok(ops::soft_max(&ctx, &kq, Some(&mask), 0.17, 0.0), "soft_max");
    bench_op(
        c,
        &pool,
        "soft_max_128x128x12x32",
        &y,
        (kq.nbytes() * 2) as u64,
    );

    // layer norm and broadcast rows
    let h = f(&[HIDDEN, tokens], 4);
    let g = f(&[HIDDEN], 5);
    let y = ok(ops::norm(&ctx, &h, 1e-12), "norm");
    bench_op(c, &pool, "norm_384x4096", &y, (h.nbytes() * 2) as u64);
    let y = ok(ops::add(&ctx, &h, &g), "add");
    bench_op(c, &pool, "add_bcast_384x4096", &y, (h.nbytes() * 2) as u64);
    let y = ok(ops::mul(&ctx, &h, &g), "mul");
    bench_op(c, &pool, "mul_bcast_384x4096", &y, (h.nbytes() * 2) as u64);

    // attention products on permuted views (throughput: 2·M·N·K flops as "bytes")
    let qkv = f(&[HIDDEN, tokens], 6);
    let heads = |t: &Tensor| {
        let t = ok(
            ops::reshape(&ctx, t, &[HEAD_DIM, HEADS, seq, batch]),
            "reshape",
        );
        ok(ops::permute(&ctx, &t, [0, 2, 1, 3]), "permute")
    };
    let q = heads(&qkv);
    let k = heads(&f(&[HIDDEN, tokens], 7));
    let y = ok(ops::mul_mat(&ctx, &k, &q), "kq");
    let flops = (2 * seq * seq * HEAD_DIM * HEADS * batch) as u64;
    bench_op(c, &pool, "attn_kq_flops", &y, flops);
    let v = f(&[seq, HEAD_DIM, HEADS, batch], 8);
    let p = f(&[seq, seq, HEADS, batch], 9);
    let y = ok(ops::mul_mat(&ctx, &v, &p), "kqv");
    bench_op(c, &pool, "attn_kqv_flops", &y, flops);

    // GEMM of the FFN up-projection (384 → 1536) over 4096 tokens
    for wtype in [DType::F32, DType::F16, DType::Q8_0] {
        let w = tensor(&ctx, wtype, &[HIDDEN, INTERMEDIATE], 10, 0.08);
        let y = ok(ops::mul_mat(&ctx, &w, &h), "gemm");
        let flops = (2 * HIDDEN * INTERMEDIATE * tokens) as u64;
        bench_op(
            c,
            &pool,
            &format!("gemm_{wtype}_384x1536x4096_flops"),
            &y,
            flops,
        );
    }
    // The other f32 MiniLM products (the shapes of benches/compare_kernels.py, there beside
    // numpy): the FFN down-projection and the attention projections over 128 tokens (one
    // sentence: the main path) and 4096 (a batch: the wide path), and the up-projection over 128.
    for (k_in, m_out) in [
        (INTERMEDIATE, HIDDEN),
        (HIDDEN, HIDDEN),
        (HIDDEN, INTERMEDIATE),
    ] {
        for n_tok in [seq, tokens] {
            if (k_in, m_out, n_tok) == (HIDDEN, INTERMEDIATE, tokens) {
                continue; // above
            }
            let w = tensor(&ctx, DType::F32, &[k_in, m_out], 13, 0.08);
            let x = f(&[k_in, n_tok], 14);
            let y = ok(ops::mul_mat(&ctx, &w, &x), "gemm");
            let flops = (2 * k_in * m_out * n_tok) as u64;
            bench_op(
                c,
                &pool,
                &format!("gemm_f32_{k_in}x{m_out}x{n_tok}_flops"),
                &y,
                flops,
            );
        }
    }

    // flash attention over f32 keys/values (no mask): 2 products of 2·n_q·n_kv·d flops per
    // head; d = 80 leaves a partial vector in the value tiles
    for (d, n_q) in [(64usize, 32usize), (80, 32), (64, 1)] {
        let (n_kv, heads) = (512usize, 8usize);
        let q = f(&[d, n_q, heads, 1], 15);
        let k = f(&[d, n_kv, heads, 1], 16);
        let v = f(&[d, n_kv, heads, 1], 17);
        let scale = 1.0 / (d as f32).sqrt();
        let y = ok(
            ops::flash_attn_ext(&ctx, &q, &k, &v, None, scale, 0.0, 0.0),
            "flash_attn_ext",
        );
        let flops = (4 * n_q * n_kv * d * heads) as u64;
        bench_op(
            c,
            &pool,
            &format!("flash_attn_f32_d{d}_q{n_q}_kv{n_kv}_flops"),
            &y,
            flops,
        );
    }

    // matrix × vector: weight bytes
    let xv = f(&[4096], 11);
    for wtype in [DType::F32, DType::F16, DType::Q8_0, DType::Q4_0] {
        let w = tensor(&ctx, wtype, &[4096, 4096], 12, 0.05);
        let y = ok(ops::mul_mat(&ctx, &w, &xv), "gemv");
        bench_op(
            c,
            &pool,
            &format!("gemv_{wtype}_4096x4096"),
            &y,
            w.nbytes() as u64,
        );
    }
}

criterion_group!(benches, bench_graphs, bench_ops);
criterion_main!(benches);
