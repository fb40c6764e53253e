//! The public API of the crate (issue 14): buffer types that know their device and size
//! tensors, extension names, statuses, the scheduler after a reset, empty buffers, events.

use std::sync::Arc;

use ferrograph::alloc::ctx_tensors_size;
use ferrograph::backend::Backend;
use ferrograph::buffer::{alloc_cpu_buffer, Buffer, BufferType, CpuBufferType};
use ferrograph::context::Context;
use ferrograph::cpu::backend::CpuBackend;
use ferrograph::dtype::DType;
use ferrograph::error::{status_to_string, Status};
use ferrograph::graph::Graph;
use ferrograph::ops;
use ferrograph::registry::{self, Extension};
use ferrograph::sched::Scheduler;
use ferrograph::tensor::Tensor;

/// CPU memory whose tensors take whole 256-byte blocks plus a 64-byte header per dimension in
/// use: a padding that depends on the tensor's shape, not only on its byte count.
#[derive(Debug)]
struct ShapePadded;

impl BufferType for ShapePadded {
    fn name(&self) -> &str {
        "SHAPE_PADDED"
    }

    fn alloc_buffer(self: Arc<Self>, size: usize) -> ferrograph::Result<Buffer> {
        CpuBufferType::shared().alloc_buffer(size)
    }

    fn alignment(&self) -> usize {
        64
    }

    fn alloc_size(&self, tensor: &Tensor) -> usize {
        let dims = tensor.ne().iter().filter(|&&n| n > 1).count();
        tensor.nbytes().div_ceil(256) * 256 + 64 * dims
    }

    fn is_host(&self) -> bool {
        true
    }
}

#[test]
fn cpu_buffer_type_belongs_to_the_cpu_device() {
    let device = CpuBufferType::shared().device().expect("a device");
    assert_eq!(device.name(), "CPU");
    let cpu = registry::dev_by_name("CPU").unwrap();
    assert!(Arc::ptr_eq(&cpu.buffer_type(), &CpuBufferType::shared()));
    assert!(
        ShapePadded.device().is_none(),
        "free-standing types have none"
    );
}

#[test]
fn alloc_size_sees_the_tensor() {
    let ctx = Context::new(true);
    let a = ctx.new_tensor(DType::F32, &[4]).unwrap(); // 16 bytes, 1 dim > 1
    let b = ctx.new_tensor(DType::F32, &[100, 3]).unwrap(); // 1200 bytes, 2 dims > 1
    assert_eq!(ShapePadded.alloc_size(&a), 256 + 64);
    assert_eq!(ShapePadded.alloc_size(&b), 1280 + 128);
    assert_eq!(ctx_tensors_size(&ctx, &ShapePadded), 320 + 1408);
    assert_eq!(CpuBufferType::shared().alloc_size(&b), 1200);
}

#[test]
fn extensions_answer_to_ggml_names() {
    let cpu = registry::reg_by_name("CPU").unwrap();
    for (short, ggml) in registry::PROC_NAMES {
        let a = registry::proc_address(cpu.as_ref(), short);
        let b = registry::proc_address(cpu.as_ref(), ggml);
        assert!(a.is_some() && b.is_some(), "{short} / {ggml}");
        assert_eq!(format!("{a:?}"), format!("{b:?}"));
    }
    assert!(registry::proc_address(cpu.as_ref(), "ggml_backend_nothing").is_none());
    // The abort-callback extension found by ggml's name works.
    let Some(Extension::SetAbortCallback(set)) =
        registry::proc_address(cpu.as_ref(), "ggml_backend_set_abort_callback")
    else {
        panic!("no abort extension");
    };
    let backend: Arc<dyn Backend> = Arc::new(CpuBackend::new(1).unwrap());
    let ctx = Context::new(false);
    let x = ctx.new_tensor(DType::F32, &[8]).unwrap();
    let y = ops::add(&ctx, &x, &x).unwrap();
    let graph = Graph::build(&[y]);
    set(backend.as_ref(), Some(Arc::new(|| true))).unwrap();
    assert_eq!(backend.graph_compute(&graph).unwrap(), Status::Aborted);
    set(backend.as_ref(), None).unwrap();
    assert_eq!(backend.graph_compute(&graph).unwrap(), Status::Success);
}

#[test]
fn status_text_of_every_code() {
    for status in [
        Status::Success,
        Status::Aborted,
        Status::Failed,
        Status::AllocFailed,
    ] {
        assert_eq!(Status::from_code(status.code()), Some(status));
        assert_eq!(status_to_string(status.code()), status.as_str());
    }
    for code in [2, -3, 100, i32::MAX, i32::MIN] {
        assert_eq!(Status::from_code(code), None);
        assert_eq!(status_to_string(code), "unknown status");
    }
}

#[test]
fn empty_buffer_has_no_base() {
    let empty = alloc_cpu_buffer(0).unwrap();
    assert!(empty.base().is_none());
    let one = alloc_cpu_buffer(1).unwrap();
    assert!(one.base().is_some());
    one.free();
    assert!(one.base().is_none());
}

#[test]
fn device_event_caps_agree_with_event_new() {
    for device in registry::devices() {
        assert_eq!(
            device.caps().events,
            device.event_new().is_ok(),
            "{}",
            device.name()
        );
    }
}

#[test]
fn scheduler_forgets_assignments_at_reset() {
    let backend: Arc<dyn Backend> = Arc::new(CpuBackend::new(1).unwrap());
    let ctx = Context::new(true);
    let x = ctx.new_tensor(DType::F32, &[8]).unwrap();
    let y = ops::add(&ctx, &x, &x).unwrap();
    let graph = Graph::build(std::slice::from_ref(&y));
    let mut sched = Scheduler::new(vec![backend.clone()], None, 0, false, false).unwrap();
    sched.alloc_graph(&graph).unwrap();
    assert!(Arc::ptr_eq(
        &sched.get_tensor_backend(&y).unwrap(),
        &backend
    ));
    sched.reset();
    assert!(sched.get_tensor_backend(&y).is_none());
    // A pin made after the reset is still reported.
    sched.set_tensor_backend(&y, &backend).unwrap();
    assert!(sched.get_tensor_backend(&y).is_some());
    sched.alloc_graph(&graph).unwrap();
    assert!(Arc::ptr_eq(
        &sched.get_tensor_backend(&y).unwrap(),
        &backend
    ));
}
