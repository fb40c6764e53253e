//! Register-tiled dot products for matrix products with few columns: 4 weight rows × up to 3
//! activation rows per pass (4 with AVX-512), so every loaded vector feeds several
//! multiply-adds instead of one, and the 4 row sums of a column are reduced together (one
//! horizontal-add tree, not four separate horizontal sums — with short rows the reductions are
//! a large share of the work). Used by MUL_MAT below the GEMM path's column threshold (see
//! `gemm::MIN_COLS`).

use super::quant_dot::dot_f32;

/// Activation rows per pass of [`dots_4xc`] on this CPU: 4 with AVX-512 (32 registers: 16
/// accumulators, 4 activation vectors, 1 weight vector), else 3 (the widest tile that fits
/// the 16 AVX registers).
pub fn max_tile_cols() -> usize {
    if has_avx512f() {
        4
    } else {
        3
    }
}

/// Whether the AVX-512 tile kernel can run on this CPU (checked once).
fn has_avx512f() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        use std::sync::OnceLock;
        static HAS: OnceLock<bool> = OnceLock::new();
        *HAS.get_or_init(|| super::has_avx2_fma() && is_x86_feature_detected!("avx512f"))
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// `out[r][c] = a[r] · b[c]` for 4 rows of `a` and `C` (1 to 4) of `b`, all of length `k`.
pub fn dots_4xc<const C: usize>(a: [&[f32]; 4], b: [&[f32]; C]) -> [[f32; C]; 4] {
    debug_assert!((1..=4).contains(&C));
    let k = b[0].len();
    debug_assert!(a.iter().chain(&b).all(|r| r.len() == k));
    #[cfg(target_arch = "x86_64")]
    if has_avx512f() {
        // SAFETY: the CPU has AVX-512F (checked just above); every row holds `k` elements.
        return unsafe { dots_4xc_avx512(a, b, k) };
    }
    #[cfg(target_arch = "x86_64")]
    if super::has_avx2_fma() {
        // SAFETY: the CPU has AVX2 and FMA (checked just above); every row holds `k`
        // elements (checked by the caller's slicing, asserted in debug builds).
        return unsafe { dots_4xc_avx2(a, b, k) };
    }
    let mut out = [[0f32; C]; 4];
    for (r, row) in a.iter().enumerate() {
        for (c, col) in b.iter().enumerate() {
            out[r][c] = dot_f32(row, col);
        }
    }
    out
}

/// [`dots_4xc`] 16 lanes wide; the last `k % 16` elements through masked loads (lanes past
/// the end are neither read nor faulted on).
///
/// # Safety
/// The CPU must support AVX-512F, and every slice must hold at least `k` elements.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn dots_4xc_avx512<const C: usize>(
    a: [&[f32]; 4],
    b: [&[f32]; C],
    k: usize,
) -> [[f32; C]; 4] {
    use std::arch::x86_64::*;
    let mut acc = [[_mm512_setzero_ps(); 4]; C];
    // One loop (no closure: a closure would not get this function's target features).
    let mut i = 0;
    while i < k {
        let mask = super::math::lanes16(k - i);
        // SAFETY: lanes of `mask` are below `k - i`, inside every slice (caller); masked-off
        // lanes are not accessed.
        unsafe {
            let mut bv = [_mm512_setzero_ps(); C];
            for (v, col) in bv.iter_mut().zip(&b) {
                *v = _mm512_maskz_loadu_ps(mask, col.as_ptr().add(i));
            }
            for r in 0..4 {
                let w = _mm512_maskz_loadu_ps(mask, a[r].as_ptr().add(i));
                for c in 0..C {
                    acc[c][r] = _mm512_fmadd_ps(w, bv[c], acc[c][r]);
                }
            }
        }
        i += 16;
    }
    let mut out = [[0f32; C]; 4];
    for c in 0..C {
        // 16 lanes to 8 (halves added), then the 4-row tree of the AVX2 kernel.
        let halves = acc[c].map(|v| {
            _mm256_add_ps(
                _mm512_castps512_ps256(v),
                _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v))),
            )
        });
        let mut sums = [0f32; 4];
        // SAFETY: `sums` holds 4 floats, the width of the stored vector.
        unsafe { _mm_storeu_ps(sums.as_mut_ptr(), hsum4(halves)) };
        for r in 0..4 {
            out[r][c] = sums[r];
        }
    }
    out
}

/// The 8-lane sums of `v[0..4]`, as the 4 lanes of one vector.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn hsum4(v: [std::arch::x86_64::__m256; 4]) -> std::arch::x86_64::__m128 {
    use std::arch::x86_64::*;
    // hadd pairs neighbours within each 128-bit half: after two rounds lane r of each half
    // holds half of row r's sum; adding the halves finishes it.
    let h01 = _mm256_hadd_ps(v[0], v[1]);
    let h23 = _mm256_hadd_ps(v[2], v[3]);
    let h = _mm256_hadd_ps(h01, h23);
    _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps::<1>(h))
}

/// # Safety
/// The CPU must support AVX2 and FMA, and every slice must hold at least `k` elements.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn dots_4xc_avx2<const C: usize>(a: [&[f32]; 4], b: [&[f32]; C], k: usize) -> [[f32; C]; 4] {
    use std::arch::x86_64::*;
    // acc[c][r]: column-major so each column's four row accumulators reduce together.
    let mut acc = [[_mm256_setzero_ps(); 4]; C];
    let full = k / 8 * 8;
    let mut i = 0;
    while i < full {
        // SAFETY: i + 8 <= k and every slice holds k elements (caller).
        unsafe {
            let mut bv = [_mm256_setzero_ps(); C];
            for (v, col) in bv.iter_mut().zip(&b) {
                *v = _mm256_loadu_ps(col.as_ptr().add(i));
            }
            for r in 0..4 {
                let w = _mm256_loadu_ps(a[r].as_ptr().add(i));
                for c in 0..C {
                    acc[c][r] = _mm256_fmadd_ps(w, bv[c], acc[c][r]);
                }
            }
        }
        i += 8;
    }
    let mut out = [[0f32; C]; 4];
    for c in 0..C {
        let mut sums = [0f32; 4];
        // SAFETY: `sums` holds 4 floats, the width of the stored vector.
        unsafe { _mm_storeu_ps(sums.as_mut_ptr(), hsum4(acc[c])) };
        for r in 0..4 {
            let mut s = sums[r];
            for j in full..k {
                s += a[r][j] * b[c][j];
            }
            out[r][c] = s;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Checks a `C`-column tile, through every SIMD path this CPU has, against f64 dot products.
    fn check<const C: usize>(rows: &[Vec<f32>], k: usize) {
        let a = [&rows[0][..], &rows[1][..], &rows[2][..], &rows[3][..]];
        let b: [&[f32]; C] = std::array::from_fn(|c| &rows[4 + c][..]);
        let mut paths = vec![("dispatch", dots_4xc(a, b))];
        #[cfg(target_arch = "x86_64")]
        {
            if super::super::has_avx2_fma() {
                // SAFETY: AVX2 and FMA were detected; every row holds `k` elements.
                paths.push(("avx2", unsafe { dots_4xc_avx2(a, b, k) }));
            }
            if has_avx512f() {
                // SAFETY: AVX-512F was detected; every row holds `k` elements.
                paths.push(("avx512", unsafe { dots_4xc_avx512(a, b, k) }));
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
}
