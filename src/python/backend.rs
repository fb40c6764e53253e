//! Python classes for the device layer: `DeviceType`, `BufferUsage`, `BufferType`, `Buffer`,
//! `Device`, `Backend`, `GraphPlan`, `Event`, `Registration`, and the registry functions
//! (`fg.devices()`, `fg.init_backend(...)`, ...).
//!
//! Each class is a thin handle on the core's shared object (`Arc<dyn Backend>`, [`Buffer`],
//! ...), so Python can never free memory the core still uses. Compute and large transfers run
//! with the interpreter released; callbacks re-attach to call Python.

use std::sync::Arc;

use numpy::PyArrayMethods;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

use super::convert::{byte_view, check_plain_data, is_ndarray, numpy, DETACH_THRESHOLD};
use super::errors::{guard, invalid};
use super::graph::PyGraph;
use super::lock::{detach_quiet, CallbackScope, CoreLock, ErrorSlot};
use super::tensor::PyTensor;
use crate::backend::{Backend, GraphPlan};
use crate::buffer::{Buffer, BufferType, BufferUsage, ForeignHostMemory};
use crate::cpu::backend::as_cpu;
use crate::device::{check_n_threads, BackendParams, Device, DeviceType};
use crate::error::{Error, Status};
use crate::event::Event;
use crate::registry::{self, Extension, Registration};
use crate::tensor::Tensor;

/// The kind of a device.
#[pyclass(
    name = "DeviceType",
    module = "ferrograph",
    eq,
    eq_int,
    frozen,
    hash,
    from_py_object
)]
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
#[allow(clippy::upper_case_acronyms)]
pub enum PyDeviceType {
    /// The host CPU.
    CPU,
    /// A discrete GPU with its own memory.
    GPU,
    /// An integrated GPU sharing host memory.
    IGPU,
    /// An accelerator used beside the CPU (BLAS, NPU, ...).
    ACCEL,
}

impl From<DeviceType> for PyDeviceType {
    fn from(t: DeviceType) -> Self {
        match t {
            DeviceType::Cpu => PyDeviceType::CPU,
            DeviceType::Gpu => PyDeviceType::GPU,
            DeviceType::IGpu => PyDeviceType::IGPU,
            DeviceType::Accel => PyDeviceType::ACCEL,
        }
    }
}

impl From<PyDeviceType> for DeviceType {
    fn from(t: PyDeviceType) -> Self {
        match t {
            PyDeviceType::CPU => DeviceType::Cpu,
            PyDeviceType::GPU => DeviceType::Gpu,
            PyDeviceType::IGPU => DeviceType::IGpu,
            PyDeviceType::ACCEL => DeviceType::Accel,
        }
    }
}

#[pymethods]
impl PyDeviceType {
    /// The upper-case name (`"CPU"`).
    #[getter]
    fn name(&self) -> &'static str {
        DeviceType::from(*self).name()
    }

    /// ggml's name for an integrated GPU: the same member as `IGPU`.
    #[classattr]
    #[allow(non_snake_case)]
    fn GPU_UMA() -> PyDeviceType {
        PyDeviceType::IGPU
    }
}

/// A device type given as `fg.DeviceType.CPU` or a name (`"cpu"`, `"gpu"`, ...).
pub(crate) enum DeviceTypeArg {
    Typed(PyDeviceType),
    Named(String),
}

impl<'a, 'py> FromPyObject<'a, 'py> for DeviceTypeArg {
    type Error = PyErr;

    fn extract(obj: pyo3::Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        if let Ok(t) = obj.extract::<PyDeviceType>() {
            return Ok(DeviceTypeArg::Typed(t));
        }
        if let Ok(name) = obj.extract::<String>() {
            return Ok(DeviceTypeArg::Named(name));
        }
        Err(super::utils::type_error(format!(
            "expected a DeviceType or a device type name ('cpu', 'gpu', 'igpu', 'accel'), got {}",
            super::utils::type_name(&obj)
        )))
    }
}

impl DeviceTypeArg {
    fn resolve(self) -> crate::Result<DeviceType> {
        match self {
            DeviceTypeArg::Typed(t) => Ok(t.into()),
            DeviceTypeArg::Named(name) => DeviceType::from_name(&name),
        }
    }
}

/// What a buffer holds; the scheduler sends ops that consume weights to the weights' backend.
#[pyclass(
    name = "BufferUsage",
    module = "ferrograph",
    eq,
    eq_int,
    frozen,
    hash,
    from_py_object
)]
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
#[allow(clippy::upper_case_acronyms)]
pub enum PyBufferUsage {
    /// No particular use.
    ANY,
    /// Model weights.
    WEIGHTS,
    /// Intermediate results.
    COMPUTE,
}

#[pymethods]
impl PyBufferUsage {
    /// The upper-case name (`"WEIGHTS"`).
    #[getter]
    fn name(&self) -> &'static str {
        match self {
            PyBufferUsage::ANY => "ANY",
            PyBufferUsage::WEIGHTS => "WEIGHTS",
            PyBufferUsage::COMPUTE => "COMPUTE",
        }
    }
}

impl From<BufferUsage> for PyBufferUsage {
    fn from(u: BufferUsage) -> Self {
        match u {
            BufferUsage::Any => PyBufferUsage::ANY,
            BufferUsage::Weights => PyBufferUsage::WEIGHTS,
            BufferUsage::Compute => PyBufferUsage::COMPUTE,
        }
    }
}

impl From<PyBufferUsage> for BufferUsage {
    fn from(u: PyBufferUsage) -> Self {
        match u {
            PyBufferUsage::ANY => BufferUsage::Any,
            PyBufferUsage::WEIGHTS => BufferUsage::Weights,
            PyBufferUsage::COMPUTE => BufferUsage::Compute,
        }
    }
}

/// A kind of memory that makes buffers (host memory for the CPU).
#[pyclass(name = "BufferType", module = "ferrograph", frozen)]
pub struct PyBufferType {
    pub(crate) inner: Arc<dyn BufferType>,
}

#[pymethods]
impl PyBufferType {
    /// Short name (`"CPU"`).
    #[getter]
    fn name(&self) -> String {
        self.inner.name().to_owned()
    }

    /// Alignment in bytes of tensor offsets in buffers of this type.
    #[getter]
    fn alignment(&self) -> usize {
        self.inner.alignment()
    }

    /// Largest buffer this type can allocate, in bytes.
    #[getter]
    fn max_size(&self) -> usize {
        self.inner.max_size()
    }

    /// Whether the memory is addressable from the host (numpy views are possible).
    #[getter]
    fn is_host(&self) -> bool {
        self.inner.is_host()
    }

    /// Bytes a tensor needs in a buffer of this type (padding included).
    fn alloc_size(&self, tensor: &PyTensor) -> PyResult<usize> {
        // A Python buffer type's failure or bad size is raised here (BackendError).
        Ok(super::plugin::checked(|| {
            self.inner.alloc_size(&tensor.inner)
        })?)
    }

    /// The device this buffer type belongs to, or None for a free-standing type.
    #[getter]
    fn device(&self) -> Option<PyDevice> {
        self.inner.device().map(|inner| PyDevice { inner })
    }

    /// Allocates a buffer of `size` bytes (0 gives a valid empty buffer).
    fn alloc_buffer(&self, py: Python<'_>, size: usize) -> PyResult<PyBuffer> {
        let buft = self.inner.clone();
        let buffer = py.detach(|| buft.alloc_buffer(size))?;
        Ok(PyBuffer { inner: buffer })
    }

    fn __eq__(&self, other: &Bound<'_, PyAny>) -> bool {
        other
            .cast::<PyBufferType>()
            .is_ok_and(|o| Arc::ptr_eq(&o.get().inner, &self.inner))
    }

    fn __hash__(&self) -> u64 {
        Arc::as_ptr(&self.inner) as *const u8 as usize as u64
    }

    fn __repr__(&self) -> String {
        format!(
            "BufferType(name={:?}, alignment={}, is_host={})",
            self.inner.name(),
            self.inner.alignment(),
            self.inner.is_host()
        )
    }
}

/// A block of memory of some buffer type. Tensors bound to it keep it alive; `reset()` and
/// `free()` make those tensors stale (an error on access, never a read of reused memory).
#[pyclass(name = "Buffer", module = "ferrograph", frozen)]
pub struct PyBuffer {
    pub(crate) inner: Buffer,
}

#[pymethods]
impl PyBuffer {
    /// Size in bytes.
    #[getter]
    fn size(&self) -> usize {
        self.inner.size()
    }

    /// The host address of the first byte, or None for device memory, an empty buffer (as
    /// ggml's NULL base) and a freed one.
    #[getter]
    fn base(&self) -> Option<usize> {
        self.inner.base().map(|p| p.as_ptr() as usize)
    }

    /// The buffer's type.
    #[getter]
    fn buffer_type(&self) -> PyBufferType {
        PyBufferType {
            inner: self.inner.buffer_type().clone(),
        }
    }

    /// Alignment of tensor offsets in bytes.
    #[getter]
    fn alignment(&self) -> usize {
        self.inner.alignment()
    }

    /// The buffer type's name (`"CPU"`).
    #[getter]
    fn name(&self) -> String {
        self.inner.buffer_type().name().to_owned()
    }

    /// The largest buffer of this buffer's type.
    #[getter]
    fn max_size(&self) -> usize {
        self.inner.buffer_type().max_size()
    }

    /// Bytes `tensor` needs in this buffer (padding included).
    fn alloc_size(&self, tensor: &PyTensor) -> usize {
        self.inner.buffer_type().alloc_size(&tensor.inner)
    }

    /// Binds `tensor` to this buffer at byte `offset` (ggml's `buffer_init_tensor` after
    /// `tensor_alloc`): bounds and alignment checked; views are bound to their source.
    #[pyo3(signature = (tensor, offset = 0))]
    fn init_tensor(&self, tensor: &PyTensor, offset: usize) -> PyResult<()> {
        if tensor.inner.is_view() {
            crate::alloc::view_init(&tensor.inner)?;
        } else {
            crate::alloc::tensor_alloc(&tensor.inner, &self.inner, offset)?;
        }
        Ok(())
    }

    /// Whether the memory is host-addressable.
    #[getter]
    fn is_host(&self) -> bool {
        self.inner.is_host()
    }

    /// What the buffer holds (settable: mark model weights with `BufferUsage.WEIGHTS`).
    #[getter]
    fn get_usage(&self) -> PyBufferUsage {
        self.inner.usage().into()
    }

    #[setter]
    fn set_usage(&self, usage: PyBufferUsage) {
        self.inner.set_usage(usage.into());
    }

    /// Whether this buffer is made of several (a multi-buffer).
    #[getter]
    fn is_multi(&self) -> bool {
        self.inner.is_multi()
    }

    /// The parts of a multi-buffer (empty otherwise).
    #[getter]
    fn parts(&self) -> Vec<PyBuffer> {
        self.inner
            .parts()
            .iter()
            .map(|b| PyBuffer { inner: b.clone() })
            .collect()
    }

    /// Whether `free()` was called.
    #[getter]
    fn is_freed(&self) -> bool {
        self.inner.is_freed()
    }

    /// Sets every byte to `value`.
    #[pyo3(signature = (value = 0))]
    fn clear(&self, py: Python<'_>, value: u8) -> PyResult<()> {
        let buffer = self.inner.clone();
        py.detach(|| buffer.clear(value))?;
        Ok(())
    }

    /// Releases the contents: tensors bound before become stale.
    fn reset(&self) {
        self.inner.reset();
    }

    /// Frees the memory now; tensors bound to it become stale.
    fn free(&self) {
        self.inner.free();
    }

    /// Reads `size` bytes at `offset` (bounds checked).
    fn read<'py>(
        &self,
        py: Python<'py>,
        offset: usize,
        size: usize,
    ) -> PyResult<Bound<'py, PyBytes>> {
        // Checked before the output is allocated: `size` is the caller's number.
        self.inner.check_range(offset, size, "read")?;
        let mut out = vec![0u8; size];
        let buffer = self.inner.clone();
        if size >= DETACH_THRESHOLD {
            py.detach(|| buffer.read(offset, &mut out))?;
        } else {
            buffer.read(offset, &mut out)?;
        }
        Ok(PyBytes::new(py, &out))
    }

    /// Writes `data` (bytes-like, or a plain-data numpy array's bytes in C order) at
    /// `offset` (bounds checked).
    fn write(&self, py: Python<'_>, offset: usize, data: &Bound<'_, PyAny>) -> PyResult<()> {
        let buffer = self.inner.clone();
        with_raw_bytes(py, data, |bytes| buffer.write(offset, bytes))
    }

    fn __len__(&self) -> usize {
        self.inner.size()
    }

    fn __eq__(&self, other: &Bound<'_, PyAny>) -> bool {
        other
            .cast::<PyBuffer>()
            .is_ok_and(|o| o.get().inner.same(&self.inner))
    }

    fn __hash__(&self) -> u64 {
        self.inner.id()
    }

    fn __repr__(&self) -> String {
        format!("{:?}", self.inner)
    }
}

/// A device: a source of buffer types and backends.
#[pyclass(name = "Device", module = "ferrograph", frozen)]
pub struct PyDevice {
    pub(crate) inner: Arc<dyn Device>,
}

#[pymethods]
impl PyDevice {
    /// Short unique name (`"CPU"`).
    #[getter]
    fn name(&self) -> String {
        self.inner.name().to_owned()
    }

    /// Human-readable description (the CPU model for the CPU).
    #[getter]
    fn description(&self) -> String {
        self.inner.description()
    }

    /// `(free, total)` memory in bytes.
    #[getter]
    fn memory(&self) -> PyResult<(usize, usize)> {
        // A Python device's failure or malformed answer is raised here (BackendError).
        Ok(super::plugin::checked(|| self.inner.memory())?)
    }

    /// The kind of device.
    #[getter]
    fn r#type(&self) -> PyDeviceType {
        self.inner.device_type().into()
    }

    /// The registration providing the device, or None for a device added on its own with
    /// `device_register` whose registration is not registered.
    #[getter]
    fn registration(&self) -> Option<PyRegistration> {
        registry::reg_by_name(self.inner.registration_name()).map(|inner| PyRegistration { inner })
    }

    /// The name of the registration providing the device.
    #[getter]
    fn registration_name(&self) -> String {
        self.inner.registration_name().to_owned()
    }

    /// A buffer of this device over the memory of a writable, C-contiguous numpy array,
    /// without copying (ggml's `dev_buffer_from_host_ptr`); the buffer keeps the array alive.
    /// `max_tensor_size` is the largest tensor that will be placed in it (0: unknown).
    /// BackendError when the device cannot wrap host memory (see `props()["caps"]`).
    #[pyo3(signature = (array, max_tensor_size = 0))]
    fn buffer_from_host_ptr(
        &self,
        array: &Bound<'_, PyAny>,
        max_tensor_size: usize,
    ) -> PyResult<PyBuffer> {
        let (address, size) = host_array_memory(array, "buffer_from_host_ptr")?;
        let alignment = self.inner.buffer_type().alignment();
        check_array_alignment(address, size, alignment)?;
        // SAFETY: `host_array_memory` checked that the array is writeable and C-contiguous, so
        // `address` points at `size` bytes it owns; `keep_alive` below stores a strong
        // reference to the array in the buffer, which keeps that memory valid for as long as
        // the buffer lives (numpy cannot resize an array that has other references).
        let buffer = unsafe {
            self.inner
                .buffer_from_host_ptr(address as *mut u8, size, max_tensor_size)?
        };
        buffer.keep_alive(Box::new(ArrayOwner(array.clone().unbind())));
        Ok(PyBuffer { inner: buffer })
    }

    /// Every property at once: name, description, memory_free, memory_total, type and caps
    /// (async, host_buffer, buffer_from_host_ptr, events).
    fn props<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let p = self.inner.props();
        let d = PyDict::new(py);
        d.set_item("name", p.name)?;
        d.set_item("description", p.description)?;
        d.set_item("memory_free", p.memory_free)?;
        d.set_item("memory_total", p.memory_total)?;
        d.set_item("type", PyDeviceType::from(p.device_type))?;
        let caps = PyDict::new(py);
        caps.set_item("async", p.caps.async_ops)?;
        caps.set_item("host_buffer", p.caps.host_buffer)?;
        caps.set_item("buffer_from_host_ptr", p.caps.buffer_from_host_ptr)?;
        caps.set_item("events", p.caps.events)?;
        d.set_item("caps", caps)?;
        Ok(d)
    }

    /// Opens a backend on this device. `params` is ggml's `"key=value,..."` text;
    /// `n_threads` overrides the thread count where the device has one.
    #[pyo3(signature = (params = "", n_threads = None))]
    fn init_backend(&self, params: &str, n_threads: Option<usize>) -> PyResult<PyBackend> {
        let parsed = BackendParams::parse(&params_text(params, n_threads)?)?;
        registry::check_params(self.inner.as_ref(), &parsed)?;
        Ok(PyBackend {
            inner: self.inner.init_backend(&parsed)?,
        })
    }

    /// The device's main buffer type.
    #[getter]
    fn buffer_type(&self) -> PyBufferType {
        PyBufferType {
            inner: self.inner.buffer_type(),
        }
    }

    /// A host buffer type for faster transfers to this device, or None.
    #[getter]
    fn host_buffer_type(&self) -> Option<PyBufferType> {
        self.inner
            .host_buffer_type()
            .map(|inner| PyBufferType { inner })
    }

    /// Whether the device computes the op that produces `tensor`.
    fn supports_op(&self, tensor: &PyTensor) -> PyResult<bool> {
        // A Python device's failure or non-bool answer is raised here (BackendError).
        Ok(super::plugin::checked(|| {
            self.inner.supports_op(&tensor.inner)
        })?)
    }

    /// Whether the device's backends can use memory of `buffer_type` directly.
    fn supports_buft(&self, buffer_type: &PyBufferType) -> bool {
        self.inner.supports_buft(buffer_type.inner.as_ref())
    }

    /// Whether the scheduler should move this op here although its weights are in host memory.
    fn offload_op(&self, tensor: &PyTensor) -> bool {
        self.inner.offload_op(&tensor.inner)
    }

    /// A new event for synchronising this device's backends (BackendError if it has none).
    fn event_new(&self) -> PyResult<PyEvent> {
        Ok(PyEvent {
            inner: self.inner.event_new()?,
        })
    }

    fn __eq__(&self, other: &Bound<'_, PyAny>) -> bool {
        other
            .cast::<PyDevice>()
            .is_ok_and(|o| Arc::ptr_eq(&o.get().inner, &self.inner))
    }

    fn __hash__(&self) -> u64 {
        Arc::as_ptr(&self.inner) as *const u8 as usize as u64
    }

    fn __repr__(&self) -> String {
        let (free, total) = self.inner.memory();
        format!(
            "Device(name={:?}, type=DeviceType.{}, description={:?}, memory={:.1}/{:.1} GiB free)",
            self.inner.name(),
            self.inner.device_type().name(),
            self.inner.description(),
            free as f64 / (1u64 << 30) as f64,
            total as f64 / (1u64 << 30) as f64
        )
    }
}

/// Calls `write` with the raw bytes of `data`: a C-contiguous numpy array's memory (read in
/// place, the interpreter released for large arrays) or a bytes-like object.
fn with_raw_bytes(
    py: Python<'_>,
    data: &Bound<'_, PyAny>,
    write: impl FnOnce(&[u8]) -> crate::Result<()> + Send,
) -> PyResult<()> {
    if is_ndarray(data)? {
        // Any layout is accepted (copied to C order first, as Tensor.set does); object arrays
        // are refused by `byte_view`.
        check_plain_data(data)?;
        let contiguous = numpy(py)?.call_method1("ascontiguousarray", (data,))?;
        let view = byte_view(&contiguous)?;
        let view = view.readonly();
        let bytes = view
            .as_slice()
            .map_err(|_| invalid("the array must be C-contiguous"))?;
        if bytes.len() >= DETACH_THRESHOLD {
            py.detach(|| write(bytes))?;
        } else {
            write(bytes)?;
        }
    } else {
        write(&bytes_of(data)?)?;
    }
    Ok(())
}

/// The bytes of a bytes-like object (bytes, bytearray, memoryview or any buffer) or of a list
/// of ints; ArgumentTypeError for anything else (a str, an int).
fn bytes_of(data: &Bound<'_, PyAny>) -> PyResult<Vec<u8>> {
    if let Ok(b) = data.cast::<PyBytes>() {
        return Ok(b.as_bytes().to_vec());
    }
    let wrong = || {
        super::utils::type_error(format!(
            "data must be a numpy array or a bytes-like object (bytes, bytearray, memoryview), \
             got {}",
            super::utils::type_name(data)
        ))
    };
    if data.is_instance_of::<pyo3::types::PyString>() || data.hasattr("__index__")? {
        return Err(wrong());
    }
    let py = data.py();
    if let Ok(view) = py.import("builtins")?.getattr("memoryview")?.call1((data,)) {
        let bytes = view.call_method0("tobytes")?;
        return Ok(bytes.cast::<PyBytes>()?.as_bytes().to_vec());
    }
    data.extract::<Vec<u8>>().map_err(|_| wrong())
}

/// `size` bytes (by default the rest of `tensor` from `offset`) filled by `read`, with the
/// interpreter released, as a bytes object.
fn read_raw_bytes<'py>(
    py: Python<'py>,
    tensor: &Tensor,
    offset: usize,
    size: Option<usize>,
    read: impl FnOnce(&mut [u8]) -> crate::Result<()> + Send,
) -> PyResult<Bound<'py, PyBytes>> {
    let size = size.unwrap_or_else(|| tensor.nbytes().saturating_sub(offset));
    // Checked before the output is allocated: `size` is the caller's number.
    tensor.check_byte_range(offset, size, "read")?;
    let mut out = vec![0u8; size];
    py.detach(|| read(&mut out))?;
    Ok(PyBytes::new(py, &out))
}

/// The outcome of a computation on `backends`: the exception an abort callback raised (the
/// original one) when it stopped it, else the error or status.
pub(crate) fn finish_compute(
    py: Python<'_>,
    backends: &[Arc<dyn Backend>],
    result: crate::Result<Status>,
) -> PyResult<()> {
    match result {
        Ok(Status::Success) => {
            // A callback that raised after the last node: still the caller's to see.
            raise_callback_error(py, backends)
        }
        Ok(status) => {
            raise_callback_error(py, backends)?;
            check_status(status)
        }
        Err(err) => {
            raise_callback_error(py, backends)?;
            Err(err.into())
        }
    }
}

/// Raises `AbortedError` for an aborted status and `BackendError` for a failed one.
pub(crate) fn check_status(status: Status) -> PyResult<()> {
    match status {
        Status::Success => Ok(()),
        Status::Aborted => Err(Error::Aborted.into()),
        other => Err(Error::Backend(other.to_string()).into()),
    }
}

/// The exception the process-wide abort callback raised, for the computation it stopped.
pub(crate) static GLOBAL_ABORT_ERROR: ErrorSlot = ErrorSlot::new();

/// Per backend (by address): the exception its abort callback raised. The table holds the
/// slots weakly; the callback installed on the backend holds the only strong handle, so a
/// slot goes away with its backend (or when the callback is replaced) and dead entries are
/// pruned on every insertion: the table does not grow with the number of backends made.
static BACKEND_ABORT_ERRORS: std::sync::Mutex<Vec<(usize, std::sync::Weak<ErrorSlot>)>> =
    std::sync::Mutex::new(Vec::new());

fn backend_key(backend: &Arc<dyn Backend>) -> usize {
    Arc::as_ptr(backend) as *const u8 as usize
}

/// The error slot of `backend`'s abort callback (made on first use). The caller moves it
/// into the callback it installs on the backend, which keeps it alive.
fn backend_abort_slot(backend: &Arc<dyn Backend>) -> Arc<ErrorSlot> {
    let key = backend_key(backend);
    let mut slots = BACKEND_ABORT_ERRORS
        .lock()
        .unwrap_or_else(|p| p.into_inner());
    // An address may be reused by a later backend once the first is gone: only live
    // entries count.
    slots.retain(|(_, slot)| slot.strong_count() > 0);
    if let Some(slot) = slots
        .iter()
        .find(|(k, _)| *k == key)
        .and_then(|(_, s)| s.upgrade())
    {
        return slot;
    }
    let slot = Arc::new(ErrorSlot::default());
    slots.push((key, Arc::downgrade(&slot)));
    slot
}

/// How many per-backend abort slots are alive (for leak tests).
#[pyfunction(name = "_abort_slot_count")]
fn abort_slot_count() -> usize {
    let mut slots = BACKEND_ABORT_ERRORS
        .lock()
        .unwrap_or_else(|p| p.into_inner());
    slots.retain(|(_, slot)| slot.strong_count() > 0);
    slots.len()
}

/// Raises the exception an abort callback (the global one, or one of `backends`') raised
/// during the computation that just stopped; Ok when none did.
pub(crate) fn raise_callback_error(_py: Python<'_>, backends: &[Arc<dyn Backend>]) -> PyResult<()> {
    let mut first = GLOBAL_ABORT_ERROR.take();
    let slots: Vec<Arc<ErrorSlot>> = {
        let all = BACKEND_ABORT_ERRORS
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        backends
            .iter()
            .filter_map(|b| {
                let key = backend_key(b);
                all.iter()
                    .find(|(k, s)| *k == key && s.strong_count() > 0)
                    .and_then(|(_, s)| s.upgrade())
            })
            .collect()
    };
    for slot in slots {
        if let Some(err) = slot.take() {
            first.get_or_insert(err);
        }
    }
    match first {
        Some(err) => Err(err),
        None => Ok(()),
    }
}

/// Wraps a Python callable as an abort callback: it is polled between nodes, and a true result
/// stops the computation (AbortedError). An exception stops it too and is kept in `slot`, so
/// the call that started the computation raises it.
pub(crate) fn python_abort_callback(
    callable: Py<PyAny>,
    slot: &'static ErrorSlot,
) -> crate::registry::AbortCallback {
    abort_callback_into(callable, move |err| slot.store(err))
}

fn abort_callback_into(
    callable: Py<PyAny>,
    keep: impl Fn(PyErr) + Send + Sync + 'static,
) -> crate::registry::AbortCallback {
    Arc::new(move || {
        Python::attach(|py| {
            let _scope = CallbackScope::enter();
            match callable.call0(py).and_then(|r| r.bind(py).is_truthy()) {
                Ok(stop) => stop,
                Err(err) => {
                    keep(err);
                    true
                }
            }
        })
    })
}

/// A stream of work on a device: tensor transfers, graph computation, plans.
#[pyclass(name = "Backend", module = "ferrograph", frozen)]
pub struct PyBackend {
    pub(crate) inner: Arc<dyn Backend>,
}

impl PyBackend {
    fn compute(&self, py: Python<'_>, graph: &PyGraph, wait: bool) -> PyResult<()> {
        let backend = self.inner.clone();
        let graph = graph.inner.clone();
        let result = detach_quiet(py, || {
            guard("Backend.graph_compute", || {
                if wait {
                    backend.graph_compute(&graph)
                } else {
                    backend.graph_compute_async(&graph)
                }
            })
        });
        finish_compute(py, std::slice::from_ref(&self.inner), result)
    }
}

#[pymethods]
impl PyBackend {
    /// Short name (`"CPU"`).
    #[getter]
    fn name(&self) -> String {
        self.inner.name().to_owned()
    }

    /// The implementation's 16-byte GUID.
    #[getter]
    fn guid<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &self.inner.guid())
    }

    /// The device the backend runs on.
    #[getter]
    fn device(&self) -> PyDevice {
        PyDevice {
            inner: self.inner.device(),
        }
    }

    /// Whether this is a CPU backend.
    #[getter]
    fn is_cpu(&self) -> bool {
        as_cpu(self.inner.as_ref()).is_ok()
    }

    /// The buffer type the backend computes on by default.
    #[getter]
    fn default_buffer_type(&self) -> PyBufferType {
        PyBufferType {
            inner: self.inner.default_buffer_type(),
        }
    }

    /// Alignment of the default buffer type.
    #[getter]
    fn alignment(&self) -> usize {
        self.inner.alignment()
    }

    /// Largest buffer of the default type.
    #[getter]
    fn max_size(&self) -> usize {
        self.inner.max_size()
    }

    /// Allocates a buffer of the default type.
    fn alloc_buffer(&self, py: Python<'_>, size: usize) -> PyResult<PyBuffer> {
        let backend = self.inner.clone();
        Ok(PyBuffer {
            inner: py.detach(|| backend.alloc_buffer(size))?,
        })
    }

    /// Threads the CPU backend uses (settable). BackendError on other backends.
    #[getter]
    fn get_n_threads(&self, py: Python<'_>) -> PyResult<usize> {
        let backend = self.inner.clone();
        // The pool's lock is a core lock: never waited for with the interpreter held.
        Ok(py.detach(|| as_cpu(backend.as_ref()).map(|cpu| cpu.n_threads()))?)
    }

    #[setter]
    fn set_n_threads(&self, py: Python<'_>, n_threads: usize) -> PyResult<()> {
        check_n_threads(n_threads)?;
        let backend = self.inner.clone();
        detach_quiet(py, || as_cpu(backend.as_ref())?.set_n_threads(n_threads))?;
        Ok(())
    }

    /// Whether the CPU backend runs the scalar reference kernels (settable; for tests).
    #[getter]
    fn get_use_reference(&self) -> PyResult<bool> {
        Ok(as_cpu(self.inner.as_ref())?.use_reference())
    }

    #[setter]
    fn set_use_reference(&self, on: bool) -> PyResult<()> {
        as_cpu(self.inner.as_ref())?.set_use_reference(on);
        Ok(())
    }

    /// Installs (or with None clears) an abort callback: a callable polled between nodes;
    /// returning True stops the computation, which then raises `AbortedError`. The backend
    /// stays usable.
    /// An exception the callback raises stops the computation too, and `graph_compute`
    /// re-raises it. Anything but a callable or None is rejected.
    #[pyo3(signature = (callback))]
    fn set_abort_callback(&self, py: Python<'_>, callback: Option<Py<PyAny>>) -> PyResult<()> {
        if let Some(cb) = &callback {
            super::utils::check_callable(cb.bind(py), "set_abort_callback")?;
        }
        let backend = self.inner.clone();
        let slot = backend_abort_slot(&backend);
        let callback = callback.map(|cb| abort_callback_into(cb, move |err| slot.store(err)));
        py.detach(|| -> crate::Result<()> {
            as_cpu(backend.as_ref())?.set_abort_callback(callback);
            Ok(())
        })?;
        Ok(())
    }

    /// Computes every node of `graph` and waits. Raises `AbortedError` when an abort callback
    /// stopped it and `UnsupportedOpError` for an op the backend lacks.
    fn graph_compute(&self, py: Python<'_>, graph: &PyGraph) -> PyResult<()> {
        self.compute(py, graph, true)
    }

    /// Queues the computation of `graph`; `synchronize()` waits for it.
    fn graph_compute_async(&self, py: Python<'_>, graph: &PyGraph) -> PyResult<()> {
        self.compute(py, graph, false)
    }

    /// Waits for all queued work.
    fn synchronize(&self, py: Python<'_>) -> PyResult<()> {
        let backend = self.inner.clone();
        py.detach(|| backend.synchronize())?;
        Ok(())
    }

    /// Prepares `graph` for repeated computation.
    fn graph_plan_create(&self, graph: &PyGraph) -> PyResult<PyGraphPlan> {
        let plan = self.inner.graph_plan_create(&graph.inner)?;
        Ok(PyGraphPlan {
            backend: self.inner.clone(),
            plan: CoreLock::new(Some(plan), "the GraphPlan"),
        })
    }

    /// Writes the bytes of a numpy array (or bytes) into `tensor` at byte `offset`, possibly
    /// queued; the data is copied before the call returns.
    #[pyo3(signature = (tensor, data, offset = 0))]
    fn set_tensor_async(
        &self,
        py: Python<'_>,
        tensor: &PyTensor,
        data: &Bound<'_, PyAny>,
        offset: usize,
    ) -> PyResult<()> {
        let (backend, t) = (self.inner.clone(), tensor.inner.clone());
        with_raw_bytes(py, data, |bytes| {
            backend.set_tensor_async(&t, offset, bytes)
        })
    }

    /// Reads `size` bytes of `tensor` at `offset` (all of it by default) as bytes.
    #[pyo3(signature = (tensor, offset = 0, size = None))]
    fn get_tensor_async<'py>(
        &self,
        py: Python<'py>,
        tensor: &PyTensor,
        offset: usize,
        size: Option<usize>,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let (backend, t) = (self.inner.clone(), tensor.inner.clone());
        read_raw_bytes(py, &t, offset, size, |out| {
            backend.get_tensor_async(&t, offset, out)
        })
    }

    /// Whether the backend computes the op producing `tensor`.
    fn supports_op(&self, tensor: &PyTensor) -> PyResult<bool> {
        // A Python device's failure or non-bool answer is raised here (BackendError).
        Ok(super::plugin::checked(|| {
            self.inner.supports_op(&tensor.inner)
        })?)
    }

    /// Whether the backend can use memory of `buffer_type`.
    fn supports_buft(&self, buffer_type: &PyBufferType) -> bool {
        self.inner.supports_buft(buffer_type.inner.as_ref())
    }

    /// Whether the scheduler should move this op here although its weights are in host memory.
    fn offload_op(&self, tensor: &PyTensor) -> bool {
        self.inner.offload_op(&tensor.inner)
    }

    fn __eq__(&self, other: &Bound<'_, PyAny>) -> bool {
        other
            .cast::<PyBackend>()
            .is_ok_and(|o| Arc::ptr_eq(&o.get().inner, &self.inner))
    }

    fn __hash__(&self) -> u64 {
        Arc::as_ptr(&self.inner) as *const u8 as usize as u64
    }

    fn __repr__(&self) -> String {
        match as_cpu(self.inner.as_ref()) {
            Ok(cpu) => format!("Backend(name='CPU', n_threads={})", cpu.n_threads()),
            Err(_) => format!(
                "Backend(name={:?}, device={:?})",
                self.inner.name(),
                self.inner.device().name()
            ),
        }
    }
}

/// A prepared computation of one graph on one backend.
#[pyclass(name = "GraphPlan", module = "ferrograph", frozen)]
pub struct PyGraphPlan {
    backend: Arc<dyn Backend>,
    plan: CoreLock<Option<Box<dyn GraphPlan>>>,
}

impl PyGraphPlan {
    /// Runs `f` on the plan under the rules of `lock.rs`; StaleTensorError once freed.
    fn with_plan<T: Send>(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&mut Box<dyn GraphPlan>) -> crate::Result<T> + Send,
    ) -> PyResult<T> {
        let result = self.plan.with(py, |guard| match guard.as_mut() {
            Some(plan) => f(plan),
            None => Err(Error::Stale("the graph plan was freed".into())),
        })?;
        Ok(result?)
    }
}

#[pymethods]
impl PyGraphPlan {
    /// Scratch bytes the plan reserves.
    #[getter]
    fn work_size(&self, py: Python<'_>) -> PyResult<usize> {
        self.with_plan(py, |plan| Ok(plan.work_size()))
    }

    /// Computes the plan's graph.
    fn compute(&self, py: Python<'_>) -> PyResult<()> {
        let backend = self.backend.clone();
        let result = self.plan.with(py, |guard| match guard.as_mut() {
            Some(plan) => guard_compute(&backend, plan.as_ref()),
            None => Err(Error::Stale("the graph plan was freed".into())),
        })?;
        finish_compute(py, std::slice::from_ref(&self.backend), result)
    }

    /// Points the plan at another graph of the same structure.
    fn update(&self, py: Python<'_>, graph: &PyGraph) -> PyResult<()> {
        let backend = self.backend.clone();
        let graph = graph.inner.clone();
        self.with_plan(py, |plan| backend.graph_plan_update(plan, &graph))
    }

    /// Releases the plan; using it afterwards raises `StaleTensorError`.
    fn free(&self, py: Python<'_>) -> PyResult<()> {
        self.plan.with(py, |plan| *plan = None)
    }

    fn __repr__(&self, py: Python<'_>) -> String {
        match self.work_size(py) {
            Ok(work) => format!(
                "GraphPlan(backend={:?}, work_size={work})",
                self.backend.name()
            ),
            Err(_) => "GraphPlan(freed)".to_owned(),
        }
    }
}

fn guard_compute(backend: &Arc<dyn Backend>, plan: &dyn GraphPlan) -> crate::Result<Status> {
    guard("GraphPlan.compute", || backend.graph_plan_compute(plan))
}

/// A synchronisation point between backends.
#[pyclass(name = "Event", module = "ferrograph", frozen)]
pub struct PyEvent {
    inner: Arc<dyn Event>,
}

#[pymethods]
impl PyEvent {
    /// Marks the point in `backend`'s queue the event stands for.
    fn record(&self, backend: &PyBackend) -> PyResult<()> {
        self.inner.record(backend.inner.as_ref())?;
        Ok(())
    }

    /// Blocks until the recorded work is done.
    fn synchronize(&self, py: Python<'_>) -> PyResult<()> {
        let event = self.inner.clone();
        py.detach(|| event.synchronize())?;
        Ok(())
    }

    /// Makes `backend` wait for the event before its later work.
    fn wait(&self, backend: &PyBackend) -> PyResult<()> {
        self.inner.wait(backend.inner.as_ref())?;
        Ok(())
    }

    fn __repr__(&self) -> &'static str {
        "Event()"
    }
}

/// A backend registration: one implementation and its devices.
#[pyclass(name = "Registration", module = "ferrograph", frozen)]
pub struct PyRegistration {
    pub(crate) inner: Arc<dyn Registration>,
}

#[pymethods]
impl PyRegistration {
    /// The registration's name (`"CPU"`).
    #[getter]
    fn name(&self) -> String {
        self.inner.name().to_owned()
    }

    /// Its devices.
    fn devices(&self) -> Vec<PyDevice> {
        self.inner
            .devices()
            .into_iter()
            .map(|inner| PyDevice { inner })
            .collect()
    }

    /// Number of devices.
    #[getter]
    fn dev_count(&self) -> usize {
        self.inner.devices().len()
    }

    /// Whether the registration provides the named extension function (ggml's
    /// `get_proc_address`): "set_n_threads", "set_abort_callback", "get_features",
    /// "dev_get_extra_bufts", or the same under ggml's names ("ggml_backend_set_n_threads",
    /// "ggml_backend_set_abort_callback", "ggml_backend_get_features",
    /// "ggml_backend_dev_get_extra_bufts").
    fn has_proc(&self, name: &str) -> bool {
        registry::proc_address(self.inner.as_ref(), name).is_some()
    }

    /// Installs (or with None clears) `backend`'s abort callback through the registration's
    /// "set_abort_callback" extension: as `Backend.set_abort_callback`, for any backend whose
    /// registration provides the extension. UnsupportedOpError when it does not.
    fn set_abort_callback(
        &self,
        py: Python<'_>,
        backend: &PyBackend,
        callback: Option<Py<PyAny>>,
    ) -> PyResult<()> {
        let Some(Extension::SetAbortCallback(set)) =
            registry::proc_address(self.inner.as_ref(), "set_abort_callback")
        else {
            return Err(Error::UnsupportedOp(format!(
                "registration {} has no set_abort_callback",
                self.inner.name()
            ))
            .into());
        };
        if let Some(cb) = &callback {
            super::utils::check_callable(cb.bind(py), "set_abort_callback")?;
        }
        let target = backend.inner.clone();
        let slot = backend_abort_slot(&target);
        let callback = callback.map(|cb| abort_callback_into(cb, move |err| slot.store(err)));
        py.detach(|| set(target.as_ref(), callback))?;
        Ok(())
    }

    /// The registration's features as a dict (its "get_features" extension), or {}.
    fn features<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        if let Some(Extension::Features(f)) =
            registry::proc_address(self.inner.as_ref(), "get_features")
        {
            for (k, v) in f() {
                d.set_item(k, v)?;
            }
        }
        Ok(d)
    }

    /// Extra buffer types its devices offer (its "dev_get_extra_bufts" extension), or [].
    fn extra_buffer_types(&self) -> Vec<PyBufferType> {
        match registry::proc_address(self.inner.as_ref(), "dev_get_extra_bufts") {
            Some(Extension::ExtraBufferTypes(f)) => f()
                .into_iter()
                .map(|inner| PyBufferType { inner })
                .collect(),
            _ => Vec::new(),
        }
    }

    /// Sets a backend's thread count through the registration's extension function.
    fn set_n_threads(&self, py: Python<'_>, backend: &PyBackend, n_threads: usize) -> PyResult<()> {
        check_n_threads(n_threads)?;
        match registry::proc_address(self.inner.as_ref(), "set_n_threads") {
            Some(Extension::SetThreadCount(f)) => {
                let backend = backend.inner.clone();
                // Resizing takes the backend's pool lock: never with the interpreter held.
                Ok(detach_quiet(py, || f(backend.as_ref(), n_threads))?)
            }
            _ => Err(Error::UnsupportedOp(format!(
                "registration {} has no set_n_threads",
                self.inner.name()
            ))
            .into()),
        }
    }

    fn __repr__(&self) -> String {
        format!(
            "Registration(name={:?}, devices={})",
            self.inner.name(),
            self.inner.devices().len()
        )
    }
}

/// Every registered device, in registration order.
#[pyfunction]
fn devices() -> Vec<PyDevice> {
    registry::devices()
        .into_iter()
        .map(|inner| PyDevice { inner })
        .collect()
}

/// Number of registered devices.
#[pyfunction]
fn dev_count() -> usize {
    registry::dev_count()
}

/// The device at `index` (OutOfBoundsError past the end).
#[pyfunction]
fn dev_get(index: usize) -> PyResult<PyDevice> {
    Ok(PyDevice {
        inner: registry::dev_get(index)?,
    })
}

/// The device with this name (case-insensitive), or None.
#[pyfunction]
fn dev_by_name(name: &str) -> Option<PyDevice> {
    registry::dev_by_name(name).map(|inner| PyDevice { inner })
}

/// The first device of this type, or None.
#[pyfunction]
fn dev_by_type(device_type: DeviceTypeArg) -> PyResult<Option<PyDevice>> {
    Ok(registry::dev_by_type(device_type.resolve()?).map(|inner| PyDevice { inner }))
}

/// Every registration, in order.
#[pyfunction]
fn registrations() -> Vec<PyRegistration> {
    registry::registrations()
        .into_iter()
        .map(|inner| PyRegistration { inner })
        .collect()
}

/// Number of registrations.
#[pyfunction]
fn reg_count() -> usize {
    registry::reg_count()
}

/// The registration at `index` (OutOfBoundsError past the end).
#[pyfunction]
fn reg_get(index: usize) -> PyResult<PyRegistration> {
    Ok(PyRegistration {
        inner: registry::reg_get(index)?,
    })
}

/// Adds one device to the registry on its own (ggml's `device_register`), e.g. a device of a
/// registration that is not itself registered. BackendError when a device of that name is
/// already registered.
#[pyfunction]
fn device_register(device: &PyDevice) -> PyResult<()> {
    registry::register_device(device.inner.clone())?;
    Ok(())
}

/// The registration with this name (case-insensitive), or None.
#[pyfunction]
fn reg_by_name(name: &str) -> Option<PyRegistration> {
    registry::reg_by_name(name).map(|inner| PyRegistration { inner })
}

/// ggml's parameter text with `n_threads` (if given) appended.
fn params_text(params: &str, n_threads: Option<usize>) -> PyResult<String> {
    let Some(n) = n_threads else {
        return Ok(params.to_owned());
    };
    check_n_threads(n)?;
    Ok(if params.trim().is_empty() {
        format!("n_threads={n}")
    } else {
        format!("{params},n_threads={n}")
    })
}

/// Opens a backend on the device with this name (case-insensitive), e.g. `"CPU"`.
/// BackendError names the known devices when there is none by that name.
#[pyfunction]
#[pyo3(signature = (name, params = "", n_threads = None))]
fn init_backend(name: &str, params: &str, n_threads: Option<usize>) -> PyResult<PyBackend> {
    let params = params_text(params, n_threads)?;
    Ok(PyBackend {
        inner: registry::init_by_name(name, &params)?,
    })
}

/// Opens a backend on the first device of this type.
#[pyfunction]
#[pyo3(signature = (device_type, params = "", n_threads = None))]
fn init_by_type(
    device_type: DeviceTypeArg,
    params: &str,
    n_threads: Option<usize>,
) -> PyResult<PyBackend> {
    let params = params_text(params, n_threads)?;
    Ok(PyBackend {
        inner: registry::init_by_type(device_type.resolve()?, &params)?,
    })
}

/// Opens the best backend: a GPU if present, else an integrated GPU, else the CPU.
#[pyfunction]
fn init_best() -> PyResult<PyBackend> {
    Ok(PyBackend {
        inner: registry::init_best()?,
    })
}

/// The CPU buffer type (aligned host memory).
#[pyfunction]
fn cpu_buffer_type() -> PyBufferType {
    PyBufferType {
        inner: crate::buffer::CpuBufferType::shared(),
    }
}

/// Keeps a numpy array alive while a buffer wraps its memory.
struct ArrayOwner(#[allow(dead_code)] Py<PyAny>);

/// The data address and byte size of a writable, C-contiguous numpy array of plain data (no
/// object pointers), for wrapping its memory in a buffer; `what` names the caller in errors.
fn host_array_memory(array: &Bound<'_, PyAny>, what: &str) -> PyResult<(usize, usize)> {
    if !is_ndarray(array)? {
        return Err(invalid(format!("{what} needs a numpy array")));
    }
    // Bytes written through the buffer would overwrite object pointers.
    check_plain_data(array)?;
    let flags = array.getattr("flags")?;
    if !flags.getattr("c_contiguous")?.is_truthy()? {
        return Err(invalid("the array must be C-contiguous"));
    }
    if !flags.getattr("writeable")?.is_truthy()? {
        return Err(invalid("the array must be writeable"));
    }
    let address: usize = array
        .getattr("__array_interface__")?
        .get_item("data")?
        .get_item(0)?
        .extract()?;
    let size: usize = array.getattr("nbytes")?.extract()?;
    Ok((address, size))
}

/// InvalidArgumentError unless a non-empty array's data at `address` is aligned to `alignment`.
fn check_array_alignment(address: usize, size: usize, alignment: usize) -> PyResult<()> {
    if size > 0 && !address.is_multiple_of(alignment.max(1)) {
        return Err(invalid(format!(
            "the array's data at {address:#x} is not aligned to {alignment} bytes, which this \
             buffer type needs; allocate it aligned (e.g. fg.aligned_empty) or copy it"
        )));
    }
    Ok(())
}

/// A CPU buffer over the memory of a writable, C-contiguous numpy array, without copying; the
/// buffer keeps the array alive. The array's data must be aligned to the CPU buffer type's
/// alignment (64 bytes); a misaligned array raises InvalidArgumentError with that figure.
#[pyfunction]
fn cpu_buffer_from_array(array: &Bound<'_, PyAny>) -> PyResult<PyBuffer> {
    let (address, size) = host_array_memory(array, "cpu_buffer_from_array")?;
    check_array_alignment(address, size, crate::buffer::HOST_ALIGNMENT)?;
    let owner: Box<dyn std::any::Any + Send + Sync> = Box::new(ArrayOwner(array.clone().unbind()));
    // SAFETY: the array is writeable and C-contiguous, so `address` points at `size` bytes it
    // owns; `owner` holds a strong reference to the array, which keeps that memory valid for as
    // long as the buffer lives. numpy cannot resize an array that has other references.
    let memory = unsafe { ForeignHostMemory::new(address as *mut u8, size, Some(owner))? };
    Ok(PyBuffer {
        inner: Buffer::new(Box::new(memory), crate::buffer::CpuBufferType::shared()),
    })
}

/// Writes raw bytes (a bytes object or a C-contiguous numpy array's memory) into `tensor` at
/// byte `offset` (ggml's `tensor_set`; bounds checked). `Tensor.set(array)` is the typed form.
#[pyfunction]
#[pyo3(signature = (tensor, data, offset = 0))]
fn tensor_set(
    py: Python<'_>,
    tensor: &PyTensor,
    data: &Bound<'_, PyAny>,
    offset: usize,
) -> PyResult<()> {
    let t = tensor.inner.clone();
    with_raw_bytes(py, data, |bytes| t.write_bytes(offset, bytes))
}

/// Reads `size` bytes of `tensor` at byte `offset` (all of it by default) as bytes (ggml's
/// `tensor_get`; bounds checked). `Tensor.numpy()` is the typed form.
#[pyfunction]
#[pyo3(signature = (tensor, offset = 0, size = None))]
fn tensor_get<'py>(
    py: Python<'py>,
    tensor: &PyTensor,
    offset: usize,
    size: Option<usize>,
) -> PyResult<Bound<'py, PyBytes>> {
    let t = tensor.inner.clone();
    read_raw_bytes(py, &t, offset, size, |out| t.read_bytes(offset, out))
}

/// Sets `size` bytes of `tensor` at `offset` (all of it by default) to `value`.
#[pyfunction]
#[pyo3(signature = (tensor, value = 0, offset = 0, size = None))]
fn tensor_memset(tensor: &PyTensor, value: u8, offset: usize, size: Option<usize>) -> PyResult<()> {
    let size = size.unwrap_or_else(|| tensor.inner.nbytes().saturating_sub(offset));
    tensor.inner.fill_bytes(offset, size, value)?;
    Ok(())
}

/// Copies `src` into `dst` (same dtype, shape and strides) across any two buffers.
#[pyfunction]
fn tensor_copy(py: Python<'_>, src: &PyTensor, dst: &PyTensor) -> PyResult<()> {
    let (s, d) = (src.inner.clone(), dst.inner.clone());
    py.detach(|| crate::backend::tensor_copy(&s, &d))?;
    Ok(())
}

/// Queues a copy of `src` (on `src_backend`) into `dst` (on `dst_backend`), falling back to a
/// synchronous copy where the backends cannot do it asynchronously.
#[pyfunction]
fn tensor_copy_async(
    py: Python<'_>,
    src_backend: &PyBackend,
    dst_backend: &PyBackend,
    src: &PyTensor,
    dst: &PyTensor,
) -> PyResult<()> {
    let (sb, db) = (src_backend.inner.clone(), dst_backend.inner.clone());
    let (s, d) = (src.inner.clone(), dst.inner.clone());
    py.detach(|| crate::backend::tensor_copy_async(sb.as_ref(), db.as_ref(), &s, &d))?;
    Ok(())
}

/// Registers the classes and functions.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(abort_slot_count, m)?)?;
    m.add_function(wrap_pyfunction!(tensor_set, m)?)?;
    m.add_function(wrap_pyfunction!(tensor_get, m)?)?;
    m.add_function(wrap_pyfunction!(tensor_memset, m)?)?;
    m.add_function(wrap_pyfunction!(tensor_copy, m)?)?;
    m.add_function(wrap_pyfunction!(tensor_copy_async, m)?)?;
    m.add_class::<PyDeviceType>()?;
    m.add_class::<PyBufferUsage>()?;
    m.add_class::<PyBufferType>()?;
    m.add_class::<PyBuffer>()?;
    m.add_class::<PyDevice>()?;
    m.add_class::<PyBackend>()?;
    m.add_class::<PyGraphPlan>()?;
    m.add_class::<PyEvent>()?;
    m.add_class::<PyRegistration>()?;
    m.add_function(wrap_pyfunction!(devices, m)?)?;
    m.add_function(wrap_pyfunction!(dev_count, m)?)?;
    m.add_function(wrap_pyfunction!(dev_get, m)?)?;
    m.add_function(wrap_pyfunction!(dev_by_name, m)?)?;
    m.add_function(wrap_pyfunction!(dev_by_type, m)?)?;
    m.add_function(wrap_pyfunction!(registrations, m)?)?;
    m.add_function(wrap_pyfunction!(reg_by_name, m)?)?;
    m.add_function(wrap_pyfunction!(reg_count, m)?)?;
    m.add_function(wrap_pyfunction!(reg_get, m)?)?;
    m.add_function(wrap_pyfunction!(device_register, m)?)?;
    m.add_function(wrap_pyfunction!(init_backend, m)?)?;
    m.add_function(wrap_pyfunction!(init_by_type, m)?)?;
    m.add_function(wrap_pyfunction!(init_best, m)?)?;
    m.add_function(wrap_pyfunction!(cpu_buffer_type, m)?)?;
    m.add_function(wrap_pyfunction!(cpu_buffer_from_array, m)?)?;
    Ok(())
}
