//! Python classes for memory: `BufferUsage`, `BufferType`, `Buffer`, and the CPU buffer
//! functions (`fg.cpu_buffer_type()`, `fg.cpu_buffer_from_array(array)`).
//!
//! A `Buffer` is a handle on the core's shared [`Buffer`], so Python can never free memory the
//! core still uses.

use std::sync::Arc;

use pyo3::prelude::*;
use pyo3::types::PyBytes;

use super::PyDevice;
use crate::convert::{check_plain_data, is_ndarray, DETACH_THRESHOLD};
use crate::errors::invalid;
use crate::tensor::PyTensor;
use crate::tensor_raw::with_raw_bytes;
use ferrograph::buffer::{Buffer, BufferType, BufferUsage, ForeignHostMemory};

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
#[pyclass(name = "BufferType", module = "ferrograph", frozen, subclass)]
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
        Ok(crate::plugin::checked(|| {
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
            ferrograph::alloc::view_init(&tensor.inner)?;
        } else {
            ferrograph::alloc::tensor_alloc(&tensor.inner, &self.inner, offset)?;
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

/// The CPU buffer type (aligned host memory).
#[pyfunction]
fn cpu_buffer_type() -> PyBufferType {
    PyBufferType {
        inner: ferrograph::buffer::CpuBufferType::shared(),
    }
}

/// Keeps a numpy array alive while a buffer wraps its memory.
pub(super) struct ArrayOwner(#[allow(dead_code)] pub(super) Py<PyAny>);

/// The data address and byte size of a writable, C-contiguous numpy array of plain data (no
/// object pointers), for wrapping its memory in a buffer; `what` names the caller in errors.
pub(super) fn host_array_memory(array: &Bound<'_, PyAny>, what: &str) -> PyResult<(usize, usize)> {
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
pub(super) fn check_array_alignment(address: usize, size: usize, alignment: usize) -> PyResult<()> {
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
    check_array_alignment(address, size, ferrograph::buffer::HOST_ALIGNMENT)?;
    let owner: Box<dyn std::any::Any + Send + Sync> = Box::new(ArrayOwner(array.clone().unbind()));
    // SAFETY: the array is writeable and C-contiguous, so `address` points at `size` bytes it
    // owns; `owner` holds a strong reference to the array, which keeps that memory valid for as
    // long as the buffer lives. numpy cannot resize an array that has other references.
    let memory = unsafe { ForeignHostMemory::new(address as *mut u8, size, Some(owner))? };
    Ok(PyBuffer {
        inner: Buffer::new(
            Box::new(memory),
            ferrograph::buffer::CpuBufferType::shared(),
        ),
    })
}

/// Registers the classes and functions.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyBufferUsage>()?;
    m.add_class::<PyBufferType>()?;
    m.add_class::<PyBuffer>()?;
    m.add_function(wrap_pyfunction!(cpu_buffer_type, m)?)?;
    m.add_function(wrap_pyfunction!(cpu_buffer_from_array, m)?)?;
    Ok(())
}
