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
    // Host memory is described below the devices; the CPU device announces itself as its
    // owner when it is created (here, by the registry).
    let cpu = registry::dev_by_name("CPU").unwrap();
    let device = CpuBufferType::shared().device().expect("a device");
    assert_eq!(device.name(), "CPU");
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

/// A CPU device under another name, so one registration can offer several CPU devices.
#[derive(Debug)]
struct NamedCpu(String);

impl ferrograph::Device for NamedCpu {
    fn name(&self) -> &str {
        &self.0
    }
    fn description(&self) -> String {
        format!("{} (a CPU device for split tests)", self.0)
    }
    fn memory(&self) -> (usize, usize) {
        ferrograph::CpuDevice::shared().memory()
    }
    fn device_type(&self) -> ferrograph::DeviceType {
        ferrograph::DeviceType::Cpu
    }
    fn caps(&self) -> ferrograph::device::DeviceCaps {
        ferrograph::CpuDevice::shared().caps()
    }
    fn registration_name(&self) -> &str {
        "SPLITCPU"
    }
    fn init_backend(
        &self,
        _params: &ferrograph::BackendParams,
    ) -> ferrograph::Result<Arc<dyn Backend>> {
        Ok(Arc::new(CpuBackend::new(1)?))
    }
    fn buffer_type(&self) -> Arc<dyn BufferType> {
        CpuBufferType::shared()
    }
    fn supports_op(&self, op: &Tensor) -> bool {
        ferrograph::CpuDevice::shared().supports_op(op)
    }
    fn supports_buft(&self, buffer_type: &dyn BufferType) -> bool {
        buffer_type.is_host()
    }
}

struct SplitCpus(usize);

impl ferrograph::Registration for SplitCpus {
    fn name(&self) -> &str {
        "SPLITCPU"
    }
    fn devices(&self) -> Vec<Arc<dyn ferrograph::Device>> {
        (0..self.0)
            .map(|i| Arc::new(NamedCpu(format!("SPLITCPU{i}"))) as Arc<dyn ferrograph::Device>)
            .collect()
    }
}

#[test]
fn split_rows_cover_the_matrix_in_proportion() {
    let split =
        ferrograph::row_split::SplitBufferType::new(&SplitCpus(3), &[1.0, 2.0, 1.0]).unwrap();
    assert_eq!(split.row_ranges(8), vec![0..2, 2..6, 6..8]);
    assert_eq!(split.row_ranges(1), vec![0..0, 0..1, 1..1]);
    let equal = ferrograph::row_split::SplitBufferType::new(&SplitCpus(3), &[]).unwrap();
    assert_eq!(equal.row_ranges(9), vec![0..3, 3..6, 6..9]);
    for bad in [&[1.0, 1.0][..], &[1.0, -1.0, 1.0], &[f32::NAN, 1.0, 1.0]] {
        assert!(ferrograph::row_split::SplitBufferType::new(&SplitCpus(3), bad).is_err());
    }
}

#[test]
fn row_split_mul_mat_equals_the_unsplit_one() {
    let (k, rows, n) = (32, 13, 3);
    let w: Vec<f32> = (0..k * rows)
        .map(|i| ((i * 7) % 19) as f32 * 0.25 - 2.0)
        .collect();
    let x: Vec<f32> = (0..k * n)
        .map(|i| ((i * 5) % 11) as f32 * 0.5 - 2.5)
        .collect();

    // Unsplit, on the CPU.
    let ctx = Context::new(true);
    let wt = ctx.new_tensor(DType::F32, &[k, rows]).unwrap();
    let xt = ctx.new_tensor(DType::F32, &[k, n]).unwrap();
    let y = ops::mul_mat(&ctx, &wt, &xt).unwrap();
    let graph = Graph::build(std::slice::from_ref(&y));
    ferrograph::GraphAllocator::new(CpuBufferType::shared())
        .alloc_graph(&graph)
        .unwrap();
    wt.set_f32(&w).unwrap();
    xt.set_f32(&x).unwrap();
    let cpu: Arc<dyn Backend> = Arc::new(CpuBackend::new(1).unwrap());
    cpu.graph_compute(&graph).unwrap();
    let expected = y.to_f32_vec().unwrap();

    for shares in [&[1.0f32, 1.0, 1.0][..], &[3.0, 0.0, 1.0], &[0.0, 0.0, 0.0]] {
        let split = ferrograph::row_split::SplitBufferType::new(&SplitCpus(3), shares).unwrap();
        let weight = split.alloc_weight(DType::F32, k, rows).unwrap();
        let bytes: Vec<u8> = w.iter().flat_map(|v| v.to_le_bytes()).collect();
        weight.set_bytes(&bytes).unwrap();
        assert!(weight.parts().len() >= 2, "{shares:?}");
        assert_eq!(
            weight.parts().iter().map(|p| p.rows.len()).sum::<usize>(),
            rows
        );
        let got = weight.mul_mat(&x, n).unwrap();
        // Each part computes whole dot products exactly as the unsplit kernel does.
        assert_eq!(got, expected, "{shares:?}");
    }
    let split = ferrograph::row_split::SplitBufferType::new(&SplitCpus(2), &[]).unwrap();
    let weight = split.alloc_weight(DType::F32, k, rows).unwrap();
    assert!(weight.set_bytes(&[0u8; 3]).is_err());
    assert!(weight.mul_mat(&x[..5], n).is_err());
}

#[test]
fn split_over_a_list_of_devices() {
    // Devices need not share a registration (remote servers are one registration each).
    let cpu: Arc<dyn ferrograph::Device> = ferrograph::CpuDevice::shared();
    let devices = vec![cpu.clone(), Arc::new(NamedCpu("SPLITCPU9".into())) as _];
    let split = ferrograph::row_split::SplitBufferType::from_devices("mixed", devices, &[1.0, 1.0])
        .unwrap();
    assert_eq!(split.registration(), "mixed");
    assert_eq!(split.row_ranges(4), vec![0..2, 2..4]);
    let err = ferrograph::row_split::SplitBufferType::from_devices("none", Vec::new(), &[]);
    assert!(err.unwrap_err().to_string().contains("no devices"));
    let (k, rows) = (8, 5);
    let w: Vec<f32> = (0..k * rows).map(|i| i as f32 * 0.25 - 3.0).collect();
    let weight = split.alloc_weight(DType::F32, k, rows).unwrap();
    let bytes: Vec<u8> = w.iter().flat_map(|v| v.to_ne_bytes()).collect();
    weight.set_bytes(&bytes).unwrap();
    let x: Vec<f32> = (0..k).map(|i| i as f32 * 0.5).collect();
    let got = weight.mul_mat(&x, 1).unwrap();
    for (r, g) in got.iter().enumerate() {
        // Small integers and quarters: every product and sum is exact in f32.
        let expected: f32 = (0..k).map(|i| w[r * k + i] * x[i]).sum();
        assert_eq!(*g, expected, "row {r}");
    }
}
