//! Element types across the boundary.
//!
//! Python's `ferrograph.DType` (in `dtypes.py`) is the user-facing class; the native module
//! accepts anything that names a type (`"f16"`, `"float16"`, `np.float16`, `np.dtype(...)`, a
//! `DType`) and returns `DType` singletons.

use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyString, PyType};

use ferrograph::dtype::DType;

/// A dtype argument: any accepted spelling, resolved to [`DType`].
#[derive(Clone, Copy, Debug)]
pub(crate) struct DTypeArg(pub DType);

/// Resolves any dtype spelling to a [`DType`].
pub(crate) fn resolve(obj: &Bound<'_, PyAny>) -> PyResult<DType> {
    if let Ok(s) = obj.cast::<PyString>() {
        return Ok(DType::from_name(&s.to_cow()?)?);
    }
    // Our own DType objects carry their ggml name.
    if let Ok(name) = obj.getattr(pyo3::intern!(obj.py(), "__ferrograph_dtype__")) {
        if let Ok(name) = name.extract::<String>() {
            return Ok(DType::from_name(&name)?);
        }
    }
    // numpy types, dtypes and anything numpy.dtype() understands.
    let numpy = obj.py().import("numpy")?;
    let dtype = numpy.getattr("dtype")?.call1((obj,)).map_err(|_| {
        super::errors::dtype(format!(
            "{} does not name a dtype",
            obj.repr().map(|r| r.to_string()).unwrap_or_default()
        ))
    })?;
    let name: String = dtype.getattr("name")?.extract()?;
    Ok(DType::from_name(&name)?)
}

impl<'a, 'py> FromPyObject<'a, 'py> for DTypeArg {
    type Error = PyErr;

    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        resolve(&obj.to_owned()).map(DTypeArg)
    }
}

static DTYPE_CLASS: PyOnceLock<Py<PyType>> = PyOnceLock::new();

/// The `ferrograph.DType` singleton for `dtype` (its short name if the package is missing).
pub(crate) fn to_py(py: Python<'_>, dtype: DType) -> PyResult<Bound<'_, PyAny>> {
    match DTYPE_CLASS.import(py, "ferrograph.dtypes", "DType") {
        Ok(class) => class.call1((dtype.name(),)),
        Err(_) => Ok(PyString::new(py, dtype.name()).into_any()),
    }
}

/// Facts about a dtype: `(name, numpy_name or None, type_size, block_size, is_quantized)`.
#[pyfunction]
fn dtype_info(dtype: DTypeArg) -> (&'static str, Option<&'static str>, usize, usize, bool) {
    let d = dtype.0;
    (
        d.name(),
        d.numpy_name(),
        d.type_size(),
        d.block_size(),
        d.is_quantized(),
    )
}

/// Bytes taken by a row of `n` elements of `dtype` (ShapeError if `n` is not a whole number
/// of blocks).
#[pyfunction]
fn dtype_row_size(dtype: DTypeArg, n: usize) -> PyResult<usize> {
    Ok(dtype.0.row_size(n)?)
}

/// The ggml names of every dtype, in declaration order.
#[pyfunction]
fn dtype_names() -> Vec<&'static str> {
    DType::ALL.iter().map(|d| d.name()).collect()
}

/// Registers the dtype helpers.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(dtype_info, m)?)?;
    m.add_function(wrap_pyfunction!(dtype_row_size, m)?)?;
    m.add_function(wrap_pyfunction!(dtype_names, m)?)?;
    Ok(())
}
