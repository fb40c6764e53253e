//! Library and machine information: version, CPU features, SIMD path.

use pyo3::prelude::*;
use pyo3::types::PyDict;

use numpy::{PyArray1, PyArrayMethods, PyUntypedArrayMethods};

use super::dtype::DTypeArg;
use super::errors::invalid;
use ferrograph::convert;
use ferrograph::cpu::features::{self, CpuFeatures, NumaStrategy};
use ferrograph::cpu::type_traits::type_traits;
use ferrograph::error::Error;
use ferrograph::pool::{ThreadPriority, ThreadpoolParams};

/// The library version (`Cargo.toml`'s).
#[pyfunction]
fn version() -> &'static str {
    ferrograph::VERSION
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
        Error::unsupported(format!("the CPU cannot convert f32 to {}", dtype.0.name()))
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
        Error::unsupported(format!("the CPU has no dot product for {}", dtype.0.name()))
    })?;
    Ok(vec_dot(n, x, y)?)
}

/// The measured f32 multiply-add peak of `n_threads` threads (default: the CPU backend's
/// default count), GFLOPS (see `ferrograph.cpu.fma_peak_gflops`). Runs without the
/// interpreter.
#[pyfunction]
#[pyo3(signature = (n_threads = None, seconds = 0.2))]
fn cpu_fma_peak_gflops(py: Python<'_>, n_threads: Option<usize>, seconds: f64) -> PyResult<f64> {
    let n = n_threads.unwrap_or_else(ferrograph::pool::default_n_threads);
    Ok(py.detach(|| ferrograph::cpu::fma_peak_gflops(n, seconds))?)
}

/// The measured peak of the integer GEMM's byte products of `n_threads` threads, giga-operations
/// per second (see `ferrograph.cpu.int8_peak_gops`). Runs without the interpreter.
#[pyfunction]
#[pyo3(signature = (n_threads = None, seconds = 0.2))]
fn cpu_int8_peak_gops(py: Python<'_>, n_threads: Option<usize>, seconds: f64) -> PyResult<f64> {
    let n = n_threads.unwrap_or_else(ferrograph::pool::default_n_threads);
    Ok(py.detach(|| ferrograph::cpu::int8_peak_gops(n, seconds))?)
}

/// The numeric CPU facts, `{"sve_cnt": bytes, "rvv_vlen": bytes}`: the SVE vector length on
/// AArch64 Linux and the RISC-V vector register length where the build targets the V extension;
/// 0 where the machine has no such vectors.
#[pyfunction]
fn cpu_feature_counts(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    let dict = PyDict::new(py);
    for (name, count) in CpuFeatures::detect().as_counts() {
        dict.set_item(name, count)?;
    }
    Ok(dict)
}

/// Records how compute threads are placed on a NUMA machine (ggml's `numa_init`):
/// "disabled", "distribute", "isolate", "numactl" or "mirror". Only the first call counts.
#[pyfunction]
#[pyo3(signature = (strategy = "distribute"))]
fn numa_init(strategy: &str) -> PyResult<()> {
    let strategy = match strategy.to_ascii_lowercase().as_str() {
        "disabled" => NumaStrategy::Disabled,
        "distribute" => NumaStrategy::Distribute,
        "isolate" => NumaStrategy::Isolate,
        "numactl" => NumaStrategy::Numactl,
        "mirror" => NumaStrategy::Mirror,
        other => {
            return Err(invalid(format!(
                "unknown NUMA strategy {other:?}; expected disabled, distribute, isolate, \
                 numactl or mirror"
            )))
        }
    };
    features::numa_init(strategy);
    Ok(())
}

/// Whether the machine has more than one NUMA node.
#[pyfunction]
fn is_numa() -> bool {
    features::is_numa()
}

/// Prepares the CPU backend now instead of on first use (ggml's `cpu_init`; optional).
#[pyfunction]
fn cpu_init() {
    ferrograph::cpu::cpu_init();
}

/// Starts the library's clocks (ggml's `time_init`; optional, the first clock call does it).
#[pyfunction]
fn time_init() {
    ferrograph::util::time_init();
}

/// The CPU's f32-to-f32 row conversion (a copy; ggml's `cpu_fp32_to_fp32`): a new float32
/// array equal to the 1-d float32 array `x`.
#[pyfunction]
fn cpu_fp32_to_fp32<'py>(
    py: Python<'py>,
    x: &Bound<'py, PyAny>,
) -> PyResult<Bound<'py, PyArray1<f32>>> {
    let x = x.cast::<PyArray1<f32>>().map_err(|_| {
        let got = super::convert::dtype_name(x)
            .map(|d| format!("a {d} array"))
            .unwrap_or_else(|_| super::utils::type_name(x));
        super::errors::dtype(format!(
            "cpu_fp32_to_fp32 needs a 1-d float32 array, got {got}"
        ))
    })?;
    let x = x.readonly();
    let src = x.as_slice().map_err(|_| invalid("x must be contiguous"))?;
    let mut out = vec![0f32; x.len()];
    convert::cpu_fp32_to_fp32(src, &mut out)?;
    Ok(PyArray1::from_vec(py, out))
}

/// Parameters of a CPU thread pool (ggml's `ggml_threadpool_params`): threads, priority,
/// polling level, CPU placement. `Threadpool(params=...)` starts a pool with them.
#[pyclass(name = "ThreadpoolParams", module = "ferrograph", eq, from_py_object)]
#[derive(Clone, PartialEq)]
pub struct PyThreadpoolParams {
    pub(crate) inner: ThreadpoolParams,
}

#[pymethods]
impl PyThreadpoolParams {
    /// ggml's defaults for `n_threads` threads, with any field overridden: `priority` -1 (low)
    /// to 3 (real-time), `poll` 0-100, `strict_cpu` pins worker i to the i-th CPU of
    /// `cpumask` (a sequence of bools, `cpumask[c]` for CPU c; empty: every CPU).
    #[new]
    #[pyo3(signature = (n_threads, *, priority = 0, poll = 50, strict_cpu = false, cpumask = None, paused = false))]
    fn new(
        n_threads: usize,
        priority: i32,
        poll: u32,
        strict_cpu: bool,
        cpumask: Option<Vec<bool>>,
        paused: bool,
    ) -> PyResult<Self> {
        let inner = ThreadpoolParams {
            priority: ThreadPriority::from_code(priority)?,
            poll,
            strict_cpu,
            cpumask: cpumask.unwrap_or_default(),
            paused,
            ..ThreadpoolParams::new(n_threads)
        };
        inner.check()?;
        Ok(PyThreadpoolParams { inner })
    }

    /// Worker threads.
    #[getter]
    fn n_threads(&self) -> usize {
        self.inner.n_threads
    }

    /// Scheduling priority, -1 (low) to 3 (real-time).
    #[getter]
    fn priority(&self) -> i32 {
        self.inner.priority.code()
    }

    /// Busy-wait level before sleeping, 0-100: idle workers spin up to poll × 2 µs between
    /// the jobs of a computation and up to poll × 20 µs after it returns before they sleep
    /// (0: sleep at once).
    #[getter]
    fn poll(&self) -> u32 {
        self.inner.poll
    }

    /// Whether each worker is pinned to one CPU of the mask.
    #[getter]
    fn strict_cpu(&self) -> bool {
        self.inner.strict_cpu
    }

    /// The CPU mask (`cpumask[c]` for CPU c; empty: no restriction).
    #[getter]
    fn cpumask(&self) -> Vec<bool> {
        self.inner.cpumask.clone()
    }

    /// Whether the pool starts paused.
    #[getter]
    fn paused(&self) -> bool {
        self.inner.paused
    }

    /// Whether a pool of these parameters is interchangeable with one of `other`'s (ggml's
    /// `threadpool_params_match`).
    fn matches(&self, other: &PyThreadpoolParams) -> bool {
        self.inner.matches(&other.inner)
    }

    fn __repr__(&self) -> String {
        let p = &self.inner;
        format!(
            "ThreadpoolParams(n_threads={}, priority={}, poll={}, strict_cpu={}, cpus={:?}, paused={})",
            p.n_threads,
            p.priority.code(),
            p.poll,
            if p.strict_cpu { "True" } else { "False" },
            p.allowed_cpus(),
            if p.paused { "True" } else { "False" }
        )
    }
}

/// ggml's default thread-pool parameters for `n_threads` threads.
#[pyfunction]
fn threadpool_params_default(n_threads: usize) -> PyResult<PyThreadpoolParams> {
    ferrograph::device::check_n_threads(n_threads)?;
    Ok(PyThreadpoolParams {
        inner: ThreadpoolParams::new(n_threads),
    })
}

/// Resets `params` to the defaults for `n_threads` (ggml's `threadpool_params_init`).
#[pyfunction]
fn threadpool_params_init(
    mut params: PyRefMut<'_, PyThreadpoolParams>,
    n_threads: usize,
) -> PyResult<()> {
    ferrograph::device::check_n_threads(n_threads)?;
    params.inner.init(n_threads);
    Ok(())
}

/// Whether two parameter sets describe interchangeable pools (ggml's
/// `threadpool_params_match`).
#[pyfunction]
fn threadpool_params_match(a: &PyThreadpoolParams, b: &PyThreadpoolParams) -> bool {
    a.inner.matches(&b.inner)
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
    m.add_function(wrap_pyfunction!(cpu_fma_peak_gflops, m)?)?;
    m.add_function(wrap_pyfunction!(cpu_int8_peak_gops, m)?)?;
    m.add_function(wrap_pyfunction!(cpu_feature_counts, m)?)?;
    m.add_function(wrap_pyfunction!(numa_init, m)?)?;
    m.add_function(wrap_pyfunction!(is_numa, m)?)?;
    m.add_function(wrap_pyfunction!(cpu_init, m)?)?;
    m.add_function(wrap_pyfunction!(time_init, m)?)?;
    m.add_function(wrap_pyfunction!(cpu_fp32_to_fp32, m)?)?;
    m.add_class::<PyThreadpoolParams>()?;
    m.add_function(wrap_pyfunction!(threadpool_params_default, m)?)?;
    m.add_function(wrap_pyfunction!(threadpool_params_init, m)?)?;
    m.add_function(wrap_pyfunction!(threadpool_params_match, m)?)?;
    Ok(())
}
