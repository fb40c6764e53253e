//! Loading backend libraries at run time, and the BLAS accelerator, from Python.

use pyo3::prelude::*;
use pyo3::types::PyDict;

use super::backend::PyRegistration;
use super::lock::detach_quiet;

/// Loads the backend library at `path` (a `libferrograph_*.so` built from this version of
/// ferrograph with the same compiler) and registers its backend. BackendError explains a
/// library that is not a ferrograph backend, of another ABI, or unable to run here; the
/// registry is left as it was.
#[pyfunction]
fn load_backend(py: Python<'_>, path: std::path::PathBuf) -> PyResult<PyRegistration> {
    let inner = detach_quiet(py, || ferrograph::dynload::load(&path))?;
    Ok(PyRegistration { inner })
}

/// Unregisters a backend loaded from a library (the library itself stays mapped, since
/// objects it made may still be alive).
#[pyfunction]
fn unload_backend(py: Python<'_>, name: &str) -> PyResult<()> {
    detach_quiet(py, || ferrograph::dynload::unload(name))?;
    Ok(())
}

/// Loads every backend library found in `directory` (the best-scoring variant of each name);
/// returns the names registered. Files that are skipped are logged with the reason under the
/// `ferrograph` loggers.
#[pyfunction]
fn load_backends_from_path(py: Python<'_>, directory: std::path::PathBuf) -> PyResult<Vec<String>> {
    let loaded = detach_quiet(py, || ferrograph::dynload::load_all_from_path(&directory))?;
    Ok(loaded.iter().map(|r| r.name().to_owned()).collect())
}

/// Loads backend libraries from the standard places: each directory of
/// `FERROGRAPH_BACKEND_PATH`, the executable's directory and the current directory. Returns
/// the names registered.
#[pyfunction]
fn load_dynamic_backends(py: Python<'_>) -> Vec<String> {
    let loaded = detach_quiet(py, ferrograph::dynload::load_all);
    loaded.iter().map(|r| r.name().to_owned()).collect()
}

/// The backends loaded from libraries: [{"name", "path", "score"}].
#[pyfunction]
fn loaded_backends(py: Python<'_>) -> PyResult<Vec<Bound<'_, PyDict>>> {
    detach_quiet(py, ferrograph::dynload::loaded)
        .into_iter()
        .map(|b| {
            let d = PyDict::new(py);
            d.set_item("name", b.name)?;
            d.set_item("path", b.path)?;
            d.set_item("score", b.score)?;
            Ok(d)
        })
        .collect()
}

/// The directories `load_dynamic_backends()` searches, in order.
#[pyfunction]
fn backend_search_paths(py: Python<'_>) -> Vec<std::path::PathBuf> {
    detach_quiet(py, ferrograph::dynload::search_paths)
}

/// Whether a BLAS library was found (the BLAS accelerator can run).
#[pyfunction]
fn blas_available() -> bool {
    ferrograph::blas::is_available()
}

/// Why no BLAS library is available, or None when one is.
#[pyfunction]
fn blas_unavailable_reason() -> Option<String> {
    ferrograph::blas::unavailable_reason()
}

/// Registers the in-process BLAS accelerator backend (device "BLAS", type ACCEL). With no
/// BLAS library found it registers with no devices. BackendError if already registered.
#[pyfunction]
fn register_blas(py: Python<'_>) -> PyResult<()> {
    detach_quiet(py, ferrograph::blas::register)?;
    Ok(())
}

/// Registers the functions.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(load_backend, m)?)?;
    m.add_function(wrap_pyfunction!(unload_backend, m)?)?;
    m.add_function(wrap_pyfunction!(load_backends_from_path, m)?)?;
    m.add_function(wrap_pyfunction!(load_dynamic_backends, m)?)?;
    m.add_function(wrap_pyfunction!(loaded_backends, m)?)?;
    m.add_function(wrap_pyfunction!(backend_search_paths, m)?)?;
    m.add_function(wrap_pyfunction!(blas_available, m)?)?;
    m.add_function(wrap_pyfunction!(blas_unavailable_reason, m)?)?;
    m.add_function(wrap_pyfunction!(register_blas, m)?)?;
    Ok(())
}
