//! `ferrograph.Profile`: the per-node timings of one profiled scheduler run
//! (`Scheduler.graph_compute(graph, profile=True)`), with per-op totals, the slowest nodes and
//! a readable table.

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

use ferrograph::sched::{NodeTime, Profile};

/// Nodes the table and `str()` list by default.
const DEFAULT_TOP: usize = 10;

/// Where the time of a scheduler run went: wall time per node, totals per op type.
///
/// On the CPU backend the run is a normal one with the clock read around each node, so node
/// times are what the run spends on them (a fused run of mat-vecs is shared among its products
/// by weight bytes) and `total_seconds - node_seconds` is the run's own bookkeeping. On other
/// backends (or with an eval callback) each node is computed on its own and waited for, which
/// costs a dispatch and a wait per node. Node times never overlap (one node's rows are still
/// shared among the CPU threads). Copies between backends count in `total_seconds` but in no
/// node. `p1 + p2` adds two runs' timings.
#[pyclass(name = "Profile", module = "ferrograph", frozen)]
pub(crate) struct PyProfile {
    inner: Profile,
}

impl From<Profile> for PyProfile {
    fn from(inner: Profile) -> Self {
        PyProfile { inner }
    }
}

fn node_dict<'py>(py: Python<'py>, n: &NodeTime) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("index", n.index)?;
    d.set_item("name", &n.name)?;
    d.set_item("op", &n.op)?;
    d.set_item("shape", pyo3::types::PyTuple::new(py, &n.shape)?)?;
    d.set_item("backend", &n.backend)?;
    d.set_item("seconds", n.seconds)?;
    Ok(d)
}

#[pymethods]
impl PyProfile {
    /// Wall time of the whole call, in seconds (node times sum to at most this).
    #[getter]
    fn total_seconds(&self) -> f64 {
        self.inner.total_seconds
    }

    /// Summed wall time of the nodes, in seconds.
    #[getter]
    fn node_seconds(&self) -> f64 {
        self.inner.node_seconds()
    }

    /// Every node in execution order, as dicts: index, name, op, shape, backend, seconds.
    #[getter]
    fn nodes<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let items = self
            .inner
            .nodes
            .iter()
            .map(|n| node_dict(py, n))
            .collect::<PyResult<Vec<_>>>()?;
        PyList::new(py, items)
    }

    /// Per op type, slowest first: `{op: {"count": n, "seconds": s}}`.
    #[getter]
    fn ops<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        for t in self.inner.by_op() {
            let entry = PyDict::new(py);
            entry.set_item("count", t.count)?;
            entry.set_item("seconds", t.seconds)?;
            d.set_item(&t.op, entry)?;
        }
        Ok(d)
    }

    /// The `n` slowest nodes, slowest first (dicts as in `nodes`).
    #[pyo3(signature = (n = 10))]
    fn top<'py>(&self, py: Python<'py>, n: usize) -> PyResult<Bound<'py, PyList>> {
        let items = self
            .inner
            .top(n)
            .into_iter()
            .map(|t| node_dict(py, t))
            .collect::<PyResult<Vec<_>>>()?;
        PyList::new(py, items)
    }

    /// The readable table: a summary line, per-op totals, then the `top` slowest nodes.
    #[pyo3(signature = (top = 10))]
    fn table(&self, top: usize) -> String {
        self.inner.table(top)
    }

    /// Plain data: total_seconds, node_seconds, ops (as `ops`) and nodes (as `nodes`).
    fn to_dict<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        d.set_item("total_seconds", self.inner.total_seconds)?;
        d.set_item("node_seconds", self.inner.node_seconds())?;
        d.set_item("ops", self.ops(py)?)?;
        d.set_item("nodes", self.nodes(py)?)?;
        Ok(d)
    }

    /// Both runs' timings in one profile (e.g. one run per batch).
    fn __add__(&self, other: PyRef<'_, PyProfile>) -> PyProfile {
        let mut inner = self.inner.clone();
        inner.merge(&other.inner);
        PyProfile { inner }
    }

    /// `other + self`; a `0` on the left gives this profile, so `sum(profiles)` works.
    fn __radd__(&self, other: &Bound<'_, PyAny>) -> PyResult<Py<PyAny>> {
        let py = other.py();
        let mut inner = match other.cast::<PyProfile>() {
            Ok(left) => left.get().inner.clone(),
            Err(_) if other.extract::<i64>().is_ok_and(|v| v == 0) => Profile::default(),
            Err(_) => return Ok(py.NotImplemented()),
        };
        inner.merge(&self.inner);
        Ok(Py::new(py, PyProfile { inner })?.into_any())
    }

    fn __len__(&self) -> usize {
        self.inner.nodes.len()
    }

    fn __str__(&self) -> String {
        self.inner.table(DEFAULT_TOP)
    }

    fn __repr__(&self) -> String {
        let slowest = self
            .inner
            .by_op()
            .first()
            .map(|t| format!(", slowest op {} {:.3} ms", t.op, t.seconds * 1e3))
            .unwrap_or_default();
        format!(
            "<Profile {} nodes, {:.3} ms total{slowest}>",
            self.inner.nodes.len(),
            self.inner.total_seconds * 1e3
        )
    }
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyProfile>()
}
