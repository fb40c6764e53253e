//! FLASH_ATTN_EXT: fused `softmax(q·kᵀ·scale (softcapped) + slope·mask) · v` with an online
//! softmax, f32 queries and f32/f16 keys and values.
//!
//! Output `[Dv, n_head, n_q, n_seq]`. Key/value heads are shared by `n_head / n_head_kv` query
//! heads (GQA). All arithmetic is f32 (ggml converts q to f16 for f16 keys; we do not).

use super::par_ranges;
use super::quant_dot::dot_f32;
use super::softmax::alibi_slope;
use super::view::RawTensor;
use crate::error::Result;

/// FLASH_ATTN_EXT over q `[D, n_q, n_head, n_seq]`, k `[D, n_kv, n_head_kv, n_seq_kv]`,
/// v `[Dv, n_kv, n_head_kv, n_seq_kv]` and an optional mask `[n_kv, ≥n_q, m2, m3]`.
#[allow(clippy::too_many_arguments)]
pub fn flash_attn_ext(
    dst: RawTensor,
    q: RawTensor,
    k: RawTensor,
    v: RawTensor,
    mask: Option<RawTensor>,
    scale: f32,
    max_bias: f32,
    logit_softcap: f32,
) -> Result<()> {
    let (d, n_q, n_head, n_seq) = (q.ne[0], q.ne[1], q.ne[2], q.ne[3]);
    let (n_kv, dv) = (k.ne[1], v.ne[0]);
    let rk2 = n_head / k.ne[2].max(1);
    let rk3 = n_seq / k.ne[3].max(1);
    let scale = if logit_softcap != 0.0 {
        scale / logit_softcap
    } else {
        scale
    };
    let tasks = n_q * n_head * n_seq;
    let grain = (1usize << 16).div_ceil((n_kv * (d + dv)).max(1)).max(1);
    par_ranges(tasks, grain, |range| {
        let mut kf = Vec::new();
        let mut vf = Vec::new();
        let mut head: Option<(usize, usize)> = None;
        let mut qrow = vec![0f32; d];
        let mut mrow = vec![0f32; if mask.is_some() { n_kv } else { 0 }];
        let mut acc = vec![0f32; dv];
        for t in range {
            let iq1 = t % n_q;
            let iq2 = (t / n_q) % n_head;
            let iq3 = t / (n_q * n_head);
            let (ik2, ik3) = (iq2 / rk2.max(1), iq3 / rk3.max(1));
            if head != Some((ik2, ik3)) {
                kf.resize(n_kv * d, 0.0);
                vf.resize(n_kv * dv, 0.0);
                for ic in 0..n_kv {
                    // SAFETY: rows (ic, ik2, ik3) lie inside k and v (builder shape checks),
                    // which are read-only here.
                    unsafe {
                        k.load_row(ic, ik2, ik3, &mut kf[ic * d..(ic + 1) * d])?;
                        v.load_row(ic, ik2, ik3, &mut vf[ic * dv..(ic + 1) * dv])?;
                    }
                }
                head = Some((ik2, ik3));
            }
            // SAFETY: the query row and mask row lie inside their tensors (read-only).
            unsafe {
                q.load_row(iq1, iq2, iq3, &mut qrow)?;
                if let Some(m) = &mask {
                    m.load_row(iq1, iq2 % m.ne[2], iq3 % m.ne[3], &mut mrow)?;
                }
            }
            let slope = alibi_slope(max_bias, n_head, iq2);
            let mut running_max = f32::NEG_INFINITY;
            let mut sum = 0f32;
            acc.iter_mut().for_each(|x| *x = 0.0);
            for ic in 0..n_kv {
                let mv = if mask.is_some() {
                    slope * mrow[ic]
                } else {
                    0.0
                };
                if mv == f32::NEG_INFINITY {
                    continue;
                }
                let mut s = dot_f32(&qrow, &kf[ic * d..(ic + 1) * d]) * scale;
                if logit_softcap != 0.0 {
                    s = logit_softcap * s.tanh();
                }
                s += mv;
                let vs;
                if s > running_max {
                    let ms = (running_max - s).exp();
                    running_max = s;
                    acc.iter_mut().for_each(|x| *x *= ms);
                    sum *= ms;
                    vs = 1.0;
                } else {
                    vs = (s - running_max).exp();
                }
                acc.iter_mut()
                    .zip(&vf[ic * dv..(ic + 1) * dv])
                    .for_each(|(a, &x)| *a += x * vs);
                sum += vs;
            }
            let inv = if sum == 0.0 { 0.0 } else { 1.0 / sum };
            acc.iter_mut().for_each(|x| *x *= inv);
            // SAFETY: dst row (iq2, iq1, iq3) belongs to this task only.
            unsafe { dst.store_row(iq2, iq1, iq3, &acc)? };
        }
        Ok(())
    })
}
