//! Graph allocator on a MiniLM-shaped encoder (6 layers, hidden 384, 12 heads, intermediate
//! 1536, sequence 128): prints the planned compute buffer size beside the sum of all
//! intermediate tensor sizes, then times planning (`reserve` of a new graph) and replay
//! (`alloc_graph` of a rebuilt graph with the same topology).

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, BatchSize, Criterion};
use ferrograph::alloc::{alloc_ctx_tensors_from_buft, check_plan, GraphAllocator};
use ferrograph::buffer::{Buffer, CpuBufferType};
use ferrograph::context::Context;
use ferrograph::dtype::DType;
use ferrograph::graph::Graph;
use ferrograph::ops::{self, UnaryOp};
use ferrograph::tensor::Tensor;
use ferrograph::Result;

const LAYERS: usize = 6;
const HIDDEN: usize = 384;
const HEADS: usize = 12;
const HEAD_DIM: usize = HIDDEN / HEADS;
const INTERMEDIATE: usize = 1536;
const SEQ: usize = 128;

struct Layer {
    wq: Tensor,
    bq: Tensor,
    wk: Tensor,
    bk: Tensor,
    wv: Tensor,
    bv: Tensor,
    wo: Tensor,
    bo: Tensor,
    ln1_g: Tensor,
    ln1_b: Tensor,
    w1: Tensor,
    b1: Tensor,
    w2: Tensor,
    b2: Tensor,
    ln2_g: Tensor,
    ln2_b: Tensor,
}

/// Weights in their own (external) host buffer.
struct Weights {
    layers: Vec<Layer>,
    _ctx: Context,
    _buffers: Vec<Buffer>,
}

fn weights() -> Result<Weights> {
    let ctx = Context::new(true);
    let t = |ne: &[usize]| ctx.new_tensor(DType::F16, ne);
    let v = |n: usize| ctx.new_tensor(DType::F32, &[n]);
    let mut layers = Vec::new();
    for _ in 0..LAYERS {
        layers.push(Layer {
            wq: t(&[HIDDEN, HIDDEN])?,
            bq: v(HIDDEN)?,
            wk: t(&[HIDDEN, HIDDEN])?,
            bk: v(HIDDEN)?,
            wv: t(&[HIDDEN, HIDDEN])?,
            bv: v(HIDDEN)?,
            wo: t(&[HIDDEN, HIDDEN])?,
            bo: v(HIDDEN)?,
            ln1_g: v(HIDDEN)?,
            ln1_b: v(HIDDEN)?,
            w1: t(&[HIDDEN, INTERMEDIATE])?,
            b1: v(INTERMEDIATE)?,
            w2: t(&[INTERMEDIATE, HIDDEN])?,
            b2: v(HIDDEN)?,
            ln2_g: v(HIDDEN)?,
            ln2_b: v(HIDDEN)?,
        });
    }
    let buffers = alloc_ctx_tensors_from_buft(&ctx, CpuBufferType::shared())?;
    Ok(Weights {
        layers,
        _ctx: ctx,
        _buffers: buffers,
    })
}

/// The encoder graph for `batch` sequences (built in a fresh context).
fn encoder(w: &Weights, batch: usize) -> Result<Graph> {
    let ctx = Context::new(true);
    let mut x = ctx.new_tensor(DType::F32, &[HIDDEN, SEQ, batch])?;
    x.set_input();
    x.set_name("embeddings");
    let mask = ctx.new_tensor(DType::F32, &[SEQ, SEQ])?;
    mask.set_input();
    mask.set_name("mask");
    let scale = 1.0 / (HEAD_DIM as f32).sqrt();
    for l in &w.layers {
        let proj = |wt: &Tensor, b: &Tensor, x: &Tensor| -> Result<Tensor> {
            ops::add(&ctx, &ops::mul_mat(&ctx, wt, x)?, b)
        };
        let heads = |t: Tensor| -> Result<Tensor> {
            let t = ops::reshape(&ctx, &t, &[HEAD_DIM, HEADS, SEQ, batch])?;
            ops::permute(&ctx, &t, [0, 2, 1, 3])
        };
        let q = heads(proj(&l.wq, &l.bq, &x)?)?;
        let k = heads(proj(&l.wk, &l.bk, &x)?)?;
        let v = ops::reshape(
            &ctx,
            &proj(&l.wv, &l.bv, &x)?,
            &[HEAD_DIM, HEADS, SEQ, batch],
        )?;
        let v = ops::cont(&ctx, &ops::permute(&ctx, &v, [1, 2, 0, 3])?)?; // [SEQ, HEAD_DIM, HEADS, batch]
        let kq = ops::mul_mat(&ctx, &k, &q)?; // [SEQ_k, SEQ_q, HEADS, batch]
        let kq = ops::soft_max(&ctx, &kq, Some(&mask), scale, 0.0)?;
        let kqv = ops::mul_mat(&ctx, &v, &kq)?; // [HEAD_DIM, SEQ, HEADS, batch]
        let merged = ops::permute(&ctx, &kqv, [0, 2, 1, 3])?;
        let merged = ops::cont_shape(&ctx, &merged, &[HIDDEN, SEQ, batch])?;
        let attn = proj(&l.wo, &l.bo, &merged)?;
        let h = ops::add(&ctx, &attn, &x)?;
        let h = ops::norm(&ctx, &h, 1e-12)?;
        let h = ops::add(&ctx, &ops::mul(&ctx, &h, &l.ln1_g)?, &l.ln1_b)?;
        let ff = ops::unary(&ctx, &proj(&l.w1, &l.b1, &h)?, UnaryOp::Gelu)?;
        let ff = proj(&l.w2, &l.b2, &ff)?;
        let out = ops::add(&ctx, &ff, &h)?;
        let out = ops::norm(&ctx, &out, 1e-12)?;
        x = ops::add(&ctx, &ops::mul(&ctx, &out, &l.ln2_g)?, &l.ln2_b)?;
    }
    x.set_output();
    x.set_name("hidden_states");
    Ok(Graph::build(&[x]))
}

fn mib(bytes: usize) -> f64 {
    bytes as f64 / (1024.0 * 1024.0)
}

fn bench_alloc(c: &mut Criterion) {
    let w = match weights() {
        Ok(w) => w,
        Err(e) => panic!("weights: {e}"),
    };
    let build = |batch: usize| match encoder(&w, batch) {
        Ok(g) => g,
        Err(e) => panic!("graph: {e}"),
    };
    for batch in [1usize, 32] {
        let graph = build(batch);
        let mut galloc = GraphAllocator::new(CpuBufferType::shared());
        if let Err(e) = galloc.reserve(&graph) {
            panic!("reserve: {e}");
        }
        let Some(plan) = galloc.plan() else {
            panic!("no plan")
        };
        if let Err(e) = check_plan(&graph, plan) {
            panic!("{e}");
        }
        let intermediates: usize = graph
            .nodes()
            .iter()
            .filter(|n| !n.is_view())
            .map(Tensor::nbytes)
            .sum();
        println!(
            "MiniLM encoder batch {batch}: {} nodes, {} leafs; compute buffer {:.2} MiB \
             (planned tensors {:.2} MiB, all intermediate tensors {:.2} MiB, peak live {:.2} \
             MiB, fragmentation {:.3}, {} placed, {} in place)",
            graph.n_nodes(),
            graph.n_leafs(),
            mib(galloc.buffer_size(0)),
            mib(plan.tensor_bytes()),
            mib(intermediates),
            mib(plan.peak_live_bytes()),
            plan.fragmentation(),
            plan.tensors.len(),
            plan.tensors
                .iter()
                .filter(|t| t.inplace_parent.is_some())
                .count(),
        );

        let mut group = c.benchmark_group(format!("alloc/minilm_b{batch}"));
        // Planning: a new graph each time (the allocator's buffers are already big enough).
        group.bench_function("reserve_new_graph", |b| {
            b.iter_batched(
                || build(batch),
                |g| {
                    if let Err(e) = galloc.reserve(&g) {
                        panic!("reserve: {e}");
                    }
                    g
                },
                BatchSize::SmallInput,
            )
        });
        if let Err(e) = galloc.reserve(&graph) {
            panic!("reserve: {e}");
        }
        // Replay: a rebuilt graph of the same topology.
        group.bench_function("alloc_graph_rebuilt", |b| {
            b.iter_batched(
                || build(batch),
                |g| {
                    if let Err(e) = galloc.alloc_graph(&g) {
                        panic!("alloc_graph: {e}");
                    }
                    g
                },
                BatchSize::SmallInput,
            )
        });
        // Replay of the very same graph.
        group.bench_function("alloc_graph_same", |b| {
            b.iter(|| {
                if let Err(e) = galloc.alloc_graph(black_box(&graph)) {
                    panic!("alloc_graph: {e}");
                }
            })
        });
        group.finish();
    }
}

criterion_group!(benches, bench_alloc);
criterion_main!(benches);
