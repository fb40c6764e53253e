//! Allocating every tensor of a context at once (ggml's `alloc_ctx_tensors_from_buft`).

use std::sync::Arc;

use crate::alloc::dyn_alloc::align_up;
use crate::alloc::tensor_alloc::{view_init, TensorAllocator};
use crate::buffer::{Buffer, BufferType};
use crate::context::Context;
use crate::error::{Error, Result};
use crate::tensor::Tensor;

/// Non-view, unallocated tensors of `ctx` grouped into ranges that each fit one buffer of
/// `buft`: `(tensors, bytes)` per range.
fn ranges(ctx: &Context, buft: &dyn BufferType) -> Result<Vec<(Vec<Tensor>, usize)>> {
    let alignment = buft.alignment().max(1);
    let max_size = buft.max_size();
    let mut ranges: Vec<(Vec<Tensor>, usize)> = Vec::new();
    let mut current: Vec<Tensor> = Vec::new();
    let mut current_size = 0usize;
    for tensor in ctx.tensors() {
        if tensor.is_view() || tensor.is_allocated() {
            continue;
        }
        let size = align_up(buft.alloc_size(&tensor), alignment)
            .filter(|&s| s <= max_size)
            .ok_or_else(|| {
                let requested = buft.alloc_size(&tensor);
                Error::alloc_failed(
                    format!(
                        "{} needs {requested} bytes, more than the maximum buffer size \
                         {max_size} of {}",
                        tensor.label(),
                        buft.name()
                    ),
                    requested,
                    Some(max_size),
                    buft.name(),
                )
            })?;
        let fits = current_size
            .checked_add(size)
            .is_some_and(|s| s <= max_size);
        if !current.is_empty() && !fits {
            ranges.push((std::mem::take(&mut current), current_size));
            current_size = 0;
        }
        current.push(tensor);
        current_size += size;
    }
    if !current.is_empty() {
        ranges.push((current, current_size));
    }
    Ok(ranges)
}

/// Bytes [`alloc_ctx_tensors_from_buft`] would allocate for `ctx` (the sum over all buffers).
/// Tensors larger than the buffer type's maximum size are counted as they are.
pub fn ctx_tensors_size(ctx: &Context, buft: &dyn BufferType) -> usize {
    let alignment = buft.alignment().max(1);
    let max_size = buft.max_size();
    let mut total = 0usize;
    let mut current = 0usize;
    for tensor in ctx.tensors() {
        if tensor.is_view() || tensor.is_allocated() {
            continue;
        }
        let size = align_up(buft.alloc_size(&tensor), alignment).unwrap_or(usize::MAX);
        if current > 0 && current.saturating_add(size) > max_size {
            total = total.saturating_add(current);
            current = 0;
        }
        current = current.saturating_add(size);
    }
    total.saturating_add(current)
}

/// Allocates every non-view tensor of `ctx` that has no memory yet, in creation order at
/// aligned offsets, in buffers of `buft`; then checks every view of the context.
///
/// When the tensors do not fit in one buffer of the type's maximum size they are split over
/// several buffers, all returned (in order). An empty vector means there was nothing to
/// allocate. A single tensor above the maximum size is an [`Error::Alloc`]. On any error the
/// buffers made so far are freed and the tensors placed in them unbound.
pub fn alloc_ctx_tensors_from_buft(
    ctx: &Context,
    buft: Arc<dyn BufferType>,
) -> Result<Vec<Buffer>> {
    let ranges = ranges(ctx, buft.as_ref())?;
    let mut buffers: Vec<Buffer> = Vec::with_capacity(ranges.len());
    let mut placed: Vec<Tensor> = Vec::new();
    let result = (|| {
        for (tensors, size) in &ranges {
            let buffer = buft.clone().alloc_buffer(*size)?;
            buffers.push(buffer.clone());
            let mut talloc = TensorAllocator::new(&buffer);
            for tensor in tensors {
                talloc.alloc(tensor)?;
                placed.push(tensor.clone());
            }
        }
        for tensor in ctx.tensors() {
            if tensor.is_view() {
                view_init(&tensor)?;
            }
        }
        Ok(())
    })();
    match result {
        Ok(()) => Ok(buffers),
        Err(e) => {
            for tensor in &placed {
                tensor.unbind();
            }
            for buffer in &buffers {
                buffer.free();
            }
            Err(e)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::buffer::CpuBufferType;
    use crate::dtype::DType;
    use crate::ops;

    #[test]
    fn allocates_context_in_one_cpu_buffer() {
        let ctx = Context::new(true);
        let a = ctx.new_tensor(DType::F32, &[10]).unwrap();
        let b = ctx.new_tensor(DType::F16, &[7, 3]).unwrap();
        let v = ops::reshape(&ctx, &a, &[5, 2]).unwrap();
        assert_eq!(
            ctx_tensors_size(&ctx, CpuBufferType::shared().as_ref()),
            128
        );
        let buffers = alloc_ctx_tensors_from_buft(&ctx, CpuBufferType::shared()).unwrap();
        assert_eq!(buffers.len(), 1);
        assert_eq!(buffers[0].size(), 128);
        assert!(a.is_allocated() && b.is_allocated() && v.is_allocated());
        // Nothing left to allocate.
        assert!(alloc_ctx_tensors_from_buft(&ctx, CpuBufferType::shared())
            .unwrap()
            .is_empty());
        assert_eq!(ctx_tensors_size(&ctx, CpuBufferType::shared().as_ref()), 0);
    }
}
