//! Graph allocator, planner and context allocation: ggml's allocator test cases in our own
//! words, plus a property test over random graphs. Every plan goes through `check_plan`.

use std::sync::Arc;

use ferrograph::alloc::{
    alloc_ctx_tensors_from_buft, check_plan, ctx_tensors_size, GraphAllocator, MemoryPlan,
    TensorPlan, POISON_BYTE,
};
use ferrograph::buffer::{Buffer, BufferType, CpuBufferType, HostMemory};
use ferrograph::context::Context;
use ferrograph::dtype::DType;
use ferrograph::graph::Graph;
use ferrograph::ops::{self, UnaryOp};
use ferrograph::tensor::Tensor;
use ferrograph::{Error, Result};
use proptest::prelude::*;

/// A host buffer type with a chosen alignment and maximum buffer size.
#[derive(Debug)]
struct FakeBuft {
    name: &'static str,
    align: usize,
    max: usize,
}

impl BufferType for FakeBuft {
    fn name(&self) -> &str {
        self.name
    }
    fn alloc_buffer(self: Arc<Self>, size: usize) -> Result<Buffer> {
        if size > self.max {
            return Err(Error::alloc(format!("{size} > max {}", self.max)));
        }
        Ok(Buffer::new(Box::new(HostMemory::new(size, 64)?), self))
    }
    fn alignment(&self) -> usize {
        self.align
    }
    fn max_size(&self) -> usize {
        self.max
    }
    fn is_host(&self) -> bool {
        true
    }
}

fn fake(align: usize, max: usize) -> Arc<dyn BufferType> {
    Arc::new(FakeBuft {
        name: "FAKE",
        align,
        max,
    })
}

fn cpu() -> Arc<dyn BufferType> {
    CpuBufferType::shared()
}

fn f32s(ctx: &Context, n: usize) -> Tensor {
    ctx.new_tensor(DType::F32, &[n]).unwrap()
}

fn input(ctx: &Context, n: usize) -> Tensor {
    let t = f32s(ctx, n);
    t.set_input();
    t
}

/// Reserves, checks the plan, allocates and checks that every tensor has memory.
fn reserve_check_alloc(galloc: &mut GraphAllocator, graph: &Graph) -> MemoryPlan {
    galloc.reserve(graph).unwrap();
    let plan = galloc.plan().unwrap().clone();
    check_plan(graph, &plan).unwrap_or_else(|e| panic!("{e}\n{plan}"));
    galloc.alloc_graph(graph).unwrap();
    assert_all_allocated(graph);
    plan
}

fn assert_all_allocated(graph: &Graph) {
    for t in graph.nodes().iter().chain(graph.leafs()) {
        assert!(t.is_allocated(), "{} has no memory", t.label());
    }
}

fn placed<'a>(plan: &'a MemoryPlan, t: &Tensor) -> &'a TensorPlan {
    plan.tensor(t.id())
        .unwrap_or_else(|| panic!("{} not in plan\n{plan}", t.label()))
}

#[test]
fn max_size_forces_several_chunks() {
    // 8-byte tensors, chunks of at most 16 bytes: three live inputs need two chunks.
    let ctx = Context::new(true);
    let (a, b, c) = (input(&ctx, 2), input(&ctx, 2), input(&ctx, 2));
    let s = ops::add(&ctx, &a, &b).unwrap();
    let out = ops::add(&ctx, &s, &c).unwrap();
    out.set_output();
    let graph = Graph::build(&[out]);
    let mut galloc = GraphAllocator::new(fake(8, 16));
    let plan = reserve_check_alloc(&mut galloc, &graph);
    let chunks = &plan.buffers[0].chunk_sizes;
    assert!(chunks.len() >= 2, "{plan}");
    assert!(chunks.iter().all(|&c| c <= 16));
    assert_eq!(galloc.buffers(0).len(), chunks.len());
    assert!(galloc.buffers(0).iter().all(|b| b.size() <= 16));
    assert_eq!(galloc.buffer_size(0), chunks.iter().sum::<usize>());
}

#[test]
fn tensor_larger_than_max_size_is_an_error() {
    let ctx = Context::new(true);
    let a = input(&ctx, 8); // 32 bytes
    let out = ops::sqr(&ctx, &a).unwrap();
    let graph = Graph::build(&[out]);
    let mut galloc = GraphAllocator::new(fake(8, 16));
    let err = galloc.reserve(&graph).unwrap_err();
    assert!(
        matches!(err, Error::AllocFailed { message: ref m, .. } if m.contains("maximum")),
        "{err}"
    );
    assert!(galloc.alloc_graph(&graph).is_err());
    // Context allocation reports it too.
    assert!(alloc_ctx_tensors_from_buft(&ctx, fake(8, 16)).is_err());
    assert!(!a.is_allocated());
}

#[test]
fn leftover_space_in_a_chunk_is_filled() {
    // Chunks of 16 bytes, alignment 4: a (12) opens chunk 0, b (8) needs chunk 1, and c (4)
    // fills the leftover 4 bytes of chunk 0.
    let ctx = Context::new(true);
    let (a, b, c) = (input(&ctx, 3), input(&ctx, 2), input(&ctx, 1));
    let sa = ops::sum(&ctx, &a).unwrap();
    let sb = ops::sum(&ctx, &b).unwrap();
    let t = ops::add(&ctx, &sa, &sb).unwrap();
    let u = ops::add(&ctx, &t, &c).unwrap();
    u.set_output();
    let mut graph = Graph::new();
    for x in [&a, &b, &c, &u] {
        graph.expand(x);
    }
    let mut galloc = GraphAllocator::new(fake(4, 16));
    let plan = reserve_check_alloc(&mut galloc, &graph);
    let (pa, pb, pc) = (placed(&plan, &a), placed(&plan, &b), placed(&plan, &c));
    assert_eq!((pa.chunk, pa.offset), (0, 0));
    assert_eq!((pb.chunk, pb.offset), (1, 0));
    assert_eq!((pc.chunk, pc.offset), (0, 12), "{plan}");
    assert!(plan.buffers[0].chunk_sizes.iter().all(|&s| s <= 16));
}

#[test]
fn inplace_ops_reuse_their_parent() {
    let ctx = Context::new(true);
    let a = input(&ctx, 16);
    let x = ops::sqr(&ctx, &a).unwrap(); // a is an input: never overwritten in place
    let y = ops::sqr(&ctx, &x).unwrap(); // in place over x
    let z = ops::add(&ctx, &y, &a).unwrap(); // in place over y
    z.set_output();
    let graph = Graph::build(std::slice::from_ref(&z));
    let mut galloc = GraphAllocator::new(cpu());
    let plan = reserve_check_alloc(&mut galloc, &graph);
    let (px, py, pz) = (placed(&plan, &x), placed(&plan, &y), placed(&plan, &z));
    assert_ne!(px.offset, placed(&plan, &a).offset);
    assert_eq!(px.inplace_parent, None);
    assert_eq!((py.offset, py.inplace_parent), (px.offset, Some(x.id())));
    assert_eq!((pz.offset, pz.inplace_parent), (py.offset, Some(y.id())));
    assert_eq!(plan.total(), 128);
    assert_eq!(
        x.storage().unwrap().offset,
        z.storage().unwrap().offset,
        "replay binds the shared offset"
    );

    // A parent with two consumers is not overwritten.
    let ctx = Context::new(true);
    let a = input(&ctx, 16);
    let x = ops::sqr(&ctx, &a).unwrap();
    let y = ops::sqr(&ctx, &x).unwrap();
    let z = ops::add(&ctx, &y, &x).unwrap();
    z.set_output();
    let graph = Graph::build(&[z]);
    let plan = reserve_check_alloc(&mut GraphAllocator::new(cpu()), &graph);
    assert_ne!(placed(&plan, &y).offset, placed(&plan, &x).offset);

    // Outputs are never overwritten in place.
    let ctx = Context::new(true);
    let a = input(&ctx, 16);
    let x = ops::sqr(&ctx, &a).unwrap();
    x.set_output();
    let y = ops::sqr(&ctx, &x).unwrap();
    y.set_output();
    let graph = Graph::build(std::slice::from_ref(&y));
    let plan = reserve_check_alloc(&mut GraphAllocator::new(cpu()), &graph);
    assert_ne!(placed(&plan, &y).offset, placed(&plan, &x).offset);
    assert_eq!(placed(&plan, &x).last_use, None);
}

#[test]
fn inplace_through_a_view_takes_the_source() {
    let ctx = Context::new(true);
    let a = input(&ctx, 16);
    let x = ops::cont(&ctx, &a).unwrap();
    let v = ops::reshape(&ctx, &x, &[4, 4]).unwrap();
    let y = ops::sqr(&ctx, &v).unwrap();
    y.set_output();
    let graph = Graph::build(std::slice::from_ref(&y));
    let plan = reserve_check_alloc(&mut GraphAllocator::new(cpu()), &graph);
    let (px, py) = (placed(&plan, &x), placed(&plan, &y));
    assert_eq!(
        (py.offset, py.inplace_parent),
        (px.offset, Some(x.id())),
        "{plan}"
    );

    // Not when the source has another view still to be read.
    let ctx = Context::new(true);
    let a = input(&ctx, 16);
    let x = ops::cont(&ctx, &a).unwrap();
    let v = ops::reshape(&ctx, &x, &[4, 4]).unwrap();
    let w = ops::reshape(&ctx, &x, &[16]).unwrap();
    let y = ops::sqr(&ctx, &v).unwrap();
    let z = ops::cont(&ctx, &w).unwrap();
    let out = ops::add(&ctx, &y, &ops::reshape(&ctx, &z, &[4, 4]).unwrap()).unwrap();
    out.set_output();
    let graph = Graph::build(&[out]);
    let plan = reserve_check_alloc(&mut GraphAllocator::new(cpu()), &graph);
    assert_ne!(placed(&plan, &y).offset, placed(&plan, &x).offset);
}

#[test]
fn views_keep_their_source_alive() {
    let ctx = Context::new(true);
    let a = input(&ctx, 16);
    let x = ops::cont(&ctx, &a).unwrap();
    let v = ops::transpose(&ctx, &ops::reshape(&ctx, &x, &[4, 4]).unwrap()).unwrap();
    let mut filler = ops::cont(&ctx, &a).unwrap();
    for _ in 0..4 {
        filler = ops::cont(&ctx, &filler).unwrap();
    }
    let late = ops::cont(&ctx, &v).unwrap(); // reads x through the view, much later
    let out = ops::add(&ctx, &late, &ops::reshape(&ctx, &filler, &[4, 4]).unwrap()).unwrap();
    out.set_output();
    let mut graph = Graph::new();
    graph.expand(&v);
    graph.expand(&filler);
    graph.expand(&out);
    let plan = reserve_check_alloc(&mut GraphAllocator::new(cpu()), &graph);
    let late_index = graph.nodes().iter().position(|n| n == &late).unwrap();
    let px = placed(&plan, &x);
    assert!(px.last_use.is_some_and(|l| l >= late_index), "{plan}");
}

#[test]
fn freed_memory_is_reused() {
    // x is freed after y reads it; z then takes x's place.
    let ctx = Context::new(true);
    let a = input(&ctx, 16);
    let x = ops::cont(&ctx, &a).unwrap();
    let y = ops::cont(&ctx, &x).unwrap();
    let z = ops::cont(&ctx, &y).unwrap();
    z.set_output();
    let graph = Graph::build(std::slice::from_ref(&z));
    let plan = reserve_check_alloc(&mut GraphAllocator::new(cpu()), &graph);
    // a (an input, free after x) takes y; x (free after y) takes z.
    assert_eq!(placed(&plan, &z).offset, placed(&plan, &x).offset);
    assert_eq!(placed(&plan, &y).offset, placed(&plan, &a).offset);
    assert_eq!(plan.total(), 2 * 64);
    assert!(plan.tensor_bytes() > plan.total());
}

#[test]
fn adjacent_free_blocks_merge() {
    // x1 and x2 are freed at different nodes; merged, they hold `big` (their combined size)
    // without growing the buffer.
    let ctx = Context::new(true);
    let a = input(&ctx, 16);
    let x1 = ops::cont(&ctx, &a).unwrap();
    let x2 = ops::cont(&ctx, &a).unwrap();
    let x3 = ops::cont(&ctx, &a).unwrap();
    let q = ops::cont(&ctx, &a).unwrap();
    let q2 = ops::add(&ctx, &q, &x2).unwrap(); // in place over q; frees x2
    let q3 = ops::add(&ctx, &q2, &x1).unwrap(); // in place over q2; frees x1
    let big = ops::concat(&ctx, &x3, &x3, 0).unwrap(); // 128 bytes
    q3.set_output();
    big.set_output();
    let mut graph = Graph::new();
    for t in [&x1, &x2, &x3, &q, &q3, &big] {
        graph.expand(t);
    }
    let plan = reserve_check_alloc(&mut GraphAllocator::new(cpu()), &graph);
    let pbig = placed(&plan, &big);
    assert_eq!(plan.total(), 5 * 64, "{plan}");
    assert!(
        pbig.offset + pbig.size <= placed(&plan, &x2).offset + 64,
        "{plan}"
    );
}

#[test]
fn freed_memory_is_preferred_over_growth() {
    let ctx = Context::new(true);
    let a = input(&ctx, 16);
    let big = ops::concat(&ctx, &a, &a, 0).unwrap(); // 128 bytes
    let s = ops::sum(&ctx, &big).unwrap();
    let t = ops::cont(&ctx, &s).unwrap();
    let u = ops::cont(&ctx, &t).unwrap();
    u.set_output();
    let graph = Graph::build(&[u]);
    let plan = reserve_check_alloc(&mut GraphAllocator::new(cpu()), &graph);
    // a (64) and big (128) are freed before s, t and u need room: nothing grows beyond them.
    assert_eq!(plan.total(), 192, "{plan}");
    assert_eq!(placed(&plan, &s).offset, placed(&plan, &a).offset);
    assert_eq!(placed(&plan, &t).offset, placed(&plan, &big).offset);
}

#[test]
fn several_buffer_types_and_external_tensors() {
    // Weights live in their own buffer (external to the graph allocator).
    let weights = Context::new(true);
    let w = weights.new_tensor(DType::F32, &[16]).unwrap();
    let wbufs = alloc_ctx_tensors_from_buft(&weights, cpu()).unwrap();
    assert_eq!(wbufs.len(), 1);

    let ctx = Context::new(true);
    let a = input(&ctx, 16);
    let x = ops::mul(&ctx, &a, &w).unwrap();
    let y = ops::sqr(&ctx, &x).unwrap();
    let z = ops::add(&ctx, &y, &w).unwrap();
    z.set_output();
    let graph = Graph::build(std::slice::from_ref(&z));
    let other = fake(16, usize::MAX);
    let mut galloc = GraphAllocator::new_n(&[cpu(), other.clone()]);
    let node_ids: Vec<usize> = (0..graph.n_nodes()).map(|i| i % 2).collect();
    let leaf_ids = vec![1; graph.n_leafs()];
    galloc.reserve_n(&graph, &node_ids, &leaf_ids).unwrap();
    let plan = galloc.plan().unwrap().clone();
    check_plan(&graph, &plan).unwrap();
    assert!(
        plan.tensor(w.id()).is_none(),
        "external tensors are not placed"
    );
    assert_eq!(
        galloc.reserve_n_size(&graph, &node_ids, &leaf_ids).unwrap(),
        vec![plan.buffers[0].size(), plan.buffers[1].size()]
    );
    galloc.alloc_graph(&graph).unwrap();
    assert!(w.buffer().unwrap().same(&wbufs[0]));
    for (node, &id) in graph.nodes().iter().zip(&node_ids) {
        let name = node.buffer().unwrap().buffer_type().name().to_owned();
        assert_eq!(name, if id == 0 { "CPU" } else { "FAKE" });
    }
    assert_eq!(a.buffer().unwrap().buffer_type().name(), "FAKE");

    // A different graph cannot be replayed with several buffer types.
    let bigger = ops::sqr(&ctx, &z).unwrap();
    let graph2 = Graph::build(&[bigger]);
    let err = galloc.alloc_graph(&graph2).unwrap_err();
    assert!(
        matches!(err, Error::AllocFailed { message: ref m, .. } if m.contains("reserve_n")),
        "{err}"
    );

    // Ids with the same buffer type share one buffer. (Release first: tensors bound by a live
    // allocator count as external for any other allocator.)
    galloc.release();
    let mut shared = GraphAllocator::new_n(&[cpu(), cpu()]);
    shared.reserve_n(&graph, &node_ids, &[]).unwrap();
    let plan = shared.plan().unwrap();
    check_plan(&graph, plan).unwrap();
    assert_eq!(plan.buffers[1].shared_with, Some(0));
    assert!(plan.tensors.iter().all(|t| t.buffer_id == 0));
    assert_eq!(shared.buffer_size(1), 0);
    assert!(shared.buffer_size(0) > 0);
    assert!(GraphAllocator::new(cpu())
        .reserve_n(&graph, &[3], &[])
        .is_err());
}

#[test]
fn zero_size_buffers() {
    // Buffer id 1 receives nothing: it still gets an (empty) buffer.
    let ctx = Context::new(true);
    let a = input(&ctx, 4);
    let out = ops::sqr(&ctx, &a).unwrap();
    let graph = Graph::build(&[out]);
    let mut galloc = GraphAllocator::new_n(&[cpu(), fake(8, 1024)]);
    galloc.reserve_n(&graph, &[], &[]).unwrap();
    check_plan(&graph, galloc.plan().unwrap()).unwrap();
    galloc.alloc_graph(&graph).unwrap();
    assert_eq!(galloc.buffer_size(1), 0);
    assert_eq!(galloc.buffers(1).len(), 1);

    // A graph of zero-byte tensors needs zero bytes.
    let ctx = Context::new(true);
    let empty = ctx.new_tensor(DType::F32, &[0]).unwrap();
    empty.set_input();
    let graph = Graph::build(std::slice::from_ref(&empty));
    let mut galloc = GraphAllocator::new(cpu());
    let plan = reserve_check_alloc(&mut galloc, &graph);
    assert_eq!(plan.total(), 0);
    assert_eq!(galloc.buffer_size(0), 0);
    assert!(empty.is_allocated());
}

fn chain(width: usize, output_name: &str) -> (Graph, Tensor, Tensor) {
    let ctx = Context::new(true);
    let a = input(&ctx, width);
    let x = ops::cont(&ctx, &a).unwrap();
    let y = ops::unary(&ctx, &x, UnaryOp::Gelu).unwrap();
    let z = ops::cont(&ctx, &y).unwrap();
    let out = ops::add(&ctx, &z, &x).unwrap();
    out.set_output();
    out.set_name(output_name);
    (Graph::build(std::slice::from_ref(&out)), x, out)
}

#[test]
fn replay_and_automatic_re_reservation() {
    let mut galloc = GraphAllocator::new(cpu());
    let (g1, x1, out1) = chain(64, "first");
    let plan1 = reserve_check_alloc(&mut galloc, &g1);
    let buffer = galloc.buffer(0).unwrap().clone();
    out1.set_f32(&[1.0; 64]).unwrap();

    // A rebuilt graph of the same shape replays the plan in the same buffer, and the previous
    // graph's tensors become stale.
    let (g2, x2, _) = chain(64, "second");
    galloc.alloc_graph(&g2).unwrap();
    assert!(galloc.buffer(0).unwrap().same(&buffer));
    assert_eq!(
        x2.storage().unwrap().offset,
        placed(&plan1, &x1).offset,
        "same offsets by position"
    );
    assert!(matches!(out1.to_f32_vec(), Err(Error::Stale(_))));
    assert!(matches!(x1.storage(), Err(Error::Stale(_))));

    // A smaller graph of the same topology fits the plan: no replanning.
    let (g3, _, _) = chain(16, "smaller");
    galloc.alloc_graph(&g3).unwrap();
    assert!(galloc.buffer(0).unwrap().same(&buffer));
    assert_eq!(galloc.plan().unwrap(), &plan1);

    // A bigger graph is re-reserved automatically and the buffer grows.
    let (g4, _, _) = chain(256, "bigger");
    galloc.alloc_graph(&g4).unwrap();
    check_plan(&g4, galloc.plan().unwrap()).unwrap();
    assert_all_allocated(&g4);
    assert!(galloc.buffer_size(0) > buffer.size());
    assert!(buffer.is_freed());

    // Buffers never shrink on their own; shrink() fits them to the current plan.
    let big_size = galloc.buffer_size(0);
    let (g5, _, _) = chain(16, "small again");
    galloc.reserve(&g5).unwrap();
    assert_eq!(galloc.buffer_size(0), big_size);
    galloc.shrink().unwrap();
    assert_eq!(galloc.buffer_size(0), galloc.plan().unwrap().total());
    galloc.alloc_graph(&g5).unwrap();
    assert_all_allocated(&g5);
    galloc.release();
    assert_eq!(galloc.buffer_size(0), 0);
    assert!(g5.nodes().iter().all(|n| !n.is_allocated()));
}

#[test]
fn poison_fills_compute_buffers() {
    let (graph, _, out) = chain(8, "out");
    let mut galloc = GraphAllocator::new(cpu());
    galloc.set_poison(true);
    assert!(galloc.poison());
    reserve_check_alloc(&mut galloc, &graph);
    let mut bytes = vec![0u8; out.nbytes()];
    out.read_bytes(0, &mut bytes).unwrap();
    assert!(bytes.iter().all(|&b| b == POISON_BYTE));
}

#[test]
fn plan_display_and_fragmentation() {
    let (graph, _, _) = chain(64, "out");
    let mut galloc = GraphAllocator::new(cpu());
    let plan = reserve_check_alloc(&mut galloc, &graph);
    let text = plan.to_string();
    assert!(text.contains("MemoryPlan") && text.contains("out"));
    assert!(text.contains("inplace"));
    let f = plan.fragmentation();
    assert!((0.0..1.0).contains(&f), "{f}");
    assert!(plan.peak_live_bytes() <= plan.total());
}

#[test]
fn context_allocation_splits_by_max_size() {
    let ctx = Context::new(true);
    let ts: Vec<Tensor> = (0..3).map(|_| f32s(&ctx, 10)).collect(); // 40 bytes each
    let v = ops::reshape(&ctx, &ts[0], &[5, 2]).unwrap();
    let buft = fake(8, 64);
    assert_eq!(ctx_tensors_size(&ctx, buft.as_ref()), 120);
    let buffers = alloc_ctx_tensors_from_buft(&ctx, buft).unwrap();
    assert_eq!(buffers.len(), 3);
    assert!(buffers.iter().all(|b| b.size() == 40));
    for (t, b) in ts.iter().zip(&buffers) {
        assert!(t.buffer().unwrap().same(b));
    }
    assert!(v.is_allocated());

    let ctx = Context::new(true);
    let ts: Vec<Tensor> = (0..4).map(|_| f32s(&ctx, 4)).collect(); // 16 bytes each
    let buffers = alloc_ctx_tensors_from_buft(&ctx, fake(8, 32)).unwrap();
    assert_eq!(buffers.len(), 2);
    assert_eq!(ts[1].storage().unwrap().offset, 16);
}

// ----- property test: random graphs -----

#[derive(Debug, Clone)]
struct Step {
    kind: u8,
    a: usize,
    b: usize,
    output: bool,
    buffer: usize,
}

fn step() -> impl Strategy<Value = Step> {
    (
        0u8..9,
        any::<usize>(),
        any::<usize>(),
        prop::bool::weighted(0.15),
        0usize..2,
    )
        .prop_map(|(kind, a, b, output, buffer)| Step {
            kind,
            a,
            b,
            output,
            buffer,
        })
}

/// Builds a random DAG over tensors of shape `[n0, n1]`: elementwise ops (most may run in
/// place), copies, reshape round trips, transposes, row views broadcast into adds.
fn random_graph(
    n0: usize,
    n1: usize,
    n_inputs: usize,
    external: bool,
    steps: &[Step],
) -> (Graph, Context) {
    let ctx = Context::new(true);
    let mut pool: Vec<Tensor> = (0..n_inputs)
        .map(|_| {
            let t = ctx.new_tensor(DType::F32, &[n0, n1]).unwrap();
            t.set_input();
            t
        })
        .collect();
    if external {
        let weights = Context::new(true);
        let w = weights.new_tensor(DType::F32, &[n0, n1]).unwrap();
        let _ = alloc_ctx_tensors_from_buft(&weights, cpu()).unwrap();
        pool.push(w);
    }
    let mut outputs = Vec::new();
    for s in steps {
        let x = pool[s.a % pool.len()].clone();
        let y = pool[s.b % pool.len()].clone();
        let t = match s.kind {
            0 => ops::sqr(&ctx, &x),
            1 => ops::unary(&ctx, &x, UnaryOp::Gelu),
            2 => ops::add(&ctx, &x, &y),
            3 => ops::mul(&ctx, &x, &y),
            4 => ops::cont(&ctx, &x),
            5 => ops::reshape(&ctx, &x, &[n0 * n1]).and_then(|v| ops::reshape(&ctx, &v, &[n0, n1])),
            6 => ops::transpose(&ctx, &x)
                .and_then(|t| ops::cont(&ctx, &t))
                .and_then(|c| ops::reshape(&ctx, &c, &[n0, n1])),
            7 => {
                let row = s.b % n1;
                ops::view(&ctx, &x, &[n0], &[], row * x.nb()[1])
                    .and_then(|v| ops::add(&ctx, &y, &v))
            }
            _ => ops::soft_max(&ctx, &x, None, 1.0, 0.0),
        }
        .unwrap();
        if s.output {
            t.set_output();
            outputs.push(t.clone());
        }
        pool.push(t);
    }
    let last = pool.last().unwrap().clone();
    last.set_output();
    outputs.push(last);
    (Graph::build(&outputs), ctx)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn random_graphs_plan_without_conflicts(
        n0 in 1usize..9,
        n1 in 1usize..5,
        n_inputs in 1usize..4,
        external in any::<bool>(),
        steps in prop::collection::vec(step(), 1..40),
        buft_kind in 0u8..3,
        align in prop::sample::select(vec![1usize, 4, 8, 32]),
    ) {
        let (graph, _ctx) = random_graph(n0, n1, n_inputs, external, &steps);
        let largest = graph.nodes().iter().chain(graph.leafs()).map(Tensor::nbytes).max().unwrap_or(0);
        let mut galloc = match buft_kind {
            0 => GraphAllocator::new(cpu()),
            // Small chunks: forces several chunks.
            1 => GraphAllocator::new(fake(align, largest.next_multiple_of(align).max(align) * 2)),
            _ => GraphAllocator::new_n(&[cpu(), fake(align, usize::MAX)]),
        };
        let node_ids: Vec<usize> = if buft_kind == 2 {
            steps.iter().cycle().take(graph.n_nodes()).map(|s| s.buffer).collect()
        } else {
            Vec::new()
        };
        galloc.reserve_n(&graph, &node_ids, &[]).unwrap();
        let plan = galloc.plan().unwrap().clone();
        if let Err(e) = check_plan(&graph, &plan) {
            panic!("{e}\n{graph}\n{plan}");
        }
        let sizes = galloc.reserve_n_size(&graph, &node_ids, &[]).unwrap();
        prop_assert_eq!(sizes.iter().sum::<usize>(), plan.total());
        galloc.alloc_graph(&graph).unwrap();
        assert_all_allocated(&graph);
        // Replaying the same graph keeps the plan.
        galloc.alloc_graph(&graph).unwrap();
        prop_assert_eq!(galloc.plan().unwrap(), &plan);
        assert_all_allocated(&graph);
        prop_assert!(plan.peak_live_bytes() <= plan.total());
    }
}

#[test]
fn source_of_an_output_view_is_kept() {
    // Regression (found by the property test): only the view carries the output flag; its
    // source must not be released after the view's last consumer.
    let ctx = Context::new(true);
    let a = input(&ctx, 16);
    let x = ops::cont(&ctx, &a).unwrap();
    let v = ops::reshape(&ctx, &x, &[4, 4]).unwrap();
    v.set_output();
    let y = ops::cont(&ctx, &v).unwrap();
    let z = ops::cont(&ctx, &y).unwrap();
    let w = ops::cont(&ctx, &z).unwrap();
    w.set_output();
    let graph = Graph::build(&[v, w]);
    let plan = reserve_check_alloc(&mut GraphAllocator::new(cpu()), &graph);
    assert_eq!(placed(&plan, &x).last_use, None, "{plan}");
}
