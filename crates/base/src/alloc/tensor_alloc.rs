//! The linear allocator (ggml's `tallocr`) and the single-tensor helpers
//! [`tensor_alloc`] and [`view_init`].

use crate::alloc::dyn_alloc::align_up;
use crate::buffer::Buffer;
use crate::error::{Error, Result};
use crate::tensor::Tensor;

/// Places tensors one after another in one buffer, each at the next offset aligned to the
/// buffer's alignment. Nothing is ever freed.
#[derive(Debug, Clone)]
pub struct TensorAllocator {
    buffer: Buffer,
    offset: usize,
    alignment: usize,
}

impl TensorAllocator {
    /// A linear allocator over `buffer`, starting at offset 0.
    pub fn new(buffer: &Buffer) -> TensorAllocator {
        TensorAllocator {
            buffer: buffer.clone(),
            offset: 0,
            alignment: buffer.alignment().max(1),
        }
    }

    /// The buffer tensors are placed in.
    pub fn buffer(&self) -> &Buffer {
        &self.buffer
    }

    /// The next free offset (bytes used so far, padding included).
    pub fn offset(&self) -> usize {
        self.offset
    }

    /// Places `tensor` at the next aligned offset and binds it there.
    ///
    /// Views take no memory: they are only checked ([`view_init`]). A tensor that is already
    /// allocated is an [`Error::InvalidArgument`]; one that does not fit is an
    /// [`Error::Alloc`] naming the bytes needed, the offset and the buffer size.
    pub fn alloc(&mut self, tensor: &Tensor) -> Result<()> {
        if tensor.is_view() {
            return view_init(tensor);
        }
        if tensor.is_allocated() {
            return Err(Error::InvalidArgument(format!(
                "{} is already allocated",
                tensor.label()
            )));
        }
        let needed = self.buffer.buffer_type().alloc_size(tensor);
        let padded = align_up(needed, self.alignment);
        let end = padded.and_then(|p| self.offset.checked_add(p));
        match end {
            Some(end) if end <= self.buffer.size() => {
                tensor.bind(&self.buffer, self.offset)?;
                self.offset = end;
                Ok(())
            }
            _ => Err(Error::alloc(format!(
                "not enough space in the buffer for {}: needed {needed} bytes at offset {}, \
                 but the buffer has {} bytes ({} available)",
                tensor.label(),
                self.offset,
                self.buffer.size(),
                self.buffer.size().saturating_sub(self.offset)
            ))),
        }
    }
}

/// Binds a non-view, not yet allocated `tensor` at `offset` in `buffer` (ggml's
/// `backend_tensor_alloc`): checks that the tensor's allocation size (as the buffer type
/// counts it) fits and that the offset is aligned.
pub fn tensor_alloc(tensor: &Tensor, buffer: &Buffer, offset: usize) -> Result<()> {
    if tensor.is_view() {
        return Err(Error::InvalidArgument(format!(
            "{} is a view; use view_init",
            tensor.label()
        )));
    }
    if tensor.is_allocated() {
        return Err(Error::InvalidArgument(format!(
            "{} is already allocated",
            tensor.label()
        )));
    }
    let needed = buffer.buffer_type().alloc_size(tensor);
    if offset
        .checked_add(needed)
        .is_none_or(|end| end > buffer.size())
    {
        return Err(Error::alloc(format!(
            "{} needs {needed} bytes at offset {offset} but the buffer has {} bytes",
            tensor.label(),
            buffer.size()
        )));
    }
    tensor.bind(buffer, offset)
}

/// Initialises a view (ggml's `backend_view_init`). A view's storage always resolves through
/// its source, so this only checks that the source is allocated (and not stale).
pub fn view_init(tensor: &Tensor) -> Result<()> {
    if !tensor.is_view() {
        return Err(Error::InvalidArgument(format!(
            "{} is not a view",
            tensor.label()
        )));
    }
    tensor.storage().map(|_| ())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::buffer::alloc_cpu_buffer;
    use crate::context::Context;
    use crate::dtype::DType;
    use crate::ops;

    #[test]
    fn linear_placement_and_overflow() {
        let ctx = Context::new(true);
        let a = ctx.new_tensor(DType::F32, &[3]).unwrap();
        let b = ctx.new_tensor(DType::F32, &[10]).unwrap();
        let c = ctx.new_tensor(DType::F32, &[100]).unwrap();
        let v = ops::reshape(&ctx, &b, &[5, 2]).unwrap();
        let buffer = alloc_cpu_buffer(256).unwrap();
        let mut talloc = TensorAllocator::new(&buffer);
        assert!(talloc.alloc(&v).is_err()); // source not allocated yet
        talloc.alloc(&a).unwrap();
        talloc.alloc(&b).unwrap();
        talloc.alloc(&v).unwrap();
        assert_eq!(a.storage().unwrap().offset, 0);
        assert_eq!(b.storage().unwrap().offset, 64);
        assert_eq!(talloc.offset(), 128);
        let err = talloc.alloc(&c).unwrap_err();
        assert!(
            matches!(err, Error::AllocFailed { message: ref m, .. } if m.contains("400") && m.contains("128"))
        );
        assert!(talloc.alloc(&a).is_err());
    }

    #[test]
    fn tensor_alloc_checks() {
        let ctx = Context::new(true);
        let a = ctx.new_tensor(DType::F32, &[16]).unwrap();
        let v = ops::transpose(&ctx, &a).unwrap();
        let buffer = alloc_cpu_buffer(128).unwrap();
        assert!(view_init(&v).is_err());
        assert!(tensor_alloc(&a, &buffer, 100).is_err());
        assert!(tensor_alloc(&v, &buffer, 0).is_err());
        tensor_alloc(&a, &buffer, 64).unwrap();
        view_init(&v).unwrap();
        assert!(view_init(&a).is_err());
        assert!(tensor_alloc(&a, &buffer, 0).is_err());
    }
}
