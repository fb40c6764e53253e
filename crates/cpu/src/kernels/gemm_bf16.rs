//! MUL_MAT with bf16 weights as bf16 × bf16 products accumulated in f32: the activations are
//! rounded to bf16 (round to nearest even) and multiplied natively, instead of widening the
//! weights to f32.
//!
//! Kernel. On CPUs with AMX-BF16 (this team's Xeon) the products run on AMX tiles:
//! `tdpbf16ps` multiplies a 16 × 32 tile of activations by a 32 × 16 tile of weights (in the
//! pair-interleaved layout the instruction wants, packed per task a panel of 32 weight rows at
//! a time) into a 16 × 16 f32 tile; 2 × 2 output tiles stay in tile registers for a whole
//! row of `k`. `vdpbf16ps` (AVX512_BF16), the instruction the issue named, was measured at
//! about a quarter of the FMA rate per instruction on this CPU (twice the products, so half
//! the f32 FMA's multiply-add rate): it cannot beat the f32 GEMM and is not used. Setting
//! `FERROGRAPH_NO_AMX` in the environment turns the AMX path off (bf16 weights then take the
//! f32 GEMM).
//!
//! Arithmetic. The portable kernel (also compiled for AVX2) computes, for output element
//! `(i, j)`, with `k` padded with zeros to a multiple of 32: `acc = 0`, then for each pair
//! `p` of `k` in ascending order `acc = ftz(acc + w[2p]·x[2p])`, `acc = ftz(acc + w[2p+1]·x[2p+1])`,
//! where bf16 inputs that are subnormal count as zero, each product of two bf16 values is
//! exact in f32, each sum is rounded to nearest even and `ftz` flushes a subnormal sum to
//! zero — `tdpbf16ps`'s documented pseudo-code. The hardware rounds its accumulation
//! differently (measured here: none of the obvious orders or groupings reproduces its bits),
//! so the AMX results are tested against the portable ones with a tolerance (2⁻²⁰ of the sum
//! of the products' magnitudes), not bit for bit. Results never depend on the thread count:
//! every output element is one tile computation whatever the task split. MUL_MAT uses this
//! path only where AMX runs; elsewhere bf16 weights go through the f32 GEMM (widened exactly,
//! f32 activations), which is faster than emulating the tiles.

use super::view::RowIo;
use std::cell::RefCell;

use super::par_ranges;
use super::view::RawTensor;
use crate::dtype::DType;
use crate::error::{Error, Result};

/// `k` per tile step (one tile row of activations: 32 bf16 = 64 bytes).
const KB: usize = 32;
/// Weight rows per packed panel (two 16-column weight tiles).
const PANEL: usize = 32;
/// Activation rows per pass (two 16-row activation tiles).
const ROWS: usize = 32;

/// The kernel family.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Isa {
    /// Portable Rust emulation of the tile arithmetic.
    Portable,
    /// The portable kernel compiled with AVX2 + FMA.
    Avx2,
    /// AMX-BF16 tiles.
    Amx,
}

impl Isa {
    /// Every family this CPU runs, slowest first.
    pub fn available() -> Vec<Isa> {
        let mut out = vec![Isa::Portable];
        if crate::isa::get().avx2_fma() {
            out.push(Isa::Avx2);
        }
        if has_amx_bf16() {
            out.push(Isa::Amx);
        }
        out
    }

    /// The fastest family this CPU runs.
    pub fn best() -> Isa {
        static BEST: std::sync::OnceLock<Isa> = std::sync::OnceLock::new();
        *BEST.get_or_init(|| *Isa::available().last().unwrap_or(&Isa::Portable))
    }
}

/// Whether AMX-BF16 is present and the kernel allowed this process to use its tile state
/// (Linux asks for it once with `arch_prctl(ARCH_REQ_XCOMP_PERM)`), and `FERROGRAPH_NO_AMX` is
/// unset (see [`crate::isa::Features::amx_bf16`]).
fn has_amx_bf16() -> bool {
    crate::isa::get().amx_bf16
}

/// Whether this path handles the product (bf16 weights with dense rows, a dense f32 output).
pub fn applies(a: &RawTensor, dst: &RawTensor) -> bool {
    a.dtype == DType::BF16
        && a.ne[0] > 0
        && a.nb[0] == 2
        && (a.ptr.0 as usize).is_multiple_of(2)
        && a.nb[1..].iter().all(|s| s % 2 == 0)
        && dst.dtype == DType::F32
        && dst.nb[0] == 4
        && (dst.ptr.0 as usize).is_multiple_of(4)
        && dst.nb[1..].iter().all(|s| s % 4 == 0)
}

/// `k` padded to whole tile steps.
fn padded(k: usize) -> usize {
    k.div_ceil(KB) * KB
}

/// A bf16 value as the f32 the tile unit uses: subnormals count as (signed) zero.
#[inline(always)]
fn widen_daz(v: u16) -> f32 {
    let v = if v & 0x7f80 == 0 { v & 0x8000 } else { v };
    f32::from_bits(u32::from(v) << 16)
}

/// Flushes a subnormal f32 to zero of the same sign.
#[inline(always)]
fn ftz(v: f32) -> f32 {
    if v.is_subnormal() {
        f32::from_bits(v.to_bits() & 0x8000_0000)
    } else {
        v
    }
}

/// Packs weight rows (`rows[r]`: `k` bf16 values of panel row `r`; `None` past the last row)
/// into tiles: per step of 32 `k`, two 1 KiB tiles (rows 0..16, 16..32), each 16 lines of
/// (pair `p`, 16 weight rows × 2 values).
fn pack_panel(rows: &[Option<&[u16]>; PANEL], k: usize, out: &mut Vec<u16>) {
    let kp = padded(k);
    out.clear();
    out.resize(kp / KB * 2 * 512, 0);
    let mut done = 0;
    #[cfg(target_arch = "x86_64")]
    if has_avx512() {
        // SAFETY: the CPU has AVX-512F (checked); every present row holds `k` values and
        // `out` holds `kp / 32` packed steps.
        done = unsafe { x86::pack_full_steps(rows, k, out) };
    }
    pack_steps_portable(rows, k, done, out);
}

/// Whether the AVX-512F packer can run on this CPU.
fn has_avx512() -> bool {
    crate::isa::get().avx512f()
}

/// [`pack_panel`] in portable Rust for the steps from `first_step` on (`out` zeroed).
fn pack_steps_portable(
    rows: &[Option<&[u16]>; PANEL],
    k: usize,
    first_step: usize,
    out: &mut [u16],
) {
    for (r, row) in rows.iter().enumerate() {
        let Some(row) = row else { continue };
        let (t, col) = (r / 16, r % 16);
        for (kk, &v) in row.iter().enumerate().take(k).skip(first_step * KB) {
            let (step, p, h) = (kk / KB, (kk % KB) / 2, kk % 2);
            out[(step * 2 + t) * 512 + p * 32 + col * 2 + h] = v;
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{KB, PANEL};
    use std::arch::x86_64::*;

    /// Packs the steps of 32 `k` that every row holds completely with gathers (one gather
    /// = one 64-byte line: one pair of `k` of 16 rows) and returns how many it packed (0 when
    /// the rows are too far apart for 32-bit offsets).
    ///
    /// # Safety
    /// The CPU must support AVX-512F; every present row holds `k` values (`rows[0]` present)
    /// and `out` holds `ceil(k / 32)` packed steps.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn pack_full_steps(
        rows: &[Option<&[u16]>; PANEL],
        k: usize,
        out: &mut [u16],
    ) -> usize {
        let Some(first) = rows[0] else { return 0 };
        let base = first.as_ptr().cast::<u8>();
        let mut offsets = [[0i32; 16]; 2];
        let mut masks = [0u16; 2];
        for (r, row) in rows.iter().enumerate() {
            if let Some(row) = row {
                let off = row.as_ptr() as isize - base as isize;
                let Ok(off) = i32::try_from(off) else {
                    return 0;
                };
                if i32::try_from(i64::from(off) + 2 * k as i64).is_err() {
                    return 0;
                }
                offsets[r / 16][r % 16] = off;
                masks[r / 16] |= 1 << (r % 16);
            }
        }
        let steps = k / KB;
        let zero = _mm512_setzero_si512();
        for t in 0..2 {
            // SAFETY: `offsets[t]` holds 16 i32.
            let at = unsafe { _mm512_loadu_si512(offsets[t].as_ptr().cast()) };
            for step in 0..steps {
                for p in 0..KB / 2 {
                    let o =
                        _mm512_add_epi32(at, _mm512_set1_epi32(((step * KB + 2 * p) * 2) as i32));
                    // SAFETY: present rows hold elements step·32 + 2p and + 1 (step < k / 32);
                    // masked lanes are not read; the line lies inside `out`.
                    unsafe {
                        let line = _mm512_mask_i32gather_epi32::<1>(zero, masks[t], o, base.cast());
                        _mm512_storeu_si512(
                            out.as_mut_ptr().add((step * 2 + t) * 512 + p * 32).cast(),
                            line,
                        );
                    }
                }
            }
        }
        steps
    }

    /// [`super::round_bf16`] on 16 values at a time; returns how many it rounded (a multiple
    /// of 16, at most `min(x.len(), out.len())`).
    ///
    /// # Safety
    /// The CPU must support AVX-512F.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn round_row(x: &[f32], out: &mut [u16]) -> usize {
        let n = x.len().min(out.len()) / 16 * 16;
        let abs = _mm512_set1_epi32(0x7fff_ffff);
        let inf = _mm512_set1_epi32(0x7f80_0000);
        let half = _mm512_set1_epi32(0x7fff);
        let one = _mm512_set1_epi32(1);
        let quiet = _mm512_set1_epi32(0x40);
        for i in (0..n).step_by(16) {
            // SAFETY: 16 values at `i` exist in `x` and `out` (i + 16 ≤ n).
            unsafe {
                let v = _mm512_loadu_si512(x.as_ptr().add(i).cast());
                let nan = _mm512_cmpgt_epi32_mask(_mm512_and_si512(v, abs), inf);
                let hi = _mm512_srli_epi32::<16>(v);
                let rounded = _mm512_srli_epi32::<16>(_mm512_add_epi32(
                    _mm512_add_epi32(v, half),
                    _mm512_and_si512(hi, one),
                ));
                let r = _mm512_mask_or_epi32(rounded, nan, hi, quiet);
                _mm256_storeu_si256(out.as_mut_ptr().add(i).cast(), _mm512_cvtepi32_epi16(r));
            }
        }
        n
    }
}

/// The portable kernel: `out[j][i]` for activation rows `acts` (`ROWS` rows of `kp` bf16,
/// stride `kp`) and the packed panel.
#[inline(always)]
fn tile_portable(panel: &[u16], acts: &[u16], kp: usize, out: &mut [[f32; PANEL]; ROWS]) {
    for (j, out_row) in out.iter_mut().enumerate() {
        let x = &acts[j * kp..(j + 1) * kp];
        for (i, o) in out_row.iter_mut().enumerate() {
            let (t, col) = (i / 16, i % 16);
            let mut acc = 0f32;
            for step in 0..kp / KB {
                let tile = &panel[(step * 2 + t) * 512..];
                for p in 0..KB / 2 {
                    for h in 0..2 {
                        let w = widen_daz(tile[p * 32 + col * 2 + h]);
                        let a = widen_daz(x[step * KB + 2 * p + h]);
                        acc = ftz(acc + ftz(w * a));
                    }
                }
            }
            *o = acc;
        }
    }
}

/// [`tile_portable`] compiled with AVX2 + FMA (the same arithmetic).
///
/// # Safety
/// The CPU must support AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn tile_avx2(panel: &[u16], acts: &[u16], kp: usize, out: &mut [[f32; PANEL]; ROWS]) {
    tile_portable(panel, acts, kp, out);
}

#[cfg(target_arch = "x86_64")]
mod amx {
    use super::{KB, PANEL, ROWS};
    use std::arch::asm;

    /// The tile configuration: palette 1; tiles 0-3 are 16 × 16 f32 outputs, 4-5 16 × 32
    /// bf16 activations, 6-7 16 pairs × 16 columns of bf16 weights (all 16 rows × 64 bytes).
    #[repr(C, align(64))]
    struct Config([u8; 64]);

    fn config() -> Config {
        let mut c = [0u8; 64];
        c[0] = 1;
        for t in 0..8 {
            c[16 + 2 * t..18 + 2 * t].copy_from_slice(&64u16.to_le_bytes());
            c[48 + t] = 16;
        }
        Config(c)
    }

    /// The AMX kernel (see [`super::tile_portable`] for what it computes).
    ///
    /// # Safety
    /// AMX-BF16 must be usable by this process (`has_amx_bf16`); `panel` holds `kp / 32`
    /// packed steps and `acts` `ROWS` rows of `kp` bf16 values.
    pub unsafe fn tile(panel: &[u16], acts: &[u16], kp: usize, out: &mut [[f32; PANEL]; ROWS]) {
        let cfg = config();
        let a_stride = kp * 2;
        let (pa, pw) = (acts.as_ptr(), panel.as_ptr());
        // SAFETY: the configuration is valid for palette 1; every tile load reads 16 rows of
        // 64 bytes inside `acts` (rows j0..j0 + 16, elements s·32..s·32 + 32) or inside the
        // panel (one 1 KiB tile); the stores write the 32 × 32 f32 of `out` (128-byte
        // rows). The tile registers are used by nothing else in this program.
        unsafe {
            asm!("ldtilecfg [{}]", in(reg) cfg.0.as_ptr(), options(nostack, readonly));
            asm!(
                "tilezero tmm0",
                "tilezero tmm1",
                "tilezero tmm2",
                "tilezero tmm3",
                options(nostack, nomem)
            );
            for step in 0..kp / KB {
                let a0 = pa.add(step * KB);
                let a1 = pa.add(16 * kp + step * KB);
                let w0 = pw.add(step * 2 * 512);
                let w1 = pw.add((step * 2 + 1) * 512);
                asm!(
                    "tileloadd tmm4, [{a0} + {sa}*1]",
                    "tileloadd tmm5, [{a1} + {sa}*1]",
                    "tileloadd tmm6, [{w0} + {sw}*1]",
                    "tileloadd tmm7, [{w1} + {sw}*1]",
                    "tdpbf16ps tmm0, tmm4, tmm6",
                    "tdpbf16ps tmm1, tmm4, tmm7",
                    "tdpbf16ps tmm2, tmm5, tmm6",
                    "tdpbf16ps tmm3, tmm5, tmm7",
                    a0 = in(reg) a0,
                    a1 = in(reg) a1,
                    w0 = in(reg) w0,
                    w1 = in(reg) w1,
                    sa = in(reg) a_stride,
                    sw = in(reg) 64usize,
                    options(nostack, readonly)
                );
            }
            let o = out.as_mut_ptr().cast::<f32>();
            let so = PANEL * 4;
            asm!(
                "tilestored [{o00} + {so}*1], tmm0",
                "tilestored [{o01} + {so}*1], tmm1",
                "tilestored [{o10} + {so}*1], tmm2",
                "tilestored [{o11} + {so}*1], tmm3",
                "tilerelease",
                o00 = in(reg) o,
                o01 = in(reg) o.add(16),
                o10 = in(reg) o.add(16 * PANEL),
                o11 = in(reg) o.add(16 * PANEL + 16),
                so = in(reg) so,
                options(nostack)
            );
        }
        let _ = ROWS;
    }
}

/// One pass with the kernels of `isa`.
fn run_tile(isa: Isa, panel: &[u16], acts: &[u16], kp: usize, out: &mut [[f32; PANEL]; ROWS]) {
    assert!(kp.is_multiple_of(KB) && panel.len() >= kp / KB * 1024 && acts.len() >= ROWS * kp);
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `Amx` is only chosen when the process may use AMX-BF16; sizes checked above.
        Isa::Amx => unsafe { amx::tile(panel, acts, kp, out) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `Avx2` is only chosen when the CPU has AVX2 and FMA.
        Isa::Avx2 => unsafe { tile_avx2(panel, acts, kp, out) },
        #[allow(unreachable_patterns)]
        _ => tile_portable(panel, acts, kp, out),
    }
}

/// `v` rounded to bf16, to nearest even; NaN stays a (quiet) NaN.
#[inline(always)]
fn round_bf16(v: f32) -> u16 {
    let x = v.to_bits();
    if x & 0x7fff_ffff > 0x7f80_0000 {
        return ((x >> 16) | 0x40) as u16;
    }
    ((x + 0x7fff + ((x >> 16) & 1)) >> 16) as u16
}

/// Rounds f32 activations to bf16 ([`round_bf16`]) into `out` (`k` padded with zeros to
/// `out.len()`); AVX-512 when the CPU has it, with the same bits.
fn round_row(x: &[f32], out: &mut [u16]) {
    let mut done = 0;
    #[cfg(target_arch = "x86_64")]
    if has_avx512() {
        // SAFETY: the CPU has AVX-512F (checked).
        done = unsafe { x86::round_row(x, out) };
    }
    for (o, &v) in out.iter_mut().zip(x).skip(done) {
        *o = round_bf16(v);
    }
    out[x.len()..].iter_mut().for_each(|o| *o = 0);
}

thread_local! {
    // The packed panel of the running task, kept between calls.
    static PANEL_BUF: RefCell<Vec<u16>> = const { RefCell::new(Vec::new()) };
    // The calling thread's activations rounded to bf16, kept between calls.
    static ACTS_BUF: RefCell<Vec<u16>> = const { RefCell::new(Vec::new()) };
}

/// MUL_MAT `dst[i, j, i12, i13] = Σ_k a[k, i, i12/r2, i13/r3] · b[k, j, i12, i13]` with bf16
/// weights `a` (see the module documentation) on the kernels of `isa`.
pub fn mul_mat(
    isa: Isa,
    dst: &RawTensor,
    a: &RawTensor,
    b: &RawTensor,
    (r2, r3): (usize, usize),
) -> Result<()> {
    if !applies(a, dst) || b.ne[0] != a.ne[0] {
        return Err(Error::shape("bf16 GEMM: operands do not fit this path"));
    }
    let (k, m, n) = (a.ne[0], a.ne[1], b.ne[1]);
    let (ne12, ne13) = (b.ne[2], b.ne[3]);
    let kp = padded(k);
    let batches = ne12 * ne13;
    // Activations: per batch, n rows padded to a multiple of ROWS, each kp bf16.
    let n_pad = n.next_multiple_of(ROWS);
    let mut acts = ACTS_BUF.with(RefCell::take);
    acts.clear();
    acts.resize(batches * n_pad * kp, 0);
    super::par_rows_mut(
        &mut acts,
        kp,
        || vec![0f32; k],
        |r, out, buf| {
            let (batch, j) = (r / n_pad, r % n_pad);
            if j < n {
                let (i2, i3) = (batch % ne12, batch / ne12);
                // SAFETY: row (j, i2, i3) lies inside `b` (read-only).
                unsafe { b.load_row(j, i2, i3, buf)? };
                round_row(buf, out);
            }
            Ok(())
        },
    )?;
    let panels = m.div_ceil(PANEL);
    let tasks = batches * panels;
    let (r2, r3) = (r2.max(1), r3.max(1));
    let acts_ref = &acts;
    let result = par_ranges(tasks, 1, |range| {
        let mut buf = PANEL_BUF.with(RefCell::take);
        let mut out = [[0f32; PANEL]; ROWS];
        for task in range {
            let p = task % panels;
            let batch = task / panels;
            let (i12, i13) = (batch % ne12, batch / ne12);
            let (i02, i03) = (i12 / r2, i13 / r3);
            let i0 = p * PANEL;
            let rows: [Option<&[u16]>; PANEL] = std::array::from_fn(|r| {
                (i0 + r < m).then(|| {
                    // SAFETY: weight row (i0 + r, i02, i03) lies inside `a` (read-only) and
                    // holds `k` dense, 2-byte aligned bf16 values (`applies`).
                    unsafe {
                        std::slice::from_raw_parts(
                            a.at(a.row_offset(i0 + r, i02, i03))
                                .cast::<u16>()
                                .cast_const(),
                            k,
                        )
                    }
                })
            });
            pack_panel(&rows, k, &mut buf);
            let valid = (m - i0).min(PANEL);
            let base = batch * n_pad * kp;
            for j0 in (0..n).step_by(ROWS) {
                let x = &acts_ref[base + j0 * kp..base + (j0 + ROWS) * kp];
                run_tile(isa, &buf, x, kp, &mut out);
                for (jj, row) in out.iter().enumerate().take((n - j0).min(ROWS)) {
                    let off = dst.row_offset(j0 + jj, i12, i13) + i0 * 4;
                    // SAFETY: output elements (i0..i0 + valid, j0 + jj) of batch (i12, i13)
                    // lie inside `dst`, are contiguous f32 (`applies`) and belong to this
                    // task alone.
                    unsafe {
                        std::ptr::copy_nonoverlapping(
                            row.as_ptr(),
                            dst.at(off).cast::<f32>(),
                            valid,
                        )
                    };
                }
            }
        }
        PANEL_BUF.with(|cell| cell.replace(buf));
        Ok(())
    });
    ACTS_BUF.with(|cell| cell.replace(acts));
    result
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::testing::values;
    use half::bf16;

    /// The SIMD rounding to bf16 gives the portable bits (ties, NaN, infinities, overflow to
    /// infinity, subnormals), and rounds to nearest even like `half`'s conversion on
    /// ordinary values.
    #[test]
    fn round_row_matches_the_portable_rounding() {
        let mut x = values(1000, 17);
        let specials = [
            f32::from_bits(0x3f80_8000),
            f32::from_bits(0x3f81_8000),
            f32::from_bits(0xbf80_8000),
            f32::NAN,
            -f32::NAN,
            f32::from_bits(0x7f80_0001),
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::MAX,
            -f32::MAX,
            1e-40,
            -0.0,
        ];
        x[..specials.len()].copy_from_slice(&specials);
        let mut got = vec![0u16; 1024];
        round_row(&x, &mut got);
        for (i, (&v, &g)) in x.iter().zip(&got).enumerate() {
            assert_eq!(g, round_bf16(v), "value {i}: {v}");
        }
        assert!(got[1000..].iter().all(|&g| g == 0));
        assert_eq!(round_bf16(f32::from_bits(0x3f80_8000)), 0x3f80);
        assert_eq!(round_bf16(f32::from_bits(0x3f81_8000)), 0x3f82);
        assert_eq!(round_bf16(f32::MAX), 0x7f80);
        for &v in &x[specials.len()..] {
            assert_eq!(round_bf16(v), bf16::from_f32(v).to_bits());
        }
    }

    /// The portable kernel and its AVX2 build give the written-out arithmetic's bits; the AMX
    /// kernel stays within 2⁻²⁰ of the sum of the products' magnitudes (its accumulation
    /// rounds differently, see the module documentation) — on ordinary values, values whose
    /// products fall near or into the subnormal range, subnormal inputs and an odd `k`
    /// (zero padding).
    #[test]
    fn every_isa_matches_the_pair_arithmetic() {
        for (k, scale) in [
            (64usize, 1.0f32),
            (50, 1e-19),
            (96, 1e-19),
            (33, 3e17),
            (800, 1.0),
        ] {
            let m = 29;
            let w: Vec<u16> = values(m * k, 3 + k as u32)
                .iter()
                .map(|&v| bf16::from_f32(v * scale).to_bits())
                .collect();
            let mut xf = values(ROWS * k, 4 + k as u32);
            xf.iter_mut().for_each(|v| *v *= scale);
            xf[3] = 1e-40; // subnormal: counts as zero
            let kp = padded(k);
            let mut acts = vec![0u16; ROWS * kp];
            for (j, row) in xf.chunks_exact(k).enumerate() {
                round_row(row, &mut acts[j * kp..(j + 1) * kp]);
            }
            let rows: [Option<&[u16]>; PANEL] =
                std::array::from_fn(|r| (r < m).then(|| &w[r * k..(r + 1) * k]));
            let mut panel = Vec::new();
            pack_panel(&rows, k, &mut panel);
            let mut portable = vec![0u16; panel.len()];
            pack_steps_portable(&rows, k, 0, &mut portable);
            assert!(
                panel == portable,
                "k {k}: packed panels differ from the portable packer"
            );
            let mut want = [[0f32; PANEL]; ROWS];
            let mut magnitude = [[0f64; PANEL]; ROWS];
            for (j, row) in want.iter_mut().enumerate() {
                for (i, o) in row.iter_mut().enumerate().take(m) {
                    let mut acc = 0f32;
                    for kk in 0..k {
                        let p = widen_daz(w[i * k + kk]) * widen_daz(acts[j * kp + kk]);
                        acc = ftz(acc + ftz(p));
                        magnitude[j][i] += f64::from(p).abs();
                    }
                    *o = acc;
                }
            }
            for isa in Isa::available() {
                let mut out = [[0f32; PANEL]; ROWS];
                run_tile(isa, &panel, &acts, kp, &mut out);
                for j in 0..ROWS {
                    for i in 0..m {
                        let (got, exp) = (out[j][i], want[j][i]);
                        if isa == Isa::Amx {
                            let limit = magnitude[j][i] * 2f64.powi(-20) + 1e-37;
                            assert!(
                                (f64::from(got) - f64::from(exp)).abs() <= limit,
                                "{isa:?} k {k} scale {scale}: ({i}, {j}) {got} vs {exp}"
                            );
                        } else {
                            assert_eq!(
                                got.to_bits(),
                                exp.to_bits(),
                                "{isa:?} k {k} scale {scale}: ({i}, {j}) {got} vs {exp}"
                            );
                        }
                    }
                }
            }
        }
    }
}
