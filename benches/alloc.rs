//! Graph allocator on a MiniLM-shaped encoder (6 layers, hidden 384, 12 heads, intermediate
//! 1536, sequence 128): prints the planned compute buffer size beside the sum of all
//! intermediate tensor sizes, then times planning (`reserve` of a new graph) and replay
//! (`alloc_graph` of a rebuilt graph with the same topology).

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, BatchSize, Criterion};
use ferrograph::alloc::{check_plan, GraphAllocator};
use ferrograph::buffer::CpuBufferType;
use ferrograph::tensor::Tensor;

#[path = "common/minilm.rs"]
mod minilm;
use minilm::{encoder, weights};

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
