//! The Python `Tensor`: a handle on a core [`Tensor`], so Python never owns or frees memory
//! the core still uses.
//!
//! Shapes are numpy-ordered (`shape`, `strides` in bytes, last axis fastest); ggml's order is
//! `ne` / `nb`. Equality and hashing are by identity: two Python objects that wrap the same
//! core tensor compare equal.

use numpy::ndarray::ArrayView1;
use numpy::{PyArray1, PyArrayDyn, PyArrayMethods, PyUntypedArrayMethods};
use pyo3::basic::CompareOp;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyTuple};

use super::context::PyContext;
use super::convert::{
    bfloat16_type, byte_view, dtype_name, is_ndarray, numpy, shape_of, DETACH_THRESHOLD,
};
use super::dtype;
use super::errors::{self, guard};
use ferrograph::dtype::DType;
use ferrograph::error::Result;
use ferrograph::ops::{Op, RopeMode};
use ferrograph::tensor::Tensor;

/// A tensor: dtype, shape, the op that computes it and its operands, and (once allocated) its
/// memory.
#[pyclass(name = "Tensor", module = "ferrograph", frozen)]
pub struct PyTensor {
    pub(crate) inner: Tensor,
}

impl PyTensor {
    /// Wraps a core tensor.
    pub(crate) fn wrap(py: Python<'_>, tensor: Tensor) -> PyResult<Bound<'_, PyTensor>> {
        Bound::new(py, PyTensor { inner: tensor })
    }
}

/// The numpy dtype a tensor of `dtype` reads as (f32 for quantized types, which dequantize).
pub(crate) fn numpy_dtype<'py>(py: Python<'py>, dtype: DType) -> PyResult<Bound<'py, PyAny>> {
    let np = numpy(py)?;
    match dtype {
        DType::BF16 => match bfloat16_type(py) {
            Some(t) => Ok(t),
            None => np.getattr("uint16"),
        },
        other => np.getattr(other.numpy_name().unwrap_or("float32")),
    }
}

/// Visits the byte offset of each dense run of elements in logical (numpy C) order:
/// `(offset in the tensor, length in bytes)`.
fn for_each_run(t: &Tensor, mut f: impl FnMut(usize, usize) -> Result<()>) -> Result<()> {
    let (ne, nb) = (t.ne(), t.nb());
    let size = t.dtype().type_size();
    if t.nelements() == 0 {
        return Ok(());
    }
    if t.is_contiguous() {
        return f(0, t.nelements() / t.dtype().block_size() * size);
    }
    let dense_rows = t.is_contiguous_rows();
    for i3 in 0..ne[3] {
        for i2 in 0..ne[2] {
            for i1 in 0..ne[1] {
                let base = i1 * nb[1] + i2 * nb[2] + i3 * nb[3];
                if dense_rows {
                    f(base, t.row_bytes())?;
                } else {
                    for i0 in 0..ne[0] {
                        f(base + i0 * nb[0], size)?;
                    }
                }
            }
        }
    }
    Ok(())
}

/// Copies the tensor's elements, in logical order, into `dst` (exactly the logical bytes).
fn read_logical(t: &Tensor, dst: &mut [u8]) -> Result<()> {
    let mut at = 0;
    for_each_run(t, |offset, len| {
        t.read_bytes(offset, &mut dst[at..at + len])?;
        at += len;
        Ok(())
    })
}

/// Writes the tensor's elements, in logical order, from `src`.
fn write_logical(t: &Tensor, src: &[u8]) -> Result<()> {
    let mut at = 0;
    for_each_run(t, |offset, len| {
        t.write_bytes(offset, &src[at..at + len])?;
        at += len;
        Ok(())
    })
}

/// Runs `$body` with `$T` the Rust element type of a plain numpy dtype (f32, f16, int8-64),
/// else evaluates `$other`: the types `Tensor.set` and `Tensor.numpy()` move without Python
/// calls.
macro_rules! plain_element {
    ($dtype:expr, $T:ident => $body:expr, $other:expr) => {
        plain_element!(@arms $dtype, $T, $body, $other;
            F32 f32, F64 f64, F16 half::f16, I8 i8, I16 i16, I32 i32, I64 i64)
    };
    (@arms $dtype:expr, $T:ident, $body:expr, $other:expr; $($variant:ident $rust:ty),*) => {
        match $dtype {
            $(DType::$variant => {
                type $T = $rust;
                $body
            })*
            _ => $other,
        }
    };
}

/// `Tensor.set`'s common case without a Python call: a C-contiguous array of exactly the
/// tensor's element type (native byte order) and shape. Returns whether it applied; `false`
/// leaves every other case (conversions, checks, their errors) to the general path.
fn set_exact(t: &Tensor, array: &Bound<'_, PyAny>) -> PyResult<bool> {
    plain_element!(t.dtype(), T => set_exact_as::<T>(t, array), Ok(false))
}

/// [`set_exact`] for element type `T`.
fn set_exact_as<T: numpy::Element + Copy>(t: &Tensor, array: &Bound<'_, PyAny>) -> PyResult<bool> {
    let Ok(typed) = array.cast::<PyArrayDyn<T>>() else {
        return Ok(false);
    };
    if !typed.is_c_contiguous() || typed.shape() != t.shape().as_slice() {
        return Ok(false);
    }
    let Ok(view) = typed.try_readonly() else {
        return Ok(false);
    };
    let Ok(values) = view.as_slice() else {
        return Ok(false);
    };
    // SAFETY: a slice of plain numeric values viewed as its bytes (same memory, same length
    // in bytes; u8 has no alignment or validity requirements).
    let src = unsafe {
        std::slice::from_raw_parts(values.as_ptr().cast::<u8>(), std::mem::size_of_val(values))
    };
    t.storage()?;
    write_array_bytes(array.py(), t, src)?;
    Ok(true)
}

/// Writes `src` (an array's bytes in logical order) into `t`, without the interpreter when
/// it is large.
fn write_array_bytes(py: Python<'_>, t: &Tensor, src: &[u8]) -> PyResult<()> {
    let work = || guard("Tensor.set", || write_logical(t, src));
    if src.len() >= DETACH_THRESHOLD {
        py.detach(work)?;
    } else {
        work()?;
    }
    Ok(())
}

/// [`to_numpy`] for a small tensor of a plain numpy type (f32, f16, int8-64), without calls
/// into Python (`numpy.empty` and a byte view cost microseconds, most of a small read):
/// `None` for the other types. Only for arrays below `DETACH_THRESHOLD` bytes (the caller
/// checks), where allocating them cannot fail for their size.
fn small_to_numpy<'py>(py: Python<'py>, t: &Tensor) -> PyResult<Option<Bound<'py, PyAny>>> {
    plain_element!(t.dtype(), T => small_to_numpy_as::<T>(py, t), Ok(None))
}

/// [`small_to_numpy`] for element type `T`.
fn small_to_numpy_as<'py, T: numpy::Element + Copy>(
    py: Python<'py>,
    t: &Tensor,
) -> PyResult<Option<Bound<'py, PyAny>>> {
    let array = PyArrayDyn::<T>::zeros(py, t.shape().as_slice(), false);
    {
        let mut view = array.readwrite();
        let values = view
            .as_slice_mut()
            .map_err(|e| errors::shape(e.to_string()))?;
        // SAFETY: a slice of plain numeric values viewed as its bytes (same memory, same
        // length in bytes; every byte pattern is a valid value of these types).
        let dst = unsafe {
            std::slice::from_raw_parts_mut(
                values.as_mut_ptr().cast::<u8>(),
                std::mem::size_of_val(values),
            )
        };
        guard("Tensor.numpy", || read_logical(t, dst))?;
    }
    Ok(Some(array.into_any()))
}

/// A copy of the tensor's data as a numpy array (quantized types dequantize to f32).
pub(crate) fn to_numpy<'py>(py: Python<'py>, t: &Tensor) -> PyResult<Bound<'py, PyAny>> {
    // Check first: an unallocated tensor raises NotAllocatedError; one whose bytes do not hold
    // its value (never computed, overwritten by a later node, older than its inputs) raises
    // StaleTensorError naming it and the fix.
    t.check_current()?;
    let large = t.nbytes() >= DETACH_THRESHOLD;
    // The array's size, not the tensor's span: a zero-stride view names more elements than its
    // bytes hold.
    let array_bytes = t.nelements().checked_mul(t.dtype().type_size());
    if array_bytes.is_some_and(|n| n < DETACH_THRESHOLD) {
        if let Some(array) = small_to_numpy(py, t)? {
            return Ok(array);
        }
    }
    let shape = PyTuple::new(py, t.shape())?;
    if t.dtype().is_quantized() {
        let work = || guard("Tensor.numpy", || t.to_f32_vec());
        let values = if large { py.detach(work)? } else { work()? };
        return PyArray1::from_vec(py, values).call_method1("reshape", (shape,));
    }
    // numpy's MemoryError (a zero-stride view can name more elements than memory holds) is an
    // AllocationError like every other failed allocation.
    let array = numpy(py)?
        .call_method1("empty", (shape, numpy_dtype(py, t.dtype())?))
        .map_err(|e| {
            if e.is_instance_of::<pyo3::exceptions::PyMemoryError>(py) {
                ferrograph::Error::alloc(format!(
                    "{} has {} elements: {e}",
                    t.label(),
                    t.nelements()
                ))
                .into()
            } else {
                e
            }
        })?;
    {
        let bytes = byte_view(&array)?;
        let mut bytes = bytes.readwrite();
        let dst = bytes
            .as_slice_mut()
            .map_err(|e| errors::shape(e.to_string()))?;
        let mut work = || guard("Tensor.numpy", || read_logical(t, dst));
        if large {
            py.detach(work)?;
        } else {
            work()?;
        }
    }
    Ok(array)
}

/// Keeps a tensor (and so its buffer) alive while numpy views of its memory exist.
#[pyclass(module = "ferrograph._core", frozen)]
pub(crate) struct TensorMemory {
    _tensor: Tensor,
}

/// A writable numpy view of a host tensor's memory with the tensor's shape and strides
/// (quantized tensors: a 1-d uint8 view of their bytes). Valid only while the tensor's buffer
/// is alive and not reset: custom ops receive these and must not keep them.
pub(crate) fn host_view<'py>(py: Python<'py>, t: &Tensor) -> PyResult<Bound<'py, PyAny>> {
    let ptr = t.host_ptr()?;
    let span = t.nbytes();
    let container = Bound::new(py, TensorMemory { _tensor: t.clone() })?;
    // SAFETY: `host_ptr` points at `nbytes` bytes inside a live host buffer (checked when the
    // tensor was bound); the container keeps the tensor, its storage and so the buffer alive
    // for as long as the numpy array exists.
    let base = unsafe {
        let view = ArrayView1::from_shape_ptr(span, ptr as *const u8);
        PyArray1::<u8>::borrow_from_array(&view, container.into_any())
    };
    if t.dtype().is_quantized() {
        return Ok(base.into_any());
    }
    let np = numpy(py)?;
    let typed = base.call_method1("view", (numpy_dtype(py, t.dtype())?,))?;
    let kwargs = PyDict::new(py);
    kwargs.set_item("shape", PyTuple::new(py, t.shape())?)?;
    kwargs.set_item("strides", PyTuple::new(py, t.strides())?)?;
    kwargs.set_item("writeable", true)?;
    np.getattr("lib")?
        .getattr("stride_tricks")?
        .getattr("as_strided")?
        .call((typed,), Some(&kwargs))
}

/// The op's parameters as a dict.
pub(crate) fn op_params<'py>(py: Python<'py>, op: &Op) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    match op {
        Op::Acc {
            nb1,
            nb2,
            nb3,
            offset,
        } => {
            d.set_item("nb1", nb1)?;
            d.set_item("nb2", nb2)?;
            d.set_item("nb3", nb3)?;
            d.set_item("offset", offset)?;
        }
        Op::Concat { dim } => d.set_item("dim", dim)?,
        Op::Unary(u) => d.set_item("op", u.name())?,
        Op::LeakyRelu { negative_slope } => d.set_item("negative_slope", negative_slope)?,
        Op::Glu { op, swapped } => {
            d.set_item("op", op.name())?;
            d.set_item("swapped", swapped)?;
        }
        Op::Norm { eps } | Op::RmsNorm { eps } | Op::L2Norm { eps } => d.set_item("eps", eps)?,
        Op::GroupNorm { n_groups, eps } => {
            d.set_item("n_groups", n_groups)?;
            d.set_item("eps", eps)?;
        }
        Op::Scale { s, b } => {
            d.set_item("s", s)?;
            d.set_item("b", b)?;
        }
        Op::Permute { axes } => d.set_item("axes", PyTuple::new(py, axes)?)?,
        Op::DiagMaskInf { n_past } => d.set_item("n_past", n_past)?,
        Op::SoftMax { scale, max_bias } => {
            d.set_item("scale", scale)?;
            d.set_item("max_bias", max_bias)?;
        }
        Op::Rope(p) => {
            d.set_item("n_dims", p.n_dims)?;
            d.set_item(
                "mode",
                match p.mode {
                    RopeMode::Normal => "normal",
                    RopeMode::Neox => "neox",
                },
            )?;
            d.set_item("n_ctx_orig", p.n_ctx_orig)?;
            d.set_item("freq_base", p.freq_base)?;
            d.set_item("freq_scale", p.freq_scale)?;
            d.set_item("ext_factor", p.ext_factor)?;
            d.set_item("attn_factor", p.attn_factor)?;
            d.set_item("beta_fast", p.beta_fast)?;
            d.set_item("beta_slow", p.beta_slow)?;
        }
        Op::Clamp { min, max } => {
            d.set_item("min", min)?;
            d.set_item("max", max)?;
        }
        Op::FlashAttnExt {
            scale,
            max_bias,
            logit_softcap,
        } => {
            d.set_item("scale", scale)?;
            d.set_item("max_bias", max_bias)?;
            d.set_item("logit_softcap", logit_softcap)?;
        }
        Op::Custom(c) => d.set_item("name", c.0.name())?,
        _ => {}
    }
    Ok(d)
}

/// Calls `ferrograph.ops.<name>(*args)`: the operators are graph builders written in Python
/// over the op builders.
fn surface<'py>(
    py: Python<'py>,
    name: &str,
    args: impl pyo3::call::PyCallArgs<'py>,
) -> PyResult<Bound<'py, PyAny>> {
    py.import("ferrograph.ops")?.getattr(name)?.call1(args)
}

fn html_escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

#[pymethods]
impl PyTensor {
    /// The process-unique identity of the tensor.
    #[getter]
    fn id(&self) -> u64 {
        self.inner.id()
    }

    /// The element type (a `ferrograph.DType`).
    #[getter]
    fn dtype<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        dtype::to_py(py, self.inner.dtype())
    }

    /// numpy-order shape (last axis fastest).
    #[getter]
    fn shape<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        PyTuple::new(py, self.inner.shape())
    }

    /// numpy-order byte strides.
    #[getter]
    fn strides<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        PyTuple::new(py, self.inner.strides())
    }

    /// ggml-order sizes: 4 entries, `ne[0]` fastest.
    #[getter]
    fn ne<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        PyTuple::new(py, self.inner.ne())
    }

    /// ggml-order byte strides: 4 entries.
    #[getter]
    fn nb<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        PyTuple::new(py, self.inner.nb())
    }

    /// Number of (numpy) dimensions.
    #[getter]
    fn ndim(&self) -> usize {
        self.inner.ndim()
    }

    /// Bytes spanned in memory (ggml's `nbytes`).
    #[getter]
    fn nbytes(&self) -> usize {
        self.inner.nbytes()
    }

    /// Number of elements.
    #[getter]
    fn nelements(&self) -> usize {
        self.inner.nelements()
    }

    /// The name (`""` if unset).
    #[getter]
    fn get_name(&self) -> String {
        self.inner.name()
    }

    #[setter]
    fn set_name(&self, name: &str) {
        self.inner.set_name(name);
    }

    /// The op's upper-case name (`"MUL_MAT"`, `"UNARY"`, `"NONE"` for leaves).
    #[getter]
    fn op(&self) -> &'static str {
        self.inner.op().name()
    }

    /// The op's name including the unary / GLU sub-op (`"GELU"` rather than `"UNARY"`).
    #[getter]
    fn op_desc(&self) -> String {
        self.inner.op().display_name()
    }

    /// The op's parameters as a dict (empty when it has none).
    #[getter]
    fn op_params<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        op_params(py, self.inner.op())
    }

    /// The op's operands.
    #[getter]
    fn srcs<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let items = self
            .inner
            .srcs()
            .iter()
            .map(|t| PyTensor::wrap(py, t.clone()))
            .collect::<PyResult<Vec<_>>>()?;
        PyList::new(py, items)
    }

    /// The tensor whose memory this one views, or None.
    #[getter]
    fn view_src<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyTensor>>> {
        self.inner
            .view_src()
            .map(|t| PyTensor::wrap(py, t.clone()))
            .transpose()
    }

    /// Byte offset into the view source.
    #[getter]
    fn view_offset(&self) -> usize {
        self.inner.view_offset()
    }

    /// The context that created the tensor, while it is alive.
    #[getter]
    fn context(&self) -> Option<PyContext> {
        self.inner.context().map(|inner| PyContext { inner })
    }

    /// Raw flag bits (1 input, 2 output, 4 param, 8 loss).
    #[getter]
    fn flags(&self) -> u8 {
        self.inner.flags()
    }

    /// Whether the tensor is marked as a graph input.
    #[getter]
    fn is_input(&self) -> bool {
        self.inner.is_input()
    }

    /// Whether the tensor is marked as a graph output.
    #[getter]
    fn is_output(&self) -> bool {
        self.inner.is_output()
    }

    /// Whether the tensor is marked as a trainable parameter.
    #[getter]
    fn is_param(&self) -> bool {
        self.inner.is_param()
    }

    /// Whether the tensor views another's memory.
    #[getter]
    fn is_view(&self) -> bool {
        self.inner.is_view()
    }

    /// Whether the tensor (or its view source) has live memory.
    #[getter]
    fn is_allocated(&self) -> bool {
        self.inner.is_allocated()
    }

    /// The buffer holding the tensor's memory (a view's source buffer), or None.
    #[getter]
    fn buffer(&self) -> Option<super::backend::PyBuffer> {
        self.inner
            .buffer()
            .map(|inner| super::backend::PyBuffer { inner })
    }

    /// Marks the tensor as a graph input (filled before each compute). Returns self.
    fn set_input(slf: Bound<'_, Self>) -> Bound<'_, Self> {
        slf.get().inner.set_input();
        slf
    }

    /// Marks the tensor as a graph output (its memory is never reused). Returns self.
    fn set_output(slf: Bound<'_, Self>) -> Bound<'_, Self> {
        slf.get().inner.set_output();
        slf
    }

    /// Marks the tensor as a trainable parameter. Returns self.
    fn set_param(slf: Bound<'_, Self>) -> Bound<'_, Self> {
        slf.get().inner.set_param();
        slf
    }

    /// Whether elements are laid out densely in order.
    fn is_contiguous(&self) -> bool {
        self.inner.is_contiguous()
    }

    /// Whether ggml dimensions 0 and 1 are swapped (numpy's last two axes).
    fn is_transposed(&self) -> bool {
        self.inner.is_transposed()
    }

    /// Whether the strides are not in increasing ggml order.
    fn is_permuted(&self) -> bool {
        self.inner.is_permuted()
    }

    /// Whether both tensors have the same dtype, shape and strides.
    fn same_layout(&self, other: PyRef<'_, PyTensor>) -> bool {
        self.inner.same_layout(&other.inner)
    }

    /// A copy of the data as a numpy array in numpy order (quantized types dequantize to
    /// float32; bf16 reads as ml_dtypes.bfloat16 or uint16 bits). NotAllocatedError if the
    /// tensor has no memory.
    fn numpy<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        to_numpy(py, &self.inner)
    }

    /// The numpy array protocol (NumPy 2 semantics): always a copy, so `copy=False` raises
    /// ValueError.
    #[pyo3(signature = (dtype = None, copy = None))]
    fn __array__<'py>(
        &self,
        py: Python<'py>,
        dtype: Option<Bound<'py, PyAny>>,
        copy: Option<bool>,
    ) -> PyResult<Bound<'py, PyAny>> {
        if copy == Some(false) {
            return Err(pyo3::exceptions::PyValueError::new_err(
                "a ferrograph Tensor cannot be viewed without a copy; use copy=None or True",
            ));
        }
        let array = to_numpy(py, &self.inner)?;
        match dtype {
            Some(dtype) if !dtype.is_none() => {
                let kwargs = PyDict::new(py);
                kwargs.set_item("copy", false)?;
                array.call_method("astype", (dtype,), Some(&kwargs))
            }
            _ => Ok(array),
        }
    }

    /// Writes a numpy array into the tensor. Its shape must equal `shape` exactly and its
    /// dtype must be the tensor's (bf16 tensors take ml_dtypes.bfloat16 or uint16 bits), except
    /// that float arrays set quantized tensors (quantizing). Non-contiguous arrays are copied
    /// first. Returns self.
    fn set<'py>(slf: Bound<'py, Self>, array: &Bound<'py, PyAny>) -> PyResult<Bound<'py, Self>> {
        let py = slf.py();
        let t = &slf.get().inner;
        if set_exact(t, array)? {
            return Ok(slf);
        }
        let np = numpy(py)?;
        let dtype = t.dtype();
        let bf16_from_numbers =
            dtype == DType::BF16 && !is_ndarray(array)? && bfloat16_type(py).is_none();
        let array = if is_ndarray(array)? {
            array.clone()
        } else if bf16_from_numbers {
            // Without ml_dtypes there is no bf16 numpy type: read Python numbers as float32
            // and convert them like a quantized type's values (not as uint16 bit patterns).
            np.call_method1("asarray", (array, "float32"))?
        } else {
            np.call_method1("asarray", (array, numpy_dtype(py, dtype)?))?
        };
        let shape = shape_of(&array)?;
        if shape != t.shape() {
            return Err(errors::shape(format!(
                "{} has shape {:?}; the array has shape {shape:?}",
                t.label(),
                t.shape()
            )));
        }
        let name = dtype_name(&array)?;
        if dtype.is_quantized() || bf16_from_numbers {
            let kind: String = array.getattr("dtype")?.getattr("kind")?.extract()?;
            if kind != "f" && name != "bfloat16" {
                return Err(errors::dtype(format!(
                    "{} is {}; set it from a float array, not {name}",
                    t.label(),
                    dtype.name()
                )));
            }
            let values = np
                .call_method1("ascontiguousarray", (array, "float32"))?
                .call_method1("reshape", (-1,))?
                .cast_into::<PyArray1<f32>>()?;
            let values = values.readonly();
            let s = values
                .as_slice()
                .map_err(|e| errors::shape(e.to_string()))?;
            let work = || guard("Tensor.set", || t.set_f32(s));
            if s.len() >= DETACH_THRESHOLD {
                py.detach(work)?;
            } else {
                work()?;
            }
            return Ok(slf);
        }
        let accepted: &[&str] = match dtype {
            DType::BF16 => &["bfloat16", "uint16"],
            other => &[other.numpy_name().unwrap_or("")],
        };
        if !accepted.contains(&name.as_str()) {
            return Err(errors::dtype(format!(
                "{} is {} and needs a {} array, got {name}",
                t.label(),
                dtype.name(),
                accepted.join(" or ")
            )));
        }
        t.storage()?;
        let contiguous = np.call_method1("ascontiguousarray", (array,))?;
        let bytes = byte_view(&contiguous)?;
        let bytes = bytes.readonly();
        let src = bytes.as_slice().map_err(|e| errors::shape(e.to_string()))?;
        write_array_bytes(py, t, src)?;
        Ok(slf)
    }

    fn __repr__(&self) -> String {
        let t = &self.inner;
        let name = t.name();
        let mut out = String::from("Tensor(");
        if !name.is_empty() {
            out.push_str(&format!("'{}', ", name.replace('\'', "\\'")));
        }
        let shape = t.shape();
        let shape_text = if shape.len() == 1 {
            format!("({},)", shape[0])
        } else {
            format!(
                "({})",
                shape
                    .iter()
                    .map(usize::to_string)
                    .collect::<Vec<_>>()
                    .join(", ")
            )
        };
        out.push_str(&format!(
            "{}, shape={shape_text}, op={}",
            t.dtype().name(),
            t.op().display_name()
        ));
        if t.is_view() {
            out.push_str(", view");
        }
        out.push(')');
        out
    }

    /// A small HTML table of the metadata (never the data).
    fn _repr_html_(&self) -> String {
        let t = &self.inner;
        let rows = [
            ("name", t.name()),
            ("dtype", t.dtype().name().to_owned()),
            ("shape", format!("{:?}", t.shape())),
            ("ne", format!("{:?}", t.ne())),
            ("op", t.op().display_name()),
            ("params", t.op().params_text()),
            ("srcs", t.srcs().len().to_string()),
            ("view", t.is_view().to_string()),
            ("allocated", t.is_allocated().to_string()),
        ];
        let mut html = String::from("<table><tr><th colspan=\"2\">ferrograph.Tensor</th></tr>");
        for (key, value) in rows {
            html.push_str(&format!(
                "<tr><td>{key}</td><td><code>{}</code></td></tr>",
                html_escape(&value)
            ));
        }
        html.push_str("</table>");
        html
    }

    fn __hash__(&self) -> u64 {
        self.inner.id()
    }

    // ----- numpy-style operators: graph builders defined in `ferrograph.ops` -----

    /// numpy refuses to treat a Tensor as an array operand (`np.add(t, x)` raises TypeError)
    /// so `array + tensor` reaches `Tensor.__radd__`, which explains what to do.
    #[classattr]
    fn __array_ufunc__() -> Option<bool> {
        None
    }

    /// Number of elements (numpy's `size`).
    #[getter]
    fn size(&self) -> usize {
        self.inner.nelements()
    }

    /// Length of the first axis (numpy's `len`).
    fn __len__(&self) -> usize {
        self.inner.shape().first().copied().unwrap_or(1)
    }

    /// Always true: a tensor is a graph node, never an ambiguous truth value (`if t:` means
    /// "is there a tensor", as for any object).
    fn __bool__(&self) -> bool {
        true
    }

    /// All axes reversed (numpy's `.T`): a permuted view.
    #[getter(T)]
    fn transposed<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyAny>> {
        surface(slf.py(), "_reversed_axes", (slf,))
    }

    /// numpy's `reshape(*shape)` (one `-1` allowed): a view of a contiguous tensor, else of a
    /// contiguous copy (`cont`).
    #[pyo3(signature = (*shape))]
    fn reshape<'py>(
        slf: &Bound<'py, Self>,
        shape: &Bound<'py, PyTuple>,
    ) -> PyResult<Bound<'py, PyAny>> {
        surface(slf.py(), "_reshape_method", (slf, shape))
    }

    /// Basic indexing (ints, slices with a positive step, `...`) as a view; see
    /// `ferrograph.ops` for what the layout allows.
    fn __getitem__<'py>(
        slf: &Bound<'py, Self>,
        key: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyAny>> {
        surface(slf.py(), "_getitem", (slf, key))
    }

    /// `-a`: `ops.neg(a)`.
    fn __neg__<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyAny>> {
        surface(slf.py(), "neg", (slf,))
    }

    /// `a + b` with numpy broadcasting; `b` may be a Python number.
    fn __add__<'py>(
        slf: &Bound<'py, Self>,
        other: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyAny>> {
        surface(slf.py(), "_operator", ("add", slf, other, false))
    }

    /// `b + a` for a Python number `b`.
    fn __radd__<'py>(
        slf: &Bound<'py, Self>,
        other: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyAny>> {
        surface(slf.py(), "_operator", ("add", slf, other, true))
    }

    /// `a - b` with numpy broadcasting; `b` may be a Python number.
    fn __sub__<'py>(
        slf: &Bound<'py, Self>,
        other: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyAny>> {
        surface(slf.py(), "_operator", ("sub", slf, other, false))
    }

    /// `b - a` for a Python number `b`.
    fn __rsub__<'py>(
        slf: &Bound<'py, Self>,
        other: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyAny>> {
        surface(slf.py(), "_operator", ("sub", slf, other, true))
    }

    /// `a * b` with numpy broadcasting; `b` may be a Python number.
    fn __mul__<'py>(
        slf: &Bound<'py, Self>,
        other: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyAny>> {
        surface(slf.py(), "_operator", ("mul", slf, other, false))
    }

    /// `b * a` for a Python number `b`.
    fn __rmul__<'py>(
        slf: &Bound<'py, Self>,
        other: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyAny>> {
        surface(slf.py(), "_operator", ("mul", slf, other, true))
    }

    /// `a / b` with numpy broadcasting; `b` may be a Python number.
    fn __truediv__<'py>(
        slf: &Bound<'py, Self>,
        other: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyAny>> {
        surface(slf.py(), "_operator", ("div", slf, other, false))
    }

    /// `b / a` for a Python number `b`.
    fn __rtruediv__<'py>(
        slf: &Bound<'py, Self>,
        other: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyAny>> {
        surface(slf.py(), "_operator", ("div", slf, other, true))
    }

    /// `a @ b`: `np.matmul`, batch axes broadcast (`ops.matmul`).
    fn __matmul__<'py>(
        slf: &Bound<'py, Self>,
        other: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyAny>> {
        surface(slf.py(), "_operator", ("matmul", slf, other, false))
    }

    /// `b @ a` (only tensors take part in `@`).
    fn __rmatmul__<'py>(
        slf: &Bound<'py, Self>,
        other: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyAny>> {
        surface(slf.py(), "_operator", ("matmul", slf, other, true))
    }

    fn __richcmp__(&self, other: &Bound<'_, PyAny>, op: CompareOp) -> Py<PyAny> {
        let py = other.py();
        let Ok(other) = other.cast::<PyTensor>() else {
            return py.NotImplemented();
        };
        let same = self.inner.same(&other.get().inner);
        match op {
            CompareOp::Eq => pyo3::types::PyBool::new(py, same)
                .to_owned()
                .into_any()
                .unbind(),
            CompareOp::Ne => pyo3::types::PyBool::new(py, !same)
                .to_owned()
                .into_any()
                .unbind(),
            _ => py.NotImplemented(),
        }
    }
}
