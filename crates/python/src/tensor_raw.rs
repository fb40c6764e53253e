//! Raw tensor memory from Python: ggml's `tensor_set` / `tensor_get` / `tensor_memset` /
//! `tensor_copy` (`_async`) on bytes, and the helpers that read and write raw bytes for them
//! and for `Buffer` and `Backend` transfers.

use numpy::PyArrayMethods;
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use super::backend::PyBackend;
use super::convert::{byte_view, check_plain_data, is_ndarray, numpy, DETACH_THRESHOLD};
use super::errors::invalid;
use super::tensor::PyTensor;
use ferrograph::tensor::Tensor;

/// Calls `write` with the raw bytes of `data`: a C-contiguous numpy array's memory (read in
/// place, the interpreter released for large arrays) or a bytes-like object.
pub(crate) fn with_raw_bytes(
    py: Python<'_>,
    data: &Bound<'_, PyAny>,
    write: impl FnOnce(&[u8]) -> ferrograph::Result<()> + Send,
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
pub(crate) fn bytes_of(data: &Bound<'_, PyAny>) -> PyResult<Vec<u8>> {
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
pub(crate) fn read_raw_bytes<'py>(
    py: Python<'py>,
    tensor: &Tensor,
    offset: usize,
    size: Option<usize>,
    read: impl FnOnce(&mut [u8]) -> ferrograph::Result<()> + Send,
) -> PyResult<Bound<'py, PyBytes>> {
    let size = size.unwrap_or_else(|| tensor.nbytes().saturating_sub(offset));
    // Checked before the output is allocated: `size` is the caller's number.
    tensor.check_byte_range(offset, size, "read")?;
    // Bytes that are not the tensor's value (see `Tensor::check_current`) are refused.
    tensor.check_current()?;
    let mut out = vec![0u8; size];
    py.detach(|| read(&mut out))?;
    Ok(PyBytes::new(py, &out))
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
    py.detach(|| ferrograph::backend::tensor_copy(&s, &d))?;
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
    py.detach(|| ferrograph::backend::tensor_copy_async(sb.as_ref(), db.as_ref(), &s, &d))?;
    Ok(())
}

/// Registers the classes and functions.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(tensor_set, m)?)?;
    m.add_function(wrap_pyfunction!(tensor_get, m)?)?;
    m.add_function(wrap_pyfunction!(tensor_memset, m)?)?;
    m.add_function(wrap_pyfunction!(tensor_copy, m)?)?;
    m.add_function(wrap_pyfunction!(tensor_copy_async, m)?)?;
    Ok(())
}
