//! Tests of the base layer's scheduler, profiler and graph copies that need a backend to
//! compute on: the CPU's (the base crate's own unit tests cannot name it, being below it).

use std::sync::Arc;

use ferrograph::backend::Backend;
use ferrograph::context::Context;
use ferrograph::cpu::backend::CpuBackend;
use ferrograph::dtype::DType;
use ferrograph::error::Status;
use ferrograph::graph::Graph;
use ferrograph::graph_copy::{compare_graph_backend, graph_copy};
use ferrograph::ops;
use ferrograph::sched::{Cause, OffloadPolicy, Scheduler};
use ferrograph::tensor::Tensor;

fn cpu() -> Arc<dyn Backend> {
    Arc::new(CpuBackend::new(1).unwrap())
}

fn chain(ctx: &Context) -> (Tensor, Graph) {
    let x = ctx.new_tensor(DType::F32, &[4, 2]).unwrap();
    x.set_input();
    let y = ops::scale(ctx, &x, 2.0, 0.0).unwrap();
    let z = ops::add(ctx, &y, &x).unwrap();
    z.set_output();
    let g = Graph::build(std::slice::from_ref(&z));
    (x, g)
}

#[test]
fn single_cpu_plan_is_one_split_and_cached() {
    let mut sched = Scheduler::new(vec![cpu()], None, 16, false, false).unwrap();
    let ctx = Context::new(true);
    let (x, g) = chain(&ctx);
    sched.alloc_graph(&g).unwrap();
    x.set_f32(&[1.0; 8]).unwrap();
    assert_eq!(sched.graph_compute(&g).unwrap(), Status::Success);
    assert_eq!(g.node(-1).unwrap().to_f32_vec().unwrap(), vec![3.0; 8]);
    assert_eq!(sched.n_splits(), 1);
    let plan = sched.plan().unwrap();
    assert!(plan.copies.is_empty());
    assert_eq!(plan.leafs[0].assignment.cause, Cause::Input);
    // A rebuilt graph of the same shape hits the cache.
    let ctx2 = Context::new(true);
    let (_, g2) = chain(&ctx2);
    sched.reset();
    sched.alloc_graph(&g2).unwrap();
    assert_eq!(sched.plan_cache_stats(), (1, 1));
}

#[test]
fn offload_policy_values() {
    let ctx = Context::new(true);
    let a = ctx.new_tensor(DType::F32, &[4, 3]).unwrap();
    let b = ctx.new_tensor(DType::F32, &[4, 5]).unwrap();
    let m = ops::mul_mat(&ctx, &a, &b).unwrap();
    let backend = cpu();
    assert!(OffloadPolicy::MinBatch(5).offload(backend.as_ref(), &m));
    assert!(!OffloadPolicy::MinBatch(6).offload(backend.as_ref(), &m));
    assert!(!OffloadPolicy::Never.offload(backend.as_ref(), &m));
    assert!(OffloadPolicy::Always.offload(backend.as_ref(), &m));
}

/// A real run on the CPU backend: one entry per node, in order, with the node's name, op
/// and shape, times that sum to at most the wall time, and the same result as a normal run.
#[test]
fn profiled_run_times_every_node() {
    use ferrograph::context::Context;
    use ferrograph::cpu::backend::CpuBackend;
    use ferrograph::dtype::DType;
    use ferrograph::ops;
    use std::sync::Arc;

    let cpu: Arc<dyn Backend> = Arc::new(CpuBackend::new(2).unwrap());
    let mut sched = Scheduler::new(vec![cpu], None, 16, false, false).unwrap();
    let ctx = Context::new(true);
    let x = ctx.new_tensor(DType::F32, &[3, 4]).unwrap();
    x.set_input();
    let y = ops::scale(&ctx, &x, 2.0, 0.0).unwrap();
    y.set_name("doubled");
    let z = ops::add(&ctx, &y, &x).unwrap();
    z.set_name("sum");
    z.set_output();
    let g = Graph::build(std::slice::from_ref(&z));
    sched.alloc_graph(&g).unwrap();
    x.set_f32(&[1.0; 12]).unwrap();
    let (status, p) = sched.graph_compute_profiled(&g).unwrap();
    assert_eq!(status, Status::Success);
    assert_eq!(z.to_f32_vec().unwrap(), vec![3.0; 12]);
    let seen: Vec<(usize, &str, &str)> = p
        .nodes
        .iter()
        .map(|n| (n.index, n.name.as_str(), n.op.as_str()))
        .collect();
    assert_eq!(seen, vec![(0, "doubled", "SCALE"), (1, "sum", "ADD")]);
    assert_eq!(p.nodes[1].shape, vec![4, 3]);
    assert!(p
        .nodes
        .iter()
        .all(|n| n.seconds >= 0.0 && n.backend == "CPU"));
    assert!(p.node_seconds() <= p.total_seconds);
}

/// On the CPU backend a profile is read inside a normal run: the same bits as an unprofiled
/// run, every node listed, views at zero, and mat-vecs fused into one job (a layer's q, k, v
/// reading the same activations) sharing the job's time by their weights' bytes.
#[test]
fn profile_of_a_cpu_run_is_read_inside_the_run() {
    use ferrograph::alloc::alloc_ctx_tensors_from_buft;
    use ferrograph::buffer::CpuBufferType;

    let cpu: Arc<dyn Backend> = Arc::new(CpuBackend::new(2).unwrap());
    let weights = Context::new(true);
    let k = 256;
    let rows = [64usize, 32, 96];
    let mats: Vec<Tensor> = rows
        .iter()
        .map(|&r| weights.new_tensor(DType::Q4_K, &[k, r]).unwrap())
        .collect();
    alloc_ctx_tensors_from_buft(&weights, CpuBufferType::shared()).unwrap();
    for (i, (m, &r)) in mats.iter().zip(&rows).enumerate() {
        let values: Vec<f32> = (0..k * r)
            .map(|j| ((j * 7919 + i * 104_729) % 1013) as f32 / 500.0 - 1.0)
            .collect();
        let mut bytes = vec![0u8; DType::Q4_K.row_size(k).unwrap() * r];
        DType::Q4_K.row_from_f32(&values, &mut bytes).unwrap();
        m.write_bytes(0, &bytes).unwrap();
    }
    let ctx = Context::new(true);
    let x = ctx.new_tensor(DType::F32, &[k, 1]).unwrap();
    x.set_input();
    let normed = ops::rms_norm(&ctx, &x, 1e-5).unwrap();
    let outs: Vec<Tensor> = mats
        .iter()
        .map(|m| {
            let y = ops::mul_mat(&ctx, m, &normed).unwrap();
            let flat = ops::reshape(&ctx, &y, &[y.nelements()]).unwrap();
            flat.set_output();
            flat
        })
        .collect();
    let g = Graph::build(&outs);
    let mut sched = Scheduler::new(vec![cpu], None, 16, false, false).unwrap();
    sched.alloc_graph(&g).unwrap();
    let input: Vec<f32> = (0..k).map(|j| (j as f32 * 0.37).sin()).collect();
    x.set_f32(&input).unwrap();
    let bits = |outs: &[Tensor]| -> Vec<Vec<u32>> {
        outs.iter()
            .map(|o| {
                o.to_f32_vec()
                    .unwrap()
                    .iter()
                    .map(|v| v.to_bits())
                    .collect()
            })
            .collect()
    };
    assert_eq!(sched.graph_compute(&g).unwrap(), Status::Success);
    let plain = bits(&outs);
    // (the norm may compute in place over the input, as in ggml: set it before each run)
    x.set_f32(&input).unwrap();
    let (status, p) = sched.graph_compute_profiled(&g).unwrap();
    assert_eq!(status, Status::Success);
    assert_eq!(bits(&outs), plain);
    assert_eq!(p.nodes.len(), g.n_nodes());
    assert!(p.node_seconds() <= p.total_seconds);
    let products: Vec<f64> = p
        .nodes
        .iter()
        .filter(|n| n.op == "MUL_MAT")
        .map(|n| n.seconds)
        .collect();
    assert_eq!(products.len(), 3);
    assert!(products.iter().all(|&s| s > 0.0), "{products:?}");
    // one job's time shared by weight bytes: the rows' proportions
    for (s, &r) in products.iter().zip(&rows) {
        let expected = products[0] * r as f64 / rows[0] as f64;
        assert!(
            (s - expected).abs() <= 1e-9 * expected.max(1e-12),
            "{products:?}"
        );
    }
    for n in p.nodes.iter().filter(|n| n.op == "RESHAPE") {
        assert_eq!(n.seconds, 0.0);
    }
}

#[test]
fn copy_and_compare_two_cpu_backends() {
    let ctx = Context::new(false);
    let a = ctx.new_tensor(DType::F32, &[8, 4]).unwrap();
    let w = ctx.new_tensor(DType::F16, &[8, 3]).unwrap();
    a.set_f32(&(0..32).map(|i| i as f32 * 0.25 - 3.0).collect::<Vec<_>>())
        .unwrap();
    let wv: Vec<f32> = (0..24).map(|i| (i % 5) as f32 - 2.0).collect();
    let wh: Vec<u8> = wv
        .iter()
        .flat_map(|v| half::f16::from_f32(*v).to_le_bytes())
        .collect();
    w.write_bytes(0, &wh).unwrap();
    let y = ops::mul_mat(&ctx, &w, &a).unwrap();
    let t = ops::transpose(&ctx, &y).unwrap();
    let z = ops::unary(&ctx, &ops::cont(&ctx, &t).unwrap(), ops::UnaryOp::Gelu).unwrap();
    let graph = Graph::build(std::slice::from_ref(&z));
    let cpu1 = CpuBackend::new(1).unwrap();
    let cpu2 = CpuBackend::new(2).unwrap();
    let copy = graph_copy(&cpu2, &graph).unwrap();
    assert_eq!(copy.graph.n_nodes(), graph.n_nodes());
    let a2 = copy.copy_of(&a).unwrap();
    assert_eq!(a2.to_f32_vec().unwrap(), a.to_f32_vec().unwrap());
    assert!(!a2.buffer().unwrap().same(&a.buffer().unwrap()));
    let mut seen = Vec::new();
    let all = compare_graph_backend(&cpu1, &cpu2, &graph, |i, t1, t2| {
        let (x, y) = (t1.to_f32_vec().unwrap(), t2.to_f32_vec().unwrap());
        assert_eq!(x, y, "node {i}");
        seen.push(i);
        true
    })
    .unwrap();
    assert!(all);
    // The transpose is a view op: skipped by the callback.
    assert_eq!(seen.len(), graph.n_nodes() - 1);
    let stopped = compare_graph_backend(&cpu1, &cpu2, &graph, |_, _, _| false).unwrap();
    assert!(!stopped);
}
