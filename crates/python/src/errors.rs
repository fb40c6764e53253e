//! Maps [`ferrograph::Error`] variants to the exception classes of `ferrograph.errors`.
//!
//! The classes are defined in Python (`python/ferrograph/errors.py`) so that they are ordinary,
//! picklable, documented classes with the right builtin bases (`ShapeError` is also a
//! `ValueError`, ...). They are imported once per interpreter and cached.

use std::panic::{catch_unwind, AssertUnwindSafe};

use pyo3::exceptions::{
    PyIndexError, PyMemoryError, PyNotImplementedError, PyRuntimeError, PyTypeError, PyValueError,
};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::PyType;

use ferrograph::error::{Error, ErrorKind};

/// The exception classes, in the order of [`class_index`].
const CLASS_NAMES: [&str; 15] = [
    "Error",
    "ShapeError",
    "DTypeError",
    "AllocationError",
    "UnsupportedOpError",
    "BackendError",
    "OutOfBoundsError",
    "StaleTensorError",
    "NotAllocatedError",
    "AbortedError",
    "InvalidArgumentError",
    "ArgumentTypeError",
    "BusyError",
    "DeviceLostError",
    "GGUFError",
];

static CLASSES: PyOnceLock<Vec<Py<PyType>>> = PyOnceLock::new();

fn class_index(err: &Error) -> usize {
    // Index 0 is the base class; the kinds follow in `ErrorKind::ALL` order.
    1 + usize::from(err.kind().number())
}

/// Sets the facts of `err` (if it has any) as attributes of the exception `value`: `requested`,
/// `limit`, `buffer_type`; `op`, `dtypes`, `backend`; `offset`, `size`, `limit`; `names`,
/// `shapes`; `path`, `field`, `offset` (GGUF). The classes in errors.py declare them all as None
/// by default.
fn set_facts(value: &Bound<'_, PyAny>, err: &Error) -> PyResult<()> {
    match err {
        Error::AllocFailed {
            requested,
            limit,
            buffer_type,
            ..
        } => {
            value.setattr("requested", requested)?;
            value.setattr("limit", limit)?;
            value.setattr("buffer_type", buffer_type)?;
        }
        // Built from a message only (no op named): the facts stay None, as for any error
        // without them.
        Error::OpUnsupported { op: None, .. } => {}
        Error::OpUnsupported {
            op,
            dtypes,
            backend,
            ..
        } => {
            value.setattr("op", op)?;
            value.setattr("dtypes", pyo3::types::PyTuple::new(value.py(), dtypes)?)?;
            value.setattr("backend", backend)?;
        }
        Error::OutOfRange {
            offset,
            size,
            limit,
            ..
        } => {
            value.setattr("offset", offset)?;
            value.setattr("size", size)?;
            value.setattr("limit", limit)?;
        }
        Error::ShapeMismatch { shapes, .. } if shapes.is_empty() => {}
        Error::ShapeMismatch { names, shapes, .. } => {
            value.setattr("names", pyo3::types::PyTuple::new(value.py(), names)?)?;
            let shapes = shapes
                .iter()
                .map(|s| pyo3::types::PyTuple::new(value.py(), s))
                .collect::<PyResult<Vec<_>>>()?;
            value.setattr("shapes", pyo3::types::PyTuple::new(value.py(), shapes)?)?;
        }
        Error::Gguf {
            path,
            field,
            offset,
            ..
        } => {
            value.setattr("path", path)?;
            value.setattr("field", field)?;
            value.setattr("offset", offset)?;
        }
        _ => {}
    }
    Ok(())
}

fn classes(py: Python<'_>) -> PyResult<&Vec<Py<PyType>>> {
    CLASSES.get_or_try_init(py, || {
        let module = py.import("ferrograph.errors")?;
        CLASS_NAMES
            .iter()
            .map(|name| Ok(module.getattr(*name)?.cast_into::<PyType>()?.unbind()))
            .collect()
    })
}

/// The `ferrograph.errors` class for `err`, or a builtin stand-in when the Python package is
/// not importable (the native module loaded on its own).
fn to_pyerr_attached(py: Python<'_>, err: &Error) -> PyErr {
    let message = err.to_string();
    match classes(py) {
        Ok(classes) => {
            let class = classes[class_index(err)].bind(py);
            // The instance is made now (not lazily) so that the facts can be set on it.
            match class.call1((message.clone(),)) {
                Ok(value) => {
                    if let Err(e) = set_facts(&value, err) {
                        return e;
                    }
                    PyErr::from_value(value)
                }
                Err(_) => PyErr::from_type(class.clone(), message),
            }
        }
        Err(_) => match err.kind() {
            ErrorKind::Shape | ErrorKind::InvalidArgument | ErrorKind::Gguf => {
                PyValueError::new_err(message)
            }
            ErrorKind::DType | ErrorKind::ArgumentType => PyTypeError::new_err(message),
            ErrorKind::Alloc => PyMemoryError::new_err(message),
            ErrorKind::UnsupportedOp => PyNotImplementedError::new_err(message),
            ErrorKind::OutOfBounds => PyIndexError::new_err(message),
            _ => PyRuntimeError::new_err(message),
        },
    }
}

/// Turns core errors into Python exceptions: installed into the base crate's conversion hook
/// when the module loads ([`ferrograph::error::python::set_converter`]).
pub(crate) fn convert_error(err: &Error) -> PyErr {
    // A Python exception the error carries (a custom op's, a plugin's) becomes __cause__.
    Python::attach(|py| super::raised::restore(py, to_pyerr_attached(py, err)))
}

/// Shorthand for raising a ferrograph error class from binding code.
pub(crate) fn shape(message: impl Into<String>) -> PyErr {
    Error::shape(message.into()).into()
}

/// Shorthand for `DTypeError`.
pub(crate) fn dtype(message: impl Into<String>) -> PyErr {
    Error::DType(message.into()).into()
}

/// Shorthand for `InvalidArgumentError`.
pub(crate) fn invalid(message: impl Into<String>) -> PyErr {
    Error::InvalidArgument(message.into()).into()
}

/// The message of a caught panic payload.
pub(crate) fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_owned()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "unknown panic".to_owned()
    }
}

/// Runs `f` (a kernel, a conversion, a user callback) and turns a panic into
/// [`Error::Backend`], so no panic unwinds into Python.
pub(crate) fn guard<T>(
    what: &str,
    f: impl FnOnce() -> ferrograph::Result<T>,
) -> ferrograph::Result<T> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(result) => result,
        Err(payload) => Err(Error::Backend(format!(
            "internal error in {what}: {}",
            panic_message(payload.as_ref())
        ))),
    }
}

/// Names of the exception classes (for `_core.error_class_names()`, used by the tests that
/// check every variant has a class).
#[pyfunction]
pub(crate) fn error_class_names() -> Vec<&'static str> {
    CLASS_NAMES.to_vec()
}

/// Raises the exception class mapped from the Rust variant named `variant` (for tests of the
/// mapping: "Shape", "DType", "Alloc", "UnsupportedOp", "Backend", "OutOfBounds", "Stale",
/// "NotAllocated", "Aborted", "InvalidArgument", "ArgumentType", "Busy", "DeviceLost", "Gguf").
#[pyfunction]
fn raise_error(variant: &str, message: &str) -> PyResult<()> {
    let m = message.to_owned();
    let err = match variant {
        "Shape" => Error::shape(m),
        "DType" => Error::DType(m),
        "Alloc" => Error::alloc(m),
        "UnsupportedOp" => Error::unsupported(m),
        "Backend" => Error::Backend(m),
        "OutOfBounds" => Error::out_of_bounds(m),
        "Stale" => Error::Stale(m),
        "NotAllocated" => Error::NotAllocated(m),
        "Aborted" => Error::Aborted,
        "InvalidArgument" => Error::InvalidArgument(m),
        "ArgumentType" => Error::ArgumentType(m),
        "Busy" => Error::Busy(m),
        "DeviceLost" => Error::DeviceLost(m),
        "Gguf" => Error::gguf("test.gguf", "header.magic", Some(0), m),
        other => return Err(invalid(format!("unknown error variant {other:?}"))),
    };
    Err(err.into())
}

/// A function that panics inside [`guard`] (for the test that panics become `fg.Error`).
#[pyfunction(name = "panic")]
fn panic_in_guard() -> PyResult<()> {
    guard("a test", || -> ferrograph::Result<()> {
        panic!("deliberate test panic")
    })?;
    Ok(())
}

/// Registers the helper functions.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(error_class_names, m)?)?;
    Ok(())
}

/// Registers the test hooks (`raise_error`, `panic`) in `ferrograph._core._testing`.
pub(crate) fn register_testing(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(raise_error, m)?)?;
    m.add_function(wrap_pyfunction!(panic_in_guard, m)?)?;
    Ok(())
}
