//! Builders that validate shapes and dtypes, over the op IR of [`crate::op`].
//!
//! The op set and its parameter types live in [`crate::op`] and are re-exported here, so
//! `ops::Op`, `ops::UnaryOp` and the rest keep their paths. [`rebuild`] maps an [`Op`] value
//! back to its builder call (the remote server rebuilds every tensor it is sent with it).
//!
//! Builders follow ggml's semantics and argument order (`mul_mat(a, b)` computes `b · aᵀ` in
//! numpy terms) and return a new tensor recorded in the given context. Every builder checks its
//! operands and returns [`Error::Shape`] or [`Error::DType`] naming the tensors and their shapes.

use std::sync::Arc;

use crate::context::Context;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::tensor::{contiguous_strides, Tensor, TensorSpec, MAX_DIMS};

pub use crate::op::{CustomOp, CustomOpRef, GluOp, Op, RopeMode, RopeParams, UnaryOp};

// ----- helpers -----

fn describe(t: &Tensor) -> String {
    format!("{} ({} {:?})", t.label(), t.dtype(), t.shape())
}

fn new_result(
    ctx: &Context,
    dtype: DType,
    ne: [usize; MAX_DIMS],
    ndim: usize,
    op: Op,
    srcs: Vec<Tensor>,
) -> Result<Tensor> {
    ctx.create(TensorSpec {
        dtype,
        ne,
        nb: None,
        ndim,
        op,
        srcs,
        view: None,
    })
}

/// Checks that a view of `src` with strides `nb` at byte `offset` addresses whole elements:
/// every element (for block-quantized types, every block) starts at a multiple of the type
/// size from the source's start, and block-quantized rows are runs of contiguous blocks.
/// Anything else would read elements cut in two (garbage for blocks, a misaligned pointer —
/// undefined behaviour for Rust slices — for f32/f16).
fn check_view_layout(
    op: &Op,
    src: &Tensor,
    ne: &[usize; MAX_DIMS],
    nb: &[usize; MAX_DIMS],
    offset: usize,
) -> Result<()> {
    let dtype = src.dtype();
    let unit = dtype.type_size();
    let what = if dtype.is_quantized() {
        format!("{} block ({unit} bytes)", dtype.name())
    } else {
        format!("{} element ({unit} bytes)", dtype.name())
    };
    if !offset.is_multiple_of(unit) {
        return Err(Error::shape(format!(
            "{}: a view of {} at byte offset {offset} would start inside a {what}; offsets must \
             be multiples of {unit}",
            op.name(),
            describe(src)
        )));
    }
    if dtype.is_quantized() && ne[0] > 1 && nb[0] != unit {
        return Err(Error::shape(format!(
            "{}: a view of the {} tensor {} whose rows are not contiguous blocks (the first \
             dimension's stride would be {} bytes, a block is {unit}): quantized rows cannot \
             be transposed or permuted away from the first dimension; convert to f32 first",
            op.name(),
            dtype.name(),
            describe(src),
            nb[0]
        )));
    }
    if let Some(i) = (0..MAX_DIMS).find(|&i| ne[i] > 1 && !nb[i].is_multiple_of(unit)) {
        return Err(Error::shape(format!(
            "{}: a view of {} with a stride of {} bytes in dimension {i} would cut a {what}; \
             strides must be multiples of {unit}",
            op.name(),
            describe(src),
            nb[i]
        )));
    }
    Ok(())
}

#[allow(clippy::too_many_arguments)]
fn new_view(
    ctx: &Context,
    src: &Tensor,
    ne: [usize; MAX_DIMS],
    nb: [usize; MAX_DIMS],
    ndim: usize,
    offset: usize,
    op: Op,
    srcs: Vec<Tensor>,
) -> Result<Tensor> {
    check_view_layout(&op, src, &ne, &nb, offset)?;
    check_span(src.dtype(), &ne, &nb, op.name())?;
    ctx.create(TensorSpec {
        dtype: src.dtype(),
        ne,
        nb: Some(nb),
        ndim,
        op,
        srcs,
        view: Some((src.clone(), offset)),
    })
}

/// The bytes a tensor of this dtype, shape and strides spans (as
/// [`span_bytes`](crate::tensor::span_bytes) counts them), or an error when strides make that
/// overflow or exceed `isize::MAX`: strides that come from a caller are checked with it before
/// any tensor is made of them.
pub(crate) fn check_span(
    dtype: DType,
    ne: &[usize; MAX_DIMS],
    nb: &[usize; MAX_DIMS],
    what: &str,
) -> Result<usize> {
    if ne.contains(&0) {
        return Ok(0);
    }
    let block = dtype.block_size();
    let (first, start) = if block == 1 {
        (0, Some(dtype.type_size()))
    } else {
        (1, ne[0].checked_mul(nb[0]).map(|x| x / block))
    };
    let span = (first..MAX_DIMS).try_fold(start, |acc, i| {
        Some(acc.and_then(|acc| (ne[i] - 1).checked_mul(nb[i])?.checked_add(acc)))
    });
    match span.flatten() {
        Some(bytes) if bytes <= isize::MAX as usize => Ok(bytes),
        _ => Err(Error::shape(format!(
            "{what}: strides {nb:?} of shape {ne:?} overflow"
        ))),
    }
}

/// Checks explicit strides for a tensor that may be written: the span they give must be
/// computable without overflow, quantized rows must be dense blocks (their kernels read whole
/// blocks), and no two elements may share bytes (kernels write such tensors from several
/// threads).
pub fn check_strides(
    dtype: DType,
    ne: &[usize; MAX_DIMS],
    nb: &[usize; MAX_DIMS],
    what: &str,
) -> Result<()> {
    crate::tensor::check_shape(dtype, ne, what)?;
    if dtype.is_quantized() && nb[0] != dtype.type_size() {
        return Err(Error::shape(format!(
            "{what}: quantized ({dtype}) rows must be dense, got element stride {}",
            nb[0]
        )));
    }
    let span = (0..MAX_DIMS).try_fold(dtype.type_size(), |acc, i| {
        ne[i]
            .saturating_sub(1)
            .checked_mul(nb[i])
            .and_then(|x| acc.checked_add(x))
    });
    if span.is_none_or(|s| s > isize::MAX as usize) {
        return Err(Error::shape(format!(
            "{what}: strides {nb:?} of shape {ne:?} overflow"
        )));
    }
    let mut dims: Vec<(usize, usize)> = (0..MAX_DIMS)
        .map(|i| {
            let n = if i == 0 {
                ne[0] / dtype.block_size()
            } else {
                ne[i]
            };
            (n, nb[i])
        })
        .filter(|&(n, _)| n > 1)
        .collect();
    dims.sort_by_key(|&(_, stride)| stride);
    let mut extent = dtype.type_size();
    for (n, stride) in dims {
        if stride < extent {
            return Err(Error::shape(format!(
                "{what}: strides {nb:?} of shape {ne:?} make elements overlap"
            )));
        }
        // No overflow: the span check above bounds every (n - 1) * stride and their sum.
        extent += (n - 1) * stride;
    }
    Ok(())
}

fn require_float(op: &str, t: &Tensor) -> Result<()> {
    if t.dtype().is_float() {
        Ok(())
    } else {
        Err(Error::DType(format!(
            "{op} needs a float tensor (f32, f16, bf16), got {}",
            describe(t)
        )))
    }
}

fn require_dtype(op: &str, t: &Tensor, allowed: &[DType]) -> Result<()> {
    if allowed.contains(&t.dtype()) {
        Ok(())
    } else {
        Err(Error::DType(format!(
            "{op} accepts {} here, got {}",
            allowed
                .iter()
                .map(|d| d.name())
                .collect::<Vec<_>>()
                .join("/"),
            describe(t)
        )))
    }
}

/// [`require_dtype`] for the weights of a matrix product: any [`DType::is_weight_type`].
fn require_weights(op: &str, t: &Tensor) -> Result<()> {
    if t.dtype().is_weight_type() {
        return Ok(());
    }
    let weights: Vec<DType> = DType::ALL
        .into_iter()
        .filter(|d| d.is_weight_type())
        .collect();
    require_dtype(op, t, &weights)
}

/// Whether `b` can be tiled to `a`'s shape (every dimension of `a` a multiple of `b`'s).
pub fn can_repeat(b: &Tensor, a: &Tensor) -> bool {
    let (nb, na) = (b.ne(), a.ne());
    (0..MAX_DIMS).all(|i| (nb[i] == 0 && na[i] == 0) || (nb[i] != 0 && na[i] % nb[i] == 0))
}

fn binary(ctx: &Context, a: &Tensor, b: &Tensor, op: Op) -> Result<Tensor> {
    let name = op.name();
    require_float(name, a)?;
    if b.dtype() != DType::F32 && b.dtype() != a.dtype() {
        let allowed = if a.dtype() == DType::F32 {
            "f32".to_owned()
        } else {
            format!("f32 or {}", a.dtype())
        };
        return Err(Error::DType(format!(
            "{name}: the second operand must be {allowed}, got {}",
            describe(b)
        )));
    }
    if !can_repeat(b, a) {
        return Err(operands_mismatch(
            format!(
                "{name}: {} cannot be broadcast to {} (each dimension of the first must be a multiple of the second's)",
                describe(b),
                describe(a)
            ),
            &[a, b],
        ));
    }
    new_result(
        ctx,
        a.dtype(),
        a.ne(),
        a.ndim().max(b.ndim()),
        op,
        vec![a.clone(), b.clone()],
    )
}

fn elementwise(ctx: &Context, a: &Tensor, op: Op) -> Result<Tensor> {
    require_float(op.name(), a)?;
    new_result(ctx, a.dtype(), a.ne(), a.ndim(), op, vec![a.clone()])
}

// ----- copies and views -----

/// A copy of `a` with the same shape (op DUP).
pub fn dup(ctx: &Context, a: &Tensor) -> Result<Tensor> {
    new_result(ctx, a.dtype(), a.ne(), a.ndim(), Op::Dup, vec![a.clone()])
}

/// Copies `a` into `b` (converting the dtype); the result is a view of `b`.
pub fn cpy(ctx: &Context, a: &Tensor, b: &Tensor) -> Result<Tensor> {
    if a.nelements() != b.nelements() {
        return Err(Error::shape(format!(
            "CPY: {} and {} have different element counts",
            describe(a),
            describe(b)
        )));
    }
    if b.dtype().is_quantized() && !b.is_contiguous_rows() {
        return Err(Error::shape(format!(
            "CPY: quantized destination {} must have dense rows",
            describe(b)
        )));
    }
    new_view(
        ctx,
        b,
        b.ne(),
        b.nb(),
        b.ndim(),
        0,
        Op::Cpy,
        vec![a.clone(), b.clone()],
    )
}

/// A contiguous copy of `a`.
pub fn cont(ctx: &Context, a: &Tensor) -> Result<Tensor> {
    new_result(ctx, a.dtype(), a.ne(), a.ndim(), Op::Cont, vec![a.clone()])
}

/// A contiguous copy of `a` with a new ggml-order shape of the same element count.
pub fn cont_shape(ctx: &Context, a: &Tensor, ne: &[usize]) -> Result<Tensor> {
    let full = full_ne(ne, "CONT")?;
    crate::tensor::check_shape(a.dtype(), &full, "CONT")?;
    if full.iter().product::<usize>() != a.nelements() {
        return Err(Error::shape(format!(
            "CONT: cannot give {} the shape {ne:?}",
            describe(a)
        )));
    }
    new_result(ctx, a.dtype(), full, ne.len(), Op::Cont, vec![a.clone()])
}

fn full_ne(ne: &[usize], op: &str) -> Result<[usize; MAX_DIMS]> {
    if ne.is_empty() || ne.len() > MAX_DIMS {
        return Err(Error::shape(format!(
            "{op}: a shape needs 1 to {MAX_DIMS} dimensions, got {ne:?}"
        )));
    }
    let mut full = [1usize; MAX_DIMS];
    full[..ne.len()].copy_from_slice(ne);
    Ok(full)
}

/// The same memory with a new ggml-order shape; `a` must be contiguous.
pub fn reshape(ctx: &Context, a: &Tensor, ne: &[usize]) -> Result<Tensor> {
    let full = full_ne(ne, "RESHAPE")?;
    // First: the element count below must not overflow.
    crate::tensor::check_shape(a.dtype(), &full, "RESHAPE")?;
    if !a.is_contiguous() {
        return Err(Error::shape(format!(
            "RESHAPE: {} is not contiguous; use cont first",
            describe(a)
        )));
    }
    if full.iter().product::<usize>() != a.nelements() {
        return Err(Error::shape(format!(
            "RESHAPE: {} has {} elements, the shape {ne:?} has {}",
            describe(a),
            a.nelements(),
            full.iter().product::<usize>()
        )));
    }
    let nb = contiguous_strides(a.dtype(), &full);
    new_view(ctx, a, full, nb, ne.len(), 0, Op::Reshape, vec![a.clone()])
}

/// A view of `a` with ggml-order shape `ne`, row strides `nb[1..]` (bytes; `nb[0]` is the
/// element size) and byte `offset`. `ne.len()` gives the dimensions; `strides` has one entry
/// fewer.
pub fn view(
    ctx: &Context,
    a: &Tensor,
    ne: &[usize],
    strides: &[usize],
    offset: usize,
) -> Result<Tensor> {
    let full = full_ne(ne, "VIEW")?;
    if strides.len() + 1 != ne.len() {
        return Err(Error::shape(format!(
            "VIEW: {} dimensions need {} strides, got {}",
            ne.len(),
            ne.len() - 1,
            strides.len()
        )));
    }
    crate::tensor::check_shape(a.dtype(), &full, "VIEW")?;
    let mut nb = contiguous_strides(a.dtype(), &full);
    nb[1..ne.len()].copy_from_slice(strides);
    for i in ne.len()..MAX_DIMS {
        // Dimensions of one element: their stride never addresses anything, so a caller's
        // huge last stride saturates here instead of overflowing.
        nb[i] = nb[i - 1].saturating_mul(full[i - 1]);
    }
    new_view(
        ctx,
        a,
        full,
        nb,
        ne.len(),
        offset,
        Op::View,
        vec![a.clone()],
    )
}

/// Reorders dimensions: source dimension `i` becomes dimension `axes[i]` (ggml order).
pub fn permute(ctx: &Context, a: &Tensor, axes: [usize; MAX_DIMS]) -> Result<Tensor> {
    let mut seen = [false; MAX_DIMS];
    for &axis in &axes {
        if axis >= MAX_DIMS || seen[axis] {
            return Err(Error::shape(format!(
                "PERMUTE: {axes:?} is not a permutation of 0..4"
            )));
        }
        seen[axis] = true;
    }
    if a.dtype().is_quantized() && axes[0] != 0 {
        return Err(quantized_row_moved("PERMUTE", a));
    }
    let (src_ne, src_nb) = (a.ne(), a.nb());
    let mut ne = [0usize; MAX_DIMS];
    let mut nb = [0usize; MAX_DIMS];
    for i in 0..MAX_DIMS {
        ne[axes[i]] = src_ne[i];
        nb[axes[i]] = src_nb[i];
    }
    let ndim = (0..MAX_DIMS)
        .filter(|&i| i < a.ndim())
        .map(|i| axes[i] + 1)
        .max()
        .unwrap_or(1);
    new_view(
        ctx,
        a,
        ne,
        nb,
        ndim.max(a.ndim()),
        0,
        Op::Permute { axes },
        vec![a.clone()],
    )
}

/// A shape error naming `operands` with their shapes (numpy order), for Python's
/// `ShapeError.names` / `.shapes`.
fn operands_mismatch(message: String, operands: &[&Tensor]) -> Error {
    Error::shapes_mismatch(
        message,
        operands.iter().map(|t| t.name()).collect(),
        operands.iter().map(|t| t.shape()).collect(),
    )
}

/// The error for a permutation that moves the rows of a block-quantized tensor: its elements
/// along dimension 0 are packed in blocks, so no stride can address them along another one.
fn quantized_row_moved(op: &str, a: &Tensor) -> Error {
    Error::shape(format!(
        "{op}: the rows of the {} tensor {} are packed in blocks of {} and cannot move away \
         from the first dimension; convert it to f32 first (cpy into an f32 tensor)",
        a.dtype().name(),
        describe(a),
        a.dtype().block_size()
    ))
}

/// Swaps dimensions 0 and 1.
pub fn transpose(ctx: &Context, a: &Tensor) -> Result<Tensor> {
    if a.dtype().is_quantized() {
        return Err(quantized_row_moved("TRANSPOSE", a));
    }
    let (mut ne, mut nb) = (a.ne(), a.nb());
    ne.swap(0, 1);
    nb.swap(0, 1);
    new_view(
        ctx,
        a,
        ne,
        nb,
        a.ndim().max(2),
        0,
        Op::Transpose,
        vec![a.clone()],
    )
}

/// Gathers rows of `a` by the i32 indices in `b`: result `[a.ne0, b.ne0, b.ne1, b.ne2]`.
pub fn get_rows(ctx: &Context, a: &Tensor, b: &Tensor) -> Result<Tensor> {
    require_dtype("GET_ROWS indices", b, &[DType::I32])?;
    let (na, nb) = (a.ne(), b.ne());
    if na[2] != nb[1] || na[3] != nb[2] || nb[3] != 1 {
        return Err(Error::shape(format!(
            "GET_ROWS: indices {} do not match the batch dimensions of {}",
            describe(b),
            describe(a)
        )));
    }
    let dtype = if a.dtype() == DType::I32 {
        DType::I32
    } else {
        DType::F32
    };
    let ne = [na[0], nb[0], nb[1], nb[2]];
    new_result(
        ctx,
        dtype,
        ne,
        a.ndim().max(b.ndim() + 1),
        Op::GetRows,
        vec![a.clone(), b.clone()],
    )
}

/// Writes rows of `b` (f32) into `a` at the row indices `c` (i32 or i64), converting to `a`'s
/// dtype; the result is a view of `a`.
pub fn set_rows(ctx: &Context, a: &Tensor, b: &Tensor, c: &Tensor) -> Result<Tensor> {
    require_dtype("SET_ROWS source", b, &[DType::F32])?;
    require_dtype("SET_ROWS indices", c, &[DType::I32, DType::I64])?;
    let (na, nb, nc) = (a.ne(), b.ne(), c.ne());
    let ok = na[0] == nb[0]
        && na[2] == nb[2]
        && na[3] == nb[3]
        && nb[1] == nc[0]
        && nc[1] != 0
        && nc[2] != 0
        && nb[2] % nc[1] == 0
        && nb[3] % nc[2] == 0
        && nc[3] == 1;
    if !ok {
        return Err(Error::shape(format!(
            "SET_ROWS: destination {}, rows {} and indices {} do not fit together",
            describe(a),
            describe(b),
            describe(c)
        )));
    }
    new_view(
        ctx,
        a,
        a.ne(),
        a.nb(),
        a.ndim(),
        0,
        Op::SetRows,
        vec![a.clone(), b.clone(), c.clone()],
    )
}

// ----- arithmetic -----

/// `a + b`, `b` broadcast by repetition.
pub fn add(ctx: &Context, a: &Tensor, b: &Tensor) -> Result<Tensor> {
    binary(ctx, a, b, Op::Add)
}

/// `a − b`, `b` broadcast by repetition.
pub fn sub(ctx: &Context, a: &Tensor, b: &Tensor) -> Result<Tensor> {
    binary(ctx, a, b, Op::Sub)
}

/// `a · b` element-wise, `b` broadcast by repetition.
pub fn mul(ctx: &Context, a: &Tensor, b: &Tensor) -> Result<Tensor> {
    binary(ctx, a, b, Op::Mul)
}

/// `a / b` element-wise, `b` broadcast by repetition.
pub fn div(ctx: &Context, a: &Tensor, b: &Tensor) -> Result<Tensor> {
    binary(ctx, a, b, Op::Div)
}

/// `a + b` where `b` has one element.
pub fn add1(ctx: &Context, a: &Tensor, b: &Tensor) -> Result<Tensor> {
    require_float("ADD1", a)?;
    if b.nelements() != 1 {
        return Err(Error::shape(format!(
            "ADD1: {} must have exactly one element",
            describe(b)
        )));
    }
    require_float("ADD1", b)?;
    new_result(
        ctx,
        a.dtype(),
        a.ne(),
        a.ndim(),
        Op::Add1,
        vec![a.clone(), b.clone()],
    )
}

/// Adds `b` into the region of (a copy of) `a` given by byte strides and offset.
pub fn acc(
    ctx: &Context,
    a: &Tensor,
    b: &Tensor,
    nb1: usize,
    nb2: usize,
    nb3: usize,
    offset: usize,
) -> Result<Tensor> {
    require_dtype("ACC", a, &[DType::F32])?;
    require_dtype("ACC", b, &[DType::F32])?;
    if b.nelements() > a.nelements() {
        return Err(Error::shape(format!(
            "ACC: {} is larger than {}",
            describe(b),
            describe(a)
        )));
    }
    // Strides and offset in whole f32 elements (as a view requires): a cut element would be
    // written as garbage.
    let element = DType::F32.type_size();
    if [nb1, nb2, nb3, offset].iter().any(|v| v % element != 0) {
        return Err(Error::shape(format!(
            "ACC: strides {nb1}, {nb2}, {nb3} and offset {offset} must be multiples of the \
             {element}-byte f32 element"
        )));
    }
    // The kernel adds into the region from several threads: it must not overflow or overlap.
    let region_nb = [element, nb1, nb2, nb3];
    check_strides(DType::F32, &b.ne(), &region_nb, "ACC region")?;
    let region = check_span(DType::F32, &b.ne(), &region_nb, "ACC region")?;
    if offset
        .checked_add(region)
        .is_none_or(|end| end > a.nbytes())
    {
        return Err(Error::shape(format!(
            "ACC: the region of {} at offset {offset} falls outside {}",
            describe(b),
            describe(a)
        )));
    }
    new_result(
        ctx,
        a.dtype(),
        a.ne(),
        a.ndim(),
        Op::Acc {
            nb1,
            nb2,
            nb3,
            offset,
        },
        vec![a.clone(), b.clone()],
    )
}

/// `a·s + b` (ggml's scale with bias).
pub fn scale(ctx: &Context, a: &Tensor, s: f32, b: f32) -> Result<Tensor> {
    elementwise(ctx, a, Op::Scale { s, b })
}

/// x².
pub fn sqr(ctx: &Context, a: &Tensor) -> Result<Tensor> {
    elementwise(ctx, a, Op::Sqr)
}

/// √x.
pub fn sqrt(ctx: &Context, a: &Tensor) -> Result<Tensor> {
    elementwise(ctx, a, Op::Sqrt)
}

/// ln x.
pub fn log(ctx: &Context, a: &Tensor) -> Result<Tensor> {
    elementwise(ctx, a, Op::Log)
}

/// sin x.
pub fn sin(ctx: &Context, a: &Tensor) -> Result<Tensor> {
    elementwise(ctx, a, Op::Sin)
}

/// cos x.
pub fn cos(ctx: &Context, a: &Tensor) -> Result<Tensor> {
    elementwise(ctx, a, Op::Cos)
}

/// Clamps to `[min, max]`.
pub fn clamp(ctx: &Context, a: &Tensor, min: f32, max: f32) -> Result<Tensor> {
    if min > max || min.is_nan() || max.is_nan() {
        return Err(Error::InvalidArgument(format!(
            "CLAMP: min {min} must not exceed max {max}"
        )));
    }
    elementwise(ctx, a, Op::Clamp { min, max })
}

/// The sum of all elements, as a one-element f32 tensor.
pub fn sum(ctx: &Context, a: &Tensor) -> Result<Tensor> {
    require_float("SUM", a)?;
    new_result(ctx, DType::F32, [1, 1, 1, 1], 1, Op::Sum, vec![a.clone()])
}

/// The sum of each row: shape `[1, ne1, ne2, ne3]`.
pub fn sum_rows(ctx: &Context, a: &Tensor) -> Result<Tensor> {
    require_float("SUM_ROWS", a)?;
    let ne = a.ne();
    new_result(
        ctx,
        DType::F32,
        [1, ne[1], ne[2], ne[3]],
        a.ndim(),
        Op::SumRows,
        vec![a.clone()],
    )
}

/// The mean of each row: shape `[1, ne1, ne2, ne3]`.
pub fn mean(ctx: &Context, a: &Tensor) -> Result<Tensor> {
    require_float("MEAN", a)?;
    let ne = a.ne();
    new_result(
        ctx,
        DType::F32,
        [1, ne[1], ne[2], ne[3]],
        a.ndim(),
        Op::Mean,
        vec![a.clone()],
    )
}

/// The index of each row's maximum of a matrix: i32 of shape `[ne1]`.
pub fn argmax(ctx: &Context, a: &Tensor) -> Result<Tensor> {
    require_dtype("ARGMAX", a, &[DType::F32])?;
    let ne = a.ne();
    if ne[0] == 0 && ne[1] > 0 {
        return Err(Error::shape(format!(
            "ARGMAX: the rows of {} are empty; an empty row has no maximum",
            describe(a)
        )));
    }
    if ne[2] != 1 || ne[3] != 1 {
        return Err(Error::shape(format!(
            "ARGMAX needs a matrix, got {}",
            describe(a)
        )));
    }
    if ne[1] > i32::MAX as usize || ne[0] > i32::MAX as usize {
        return Err(Error::shape(format!(
            "ARGMAX: {} is too large for i32 indices",
            describe(a)
        )));
    }
    new_result(
        ctx,
        DType::I32,
        [ne[1], 1, 1, 1],
        1,
        Op::Argmax,
        vec![a.clone()],
    )
}

/// Tiles `a` to the shape of `b`.
pub fn repeat(ctx: &Context, a: &Tensor, b: &Tensor) -> Result<Tensor> {
    require_float("REPEAT", a)?;
    if !can_repeat(a, b) {
        return Err(Error::shape(format!(
            "REPEAT: {} does not tile {}",
            describe(a),
            describe(b)
        )));
    }
    new_result(
        ctx,
        a.dtype(),
        b.ne(),
        b.ndim(),
        Op::Repeat,
        vec![a.clone(), b.clone()],
    )
}

/// Joins `a` and `b` along ggml-order dimension `dim`.
pub fn concat(ctx: &Context, a: &Tensor, b: &Tensor, dim: usize) -> Result<Tensor> {
    if dim >= MAX_DIMS {
        return Err(Error::shape(format!(
            "CONCAT: dimension {dim} is out of range"
        )));
    }
    if a.dtype() != b.dtype() {
        return Err(Error::DType(format!(
            "CONCAT: {} and {} differ in dtype",
            describe(a),
            describe(b)
        )));
    }
    require_dtype(
        "CONCAT",
        a,
        &[DType::F32, DType::F16, DType::BF16, DType::I32],
    )?;
    let (na, nb) = (a.ne(), b.ne());
    if (0..MAX_DIMS).any(|i| i != dim && na[i] != nb[i]) {
        return Err(Error::shape(format!(
            "CONCAT along {dim}: {} and {} differ in another dimension",
            describe(a),
            describe(b)
        )));
    }
    let mut ne = na;
    ne[dim] += nb[dim];
    new_result(
        ctx,
        a.dtype(),
        ne,
        a.ndim().max(b.ndim()).max(dim + 1),
        Op::Concat { dim },
        vec![a.clone(), b.clone()],
    )
}

// ----- activations -----

/// An element-wise activation.
pub fn unary(ctx: &Context, a: &Tensor, op: UnaryOp) -> Result<Tensor> {
    elementwise(ctx, a, Op::Unary(op))
}

/// x if x > 0 else `negative_slope`·x.
pub fn leaky_relu(ctx: &Context, a: &Tensor, negative_slope: f32) -> Result<Tensor> {
    elementwise(ctx, a, Op::LeakyRelu { negative_slope })
}

/// Fused gated unit: each row is split in halves `[x, g]`; the result is `act(x)·g` (or
/// `act(g)·x` when `swapped`), half as wide.
pub fn glu(ctx: &Context, a: &Tensor, op: GluOp, swapped: bool) -> Result<Tensor> {
    require_float(op.name(), a)?;
    let mut ne = a.ne();
    if !ne[0].is_multiple_of(2) {
        return Err(Error::shape(format!(
            "{}: the row length of {} must be even",
            op.name(),
            describe(a)
        )));
    }
    ne[0] /= 2;
    new_result(
        ctx,
        a.dtype(),
        ne,
        a.ndim(),
        Op::Glu { op, swapped },
        vec![a.clone()],
    )
}

/// Split gated unit: `act(a)·b` for tensors of equal shape.
pub fn glu_split(ctx: &Context, a: &Tensor, b: &Tensor, op: GluOp) -> Result<Tensor> {
    require_float(op.name(), a)?;
    if !a.same_shape(b) || a.dtype() != b.dtype() {
        return Err(Error::shape(format!(
            "{}: {} and {} must have the same shape and dtype",
            op.name(),
            describe(a),
            describe(b)
        )));
    }
    new_result(
        ctx,
        a.dtype(),
        a.ne(),
        a.ndim(),
        Op::Glu { op, swapped: false },
        vec![a.clone(), b.clone()],
    )
}

// ----- normalisation -----

fn check_eps(op: &str, eps: f32) -> Result<()> {
    if eps.is_finite() && eps >= 0.0 {
        Ok(())
    } else {
        Err(Error::InvalidArgument(format!(
            "{op}: eps must be finite and non-negative, got {eps}"
        )))
    }
}

/// Layer normalisation of each row (no affine part).
pub fn norm(ctx: &Context, a: &Tensor, eps: f32) -> Result<Tensor> {
    check_eps("NORM", eps)?;
    require_dtype("NORM", a, &[DType::F32])?;
    elementwise(ctx, a, Op::Norm { eps })
}

/// RMS normalisation of each row.
pub fn rms_norm(ctx: &Context, a: &Tensor, eps: f32) -> Result<Tensor> {
    check_eps("RMS_NORM", eps)?;
    require_dtype("RMS_NORM", a, &[DType::F32])?;
    elementwise(ctx, a, Op::RmsNorm { eps })
}

/// Group normalisation over `n_groups` groups of dimension 2.
pub fn group_norm(ctx: &Context, a: &Tensor, n_groups: usize, eps: f32) -> Result<Tensor> {
    check_eps("GROUP_NORM", eps)?;
    require_dtype("GROUP_NORM", a, &[DType::F32])?;
    // The kernel's work grows with the number of groups: bounded by the channels (axis 2), so
    // no group is empty and a small tensor cannot ask for unbounded work.
    let channels = a.ne()[2].max(1);
    if n_groups == 0 || n_groups > channels {
        return Err(Error::InvalidArgument(format!(
            "GROUP_NORM: n_groups must be between 1 and the {channels} channels of {}, not {n_groups}",
            describe(a)
        )));
    }
    elementwise(ctx, a, Op::GroupNorm { n_groups, eps })
}

/// L2 normalisation of each row.
pub fn l2_norm(ctx: &Context, a: &Tensor, eps: f32) -> Result<Tensor> {
    check_eps("L2_NORM", eps)?;
    require_dtype("L2_NORM", a, &[DType::F32])?;
    elementwise(ctx, a, Op::L2Norm { eps })
}

// ----- matrix products -----

/// Matrix product with ggml's meaning: `a` is `[K, M, ..]`, `b` is `[K, N, ..]`, the f32 result
/// is `[M, N, ..]`, i.e. `b · aᵀ` in numpy terms. `a`'s batch dimensions broadcast over `b`'s.
pub fn mul_mat(ctx: &Context, a: &Tensor, b: &Tensor) -> Result<Tensor> {
    require_weights("MUL_MAT weights", a)?;
    require_dtype("MUL_MAT activations", b, &[DType::F32])?;
    let (na, nb) = (a.ne(), b.ne());
    if na[0] != nb[0] || na[2] == 0 || na[3] == 0 || nb[2] % na[2] != 0 || nb[3] % na[3] != 0 {
        return Err(operands_mismatch(
            format!(
                "MUL_MAT: {} and {} do not fit (inner sizes must match, and the second's batch \
                 dimensions must be multiples of the first's)",
                describe(a),
                describe(b)
            ),
            &[a, b],
        ));
    }
    if na[0] == 0 {
        return Err(Error::shape(format!(
            "MUL_MAT: {} and {} have an inner dimension of 0 (no columns to multiply)",
            describe(a),
            describe(b)
        )));
    }
    if na[0] > 1 && a.nb()[0] != a.dtype().type_size() {
        return Err(Error::shape(format!(
            "MUL_MAT: the rows of the first operand {} are not contiguous (is it transposed?); \
             use cont first",
            describe(a)
        )));
    }
    let ne = [na[1], nb[1], nb[2], nb[3]];
    new_result(
        ctx,
        DType::F32,
        ne,
        a.ndim().max(b.ndim()),
        Op::MulMat,
        vec![a.clone(), b.clone()],
    )
}

/// Outer products of the columns of `a` and `b`, summed: result `[a.ne0, b.ne0, b.ne2, b.ne3]`.
pub fn out_prod(ctx: &Context, a: &Tensor, b: &Tensor) -> Result<Tensor> {
    require_weights("OUT_PROD", a)?;
    require_dtype("OUT_PROD", b, &[DType::F32])?;
    let (na, nb) = (a.ne(), b.ne());
    if na[1] != nb[1] || na[2] == 0 || na[3] == 0 || nb[2] % na[2] != 0 || nb[3] % na[3] != 0 {
        return Err(Error::shape(format!(
            "OUT_PROD: {} and {} do not fit",
            describe(a),
            describe(b)
        )));
    }
    let ne = [na[0], nb[0], nb[2], nb[3]];
    new_result(
        ctx,
        DType::F32,
        ne,
        a.ndim().max(b.ndim()),
        Op::OutProd,
        vec![a.clone(), b.clone()],
    )
}

/// Mixture-of-experts product: `experts` `[K, M, n_expert]`, `b` `[K, n_b, n_tokens]`, `ids`
/// i32 `[n_used, n_tokens]`; result `[M, n_used, n_tokens]`.
pub fn mul_mat_id(ctx: &Context, experts: &Tensor, b: &Tensor, ids: &Tensor) -> Result<Tensor> {
    require_weights("MUL_MAT_ID weights", experts)?;
    require_dtype("MUL_MAT_ID activations", b, &[DType::F32])?;
    require_dtype("MUL_MAT_ID ids", ids, &[DType::I32])?;
    let (ne, nb, ni) = (experts.ne(), b.ne(), ids.ne());
    let ok = ne[3] == 1
        && nb[3] == 1
        && ni[2] == 1
        && ni[3] == 1
        && ni[1] == nb[2]
        && ne[0] == nb[0]
        && nb[1] != 0
        && ni[0] % nb[1] == 0;
    if !ok {
        return Err(Error::shape(format!(
            "MUL_MAT_ID: experts {}, activations {} and ids {} do not fit",
            describe(experts),
            describe(b),
            describe(ids)
        )));
    }
    let out = [ne[1], ni[0], nb[2], 1];
    new_result(
        ctx,
        DType::F32,
        out,
        3,
        Op::MulMatId,
        vec![experts.clone(), b.clone(), ids.clone()],
    )
}

// ----- attention -----

/// Sets elements with column > row + `n_past` to −∞ (per matrix).
pub fn diag_mask_inf(ctx: &Context, a: &Tensor, n_past: usize) -> Result<Tensor> {
    require_dtype("DIAG_MASK_INF", a, &[DType::F32])?;
    // The kernel adds row numbers to n_past: bounded so that the sum cannot overflow.
    if n_past > isize::MAX as usize {
        return Err(Error::InvalidArgument(format!(
            "DIAG_MASK_INF: n_past {n_past} is larger than any tensor"
        )));
    }
    elementwise(ctx, a, Op::DiagMaskInf { n_past })
}

/// The shape an attention mask must fit: `cols` wide (the keys), at least `rows` rows (the
/// queries; extra rows are padding), dividing `n2` and `n3` so it broadcasts over them.
struct MaskFit {
    cols: usize,
    rows: usize,
    n2: usize,
    n3: usize,
    /// Whether the kernel reads mask rows as dense runs.
    contiguous_rows: bool,
}

/// The mask check shared by SOFT_MAX and FLASH_ATTN_EXT: an f16 or f32 mask that fits (the
/// shape error names `operands()`), and no ALiBi (`max_bias > 0`) without a mask.
fn check_attention_mask(
    op: &str,
    mask: Option<&Tensor>,
    max_bias: f32,
    fit: MaskFit,
    operands: impl FnOnce() -> String,
) -> Result<()> {
    let Some(mask) = mask else {
        if max_bias > 0.0 {
            return Err(Error::InvalidArgument(format!(
                "{op}: ALiBi (max_bias > 0) needs a mask"
            )));
        }
        return Ok(());
    };
    require_dtype(&format!("{op} mask"), mask, &[DType::F32, DType::F16])?;
    let nm = mask.ne();
    if (fit.contiguous_rows && !mask.is_contiguous_rows())
        || nm[0] != fit.cols
        || nm[1] < fit.rows
        || nm[2] == 0
        || nm[3] == 0
        || !fit.n2.is_multiple_of(nm[2])
        || !fit.n3.is_multiple_of(nm[3])
    {
        return Err(Error::shape(format!(
            "{op}: mask {} does not fit {}",
            describe(mask),
            operands()
        )));
    }
    Ok(())
}

/// Row softmax of `a·scale + mask` with optional ALiBi slopes (`max_bias > 0` needs a mask).
/// The mask (f16 or f32) is `[ne0, ≥ne1, ..]` and broadcasts over dimensions 2 and 3.
pub fn soft_max(
    ctx: &Context,
    a: &Tensor,
    mask: Option<&Tensor>,
    scale: f32,
    max_bias: f32,
) -> Result<Tensor> {
    require_dtype("SOFT_MAX", a, &[DType::F32])?;
    let mut srcs = vec![a.clone()];
    let na = a.ne();
    check_attention_mask(
        "SOFT_MAX",
        mask,
        max_bias,
        MaskFit {
            cols: na[0],
            rows: na[1],
            n2: na[2],
            n3: na[3],
            contiguous_rows: true,
        },
        || describe(a),
    )?;
    srcs.extend(mask.cloned());
    if !scale.is_finite() || !max_bias.is_finite() || max_bias < 0.0 {
        return Err(Error::InvalidArgument(format!(
            "SOFT_MAX: scale {scale} and max_bias {max_bias} must be finite (max_bias ≥ 0)"
        )));
    }
    new_result(
        ctx,
        DType::F32,
        a.ne(),
        a.ndim(),
        Op::SoftMax { scale, max_bias },
        srcs,
    )
}

/// Rotary position embedding of `a` `[head_dim, n_head, n_tokens, ..]` at positions `pos`
/// (i32, one per token), optionally with per-dimension frequency factors (f32, ≥ n_dims/2).
pub fn rope(
    ctx: &Context,
    a: &Tensor,
    pos: &Tensor,
    freq_factors: Option<&Tensor>,
    params: RopeParams,
) -> Result<Tensor> {
    require_dtype("ROPE", a, &[DType::F32, DType::F16])?;
    require_dtype("ROPE positions", pos, &[DType::I32])?;
    let ne = a.ne();
    if pos.ndim() != 1 || pos.ne()[0] != ne[2] {
        return Err(Error::shape(format!(
            "ROPE: positions {} must be a vector of {} entries (dimension 2 of {})",
            describe(pos),
            ne[2],
            describe(a)
        )));
    }
    if params.n_dims == 0 || !params.n_dims.is_multiple_of(2) || params.n_dims > ne[0] {
        return Err(Error::InvalidArgument(format!(
            "ROPE: n_dims {} must be even, positive and at most {}",
            params.n_dims, ne[0]
        )));
    }
    let mut srcs = vec![a.clone(), pos.clone()];
    if let Some(ff) = freq_factors {
        require_dtype("ROPE freq_factors", ff, &[DType::F32])?;
        if ff.ne()[0] < params.n_dims / 2 {
            return Err(Error::shape(format!(
                "ROPE: freq_factors {} needs at least {} entries",
                describe(ff),
                params.n_dims / 2
            )));
        }
        srcs.push(ff.clone());
    }
    new_result(ctx, a.dtype(), ne, a.ndim(), Op::Rope(params), srcs)
}

/// Whether FLASH_ATTN_EXT reads keys and values of `dtype`: the float types and ggml's
/// 32-value block types (quantized KV caches, dequantized a row at a time).
pub fn is_attention_kv_type(dtype: DType) -> bool {
    matches!(dtype, DType::F32 | DType::F16 | DType::BF16)
        || (dtype.is_quantized() && dtype.block_size() == 32 && dtype != DType::Q8_1)
}

/// Fused attention. `q` `[D, n_q, n_head, n_seq]` (f32); `k` `[D, n_kv, n_head_kv, n_seq]`,
/// `v` `[Dv, n_kv, n_head_kv, n_seq]` (f32 or f16); optional mask `[n_kv, ≥n_q, ..]`
/// (f16/f32). The result is f32 `[Dv, n_head, n_q, n_seq]` (heads and queries swapped, as ggml).
#[allow(clippy::too_many_arguments)]
pub fn flash_attn_ext(
    ctx: &Context,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: Option<&Tensor>,
    scale: f32,
    max_bias: f32,
    logit_softcap: f32,
) -> Result<Tensor> {
    require_dtype("FLASH_ATTN_EXT q", q, &[DType::F32])?;
    for (what, t) in [("FLASH_ATTN_EXT k", k), ("FLASH_ATTN_EXT v", v)] {
        if !is_attention_kv_type(t.dtype()) {
            return Err(Error::DType(format!(
                "{what}: {} is {}; keys and values are f32, f16, bf16 or a block type of 32 \
                 (a quantized KV cache)",
                describe(t),
                t.dtype().name()
            )));
        }
    }
    let (nq, nk, nv) = (q.ne(), k.ne(), v.ne());
    let ok = nq[0] == nk[0]
        && nk[1] == nv[1]
        && nk[2] == nv[2]
        && nk[2] != 0
        && nq[2] % nk[2] == 0
        && nk[3] == nv[3]
        && nk[3] != 0
        && nq[3] % nk[3] == 0;
    if !ok {
        return Err(Error::shape(format!(
            "FLASH_ATTN_EXT: q {}, k {} and v {} do not fit",
            describe(q),
            describe(k),
            describe(v)
        )));
    }
    let mut srcs = vec![q.clone(), k.clone(), v.clone()];
    check_attention_mask(
        "FLASH_ATTN_EXT",
        mask,
        max_bias,
        MaskFit {
            cols: nk[1],
            rows: nq[1],
            n2: nq[2],
            n3: nq[3],
            contiguous_rows: false,
        },
        || format!("q {} and k {}", describe(q), describe(k)),
    )?;
    srcs.extend(mask.cloned());
    let ne = [nv[0], nq[2], nq[1], nq[3]];
    new_result(
        ctx,
        DType::F32,
        ne,
        4,
        Op::FlashAttnExt {
            scale,
            max_bias,
            logit_softcap,
        },
        srcs,
    )
}

// ----- custom -----

/// A user-defined op over `srcs` producing a new tensor of `dtype` and ggml-order shape `ne`.
pub fn custom(
    ctx: &Context,
    op: Arc<dyn CustomOp>,
    srcs: &[Tensor],
    dtype: DType,
    ne: &[usize],
) -> Result<Tensor> {
    let full = full_ne(ne, "CUSTOM")?;
    new_result(
        ctx,
        dtype,
        full,
        ne.len(),
        Op::Custom(CustomOpRef(op)),
        srcs.to_vec(),
    )
}

// ----- rebuilding -----

/// What a rebuilt tensor is asked to look like. Most ops decide their result from their
/// operands; the ones that take it from the caller read it here: a leaf ([`Op::None`]: dtype
/// and shape), [`Op::Cont`] and [`Op::Reshape`] (shape), [`Op::View`] (shape, strides and
/// offset) and [`Op::Custom`] (dtype and shape). The others ignore it; a caller that must
/// trust the result compares it with the layout afterwards.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Layout {
    /// Element type.
    pub dtype: DType,
    /// Elements per dimension, ggml order (dimensions from `ndim` on are 1).
    pub ne: [usize; MAX_DIMS],
    /// Byte strides, ggml order.
    pub nb: [usize; MAX_DIMS],
    /// Dimensions the user sees (1 to 4).
    pub ndim: usize,
    /// For a view, its byte offset from the start of the tensor whose memory it shares (the
    /// root of a chain of views, as [`Tensor::view_offset`] reports it).
    pub view_offset: usize,
}

impl Layout {
    /// The layout of an existing tensor.
    pub fn of(t: &Tensor) -> Layout {
        Layout {
            dtype: t.dtype(),
            ne: t.ne(),
            nb: t.nb(),
            ndim: t.ndim(),
            view_offset: t.view_offset(),
        }
    }
}

/// `srcs` when the op takes one of the `allowed` operand counts, else an error.
fn operands<'a>(op: &Op, srcs: &'a [Tensor], allowed: &[usize]) -> Result<&'a [Tensor]> {
    if allowed.contains(&srcs.len()) {
        Ok(srcs)
    } else {
        Err(Error::InvalidArgument(format!(
            "{} takes {} operands, got {}",
            op.name(),
            allowed
                .iter()
                .map(|n| n.to_string())
                .collect::<Vec<_>>()
                .join(" or "),
            srcs.len()
        )))
    }
}

/// Makes the tensor `op` computes from `srcs` by calling its builder, so everything a builder
/// checks (operand counts, dtypes, shapes, parameters) is checked again. `layout` supplies what
/// the op takes from its caller rather than its operands (see [`Layout`]). The one place that
/// maps an [`Op`] value to builder calls: a new op does not compile until it is handled here.
pub fn rebuild(ctx: &Context, op: &Op, srcs: &[Tensor], layout: &Layout) -> Result<Tensor> {
    let ndim = layout.ndim;
    if !(1..=MAX_DIMS).contains(&ndim) {
        return Err(Error::shape(format!(
            "{}: ndim {ndim} is outside 1..={MAX_DIMS}",
            op.name()
        )));
    }
    let shape = &layout.ne[..ndim];
    let one = |srcs: &[Tensor]| operands(op, srcs, &[1]).map(|s| s[0].clone());
    let two = |srcs: &[Tensor]| operands(op, srcs, &[2]).map(|s| (s[0].clone(), s[1].clone()));
    match *op {
        Op::None => {
            operands(op, srcs, &[0])?;
            ctx.new_tensor(layout.dtype, shape)
        }
        Op::Dup => dup(ctx, &one(srcs)?),
        Op::Add => two(srcs).and_then(|(a, b)| add(ctx, &a, &b)),
        Op::Sub => two(srcs).and_then(|(a, b)| sub(ctx, &a, &b)),
        Op::Mul => two(srcs).and_then(|(a, b)| mul(ctx, &a, &b)),
        Op::Div => two(srcs).and_then(|(a, b)| div(ctx, &a, &b)),
        Op::Add1 => two(srcs).and_then(|(a, b)| add1(ctx, &a, &b)),
        Op::Acc {
            nb1,
            nb2,
            nb3,
            offset,
        } => two(srcs).and_then(|(a, b)| acc(ctx, &a, &b, nb1, nb2, nb3, offset)),
        Op::Sqr => sqr(ctx, &one(srcs)?),
        Op::Sqrt => sqrt(ctx, &one(srcs)?),
        Op::Log => log(ctx, &one(srcs)?),
        Op::Sin => sin(ctx, &one(srcs)?),
        Op::Cos => cos(ctx, &one(srcs)?),
        Op::Sum => sum(ctx, &one(srcs)?),
        Op::SumRows => sum_rows(ctx, &one(srcs)?),
        Op::Mean => mean(ctx, &one(srcs)?),
        Op::Argmax => argmax(ctx, &one(srcs)?),
        Op::Repeat => two(srcs).and_then(|(a, b)| repeat(ctx, &a, &b)),
        Op::Concat { dim } => two(srcs).and_then(|(a, b)| concat(ctx, &a, &b, dim)),
        Op::Unary(u) => unary(ctx, &one(srcs)?, u),
        Op::LeakyRelu { negative_slope } => leaky_relu(ctx, &one(srcs)?, negative_slope),
        Op::Glu {
            op: glu_op,
            swapped,
        } => match operands(op, srcs, &[1, 2])? {
            [a] => glu(ctx, a, glu_op, swapped),
            [a, b] if !swapped => glu_split(ctx, a, b, glu_op),
            _ => Err(Error::InvalidArgument(format!(
                "{}: a split gated unit cannot be swapped",
                glu_op.name()
            ))),
        },
        Op::Norm { eps } => norm(ctx, &one(srcs)?, eps),
        Op::RmsNorm { eps } => rms_norm(ctx, &one(srcs)?, eps),
        Op::GroupNorm { n_groups, eps } => group_norm(ctx, &one(srcs)?, n_groups, eps),
        Op::L2Norm { eps } => l2_norm(ctx, &one(srcs)?, eps),
        Op::MulMat => two(srcs).and_then(|(a, b)| mul_mat(ctx, &a, &b)),
        Op::MulMatId => {
            let s = operands(op, srcs, &[3])?;
            mul_mat_id(ctx, &s[0], &s[1], &s[2])
        }
        Op::OutProd => two(srcs).and_then(|(a, b)| out_prod(ctx, &a, &b)),
        Op::Scale { s, b } => scale(ctx, &one(srcs)?, s, b),
        Op::Cpy => two(srcs).and_then(|(a, b)| cpy(ctx, &a, &b)),
        Op::Cont => cont_shape(ctx, &one(srcs)?, shape),
        Op::Reshape => reshape(ctx, &one(srcs)?, shape),
        Op::View => {
            let a = one(srcs)?;
            // The layout's offset is from the root; the builder takes it from its operand.
            let offset = layout
                .view_offset
                .checked_sub(a.view_offset())
                .ok_or_else(|| {
                    Error::shape(format!(
                        "VIEW: offset {} lies before its operand's own offset {}",
                        layout.view_offset,
                        a.view_offset()
                    ))
                })?;
            view(ctx, &a, shape, &layout.nb[1..ndim], offset)
        }
        Op::Permute { axes } => permute(ctx, &one(srcs)?, axes),
        Op::Transpose => transpose(ctx, &one(srcs)?),
        Op::GetRows => two(srcs).and_then(|(a, b)| get_rows(ctx, &a, &b)),
        Op::SetRows => {
            let s = operands(op, srcs, &[3])?;
            set_rows(ctx, &s[0], &s[1], &s[2])
        }
        Op::DiagMaskInf { n_past } => diag_mask_inf(ctx, &one(srcs)?, n_past),
        Op::SoftMax { scale, max_bias } => {
            let s = operands(op, srcs, &[1, 2])?;
            soft_max(ctx, &s[0], s.get(1), scale, max_bias)
        }
        Op::Rope(params) => {
            let s = operands(op, srcs, &[2, 3])?;
            rope(ctx, &s[0], &s[1], s.get(2), params)
        }
        Op::Clamp { min, max } => clamp(ctx, &one(srcs)?, min, max),
        Op::FlashAttnExt {
            scale,
            max_bias,
            logit_softcap,
        } => {
            let s = operands(op, srcs, &[3, 4])?;
            flash_attn_ext(
                ctx,
                &s[0],
                &s[1],
                &s[2],
                s.get(3),
                scale,
                max_bias,
                logit_softcap,
            )
        }
        Op::Custom(ref c) => custom(ctx, c.0.clone(), srcs, layout.dtype, shape),
    }
}

/// One tensor of each op, for tests that walk the whole op set (the local [`rebuild`], the
/// remote wire's round trip). Built with the tests, or with the feature `samples` (which the
/// crates above turn on for their own tests).
#[cfg(any(test, feature = "samples"))]
pub mod samples {
    use super::*;

    /// The number of `Op` variants: [`variant`]'s arms.
    pub const N_VARIANTS: usize = 44;

    /// A number per `Op` variant. No wildcard: a new op does not compile until it is numbered
    /// here (and [`one_of_each`] then fails until it builds one).
    pub fn variant(op: &Op) -> usize {
        match op {
            Op::None => 0,
            Op::Dup => 1,
            Op::Add => 2,
            Op::Sub => 3,
            Op::Mul => 4,
            Op::Div => 5,
            Op::Add1 => 6,
            Op::Acc { .. } => 7,
            Op::Sqr => 8,
            Op::Sqrt => 9,
            Op::Log => 10,
            Op::Sin => 11,
            Op::Cos => 12,
            Op::Sum => 13,
            Op::SumRows => 14,
            Op::Mean => 15,
            Op::Argmax => 16,
            Op::Repeat => 17,
            Op::Concat { .. } => 18,
            Op::Unary(_) => 19,
            Op::LeakyRelu { .. } => 20,
            Op::Glu { .. } => 21,
            Op::Norm { .. } => 22,
            Op::RmsNorm { .. } => 23,
            Op::GroupNorm { .. } => 24,
            Op::L2Norm { .. } => 25,
            Op::MulMat => 26,
            Op::MulMatId => 27,
            Op::OutProd => 28,
            Op::Scale { .. } => 29,
            Op::Cpy => 30,
            Op::Cont => 31,
            Op::Reshape => 32,
            Op::View => 33,
            Op::Permute { .. } => 34,
            Op::Transpose => 35,
            Op::GetRows => 36,
            Op::SetRows => 37,
            Op::DiagMaskInf { .. } => 38,
            Op::SoftMax { .. } => 39,
            Op::Rope(_) => 40,
            Op::Clamp { .. } => 41,
            Op::FlashAttnExt { .. } => 42,
            Op::Custom(_) => 43,
        }
    }

    struct Negate;

    impl CustomOp for Negate {
        fn name(&self) -> &str {
            "negate"
        }

        fn compute(&self, _dst: &Tensor, _srcs: &[Tensor]) -> Result<()> {
            Ok(())
        }
    }

    /// Small tensors built by every builder (some ops more than once, with and without their
    /// optional operands), in dependency order; the last one is a custom op.
    pub fn one_of_each(c: &Context) -> Vec<Tensor> {
        let t = |dtype: DType, ne: &[usize]| c.new_tensor(dtype, ne).unwrap();
        let f = t(DType::F32, &[8, 4, 2]);
        let m = t(DType::F32, &[8, 4]);
        let row = t(DType::F32, &[8]);
        let one = t(DType::F32, &[1]);
        let small = t(DType::F32, &[2, 2]);
        let w = t(DType::F16, &[8, 3]);
        let experts = t(DType::Q8_0, &[32, 3, 2]);
        let acts = t(DType::F32, &[32, 1, 4]);
        let ids = t(DType::I32, &[2, 4]);
        let cols = t(DType::F32, &[5, 4]);
        let f16 = t(DType::F16, &[8, 4, 2]);
        let idx = t(DType::I32, &[3]);
        let idx64 = t(DType::I64, &[3]);
        let table = t(DType::F16, &[8, 10]);
        let rows = t(DType::F32, &[8, 3]);
        let mask = t(DType::F16, &[8, 4]);
        let x = t(DType::F32, &[8, 2, 3]);
        let freqs = t(DType::F32, &[4]);
        let q = t(DType::F32, &[8, 3, 2, 1]);
        let k = t(DType::F16, &[8, 5, 2, 1]);
        let v = t(DType::F16, &[8, 5, 2, 1]);
        let kv_mask = t(DType::F16, &[5, 3]);
        let mut out = vec![f.clone()];
        let mut push = |r: Result<Tensor>| out.push(r.unwrap());
        push(dup(c, &f));
        push(add(c, &f, &row));
        push(sub(c, &f, &row));
        push(mul(c, &f, &row));
        push(div(c, &f, &row));
        push(add1(c, &f, &one));
        push(acc(c, &f, &small, 32, 128, 128, 4));
        push(sqr(c, &f));
        push(sqrt(c, &f));
        push(log(c, &f));
        push(sin(c, &f));
        push(cos(c, &f));
        push(sum(c, &f));
        push(sum_rows(c, &f));
        push(mean(c, &f));
        push(argmax(c, &m));
        push(repeat(c, &row, &f));
        push(concat(c, &f, &f, 2));
        push(unary(c, &f, UnaryOp::GeluErf));
        push(leaky_relu(c, &f, 0.1));
        push(glu(c, &f, GluOp::Swiglu, true));
        push(glu_split(c, &f, &f, GluOp::Geglu));
        push(norm(c, &f, 1e-5));
        push(rms_norm(c, &f, 1e-6));
        push(group_norm(c, &f, 2, 1e-5));
        push(l2_norm(c, &f, 1e-12));
        push(mul_mat(c, &w, &f));
        push(mul_mat_id(c, &experts, &acts, &ids));
        push(out_prod(c, &m, &cols));
        push(scale(c, &f, 2.0, 0.5));
        push(cpy(c, &f, &f16));
        let mt = transpose(c, &m).unwrap();
        push(Ok(mt.clone()));
        push(cont(c, &mt));
        push(cont_shape(c, &mt, &[16, 2]));
        push(reshape(c, &f, &[32, 2]));
        let half = view(c, &f, &[8, 2], &[32], 32).unwrap();
        push(Ok(half.clone()));
        push(view(c, &half, &[4], &[], 48));
        push(permute(c, &f, [2, 0, 1, 3]));
        push(get_rows(c, &m, &idx));
        push(set_rows(c, &table, &rows, &idx64));
        push(diag_mask_inf(c, &f, 1));
        push(soft_max(c, &f, Some(&mask), 0.5, 0.0));
        push(soft_max(c, &f, None, 1.0, 0.0));
        let mut params = RopeParams::new(8, RopeMode::Neox);
        params.n_ctx_orig = 4096;
        params.ext_factor = 1.0;
        push(rope(c, &x, &idx, Some(&freqs), params));
        push(rope(
            c,
            &x,
            &idx,
            None,
            RopeParams::new(4, RopeMode::Normal),
        ));
        push(clamp(c, &f, -1.0, 1.0));
        push(flash_attn_ext(
            c,
            &q,
            &k,
            &v,
            Some(&kv_mask),
            0.35,
            0.0,
            0.0,
        ));
        push(flash_attn_ext(c, &q, &k, &v, None, 0.35, 0.0, 30.0));
        push(custom(c, Arc::new(Negate), &[f], DType::F32, &[4]));
        out
    }
}

#[cfg(test)]
mod tests {
    use super::samples::*;
    use super::*;

    fn ctx() -> Context {
        Context::new(true)
    }

    #[test]
    fn rebuild_reproduces_every_op() {
        let (c, again) = (ctx(), ctx());
        let originals = one_of_each(&c);
        let mut covered = [false; N_VARIANTS];
        for t in &originals {
            covered[variant(t.op())] = true;
            let r = rebuild(&again, t.op(), t.srcs(), &Layout::of(t)).unwrap();
            let what = t.op().display_name();
            assert_eq!(r.op(), t.op(), "{what}");
            assert_eq!(Layout::of(&r), Layout::of(t), "{what}");
            assert_eq!(r.ndim(), t.ndim(), "{what}");
            assert_eq!(r.srcs(), t.srcs(), "{what}");
            assert_eq!(r.view_src(), t.view_src(), "{what}");
        }
        let missing: Vec<usize> = (0..N_VARIANTS).filter(|&i| !covered[i]).collect();
        assert!(missing.is_empty(), "variants without a sample: {missing:?}");
    }

    #[test]
    fn rebuild_checks_operand_counts_and_layouts() {
        let c = ctx();
        let a = c.new_tensor(DType::F32, &[4, 3]).unwrap();
        let layout = Layout::of(&a);
        for (op, srcs) in [
            (Op::Add, vec![a.clone()]),
            (Op::Dup, vec![]),
            (Op::None, vec![a.clone()]),
            (Op::MulMatId, vec![a.clone(), a.clone()]),
            (
                Op::Rope(RopeParams::new(4, RopeMode::Normal)),
                vec![a.clone(); 4],
            ),
        ] {
            let err = rebuild(&c, &op, &srcs, &layout).unwrap_err();
            assert!(err.to_string().contains("operands"), "{err}");
        }
        for ndim in [0, 5, usize::MAX] {
            let bad = Layout { ndim, ..layout };
            assert!(rebuild(&c, &Op::Reshape, std::slice::from_ref(&a), &bad).is_err());
        }
        let glu_swapped = Op::Glu {
            op: GluOp::Reglu,
            swapped: true,
        };
        assert!(rebuild(&c, &glu_swapped, &[a.clone(), a.clone()], &layout).is_err());
        // A view's offset before its operand's own is refused, not wrapped.
        let v = view(&c, &a, &[4], &[], 16).unwrap();
        let before = Layout {
            view_offset: 8,
            ..Layout::of(&v)
        };
        assert!(rebuild(&c, &Op::View, &[v], &before).is_err());
    }

    #[test]
    fn hostile_sizes_are_errors_not_overflows() {
        let c = ctx();
        let a = c.new_tensor(DType::F32, &[8, 4]).unwrap();
        let huge = usize::MAX / 2 + 1;
        // Empty, but with strides that would overflow.
        assert!(c
            .new_tensor(DType::F32, &[1 << 40, 1 << 40, 1 << 40, 0])
            .is_err());
        assert!(reshape(&c, &a, &[huge, 2]).is_err());
        assert!(reshape(&c, &a, &[1 << 32, 1 << 32, 0]).is_err());
        assert!(cont_shape(&c, &a, &[huge, 4]).is_err());
        assert!(view(&c, &a, &[2, 2], &[usize::MAX], 0).is_err());
        assert!(view(&c, &a, &[2, 3], &[huge], 0).is_err());
        assert!(diag_mask_inf(&c, &a, usize::MAX).is_err());
        let b = c.new_tensor(DType::F32, &[2, 2]).unwrap();
        for (nb1, nb2) in [(usize::MAX - 3, 0), (0, 0), (4, 64)] {
            // Overflowing or overlapping regions.
            assert!(acc(&c, &a, &b, nb1, nb2, nb2, 0).is_err(), "{nb1} {nb2}");
        }
        assert!(permute(&c, &a, [usize::MAX, 0, 1, 2]).is_err());
        assert!(concat(&c, &a, &a, usize::MAX).is_err());
        let pos = c.new_tensor(DType::I32, &[1]).unwrap();
        let x = c.new_tensor(DType::F32, &[8, 2, 1]).unwrap();
        for n_dims in [0, 3, 10, usize::MAX] {
            let p = RopeParams::new(n_dims, RopeMode::Normal);
            assert!(rope(&c, &x, &pos, None, p).is_err(), "{n_dims}");
        }
    }

    #[test]
    fn work_setting_parameters_are_bounded_by_their_tensors() {
        let c = ctx();
        let a = c.new_tensor(DType::F32, &[4, 3, 6]).unwrap();
        assert!(group_norm(&c, &a, 6, 1e-5).is_ok());
        for n_groups in [0, 7, 1 << 62, usize::MAX] {
            let err = group_norm(&c, &a, n_groups, 1e-5).unwrap_err();
            assert!(err.to_string().contains("n_groups"), "{err}");
        }
        // ACC strides and offsets in whole f32 elements, as views require.
        let big = c.new_tensor(DType::F32, &[8, 8]).unwrap();
        let small = c.new_tensor(DType::F32, &[2, 2]).unwrap();
        assert!(acc(&c, &big, &small, 32, 64, 64, 8).is_ok());
        for (nb1, offset) in [(30, 8), (32, 6), (33, 0)] {
            let err = acc(&c, &big, &small, nb1, 64, 64, offset).unwrap_err();
            assert_eq!(err.kind(), crate::error::ErrorKind::Shape, "{err}");
        }
    }

    #[test]
    fn mul_mat_shapes_follow_ggml() {
        let c = ctx();
        let w = c.new_tensor(DType::F16, &[4096, 1024]).unwrap();
        let x = c.new_tensor(DType::F32, &[4096, 8]).unwrap();
        let y = mul_mat(&c, &w, &x).unwrap();
        assert_eq!(y.ne(), [1024, 8, 1, 1]);
        assert_eq!(y.shape(), vec![8, 1024]);
        let bad = c.new_tensor(DType::F32, &[4095, 8]).unwrap();
        let err = mul_mat(&c, &w, &bad).unwrap_err();
        assert_eq!(err.kind(), crate::error::ErrorKind::Shape, "{err}");
        assert!(
            matches!(&err, Error::ShapeMismatch { shapes, .. } if shapes == &vec![vec![1024, 4096], vec![8, 4095]]),
            "{err:?}"
        );
        assert!(mul_mat(&c, &x, &w).is_err(), "f16 activations are rejected");
    }

    #[test]
    fn broadcasting_and_views() {
        let c = ctx();
        let a = c.new_tensor(DType::F32, &[6, 4, 3]).unwrap();
        let b = c.new_tensor(DType::F32, &[6, 2, 1]).unwrap();
        assert!(add(&c, &a, &b).is_ok());
        let odd = c.new_tensor(DType::F32, &[6, 3]).unwrap();
        assert!(add(&c, &a, &odd).is_err());
        let t = transpose(&c, &a).unwrap();
        assert_eq!(t.ne(), [4, 6, 3, 1]);
        assert!(t.is_transposed() && !t.is_contiguous());
        assert!(reshape(&c, &t, &[24, 3]).is_err());
        let r = reshape(&c, &a, &[24, 3]).unwrap();
        assert_eq!(r.view_src().unwrap(), &a);
        let p = permute(&c, &a, [2, 0, 1, 3]).unwrap();
        assert_eq!(p.ne(), [4, 3, 6, 1]);
        let v = view(&c, &a, &[6, 2], &[24], 24).unwrap();
        assert_eq!(v.view_offset(), 24);
        assert!(
            view(&c, &a, &[6, 4], &[24], 24 * 10).is_err(),
            "view past the end"
        );
        let vv = view(&c, &v, &[6], &[], 24).unwrap();
        assert_eq!(vv.view_src().unwrap(), &a);
        assert_eq!(vv.view_offset(), 48);
    }

    #[test]
    fn attention_shapes() {
        let c = ctx();
        let q = c.new_tensor(DType::F32, &[64, 7, 12, 1]).unwrap();
        let k = c.new_tensor(DType::F16, &[64, 32, 4, 1]).unwrap();
        let v = c.new_tensor(DType::F16, &[64, 32, 4, 1]).unwrap();
        let mask = c.new_tensor(DType::F16, &[32, 8]).unwrap();
        let out = flash_attn_ext(&c, &q, &k, &v, Some(&mask), 0.125, 0.0, 0.0).unwrap();
        assert_eq!(out.ne(), [64, 12, 7, 1]);
        let s = c.new_tensor(DType::F32, &[32, 7, 12]).unwrap();
        assert!(soft_max(&c, &s, Some(&mask), 1.0, 0.0).is_ok());
        assert!(soft_max(&c, &s, None, 1.0, 8.0).is_err());
        let pos = c.new_tensor(DType::I32, &[7]).unwrap();
        attention_mask_errors(&c, &q, &k, &v, &s);
        let x = c.new_tensor(DType::F32, &[64, 12, 7]).unwrap();
        assert!(rope(&c, &x, &pos, None, RopeParams::new(64, RopeMode::Neox)).is_ok());
        assert!(rope(&c, &x, &pos, None, RopeParams::new(65, RopeMode::Neox)).is_err());
    }

    /// The mask rules SOFT_MAX and FLASH_ATTN_EXT share: dtype, width, rows, broadcast, ALiBi.
    fn attention_mask_errors(c: &Context, q: &Tensor, k: &Tensor, v: &Tensor, s: &Tensor) {
        let fa = |mask: Option<&Tensor>, max_bias: f32| {
            flash_attn_ext(c, q, k, v, mask, 0.125, max_bias, 0.0)
        };
        let sm = |mask: Option<&Tensor>, max_bias: f32| soft_max(c, s, mask, 1.0, max_bias);
        let bad = [
            c.new_tensor(DType::F16, &[31, 8]).unwrap(), // width is not the keys'
            c.new_tensor(DType::F16, &[32, 6]).unwrap(), // fewer rows than queries
            c.new_tensor(DType::F16, &[32, 8, 5]).unwrap(), // 5 does not divide 12
        ];
        for mask in &bad {
            let err = fa(Some(mask), 0.0).unwrap_err();
            assert!(err.to_string().contains("FLASH_ATTN_EXT: mask"), "{err}");
            let err = sm(Some(mask), 0.0).unwrap_err();
            assert!(err.to_string().contains("SOFT_MAX: mask"), "{err}");
        }
        let i32_mask = c.new_tensor(DType::I32, &[32, 8]).unwrap();
        assert!(fa(Some(&i32_mask), 0.0).is_err() && sm(Some(&i32_mask), 0.0).is_err());
        let err = fa(None, 8.0).unwrap_err().to_string();
        assert!(err.contains("FLASH_ATTN_EXT: ALiBi"), "{err}");
        let err = sm(None, 8.0).unwrap_err().to_string();
        assert!(err.contains("SOFT_MAX: ALiBi"), "{err}");
        // A broadcasting mask and ALiBi with a mask are accepted.
        let broadcast = c.new_tensor(DType::F32, &[32, 7, 4]).unwrap();
        assert!(fa(Some(&broadcast), 8.0).is_ok() && sm(Some(&broadcast), 8.0).is_ok());
        // SOFT_MAX reads mask rows as dense runs; FLASH_ATTN_EXT takes a strided mask.
        let wide = c.new_tensor(DType::F16, &[64, 8]).unwrap();
        let strided = transpose(c, &view(c, &wide, &[8, 32], &[16], 0).unwrap()).unwrap();
        assert!(sm(Some(&strided), 0.0).is_err());
        assert!(fa(Some(&strided), 0.0).is_ok());
    }

    #[test]
    fn rows_and_reductions() {
        let c = ctx();
        let table = c.new_tensor(DType::Q8_0, &[64, 100]).unwrap();
        let idx = c.new_tensor(DType::I32, &[5]).unwrap();
        let rows = get_rows(&c, &table, &idx).unwrap();
        assert_eq!((rows.dtype(), rows.ne()), (DType::F32, [64, 5, 1, 1]));
        let f = c.new_tensor(DType::F32, &[64, 5]).unwrap();
        let dst = c.new_tensor(DType::F16, &[64, 100]).unwrap();
        assert!(set_rows(&c, &dst, &f, &idx).unwrap().is_view());
        assert_eq!(argmax(&c, &f).unwrap().ne(), [5, 1, 1, 1]);
        assert_eq!(sum_rows(&c, &f).unwrap().shape(), vec![5, 1]);
        assert!(concat(&c, &f, &f, 1).unwrap().ne() == [64, 10, 1, 1]);
        assert!(glu(
            &c,
            &c.new_tensor(DType::F32, &[7]).unwrap(),
            GluOp::Swiglu,
            false
        )
        .is_err());
    }
}
