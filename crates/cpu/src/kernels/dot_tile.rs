//! Register-tiled dot products for matrix products with few columns: 4 weight rows × up to 3
//! activation rows per pass (4 with AVX-512), so every loaded vector feeds several
//! multiply-adds instead of one, and the 4 row sums of a column are reduced together (one
//! horizontal-add tree, not four separate horizontal sums — with short rows the reductions are
//! a large share of the work). Used by MUL_MAT below the GEMM path's column threshold (see
//! `gemm::applies`: 32 columns, 72 for f16/bf16 weights on AVX-512). A row's result depends
//! only on its own row and column (the reduction tree keeps rows apart), so MUL_MAT pads a
//! tile's missing rows with copies and any grouping of rows gives the same bits.

use super::quant_dot::dot_f32;
#[cfg(target_arch = "x86_64")]
use super::simd::{hsum4, load_tail, Avx2, Avx512, Simd};

/// Activation rows per pass of [`dots_4xc`] on this CPU: 4 with AVX-512 (32 registers: 16
/// accumulators, 4 activation vectors, 1 weight vector), else 3 (the widest tile that fits
/// the 16 AVX registers).
pub(crate) fn max_tile_cols() -> usize {
    if has_avx512f() {
        4
    } else {
        3
    }
}

/// Whether the AVX-512 tile kernel can run on this CPU: AVX-512F and VL (with VL, 256-bit
/// instructions such as the f16 loads may use all 32 registers: with F alone LLVM kept the 16
/// accumulators in the lower 16 and spilled them to the stack every step), with the AVX2 and
/// FMA the rest of the module's code is built with.
fn has_avx512f() -> bool {
    let isa = crate::isa::get();
    isa.avx512f_avx2_fma() && isa.avx512vl
}

/// The element type of the weight rows a tile reads: f32, or the bits of 16-bit floats,
/// widened to f32 in registers as they are loaded (exactly, so a tile over 16-bit rows gives
/// the bits of the same tile over the rows converted to f32 first).
pub(crate) trait TileWeight: Copy + Sync {
    /// `LANES` elements at `p` widened, or with masked tails the first `min(n, LANES)` and
    /// zeros (as [`load_tail`] reads f32).
    ///
    /// # Safety
    /// As [`load_tail`], for elements of this type; the CPU has F16C.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load<S: Simd>(s: S, p: *const Self, n: usize) -> S::V;

    /// One element as f32 (exact).
    fn widen(self) -> f32;
}

impl TileWeight for f32 {
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load<S: Simd>(s: S, p: *const f32, n: usize) -> S::V {
        // SAFETY: forwarded (caller).
        unsafe {
            if n >= S::LANES {
                s.loadu(p)
            } else {
                load_tail(s, p, n)
            }
        }
    }
    #[inline(always)]
    fn widen(self) -> f32 {
        self
    }
}

/// The bits of an IEEE half-precision float (GGML's f16), as a tile's weight element.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(transparent)]
pub(crate) struct F16Bits(pub u16);

/// The bits of a bfloat16, as a tile's weight element.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(transparent)]
pub(crate) struct Bf16Bits(pub u16);

impl TileWeight for F16Bits {
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load<S: Simd>(s: S, p: *const F16Bits, n: usize) -> S::V {
        // SAFETY: forwarded (caller): `F16Bits` is a transparent `u16`.
        unsafe { s.load_half::<false>(p.cast(), n) }
    }
    #[inline(always)]
    fn widen(self) -> f32 {
        super::quant_dot::f16_bits_to_f32(self.0)
    }
}

impl TileWeight for Bf16Bits {
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load<S: Simd>(s: S, p: *const Bf16Bits, n: usize) -> S::V {
        // SAFETY: forwarded (caller): `Bf16Bits` is a transparent `u16`.
        unsafe { s.load_half::<true>(p.cast(), n) }
    }
    #[inline(always)]
    fn widen(self) -> f32 {
        super::quant_dot::bf16_bits_widened(self.0)
    }
}

/// Whether [`dots_4xc`] runs SIMD code on this CPU (otherwise it widens 16-bit weight rows
/// one by one: callers holding such rows convert them once instead).
pub(crate) fn simd_tiles() -> bool {
    has_avx512f() || crate::isa::get().avx2_fma_f16c()
}

/// `out[r][c] = a[r] · b[c]` for 4 rows of `a` and `C` (1 to 4) of `b`, all of length `k`.
/// With `next`, it asks meanwhile for the cache lines of the first `k` elements of those 4
/// rows (the weight rows the caller computes next; a hint: nothing is read through them).
pub(crate) fn dots_4xc<W: TileWeight, const C: usize>(
    a: [&[W]; 4],
    b: [&[f32]; C],
    next: Option<[*const W; 4]>,
) -> [[f32; C]; 4] {
    debug_assert!((1..=4).contains(&C));
    let k = b[0].len();
    assert!(a.iter().all(|r| r.len() == k) && b.iter().all(|r| r.len() == k));
    #[cfg(target_arch = "x86_64")]
    if has_avx512f() {
        if let Some(s) = Avx512::new() {
            // SAFETY: the token proves AVX-512F (which implies F16C), `has_avx512f` checked
            // VL; every row holds `k` elements (asserted).
            return unsafe { dots_4xc_avx512(s, a, b, k, next) };
        }
    }
    #[cfg(target_arch = "x86_64")]
    if crate::isa::get().avx2_fma_f16c() {
        // SAFETY: the CPU has AVX2, FMA and F16C (checked); every row holds `k` elements
        // (asserted).
        return unsafe { dots_4xc_avx2(Avx2::assume(), a, b, k, next) };
    }
    let mut out = [[0f32; C]; 4];
    for (r, row) in a.iter().enumerate() {
        let row: Vec<f32> = row.iter().map(|w| w.widen()).collect();
        for (c, col) in b.iter().enumerate() {
            out[r][c] = dot_f32(&row, col);
        }
    }
    out
}

/// [`dots_4xc`] for AVX-512 (16 lanes; the last `k % 16` elements through masked loads).
///
/// # Safety
/// The CPU must have AVX-512VL (as well as the token's AVX-512F); every slice must hold at
/// least `k` elements.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512vl")]
unsafe fn dots_4xc_avx512<W: TileWeight, const C: usize>(
    s: Avx512,
    a: [&[W]; 4],
    b: [&[f32]; C],
    k: usize,
    next: Option<[*const W; 4]>,
) -> [[f32; C]; 4] {
    // SAFETY: forwarded (caller).
    unsafe { dots_4xc_simd(s, a, b, k, next) }
}

/// [`dots_4xc`] for AVX2 (8 lanes; the last `k % 8` elements added in scalar code).
///
/// # Safety
/// The CPU must have F16C (as well as the token's AVX2 and FMA); every slice must hold at
/// least `k` elements.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dots_4xc_avx2<W: TileWeight, const C: usize>(
    s: Avx2,
    a: [&[W]; 4],
    b: [&[f32]; C],
    k: usize,
    next: Option<[*const W; 4]>,
) -> [[f32; C]; 4] {
    // SAFETY: forwarded (caller).
    unsafe { dots_4xc_simd(s, a, b, k, next) }
}

/// The tile for any [`Simd`]: lane `l` of accumulator `(r, c)` sums the products of elements
/// `i ≡ l (mod LANES)` in order with fused multiply-adds; the lanes are folded to 8
/// ([`Simd::halves8`]) and the 4 rows of a column reduced together ([`hsum4`]). With masked
/// tails the last partial vector is loaded with zeros past `k`; without, the last `k % LANES`
/// products are added to the reduced sum one by one (unfused). Weight elements are widened
/// exactly, so the arithmetic is that of the widened rows.
///
/// # Safety
/// Every slice must hold at least `k` elements; the CPU has F16C.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn dots_4xc_simd<S: Simd, W: TileWeight, const C: usize>(
    s: S,
    a: [&[W]; 4],
    b: [&[f32]; C],
    k: usize,
    next: Option<[*const W; 4]>,
) -> [[f32; C]; 4] {
    // acc[c][r]: column-major so each column's four row accumulators reduce together.
    let mut acc = [[s.zero(); 4]; C];
    let full = if S::MASKED_TAILS {
        k
    } else {
        k / S::LANES * S::LANES
    };
    // Whole vectors with plain loads, then (masked tails) one partial vector: the same steps
    // as masked loads all along, without a mask to compute per load.
    let whole = k / S::LANES * S::LANES;
    let mut i = 0;
    while i < whole {
        // The next rows' line at this offset, each time the current rows enter a new line.
        if let Some(rows) = next {
            if (i * std::mem::size_of::<W>()).is_multiple_of(64) {
                for row in rows {
                    super::simd::prefetch_lines(row.wrapping_add(i).cast(), 1);
                }
            }
        }
        // SAFETY: i + LANES <= k and every slice holds k elements (caller).
        unsafe { tile_step(s, &mut acc, &a, &b, i, None) };
        i += S::LANES;
    }
    if full > whole {
        // SAFETY: only the first k - i lanes are accessed (masked tails).
        unsafe { tile_step(s, &mut acc, &a, &b, i, Some(k - i)) };
    }
    let mut out = [[0f32; C]; 4];
    for c in 0..C {
        let v = acc[c];
        let halves = [
            s.halves8(v[0]),
            s.halves8(v[1]),
            s.halves8(v[2]),
            s.halves8(v[3]),
        ];
        let sums = hsum4(s, halves);
        for r in 0..4 {
            let mut sum = sums[r];
            for j in full..k {
                sum += a[r][j].widen() * b[c][j];
            }
            out[r][c] = sum;
        }
    }
    out
}

/// One step of [`dots_4xc_simd`]: elements `i..i + LANES` of every row into the
/// accumulators (`acc[c][r]` += a[r] × b[c] per lane), or with `tail = Some(n)` the first `n`
/// through masked loads.
///
/// # Safety
/// Every slice holds `i + LANES` elements, or `i + n` with a tail; the CPU has F16C.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn tile_step<S: Simd, W: TileWeight, const C: usize>(
    s: S,
    acc: &mut [[S::V; 4]; C],
    a: &[&[W]; 4],
    b: &[&[f32]; C],
    i: usize,
    tail: Option<usize>,
) {
    // SAFETY: as the caller guarantees.
    unsafe {
        let mut bv = [s.zero(); C];
        for c in 0..C {
            let p = b[c].as_ptr().add(i);
            bv[c] = match tail {
                None => s.loadu(p),
                Some(n) => s.load_partial(p, n),
            };
        }
        for r in 0..4 {
            let p = a[r].as_ptr().add(i);
            let w = match tail {
                None => W::load(s, p, S::LANES),
                Some(n) => W::load(s, p, n),
            };
            for c in 0..C {
                acc[c][r] = s.fma(w, bv[c], acc[c][r]);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "x86_64")]
    use crate::kernels::simd::tests::Emu16;

    /// [`dots_4xc_simd`] on [`Emu16`], the 16-lane stand-in for AVX-512.
    ///
    /// # Safety
    /// As [`dots_4xc_simd`].
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn emu16<W: TileWeight, const C: usize>(
        s: Emu16,
        a: [&[W]; 4],
        b: [&[f32]; C],
        k: usize,
    ) -> [[f32; C]; 4] {
        // SAFETY: forwarded (caller).
        unsafe { dots_4xc_simd(s, a, b, k, None) }
    }

    #[cfg(target_arch = "x86_64")]
    fn bits<const C: usize>(x: [[f32; C]; 4]) -> [[u32; C]; 4] {
        x.map(|row| row.map(f32::to_bits))
    }

    /// The exact arithmetic of [`dots_4xc_simd`] with `lanes` lanes, in scalar code: lane
    /// sums by fused multiply-adds, folded to 8 lanes (low + high), the hadd tree, then the
    /// unmasked tail one product at a time.
    #[cfg(target_arch = "x86_64")]
    fn model<const C: usize>(
        lanes: usize,
        masked: bool,
        a: [&[f32]; 4],
        b: [&[f32]; C],
        k: usize,
    ) -> [[f32; C]; 4] {
        let full = if masked { k } else { k / lanes * lanes };
        std::array::from_fn(|r| {
            std::array::from_fn(|c| {
                let mut acc = vec![0f32; lanes];
                for i in 0..full {
                    acc[i % lanes] = a[r][i].mul_add(b[c][i], acc[i % lanes]);
                }
                let l8: Vec<f32> = if lanes == 16 {
                    (0..8).map(|l| acc[l] + acc[l + 8]).collect()
                } else {
                    acc
                };
                let mut sum =
                    ((l8[0] + l8[1]) + (l8[2] + l8[3])) + ((l8[4] + l8[5]) + (l8[6] + l8[7]));
                for j in full..k {
                    sum += a[r][j] * b[c][j];
                }
                sum
            })
        })
    }

    /// Checks a `C`-column tile, through every SIMD path this CPU has, against f64 dot products.
    fn check<const C: usize>(rows: &[Vec<f32>], k: usize) {
        let a = [&rows[0][..], &rows[1][..], &rows[2][..], &rows[3][..]];
        let b: [&[f32]; C] = std::array::from_fn(|c| &rows[4 + c][..]);
        let mut paths = vec![("dispatch", dots_4xc(a, b, None))];
        // Prefetching other rows meanwhile is a hint: the same bits.
        #[cfg(target_arch = "x86_64")]
        {
            let next = std::array::from_fn(|r| rows[(r + 1) % rows.len()].as_ptr());
            assert_eq!(
                bits(dots_4xc(a, b, Some(next))),
                bits(paths[0].1),
                "prefetching k={k}"
            );
        }
        #[cfg(target_arch = "x86_64")]
        {
            if crate::isa::get().avx2_fma_f16c() {
                // SAFETY: the CPU has AVX2, FMA and F16C; every row holds `k` elements.
                let got = unsafe { dots_4xc_avx2(Avx2::assume(), a, b, k, None) };
                assert_eq!(bits(got), bits(model(8, false, a, b, k)), "avx2 k={k}");
                paths.push(("avx2", got));
            }
            if let Some(s) = Avx512::new().filter(|_| has_avx512f()) {
                // SAFETY: the CPU has AVX-512F and VL; every row holds `k` elements.
                let got = unsafe { dots_4xc_avx512(s, a, b, k, None) };
                assert_eq!(bits(got), bits(model(16, true, a, b, k)), "avx512 k={k}");
                paths.push(("avx512", got));
            }
            if let Some(s) = Emu16::new().filter(|_| crate::isa::get().f16c) {
                // SAFETY: every row holds `k` elements; the CPU has F16C.
                let got = unsafe { emu16(s, a, b, k) };
                assert_eq!(bits(got), bits(model(16, true, a, b, k)), "emu16 k={k}");
                paths.push(("emu16", got));
            }
        }
        for (path, got) in paths {
            for r in 0..4 {
                for c in 0..C {
                    let exact: f64 = a[r]
                        .iter()
                        .zip(b[c])
                        .map(|(x, y)| *x as f64 * *y as f64)
                        .sum();
                    let err = (got[r][c] as f64 - exact).abs();
                    assert!(
                        err <= 1e-4 * (1.0 + exact.abs()),
                        "{path} k={k} C={C} r={r} c={c}: {} vs {exact}",
                        got[r][c]
                    );
                }
            }
        }
    }

    #[test]
    fn matches_f64_dots_for_odd_lengths_and_every_width() {
        for k in [1usize, 7, 8, 9, 31, 384, 1537] {
            let rows: Vec<Vec<f32>> = (0..8)
                .map(|r| {
                    (0..k)
                        .map(|i| ((i * 3 + r * 7) % 17) as f32 * 0.1 - 0.8)
                        .collect()
                })
                .collect();
            check::<1>(&rows, k);
            check::<2>(&rows, k);
            check::<3>(&rows, k);
            check::<4>(&rows, k);
        }
    }

    /// Every path's tile over 16-bit weight rows, widened as loaded, against the same path's
    /// tile over the rows widened to f32 first: the same bits (widening is exact), prefetch
    /// or not, for row lengths with and without a partial last vector.
    #[cfg(target_arch = "x86_64")]
    fn check_half<W: TileWeight, const C: usize>(bits16: &[Vec<u16>], wrap: fn(u16) -> W) {
        let k = bits16[0].len();
        let half: Vec<Vec<W>> = bits16
            .iter()
            .map(|r| r.iter().map(|&b| wrap(b)).collect())
            .collect();
        let wide: Vec<Vec<f32>> = half
            .iter()
            .map(|r| r.iter().map(|w| w.widen()).collect())
            .collect();
        let (ah, aw) = (
            [&half[0][..], &half[1][..], &half[2][..], &half[3][..]],
            [&wide[0][..], &wide[1][..], &wide[2][..], &wide[3][..]],
        );
        let b: [&[f32]; C] = std::array::from_fn(|c| &wide[4 + c][..]);
        let next = std::array::from_fn(|r| half[(r + 1) % 4].as_ptr());
        let want = bits(dots_4xc(aw, b, None));
        assert_eq!(bits(dots_4xc(ah, b, None)), want, "dispatch k={k} C={C}");
        assert_eq!(
            bits(dots_4xc(ah, b, Some(next))),
            want,
            "prefetching k={k} C={C}"
        );
        if crate::isa::get().avx2_fma_f16c() {
            // SAFETY: the CPU has AVX2, FMA and F16C; every row holds `k` elements.
            let (got, want) = unsafe {
                (
                    dots_4xc_avx2(Avx2::assume(), ah, b, k, None),
                    dots_4xc_avx2(Avx2::assume(), aw, b, k, None),
                )
            };
            assert_eq!(bits(got), bits(want), "avx2 k={k} C={C}");
        }
        if let Some(s) = Avx512::new().filter(|_| has_avx512f()) {
            // SAFETY: the CPU has AVX-512F and VL; every row holds `k` elements.
            let (got, want) = unsafe {
                (
                    dots_4xc_avx512(s, ah, b, k, None),
                    dots_4xc_avx512(s, aw, b, k, None),
                )
            };
            assert_eq!(bits(got), bits(want), "avx512 k={k} C={C}");
        }
        if let Some(s) = Emu16::new().filter(|_| crate::isa::get().f16c) {
            // SAFETY: every row holds `k` elements; the CPU has F16C.
            let (got, want) = unsafe { (emu16(s, ah, b, k), emu16(s, aw, b, k)) };
            assert_eq!(bits(got), bits(want), "emu16 k={k} C={C}");
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn half_rows_widen_to_the_bits_of_f32_rows() {
        for k in [1usize, 7, 8, 9, 17, 31, 384, 1537] {
            // Every 16-bit pattern class: normal, subnormal and zero values of both signs
            // (infinities and NaNs would make the sums NaN in every path alike).
            let rows: Vec<Vec<u16>> = (0..8u32)
                .map(|r| {
                    (0..k as u32)
                        .map(|i| {
                            let x = (i.wrapping_mul(2_654_435_761) ^ r.wrapping_mul(40_503)) >> 7;
                            (x as u16 & 0xbbff) | (0x0100 * (x as u16 & 1))
                        })
                        .collect()
                })
                .collect();
            check_half::<F16Bits, 1>(&rows, F16Bits);
            check_half::<F16Bits, 3>(&rows, F16Bits);
            check_half::<F16Bits, 4>(&rows, F16Bits);
            check_half::<Bf16Bits, 2>(&rows, Bf16Bits);
            check_half::<Bf16Bits, 4>(&rows, Bf16Bits);
        }
    }
}
