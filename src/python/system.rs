//! Library and machine information: version, CPU features, SIMD path.

use pyo3::prelude::*;
use pyo3::types::PyDict;

use numpy::{PyArray1, PyArrayMethods};

use super::dtype::DTypeArg;
use super::errors::invalid;
use crate::convert;
use crate::cpu::features::{self, CpuFeatures};
use crate::cpu::type_traits::type_traits;
use crate::error::Error;

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

/// The CPU type traits of `dtype` (ggml's `get_type_traits_cpu`): `(has_from_float,
/// has_vec_dot, vec_dot_type name, nrows)`.
#[pyfunction]
fn cpu_type_traits(dtype: DTypeArg) -> (bool, bool, &'static str, usize) {
    let t = type_traits(dtype.0);
    (
        t.from_float.is_some(),
        t.vec_dot.is_some(),
        t.vec_dot_type.name(),
        t.nrows,
    )
}

/// Converts a 1-d f32 array into a row of `dtype` with the CPU's `from_float`; returns its
/// bytes as a uint8 array.
#[pyfunction]
fn cpu_from_float<'py>(
    py: Python<'py>,
    dtype: DTypeArg,
    x: &Bound<'py, PyAny>,
) -> PyResult<Bound<'py, PyArray1<u8>>> {
    let x = x.cast::<PyArray1<f32>>().map_err(|_| {
        let got = super::convert::dtype_name(x)
            .map(|d| format!("a {d} array"))
            .unwrap_or_else(|_| super::utils::type_name(x));
        super::errors::dtype(format!(
            "cpu_from_float needs a 1-d float32 array, got {got}"
        ))
    })?;
    let x = x.readonly();
    let t = type_traits(dtype.0);
    let from_float = t.from_float.ok_or_else(|| {
        Error::UnsupportedOp(format!("the CPU cannot convert f32 to {}", dtype.0.name()))
    })?;
    let x = x.as_slice().map_err(|_| invalid("x must be contiguous"))?;
    let mut out = vec![0u8; dtype.0.row_size(x.len())?];
    from_float(x, &mut out)?;
    Ok(PyArray1::from_vec(py, out))
}

/// The CPU's dot product of `n` elements: `x` a row of `dtype`, `y` a row of its
/// `vec_dot_type` (bytes, e.g. from `cpu_from_float`).
#[pyfunction]
fn cpu_vec_dot(dtype: DTypeArg, n: usize, x: &[u8], y: &[u8]) -> PyResult<f32> {
    let t = type_traits(dtype.0);
    let vec_dot = t.vec_dot.ok_or_else(|| {
        Error::UnsupportedOp(format!("the CPU has no dot product for {}", dtype.0.name()))
    })?;
    Ok(vec_dot(n, x, y)?)
}

/// Registers the system functions.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(version, m)?)?;
    m.add_function(wrap_pyfunction!(system_info, m)?)?;
    m.add_function(wrap_pyfunction!(cpu_features, m)?)?;
    m.add_function(wrap_pyfunction!(simd_path, m)?)?;
    m.add_function(wrap_pyfunction!(cpu_type_traits, m)?)?;
    m.add_function(wrap_pyfunction!(cpu_from_float, m)?)?;
    m.add_function(wrap_pyfunction!(cpu_vec_dot, m)?)?;
    Ok(())
}
