//! AVX2 + F16C kernels for x86-64.
//!
//! Each kernel converts `min(src.len(), dst.len())` elements: whole blocks with vector
//! instructions, the last few (fewer than one block) with the scalar functions of the parent
//! module, which give the same bits.
//!
//! `f16` uses the F16C instructions (`vcvtps2ph` with an explicit round-to-nearest-even
//! immediate, so MXCSR's rounding mode does not matter; `vcvtph2ps`). Neither honours
//! MXCSR's flush-to-zero or denormals-are-zero, so subnormals are always exact. For a NaN both
//! keep the sign and the (truncated) payload and set the quiet bit. `bf16` is done with AVX2
//! integer arithmetic.
//!
//! Every kernel has an ordinary-store and a streaming-store (`NT = true`) form. The streaming
//! form converts a few leading elements with scalar code until the destination is 32-byte
//! aligned, writes the blocks with `vmovntdq`, and ends with `sfence` so the streamed data is
//! ordered before anything the thread stores afterwards (such as rayon's completion signal).
#![deny(unsafe_op_in_unsafe_fn)]

use std::arch::x86_64::*;

use half::{bf16, f16};

/// How many leading elements of a row of `n` at `d` to convert with scalar code so that the rest
/// starts on a 32-byte boundary (needed by the streaming stores). At most `n`.
#[inline]
fn align_head<T>(d: *mut T, n: usize) -> usize {
    // Element types here are 2 or 4 bytes, aligned to their size, so the distance to the next
    // 32-byte boundary is a whole number of elements.
    let size = std::mem::size_of::<T>();
    let misalign = d as usize % 32;
    let head = if misalign == 0 {
        0
    } else {
        (32 - misalign) / size
    };
    head.min(n)
}

/// Stores 32 bytes at `p`: a non-temporal (streaming) store when `NT`, an ordinary unaligned
/// store otherwise.
///
/// # Safety
/// `p` must be valid for a 32-byte write; when `NT` it must also be 32-byte aligned. The CPU
/// must support AVX2.
#[inline]
#[target_feature(enable = "avx2,f16c,fma")]
unsafe fn store256<const NT: bool>(p: *mut __m256i, v: __m256i) {
    // SAFETY: forwarded from this function's contract.
    unsafe {
        if NT {
            _mm256_stream_si256(p, v);
        } else {
            _mm256_storeu_si256(p, v);
        }
    }
}

/// After a run of streaming stores, a store fence, so that they are ordered before whatever
/// this thread stores next (for example the flag that tells another thread the chunk is done).
#[inline]
fn finish_streaming<const NT: bool>() {
    if NT {
        // SAFETY: `sfence` has no memory-safety preconditions, and SSE is part of every x86-64
        // CPU. (Newer compilers treat the intrinsic as safe, hence the `allow`.)
        #[allow(unused_unsafe)]
        unsafe {
            _mm_sfence()
        };
    }
}

/// `f32 → f16` with F16C, 32 elements per iteration.
///
/// # Safety
/// The CPU must support AVX2, F16C and FMA.
#[target_feature(enable = "avx2,f16c,fma")]
pub(super) unsafe fn f32_to_f16<const NT: bool>(src: &[f32], dst: &mut [f16]) {
    let n = src.len().min(dst.len());
    let s = src.as_ptr();
    // `f16` is `repr(transparent)` over `u16`, so the element memory is plain `u16`s.
    let d = dst.as_mut_ptr().cast::<u16>();
    let mut i = if NT { align_head(d, n) } else { 0 };
    super::scalar_f32_to_f16(&src[..i], &mut dst[..i]);
    while i + 32 <= n {
        // SAFETY: `i + 32 <= n`, and `n` is at most the length of either slice, so the four
        // 8-element loads read `src[i..i + 32]` and the two 32-byte stores write
        // `dst[i..i + 32]`, all in bounds. The loads are the unaligned form; the stores are
        // unaligned unless `NT`, in which case `align_head` made `d + i` 32-byte aligned and
        // `i` advances by 32 elements = 64 bytes, keeping it so.
        unsafe {
            let a = _mm256_loadu_ps(s.add(i));
            let b = _mm256_loadu_ps(s.add(i + 8));
            let c = _mm256_loadu_ps(s.add(i + 16));
            let e = _mm256_loadu_ps(s.add(i + 24));
            let ha = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(a);
            let hb = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(b);
            let hc = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(c);
            let he = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(e);
            store256::<NT>(d.add(i).cast(), _mm256_set_m128i(hb, ha));
            store256::<NT>(d.add(i + 16).cast(), _mm256_set_m128i(he, hc));
        }
        i += 32;
    }
    while i + 8 <= n {
        // SAFETY: `i + 8 <= n` (see above): reads `src[i..i + 8]`, writes `dst[i..i + 8]`.
        unsafe {
            let a = _mm256_loadu_ps(s.add(i));
            let h = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(a);
            _mm_storeu_si128(d.add(i).cast(), h);
        }
        i += 8;
    }
    finish_streaming::<NT>();
    super::scalar_f32_to_f16(&src[i..n], &mut dst[i..n]);
}

/// `f16 → f32` with F16C, 32 elements per iteration.
///
/// # Safety
/// The CPU must support AVX2, F16C and FMA.
#[target_feature(enable = "avx2,f16c,fma")]
pub(super) unsafe fn f16_to_f32<const NT: bool>(src: &[f16], dst: &mut [f32]) {
    let n = src.len().min(dst.len());
    let s = src.as_ptr().cast::<u16>();
    let d = dst.as_mut_ptr();
    let mut i = if NT { align_head(d, n) } else { 0 };
    super::scalar_f16_to_f32(&src[..i], &mut dst[..i]);
    while i + 32 <= n {
        // SAFETY: `i + 32 <= n <= len` of both slices: the two 32-byte loads read
        // `src[i..i + 32]` and the four 8-float stores write `dst[i..i + 32]`. Loads are
        // unaligned; stores too unless `NT`, in which case `align_head` made `d + i` 32-byte
        // aligned and each step of 32 floats (128 bytes) keeps it so.
        unsafe {
            let ab = _mm256_loadu_si256(s.add(i).cast());
            let ce = _mm256_loadu_si256(s.add(i + 16).cast());
            let a = _mm256_cvtph_ps(_mm256_castsi256_si128(ab));
            let b = _mm256_cvtph_ps(_mm256_extracti128_si256::<1>(ab));
            let c = _mm256_cvtph_ps(_mm256_castsi256_si128(ce));
            let e = _mm256_cvtph_ps(_mm256_extracti128_si256::<1>(ce));
            store256::<NT>(d.add(i).cast(), _mm256_castps_si256(a));
            store256::<NT>(d.add(i + 8).cast(), _mm256_castps_si256(b));
            store256::<NT>(d.add(i + 16).cast(), _mm256_castps_si256(c));
            store256::<NT>(d.add(i + 24).cast(), _mm256_castps_si256(e));
        }
        i += 32;
    }
    while i + 8 <= n {
        // SAFETY: `i + 8 <= n`: reads `src[i..i + 8]` (16 bytes), writes `dst[i..i + 8]`.
        unsafe {
            let h = _mm_loadu_si128(s.add(i).cast());
            _mm256_storeu_ps(d.add(i), _mm256_cvtph_ps(h));
        }
        i += 8;
    }
    finish_streaming::<NT>();
    super::scalar_f16_to_f32(&src[i..n], &mut dst[i..n]);
}

/// Rounds eight `f32` (as integer lanes) to `bf16` bits, each in the low half of its 32-bit
/// lane: round to nearest even, NaNs quieted.
#[inline]
#[target_feature(enable = "avx2,f16c,fma")]
unsafe fn round_bf16_lanes(x: __m256i) -> __m256i {
    // SAFETY: only register arithmetic; the caller guarantees AVX2. (Newer compilers treat
    // these intrinsics as safe inside a `target_feature` function, older ones do not, hence
    // the block and the `allow`.)
    #[allow(unused_unsafe)]
    unsafe {
        let one = _mm256_set1_epi32(1);
        let bias = _mm256_set1_epi32(0x7fff);
        let quiet = _mm256_set1_epi32(0x0040_0000);
        // Round: x + 0x7fff + (bit 16 of x), then keep the top half.
        let lsb = _mm256_and_si256(_mm256_srli_epi32::<16>(x), one);
        let rounded = _mm256_add_epi32(_mm256_add_epi32(x, bias), lsb);
        // NaN lanes (unordered with themselves) take their own bits with the quiet bit set
        // instead. The float compare raises no exception for quiet NaNs and only sets a
        // sticky MXCSR flag for signalling ones.
        let xf = _mm256_castsi256_ps(x);
        let is_nan = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_UNORD_Q>(xf, xf));
        let nan = _mm256_or_si256(x, quiet);
        _mm256_srli_epi32::<16>(_mm256_blendv_epi8(rounded, nan, is_nan))
    }
}

/// `f32 → bf16` with AVX2 integer arithmetic, 16 elements per iteration.
///
/// # Safety
/// The CPU must support AVX2, F16C and FMA.
#[target_feature(enable = "avx2,f16c,fma")]
pub(super) unsafe fn f32_to_bf16<const NT: bool>(src: &[f32], dst: &mut [bf16]) {
    let n = src.len().min(dst.len());
    let s = src.as_ptr().cast::<u32>();
    let d = dst.as_mut_ptr().cast::<u16>();
    let mut i = if NT { align_head(d, n) } else { 0 };
    super::scalar_f32_to_bf16(&src[..i], &mut dst[..i]);
    while i + 16 <= n {
        // SAFETY: `i + 16 <= n <= len` of both slices: the two 32-byte loads read
        // `src[i..i + 16]`, the 32-byte store writes `dst[i..i + 16]`. Loads are unaligned;
        // the store too unless `NT`, in which case `align_head` made `d + i` 32-byte aligned
        // and each step of 16 elements (32 bytes) keeps it so. The helper needs AVX2, which
        // this function's contract guarantees.
        unsafe {
            let lo = round_bf16_lanes(_mm256_loadu_si256(s.add(i).cast()));
            let hi = round_bf16_lanes(_mm256_loadu_si256(s.add(i + 8).cast()));
            // Lanes hold values in 0..=0xffff, so the unsigned-saturating pack is exact. It
            // packs per 128-bit half: [lo0..3, hi0..3, lo4..7, hi4..7]; reorder the 64-bit
            // quarters to [lo0..3, lo4..7, hi0..3, hi4..7].
            let packed = _mm256_packus_epi32(lo, hi);
            let ordered = _mm256_permute4x64_epi64::<0b11_01_10_00>(packed);
            store256::<NT>(d.add(i).cast(), ordered);
        }
        i += 16;
    }
    finish_streaming::<NT>();
    super::scalar_f32_to_bf16(&src[i..n], &mut dst[i..n]);
}

/// `bf16 → f32` with AVX2: widen, shift into the top half, quiet NaNs. 16 per iteration.
///
/// # Safety
/// The CPU must support AVX2, F16C and FMA.
#[target_feature(enable = "avx2,f16c,fma")]
pub(super) unsafe fn bf16_to_f32<const NT: bool>(src: &[bf16], dst: &mut [f32]) {
    let n = src.len().min(dst.len());
    let s = src.as_ptr().cast::<u16>();
    let d = dst.as_mut_ptr().cast::<u32>();
    let mut i = if NT { align_head(d, n) } else { 0 };
    super::scalar_bf16_to_f32(&src[..i], &mut dst[..i]);
    while i + 16 <= n {
        // SAFETY: `i + 16 <= n <= len` of both slices: the two 16-byte loads read
        // `src[i..i + 16]`, the two 32-byte stores write `dst[i..i + 16]`. Loads are
        // unaligned; stores too unless `NT`, in which case `align_head` made `d + i` 32-byte
        // aligned and each step of 16 elements (64 bytes) keeps it so.
        unsafe {
            let quiet = _mm256_castsi256_ps(_mm256_set1_epi32(0x0040_0000));
            let a =
                _mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(_mm_loadu_si128(s.add(i).cast())));
            let b = _mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(_mm_loadu_si128(
                s.add(i + 8).cast(),
            )));
            let (a, b) = (_mm256_castsi256_ps(a), _mm256_castsi256_ps(b));
            // NaN lanes are unordered with themselves; OR the quiet bit into just those.
            let na = _mm256_cmp_ps::<_CMP_UNORD_Q>(a, a);
            let nb = _mm256_cmp_ps::<_CMP_UNORD_Q>(b, b);
            let a = _mm256_or_ps(a, _mm256_and_ps(na, quiet));
            let b = _mm256_or_ps(b, _mm256_and_ps(nb, quiet));
            store256::<NT>(d.add(i).cast(), _mm256_castps_si256(a));
            store256::<NT>(d.add(i + 8).cast(), _mm256_castps_si256(b));
        }
        i += 16;
    }
    finish_streaming::<NT>();
    super::scalar_bf16_to_f32(&src[i..n], &mut dst[i..n]);
}
