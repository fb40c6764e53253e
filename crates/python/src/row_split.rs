//! Python bindings of the split buffer type (`crates/backends/src/row_split.rs`): a buffer type whose tensors'
//! rows are spread over several devices, its device and backend (through the inherited
//! `BufferType.device`), and the stand-alone row-split product of `SplitWeight`.

use std::sync::Arc;

use numpy::{PyArray1, PyArrayMethods};
use pyo3::prelude::*;

use super::backend::{PyBufferType, PyDevice, PyRegistration};
use super::convert::numpy;
use super::dtype::{self, DTypeArg};
use super::errors;
use super::tensor::PyTensor;
use ferrograph::buffer::BufferType;
use ferrograph::context::Context;
use ferrograph::device::Device;
use ferrograph::dtype::DType;
use ferrograph::row_split::{SplitBufferType, SplitPart, SplitWeight};

/// A buffer type whose matrices' rows are divided among several devices (ggml's split buffer
/// type).
///
/// ``SplitBufferType(registration, tensor_split=[...])`` splits over every device of a
/// :class:`Registration`; a sequence of :class:`Device` objects (possibly of different
/// registrations, e.g. remote servers) works too. Device ``i`` takes a share of the rows
/// proportional to ``tensor_split[i]``; an empty or all-zero list gives equal shares.
///
/// It is a :class:`BufferType`: weights allocated in it
/// (``fg.alloc_ctx_tensors_from_buft(ctx, split)``) keep each device's rows in that device's
/// memory, and ``split.device.init_backend()`` opens the backend that computes ``mul_mat``
/// with them, part by part; a :class:`Scheduler` given that backend runs such products there.
#[pyclass(name = "SplitBufferType", module = "ferrograph", frozen, extends = PyBufferType)]
pub struct PySplitBufferType {
    inner: Arc<SplitBufferType>,
}

#[pymethods]
impl PySplitBufferType {
    #[new]
    #[pyo3(signature = (devices, tensor_split = Vec::new()))]
    fn new(
        devices: &Bound<'_, PyAny>,
        tensor_split: Vec<f32>,
    ) -> PyResult<PyClassInitializer<Self>> {
        let inner =
            if let Ok(reg) = devices.cast::<PyRegistration>() {
                SplitBufferType::new(&*reg.get().inner, &tensor_split)?
            } else if let Ok(iter) = devices.try_iter() {
                let mut list: Vec<Arc<dyn Device>> = Vec::new();
                for item in iter {
                    let item = item?;
                    let device =
                        item.cast::<PyDevice>().map_err(|_| {
                            errors::invalid(format!(
                        "SplitBufferType takes a Registration or Devices, got a {} in the list",
                        item.get_type().name().map(|n| n.to_string()).unwrap_or_default()
                    ))
                        })?;
                    list.push(device.get().inner.clone());
                }
                let name = list
                    .iter()
                    .map(|d| d.name().to_owned())
                    .collect::<Vec<_>>()
                    .join("+");
                SplitBufferType::from_devices(&name, list, &tensor_split)?
            } else {
                return Err(pyo3::exceptions::PyTypeError::new_err(format!(
                    "SplitBufferType takes a Registration or a sequence of Devices, got {}",
                    devices.get_type().name()?
                )));
            };
        let base = PyBufferType {
            inner: inner.clone() as Arc<dyn BufferType>,
        };
        Ok(PyClassInitializer::from(base).add_subclass(PySplitBufferType { inner }))
    }

    /// The registration's name (for a list of devices, their names joined by ``+``).
    #[getter]
    fn registration(&self) -> String {
        self.inner.registration().to_owned()
    }

    /// The devices, in split order.
    #[getter]
    fn devices(&self) -> Vec<PyDevice> {
        self.inner
            .devices()
            .iter()
            .map(|d| PyDevice { inner: d.clone() })
            .collect()
    }

    /// The ``(start, stop)`` rows each device holds of a matrix of ``nrows`` rows: contiguous,
    /// in order, covering every row once (a device may get an empty range).
    fn row_ranges(&self, nrows: usize) -> Vec<(usize, usize)> {
        self.inner
            .row_ranges(nrows)
            .into_iter()
            .map(|r| (r.start, r.end))
            .collect()
    }

    /// The parts of ``tensor``, a tensor allocated in this buffer type:
    /// ``(device, (start, stop), part)`` for each device holding rows, ``part`` being those
    /// rows as a tensor in the device's memory. Raises ``InvalidArgumentError`` for any other
    /// tensor (or a view of part of one).
    fn tensor_parts<'py>(
        &self,
        py: Python<'py>,
        tensor: &PyTensor,
    ) -> PyResult<Vec<PartTuple<'py>>> {
        let parts = self.inner.tensor_parts(&tensor.inner).ok_or_else(|| {
            errors::invalid(format!(
                "{} is not a tensor allocated in {}",
                tensor.inner.label(),
                self.inner.name()
            ))
        })?;
        part_tuples(py, parts.parts())
    }

    /// Allocates a weight of numpy ``shape`` ``(nrows, row_len)`` and ``dtype`` (default
    /// float32) in a buffer of this type, each device's rows in that device's memory. Its
    /// contents are undefined until :meth:`SplitWeight.set`.
    #[pyo3(signature = (shape, dtype = DTypeArg(DType::F32)))]
    fn alloc_weight(&self, shape: (usize, usize), dtype: DTypeArg) -> PyResult<PySplitWeight> {
        let (nrows, row_len) = shape;
        let weight = self.inner.alloc_weight(dtype.0, row_len, nrows)?;
        Ok(PySplitWeight {
            inner: Arc::new(weight),
        })
    }

    fn __repr__(&self) -> String {
        let names: Vec<&str> = self.inner.devices().iter().map(|d| d.name()).collect();
        format!(
            "SplitBufferType(registration={:?}, devices={names:?})",
            self.inner.registration()
        )
    }
}

/// One part of a split weight as Python sees it: `(device, (start, stop), tensor)`.
type PartTuple<'py> = (PyDevice, (usize, usize), Bound<'py, PyTensor>);

fn part_tuples<'py>(py: Python<'py>, parts: &[SplitPart]) -> PyResult<Vec<PartTuple<'py>>> {
    parts
        .iter()
        .map(|p| {
            Ok((
                PyDevice {
                    inner: p.device.clone(),
                },
                (p.rows.start, p.rows.end),
                PyTensor::wrap(py, p.tensor.clone())?,
            ))
        })
        .collect()
}

/// A weight matrix whose rows live on several devices (made by
/// :meth:`SplitBufferType.alloc_weight`).
#[pyclass(name = "SplitWeight", module = "ferrograph", frozen)]
pub struct PySplitWeight {
    inner: Arc<SplitWeight>,
}

#[pymethods]
impl PySplitWeight {
    /// Numpy shape ``(nrows, row_len)``.
    #[getter]
    fn shape(&self) -> (usize, usize) {
        let [row_len, nrows] = self.inner.ne();
        (nrows, row_len)
    }

    /// The element type.
    #[getter]
    fn dtype<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        dtype::to_py(py, self.inner.dtype())
    }

    /// The parts in row order: ``(device, (start, stop), tensor)`` for each device holding
    /// rows, ``tensor`` being its rows (numpy shape ``(stop - start, row_len)``).
    fn parts<'py>(&self, py: Python<'py>) -> PyResult<Vec<PartTuple<'py>>> {
        part_tuples(py, self.inner.parts())
    }

    /// The weight as a tensor in its split buffer, for graphs (see :class:`SplitBufferType`).
    #[getter]
    fn tensor<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTensor>> {
        PyTensor::wrap(py, self.inner.tensor().clone())
    }

    /// Sets the whole weight from an array of its shape (converted to its dtype as
    /// :meth:`Tensor.set` does); each device receives its rows. Returns the weight.
    fn set<'py>(slf: Bound<'py, Self>, array: &Bound<'py, PyAny>) -> PyResult<Bound<'py, Self>> {
        let py = slf.py();
        let weight = slf.get().inner.clone();
        // Convert through a host tensor of the same dtype and shape, so every conversion rule
        // (and its errors) is Tensor.set's.
        let ctx = Context::new(false);
        let [row_len, nrows] = weight.ne();
        let staging = ctx.new_tensor(weight.dtype(), &[row_len, nrows])?;
        PyTensor::wrap(py, staging.clone())?.call_method1("set", (array,))?;
        py.detach(move || -> ferrograph::Result<()> {
            let mut bytes = vec![0u8; staging.nbytes()];
            staging.read_bytes(0, &mut bytes)?;
            weight.set_bytes(&bytes)
        })?;
        Ok(slf)
    }

    /// ``x @ W.T`` with the rows of ``W`` split: ``x`` is float32 of shape ``(n, row_len)``
    /// (or ``(row_len,)``); the result has shape ``(n, nrows)`` (or ``(nrows,)``). Each part is
    /// multiplied on a backend of its own device and the columns are gathered in order, so
    /// the result equals the unsplit ``mul_mat(W, x)``. Runs with the interpreter released.
    fn mul_mat<'py>(&self, py: Python<'py>, x: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
        let np = numpy(py)?;
        let x = np.call_method1("ascontiguousarray", (x, "float32"))?;
        let shape: Vec<usize> = x.getattr("shape")?.extract()?;
        let [row_len, nrows] = self.inner.ne();
        let (n_cols, vector) = match shape.as_slice() {
            [k] if *k == row_len => (1, true),
            [n, k] if *k == row_len => (*n, false),
            _ => {
                return Err(errors::shape(format!(
                    "mul_mat needs x of shape (n, {row_len}) or ({row_len},), got {shape:?}"
                )))
            }
        };
        let flat = x.call_method1("reshape", (-1,))?;
        let values: Vec<f32> = flat.cast::<PyArray1<f32>>()?.to_vec()?;
        let weight = self.inner.clone();
        let out = py.detach(move || weight.mul_mat(&values, n_cols))?;
        let array = PyArray1::from_vec(py, out).into_any();
        if vector {
            Ok(array)
        } else {
            array.call_method1("reshape", ((n_cols, nrows),))
        }
    }

    fn __repr__(&self) -> String {
        let [row_len, nrows] = self.inner.ne();
        let parts: Vec<String> = self
            .inner
            .parts()
            .iter()
            .map(|p| format!("{}[{}:{}]", p.device.name(), p.rows.start, p.rows.end))
            .collect();
        format!(
            "SplitWeight(shape=({nrows}, {row_len}), dtype={}, parts=[{}])",
            self.inner.dtype().name(),
            parts.join(", ")
        )
    }
}

/// Adds the classes to the module.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PySplitBufferType>()?;
    m.add_class::<PySplitWeight>()?;
    Ok(())
}
