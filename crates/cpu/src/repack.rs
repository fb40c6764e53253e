//! The CPU's repacking buffer type (ggml's "extra" buffer types): host memory in which weight
//! matrices the CPU has a faster kernel for are stored in that kernel's layout.
//!
//! A whole, contiguous 2-D matrix bound in a [`RepackBufferType`] buffer gets a layout from
//! the moment it is bound ([`layout_for`]): q4_1 rows of whole blocks are interleaved eight
//! rows at a time ([`interleaved`], the decoding mat-vec's layout: a permutation of the plain
//! bytes), q4_0 rows of whole blocks as nibble panels that the integer GEMM expands with a
//! few instructions per line ([`crate::kernels::gemm_q8::nibbles`], also a permutation, padded
//! to whole panels of 32 rows), q8_0 rows as the integer GEMM's packed panels
//! ([`crate::kernels::gemm_q8::stored`], larger than the plain bytes: [`BufferType::alloc_size`] says how much). Every
//! other tensor is stored plainly. Writes and reads of any byte range go through the layout's
//! mapping and return exactly the plain bytes: a weight can be set piece by piece, read back,
//! copied to another device, and nothing can go stale. The memory has no host pointer for
//! others to use ([`BufferType::is_host`] is false), so only the CPU backend, which knows the
//! layouts ([`stored_view`]), reads it directly: its matrix products use the layouts' kernels,
//! and any other op gets a plain copy of the operand.
//!
//! The CPU device offers the type as its extra buffer type (`dev_get_extra_bufts`); the GGUF
//! loader places a language model's q4_1 matrices in it when asked, the sentence encoder its
//! q8_0/q4_0 matrices.

use std::ptr::NonNull;
use std::sync::{Arc, OnceLock, RwLock};

use crate::buffer::{Buffer, BufferMemory, BufferType, HostMemory, HOST_ALIGNMENT};
use crate::device::Device;
use crate::error::{Error, Result};
use crate::kernels::gemm_q8::nibbles::NibbleLayout;
use crate::kernels::gemm_q8::stored::PanelLayout;
use crate::kernels::interleaved::Layout;
pub use crate::kernels::stored_layout::StoredLayout;
use crate::tensor::Tensor;

/// The name of the repacking buffer type.
pub const NAME: &str = "CPU_REPACK";

/// The buffer type whose buffers store interleavable weights interleaved (see the module doc).
#[derive(Debug, Default)]
pub struct RepackBufferType;

impl RepackBufferType {
    /// The shared instance.
    pub fn shared() -> Arc<dyn BufferType> {
        static INSTANCE: OnceLock<Arc<RepackBufferType>> = OnceLock::new();
        INSTANCE.get_or_init(|| Arc::new(RepackBufferType)).clone()
    }
}

impl BufferType for RepackBufferType {
    fn name(&self) -> &str {
        NAME
    }

    fn alloc_buffer(self: Arc<Self>, size: usize) -> Result<Buffer> {
        let memory = RepackMemory {
            host: HostMemory::new(size, HOST_ALIGNMENT)?,
            layouts: RwLock::new(Vec::new()),
        };
        Ok(Buffer::new(Box::new(memory), self))
    }

    fn alignment(&self) -> usize {
        HOST_ALIGNMENT
    }

    fn alloc_size(&self, tensor: &Tensor) -> usize {
        layout_for(tensor).map_or(tensor.nbytes(), |l| l.stored_bytes())
    }

    fn is_host(&self) -> bool {
        false
    }

    fn device(&self) -> Option<Arc<dyn Device>> {
        Some(crate::backend::CpuDevice::shared())
    }
}

/// Whether `buffer_type` is the repacking type.
pub fn is_repack(buffer_type: &dyn BufferType) -> bool {
    buffer_type.name() == NAME && !buffer_type.is_host()
}

/// The layout `tensor` would get in a repacking buffer, if any: a whole, contiguous 2-D matrix
/// (not a view) of q4_1 with at least one group of eight rows (interleaved), of q4_0 (nibble
/// panels) or of q8_0 (packed panels), in rows of whole blocks.
pub fn layout_for(tensor: &Tensor) -> Option<StoredLayout> {
    let ne = tensor.ne();
    if tensor.view_src().is_some() || !tensor.is_contiguous() || ne[2] != 1 || ne[3] != 1 {
        return None;
    }
    if let Some(l) = Layout::new(tensor.dtype(), ne[0], ne[1]).filter(|l| l.grouped_rows() > 0) {
        return Some(StoredLayout::Interleaved(l));
    }
    if let Some(l) = NibbleLayout::new(tensor.dtype(), ne[0], ne[1]) {
        return Some(StoredLayout::Nibbles(l));
    }
    PanelLayout::new(tensor.dtype(), ne[0], ne[1]).map(StoredLayout::Panels)
}

/// The memory of a repacking buffer: host bytes plus the interleaved tensors' places.
struct RepackMemory {
    host: HostMemory,
    /// `(offset, layout)` of each laid-out tensor, sorted by offset, their stored spans not
    /// overlapping.
    layouts: RwLock<Vec<(usize, StoredLayout)>>,
}

impl RepackMemory {
    fn layouts(&self) -> std::sync::RwLockReadGuard<'_, Vec<(usize, StoredLayout)>> {
        self.layouts.read().unwrap_or_else(|p| p.into_inner())
    }

    /// Calls `f(offset, len, Some((tensor offset, layout)))` for each piece of
    /// `offset..offset + len` inside a laid-out tensor's plain range and `f(offset, len, None)`
    /// for each plain piece, in order.
    fn for_pieces(
        &self,
        offset: usize,
        len: usize,
        mut f: impl FnMut(usize, usize, Option<(usize, &StoredLayout)>),
    ) {
        let layouts = self.layouts();
        let end = offset + len;
        let mut at = offset;
        for (start, layout) in layouts.iter() {
            let stop = start + layout.plain_bytes();
            if stop <= at {
                continue;
            }
            if *start >= end {
                break;
            }
            if *start > at {
                f(at, start - at, None);
                at = *start;
            }
            let piece_end = stop.min(end);
            f(at, piece_end - at, Some((*start, layout)));
            at = piece_end;
        }
        if at < end {
            f(at, end - at, None);
        }
    }

    /// The `len` bytes at `offset` of the memory.
    ///
    /// # Safety
    /// `offset + len` must not exceed the size, and no other thread may touch these bytes
    /// while the slice lives (the host-buffer contract: graph order decides who touches what).
    #[allow(clippy::mut_from_ref)]
    unsafe fn region(&self, offset: usize, len: usize) -> &mut [u8] {
        match self.host.host_ptr() {
            // SAFETY: the host memory owns `size` bytes at `ptr` for its whole life; the range
            // lies inside them and is the caller's alone for the slice's life.
            Some(ptr) => unsafe { std::slice::from_raw_parts_mut(ptr.as_ptr().add(offset), len) },
            None => &mut [],
        }
    }
}

impl BufferMemory for RepackMemory {
    fn size(&self) -> usize {
        self.host.size()
    }

    fn host_ptr(&self) -> Option<NonNull<u8>> {
        None
    }

    fn write(&self, offset: usize, data: &[u8]) -> Result<()> {
        self.for_pieces(offset, data.len(), |at, n, tensor| {
            let src = &data[at - offset..at - offset + n];
            match tensor {
                Some((start, layout)) => {
                    // SAFETY: the laid-out tensor lies inside the memory (it was bound there);
                    // writers of a buffer's bytes are ordered by the caller.
                    let stored = unsafe { self.region(start, layout.stored_bytes()) };
                    layout.copy_in(stored, at - start, src);
                }
                // SAFETY: `Buffer` checked the range; as above.
                None => unsafe { self.region(at, n) }.copy_from_slice(src),
            }
        });
        Ok(())
    }

    fn read(&self, offset: usize, out: &mut [u8]) -> Result<()> {
        self.for_pieces(offset, out.len(), |at, n, tensor| {
            let dst = &mut out[at - offset..at - offset + n];
            match tensor {
                Some((start, layout)) => {
                    // SAFETY: as in `write`; the bytes are only read.
                    let stored = unsafe { self.region(start, layout.stored_bytes()) };
                    layout.copy_out(stored, at - start, dst);
                }
                // SAFETY: as in `write`; the bytes are only read.
                None => dst.copy_from_slice(unsafe { self.region(at, n) }),
            }
        });
        Ok(())
    }

    fn fill(&self, offset: usize, len: usize, value: u8) -> Result<()> {
        // Plain pieces in place; a laid-out tensor's piece as a write of that many `value`s
        // (a part of an interleaved matrix is not the same part of its stored bytes).
        let chunk = [value; 4096];
        let mut result = Ok(());
        self.for_pieces(offset, len, |at, n, tensor| match tensor {
            None if result.is_ok() => result = self.host.fill(at, n, value),
            None => {}
            Some((start, layout)) => {
                // SAFETY: as in `write`.
                let stored = unsafe { self.region(start, layout.stored_bytes()) };
                for piece in (at..at + n).step_by(chunk.len()) {
                    let m = chunk.len().min(at + n - piece);
                    layout.copy_in(stored, piece - start, &chunk[..m]);
                }
            }
        });
        result
    }

    fn init_tensor(&self, tensor: &Tensor, offset: usize) -> Result<()> {
        let layout = layout_for(tensor);
        let span = layout.map_or(tensor.nbytes(), |l| l.stored_bytes());
        let end = offset
            .checked_add(span)
            .filter(|&end| end <= self.size())
            .ok_or_else(|| {
                Error::out_of_bounds(format!(
                    "{} needs {span} bytes at offset {offset} of a {}-byte {NAME} buffer",
                    tensor.label(),
                    self.size()
                ))
            })?;
        let mut layouts = self.layouts.write().unwrap_or_else(|p| p.into_inner());
        // The range's old tenants are gone; its bytes now follow the new tensor's layout.
        layouts.retain(|(start, l)| start + l.stored_bytes() <= offset || *start >= end);
        if let Some(layout) = layout {
            if let StoredLayout::Panels(_) | StoredLayout::Nibbles(_) = layout {
                // Rows past the matrix's last one stay zero in its last panel.
                // SAFETY: the span lies inside the memory (checked above); binding is ordered
                // before any use of the tensor by the caller.
                unsafe { self.region(offset, span) }.fill(0);
            }
            let at = layouts.partition_point(|(start, _)| *start < offset);
            layouts.insert(at, (offset, layout));
        }
        Ok(())
    }

    fn as_any(&self) -> Option<&dyn std::any::Any> {
        Some(self)
    }
}

/// How the CPU backend sees a tensor stored in a repacking buffer.
pub enum StoredView {
    /// Stored plainly at this host address.
    Plain(*mut u8),
    /// The whole matrix at this host address, in this layout.
    LaidOut(*mut u8, StoredLayout),
    /// Part of a laid-out matrix (a view): readable only through a plain copy.
    Mapped,
}

/// Where and how `tensor` is stored, if its memory is a repacking buffer's (`None` for any
/// other memory).
pub fn stored_view(tensor: &Tensor) -> Option<StoredView> {
    let storage = tensor.storage().ok()?;
    let offset = storage.offset;
    let memory = storage
        .buffer
        .memory()
        .as_any()?
        .downcast_ref::<RepackMemory>()?;
    let base = memory.host.host_ptr()?.as_ptr();
    let end = offset + tensor.nbytes();
    let layouts = memory.layouts();
    // The first laid-out tensor whose plain range ends after `offset` (sorted, not
    // overlapping: their ends increase), if it starts before the tensor's end. A binary
    // search: products look their weights up on every compute, among all of a model's.
    let first_after = layouts.partition_point(|(start, l)| start + l.plain_bytes() <= offset);
    let covering = layouts
        .get(first_after)
        .filter(|(start, _)| *start < end.max(offset + 1));
    // SAFETY: `offset + nbytes` lies inside the buffer (checked when the tensor was bound).
    let at = unsafe { base.add(offset) };
    Some(match covering {
        None => StoredView::Plain(at),
        Some((start, layout)) if *start == offset && Some(*layout) == layout_for(tensor) => {
            StoredView::LaidOut(at, *layout)
        }
        Some(_) => StoredView::Mapped,
    })
}
