//! numpy conversions: f32 ⇄ f16 / bf16, f32 → i32, quantize / dequantize.
//!
//! Every function takes an array (or anything `numpy.asarray` accepts) and returns a new array
//! of the same shape, or writes into `out=`, which must be a writable, C-contiguous array of
//! the result dtype and exactly the input's shape (`DTypeError` / `ShapeError` otherwise).
//! bf16 arrays are `ml_dtypes.bfloat16` when that package is importable, else `uint16` bit
//! patterns; either is accepted as bf16 input. Large conversions release the interpreter.

use half::slice::HalfBitsSliceExt;
use half::{bf16, f16};
use numpy::{Element, PyArray1, PyArrayDyn, PyArrayMethods, PyUntypedArrayMethods};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyModule, PyTuple};

use super::dtype::DTypeArg;
use super::errors::{self, guard};
use ferrograph::convert;
use ferrograph::dtype::DType;
use ferrograph::quant;

/// Conversions of at least this many elements run with the interpreter released.
pub(crate) const DETACH_THRESHOLD: usize = 1 << 15;

static NUMPY: PyOnceLock<Py<PyModule>> = PyOnceLock::new();
static BFLOAT16: PyOnceLock<Option<Py<PyAny>>> = PyOnceLock::new();

/// The `numpy` module.
pub(crate) fn numpy(py: Python<'_>) -> PyResult<&Bound<'_, PyModule>> {
    NUMPY
        .get_or_try_init(py, || py.import("numpy").map(Bound::unbind))
        .map(|m| m.bind(py))
}

/// `ml_dtypes.bfloat16`, if that package is importable.
pub(crate) fn bfloat16_type(py: Python<'_>) -> Option<Bound<'_, PyAny>> {
    BFLOAT16
        .get_or_init(py, || {
            py.import("ml_dtypes")
                .and_then(|m| m.getattr("bfloat16"))
                .ok()
                .map(Bound::unbind)
        })
        .as_ref()
        .map(|t| t.bind(py).clone())
}

/// Whether `obj` is a numpy array.
pub(crate) fn is_ndarray(obj: &Bound<'_, PyAny>) -> PyResult<bool> {
    obj.is_instance(&numpy(obj.py())?.getattr("ndarray")?)
}

/// The numpy name of an array's dtype (`"float32"`, `"bfloat16"`, ...), with `"(non-native)"`
/// appended when its byte order is not the machine's.
pub(crate) fn dtype_name(array: &Bound<'_, PyAny>) -> PyResult<String> {
    let dtype = array.getattr("dtype")?;
    let name: String = dtype.getattr("name")?.extract()?;
    let native: bool = dtype.getattr("isnative")?.extract()?;
    Ok(if native {
        name
    } else {
        format!("{name} (non-native byte order)")
    })
}

/// Refuses arrays that are not plain data: object dtypes, and structured dtypes with an
/// object field anywhere (their bytes are pointers to Python objects; writing them corrupts
/// reference counts, reading them leaks addresses). DTypeError naming the dtype.
pub(crate) fn check_plain_data(array: &Bound<'_, PyAny>) -> PyResult<()> {
    let dtype = array.getattr("dtype")?;
    if dtype.getattr("hasobject")?.is_truthy()? {
        let text = dtype.str()?.to_string();
        return Err(errors::dtype(format!(
            "arrays of Python objects (dtype {text}) cannot be used as raw memory; use a \
             numeric or boolean dtype"
        )));
    }
    Ok(())
}

/// The array as a 1-d uint8 view of the same (C-contiguous) memory; object arrays are refused
/// ([`check_plain_data`]).
pub(crate) fn byte_view<'py>(array: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyArray1<u8>>> {
    check_plain_data(array)?;
    let py = array.py();
    let flat = array.call_method1("reshape", (-1,))?;
    let bytes = flat.call_method1("view", (numpy(py)?.getattr("uint8")?,))?;
    Ok(bytes.cast_into::<PyArray1<u8>>()?)
}

/// numpy's shape of an array.
pub(crate) fn shape_of(array: &Bound<'_, PyAny>) -> PyResult<Vec<usize>> {
    array.getattr("shape")?.extract()
}

/// An input array of element type `T`: numpy arrays must have one of the `accepted` dtype
/// names (bf16 is read through a `uint16` view); other objects go through
/// `numpy.asarray(x, dtype=fallback)`. The result is C-contiguous.
fn input_array<'py, T: Element>(
    x: &Bound<'py, PyAny>,
    function: &str,
    accepted: &[&str],
    fallback: &str,
) -> PyResult<Bound<'py, PyArrayDyn<T>>> {
    let py = x.py();
    let np = numpy(py)?;
    let array = if is_ndarray(x)? {
        let name = dtype_name(x)?;
        if !accepted.contains(&name.as_str()) {
            return Err(errors::dtype(format!(
                "{function} expects a {} array, got {name}",
                accepted.join(" or ")
            )));
        }
        np.call_method1("ascontiguousarray", (x,))?
    } else {
        np.call_method1("asarray", (x, fallback))?
    };
    let array = if std::mem::size_of::<T>() == 2 && dtype_name(&array)? == "bfloat16" {
        array.call_method1("view", (np.getattr("uint16")?,))?
    } else {
        array
    };
    Ok(array.cast_into::<PyArrayDyn<T>>()?)
}

/// The output array: a new one of `shape` and dtype `create`, or the caller's `out` checked
/// against `accepted` dtype names, C-contiguity, writability and `shape`. Returns the array to
/// hand back to Python and the typed array to write (a `uint16` view for bf16).
fn output_array<'py, T: Element>(
    py: Python<'py>,
    out: Option<&Bound<'py, PyAny>>,
    shape: &[usize],
    function: &str,
    accepted: &[&str],
    create: &Bound<'py, PyAny>,
) -> PyResult<(Bound<'py, PyAny>, Bound<'py, PyArrayDyn<T>>)> {
    let np = numpy(py)?;
    let result = match out {
        None => np.call_method1("empty", (PyTuple::new(py, shape)?, create))?,
        Some(out) => {
            if !is_ndarray(out)? {
                return Err(errors::dtype(format!(
                    "{function}: out= must be a numpy array, got {}",
                    out.get_type().name()?
                )));
            }
            let name = dtype_name(out)?;
            if !accepted.contains(&name.as_str()) {
                return Err(errors::dtype(format!(
                    "{function}: out= must have dtype {}, got {name}",
                    accepted.join(" or ")
                )));
            }
            let out_shape = shape_of(out)?;
            if out_shape != shape {
                return Err(errors::shape(format!(
                    "{function}: out= has shape {out_shape:?}, the result has shape {shape:?}"
                )));
            }
            let flags = out.getattr("flags")?;
            if !flags.getattr("c_contiguous")?.extract::<bool>()? {
                return Err(errors::shape(format!(
                    "{function}: out= must be C-contiguous"
                )));
            }
            if !flags.getattr("writeable")?.extract::<bool>()? {
                return Err(errors::invalid(format!("{function}: out= is read-only")));
            }
            out.clone()
        }
    };
    let typed = if std::mem::size_of::<T>() == 2 && dtype_name(&result)? == "bfloat16" {
        result.call_method1("view", (np.getattr("uint16")?,))?
    } else {
        result.clone()
    };
    Ok((result, typed.cast_into::<PyArrayDyn<T>>()?))
}

/// The dtype bf16 results are created with: `ml_dtypes.bfloat16`, else `uint16`.
fn bf16_result_dtype(py: Python<'_>) -> PyResult<Bound<'_, PyAny>> {
    match bfloat16_type(py) {
        Some(t) => Ok(t),
        None => numpy(py)?.getattr("uint16"),
    }
}

/// Runs a row conversion from `src` into `dst`, releasing the interpreter for large inputs and
/// turning a panic into an error.
fn run_conversion<S: Element + Sync, D: Element + Send>(
    py: Python<'_>,
    function: &str,
    src: &Bound<'_, PyArrayDyn<S>>,
    dst: &Bound<'_, PyArrayDyn<D>>,
    convert: impl Fn(&[S], &mut [D]) -> ferrograph::Result<()> + Send + Sync,
) -> PyResult<()> {
    let src = src
        .try_readonly()
        .map_err(|e| errors::invalid(format!("{function}: {e}")))?;
    let mut dst = dst.try_readwrite().map_err(|e| {
        errors::invalid(format!(
            "{function}: out= overlaps the input or is in use ({e})"
        ))
    })?;
    let s = src
        .as_slice()
        .map_err(|e| errors::shape(format!("{function}: {e}")))?;
    let d = dst
        .as_slice_mut()
        .map_err(|e| errors::shape(format!("{function}: {e}")))?;
    let mut work = || guard(function, || convert(s, d));
    if s.len() >= DETACH_THRESHOLD {
        py.detach(work)?;
    } else {
        work()?;
    }
    Ok(())
}

/// Converts a float32 array to float16 (round to nearest even), as ggml's `fp32_to_fp16_row`.
#[pyfunction]
#[pyo3(signature = (x, out = None))]
fn fp32_to_fp16<'py>(
    x: &Bound<'py, PyAny>,
    out: Option<&Bound<'py, PyAny>>,
) -> PyResult<Bound<'py, PyAny>> {
    let py = x.py();
    let src = input_array::<f32>(x, "fp32_to_fp16", &["float32"], "float32")?;
    let create = numpy(py)?.getattr("float16")?;
    let (result, dst) =
        output_array::<f16>(py, out, src.shape(), "fp32_to_fp16", &["float16"], &create)?;
    run_conversion(py, "fp32_to_fp16", &src, &dst, convert::fp32_to_fp16_row)?;
    Ok(result)
}

/// Converts a float16 array to float32 (exact).
#[pyfunction]
#[pyo3(signature = (x, out = None))]
fn fp16_to_fp32<'py>(
    x: &Bound<'py, PyAny>,
    out: Option<&Bound<'py, PyAny>>,
) -> PyResult<Bound<'py, PyAny>> {
    let py = x.py();
    let src = input_array::<f16>(x, "fp16_to_fp32", &["float16"], "float16")?;
    let create = numpy(py)?.getattr("float32")?;
    let (result, dst) =
        output_array::<f32>(py, out, src.shape(), "fp16_to_fp32", &["float32"], &create)?;
    run_conversion(py, "fp16_to_fp32", &src, &dst, convert::fp16_to_fp32_row)?;
    Ok(result)
}

fn to_bf16<'py>(
    x: &Bound<'py, PyAny>,
    out: Option<&Bound<'py, PyAny>>,
    function: &str,
    row: fn(&[f32], &mut [bf16]) -> ferrograph::Result<()>,
) -> PyResult<Bound<'py, PyAny>> {
    let py = x.py();
    let src = input_array::<f32>(x, function, &["float32"], "float32")?;
    let create = bf16_result_dtype(py)?;
    let (result, dst) = output_array::<u16>(
        py,
        out,
        src.shape(),
        function,
        &["bfloat16", "uint16"],
        &create,
    )?;
    run_conversion(py, function, &src, &dst, move |s, d: &mut [u16]| {
        row(s, d.reinterpret_cast_mut::<bf16>())
    })?;
    Ok(result)
}

/// Converts a float32 array to bfloat16 (round to nearest even; NaN stays NaN). The result is
/// an `ml_dtypes.bfloat16` array, or `uint16` bit patterns when ml_dtypes is missing.
#[pyfunction]
#[pyo3(signature = (x, out = None))]
fn fp32_to_bf16<'py>(
    x: &Bound<'py, PyAny>,
    out: Option<&Bound<'py, PyAny>>,
) -> PyResult<Bound<'py, PyAny>> {
    to_bf16(x, out, "fp32_to_bf16", convert::fp32_to_bf16_row)
}

/// As `fp32_to_bf16`, through the scalar reference conversion.
#[pyfunction]
#[pyo3(signature = (x, out = None))]
fn fp32_to_bf16_ref<'py>(
    x: &Bound<'py, PyAny>,
    out: Option<&Bound<'py, PyAny>>,
) -> PyResult<Bound<'py, PyAny>> {
    to_bf16(x, out, "fp32_to_bf16_ref", convert::fp32_to_bf16_row_ref)
}

/// Converts a bfloat16 array (`ml_dtypes.bfloat16` or `uint16` bit patterns) to float32.
#[pyfunction]
#[pyo3(signature = (x, out = None))]
fn bf16_to_fp32<'py>(
    x: &Bound<'py, PyAny>,
    out: Option<&Bound<'py, PyAny>>,
) -> PyResult<Bound<'py, PyAny>> {
    let py = x.py();
    let src = input_array::<u16>(x, "bf16_to_fp32", &["bfloat16", "uint16"], "uint16")?;
    let create = numpy(py)?.getattr("float32")?;
    let (result, dst) =
        output_array::<f32>(py, out, src.shape(), "bf16_to_fp32", &["float32"], &create)?;
    run_conversion(py, "bf16_to_fp32", &src, &dst, |s: &[u16], d| {
        convert::bf16_to_fp32_row(s.reinterpret_cast::<bf16>(), d)
    })?;
    Ok(result)
}

/// Converts a float32 array to int32 as ggml's CPU backend does (`cpu_fp32_to_i32`).
#[pyfunction]
#[pyo3(signature = (x, out = None))]
fn fp32_to_i32<'py>(
    x: &Bound<'py, PyAny>,
    out: Option<&Bound<'py, PyAny>>,
) -> PyResult<Bound<'py, PyAny>> {
    let py = x.py();
    let src = input_array::<f32>(x, "fp32_to_i32", &["float32"], "float32")?;
    let create = numpy(py)?.getattr("int32")?;
    let (result, dst) =
        output_array::<i32>(py, out, src.shape(), "fp32_to_i32", &["int32"], &create)?;
    run_conversion(py, "fp32_to_i32", &src, &dst, convert::cpu_fp32_to_i32)?;
    Ok(result)
}

/// A float array flattened to contiguous float32 (DTypeError for non-float arrays).
fn float_values<'py>(x: &Bound<'py, PyAny>, function: &str) -> PyResult<Bound<'py, PyArray1<f32>>> {
    let np = numpy(x.py())?;
    let array = if is_ndarray(x)? {
        let kind: String = x.getattr("dtype")?.getattr("kind")?.extract()?;
        let name = dtype_name(x)?;
        if kind != "f" && name != "bfloat16" {
            return Err(errors::dtype(format!(
                "{function} expects a float array, got {name}"
            )));
        }
        x.clone()
    } else {
        np.call_method1("asarray", (x, "float32"))?
    };
    let flat = np.call_method1(
        "ascontiguousarray",
        (array.call_method1("reshape", (-1,))?, "float32"),
    )?;
    Ok(flat.cast_into::<PyArray1<f32>>()?)
}

/// Encodes float values as `dtype` bytes (blocks for quantized types), flattening the array in
/// C order. Returns a 1-d uint8 array of `dtype.row_size(n)` bytes.
#[pyfunction]
fn quantize<'py>(x: &Bound<'py, PyAny>, dtype: DTypeArg) -> PyResult<Bound<'py, PyArray1<u8>>> {
    let py = x.py();
    let values = float_values(x, "quantize")?;
    let values = values.readonly();
    let s = values
        .as_slice()
        .map_err(|e| errors::shape(e.to_string()))?;
    let dtype = dtype.0;
    let work = || {
        guard("quantize", || match dtype {
            DType::Q8_0 => quant::quantize_q8_0_bytes(s),
            DType::Q4_0 => quant::quantize_q4_0_bytes(s),
            other => {
                let mut bytes = vec![0u8; other.row_size(s.len())?];
                other.row_from_f32(s, &mut bytes)?;
                Ok(bytes)
            }
        })
    };
    let bytes = if s.len() >= DETACH_THRESHOLD {
        py.detach(work)?
    } else {
        work()?
    };
    Ok(PyArray1::from_vec(py, bytes))
}

/// Decodes `n` values stored as `dtype` in a uint8 array (as made by `quantize`) to a 1-d
/// float32 array.
#[pyfunction]
fn dequantize<'py>(
    data: &Bound<'py, PyAny>,
    dtype: DTypeArg,
    n: usize,
) -> PyResult<Bound<'py, PyArray1<f32>>> {
    let py = data.py();
    let np = numpy(py)?;
    let bytes = if is_ndarray(data)? {
        let name = dtype_name(data)?;
        if name != "uint8" && name != "int8" {
            return Err(errors::dtype(format!(
                "dequantize expects a uint8 array of encoded bytes, got {name}"
            )));
        }
        byte_view(&np.call_method1("ascontiguousarray", (data,))?)?
    } else {
        np.call_method1("frombuffer", (data, "uint8"))?
            .cast_into::<PyArray1<u8>>()?
    };
    let dtype = dtype.0;
    let expected = dtype.row_size(n)?;
    let bytes = bytes.readonly();
    let b = bytes.as_slice().map_err(|e| errors::shape(e.to_string()))?;
    if b.len() != expected {
        return Err(errors::shape(format!(
            "dequantize: {n} {} values take {expected} bytes, got {}",
            dtype.name(),
            b.len()
        )));
    }
    let work = || {
        guard("dequantize", || match dtype {
            DType::Q8_0 => quant::dequantize_q8_0_bytes(b, n),
            DType::Q4_0 => quant::dequantize_q4_0_bytes(b, n),
            other => {
                let mut values = vec![0f32; n];
                other.row_to_f32(b, &mut values)?;
                Ok(values)
            }
        })
    };
    let values = if n >= DETACH_THRESHOLD {
        py.detach(work)?
    } else {
        work()?
    };
    Ok(PyArray1::from_vec(py, values))
}

/// Registers the conversion functions.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(fp32_to_fp16, m)?)?;
    m.add_function(wrap_pyfunction!(fp16_to_fp32, m)?)?;
    m.add_function(wrap_pyfunction!(fp32_to_bf16, m)?)?;
    m.add_function(wrap_pyfunction!(fp32_to_bf16_ref, m)?)?;
    m.add_function(wrap_pyfunction!(bf16_to_fp32, m)?)?;
    m.add_function(wrap_pyfunction!(fp32_to_i32, m)?)?;
    m.add_function(wrap_pyfunction!(quantize, m)?)?;
    m.add_function(wrap_pyfunction!(dequantize, m)?)?;
    Ok(())
}
