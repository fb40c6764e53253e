//! FLASH_ATTN_EXT: fused `softmax(q·kᵀ·scale (softcapped) + slope·mask) · v`, f32 queries and
//! f32/f16 keys and values.
//!
//! Output `[Dv, n_head, n_q, n_seq]`. Key/value heads are shared by `n_head / n_head_kv` query
//! heads (GQA). Each task takes one head and a block of up to [`Q_BLOCK`] queries: their scores
//! against every key come from the GEMM micro-kernels (keys read in place as the "weights"),
//! each score row is soft-maxed in a per-thread buffer, and the probabilities times the values
//! (values read in place through strides, as transposed weights) are written straight into the
//! output rows. Nothing of size `n_q × n_kv` per head is materialised in the graph, and no
//! head is copied. All arithmetic is f32 (ggml converts q to f16 for f16 keys; we do not).

use std::cell::RefCell;

use super::gemm::{self, F32Rows, Isa, Product, WeightRows};
use super::math;
use super::par_ranges;
use super::softmax::{alibi_slope, soft_max_row};
use super::view::RawTensor;
use crate::dtype::DType;
use crate::error::Result;

/// Queries per task: a multiple of every GEMM tile height, small enough that a task's scores
/// (`Q_BLOCK × n_kv`) stay in L1/L2.
const Q_BLOCK: usize = 32;

/// Per-thread buffers: scores/probabilities, packed queries and one mask row.
#[derive(Default)]
struct Scratch {
    scores: Vec<f32>,
    queries: Vec<f32>,
    mask: Vec<f32>,
}

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
}

/// Whether `t`'s rows are dense, aligned f32 with 4-byte-multiple strides (read in place).
fn f32_rows(t: &RawTensor) -> bool {
    t.dtype == DType::F32
        && (t.ne[0] <= 1 || t.nb[0] == 4)
        && (t.ptr.0 as usize).is_multiple_of(4)
        && t.nb[1..].iter().all(|s| s % 4 == 0)
}

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
    let q_blocks = n_q.div_ceil(Q_BLOCK);
    let tasks = q_blocks * n_head * n_seq;
    let isa = Isa::best();
    let q_direct = f32_rows(&q);
    let dst_direct = f32_rows(&dst);
    par_ranges(tasks, 1, |range| {
        // Taken out of the thread-local for the range (see `gemm::with_scratch`): a nested
        // parallel row conversion may run another task on this thread meanwhile.
        let mut scratch = SCRATCH.with(RefCell::take);
        let result = (|| -> Result<()> {
            let Scratch {
                scores,
                queries,
                mask: mrow,
            } = &mut scratch;
            for t in range {
                let qb = t % q_blocks;
                let iq2 = (t / q_blocks) % n_head;
                let iq3 = t / (q_blocks * n_head);
                let (ik2, ik3) = (iq2 / rk2.max(1), iq3 / rk3.max(1));
                let q0 = qb * Q_BLOCK;
                let rows = Q_BLOCK.min(n_q - q0);
                // Queries: in place when they are dense f32 rows, else converted.
                let queries_rows = if q_direct {
                    F32Rows {
                        // SAFETY: query row (q0, iq2, iq3) lies inside q.
                        ptr: unsafe { q.at(q.row_offset(q0, iq2, iq3)) }.cast::<f32>(),
                        row_stride: q.nb[1] / 4,
                    }
                } else {
                    queries.resize(rows * d, 0.0);
                    for (r, out) in queries.chunks_exact_mut(d.max(1)).enumerate().take(rows) {
                        // SAFETY: query row (q0 + r, iq2, iq3) lies inside q (read-only).
                        unsafe { q.load_row(q0 + r, iq2, iq3, out)? };
                    }
                    F32Rows {
                        ptr: queries.as_ptr(),
                        row_stride: d,
                    }
                };
                // Scores: rows × n_kv, q · kᵀ with the keys as weight rows.
                scores.resize(rows * n_kv, 0.0);
                let product = Product {
                    weights: WeightRows::of(&k, (ik2, ik3)),
                    b: queries_rows,
                    dst: scores.as_mut_ptr(),
                    dst_stride: n_kv,
                };
                // SAFETY: the keys of head (ik2, ik3) are n_kv rows of d inside k, the queries
                // `rows` rows of d; `scores` holds rows × n_kv values owned by this task.
                unsafe { gemm::run_serial(isa, (n_kv, rows, d), &product)? };
                mrow.resize(if mask.is_some() { n_kv } else { 0 }, 0.0);
                let slope = alibi_slope(max_bias, n_head, iq2);
                for (r, x) in scores.chunks_exact_mut(n_kv.max(1)).enumerate().take(rows) {
                    if let Some(m) = &mask {
                        // SAFETY: the mask row lies inside the mask (builder checks).
                        unsafe { m.load_row(q0 + r, iq2 % m.ne[2], iq3 % m.ne[3], mrow)? };
                    }
                    for (i, s) in x.iter_mut().enumerate() {
                        let mut v = *s * scale;
                        if logit_softcap != 0.0 {
                            v = logit_softcap * v.tanh();
                        }
                        if mask.is_some() {
                            v += slope * mrow[i];
                        }
                        *s = v;
                    }
                    if math::max_f32(x) == f32::NEG_INFINITY {
                        // Every key masked: no probability mass, a zero output row.
                        x.iter_mut().for_each(|v| *v = 0.0);
                    } else {
                        soft_max_row(x, None, 1.0);
                    }
                }
                // Output rows (iq2, q0 + r, iq3) = probabilities · values; the values are the
                // "weights" with rows along Dv and elements along the keys (strided view).
                // SAFETY: element (0, 0, ik2, ik3) lies inside v.
                let v_base = unsafe { v.at(v.row_offset(0, ik2, ik3)) }.cast_const();
                let values = WeightRows::Convert {
                    dtype: v.dtype,
                    ptr: v_base,
                    row_bytes: v.nb[0],
                    elem_bytes: v.nb[1],
                };
                let probs = F32Rows {
                    ptr: scores.as_ptr(),
                    row_stride: n_kv,
                };
                if dst_direct {
                    let product = Product {
                        weights: values,
                        b: probs,
                        // SAFETY: dst row (iq2, q0, iq3) lies inside dst.
                        dst: unsafe { dst.at(dst.row_offset(iq2, q0, iq3)) }.cast::<f32>(),
                        dst_stride: dst.nb[2] / 4,
                    };
                    // SAFETY: v's elements (i, ic) for i < dv, ic < n_kv lie inside v; the
                    // output rows (iq2, q0 + r, iq3), r < rows, belong to this task alone.
                    unsafe { gemm::run_serial(isa, (dv, rows, n_kv), &product)? };
                } else {
                    let mut out = vec![0f32; rows * dv];
                    let product = Product {
                        weights: values,
                        b: probs,
                        dst: out.as_mut_ptr(),
                        dst_stride: dv,
                    };
                    // SAFETY: as above, into a local buffer.
                    unsafe { gemm::run_serial(isa, (dv, rows, n_kv), &product)? };
                    for (r, row) in out.chunks_exact(dv.max(1)).enumerate() {
                        // SAFETY: dst row (iq2, q0 + r, iq3) belongs to this task only.
                        unsafe { dst.store_row(iq2, q0 + r, iq3, row)? };
                    }
                }
            }
            Ok(())
        })();
        SCRATCH.with(|cell| cell.replace(scratch));
        result
    })
}
