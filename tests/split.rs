//! Weights split by rows over several devices, used by ordinary graphs: the scheduler places a
//! `MUL_MAT` whose weight lives in a split buffer on the split buffer type's backend, which
//! computes each part on its own device and gathers the rows (ggml's split buffer type).

use std::sync::Arc;

use ferrograph::alloc::alloc_ctx_tensors_from_buft;
use ferrograph::buffer::Buffer;
use ferrograph::sched::Cause;
use ferrograph::{
    ops, Backend, BackendParams, BufferType, BufferUsage, Context, CpuBackend, CpuBufferType,
    CpuDevice, DType, Device, Graph, Scheduler, SplitBufferType, Tensor,
};

fn values(n: usize, seed: u32) -> Vec<f32> {
    let mut state = seed.wrapping_mul(2_654_435_761).wrapping_add(12345);
    (0..n)
        .map(|_| {
            state = state.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            (state >> 8) as f32 / (1u32 << 24) as f32 * 2.0 - 1.0
        })
        .collect()
}

fn three_cpus(shares: &[f32]) -> Arc<SplitBufferType> {
    let cpu: Arc<dyn Device> = CpuDevice::shared();
    SplitBufferType::from_devices("CPU", vec![cpu.clone(), cpu.clone(), cpu], shares).unwrap()
}

/// `y = mul_mat(w, x) + b` with `w` of `dtype` (`ne = [k, rows]`), `x` an input of
/// `ne = [k, n, batch]`.
struct Mlp {
    w: Tensor,
    b: Tensor,
    x: Tensor,
    y: Tensor,
    graph: Graph,
    _weights: Vec<Buffer>,
}

fn mlp(
    dtype: DType,
    k: usize,
    rows: usize,
    n: usize,
    batch: usize,
    wbuft: Arc<dyn BufferType>,
) -> Mlp {
    let (wctx, bctx, ctx) = (Context::new(true), Context::new(true), Context::new(true));
    let w = wctx.new_tensor(dtype, &[k, rows]).unwrap();
    let b = bctx.new_tensor(DType::F32, &[rows]).unwrap();
    let x = ctx.new_tensor(DType::F32, &[k, n, batch]).unwrap();
    x.set_input();
    let y = ops::add(&ctx, &ops::mul_mat(&ctx, &w, &x).unwrap(), &b).unwrap();
    y.set_output();
    let mut weights = alloc_ctx_tensors_from_buft(&wctx, wbuft).unwrap();
    weights.extend(alloc_ctx_tensors_from_buft(&bctx, CpuBufferType::shared()).unwrap());
    for buffer in &weights {
        buffer.set_usage(BufferUsage::Weights);
    }
    w.set_f32(&values(k * rows, 1)).unwrap();
    b.set_f32(&values(rows, 2)).unwrap();
    let graph = Graph::build(std::slice::from_ref(&y));
    Mlp {
        w,
        b,
        x,
        y,
        graph,
        _weights: weights,
    }
}

fn cpu() -> Arc<dyn Backend> {
    Arc::new(CpuBackend::new(2).unwrap())
}

/// The unsplit result: the same graph with the weight in host memory, on the CPU backend.
fn unsplit(dtype: DType, k: usize, rows: usize, n: usize, batch: usize, input: &[f32]) -> Vec<f32> {
    let m = mlp(dtype, k, rows, n, batch, CpuBufferType::shared());
    ferrograph::GraphAllocator::new(CpuBufferType::shared())
        .alloc_graph(&m.graph)
        .unwrap();
    m.x.set_f32(input).unwrap();
    cpu().graph_compute(&m.graph).unwrap();
    m.y.to_f32_vec().unwrap()
}

/// The split device's backend and a scheduler over it and the CPU (last).
fn split_sched(split: &SplitBufferType) -> (Arc<dyn Backend>, Scheduler) {
    let backend = split
        .split_device()
        .init_backend(&BackendParams::default())
        .unwrap();
    let sched = Scheduler::new(vec![backend.clone(), cpu()], None, 16, false, false).unwrap();
    (backend, sched)
}

#[test]
fn scheduler_runs_split_weight_mul_mat_per_part_and_equals_unsplit() {
    // Uneven shares over three CPU devices; 4 to 96 columns (register tiles, and the GEMM
    // from a per-type column count), a batch dimension that broadcasts the 2-D weight; f32,
    // f16 and bf16 weights.
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        for (n, batch) in [(4, 1), (13, 1), (40, 1), (3, 2), (96, 1)] {
            let (k, rows) = (64, 37);
            let split = three_cpus(&[1.0, 2.0, 0.5]);
            let m = mlp(dtype, k, rows, n, batch, split.clone());
            let parts = split.tensor_parts(&m.w).expect("the weight is split");
            let ranges: Vec<_> = parts.parts().iter().map(|p| p.rows.clone()).collect();
            assert_eq!(ranges, vec![0..11, 11..32, 32..37]);
            // The weight reads back whole from its parts.
            let whole = m.w.to_f32_vec().unwrap();
            let reference = mlp(dtype, k, rows, n, batch, CpuBufferType::shared());
            assert_eq!(whole, reference.w.to_f32_vec().unwrap());

            let (_, mut sched) = split_sched(&split);
            for round in 0..2 {
                let input = values(k * n * batch, 10 + round);
                sched.alloc_graph(&m.graph).unwrap();
                m.x.set_f32(&input).unwrap();
                sched.graph_compute(&m.graph).unwrap();
                let (got, want) = (
                    m.y.to_f32_vec().unwrap(),
                    unsplit(dtype, k, rows, n, batch, &input),
                );
                // Every path computes each output element from its weight row and column
                // alone (GEMM panels, register tiles of 4 rows padded at a part's end), so
                // the parts give the unsplit product's bits.
                let differ = got
                    .iter()
                    .zip(&want)
                    .filter(|(g, w)| g.to_bits() != w.to_bits())
                    .count();
                assert_eq!(differ, 0, "{dtype:?} n={n} batch={batch} round {round}");
            }
            // What the scheduler did: the product on the split backend because of its
            // weight, the bias add on the CPU, and the weight never copied.
            let plan = sched.plan().unwrap();
            let mm = plan.nodes.iter().find(|e| e.op == "MUL_MAT").unwrap();
            assert_eq!(
                (mm.assignment.backend, mm.assignment.cause),
                (0, Cause::Weight)
            );
            assert_eq!(plan.backend_names[0], "CPU_Split");
            assert!(plan.splits.iter().any(|s| s.backend == 0), "{plan}");
            assert!(plan.copies.is_empty(), "host memory on both sides: {plan}");
            assert!(plan.to_string().contains("CPU_Split"), "{plan}");
            let _ = &m.b;
        }
    }
}

#[test]
fn split_weight_decides_even_without_the_weights_usage() {
    // A split buffer is marked as weights when allocated; a caller resetting the usage must
    // not make the scheduler copy the whole weight to the CPU instead.
    let split = three_cpus(&[2.0, 1.0, 1.0]);
    let (k, rows, n) = (32, 9, 33);
    let m = mlp(DType::F32, k, rows, n, 1, split.clone());
    m.w.buffer().unwrap().set_usage(BufferUsage::Any);
    let (_, mut sched) = split_sched(&split);
    let input = values(k * n, 20);
    sched.alloc_graph(&m.graph).unwrap();
    m.x.set_f32(&input).unwrap();
    sched.graph_compute(&m.graph).unwrap();
    assert_eq!(
        m.y.to_f32_vec().unwrap(),
        unsplit(DType::F32, k, rows, n, 1, &input)
    );
    let plan = sched.plan().unwrap();
    let mm = plan.nodes.iter().find(|e| e.op == "MUL_MAT").unwrap();
    assert_eq!(mm.assignment.backend, 0, "{plan}");
    assert!(plan.copies.is_empty(), "{plan}");
}

#[test]
fn split_weight_with_an_unsupported_op_is_a_clear_error() {
    let split = three_cpus(&[]);
    let wctx = Context::new(true);
    let w = wctx.new_tensor(DType::F32, &[8, 6]).unwrap();
    let _buffers = alloc_ctx_tensors_from_buft(&wctx, split.clone()).unwrap();
    w.set_f32(&values(48, 3)).unwrap();
    let ctx = Context::new(true);
    let x = ctx.new_tensor(DType::F32, &[8, 6]).unwrap();
    x.set_input();
    let y = ops::add(&ctx, &w, &x).unwrap();
    let graph = Graph::build(std::slice::from_ref(&y));
    let (split_backend, mut sched) = split_sched(&split);
    let err = sched.alloc_graph(&graph).unwrap_err();
    let text = err.to_string();
    assert_eq!(
        err.kind(),
        ferrograph::error::ErrorKind::UnsupportedOp,
        "{text}"
    );
    assert!(
        text.contains("ADD") && text.contains("split by rows"),
        "{text}"
    );

    // A MUL_MAT on a split weight with no split backend in the scheduler: an error naming
    // the split buffer, not a silent copy of the whole weight to the CPU.
    let y = ops::mul_mat(&ctx, &w, &x).unwrap();
    let graph = Graph::build(std::slice::from_ref(&y));
    let mut cpu_only = Scheduler::new(vec![cpu()], None, 16, false, false).unwrap();
    let text = cpu_only.alloc_graph(&graph).unwrap_err().to_string();
    assert!(text.contains("CPU_Split buffer"), "{text}");

    // The split backend itself refuses other ops in a graph handed to it directly.
    let z = ops::add(&ctx, &x, &x).unwrap();
    let text = split_backend
        .graph_compute(&Graph::build(std::slice::from_ref(&z)))
        .unwrap_err()
        .to_string();
    assert!(text.contains("only MUL_MAT"), "{text}");
}

#[test]
fn split_buffers_hold_matrices_only_and_bound_their_bytes() {
    let split = three_cpus(&[1.0, 1.0, 1.0]);
    assert!(split.is_split() && !split.is_host());
    assert_eq!(split.device().unwrap().name(), "CPU_Split");
    let ctx = Context::new(true);
    ctx.new_tensor(DType::F32, &[4, 3, 2]).unwrap();
    let err = alloc_ctx_tensors_from_buft(&ctx, split.clone()).unwrap_err();
    assert!(err.to_string().contains("2-D"), "{err}");
    let ctx = Context::new(true);
    let w = ctx.new_tensor(DType::Q8_0, &[64, 5]).unwrap();
    let buffers = alloc_ctx_tensors_from_buft(&ctx, split.clone()).unwrap();
    let data = values(64 * 5, 4);
    w.set_f32(&data).unwrap();
    let parts = split.tensor_parts(&w).unwrap();
    assert_eq!(parts.parts().len(), 3);
    // Quantized rows stay whole blocks: reading back through the parts gives what a host
    // q8_0 tensor holds.
    let host = Context::new(false)
        .new_tensor(DType::Q8_0, &[64, 5])
        .unwrap();
    host.set_f32(&data).unwrap();
    assert_eq!(w.to_f32_vec().unwrap(), host.to_f32_vec().unwrap());
    // Bytes between or after tensors belong to no part.
    let buffer = &buffers[0];
    assert!(buffer.write(w.nbytes(), &[0u8; 4]).is_err() || buffer.size() == w.nbytes());
    buffer.clear(0).unwrap();
    assert!(w.to_f32_vec().unwrap().iter().all(|&v| v == 0.0));
}
