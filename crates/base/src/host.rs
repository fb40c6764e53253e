//! Host memory and host tensor views: aligned allocations (huge-page advised when large),
//! memory someone else owns, and [`RawTensor`], a tensor's address with its layout, which
//! kernels and host backends index.

use std::alloc::{self, Layout};
use std::ptr::NonNull;

use crate::dtype::DType;
use crate::error::{Error, Result};

/// Most dimensions a tensor has (ggml's `GGML_MAX_DIMS`).
pub const MAX_DIMS: usize = 4;

/// Alignment of host buffers in bytes (enough for any SIMD load on the supported ISAs).
pub const HOST_ALIGNMENT: usize = 64;

/// Host buffers of at least this many bytes are huge-page aligned and advised to use huge pages.
pub const HUGE_PAGE: usize = 2 << 20;

/// Asks the kernel to back `len` bytes at `ptr` with transparent huge pages (advice only: a
/// refusal changes nothing but speed).
fn advise_huge_pages(ptr: *mut u8, len: usize) {
    #[cfg(target_os = "linux")]
    {
        // SAFETY: madvise only reads the address range, which belongs to a live allocation
        // of `len` bytes; MADV_HUGEPAGE does not change the memory's contents or validity.
        let rc = unsafe { libc::madvise(ptr.cast::<libc::c_void>(), len, libc::MADV_HUGEPAGE) };
        if rc != 0 {
            log::debug!("madvise(MADV_HUGEPAGE) of {len} bytes was refused");
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = (ptr, len);
}

/// Aligned host memory owned by a buffer.
pub struct HostMemory {
    pub(crate) ptr: NonNull<u8>,
    pub(crate) size: usize,
    layout: Option<Layout>,
}

// SAFETY: the memory is a plain byte allocation owned by this value; concurrent access is
// governed by the graph order (see `ARCHITECTURE.md`), the same contract as any host buffer.
unsafe impl Send for HostMemory {}
// SAFETY: as above; the struct itself holds no thread-affine state.
unsafe impl Sync for HostMemory {}

impl HostMemory {
    /// Allocates `size` zeroed bytes aligned to `align` (a power of two).
    ///
    /// Allocations of [`HUGE_PAGE`] bytes or more are aligned to a huge page and, on Linux,
    /// advised to use transparent huge pages before they are first touched: large weight and
    /// compute buffers then cost far fewer TLB misses (measured: tensor copies and big matrix
    /// products run at memory speed instead of page-walk speed).
    pub fn new(size: usize, align: usize) -> Result<Self> {
        if size == 0 {
            return Ok(Self {
                ptr: NonNull::<u64>::dangling().cast(),
                size: 0,
                layout: None,
            });
        }
        let huge = size >= HUGE_PAGE;
        let align = if huge { align.max(HUGE_PAGE) } else { align };
        let layout = Layout::from_size_align(size, align).map_err(|e| {
            Error::alloc(format!(
                "cannot lay out {size} bytes aligned to {align}: {e}"
            ))
        })?;
        let raw = if huge {
            // SAFETY: the layout has a non-zero size, checked above.
            let raw = unsafe { alloc::alloc(layout) };
            if !raw.is_null() {
                advise_huge_pages(raw, size);
                // SAFETY: `raw` points at `size` writable bytes just allocated; zeroing them
                // after the advice lets the first touch fault in huge pages.
                unsafe { std::ptr::write_bytes(raw, 0, size) };
            }
            raw
        } else {
            // SAFETY: the layout has a non-zero size, checked above.
            unsafe { alloc::alloc_zeroed(layout) }
        };
        let ptr = NonNull::new(raw).ok_or_else(|| {
            Error::alloc_failed(
                format!("host allocation of {size} bytes failed"),
                size,
                None,
                "CPU",
            )
        })?;
        Ok(Self {
            ptr,
            size,
            layout: Some(layout),
        })
    }
}

impl Drop for HostMemory {
    fn drop(&mut self) {
        if let Some(layout) = self.layout {
            // SAFETY: `ptr` came from `alloc_zeroed` with this exact layout and is freed once.
            unsafe { alloc::dealloc(self.ptr.as_ptr(), layout) };
        }
    }
}

/// Copies `data` to `base + offset`.
///
/// # Safety
/// `base + offset .. + data.len()` must be writable memory that `data` does not overlap.
pub(crate) unsafe fn host_write(base: NonNull<u8>, offset: usize, data: &[u8]) {
    // SAFETY: guaranteed by the caller.
    unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), base.as_ptr().add(offset), data.len()) }
}

/// Copies `out.len()` bytes from `base + offset` into `out`.
///
/// # Safety
/// `base + offset .. + out.len()` must be readable memory that `out` does not overlap.
pub(crate) unsafe fn host_read(base: NonNull<u8>, offset: usize, out: &mut [u8]) {
    // SAFETY: guaranteed by the caller.
    unsafe { std::ptr::copy_nonoverlapping(base.as_ptr().add(offset), out.as_mut_ptr(), out.len()) }
}

/// Sets `len` bytes at `base + offset` to `value`.
///
/// # Safety
/// `base + offset .. + len` must be writable memory.
pub(crate) unsafe fn host_fill(base: NonNull<u8>, offset: usize, len: usize, value: u8) {
    // SAFETY: guaranteed by the caller.
    unsafe { std::ptr::write_bytes(base.as_ptr().add(offset), value, len) }
}

/// Host memory owned by someone else (a numpy array, a memory map), optionally kept alive by
/// an owner object stored beside it.
pub struct ForeignHostMemory {
    pub(crate) ptr: NonNull<u8>,
    pub(crate) size: usize,
    _owner: Option<Box<dyn std::any::Any + Send + Sync>>,
}

// SAFETY: the creator guarantees the memory stays valid while this value lives (see `new`);
// access follows the same rules as `HostMemory`.
unsafe impl Send for ForeignHostMemory {}
// SAFETY: as above.
unsafe impl Sync for ForeignHostMemory {}

impl ForeignHostMemory {
    /// Wraps `size` bytes at `ptr`; `owner` (if any) is dropped with the buffer.
    ///
    /// # Safety
    /// `ptr` must be valid for reads and writes of `size` bytes until this value (and so the
    /// owner) is dropped, and nothing else may free it meanwhile.
    pub unsafe fn new(
        ptr: *mut u8,
        size: usize,
        owner: Option<Box<dyn std::any::Any + Send + Sync>>,
    ) -> Result<Self> {
        let ptr = if size == 0 {
            NonNull::<u64>::dangling().cast()
        } else {
            NonNull::new(ptr)
                .ok_or_else(|| Error::InvalidArgument("host pointer is null".into()))?
        };
        Ok(Self {
            ptr,
            size,
            _owner: owner,
        })
    }
}

/// A raw host pointer that may cross threads. Kernels guarantee that tasks write disjoint
/// bytes, which is what makes sharing it sound.
#[derive(Clone, Copy, Debug)]
pub struct SendPtr(pub *mut u8);

// SAFETY: the pointer is only dereferenced by kernels that split work so that no two tasks
// write the same bytes and no task reads bytes another task writes during the same op.
unsafe impl Send for SendPtr {}
// SAFETY: as above; shared access is only ever read-only or to disjoint regions.
unsafe impl Sync for SendPtr {}

/// A tensor's host memory with its layout.
#[derive(Clone, Copy, Debug)]
pub struct RawTensor {
    /// Address of the first element.
    pub ptr: SendPtr,
    /// Element type.
    pub dtype: DType,
    /// Elements per dimension (ggml order).
    pub ne: [usize; MAX_DIMS],
    /// Byte strides per dimension (for quantized types `nb[0]` is the block size in bytes).
    pub nb: [usize; MAX_DIMS],
}

impl RawTensor {
    /// Number of rows (product of `ne[1..]`).
    #[inline]
    pub fn nrows(&self) -> usize {
        self.ne[1] * self.ne[2] * self.ne[3]
    }

    /// Total number of elements.
    #[inline]
    pub fn nelements(&self) -> usize {
        self.ne.iter().product()
    }

    /// The (i1, i2, i3) coordinates of flat row `r`.
    #[inline]
    pub fn row_coords(&self, r: usize) -> (usize, usize, usize) {
        let i1 = r % self.ne[1];
        let i2 = (r / self.ne[1]) % self.ne[2];
        let i3 = r / (self.ne[1] * self.ne[2]);
        (i1, i2, i3)
    }

    /// Byte offset of row (i1, i2, i3).
    #[inline]
    pub fn row_offset(&self, i1: usize, i2: usize, i3: usize) -> usize {
        i1 * self.nb[1] + i2 * self.nb[2] + i3 * self.nb[3]
    }

    /// Byte offset of element (i0, i1, i2, i3); `i0` must be block-aligned for quantized types.
    #[inline]
    pub fn offset(&self, i0: usize, i1: usize, i2: usize, i3: usize) -> usize {
        i0 / self.dtype.block_size() * self.nb[0] + self.row_offset(i1, i2, i3)
    }

    /// Address `offset` bytes past the first element.
    ///
    /// # Safety
    /// `offset` must lie within the tensor's span.
    #[inline]
    pub unsafe fn at(&self, offset: usize) -> *mut u8 {
        // SAFETY: guaranteed by the caller.
        unsafe { self.ptr.0.add(offset) }
    }

    /// Whether the elements of each row are adjacent.
    #[inline]
    pub fn dense_rows(&self) -> bool {
        self.ne[0] <= 1 || self.dtype.is_quantized() || self.nb[0] == self.dtype.type_size()
    }

    /// Whether the whole tensor is laid out densely in logical order.
    pub fn is_contiguous(&self) -> bool {
        let mut expected = self.dtype.type_size();
        let block = self.dtype.block_size();
        for i in 0..MAX_DIMS {
            if self.ne[i] != 1 && self.nb[i] != expected {
                return false;
            }
            expected *= if i == 0 {
                self.ne[0] / block
            } else {
                self.ne[i]
            };
        }
        true
    }
}
