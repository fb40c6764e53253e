//! GGUF files from Python: `GGUFFile` (reading, `tensor`, `raw`, `load`), `GGUFTensorInfo`,
//! and `gguf_write`, which `ferrograph.gguf.write` calls once it has given every metadata value
//! its GGUF type.
//!
//! Shapes are numpy-ordered here (the file's `ne` reversed). Parsing, dequantizing, loading and
//! writing run with the interpreter released.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use numpy::ndarray::ArrayView1;
use numpy::{PyArray1, PyArrayMethods};
use pyo3::exceptions::{PyFileNotFoundError, PyKeyError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyTuple};

use super::backend::{PyBackend, PyBuffer, PyBufferType, PyDevice};
use super::context::PyContext;
use super::convert::{numpy, DETACH_THRESHOLD};
use super::dtype::{self, DTypeArg};
use super::errors::guard;
use super::tensor::{numpy_dtype, PyTensor};
use super::utils::{type_error, type_name};
use ferrograph::buffer::BufferType;
use ferrograph::context::Context;
use ferrograph::device::Device;
use ferrograph::error::Error;
use ferrograph::gguf::{
    write_gguf, GgufArray, GgufFile, GgufTensorInfo, GgufTensorToWrite, GgufType, GgufValue,
    MAX_ARRAY_NESTING,
};

/// What the file says about one tensor: `name`, `dtype`, `shape` (numpy order), `ne` (ggml
/// order, four entries), `n_dims`, `offset` (of its data in the file), `nbytes`.
#[pyclass(name = "GGUFTensorInfo", module = "ferrograph.gguf", frozen, eq)]
#[derive(PartialEq)]
pub struct PyGgufTensorInfo {
    info: GgufTensorInfo,
}

#[pymethods]
impl PyGgufTensorInfo {
    /// The tensor's name.
    #[getter]
    fn name(&self) -> &str {
        &self.info.name
    }

    /// The element type (an `fg.DType`).
    #[getter]
    fn dtype<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        dtype::to_py(py, self.info.dtype)
    }

    /// The numpy-order shape: the file's dimensions, slowest first.
    #[getter]
    fn shape<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        PyTuple::new(py, self.info.shape())
    }

    /// ggml's dimensions, fastest first, padded with ones to four.
    #[getter]
    fn ne<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        PyTuple::new(py, self.info.ne)
    }

    /// How many dimensions the file gives (0 to 4).
    #[getter]
    fn n_dims(&self) -> usize {
        self.info.n_dims
    }

    /// The byte offset of the tensor's data in the file.
    // Python's `offset` is the absolute one (what a reader seeks to), not the offset inside
    // the data section that the core's `GgufTensorInfo::offset` holds.
    #[allow(clippy::misnamed_getters)]
    #[getter]
    fn offset(&self) -> usize {
        self.info.file_offset
    }

    /// The size of the tensor's data in bytes.
    #[getter]
    fn nbytes(&self) -> usize {
        self.info.nbytes
    }

    /// The number of elements.
    #[getter]
    fn nelements(&self) -> usize {
        self.info.nelements()
    }

    fn __repr__(&self) -> String {
        format!(
            "GGUFTensorInfo(name={:?}, dtype={}, shape={:?}, offset={}, nbytes={})",
            self.info.name,
            self.info.dtype.name(),
            self.info.shape(),
            self.info.file_offset,
            self.info.nbytes
        )
    }
}

/// Keeps a file's map alive while numpy views of it exist.
#[pyclass(module = "ferrograph._core", frozen)]
struct GgufMemory {
    _file: Arc<GgufFile>,
}

/// A device given as a `Backend` (its device) or a `Device`.
enum DeviceArg {
    Device(Arc<dyn Device>),
}

impl<'a, 'py> FromPyObject<'a, 'py> for DeviceArg {
    type Error = PyErr;

    fn extract(obj: pyo3::Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        if let Ok(b) = obj.cast::<PyBackend>() {
            return Ok(DeviceArg::Device(b.get().inner.device()));
        }
        if let Ok(d) = obj.cast::<PyDevice>() {
            return Ok(DeviceArg::Device(d.get().inner.clone()));
        }
        Err(type_error(format!(
            "expected a Backend or a Device, got {}",
            type_name(&obj)
        )))
    }
}

/// A GGUF file (version 2 or 3), memory-mapped: its metadata, its tensor infos, each tensor as
/// a numpy array, and all tensors bound to a device at once. A context manager: leaving the
/// `with` block closes it.
///
/// Malformed files raise `fg.GGUFError` (naming the file, the field and its byte offset); a
/// missing file raises `FileNotFoundError`.
#[pyclass(name = "GGUFFile", module = "ferrograph.gguf", frozen)]
pub struct PyGgufFile {
    path: String,
    file: Mutex<Option<Arc<GgufFile>>>,
}

impl PyGgufFile {
    /// The open file, or the error for a closed one.
    fn open_file(&self) -> PyResult<Arc<GgufFile>> {
        self.file
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
            .ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "GGUF file {:?} is closed (use it inside its `with` block)",
                    self.path
                ))
                .into()
            })
    }

    fn info(&self, file: &GgufFile, name: &str) -> PyResult<GgufTensorInfo> {
        file.tensor_info(name).cloned().ok_or_else(|| {
            PyKeyError::new_err(format!("{:?}: no tensor named {name:?}", self.path))
        })
    }
}

#[pymethods]
impl PyGgufFile {
    /// Opens and checks the file at `path` (a str or path-like).
    #[new]
    fn new(py: Python<'_>, path: PathBuf) -> PyResult<Self> {
        let shown = path.display().to_string();
        if !path.exists() {
            return Err(PyFileNotFoundError::new_err((
                2,
                "No such file or directory",
                shown,
            )));
        }
        let file = py.detach(|| guard("GGUFFile", || GgufFile::open(&path)))?;
        Ok(PyGgufFile {
            path: shown,
            file: Mutex::new(Some(Arc::new(file))),
        })
    }

    /// The path, as given.
    #[getter]
    fn path(&self) -> &str {
        &self.path
    }

    /// The format version (2 or 3).
    #[getter]
    fn version(&self) -> PyResult<u32> {
        Ok(self.open_file()?.version())
    }

    /// The alignment of the data section and of tensor offsets (32 unless the file says).
    #[getter]
    fn alignment(&self) -> PyResult<usize> {
        Ok(self.open_file()?.alignment())
    }

    /// The byte offset where the data section starts.
    #[getter]
    fn data_offset(&self) -> PyResult<usize> {
        Ok(self.open_file()?.data_offset())
    }

    /// Whether `close()` was called (or the `with` block left).
    #[getter]
    fn closed(&self) -> bool {
        self.file
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .is_none()
    }

    /// The metadata as a new dict in file order: ints, floats, bools, strs, and lists for
    /// arrays (nested lists for arrays of arrays).
    #[getter]
    fn metadata<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let file = self.open_file()?;
        let dict = PyDict::new(py);
        for (key, value) in file.metadata() {
            dict.set_item(key, value_to_py(py, value)?)?;
        }
        Ok(dict)
    }

    /// Every tensor info, in file order.
    #[getter]
    fn tensors(&self) -> PyResult<Vec<PyGgufTensorInfo>> {
        Ok(self
            .open_file()?
            .tensors()
            .iter()
            .map(|info| PyGgufTensorInfo { info: info.clone() })
            .collect())
    }

    /// The tensor `name` as a new numpy array in numpy-order shape: f32, f16, bf16 (as
    /// `ml_dtypes.bfloat16`, else uint16 bits) and integer types as themselves, block types
    /// dequantized to float32. KeyError for an unknown name.
    fn tensor<'py>(&self, py: Python<'py>, name: &str) -> PyResult<Bound<'py, PyAny>> {
        let file = self.open_file()?;
        let info = self.info(&file, name)?;
        let shape = PyTuple::new(py, info.shape())?;
        let large = info.nbytes >= DETACH_THRESHOLD;
        if info.dtype.is_quantized() {
            let work = || guard("GGUFFile.tensor", || file.tensor_to_f32(name));
            let values = if large { py.detach(work)? } else { work()? };
            return PyArray1::from_vec(py, values).call_method1("reshape", (shape,));
        }
        let array = numpy(py)?.call_method1("empty", (shape, numpy_dtype(py, info.dtype)?))?;
        {
            let bytes = array
                .call_method1("reshape", (-1,))?
                .call_method1("view", (numpy(py)?.getattr("uint8")?,))?;
            let bytes = bytes.cast_into::<PyArray1<u8>>()?;
            let mut bytes = bytes.readwrite();
            let dst = bytes
                .as_slice_mut()
                .map_err(|e| super::errors::shape(e.to_string()))?;
            let src = file.tensor_data(name).unwrap_or_default();
            if large {
                py.detach(|| dst.copy_from_slice(src));
            } else {
                dst.copy_from_slice(src);
            }
        }
        Ok(array)
    }

    /// The bytes of tensor `name` as a read-only 1-d uint8 numpy array over the file's map (no
    /// copy; the array keeps the map alive after `close()`). KeyError for an unknown name.
    fn raw<'py>(&self, py: Python<'py>, name: &str) -> PyResult<Bound<'py, PyAny>> {
        let file = self.open_file()?;
        self.info(&file, name)?;
        let data = file.tensor_data(name).unwrap_or_default();
        let (ptr, len) = (data.as_ptr(), data.len());
        let container = Bound::new(
            py,
            GgufMemory {
                _file: file.clone(),
            },
        )?;
        // SAFETY: `ptr` points at `len` bytes of the file's map, which stays mapped while the
        // `GgufFile` lives; the container holds an `Arc` of it, and numpy keeps the container
        // as the array's base for as long as the array (or any view of it) exists. The map is
        // read-only, so the array is made read-only below before anyone sees it.
        let array = unsafe {
            let view = ArrayView1::from_shape_ptr(len, ptr);
            PyArray1::<u8>::borrow_from_array(&view, container.into_any())
        };
        let kwargs = PyDict::new(py);
        kwargs.set_item("write", false)?;
        array.call_method("setflags", (), Some(&kwargs))?;
        Ok(array.into_any())
    }

    /// Binds every tensor to one buffer of `target` (a `Backend`, for its device, or a
    /// `Device`) and returns `(buffer, tensors)`: `tensors` maps each name (in file order) to
    /// an `fg.Tensor` and has a `context` attribute, the context the tensors belong to (kept
    /// alive by the mapping; pass `ctx=` to use your own `no_alloc` context instead).
    ///
    /// On devices that can wrap host memory (the CPU, BLAS) nothing is copied: the buffer
    /// wraps a private copy-on-write map of the file, whose pages stay shared with the page
    /// cache until written. Other devices get a buffer of their own type with the data copied
    /// in. The buffer is marked as weights.
    ///
    /// `placed` maps tensor names to buffer types (such as the CPU device's
    /// `extra_buffer_types()`, whose repacking type stores matrices in its kernels' layout):
    /// those tensors are copied into buffers of their type instead, and the file pages only
    /// they used are released. The returned buffer holds the others.
    #[pyo3(signature = (target, ctx = None, placed = None))]
    fn load<'py>(
        &self,
        py: Python<'py>,
        target: DeviceArg,
        ctx: Option<PyRef<'py, PyContext>>,
        placed: Option<std::collections::HashMap<String, PyRef<'py, PyBufferType>>>,
    ) -> PyResult<(PyBuffer, Bound<'py, PyAny>)> {
        let file = self.open_file()?;
        let DeviceArg::Device(device) = target;
        let context = match &ctx {
            Some(c) => c.inner.clone(),
            None => Context::new(true),
        };
        let placed: std::collections::HashMap<String, Arc<dyn BufferType>> = placed
            .unwrap_or_default()
            .into_iter()
            .map(|(name, buft)| (name, buft.inner.clone()))
            .collect();
        let weights = py.detach(|| {
            guard("GGUFFile.load", || {
                file.load_into_placed(device.as_ref(), &context, &placed)
            })
        })?;
        let dict = PyDict::new(py);
        for tensor in &weights.tensors {
            dict.set_item(tensor.name(), PyTensor::wrap(py, tensor.clone())?)?;
        }
        let mapping = match py
            .import("ferrograph.gguf")
            .and_then(|m| m.getattr("GGUFTensors"))
        {
            Ok(class) => {
                let obj = class.call1((dict,))?;
                obj.setattr(
                    "context",
                    PyContext {
                        inner: weights.context.clone(),
                    },
                )?;
                obj
            }
            Err(_) => dict.into_any(),
        };
        Ok((
            PyBuffer {
                inner: weights.buffer,
            },
            mapping,
        ))
    }

    /// Closes the file: its map is released once no array from `raw()` and no tensor bound by
    /// `load()` uses it. Using the file afterwards raises InvalidArgumentError.
    fn close(&self) {
        self.file.lock().unwrap_or_else(|p| p.into_inner()).take();
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    fn __exit__(
        &self,
        _exc_type: Option<&Bound<'_, PyAny>>,
        _exc: Option<&Bound<'_, PyAny>>,
        _tb: Option<&Bound<'_, PyAny>>,
    ) -> bool {
        self.close();
        false
    }

    /// The number of tensors.
    fn __len__(&self) -> PyResult<usize> {
        Ok(self.open_file()?.tensors().len())
    }

    /// Whether the file has a tensor named `name`.
    fn __contains__(&self, name: &Bound<'_, PyAny>) -> PyResult<bool> {
        let file = self.open_file()?;
        Ok(name
            .extract::<String>()
            .is_ok_and(|n| file.tensor_info(&n).is_some()))
    }

    /// The info of tensor `name` (KeyError if there is none).
    fn __getitem__(&self, name: &str) -> PyResult<PyGgufTensorInfo> {
        let file = self.open_file()?;
        Ok(PyGgufTensorInfo {
            info: self.info(&file, name)?,
        })
    }

    /// The tensor names, in file order.
    fn __iter__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let file = self.open_file()?;
        let names: Vec<&str> = file.tensors().iter().map(|t| t.name.as_str()).collect();
        PyList::new(py, names)?.try_iter().map(Bound::into_any)
    }

    fn __repr__(&self) -> String {
        match self.file.lock().unwrap_or_else(|p| p.into_inner()).as_ref() {
            Some(f) => format!(
                "GGUFFile({:?}, version={}, tensors={}, metadata={}, alignment={}, size={})",
                self.path,
                f.version(),
                f.tensors().len(),
                f.metadata().len(),
                f.alignment(),
                f.size()
            ),
            None => format!("GGUFFile({:?}, closed)", self.path),
        }
    }
}

/// A metadata value as a Python object.
fn value_to_py<'py>(py: Python<'py>, value: &GgufValue) -> PyResult<Bound<'py, PyAny>> {
    Ok(match value {
        GgufValue::U8(v) => v.into_pyobject(py)?.into_any(),
        GgufValue::I8(v) => v.into_pyobject(py)?.into_any(),
        GgufValue::U16(v) => v.into_pyobject(py)?.into_any(),
        GgufValue::I16(v) => v.into_pyobject(py)?.into_any(),
        GgufValue::U32(v) => v.into_pyobject(py)?.into_any(),
        GgufValue::I32(v) => v.into_pyobject(py)?.into_any(),
        GgufValue::F32(v) => v.into_pyobject(py)?.into_any(),
        GgufValue::Bool(v) => v.into_pyobject(py)?.to_owned().into_any(),
        GgufValue::String(v) => v.into_pyobject(py)?.into_any(),
        GgufValue::Array(a) => array_to_py(py, a)?.into_any(),
        GgufValue::U64(v) => v.into_pyobject(py)?.into_any(),
        GgufValue::I64(v) => v.into_pyobject(py)?.into_any(),
        GgufValue::F64(v) => v.into_pyobject(py)?.into_any(),
    })
}

fn array_to_py<'py>(py: Python<'py>, array: &GgufArray) -> PyResult<Bound<'py, PyList>> {
    match array {
        GgufArray::U8(v) => PyList::new(py, v),
        GgufArray::I8(v) => PyList::new(py, v),
        GgufArray::U16(v) => PyList::new(py, v),
        GgufArray::I16(v) => PyList::new(py, v),
        GgufArray::U32(v) => PyList::new(py, v),
        GgufArray::I32(v) => PyList::new(py, v),
        GgufArray::F32(v) => PyList::new(py, v),
        GgufArray::Bool(v) => PyList::new(py, v),
        GgufArray::String(v) => PyList::new(py, v),
        GgufArray::Array(v) => {
            let items = v
                .iter()
                .map(|a| array_to_py(py, a))
                .collect::<PyResult<Vec<_>>>()?;
            PyList::new(py, items)
        }
        GgufArray::U64(v) => PyList::new(py, v),
        GgufArray::I64(v) => PyList::new(py, v),
        GgufArray::F64(v) => PyList::new(py, v),
    }
}

/// Converts typed values from `ferrograph.gguf` into [`GgufValue`]s, naming the key in errors.
struct ValueReader<'a> {
    path: &'a str,
}

impl ValueReader<'_> {
    fn fail(&self, field: &str, problem: impl std::fmt::Display) -> PyErr {
        Error::gguf(self.path, field, None, problem).into()
    }

    fn gguf_type(&self, field: &str, name: &Bound<'_, PyAny>) -> PyResult<GgufType> {
        let text: String = name
            .extract()
            .map_err(|_| self.fail(field, "the value type must be a str"))?;
        GgufType::from_name(&text).ok_or_else(|| {
            self.fail(
                field,
                format!(
                    "unknown value type {text:?}; expected u8, i8, u16, i16, u32, i32, u64, \
                     i64, f32, f64, bool, str or array"
                ),
            )
        })
    }

    /// A `(type, payload)` pair: scalars carry their value, arrays `(element type, items)`.
    fn value(&self, field: &str, obj: &Bound<'_, PyAny>) -> PyResult<GgufValue> {
        let (ty, payload): (Bound<'_, PyAny>, Bound<'_, PyAny>) = obj
            .extract()
            .map_err(|_| self.fail(field, "expected a (type, value) pair"))?;
        let ty = self.gguf_type(field, &ty)?;
        if ty == GgufType::Array {
            return Ok(GgufValue::Array(self.array(field, &payload, 1)?));
        }
        self.scalar(field, ty, &payload)
    }

    /// The error for `obj`, which is not a value of `ty`.
    fn not_a(&self, field: &str, ty: GgufType, obj: &Bound<'_, PyAny>) -> PyErr {
        self.fail(
            field,
            format!(
                "{} is not a {} value (or is out of its range)",
                obj.repr().map(|r| r.to_string()).unwrap_or_default(),
                ty.name()
            ),
        )
    }

    fn scalar(&self, field: &str, ty: GgufType, obj: &Bound<'_, PyAny>) -> PyResult<GgufValue> {
        let bad = |_| self.not_a(field, ty, obj);
        Ok(match ty {
            GgufType::U8 => GgufValue::U8(obj.extract().map_err(bad)?),
            GgufType::I8 => GgufValue::I8(obj.extract().map_err(bad)?),
            GgufType::U16 => GgufValue::U16(obj.extract().map_err(bad)?),
            GgufType::I16 => GgufValue::I16(obj.extract().map_err(bad)?),
            GgufType::U32 => GgufValue::U32(obj.extract().map_err(bad)?),
            GgufType::I32 => GgufValue::I32(obj.extract().map_err(bad)?),
            GgufType::F32 => GgufValue::F32(obj.extract().map_err(bad)?),
            GgufType::Bool => GgufValue::Bool(obj.extract().map_err(bad)?),
            GgufType::String => GgufValue::String(obj.extract().map_err(bad)?),
            GgufType::U64 => GgufValue::U64(obj.extract().map_err(bad)?),
            GgufType::I64 => GgufValue::I64(obj.extract().map_err(bad)?),
            GgufType::F64 => GgufValue::F64(obj.extract().map_err(bad)?),
            GgufType::Array => return Err(self.fail(field, "an array is not a scalar")),
        })
    }

    /// An `(element type, items)` pair at nesting `depth`.
    fn array(&self, field: &str, obj: &Bound<'_, PyAny>, depth: usize) -> PyResult<GgufArray> {
        if depth > MAX_ARRAY_NESTING {
            return Err(self.fail(
                field,
                format!("arrays nest more than {MAX_ARRAY_NESTING} deep"),
            ));
        }
        let (elem, items): (Bound<'_, PyAny>, Bound<'_, PyAny>) = obj
            .extract()
            .map_err(|_| self.fail(field, "an array must be an (element type, items) pair"))?;
        let elem = self.gguf_type(field, &elem)?;
        let items: Vec<Bound<'_, PyAny>> = items
            .try_iter()
            .and_then(|it| it.collect::<PyResult<Vec<_>>>())
            .map_err(|_| self.fail(field, "array items must be iterable"))?;
        macro_rules! each {
            ($variant:ident) => {{
                let mut out = Vec::with_capacity(items.len());
                for (i, item) in items.iter().enumerate() {
                    out.push(
                        item.extract()
                            .map_err(|_| self.not_a(&format!("{field}[{i}]"), elem, item))?,
                    );
                }
                GgufArray::$variant(out)
            }};
        }
        Ok(match elem {
            GgufType::U8 => each!(U8),
            GgufType::I8 => each!(I8),
            GgufType::U16 => each!(U16),
            GgufType::I16 => each!(I16),
            GgufType::U32 => each!(U32),
            GgufType::I32 => each!(I32),
            GgufType::F32 => each!(F32),
            GgufType::Bool => each!(Bool),
            GgufType::String => each!(String),
            GgufType::U64 => each!(U64),
            GgufType::I64 => each!(I64),
            GgufType::F64 => each!(F64),
            GgufType::Array => GgufArray::Array(
                items
                    .iter()
                    .enumerate()
                    .map(|(i, item)| self.array(&format!("{field}[{i}]"), item, depth + 1))
                    .collect::<PyResult<Vec<_>>>()?,
            ),
        })
    }
}

/// Writes a version 3 GGUF file (the native half of `ferrograph.gguf.write`, which documents
/// it). `metadata`: `(key, (type, value))` pairs, arrays as `("array", (element type,
/// items))`; `tensors`: `(name, dtype, ne in ggml order, 1-d uint8 array of the bytes)`.
#[pyfunction]
#[pyo3(signature = (path, metadata, tensors, alignment = 32))]
fn gguf_write(
    py: Python<'_>,
    path: PathBuf,
    metadata: Vec<(String, Bound<'_, PyAny>)>,
    tensors: Vec<(String, DTypeArg, Vec<usize>, Bound<'_, PyAny>)>,
    alignment: usize,
) -> PyResult<()> {
    let shown = path.display().to_string();
    let reader = ValueReader { path: &shown };
    let mut meta = Vec::with_capacity(metadata.len());
    for (key, value) in &metadata {
        let value = reader.value(&format!("metadata {key:?}"), value)?;
        meta.push((key.clone(), value));
    }
    let arrays = tensors
        .iter()
        .map(|(name, _, _, data)| {
            data.cast::<PyArray1<u8>>()
                .map(|a| a.readonly())
                .map_err(|_| {
                    reader.fail(
                        &format!("tensor {name:?}"),
                        "the data must be a 1-d uint8 numpy array",
                    )
                })
        })
        .collect::<PyResult<Vec<_>>>()?;
    let slices = arrays
        .iter()
        .map(|a| {
            a.as_slice()
                .map_err(|e| super::errors::shape(e.to_string()))
        })
        .collect::<PyResult<Vec<_>>>()?;
    let to_write: Vec<GgufTensorToWrite<'_>> = tensors
        .iter()
        .zip(&slices)
        .map(|((name, dtype, ne, _), data)| GgufTensorToWrite {
            name: name.clone(),
            dtype: dtype.0,
            ne: ne.clone(),
            data,
        })
        .collect();
    py.detach(|| {
        guard("gguf.write", || {
            write_gguf(&path, &meta, &to_write, alignment)
        })
    })?;
    Ok(())
}

/// Registers the classes and functions.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyGgufFile>()?;
    m.add_class::<PyGgufTensorInfo>()?;
    m.add_function(wrap_pyfunction!(gguf_write, m)?)?;
    Ok(())
}
