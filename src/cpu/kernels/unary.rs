//! Element-wise ops: every [`UnaryOp`], LEAKY_RELU, SQR, SQRT, LOG, SIN, COS, CLAMP, SCALE,
//! and the gated linear units (fused halves and split form).
//!
//! f16/bf16 rows are computed in f32 and stored back in their dtype. GELU is the tanh form
//! computed exactly in f32 (ggml by default reads a 64K-entry f16 lookup table instead, so its
//! results differ by up to one f16 rounding step); GELU_ERF uses an erf accurate to ~1e-7.

use super::view::RawTensor;
use super::{par_ranges, row_grain};
use crate::error::{Error, Result};
use crate::ops::{GluOp, Op, UnaryOp};

const SQRT_2_OVER_PI: f32 = 0.797_884_6;
const GELU_COEF_A: f32 = 0.044715;

/// erf(x) (Numerical Recipes' erfc Chebyshev fit, fractional error below 1.2e-7).
pub fn erf(x: f32) -> f32 {
    let x = x as f64;
    let z = x.abs();
    let t = 1.0 / (1.0 + 0.5 * z);
    let poly = -z * z - 1.265_512_23
        + t * (1.000_023_68
            + t * (0.374_091_96
                + t * (0.096_784_18
                    + t * (-0.186_288_06
                        + t * (0.278_868_07
                            + t * (-1.135_203_98
                                + t * (1.488_515_87 + t * (-0.822_152_23 + t * 0.170_872_77))))))));
    let erfc = t * poly.exp();
    (if x >= 0.0 { 1.0 - erfc } else { erfc - 1.0 }) as f32
}

/// GELU, tanh approximation.
pub fn gelu(x: f32) -> f32 {
    0.5 * x * (1.0 + (SQRT_2_OVER_PI * x * (1.0 + GELU_COEF_A * x * x)).tanh())
}

/// SiLU: x·σ(x).
pub fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// One unary function applied to `x`.
pub fn unary_value(op: UnaryOp, x: f32) -> f32 {
    match op {
        UnaryOp::Abs => x.abs(),
        UnaryOp::Sgn => {
            if x > 0.0 {
                1.0
            } else if x < 0.0 {
                -1.0
            } else {
                0.0
            }
        }
        UnaryOp::Neg => -x,
        UnaryOp::Step => {
            if x > 0.0 {
                1.0
            } else {
                0.0
            }
        }
        UnaryOp::Tanh => x.tanh(),
        UnaryOp::Elu => {
            if x > 0.0 {
                x
            } else {
                x.exp_m1()
            }
        }
        UnaryOp::Relu => x.max(0.0),
        UnaryOp::Sigmoid => 1.0 / (1.0 + (-x).exp()),
        UnaryOp::Gelu => gelu(x),
        UnaryOp::GeluErf => 0.5 * x * (1.0 + erf(x * std::f32::consts::FRAC_1_SQRT_2)),
        UnaryOp::GeluQuick => x * (1.0 / (1.0 + (-1.702 * x).exp())),
        UnaryOp::Silu => silu(x),
        UnaryOp::Hardswish => x * ((x + 3.0) / 6.0).clamp(0.0, 1.0),
        UnaryOp::Hardsigmoid => ((x + 3.0) / 6.0).clamp(0.0, 1.0),
        UnaryOp::Exp => x.exp(),
    }
}

/// Applies an element-wise op to a row in place.
fn apply_row(op: &Op, row: &mut [f32]) -> Result<()> {
    match *op {
        Op::Sqr => row.iter_mut().for_each(|v| *v *= *v),
        Op::Sqrt => row.iter_mut().for_each(|v| *v = v.sqrt()),
        Op::Log => row.iter_mut().for_each(|v| *v = v.ln()),
        Op::Sin => row.iter_mut().for_each(|v| *v = v.sin()),
        Op::Cos => row.iter_mut().for_each(|v| *v = v.cos()),
        Op::Clamp { min, max } => row.iter_mut().for_each(|v| *v = v.max(min).min(max)),
        Op::Scale { s, b } => row.iter_mut().for_each(|v| *v = *v * s + b),
        Op::LeakyRelu { negative_slope } => row
            .iter_mut()
            .for_each(|v| *v = v.max(0.0) + negative_slope * v.min(0.0)),
        Op::Unary(UnaryOp::Relu) => row.iter_mut().for_each(|v| *v = v.max(0.0)),
        Op::Unary(UnaryOp::Neg) => row.iter_mut().for_each(|v| *v = -*v),
        Op::Unary(UnaryOp::Abs) => row.iter_mut().for_each(|v| *v = v.abs()),
        Op::Unary(u) => row.iter_mut().for_each(|v| *v = unary_value(u, *v)),
        ref other => {
            return Err(Error::UnsupportedOp(format!(
                "{} is not an element-wise op",
                other.name()
            )))
        }
    }
    Ok(())
}

/// `dst = f(a)` element-wise; `dst` may alias `a`.
pub fn elementwise(op: &Op, dst: RawTensor, a: RawTensor) -> Result<()> {
    let n0 = dst.ne[0];
    par_ranges(dst.nrows(), row_grain(n0), |rows| {
        let mut x = vec![0f32; n0];
        for r in rows {
            let (i1, i2, i3) = dst.row_coords(r);
            // SAFETY: the row lies inside both tensors; it is read completely before this task
            // (its only writer) stores it.
            unsafe {
                a.load_row(i1, i2, i3, &mut x)?;
                apply_row(op, &mut x)?;
                dst.store_row(i1, i2, i3, &x)?;
            }
        }
        Ok(())
    })
}

/// Gated linear unit: fused (`b` is `None`: each row of `a` is `[x, g]`, or `[g, x]` when
/// `swapped`) or split (`act(a)·b`).
pub fn glu(
    op: GluOp,
    swapped: bool,
    dst: RawTensor,
    a: RawTensor,
    b: Option<RawTensor>,
) -> Result<()> {
    let nc = dst.ne[0];
    let act = op.activation();
    par_ranges(dst.nrows(), row_grain(nc), |rows| {
        let mut row = vec![0f32; if b.is_some() { nc } else { 2 * nc }];
        let mut gate = vec![0f32; nc];
        for r in rows {
            let (i1, i2, i3) = dst.row_coords(r);
            // SAFETY: rows lie inside their tensors; the dst row belongs to this task and the
            // sources are read before it is written.
            unsafe {
                a.load_row(i1, i2, i3, &mut row)?;
                let (x, g): (&[f32], &[f32]) = match b {
                    Some(b) => {
                        b.load_row(i1, i2, i3, &mut gate)?;
                        (&row, &gate)
                    }
                    None if swapped => (&row[nc..], &row[..nc]),
                    None => (&row[..nc], &row[nc..]),
                };
                let out: Vec<f32> = x
                    .iter()
                    .zip(g)
                    .map(|(&x, &g)| unary_value(act, x) * g)
                    .collect();
                dst.store_row(i1, i2, i3, &out)?;
            }
        }
        Ok(())
    })
}
