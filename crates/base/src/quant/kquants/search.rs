//! The rounding rule and the per-group scale searches of ggml's reference K-quant
//! quantizers (ggml's `nearest_int`, `make_qx_quants`, `make_q3_quants`,
//! `make_qkx2_quants` and `best_index_int8`), restated. All arithmetic is f32, one rounded
//! operation at a time, in the order the sums are written here.

use super::GROUP_MAX_EPS;

/// `x` rounded to the nearest integer, ties to even, by ggml's trick: adding `1.5·2²³` moves
/// the integer part into the low mantissa bits. Exact for `|x| < 2²²`; other arguments
/// (including NaN and infinities) give some value in `−2²²..2²²` without panicking.
#[inline]
pub(super) fn nearest_int(x: f32) -> i32 {
    let v = x + 12_582_912.0;
    (v.to_bits() as i32 & 0x007f_ffff) - 0x0040_0000
}

/// The index of the entry of the ascending table `values` nearest to `x` (ties and
/// midpoints go to the larger entry): a branch-free binary search on doubled values, so
/// both sides of each comparison are exact.
#[inline]
pub(super) fn best_index_iq4(values: &[i8; 16], x: f32) -> usize {
    let x2 = x + x;
    let mut idx = 0;
    let mut step = 8;
    while step > 0 {
        let j = idx + step;
        if x2 >= f32::from(values[j - 1]) + f32::from(values[j]) {
            idx = j;
        }
        step >>= 1;
    }
    idx
}

/// The first value of largest magnitude of `x`, with its sign, and that magnitude.
#[inline]
fn signed_max(x: &[f32]) -> (f32, f32) {
    let mut max = 0f32;
    let mut amax = 0f32;
    for &v in x {
        if v.abs() > amax {
            amax = v.abs();
            max = v;
        }
    }
    (max, amax)
}

/// ggml's `make_qx_quants` with `rmse_type = 1` and no importance weights (weights `x²`):
/// signed quants `l` in `−nmax..nmax` stored in `out` as `l + nmax`; returns the group scale.
///
/// The first guess is `iscale = −nmax/max` (`max` the signed extreme); then 18 more inverse
/// scales `−(nmax + 0.1·is)/max` (`is = ±1..=±9`) are tried, and the one whose weighted
/// least-squares scale `Σwxl / Σwl²` explains the most (`(Σwxl)²/Σwl²`) wins.
pub(super) fn make_qx_quants(x: &[f32], nmax: i32, out: &mut [i8]) -> f32 {
    let (max, amax) = signed_max(x);
    if amax < GROUP_MAX_EPS {
        out.fill(0);
        return 0.0;
    }
    let quant = |iscale: f32, v: f32| nearest_int(iscale * v).clamp(-nmax, nmax - 1);
    // Σ w·x·l and Σ w·l² for one inverse scale, with w = x².
    let sums = |iscale: f32| {
        let (mut sumlx, mut suml2) = (0f32, 0f32);
        for &v in x {
            let l = quant(iscale, v) as f32;
            let w = v * v;
            sumlx += w * v * l;
            suml2 += w * l * l;
        }
        (sumlx, suml2)
    };
    let iscale = -(nmax as f32) / max;
    for (o, &v) in out.iter_mut().zip(x) {
        *o = (quant(iscale, v) + nmax) as i8;
    }
    let (sumlx, suml2) = sums(iscale);
    let mut scale = if suml2 != 0.0 { sumlx / suml2 } else { 0.0 };
    let mut best = scale * sumlx;
    for is in -9..=9 {
        if is == 0 {
            continue;
        }
        let iscale = -(nmax as f32 + 0.1 * is as f32) / max;
        let (sumlx, suml2) = sums(iscale);
        if suml2 > 0.0 && sumlx * sumlx > best * suml2 {
            for (o, &v) in out.iter_mut().zip(x) {
                *o = (quant(iscale, v) + nmax) as i8;
            }
            scale = sumlx / suml2;
            best = scale * sumlx;
        }
    }
    scale
}

/// ggml's `make_q3_quants` with `do_rmse`: signed quants `l` in `−nmax..nmax` stored in `out`
/// as `l + nmax`; returns the group scale.
///
/// Starts from `iscale = −nmax/max`, then runs up to five passes of coordinate descent: each
/// value in turn moves to the level its own least-squares fit (all other values fixed)
/// suggests, if that improves `(Σwxl)²/Σwl²` (weights `w = x²`).
pub(super) fn make_q3_quants(x: &[f32], nmax: i32, out: &mut [i8]) -> f32 {
    let (max, amax) = signed_max(x);
    if amax < GROUP_MAX_EPS {
        out.fill(0);
        return 0.0;
    }
    let iscale = -(nmax as f32) / max;
    let mut sumlx = 0f32;
    let mut suml2 = 0f32;
    let mut l = [0i32; 16];
    for (li, &v) in l.iter_mut().zip(x) {
        *li = nearest_int(iscale * v).clamp(-nmax, nmax - 1);
        let w = v * v;
        let lf = *li as f32;
        sumlx += w * v * lf;
        suml2 += w * lf * lf;
    }
    for _ in 0..5 {
        let mut changed = false;
        for (li, &v) in l.iter_mut().zip(x) {
            let w = v * v;
            let lf = *li as f32;
            let mut slx = sumlx - w * v * lf;
            if slx > 0.0 {
                let mut sl2 = suml2 - w * lf * lf;
                let new_l = nearest_int(v * sl2 / slx).clamp(-nmax, nmax - 1);
                if new_l != *li {
                    let nf = new_l as f32;
                    slx += w * v * nf;
                    sl2 += w * nf * nf;
                    if sl2 > 0.0 && slx * slx * suml2 > sumlx * sumlx * sl2 {
                        *li = new_l;
                        sumlx = slx;
                        suml2 = sl2;
                        changed = true;
                    }
                }
            }
        }
        if !changed {
            break;
        }
    }
    for (o, &li) in out.iter_mut().zip(&l) {
        *o = (li + nmax) as i8;
    }
    if suml2 > 0.0 {
        sumlx / suml2
    } else {
        0.0
    }
}

/// ggml's `make_qkx2_quants`: unsigned quants `0..=nmax` in `l` (`laux` is scratch of the
/// same length) approximating `x` as `scale·l − min`; returns `(scale, min)` with `min ≥ 0`.
///
/// The first fit spans `[min(x, 0), max(x)]`; then for `is = 0..=nstep` the inverse scale
/// `(rmin + rdelta·is + nmax)/(max − min)` assigns levels, a weighted least-squares fit of
/// scale and offset (offset clamped to `≤ 0`) is computed for them, and the fit with the
/// smallest weighted error (absolute if `use_mad`, else squared) is kept.
#[allow(clippy::too_many_arguments)]
pub(super) fn make_qkx2_quants(
    x: &[f32],
    weights: &[f32],
    nmax: i32,
    l: &mut [u8],
    laux: &mut [u8],
    rmin: f32,
    rdelta: f32,
    nstep: i32,
    use_mad: bool,
) -> (f32, f32) {
    let n = x.len();
    let mut min = x[0];
    let mut max = x[0];
    let mut sum_w = weights[0];
    let mut sum_x = sum_w * x[0];
    for i in 1..n {
        if x[i] < min {
            min = x[i];
        }
        if x[i] > max {
            max = x[i];
        }
        let w = weights[i];
        sum_w += w;
        sum_x += w * x[i];
    }
    if min > 0.0 {
        min = 0.0;
    }
    if max == min {
        l[..n].fill(0);
        return (0.0, -min);
    }
    let error = |diff: f32| if use_mad { diff.abs() } else { diff * diff };
    let mut iscale = nmax as f32 / (max - min);
    let mut scale = 1.0 / iscale;
    let mut best_error = 0f32;
    for i in 0..n {
        let q = nearest_int(iscale * (x[i] - min)).clamp(0, nmax);
        l[i] = q as u8;
        let diff = scale * q as f32 + min - x[i];
        best_error += weights[i] * error(diff);
    }
    if nstep < 1 {
        return (scale, -min);
    }
    for is in 0..=nstep {
        iscale = (rmin + rdelta * is as f32 + nmax as f32) / (max - min);
        let (mut sum_l, mut sum_l2, mut sum_xl) = (0f32, 0f32, 0f32);
        for i in 0..n {
            let q = nearest_int(iscale * (x[i] - min)).clamp(0, nmax);
            laux[i] = q as u8;
            let w = weights[i];
            let lf = q as f32;
            sum_l += w * lf;
            sum_l2 += w * lf * lf;
            sum_xl += w * lf * x[i];
        }
        let det = sum_w * sum_l2 - sum_l * sum_l;
        if det > 0.0 {
            let mut this_scale = (sum_w * sum_xl - sum_x * sum_l) / det;
            let mut this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det;
            if this_min > 0.0 {
                this_min = 0.0;
                this_scale = sum_xl / sum_l2;
            }
            let mut cur_error = 0f32;
            for i in 0..n {
                let diff = this_scale * f32::from(laux[i]) + this_min - x[i];
                cur_error += weights[i] * error(diff);
            }
            if cur_error < best_error {
                l[..n].copy_from_slice(&laux[..n]);
                best_error = cur_error;
                scale = this_scale;
                min = this_min;
            }
        }
    }
    (scale, -min)
}
