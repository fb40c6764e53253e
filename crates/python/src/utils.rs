//! Utilities from Python: clocks, status strings, GUIDs, the global abort callback, thread
//! pools, `graph_compute_with_ctx`, graph copies and the two-backend comparison helper.

use std::sync::Arc;

use pyo3::prelude::*;

use super::backend::{
    finish_compute, python_abort_callback, PyBackend, PyBuffer, GLOBAL_ABORT_ERROR,
};
use super::errors::{guard, invalid};
use super::graph::PyGraph;
use super::lock::CallbackScope;
use super::tensor::PyTensor;
use ferrograph::cpu::backend::as_cpu;
use ferrograph::error::Error;
use ferrograph::graph_copy::{self as copying, GraphCopy};
use ferrograph::pool::{Threadpool, ThreadpoolParams};

/// The Python name of `obj`'s type (`"int"`, `"list"`), for messages.
pub(crate) fn type_name(obj: &Bound<'_, PyAny>) -> String {
    obj.get_type()
        .name()
        .map(|n| n.to_string())
        .unwrap_or_else(|_| "object".into())
}

/// `ArgumentTypeError` (a `TypeError`) with `message`.
pub(crate) fn type_error(message: impl Into<String>) -> PyErr {
    Error::ArgumentType(message.into()).into()
}

/// Rejects anything but a callable (`ArgumentTypeError` naming `what` and the type given).
pub(crate) fn check_callable(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<()> {
    if obj.is_callable() {
        Ok(())
    } else {
        Err(type_error(format!(
            "{what}: the callback must be callable (or None), got {}",
            type_name(obj)
        )))
    }
}

/// A shape given as one int or a sequence of ints (numpy order). Anything else is an
/// `ArgumentTypeError` saying so in Python terms; a negative size an `InvalidArgumentError`.
pub(crate) enum ShapeArg {
    /// `n`: a 1-d shape.
    One(usize),
    /// `(d0, d1, ...)`.
    Many(Vec<usize>),
}

impl ShapeArg {
    /// The dimensions, numpy order.
    pub(crate) fn into_vec(self) -> Vec<usize> {
        match self {
            ShapeArg::One(n) => vec![n],
            ShapeArg::Many(v) => v,
        }
    }
}

/// One dimension of a shape: an int (or an object with `__index__`) that is not negative.
fn shape_dim(item: &Bound<'_, PyAny>, position: Option<usize>) -> PyResult<usize> {
    let at = position
        .map(|i| format!(" at position {i}"))
        .unwrap_or_default();
    if item.is_instance_of::<pyo3::types::PyBool>() || item.is_instance_of::<pyo3::types::PyFloat>()
    {
        return Err(type_error(format!(
            "a shape's sizes must be ints, got {}{at}",
            type_name(item)
        )));
    }
    let index = item.call_method0("__index__").map_err(|_| {
        type_error(format!(
            "a shape must be an int or a sequence of ints, got {}{at}",
            type_name(item)
        ))
    })?;
    let value: i128 = index.extract()?;
    usize::try_from(value).map_err(|_| {
        Error::InvalidArgument(format!(
            "a shape's size must be from 0 to 2**64-1, got {value}{at}"
        ))
        .into()
    })
}

impl<'a, 'py> FromPyObject<'a, 'py> for ShapeArg {
    type Error = PyErr;

    fn extract(obj: pyo3::Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        if obj.hasattr("__index__")? && !obj.hasattr("__len__")? {
            return Ok(ShapeArg::One(shape_dim(&obj, None)?));
        }
        if obj.is_instance_of::<pyo3::types::PyString>()
            || obj.is_instance_of::<pyo3::types::PyBytes>()
            || obj.is_instance_of::<pyo3::types::PyDict>()
        {
            return Err(type_error(format!(
                "a shape must be an int or a sequence of ints, got {}",
                type_name(&obj)
            )));
        }
        let items = obj.try_iter().map_err(|_| {
            type_error(format!(
                "a shape must be an int or a sequence of ints, got {}",
                type_name(&obj)
            ))
        })?;
        let mut dims = Vec::new();
        for (i, item) in items.enumerate() {
            dims.push(shape_dim(&item?, Some(i))?);
        }
        Ok(ShapeArg::Many(dims))
    }
}

/// Milliseconds since the library's clock started.
#[pyfunction]
fn time_ms() -> i64 {
    ferrograph::util::time_ms()
}

/// Microseconds since the library's clock started.
#[pyfunction]
fn time_us() -> i64 {
    ferrograph::util::time_us()
}

/// The CPU's cycle counter (a monotonic counter where there is none).
#[pyfunction]
fn cycles() -> i64 {
    ferrograph::util::cycles()
}

/// Cycles per millisecond (measured once).
#[pyfunction]
fn cycles_per_ms() -> i64 {
    ferrograph::util::cycles_per_ms()
}

/// The source revision the library was built from ("unknown" outside a git build).
#[pyfunction]
fn commit() -> &'static str {
    ferrograph::util::commit()
}

/// The text of a status code (0 success, 1 aborted, -1 failed, -2 allocation failed;
/// "unknown status" for any other code, as ggml's).
#[pyfunction]
fn status_to_string(code: i64) -> &'static str {
    i32::try_from(code).map_or("unknown status", ferrograph::error::status_to_string)
}

/// Whether two backend GUIDs are equal.
#[pyfunction]
fn guid_matches(a: &[u8], b: &[u8]) -> bool {
    a.len() == 16 && a == b
}

/// Installs (or with None clears) the process-wide abort callback, polled by every CPU
/// computation beside each backend's own; returning True stops it with `AbortedError`, and an
/// exception it raises stops it and is re-raised by the compute call.
#[pyfunction]
fn set_global_abort_callback(py: Python<'_>, callback: Option<Py<PyAny>>) -> PyResult<()> {
    if let Some(cb) = &callback {
        check_callable(cb.bind(py), "set_global_abort_callback")?;
    }
    let callback = callback.map(|cb| python_abort_callback(cb, &GLOBAL_ABORT_ERROR));
    py.detach(|| ferrograph::cpu::backend::set_global_abort_callback(callback));
    Ok(())
}

/// Computes `graph` on the host with `n_threads` threads and no backend object (ggml's
/// `graph_compute_with_ctx`): every tensor needs host memory, e.g. from `Context(no_alloc=False)`.
#[pyfunction]
#[pyo3(signature = (graph, n_threads = 1))]
fn graph_compute_with_ctx(py: Python<'_>, graph: &PyGraph, n_threads: usize) -> PyResult<()> {
    ferrograph::device::check_n_threads(n_threads)?;
    let graph = graph.inner.clone();
    let result = super::lock::detach_quiet(py, || {
        guard("graph_compute_with_ctx", || {
            ferrograph::cpu::backend::graph_compute_with_ctx(&graph, n_threads)
        })
    });
    finish_compute(py, &[], result)
}

/// A persistent pool of worker threads for CPU backends (ggml's threadpool API); the thread
/// computing on it joins its workers for the call.
#[pyclass(name = "Threadpool", module = "ferrograph", frozen)]
pub struct PyThreadpool {
    inner: Arc<Threadpool>,
}

#[pymethods]
impl PyThreadpool {
    /// A pool of `n_threads` workers (`paused=True` starts it paused), or one made with
    /// `params` (a `ThreadpoolParams`: priority, polling, CPU placement), given instead.
    #[new]
    #[pyo3(signature = (n_threads = None, paused = false, *, params = None))]
    fn new(
        py: Python<'_>,
        n_threads: Option<usize>,
        paused: bool,
        params: Option<PyRef<'_, super::system::PyThreadpoolParams>>,
    ) -> PyResult<Self> {
        let params = match (n_threads, params) {
            (Some(n_threads), None) => {
                ferrograph::device::check_n_threads(n_threads)?;
                let mut params = ThreadpoolParams::new(n_threads);
                params.paused = paused;
                params
            }
            (None, Some(params)) => params.inner.clone(),
            _ => {
                return Err(invalid(
                    "Threadpool takes n_threads or params=ThreadpoolParams(...), one of them",
                ))
            }
        };
        // Workers start (and apply placement) on their own threads: not with the GIL held.
        let inner = py.detach(|| Threadpool::new(&params))?;
        Ok(PyThreadpool { inner })
    }

    /// The parameters the pool was made with.
    #[getter]
    fn params(&self) -> super::system::PyThreadpoolParams {
        super::system::PyThreadpoolParams {
            inner: self.inner.params().clone(),
        }
    }

    /// What the OS refused when the workers applied the placement or priority (empty when all
    /// was applied; complete once the pool has computed something).
    #[getter]
    fn placement_errors(&self) -> Vec<String> {
        self.inner.placement_errors()
    }

    /// Number of worker threads.
    #[getter]
    fn n_threads(&self) -> usize {
        self.inner.n_threads()
    }

    /// Whether the pool is paused.
    #[getter]
    fn is_paused(&self) -> bool {
        self.inner.is_paused()
    }

    /// Pauses the pool (idle workers sleep); a computation resumes it.
    fn pause(&self) {
        self.inner.pause();
    }

    /// Resumes the pool.
    fn resume(&self) {
        self.inner.resume();
    }

    /// Makes `backend` (a CPU backend) compute on this pool.
    fn attach(&self, py: Python<'_>, backend: &PyBackend) -> PyResult<()> {
        let (backend, pool) = (backend.inner.clone(), self.inner.clone());
        // The backend's pool lock is a core lock: not waited for with the interpreter held.
        super::lock::detach_quiet(py, || -> ferrograph::Result<()> {
            as_cpu(backend.as_ref())?.set_threadpool(pool);
            Ok(())
        })?;
        Ok(())
    }

    fn __repr__(&self) -> String {
        format!(
            "Threadpool(n_threads={}, paused={})",
            self.inner.n_threads(),
            self.inner.is_paused()
        )
    }
}

/// A graph copied to another backend (`fg.graph_copy`).
#[pyclass(name = "GraphCopy", module = "ferrograph", frozen)]
pub struct PyGraphCopy {
    inner: GraphCopy,
}

#[pymethods]
impl PyGraphCopy {
    /// The copied graph.
    #[getter]
    fn graph(&self) -> PyGraph {
        PyGraph {
            inner: self.inner.graph.clone(),
        }
    }

    /// The buffer holding the copies.
    #[getter]
    fn buffer(&self) -> PyBuffer {
        PyBuffer {
            inner: self.inner.buffer.clone(),
        }
    }

    /// The copy of a tensor of the source graph, or None.
    fn copy_of<'py>(
        &self,
        py: Python<'py>,
        tensor: &PyTensor,
    ) -> PyResult<Option<Bound<'py, PyTensor>>> {
        self.inner
            .copy_of(&tensor.inner)
            .map(|t| PyTensor::wrap(py, t.clone()))
            .transpose()
    }
}

/// Copies `graph` (tensors, ops and data) into one buffer of `backend`.
#[pyfunction]
fn graph_copy(py: Python<'_>, backend: &PyBackend, graph: &PyGraph) -> PyResult<PyGraphCopy> {
    let backend = backend.inner.clone();
    let graph = graph.inner.clone();
    let copy = py.detach(|| copying::graph_copy(backend.as_ref(), &graph))?;
    Ok(PyGraphCopy { inner: copy })
}

/// Computes `graph` on `backend1` and a copy on `backend2` node by node, calling
/// `callback(index, t1, t2)` after each non-view node (return False to stop). Returns True
/// when every node was compared.
#[pyfunction]
fn compare_graph_backend(
    py: Python<'_>,
    backend1: &PyBackend,
    backend2: &PyBackend,
    graph: &PyGraph,
    callback: Py<PyAny>,
) -> PyResult<bool> {
    check_callable(callback.bind(py), "compare_graph_backend")?;
    let (b1, b2) = (backend1.inner.clone(), backend2.inner.clone());
    let graph = graph.inner.clone();
    let mut raised: Option<PyErr> = None;
    let done = py.detach(|| {
        copying::compare_graph_backend(b1.as_ref(), b2.as_ref(), &graph, |i, t1, t2| {
            Python::attach(|py| {
                let _scope = CallbackScope::enter();
                let call = || -> PyResult<bool> {
                    let a = PyTensor::wrap(py, t1.clone())?;
                    let b = PyTensor::wrap(py, t2.clone())?;
                    callback.call1(py, (i, a, b))?.bind(py).is_truthy()
                };
                match call() {
                    Ok(go_on) => go_on,
                    Err(e) => {
                        raised = Some(e);
                        false
                    }
                }
            })
        })
    });
    // The callback's exception first: the comparison stopped because of it.
    if let Some(err) = raised {
        return Err(err);
    }
    Ok(done?)
}

/// Registers the functions and classes.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(time_ms, m)?)?;
    m.add_function(wrap_pyfunction!(time_us, m)?)?;
    m.add_function(wrap_pyfunction!(cycles, m)?)?;
    m.add_function(wrap_pyfunction!(cycles_per_ms, m)?)?;
    m.add_function(wrap_pyfunction!(commit, m)?)?;
    m.add_function(wrap_pyfunction!(status_to_string, m)?)?;
    m.add_function(wrap_pyfunction!(guid_matches, m)?)?;
    m.add_function(wrap_pyfunction!(set_global_abort_callback, m)?)?;
    m.add_function(wrap_pyfunction!(graph_compute_with_ctx, m)?)?;
    m.add_function(wrap_pyfunction!(graph_copy, m)?)?;
    m.add_function(wrap_pyfunction!(compare_graph_backend, m)?)?;
    m.add_class::<PyThreadpool>()?;
    m.add_class::<PyGraphCopy>()?;
    Ok(())
}
