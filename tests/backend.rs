//! The device / backend / registry layer on the CPU backend.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use ferrograph::backend::{tensor_copy, tensor_copy_async, Backend};
use ferrograph::buffer::{alloc_cpu_buffer, BufferUsage};
use ferrograph::context::Context;
use ferrograph::cpu::backend::{as_cpu, CpuBackend};
use ferrograph::device::DeviceType;
use ferrograph::dtype::DType;
use ferrograph::error::{Error, Status};
use ferrograph::event::{record_or_sync, wait_or_sync};
use ferrograph::graph::Graph;
use ferrograph::ops;
use ferrograph::registry::{self, Extension};

#[test]
fn registry_always_has_the_cpu() {
    assert!(registry::reg_count() >= 1);
    assert!(
        registry::reg_by_name("cpu").is_some(),
        "lookup is case-insensitive"
    );
    let cpu = registry::dev_by_name("Cpu").expect("CPU device");
    assert_eq!(cpu.device_type(), DeviceType::Cpu);
    let (free, total) = cpu.memory();
    assert!(total > 0 && free <= total);
    assert!(cpu.caps().buffer_from_host_ptr);
    assert!(registry::dev_by_type(DeviceType::Cpu).is_some());
    assert!(registry::dev_get(registry::dev_count()).is_err());
    let err = registry::init_by_name("no-such-backend", "").expect_err("unknown names fail");
    assert!(matches!(err, Error::Backend(_)), "{err}");
    assert!(registry::init_by_name("CPU", "n_threads=zero").is_err());
    let best = registry::init_best().unwrap();
    assert_eq!(best.name(), "CPU");
    assert!(registry::unregister("CPU").is_err());
}

#[test]
fn cpu_extensions_are_typed() {
    let reg = registry::reg_by_name("CPU").unwrap();
    let backend = registry::init_by_name("CPU", "n_threads=1").unwrap();
    match reg.proc_address("set_n_threads") {
        Some(Extension::SetThreadCount(set)) => set(backend.as_ref(), 2).unwrap(),
        other => panic!("unexpected {other:?}"),
    }
    assert_eq!(as_cpu(backend.as_ref()).unwrap().n_threads(), 2);
    match reg.proc_address("get_features") {
        Some(Extension::Features(features)) => assert!(!features().is_empty()),
        other => panic!("unexpected {other:?}"),
    }
    assert!(reg.proc_address("nonexistent").is_none());
}

fn small_graph() -> (
    Context,
    ferrograph::tensor::Tensor,
    ferrograph::tensor::Tensor,
    Graph,
) {
    let ctx = Context::new(false);
    let a = ctx.new_tensor(DType::F32, &[5, 3]).unwrap();
    let b = ctx.new_tensor(DType::F32, &[5, 1]).unwrap();
    a.set_f32(&(0..15).map(|i| i as f32).collect::<Vec<_>>())
        .unwrap();
    b.set_f32(&[1.0, 2.0, 3.0, 4.0, 5.0]).unwrap();
    let sum = ops::add(&ctx, &a, &b).unwrap();
    let out = ops::scale(&ctx, &sum, 2.0, 0.5).unwrap();
    let graph = Graph::build(std::slice::from_ref(&out));
    (ctx, a, out, graph)
}

#[test]
fn compute_plan_and_abort() {
    let backend = CpuBackend::new(2).unwrap();
    let (_ctx, _a, out, graph) = small_graph();
    assert_eq!(backend.graph_compute(&graph).unwrap(), Status::Success);
    let values = out.to_f32_vec().unwrap();
    for (i, v) in values.iter().enumerate() {
        let expected = ((i as f32) + (i % 5 + 1) as f32) * 2.0 + 0.5;
        assert_eq!(*v, expected);
    }
    let plan = backend.graph_plan_create(&graph).unwrap();
    assert_eq!(
        backend.graph_plan_compute(plan.as_ref()).unwrap(),
        Status::Success
    );

    let calls = Arc::new(AtomicUsize::new(0));
    let seen = calls.clone();
    backend.set_abort_callback(Some(Arc::new(move || {
        seen.fetch_add(1, Ordering::SeqCst);
        true
    })));
    assert_eq!(backend.graph_compute(&graph).unwrap(), Status::Aborted);
    assert!(calls.load(Ordering::SeqCst) >= 1);
    backend.set_abort_callback(None);
    assert_eq!(
        backend.graph_compute(&graph).unwrap(),
        Status::Success,
        "usable after abort"
    );
}

#[test]
fn a_failing_graph_fails_every_compute_and_a_replayed_graph_keeps_its_results() {
    // The backend keeps its scratch between computes and skips the per-node kernel check for
    // a graph epoch it computed successfully. Covered here: a failing graph fails the same way
    // every time, and a replayed graph (check skipped, scratch reused) computes fresh inputs
    // right. The skipped check itself cannot be provoked from outside: the op builders refuse
    // every operand combination the CPU has no kernel for.
    let backend = CpuBackend::new(2).unwrap();
    let ctx = Context::new(true);
    let a = ctx.new_tensor(DType::F32, &[4]).unwrap();
    let bad = Graph::build(&[ops::scale(&ctx, &a, 2.0, 0.0).unwrap()]);
    for _ in 0..3 {
        let err = backend.graph_compute(&bad).unwrap_err();
        assert!(err.to_string().contains("no memory"), "{err}");
    }
    let (_ctx, x, out, graph) = small_graph();
    for round in 0..3 {
        x.set_f32(&(0..15).map(|i| (i + round) as f32).collect::<Vec<_>>())
            .unwrap();
        assert_eq!(backend.graph_compute(&graph).unwrap(), Status::Success);
        let values = out.to_f32_vec().unwrap();
        for (i, v) in values.iter().enumerate() {
            let expected = ((i + round) as f32 + (i % 5 + 1) as f32) * 2.0 + 0.5;
            assert_eq!(*v, expected, "round {round}");
        }
        // The failing graph still fails between replays.
        assert!(backend.graph_compute(&bad).is_err());
    }
}

/// The backend keeps the operands it resolved for a graph and computes the same graph again
/// with them; a graph whose tensors were moved to other memory, or whose buffer was reset,
/// must be resolved afresh (the new memory read, the stale one refused), never read through
/// the old addresses.
#[test]
fn a_replayed_graph_follows_its_tensors_to_new_memory() {
    use ferrograph::alloc::GraphAllocator;
    use ferrograph::buffer::CpuBufferType;

    let backend = CpuBackend::new(2).unwrap();
    let ctx = Context::new(true);
    let x = ctx.new_tensor(DType::F32, &[64]).unwrap();
    x.set_input();
    let doubled = ops::scale(&ctx, &x, 2.0, 0.0).unwrap();
    let out = ops::add(&ctx, &doubled, &x).unwrap();
    out.set_output();
    let graph = Graph::build(std::slice::from_ref(&out));
    let input = |k: f32| (0..64).map(|i| i as f32 + k).collect::<Vec<_>>();
    let expect = |k: f32| (0..64).map(|i| 3.0 * (i as f32 + k)).collect::<Vec<_>>();

    let mut first = GraphAllocator::new(CpuBufferType::shared());
    first.alloc_graph(&graph).unwrap();
    for k in [0.0, 1.0] {
        x.set_f32(&input(k)).unwrap();
        assert_eq!(backend.graph_compute(&graph).unwrap(), Status::Success);
        assert_eq!(out.to_f32_vec().unwrap(), expect(k));
    }
    let old = out.host_ptr().unwrap();
    // The same tensors in another allocator's memory; the first one's memory is released.
    let mut second = GraphAllocator::new(CpuBufferType::shared());
    let mut filler = Vec::new();
    for _ in 0..4 {
        // other allocations, so the new buffer does not land where the old one was
        filler.push(alloc_cpu_buffer(1 << 16).unwrap());
    }
    for node in graph.nodes().iter().chain(graph.leafs()) {
        node.unbind();
    }
    second.alloc_graph(&graph).unwrap();
    drop(first);
    assert_ne!(out.host_ptr().unwrap(), old, "the tensors moved");
    for k in [5.0, 9.0] {
        x.set_f32(&input(k)).unwrap();
        assert_eq!(backend.graph_compute(&graph).unwrap(), Status::Success);
        assert_eq!(out.to_f32_vec().unwrap(), expect(k));
    }
    // A reset buffer: its tensors are stale, and computing the graph says so.
    for buffer in second.buffers(0) {
        buffer.reset();
    }
    let err = backend.graph_compute(&graph).unwrap_err();
    assert!(matches!(err, Error::Stale(_)), "{err}");
}

/// A node of the computation itself (a custom op) that resets the memory of the nodes after
/// it: on a replay, with the operands of those nodes already resolved and kept, the next node
/// still sees the reset (the check runs before every node) and the compute fails as stale.
#[test]
fn a_reset_inside_a_replayed_computation_is_seen_by_the_next_node() {
    use ferrograph::alloc::GraphAllocator;
    use ferrograph::buffer::{Buffer, CpuBufferType};
    use ferrograph::op::CustomOp;
    use std::sync::Mutex;

    /// Copies its source; on its `arm`-th call and later, then resets `target`.
    struct ResetAfter {
        calls: AtomicUsize,
        arm: usize,
        target: Mutex<Option<Buffer>>,
    }
    impl CustomOp for ResetAfter {
        fn name(&self) -> &str {
            "reset_after"
        }
        fn compute(
            &self,
            dst: &ferrograph::tensor::Tensor,
            srcs: &[ferrograph::tensor::Tensor],
        ) -> ferrograph::Result<()> {
            dst.set_f32(&srcs[0].to_f32_vec()?)?;
            if self.calls.fetch_add(1, Ordering::SeqCst) + 1 >= self.arm {
                if let Some(b) = self.target.lock().unwrap().as_ref() {
                    b.reset();
                }
            }
            Ok(())
        }
    }

    let backend = CpuBackend::new(2).unwrap();
    let ctx = Context::new(true);
    let x = ctx.new_tensor(DType::F32, &[32]).unwrap();
    x.set_input();
    let op = Arc::new(ResetAfter {
        calls: AtomicUsize::new(0),
        arm: 2,
        target: Mutex::new(None),
    });
    let a = ops::scale(&ctx, &x, 2.0, 0.0).unwrap();
    let b = ops::custom(
        &ctx,
        op.clone(),
        std::slice::from_ref(&a),
        DType::F32,
        &[32],
    )
    .unwrap();
    let c = ops::scale(&ctx, &b, 3.0, 0.0).unwrap();
    let out = ops::add(&ctx, &c, &a).unwrap();
    out.set_output();
    let graph = Graph::build(std::slice::from_ref(&out));
    let mut galloc = GraphAllocator::new(CpuBufferType::shared());
    galloc.alloc_graph(&graph).unwrap();
    *op.target.lock().unwrap() = Some(galloc.buffers(0)[0].clone());
    x.set_f32(&[1.0; 32]).unwrap();
    // First compute: every node resolved and kept; the op does not reset yet.
    assert_eq!(backend.graph_compute(&graph).unwrap(), Status::Success);
    assert_eq!(out.to_f32_vec().unwrap(), vec![8.0; 32]);
    // Replay: the op resets the buffer; the next node must not read it through kept views.
    x.set_f32(&[1.0; 32]).unwrap();
    let err = backend.graph_compute(&graph).unwrap_err();
    assert!(matches!(err, Error::Stale(_)), "{err}");
}

#[test]
fn tensor_transfers_and_copies() {
    let backend = registry::init_by_name("CPU", "").unwrap();
    let ctx = Context::new(true);
    let src = ctx.new_tensor(DType::F32, &[4]).unwrap();
    let dst = ctx.new_tensor(DType::F32, &[4]).unwrap();
    let other = ctx.new_tensor(DType::F16, &[4]).unwrap();
    let buffer = backend.alloc_buffer(256).unwrap();
    buffer.set_usage(BufferUsage::Weights);
    assert_eq!(buffer.usage(), BufferUsage::Weights);
    src.bind(&buffer, 0).unwrap();
    let second = alloc_cpu_buffer(64).unwrap();
    dst.bind(&second, 0).unwrap();
    let bytes: Vec<u8> = [1.0f32, 2.0, 3.0, 4.0]
        .iter()
        .flat_map(|v| v.to_ne_bytes())
        .collect();
    backend.set_tensor_async(&src, 0, &bytes).unwrap();
    backend.synchronize().unwrap();
    tensor_copy(&src, &dst).unwrap();
    assert_eq!(dst.to_f32_vec().unwrap(), vec![1.0, 2.0, 3.0, 4.0]);
    tensor_copy_async(backend.as_ref(), backend.as_ref(), &dst, &src).unwrap();
    let mut out = vec![0u8; 16];
    backend.get_tensor_async(&src, 0, &mut out).unwrap();
    assert_eq!(out, bytes);
    assert!(matches!(
        tensor_copy(&src, &other),
        Err(Error::ShapeMismatch { .. })
    ));
    assert!(matches!(
        src.write_bytes(12, &[0u8; 8]),
        Err(e) if e.kind() == ferrograph::error::ErrorKind::OutOfBounds
    ));
    buffer.reset();
    assert!(matches!(src.to_f32_vec(), Err(Error::Stale(_))));
}

#[test]
fn host_pointer_buffers_and_events() {
    let cpu = registry::dev_by_name("CPU").unwrap();
    let mut storage = vec![0u64; 8];
    // SAFETY: `storage` outlives the buffer, which is dropped at the end of this test.
    let buffer = unsafe { cpu.buffer_from_host_ptr(storage.as_mut_ptr().cast(), 64, 64) }.unwrap();
    buffer.write(0, &[7u8; 8]).unwrap();
    drop(buffer);
    assert_eq!(storage[0], u64::from_ne_bytes([7; 8]));

    let backend = cpu.init_backend(&Default::default()).unwrap();
    let event = cpu.event_new().unwrap();
    record_or_sync(Some(&event), backend.as_ref()).unwrap();
    event.synchronize().unwrap();
    wait_or_sync(Some(&event), backend.as_ref(), backend.as_ref()).unwrap();
    record_or_sync(None, backend.as_ref()).unwrap();
}

#[test]
fn shared_threadpools_and_direct_compute() {
    use ferrograph::cpu::backend::graph_compute_with_ctx;
    use ferrograph::pool::{Threadpool, ThreadpoolParams};
    let pool = Threadpool::new(&ThreadpoolParams::new(2)).unwrap();
    let first = CpuBackend::new(1).unwrap();
    let second = CpuBackend::new(1).unwrap();
    first.set_threadpool(pool.clone());
    second.set_threadpool(pool.clone());
    assert_eq!(first.n_threads(), 2);
    let (_ctx, _a, out, graph) = small_graph();
    pool.pause();
    assert_eq!(second.graph_compute(&graph).unwrap(), Status::Success);
    assert!(!pool.is_paused());
    let expected = out.to_f32_vec().unwrap();
    out.fill_bytes(0, out.nbytes(), 0).unwrap();
    assert_eq!(graph_compute_with_ctx(&graph, 2).unwrap(), Status::Success);
    assert_eq!(out.to_f32_vec().unwrap(), expected);
    assert!(graph_compute_with_ctx(&graph, 0).is_err());
}
