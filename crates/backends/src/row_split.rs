//! Weights split by rows across several devices (ggml's split buffer type): a matrix too large
//! for one device keeps rows `r0..r1` on the first device, `r1..r2` on the next, ..., in
//! proportions the caller chooses.
//!
//! * [`SplitBufferType`] is a [`BufferType`]: a context's weights allocated in it
//!   (`alloc_ctx_tensors_from_buft`) get, for each tensor, one part per device in that device's
//!   own buffer type ([`BufferMemory::init_tensor`]); writing and reading the tensor reach its
//!   parts, row by row.
//! * Its [`device`](BufferType::device) is a [`SplitDevice`], whose [`SplitBackend`] computes
//!   a `MUL_MAT` whose first operand is a split weight: it copies the activations to every
//!   part's device, runs that part's product there and writes the part's rows of the result.
//!   Its own memory (activations, results) is host memory, so a [`Scheduler`] given the split
//!   backend places such products on it because of where the weight lives, and copies nothing
//!   between it and the CPU.
//! * [`SplitWeight`] is the same without a graph: one weight and its row-split product.
//!
//! [`Scheduler`]: crate::sched::Scheduler

use std::any::Any;
use std::fmt;
use std::ops::Range;
use std::sync::{Arc, Mutex, MutexGuard, Weak};

use crate::alloc::{alloc_ctx_tensors_from_buft, GraphAllocator};
use crate::backend::{Backend, Guid};
use crate::buffer::{
    for_overlaps, Buffer, BufferMemory, BufferType, BufferUsage, CpuBufferType, HOST_ALIGNMENT,
};
use crate::context::Context;
use crate::device::{BackendParams, Device, DeviceCaps, DeviceType};
use crate::dtype::DType;
use crate::error::{Error, Result, Status};
use crate::graph::Graph;
use crate::ops::{self, Op};
use crate::registration::Registration;
use crate::tensor::Tensor;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// How the rows of weights are divided among several devices; a buffer type whose buffers
/// hold each tensor's rows on those devices (see the module doc).
pub struct SplitBufferType {
    this: Weak<SplitBufferType>,
    registration: String,
    /// `"<registration>_Split"`: the buffer type's, device's and backend's name.
    name: String,
    devices: Vec<Arc<dyn Device>>,
    /// Where each device's share starts, as a fraction of the rows (ascending, first 0).
    starts: Vec<f64>,
}

impl fmt::Debug for SplitBufferType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let names: Vec<&str> = self.devices.iter().map(|d| d.name()).collect();
        write!(
            f,
            "SplitBufferType({}, devices={names:?})",
            self.registration
        )
    }
}

impl SplitBufferType {
    /// Splits over every device of `registration`, device `i` taking a share proportional to
    /// `tensor_split[i]` (ggml's `tensor_split`); an empty or all-zero list gives equal
    /// shares. Shares must be finite and not negative, one per device.
    pub fn new(
        registration: &dyn Registration,
        tensor_split: &[f32],
    ) -> Result<Arc<SplitBufferType>> {
        Self::from_devices(registration.name(), registration.devices(), tensor_split)
    }

    /// Splits over `devices` (in that order), as [`SplitBufferType::new`] does over a
    /// registration's; `name` says where they come from (the registration's name, or any label
    /// for devices gathered from several registrations, e.g. remote servers). The mechanism only
    /// needs each device's buffer type and backends, so the devices need not share a
    /// registration.
    pub fn from_devices(
        name: &str,
        devices: Vec<Arc<dyn Device>>,
        tensor_split: &[f32],
    ) -> Result<Arc<SplitBufferType>> {
        if devices.is_empty() {
            return Err(Error::InvalidArgument(format!(
                "{name} has no devices to split over"
            )));
        }
        let weights: Vec<f64> = if tensor_split.iter().all(|&w| w == 0.0) {
            vec![1.0; devices.len()]
        } else if tensor_split.len() != devices.len() {
            return Err(Error::InvalidArgument(format!(
                "tensor_split has {} shares for {} devices",
                tensor_split.len(),
                devices.len()
            )));
        } else if tensor_split.iter().any(|w| !w.is_finite() || *w < 0.0) {
            return Err(Error::InvalidArgument(format!(
                "tensor_split shares must be finite and not negative, got {tensor_split:?}"
            )));
        } else {
            tensor_split.iter().map(|&w| f64::from(w)).collect()
        };
        let total: f64 = weights.iter().sum();
        let mut starts = Vec::with_capacity(weights.len());
        let mut acc = 0.0;
        for w in &weights {
            starts.push(acc / total);
            acc += w;
        }
        Ok(Arc::new_cyclic(|this| SplitBufferType {
            this: this.clone(),
            registration: name.to_owned(),
            name: format!("{name}_Split"),
            devices,
            starts,
        }))
    }

    /// The registration's name (or the label given to [`SplitBufferType::from_devices`]).
    pub fn registration(&self) -> &str {
        &self.registration
    }

    /// The devices, in split order.
    pub fn devices(&self) -> &[Arc<dyn Device>] {
        &self.devices
    }

    /// The rows each device holds of a matrix of `nrows` rows (contiguous, in order, covering
    /// every row once; a device may get none).
    pub fn row_ranges(&self, nrows: usize) -> Vec<Range<usize>> {
        let bound = |i: usize| -> usize {
            match self.starts.get(i) {
                Some(&f) => ((f * nrows as f64).round() as usize).min(nrows),
                None => nrows,
            }
        };
        (0..self.devices.len())
            .map(|i| bound(i)..bound(i + 1).max(bound(i)))
            .collect()
    }

    fn arc(&self) -> Arc<SplitBufferType> {
        // `this` is set by `Arc::new_cyclic` and `&self` proves the Arc is alive.
        self.this
            .upgrade()
            .expect("a SplitBufferType lives in an Arc")
    }

    /// The device computing with this buffer type's weights (its backend runs `MUL_MAT` on
    /// every part).
    pub fn split_device(&self) -> Arc<SplitDevice> {
        Arc::new(SplitDevice { buft: self.arc() })
    }

    /// The parts of `tensor`, a tensor allocated in a buffer of this type (as a whole: not a
    /// view of part of it); `None` for any other tensor.
    pub fn tensor_parts(&self, tensor: &Tensor) -> Option<Arc<SplitTensor>> {
        let storage = tensor.storage().ok()?;
        if !std::ptr::addr_eq(
            Arc::as_ptr(storage.buffer.buffer_type()),
            self as *const Self,
        ) {
            return None;
        }
        let memory = storage
            .buffer
            .memory()
            .as_any()?
            .downcast_ref::<SplitMemory>()?;
        let state = lock(&memory.state);
        let entry = state
            .tensors
            .iter()
            .find(|e| e.offset == storage.offset)?
            .clone();
        drop(state);
        (entry.dtype == tensor.dtype() && entry.ne == tensor.ne() && tensor.is_contiguous())
            .then_some(entry)
    }

    /// A weight of `dtype` with rows of `row_len` elements and `nrows` rows (ggml's
    /// `ne = [row_len, nrows]`) in a buffer of this type.
    pub fn alloc_weight(&self, dtype: DType, row_len: usize, nrows: usize) -> Result<SplitWeight> {
        dtype.row_size(row_len)?;
        let ctx = Context::new(true);
        let tensor = ctx.new_tensor(dtype, &[row_len, nrows])?;
        let buffers = alloc_ctx_tensors_from_buft(&ctx, self.arc())?;
        let parts = self
            .tensor_parts(&tensor)
            .ok_or_else(|| Error::Backend("a split weight lost its parts".into()))?;
        Ok(SplitWeight {
            buft: self.arc(),
            tensor,
            parts,
            _buffers: buffers,
        })
    }

    /// Whether the split backend runs `t`: a leaf or view in a buffer of this type, or a
    /// `MUL_MAT` whose first operand is a whole split weight of this type and whose second is
    /// contiguous.
    fn supports_op(&self, t: &Tensor) -> bool {
        let in_here = |t: &Tensor| {
            t.buffer().is_some_and(|b| {
                std::ptr::addr_eq(Arc::as_ptr(b.buffer_type()), self as *const Self)
            })
        };
        match t.op() {
            Op::None => in_here(t),
            op if op.is_view_op() => in_here(t),
            Op::MulMat => {
                let srcs = t.srcs();
                srcs.len() == 2 && srcs[1].is_contiguous() && self.tensor_parts(&srcs[0]).is_some()
            }
            _ => false,
        }
    }
}

impl BufferType for SplitBufferType {
    fn name(&self) -> &str {
        &self.name
    }

    fn alloc_buffer(self: Arc<Self>, size: usize) -> Result<Buffer> {
        let memory = SplitMemory {
            buft: self.clone(),
            size,
            state: Mutex::new(SplitState {
                usage: BufferUsage::Weights,
                tensors: Vec::new(),
            }),
        };
        let buffer = Buffer::new(Box::new(memory), self);
        // A split buffer holds weights: products reading them follow them to the split backend.
        buffer.set_usage(BufferUsage::Weights);
        Ok(buffer)
    }

    fn alignment(&self) -> usize {
        HOST_ALIGNMENT
    }

    fn is_host(&self) -> bool {
        false
    }

    fn device(&self) -> Option<Arc<dyn Device>> {
        Some(self.split_device())
    }

    fn is_split(&self) -> bool {
        true
    }
}

/// One device's rows of a split tensor.
pub struct SplitPart {
    /// The device holding them.
    pub device: Arc<dyn Device>,
    /// Its position in the split buffer type's device list.
    pub device_index: usize,
    /// Which rows of the whole weight.
    pub rows: Range<usize>,
    /// The rows, as a tensor in the device's memory (`ne = [row_len, rows.len()]`).
    pub tensor: Tensor,
    _buffers: Vec<Buffer>,
}

/// A tensor of a split buffer: where it sits in the buffer and its parts in row order.
pub struct SplitTensor {
    offset: usize,
    nbytes: usize,
    row_bytes: usize,
    dtype: DType,
    ne: [usize; 4],
    parts: Vec<SplitPart>,
}

impl SplitTensor {
    /// The parts holding rows, in row order.
    pub fn parts(&self) -> &[SplitPart] {
        &self.parts
    }

    /// Calls `f(part, offset in the part, start in the request, length)` for each part that
    /// the tensor-relative byte range `at..at + len` touches.
    fn for_range(
        &self,
        at: usize,
        len: usize,
        mut f: impl FnMut(&SplitPart, usize, usize, usize) -> Result<()>,
    ) -> Result<()> {
        let pieces = self
            .parts
            .iter()
            .map(|p| p.rows.start * self.row_bytes..p.rows.end * self.row_bytes);
        for_overlaps(pieces, at, len, |i, at, start, n| {
            f(&self.parts[i], at, start, n)
        })
        .map(|_| ())
    }
}

struct SplitState {
    usage: BufferUsage,
    /// The tensors bound so far, by offset; none overlap.
    tensors: Vec<Arc<SplitTensor>>,
}

/// The memory of a split buffer: no bytes of its own, only the parts of each tensor bound to
/// it, on their devices.
struct SplitMemory {
    buft: Arc<SplitBufferType>,
    size: usize,
    state: Mutex<SplitState>,
}

impl SplitMemory {
    /// Calls `f` for every part the buffer range `offset..offset + len` touches (see
    /// [`SplitTensor::for_range`]); bytes outside every tensor are an error when `strict`.
    fn for_range(
        &self,
        offset: usize,
        len: usize,
        strict: bool,
        mut f: impl FnMut(&SplitPart, usize, usize, usize) -> Result<()>,
    ) -> Result<()> {
        let tensors = lock(&self.state).tensors.clone();
        let end = offset + len;
        let pieces = tensors.iter().map(|t| t.offset..t.offset + t.nbytes);
        let covered = for_overlaps(pieces, offset, len, |i, at, start, n| {
            tensors[i].for_range(at, n, |part, p_at, p_start, p_n| {
                f(part, p_at, start + p_start, p_n)
            })
        })?;
        if strict && covered != len {
            return Err(Error::InvalidArgument(format!(
                "bytes {offset}..{end} of a {} buffer are not all inside its tensors (a split \
                 buffer holds only its tensors' rows, on their devices)",
                self.buft.name
            )));
        }
        Ok(())
    }
}

impl BufferMemory for SplitMemory {
    fn size(&self) -> usize {
        self.size
    }

    fn host_ptr(&self) -> Option<std::ptr::NonNull<u8>> {
        None
    }

    fn write(&self, offset: usize, data: &[u8]) -> Result<()> {
        self.for_range(offset, data.len(), true, |part, at, start, n| {
            part.tensor.write_bytes(at, &data[start..start + n])
        })
    }

    fn read(&self, offset: usize, out: &mut [u8]) -> Result<()> {
        let len = out.len();
        self.for_range(offset, len, true, |part, at, start, n| {
            part.tensor.read_bytes(at, &mut out[start..start + n])
        })
    }

    fn fill(&self, offset: usize, len: usize, value: u8) -> Result<()> {
        self.for_range(offset, len, false, |part, at, _, n| {
            part.tensor.fill_bytes(at, n, value)
        })
    }

    fn usage_changed(&self, usage: BufferUsage) {
        let mut state = lock(&self.state);
        state.usage = usage;
        for t in &state.tensors {
            for part in &t.parts {
                for b in &part._buffers {
                    b.set_usage(usage);
                }
            }
        }
    }

    fn init_tensor(&self, tensor: &Tensor, offset: usize) -> Result<()> {
        let ne = tensor.ne();
        if !tensor.is_contiguous() || ne[2] != 1 || ne[3] != 1 {
            return Err(Error::shape(format!(
                "a {} buffer splits matrices by rows: {} must be a contiguous 2-D tensor, got \
                 shape {:?}",
                self.buft.name,
                tensor.label(),
                tensor.shape()
            )));
        }
        let (row_len, nrows) = (ne[0], ne[1]);
        let row_bytes = tensor.dtype().row_size(row_len)?;
        let usage = lock(&self.state).usage;
        let mut parts = Vec::new();
        for (i, (device, rows)) in self
            .buft
            .devices
            .iter()
            .zip(self.buft.row_ranges(nrows))
            .enumerate()
        {
            if rows.is_empty() {
                continue;
            }
            let ctx = Context::new(true);
            let part = ctx.new_tensor(tensor.dtype(), &[row_len, rows.len()])?;
            part.set_name(&format!("{}[{}:{}]", tensor.label(), rows.start, rows.end));
            let buffers = alloc_ctx_tensors_from_buft(&ctx, device.buffer_type()).map_err(|e| {
                Error::Backend(format!(
                    "rows {}..{} of {} on device {}: {e}",
                    rows.start,
                    rows.end,
                    tensor.label(),
                    device.name()
                ))
            })?;
            for b in &buffers {
                b.set_usage(usage);
            }
            parts.push(SplitPart {
                device: device.clone(),
                device_index: i,
                rows,
                tensor: part,
                _buffers: buffers,
            });
        }
        let entry = Arc::new(SplitTensor {
            offset,
            nbytes: tensor.nbytes(),
            row_bytes,
            dtype: tensor.dtype(),
            ne,
            parts,
        });
        let mut state = lock(&self.state);
        // A tensor bound over an earlier one's bytes replaces it (allocators reuse places).
        let end = offset + entry.nbytes;
        state
            .tensors
            .retain(|t| t.offset != offset && (t.offset >= end || t.offset + t.nbytes <= offset));
        let at = state.tensors.partition_point(|t| t.offset < offset);
        state.tensors.insert(at, entry);
        Ok(())
    }

    fn as_any(&self) -> Option<&dyn Any> {
        Some(self)
    }
}

/// The device of a [`SplitBufferType`]: computes products with its split weights, on their
/// parts' devices; its own memory is host memory.
pub struct SplitDevice {
    buft: Arc<SplitBufferType>,
}

impl fmt::Debug for SplitDevice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "SplitDevice({})", self.buft.name)
    }
}

impl SplitDevice {
    /// The split buffer type this device computes with.
    pub fn split_buffer_type(&self) -> &Arc<SplitBufferType> {
        &self.buft
    }
}

impl Device for SplitDevice {
    fn name(&self) -> &str {
        &self.buft.name
    }

    fn description(&self) -> String {
        let names: Vec<&str> = self.buft.devices.iter().map(|d| d.name()).collect();
        format!("weights split by rows over {}", names.join(", "))
    }

    fn memory(&self) -> (usize, usize) {
        self.buft.devices.iter().fold((0, 0), |(f, t), d| {
            let (df, dt) = d.memory();
            (f.saturating_add(df), t.saturating_add(dt))
        })
    }

    fn device_type(&self) -> DeviceType {
        DeviceType::Accel
    }

    fn caps(&self) -> DeviceCaps {
        DeviceCaps::default()
    }

    fn registration_name(&self) -> &str {
        &self.buft.registration
    }

    fn init_backend(&self, params: &BackendParams) -> Result<Arc<dyn Backend>> {
        // One backend per distinct device: parts on the same device share it.
        let mut backends: Vec<Arc<dyn Backend>> = Vec::with_capacity(self.buft.devices.len());
        for (i, device) in self.buft.devices.iter().enumerate() {
            let earlier = self.buft.devices[..i]
                .iter()
                .position(|d| Arc::ptr_eq(d, device));
            backends.push(match earlier {
                Some(j) => backends[j].clone(),
                None => device.init_backend(params)?,
            });
        }
        Ok(Arc::new(SplitBackend {
            device: Arc::new(SplitDevice {
                buft: self.buft.clone(),
            }),
            backends,
        }))
    }

    /// Host memory: activations and results of the split backend live there.
    fn buffer_type(&self) -> Arc<dyn BufferType> {
        CpuBufferType::shared()
    }

    fn supports_op(&self, op: &Tensor) -> bool {
        self.buft.supports_op(op)
    }

    fn supports_buft(&self, buffer_type: &dyn BufferType) -> bool {
        buffer_type.is_host()
            || std::ptr::addr_eq(
                buffer_type as *const dyn BufferType,
                Arc::as_ptr(&self.buft),
            )
    }
}

/// The backend of a [`SplitDevice`]: one backend per part device, and `MUL_MAT` with a split
/// weight computed part by part.
pub struct SplitBackend {
    device: Arc<SplitDevice>,
    /// One per device of the split buffer type (shared where a device repeats).
    backends: Vec<Arc<dyn Backend>>,
}

impl SplitBackend {
    /// The backends running the parts, one per device of the split buffer type.
    pub fn part_backends(&self) -> &[Arc<dyn Backend>] {
        &self.backends
    }
}

impl Backend for SplitBackend {
    fn guid(&self) -> Guid {
        *b"ferrograph-split"
    }

    fn name(&self) -> &str {
        &self.device.buft.name
    }

    fn device(&self) -> Arc<dyn Device> {
        self.device.clone()
    }

    fn as_any(&self) -> &dyn Any {
        self
    }

    fn synchronize(&self) -> Result<()> {
        for b in &self.backends {
            b.synchronize()?;
        }
        Ok(())
    }

    fn graph_compute_async(&self, graph: &Graph) -> Result<Status> {
        for node in graph.nodes() {
            if matches!(node.op(), Op::None) || node.op().is_view_op() {
                continue;
            }
            let parts = match node.op() {
                Op::MulMat => self.device.buft.tensor_parts(&node.srcs()[0]),
                _ => None,
            };
            let Some(parts) = parts else {
                return Err(Error::op_unsupported(
                    format!(
                        "backend {} runs only MUL_MAT with a split weight as its first operand, \
                         not {} ({})",
                        self.name(),
                        node.label(),
                        node.op().display_name()
                    ),
                    node.op().display_name(),
                    node.srcs()
                        .iter()
                        .map(|s| s.dtype().name().to_owned())
                        .collect(),
                    Some(self.name().to_owned()),
                ));
            };
            mul_mat_parts(&parts, &node.srcs()[1], node, &self.backends)?;
        }
        crate::tensor::mark_computed(graph.nodes());
        Ok(Status::Success)
    }

    fn supports_op(&self, op: &Tensor) -> bool {
        self.device.supports_op(op)
    }

    fn supports_buft(&self, buffer_type: &dyn BufferType) -> bool {
        self.device.supports_buft(buffer_type)
    }
}

/// `dst = MUL_MAT(split weight, x)`: `x` (contiguous, any buffer) is written to every part's
/// device, each part's product is queued on `backends[part.device_index]`, then each part's
/// rows are read back into their place in `dst`.
fn mul_mat_parts(
    weight: &SplitTensor,
    x: &Tensor,
    dst: &Tensor,
    backends: &[Arc<dyn Backend>],
) -> Result<()> {
    let (xne, dne) = (x.ne(), dst.ne());
    if !x.is_contiguous() || xne[0] != weight.ne[0] || dne != [weight.ne[1], xne[1], xne[2], xne[3]]
    {
        return Err(Error::shape(format!(
            "a split MUL_MAT of a {:?} weight needs contiguous activations of {} values per \
             row and a result of shape [{}, ...]; got {:?} and {:?}",
            weight.ne,
            weight.ne[0],
            weight.ne[1],
            x.shape(),
            dst.shape()
        )));
    }
    let mut xbytes = vec![0u8; x.nbytes()];
    x.read_bytes(0, &mut xbytes)?;
    // Everything a queued part reads or writes stays alive until its rows are read back.
    struct Launched {
        y: Tensor,
        backend: Arc<dyn Backend>,
        _graph: Graph,
        _alloc: GraphAllocator,
    }
    let context = |part: &SplitPart, e: Error| -> Error {
        Error::Backend(format!(
            "split MUL_MAT, rows {}..{} on device {}: {e}",
            part.rows.start,
            part.rows.end,
            part.device.name()
        ))
    };
    let mut launched = Vec::with_capacity(weight.parts.len());
    for part in &weight.parts {
        let backend = backends[part.device_index].clone();
        let run = || -> Result<Launched> {
            let ctx = Context::new(true);
            let xt = ctx.new_tensor(x.dtype(), &xne)?;
            let y = ops::mul_mat(&ctx, &part.tensor, &xt)?;
            let graph = Graph::build(std::slice::from_ref(&y));
            let mut alloc = GraphAllocator::new(backend.default_buffer_type());
            alloc.alloc_graph(&graph)?;
            backend.set_tensor_async(&xt, 0, &xbytes)?;
            backend.graph_compute_async(&graph)?;
            Ok(Launched {
                y,
                backend: backend.clone(),
                _graph: graph,
                _alloc: alloc,
            })
        };
        launched.push(run().map_err(|e| context(part, e))?);
    }
    let elem = dst.nb()[0];
    let nb = dst.nb();
    for (part, l) in weight.parts.iter().zip(&launched) {
        let read = || -> Result<Vec<u8>> {
            l.backend.synchronize()?;
            let mut ybytes = vec![0u8; l.y.nbytes()];
            l.y.read_bytes(0, &mut ybytes)?;
            Ok(ybytes)
        };
        let ybytes = read().map_err(|e| context(part, e))?;
        let chunk = part.rows.len() * elem;
        let mut row = 0usize;
        for i3 in 0..dne[3] {
            for i2 in 0..dne[2] {
                for i1 in 0..dne[1] {
                    let at = i1 * nb[1] + i2 * nb[2] + i3 * nb[3] + part.rows.start * elem;
                    dst.write_bytes(at, &ybytes[row * chunk..(row + 1) * chunk])?;
                    row += 1;
                }
            }
        }
    }
    Ok(())
}

/// A weight matrix whose rows are spread over several devices, with its row-split product
/// (made by [`SplitBufferType::alloc_weight`]); for graphs, allocate the weight in the split
/// buffer type and give the scheduler the split device's backend.
pub struct SplitWeight {
    buft: Arc<SplitBufferType>,
    tensor: Tensor,
    parts: Arc<SplitTensor>,
    _buffers: Vec<Buffer>,
}

impl SplitWeight {
    /// The parts, in row order.
    pub fn parts(&self) -> &[SplitPart] {
        &self.parts.parts
    }

    /// The weight as a tensor in its split buffer (usable in graphs).
    pub fn tensor(&self) -> &Tensor {
        &self.tensor
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        self.parts.dtype
    }

    /// `[row_len, nrows]`, ggml's order.
    pub fn ne(&self) -> [usize; 2] {
        [self.parts.ne[0], self.parts.ne[1]]
    }

    /// Sets the whole weight from its bytes (rows in order, as a contiguous tensor of the same
    /// dtype and shape holds them); each device receives its rows.
    pub fn set_bytes(&self, data: &[u8]) -> Result<()> {
        if data.len() != self.parts.nbytes {
            let [row_len, nrows] = self.ne();
            return Err(Error::shape(format!(
                "a {} weight of {nrows} rows of {row_len} needs {} bytes, got {}",
                self.dtype().name(),
                self.parts.nbytes,
                data.len()
            )));
        }
        self.tensor.write_bytes(0, data)
    }

    /// `W x` with ggml's MUL_MAT meaning: `x` holds `n_cols` columns of `row_len` f32 values
    /// (`ne = [row_len, n_cols]`); the result holds `n_cols` rows of `nrows` values. Each part
    /// is multiplied on a backend of its own device (opened for this call); the rows are
    /// gathered in order.
    pub fn mul_mat(&self, x: &[f32], n_cols: usize) -> Result<Vec<f32>> {
        let [row_len, nrows] = self.ne();
        if row_len.checked_mul(n_cols) != Some(x.len()) {
            return Err(Error::shape(format!(
                "x must hold {n_cols} columns of {row_len} values, got {} values",
                x.len()
            )));
        }
        let ctx = Context::new(false);
        let xt = ctx.new_tensor(DType::F32, &[row_len, n_cols])?;
        let yt = ctx.new_tensor(DType::F32, &[nrows, n_cols])?;
        xt.set_f32(x)?;
        let backend = self
            .buft
            .split_device()
            .init_backend(&BackendParams::default())?;
        let backends = &backend
            .as_any()
            .downcast_ref::<SplitBackend>()
            .ok_or_else(|| Error::Backend("the split device opened another backend".into()))?
            .backends;
        mul_mat_parts(&self.parts, &xt, &yt, backends)?;
        yt.to_f32_vec()
    }
}
