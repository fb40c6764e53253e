//! Tensors: shared handles to immutable metadata plus a storage binding.
//!
//! A [`Tensor`] is an `Arc` around a node. Its dtype, shape (`ne`), strides (`nb`), op, sources
//! and view source never change after creation; its name, flags and storage binding are small
//! interior-mutable fields. Identity (for graphs, plans and allocators) is [`Tensor::id`].
//!
//! Shapes follow ggml: `ne[0]` is the fastest-varying dimension and `nb[i]` is the byte stride
//! of dimension `i`. [`Tensor::shape`] gives the numpy order (reversed).
//!
//! # Current values
//!
//! Memory that is live is not enough for a read to be right: the graph allocator gives an
//! intermediate's bytes to a later node once its consumers are done, and a result bound to
//! fresh memory holds nothing until it is computed. Each tensor therefore carries three ticks
//! of one process-wide counter — when it was last written from outside a compute
//! ([`Tensor::note_written`]: `write_bytes`, `fill_bytes`, copies), last computed
//! ([`mark_computed`], called by every backend after a graph succeeds) and last bound — plus
//! the first later node the allocator placed over its bytes. [`Tensor::check_current`] compares
//! them when a user reads a value: a result never computed since it was bound, a tensor whose
//! overwriting node ran after it, or a result older than a write to something it depends on
//! is reported as [`Error::Stale`] naming the tensor and the fix. The compute path pays one
//! atomic add per graph and one store per node.

use std::fmt;
use std::hash::{Hash, Hasher};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};

use crate::buffer::Buffer;
use crate::context::{Context, ContextInner};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::host::{RawTensor, SendPtr};
use crate::op::Op;

pub use crate::host::MAX_DIMS;

/// The layout epoch: a process-wide counter bumped whenever a tensor's bound byte range or its
/// recorded overwriter changes (a bind to a new place, an unbind, an allocator's sweep). The
/// allocators' overwrite records (`alloc::overwrites`) stay valid while it reads the same.
static LAYOUT_EPOCH: AtomicU64 = AtomicU64::new(1);

/// The bindings epoch: a process-wide counter bumped whenever any tensor's binding may have
/// changed where its bytes are or whether they are live (a bind to a new place, an unbind, an
/// allocator's sweep, a buffer reset or freed). While it reads the same, every host address a
/// compute resolved for a tensor that is still alive stays the address it would resolve now.
static BINDINGS_EPOCH: AtomicU64 = AtomicU64::new(1);

/// Bumps the layout epoch (see [`layout_epoch`]) and the bindings epoch.
pub(crate) fn note_layout_changed() {
    LAYOUT_EPOCH.fetch_add(1, Ordering::AcqRel);
    note_bindings_changed();
}

/// Bumps the bindings epoch (see [`bindings_epoch`]).
pub(crate) fn note_bindings_changed() {
    BINDINGS_EPOCH.fetch_add(1, Ordering::AcqRel);
}

/// Bindings made as one change of the layout (an allocator binding a whole graph): every
/// tensor bound through it gets one clock stamp, and the epochs are bumped at the first
/// binding that moves a tensor and once more when the batch ends, instead of at every
/// binding. An observer that read an epoch before the batch's first move sees it changed
/// from then on, as with bumps per binding; one that reads it mid-batch sees the final bump.
/// A batch whose bindings all keep their places bumps nothing (a replayed plan keeps its
/// records). Single-threaded by construction (not `Sync`).
pub(crate) struct BindBatch {
    /// The clock stamp of the batch's bindings (0 until the first).
    stamp: std::cell::Cell<u64>,
    /// Whether a binding moved a tensor (the epochs were bumped once already).
    moved: std::cell::Cell<bool>,
}

impl BindBatch {
    /// A batch with nothing bound yet.
    pub(crate) fn new() -> BindBatch {
        BindBatch {
            stamp: std::cell::Cell::new(0),
            moved: std::cell::Cell::new(false),
        }
    }

    /// The batch's clock stamp, taken at its first binding.
    fn stamp(&self) -> u64 {
        if self.stamp.get() == 0 {
            self.stamp.set(tick());
        }
        self.stamp.get()
    }

    /// A binding moved a tensor: the epochs are bumped now if this is the batch's first.
    fn note_moved(&self) {
        if !self.moved.replace(true) {
            note_layout_changed();
        }
    }
}

impl Drop for BindBatch {
    fn drop(&mut self) {
        if self.moved.get() {
            note_layout_changed();
        }
    }
}

/// The bindings epoch's current value: compute engines may keep the host addresses they
/// resolved for a graph's tensors while it is unchanged (and the graph alive), instead of
/// resolving every operand through its binding on every compute.
pub fn bindings_epoch() -> u64 {
    BINDINGS_EPOCH.load(Ordering::Acquire)
}

/// The layout epoch's current value.
pub(crate) fn layout_epoch() -> u64 {
    LAYOUT_EPOCH.load(Ordering::Acquire)
}

/// Flag bits of a tensor's role in a graph.
pub mod flags {
    /// Filled by the user before each compute.
    pub const INPUT: u8 = 1;
    /// Read by the user after compute; its memory is never reused.
    pub const OUTPUT: u8 = 2;
    /// A trainable parameter.
    pub const PARAM: u8 = 4;
    /// A loss value (training).
    pub const LOSS: u8 = 8;
}

/// Where a (non-view) tensor's bytes live.
#[derive(Clone, Debug)]
pub struct Storage {
    /// The buffer holding the bytes.
    pub buffer: Buffer,
    /// Byte offset of the tensor's first element in the buffer.
    pub offset: usize,
    /// The buffer's generation when the tensor was bound; a later reset makes it stale.
    pub generation: u64,
}

/// The shared node behind a [`Tensor`].
pub struct TensorNode {
    id: u64,
    dtype: DType,
    ne: [usize; MAX_DIMS],
    nb: [usize; MAX_DIMS],
    /// Bytes spanned ([`span_bytes`] of the fixed shape and strides), computed once: the
    /// allocators ask for it per tensor and per allocation.
    nbytes: usize,
    ndim: usize,
    op: Op,
    srcs: Vec<Tensor>,
    view_src: Option<Tensor>,
    view_offset: usize,
    name: Mutex<String>,
    flags: AtomicU8,
    storage: Mutex<Option<Storage>>,
    /// Lock-free mirror of the binding: the bound buffer's id (0 when unbound).
    bound_buffer: AtomicU64,
    /// Lock-free mirror of the binding: the buffer's generation when bound.
    bound_generation: AtomicU64,
    /// Value bookkeeping (see the module documentation, "Current values"): the clock when the bytes were last written from
    /// outside a compute (0: never).
    written_at: AtomicU64,
    /// The clock when a compute last produced the value (0: never).
    computed_at: AtomicU64,
    /// The clock when the tensor was last bound to memory (0: never).
    bound_at: AtomicU64,
    /// The first later node of an allocated graph whose memory overlaps this tensor's
    /// (recorded by [`crate::alloc::record_overwrites`]); its compute overwrites this value.
    overwritten_by: Mutex<Option<Weak<TensorNode>>>,
    /// Whether `overwritten_by` may hold a node: written under its lock, read without it so
    /// that forgetting a record that is not there takes no lock (allocations bind hundreds of
    /// fresh tensors). A reader seeing `false` while another thread records a node orders
    /// its own clearing first, which is a valid order of the two.
    has_overwriter: AtomicBool,
    context: Weak<ContextInner>,
}

/// A tensor handle: cheap to clone, compared and hashed by identity.
#[derive(Clone)]
pub struct Tensor(Arc<TensorNode>);

static NEXT_TENSOR_ID: AtomicU64 = AtomicU64::new(1);

/// Everything needed to create a tensor node (used by contexts and op builders).
pub struct TensorSpec {
    /// Element type.
    pub dtype: DType,
    /// Elements per dimension (ggml order).
    pub ne: [usize; MAX_DIMS],
    /// Explicit strides (views); `None` means contiguous.
    pub nb: Option<[usize; MAX_DIMS]>,
    /// Number of dimensions the user sees (numpy `ndim`).
    pub ndim: usize,
    /// The op that computes the tensor (`Op::None` for a leaf).
    pub op: Op,
    /// The op's operands.
    pub srcs: Vec<Tensor>,
    /// For a view: the viewed tensor and the byte offset into it.
    pub view: Option<(Tensor, usize)>,
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    // A poisoned lock only means another thread panicked while holding it; the guarded data is
    // plain metadata that stays consistent, so keep going.
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Strides of a contiguous tensor of `dtype` and shape `ne`.
pub fn contiguous_strides(dtype: DType, ne: &[usize; MAX_DIMS]) -> [usize; MAX_DIMS] {
    let mut nb = [0usize; MAX_DIMS];
    nb[0] = dtype.type_size();
    nb[1] = nb[0] * (ne[0] / dtype.block_size());
    for i in 2..MAX_DIMS {
        nb[i] = nb[i - 1] * ne[i - 1];
    }
    nb
}

/// The highest dimension with more than one element, plus one (at least 1) — ggml's `n_dims`.
pub fn ne_ndim(ne: &[usize; MAX_DIMS]) -> usize {
    (1..MAX_DIMS)
        .rev()
        .find(|&i| ne[i] > 1)
        .map_or(1, |i| i + 1)
}

/// Bytes spanned by a tensor of this dtype, shape and strides (ggml's `nbytes`).
pub fn span_bytes(dtype: DType, ne: &[usize; MAX_DIMS], nb: &[usize; MAX_DIMS]) -> usize {
    if ne.contains(&0) {
        return 0;
    }
    let block = dtype.block_size();
    let mut bytes = if block == 1 {
        dtype.type_size()
    } else {
        ne[0] * nb[0] / block
    };
    let first = if block == 1 { 0 } else { 1 };
    for i in first..MAX_DIMS {
        bytes += (ne[i] - 1) * nb[i];
    }
    bytes
}

/// Checks a shape for overflow and block alignment, naming the tensor in errors.
pub fn check_shape(dtype: DType, ne: &[usize; MAX_DIMS], what: &str) -> Result<()> {
    if !ne[0].is_multiple_of(dtype.block_size()) {
        return Err(Error::shape(format!(
            "{what}: the row length {} is not a multiple of the {} block size {}",
            ne[0],
            dtype.name(),
            dtype.block_size()
        )));
    }
    // Zero dimensions left out: an empty tensor's strides are still products of the others.
    let elements = ne
        .iter()
        .filter(|&&n| n != 0)
        .try_fold(1usize, |acc, &n| acc.checked_mul(n));
    let bytes = elements.and_then(|n| n.checked_mul(dtype.type_size()));
    if bytes.is_none_or(|b| b > isize::MAX as usize) {
        return Err(Error::shape(format!("{what}: shape {ne:?} is too large")));
    }
    Ok(())
}

impl Tensor {
    pub(crate) fn from_spec(spec: TensorSpec, context: Weak<ContextInner>) -> Result<Tensor> {
        check_shape(spec.dtype, &spec.ne, spec.op.name())?;
        let nb = spec
            .nb
            .unwrap_or_else(|| contiguous_strides(spec.dtype, &spec.ne));
        let nbytes = span_bytes(spec.dtype, &spec.ne, &nb);
        let (view_src, view_offset) = match spec.view {
            Some((src, offset)) => {
                // A view of a view points at the root so storage resolves in one step.
                let (root, base) = match src.view_src() {
                    Some(root) => (root.clone(), src.view_offset()),
                    None => (src, 0),
                };
                let end = offset.checked_add(base).and_then(|o| o.checked_add(nbytes));
                if end.is_none_or(|end| end > root.nbytes()) {
                    return Err(Error::shape(format!(
                        "view of {} bytes at offset {} is outside {} ({} bytes)",
                        nbytes,
                        base + offset,
                        root.label(),
                        root.nbytes()
                    )));
                }
                (Some(root), base + offset)
            }
            None => (None, 0),
        };
        let ndim = spec.ndim.clamp(1, MAX_DIMS).max(ne_ndim(&spec.ne));
        Ok(Tensor(Arc::new(TensorNode {
            id: NEXT_TENSOR_ID.fetch_add(1, Ordering::Relaxed),
            dtype: spec.dtype,
            ne: spec.ne,
            nb,
            nbytes,
            ndim,
            op: spec.op,
            srcs: spec.srcs,
            view_src,
            view_offset,
            name: Mutex::new(String::new()),
            flags: AtomicU8::new(0),
            storage: Mutex::new(None),
            bound_buffer: AtomicU64::new(0),
            bound_generation: AtomicU64::new(0),
            written_at: AtomicU64::new(0),
            computed_at: AtomicU64::new(0),
            bound_at: AtomicU64::new(0),
            overwritten_by: Mutex::new(None),
            has_overwriter: AtomicBool::new(false),
            context,
        })))
    }

    /// A process-unique identity.
    #[inline]
    pub fn id(&self) -> u64 {
        self.0.id
    }

    /// The element type.
    #[inline]
    pub fn dtype(&self) -> DType {
        self.0.dtype
    }

    /// Elements per dimension, ggml order (`ne[0]` fastest).
    #[inline]
    pub fn ne(&self) -> [usize; MAX_DIMS] {
        self.0.ne
    }

    /// Byte strides per dimension, ggml order.
    #[inline]
    pub fn nb(&self) -> [usize; MAX_DIMS] {
        self.0.nb
    }

    /// Number of dimensions the user sees.
    #[inline]
    pub fn ndim(&self) -> usize {
        self.0.ndim
    }

    /// The numpy-order shape (`ndim` entries, last axis fastest).
    pub fn shape(&self) -> Vec<usize> {
        self.0.ne[..self.0.ndim].iter().rev().copied().collect()
    }

    /// The numpy-order byte strides (`ndim` entries); for quantized types these are block
    /// strides and not meaningful per element.
    pub fn strides(&self) -> Vec<usize> {
        self.0.nb[..self.0.ndim].iter().rev().copied().collect()
    }

    /// Total number of elements.
    #[inline]
    pub fn nelements(&self) -> usize {
        self.0.ne.iter().product()
    }

    /// Number of rows (product of `ne[1..]`).
    #[inline]
    pub fn nrows(&self) -> usize {
        self.0.ne[1..].iter().product()
    }

    /// Bytes spanned in memory (ggml's `nbytes`).
    #[inline]
    pub fn nbytes(&self) -> usize {
        self.0.nbytes
    }

    /// Bytes of one contiguous row.
    pub fn row_bytes(&self) -> usize {
        self.0.ne[0] / self.0.dtype.block_size() * self.0.dtype.type_size()
    }

    /// The op that computes this tensor ([`Op::None`] for leaves made by a context).
    #[inline]
    pub fn op(&self) -> &Op {
        &self.0.op
    }

    /// The op's operands.
    #[inline]
    pub fn srcs(&self) -> &[Tensor] {
        &self.0.srcs
    }

    /// The tensor whose memory this one views, if it is a view.
    #[inline]
    pub fn view_src(&self) -> Option<&Tensor> {
        self.0.view_src.as_ref()
    }

    /// Byte offset into the view source.
    pub fn view_offset(&self) -> usize {
        self.0.view_offset
    }

    /// The context that created the tensor, while it is alive.
    pub fn context(&self) -> Option<Context> {
        self.0.context.upgrade().map(Context::from_inner)
    }

    /// The name ("" if none was set).
    #[inline]
    pub fn name(&self) -> String {
        lock(&self.0.name).clone()
    }

    /// Sets the name.
    pub fn set_name(&self, name: &str) -> &Self {
        *lock(&self.0.name) = name.to_owned();
        self
    }

    /// How messages name the tensor: `tensor 'name'` when it has a name, else its id, op and
    /// numpy shape (`tensor #9 (RELU, shape (4,))`) so the reader can tell which one it is.
    pub fn label(&self) -> String {
        let name = self.name();
        if !name.is_empty() {
            return format!("tensor '{name}'");
        }
        let shape = self.shape();
        let shape_text = match shape.as_slice() {
            [one] => format!("({one},)"),
            dims => format!(
                "({})",
                dims.iter()
                    .map(usize::to_string)
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        };
        let op = match self.0.op {
            Op::None => "leaf".to_owned(),
            ref op => op.display_name(),
        };
        format!("tensor #{} ({op}, shape {shape_text})", self.0.id)
    }

    /// Raw flag bits (see [`flags`]).
    pub fn flags(&self) -> u8 {
        self.0.flags.load(Ordering::Relaxed)
    }

    fn set_flag(&self, flag: u8) {
        self.0.flags.fetch_or(flag, Ordering::Relaxed);
    }

    /// Marks the tensor as a graph input.
    pub fn set_input(&self) {
        self.set_flag(flags::INPUT);
    }

    /// Marks the tensor as a graph output.
    pub fn set_output(&self) {
        self.set_flag(flags::OUTPUT);
    }

    /// Marks the tensor as a trainable parameter.
    pub fn set_param(&self) {
        self.set_flag(flags::PARAM);
    }

    /// Marks the tensor as a loss.
    pub fn set_loss(&self) {
        self.set_flag(flags::LOSS);
    }

    /// Whether the input flag is set.
    pub fn is_input(&self) -> bool {
        self.flags() & flags::INPUT != 0
    }

    /// Whether the output flag is set.
    pub fn is_output(&self) -> bool {
        self.flags() & flags::OUTPUT != 0
    }

    /// Whether the param flag is set.
    pub fn is_param(&self) -> bool {
        self.flags() & flags::PARAM != 0
    }

    /// Whether the tensor has no elements.
    pub fn is_empty(&self) -> bool {
        self.0.ne.contains(&0)
    }

    /// Whether elements are laid out densely in the natural order (dimensions of size one
    /// may have any stride).
    #[inline]
    pub fn is_contiguous(&self) -> bool {
        let expected = contiguous_strides(self.0.dtype, &self.0.ne);
        (0..MAX_DIMS).all(|i| self.0.ne[i] == 1 || self.0.nb[i] == expected[i])
    }

    /// Whether each row is dense (rows themselves may be strided).
    pub fn is_contiguous_rows(&self) -> bool {
        self.0.ne[0] == 1 || self.0.nb[0] == self.0.dtype.type_size()
    }

    /// Whether dimensions 0 and 1 are swapped (ggml's `is_transposed`).
    pub fn is_transposed(&self) -> bool {
        self.0.nb[0] > self.0.nb[1]
    }

    /// Whether the strides are not in increasing order (ggml's `is_permuted`).
    pub fn is_permuted(&self) -> bool {
        let nb = &self.0.nb;
        nb[0] > nb[1] || nb[1] > nb[2] || nb[2] > nb[3]
    }

    /// Whether both tensors have the same shape.
    pub fn same_shape(&self, other: &Tensor) -> bool {
        self.0.ne == other.0.ne
    }

    /// Whether both tensors have the same dtype, shape and strides (ggml's
    /// `are_same_layout`): one may then be copied or computed into the other's memory.
    pub fn same_layout(&self, other: &Tensor) -> bool {
        self.0.dtype == other.0.dtype && self.0.ne == other.0.ne && self.0.nb == other.0.nb
    }

    /// Whether the two handles are the same tensor.
    pub fn same(&self, other: &Tensor) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }

    /// Whether this tensor is a view of another.
    pub fn is_view(&self) -> bool {
        self.0.view_src.is_some()
    }

    // ----- storage -----

    /// Binds a non-view tensor to `offset` in `buffer` (checked: bounds and alignment).
    pub fn bind(&self, buffer: &Buffer, offset: usize) -> Result<()> {
        self.bind_aligned(buffer, offset, buffer.alignment(), None)
    }

    /// [`Tensor::bind`] as part of `batch` (see [`BindBatch`]).
    pub(crate) fn bind_in(&self, buffer: &Buffer, offset: usize, batch: &BindBatch) -> Result<()> {
        self.bind_aligned(buffer, offset, buffer.alignment(), Some(batch))
    }

    /// Binds a non-view tensor to `offset` in `buffer` where memory laid out by someone else
    /// fixes the offsets (ggml's `tensor_alloc`, which checks bounds only): `offset` must be a
    /// multiple of `alignment` instead of the buffer type's alignment. Used for a GGUF file's
    /// tensors wrapped in place, whose offsets follow the file's alignment (32 by default)
    /// rather than the CPU buffer type's 64. `alignment` must be a power of two and at least
    /// the dtype's element alignment (8 covers every type), so kernels can read the elements.
    /// For host memory the address `base + offset` must be a multiple of `alignment` too.
    pub fn bind_with_alignment(
        &self,
        buffer: &Buffer,
        offset: usize,
        alignment: usize,
    ) -> Result<()> {
        if !alignment.is_power_of_two() || alignment < 8 {
            return Err(Error::InvalidArgument(format!(
                "binding {} needs a power-of-two alignment of at least 8 bytes, got {alignment}",
                self.label()
            )));
        }
        if let Some(base) = buffer.host_ptr() {
            let address = (base.as_ptr() as usize).wrapping_add(offset);
            if !address.is_multiple_of(alignment) {
                return Err(Error::alloc(format!(
                    "{} would start at address {address:#x}, not a multiple of {alignment}",
                    self.label()
                )));
            }
        }
        self.bind_aligned(buffer, offset, alignment, None)
    }

    fn bind_aligned(
        &self,
        buffer: &Buffer,
        offset: usize,
        alignment: usize,
        batch: Option<&BindBatch>,
    ) -> Result<()> {
        if self.is_view() {
            return Err(Error::InvalidArgument(format!(
                "{} is a view; it uses its source's memory and cannot be bound",
                self.label()
            )));
        }
        if buffer.is_freed() {
            return Err(Error::Stale(format!(
                "cannot bind {} to a freed buffer",
                self.label()
            )));
        }
        {
            // Rebinding to the place it already had (allocators replaying a plan): the bounds
            // and alignment were checked then and cannot have changed; refresh the generation.
            let mut storage = lock(&self.0.storage);
            if let Some(s) = storage.as_mut() {
                if s.offset == offset && s.buffer.same(buffer) {
                    let generation = buffer.generation();
                    s.generation = generation;
                    self.0.bound_generation.store(generation, Ordering::Release);
                    drop(storage);
                    // Same bytes: the recorded overwriter (if any) still stands, so the
                    // layout epoch is left alone and a replayed plan can skip its sweep.
                    let stamp = batch.map_or_else(tick, BindBatch::stamp);
                    self.0.bound_at.store(stamp, Ordering::Release);
                    return Ok(());
                }
            }
        }
        let end = offset.checked_add(self.nbytes());
        if end.is_none_or(|end| end > buffer.size()) {
            return Err(Error::alloc(format!(
                "{} needs {} bytes at offset {offset} but the buffer has {} bytes",
                self.label(),
                self.nbytes(),
                buffer.size()
            )));
        }
        let align = alignment.max(1);
        if !offset.is_multiple_of(align) {
            return Err(Error::alloc(format!(
                "offset {offset} of {} is not a multiple of the alignment {align}",
                self.label()
            )));
        }
        buffer.init_tensor(self, offset)?;
        let generation = buffer.generation();
        let mut storage = lock(&self.0.storage);
        *storage = Some(Storage {
            buffer: buffer.clone(),
            offset,
            generation,
        });
        self.0.bound_buffer.store(buffer.id(), Ordering::Release);
        self.0.bound_generation.store(generation, Ordering::Release);
        drop(storage);
        self.note_bound(batch);
        Ok(())
    }

    /// Removes the storage binding (the tensor becomes unallocated).
    pub fn unbind(&self) {
        let mut storage = lock(&self.0.storage);
        *storage = None;
        self.0.bound_buffer.store(0, Ordering::Release);
        self.0.bound_generation.store(0, Ordering::Release);
        drop(storage);
        note_layout_changed();
    }

    /// The id of the buffer this tensor itself is bound to ([`Tensor::bind`]), or `None`.
    ///
    /// A lock-free read for hot paths (plan caches): it says nothing about whether the
    /// binding is still live (see [`Tensor::binding_is_live`]), and views report `None`
    /// (they are never bound; their bytes live in their source).
    pub fn bound_buffer_id(&self) -> Option<u64> {
        match self.0.bound_buffer.load(Ordering::Acquire) {
            0 => None,
            id => Some(id),
        }
    }

    /// The generation the bound buffer had when this tensor was bound (0 when unbound);
    /// lock-free, to be read with [`Tensor::bound_buffer_id`]. The binding is live while the
    /// buffer's [`Buffer::generation`] still equals it and the buffer is not freed.
    pub fn bound_generation(&self) -> u64 {
        self.0.bound_generation.load(Ordering::Acquire)
    }

    /// Whether the tensor's own binding is live (bound, buffer neither freed nor reset since):
    /// [`Tensor::is_allocated`] for non-views without cloning the storage or building an
    /// error.
    pub fn binding_is_live(&self) -> bool {
        lock(&self.0.storage)
            .as_ref()
            .is_some_and(|s| !s.buffer.is_freed() && s.buffer.generation() == s.generation)
    }

    /// Whether the tensor (or its view source) is bound to a live buffer.
    pub fn is_allocated(&self) -> bool {
        self.storage().is_ok()
    }

    /// The storage of the tensor's bytes: for a view, its source's storage advanced by the
    /// view offset. Errors if unallocated or stale.
    pub fn storage(&self) -> Result<Storage> {
        let owner = self.0.view_src.as_ref().unwrap_or(self);
        let binding = lock(&owner.0.storage).clone();
        let mut storage = binding.ok_or_else(|| {
            let fix = "allocate its graph first (GraphAllocator.alloc_graph or \
                       Scheduler.alloc_graph; alloc_ctx_tensors for a context's tensors)";
            if self.is_view() {
                Error::NotAllocated(format!(
                    "{} views {}, which has no memory; {fix}",
                    self.label(),
                    owner.label()
                ))
            } else {
                Error::NotAllocated(format!("{} has no memory; {fix}", self.label()))
            }
        })?;
        if storage.buffer.is_freed() || storage.buffer.generation() != storage.generation {
            return Err(Error::Stale(format!(
                "{}: its buffer was {} after the tensor was allocated",
                self.label(),
                if storage.buffer.is_freed() {
                    "freed"
                } else {
                    "reset"
                }
            )));
        }
        storage.offset += self.0.view_offset;
        Ok(storage)
    }

    /// The buffer holding the tensor's bytes, if allocated.
    pub fn buffer(&self) -> Option<Buffer> {
        self.storage().ok().map(|s| s.buffer)
    }

    /// The host address of the first byte when the tensor is bound to live host memory;
    /// `None` otherwise, without building an error ([`Tensor::host_ptr`] says why). Compute
    /// loops ask this for every operand of every node, so it reads the binding in place: no
    /// clone of the buffer handle (whose shared count all of a buffer's tensors touch) and no
    /// message formatted for operands that are resolved another way (repacked weights).
    #[inline]
    pub fn live_host_ptr(&self) -> Option<*mut u8> {
        let owner = self.0.view_src.as_ref().unwrap_or(self);
        let binding = lock(&owner.0.storage);
        let s = binding.as_ref()?;
        if s.buffer.is_freed() || s.buffer.generation() != s.generation {
            return None;
        }
        let base = s.buffer.host_ptr()?;
        // SAFETY: `bind` checked that `offset + nbytes` lies inside the buffer, and views were
        // checked to lie inside their source at creation.
        Some(unsafe { base.as_ptr().add(s.offset + self.0.view_offset) })
    }

    /// The host address of the first byte, for tensors in host memory.
    #[inline]
    pub fn host_ptr(&self) -> Result<*mut u8> {
        if let Some(ptr) = self.live_host_ptr() {
            return Ok(ptr);
        }
        // Unbound, stale or not host memory: the slow path names the problem.
        let storage = self.storage()?;
        let base = storage
            .buffer
            .host_ptr()
            .ok_or_else(|| Error::Backend(format!("{} is not in host memory", self.label())))?;
        // SAFETY: `bind` checked that `offset + nbytes` lies inside the buffer, and views were
        // checked to lie inside their source at creation.
        Ok(unsafe { base.as_ptr().add(storage.offset) })
    }

    /// Checks that `len` bytes at `offset` lie inside the tensor's span, without overflow:
    /// callers that allocate an output for a caller's size check it first.
    pub fn check_byte_range(&self, offset: usize, len: usize, what: &str) -> Result<()> {
        match offset.checked_add(len) {
            Some(end) if end <= self.nbytes() => Ok(()),
            _ => Err(Error::out_of_bounds(format!(
                "{what} of {len} bytes at offset {offset} is outside {} ({} bytes)",
                self.label(),
                self.nbytes()
            ))),
        }
    }

    /// Writes raw bytes at `offset` within the tensor's span (ggml's `tensor_set`).
    pub fn write_bytes(&self, offset: usize, data: &[u8]) -> Result<()> {
        self.check_byte_range(offset, data.len(), "write")?;
        let storage = self.storage()?;
        storage.buffer.write(storage.offset + offset, data)?;
        self.note_written();
        Ok(())
    }

    /// Reads raw bytes at `offset` within the tensor's span (ggml's `tensor_get`).
    pub fn read_bytes(&self, offset: usize, out: &mut [u8]) -> Result<()> {
        self.check_byte_range(offset, out.len(), "read")?;
        let storage = self.storage()?;
        storage.buffer.read(storage.offset + offset, out)
    }

    /// Fills `len` bytes at `offset` with `value` (ggml's `tensor_memset`).
    pub fn fill_bytes(&self, offset: usize, len: usize, value: u8) -> Result<()> {
        self.check_byte_range(offset, len, "memset")?;
        let storage = self.storage()?;
        storage.buffer.fill(storage.offset + offset, len, value)?;
        self.note_written();
        Ok(())
    }

    /// Reads all elements as f32 in logical order (any layout, any dtype).
    pub fn to_f32_vec(&self) -> Result<Vec<f32>> {
        let ne = self.0.ne;
        let nb = self.0.nb;
        let row_bytes = self.row_bytes();
        // A view with a zero stride can name far more elements than its memory holds: the
        // output is allocated fallibly (an AllocationError, not an abort).
        let n = self.nelements();
        let mut out = Vec::new();
        out.try_reserve_exact(n).map_err(|_| {
            Error::alloc(format!(
                "{} has {n} elements; {} bytes of f32 values cannot be allocated",
                self.label(),
                n.saturating_mul(4)
            ))
        })?;
        out.resize(n, 0f32);
        if ne[0] == 0 {
            return Ok(out);
        }
        let mut row = vec![0u8; row_bytes];
        let contiguous_rows = self.is_contiguous_rows() || self.0.dtype.is_quantized();
        let type_size = self.0.dtype.type_size();
        let mut element = vec![0u8; type_size];
        let mut one = [0f32; 1];
        for (r, chunk) in out.chunks_exact_mut(ne[0]).enumerate() {
            let i1 = r % ne[1];
            let i2 = (r / ne[1]) % ne[2];
            let i3 = r / (ne[1] * ne[2]);
            let base = i1 * nb[1] + i2 * nb[2] + i3 * nb[3];
            if contiguous_rows {
                self.read_bytes(base, &mut row)?;
                self.0.dtype.row_to_f32(&row, chunk)?;
            } else {
                for (i0, value) in chunk.iter_mut().enumerate() {
                    self.read_bytes(base + i0 * nb[0], &mut element)?;
                    self.0.dtype.row_to_f32(&element, &mut one)?;
                    *value = one[0];
                }
            }
        }
        Ok(out)
    }

    /// Writes all elements from f32 values in logical order, converting to the dtype.
    pub fn set_f32(&self, values: &[f32]) -> Result<()> {
        if values.len() != self.nelements() {
            return Err(Error::shape(format!(
                "{} has {} elements (shape {:?}) but {} values were given",
                self.label(),
                self.nelements(),
                self.shape(),
                values.len()
            )));
        }
        let ne = self.0.ne;
        let nb = self.0.nb;
        if ne[0] == 0 {
            return Ok(());
        }
        let contiguous_rows = self.is_contiguous_rows() || self.0.dtype.is_quantized();
        let mut row = vec![0u8; self.row_bytes()];
        let mut element = vec![0u8; self.0.dtype.type_size()];
        for (r, chunk) in values.chunks_exact(ne[0]).enumerate() {
            let i1 = r % ne[1];
            let i2 = (r / ne[1]) % ne[2];
            let i3 = r / (ne[1] * ne[2]);
            let base = i1 * nb[1] + i2 * nb[2] + i3 * nb[3];
            if contiguous_rows {
                self.0.dtype.row_from_f32(chunk, &mut row)?;
                self.write_bytes(base, &row)?;
            } else {
                for (i0, value) in chunk.iter().enumerate() {
                    self.0
                        .dtype
                        .row_from_f32(std::slice::from_ref(value), &mut element)?;
                    self.write_bytes(base + i0 * nb[0], &element)?;
                }
            }
        }
        Ok(())
    }
}

/// The value clock: every write, compute and binding takes the next tick (see the module
/// documentation, "Current values").
static VALUE_CLOCK: AtomicU64 = AtomicU64::new(0);

/// The tick of the latest write from outside a compute, to any tensor: when it is older than a
/// result, no input of that result can have changed since it was computed.
static LAST_WRITE: AtomicU64 = AtomicU64::new(0);

fn tick() -> u64 {
    VALUE_CLOCK.fetch_add(1, Ordering::AcqRel) + 1
}

/// Records that `nodes` were computed, in this order (a graph's nodes after a successful
/// compute): each non-view node takes the next tick; a view node that writes through to its
/// source (`cpy`, `set_rows` into a cache) stamps the source. Leaves and pure views (reshape,
/// view, permute, transpose) have no value of their own and are skipped. One atomic add for
/// the whole call plus one store per node: counters, never copies.
pub fn mark_computed(nodes: &[Tensor]) {
    let n = nodes.len() as u64;
    if n == 0 {
        return;
    }
    let base = VALUE_CLOCK.fetch_add(n, Ordering::AcqRel) + 1;
    for (stamp, node) in (base..).zip(nodes) {
        match node.view_src() {
            None if !matches!(node.op(), Op::None) => {
                node.0.computed_at.store(stamp, Ordering::Release);
            }
            Some(root) if !node.op().is_view_op() => {
                root.0.computed_at.fetch_max(stamp, Ordering::AcqRel);
            }
            _ => {}
        }
    }
}

impl Tensor {
    /// The tensor whose bytes this one reads: the view source, or the tensor itself.
    fn value_owner(&self) -> &Tensor {
        self.0.view_src.as_ref().unwrap_or(self)
    }

    /// The tick of the tensor's latest value (written or computed; 0 for never).
    fn value_tick(&self) -> u64 {
        let node = &self.0;
        node.written_at
            .load(Ordering::Acquire)
            .max(node.computed_at.load(Ordering::Acquire))
    }

    /// The tensor was bound to a new place: a fresh value clock, no recorded overwriter, and a
    /// new layout epoch (see `alloc::overwrites`, "Replays"; in a batch, the batch's stamp and
    /// epoch bumps).
    fn note_bound(&self, batch: Option<&BindBatch>) {
        let stamp = batch.map_or_else(tick, BindBatch::stamp);
        self.0.bound_at.store(stamp, Ordering::Release);
        self.clear_overwritten_by();
        match batch {
            Some(batch) => batch.note_moved(),
            None => note_layout_changed(),
        }
    }

    /// Records that the tensor's bytes (a view's source's) were written from outside a
    /// compute: `set`, `tensor_set`, a copy. Results computed from it before become stale.
    pub fn note_written(&self) {
        let stamp = tick();
        self.value_owner()
            .0
            .written_at
            .store(stamp, Ordering::Release);
        LAST_WRITE.fetch_max(stamp, Ordering::AcqRel);
    }

    /// Records that `later`, a node computed after this tensor in an allocated graph, shares
    /// some of its bytes (set by the graph allocator; cleared when the tensor is bound again).
    pub(crate) fn set_overwritten_by(&self, later: &Tensor) {
        self.replace_overwritten_by(Some(later));
    }

    /// The recorded overwriting node, if it is still alive (for tests).
    #[cfg(test)]
    pub(crate) fn overwritten_by(&self) -> Option<Tensor> {
        lock(&self.0.overwritten_by)
            .as_ref()
            .and_then(Weak::upgrade)
            .map(Tensor)
    }

    /// Replaces the recorded overwriting node by `later` (none: forgets it), under one lock.
    pub(crate) fn replace_overwritten_by(&self, later: Option<&Tensor>) {
        if later.is_none() && !self.0.has_overwriter.load(Ordering::Acquire) {
            return;
        }
        let mut record = lock(&self.0.overwritten_by);
        *record = later.map(|t| Arc::downgrade(&t.0));
        self.0
            .has_overwriter
            .store(record.is_some(), Ordering::Release);
    }

    /// Forgets a recorded overwriting node (before the allocator records them afresh).
    pub(crate) fn clear_overwritten_by(&self) {
        self.replace_overwritten_by(None);
    }

    /// The byte range the tensor's own binding covers: `(buffer id, offset, nbytes)`; `None`
    /// for views and unbound tensors.
    pub(crate) fn bound_span(&self) -> Option<(u64, usize, usize)> {
        if self.is_view() {
            return None;
        }
        lock(&self.0.storage)
            .as_ref()
            .map(|s| (s.buffer.id(), s.offset, self.nbytes()))
    }

    /// Checks that reading the tensor gives its current value, not bytes that belong to
    /// something else or were never computed (see the module documentation, "Current
    /// values"). Errors, each naming the tensor and the fix:
    ///
    /// * [`Error::NotAllocated`] / [`Error::Stale`] as [`Tensor::storage`] (no memory; buffer
    ///   freed or reset);
    /// * [`Error::Stale`] for a result not computed since its memory was bound;
    /// * [`Error::Stale`] for a tensor whose memory the allocator's plan gave to a later node
    ///   that has been computed since;
    /// * [`Error::Stale`] for a result computed before one of the tensors it depends on was
    ///   last written.
    ///
    /// Backends call this from user-facing reads (the Python `numpy()`); kernels never do.
    pub fn check_current(&self) -> Result<()> {
        let owner = self.value_owner();
        if !owner.binding_is_live() {
            // The storage error (no memory; buffer freed or reset), with its message.
            self.storage()?;
        }
        let value = owner.value_tick();
        let is_result = !matches!(owner.op(), Op::None);
        // Labels are built on the error paths only: a read that is current pays for ticks.
        let what = || {
            if self.same(owner) {
                self.label()
            } else {
                format!("{} (a view of {})", self.label(), owner.label())
            }
        };
        if is_result && (value == 0 || value < owner.0.bound_at.load(Ordering::Acquire)) {
            return Err(Error::Stale(format!(
                "{} has not been computed since its memory was allocated; compute its graph \
                 (backend.graph_compute(graph) or scheduler.graph_compute(graph)) before reading \
                 it",
                what()
            )));
        }
        let overwriter = lock(&owner.0.overwritten_by)
            .as_ref()
            .and_then(Weak::upgrade)
            .map(Tensor);
        if let Some(later) = overwriter {
            if later.value_tick() > value {
                return Err(Error::Stale(format!(
                    "{} no longer holds its value: the allocator gave its memory to {}, which \
                     a later step of the graph has written since; call set_output() on it \
                     before allocating the graph to keep it",
                    what(),
                    later.label()
                )));
            }
        }
        if is_result && LAST_WRITE.load(Ordering::Acquire) > value {
            if let Some(changed) = owner.dependency_written_after(value) {
                return Err(Error::Stale(format!(
                    "{} was computed before {} was last set; compute its graph again to read a \
                     current value",
                    what(),
                    changed.label()
                )));
            }
        }
        Ok(())
    }

    /// A tensor this one depends on (through operands and view sources) written after `since`.
    fn dependency_written_after(&self, since: u64) -> Option<Tensor> {
        let mut seen = std::collections::HashSet::new();
        let mut pending: Vec<&Tensor> = self.srcs().iter().chain(self.view_src()).collect();
        while let Some(t) = pending.pop() {
            if !seen.insert(t.id()) {
                continue;
            }
            if t.0.written_at.load(Ordering::Acquire) > since {
                return Some(t.clone());
            }
            pending.extend(t.srcs().iter().chain(t.view_src()));
        }
        None
    }
}

impl Drop for TensorNode {
    /// Releases long operand chains iteratively: a graph of 100k chained ops must not overflow
    /// the stack through nested `Arc` drops.
    fn drop(&mut self) {
        let mut pending: Vec<Tensor> = std::mem::take(&mut self.srcs);
        pending.extend(self.view_src.take());
        while let Some(tensor) = pending.pop() {
            if let Some(mut node) = Arc::into_inner(tensor.0) {
                pending.append(&mut node.srcs);
                pending.extend(node.view_src.take());
            }
        }
    }
}

impl PartialEq for Tensor {
    fn eq(&self, other: &Self) -> bool {
        self.same(other)
    }
}

impl Eq for Tensor {}

impl Hash for Tensor {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.0.id.hash(state);
    }
}

impl fmt::Debug for Tensor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Tensor(")?;
        let name = self.name();
        if !name.is_empty() {
            write!(f, "'{name}', ")?;
        }
        write!(
            f,
            "{}, shape={:?}, op={}",
            self.0.dtype,
            self.shape(),
            self.0.op.name()
        )?;
        if self.is_view() {
            write!(f, ", view")?;
        }
        write!(f, ")")
    }
}

impl fmt::Display for Tensor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self, f)
    }
}

impl RawTensor {
    /// The view of an allocated host tensor (the storage error otherwise).
    pub fn new(tensor: &Tensor) -> Result<RawTensor> {
        let ptr = tensor.host_ptr()?;
        Ok(RawTensor {
            ptr: SendPtr(ptr),
            dtype: tensor.dtype(),
            ne: tensor.ne(),
            nb: tensor.nb(),
        })
    }

    /// [`RawTensor::new`] without the error: `None` when the tensor is not bound to live host
    /// memory (nothing is formatted, so callers with another way to read it pay nothing).
    pub fn live(tensor: &Tensor) -> Option<RawTensor> {
        let ptr = tensor.live_host_ptr()?;
        Some(RawTensor {
            ptr: SendPtr(ptr),
            dtype: tensor.dtype(),
            ne: tensor.ne(),
            nb: tensor.nb(),
        })
    }
}
