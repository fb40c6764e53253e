//! Element-wise ops: every [`UnaryOp`], LEAKY_RELU, SQR, SQRT, LOG, SIN, COS, CLAMP, SCALE,
//! and the gated linear units (fused halves and split form).
//!
//! f16/bf16 rows are computed in f32 and stored back in their dtype. GELU is the tanh form
//! computed exactly in f32 (ggml by default reads a 64K-entry f16 lookup table instead, so its
//! results differ by up to one f16 rounding step). GELU_ERF uses [`erf_f32`], a rational
//! approximation in f32 (absolute error below 5e-7, auto-vectorised); the reference kernels use
//! [`erf`] in f64 (~1e-7). SiLU, sigmoid, GELU and EXP use [`math::exp`] (~2 ulp,
//! auto-vectorised). The hot row loops are compiled twice, for the baseline target and for
//! AVX2+FMA, and chosen at run time.

use super::math;
#[cfg(target_arch = "x86_64")]
use super::simd::Simd;
use super::view::RawTensor;
use super::view::RowIo;
use super::{par_ranges, row_grain, simd_fn};
use crate::error::{Error, Result};
use crate::ops::{GluOp, Op, UnaryOp};

const SQRT_2_OVER_PI: f32 = 0.797_884_6;
const GELU_COEF_A: f32 = 0.044715;

/// erf(x) (Numerical Recipes' erfc Chebyshev fit, fractional error below 1.2e-7), computed in
/// f64: the reference for [`erf_f32`].
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

/// erf(x) in f32 without branches or calls, so loops over rows vectorise: `x·P(x²)/Q(x²)` on
/// `x` clamped to [−4, 4] (Eigen's `generic_fast_erf_float` coefficients), ±1 exactly beyond
/// ±3.7 (where 1 − erf < 1.7e-7). Absolute error below 4.5e-7 over all floats; NaN propagates.
#[inline(always)]
pub fn erf_f32(x_in: f32) -> f32 {
    // `f32::clamp` keeps NaN, and compiles to min/max.
    let x = x_in.clamp(-4.0, 4.0);
    let x2 = x * x;
    let p = ERF_P[1..].iter().fold(ERF_P[0], |p, &c| p * x2 + c);
    let q = ERF_Q[1..].iter().fold(ERF_Q[0], |q, &c| q * x2 + c);
    let r = x * p / q;
    // A select, not a branch, so the loop still vectorises.
    if x.abs() > 3.7 {
        1f32.copysign(x)
    } else {
        r
    }
}

/// [`erf_f32`]'s numerator polynomial in x², highest degree first.
const ERF_P: [f32; 7] = [
    -2.726_142_3e-10,
    2.770_681_4e-8,
    -2.101_024e-6,
    -5.692_506_4e-5,
    -7.349_906_3e-4,
    -2.954_600_1e-3,
    -1.609_603_3e-2,
];
/// [`erf_f32`]'s denominator polynomial in x², highest degree first.
const ERF_Q: [f32; 5] = [
    -1.456_607_2e-5,
    -2.133_740_6e-4,
    -1.682_827e-3,
    -7.373_329_3e-3,
    -1.426_473_9e-2,
];

/// GELU_ERF of one vector in explicit SIMD: [`erf_f32`]'s rational function with fused
/// multiply-adds and `0.5·x + 0.5·x·erf` as one more (the auto-vectorised scalar form cannot
/// fuse). Lane-wise, so every ISA gives the same bits; agrees with [`gelu_erf`] to a few ulp;
/// error against the exact GELU below `3e-7·|x|` plus 2 ulp of the result (test).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn gelu_erf_v<S: Simd>(s: S, v: S::V) -> S::V {
    let z = s.mul(v, s.splat(std::f32::consts::FRAC_1_SQRT_2));
    // `min`/`max` return their second operand when one is NaN: NaN lanes pass through.
    let zc = s.min(s.splat(4.0), s.max(s.splat(-4.0), z));
    let z2 = s.mul(zc, zc);
    let mut p = s.splat(ERF_P[0]);
    for &c in &ERF_P[1..] {
        p = s.fma(p, z2, s.splat(c));
    }
    let mut q = s.splat(ERF_Q[0]);
    for &c in &ERF_Q[1..] {
        q = s.fma(q, z2, s.splat(c));
    }
    let r = s.div(s.mul(zc, p), q);
    // ±1 beyond |z| > 3.7, with z's sign.
    let erf = s.select_gt(zc, s.splat(3.7), s.splat(1.0), r);
    let erf = s.select_gt(s.splat(-3.7), zc, s.splat(-1.0), erf);
    let half = s.mul(v, s.splat(0.5));
    s.fma(half, erf, half)
}

/// SiLU of one vector in explicit SIMD: `x / (1 + e^(−x))` with [`math::exp_v`] (the scalar
/// [`silu`] calls the scalar exp per element, which does not vectorise: SmolLM2's SWIGLU of
/// 1536 values took ~8 µs). Lane-wise, so every ISA gives the same bits; ±∞ and NaN as the
/// scalar form gives them (e^(−x) saturates to +∞ below −88: `x/∞` is −0, and NaN for −∞).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn silu_v<S: Simd>(s: S, v: S::V) -> S::V {
    let e = math::exp_v(s, s.sub(s.zero(), v));
    s.div(v, s.add(s.splat(1.0), e))
}

/// The activations with explicit SIMD rows (the others auto-vectorise or stay scalar).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum SimdAct {
    /// [`gelu_erf_v`].
    GeluErf,
    /// [`silu_v`].
    Silu,
}

impl SimdAct {
    /// The explicit SIMD row of `op`, if it has one.
    fn of(op: UnaryOp) -> Option<SimdAct> {
        match op {
            UnaryOp::GeluErf => Some(SimdAct::GeluErf),
            UnaryOp::Silu => Some(SimdAct::Silu),
            _ => None,
        }
    }
}

/// `act` over `row` in place, vector by vector (the last one partial), written once for every
/// ISA. The activation is picked by a `match` on direct calls (the loop is unswitched): passed
/// as a function value instead, its lane methods were no longer inlined with the entry
/// point's features (SiLU of 1536 values took 52 µs instead of 2).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn simd_act_row<S: Simd>(s: S, act: SimdAct, row: &mut [f32]) {
    let n = row.len();
    let mut i = 0;
    while i < n {
        let left = n - i;
        // SAFETY: the partial forms touch elements i..min(i + LANES, n) of the row only.
        unsafe {
            let ptr = row.as_mut_ptr().add(i);
            let v = s.load_partial(ptr, left);
            let y = match act {
                SimdAct::GeluErf => gelu_erf_v(s, v),
                SimdAct::Silu => silu_v(s, v),
            };
            s.store_partial(ptr, y, left);
        }
        i += S::LANES;
    }
}

/// Each ISA's compiled copy of [`simd_act_row`].
#[cfg(target_arch = "x86_64")]
mod simd_entry {
    use super::super::simd::{Avx2, Avx512};
    use super::SimdAct;

    /// [`super::simd_act_row`] with AVX2 and FMA.
    ///
    /// # Safety
    /// None beyond the token, which proves the features (`target_feature` makes it unsafe).
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn act_row_avx2(t: Avx2, act: SimdAct, row: &mut [f32]) {
        super::simd_act_row(t, act, row)
    }

    /// [`super::simd_act_row`] with AVX-512F.
    ///
    /// # Safety
    /// As [`act_row_avx2`].
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn act_row_avx512(t: Avx512, act: SimdAct, row: &mut [f32]) {
        super::simd_act_row(t, act, row)
    }
}

/// `act` over `row` in place with the widest SIMD entry this CPU runs; `false` (row untouched)
/// when there is none.
fn simd_act_fast(act: SimdAct, row: &mut [f32]) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        use super::simd::{Avx2, Avx512};
        if let Some(t) = Avx512::new() {
            // SAFETY: the token proves the entry point's features.
            unsafe { simd_entry::act_row_avx512(t, act, row) };
            return true;
        }
        if let Some(t) = Avx2::new() {
            // SAFETY: as above.
            unsafe { simd_entry::act_row_avx2(t, act, row) };
            return true;
        }
    }
    let _ = (act, row);
    false
}

/// Applies an element-wise op to a row in place with the fastest kernels this CPU has.
fn apply_row_fast(op: &Op, row: &mut [f32]) -> Result<()> {
    if let Op::Unary(u) = op {
        if SimdAct::of(*u).is_some_and(|act| simd_act_fast(act, row)) {
            return Ok(());
        }
    }
    apply_row(op, row)
}

/// `out = act(x)·g` with the fastest kernels this CPU has: the SIMD activation row in place
/// in `out`, then the product (the same bits at any vector width).
fn glu_row_fast(act: UnaryOp, x: &[f32], g: &[f32], out: &mut Vec<f32>) {
    if let Some(simd) = SimdAct::of(act) {
        out.clear();
        out.extend_from_slice(x);
        if simd_act_fast(simd, out) {
            out.iter_mut().zip(g).for_each(|(o, &g)| *o *= g);
            return;
        }
    }
    glu_row(act, x, g, out)
}

/// GELU with the exact (erf) form, through [`erf_f32`].
#[inline(always)]
pub fn gelu_erf(x: f32) -> f32 {
    0.5 * x * (1.0 + erf_f32(x * std::f32::consts::FRAC_1_SQRT_2))
}

/// GELU, tanh approximation.
pub fn gelu(x: f32) -> f32 {
    0.5 * x * (1.0 + math::tanh_via_exp(SQRT_2_OVER_PI * x * (1.0 + GELU_COEF_A * x * x)))
}

/// SiLU: x·σ(x).
pub fn silu(x: f32) -> f32 {
    x / (1.0 + math::exp(-x))
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
        UnaryOp::Sigmoid => math::sigmoid(x),
        UnaryOp::Gelu => gelu(x),
        UnaryOp::GeluErf => 0.5 * x * (1.0 + erf(x * std::f32::consts::FRAC_1_SQRT_2)),
        UnaryOp::GeluQuick => x * math::sigmoid(1.702 * x),
        UnaryOp::Silu => silu(x),
        UnaryOp::Hardswish => x * ((x + 3.0) / 6.0).clamp(0.0, 1.0),
        UnaryOp::Hardsigmoid => ((x + 3.0) / 6.0).clamp(0.0, 1.0),
        UnaryOp::Exp => math::exp(x),
    }
}

simd_fn! {
    /// Applies an element-wise op to a row in place (fast kernels). The simple arms repeat
    /// those of [`apply_row_ref`] on purpose: here they are compiled inside the AVX2 variant
    /// and vectorise, while a call into the reference would run its baseline code.
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
            Op::Unary(UnaryOp::Silu) => row.iter_mut().for_each(|v| *v = silu(*v)),
            Op::Unary(UnaryOp::Gelu) => row.iter_mut().for_each(|v| *v = gelu(*v)),
            Op::Unary(UnaryOp::GeluErf) => row.iter_mut().for_each(|v| *v = gelu_erf(*v)),
            Op::Unary(UnaryOp::Sigmoid) => row.iter_mut().for_each(|v| *v = math::sigmoid(*v)),
            Op::Unary(UnaryOp::Exp) => row.iter_mut().for_each(|v| *v = math::exp(*v)),
            _ => return apply_row_ref(op, row),
        }
        Ok(())
    }
}

/// Applies an element-wise op to a row in place (scalar reference: every unary function
/// through [`unary_value`]).
fn apply_row_ref(op: &Op, row: &mut [f32]) -> Result<()> {
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
        Op::Unary(u) => row.iter_mut().for_each(|v| *v = unary_value(u, *v)),
        ref other => {
            return Err(Error::unsupported(format!(
                "{} is not an element-wise op",
                other.name()
            )))
        }
    }
    Ok(())
}

/// `dst = f(a)` element-wise; `dst` may alias `a`. `reference` selects the scalar reference
/// functions.
pub fn elementwise(op: &Op, dst: RawTensor, a: RawTensor, reference: bool) -> Result<()> {
    let n0 = dst.ne[0];
    par_ranges(dst.nrows(), row_grain(n0), |rows| {
        let mut x = vec![0f32; n0];
        for r in rows {
            let (i1, i2, i3) = dst.row_coords(r);
            // SAFETY: the row lies inside both tensors; it is read completely before this task
            // (its only writer) stores it.
            unsafe {
                a.load_row(i1, i2, i3, &mut x)?;
                if reference {
                    apply_row_ref(op, &mut x)?;
                } else {
                    apply_row_fast(op, &mut x)?;
                }
                dst.store_row(i1, i2, i3, &x)?;
            }
        }
        Ok(())
    })
}

simd_fn! {
    /// `out = act(x)·g` (fast kernels for SiLU and both GELUs).
    fn glu_row(act: UnaryOp, x: &[f32], g: &[f32], out: &mut Vec<f32>) {
        out.clear();
        match act {
            UnaryOp::Silu => out.extend(x.iter().zip(g).map(|(&x, &g)| silu(x) * g)),
            UnaryOp::Gelu => out.extend(x.iter().zip(g).map(|(&x, &g)| gelu(x) * g)),
            UnaryOp::GeluErf => out.extend(x.iter().zip(g).map(|(&x, &g)| gelu_erf(x) * g)),
            _ => glu_row_ref(act, x, g, out),
        }
    }
}

/// `out = act(x)·g` through [`unary_value`] (scalar reference).
fn glu_row_ref(act: UnaryOp, x: &[f32], g: &[f32], out: &mut Vec<f32>) {
    out.clear();
    out.extend(x.iter().zip(g).map(|(&x, &g)| unary_value(act, x) * g));
}

/// Gated linear unit: fused (`b` is `None`: each row of `a` is `[x, g]`, or `[g, x]` when
/// `swapped`) or split (`act(a)·b`). `reference` selects the scalar reference functions.
pub fn glu(
    op: GluOp,
    swapped: bool,
    dst: RawTensor,
    a: RawTensor,
    b: Option<RawTensor>,
    reference: bool,
) -> Result<()> {
    let nc = dst.ne[0];
    let act = op.activation();
    par_ranges(dst.nrows(), row_grain(nc), |rows| {
        let mut row = vec![0f32; if b.is_some() { nc } else { 2 * nc }];
        let mut gate = vec![0f32; nc];
        let mut out = Vec::with_capacity(nc);
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
                if reference {
                    glu_row_ref(act, x, g, &mut out);
                } else {
                    glu_row_fast(act, x, g, &mut out);
                }
                dst.store_row(i1, i2, i3, &out)?;
            }
        }
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// erf in f64 to ~1e-16: `2/√π·e^{−x²}·Σ 2ⁿx^{2n+1}/(1·3·…·(2n+1))` (all terms positive,
    /// so no cancellation), ±1 beyond 6.
    fn erf_f64(x: f64) -> f64 {
        let a = x.abs();
        if a == 0.0 || a > 6.0 {
            return if a == 0.0 { x } else { x.signum() };
        }
        let (mut term, mut sum, mut n) = (a, a, 0.0);
        while term > sum * 1e-18 {
            n += 1.0;
            term *= 2.0 * a * a / (2.0 * n + 1.0);
            sum += term;
        }
        let r = 2.0 / std::f64::consts::PI.sqrt() * (-a * a).exp() * sum;
        r.copysign(x)
    }

    #[test]
    fn erf_f32_is_accurate_over_all_floats() {
        let mut worst = (0f64, 0f32);
        let mut check = |x: f32| {
            let err = (erf_f32(x) as f64 - erf_f64(x as f64)).abs();
            if err > worst.0 {
                worst = (err, x);
            }
        };
        // dense in the interesting range
        let mut x = -6.0f32;
        while x <= 6.0 {
            check(x);
            x += 1.0 / 4096.0;
        }
        // every 4099th positive finite bit pattern, both signs
        let mut bits = 0u32;
        while bits < f32::INFINITY.to_bits() {
            let x = f32::from_bits(bits);
            check(x);
            check(-x);
            bits += 4099;
        }
        assert!(
            worst.0 < 5e-7,
            "erf_f32: error {:e} at {}",
            worst.0,
            worst.1
        );
        assert_eq!(erf_f32(0.0), 0.0);
        assert_eq!(erf_f32(f32::INFINITY), 1.0);
        assert_eq!(erf_f32(f32::NEG_INFINITY), -1.0);
        assert!(erf_f32(f32::NAN).is_nan());
        // the reference erf agrees with the series too
        let mut x = -6.0f32;
        while x <= 6.0 {
            assert!((erf(x) as f64 - erf_f64(x as f64)).abs() < 2e-7, "erf({x})");
            x += 1.0 / 256.0;
        }
    }

    /// Inputs for the SIMD activation rows: a ramp over `[-10000, 10000)·step`, every
    /// 40 009th bit pattern of either sign up to ∞, and `extra`.
    #[cfg(target_arch = "x86_64")]
    fn simd_inputs(step: f32, extra: &[f32]) -> Vec<f32> {
        let mut xs: Vec<f32> = (0..20_000).map(|i| (i as f32 - 10_000.0) * step).collect();
        let mut bits = 0u32;
        while bits < f32::INFINITY.to_bits() {
            xs.push(f32::from_bits(bits));
            xs.push(-f32::from_bits(bits));
            bits += 40_009;
        }
        xs.extend(extra);
        xs
    }

    /// The bits of `v`, every NaN as one pattern.
    #[cfg(target_arch = "x86_64")]
    fn bit_pattern(v: &[f32]) -> Vec<u32> {
        v.iter()
            .map(|x| if x.is_nan() { u32::MAX } else { x.to_bits() })
            .collect()
    }

    /// `act` over `x` on AVX2, checked to give the same bits on the 16-lane stand-in and on
    /// native AVX-512 where present; `None` without AVX2.
    #[cfg(target_arch = "x86_64")]
    fn simd_act_same_on_every_isa(act: SimdAct, x: &[f32]) -> Option<Vec<f32>> {
        use super::super::simd::{tests::Emu16, Avx2, Avx512};
        let avx2 = Avx2::new()?;
        let mut got = x.to_vec();
        simd_act_row(avx2, act, &mut got);
        let mut wide = x.to_vec();
        simd_act_row(Emu16::new().unwrap(), act, &mut wide);
        assert_eq!(
            bit_pattern(&got),
            bit_pattern(&wide),
            "{act:?}, len {}",
            x.len()
        );
        if let Some(t) = Avx512::new() {
            let mut native = x.to_vec();
            // SAFETY: the token proves AVX-512F.
            unsafe { simd_entry::act_row_avx512(t, act, &mut native) };
            assert_eq!(
                bit_pattern(&got),
                bit_pattern(&native),
                "{act:?}, len {}",
                x.len()
            );
        }
        Some(got)
    }

    /// The SIMD GELU_ERF row (AVX2, the 16-lane stand-in, AVX-512 when present) against the
    /// exact GELU (f64 erf series): error below `3e-7·|x|` plus 2 ulp of the result over a
    /// dense range and spread bit patterns; NaN and ±∞ as the scalar form; row lengths that
    /// leave partial vectors; the same bits from every ISA.
    #[test]
    #[cfg(target_arch = "x86_64")]
    fn gelu_erf_simd_row_is_accurate_and_the_same_on_every_isa() {
        let xs = simd_inputs(1e-3, &[f32::INFINITY, f32::NAN, 0.0, -0.0, 1e-30, -1e30]);
        for len in [xs.len(), 17, 3] {
            let x = &xs[..len];
            let Some(got) = simd_act_same_on_every_isa(SimdAct::GeluErf, x) else {
                return;
            };
            for (&x, &g) in x.iter().zip(&got) {
                let scalar = gelu_erf(x);
                if scalar.is_nan() {
                    assert!(g.is_nan(), "gelu({x}) = {g}, scalar NaN");
                    continue;
                }
                if x.is_infinite() {
                    assert_eq!(g, scalar, "gelu({x})");
                    continue;
                }
                let xd = x as f64;
                let want = 0.5 * xd * (1.0 + erf_f64(xd * std::f64::consts::FRAC_1_SQRT_2));
                let tol = 3e-7 * xd.abs() + 2.0 * f32::EPSILON as f64 * want.abs() + 1e-38;
                assert!(
                    (g as f64 - want).abs() <= tol,
                    "gelu({x}) = {g}, exact {want}"
                );
            }
        }
    }

    /// SiLU's SIMD row and the SWIGLU row built on it: the same bits on AVX2, the 16-lane
    /// stand-in and native AVX-512, within a few ulp of SiLU computed in f64, NaN and ±∞ as the
    /// scalar form; every prefix length around the vector width.
    #[test]
    #[cfg(target_arch = "x86_64")]
    fn silu_simd_rows_are_accurate_and_the_same_on_every_isa() {
        let specials = [
            f32::INFINITY,
            -f32::INFINITY,
            f32::NAN,
            0.0,
            -0.0,
            88.7,
            -88.7,
            -89.5,
        ];
        let xs = simd_inputs(1e-2, &specials);
        let gate: Vec<f32> = (0..xs.len()).map(|i| (i % 7) as f32 - 2.5).collect();
        for len in (0..40).chain([xs.len()]) {
            let x = &xs[..len];
            let Some(got) = simd_act_same_on_every_isa(SimdAct::Silu, x) else {
                return;
            };
            for (&x, &y) in x.iter().zip(&got) {
                let scalar = silu(x);
                if scalar.is_nan() || x.is_infinite() {
                    assert_eq!(bit_pattern(&[y]), bit_pattern(&[scalar]), "silu({x}) = {y}");
                    continue;
                }
                let xd = f64::from(x);
                let want = xd / (1.0 + (-xd).exp());
                // Below x ≈ −88.72, e^(−x) overflows f32 and the result is −0 (as the scalar
                // form's): the exact value is then under 2.7e-37 in magnitude.
                let tol = 1e-6 * want.abs() + 3e-37;
                assert!(
                    (f64::from(y) - want).abs() <= tol,
                    "silu({x}) = {y}, exact {want}"
                );
            }
            // SWIGLU: the activation times the gate, exactly the rows' product.
            let mut glu = Vec::new();
            glu_row_fast(UnaryOp::Silu, x, &gate[..len], &mut glu);
            let want: Vec<f32> = got.iter().zip(&gate).map(|(a, g)| a * g).collect();
            assert_eq!(bit_pattern(&glu), bit_pattern(&want), "swiglu len {len}");
        }
    }

    #[test]
    fn fast_rows_match_the_reference() {
        let ops = [
            Op::Unary(UnaryOp::GeluErf),
            Op::Unary(UnaryOp::Gelu),
            Op::Unary(UnaryOp::Silu),
            Op::Unary(UnaryOp::Exp),
            Op::Scale { s: 0.5, b: 1.0 },
        ];
        let x: Vec<f32> = (0..1000).map(|i| (i as f32 - 500.0) / 50.0).collect();
        for op in ops {
            let (mut fast, mut reference) = (x.clone(), x.clone());
            apply_row(&op, &mut fast).unwrap();
            apply_row_ref(&op, &mut reference).unwrap();
            for ((f, r), x) in fast.iter().zip(&reference).zip(&x) {
                let tol = 1e-6 * (1.0 + r.abs());
                assert!((f - r).abs() <= tol, "{}: {x}: {f} vs {r}", op.name());
            }
        }
    }
}
