//! Buffer types and buffers: where tensor memory lives.
//!
//! A [`BufferType`] is a kind of memory (host memory for the CPU, device memory elsewhere) and
//! makes [`Buffer`]s. A buffer is a shared handle: tensors bound to it keep it alive, and its
//! *generation* changes whenever its contents are released (`reset`, `free`), so a tensor bound
//! before that point is detected as stale instead of reading reused memory.

use std::fmt;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::Arc;

use crate::device::Device;
use crate::error::{Error, Result};
use crate::host::{host_fill, host_read, host_write};
pub use crate::host::{ForeignHostMemory, HostMemory, HOST_ALIGNMENT, HUGE_PAGE};
use crate::tensor::Tensor;

/// What a buffer holds; the scheduler treats weight buffers specially.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BufferUsage {
    /// No particular use.
    Any,
    /// Model weights: ops consuming them prefer the backend that holds them.
    Weights,
    /// Intermediate results of a graph.
    Compute,
}

impl BufferUsage {
    fn to_u8(self) -> u8 {
        match self {
            BufferUsage::Any => 0,
            BufferUsage::Weights => 1,
            BufferUsage::Compute => 2,
        }
    }

    fn from_u8(value: u8) -> Self {
        match value {
            1 => BufferUsage::Weights,
            2 => BufferUsage::Compute,
            _ => BufferUsage::Any,
        }
    }
}

/// A kind of memory that makes buffers.
pub trait BufferType: Send + Sync + fmt::Debug {
    /// A short name such as `"CPU"`.
    fn name(&self) -> &str;
    /// Allocates a buffer of `size` bytes; zero gives a valid empty buffer.
    fn alloc_buffer(self: Arc<Self>, size: usize) -> Result<Buffer>;
    /// Alignment in bytes of tensor offsets inside buffers of this type.
    fn alignment(&self) -> usize;
    /// The largest buffer this type can allocate.
    fn max_size(&self) -> usize {
        usize::MAX
    }
    /// Bytes `tensor` needs in a buffer of this type, padding included (ggml's
    /// `get_alloc_size`): a device that pads by dtype or shape overrides this; the default is
    /// the tensor's own byte size.
    fn alloc_size(&self, tensor: &Tensor) -> usize {
        tensor.nbytes()
    }
    /// Whether the memory is directly addressable from the host.
    fn is_host(&self) -> bool;
    /// The device this buffer type belongs to, where it belongs to one (ggml's
    /// `buft_get_device`); `None` for free-standing types.
    fn device(&self) -> Option<Arc<dyn Device>> {
        None
    }
    /// Whether buffers of this type spread each tensor's rows over several devices (a
    /// the row-split buffer type): such a tensor can be read only by
    /// a backend that runs the op on every part, never copied whole to another backend.
    fn is_split(&self) -> bool {
        false
    }
}

/// Whether two buffer types make interchangeable memory: the same object, or two host buffer
/// types with the same name and alignment (a backend library loaded at run time carries its own
/// copy of the CPU buffer type, which must count as the host's).
pub fn same_buffer_type(a: &Arc<dyn BufferType>, b: &Arc<dyn BufferType>) -> bool {
    std::ptr::addr_eq(Arc::as_ptr(a), Arc::as_ptr(b))
        || (a.is_host() && b.is_host() && a.name() == b.name() && a.alignment() == b.alignment())
}

/// The memory behind a buffer. Offsets and lengths are checked by [`Buffer`] before any call.
pub trait BufferMemory: Send + Sync {
    /// Size in bytes.
    fn size(&self) -> usize;
    /// The host address of the first byte, for host-accessible memory.
    fn host_ptr(&self) -> Option<NonNull<u8>>;
    /// Copies `data` to `offset`.
    fn write(&self, offset: usize, data: &[u8]) -> Result<()>;
    /// Copies `out.len()` bytes from `offset` into `out`.
    fn read(&self, offset: usize, out: &mut [u8]) -> Result<()>;
    /// Fills `len` bytes at `offset` with `value`.
    fn fill(&self, offset: usize, len: usize, value: u8) -> Result<()>;
    /// The buffers this memory is made of (a multi-buffer's parts); empty for plain memory.
    fn parts(&self) -> &[Buffer] {
        &[]
    }
    /// Told when the buffer's usage changes (remote memory sends only weights through the
    /// server's weight cache); nothing by default.
    fn usage_changed(&self, usage: BufferUsage) {
        let _ = usage;
    }
    /// Told when `tensor` is bound at `offset` (ggml's `buffer_init_tensor`), after the bounds
    /// and alignment checks: memory that places tensors itself (a split buffer allocates each
    /// device's rows) does it here; nothing by default.
    fn init_tensor(&self, tensor: &Tensor, offset: usize) -> Result<()> {
        let _ = (tensor, offset);
        Ok(())
    }
    /// The memory as `Any`, for the backend that made it to reach its own type; `None` by
    /// default.
    fn as_any(&self) -> Option<&dyn std::any::Any> {
        None
    }
}

/// The memory of a multi-buffer: several buffers addressed as one concatenated range, so
/// usage, clear, reset and free reach every part.
struct MultiMemory {
    parts: Vec<Buffer>,
}

/// Calls `f(i, offset in piece i, start in the request, length)` for each byte range
/// `pieces[i]` that the request `offset..offset + len` overlaps (the pieces in ascending order,
/// not overlapping each other); returns how many requested bytes the pieces covered.
pub fn for_overlaps(
    pieces: impl IntoIterator<Item = std::ops::Range<usize>>,
    offset: usize,
    len: usize,
    mut f: impl FnMut(usize, usize, usize, usize) -> Result<()>,
) -> Result<usize> {
    let end = offset + len;
    let mut covered = 0;
    for (i, piece) in pieces.into_iter().enumerate() {
        let (lo, hi) = (offset.max(piece.start), end.min(piece.end));
        if lo < hi {
            f(i, lo - piece.start, lo - offset, hi - lo)?;
            covered += hi - lo;
        }
    }
    Ok(covered)
}

impl MultiMemory {
    /// Calls `f(part, offset in part, start in the request, length)` for each part that the
    /// byte range `offset..offset + len` touches.
    fn for_range(
        &self,
        offset: usize,
        len: usize,
        mut f: impl FnMut(&Buffer, usize, usize, usize) -> Result<()>,
    ) -> Result<()> {
        let starts = self.parts.iter().scan(0usize, |start, part| {
            let range = *start..*start + part.size();
            *start = range.end;
            Some(range)
        });
        for_overlaps(starts, offset, len, |i, at, start, n| {
            f(&self.parts[i], at, start, n)
        })
        .map(|_| ())
    }
}

impl BufferMemory for MultiMemory {
    fn size(&self) -> usize {
        self.parts.iter().map(Buffer::size).sum()
    }

    fn host_ptr(&self) -> Option<NonNull<u8>> {
        None
    }

    fn write(&self, offset: usize, data: &[u8]) -> Result<()> {
        self.for_range(offset, data.len(), |part, at, start, len| {
            part.write(at, &data[start..start + len])
        })
    }

    fn read(&self, offset: usize, out: &mut [u8]) -> Result<()> {
        let len = out.len();
        self.for_range(offset, len, |part, at, start, n| {
            part.read(at, &mut out[start..start + n])
        })
    }

    fn fill(&self, offset: usize, len: usize, value: u8) -> Result<()> {
        self.for_range(offset, len, |part, at, _, n| part.fill(at, n, value))
    }

    fn parts(&self) -> &[Buffer] {
        &self.parts
    }
}

/// Implements [`BufferMemory`] for a host-memory type with fields `ptr: NonNull<u8>` valid for
/// reads and writes of `size: usize` bytes while the value lives ([`HostMemory`] owns its
/// allocation; [`ForeignHostMemory`]'s creator guarantees it, see its `new`).
macro_rules! host_buffer_memory {
    ($ty:ty) => {
        impl BufferMemory for $ty {
            fn size(&self) -> usize {
                self.size
            }

            fn host_ptr(&self) -> Option<NonNull<u8>> {
                Some(self.ptr)
            }

            fn write(&self, offset: usize, data: &[u8]) -> Result<()> {
                // SAFETY: `Buffer` checked `offset + data.len() <= size` and the memory is
                // valid (see the macro's doc); the source is a separate borrowed slice, so the
                // ranges cannot overlap.
                unsafe { host_write(self.ptr, offset, data) };
                Ok(())
            }

            fn read(&self, offset: usize, out: &mut [u8]) -> Result<()> {
                // SAFETY: as in `write`; `out` is an exclusive borrow distinct from this memory.
                unsafe { host_read(self.ptr, offset, out) };
                Ok(())
            }

            fn fill(&self, offset: usize, len: usize, value: u8) -> Result<()> {
                // SAFETY: bounds checked by `Buffer`; validity as in `write`.
                unsafe { host_fill(self.ptr, offset, len, value) };
                Ok(())
            }
        }
    };
}

host_buffer_memory!(HostMemory);

host_buffer_memory!(ForeignHostMemory);

struct BufferInner {
    memory: Box<dyn BufferMemory>,
    buffer_type: Arc<dyn BufferType>,
    usage: AtomicU8,
    generation: AtomicU64,
    freed: AtomicBool,
    id: u64,
    /// Objects kept alive as long as the buffer (the owner of wrapped foreign memory).
    owners: std::sync::Mutex<Vec<Box<dyn std::any::Any + Send + Sync>>>,
}

/// A block of memory of some [`BufferType`]; cheap to clone (a shared handle).
#[derive(Clone)]
pub struct Buffer(Arc<BufferInner>);

static NEXT_BUFFER_ID: AtomicU64 = AtomicU64::new(1);

impl Buffer {
    /// Wraps `memory` made by `buffer_type`.
    pub fn new(memory: Box<dyn BufferMemory>, buffer_type: Arc<dyn BufferType>) -> Self {
        Buffer(Arc::new(BufferInner {
            memory,
            buffer_type,
            usage: AtomicU8::new(BufferUsage::Any.to_u8()),
            generation: AtomicU64::new(0),
            freed: AtomicBool::new(false),
            id: NEXT_BUFFER_ID.fetch_add(1, Ordering::Relaxed),
            owners: std::sync::Mutex::new(Vec::new()),
        }))
    }

    /// A process-unique id, stable for the buffer's life.
    pub fn id(&self) -> u64 {
        self.0.id
    }

    /// Size in bytes.
    pub fn size(&self) -> usize {
        self.0.memory.size()
    }

    /// The buffer type that made this buffer.
    pub fn buffer_type(&self) -> &Arc<dyn BufferType> {
        &self.0.buffer_type
    }

    /// Alignment of tensor offsets in this buffer.
    pub fn alignment(&self) -> usize {
        self.0.buffer_type.alignment()
    }

    /// Whether the memory is host-addressable.
    pub fn is_host(&self) -> bool {
        self.0.buffer_type.is_host() && self.0.memory.host_ptr().is_some()
    }

    /// The current usage tag.
    pub fn usage(&self) -> BufferUsage {
        BufferUsage::from_u8(self.0.usage.load(Ordering::Relaxed))
    }

    /// Sets the usage tag (on every part of a multi-buffer too).
    pub fn set_usage(&self, usage: BufferUsage) {
        self.0.usage.store(usage.to_u8(), Ordering::Relaxed);
        self.0.memory.usage_changed(usage);
        for part in self.0.memory.parts() {
            part.set_usage(usage);
        }
    }

    /// A multi-buffer: one buffer made of `parts` (ggml's `buffer_multi`), used when a context
    /// needs more memory than one buffer of its type may hold. Its bytes are the parts'
    /// concatenated; usage, reset and free apply to every part. Needs at least one part.
    pub fn multi(parts: Vec<Buffer>) -> Result<Buffer> {
        let first = parts.first().ok_or_else(|| {
            Error::InvalidArgument("a multi-buffer needs at least one buffer".into())
        })?;
        let buffer_type = first.buffer_type().clone();
        let usage = first.usage();
        let buffer = Buffer::new(Box::new(MultiMemory { parts }), buffer_type);
        buffer.set_usage(usage);
        Ok(buffer)
    }

    /// Lets the memory place `tensor`, being bound at `offset` (see
    /// [`BufferMemory::init_tensor`]); called by [`Tensor::bind`].
    pub fn init_tensor(&self, tensor: &Tensor, offset: usize) -> Result<()> {
        self.0.memory.init_tensor(tensor, offset)
    }

    /// The buffer's memory, for the backend that made it (see [`BufferMemory::as_any`]).
    pub fn memory(&self) -> &dyn BufferMemory {
        self.0.memory.as_ref()
    }

    /// The parts of a multi-buffer (empty for an ordinary buffer).
    pub fn parts(&self) -> &[Buffer] {
        self.0.memory.parts()
    }

    /// Whether this is a multi-buffer.
    pub fn is_multi(&self) -> bool {
        !self.0.memory.parts().is_empty()
    }

    /// The generation: it changes whenever the contents are released.
    pub fn generation(&self) -> u64 {
        self.0.generation.load(Ordering::Acquire)
    }

    /// Whether [`Buffer::free`] was called.
    pub fn is_freed(&self) -> bool {
        self.0.freed.load(Ordering::Acquire)
    }

    /// Releases the buffer for its tensors: every tensor bound so far becomes stale. The memory
    /// itself is returned once the last handle is dropped, so no live reference can dangle.
    pub fn free(&self) {
        self.0.freed.store(true, Ordering::Release);
        self.0.generation.fetch_add(1, Ordering::AcqRel);
        crate::tensor::note_bindings_changed();
        for part in self.0.memory.parts() {
            part.free();
        }
    }

    /// Invalidates all tensors bound to the buffer (they become stale) without freeing it.
    pub fn reset(&self) {
        self.0.generation.fetch_add(1, Ordering::AcqRel);
        crate::tensor::note_bindings_changed();
        for part in self.0.memory.parts() {
            part.reset();
        }
    }

    /// Keeps `owner` alive until the buffer itself is dropped: used when the buffer wraps
    /// memory that `owner` holds (a numpy array given to `buffer_from_host_ptr`).
    pub fn keep_alive(&self, owner: Box<dyn std::any::Any + Send + Sync>) {
        self.0
            .owners
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(owner);
    }

    /// ggml's buffer base: the host address of the first byte, or `None` for an empty buffer
    /// (ggml gives NULL), device memory, or a freed buffer.
    pub fn base(&self) -> Option<NonNull<u8>> {
        if self.size() == 0 {
            return None;
        }
        self.host_ptr()
    }

    /// The base host address, if the buffer is host memory and not freed.
    pub fn host_ptr(&self) -> Option<NonNull<u8>> {
        if self.is_freed() {
            return None;
        }
        self.0.memory.host_ptr()
    }

    /// Checks that `len` bytes at `offset` lie inside the (live) buffer, without overflow:
    /// callers that allocate an output for a caller's size check it first.
    pub fn check_range(&self, offset: usize, len: usize, what: &str) -> Result<()> {
        if self.is_freed() {
            return Err(Error::Stale(format!("{what} on a freed buffer")));
        }
        let end = offset.checked_add(len);
        match end {
            Some(end) if end <= self.size() => Ok(()),
            _ => Err(Error::out_of_range(
                format!(
                    "{what} of {len} bytes at offset {offset} exceeds the buffer's {} bytes",
                    self.size()
                ),
                offset,
                len,
                self.size(),
            )),
        }
    }

    /// Writes `data` at `offset`, bounds-checked.
    pub fn write(&self, offset: usize, data: &[u8]) -> Result<()> {
        self.check_range(offset, data.len(), "write")?;
        self.0.memory.write(offset, data)
    }

    /// Reads `out.len()` bytes from `offset`, bounds-checked.
    pub fn read(&self, offset: usize, out: &mut [u8]) -> Result<()> {
        self.check_range(offset, out.len(), "read")?;
        self.0.memory.read(offset, out)
    }

    /// Fills `len` bytes at `offset` with `value`, bounds-checked.
    pub fn fill(&self, offset: usize, len: usize, value: u8) -> Result<()> {
        self.check_range(offset, len, "memset")?;
        self.0.memory.fill(offset, len, value)
    }

    /// Fills the whole buffer with `value`.
    pub fn clear(&self, value: u8) -> Result<()> {
        self.fill(0, self.size(), value)
    }

    /// Whether two handles refer to the same buffer.
    pub fn same(&self, other: &Buffer) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

impl fmt::Debug for Buffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "Buffer(type={}, size={}, usage={:?}{})",
            self.0.buffer_type.name(),
            self.size(),
            self.usage(),
            if self.is_freed() { ", freed" } else { "" }
        )
    }
}

/// The CPU buffer type: aligned host memory.
#[derive(Debug, Default)]
pub struct CpuBufferType;

impl CpuBufferType {
    /// The shared instance.
    pub fn shared() -> Arc<dyn BufferType> {
        static INSTANCE: std::sync::OnceLock<Arc<CpuBufferType>> = std::sync::OnceLock::new();
        INSTANCE.get_or_init(|| Arc::new(CpuBufferType)).clone()
    }
}

impl BufferType for CpuBufferType {
    fn name(&self) -> &str {
        "CPU"
    }

    fn alloc_buffer(self: Arc<Self>, size: usize) -> Result<Buffer> {
        let memory = HostMemory::new(size, HOST_ALIGNMENT)?;
        Ok(Buffer::new(Box::new(memory), self))
    }

    fn alignment(&self) -> usize {
        HOST_ALIGNMENT
    }

    fn is_host(&self) -> bool {
        true
    }

    /// The device that computes on host memory, once its crate has announced it
    /// ([`set_host_device`]; the CPU device does on creation, and the registry creates it).
    fn device(&self) -> Option<Arc<dyn Device>> {
        HOST_DEVICE.get().cloned()
    }
}

/// The device behind [`CpuBufferType`]: host memory is described here, below every device, so
/// the CPU device (a layer up) announces itself instead of being named.
static HOST_DEVICE: std::sync::OnceLock<Arc<dyn Device>> = std::sync::OnceLock::new();

/// Announces the device that owns host memory (the CPU device; the first call wins).
pub fn set_host_device(device: Arc<dyn Device>) {
    let _ = HOST_DEVICE.set(device);
}

/// A CPU buffer over `size` bytes of host memory the caller owns (ggml's `cpu_buffer_from_ptr`).
///
/// # Safety
/// `ptr` must be valid for reads and writes of `size` bytes for as long as the buffer (or any
/// tensor bound to it) lives, and nothing else may free it meanwhile.
pub unsafe fn cpu_buffer_from_ptr(ptr: *mut u8, size: usize) -> Result<Buffer> {
    // SAFETY: forwarded to the caller (see above).
    let memory = unsafe { ForeignHostMemory::new(ptr, size, None)? };
    Ok(Buffer::new(Box::new(memory), CpuBufferType::shared()))
}

/// The [`Device`] methods of a device that computes in host memory (the CPU, BLAS): its
/// buffer type is the CPU's, it wraps host pointers as CPU buffers, and it reads any host
/// buffer. Expanded inside an `impl Device for ...` block, so the devices share one
/// implementation.
#[macro_export]
macro_rules! host_memory_device {
    () => {
        $crate::host_memory_device!(|_buffer_type| false);
    };
    // `also`: which non-host buffer types the device reads as well (the CPU: its repacking
    // type).
    (|$bt:ident| $also:expr) => {
        fn buffer_type(&self) -> std::sync::Arc<dyn $crate::buffer::BufferType> {
            $crate::buffer::CpuBufferType::shared()
        }

        unsafe fn buffer_from_host_ptr(
            &self,
            ptr: *mut u8,
            size: usize,
            _max_tensor_size: usize,
        ) -> $crate::error::Result<$crate::buffer::Buffer> {
            // SAFETY: the caller guarantees `ptr` is valid for `size` bytes for the buffer's
            // life (the contract of `Device::buffer_from_host_ptr`).
            unsafe { $crate::buffer::cpu_buffer_from_ptr(ptr, size) }
        }

        fn supports_buft(&self, buffer_type: &dyn $crate::buffer::BufferType) -> bool {
            let $bt = buffer_type;
            buffer_type.is_host() || $also
        }
    };
}

/// Allocates a CPU buffer of `size` bytes.
pub fn alloc_cpu_buffer(size: usize) -> Result<Buffer> {
    Arc::new(CpuBufferType).alloc_buffer(size)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_buffer_bounds_and_generations() {
        let buffer = alloc_cpu_buffer(16).unwrap();
        assert_eq!(buffer.size(), 16);
        assert_eq!(
            buffer.host_ptr().unwrap().as_ptr() as usize % HOST_ALIGNMENT,
            0
        );
        buffer.write(4, &[1, 2, 3]).unwrap();
        let mut out = [0u8; 3];
        buffer.read(4, &mut out).unwrap();
        assert_eq!(out, [1, 2, 3]);
        assert!(matches!(
            buffer.write(15, &[1, 2]),
            Err(Error::OutOfRange {
                offset: Some(15),
                size: Some(2),
                limit: Some(16),
                ..
            })
        ));
        let err = buffer.read(usize::MAX, &mut out).unwrap_err();
        assert_eq!(err.kind(), crate::error::ErrorKind::OutOfBounds);
        let generation = buffer.generation();
        buffer.reset();
        assert_ne!(buffer.generation(), generation);
        buffer.free();
        assert!(matches!(buffer.write(0, &[1]), Err(Error::Stale(_))));
    }

    #[test]
    fn multi_buffer_spans_parts_and_propagates() {
        let a = alloc_cpu_buffer(4).unwrap();
        let b = alloc_cpu_buffer(6).unwrap();
        let multi = Buffer::multi(vec![a.clone(), b.clone()]).unwrap();
        assert!(multi.is_multi());
        assert_eq!(multi.size(), 10);
        multi.write(2, &[1, 2, 3, 4]).unwrap();
        let mut out = [0u8; 2];
        b.read(0, &mut out).unwrap();
        assert_eq!(out, [3, 4]);
        let mut all = [9u8; 10];
        multi.read(0, &mut all).unwrap();
        assert_eq!(&all[2..6], &[1, 2, 3, 4]);
        multi.set_usage(BufferUsage::Weights);
        assert_eq!(b.usage(), BufferUsage::Weights);
        multi.free();
        assert!(a.is_freed() && b.is_freed());
        assert!(Buffer::multi(Vec::new()).is_err());
    }

    #[test]
    fn zero_size_buffer_is_valid() {
        let buffer = alloc_cpu_buffer(0).unwrap();
        assert_eq!(buffer.size(), 0);
        assert!(
            buffer.base().is_none(),
            "ggml: an empty buffer's base is NULL"
        );
        buffer.clear(0).unwrap();
        assert!(buffer.write(0, &[1]).is_err());
    }
}
