//! Dot products (f32, q8_0·q8_0, q4_0·q8_0) and the kernels' own q8_0/q4_0 block codecs.
//!
//! Blocks follow ggml's layout byte for byte: q8_0 is an f16 scale `d` then 32 signed bytes;
//! q4_0 is an f16 scale then 16 bytes whose low nibble holds element `j` and high nibble
//! element `j + 16`, offset by 8. Quantization follows ggml's reference rounding. The SIMD
//! paths use AVX2/FMA when the CPU has them (checked at run time); the scalar paths are the
//! reference.

use half::f16;

/// Elements per q8_0 / q4_0 block.
pub const QK: usize = 32;
/// Bytes of one q8_0 block.
pub const Q8_0_BYTES: usize = 2 + QK;
/// Bytes of one q4_0 block.
pub const Q4_0_BYTES: usize = 2 + QK / 2;

/// Exact f16 → f32 conversion of raw bits without a function call or table (F. Giesen's
/// branch-light method); handles zeros, subnormals, infinities and NaN.
#[inline(always)]
pub fn f16_bits_to_f32(h: u16) -> f32 {
    let magic = f32::from_bits(113 << 23);
    let shifted_exp = 0x7c00u32 << 13;
    let mut o = ((h as u32) & 0x7fff) << 13;
    let exp = shifted_exp & o;
    o += (127 - 15) << 23;
    if exp == shifted_exp {
        o += (128 - 16) << 23;
    } else if exp == 0 {
        o += 1 << 23;
        o = (f32::from_bits(o) - magic).to_bits();
    }
    f32::from_bits(o | (((h as u32) & 0x8000) << 16))
}

#[inline(always)]
fn read_d(block: &[u8]) -> f32 {
    f16_bits_to_f32(u16::from_ne_bytes([block[0], block[1]]))
}

fn write_d(block: &mut [u8], d: f32) {
    block[..2].copy_from_slice(&f16::from_f32(d).to_bits().to_ne_bytes());
}

/// Quantizes `x` (a multiple of 32 values) into q8_0 blocks in `out` (ggml's reference).
pub fn quantize_row_q8_0(x: &[f32], out: &mut [u8]) {
    for (xs, block) in x.chunks_exact(QK).zip(out.chunks_exact_mut(Q8_0_BYTES)) {
        let amax = xs.iter().fold(0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        write_d(block, d);
        for (q, &v) in block[2..].iter_mut().zip(xs) {
            *q = ((v * id).round() as i8) as u8;
        }
    }
}

/// Dequantizes q8_0 blocks into `out` (a multiple of 32 values).
pub fn dequantize_row_q8_0(blocks: &[u8], out: &mut [f32]) {
    for (ys, block) in out
        .chunks_exact_mut(QK)
        .zip(blocks.chunks_exact(Q8_0_BYTES))
    {
        let d = read_d(block);
        for (y, &q) in ys.iter_mut().zip(&block[2..]) {
            *y = (q as i8) as f32 * d;
        }
    }
}

/// Quantizes `x` into q4_0 blocks (ggml's reference: the value of largest magnitude maps to −8).
pub fn quantize_row_q4_0(x: &[f32], out: &mut [u8]) {
    for (xs, block) in x.chunks_exact(QK).zip(out.chunks_exact_mut(Q4_0_BYTES)) {
        let mut amax = 0f32;
        let mut max = 0f32;
        for &v in xs {
            if amax < v.abs() {
                amax = v.abs();
                max = v;
            }
        }
        let d = max / -8.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        write_d(block, d);
        for j in 0..QK / 2 {
            let x0 = ((xs[j] * id + 8.5) as i8).min(15) as u8;
            let x1 = ((xs[j + QK / 2] * id + 8.5) as i8).min(15) as u8;
            block[2 + j] = x0 | (x1 << 4);
        }
    }
}

/// Dequantizes q4_0 blocks into `out`.
pub fn dequantize_row_q4_0(blocks: &[u8], out: &mut [f32]) {
    for (ys, block) in out
        .chunks_exact_mut(QK)
        .zip(blocks.chunks_exact(Q4_0_BYTES))
    {
        let d = read_d(block);
        for j in 0..QK / 2 {
            let q = block[2 + j];
            ys[j] = ((q & 0x0f) as i32 - 8) as f32 * d;
            ys[j + QK / 2] = ((q >> 4) as i32 - 8) as f32 * d;
        }
    }
}

/// Whether the AVX2 + FMA paths can run on this CPU.
pub fn has_avx2_fma() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        use std::sync::OnceLock;
        static HAS: OnceLock<bool> = OnceLock::new();
        *HAS.get_or_init(|| is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma"))
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Dot product of `a` (widened to f32 by `widen`) with `b`, with 8 accumulators: the
/// scalar reference shared by the f32 and f16 kernels.
fn dot_widened_ref<T: Copy>(a: &[T], b: &[f32], widen: impl Fn(T) -> f32) -> f32 {
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let mut acc = [0f32; 8];
    let mut ca = a.chunks_exact(8);
    let mut cb = b.chunks_exact(8);
    for (x, y) in (&mut ca).zip(&mut cb) {
        for k in 0..8 {
            acc[k] += widen(x[k]) * y[k];
        }
    }
    let mut sum: f32 = acc.iter().sum();
    for (&x, y) in ca.remainder().iter().zip(cb.remainder()) {
        sum += widen(x) * y;
    }
    sum
}

/// f32 dot product, scalar reference with 8 accumulators.
pub fn dot_f32_ref(a: &[f32], b: &[f32]) -> f32 {
    dot_widened_ref(a, b, |x| x)
}

/// f32 dot product, SIMD when available.
pub fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if has_avx2_fma() {
        // SAFETY: AVX2 and FMA were detected at run time.
        return unsafe { x86::dot_f32(a, b) };
    }
    dot_f32_ref(a, b)
}

/// f16 (as raw bits) · f32 dot product, scalar reference with 8 accumulators.
pub fn dot_f16_f32_ref(a: &[u16], b: &[f32]) -> f32 {
    dot_widened_ref(a, b, f16_bits_to_f32)
}

/// Whether the AVX512-VNNI q4_0 dot product (256-bit `vpdpbusd`, which needs AVX512-VL too)
/// can run on this CPU.
fn has_avx512_vnni() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        use std::sync::OnceLock;
        static HAS: OnceLock<bool> = OnceLock::new();
        *HAS.get_or_init(|| {
            has_f16c()
                && is_x86_feature_detected!("avx512vnni")
                && is_x86_feature_detected!("avx512vl")
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Whether the F16C path of [`dot_f16_f32`] can run on this CPU.
fn has_f16c() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        has_avx2_fma() && is_x86_feature_detected!("f16c")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// f16 · f32 dot product (weights read as f16, no f32 copy), SIMD when available.
pub fn dot_f16_f32(a: &[u16], b: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if has_f16c() {
        // SAFETY: AVX2, FMA and F16C were detected at run time.
        return unsafe { x86::dot_f16_f32(a, b) };
    }
    dot_f16_f32_ref(a, b)
}

/// q8_0 · q8_0 over whole blocks, scalar reference (integer products per block).
pub fn dot_q8_0_q8_0_ref(a: &[u8], b: &[u8]) -> f32 {
    let mut sum = 0f32;
    for (x, y) in a.chunks_exact(Q8_0_BYTES).zip(b.chunks_exact(Q8_0_BYTES)) {
        let mut isum = 0i32;
        for k in 0..QK {
            isum += (x[2 + k] as i8) as i32 * (y[2 + k] as i8) as i32;
        }
        sum += isum as f32 * (read_d(x) * read_d(y));
    }
    sum
}

/// q4_0 · q8_0 over whole blocks, scalar reference.
pub fn dot_q4_0_q8_0_ref(a: &[u8], b: &[u8]) -> f32 {
    let mut sum = 0f32;
    for (x, y) in a.chunks_exact(Q4_0_BYTES).zip(b.chunks_exact(Q8_0_BYTES)) {
        let mut isum = 0i32;
        for j in 0..QK / 2 {
            let q = x[2 + j];
            isum += ((q & 0x0f) as i32 - 8) * (y[2 + j] as i8) as i32;
            isum += ((q >> 4) as i32 - 8) * (y[2 + j + QK / 2] as i8) as i32;
        }
        sum += isum as f32 * (read_d(x) * read_d(y));
    }
    sum
}

/// q8_0 · q8_0, SIMD when available.
pub fn dot_q8_0_q8_0(a: &[u8], b: &[u8]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if has_f16c() {
        // SAFETY: AVX2, FMA and F16C were detected at run time.
        return unsafe { x86::dot_q8_0_q8_0(a, b) };
    }
    dot_q8_0_q8_0_ref(a, b)
}

/// q4_0 · q8_0, SIMD when available.
pub fn dot_q4_0_q8_0(a: &[u8], b: &[u8]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if has_avx512_vnni() {
        // SAFETY: AVX2, FMA, F16C, AVX512-VNNI and AVX512-VL were detected at run time.
        return unsafe { x86::dot_q4_0_q8_0_vnni(a, b) };
    }
    #[cfg(target_arch = "x86_64")]
    if has_f16c() {
        // SAFETY: AVX2, FMA and F16C were detected at run time.
        return unsafe { x86::dot_q4_0_q8_0(a, b) };
    }
    dot_q4_0_q8_0_ref(a, b)
}

#[cfg(target_arch = "x86_64")]
/// x86-64 kernels: AVX2/FMA/F16C, and AVX512-VNNI for q4_0 (each function says what it needs).
mod x86 {
    use super::{Q4_0_BYTES, Q8_0_BYTES};
    use std::arch::x86_64::*;

    #[target_feature(enable = "avx2,fma")]
    unsafe fn hsum(v: __m256) -> f32 {
        let lo = _mm256_castps256_ps128(v);
        let hi = _mm256_extractf128_ps(v, 1);
        let s = _mm_add_ps(lo, hi);
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
        _mm_cvtss_f32(s)
    }

    /// # Safety
    /// The CPU must support AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
        let n = a.len().min(b.len());
        let (pa, pb) = (a.as_ptr(), b.as_ptr());
        let mut acc = [_mm256_setzero_ps(); 4];
        let mut i = 0;
        // SAFETY: every load reads 8 floats below `n` from both slices.
        unsafe {
            while i + 32 <= n {
                for (k, slot) in acc.iter_mut().enumerate() {
                    let x = _mm256_loadu_ps(pa.add(i + 8 * k));
                    let y = _mm256_loadu_ps(pb.add(i + 8 * k));
                    *slot = _mm256_fmadd_ps(x, y, *slot);
                }
                i += 32;
            }
            while i + 8 <= n {
                let x = _mm256_loadu_ps(pa.add(i));
                let y = _mm256_loadu_ps(pb.add(i));
                acc[0] = _mm256_fmadd_ps(x, y, acc[0]);
                i += 8;
            }
        }
        let total = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
        // SAFETY: AVX2 is enabled for this function.
        let mut sum = unsafe { hsum(total) };
        while i < n {
            sum += a[i] * b[i];
            i += 1;
        }
        sum
    }

    /// # Safety
    /// The CPU must support AVX2, FMA and F16C.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_f16_f32(a: &[u16], b: &[f32]) -> f32 {
        let n = a.len().min(b.len());
        let (pa, pb) = (a.as_ptr(), b.as_ptr());
        let mut acc = [_mm256_setzero_ps(); 4];
        let mut i = 0;
        // SAFETY: every load reads 8 elements below `n` from both slices.
        unsafe {
            while i + 32 <= n {
                for (k, slot) in acc.iter_mut().enumerate() {
                    let h = _mm_loadu_si128(pa.add(i + 8 * k).cast::<__m128i>());
                    let x = _mm256_cvtph_ps(h);
                    let y = _mm256_loadu_ps(pb.add(i + 8 * k));
                    *slot = _mm256_fmadd_ps(x, y, *slot);
                }
                i += 32;
            }
            while i + 8 <= n {
                let x = _mm256_cvtph_ps(_mm_loadu_si128(pa.add(i).cast::<__m128i>()));
                let y = _mm256_loadu_ps(pb.add(i));
                acc[0] = _mm256_fmadd_ps(x, y, acc[0]);
                i += 8;
            }
        }
        let total = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
        // SAFETY: AVX2 is enabled for this function.
        let mut sum = unsafe { hsum(total) };
        while i < n {
            sum += super::f16_bits_to_f32(a[i]) * b[i];
            i += 1;
        }
        sum
    }

    /// Sum of the 8 i32 lanes of `x·y` (signed bytes) as f32 lanes.
    #[target_feature(enable = "avx2,fma")]
    unsafe fn mul_sum_i8(x: __m256i, y: __m256i) -> __m256 {
        let ax = _mm256_sign_epi8(x, x);
        let sy = _mm256_sign_epi8(y, x);
        let dot = _mm256_maddubs_epi16(ax, sy);
        let summed = _mm256_madd_epi16(dot, _mm256_set1_epi16(1));
        _mm256_cvtepi32_ps(summed)
    }

    /// The f16 scale at the start of a block, as f32 (one F16C conversion; the portable
    /// `read_d` costs a dozen instructions and two of them per block showed in profiles).
    #[target_feature(enable = "avx2,fma,f16c")]
    fn scale(block: &[u8]) -> f32 {
        let bits = _mm_cvtsi32_si128(i32::from(u16::from_ne_bytes([block[0], block[1]])));
        _mm_cvtss_f32(_mm_cvtph_ps(bits))
    }

    /// The dot product of the weight row `a` (q4_0 when `Q4`, else q8_0) with the q8_0 row
    /// `b`; even and odd blocks go to separate accumulators (independent multiply-add
    /// chains). One row at a time: sharing each activation block between two weight rows
    /// was measured 1.4-2x slower on mat-vec products (two interleaved weight streams).
    /// No closures: a closure is a separate function without the enabled features, and
    /// calling one per block made this 2x slower.
    #[target_feature(enable = "avx2,fma,f16c")]
    fn blocks_dot<const Q4: bool>(a: &[u8], b: &[u8]) -> f32 {
        let a_block = if Q4 { Q4_0_BYTES } else { Q8_0_BYTES };
        let n = (a.len() / a_block).min(b.len() / Q8_0_BYTES);
        let low = _mm256_set1_epi8(0x0f);
        let eight = _mm256_set1_epi8(8);
        let mut even = _mm256_setzero_ps();
        let mut odd = _mm256_setzero_ps();
        // Block `i` into `acc` (a macro, not a closure: see above).
        macro_rules! block {
            ($i:expr, $acc:ident) => {{
                let i = $i;
                let y = &b[i * Q8_0_BYTES..(i + 1) * Q8_0_BYTES];
                let dy = scale(y);
                // SAFETY: a q8_0 block holds 32 quant bytes after its 2-byte scale.
                let qy = unsafe { _mm256_loadu_si256(y.as_ptr().add(2).cast()) };
                let x = &a[i * a_block..(i + 1) * a_block];
                let qx = if Q4 {
                    // SAFETY: a q4_0 block holds 16 quant bytes after its 2-byte scale.
                    let packed = unsafe { _mm_loadu_si128(x.as_ptr().add(2).cast()) };
                    // Low nibbles are elements 0..16, high nibbles 16..32; values − 8.
                    let hi = _mm_srli_epi16(packed, 4);
                    let both = _mm256_set_m128i(hi, packed);
                    _mm256_sub_epi8(_mm256_and_si256(both, low), eight)
                } else {
                    // SAFETY: a q8_0 block holds 32 quant bytes after its 2-byte scale.
                    unsafe { _mm256_loadu_si256(x.as_ptr().add(2).cast()) }
                };
                let d = _mm256_set1_ps(scale(x) * dy);
                // SAFETY: AVX2 is enabled for this function.
                let p = unsafe { mul_sum_i8(qx, qy) };
                $acc = _mm256_fmadd_ps(d, p, $acc);
            }};
        }
        let mut i = 0;
        while i + 2 <= n {
            block!(i, even);
            block!(i + 1, odd);
            i += 2;
        }
        if i < n {
            block!(i, even);
        }
        // SAFETY: AVX2 is enabled for this function.
        unsafe { hsum(_mm256_add_ps(even, odd)) }
    }

    /// # Safety
    /// The CPU must support AVX2, FMA and F16C.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_q8_0_q8_0(a: &[u8], b: &[u8]) -> f32 {
        blocks_dot::<false>(a, b)
    }

    /// # Safety
    /// The CPU must support AVX2, FMA and F16C.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_q4_0_q8_0(a: &[u8], b: &[u8]) -> f32 {
        blocks_dot::<true>(a, b)
    }

    /// q4_0 · q8_0 with VNNI: the nibbles stay unsigned (0..15) and `vpdpbusd` multiplies
    /// them by the signed activations and sums groups of four in one instruction; the −8
    /// offset is a second `vpdpbusd` (8·y) subtracted — instead of two sign fixes, a
    /// multiply-add of pairs and a widening add per block.
    ///
    /// # Safety
    /// The CPU must support AVX2, FMA, F16C, AVX512-VNNI and AVX512-VL.
    #[target_feature(enable = "avx2,fma,f16c,avx512vnni,avx512vl")]
    pub unsafe fn dot_q4_0_q8_0_vnni(a: &[u8], b: &[u8]) -> f32 {
        let n = (a.len() / Q4_0_BYTES).min(b.len() / Q8_0_BYTES);
        let low = _mm256_set1_epi8(0x0f);
        let eight = _mm256_set1_epi8(8);
        let mut acc = [_mm256_setzero_ps(); 2];
        for i in 0..n {
            let (x, y) = (&a[i * Q4_0_BYTES..], &b[i * Q8_0_BYTES..]);
            // SAFETY: a q8_0 block holds 32 quant bytes after its 2-byte scale; a q4_0 block 16.
            let (qy, packed) = unsafe {
                (
                    _mm256_loadu_si256(y.as_ptr().add(2).cast()),
                    _mm_loadu_si128(x.as_ptr().add(2).cast()),
                )
            };
            // Low nibbles are elements 0..16, high nibbles 16..32.
            let both = _mm256_set_m128i(_mm_srli_epi16(packed, 4), packed);
            let qx = _mm256_and_si256(both, low);
            // Σ (x − 8)·y = Σ x·y − Σ 8·y, both sums of fours by vpdpbusd (independent).
            let zero = _mm256_setzero_si256();
            let dots = _mm256_sub_epi32(
                _mm256_dpbusd_epi32(zero, qx, qy),
                _mm256_dpbusd_epi32(zero, eight, qy),
            );
            let d = _mm256_set1_ps(scale(x) * scale(y));
            acc[i & 1] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(dots), acc[i & 1]);
        }
        // SAFETY: AVX2 is enabled for this function.
        unsafe { hsum(_mm256_add_ps(acc[0], acc[1])) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn values(n: usize, seed: u32) -> Vec<f32> {
        let mut s = seed;
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 17;
                s ^= s << 5;
                (s as f32 / u32::MAX as f32) * 2.0 - 1.0
            })
            .collect()
    }

    #[test]
    fn fast_f16_decode_is_exact() {
        for bits in 0..=u16::MAX {
            let want = f16::from_bits(bits).to_f32();
            let got = f16_bits_to_f32(bits);
            assert!(
                got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()),
                "{bits:#x}: {got} vs {want}"
            );
        }
    }

    /// Every SIMD path this CPU has (AVX2 and, where present, VNNI), over odd and even block
    /// counts (the kernels alternate two accumulators), against the integer reference.
    #[test]
    fn every_quant_dot_path_matches_reference() {
        for blocks in [1usize, 2, 3, 5, 8] {
            let n = blocks * QK;
            let x = values(n, 5 + blocks as u32);
            let y = values(n, 6 + blocks as u32);
            let mut qa = vec![0u8; blocks * Q8_0_BYTES];
            let mut qb = vec![0u8; blocks * Q8_0_BYTES];
            let mut q4 = vec![0u8; blocks * Q4_0_BYTES];
            quantize_row_q8_0(&x, &mut qa);
            quantize_row_q8_0(&y, &mut qb);
            quantize_row_q4_0(&x, &mut q4);
            let r8 = dot_q8_0_q8_0_ref(&qa, &qb);
            let r4 = dot_q4_0_q8_0_ref(&q4, &qb);
            let close = |got: f32, want: f32, what: &str| {
                assert!(
                    (got - want).abs() <= 1e-5 * want.abs().max(1.0),
                    "{what}, {blocks} blocks: {got} vs {want}"
                );
            };
            close(dot_q8_0_q8_0(&qa, &qb), r8, "q8_0 dispatch");
            close(dot_q4_0_q8_0(&q4, &qb), r4, "q4_0 dispatch");
            #[cfg(target_arch = "x86_64")]
            if has_f16c() {
                // SAFETY: AVX2, FMA and F16C were detected.
                unsafe {
                    close(x86::dot_q8_0_q8_0(&qa, &qb), r8, "q8_0 avx2");
                    close(x86::dot_q4_0_q8_0(&q4, &qb), r4, "q4_0 avx2");
                }
            }
            #[cfg(target_arch = "x86_64")]
            if has_avx512_vnni() {
                // SAFETY: the VNNI path's features were detected.
                close(
                    unsafe { x86::dot_q4_0_q8_0_vnni(&q4, &qb) },
                    r4,
                    "q4_0 vnni",
                );
            }
        }
    }

    #[test]
    fn simd_dots_match_reference() {
        for n in [0usize, 1, 7, 8, 33, 64, 100] {
            let a = values(n, 1);
            let b = values(n, 2);
            let d = dot_f32(&a, &b) - dot_f32_ref(&a, &b);
            assert!(d.abs() < 1e-4, "n={n} diff {d}");
            let h: Vec<u16> = a
                .iter()
                .map(|&v| half::f16::from_f32(v).to_bits())
                .collect();
            let d = dot_f16_f32(&h, &b) - dot_f16_f32_ref(&h, &b);
            assert!(d.abs() < 1e-4, "f16 n={n} diff {d}");
        }
        let x = values(128, 3);
        let y = values(128, 4);
        let mut qa = vec![0u8; 4 * Q8_0_BYTES];
        let mut qb = vec![0u8; 4 * Q8_0_BYTES];
        let mut q4 = vec![0u8; 4 * Q4_0_BYTES];
        quantize_row_q8_0(&x, &mut qa);
        quantize_row_q8_0(&y, &mut qb);
        quantize_row_q4_0(&x, &mut q4);
        let r8 = dot_q8_0_q8_0_ref(&qa, &qb);
        assert!((dot_q8_0_q8_0(&qa, &qb) - r8).abs() < 1e-4 * r8.abs().max(1.0));
        let r4 = dot_q4_0_q8_0_ref(&q4, &qb);
        assert!((dot_q4_0_q8_0(&q4, &qb) - r4).abs() < 1e-4 * r4.abs().max(1.0));
        let exact = dot_f32_ref(&x, &y);
        assert!((r8 - exact).abs() < 0.05 * exact.abs().max(1.0));
        let mut back = vec![0f32; 128];
        dequantize_row_q4_0(&q4, &mut back);
        for (a, b) in x.iter().zip(&back) {
            // One step is |max|/8; values of the sign opposite to the largest clip at 7 steps.
            assert!((a - b).abs() < 0.13, "{a} {b}");
        }
    }
}
