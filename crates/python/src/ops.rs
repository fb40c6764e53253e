//! Op builders, exposed as `ferrograph.ops.<name>` with ggml's argument order.
//!
//! Every builder takes an optional keyword `ctx=`. With it, or inside `with ctx:`, the context
//! owns the result (ggml's meaning). Without either, the result belongs to no context: it is
//! made through a borrowing handle of its first operand's context (`ferrograph::context`), which
//! neither lists nor keeps it, and lives as long as its holders, so a graph built per request
//! does not grow a long-lived weights context.
//!
//! Every argument that names an axis or a stride follows numpy: shapes, `strides` and
//! `axes`/`axis` count from the first (slowest) axis, negative values count from the end.
//! ggml's forms, where dimension 0 is the fastest, are kept under names that say so
//! (`permute_ggml`, `concat_ggml`, `acc_ggml`).

use std::sync::Arc;

use pyo3::prelude::*;
use pyo3::types::{PyList, PyTuple};

use super::context::{self, PyContext, ShapeArg};
use super::dtype::DTypeArg;
use super::errors::{self, guard};
use super::tensor::{host_view, PyTensor};
use ferrograph::context::Context;
use ferrograph::error::Error;
use ferrograph::ops::{self, CustomOp, GluOp, Op, RopeMode, RopeParams, UnaryOp};
use ferrograph::tensor::{Tensor, MAX_DIMS};

type Ctx<'a> = Option<PyRef<'a, PyContext>>;
type T<'a> = PyRef<'a, PyTensor>;

/// The context a builder records its result in: explicit, else the innermost `with ctx:`
/// (both own the result), else the first operand's through a borrowing handle (it does not).
fn resolve(ctx: &Ctx<'_>, operands: &[&Tensor]) -> PyResult<Context> {
    if let Some(ctx) = ctx {
        return Ok(ctx.inner.clone());
    }
    if let Some(ctx) = context::active() {
        return Ok(ctx);
    }
    if let Some(ctx) = operands.first().and_then(|t| t.context()) {
        return Ok(ctx.borrowing());
    }
    Err(errors::invalid(
        "no context: pass ctx=, use `with ctx:`, or give a tensor operand whose context is alive",
    ))
}

/// Every builder's frame: resolves the result's context from `ctx` and the first operand
/// (before anything else, so a missing context is reported first), runs `op` with it (argument
/// checks, then the core builder) and wraps the result.
fn build<'py, E: Into<PyErr>>(
    py: Python<'py>,
    ctx: &Ctx<'_>,
    first: &Tensor,
    op: impl FnOnce(&Context) -> Result<Tensor, E>,
) -> PyResult<Bound<'py, PyTensor>> {
    let c = resolve(ctx, &[first])?;
    PyTensor::wrap(py, op(&c).map_err(Into::into)?)
}

/// A numpy axis (negative counts from the end) of a tensor with `ndim` axes, as ggml's
/// dimension index (0 = numpy's last axis).
fn ggml_dim(axis: i64, ndim: usize, op: &str) -> PyResult<usize> {
    let n = ndim as i64;
    if axis < -n || axis >= n {
        return Err(errors::shape(format!(
            "{op}: axis {axis} is out of bounds for a tensor with {ndim} dimensions"
        )));
    }
    let axis = if axis < 0 { axis + n } else { axis } as usize;
    Ok(ndim - 1 - axis)
}

/// ggml's permutation (`p[i]` = where ggml dimension `i` goes) equivalent to numpy's
/// `transpose(a, axes)` (result axis `i` is input axis `axes[i]`).
fn ggml_permutation(axes: &[i64], ndim: usize, op: &str) -> PyResult<[usize; MAX_DIMS]> {
    if axes.len() != ndim {
        return Err(errors::shape(format!(
            "{op}: axes {axes:?} do not match a tensor with {ndim} dimensions \
             (give one entry per axis)"
        )));
    }
    let mut perm = [0, 1, 2, 3];
    let mut seen = [false; MAX_DIMS];
    for (i, &axis) in axes.iter().enumerate() {
        let src = ggml_dim(axis, ndim, op)?;
        if std::mem::replace(&mut seen[src], true) {
            return Err(errors::shape(format!(
                "{op}: axes {axes:?} repeat an axis (need a permutation of 0..{ndim})"
            )));
        }
        perm[src] = ndim - 1 - i;
    }
    Ok(perm)
}

/// ggml byte strides `nb[1..]` from numpy-order byte `strides` of a view with ggml shape `ne`:
/// one entry per axis (the last must be the element size) or all but the last.
fn ggml_strides(
    strides: &[usize],
    ne: &[usize],
    dtype: ferrograph::dtype::DType,
    op: &str,
) -> PyResult<Vec<usize>> {
    let n = ne.len();
    let ggml: Vec<usize> = strides.iter().rev().copied().collect();
    if ggml.len() == n {
        if ggml[0] != dtype.type_size() {
            return Err(errors::shape(format!(
                "{op}: the last axis must be dense (stride {} for {}), got {}",
                dtype.type_size(),
                dtype.name(),
                ggml[0]
            )));
        }
        Ok(ggml[1..].to_vec())
    } else if ggml.len() + 1 == n {
        Ok(ggml)
    } else {
        Err(errors::shape(format!(
            "{op}: a {n}-d shape needs {n} or {} strides, got {}",
            n - 1,
            strides.len()
        )))
    }
}

/// ggml `ne` (fastest first) from a numpy-order shape.
fn ne_of(shape: &[usize], op: &str) -> PyResult<Vec<usize>> {
    if shape.is_empty() || shape.len() > MAX_DIMS {
        return Err(errors::shape(format!(
            "{op}: a shape needs 1 to {MAX_DIMS} dimensions, got {shape:?}"
        )));
    }
    Ok(shape.iter().rev().copied().collect())
}

macro_rules! binary_op {
    ($name:ident, $doc:literal) => {
        #[doc = $doc]
        #[pyfunction]
        #[pyo3(signature = (a, b, *, ctx = None))]
        fn $name<'py>(
            py: Python<'py>,
            a: T<'_>,
            b: T<'_>,
            ctx: Ctx<'_>,
        ) -> PyResult<Bound<'py, PyTensor>> {
            build(py, &ctx, &a.inner, |c| ops::$name(c, &a.inner, &b.inner))
        }
    };
}

macro_rules! unary_fn {
    ($name:ident, $doc:literal) => {
        #[doc = $doc]
        #[pyfunction]
        #[pyo3(signature = (a, *, ctx = None))]
        fn $name<'py>(py: Python<'py>, a: T<'_>, ctx: Ctx<'_>) -> PyResult<Bound<'py, PyTensor>> {
            build(py, &ctx, &a.inner, |c| ops::$name(c, &a.inner))
        }
    };
}

macro_rules! unary_op {
    ($name:ident, $variant:ident, $doc:literal) => {
        #[doc = $doc]
        #[pyfunction]
        #[pyo3(signature = (a, *, ctx = None))]
        fn $name<'py>(py: Python<'py>, a: T<'_>, ctx: Ctx<'_>) -> PyResult<Bound<'py, PyTensor>> {
            build(py, &ctx, &a.inner, |c| {
                ops::unary(c, &a.inner, UnaryOp::$variant)
            })
        }
    };
}

macro_rules! glu_op {
    ($name:ident, $variant:ident, $doc:literal) => {
        #[doc = $doc]
        #[pyfunction]
        #[pyo3(signature = (a, b = None, *, swapped = false, ctx = None))]
        fn $name<'py>(
            py: Python<'py>,
            a: T<'_>,
            b: Option<T<'_>>,
            swapped: bool,
            ctx: Ctx<'_>,
        ) -> PyResult<Bound<'py, PyTensor>> {
            build(py, &ctx, &a.inner, |c| -> PyResult<Tensor> {
                match b {
                    Some(b) => Ok(ops::glu_split(c, &a.inner, &b.inner, GluOp::$variant)?),
                    None => Ok(ops::glu(c, &a.inner, GluOp::$variant, swapped)?),
                }
            })
        }
    };
}

// ----- copies and views -----

unary_fn!(dup, "A copy of `a` (op DUP).");
binary_op!(
    cpy,
    "Copies `a` into `b` (converting the dtype); the result is a view of `b`."
);
binary_op!(
    get_rows,
    "Gathers rows of `a` at the int32 indices `b` (ggml's GET_ROWS)."
);
/// A view with axes reordered, numpy's `np.transpose(a, axes)`; without `axes` the last two
/// axes swap (numpy's `np.matrix_transpose(a)`, ggml's TRANSPOSE; a 1-d tensor becomes a
/// column).
#[pyfunction]
#[pyo3(signature = (a, axes = None, *, ctx = None))]
fn transpose<'py>(
    py: Python<'py>,
    a: T<'_>,
    axes: Option<Vec<i64>>,
    ctx: Ctx<'_>,
) -> PyResult<Bound<'py, PyTensor>> {
    build(py, &ctx, &a.inner, |c| -> PyResult<Tensor> {
        match axes {
            None => Ok(ops::transpose(c, &a.inner)?),
            Some(axes) => {
                let perm = ggml_permutation(&axes, a.inner.ndim(), "TRANSPOSE")?;
                Ok(ops::permute(c, &a.inner, perm)?)
            }
        }
    })
}

/// A contiguous copy of `a`, optionally with a new numpy-order `shape` of the same size.
#[pyfunction]
#[pyo3(signature = (a, shape = None, *, ctx = None))]
fn cont<'py>(
    py: Python<'py>,
    a: T<'_>,
    shape: Option<ShapeArg>,
    ctx: Ctx<'_>,
) -> PyResult<Bound<'py, PyTensor>> {
    build(py, &ctx, &a.inner, |c| -> PyResult<Tensor> {
        match shape {
            None => Ok(ops::cont(c, &a.inner)?),
            Some(shape) => {
                let ne = ne_of(&shape.into_vec(), "CONT")?;
                Ok(ops::cont_shape(c, &a.inner, &ne)?)
            }
        }
    })
}

/// A view of contiguous `a` with a new numpy-order `shape` (one entry may be -1).
#[pyfunction]
#[pyo3(signature = (a, shape, *, ctx = None))]
fn reshape<'py>(
    py: Python<'py>,
    a: T<'_>,
    shape: Bound<'_, PyAny>,
    ctx: Ctx<'_>,
) -> PyResult<Bound<'py, PyTensor>> {
    build(py, &ctx, &a.inner, |c| -> PyResult<Tensor> {
        let wanted: Vec<i64> = match shape.extract::<i64>() {
            Ok(n) => vec![n],
            Err(_) => shape.extract()?,
        };
        let n_unknown = wanted.iter().filter(|&&d| d == -1).count();
        if n_unknown > 1 || wanted.iter().any(|&d| d < -1) {
            return Err(errors::shape(format!(
                "RESHAPE: invalid shape {wanted:?} (sizes ≥ 0, at most one -1)"
            )));
        }
        let known: usize = wanted
            .iter()
            .filter(|&&d| d >= 0)
            .map(|&d| d as usize)
            .product();
        let total = a.inner.nelements();
        let resolved: Vec<usize> = wanted
            .iter()
            .map(|&d| {
                if d == -1 {
                    if known == 0 || !total.is_multiple_of(known) {
                        Err(errors::shape(format!(
                            "RESHAPE: cannot infer -1 in {wanted:?} for {total} elements"
                        )))
                    } else {
                        Ok(total / known)
                    }
                } else {
                    Ok(d as usize)
                }
            })
            .collect::<PyResult<_>>()?;
        let ne = ne_of(&resolved, "RESHAPE")?;
        Ok(ops::reshape(c, &a.inner, &ne)?)
    })
}

/// A view of `a`'s memory with a numpy-order `shape`, numpy-order byte `strides` and a byte
/// `offset`. `strides` may be omitted (contiguous), have one entry per axis (the last must be
/// the element size: rows are dense), or omit the last axis.
#[pyfunction]
#[pyo3(signature = (a, shape, strides = None, offset = 0, *, ctx = None))]
fn view<'py>(
    py: Python<'py>,
    a: T<'_>,
    shape: ShapeArg,
    strides: Option<Vec<usize>>,
    offset: usize,
    ctx: Ctx<'_>,
) -> PyResult<Bound<'py, PyTensor>> {
    build(py, &ctx, &a.inner, |c| -> PyResult<Tensor> {
        let shape = shape.into_vec();
        let ne = ne_of(&shape, "VIEW")?;
        let n = ne.len();
        let dtype = a.inner.dtype();
        let nb_rest: Vec<usize> = match strides {
            None => {
                let mut full = [1usize; MAX_DIMS];
                full[..n].copy_from_slice(&ne);
                ferrograph::tensor::contiguous_strides(dtype, &full)[1..n].to_vec()
            }
            Some(strides) => ggml_strides(&strides, &ne, dtype, "VIEW")?,
        };
        Ok(ops::view(c, &a.inner, &ne, &nb_rest, offset)?)
    })
}

/// A view with axes reordered, numpy's `np.transpose(a, axes)`: axis `i` of the result is axis
/// `axes[i]` of `a` (one entry per axis; negative entries count from the end).
#[pyfunction]
#[pyo3(signature = (a, axes, *, ctx = None))]
fn permute<'py>(
    py: Python<'py>,
    a: T<'_>,
    axes: Vec<i64>,
    ctx: Ctx<'_>,
) -> PyResult<Bound<'py, PyTensor>> {
    build(py, &ctx, &a.inner, |c| -> PyResult<Tensor> {
        let perm = ggml_permutation(&axes, a.inner.ndim(), "PERMUTE")?;
        Ok(ops::permute(c, &a.inner, perm)?)
    })
}

/// ggml's `ggml_permute`, for code ported from ggml: `axes[i]` is where ggml dimension `i` of
/// `a` goes, ggml dimension 0 being numpy's *last* axis. Fewer than 4 axes are completed with
/// the identity. Prefer [`permute`], which takes numpy's axes.
#[pyfunction]
#[pyo3(signature = (a, axes, *, ctx = None))]
fn permute_ggml<'py>(
    py: Python<'py>,
    a: T<'_>,
    axes: Vec<usize>,
    ctx: Ctx<'_>,
) -> PyResult<Bound<'py, PyTensor>> {
    build(py, &ctx, &a.inner, |c| -> PyResult<Tensor> {
        if axes.is_empty() || axes.len() > MAX_DIMS {
            return Err(errors::shape(format!(
                "PERMUTE: needs 1 to {MAX_DIMS} axes, got {axes:?}"
            )));
        }
        let mut full = [0, 1, 2, 3];
        full[..axes.len()].copy_from_slice(&axes);
        Ok(ops::permute(c, &a.inner, full)?)
    })
}

/// Scatters the f32 rows `b` into `a` at the indices `c` (int32/int64); a view of `a`.
#[pyfunction]
#[pyo3(signature = (a, b, c, *, ctx = None))]
fn set_rows<'py>(
    py: Python<'py>,
    a: T<'_>,
    b: T<'_>,
    c: T<'_>,
    ctx: Ctx<'_>,
) -> PyResult<Bound<'py, PyTensor>> {
    build(py, &ctx, &a.inner, |cx| {
        ops::set_rows(cx, &a.inner, &b.inner, &c.inner)
    })
}

// ----- arithmetic -----

binary_op!(
    add,
    "`a + b`, broadcasting `b` (each dimension of `a` a multiple of `b`'s)."
);
binary_op!(sub, "`a - b`, broadcasting `b`.");
binary_op!(mul, "`a * b`, broadcasting `b`.");
binary_op!(div, "`a / b`, broadcasting `b`.");
binary_op!(add1, "`a + b` where `b` has one element.");
binary_op!(repeat, "Tiles `a` to the shape of `b`.");
binary_op!(
    mul_mat,
    "Matrix product with ggml's meaning: `mul_mat(a, b)` is `b @ a.T` in numpy terms \
     (a: (..., n, k) weights, b: (..., m, k) f32 activations → (..., m, n) f32)."
);
binary_op!(
    out_prod,
    "ggml's OUT_PROD: `out_prod(a, b)` is `b.T @ a` in numpy terms over the last two axes \
     (a: (..., k, n), b: (..., k, m) → (..., m, n)): outer products summed over axis -2."
);

/// A copy of `a` with `b` added into a region of it (ggml's ACC): the region has `b`'s shape,
/// numpy-order byte `strides` (as in `view`; `a`'s own strides when omitted) and starts `offset`
/// bytes into `a`. In numpy terms: `as_strided(out.ravel()[offset // itemsize:], b.shape,
/// strides) += b`.
#[pyfunction]
#[pyo3(signature = (a, b, strides = None, offset = 0, *, ctx = None))]
fn acc<'py>(
    py: Python<'py>,
    a: T<'_>,
    b: T<'_>,
    strides: Option<Vec<usize>>,
    offset: usize,
    ctx: Ctx<'_>,
) -> PyResult<Bound<'py, PyTensor>> {
    build(py, &ctx, &a.inner, |c| -> PyResult<Tensor> {
        let ne_b = b.inner.ne();
        let n = b.inner.ndim();
        let mut nb = a.inner.nb();
        if let Some(strides) = strides {
            // Dimensions past b's own have one element, so a's strides there never move.
            let rest = ggml_strides(&strides, &ne_b[..n], a.inner.dtype(), "ACC")?;
            nb[1..n].copy_from_slice(&rest);
        }
        Ok(ops::acc(
            c, &a.inner, &b.inner, nb[1], nb[2], nb[3], offset,
        )?)
    })
}

/// ggml's `ggml_acc`, for code ported from ggml: `b` is added into the region of a copy of `a`
/// given by ggml byte strides `nb1..nb3` (of ggml dimensions 1-3, numpy's axes -2, -3, -4) and
/// a byte `offset`. Prefer [`acc`], which takes numpy-order strides.
#[pyfunction]
#[pyo3(signature = (a, b, nb1, nb2, nb3, offset, *, ctx = None))]
#[allow(clippy::too_many_arguments)]
fn acc_ggml<'py>(
    py: Python<'py>,
    a: T<'_>,
    b: T<'_>,
    nb1: usize,
    nb2: usize,
    nb3: usize,
    offset: usize,
    ctx: Ctx<'_>,
) -> PyResult<Bound<'py, PyTensor>> {
    build(py, &ctx, &a.inner, |c| {
        ops::acc(c, &a.inner, &b.inner, nb1, nb2, nb3, offset)
    })
}

/// `a * s + b`.
#[pyfunction]
#[pyo3(signature = (a, s, b = 0.0, *, ctx = None))]
fn scale<'py>(
    py: Python<'py>,
    a: T<'_>,
    s: f32,
    b: f32,
    ctx: Ctx<'_>,
) -> PyResult<Bound<'py, PyTensor>> {
    build(py, &ctx, &a.inner, |c| ops::scale(c, &a.inner, s, b))
}

/// Clamps to `[min, max]`.
#[pyfunction]
#[pyo3(signature = (a, min, max, *, ctx = None))]
fn clamp<'py>(
    py: Python<'py>,
    a: T<'_>,
    min: f32,
    max: f32,
    ctx: Ctx<'_>,
) -> PyResult<Bound<'py, PyTensor>> {
    build(py, &ctx, &a.inner, |c| ops::clamp(c, &a.inner, min, max))
}

unary_fn!(sqr, "`a²` elementwise.");
unary_fn!(sqrt, "`√a` elementwise.");
/// `ln a` elementwise.
#[pyfunction(name = "log")]
#[pyo3(signature = (a, *, ctx = None))]
fn log_<'py>(py: Python<'py>, a: T<'_>, ctx: Ctx<'_>) -> PyResult<Bound<'py, PyTensor>> {
    build(py, &ctx, &a.inner, |c| ops::log(c, &a.inner))
}
unary_fn!(sin, "`sin a` elementwise.");
unary_fn!(cos, "`cos a` elementwise.");
unary_fn!(sum, "The sum of all elements (one f32).");
unary_fn!(
    sum_rows,
    "The sum along the last axis, kept with length 1 (numpy's `a.sum(axis=-1, keepdims=True)`)."
);
unary_fn!(
    mean,
    "The mean along the last axis, kept with length 1 (`a.mean(axis=-1, keepdims=True)`)."
);
unary_fn!(
    argmax,
    "The index of the maximum along the last axis, int32 (`a.argmax(axis=-1)`)."
);

/// Joins `a` and `b` along `axis` (numpy's `np.concatenate((a, b), axis)`; negative counts
/// from the end). Both need the same number of dimensions and equal sizes on the other axes.
#[pyfunction]
#[pyo3(signature = (a, b, axis = 0, *, ctx = None))]
fn concat<'py>(
    py: Python<'py>,
    a: T<'_>,
    b: T<'_>,
    axis: i64,
    ctx: Ctx<'_>,
) -> PyResult<Bound<'py, PyTensor>> {
    build(py, &ctx, &a.inner, |c| -> PyResult<Tensor> {
        let ndim = a.inner.ndim();
        if b.inner.ndim() != ndim {
            return Err(errors::shape(format!(
            "CONCAT: both operands need the same number of dimensions, got shapes {:?} and {:?}",
            a.inner.shape(),
            b.inner.shape()
        )));
        }
        let dim = ggml_dim(axis, ndim, "CONCAT")?;
        Ok(ops::concat(c, &a.inner, &b.inner, dim)?)
    })
}

/// ggml's `ggml_concat`, for code ported from ggml: joins `a` and `b` along ggml dimension
/// `dim` (dimension 0 is numpy's *last* axis). Prefer [`concat`], which takes a numpy axis.
#[pyfunction]
#[pyo3(signature = (a, b, dim, *, ctx = None))]
fn concat_ggml<'py>(
    py: Python<'py>,
    a: T<'_>,
    b: T<'_>,
    dim: usize,
    ctx: Ctx<'_>,
) -> PyResult<Bound<'py, PyTensor>> {
    build(py, &ctx, &a.inner, |c| {
        ops::concat(c, &a.inner, &b.inner, dim)
    })
}

// ----- unary functions and GLUs -----

fn unary_from_name(name: &str) -> PyResult<UnaryOp> {
    let wanted = name.to_ascii_uppercase();
    UnaryOp::ALL
        .into_iter()
        .find(|u| u.name() == wanted)
        .ok_or_else(|| {
            errors::invalid(format!(
                "unknown unary op {name:?}; expected one of {}",
                UnaryOp::ALL
                    .map(|u| u.name().to_ascii_lowercase())
                    .join(", ")
            ))
        })
}

/// Applies the unary function named `op` (`"gelu"`, `"relu"`, ... case-insensitive).
#[pyfunction]
#[pyo3(signature = (a, op, *, ctx = None))]
fn unary<'py>(py: Python<'py>, a: T<'_>, op: &str, ctx: Ctx<'_>) -> PyResult<Bound<'py, PyTensor>> {
    build(py, &ctx, &a.inner, |c| -> PyResult<Tensor> {
        Ok(ops::unary(c, &a.inner, unary_from_name(op)?)?)
    })
}

/// The names accepted by `unary` (lower case).
#[pyfunction]
fn unary_op_names() -> Vec<String> {
    UnaryOp::ALL
        .iter()
        .map(|u| u.name().to_ascii_lowercase())
        .collect()
}

unary_op!(abs, Abs, "`|a|`.");
unary_op!(sgn, Sgn, "The sign of `a` (0 at 0).");
unary_op!(neg, Neg, "`-a`.");
unary_op!(step, Step, "1 where `a > 0`, else 0.");
unary_op!(tanh, Tanh, "`tanh a`.");
unary_op!(elu, Elu, "`a` if `a > 0` else `exp(a) - 1`.");
unary_op!(relu, Relu, "`max(a, 0)`.");
unary_op!(sigmoid, Sigmoid, "`1 / (1 + exp(-a))`.");
unary_op!(gelu, Gelu, "GELU, tanh approximation.");
unary_op!(gelu_erf, GeluErf, "GELU, exact erf form.");
unary_op!(
    gelu_quick,
    GeluQuick,
    "GELU, sigmoid approximation `a·σ(1.702a)`."
);
unary_op!(silu, Silu, "`a·σ(a)`.");
unary_op!(hardswish, Hardswish, "`a·min(max(a + 3, 0), 6) / 6`.");
unary_op!(hardsigmoid, Hardsigmoid, "`min(max(a + 3, 0), 6) / 6`.");
unary_op!(exp, Exp, "`exp a`.");

/// `a` if `a > 0` else `negative_slope·a`.
#[pyfunction]
#[pyo3(signature = (a, negative_slope = 0.01, *, ctx = None))]
fn leaky_relu<'py>(
    py: Python<'py>,
    a: T<'_>,
    negative_slope: f32,
    ctx: Ctx<'_>,
) -> PyResult<Bound<'py, PyTensor>> {
    build(py, &ctx, &a.inner, |c| {
        ops::leaky_relu(c, &a.inner, negative_slope)
    })
}

fn glu_from_name(name: &str) -> PyResult<GluOp> {
    match name.to_ascii_lowercase().as_str() {
        "reglu" => Ok(GluOp::Reglu),
        "geglu" => Ok(GluOp::Geglu),
        "swiglu" => Ok(GluOp::Swiglu),
        other => Err(errors::invalid(format!(
            "unknown GLU {other:?}; expected reglu, geglu or swiglu"
        ))),
    }
}

/// A gated linear unit named `op` ("reglu", "geglu", "swiglu"). With one operand the rows of
/// `a` hold both halves (`swapped` puts the activation on the second half); with `b` the gate
/// is `a` and the values `b`.
#[pyfunction]
#[pyo3(signature = (a, op, b = None, *, swapped = false, ctx = None))]
fn glu<'py>(
    py: Python<'py>,
    a: T<'_>,
    op: &str,
    b: Option<T<'_>>,
    swapped: bool,
    ctx: Ctx<'_>,
) -> PyResult<Bound<'py, PyTensor>> {
    build(py, &ctx, &a.inner, |c| -> PyResult<Tensor> {
        let op = glu_from_name(op)?;
        match b {
            Some(b) => Ok(ops::glu_split(c, &a.inner, &b.inner, op)?),
            None => Ok(ops::glu(c, &a.inner, op, swapped)?),
        }
    })
}

glu_op!(reglu, Reglu, "ReLU-gated linear unit (see `glu`).");
glu_op!(geglu, Geglu, "GELU-gated linear unit (see `glu`).");
glu_op!(swiglu, Swiglu, "SiLU-gated linear unit (see `glu`).");

// ----- normalisation -----

/// Normalises each row to zero mean and unit variance.
#[pyfunction]
#[pyo3(signature = (a, eps = 1e-5, *, ctx = None))]
fn norm<'py>(py: Python<'py>, a: T<'_>, eps: f32, ctx: Ctx<'_>) -> PyResult<Bound<'py, PyTensor>> {
    build(py, &ctx, &a.inner, |c| ops::norm(c, &a.inner, eps))
}

/// Divides each row by its root mean square.
#[pyfunction]
#[pyo3(signature = (a, eps = 1e-6, *, ctx = None))]
fn rms_norm<'py>(
    py: Python<'py>,
    a: T<'_>,
    eps: f32,
    ctx: Ctx<'_>,
) -> PyResult<Bound<'py, PyTensor>> {
    build(py, &ctx, &a.inner, |c| ops::rms_norm(c, &a.inner, eps))
}

/// Normalises `n_groups` groups of channels, the channels being axis -3 (each group spans its
/// channels' last two axes).
#[pyfunction]
#[pyo3(signature = (a, n_groups, eps = 1e-6, *, ctx = None))]
fn group_norm<'py>(
    py: Python<'py>,
    a: T<'_>,
    n_groups: usize,
    eps: f32,
    ctx: Ctx<'_>,
) -> PyResult<Bound<'py, PyTensor>> {
    build(py, &ctx, &a.inner, |c| {
        ops::group_norm(c, &a.inner, n_groups, eps)
    })
}

/// Divides each row by its L2 norm (at least `eps`).
#[pyfunction]
#[pyo3(signature = (a, eps = 1e-12, *, ctx = None))]
fn l2_norm<'py>(
    py: Python<'py>,
    a: T<'_>,
    eps: f32,
    ctx: Ctx<'_>,
) -> PyResult<Bound<'py, PyTensor>> {
    build(py, &ctx, &a.inner, |c| ops::l2_norm(c, &a.inner, eps))
}

// ----- matrix products, attention -----

/// Mixture-of-experts product: `experts` selected per row by the int32 `ids`.
#[pyfunction]
#[pyo3(signature = (experts, b, ids, *, ctx = None))]
fn mul_mat_id<'py>(
    py: Python<'py>,
    experts: T<'_>,
    b: T<'_>,
    ids: T<'_>,
    ctx: Ctx<'_>,
) -> PyResult<Bound<'py, PyTensor>> {
    build(py, &ctx, &experts.inner, |c| {
        ops::mul_mat_id(c, &experts.inner, &b.inner, &ids.inner)
    })
}

/// Sets elements above the diagonal (shifted by `n_past`) to -inf.
#[pyfunction]
#[pyo3(signature = (a, n_past, *, ctx = None))]
fn diag_mask_inf<'py>(
    py: Python<'py>,
    a: T<'_>,
    n_past: usize,
    ctx: Ctx<'_>,
) -> PyResult<Bound<'py, PyTensor>> {
    build(py, &ctx, &a.inner, |c| {
        ops::diag_mask_inf(c, &a.inner, n_past)
    })
}

/// Softmax of each row of `a·scale + mask` (plus ALiBi when `max_bias > 0`, which needs a
/// mask).
#[pyfunction]
#[pyo3(signature = (a, mask = None, scale = 1.0, max_bias = 0.0, *, ctx = None))]
fn soft_max<'py>(
    py: Python<'py>,
    a: T<'_>,
    mask: Option<T<'_>>,
    scale: f32,
    max_bias: f32,
    ctx: Ctx<'_>,
) -> PyResult<Bound<'py, PyTensor>> {
    build(py, &ctx, &a.inner, |c| {
        ops::soft_max(
            c,
            &a.inner,
            mask.as_ref().map(|m| &m.inner),
            scale,
            max_bias,
        )
    })
}

/// Rotary position embedding of `a` (..., tokens, heads, head_dim) at the int32 positions
/// `pos` (one per token, axis -3) over the first `n_dims` values of each row. `mode` is "normal" (adjacent pairs) or
/// "neox" (pairs split across halves).
#[pyfunction]
#[pyo3(signature = (
    a, pos, n_dims, mode = "normal", freq_base = 10000.0, freq_scale = 1.0, n_ctx_orig = 0,
    ext_factor = 0.0, attn_factor = 1.0, beta_fast = 32.0, beta_slow = 1.0,
    freq_factors = None, *, ctx = None
))]
#[allow(clippy::too_many_arguments)]
fn rope<'py>(
    py: Python<'py>,
    a: T<'_>,
    pos: T<'_>,
    n_dims: usize,
    mode: &str,
    freq_base: f32,
    freq_scale: f32,
    n_ctx_orig: usize,
    ext_factor: f32,
    attn_factor: f32,
    beta_fast: f32,
    beta_slow: f32,
    freq_factors: Option<T<'_>>,
    ctx: Ctx<'_>,
) -> PyResult<Bound<'py, PyTensor>> {
    build(py, &ctx, &a.inner, |c| -> PyResult<Tensor> {
        let mode = match mode.to_ascii_lowercase().as_str() {
            "normal" => RopeMode::Normal,
            "neox" => RopeMode::Neox,
            other => {
                return Err(errors::invalid(format!(
                    "ROPE: unknown mode {other:?}; expected \"normal\" or \"neox\""
                )))
            }
        };
        let params = RopeParams {
            n_dims,
            mode,
            n_ctx_orig,
            freq_base,
            freq_scale,
            ext_factor,
            attn_factor,
            beta_fast,
            beta_slow,
        };
        Ok(ops::rope(
            c,
            &a.inner,
            &pos.inner,
            freq_factors.as_ref().map(|f| &f.inner),
            params,
        )?)
    })
}

/// Fused attention `softmax(q·kᵀ·scale + mask) · v` (ggml's FLASH_ATTN_EXT): q (..., heads,
/// seq_q, d), k and v (..., heads, seq_k, d); the result is (..., seq_q, heads, d_v), axes -2
/// and -3 swapped relative to q's.
#[pyfunction]
#[pyo3(signature = (q, k, v, mask = None, scale = 1.0, max_bias = 0.0, logit_softcap = 0.0, *, ctx = None))]
#[allow(clippy::too_many_arguments)]
fn flash_attn_ext<'py>(
    py: Python<'py>,
    q: T<'_>,
    k: T<'_>,
    v: T<'_>,
    mask: Option<T<'_>>,
    scale: f32,
    max_bias: f32,
    logit_softcap: f32,
    ctx: Ctx<'_>,
) -> PyResult<Bound<'py, PyTensor>> {
    build(py, &ctx, &q.inner, |c| {
        ops::flash_attn_ext(
            c,
            &q.inner,
            &k.inner,
            &v.inner,
            mask.as_ref().map(|m| &m.inner),
            scale,
            max_bias,
            logit_softcap,
        )
    })
}

// ----- custom ops -----

/// A Python callable as a [`CustomOp`]: called as `fn(out, *srcs)` with writable numpy views of
/// the output's and sources' host memory, valid only during the call.
struct PyCustomOp {
    function: Py<PyAny>,
    name: String,
}

impl PyCustomOp {
    fn call(&self, py: Python<'_>, dst: &Tensor, srcs: &[Tensor]) -> PyResult<()> {
        let mut args = vec![host_view(py, dst)?];
        for src in srcs {
            args.push(host_view(py, src)?);
        }
        self.function.bind(py).call1(PyTuple::new(py, args)?)?;
        Ok(())
    }
}

impl CustomOp for PyCustomOp {
    fn name(&self) -> &str {
        &self.name
    }

    fn compute(&self, dst: &Tensor, srcs: &[Tensor]) -> ferrograph::Result<()> {
        guard(&format!("custom op '{}'", self.name), || {
            Python::try_attach(|py| {
                self.call(py, dst, srcs).map_err(|err| {
                    let kind = err
                        .get_type(py)
                        .name()
                        .map(|n| n.to_string())
                        .unwrap_or_else(|_| "exception".into());
                    let text = err.value(py).to_string();
                    // The exception itself travels with the error (its __cause__ in Python).
                    let marker = super::raised::keep(err);
                    Error::Backend(format!(
                        "custom op '{}' raised {kind}: {text}{marker}",
                        self.name
                    ))
                })
            })
            .unwrap_or_else(|| {
                Err(Error::Backend(format!(
                    "custom op '{}': the Python interpreter is not available",
                    self.name
                )))
            })
        })
    }
}

/// A CUSTOM op computed on the host by the Python callable `fn(out, *srcs)`, with result
/// `dtype` and numpy-order `shape`. The callable receives writable numpy views of the output's
/// and sources' memory, valid only during the call (do not keep them); an exception it raises
/// stops the computation with a `ferrograph.BackendError` whose `__cause__` is that exception.
#[pyfunction]
#[pyo3(signature = (fn_, srcs, dtype, shape, name = None, *, ctx = None))]
#[allow(clippy::too_many_arguments)]
fn custom<'py>(
    py: Python<'py>,
    fn_: Bound<'py, PyAny>,
    srcs: Vec<T<'_>>,
    dtype: DTypeArg,
    shape: ShapeArg,
    name: Option<String>,
    ctx: Ctx<'_>,
) -> PyResult<Bound<'py, PyTensor>> {
    if !fn_.is_callable() {
        return Err(errors::invalid("custom: fn must be callable"));
    }
    let tensors: Vec<Tensor> = srcs.iter().map(|t| t.inner.clone()).collect();
    let refs: Vec<&Tensor> = tensors.iter().collect();
    let c = resolve(&ctx, &refs)?;
    let name = match name {
        Some(n) => n,
        None => fn_
            .getattr("__name__")
            .and_then(|n| n.extract::<String>())
            .unwrap_or_else(|_| "python".into()),
    };
    let op = Arc::new(PyCustomOp {
        function: fn_.unbind(),
        name,
    });
    let ne = ne_of(&shape.into_vec(), "CUSTOM")?;
    PyTensor::wrap(py, ops::custom(&c, op, &tensors, dtype.0, &ne)?)
}

/// Runs a CUSTOM node's callable now, on the host, with the interpreter released around the
/// call as a compute engine would (its tensors must be allocated in host memory).
#[pyfunction]
fn run_custom(py: Python<'_>, t: T<'_>) -> PyResult<()> {
    let tensor = t.inner.clone();
    let Op::Custom(op) = tensor.op() else {
        return Err(errors::invalid(format!(
            "run_custom needs a CUSTOM node, got op {}",
            tensor.op().name()
        )));
    };
    // Unallocated (or stale) tensors are reported as such, not as a failure of the op.
    for t in std::iter::once(&tensor).chain(tensor.srcs()) {
        t.storage()?;
    }
    let op = op.0.clone();
    py.detach(|| guard("run_custom", || op.compute(&tensor, tensor.srcs())))?;
    ferrograph::tensor::mark_computed(std::slice::from_ref(&tensor));
    Ok(())
}

/// Registers the builders in the `ops` submodule.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    macro_rules! add {
        ($($f:ident),* $(,)?) => {
            $( m.add_function(wrap_pyfunction!($f, m)?)?; )*
        };
    }
    add!(
        dup,
        cpy,
        cont,
        reshape,
        view,
        permute,
        permute_ggml,
        transpose,
        get_rows,
        set_rows,
        add,
        sub,
        mul,
        div,
        add1,
        acc,
        acc_ggml,
        scale,
        sqr,
        sqrt,
        log_,
        sin,
        cos,
        clamp,
        sum,
        sum_rows,
        mean,
        argmax,
        repeat,
        concat,
        concat_ggml,
        unary,
        unary_op_names,
        abs,
        sgn,
        neg,
        step,
        tanh,
        elu,
        relu,
        sigmoid,
        gelu,
        gelu_erf,
        gelu_quick,
        silu,
        hardswish,
        hardsigmoid,
        exp,
        leaky_relu,
        glu,
        reglu,
        geglu,
        swiglu,
        norm,
        rms_norm,
        group_norm,
        l2_norm,
        mul_mat,
        out_prod,
        mul_mat_id,
        diag_mask_inf,
        soft_max,
        rope,
        flash_attn_ext,
        custom,
        run_custom,
    );
    let names = PyList::empty(m.py());
    for (name, _) in m.dict().iter() {
        let name: String = name.extract()?;
        if !name.starts_with('_') {
            names.append(name)?;
        }
    }
    m.add("__all__", names)?;
    Ok(())
}
