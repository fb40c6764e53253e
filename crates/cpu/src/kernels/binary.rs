//! ADD, SUB, MUL, DIV with ggml's broadcast of the second operand by index modulo, ADD1 and
//! ACC.
//!
//! The first operand and the result may be f32, f16 or bf16 (computed in f32, stored in the
//! result's dtype); the second is f32 or the first's dtype. Each task loads a whole row before
//! writing it, so the result may alias the first operand.

use super::copy;
use super::view::RowIo;
use super::view::{RawTensor, SendPtr};
use super::{par_ranges, row_grain, simd_fn};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::ops::Op;

#[derive(Clone, Copy)]
enum Kind {
    Add,
    Sub,
    Mul,
    Div,
}

simd_fn! {
    fn apply(kind: Kind, x: &mut [f32], y: &[f32]) {
        match kind {
            Kind::Add => x.iter_mut().zip(y).for_each(|(a, b)| *a += b),
            Kind::Sub => x.iter_mut().zip(y).for_each(|(a, b)| *a -= b),
            Kind::Mul => x.iter_mut().zip(y).for_each(|(a, b)| *a *= b),
            Kind::Div => x.iter_mut().zip(y).for_each(|(a, b)| *a /= b),
        }
    }
}

/// `dst = a ∘ b` with `b` broadcast by modulo in every dimension.
pub fn binary(op: &Op, dst: RawTensor, a: RawTensor, b: RawTensor) -> Result<()> {
    let kind = match op {
        Op::Add => Kind::Add,
        Op::Sub => Kind::Sub,
        Op::Mul => Kind::Mul,
        Op::Div => Kind::Div,
        other => {
            return Err(Error::unsupported(format!(
                "{} is not a binary op",
                other.name()
            )))
        }
    };
    let n0 = dst.ne[0];
    let nb0 = b.ne[0];
    if b.ne.contains(&0) {
        return Ok(());
    }
    let dense_f32 = |t: &RawTensor| t.dtype == DType::F32 && (t.ne[0] <= 1 || t.nb[0] == 4);
    if dense_f32(&dst) && dense_f32(&a) && dense_f32(&b) && a.ne == dst.ne && nb0 == n0 {
        return binary_dense_f32(kind, dst, a, b);
    }
    par_ranges(dst.nrows(), row_grain(n0), |rows| {
        let mut x = vec![0f32; n0];
        let mut y = vec![0f32; n0];
        let mut cached: Option<(usize, usize, usize)> = None;
        for r in rows {
            let (i1, i2, i3) = dst.row_coords(r);
            let key = (i1 % b.ne[1], i2 % b.ne[2], i3 % b.ne[3]);
            if cached != Some(key) {
                // SAFETY: the broadcast row lies inside `b`, which is read-only here.
                unsafe { b.load_row(key.0, key.1, key.2, &mut y[..nb0])? };
                for i in nb0..n0 {
                    y[i] = y[i % nb0];
                }
                cached = Some(key);
            }
            // SAFETY: row (i1, i2, i3) lies inside `a` and `dst`; this task owns the dst row
            // and reads the (possibly aliased) source row completely before writing.
            unsafe {
                a.load_row(i1, i2, i3, &mut x)?;
                apply(kind, &mut x, &y);
                dst.store_row(i1, i2, i3, &x)?;
            }
        }
        Ok(())
    })
}

/// The common case of dense f32 rows with `b` broadcast only over whole rows: each dst row is
/// computed in place (a copied in first unless the op already runs in place), with no staging
/// buffers, so large operands stream at memory bandwidth.
fn binary_dense_f32(kind: Kind, dst: RawTensor, a: RawTensor, b: RawTensor) -> Result<()> {
    let n0 = dst.ne[0];
    par_ranges(dst.nrows(), row_grain(n0), |rows| {
        let mut y = Vec::new();
        for r in rows {
            let (i1, i2, i3) = dst.row_coords(r);
            let key = (i1 % b.ne[1], i2 % b.ne[2], i3 % b.ne[3]);
            // SAFETY: the three rows lie inside their tensors (coordinates in range, rows of
            // `n0` dense f32). This task owns the dst row; `a` and `b` are only read.
            let (out, src, other) = unsafe {
                (
                    dst.at(dst.row_offset(i1, i2, i3)).cast::<f32>(),
                    a.at(a.row_offset(i1, i2, i3)).cast::<f32>().cast_const(),
                    b.at(b.row_offset(key.0, key.1, key.2))
                        .cast::<f32>()
                        .cast_const(),
                )
            };
            let overlaps = (other as usize) < (out as usize) + n0 * 4
                && (out as usize) < (other as usize) + n0 * 4;
            let other: &[f32] = if overlaps {
                // b's row shares memory with the dst row (dst = a op b in place on b): read
                // it before it is overwritten.
                y.clear();
                // SAFETY: `other` addresses n0 f32 inside `b` (see above).
                y.extend_from_slice(unsafe { std::slice::from_raw_parts(other, n0) });
                &y
            } else {
                // SAFETY: as above; checked not to overlap the dst row.
                unsafe { std::slice::from_raw_parts(other, n0) }
            };
            if !std::ptr::eq(src, out) {
                // SAFETY: both rows hold n0 f32; `copy` tolerates overlap.
                unsafe { std::ptr::copy(src, out, n0) };
            }
            // SAFETY: the dst row is this task's alone and no shared slice points into it.
            let x = unsafe { std::slice::from_raw_parts_mut(out, n0) };
            apply(kind, x, other);
        }
        Ok(())
    })
}

/// `dst = a + b[0]` for a one-element `b`.
pub fn add1(dst: RawTensor, a: RawTensor, b: RawTensor) -> Result<()> {
    let mut scalar = [0f32; 1];
    // SAFETY: `b` has one element, read-only here.
    unsafe { b.load_row(0, 0, 0, &mut scalar)? };
    let value = scalar[0];
    let n0 = dst.ne[0];
    par_ranges(dst.nrows(), row_grain(n0), |rows| {
        let mut x = vec![0f32; n0];
        for r in rows {
            let (i1, i2, i3) = dst.row_coords(r);
            // SAFETY: as in `binary`: whole-row read before write, rows owned by this task.
            unsafe {
                a.load_row(i1, i2, i3, &mut x)?;
                x.iter_mut().for_each(|v| *v += value);
                dst.store_row(i1, i2, i3, &x)?;
            }
        }
        Ok(())
    })
}

/// ACC: `dst = a`, then `b` is added into the region of `dst` at byte `offset` with byte
/// strides `[4, nb1, nb2, nb3]` (all f32).
pub fn acc(
    dst: RawTensor,
    a: RawTensor,
    b: RawTensor,
    strides: [usize; 3],
    offset: usize,
) -> Result<()> {
    if dst.dtype != DType::F32 || b.dtype != DType::F32 {
        return Err(Error::unsupported("ACC needs f32 tensors"));
    }
    copy::copy(dst, a)?;
    let region = RawTensor {
        // SAFETY: the builder checked that the region (offset + span of b) lies inside dst.
        ptr: SendPtr(unsafe { dst.at(offset) }),
        dtype: DType::F32,
        ne: b.ne,
        nb: [4, strides[0], strides[1], strides[2]],
    };
    let n0 = b.ne[0];
    let ne = b.ne;
    let disjoint = (ne[1] <= 1 || strides[0] >= n0 * 4)
        && (ne[2] <= 1 || strides[1] >= strides[0] * ne[1])
        && (ne[3] <= 1 || strides[2] >= strides[1] * ne[2]);
    let work = |rows: std::ops::Range<usize>| -> Result<()> {
        let mut x = vec![0f32; n0];
        let mut y = vec![0f32; n0];
        for r in rows {
            let (i1, i2, i3) = b.row_coords(r);
            // SAFETY: region rows lie inside dst (builder check); with disjoint rows each task
            // owns its rows, otherwise this runs on one thread.
            unsafe {
                region.load_row(i1, i2, i3, &mut x)?;
                b.load_row(i1, i2, i3, &mut y)?;
                apply(Kind::Add, &mut x, &y);
                region.store_row(i1, i2, i3, &x)?;
            }
        }
        Ok(())
    };
    if disjoint {
        par_ranges(b.nrows(), row_grain(n0), work)
    } else {
        work(0..b.nrows())
    }
}
