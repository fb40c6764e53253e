//! A small vocabulary of f32 vector operations, so that a kernel that exists for both AVX2
//! (8 lanes) and AVX-512 (16 lanes) is written once, generic over [`Simd`].
//!
//! How a kernel uses it:
//!
//! * the body is a generic `#[inline(always)]` function taking the ISA's token `s: S` and
//!   calling only `s.*` methods (and `S::LANES`, `S::MASKED_TAILS`);
//! * one small `#[target_feature]` entry point per ISA calls it with that ISA's token, so the
//!   body and every method (all `#[inline(always)]`) are compiled with the ISA's features;
//! * the tests also run the body with [`tests::Emu16`] (16 lanes built from two AVX2
//!   registers, the same per-lane results as [`Avx512`]), so the 16-lane blocking, tails and
//!   reductions are checked on machines without AVX-512.
//!
//! A token is a zero-sized proof that the CPU runs the ISA: it is only made by `new`, which
//! asks [`crate::isa`]. The methods are therefore safe, except the loads and stores, which
//! read or write through raw pointers.

#![cfg(target_arch = "x86_64")]

use std::arch::x86_64::*;

/// An f32 vector ISA.
///
/// # Safety
///
/// A value of an implementing type may only exist on a CPU that runs the type's instructions,
/// which include AVX2 and FMA (helpers on 8-lane vectors such as [`hsum4`] rely on that).
pub(crate) unsafe trait Simd: Copy {
    /// The vector type.
    type V: Copy;
    /// f32 lanes per vector.
    const LANES: usize;
    /// Whether the kernels handle the last partial vector of a row with
    /// [`Simd::load_partial`] / [`Simd::store_partial`] (AVX-512, which has masked loads
    /// and stores); otherwise they finish it with scalar code (AVX2). Each ISA's kernels
    /// keep the tail arithmetic they have always had.
    const MASKED_TAILS: bool;

    /// All lanes 0.
    fn zero(self) -> Self::V;
    /// All lanes `x`.
    fn splat(self, x: f32) -> Self::V;
    /// `a·b + c` per lane, rounded once.
    fn fma(self, a: Self::V, b: Self::V, c: Self::V) -> Self::V;
    /// The lanes summed down to 8: lane `l` of the result is the sum, from low to high, of
    /// the 8-lane pieces' lane `l` (the vector itself on AVX2; `low + high` on AVX-512).
    fn halves8(self, v: Self::V) -> __m256;
    /// `a + b` per lane.
    fn add(self, a: Self::V, b: Self::V) -> Self::V;
    /// `a − b` per lane.
    fn sub(self, a: Self::V, b: Self::V) -> Self::V;
    /// `a·b` per lane.
    fn mul(self, a: Self::V, b: Self::V) -> Self::V;
    /// `a / b` per lane.
    fn div(self, a: Self::V, b: Self::V) -> Self::V;
    /// The smaller of `a` and `b` per lane, and `b` when either is NaN (x86's `minps`): so
    /// `min(k, x)` keeps a NaN `x`.
    fn min(self, a: Self::V, b: Self::V) -> Self::V;
    /// The larger of `a` and `b` per lane, and `b` when either is NaN (x86's `maxps`).
    fn max(self, a: Self::V, b: Self::V) -> Self::V;
    /// `t` in the lanes where `a > b` (false when either is NaN), `f` elsewhere.
    fn select_gt(self, a: Self::V, b: Self::V, t: Self::V, f: Self::V) -> Self::V;
    /// `y·2ⁿ` per lane, for integer-valued `n` in [−252, 254], rounded once wherever
    /// `y·2^⌊n/2⌋` is a normal float (every ISA then gives the same, correctly rounded, bits).
    fn ldexp(self, y: Self::V, n: Self::V) -> Self::V;
    /// The first `min(n, LANES)` lanes of `v`, the others `fill`.
    fn keep_first(self, v: Self::V, n: usize, fill: f32) -> Self::V;
    /// The largest lane (a NaN lane may or may not win, as with `maxps`).
    fn reduce_max(self, v: Self::V) -> f32;

    /// `LANES` floats at `p`.
    ///
    /// # Safety
    /// `p` must be valid for reading `LANES` floats (no alignment needed).
    unsafe fn loadu(self, p: *const f32) -> Self::V;
    /// Writes `LANES` floats at `p`.
    ///
    /// # Safety
    /// `p` must be valid for writing `LANES` floats (no alignment needed).
    unsafe fn storeu(self, p: *mut f32, v: Self::V);
    /// The first `min(n, LANES)` floats at `p`, the other lanes 0; floats past them are not
    /// accessed.
    ///
    /// # Safety
    /// `p` must be valid for reading `min(n, LANES)` floats.
    unsafe fn load_partial(self, p: *const f32, n: usize) -> Self::V;
    /// Writes the first `min(n, LANES)` lanes of `v` at `p`; floats past them are not
    /// accessed.
    ///
    /// # Safety
    /// `p` must be valid for writing `min(n, LANES)` floats.
    unsafe fn store_partial(self, p: *mut f32, v: Self::V, n: usize);
    /// The first `min(n, LANES)` 16-bit floats at `p` (f16 bits, or bf16 bits with `BF16`)
    /// widened to f32 — exactly — the other lanes 0; values past them are not accessed.
    ///
    /// # Safety
    /// `p` must be valid for reading `min(n, LANES)` values; for f16 the CPU must have F16C.
    unsafe fn load_half<const BF16: bool>(self, p: *const u16, n: usize) -> Self::V;
}

/// The first `min(n, N)` values at `p` and zeros, in a stack array (a vector's last partial
/// piece of 16-bit floats, widened from there).
///
/// # Safety
/// `p` must be valid for reading `min(n, N)` values.
#[inline(always)]
unsafe fn half_tail<const N: usize>(p: *const u16, n: usize) -> [u16; N] {
    let mut t = [0u16; N];
    // SAFETY: min(n, N) values are readable at `p` (caller) and fit `t`.
    unsafe { std::ptr::copy_nonoverlapping(p, t.as_mut_ptr(), n.min(N)) };
    t
}

/// `LANES` floats at `p` ([`Simd::loadu`]), or, with masked tails, the first `min(n, LANES)`
/// of them and zeros ([`Simd::load_partial`]).
///
/// # Safety
/// `p` must be valid for reading `LANES` floats, or with masked tails `min(n, LANES)`.
#[inline(always)]
pub(crate) unsafe fn load_tail<S: Simd>(s: S, p: *const f32, n: usize) -> S::V {
    // SAFETY: forwarded (caller).
    unsafe {
        if S::MASKED_TAILS {
            s.load_partial(p, n)
        } else {
            s.loadu(p)
        }
    }
}

/// Writes `v` at `p` as [`load_tail`] reads it.
///
/// # Safety
/// `p` must be valid for writing `LANES` floats, or with masked tails `min(n, LANES)`.
#[inline(always)]
pub(crate) unsafe fn store_tail<S: Simd>(s: S, p: *mut f32, v: S::V, n: usize) {
    // SAFETY: forwarded (caller).
    unsafe {
        if S::MASKED_TAILS {
            s.store_partial(p, v, n)
        } else {
            s.storeu(p, v)
        }
    }
}

/// The 8-lane sums of `v[0..4]` as the 4 lanes of one vector: `hadd` pairs neighbours in each
/// 128-bit half, so lane `r` holds `((v[r]₀+v[r]₁)+(v[r]₂+v[r]₃)) + ((v[r]₄+v[r]₅)+(v[r]₆+v[r]₇))`.
#[inline(always)]
pub(crate) fn hsum4<S: Simd>(_: S, v: [__m256; 4]) -> [f32; 4] {
    let mut out = [0f32; 4];
    // SAFETY: a token of `S` exists, so the CPU has AVX2 (the trait's contract); `out` holds
    // the 4 stored floats.
    unsafe {
        let h01 = _mm256_hadd_ps(v[0], v[1]);
        let h23 = _mm256_hadd_ps(v[2], v[3]);
        let h = _mm256_hadd_ps(h01, h23);
        let s = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps::<1>(h));
        _mm_storeu_ps(out.as_mut_ptr(), s);
    }
    out
}

/// The lanes of `v` summed in a fixed order: [`Simd::halves8`], then the 8 lanes as a tree
/// (`l + (l+4)`, then `+2`, then `+1`).
#[inline(always)]
pub(crate) fn reduce_add<S: Simd>(s: S, v: S::V) -> f32 {
    let v = s.halves8(v);
    // SAFETY: a token of `S` exists, so the CPU has AVX2 (the trait's contract).
    unsafe {
        let q = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let d = _mm_add_ps(q, _mm_movehl_ps(q, q));
        _mm_cvtss_f32(_mm_add_ss(d, _mm_movehdup_ps(d)))
    }
}

/// How far ahead of the weights being computed the mat-vec kernels prefetch, in bytes. With
/// the hardware prefetchers alone too few lines were in flight between the bursts of
/// arithmetic; 1 KiB measured best (2-4 KiB equal, 512 B no better than none: DECISIONS).
pub(crate) const PREFETCH_BYTES: usize = 1024;

/// Asks for the cache lines of the `bytes` bytes starting [`PREFETCH_BYTES`] past `p`: the
/// weights a streaming kernel reads next (past a row's or a group's end, the next one's, which
/// follows in memory). A hint: the address is formed with wrapping arithmetic and never read
/// through, so it may lie past the end of the data.
#[inline(always)]
pub(crate) fn prefetch_ahead(p: *const u8, bytes: usize) {
    prefetch_lines(p.wrapping_add(PREFETCH_BYTES), bytes);
}

/// Asks for the cache lines of the `bytes` bytes at `p` (a hint, as [`prefetch_ahead`]: the
/// address may lie past the data and is never read through).
#[inline(always)]
pub(crate) fn prefetch_lines(p: *const u8, bytes: usize) {
    let mut off = 0;
    while off < bytes {
        // SAFETY: a prefetch reads nothing and cannot fault; SSE is part of x86-64.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(off).cast()) };
        off += 64;
    }
}

/// One f16 value (its bits) as f32, exactly, with F16C.
///
/// Not for a value per block of a hot loop: only lane 0 of the conversion is used, so LLVM
/// loads the bits with `vpinsrw` into whatever register is free (zeroing it first does not
/// survive), which can chain each block to the one before through that register. The q8_0
/// row dots convert their two scales from one general register instead (`quant_dot`).
#[inline]
#[target_feature(enable = "f16c")]
pub(crate) fn f16_to_f32(bits: u16) -> f32 {
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(bits))))
}

/// The largest of 8 lanes (tree order as [`reduce_add`]).
///
/// # Safety
/// The CPU must have AVX.
#[inline(always)]
pub(crate) unsafe fn hmax8(v: __m256) -> f32 {
    // SAFETY: AVX (caller).
    unsafe {
        let q = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let d = _mm_max_ps(q, _mm_movehl_ps(q, q));
        _mm_cvtss_f32(_mm_max_ss(d, _mm_movehdup_ps(d)))
    }
}

/// The mask of the first `min(n, 16)` lanes of a 16-lane vector (an AVX-512 `__mmask16`): the
/// lanes a loop over `n` remaining elements may touch.
#[inline(always)]
pub(crate) fn lanes16(n: usize) -> u16 {
    if n >= 16 {
        u16::MAX
    } else {
        (1u16 << n) - 1
    }
}

/// The mask of the first `min(n, 8)` lanes of an 8-lane vector, for `vmaskmovps`.
#[inline(always)]
fn mask8(_: Avx2, n: usize) -> __m256i {
    let n = n.min(8) as i32;
    // SAFETY: the token proves AVX2.
    unsafe {
        _mm256_cmpgt_epi32(
            _mm256_set1_epi32(n),
            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
        )
    }
}

/// AVX2 + FMA, 8 lanes of `__m256`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Avx2(());

impl Avx2 {
    /// The token, when the CPU has AVX2 and FMA.
    #[inline]
    pub(crate) fn new() -> Option<Avx2> {
        crate::isa::get().avx2_fma().then_some(Avx2(()))
    }

    /// The token without asking: for hot paths whose caller already chose AVX2.
    ///
    /// # Safety
    /// The CPU must have AVX2 and FMA.
    #[inline(always)]
    pub(crate) unsafe fn assume() -> Avx2 {
        Avx2(())
    }
}

// SAFETY: `Avx2::new` makes a value only when the CPU has AVX2 and FMA.
unsafe impl Simd for Avx2 {
    type V = __m256;
    const LANES: usize = 8;
    const MASKED_TAILS: bool = false;

    #[inline(always)]
    fn zero(self) -> __m256 {
        // SAFETY: the token proves AVX2 and FMA (here and in every method below).
        unsafe { _mm256_setzero_ps() }
    }
    #[inline(always)]
    fn splat(self, x: f32) -> __m256 {
        // SAFETY: as above.
        unsafe { _mm256_set1_ps(x) }
    }
    #[inline(always)]
    fn fma(self, a: __m256, b: __m256, c: __m256) -> __m256 {
        // SAFETY: as above.
        unsafe { _mm256_fmadd_ps(a, b, c) }
    }
    #[inline(always)]
    fn halves8(self, v: __m256) -> __m256 {
        v
    }
    #[inline(always)]
    fn add(self, a: __m256, b: __m256) -> __m256 {
        // SAFETY: as above.
        unsafe { _mm256_add_ps(a, b) }
    }
    #[inline(always)]
    fn sub(self, a: __m256, b: __m256) -> __m256 {
        // SAFETY: as above.
        unsafe { _mm256_sub_ps(a, b) }
    }
    #[inline(always)]
    fn mul(self, a: __m256, b: __m256) -> __m256 {
        // SAFETY: as above.
        unsafe { _mm256_mul_ps(a, b) }
    }
    #[inline(always)]
    fn div(self, a: __m256, b: __m256) -> __m256 {
        // SAFETY: as above.
        unsafe { _mm256_div_ps(a, b) }
    }
    #[inline(always)]
    fn min(self, a: __m256, b: __m256) -> __m256 {
        // SAFETY: as above.
        unsafe { _mm256_min_ps(a, b) }
    }
    #[inline(always)]
    fn max(self, a: __m256, b: __m256) -> __m256 {
        // SAFETY: as above.
        unsafe { _mm256_max_ps(a, b) }
    }
    #[inline(always)]
    fn select_gt(self, a: __m256, b: __m256, t: __m256, f: __m256) -> __m256 {
        // SAFETY: as above.
        unsafe { _mm256_blendv_ps(f, t, _mm256_cmp_ps::<_CMP_GT_OQ>(a, b)) }
    }
    #[inline(always)]
    fn ldexp(self, y: __m256, n: __m256) -> __m256 {
        // 2ⁿ as two normal powers of two, 2^⌊n/2⌋ · 2^(n−⌊n/2⌋), built in the exponent
        // field: the first product is exact, the second rounds once.
        // SAFETY: as above.
        unsafe {
            let ni = _mm256_cvtps_epi32(n);
            let half = _mm256_srai_epi32::<1>(ni);
            let bias = _mm256_set1_epi32(127);
            let s1 = _mm256_slli_epi32::<23>(_mm256_add_epi32(half, bias));
            let s2 = _mm256_slli_epi32::<23>(_mm256_add_epi32(_mm256_sub_epi32(ni, half), bias));
            _mm256_mul_ps(
                _mm256_mul_ps(y, _mm256_castsi256_ps(s1)),
                _mm256_castsi256_ps(s2),
            )
        }
    }
    #[inline(always)]
    fn keep_first(self, v: __m256, n: usize, fill: f32) -> __m256 {
        // SAFETY: as above.
        unsafe { _mm256_blendv_ps(_mm256_set1_ps(fill), v, _mm256_castsi256_ps(mask8(self, n))) }
    }
    #[inline(always)]
    fn reduce_max(self, v: __m256) -> f32 {
        // SAFETY: as above.
        unsafe { hmax8(v) }
    }
    #[inline(always)]
    unsafe fn loadu(self, p: *const f32) -> __m256 {
        // SAFETY: AVX (token); the caller guarantees 8 readable floats.
        unsafe { _mm256_loadu_ps(p) }
    }
    #[inline(always)]
    unsafe fn storeu(self, p: *mut f32, v: __m256) {
        // SAFETY: AVX (token); the caller guarantees 8 writable floats.
        unsafe { _mm256_storeu_ps(p, v) }
    }
    #[inline(always)]
    unsafe fn load_partial(self, p: *const f32, n: usize) -> __m256 {
        // A whole vector is a plain load: AVX2's masked moves are slow on AMD (a masked store
        // is microcoded there; SiLU rows with it on every vector ran at a third of the speed).
        if n >= 8 {
            // SAFETY: AVX (token); the caller guarantees min(n, 8) = 8 readable floats.
            return unsafe { _mm256_loadu_ps(p) };
        }
        // SAFETY: AVX (token); masked-off lanes are not accessed, the others are readable
        // (caller).
        unsafe { _mm256_maskload_ps(p, mask8(self, n)) }
    }
    #[inline(always)]
    unsafe fn store_partial(self, p: *mut f32, v: __m256, n: usize) {
        // A whole vector is a plain store (see `load_partial`).
        if n >= 8 {
            // SAFETY: AVX (token); the caller guarantees min(n, 8) = 8 writable floats.
            return unsafe { _mm256_storeu_ps(p, v) };
        }
        // SAFETY: AVX (token); masked-off lanes are not accessed, the others are writable
        // (caller).
        unsafe { _mm256_maskstore_ps(p, mask8(self, n), v) }
    }
    #[inline(always)]
    unsafe fn load_half<const BF16: bool>(self, p: *const u16, n: usize) -> __m256 {
        // SAFETY: 8 values are readable when n ≥ 8, else the first n are copied (caller);
        // F16C for f16 (caller), AVX2 (token) for bf16.
        unsafe {
            let h = if n >= 8 {
                _mm_loadu_si128(p.cast())
            } else {
                _mm_loadu_si128(half_tail::<8>(p, n).as_ptr().cast())
            };
            if BF16 {
                _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h)))
            } else {
                _mm256_cvtph_ps(h)
            }
        }
    }
}

/// AVX-512F, 16 lanes of `__m512`. (Rust's `avx512f` target feature implies AVX2, FMA and
/// F16C, so the 8-lane helpers run in its kernels too.)
#[derive(Clone, Copy, Debug)]
pub(crate) struct Avx512(());

impl Avx512 {
    /// The token, when the CPU has AVX-512F (and AVX2 and FMA, which every such CPU has).
    #[inline]
    pub(crate) fn new() -> Option<Avx512> {
        crate::isa::get().avx512f_avx2_fma().then_some(Avx512(()))
    }

    /// The token without asking: for hot paths whose caller already chose AVX-512.
    ///
    /// # Safety
    /// The CPU must have AVX-512F, AVX2 and FMA.
    #[inline(always)]
    pub(crate) unsafe fn assume() -> Avx512 {
        Avx512(())
    }
}

// SAFETY: `Avx512::new` makes a value only when the CPU has AVX-512F, AVX2 and FMA.
unsafe impl Simd for Avx512 {
    type V = __m512;
    const LANES: usize = 16;
    const MASKED_TAILS: bool = true;

    #[inline(always)]
    fn zero(self) -> __m512 {
        // SAFETY: the token proves AVX-512F (here and in every method below).
        unsafe { _mm512_setzero_ps() }
    }
    #[inline(always)]
    fn splat(self, x: f32) -> __m512 {
        // SAFETY: as above.
        unsafe { _mm512_set1_ps(x) }
    }
    #[inline(always)]
    fn fma(self, a: __m512, b: __m512, c: __m512) -> __m512 {
        // SAFETY: as above.
        unsafe { _mm512_fmadd_ps(a, b, c) }
    }
    #[inline(always)]
    fn halves8(self, v: __m512) -> __m256 {
        // SAFETY: as above.
        unsafe {
            _mm256_add_ps(
                _mm512_castps512_ps256(v),
                _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v))),
            )
        }
    }
    #[inline(always)]
    fn add(self, a: __m512, b: __m512) -> __m512 {
        // SAFETY: as above.
        unsafe { _mm512_add_ps(a, b) }
    }
    #[inline(always)]
    fn sub(self, a: __m512, b: __m512) -> __m512 {
        // SAFETY: as above.
        unsafe { _mm512_sub_ps(a, b) }
    }
    #[inline(always)]
    fn mul(self, a: __m512, b: __m512) -> __m512 {
        // SAFETY: as above.
        unsafe { _mm512_mul_ps(a, b) }
    }
    #[inline(always)]
    fn div(self, a: __m512, b: __m512) -> __m512 {
        // SAFETY: as above.
        unsafe { _mm512_div_ps(a, b) }
    }
    #[inline(always)]
    fn min(self, a: __m512, b: __m512) -> __m512 {
        // SAFETY: as above.
        unsafe { _mm512_min_ps(a, b) }
    }
    #[inline(always)]
    fn max(self, a: __m512, b: __m512) -> __m512 {
        // SAFETY: as above.
        unsafe { _mm512_max_ps(a, b) }
    }
    #[inline(always)]
    fn select_gt(self, a: __m512, b: __m512, t: __m512, f: __m512) -> __m512 {
        // SAFETY: as above.
        unsafe { _mm512_mask_blend_ps(_mm512_cmp_ps_mask::<_CMP_GT_OQ>(a, b), f, t) }
    }
    #[inline(always)]
    fn ldexp(self, y: __m512, n: __m512) -> __m512 {
        // `vscalefps` rounds y·2ⁿ once, as the two-factor form does where the trait says.
        // SAFETY: as above.
        unsafe { _mm512_scalef_ps(y, n) }
    }
    #[inline(always)]
    fn keep_first(self, v: __m512, n: usize, fill: f32) -> __m512 {
        // SAFETY: as above.
        unsafe { _mm512_mask_blend_ps(lanes16(n), _mm512_set1_ps(fill), v) }
    }
    #[inline(always)]
    fn reduce_max(self, v: __m512) -> f32 {
        // SAFETY: as above.
        unsafe {
            hmax8(_mm256_max_ps(
                _mm512_castps512_ps256(v),
                _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v))),
            ))
        }
    }
    #[inline(always)]
    unsafe fn loadu(self, p: *const f32) -> __m512 {
        // SAFETY: AVX-512F (token); the caller guarantees 16 readable floats.
        unsafe { _mm512_loadu_ps(p) }
    }
    #[inline(always)]
    unsafe fn storeu(self, p: *mut f32, v: __m512) {
        // SAFETY: AVX-512F (token); the caller guarantees 16 writable floats.
        unsafe { _mm512_storeu_ps(p, v) }
    }
    #[inline(always)]
    unsafe fn load_partial(self, p: *const f32, n: usize) -> __m512 {
        // SAFETY: AVX-512F (token); masked-off lanes are neither read nor fault, the others
        // are readable (caller).
        unsafe { _mm512_maskz_loadu_ps(lanes16(n), p) }
    }
    #[inline(always)]
    unsafe fn store_partial(self, p: *mut f32, v: __m512, n: usize) {
        // SAFETY: AVX-512F (token); masked-off lanes are not written, the others are
        // writable (caller).
        unsafe { _mm512_mask_storeu_ps(p, lanes16(n), v) }
    }
    #[inline(always)]
    unsafe fn load_half<const BF16: bool>(self, p: *const u16, n: usize) -> __m512 {
        // SAFETY: 16 values are readable when n ≥ 16, else the first n are copied (caller);
        // AVX-512F (token) converts both formats.
        unsafe {
            let h = if n >= 16 {
                _mm256_loadu_si256(p.cast())
            } else {
                _mm256_loadu_si256(half_tail::<16>(p, n).as_ptr().cast())
            };
            if BF16 {
                _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)))
            } else {
                _mm512_cvtph_ps(h)
            }
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A 16-lane stand-in for [`Avx512`] built from two AVX2 registers (lanes 0..8, 8..16),
    /// each method with the same per-lane result as its AVX-512 counterpart (the same single
    /// roundings, `halves8` adding low + high, masked tails), so the generic kernels' 16-lane
    /// code runs on CPUs without AVX-512.
    #[derive(Clone, Copy, Debug)]
    pub(crate) struct Emu16(Avx2);

    impl Emu16 {
        /// The token, when the CPU has AVX2 and FMA.
        pub(crate) fn new() -> Option<Emu16> {
            Avx2::new().map(Emu16)
        }
    }

    // SAFETY: made only from an `Avx2` token: the CPU has AVX2 and FMA.
    unsafe impl Simd for Emu16 {
        type V = [__m256; 2];
        const LANES: usize = 16;
        const MASKED_TAILS: bool = true;

        #[inline(always)]
        fn zero(self) -> [__m256; 2] {
            [self.0.zero(); 2]
        }
        #[inline(always)]
        fn splat(self, x: f32) -> [__m256; 2] {
            [self.0.splat(x); 2]
        }
        #[inline(always)]
        fn fma(self, a: [__m256; 2], b: [__m256; 2], c: [__m256; 2]) -> [__m256; 2] {
            [self.0.fma(a[0], b[0], c[0]), self.0.fma(a[1], b[1], c[1])]
        }
        #[inline(always)]
        fn halves8(self, v: [__m256; 2]) -> __m256 {
            // SAFETY: AVX (token).
            unsafe { _mm256_add_ps(v[0], v[1]) }
        }
        #[inline(always)]
        fn add(self, a: [__m256; 2], b: [__m256; 2]) -> [__m256; 2] {
            [self.0.add(a[0], b[0]), self.0.add(a[1], b[1])]
        }
        #[inline(always)]
        fn sub(self, a: [__m256; 2], b: [__m256; 2]) -> [__m256; 2] {
            [self.0.sub(a[0], b[0]), self.0.sub(a[1], b[1])]
        }
        #[inline(always)]
        fn mul(self, a: [__m256; 2], b: [__m256; 2]) -> [__m256; 2] {
            [self.0.mul(a[0], b[0]), self.0.mul(a[1], b[1])]
        }
        #[inline(always)]
        fn div(self, a: [__m256; 2], b: [__m256; 2]) -> [__m256; 2] {
            [self.0.div(a[0], b[0]), self.0.div(a[1], b[1])]
        }
        #[inline(always)]
        fn min(self, a: [__m256; 2], b: [__m256; 2]) -> [__m256; 2] {
            [self.0.min(a[0], b[0]), self.0.min(a[1], b[1])]
        }
        #[inline(always)]
        fn max(self, a: [__m256; 2], b: [__m256; 2]) -> [__m256; 2] {
            [self.0.max(a[0], b[0]), self.0.max(a[1], b[1])]
        }
        #[inline(always)]
        fn select_gt(
            self,
            a: [__m256; 2],
            b: [__m256; 2],
            t: [__m256; 2],
            f: [__m256; 2],
        ) -> [__m256; 2] {
            [
                self.0.select_gt(a[0], b[0], t[0], f[0]),
                self.0.select_gt(a[1], b[1], t[1], f[1]),
            ]
        }
        #[inline(always)]
        fn ldexp(self, y: [__m256; 2], n: [__m256; 2]) -> [__m256; 2] {
            [self.0.ldexp(y[0], n[0]), self.0.ldexp(y[1], n[1])]
        }
        #[inline(always)]
        fn keep_first(self, v: [__m256; 2], n: usize, fill: f32) -> [__m256; 2] {
            [
                self.0.keep_first(v[0], n, fill),
                self.0.keep_first(v[1], n.saturating_sub(8), fill),
            ]
        }
        #[inline(always)]
        fn reduce_max(self, v: [__m256; 2]) -> f32 {
            // SAFETY: AVX (token).
            unsafe { hmax8(_mm256_max_ps(v[0], v[1])) }
        }
        #[inline(always)]
        unsafe fn loadu(self, p: *const f32) -> [__m256; 2] {
            // SAFETY: the caller guarantees 16 readable floats.
            unsafe { [self.0.loadu(p), self.0.loadu(p.add(8))] }
        }
        #[inline(always)]
        unsafe fn storeu(self, p: *mut f32, v: [__m256; 2]) {
            // SAFETY: the caller guarantees 16 writable floats.
            unsafe {
                self.0.storeu(p, v[0]);
                self.0.storeu(p.add(8), v[1]);
            }
        }
        #[inline(always)]
        unsafe fn load_partial(self, p: *const f32, n: usize) -> [__m256; 2] {
            // SAFETY: lanes below n are readable (caller); the high half's pointer is formed
            // with wrapping arithmetic and, when n ≤ 8, all its lanes are masked off.
            unsafe {
                [
                    self.0.load_partial(p, n),
                    self.0.load_partial(p.wrapping_add(8), n.saturating_sub(8)),
                ]
            }
        }
        #[inline(always)]
        unsafe fn store_partial(self, p: *mut f32, v: [__m256; 2], n: usize) {
            // SAFETY: as in `load_partial`, for writing.
            unsafe {
                self.0.store_partial(p, v[0], n);
                self.0
                    .store_partial(p.wrapping_add(8), v[1], n.saturating_sub(8));
            }
        }
        #[inline(always)]
        unsafe fn load_half<const BF16: bool>(self, p: *const u16, n: usize) -> [__m256; 2] {
            // SAFETY: as in `load_partial`, for 16-bit values.
            unsafe {
                [
                    self.0.load_half::<BF16>(p, n),
                    self.0
                        .load_half::<BF16>(p.wrapping_add(8), n.saturating_sub(8)),
                ]
            }
        }
    }

    #[test]
    fn partial_loads_and_stores_touch_only_their_lanes() {
        let Some(s) = Emu16::new() else { return };
        let src: Vec<f32> = (0..16).map(|i| i as f32 + 1.0).collect();
        for n in 0..=17 {
            let mut dst = [-1f32; 16];
            // SAFETY: `src` and `dst` hold 16 floats.
            unsafe {
                let v = s.load_partial(src.as_ptr(), n);
                s.store_partial(dst.as_mut_ptr(), v, n);
            }
            for (i, &x) in dst.iter().enumerate() {
                assert_eq!(x, if i < n { src[i] } else { -1.0 }, "n={n} lane {i}");
            }
            let mut all = [0f32; 16];
            // SAFETY: as above.
            unsafe { s.storeu(all.as_mut_ptr(), s.load_partial(src.as_ptr(), n)) };
            for (i, &x) in all.iter().enumerate() {
                assert_eq!(x, if i < n { src[i] } else { 0.0 }, "n={n} lane {i}");
            }
        }
    }
}
