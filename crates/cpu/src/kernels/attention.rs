//! FLASH_ATTN_EXT: fused `softmax(q·kᵀ·scale (softcapped) + slope·mask) · v`, f32 queries and
//! f32/f16 keys and values.
//!
//! Output `[Dv, n_head, n_q, n_seq]`. Key/value heads are shared by `n_head / n_head_kv` query
//! heads (GQA). One task takes the query heads that share one key/value head and a run of
//! their queries (at most [`Q_CHUNK`] rows in all), so a decoding step converts each key/value
//! head once, not once per query head. The keys are visited in blocks of [`key_block`] keys (sized so the block's keys and values stay in L1):
//! each block's keys are transposed once into a per-thread buffer, then every group of
//! [`ROWS`] queries gets its scores against the block from a register-tiled product (queries
//! broadcast from their rows in place, keys along the vector lanes), an online-softmax update
//! (running max and sum per query; earlier partial outputs rescaled when the max grows), and
//! the probabilities times the block's values (read in place through their row stride when
//! they are f32) added to the query's output accumulator. Queries, keys and values are read
//! through their strides, so the graph can hand over permuted views of the projections: no
//! head is copied and nothing of size `n_q × n_kv` is materialised. A key block that the mask
//! hides (−∞) from every row of a task is skipped, as ggml skips −∞ mask entries: the keys
//! past a decoding step's position in a padded cache window cost nothing.
//!
//! The tiles run in explicit AVX-512F when the CPU has it, otherwise as plain loops compiled
//! for AVX2+FMA (auto-vectorised) or the baseline target. A decoding step's few rows take the
//! keys and values as stored instead (no transpose), through explicit AVX2/FMA/F16C tiles for
//! f16 and f32 rows (a q8_0 cache's rows dequantized first) that prefetch the strided rows
//! ahead. All arithmetic is f32; the families round differently (fused vs separate
//! multiply-adds, lane order of the sums); each is within 1e-5 (absolute) of an f64
//! reference on data in [−1, 1] (tests). Tasks do not depend on the thread count, so neither
//! do the results.

use super::view::RowIo;
use std::cell::RefCell;

use super::math;
#[cfg(target_arch = "x86_64")]
use super::simd::{Avx2, Avx512};
use super::softmax::alibi_slope;
use super::view::{load_f32, RawTensor};
use super::{par_ranges, par_ranges_streaming};
use crate::dtype::DType;
use crate::error::Result;

/// Query rows (queries × heads of a group) per task. A task transposes each key block once for
/// all its rows.
const Q_CHUNK: usize = 128;

/// Largest row count of a task that takes scores as dot products with the key rows as stored
/// (a decoding step: the few query heads of one group) instead of transposing each key block
/// for a register tile: the transpose costs more than it saves for so few rows.
const DIRECT_ROWS: usize = 8;

/// Queries per register tile (scores: 6 queries × 64 keys in 24 zmm accumulators; output:
/// 6 queries × 64 values).
const ROWS: usize = 6;

/// Keys per block for head sizes `d` and `dv`: the block's transposed keys and its values
/// take about 32 KiB, a multiple of 16 between 16 and 256.
fn key_block(d: usize, dv: usize) -> usize {
    let kb = 8192 / (d + dv).max(1);
    kb.clamp(16, 256) / 16 * 16
}

/// The kernel families of this module.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kernels {
    /// Plain loops (auto-vectorised for AVX2+FMA when the CPU has them).
    Generic,
    /// Explicit AVX-512F tiles.
    Avx512,
}

impl Kernels {
    /// The fastest family this CPU runs (detected once).
    pub(crate) fn best() -> Kernels {
        *Kernels::available().last().unwrap_or(&Kernels::Generic)
    }

    /// Every family this CPU runs, slowest first.
    pub(crate) fn available() -> Vec<Kernels> {
        let mut out = vec![Kernels::Generic];
        #[cfg(target_arch = "x86_64")]
        if has_avx512f() {
            out.push(Kernels::Avx512);
        }
        out
    }
}

/// Whether the CPU has AVX-512F.
pub(crate) fn has_avx512f() -> bool {
    crate::isa::get().avx512f()
}

/// Per-thread buffers.
#[derive(Default)]
struct Scratch {
    /// Transposed key block: `d × kbp` (key index along rows, zero-padded to `kbp`).
    keys_t: Vec<f32>,
    /// One key row converted to f32.
    key_row: Vec<f32>,
    /// The block's keys converted to f32 (`kb × d`, row-major) for the direct path.
    keys: Vec<f32>,
    /// The block's values converted to f32 (`kb × dv`) when they cannot be read in place.
    values: Vec<f32>,
    /// The task's queries converted to f32 (`Q_CHUNK × d`) when they cannot be read in place.
    queries: Vec<f32>,
    /// Scores, then probabilities, of one query group against the block (`ROWS × kbp`).
    scores: Vec<f32>,
    /// Output accumulators (`Q_CHUNK × dv`).
    acc: Vec<f32>,
    /// Running max and sum of each query's scores.
    max: Vec<f32>,
    sum: Vec<f32>,
    /// One mask row segment converted to f32.
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

/// Whether `t`'s rows are dense, aligned f16 values with 2-byte-multiple strides, and the CPU
/// has AVX2, FMA and F16C (the direct path then reads them in place).
fn f16_rows(t: &RawTensor) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        t.dtype == DType::F16
            && (t.ne[0] <= 1 || t.nb[0] == 2)
            && (t.ptr.0 as usize).is_multiple_of(2)
            && t.nb[1..].iter().all(|s| s % 2 == 0)
            && super::quant_dot::has_f16c()
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = t;
        false
    }
}

/// The operands and settings of one FLASH_ATTN_EXT call.
struct Attention {
    q: RawTensor,
    k: RawTensor,
    v: RawTensor,
    dst: RawTensor,
    mask: Option<RawTensor>,
    scale: f32,
    max_bias: f32,
    softcap: f32,
    kernels: Kernels,
    kb: usize,
    q_direct: bool,
    k_direct: bool,
    v_direct: bool,
    dst_direct: bool,
    mask_direct: bool,
    /// Keys / values are dense f16 rows read in place by the F16C direct path (few rows).
    k_f16: bool,
    v_f16: bool,
    /// The CPU runs the direct path's SIMD tiles ([`f16c`]: AVX2, FMA, F16C), which then
    /// also take f32 rows (in place or dequantized into the scratch).
    simd_direct: bool,
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
    flash_attn_ext_with(
        Kernels::best(),
        dst,
        q,
        k,
        v,
        mask,
        scale,
        max_bias,
        logit_softcap,
    )
}

/// [`flash_attn_ext`] with the tiles of `kernels` (which the CPU must run).
#[allow(clippy::too_many_arguments)]
pub(crate) fn flash_attn_ext_with(
    kernels: Kernels,
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
    let dv = v.ne[0];
    // softcap·tanh(s·scale/softcap) is what ggml computes for a non-zero softcap.
    let scale = if logit_softcap != 0.0 {
        scale / logit_softcap
    } else {
        scale
    };
    let att = Attention {
        q,
        k,
        v,
        dst,
        mask,
        scale,
        max_bias,
        softcap: logit_softcap,
        kernels,
        kb: key_block(d, dv),
        q_direct: f32_rows(&q),
        k_direct: f32_rows(&k),
        v_direct: f32_rows(&v),
        dst_direct: f32_rows(&dst),
        mask_direct: mask.as_ref().is_some_and(f32_rows),
        k_f16: f16_rows(&k),
        v_f16: f16_rows(&v),
        simd_direct: cfg!(target_arch = "x86_64") && super::quant_dot::has_f16c(),
    };
    // The query heads that share one key/value head are one task's rows, so each key block
    // is converted and transposed once for the whole group.
    let group = n_head / att.k.ne[2].max(1);
    let q_chunk = (Q_CHUNK / group.max(1)).max(1);
    let chunks = n_q.div_ceil(q_chunk);
    let groups = n_head / group.max(1);
    let tasks = chunks * groups * n_seq;
    let task_rows = group * q_chunk.min(n_q);
    // A decoding step's few rows visit only the keys some row sees (a padded cache window's
    // hidden tail is no task's or part's work); many rows see nearly every key.
    let live = if task_rows <= DIRECT_ROWS {
        // SAFETY: the operands are the op's checked host tensors.
        unsafe { att.live_keys()? }
    } else {
        att.k.ne[1]
    };
    let splits = key_splits(live, att.kb, task_rows);
    if splits > 1 {
        return att.split_keys(chunks, groups, q_chunk, (splits, live));
    }
    par_ranges(tasks, 1, |range| {
        // Taken out of the thread-local for the range: a nested parallel call could otherwise
        // find it borrowed.
        let mut scratch = SCRATCH.with(RefCell::take);
        let result = range.into_iter().try_for_each(|t| {
            let chunk = t % chunks;
            let ik2 = (t / chunks) % groups;
            let iq3 = t / (chunks * groups);
            let q0 = chunk * q_chunk;
            let rows = TaskRows {
                heads: ik2 * group..(ik2 + 1) * group,
                queries: q0..(q0 + q_chunk).min(n_q),
            };
            // SAFETY: the task's output rows (its heads × its queries, sequence iq3) are
            // written by this task alone; every other access is a read of a source.
            unsafe { att.task(&mut scratch, &rows, iq3, live) }
        });
        SCRATCH.with(|cell| cell.replace(scratch));
        result
    })
}

/// Keys per part when a decoding step's keys are split over tasks (a multiple of the key
/// block is used when that is larger).
const SPLIT_KEYS: usize = 128;

/// Into how many parts the `n_kv` keys of a task of `task_rows` query rows are split: several
/// for the few rows of a decoding step (the query heads of one key/value head, too few tasks
/// to keep every thread busy), one otherwise. It depends on the shape and on how many keys
/// the mask leaves visible (`Attention::live_keys`), never on the thread count, so the
/// results do not either.
fn key_splits(n_kv: usize, kb: usize, task_rows: usize) -> usize {
    if task_rows > DIRECT_ROWS {
        return 1;
    }
    let per = SPLIT_KEYS.max(kb).next_multiple_of(kb.max(1));
    n_kv.div_ceil(per.max(1)).max(1)
}

/// The query rows of one task: every query of `queries` in every head of `heads` (heads that
/// share one key/value head), row `r` = head `heads.start + r / n`, query `queries.start +
/// r % n` with `n = queries.len()`.
struct TaskRows {
    heads: std::ops::Range<usize>,
    queries: std::ops::Range<usize>,
}

impl TaskRows {
    fn len(&self) -> usize {
        self.heads.len() * self.queries.len()
    }

    /// (head, query) of row `r`.
    fn at(&self, r: usize) -> (usize, usize) {
        let n = self.queries.len();
        (self.heads.start + r / n, self.queries.start + r % n)
    }
}

impl Attention {
    /// The query rows of `rows` (sequence `iq3`) against the first `live` keys of their
    /// shared key/value head (the rest hidden from every row, see [`Attention::live_keys`]).
    ///
    /// # Safety
    /// The operands must be valid host tensors of the shapes the op builder checked, and no
    /// other task may touch the output rows of these queries.
    unsafe fn task(&self, s: &mut Scratch, rows: &TaskRows, iq3: usize, live: usize) -> Result<()> {
        // SAFETY: forwarded from the caller.
        unsafe {
            self.accumulate(s, rows, iq3, 0..live)?;
            self.store(s, rows, iq3)
        }
    }

    /// Runs the query rows of `rows` (sequence `iq3`) over the keys `keys` of their shared
    /// key/value head, leaving each row's running max, sum and unnormalised output in `s`.
    ///
    /// # Safety
    /// As [`Attention::task`]; nothing is written outside `s`.
    unsafe fn accumulate(
        &self,
        s: &mut Scratch,
        rows: &TaskRows,
        iq3: usize,
        keys: std::ops::Range<usize>,
    ) -> Result<()> {
        let (q, k, v) = (&self.q, &self.k, &self.v);
        let (d, n_head, n_seq) = (q.ne[0], q.ne[2], q.ne[3]);
        let dv = v.ne[0];
        let nr = rows.len();
        let ik2 = rows.heads.start / (n_head / k.ne[2].max(1)).max(1);
        let ik3 = iq3 / (n_seq / k.ne[3].max(1)).max(1);

        // The rows' queries as dense f32 rows (rows of different heads are not one stride
        // apart in q, and the copy is small beside the work on them).
        s.queries.resize(nr * d, 0.0);
        for (r, out) in s.queries.chunks_exact_mut(d.max(1)).enumerate().take(nr) {
            let (h, iq) = rows.at(r);
            if self.q_direct {
                // SAFETY: query row (iq, h, iq3) holds d readable f32 values inside q.
                let src = unsafe {
                    std::slice::from_raw_parts(q.at(q.row_offset(iq, h, iq3)).cast::<f32>(), d)
                };
                out.copy_from_slice(src);
            } else {
                // SAFETY: query row (iq, h, iq3) lies inside q (read-only).
                unsafe { q.load_row(iq, h, iq3, out)? };
            }
        }
        s.acc.clear();
        s.acc.resize(nr * dv, 0.0);
        s.max.clear();
        s.max.resize(nr, f32::NEG_INFINITY);
        s.sum.clear();
        s.sum.resize(nr, 0.0);

        let mut kb0 = keys.start;
        while kb0 < keys.end {
            let kbn = self.kb.min(keys.end - kb0);
            let kbp = kbn.next_multiple_of(16);
            // SAFETY: the mask segments of these rows and keys lie inside the mask.
            if unsafe { self.block_masked(&mut s.mask, rows, iq3, kb0, kbn)? } {
                // Every key of the block is masked out (−∞) for every row: it adds nothing.
                kb0 += kbn;
                continue;
            }
            let direct = nr <= DIRECT_ROWS;
            let (k_ptr, k_stride) = if !direct {
                // SAFETY: keys kb0..kb0 + kbn of head (ik2, ik3) lie inside k.
                unsafe { self.transpose_keys(s, kb0, kbn, kbp, ik2, ik3)? };
                (std::ptr::null(), 0)
            } else if self.k_direct || self.k_f16 {
                // SAFETY: key row (kb0, ik2, ik3) lies inside k.
                let p = unsafe { k.at(k.row_offset(kb0, ik2, ik3)) }.cast_const();
                (p.cast::<f32>(), k.nb[1] / k.dtype.type_size())
            } else {
                s.keys.resize(kbn * d, 0.0);
                for (j, out) in s.keys.chunks_exact_mut(d.max(1)).enumerate().take(kbn) {
                    // SAFETY: key row (kb0 + j, ik2, ik3) lies inside k (read-only).
                    unsafe { k.load_row(kb0 + j, ik2, ik3, out)? };
                }
                (s.keys.as_ptr(), d)
            };
            let v_f16 = direct && self.v_f16;
            let (v_ptr, v_stride) = if self.v_direct || v_f16 {
                // SAFETY: value row (kb0, ik2, ik3) lies inside v.
                let p = unsafe { v.at(v.row_offset(kb0, ik2, ik3)) }.cast_const();
                (p.cast::<f32>(), v.nb[1] / v.dtype.type_size())
            } else {
                s.values.resize(kbn * dv, 0.0);
                for (j, out) in s.values.chunks_exact_mut(dv.max(1)).enumerate().take(kbn) {
                    // SAFETY: value row (kb0 + j, ik2, ik3) lies inside v (read-only).
                    unsafe { v.load_row(kb0 + j, ik2, ik3, out)? };
                }
                (s.values.as_ptr(), dv)
            };
            // f16 rows are read through `v_ptr` alone, never through this f32 slice.
            let values = if v_f16 {
                &[][..]
            } else {
                // SAFETY: kbn value rows of dv f32 elements, v_stride apart, are readable (in
                // v or in the scratch buffer, not written while this slice lives).
                unsafe { std::slice::from_raw_parts(v_ptr, strided_len(kbn, v_stride, dv)) }
            };

            s.scores.resize(ROWS * kbp, 0.0);
            let mut r0 = 0;
            while r0 < nr {
                let tile_rows = ROWS.min(nr - r0);
                if direct && self.simd_direct {
                    #[cfg(target_arch = "x86_64")]
                    // SAFETY: the CPU has AVX2, FMA and F16C (`simd_direct`); kbn key rows of
                    // d values, k_stride elements apart, start at k_ptr (in k or in the
                    // scratch): f16 when `k_f16` (f16_rows checked the layout), else f32.
                    unsafe {
                        let queries = &s.queries[r0 * d..(r0 + tile_rows) * d];
                        if self.k_f16 {
                            let k16 = k_ptr.cast::<u16>();
                            f16c::scores(queries, d, k16, (k_stride, kbn), kbp, &mut s.scores)
                        } else {
                            f16c::scores(queries, d, k_ptr, (k_stride, kbn), kbp, &mut s.scores)
                        }
                    };
                } else if direct {
                    // SAFETY: kbn key rows of d elements, k_stride apart, are readable (in k
                    // or in the scratch buffer, not written while this slice lives).
                    let keys =
                        unsafe { std::slice::from_raw_parts(k_ptr, strided_len(kbn, k_stride, d)) };
                    scores_direct(
                        &s.queries[r0 * d..(r0 + tile_rows) * d],
                        d,
                        keys,
                        (k_stride, kbn),
                        kbp,
                        &mut s.scores,
                    );
                } else {
                    scores_tile(
                        self.kernels,
                        tile_rows,
                        &s.queries[r0 * d..],
                        d,
                        d,
                        &s.keys_t,
                        kbp,
                        &mut s.scores,
                    );
                }
                for r in 0..tile_rows {
                    let row_index = r0 + r;
                    let (h, iq) = rows.at(row_index);
                    let row = &mut s.scores[r * kbp..r * kbp + kbn];
                    // SAFETY: the mask row segment (kb0.., iq) lies inside the mask.
                    let mask_row = unsafe { self.mask_segment(&mut s.mask, iq, h, iq3, kb0, kbn)? };
                    let slope = alibi_slope(self.max_bias, n_head, h);
                    let block_max = prepare_scores(
                        self.kernels,
                        row,
                        self.scale,
                        self.softcap,
                        mask_row.map(|m| (m, slope)),
                    );
                    let old_max = s.max[row_index];
                    let new_max = old_max.max(block_max);
                    if new_max == f32::NEG_INFINITY {
                        // Every key so far masked: no probability mass yet.
                        row.iter_mut().for_each(|x| *x = 0.0);
                        continue;
                    }
                    let block_sum = exp_sub_sum(self.kernels, row, new_max);
                    if old_max == new_max {
                        s.sum[row_index] += block_sum;
                    } else {
                        // e^(−∞) = 0 when this is the first block with mass.
                        let alpha = math::exp(old_max - new_max);
                        s.sum[row_index] = s.sum[row_index] * alpha + block_sum;
                        s.acc[row_index * dv..(row_index + 1) * dv]
                            .iter_mut()
                            .for_each(|x| *x *= alpha);
                    }
                    s.max[row_index] = new_max;
                }
                let acc = &mut s.acc[r0 * dv..(r0 + tile_rows) * dv];
                #[cfg(target_arch = "x86_64")]
                if direct && self.simd_direct {
                    // SAFETY: the CPU has AVX2, FMA and F16C (`simd_direct`); kbn value rows of
                    // dv values, v_stride elements apart, start at v_ptr (in v or in the
                    // scratch): f16 when `v_f16` (f16_rows checked the layout), else f32.
                    unsafe {
                        if v_f16 {
                            let v16 = v_ptr.cast::<u16>();
                            f16c::values(&s.scores, kbp, v16, (v_stride, kbn), dv, acc)
                        } else {
                            f16c::values(&s.scores, kbp, v_ptr, (v_stride, kbn), dv, acc)
                        }
                    };
                    r0 += tile_rows;
                    continue;
                }
                values_tile(
                    self.kernels,
                    tile_rows,
                    &s.scores,
                    kbp,
                    values,
                    v_stride,
                    kbn,
                    dv,
                    acc,
                );
                r0 += tile_rows;
            }
            kb0 += kbn;
        }
        Ok(())
    }

    /// How many keys some query row sees: one past the last key the mask leaves visible to
    /// any row (−∞ hides a key, as the block skip reads it); every key without a mask, or
    /// when the mask hides them all (those rows keep their usual result).
    ///
    /// # Safety
    /// The operands must be valid host tensors of the shapes the op builder checked.
    unsafe fn live_keys(&self) -> Result<usize> {
        let n_kv = self.k.ne[1];
        let Some(m) = &self.mask else {
            return Ok(n_kv);
        };
        let (n_q, n_head, n_seq) = (self.q.ne[1], self.q.ne[2], self.q.ne[3]);
        let mut buf = Vec::new();
        let mut live = 0;
        // The mask broadcasts over heads and sequences: its own rows are enough.
        for iq3 in 0..n_seq.min(m.ne[3]) {
            for iq2 in 0..n_head.min(m.ne[2]) {
                for iq in 0..n_q {
                    // SAFETY: row iq of the mask holds n_kv values (checked by the builder).
                    let row = unsafe { self.mask_segment(&mut buf, iq, iq2, iq3, 0, n_kv)? };
                    if let Some(last) =
                        row.and_then(|r| r.iter().rposition(|&x| x != f32::NEG_INFINITY))
                    {
                        live = live.max(last + 1);
                    }
                    if live == n_kv {
                        return Ok(n_kv);
                    }
                }
            }
        }
        Ok(if live == 0 { n_kv } else { live })
    }

    /// The op with each task's first `live` keys (see [`Attention::live_keys`]; the rest are
    /// hidden from every row) split into `splits` parts (see [`key_splits`]): every (task,
    /// part) runs on its own, leaving its rows' max, sum and unnormalised output in a shared
    /// table; then each task's parts are merged in part order (rescaled to the largest max)
    /// and stored.
    fn split_keys(
        &self,
        chunks: usize,
        groups: usize,
        q_chunk: usize,
        (splits, live): (usize, usize),
    ) -> Result<()> {
        let (n_q, n_head, n_seq) = (self.q.ne[1], self.q.ne[2], self.q.ne[3]);
        let (n_kv, dv) = (self.k.ne[1], self.v.ne[0]);
        let group = n_head / groups.max(1);
        let tasks = chunks * groups * n_seq;
        // The parts cover the live keys; the keys after them are hidden from every row.
        let per = live.div_ceil(splits).next_multiple_of(self.kb.max(1));
        // Per (task, part): DIRECT_ROWS rows of [max, sum, output...].
        let slot = dv + 2;
        let part_len = DIRECT_ROWS * slot;
        let mut table = vec![0f32; tasks * splits * part_len];
        let table_ptr = super::view::SendPtr(table.as_mut_ptr().cast());
        let rows_of = |t: usize| {
            let chunk = t % chunks;
            let ik2 = (t / chunks) % groups;
            let q0 = chunk * q_chunk;
            (
                TaskRows {
                    heads: ik2 * group..(ik2 + 1) * group,
                    queries: q0..(q0 + q_chunk).min(n_q),
                },
                t / (chunks * groups),
            )
        };
        // One range per thread: the parts stream their keys and values from the cache.
        par_ranges_streaming(tasks * splits, 1, |range| {
            let base = table_ptr; // the whole SendPtr, not its raw field
            let mut scratch = SCRATCH.with(RefCell::take);
            let result = range.into_iter().try_for_each(|i| {
                let (t, part) = (i / splits, i % splits);
                let (rows, iq3) = rows_of(t);
                let keys = (part * per).min(n_kv)..((part + 1) * per).min(n_kv);
                // SAFETY: the operands are the op's checked host tensors; only the scratch is
                // written.
                unsafe { self.accumulate(&mut scratch, &rows, iq3, keys)? };
                // SAFETY: slot i of the table (part_len floats) is this (task, part)'s alone;
                // the table outlives the split.
                let out = unsafe {
                    std::slice::from_raw_parts_mut(base.0.cast::<f32>().add(i * part_len), part_len)
                };
                for r in 0..rows.len() {
                    let o = &mut out[r * slot..(r + 1) * slot];
                    o[0] = scratch.max[r];
                    o[1] = scratch.sum[r];
                    o[2..].copy_from_slice(&scratch.acc[r * dv..(r + 1) * dv]);
                }
                Ok(())
            });
            SCRATCH.with(|cell| cell.replace(scratch));
            result
        })?;
        par_ranges(tasks, 1, |range| {
            let mut scratch = SCRATCH.with(RefCell::take);
            let result = range.into_iter().try_for_each(|t| {
                let (rows, iq3) = rows_of(t);
                let nr = rows.len();
                let parts = &table[t * splits * part_len..(t + 1) * splits * part_len];
                scratch.acc.clear();
                scratch.acc.resize(nr * dv, 0.0);
                scratch.sum.clear();
                scratch.sum.resize(nr, 0.0);
                for r in 0..nr {
                    let row =
                        |p: usize| &parts[p * part_len + r * slot..p * part_len + (r + 1) * slot];
                    let top = (0..splits)
                        .map(|p| row(p)[0])
                        .fold(f32::NEG_INFINITY, f32::max);
                    if top == f32::NEG_INFINITY {
                        continue; // every key masked: a zero row, as without the split
                    }
                    let acc = &mut scratch.acc[r * dv..(r + 1) * dv];
                    for p in 0..splits {
                        let part = row(p);
                        if part[0] == f32::NEG_INFINITY {
                            continue;
                        }
                        let w = math::exp(part[0] - top);
                        scratch.sum[r] += part[1] * w;
                        acc.iter_mut()
                            .zip(&part[2..])
                            .for_each(|(a, x)| *a += x * w);
                    }
                }
                // SAFETY: task t's output rows are written by this task alone.
                unsafe { self.store(&mut scratch, &rows, iq3) }
            });
            SCRATCH.with(|cell| cell.replace(scratch));
            result
        })
    }

    /// Normalises the rows' outputs in `s` and stores them: output row (head, query, iq3).
    ///
    /// # Safety
    /// No other task may touch the output rows of these queries.
    unsafe fn store(&self, s: &mut Scratch, rows: &TaskRows, iq3: usize) -> Result<()> {
        let dv = self.v.ne[0];
        for r in 0..rows.len() {
            let (h, iq) = rows.at(r);
            let sum = s.sum[r];
            let inv = if sum > 0.0 { 1.0 / sum } else { 0.0 };
            let row = &mut s.acc[r * dv..(r + 1) * dv];
            row.iter_mut().for_each(|x| *x *= inv);
            let dst = &self.dst;
            if self.dst_direct {
                // SAFETY: dst row (h, iq, iq3) holds dv f32 values written by this task
                // alone (caller).
                let out = unsafe {
                    let p = dst.at(dst.row_offset(h, iq, iq3)).cast::<f32>();
                    std::slice::from_raw_parts_mut(p, dv)
                };
                out.copy_from_slice(row);
            } else {
                // SAFETY: as above.
                unsafe { dst.store_row(h, iq, iq3, row)? };
            }
        }
        Ok(())
    }

    /// Whether the mask hides keys `kb0..kb0 + kbn` (−∞) from every row of the task, so the
    /// block can be skipped (as ggml skips −∞ mask entries). `false` without a mask.
    ///
    /// # Safety
    /// The segments must lie inside the mask (the op builder checks its shape).
    unsafe fn block_masked(
        &self,
        buf: &mut Vec<f32>,
        rows: &TaskRows,
        iq3: usize,
        kb0: usize,
        kbn: usize,
    ) -> Result<bool> {
        if self.mask.is_none() {
            return Ok(false);
        }
        for r in 0..rows.len() {
            let (h, iq) = rows.at(r);
            // SAFETY: the segment lies inside the mask (caller).
            let seg = unsafe { self.mask_segment(buf, iq, h, iq3, kb0, kbn)? };
            if seg.is_some_and(|m| m.iter().any(|&x| x != f32::NEG_INFINITY)) {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// Writes keys `kb0..kb0 + kbn` of head (ik2, ik3) transposed into `s.keys_t` (`d × kbp`,
    /// columns `kbn..kbp` zero).
    ///
    /// # Safety
    /// Those keys must lie inside k.
    unsafe fn transpose_keys(
        &self,
        s: &mut Scratch,
        kb0: usize,
        kbn: usize,
        kbp: usize,
        ik2: usize,
        ik3: usize,
    ) -> Result<()> {
        let k = &self.k;
        let d = k.ne[0];
        s.keys_t.clear();
        s.keys_t.resize(d * kbp, 0.0);
        #[cfg(target_arch = "x86_64")]
        if self.kernels == Kernels::Avx512 && self.k_direct && 16 * k.nb[1] <= i32::MAX as usize {
            // SAFETY: the CPU has AVX-512F; keys kb0..kb0 + kbn of the head are d f32 values
            // each, nb[1] bytes apart (caller); keys_t holds d × kbp floats.
            unsafe {
                let p = k.at(k.row_offset(kb0, ik2, ik3)).cast_const().cast::<f32>();
                avx512::transpose(p, k.nb[1] / 4, kbn, d, s.keys_t.as_mut_ptr(), kbp);
            }
            return Ok(());
        }
        for j in 0..kbn {
            let row: &[f32] = if self.k_direct {
                // SAFETY: key row (kb0 + j, ik2, ik3) holds d readable f32 values (caller).
                unsafe {
                    let p = k.at(k.row_offset(kb0 + j, ik2, ik3)).cast_const();
                    std::slice::from_raw_parts(p.cast::<f32>(), d)
                }
            } else {
                s.key_row.resize(d, 0.0);
                // SAFETY: as above, converted.
                unsafe { k.load_row(kb0 + j, ik2, ik3, &mut s.key_row)? };
                &s.key_row
            };
            for (dd, &x) in row.iter().enumerate() {
                s.keys_t[dd * kbp + j] = x;
            }
        }
        Ok(())
    }

    /// The mask values of keys `kb0..kb0 + kbn` for query `iq` of head `iq2`, sequence `iq3`
    /// (in place when f32, else converted into `buf`); `None` without a mask.
    ///
    /// # Safety
    /// The segment must lie inside the mask (the op builder checks its shape).
    unsafe fn mask_segment<'a>(
        &'a self,
        buf: &'a mut Vec<f32>,
        iq: usize,
        iq2: usize,
        iq3: usize,
        kb0: usize,
        kbn: usize,
    ) -> Result<Option<&'a [f32]>> {
        let Some(m) = &self.mask else {
            return Ok(None);
        };
        let offset = kb0 * m.nb[0] + m.row_offset(iq, iq2 % m.ne[2], iq3 % m.ne[3]);
        // SAFETY: the segment lies inside the mask (caller).
        let p = unsafe { m.at(offset) }.cast_const();
        if self.mask_direct {
            // SAFETY: kbn f32 values are readable at p (dense rows, caller).
            return Ok(Some(unsafe {
                std::slice::from_raw_parts(p.cast::<f32>(), kbn)
            }));
        }
        buf.resize(kbn, 0.0);
        // SAFETY: kbn elements at stride nb[0] are readable at p (caller).
        unsafe { load_f32(m.dtype, p, m.nb[0], buf)? };
        Ok(Some(buf))
    }
}

/// Elements spanned by `rows` rows of `len` elements, `stride` apart.
fn strided_len(rows: usize, stride: usize, len: usize) -> usize {
    if rows == 0 {
        0
    } else {
        (rows - 1) * stride + len
    }
}

/// `x = x·scale`, then `softcap·tanh(x)` when softcap is non-zero, then `+ slope·mask`;
/// returns the largest element (−∞ when all are, NaN ignored by the generic path).
fn prepare_scores(
    kernels: Kernels,
    x: &mut [f32],
    scale: f32,
    softcap: f32,
    mask: Option<(&[f32], f32)>,
) -> f32 {
    if softcap != 0.0 {
        x.iter_mut()
            .for_each(|v| *v = softcap * (*v * scale).tanh());
        if let Some((m, slope)) = mask {
            x.iter_mut().zip(m).for_each(|(v, &mv)| *v += slope * mv);
        }
        return math::max_f32(x);
    }
    #[cfg(target_arch = "x86_64")]
    {
        use math::simd_entry::{scale_mask_max_avx2, scale_mask_max_avx512};
        if kernels == Kernels::Avx512 {
            if let Some(t) = Avx512::new() {
                // SAFETY: the token proves the entry point's features.
                return unsafe { scale_mask_max_avx512(t, x, scale, mask) };
            }
        }
        if let Some(t) = Avx2::new() {
            // SAFETY: as above.
            return unsafe { scale_mask_max_avx2(t, x, scale, mask) };
        }
    }
    let _ = kernels;
    scale_mask_row(x, scale, mask);
    math::max_f32(x)
}

super::simd_fn! {
    /// `x = x·scale + slope·mask` (vectorised).
    fn scale_mask_row(x: &mut [f32], scale: f32, mask: Option<(&[f32], f32)>) {
        match mask {
            Some((m, slope)) => x
                .iter_mut()
                .zip(m)
                .for_each(|(v, &mv)| *v = *v * scale + slope * mv),
            None => x.iter_mut().for_each(|v| *v *= scale),
        }
    }
}

/// `x = e^(x − shift)` over the row; returns Σx.
fn exp_sub_sum(kernels: Kernels, x: &mut [f32], shift: f32) -> f32 {
    #[cfg(target_arch = "x86_64")]
    {
        use math::simd_entry::{exp_sub_sum_avx2, exp_sub_sum_avx512};
        if kernels == Kernels::Avx512 {
            if let Some(t) = Avx512::new() {
                // SAFETY: the token proves the entry point's features.
                return unsafe { exp_sub_sum_avx512(t, x, shift) };
            }
        }
        if let Some(t) = Avx2::new() {
            // SAFETY: as above.
            return unsafe { exp_sub_sum_avx2(t, x, shift) };
        }
    }
    let _ = kernels;
    math::exp_sub_row(x, shift);
    math::sum_f64(x) as f32
}

/// `s[r][j] = Σ_i q[r][i] · kt[i][j]` for `rows` (≤ [`ROWS`]) query rows `q_stride` apart and
/// the transposed key block `kt` (`d × kbp`, `kbp` a multiple of 16); `s` rows are `kbp` apart.
#[allow(clippy::too_many_arguments)]
fn scores_tile(
    kernels: Kernels,
    rows: usize,
    q: &[f32],
    q_stride: usize,
    d: usize,
    kt: &[f32],
    kbp: usize,
    s: &mut [f32],
) {
    assert!(rows <= ROWS && q.len() >= strided_len(rows, q_stride, d));
    assert!(kt.len() >= d * kbp && s.len() >= rows * kbp && kbp.is_multiple_of(16));
    #[cfg(target_arch = "x86_64")]
    {
        let (q, kt, s) = (q.as_ptr(), kt.as_ptr(), s.as_mut_ptr());
        if kernels == Kernels::Avx512 {
            if let Some(t) = Avx512::new() {
                // SAFETY: the slices hold the elements the tile reads and writes (asserted
                // above).
                unsafe { tiles::scores_avx512(t, rows, q, q_stride, d, kt, kbp, s) };
                return;
            }
        }
        if let Some(t) = Avx2::new() {
            // SAFETY: as above.
            unsafe { tiles::scores_avx2(t, rows, q, q_stride, d, kt, kbp, s) };
            return;
        }
    }
    let _ = kernels;
    scores_generic(rows, q, q_stride, d, kt, kbp, s);
}

super::simd_fn! {
    /// [`scores_tile`] as plain loops.
    fn scores_generic(
        rows: usize,
        q: &[f32],
        q_stride: usize,
        d: usize,
        kt: &[f32],
        kbp: usize,
        s: &mut [f32],
    ) {
        for r in 0..rows {
            let out = &mut s[r * kbp..(r + 1) * kbp];
            out.iter_mut().for_each(|x| *x = 0.0);
            let qr = &q[r * q_stride..r * q_stride + d];
            for (i, &qv) in qr.iter().enumerate() {
                let krow = &kt[i * kbp..(i + 1) * kbp];
                out.iter_mut().zip(krow).for_each(|(o, &kv)| *o += qv * kv);
            }
        }
    }
}

super::simd_fn! {
    /// `s[r][j] = q[r] · k[j]` for the query rows `q` (`d` apart) and `kbn` key rows `k`
    /// (`k_stride` apart) as stored: each product in 8 lanes of partial sums (element `i`
    /// into lane `i % 8`), added in a fixed order. `s` rows are `kbp` apart.
    fn scores_direct(
        q: &[f32],
        d: usize,
        k: &[f32],
        k_stride_kbn: (usize, usize),
        kbp: usize,
        s: &mut [f32],
    ) {
        let (k_stride, kbn) = k_stride_kbn;
        for (r, qr) in q.chunks_exact(d.max(1)).enumerate() {
            let out = &mut s[r * kbp..r * kbp + kbn];
            for (j, o) in out.iter_mut().enumerate() {
                let kr = &k[j * k_stride..j * k_stride + d];
                let mut lanes = [0f32; 8];
                let (qc, kc) = (qr.chunks_exact(8), kr.chunks_exact(8));
                let (qt, kt) = (qc.remainder(), kc.remainder());
                for (a, b) in qc.zip(kc) {
                    for l in 0..8 {
                        lanes[l] += a[l] * b[l];
                    }
                }
                for (l, (a, b)) in qt.iter().zip(kt).enumerate() {
                    lanes[l] += a * b;
                }
                *o = ((lanes[0] + lanes[4]) + (lanes[1] + lanes[5]))
                    + ((lanes[2] + lanes[6]) + (lanes[3] + lanes[7]));
            }
        }
    }
}

/// `acc[r][e] += Σ_{j<kbn} p[r][j] · v[j][e]` for `rows` (≤ [`ROWS`]) probability rows `kbp`
/// apart and `kbn` value rows of `dv` elements `v_stride` apart; `acc` rows are `dv` apart.
#[allow(clippy::too_many_arguments)]
fn values_tile(
    kernels: Kernels,
    rows: usize,
    p: &[f32],
    kbp: usize,
    v: &[f32],
    v_stride: usize,
    kbn: usize,
    dv: usize,
    acc: &mut [f32],
) {
    assert!(rows <= ROWS && kbn <= kbp && p.len() >= rows * kbp);
    assert!(v.len() >= strided_len(kbn, v_stride, dv) && acc.len() >= rows * dv);
    #[cfg(target_arch = "x86_64")]
    {
        let (p, v, acc) = (p.as_ptr(), v.as_ptr(), acc.as_mut_ptr());
        if kernels == Kernels::Avx512 {
            if let Some(t) = Avx512::new() {
                // SAFETY: the slices hold what the tile touches (asserted above).
                unsafe { tiles::values_avx512(t, rows, p, kbp, v, v_stride, (kbn, dv), acc) };
                return;
            }
        }
        if let Some(t) = Avx2::new() {
            // SAFETY: as above.
            unsafe { tiles::values_avx2(t, rows, p, kbp, v, v_stride, (kbn, dv), acc) };
            return;
        }
    }
    let _ = kernels;
    values_generic(rows, p, kbp, v, v_stride, (kbn, dv), acc);
}

super::simd_fn! {
    /// [`values_tile`] as plain loops.
    fn values_generic(
        rows: usize,
        p: &[f32],
        kbp: usize,
        v: &[f32],
        v_stride: usize,
        kbn_dv: (usize, usize),
        acc: &mut [f32],
    ) {
        let (kbn, dv) = kbn_dv;
        for r in 0..rows {
            let out = &mut acc[r * dv..(r + 1) * dv];
            for (j, &pj) in p[r * kbp..r * kbp + kbn].iter().enumerate() {
                let vr = &v[j * v_stride..j * v_stride + dv];
                out.iter_mut().zip(vr).for_each(|(o, &x)| *o += pj * x);
            }
        }
    }
}

/// The register tiles of the score and value products, written once for every [`Simd`]: AVX2
/// (the generic family on CPUs with AVX2 and FMA) and AVX-512 (the AVX-512 family). Every
/// output element is one chain of fused multiply-adds in reduction order, so the blocking
/// (rows per pass, vectors per column group) does not change the results. The value tiles
/// finish a row's last partial group with masked vectors on AVX-512 and with scalar
/// (unfused) code on AVX2, as each family always has.
#[cfg(target_arch = "x86_64")]
mod tiles {
    use super::super::simd::{load_tail, store_tail, Avx2, Avx512, Simd};

    /// Scores of `rows` (≤ 6) queries against the transposed key block (see
    /// `scores_tile`) with AVX2: 3 query rows × 2 vectors (16 keys) per tile.
    ///
    /// # Safety
    /// `q` holds `rows` rows of `d` floats `q_stride` apart, `kt` `d × kbp` floats (`kbp` a
    /// multiple of 16), `s` `rows × kbp` writable floats.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn scores_avx2(
        t: Avx2,
        rows: usize,
        q: *const f32,
        q_stride: usize,
        d: usize,
        kt: *const f32,
        kbp: usize,
        s: *mut f32,
    ) {
        // SAFETY: forwarded (caller).
        unsafe { scores::<_, 3, 2>(t, rows, q, q_stride, d, kt, kbp, s) }
    }

    /// [`scores_avx2`] with AVX-512: up to 6 query rows × 4 vectors (64 keys) per tile.
    ///
    /// # Safety
    /// As [`scores_avx2`].
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn scores_avx512(
        t: Avx512,
        rows: usize,
        q: *const f32,
        q_stride: usize,
        d: usize,
        kt: *const f32,
        kbp: usize,
        s: *mut f32,
    ) {
        // SAFETY: forwarded (caller).
        unsafe { scores::<_, 6, 4>(t, rows, q, q_stride, d, kt, kbp, s) }
    }

    /// Probabilities times values added to the accumulators (see `values_tile`) with AVX2:
    /// up to 6 rows × 2 vectors (16 elements) per tile, the last `dv % 16` elements in scalar
    /// code.
    ///
    /// # Safety
    /// `p` holds `rows` (≤ 6) rows of `kbp` floats, `v` `kbn` rows of `dv` floats `v_stride`
    /// apart, `acc` `rows × dv` writable floats; `kbn ≤ kbp`.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn values_avx2(
        t: Avx2,
        rows: usize,
        p: *const f32,
        kbp: usize,
        v: *const f32,
        v_stride: usize,
        kbn_dv: (usize, usize),
        acc: *mut f32,
    ) {
        // SAFETY: forwarded (caller).
        unsafe { values::<_, 2>(t, rows, p, kbp, v, v_stride, kbn_dv, acc) }
    }

    /// [`values_avx2`] with AVX-512: up to 6 rows × 4 vectors (64 elements) per tile, the
    /// last partial vector masked.
    ///
    /// # Safety
    /// As [`values_avx2`].
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn values_avx512(
        t: Avx512,
        rows: usize,
        p: *const f32,
        kbp: usize,
        v: *const f32,
        v_stride: usize,
        kbn_dv: (usize, usize),
        acc: *mut f32,
    ) {
        // SAFETY: forwarded (caller).
        unsafe { values::<_, 4>(t, rows, p, kbp, v, v_stride, kbn_dv, acc) }
    }

    /// The score tiles, `RMAX` query rows and up to `WIDE` (4, 2 or 1) vectors of keys at a
    /// time.
    ///
    /// # Safety
    /// As [`scores_avx2`] (`kbp` also a multiple of `S::LANES`).
    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    pub(crate) unsafe fn scores<S: Simd, const RMAX: usize, const WIDE: usize>(
        t: S,
        rows: usize,
        q: *const f32,
        q_stride: usize,
        d: usize,
        kt: *const f32,
        kbp: usize,
        s: *mut f32,
    ) {
        let mut r = 0;
        while r < rows {
            let n = (rows - r).min(RMAX);
            // SAFETY: rows r..r + n of q and s lie inside the caller's buffers.
            unsafe {
                let (q, s) = (q.add(r * q_stride), s.add(r * kbp));
                match n {
                    1 => scores_rows::<S, 1, WIDE>(t, q, q_stride, d, kt, kbp, s),
                    2 => scores_rows::<S, 2, WIDE>(t, q, q_stride, d, kt, kbp, s),
                    3 => scores_rows::<S, 3, WIDE>(t, q, q_stride, d, kt, kbp, s),
                    4 => scores_rows::<S, 4, WIDE>(t, q, q_stride, d, kt, kbp, s),
                    5 => scores_rows::<S, 5, WIDE>(t, q, q_stride, d, kt, kbp, s),
                    _ => scores_rows::<S, 6, WIDE>(t, q, q_stride, d, kt, kbp, s),
                }
            }
            r += n;
        }
    }

    /// # Safety
    /// As [`scores`] with `rows = R`.
    #[inline(always)]
    unsafe fn scores_rows<S: Simd, const R: usize, const WIDE: usize>(
        t: S,
        q: *const f32,
        q_stride: usize,
        d: usize,
        kt: *const f32,
        kbp: usize,
        s: *mut f32,
    ) {
        let lanes = S::LANES;
        let mut j = 0;
        // SAFETY: every column group j..j + LANES·C lies below kbp (caller's layout).
        unsafe {
            if WIDE >= 4 {
                while j + 4 * lanes <= kbp {
                    scores_cols::<S, R, 4>(t, q, q_stride, d, kt, kbp, s, j);
                    j += 4 * lanes;
                }
            }
            if WIDE >= 2 {
                while j + 2 * lanes <= kbp {
                    scores_cols::<S, R, 2>(t, q, q_stride, d, kt, kbp, s, j);
                    j += 2 * lanes;
                }
            }
            while j < kbp {
                scores_cols::<S, R, 1>(t, q, q_stride, d, kt, kbp, s, j);
                j += lanes;
            }
        }
    }

    /// Columns `j..j + LANES·C` of the scores of `R` queries: R × C accumulators over `d`.
    ///
    /// # Safety
    /// As [`scores`], with `j + LANES·C ≤ kbp`.
    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    unsafe fn scores_cols<S: Simd, const R: usize, const C: usize>(
        t: S,
        q: *const f32,
        q_stride: usize,
        d: usize,
        kt: *const f32,
        kbp: usize,
        s: *mut f32,
        j: usize,
    ) {
        let lanes = S::LANES;
        // SAFETY: reads q[r·q_stride + i] (r < R, i < d) and kt[i·kbp + j..+LANES·C], writes
        // s[r·kbp + j..+LANES·C]: all inside the caller's buffers.
        unsafe {
            let mut acc = [[t.zero(); C]; R];
            for i in 0..d {
                let kp = kt.add(i * kbp + j);
                let mut kv = [t.zero(); C];
                for (c, x) in kv.iter_mut().enumerate() {
                    *x = t.loadu(kp.add(lanes * c));
                }
                for (r, row) in acc.iter_mut().enumerate() {
                    let b = t.splat(*q.add(r * q_stride + i));
                    for c in 0..C {
                        row[c] = t.fma(b, kv[c], row[c]);
                    }
                }
            }
            for (r, row) in acc.iter().enumerate() {
                for (c, &x) in row.iter().enumerate() {
                    t.storeu(s.add(r * kbp + j + lanes * c), x);
                }
            }
        }
    }

    /// The value tiles, up to 6 rows and `WIDE` (4 or 2) vectors of elements at a time.
    ///
    /// # Safety
    /// As [`values_avx2`].
    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    pub(crate) unsafe fn values<S: Simd, const WIDE: usize>(
        t: S,
        rows: usize,
        p: *const f32,
        kbp: usize,
        v: *const f32,
        v_stride: usize,
        (kbn, dv): (usize, usize),
        acc: *mut f32,
    ) {
        let mut r = 0;
        while r < rows {
            let n = (rows - r).min(6);
            // SAFETY: rows r..r + n of p and acc lie inside the caller's buffers.
            unsafe {
                let (p, acc) = (p.add(r * kbp), acc.add(r * dv));
                let args = (kbp, v, v_stride, kbn, dv);
                match n {
                    1 => values_rows::<S, 1, WIDE>(t, p, args, acc),
                    2 => values_rows::<S, 2, WIDE>(t, p, args, acc),
                    3 => values_rows::<S, 3, WIDE>(t, p, args, acc),
                    4 => values_rows::<S, 4, WIDE>(t, p, args, acc),
                    5 => values_rows::<S, 5, WIDE>(t, p, args, acc),
                    _ => values_rows::<S, 6, WIDE>(t, p, args, acc),
                }
            }
            r += n;
        }
    }

    /// `(kbp, v, v_stride, kbn, dv)` of [`values`].
    type ValueArgs = (usize, *const f32, usize, usize, usize);

    /// # Safety
    /// As [`values`] with `rows = R`.
    #[inline(always)]
    unsafe fn values_rows<S: Simd, const R: usize, const WIDE: usize>(
        t: S,
        p: *const f32,
        args: ValueArgs,
        acc: *mut f32,
    ) {
        let (kbp, v, v_stride, kbn, dv) = args;
        let lanes = S::LANES;
        let mut e = 0;
        // SAFETY: each group covers elements e..min(e + LANES·C, dv): whole vectors, or with
        // masked tails the last one partial.
        unsafe {
            if S::MASKED_TAILS {
                if WIDE >= 4 {
                    while e + 3 * lanes < dv {
                        values_cols::<S, R, 4>(t, p, args, acc, e);
                        e += 4 * lanes;
                    }
                }
                while e + lanes < dv {
                    values_cols::<S, R, 2>(t, p, args, acc, e);
                    e += 2 * lanes;
                }
                while e < dv {
                    values_cols::<S, R, 1>(t, p, args, acc, e);
                    e += lanes;
                }
            } else {
                while e + WIDE * lanes <= dv {
                    values_cols::<S, R, WIDE>(t, p, args, acc, e);
                    e += WIDE * lanes;
                }
                // the last elements of these rows, one product at a time
                for r in 0..R {
                    for j in 0..kbn {
                        let pj = *p.add(r * kbp + j);
                        for x in e..dv {
                            *acc.add(r * dv + x) += pj * *v.add(j * v_stride + x);
                        }
                    }
                }
            }
        }
    }

    /// Elements `e..min(e + LANES·C, dv)` of the accumulators of `R` rows.
    ///
    /// # Safety
    /// As [`values`], with `e + LANES·(C − 1) < dv`, and `e + LANES·C ≤ dv` without masked
    /// tails.
    #[inline(always)]
    unsafe fn values_cols<S: Simd, const R: usize, const C: usize>(
        t: S,
        p: *const f32,
        (kbp, v, v_stride, kbn, dv): ValueArgs,
        acc: *mut f32,
        e: usize,
    ) {
        let lanes = S::LANES;
        // Elements of vector c that lie below dv (at least LANES without masked tails).
        let left: [usize; C] = std::array::from_fn(|c| dv - (e + lanes * c));
        // SAFETY: only the first `left[c]` lanes of vector c are accessed (all of them
        // without masked tails): acc[r·dv + e..] (r < R), v[j·v_stride + e..] (j < kbn) and
        // p[r·kbp + j], inside the caller's buffers.
        unsafe {
            let mut a = [[t.zero(); C]; R];
            for (r, row) in a.iter_mut().enumerate() {
                for c in 0..C {
                    row[c] = load_tail(t, acc.add(r * dv + e + lanes * c), left[c]);
                }
            }
            for j in 0..kbn {
                let vp = v.add(j * v_stride + e);
                let mut vv = [t.zero(); C];
                for c in 0..C {
                    vv[c] = load_tail(t, vp.add(lanes * c), left[c]);
                }
                for (r, row) in a.iter_mut().enumerate() {
                    let b = t.splat(*p.add(r * kbp + j));
                    for c in 0..C {
                        row[c] = t.fma(b, vv[c], row[c]);
                    }
                }
            }
            for (r, row) in a.iter().enumerate() {
                for (c, &x) in row.iter().enumerate() {
                    store_tail(t, acc.add(r * dv + e + lanes * c), x, left[c]);
                }
            }
        }
    }
}

/// The direct path (few rows) over f16 keys and values read in place, widened by F16C.
#[cfg(target_arch = "x86_64")]
mod f16c {
    use std::arch::x86_64::*;

    /// The sum of the 8 lanes of `v`, in a fixed order.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn hsum(v: __m256) -> f32 {
        let s4 = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
        _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)))
    }

    /// The element types the tiles read keys and values as: f16 (widened by F16C) or f32.
    pub(super) trait Elem: Copy {
        /// 8 values at `p` as f32.
        ///
        /// # Safety
        /// AVX2, FMA and F16C; 8 values must be readable at `p`.
        unsafe fn load8(p: *const Self) -> __m256;
        /// One value at `p` as f32.
        ///
        /// # Safety
        /// AVX2, FMA and F16C; one value must be readable at `p`.
        unsafe fn load1(p: *const Self) -> f32;
    }

    impl Elem for u16 {
        #[inline]
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn load8(p: *const u16) -> __m256 {
            // SAFETY: the caller guarantees 8 readable values; the load is unaligned.
            _mm256_cvtph_ps(unsafe { _mm_loadu_si128(p.cast()) })
        }
        #[inline]
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn load1(p: *const u16) -> f32 {
            // SAFETY: the caller guarantees the value; the read is unaligned.
            super::super::simd::f16_to_f32(unsafe { p.read_unaligned() })
        }
    }

    impl Elem for f32 {
        #[inline]
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn load8(p: *const f32) -> __m256 {
            // SAFETY: the caller guarantees 8 readable values; the load is unaligned.
            unsafe { _mm256_loadu_ps(p) }
        }
        #[inline]
        unsafe fn load1(p: *const f32) -> f32 {
            // SAFETY: the caller guarantees the value; the read is unaligned.
            unsafe { p.read_unaligned() }
        }
    }

    /// Asks for the cache lines of the `n` values at `p` (a hint: the address may lie past
    /// the data).
    #[inline(always)]
    fn prefetch_row<T>(p: *const T, n: usize) {
        super::super::simd::prefetch_lines(p.cast(), n * std::mem::size_of::<T>());
    }

    /// How many key (value) rows ahead of the one being read the tiles prefetch. A cache's
    /// rows for one key/value head are a head's width out of each position's row (several
    /// heads interleaved), a strided walk the hardware prefetchers follow poorly: without
    /// this, decoding over a long context waited on the cache's lines (1 536 keys: ~4 GB/s
    /// of keys and values read, Zen 3).
    const AHEAD: usize = 16;

    /// `s[r][j] = q[r] · k[j]` for the query rows `q` (`d` apart, at most 8) and `kbn` f16
    /// key rows at `k` (`k_stride` values apart); `s` rows are `kbp` apart.
    ///
    /// Each score is its own 8-lane accumulation over the head in order, summed by [`hsum`],
    /// plus the tail in order; the row count is a compile-time constant (registers, not a
    /// stack array) and several keys go through at once, so the accumulations are independent
    /// chains instead of one FMA latency after another.
    ///
    /// # Safety
    /// AVX2, FMA and F16C; the `kbn` key rows of `d` values are readable; `s` holds the
    /// rows' `kbp`-wide segments.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn scores<T: Elem>(
        q: &[f32],
        d: usize,
        k: *const T,
        (k_stride, kbn): (usize, usize),
        kbp: usize,
        s: &mut [f32],
    ) {
        let rows = q.len() / d.max(1);
        assert!(rows <= super::DIRECT_ROWS && s.len() >= rows * kbp && kbn <= kbp);
        let args = (q, d, k, k_stride, kbn, kbp);
        // SAFETY: forwarded from the caller; `rows` is the row count of `q` and `s`.
        unsafe {
            match rows {
                0 => {}
                1 => scores_rows::<T, 1, 4>(args, s),
                2 => scores_rows::<T, 2, 4>(args, s),
                3 => scores_rows::<T, 3, 4>(args, s),
                4 => scores_rows::<T, 4, 2>(args, s),
                5 => scores_rows::<T, 5, 2>(args, s),
                6 => scores_rows::<T, 6, 2>(args, s),
                7 => scores_rows::<T, 7, 1>(args, s),
                _ => scores_rows::<T, 8, 1>(args, s),
            }
        }
    }

    /// [`scores`] for `R` rows, `J` keys at a time (then one at a time for the rest).
    ///
    /// # Safety
    /// As [`scores`], with `q` holding exactly `R` rows.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn scores_rows<T: Elem, const R: usize, const J: usize>(
        (q, d, k, k_stride, kbn, kbp): (&[f32], usize, *const T, usize, usize, usize),
        s: &mut [f32],
    ) {
        let whole = d / 8 * 8;
        // One group of `JJ` keys from key `j0` (a macro, not a closure: a closure would not
        // inherit the target features).
        macro_rules! keys {
            ($jj:expr, $j0:expr) => {{
                let j0 = $j0;
                for jj in 0..$jj {
                    prefetch_row(k.wrapping_add((j0 + jj + AHEAD) * k_stride), d);
                }
                let mut acc = [[_mm256_setzero_ps(); $jj]; R];
                for i in (0..whole).step_by(8) {
                    let mut kv = [_mm256_setzero_ps(); $jj];
                    for (jj, v) in kv.iter_mut().enumerate() {
                        // SAFETY: elements i..i + 8 of key row j0 + jj exist (caller).
                        *v = unsafe { T::load8(k.add((j0 + jj) * k_stride + i)) };
                    }
                    for (r, row) in acc.iter_mut().enumerate() {
                        // SAFETY: query row r holds elements i..i + 8; the load is unaligned.
                        let qv = unsafe { _mm256_loadu_ps(q.as_ptr().add(r * d + i)) };
                        for (a, v) in row.iter_mut().zip(&kv) {
                            *a = _mm256_fmadd_ps(qv, *v, *a);
                        }
                    }
                }
                for (r, row) in acc.iter().enumerate() {
                    for (jj, a) in row.iter().enumerate() {
                        let kr = k.wrapping_add((j0 + jj) * k_stride);
                        let mut dot = hsum(*a);
                        for i in whole..d {
                            // SAFETY: element i of key row j0 + jj exists.
                            dot += q[r * d + i] * unsafe { T::load1(kr.add(i)) };
                        }
                        s[r * kbp + j0 + jj] = dot;
                    }
                }
            }};
        }
        let mut j = 0;
        while j + J <= kbn {
            keys!(J, j);
            j += J;
        }
        while j < kbn {
            keys!(1, j);
            j += 1;
        }
    }

    /// `acc[r][e] += Σ_{j<kbn} p[r][j] · v[j][e]` for the probability rows of `p` (`kbp`
    /// apart; as many as `acc` holds rows of `dv`) and `kbn` f16 value rows at `v`
    /// (`v_stride` values apart).
    ///
    /// Each output element is its own sum over the keys in order; the row count is a
    /// compile-time constant and several 8-wide output chunks go through at once (independent
    /// FMA chains).
    ///
    /// # Safety
    /// AVX2, FMA and F16C; the `kbn` value rows of `dv` values are readable.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn values<T: Elem>(
        p: &[f32],
        kbp: usize,
        v: *const T,
        (v_stride, kbn): (usize, usize),
        dv: usize,
        acc: &mut [f32],
    ) {
        let rows = acc.len() / dv.max(1);
        assert!(rows <= super::DIRECT_ROWS && p.len() >= rows * kbp && kbn <= kbp);
        let args = (p, kbp, v, v_stride, kbn, dv);
        // SAFETY: forwarded from the caller; `rows` is the row count of `acc`.
        unsafe {
            match rows {
                0 => {}
                1 => values_rows::<T, 1, 4>(args, acc),
                2 => values_rows::<T, 2, 4>(args, acc),
                3 => values_rows::<T, 3, 2>(args, acc),
                4 => values_rows::<T, 4, 2>(args, acc),
                5 => values_rows::<T, 5, 1>(args, acc),
                6 => values_rows::<T, 6, 1>(args, acc),
                7 => values_rows::<T, 7, 1>(args, acc),
                _ => values_rows::<T, 8, 1>(args, acc),
            }
        }
    }

    /// [`values`] for `R` rows, `E` output chunks of 8 at a time (then one at a time).
    ///
    /// # Safety
    /// As [`values`], with `acc` holding exactly `R` rows.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn values_rows<T: Elem, const R: usize, const E: usize>(
        (p, kbp, v, v_stride, kbn, dv): (&[f32], usize, *const T, usize, usize, usize),
        acc: &mut [f32],
    ) {
        let whole = dv / 8 * 8;
        macro_rules! chunks {
            ($ee:expr, $e0:expr) => {{
                let e0 = $e0;
                let mut sums = [[_mm256_setzero_ps(); $ee]; R];
                for (r, row) in sums.iter_mut().enumerate() {
                    for (c, sum) in row.iter_mut().enumerate() {
                        // SAFETY: acc row r holds elements e0 + 8c..+8; the load is unaligned.
                        *sum = unsafe { _mm256_loadu_ps(acc.as_ptr().add(r * dv + e0 + 8 * c)) };
                    }
                }
                for j in 0..kbn {
                    prefetch_row(v.wrapping_add((j + AHEAD) * v_stride + e0), 8 * $ee);
                    let mut vv = [_mm256_setzero_ps(); $ee];
                    for (c, x) in vv.iter_mut().enumerate() {
                        // SAFETY: elements e0 + 8c..+8 of value row j exist (caller).
                        *x = unsafe { T::load8(v.add(j * v_stride + e0 + 8 * c)) };
                    }
                    for (r, row) in sums.iter_mut().enumerate() {
                        let pr = _mm256_set1_ps(p[r * kbp + j]);
                        for (sum, x) in row.iter_mut().zip(&vv) {
                            *sum = _mm256_fmadd_ps(pr, *x, *sum);
                        }
                    }
                }
                for (r, row) in sums.iter().enumerate() {
                    for (c, sum) in row.iter().enumerate() {
                        // SAFETY: as above; the store is unaligned.
                        unsafe {
                            _mm256_storeu_ps(acc.as_mut_ptr().add(r * dv + e0 + 8 * c), *sum)
                        };
                    }
                }
            }};
        }
        let mut e = 0;
        while e + 8 * E <= whole {
            chunks!(E, e);
            e += 8 * E;
        }
        while e < whole {
            chunks!(1, e);
            e += 8;
        }
        for e in whole..dv {
            for j in 0..kbn {
                // SAFETY: element e of value row j exists (caller).
                let x = unsafe { T::load1(v.add(j * v_stride + e)) };
                for r in 0..R {
                    acc[r * dv + e] += p[r * kbp + j] * x;
                }
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    //! The AVX-512F key transpose (a gather; AVX2 has no counterpart).
    use std::arch::x86_64::*;

    /// Writes `kbn` key rows of `d` floats (`stride` floats apart, starting at `k`) transposed
    /// into `kt` (`d × kbp`, row `i` holding element `i` of every key; columns `kbn..kbp`
    /// zero), gathering 16 keys per vector.
    ///
    /// # Safety
    /// AVX-512F; the key rows are readable, `kt` holds `d × kbp` writable floats with
    /// `kbp ≥ kbn` a multiple of 16, and `15·stride·4` fits an i32.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn transpose(
        k: *const f32,
        stride: usize,
        kbn: usize,
        d: usize,
        kt: *mut f32,
        kbp: usize,
    ) {
        let offsets = _mm512_mullo_epi32(
            _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
            _mm512_set1_epi32(stride as i32),
        );
        let mut j0 = 0;
        while j0 < kbp {
            let left = kbn.saturating_sub(j0);
            let m = super::super::simd::lanes16(left);
            // SAFETY: unmasked lanes read element i of keys j0 + l < kbn (caller's rows);
            // the store covers kt[i·kbp + j0..+16] with j0 + 16 ≤ kbp.
            unsafe {
                let base = k.add(j0.min(kbn.saturating_sub(1)) * stride);
                for i in 0..d {
                    let v =
                        _mm512_mask_i32gather_ps::<4>(_mm512_setzero_ps(), m, offsets, base.add(i));
                    _mm512_storeu_ps(kt.add(i * kbp + j0), v);
                }
            }
            j0 += 16;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::testing::at_thread_counts;

    /// A dense f32 view of `data` with shape `ne`.
    fn view(data: &mut [f32], ne: [usize; 4]) -> RawTensor {
        assert_eq!(data.len(), ne.iter().product::<usize>());
        RawTensor {
            ptr: crate::kernels::view::SendPtr(data.as_mut_ptr().cast()),
            dtype: DType::F32,
            ne,
            nb: [4, 4 * ne[0], 4 * ne[0] * ne[1], 4 * ne[0] * ne[1] * ne[2]],
        }
    }

    fn lcg(seed: &mut u64) -> f32 {
        *seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((*seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }

    /// The score and value tiles of every [`Simd`] this CPU runs (and of the 16-lane
    /// stand-in for AVX-512), bit for bit against scalar models of their arithmetic: one
    /// fused multiply-add chain per element, except the value tail that AVX2 finishes in
    /// unfused scalar code.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn tiles_match_scalar_models_bit_for_bit() {
        use crate::kernels::simd::tests::Emu16;
        use crate::kernels::simd::{Avx2, Avx512};

        /// The tiles run by one ISA: `(scores, values)` as fn pointers, and whether the value
        /// tail is masked (fused) rather than scalar.
        type Scores = unsafe fn(usize, &[f32], usize, usize, &[f32], usize, &mut [f32]);
        type Values = unsafe fn(usize, &[f32], usize, &[f32], usize, (usize, usize), &mut [f32]);

        #[target_feature(enable = "avx2,fma")]
        unsafe fn scores_emu(
            rows: usize,
            q: &[f32],
            q_stride: usize,
            d: usize,
            kt: &[f32],
            kbp: usize,
            s: &mut [f32],
        ) {
            let t = Emu16::new().expect("AVX2");
            let (q, kt, s) = (q.as_ptr(), kt.as_ptr(), s.as_mut_ptr());
            // SAFETY: forwarded (the test's buffers are large enough).
            unsafe { tiles::scores::<_, 6, 4>(t, rows, q, q_stride, d, kt, kbp, s) }
        }
        #[target_feature(enable = "avx2,fma")]
        unsafe fn values_emu(
            rows: usize,
            p: &[f32],
            kbp: usize,
            v: &[f32],
            v_stride: usize,
            kbn_dv: (usize, usize),
            acc: &mut [f32],
        ) {
            let t = Emu16::new().expect("AVX2");
            let (p, v, acc) = (p.as_ptr(), v.as_ptr(), acc.as_mut_ptr());
            // SAFETY: forwarded.
            unsafe { tiles::values::<_, 4>(t, rows, p, kbp, v, v_stride, kbn_dv, acc) }
        }
        unsafe fn scores_avx2(
            rows: usize,
            q: &[f32],
            q_stride: usize,
            d: usize,
            kt: &[f32],
            kbp: usize,
            s: &mut [f32],
        ) {
            let t = Avx2::new().expect("AVX2");
            let (q, kt, s) = (q.as_ptr(), kt.as_ptr(), s.as_mut_ptr());
            // SAFETY: forwarded.
            unsafe { tiles::scores_avx2(t, rows, q, q_stride, d, kt, kbp, s) }
        }
        unsafe fn values_avx2(
            rows: usize,
            p: &[f32],
            kbp: usize,
            v: &[f32],
            v_stride: usize,
            kbn_dv: (usize, usize),
            acc: &mut [f32],
        ) {
            let t = Avx2::new().expect("AVX2");
            let (p, v, acc) = (p.as_ptr(), v.as_ptr(), acc.as_mut_ptr());
            // SAFETY: forwarded.
            unsafe { tiles::values_avx2(t, rows, p, kbp, v, v_stride, kbn_dv, acc) }
        }
        unsafe fn scores_avx512(
            rows: usize,
            q: &[f32],
            q_stride: usize,
            d: usize,
            kt: &[f32],
            kbp: usize,
            s: &mut [f32],
        ) {
            let t = Avx512::new().expect("AVX-512F");
            let (q, kt, s) = (q.as_ptr(), kt.as_ptr(), s.as_mut_ptr());
            // SAFETY: forwarded.
            unsafe { tiles::scores_avx512(t, rows, q, q_stride, d, kt, kbp, s) }
        }
        unsafe fn values_avx512(
            rows: usize,
            p: &[f32],
            kbp: usize,
            v: &[f32],
            v_stride: usize,
            kbn_dv: (usize, usize),
            acc: &mut [f32],
        ) {
            let t = Avx512::new().expect("AVX-512F");
            let (p, v, acc) = (p.as_ptr(), v.as_ptr(), acc.as_mut_ptr());
            // SAFETY: forwarded.
            unsafe { tiles::values_avx512(t, rows, p, kbp, v, v_stride, kbn_dv, acc) }
        }

        let mut isas: Vec<(&str, Scores, Values, bool)> = Vec::new();
        if Avx2::new().is_some() {
            isas.push(("avx2", scores_avx2, values_avx2, false));
            isas.push(("emu16", scores_emu, values_emu, true));
        }
        if Avx512::new().is_some() {
            isas.push(("avx512", scores_avx512, values_avx512, true));
        }
        let mut seed = 7u64;
        let mut rand = |n: usize| -> Vec<f32> { (0..n).map(|_| lcg(&mut seed)).collect() };
        for (name, scores, values, masked) in isas {
            for rows in 1..=ROWS {
                for (d, kbp) in [(1usize, 16usize), (5, 32), (40, 48), (64, 80), (72, 128)] {
                    let q_stride = d + 3;
                    let q = rand(rows * q_stride);
                    let kt = rand(d * kbp);
                    let mut got = vec![f32::NAN; rows * kbp];
                    // SAFETY: the buffers hold what the tile reads and writes.
                    unsafe { scores(rows, &q, q_stride, d, &kt, kbp, &mut got) };
                    for r in 0..rows {
                        for j in 0..kbp {
                            let want = (0..d)
                                .fold(0f32, |a, i| q[r * q_stride + i].mul_add(kt[i * kbp + j], a));
                            assert_eq!(
                                got[r * kbp + j].to_bits(),
                                want.to_bits(),
                                "{name} scores rows={rows} d={d} kbp={kbp} r={r} j={j}"
                            );
                        }
                    }
                }
                for dv in [1usize, 8, 15, 16, 17, 40, 64, 72, 80, 100, 129] {
                    let (kbp, kbn) = (32usize, 29usize);
                    let v_stride = dv + 5;
                    let p = rand(rows * kbp);
                    let v = rand(kbn * v_stride);
                    let init = rand(rows * dv);
                    let mut got = init.clone();
                    // SAFETY: as above.
                    unsafe { values(rows, &p, kbp, &v, v_stride, (kbn, dv), &mut got) };
                    let vector_end = if masked { dv } else { dv / 16 * 16 };
                    for r in 0..rows {
                        for e in 0..dv {
                            let want = (0..kbn).fold(init[r * dv + e], |a, j| {
                                let (pj, x) = (p[r * kbp + j], v[j * v_stride + e]);
                                if e < vector_end {
                                    pj.mul_add(x, a)
                                } else {
                                    a + pj * x
                                }
                            });
                            assert_eq!(
                                got[r * dv + e].to_bits(),
                                want.to_bits(),
                                "{name} values rows={rows} dv={dv} r={r} e={e}"
                            );
                        }
                    }
                }
            }
        }
    }

    /// One case: head sizes, counts, and the score settings.
    struct Case {
        d: usize,
        dv: usize,
        n_q: usize,
        n_kv: usize,
        n_head: usize,
        n_head_kv: usize,
        n_seq: usize,
        masked: bool,
        max_bias: f32,
        softcap: f32,
    }

    /// Every kernel family against an f64 reference, queries/keys/values read through the
    /// strides of one interleaved "projection" buffer (as the graph's permuted views of a fused
    /// QKV product), with masked keys and a fully masked query row, several key blocks and
    /// query chunks, odd head sizes, GQA, ALiBi and softcapping. Tolerance: 1e-5 absolute on
    /// outputs of magnitude ≤ 1 (f32 arithmetic throughout). Identical bits at 1, 2 and 3
    /// threads for each family.
    #[test]
    fn every_family_matches_f64_reference_through_strided_views() {
        let case = |d, dv, n_q, n_kv, n_head, n_head_kv, n_seq, masked| Case {
            d,
            dv,
            n_q,
            n_kv,
            n_head,
            n_head_kv,
            n_seq,
            masked,
            max_bias: 0.0,
            softcap: 0.0,
        };
        let cases = [
            case(32, 32, 128, 128, 3, 3, 2, true),
            case(32, 32, 16, 16, 2, 2, 1, false),
            case(40, 40, 130, 300, 2, 1, 1, true),
            case(7, 19, 5, 3, 2, 2, 1, true),
            case(16, 72, 9, 33, 4, 2, 2, false),
            // decoding steps: the few rows of one group per task (the direct path)
            case(64, 64, 1, 300, 9, 3, 1, true),
            case(13, 21, 2, 70, 4, 1, 2, true),
            Case {
                max_bias: 8.0,
                ..case(24, 24, 20, 40, 4, 4, 1, true)
            },
            Case {
                softcap: 2.0,
                ..case(24, 8, 20, 40, 2, 1, 1, true)
            },
        ];
        let mut seed = 5u64;
        for c in cases {
            let n_tok = c.n_q.max(c.n_kv);
            let width = c.n_head * c.d + c.n_head_kv * (c.d + c.dv) + 3;
            let mut proj: Vec<f32> = (0..width * n_tok * c.n_seq)
                .map(|_| lcg(&mut seed))
                .collect();
            let mut mask: Vec<f32> = (0..c.n_kv * c.n_q * c.n_seq)
                .map(|i| {
                    let x = lcg(&mut seed);
                    if i % 5 == 2 || (i / c.n_kv) % c.n_q == c.n_q / 2 {
                        f32::NEG_INFINITY // incl. every key of one query row
                    } else {
                        x.min(0.0)
                    }
                })
                .collect();
            let base = RawTensor {
                ptr: crate::kernels::view::SendPtr(proj.as_mut_ptr().cast()),
                dtype: DType::F32,
                ne: [0; 4],
                nb: [4, 4 * width, 0, 4 * width * n_tok],
            };
            let part = |offset: usize, ne0: usize, n: usize, heads: usize| {
                let mut t = base;
                // SAFETY: offset < width, inside the buffer.
                t.ptr = crate::kernels::view::SendPtr(unsafe { base.at(offset * 4) });
                t.ne = [ne0, n, heads, c.n_seq];
                t.nb[2] = 4 * ne0;
                t
            };
            let q = part(0, c.d, c.n_q, c.n_head);
            let k = part(c.n_head * c.d, c.d, c.n_kv, c.n_head_kv);
            let v = part(
                c.n_head * c.d + c.n_head_kv * c.d,
                c.dv,
                c.n_kv,
                c.n_head_kv,
            );
            let mask_t = view(&mut mask, [c.n_kv, c.n_q, 1, c.n_seq]);
            let at = |t: &RawTensor, i0: usize, i1: usize, i2: usize, i3: usize| {
                let off = (i0 * t.nb[0] + t.row_offset(i1, i2, i3)) / 4;
                // SAFETY: the element lies inside the buffer behind t.
                unsafe { *t.ptr.0.cast::<f32>().add(off) as f64 }
            };
            let scale = 1.0 / (c.d as f32).sqrt();
            let mut want = vec![0f64; c.dv * c.n_head * c.n_q * c.n_seq];
            for s in 0..c.n_seq {
                for h in 0..c.n_head {
                    let hk = h / (c.n_head / c.n_head_kv);
                    let slope = alibi_slope(c.max_bias, c.n_head, h) as f64;
                    for i in 0..c.n_q {
                        let logits: Vec<f64> = (0..c.n_kv)
                            .map(|j| {
                                let dot: f64 = (0..c.d)
                                    .map(|e| at(&q, e, i, h, s) * at(&k, e, j, hk, s))
                                    .sum();
                                let mut x = dot * scale as f64;
                                if c.softcap != 0.0 {
                                    x = c.softcap as f64 * (x / c.softcap as f64).tanh();
                                }
                                if c.masked {
                                    x += slope * at(&mask_t, j, i, 0, s);
                                }
                                x
                            })
                            .collect();
                        let max = logits.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                        if max == f64::NEG_INFINITY {
                            continue; // zero row
                        }
                        let w: Vec<f64> = logits.iter().map(|x| (x - max).exp()).collect();
                        let sum: f64 = w.iter().sum();
                        for e in 0..c.dv {
                            let o: f64 = (0..c.n_kv).map(|j| w[j] * at(&v, e, j, hk, s)).sum();
                            want[e + c.dv * (h + c.n_head * (i + c.n_q * s))] = o / sum;
                        }
                    }
                }
            }
            for kernels in Kernels::available() {
                let got = at_thread_counts(|| {
                    let mut out = vec![f32::NAN; want.len()];
                    let dst = view(&mut out, [c.dv, c.n_head, c.n_q, c.n_seq]);
                    flash_attn_ext_with(
                        kernels,
                        dst,
                        q,
                        k,
                        v,
                        c.masked.then_some(mask_t),
                        scale,
                        c.max_bias,
                        c.softcap,
                    )
                    .unwrap();
                    out.iter().map(|x| x.to_bits()).collect::<Vec<u32>>()
                });
                for (n, (&g, &w)) in got.iter().zip(&want).enumerate() {
                    let g = f32::from_bits(g) as f64;
                    assert!(
                        (g - w).abs() <= 1e-5,
                        "{kernels:?} d={} dv={} n_q={} n_kv={}: element {n}: {g} vs {w}",
                        c.d,
                        c.dv,
                        c.n_q,
                        c.n_kv
                    );
                }
            }
        }
    }

    /// A KV cache of f16 rows (every head of a position in one row, as the language model
    /// keeps it), read by few-row tasks: the F16C direct path where the CPU has it, the
    /// converted rows otherwise. Against an f64 reference on the f16 values, 1e-5 absolute;
    /// identical bits at 1, 2 and 3 threads; key blocks hidden by the mask skipped.
    #[test]
    fn f16_cache_rows_on_the_direct_path_match_f64_reference() {
        use half::f16;
        // (d = dv, n_q, n_kv, n_head, n_head_kv): head sizes with and without 8-wide tails;
        // the keys a row sees (two thirds of the window; 101 of 512, an early decoding step)
        // are split over tasks when there are more than 128 (300 and 700 keys: 2 and 4 parts,
        // the hidden tail in none)
        for (d, n_q, n_kv, n_head, n_head_kv) in [
            (64, 1, 300, 9, 3),
            (64, 1, 512, 9, 3),
            (24, 2, 130, 4, 2),
            (24, 2, 700, 4, 2),
            (13, 1, 40, 3, 1),
        ] {
            let mut seed = 11u64;
            let row = n_head_kv * d;
            let mut k16: Vec<f16> = (0..n_kv * row)
                .map(|_| f16::from_f32(lcg(&mut seed)))
                .collect();
            let mut v16: Vec<f16> = (0..n_kv * row)
                .map(|_| f16::from_f32(lcg(&mut seed)))
                .collect();
            let mut q: Vec<f32> = (0..d * n_q * n_head).map(|_| lcg(&mut seed)).collect();
            // causal over the first positions, the tail of the window hidden
            let used = if n_kv == 512 { 101 } else { n_kv * 2 / 3 };
            let mut mask: Vec<f32> = (0..n_kv * n_q)
                .map(|i| {
                    if i % n_kv < used - n_q + i / n_kv {
                        0.0
                    } else {
                        f32::NEG_INFINITY
                    }
                })
                .collect();
            let cache = |data: &mut Vec<f16>| RawTensor {
                ptr: crate::kernels::view::SendPtr(data.as_mut_ptr().cast()),
                dtype: DType::F16,
                ne: [d, n_kv, n_head_kv, 1],
                nb: [2, 2 * row, 2 * d, 2 * row * n_kv],
            };
            let (k, v) = (cache(&mut k16), cache(&mut v16));
            let q_t = view(&mut q, [d, n_q, n_head, 1]);
            let mask_t = view(&mut mask, [n_kv, n_q, 1, 1]);
            let scale = 1.0 / (d as f32).sqrt();
            let mut want = vec![0f64; d * n_head * n_q];
            for h in 0..n_head {
                let hk = h / (n_head / n_head_kv);
                for i in 0..n_q {
                    let logits: Vec<f64> = (0..n_kv)
                        .map(|j| {
                            let dot: f64 = (0..d)
                                .map(|e| {
                                    q[e + d * (i + n_q * h)] as f64
                                        * k16[j * row + hk * d + e].to_f64()
                                })
                                .sum();
                            dot * scale as f64 + mask[j + n_kv * i] as f64
                        })
                        .collect();
                    let max = logits.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                    let w: Vec<f64> = logits.iter().map(|x| (x - max).exp()).collect();
                    let sum: f64 = w.iter().sum();
                    for e in 0..d {
                        let o: f64 = (0..n_kv)
                            .map(|j| w[j] * v16[j * row + hk * d + e].to_f64())
                            .sum();
                        want[e + d * (h + n_head * i)] = o / sum;
                    }
                }
            }
            for kernels in Kernels::available() {
                let got = at_thread_counts(|| {
                    let mut out = vec![f32::NAN; want.len()];
                    let dst = view(&mut out, [d, n_head, n_q, 1]);
                    flash_attn_ext_with(kernels, dst, q_t, k, v, Some(mask_t), scale, 0.0, 0.0)
                        .unwrap();
                    out.iter().map(|x| x.to_bits()).collect::<Vec<u32>>()
                });
                for (n, (&g, &w)) in got.iter().zip(&want).enumerate() {
                    let g = f32::from_bits(g) as f64;
                    assert!(
                        (g - w).abs() <= 1e-5,
                        "{kernels:?} d={d}: element {n}: {g} vs {w}"
                    );
                }
            }
        }
    }

    #[test]
    fn key_blocks_are_multiples_of_16_within_bounds() {
        for (d, dv) in [(1, 1), (32, 32), (64, 64), (128, 128), (256, 512), (7, 19)] {
            let kb = key_block(d, dv);
            assert!(
                kb.is_multiple_of(16) && (16..=256).contains(&kb),
                "{d} {dv}: {kb}"
            );
        }
    }
}
