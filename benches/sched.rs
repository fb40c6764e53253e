//! Scheduler overheads on a MiniLM-shaped encoder (6 layers, hidden 384, 12 heads,
//! intermediate 1536, sequence 128, ≈198 nodes, `common/minilm.rs`) on the CPU backend: planning a new graph
//! (assignment and split passes, plan cache off), re-planning through the cache, reset +
//! alloc on a warm scheduler (same graph and rebuilt graph), and one compute of a tiny graph
//! (the per-compute floor) beside the CPU backend computing it alone (goal: ≤ 3 µs) and a
//! profiled run, and the encoder computed plain and profiled (`graph_compute_profiled`). The `*_prev_alive` variants keep the previous graph alive until
//! the timing ends, so freeing its tensors is not counted.
//!
//! The peer is ggml 0.25.3 on the same graph (`benches/ggml_peer/`, run interleaved with this
//! bench; issue 26). Instructions per call (callgrind on `FG_SCHED_COUNT=<case>`, see
//! `count_mode`; previous graph alive; before → after this round, then ggml in the same
//! session): split of a new graph, plan cache cleared, 307 k → 181 k (ggml reset + split
//! 194 k; no signature is computed while the cache is empty, see docs/DECISIONS.md); cached
//! split of a rebuilt graph 66 k → 39 k (ggml has no cache); reset + alloc of the same graph
//! 319 k → 319 k, of which 260 k is the zero fill of the two inputs placed in compute memory
//! (ggml 226 k, no fill); reset + alloc of a rebuilt graph 496 k → 469 k, fill 290 k (ggml
//! 290 k, its second reset included). Times from two interleaved rounds on the loaded 2-core
//! Zen 3 VM (µs, round 1 / round 2, `*_prev_alive`): split of a new graph 62.1 → 33.5 /
//! 59.8 → 29.0 (ggml median 19.9 / 34.4); cached split 13.7 → 9.5 / 14.1 → 7.4; reset +
//! alloc of the same graph 15.6 → 15.7 / 17.5 → 16.0 (ggml 17.3 / 40.4); reset + alloc of a
//! rebuilt graph 58.7 → 55.8 / 55.8 → 46.4 (ggml 31.3 / 56.4).
//! Later (binding batches, one overwriter lock per tensor, spans computed once; Zen 5, two
//! interleaved rounds, `*_prev_alive`): reset + alloc of a rebuilt graph 26.3 → 17.4 µs (ggml
//! median 17.1 / 17.6), 475 k → 437 k instructions (the atomics were the cost, not the
//! count); of the same graph 5.9 → 5.0 µs (ggml 10.1 / 12.1).

use std::sync::Arc;

use criterion::{criterion_group, BatchSize, Criterion};
use ferrograph::backend::Backend;
use ferrograph::context::Context;
use ferrograph::cpu::backend::CpuBackend;
use ferrograph::dtype::DType;
use ferrograph::graph::Graph;
use ferrograph::ops;
use ferrograph::sched::Scheduler;
use ferrograph::Result;

#[path = "common/minilm.rs"]
mod minilm;
use minilm::{encoder, weights};

fn ok<T>(r: Result<T>, what: &str) -> T {
    match r {
        Ok(v) => v,
        Err(e) => panic!("{what}: {e}"),
    }
}

fn bench_sched(c: &mut Criterion) {
    let w = ok(weights(), "weights");
    let build = || ok(encoder(&w, 1), "graph");
    let cpu: Arc<dyn Backend> = Arc::new(ok(CpuBackend::new(1), "cpu"));
    let mut sched = ok(
        Scheduler::new(vec![cpu.clone()], None, 512, false, false),
        "sched",
    );
    let graph = build();
    ok(sched.reserve(&graph), "reserve");
    println!(
        "MiniLM encoder: {} nodes, {} leafs, {} splits, compute buffer {} bytes",
        graph.n_nodes(),
        graph.n_leafs(),
        sched.n_splits(),
        ok(sched.buffer_size(&cpu), "size")
    );

    let mut group = c.benchmark_group("sched/minilm");
    group.sample_size(30);
    group.measurement_time(std::time::Duration::from_secs(3));
    group.bench_function("split_new_graph", |b| {
        b.iter_batched(
            build,
            |g| {
                sched.clear_plan_cache();
                ok(sched.split_graph(&g), "split");
                g
            },
            BatchSize::SmallInput,
        )
    });
    group.bench_function("split_new_graph_cached", |b| {
        b.iter_batched(
            build,
            |g| {
                ok(sched.split_graph(&g), "split");
                g
            },
            BatchSize::SmallInput,
        )
    });
    ok(sched.alloc_graph(&graph), "alloc");
    group.bench_function("reset_alloc_same_graph", |b| {
        b.iter(|| {
            sched.reset();
            ok(sched.alloc_graph(&graph), "alloc");
        })
    });
    group.bench_function("reset_alloc_rebuilt_graph", |b| {
        b.iter_batched(
            build,
            |g| {
                sched.reset();
                ok(sched.alloc_graph(&g), "alloc");
                g
            },
            BatchSize::SmallInput,
        )
    });
    // The same rebuilt-graph cases with the previous graph kept alive by the caller until the
    // timing ends: the scheduler then drops only its references, and freeing the previous
    // graph's tensors (the caller's graph teardown, which ggml's figures do not include
    // either) is left out.
    let rebuilt_prev_alive = |sched: &mut Scheduler, iters: u64, what: Timed| {
        let mut total = std::time::Duration::ZERO;
        let mut prev = build();
        ok(sched.alloc_graph(&prev), "alloc");
        for _ in 0..iters {
            let g = build();
            if what == Timed::SplitUncached {
                sched.clear_plan_cache();
            }
            let start = std::time::Instant::now();
            match what {
                Timed::ResetAlloc => {
                    sched.reset();
                    ok(sched.alloc_graph(&g), "alloc");
                }
                Timed::SplitCached | Timed::SplitUncached => ok(sched.split_graph(&g), "split"),
            }
            total += start.elapsed();
            prev = g;
        }
        drop(prev);
        total
    };
    // A graph built just before it is split (warm in the caches, as in an application that
    // builds and schedules one graph at a time), with the plan cache cleared: the full
    // assignment and split passes.
    group.bench_function("split_new_graph_prev_alive", |b| {
        b.iter_custom(|iters| rebuilt_prev_alive(&mut sched, iters, Timed::SplitUncached))
    });
    group.bench_function("split_new_graph_cached_prev_alive", |b| {
        b.iter_custom(|iters| rebuilt_prev_alive(&mut sched, iters, Timed::SplitCached))
    });
    group.bench_function("reset_alloc_rebuilt_graph_prev_alive", |b| {
        b.iter_custom(|iters| rebuilt_prev_alive(&mut sched, iters, Timed::ResetAlloc))
    });
    group.finish();

    // The floor: one tiny graph computed again and again.
    let ctx = Context::new(true);
    let a = ok(ctx.new_tensor(DType::F32, &[16]), "a");
    a.set_input();
    let y = ok(ops::scale(&ctx, &a, 2.0, 1.0), "y");
    y.set_output();
    let tiny = Graph::build(std::slice::from_ref(&y));
    let cpu_floor = cpu.clone();
    let mut small = ok(Scheduler::new(vec![cpu], None, 8, false, false), "sched");
    ok(small.alloc_graph(&tiny), "alloc");
    ok(a.set_f32(&[1.0; 16]), "set");
    c.bench_function("sched/tiny_compute", |b| {
        b.iter(|| ok(small.graph_compute(&tiny), "compute"))
    });
    // Peers of the floor: the backend alone (no scheduler), and the profiled scheduler run
    // (each node timed alone; the unprofiled path above only checks one branch per split).
    c.bench_function("sched/tiny_compute_backend_only", |b| {
        b.iter(|| ok(cpu_floor.graph_compute(&tiny), "compute"))
    });
    // The backend alone at the default thread count: the pool's workers are never woken for
    // a node too small to split, so this is the same floor.
    let cpu_default: Arc<dyn Backend> = Arc::new(ok(
        CpuBackend::new(ferrograph::cpu::backend::default_n_threads()),
        "cpu",
    ));
    c.bench_function("sched/tiny_compute_backend_only_all_threads", |b| {
        b.iter(|| ok(cpu_default.graph_compute(&tiny), "compute"))
    });
    c.bench_function("sched/tiny_compute_profiled", |b| {
        b.iter(|| ok(small.graph_compute_profiled(&tiny), "compute"))
    });

    // Profiling cost on a real graph: the MiniLM encoder computed plain and profiled.
    let mut group = c.benchmark_group("sched/minilm_compute");
    group.sample_size(10);
    group.measurement_time(std::time::Duration::from_secs(3));
    ok(sched.alloc_graph(&graph), "alloc");
    group.bench_function("plain", |b| {
        b.iter(|| ok(sched.graph_compute(&graph), "compute"))
    });
    group.bench_function("profiled", |b| {
        b.iter(|| ok(sched.graph_compute_profiled(&graph), "compute"))
    });
    group.finish();
}

/// What the `*_prev_alive` benchmarks time.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Timed {
    /// `split_graph` with the plan cache cleared first.
    SplitUncached,
    /// `split_graph` through the plan cache.
    SplitCached,
    /// `reset` + `alloc_graph`.
    ResetAlloc,
}

/// Instruction counting (`FG_SCHED_COUNT=<case>[:<iterations>]`): runs one MiniLM case
/// `iterations` times (default 200) after a warm-up, each measured operation inside one
/// `#[inline(never)]` function `count_<case>`, and exits without running criterion. Under
///
/// ```text
/// FG_SCHED_COUNT=split_new:200 valgrind --tool=callgrind --collect-atstart=no \
///     --toggle-collect='*count_split_new*' target/release/deps/sched-<hash>
/// ```
///
/// callgrind's total divided by the iterations is the cost of one operation. Cases:
/// `split_new` (plan cache cleared before each, not counted), `split_cached`, `alloc_same`
/// (reset + alloc of the same graph), `alloc_rebuilt` (reset + alloc of a rebuilt graph); in
/// the rebuilt cases the previous graph stays alive until the next is built, as in the
/// `*_prev_alive` benches (so its teardown is not counted).
fn count_mode(spec: &str) {
    let (case, iters) = match spec.split_once(':') {
        Some((c, n)) => (c, n.parse::<usize>().expect("iterations")),
        None => (spec, 200),
    };
    let w = ok(weights(), "weights");
    let build = || ok(encoder(&w, 1), "graph");
    let cpu: Arc<dyn Backend> = Arc::new(ok(CpuBackend::new(1), "cpu"));
    let mut sched = ok(Scheduler::new(vec![cpu], None, 512, false, false), "sched");
    let graph = build();
    ok(sched.reserve(&graph), "reserve");
    ok(sched.alloc_graph(&graph), "alloc");
    let mut prev = build();
    ok(sched.alloc_graph(&prev), "alloc");
    let warm = 20;
    for i in 0..warm + iters {
        let counted = i >= warm;
        match case {
            "split_new" => {
                let g = build();
                sched.clear_plan_cache();
                if counted {
                    count_split_new(&mut sched, &g);
                } else {
                    ok(sched.split_graph(&g), "split");
                }
                prev = g;
            }
            "split_cached" => {
                let g = build();
                if counted {
                    count_split_cached(&mut sched, &g);
                } else {
                    ok(sched.split_graph(&g), "split");
                }
                prev = g;
            }
            "alloc_same" => {
                if counted {
                    count_alloc_same(&mut sched, &graph);
                } else {
                    sched.reset();
                    ok(sched.alloc_graph(&graph), "alloc");
                }
            }
            "alloc_rebuilt" => {
                let g = build();
                if counted {
                    count_alloc_rebuilt(&mut sched, &g);
                } else {
                    sched.reset();
                    ok(sched.alloc_graph(&g), "alloc");
                }
                prev = g;
            }
            other => panic!("unknown case {other}"),
        }
    }
    drop(prev);
    println!("{case}: {iters} counted iterations");
}

#[inline(never)]
fn count_split_new(sched: &mut Scheduler, g: &Graph) {
    // A distinct body per case, so the four are never merged into one symbol.
    std::hint::black_box(1u8);
    ok(sched.split_graph(g), "split");
}

#[inline(never)]
fn count_split_cached(sched: &mut Scheduler, g: &Graph) {
    // A distinct body per case, so the four are never merged into one symbol.
    std::hint::black_box(2u8);
    ok(sched.split_graph(g), "split");
}

#[inline(never)]
fn count_alloc_same(sched: &mut Scheduler, g: &Graph) {
    // A distinct body per case, so the four are never merged into one symbol.
    std::hint::black_box(3u8);
    sched.reset();
    ok(sched.alloc_graph(g), "alloc");
}

#[inline(never)]
fn count_alloc_rebuilt(sched: &mut Scheduler, g: &Graph) {
    // A distinct body per case, so the four are never merged into one symbol.
    std::hint::black_box(4u8);
    sched.reset();
    ok(sched.alloc_graph(g), "alloc");
}

criterion_group!(benches, bench_sched);

fn main() {
    if let Ok(spec) = std::env::var("FG_SCHED_COUNT") {
        count_mode(&spec);
        return;
    }
    benches();
    Criterion::default().configure_from_args().final_summary();
}
