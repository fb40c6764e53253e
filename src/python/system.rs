//! Library and machine information: version, CPU features, SIMD path.

use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::convert;
use crate::cpu::features::{self, CpuFeatures};

/// The library version (`Cargo.toml`'s).
#[pyfunction]
fn version() -> &'static str {
    crate::VERSION
}

/// A one-line summary of the CPU features ferrograph detected (ggml's `system_info`).
#[pyfunction]
fn system_info() -> String {
    features::system_info()
}

/// The detected CPU features, `{name: bool}` in detection order.
#[pyfunction]
fn cpu_features(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    let dict = PyDict::new(py);
    for (name, present) in CpuFeatures::detect().as_pairs() {
        dict.set_item(name, present)?;
    }
    Ok(dict)
}

/// The conversion path chosen at run time for this machine (e.g. `"avx2+f16c"`).
#[pyfunction]
fn simd_path() -> &'static str {
    convert::simd_path()
}

/// Registers the system functions.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(version, m)?)?;
    m.add_function(wrap_pyfunction!(system_info, m)?)?;
    m.add_function(wrap_pyfunction!(cpu_features, m)?)?;
    m.add_function(wrap_pyfunction!(simd_path, m)?)?;
    Ok(())
}
