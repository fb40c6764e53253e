//! What the stale-read bookkeeping costs (see `Tensor::check_current`): per compute, the
//! stamps every backend writes after a graph (`mark_computed`) and the check a user read does
//! (`check_current` on the output); per allocation, the overlap sweep (`record_overwrites`).
//!
//! Each is timed alone and printed as a fraction of what it rides on: the compute of a
//! MiniLM-shaped encoder for one sequence of 16 tokens (6 layers, hidden 384, f16 weights,
//! 1 thread), the compute of a tiny three-node graph, and `alloc_graph`. The goal is < 1% of
//! the compute. Medians of repeated batches; run with
//! `nice -n 5 cargo bench --bench values`.

use std::hint::black_box;
use std::time::Instant;

use ferrograph::alloc::{record_overwrites, GraphAllocator};
use ferrograph::backend::Backend;
use ferrograph::buffer::CpuBufferType;
use ferrograph::context::Context;
use ferrograph::cpu::backend::CpuBackend;
use ferrograph::dtype::DType;
use ferrograph::graph::Graph;
use ferrograph::ops::{self, UnaryOp};
use ferrograph::tensor::{mark_computed, Tensor};

#[path = "common/minilm.rs"]
mod minilm;

fn ok<T, E: std::fmt::Display>(r: std::result::Result<T, E>, what: &str) -> T {
    match r {
        Ok(v) => v,
        Err(e) => panic!("{what}: {e}"),
    }
}

/// Median seconds per call of `f`, over `batches` batches of `per_batch` calls.
fn median_seconds(batches: usize, per_batch: usize, mut f: impl FnMut()) -> f64 {
    let mut times: Vec<f64> = (0..batches)
        .map(|_| {
            let start = Instant::now();
            for _ in 0..per_batch {
                f();
            }
            start.elapsed().as_secs_f64() / per_batch as f64
        })
        .collect();
    times.sort_by(f64::total_cmp);
    times[times.len() / 2]
}

/// Fills every input of `graph` with zeros-but-valid values (what the kernels read).
fn set_inputs(graph: &Graph) {
    for t in graph.leafs().iter().chain(graph.nodes()) {
        if t.is_input() {
            ok(t.fill_bytes(0, t.nbytes(), 0), "set input");
        }
    }
}

fn report(name: &str, graph: &Graph, output: &Tensor, compute_batches: usize, per_batch: usize) {
    let cpu = ok(CpuBackend::new(1), "cpu");
    let mut galloc = GraphAllocator::new(CpuBufferType::shared());
    ok(galloc.alloc_graph(graph), "alloc");
    set_inputs(graph);
    ok(cpu.graph_compute(graph), "warm-up");
    let compute = median_seconds(compute_batches, per_batch, || {
        ok(cpu.graph_compute(black_box(graph)), "compute");
    });
    let stamps = median_seconds(15, per_batch * 20, || {
        mark_computed(black_box(graph.nodes()))
    });
    ok(output.check_current(), "the output is current");
    let check = median_seconds(15, per_batch * 20, || {
        ok(black_box(output).check_current(), "check");
    });
    let alloc = median_seconds(15, per_batch, || ok(galloc.alloc_graph(graph), "alloc"));
    let sweep = median_seconds(15, per_batch, || record_overwrites(black_box(graph)));
    println!(
        "{name}: {} nodes; compute {:.2} µs; per compute: stamps {:.1} ns = {:.3}% of it; per \
         read: check {:.1} ns ({:.3}% of the compute); per allocation: overlap sweep {:.2} µs \
         ({:.0}% of alloc_graph's {:.2} µs)",
        graph.n_nodes(),
        compute * 1e6,
        stamps * 1e9,
        100.0 * stamps / compute,
        check * 1e9,
        100.0 * check / compute,
        sweep * 1e6,
        100.0 * sweep / alloc,
        alloc * 1e6,
    );
}

fn main() {
    let w = ok(minilm::weights(), "weights");
    let graph = ok(minilm::encoder_seq(&w, 1, 16), "encoder");
    let output = graph.nodes().last().cloned().expect("a node");
    report("MiniLM-shaped encoder 1x16", &graph, &output, 15, 5);

    let ctx = Context::new(true);
    let x = ok(ctx.new_tensor(DType::F32, &[4]), "x");
    x.set_input();
    let m = ok(ops::scale(&ctx, &x, 3.0, 0.0), "scale");
    let n = ok(ops::unary(&ctx, &m, UnaryOp::Neg), "neg");
    let z = ok(ops::unary(&ctx, &n, UnaryOp::Relu), "relu");
    z.set_output();
    let tiny = Graph::build(std::slice::from_ref(&z));
    report(
        "tiny graph (scale, neg, relu on 4 floats)",
        &tiny,
        &z,
        15,
        2000,
    );
}
