//! Python classes for the device layer. This file holds `Backend`, `GraphPlan` and `Event`
//! and the abort-callback plumbing; [`buffer`] has `BufferUsage`, `BufferType` and `Buffer`,
//! [`device`] `DeviceType` and `Device`, [`registry`] `Registration` and the registry functions
//! (`fg.devices()`, `fg.init_backend(...)`, ...).
//!
//! Each class is a thin handle on the core's shared object (`Arc<dyn Backend>`, [`Buffer`],
//! ...), so Python can never free memory the core still uses. Compute and large transfers run
//! with the interpreter released; callbacks re-attach to call Python.

mod buffer;
mod device;
mod registry;

pub(crate) use buffer::{PyBuffer, PyBufferType};
pub(crate) use device::{DeviceTypeArg, PyDevice, PyDeviceType};
pub(crate) use registry::PyRegistration;

use std::sync::Arc;

use pyo3::prelude::*;
use pyo3::types::PyBytes;

use super::errors::guard;
use super::graph::PyGraph;
use super::lock::{detach_quiet, CallbackScope, CoreLock, ErrorSlot};
use super::tensor::PyTensor;
use crate::tensor_raw::{read_raw_bytes, with_raw_bytes};
use ferrograph::backend::{Backend, GraphPlan};
use ferrograph::cpu::backend::as_cpu;
use ferrograph::device::check_n_threads;
use ferrograph::error::{Error, Status};
use ferrograph::event::Event;

/// The outcome of a computation on `backends`: the exception an abort callback raised (the
/// original one) when it stopped it, else the error or status.
pub(crate) fn finish_compute(
    py: Python<'_>,
    backends: &[Arc<dyn Backend>],
    result: ferrograph::Result<Status>,
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
#[pyfunction]
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
) -> ferrograph::registration::AbortCallback {
    abort_callback_into(callable, move |err| slot.store(err))
}

fn abort_callback_into(
    callable: Py<PyAny>,
    keep: impl Fn(PyErr) + Send + Sync + 'static,
) -> ferrograph::registration::AbortCallback {
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
                    let status = backend.graph_compute(&graph)?;
                    // Again on this side: a backend loaded at run time carries its own copy
                    // of the crate, whose value clock is not this one (re-stamping in node
                    // order is harmless for the others).
                    ferrograph::tensor::mark_computed(graph.nodes());
                    Ok(status)
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
        py.detach(|| -> ferrograph::Result<()> {
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
        })?;
        // Backends that queue the bytes (remote) do not go through `write_bytes`.
        t.note_written();
        Ok(())
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
        f: impl FnOnce(&mut Box<dyn GraphPlan>) -> ferrograph::Result<T> + Send,
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

fn guard_compute(backend: &Arc<dyn Backend>, plan: &dyn GraphPlan) -> ferrograph::Result<Status> {
    guard("GraphPlan.compute", || {
        let status = backend.graph_plan_compute(plan)?;
        // as in `PyBackend::compute`: stamped on this side too
        ferrograph::tensor::mark_computed(plan.graph().nodes());
        Ok(status)
    })
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

/// Registers the test hook `abort_slot_count` in `ferrograph._core._testing`.
pub(crate) fn register_testing(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(abort_slot_count, m)?)?;
    Ok(())
}

/// Registers the classes and functions.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyBackend>()?;
    m.add_class::<PyGraphPlan>()?;
    m.add_class::<PyEvent>()?;
    buffer::register(m)?;
    device::register(m)?;
    registry::register(m)?;
    Ok(())
}
