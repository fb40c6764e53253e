//! Backends: streams of work on a device — tensor transfers, graph computation, plans — and
//! tensor copies between any two backends.

use std::any::Any;
use std::fmt;
use std::sync::Arc;

use crate::buffer::{Buffer, BufferType};
use crate::device::Device;
use crate::error::{Error, Result, Status};
use crate::graph::Graph;
use crate::tensor::Tensor;

/// A backend implementation's identity (ggml's GUID): 16 bytes that name the implementation,
/// not the instance.
pub type Guid = [u8; 16];

/// Whether two GUIDs are equal.
pub fn guid_matches(a: &Guid, b: &Guid) -> bool {
    a == b
}

/// A prepared computation of one graph on one backend.
pub trait GraphPlan: Send + Sync {
    /// The graph the plan computes.
    fn graph(&self) -> &Graph;
    /// Scratch bytes the plan reserves.
    fn work_size(&self) -> usize;
    /// Backend-specific access.
    fn as_any(&self) -> &dyn Any;
}

/// A stream of work on a device.
///
/// Transfers take borrowed slices, so an implementation that queues work must copy the data
/// before returning; the host-side contract is otherwise ggml's: `*_async` calls may complete
/// later, and [`Backend::synchronize`] waits for everything queued.
pub trait Backend: Send + Sync {
    /// The implementation's GUID.
    fn guid(&self) -> Guid;
    /// A short name (`"CPU"`).
    fn name(&self) -> &str;
    /// The device the backend runs on.
    fn device(&self) -> Arc<dyn Device>;
    /// Backend-specific access (e.g. the CPU backend's thread settings).
    fn as_any(&self) -> &dyn Any;

    /// The buffer type this backend computes on by default.
    fn default_buffer_type(&self) -> Arc<dyn BufferType> {
        self.device().buffer_type()
    }
    /// Allocates a buffer of the default type.
    fn alloc_buffer(&self, size: usize) -> Result<Buffer> {
        self.default_buffer_type().alloc_buffer(size)
    }
    /// Alignment of the default buffer type.
    fn alignment(&self) -> usize {
        self.default_buffer_type().alignment()
    }
    /// Largest buffer of the default type.
    fn max_size(&self) -> usize {
        self.default_buffer_type().max_size()
    }

    /// Writes `data` into `tensor` at byte `offset`, possibly queued.
    fn set_tensor_async(&self, tensor: &Tensor, offset: usize, data: &[u8]) -> Result<()> {
        tensor.write_bytes(offset, data)
    }
    /// Reads `out.len()` bytes of `tensor` at `offset`, possibly queued.
    fn get_tensor_async(&self, tensor: &Tensor, offset: usize, out: &mut [u8]) -> Result<()> {
        tensor.read_bytes(offset, out)
    }
    /// Queues a copy from `src` (owned by `src_backend`) into `dst` (ours); `Ok(false)` when
    /// this backend cannot do it asynchronously.
    fn cpy_tensor_async(
        &self,
        src_backend: &dyn Backend,
        src: &Tensor,
        dst: &Tensor,
    ) -> Result<bool> {
        let _ = (src_backend, src, dst);
        Ok(false)
    }
    /// Waits for all queued work.
    fn synchronize(&self) -> Result<()> {
        Ok(())
    }

    /// Prepares `graph` for repeated computation.
    fn graph_plan_create(&self, graph: &Graph) -> Result<Box<dyn GraphPlan>> {
        let _ = graph;
        Err(Error::unsupported(format!(
            "backend {} has no graph plans",
            self.name()
        )))
    }
    /// Points an existing plan at a graph of the same structure.
    fn graph_plan_update(&self, plan: &mut Box<dyn GraphPlan>, graph: &Graph) -> Result<()> {
        *plan = self.graph_plan_create(graph)?;
        Ok(())
    }
    /// Computes a prepared plan.
    fn graph_plan_compute(&self, plan: &dyn GraphPlan) -> Result<Status> {
        self.graph_compute(plan.graph())
    }
    /// Computes every node of `graph` and waits for the result.
    fn graph_compute(&self, graph: &Graph) -> Result<Status> {
        let status = self.graph_compute_async(graph)?;
        self.synchronize()?;
        Ok(status)
    }
    /// Queues the computation of `graph`.
    fn graph_compute_async(&self, graph: &Graph) -> Result<Status>;
    /// Computes `graph` as a normal run does and waits, timing each node inside that run:
    /// the status and one wall time in seconds per node of `graph` (0 for nodes with nothing
    /// to compute). `None` (the default, nothing computed) when the backend cannot time nodes
    /// inside a run; a profile then computes node by node.
    fn graph_compute_timed(&self, graph: &Graph) -> Result<Option<(Status, Vec<f64>)>> {
        let _ = graph;
        Ok(None)
    }

    /// Whether this backend computes the op.
    fn supports_op(&self, op: &Tensor) -> bool {
        self.device().supports_op(op)
    }
    /// Whether this backend can use memory of the buffer type.
    fn supports_buft(&self, buffer_type: &dyn BufferType) -> bool {
        self.device().supports_buft(buffer_type)
    }
    /// Whether to move the op here although its weights live in host memory.
    fn offload_op(&self, op: &Tensor) -> bool {
        self.device().offload_op(op)
    }
}

impl fmt::Debug for dyn Backend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Backend({})", self.name())
    }
}

/// Copies `src` into `dst` (same dtype, shape and strides) across any two buffers: directly
/// from or into host memory where one side is host, else through a host bounce buffer.
pub fn tensor_copy(src: &Tensor, dst: &Tensor) -> Result<()> {
    if !src.same_layout(dst) {
        return Err(Error::shape(format!(
            "cannot copy {src:?} into {dst:?}: dtype, shape and strides must match"
        )));
    }
    if src.same(dst) || src.nbytes() == 0 {
        return Ok(());
    }
    let src_storage = src.storage()?;
    let dst_storage = dst.storage()?;
    let nbytes = src.nbytes();
    let same_buffer = src_storage.buffer.same(&dst_storage.buffer);
    if !same_buffer {
        if let Some(base) = src_storage.buffer.host_ptr() {
            // SAFETY: `src.storage()` succeeded, so the tensor's `nbytes` lie inside its live
            // buffer (checked at bind / view creation) and the buffer differs from the
            // destination's, so the destination write cannot overlap this slice.
            let data = unsafe {
                std::slice::from_raw_parts(base.as_ptr().add(src_storage.offset), nbytes)
            };
            return dst.write_bytes(0, data);
        }
        if let Some(base) = dst_storage.buffer.host_ptr() {
            // SAFETY: as above for the destination; `&mut` is exclusive because the source is
            // in another buffer and no other reference to this range is created here.
            let out = unsafe {
                std::slice::from_raw_parts_mut(base.as_ptr().add(dst_storage.offset), nbytes)
            };
            src.read_bytes(0, out)?;
            // Written around `write_bytes`: record it (see `Tensor::check_current`).
            dst.note_written();
            return Ok(());
        }
    }
    let mut bounce = vec![0u8; nbytes];
    src.read_bytes(0, &mut bounce)?;
    dst.write_bytes(0, &bounce)
}

/// Copies `src` (on `src_backend`) into `dst` (on `dst_backend`) asynchronously where the
/// destination backend can, else synchronises both and copies.
pub fn tensor_copy_async(
    src_backend: &dyn Backend,
    dst_backend: &dyn Backend,
    src: &Tensor,
    dst: &Tensor,
) -> Result<()> {
    if !src.same_layout(dst) {
        return Err(Error::shape(format!(
            "cannot copy {src:?} into {dst:?}: dtype, shape and strides must match"
        )));
    }
    if dst_backend.cpy_tensor_async(src_backend, src, dst)? {
        dst.note_written();
        return Ok(());
    }
    src_backend.synchronize()?;
    dst_backend.synchronize()?;
    tensor_copy(src, dst)
}
