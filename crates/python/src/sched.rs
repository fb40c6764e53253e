//! The Python `Scheduler` (one graph across several backends) and its inspectable `SchedPlan`.

use std::sync::Arc;

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

use super::alloc::BuftArg;
use super::backend::{check_status, raise_callback_error, PyBackend};
use super::errors::{guard, invalid};
use super::graph::PyGraph;
use super::lock::{CallbackScope, CoreLock, ErrorSlot};
use super::profile::PyProfile;
use super::tensor::PyTensor;
use ferrograph::backend::Backend;
use ferrograph::buffer::BufferType;
use ferrograph::sched::{Assignment, CopyPlan, PlannedTensor, SchedPlan, SplitPlan, TensorRef};
use ferrograph::sched::{OffloadPolicy, Scheduler, MAX_COPIES};
use ferrograph::tensor::Tensor;

fn tensor_ref(r: TensorRef) -> (&'static str, usize) {
    match r {
        TensorRef::Node(i) => ("node", i),
        TensorRef::Leaf(i) => ("leaf", i),
        TensorRef::Outside(i) => ("outside", i),
    }
}

/// A snapshot of the scheduler's plan for its current graph: where every tensor runs and why,
/// the splits, the copies between backends and the memory per backend. `print(plan)` gives a
/// text dump, `plan.to_dot()` GraphViz, and notebooks render a table of splits.
#[pyclass(name = "SchedPlan", module = "ferrograph", frozen)]
pub struct PySchedPlan {
    plan: SchedPlan,
    dot: String,
}

impl PySchedPlan {
    fn backend_name(&self, i: usize) -> String {
        self.plan
            .backend_names
            .get(i)
            .cloned()
            .unwrap_or_else(|| format!("#{i}"))
    }

    fn assignment_dict<'py>(
        &self,
        py: Python<'py>,
        t: &PlannedTensor,
    ) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        let (kind, index) = tensor_ref(t.tensor);
        let Assignment { backend, cause } = t.assignment;
        d.set_item("kind", kind)?;
        d.set_item("index", index)?;
        d.set_item("name", &t.name)?;
        d.set_item("op", &t.op)?;
        d.set_item("is_view", t.is_view)?;
        d.set_item("backend", self.backend_name(backend))?;
        d.set_item("cause", cause.tag())?;
        Ok(d)
    }

    fn split_dict<'py>(&self, py: Python<'py>, s: &SplitPlan) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        d.set_item("backend", self.backend_name(s.backend))?;
        d.set_item("nodes", (s.nodes.start, s.nodes.end))?;
        d.set_item("n_nodes", s.nodes.len())?;
        d.set_item("inputs", s.inputs.clone())?;
        Ok(d)
    }

    fn copy_dict<'py>(&self, py: Python<'py>, c: &CopyPlan) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        let (kind, index) = tensor_ref(c.source);
        d.set_item("source_kind", kind)?;
        d.set_item("source_index", index)?;
        let name = self.plan.entry(c.source).map(|t| t.name.clone());
        d.set_item("source", name)?;
        d.set_item("from_backend", self.backend_name(c.from_backend))?;
        d.set_item("to_backend", self.backend_name(c.to_backend))?;
        d.set_item("split", c.split)?;
        d.set_item("user_input", c.user_input)?;
        d.set_item("nbytes", c.nbytes)?;
        Ok(d)
    }
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// A Python list of one dict per item.
fn dict_list<'py, T>(
    py: Python<'py>,
    items: &[T],
    to_dict: impl Fn(&T) -> PyResult<Bound<'py, PyDict>>,
) -> PyResult<Bound<'py, PyList>> {
    let dicts = items.iter().map(to_dict).collect::<PyResult<Vec<_>>>()?;
    PyList::new(py, dicts)
}

#[pymethods]
impl PySchedPlan {
    /// The backends' names, in priority order.
    #[getter]
    fn backend_names(&self) -> Vec<String> {
        self.plan.backend_names.clone()
    }

    /// Pipeline slots per copied tensor.
    #[getter]
    fn n_copies(&self) -> usize {
        self.plan.n_copies
    }

    /// Per node: {kind, index, name, op, is_view, backend, cause}.
    #[getter]
    fn nodes<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        dict_list(py, &self.plan.nodes, |t| self.assignment_dict(py, t))
    }

    /// Per leaf (and operand outside the graph): the same fields as `nodes`.
    #[getter]
    fn leafs<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        dict_list(py, &self.plan.leafs, |t| self.assignment_dict(py, t))
    }

    /// The splits in execution order: {backend, nodes: (start, end), n_nodes, inputs}.
    #[getter]
    fn splits<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        dict_list(py, &self.plan.splits, |s| self.split_dict(py, s))
    }

    /// The copies between backends: {source, from_backend, to_backend, split, user_input,
    /// nbytes, ...}.
    #[getter]
    fn copies<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        dict_list(py, &self.plan.copies, |c| self.copy_dict(py, c))
    }

    /// Compute memory per backend name, in bytes (pipeline slots included).
    #[getter]
    fn buffer_sizes<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        for (i, size) in self.plan.buffer_sizes.iter().enumerate() {
            d.set_item(self.backend_name(i), size)?;
        }
        Ok(d)
    }

    /// GraphViz source: nodes coloured by backend, one cluster per split, copies dashed.
    fn to_dot(&self) -> String {
        self.dot.clone()
    }

    fn __str__(&self) -> String {
        self.plan.to_string()
    }

    fn __repr__(&self) -> String {
        format!(
            "SchedPlan(backends={:?}, n_splits={}, n_copies={}, n_nodes={})",
            self.plan.backend_names,
            self.plan.splits.len(),
            self.plan.copies.len(),
            self.plan.nodes.len()
        )
    }

    fn _repr_html_(&self) -> String {
        let mut html = String::from(
            "<table><thead><tr><th>split</th><th>backend</th><th>nodes</th>\
             <th>first node</th><th>inputs copied</th></tr></thead><tbody>",
        );
        for (i, s) in self.plan.splits.iter().enumerate() {
            let first = self
                .plan
                .nodes
                .get(s.nodes.start)
                .map(|t| format!("{} ({})", t.name, t.op))
                .unwrap_or_default();
            let inputs: Vec<String> = s
                .inputs
                .iter()
                .filter_map(|&c| self.plan.copies.get(c))
                .map(|c| {
                    let (kind, index) = tensor_ref(c.source);
                    format!("{kind} {index} from {}", self.backend_name(c.from_backend))
                })
                .collect();
            html.push_str(&format!(
                "<tr><td>{i}</td><td>{}</td><td>{}..{}</td><td>{}</td><td>{}</td></tr>",
                escape(&self.backend_name(s.backend)),
                s.nodes.start,
                s.nodes.end,
                escape(&first),
                escape(&inputs.join(", "))
            ));
        }
        html.push_str("</tbody></table>");
        let sizes: Vec<String> = self
            .plan
            .buffer_sizes
            .iter()
            .enumerate()
            .map(|(i, s)| format!("{}: {:.2} MiB", self.backend_name(i), *s as f64 / 1048576.0))
            .collect();
        html.push_str(&format!(
            "<p>{} splits, {} copies; compute memory {}</p>",
            self.plan.splits.len(),
            self.plan.copies.len(),
            escape(&sizes.join(", "))
        ));
        html
    }
}

/// Runs one graph across several backends: assigns every op to a backend, cuts the graph into
/// splits where the backend changes, copies tensors a backend cannot read, allocates compute
/// memory with a lifetime-aware plan, and computes the splits in order.
///
/// `backends` are in priority order and the last must be a CPU backend. `parallel=True`
/// pipelines inputs over `n_copies` slots (default 4). `op_offload` lets a higher-priority
/// backend take an op whose weights sit in host memory.
#[pyclass(name = "Scheduler", module = "ferrograph", frozen)]
pub struct PyScheduler {
    inner: CoreLock<Scheduler>,
    backends: Vec<Arc<dyn Backend>>,
    /// The exception the eval callback raised during the current computation.
    eval_error: Arc<ErrorSlot>,
}

impl PyScheduler {
    /// Runs `f` on the scheduler (see `lock.rs`: the interpreter is released while waiting and
    /// working; a callback of a running computation gets BusyError).
    fn with<R: Send>(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&mut Scheduler) -> R + Send,
    ) -> PyResult<R> {
        self.inner.with(py, f)
    }

    /// A quick read of the scheduler (see `CoreLock::peek`).
    fn peek<R: Send>(&self, py: Python<'_>, f: impl FnOnce(&Scheduler) -> R + Send) -> PyResult<R> {
        self.inner.peek(py, f)
    }

    /// Runs a computation and raises what stopped it: an exception of the eval callback or of
    /// an abort callback first (the original exception), else the status's error.
    fn compute(
        &self,
        py: Python<'_>,
        what: &str,
        run: impl FnOnce(&mut Scheduler) -> ferrograph::Result<ferrograph::error::Status> + Send,
    ) -> PyResult<()> {
        self.eval_error.take();
        let result = self.with(py, |s| guard(what, || run(s)))?;
        if let Some(err) = self.eval_error.take() {
            return Err(err);
        }
        let status = match result {
            Ok(status) => status,
            Err(err) => {
                raise_callback_error(py, &self.backends)?;
                return Err(err.into());
            }
        };
        if status != ferrograph::error::Status::Success {
            raise_callback_error(py, &self.backends)?;
        }
        check_status(status)
    }
}

#[pymethods]
impl PyScheduler {
    #[new]
    #[pyo3(signature = (backends, buffer_types = None, graph_size = 2048, parallel = false, op_offload = true))]
    fn new(
        backends: Vec<PyRef<'_, PyBackend>>,
        buffer_types: Option<Vec<BuftArg<'_>>>,
        graph_size: usize,
        parallel: bool,
        op_offload: bool,
    ) -> PyResult<Self> {
        let backends: Vec<Arc<dyn Backend>> = backends.iter().map(|b| b.inner.clone()).collect();
        let bufts: Option<Vec<Arc<dyn BufferType>>> =
            buffer_types.map(|list| list.iter().map(BuftArg::resolve).collect());
        let scheduler = Scheduler::new(backends.clone(), bufts, graph_size, parallel, op_offload)?;
        Ok(PyScheduler {
            inner: CoreLock::new(scheduler, "the Scheduler"),
            backends,
            eval_error: Arc::new(ErrorSlot::default()),
        })
    }

    /// Number of backends.
    #[getter]
    fn n_backends(&self) -> usize {
        self.backends.len()
    }

    /// The backends, in priority order.
    #[getter]
    fn backends(&self) -> Vec<PyBackend> {
        self.backends
            .iter()
            .map(|b| PyBackend { inner: b.clone() })
            .collect()
    }

    /// The backend at index `i`.
    fn get_backend(&self, i: usize) -> PyResult<PyBackend> {
        self.backends
            .get(i)
            .map(|b| PyBackend { inner: b.clone() })
            .ok_or_else(|| {
                ferrograph::Error::out_of_bounds(format!(
                    "backend index {i} is outside 0..{}",
                    self.backends.len()
                ))
                .into()
            })
    }

    /// Splits of the current graph.
    #[getter]
    fn n_splits(&self, py: Python<'_>) -> PyResult<usize> {
        self.peek(py, |s| s.n_splits())
    }

    /// Pipeline slots per copied tensor (settable, 1 to 64; 1 turns pipelining off).
    #[getter]
    fn get_n_copies(&self, py: Python<'_>) -> PyResult<usize> {
        self.peek(py, |s| s.n_copies())
    }

    #[setter]
    fn set_n_copies(&self, py: Python<'_>, n: usize) -> PyResult<()> {
        if n == 0 || n > MAX_COPIES {
            return Err(invalid(format!(
                "n_copies must be between 1 and {MAX_COPIES}, got {n}"
            )));
        }
        self.with(py, |s| s.set_n_copies(n))??;
        Ok(())
    }

    /// Whether higher-priority backends may take ops whose weights are in host memory.
    #[getter]
    fn get_op_offload(&self, py: Python<'_>) -> PyResult<bool> {
        self.peek(py, |s| s.op_offload())
    }

    #[setter]
    fn set_op_offload(&self, py: Python<'_>, on: bool) -> PyResult<()> {
        self.with(py, |s| s.set_op_offload(on))
    }

    /// The offload policy: "device" (ask the backend), "never", "always", or an int — the
    /// minimum batch for which an op is offloaded.
    #[getter]
    fn get_offload_policy<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        Ok(match self.peek(py, |s| s.offload_policy())? {
            OffloadPolicy::Device => "device".into_pyobject(py)?.into_any(),
            OffloadPolicy::Never => "never".into_pyobject(py)?.into_any(),
            OffloadPolicy::Always => "always".into_pyobject(py)?.into_any(),
            OffloadPolicy::MinBatch(n) => n.into_pyobject(py)?.into_any(),
        })
    }

    #[setter]
    fn set_offload_policy(&self, policy: &Bound<'_, PyAny>) -> PyResult<()> {
        let py = policy.py();
        let policy = if let Ok(n) = policy.extract::<i64>() {
            if n < 0 || policy.is_instance_of::<pyo3::types::PyBool>() {
                return Err(invalid(format!(
                    "offload_policy: a minimum batch size must be a non-negative int, got {n}"
                )));
            }
            OffloadPolicy::MinBatch(n as usize)
        } else if let Ok(text) = policy.extract::<String>() {
            match text.to_ascii_lowercase().as_str() {
                "device" => OffloadPolicy::Device,
                "never" => OffloadPolicy::Never,
                "always" => OffloadPolicy::Always,
                other => {
                    return Err(invalid(format!(
                        "unknown offload policy {other:?}: use 'device', 'never', 'always' or \
                         a minimum batch size"
                    )))
                }
            }
        } else {
            return Err(super::utils::type_error(format!(
                "offload_policy must be 'device', 'never', 'always' or an int, got {}",
                super::utils::type_name(policy)
            )));
        };
        self.with(py, |s| s.set_offload_policy(policy))
    }

    /// The compute buffer type used for `backend`.
    fn get_buffer_type(
        &self,
        py: Python<'_>,
        backend: &PyBackend,
    ) -> PyResult<super::backend::PyBufferType> {
        let b = backend.inner.clone();
        Ok(super::backend::PyBufferType {
            inner: self.peek(py, |s| s.buffer_type(&b))??,
        })
    }

    /// Bytes of compute memory allocated for `backend`.
    fn get_buffer_size(&self, py: Python<'_>, backend: &PyBackend) -> PyResult<usize> {
        let b = backend.inner.clone();
        Ok(self.peek(py, |s| s.buffer_size(&b))??)
    }

    /// Pins `tensor` (and, through assignment, its neighbours) to `backend`.
    fn set_tensor_backend(
        &self,
        py: Python<'_>,
        tensor: &PyTensor,
        backend: &PyBackend,
    ) -> PyResult<()> {
        let (t, b) = (tensor.inner.clone(), backend.inner.clone());
        self.with(py, |s| s.set_tensor_backend(&t, &b))??;
        Ok(())
    }

    /// The backend `tensor` is pinned or assigned to, or None.
    fn get_tensor_backend(&self, py: Python<'_>, tensor: &PyTensor) -> PyResult<Option<PyBackend>> {
        let t = tensor.inner.clone();
        Ok(self
            .with(py, |s| s.get_tensor_backend(&t))?
            .map(|inner| PyBackend { inner }))
    }

    /// Per-node evaluation callback `callback(tensor, ask) -> bool`: called with ask=True
    /// before a node to ask whether the caller wants to observe it, then with ask=False once
    /// it is computed (its data readable); returning False then cancels the whole compute,
    /// which raises AbortedError. An exception raised by the callback stops the compute and
    /// is re-raised by `graph_compute`. The callback must not use this scheduler (BusyError).
    /// None removes the callback; anything else that is not callable is rejected.
    fn set_eval_callback(&self, py: Python<'_>, callback: Option<Py<PyAny>>) -> PyResult<()> {
        if let Some(cb) = &callback {
            super::utils::check_callable(cb.bind(py), "set_eval_callback")?;
        }
        let slot = self.eval_error.clone();
        let callback = callback.map(|callable| -> ferrograph::sched::EvalCallback {
            Box::new(move |tensor: &Tensor, ask: bool| {
                Python::attach(|py| {
                    let _scope = CallbackScope::enter();
                    let run = || -> PyResult<bool> {
                        let t = PyTensor::wrap(py, tensor.clone())?;
                        callable.call1(py, (t, ask))?.bind(py).is_truthy()
                    };
                    run().unwrap_or_else(|err| {
                        slot.store(err);
                        false
                    })
                })
            })
        });
        self.with(py, |s| s.set_eval_callback(callback))
    }

    /// Assigns backends and cuts `graph` into splits (no memory is allocated).
    fn split_graph(&self, py: Python<'_>, graph: &PyGraph) -> PyResult<()> {
        let graph = graph.inner.clone();
        self.with(py, |s| {
            guard("Scheduler.split_graph", || s.split_graph(&graph))
        })??;
        Ok(())
    }

    /// Plans `graph` (a measure graph of the largest shapes you will compute) and sizes the
    /// compute buffers, so later graphs up to that size allocate without growing.
    fn reserve(&self, py: Python<'_>, graph: &PyGraph) -> PyResult<()> {
        let graph = graph.inner.clone();
        self.with(py, |s| guard("Scheduler.reserve", || s.reserve(&graph)))??;
        Ok(())
    }

    /// The compute bytes per backend `reserve(graph)` would need, without allocating.
    fn reserve_size(&self, py: Python<'_>, graph: &PyGraph) -> PyResult<Vec<usize>> {
        let graph = graph.inner.clone();
        Ok(self.with(py, |s| {
            guard("Scheduler.reserve_size", || s.reserve_size(&graph))
        })??)
    }

    /// Splits `graph` and binds every tensor that needs compute memory. Call it, then set the
    /// graph's inputs, then compute: allocation gives inputs fresh (zero-filled) memory, so
    /// values set before it are lost.
    fn alloc_graph(&self, py: Python<'_>, graph: &PyGraph) -> PyResult<()> {
        let graph = graph.inner.clone();
        self.with(py, |s| {
            guard("Scheduler.alloc_graph", || s.alloc_graph(&graph))
        })??;
        Ok(())
    }

    /// Whether `graph` is the allocated graph: its inputs may be set and it computed again
    /// without another `alloc_graph` (False after `reset`, `reserve`, a pin, or once another
    /// graph was split).
    fn is_allocated(&self, py: Python<'_>, graph: &PyGraph) -> PyResult<bool> {
        let graph = graph.inner.clone();
        self.peek(py, |s| s.is_allocated(&graph))
    }

    /// Computes `graph` across the backends and waits. Raises AbortedError when the eval
    /// callback (or an abort callback) cancelled it, and the callback's own exception when it
    /// raised one. With `profile=True`, returns a `Profile` of the run (every node's wall time:
    /// read inside a normal run on the CPU backend, else each node computed on its own; see
    /// `Profile`), else None.
    #[pyo3(signature = (graph, profile = false))]
    fn graph_compute(
        &self,
        py: Python<'_>,
        graph: &PyGraph,
        profile: bool,
    ) -> PyResult<Option<PyProfile>> {
        let graph = graph.inner.clone();
        if !profile {
            self.compute(py, "Scheduler.graph_compute", |s| s.graph_compute(&graph))?;
            return Ok(None);
        }
        let mut timings = None;
        self.compute(py, "Scheduler.graph_compute", |s| {
            let (status, p) = s.graph_compute_profiled(&graph)?;
            timings = Some(p);
            Ok(status)
        })?;
        Ok(timings.map(PyProfile::from))
    }

    /// Queues the computation of `graph`; `synchronize()` waits.
    fn graph_compute_async(&self, py: Python<'_>, graph: &PyGraph) -> PyResult<()> {
        let graph = graph.inner.clone();
        self.compute(py, "Scheduler.graph_compute_async", |s| {
            s.graph_compute_async(&graph)
        })
    }

    /// Waits for every backend.
    fn synchronize(&self, py: Python<'_>) -> PyResult<()> {
        self.with(py, |s| s.synchronize())??;
        Ok(())
    }

    /// Forgets the current allocation (its tensors become stale) and the pins.
    fn reset(&self, py: Python<'_>) -> PyResult<()> {
        self.with(py, |s| s.reset())
    }

    /// The plan for the current graph, or None before the first split.
    #[getter]
    fn plan(&self, py: Python<'_>) -> PyResult<Option<PySchedPlan>> {
        self.peek(py, |s| {
            let plan = s.plan()?;
            let dot = s.to_dot().unwrap_or_default();
            Some(PySchedPlan { plan, dot })
        })
    }

    /// The compute memory plan (see `GraphAllocator.plan`): per backend buffer id its size,
    /// each tensor's offset and lifetime, peak and fragmentation; None before allocation.
    #[getter]
    fn memory_plan<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyDict>>> {
        match self.peek(py, |s| s.memory_plan().cloned())? {
            Some(plan) => Ok(Some(super::alloc::memory_plan_dict(py, &plan)?)),
            None => Ok(None),
        }
    }

    /// GraphViz source of the current plan, or None.
    fn to_dot(&self, py: Python<'_>) -> PyResult<Option<String>> {
        self.peek(py, |s| s.to_dot())
    }

    /// Drops every cached plan (the next compute re-plans).
    fn clear_plan_cache(&self, py: Python<'_>) -> PyResult<()> {
        self.with(py, |s| s.clear_plan_cache())
    }

    /// (hits, misses) of the plan cache.
    #[getter]
    fn plan_cache_stats(&self, py: Python<'_>) -> PyResult<(u64, u64)> {
        self.peek(py, |s| s.plan_cache_stats())
    }

    fn __repr__(&self, py: Python<'_>) -> String {
        let names: Vec<String> = self.backends.iter().map(|b| b.name().to_owned()).collect();
        match self.peek(py, |s| (s.n_splits(), s.n_copies())) {
            Ok((n_splits, n_copies)) => {
                format!("Scheduler(backends={names:?}, n_splits={n_splits}, n_copies={n_copies})")
            }
            Err(_) => format!("Scheduler(backends={names:?}, busy)"),
        }
    }

    fn _repr_html_(&self, py: Python<'_>) -> String {
        match self.plan(py) {
            Ok(Some(plan)) => plan._repr_html_(),
            _ => format!("<p>{}</p>", escape(&self.__repr__(py))),
        }
    }
}

/// Registers the classes.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyScheduler>()?;
    m.add_class::<PySchedPlan>()?;
    Ok(())
}
