//! ROPE: rotary position embeddings, normal and NeoX layouts, f32 and f16, with frequency
//! scaling, YaRN (ext_factor, attn_factor, beta_fast/beta_slow via ggml's corr-dims formula)
//! and optional per-pair frequency factors.
//!
//! `theta_i = pos · freq_base^(−2i/n_dims) / freq_factor_i`; dimensions past `n_dims` are
//! copied. Rows are read before they are written, so ROPE may run in place.

use super::view::RowIo;
use std::f32::consts::PI;

use super::view::{read_index, RawTensor};
use super::{par_ranges, row_grain};
use crate::error::Result;
use crate::ops::{RopeMode, RopeParams};

fn corr_dim(n_dims: usize, n_ctx_orig: usize, n_rot: f32, base: f32) -> f32 {
    n_dims as f32 * (n_ctx_orig as f32 / (n_rot * 2.0 * PI)).ln() / (2.0 * base.ln())
}

/// ggml's YaRN correction range `[start, end]` in dimension pairs.
pub fn yarn_corr_dims(p: &RopeParams) -> [f32; 2] {
    let start = corr_dim(p.n_dims, p.n_ctx_orig, p.beta_fast, p.freq_base).floor();
    let end = corr_dim(p.n_dims, p.n_ctx_orig, p.beta_slow, p.freq_base).ceil();
    [start.max(0.0), end.min(p.n_dims as f32 - 1.0)]
}

fn yarn_ramp(low: f32, high: f32, i0: usize) -> f32 {
    let y = ((i0 / 2) as f32 - low) / (high - low).max(0.001);
    1.0 - y.clamp(0.0, 1.0)
}

/// Fills `cache` with (cos, sin) per pair for position `pos`.
fn fill_cache(p: &RopeParams, corr: [f32; 2], ff: Option<&[f32]>, pos: f32, cache: &mut [f32]) {
    let theta_scale = p.freq_base.powf(-2.0 / p.n_dims as f32);
    let mut theta = pos;
    for i0 in (0..p.n_dims).step_by(2) {
        let factor = ff.map_or(1.0, |f| f[i0 / 2]);
        let theta_extrap = theta / factor;
        let theta_interp = p.freq_scale * theta_extrap;
        let mut angle = theta_interp;
        let mut mscale = p.attn_factor;
        if p.ext_factor != 0.0 {
            let ramp_mix = yarn_ramp(corr[0], corr[1], i0) * p.ext_factor;
            angle = theta_interp * (1.0 - ramp_mix) + theta_extrap * ramp_mix;
            mscale *= 1.0 + 0.1 * (1.0 / p.freq_scale).ln();
        }
        cache[i0] = angle.cos() * mscale;
        cache[i0 + 1] = angle.sin() * mscale;
        theta *= theta_scale;
    }
}

/// ROPE of `a` `[ne0, n_head, n_tokens, ne3]` at i32 positions `pos` (one per token).
pub fn rope(
    dst: RawTensor,
    a: RawTensor,
    pos: RawTensor,
    freq_factors: Option<RawTensor>,
    p: &RopeParams,
) -> Result<()> {
    let n0 = a.ne[0];
    let corr = yarn_corr_dims(p);
    let mut ff = Vec::new();
    if let Some(f) = freq_factors {
        ff = vec![0f32; p.n_dims / 2];
        // SAFETY: the builder checked the factors hold at least n_dims/2 entries (read-only).
        unsafe { f.load_row(0, 0, 0, &mut ff)? };
    }
    let ff = freq_factors.map(|_| ff.as_slice());
    let half = p.n_dims / 2;
    par_ranges(a.nrows(), row_grain(n0), |rows| {
        let mut x = vec![0f32; n0];
        let mut y = vec![0f32; n0];
        let mut cache = vec![0f32; p.n_dims];
        let mut cached: Option<usize> = None;
        for r in rows {
            let (i1, i2, i3) = a.row_coords(r);
            if cached != Some(i2) {
                // SAFETY: the positions hold ne2 entries (builder check), read-only.
                let position = unsafe { read_index(pos.dtype, pos.at(pos.offset(i2, 0, 0, 0))) };
                fill_cache(p, corr, ff, position as f32, &mut cache);
                cached = Some(i2);
            }
            // SAFETY: the row lies inside `a` and `dst`; it is read before this task, its only
            // writer, stores it.
            unsafe { a.load_row(i1, i2, i3, &mut x)? };
            y.copy_from_slice(&x);
            for i0 in (0..p.n_dims).step_by(2) {
                let (c, s) = (cache[i0], cache[i0 + 1]);
                let (j0, j1) = match p.mode {
                    RopeMode::Normal => (i0, i0 + 1),
                    RopeMode::Neox => (i0 / 2, i0 / 2 + half),
                };
                let (x0, x1) = (x[j0], x[j1]);
                y[j0] = x0 * c - x1 * s;
                y[j1] = x0 * s + x1 * c;
            }
            // SAFETY: as above.
            unsafe { dst.store_row(i1, i2, i3, &y)? };
        }
        Ok(())
    })
}
