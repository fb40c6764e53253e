//! Python classes and functions for memory allocation: `alloc_ctx_tensors`,
//! `ctx_tensors_size`, `TensorAllocator`, `tensor_alloc`, `view_init`, and the lifetime-aware
//! `GraphAllocator` with its inspectable plan.

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

use super::backend::{PyBackend, PyBuffer, PyBufferType};
use super::context::PyContext;
use super::graph::PyGraph;
use super::lock::CoreLock;
use super::tensor::PyTensor;
use super::utils::{type_error, type_name};
use ferrograph::alloc::{self, GraphAllocator, MemoryPlan, TensorAllocator};
use ferrograph::buffer::{Buffer, BufferType};
use std::sync::Arc;

/// A buffer type given directly or as a backend (its default buffer type).
pub(crate) enum BuftArg<'py> {
    Type(PyRef<'py, PyBufferType>),
    Backend(PyRef<'py, PyBackend>),
}

impl<'a, 'py> FromPyObject<'a, 'py> for BuftArg<'py> {
    type Error = PyErr;

    fn extract(obj: pyo3::Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        if let Ok(t) = obj.cast::<PyBufferType>() {
            return Ok(BuftArg::Type(t.borrow()));
        }
        if let Ok(b) = obj.cast::<PyBackend>() {
            return Ok(BuftArg::Backend(b.borrow()));
        }
        Err(type_error(format!(
            "expected a BufferType or a Backend, got {}",
            type_name(&obj)
        )))
    }
}

impl BuftArg<'_> {
    pub(crate) fn resolve(&self) -> Arc<dyn BufferType> {
        match self {
            BuftArg::Type(t) => t.inner.clone(),
            BuftArg::Backend(b) => b.inner.default_buffer_type(),
        }
    }
}

/// Allocates every tensor of `ctx` that has no memory yet in buffers of `target` (a
/// `BufferType`, or a `Backend` for its default type) and initialises views. When the buffer
/// type's max size needs several buffers, they are joined in one multi-buffer. Returns None
/// when there was nothing to allocate.
#[pyfunction]
fn alloc_ctx_tensors(
    py: Python<'_>,
    ctx: &PyContext,
    target: BuftArg<'_>,
) -> PyResult<Option<PyBuffer>> {
    let buft = target.resolve();
    let ctx = ctx.inner.clone();
    let mut buffers = py.detach(|| alloc::alloc_ctx_tensors_from_buft(&ctx, buft))?;
    Ok(match buffers.len() {
        0 => None,
        1 => buffers.pop().map(|inner| PyBuffer { inner }),
        _ => Some(PyBuffer {
            inner: Buffer::multi(buffers)?,
        }),
    })
}

/// The bytes `alloc_ctx_tensors` would allocate for `ctx` in `target`'s buffer type.
#[pyfunction]
fn ctx_tensors_size(ctx: &PyContext, target: BuftArg<'_>) -> usize {
    alloc::ctx_tensors_size(&ctx.inner, target.resolve().as_ref())
}

/// Binds `tensor` to `buffer` at byte `offset` (bounds and alignment checked).
#[pyfunction]
fn tensor_alloc(tensor: &PyTensor, buffer: &PyBuffer, offset: usize) -> PyResult<()> {
    alloc::tensor_alloc(&tensor.inner, &buffer.inner, offset)?;
    Ok(())
}

/// Binds a view to its source's memory (the source must be allocated).
#[pyfunction]
fn view_init(tensor: &PyTensor) -> PyResult<()> {
    alloc::view_init(&tensor.inner)?;
    Ok(())
}

/// A linear allocator over one buffer: each `alloc(t)` places a tensor at the next aligned
/// offset; AllocationError (with the sizes) when it does not fit.
#[pyclass(name = "TensorAllocator", module = "ferrograph")]
pub struct PyTensorAllocator {
    inner: TensorAllocator,
}

#[pymethods]
impl PyTensorAllocator {
    #[new]
    fn new(buffer: &PyBuffer) -> Self {
        PyTensorAllocator {
            inner: TensorAllocator::new(&buffer.inner),
        }
    }

    /// Places `tensor` (views are bound to their source instead).
    fn alloc(&mut self, tensor: &PyTensor) -> PyResult<()> {
        self.inner.alloc(&tensor.inner)?;
        Ok(())
    }

    /// The next free offset.
    #[getter]
    fn offset(&self) -> usize {
        self.inner.offset()
    }

    /// The buffer being filled.
    #[getter]
    fn buffer(&self) -> PyBuffer {
        PyBuffer {
            inner: self.inner.buffer().clone(),
        }
    }

    fn __repr__(&self) -> String {
        format!(
            "TensorAllocator(offset={}, size={})",
            self.inner.offset(),
            self.inner.buffer().size()
        )
    }
}

/// The plan as plain Python data: `{"buffers": [...], "tensors": [...], "n_nodes", "total",
/// "tensor_bytes", "peak_live_bytes", "fragmentation"}`.
pub(crate) fn memory_plan_dict<'py>(
    py: Python<'py>,
    plan: &MemoryPlan,
) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    let buffers = PyList::empty(py);
    for b in &plan.buffers {
        let bd = PyDict::new(py);
        bd.set_item("buffer_id", b.buffer_id)?;
        bd.set_item("buffer_type", &b.buffer_type)?;
        bd.set_item("alignment", b.alignment)?;
        bd.set_item("shared_with", b.shared_with)?;
        bd.set_item("chunk_sizes", b.chunk_sizes.clone())?;
        bd.set_item("size", b.size())?;
        buffers.append(bd)?;
    }
    let tensors = PyList::empty(py);
    for t in &plan.tensors {
        let td = PyDict::new(py);
        td.set_item("id", t.id)?;
        td.set_item("name", &t.name)?;
        td.set_item("buffer_id", t.buffer_id)?;
        td.set_item("chunk", t.chunk)?;
        td.set_item("offset", t.offset)?;
        td.set_item("size", t.size)?;
        td.set_item("first_use", t.first_use)?;
        td.set_item("last_use", t.last_use)?;
        td.set_item("inplace_parent", t.inplace_parent)?;
        tensors.append(td)?;
    }
    d.set_item("buffers", buffers)?;
    d.set_item("tensors", tensors)?;
    d.set_item("n_nodes", plan.n_nodes)?;
    d.set_item("total", plan.total())?;
    d.set_item("tensor_bytes", plan.tensor_bytes())?;
    d.set_item("peak_live_bytes", plan.peak_live_bytes())?;
    d.set_item("fragmentation", plan.fragmentation())?;
    Ok(d)
}

/// Allocates the intermediate tensors of graphs in compute buffers of one or more buffer
/// types, reusing the memory of tensors whose lifetime ended (and computing in place where
/// safe). `reserve` plans and sizes the buffers; `alloc_graph` replays the plan.
#[pyclass(name = "GraphAllocator", module = "ferrograph", frozen)]
pub struct PyGraphAllocator {
    inner: CoreLock<GraphAllocator>,
    n_buffers: usize,
}

impl PyGraphAllocator {
    /// Runs `f` on the allocator (see `lock.rs`).
    fn with<R: Send>(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&mut GraphAllocator) -> R + Send,
    ) -> PyResult<R> {
        self.inner.with(py, f)
    }

    /// A quick read of the allocator (see `CoreLock::peek`).
    fn peek<R: Send>(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&GraphAllocator) -> R + Send,
    ) -> PyResult<R> {
        self.inner.peek(py, f)
    }

    /// Rejects a buffer id outside `0..n_buffers`.
    fn check_id(&self, id: usize) -> PyResult<()> {
        if id < self.n_buffers {
            Ok(())
        } else {
            Err(ferrograph::Error::out_of_bounds(format!(
                "buffer id {id} is outside 0..{} (this allocator has {} buffer type(s))",
                self.n_buffers, self.n_buffers
            ))
            .into())
        }
    }

    /// Rejects per-tensor buffer ids outside `0..n_buffers`.
    fn check_ids(&self, what: &str, ids: &[usize]) -> PyResult<()> {
        match ids.iter().position(|&id| id >= self.n_buffers) {
            None => Ok(()),
            Some(i) => Err(ferrograph::Error::out_of_bounds(format!(
                "{what}[{i}] = {} is outside 0..{}",
                ids[i], self.n_buffers
            ))
            .into()),
        }
    }
}

/// One buffer type/backend, or a list of them.
enum BuftsArg<'py> {
    One(BuftArg<'py>),
    Many(Vec<BuftArg<'py>>),
}

impl<'a, 'py> FromPyObject<'a, 'py> for BuftsArg<'py> {
    type Error = PyErr;

    fn extract(obj: pyo3::Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        if let Ok(one) = obj.extract::<BuftArg<'py>>() {
            return Ok(BuftsArg::One(one));
        }
        let not_a_list = || {
            type_error(format!(
                "GraphAllocator needs a BufferType or Backend, or a list of them; got {}",
                type_name(&obj)
            ))
        };
        if obj.is_instance_of::<pyo3::types::PyString>() {
            return Err(not_a_list());
        }
        let items = obj.try_iter().map_err(|_| not_a_list())?;
        let mut list = Vec::new();
        for (i, item) in items.enumerate() {
            let item = item?;
            list.push(item.extract::<BuftArg<'py>>().map_err(|_| {
                type_error(format!(
                    "GraphAllocator: item {i} must be a BufferType or a Backend, got {}",
                    type_name(&item)
                ))
            })?);
        }
        Ok(BuftsArg::Many(list))
    }
}

#[pymethods]
impl PyGraphAllocator {
    /// `GraphAllocator(buft)` for one buffer type (or backend), `GraphAllocator([a, b])` for
    /// several (then use `reserve_n` with per-tensor buffer ids).
    #[new]
    fn new(buffer_types: BuftsArg<'_>) -> PyResult<Self> {
        let bufts: Vec<Arc<dyn BufferType>> = match buffer_types {
            BuftsArg::One(b) => vec![b.resolve()],
            BuftsArg::Many(list) => list.iter().map(BuftArg::resolve).collect(),
        };
        if bufts.is_empty() {
            return Err(super::errors::invalid(
                "GraphAllocator needs at least one buffer type",
            ));
        }
        let n_buffers = bufts.len();
        Ok(PyGraphAllocator {
            inner: CoreLock::new(GraphAllocator::new_n(&bufts), "the GraphAllocator"),
            n_buffers,
        })
    }

    /// Number of buffer ids.
    #[getter]
    fn n_buffers(&self) -> usize {
        self.n_buffers
    }

    /// Plans `graph` with every tensor in buffer 0 and sizes the buffers for it.
    fn reserve(&self, py: Python<'_>, graph: &PyGraph) -> PyResult<()> {
        let graph = graph.inner.clone();
        self.with(py, |a| a.reserve(&graph))??;
        Ok(())
    }

    /// Plans `graph` with node i in buffer `node_buffer_ids[i]` and leaf i in
    /// `leaf_buffer_ids[i]`.
    fn reserve_n(
        &self,
        py: Python<'_>,
        graph: &PyGraph,
        node_buffer_ids: Vec<usize>,
        leaf_buffer_ids: Vec<usize>,
    ) -> PyResult<()> {
        self.check_ids("node_buffer_ids", &node_buffer_ids)?;
        self.check_ids("leaf_buffer_ids", &leaf_buffer_ids)?;
        let graph = graph.inner.clone();
        self.with(py, |a| {
            a.reserve_n(&graph, &node_buffer_ids, &leaf_buffer_ids)
        })??;
        Ok(())
    }

    /// The bytes each buffer id would need for `graph`, without allocating.
    #[pyo3(signature = (graph, node_buffer_ids = Vec::new(), leaf_buffer_ids = Vec::new()))]
    fn reserve_n_size(
        &self,
        py: Python<'_>,
        graph: &PyGraph,
        node_buffer_ids: Vec<usize>,
        leaf_buffer_ids: Vec<usize>,
    ) -> PyResult<Vec<usize>> {
        self.check_ids("node_buffer_ids", &node_buffer_ids)?;
        self.check_ids("leaf_buffer_ids", &leaf_buffer_ids)?;
        let graph = graph.inner.clone();
        Ok(self.with(py, |a| {
            a.reserve_n_size(&graph, &node_buffer_ids, &leaf_buffer_ids)
        })??)
    }

    /// Binds every intermediate tensor of `graph` to compute memory by replaying the plan
    /// (re-planning automatically with one buffer type when the graph outgrew it).
    fn alloc_graph(&self, py: Python<'_>, graph: &PyGraph) -> PyResult<()> {
        let graph = graph.inner.clone();
        self.with(py, |a| a.alloc_graph(&graph))??;
        Ok(())
    }

    /// Bytes of compute memory of buffer id `id` (OutOfBoundsError past `n_buffers`).
    #[pyo3(signature = (id = 0))]
    fn buffer_size(&self, py: Python<'_>, id: usize) -> PyResult<usize> {
        self.check_id(id)?;
        self.peek(py, |a| a.buffer_size(id))
    }

    /// The buffers of id `id` (one per chunk; OutOfBoundsError past `n_buffers`).
    #[pyo3(signature = (id = 0))]
    fn buffers(&self, py: Python<'_>, id: usize) -> PyResult<Vec<PyBuffer>> {
        self.check_id(id)?;
        let buffers = self.peek(py, |a| a.buffers(id).to_vec())?;
        Ok(buffers
            .into_iter()
            .map(|inner| PyBuffer { inner })
            .collect())
    }

    /// Debug switch: fill released memory with a poison pattern so reuse bugs show.
    #[getter]
    fn get_poison(&self, py: Python<'_>) -> PyResult<bool> {
        self.peek(py, |a| a.poison())
    }

    #[setter]
    fn set_poison(&self, py: Python<'_>, on: bool) -> PyResult<()> {
        self.with(py, |a| a.set_poison(on))
    }

    /// The stored plan as a dict (see `memory_plan`), or None before the first reserve:
    /// per-buffer sizes, each tensor's offset and lifetime, peak and fragmentation.
    #[getter]
    fn plan<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyDict>>> {
        match self.peek(py, |a| a.plan().cloned())? {
            Some(plan) => Ok(Some(memory_plan_dict(py, &plan)?)),
            None => Ok(None),
        }
    }

    /// Checks the stored plan against `graph`: no two tensors alive at once overlap (unless
    /// in-place successors) and every tensor lies in its buffer. Raises AllocationError.
    fn check(&self, py: Python<'_>, graph: &PyGraph) -> PyResult<()> {
        let graph = graph.inner.clone();
        self.with(py, |a| match a.plan() {
            Some(plan) => alloc::check_plan(&graph, plan),
            None => Err(ferrograph::Error::InvalidArgument(
                "no plan: call reserve first".into(),
            )),
        })??;
        Ok(())
    }

    /// Shrinks the buffers to what the current plan needs (tensors become stale).
    fn shrink(&self, py: Python<'_>) -> PyResult<()> {
        self.with(py, |a| a.shrink())??;
        Ok(())
    }

    /// Frees every buffer and forgets the plan.
    fn release(&self, py: Python<'_>) -> PyResult<()> {
        self.with(py, |a| a.release())
    }

    fn __repr__(&self, py: Python<'_>) -> String {
        let n = self.n_buffers;
        match self.peek(py, |a| (0..n).map(|i| a.buffer_size(i)).collect::<Vec<_>>()) {
            Ok(sizes) => format!("GraphAllocator(n_buffers={n}, sizes={sizes:?})"),
            Err(_) => format!("GraphAllocator(n_buffers={n}, busy)"),
        }
    }
}

/// Registers the classes and functions.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyTensorAllocator>()?;
    m.add_class::<PyGraphAllocator>()?;
    m.add_function(wrap_pyfunction!(alloc_ctx_tensors, m)?)?;
    m.add_function(wrap_pyfunction!(ctx_tensors_size, m)?)?;
    m.add_function(wrap_pyfunction!(tensor_alloc, m)?)?;
    m.add_function(wrap_pyfunction!(view_init, m)?)?;
    Ok(())
}
