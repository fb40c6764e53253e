//! The Python `Graph`: nodes and leafs in execution order.

use pyo3::prelude::*;
use pyo3::types::PyList;

use super::tensor::PyTensor;
use super::utils::{type_error, type_name};
use ferrograph::graph::Graph;
use ferrograph::tensor::Tensor;

/// One tensor or a list of tensors (the outputs of a graph).
pub(crate) enum Outputs<'py> {
    /// A single output.
    One(Bound<'py, PyTensor>),
    /// Several outputs, expanded in order.
    Many(Vec<Bound<'py, PyTensor>>),
}

impl<'a, 'py> FromPyObject<'a, 'py> for Outputs<'py> {
    type Error = PyErr;

    fn extract(obj: pyo3::Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        if let Ok(t) = obj.cast::<PyTensor>() {
            return Ok(Outputs::One(t.to_owned()));
        }
        let wrong = |what: String| {
            type_error(format!(
                "Graph.build needs a Tensor or a sequence of Tensors, got {what}"
            ))
        };
        if obj.is_instance_of::<pyo3::types::PyString>() {
            return Err(wrong(type_name(&obj)));
        }
        let items = obj.try_iter().map_err(|_| wrong(type_name(&obj)))?;
        let mut tensors = Vec::new();
        for (i, item) in items.enumerate() {
            let item = item?;
            match item.cast_into::<PyTensor>() {
                Ok(t) => tensors.push(t),
                Err(e) => {
                    return Err(wrong(format!(
                        "{} at position {i}",
                        type_name(&e.into_inner())
                    )))
                }
            }
        }
        Ok(Outputs::Many(tensors))
    }
}

/// A computation graph: the tensors needed for some outputs, operands before consumers.
/// `len(g)`, iteration and indexing walk the nodes; leafs are in `g.leafs`.
#[pyclass(name = "Graph", module = "ferrograph", frozen)]
pub struct PyGraph {
    pub(crate) inner: Graph,
}

fn tensor_list<'py>(py: Python<'py>, tensors: &[Tensor]) -> PyResult<Bound<'py, PyList>> {
    let items = tensors
        .iter()
        .map(|t| PyTensor::wrap(py, t.clone()))
        .collect::<PyResult<Vec<_>>>()?;
    PyList::new(py, items)
}

fn html_escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

#[pymethods]
impl PyGraph {
    /// The graph computing `outputs` (a tensor or a list of tensors).
    #[staticmethod]
    fn build(outputs: Outputs<'_>) -> PyGraph {
        let tensors: Vec<Tensor> = match outputs {
            Outputs::One(t) => vec![t.get().inner.clone()],
            Outputs::Many(ts) => ts.iter().map(|t| t.get().inner.clone()).collect(),
        };
        PyGraph {
            inner: Graph::build(&tensors),
        }
    }

    /// The computed tensors, in execution order.
    #[getter]
    fn nodes<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        tensor_list(py, self.inner.nodes())
    }

    /// The tensors no op computes (weights, inputs, constants).
    #[getter]
    fn leafs<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        tensor_list(py, self.inner.leafs())
    }

    /// Number of nodes.
    #[getter]
    fn n_nodes(&self) -> usize {
        self.inner.n_nodes()
    }

    /// Number of leafs.
    #[getter]
    fn n_leafs(&self) -> usize {
        self.inner.n_leafs()
    }

    fn __len__(&self) -> usize {
        self.inner.n_nodes()
    }

    fn __iter__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        tensor_list(py, self.inner.nodes())?
            .into_any()
            .try_iter()
            .map(Bound::into_any)
    }

    /// The node at `i` (negative counts from the end); OutOfBoundsError outside.
    fn __getitem__<'py>(&self, py: Python<'py>, i: isize) -> PyResult<Bound<'py, PyTensor>> {
        PyTensor::wrap(py, self.inner.node(i)?.clone())
    }

    fn __contains__(&self, tensor: &Bound<'_, PyAny>) -> bool {
        tensor
            .cast::<PyTensor>()
            .is_ok_and(|t| self.inner.contains(&t.get().inner))
    }

    /// The first node or leaf with this name, or None.
    fn get_tensor<'py>(
        &self,
        py: Python<'py>,
        name: &str,
    ) -> PyResult<Option<Bound<'py, PyTensor>>> {
        self.inner
            .get_tensor(name)
            .map(|t| PyTensor::wrap(py, t.clone()))
            .transpose()
    }

    /// A graph of the nodes `start:end` only (no leafs).
    fn view(&self, start: usize, end: usize) -> PyResult<PyGraph> {
        Ok(PyGraph {
            inner: self.inner.view(start, end)?,
        })
    }

    /// A GraphViz DOT description (leafs as boxes, nodes as ellipses).
    fn to_dot(&self) -> String {
        self.inner.to_dot()
    }

    fn __str__(&self) -> String {
        self.inner.to_string()
    }

    fn __repr__(&self) -> String {
        format!("{:?}", self.inner)
    }

    /// An HTML table of the nodes (metadata only; long graphs show the first 50 nodes).
    fn _repr_html_(&self) -> String {
        let mut html = format!(
            "<table><tr><th colspan=\"5\">ferrograph.Graph: {} nodes, {} leafs</th></tr>\
             <tr><th>#</th><th>op</th><th>dtype</th><th>shape</th><th>name</th></tr>",
            self.inner.n_nodes(),
            self.inner.n_leafs()
        );
        for (i, node) in self.inner.nodes().iter().take(50).enumerate() {
            html.push_str(&format!(
                "<tr><td>{i}</td><td>{}</td><td>{}</td><td>{:?}</td><td>{}</td></tr>",
                html_escape(&node.op().display_name()),
                node.dtype().name(),
                node.shape(),
                html_escape(&node.name())
            ));
        }
        if self.inner.n_nodes() > 50 {
            html.push_str("<tr><td colspan=\"5\">…</td></tr>");
        }
        html.push_str("</table>");
        html
    }
}
