//! The Python `Context`: a tensor factory, and with `with ctx:` the context that `fg.ops`
//! builders use when none is given.

use std::cell::RefCell;

use pyo3::prelude::*;
use pyo3::types::PyList;

use super::dtype::DTypeArg;
use super::tensor::PyTensor;
use ferrograph::context::Context;

thread_local! {
    /// The contexts entered with `with ctx:` on this thread, innermost last.
    static ACTIVE: RefCell<Vec<Context>> = const { RefCell::new(Vec::new()) };
}

/// The innermost context entered with `with ctx:` on this thread.
pub(crate) fn active() -> Option<Context> {
    ACTIVE.with(|stack| stack.borrow().last().cloned())
}

pub(crate) use super::utils::ShapeArg;

/// A tensor factory. `Context()` makes metadata only (`no_alloc=True`); `Context(no_alloc=False)`
/// gives every new (non-view) tensor host memory at once. `with ctx:` makes it the context
/// `fg.ops` builders use when no `ctx=` is given.
///
/// The context owns (keeps alive until it is dropped) what `new_tensor` makes and the op
/// results built with `ctx=ctx` or inside `with ctx:`; `tensors()` and `len()` list exactly
/// those. An op result built with neither belongs to no context: your handle, later ops and
/// graphs hold it, and it is freed with the last of them (its `context` is still its first
/// operand's, which does not list it). So a loop that builds a graph per request against a
/// weights context loaded once keeps that context (and the process) at a constant size.
#[pyclass(name = "Context", module = "ferrograph", frozen)]
pub struct PyContext {
    pub(crate) inner: Context,
}

#[pymethods]
impl PyContext {
    #[new]
    #[pyo3(signature = (no_alloc = true))]
    fn new(no_alloc: bool) -> Self {
        PyContext {
            inner: Context::new(no_alloc),
        }
    }

    /// Whether tensors are created without memory.
    #[getter]
    fn no_alloc(&self) -> bool {
        self.inner.no_alloc()
    }

    /// Bytes of host memory the context holds for its tensors.
    #[getter]
    fn host_bytes(&self) -> usize {
        self.inner.host_bytes()
    }

    /// A new leaf tensor. `shape` is numpy-ordered (last axis fastest), an int or 1 to 4
    /// ints; `t.ne` gives ggml's order.
    #[pyo3(signature = (dtype, shape, name = None))]
    fn new_tensor<'py>(
        &self,
        py: Python<'py>,
        dtype: DTypeArg,
        shape: ShapeArg,
        name: Option<&str>,
    ) -> PyResult<Bound<'py, PyTensor>> {
        let shape = shape.into_vec();
        if shape.is_empty() {
            return Err(super::errors::shape(
                "a tensor needs 1 to 4 dimensions, got an empty shape",
            ));
        }
        let tensor = self.inner.new_tensor_shape(dtype.0, &shape)?;
        if let Some(name) = name {
            tensor.set_name(name);
        }
        PyTensor::wrap(py, tensor)
    }

    /// Every live tensor of the context (leaves and op results), in creation order.
    fn tensors<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let items = self
            .inner
            .tensors()
            .into_iter()
            .map(|t| PyTensor::wrap(py, t))
            .collect::<PyResult<Vec<_>>>()?;
        PyList::new(py, items)
    }

    /// The first tensor with this name, or None.
    fn get_tensor<'py>(
        &self,
        py: Python<'py>,
        name: &str,
    ) -> PyResult<Option<Bound<'py, PyTensor>>> {
        self.inner
            .get_tensor(name)
            .map(|t| PyTensor::wrap(py, t))
            .transpose()
    }

    /// A text listing of the context's tensors.
    fn describe(&self) -> String {
        self.inner.describe()
    }

    /// How many tensors the context owns.
    fn __len__(&self) -> usize {
        self.inner.len()
    }

    fn __enter__(slf: Bound<'_, Self>) -> Bound<'_, Self> {
        let ctx = slf.get().inner.clone();
        ACTIVE.with(|stack| stack.borrow_mut().push(ctx));
        slf
    }

    #[pyo3(signature = (*_args))]
    fn __exit__(&self, _args: &Bound<'_, pyo3::types::PyTuple>) -> bool {
        ACTIVE.with(|stack| {
            let mut stack = stack.borrow_mut();
            if let Some(i) = stack.iter().rposition(|c| c.same(&self.inner)) {
                stack.remove(i);
            }
        });
        false
    }

    fn __eq__(&self, other: &Bound<'_, PyAny>) -> bool {
        other
            .cast::<PyContext>()
            .is_ok_and(|o| o.get().inner.same(&self.inner))
    }

    fn __hash__(&self) -> u64 {
        self.inner.id() as u64
    }

    fn __repr__(&self) -> String {
        format!("{:?}", self.inner)
    }
}
