//! Register-tiled dot products for matrix products with few columns: 4 weight rows × 2
//! activation rows per pass, so every loaded vector feeds two or four multiply-adds instead of
//! one. Used by MUL_MAT below the GEMM path's column threshold (see `gemm::MIN_COLS`).

use super::quant_dot::dot_f32;

/// `out[r][c] = a[r] · b[c]` for 4 rows of `a` and 2 of `b`, all of length `k`.
pub fn dots_4x2(a: [&[f32]; 4], b: [&[f32]; 2]) -> [[f32; 2]; 4] {
    let k = b[0].len();
    debug_assert!(a.iter().all(|r| r.len() == k) && b[1].len() == k);
    #[cfg(target_arch = "x86_64")]
    if super::has_avx2_fma() {
        // SAFETY: the CPU has AVX2 and FMA (checked just above); every row holds `k`
        // elements (checked by the caller's slicing, asserted in debug builds).
        return unsafe { dots_4x2_avx2(a, b, k) };
    }
    let mut out = [[0f32; 2]; 4];
    for (r, row) in a.iter().enumerate() {
        for (c, col) in b.iter().enumerate() {
            out[r][c] = dot_f32(row, col);
        }
    }
    out
}

/// Sum of the 8 lanes of `v`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn hsum(v: std::arch::x86_64::__m256) -> f32 {
    use std::arch::x86_64::*;
    let lo = _mm256_castps256_ps128(v);
    let hi = _mm256_extractf128_ps::<1>(v);
    let s = _mm_add_ps(lo, hi);
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_shuffle_ps::<0b01>(s, s));
    _mm_cvtss_f32(s)
}

/// # Safety
/// The CPU must support AVX2 and FMA, and every slice must hold at least `k` elements.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn dots_4x2_avx2(a: [&[f32]; 4], b: [&[f32]; 2], k: usize) -> [[f32; 2]; 4] {
    use std::arch::x86_64::*;
    let mut acc = [[_mm256_setzero_ps(); 2]; 4];
    let full = k / 8 * 8;
    let mut i = 0;
    while i < full {
        // SAFETY: i + 8 <= k and every slice holds k elements (caller).
        unsafe {
            let b0 = _mm256_loadu_ps(b[0].as_ptr().add(i));
            let b1 = _mm256_loadu_ps(b[1].as_ptr().add(i));
            for r in 0..4 {
                let w = _mm256_loadu_ps(a[r].as_ptr().add(i));
                acc[r][0] = _mm256_fmadd_ps(w, b0, acc[r][0]);
                acc[r][1] = _mm256_fmadd_ps(w, b1, acc[r][1]);
            }
        }
        i += 8;
    }
    let mut out = [[0f32; 2]; 4];
    for r in 0..4 {
        for c in 0..2 {
            let mut s = hsum(acc[r][c]);
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

    #[test]
    fn matches_f64_dots_for_odd_lengths() {
        for k in [1usize, 7, 8, 9, 31, 384, 1537] {
            let rows: Vec<Vec<f32>> = (0..6)
                .map(|r| {
                    (0..k)
                        .map(|i| ((i * 3 + r * 7) % 17) as f32 * 0.1 - 0.8)
                        .collect()
                })
                .collect();
            let a = [&rows[0][..], &rows[1][..], &rows[2][..], &rows[3][..]];
            let b = [&rows[4][..], &rows[5][..]];
            let got = dots_4x2(a, b);
            for r in 0..4 {
                for c in 0..2 {
                    let exact: f64 = a[r]
                        .iter()
                        .zip(b[c])
                        .map(|(x, y)| *x as f64 * *y as f64)
                        .sum();
                    let err = (got[r][c] as f64 - exact).abs();
                    assert!(
                        err <= 1e-4 * (1.0 + exact.abs()),
                        "k={k} r={r} c={c}: {} vs {exact}",
                        got[r][c]
                    );
                }
            }
        }
    }
}
