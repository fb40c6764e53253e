//! Dot products of ggml's block types beyond q8_0/q4_0 against their activation partner types
//! (ggml's `vec_dot_type`): q8_0 for q5_0 and iq4_nl, q8_1 for q4_1 and q5_1, q8_K for the
//! K-quants and iq4_xs.
//!
//! Each product exists in a portable version, which *defines* its arithmetic (exact integer
//! sums per block, then a fixed sequence of f32 operations), and SIMD versions that compute
//! the same bits. [`dot_fn`] picks the fastest version this CPU runs; [`dot_fn_with`] a given
//! one, for tests.

use super::{dot_iq1, dot_iq2, dot_iq3, dot_k, dot_legacy, dot_lowbit};
use crate::dtype::DType;
use crate::quant::kquants::Q8_K_BYTES;
use crate::quant::QK_K;

/// A dot product of one weight row (whole blocks of its type) and one activation row of the
/// partner type with the same number of values.
pub type DotFn = fn(&[u8], &[u8]) -> f32;

/// A product of one weight row with `C` activation rows at once: column `c` has the bits of
/// the single-row product ([`DotFn`]) with `ys[c]`.
pub type DotColsFn<const C: usize> = fn(&[u8], [&[u8]; C]) -> [f32; C];

/// The fastest product of `dtype` rows with `C` partner rows at once on this CPU, for the
/// types that have one (where the weights' decoding is worth sharing between columns).
pub fn dot_cols_fn<const C: usize>(dtype: DType) -> Option<DotColsFn<C>> {
    if Isa::best() != Isa::Avx512 {
        return None;
    }
    dot_k::dot_cols_fn::<C>(dtype)
}

/// Blocks of a weight row `x` (`x_block` bytes each) that every activation row of `ys`
/// (`y_block` bytes per block) covers too: a several-column product's length, as the
/// single-row products zip the two rows.
#[inline(always)]
pub(crate) fn common_blocks<const C: usize>(
    x: &[u8],
    x_block: usize,
    ys: &[&[u8]; C],
    y_block: usize,
) -> usize {
    ys.iter()
        .fold(x.len() / x_block, |n, y| n.min(y.len() / y_block))
}

/// The kernel families of the block dot products.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Isa {
    /// Portable Rust: the definition of every product.
    Portable,
    /// AVX2 + FMA (+ F16C) intrinsics.
    Avx2,
    /// AVX-512F/BW with AVX2, FMA and F16C: a family's 512-bit kernels where it has them,
    /// its AVX2 ones elsewhere (same bits: the portable code defines them all).
    Avx512,
}

impl Isa {
    /// Every family this CPU runs, slowest first.
    pub fn available() -> Vec<Isa> {
        let mut out = vec![Isa::Portable];
        let features = crate::isa::get();
        if features.avx2_fma_f16c() {
            out.push(Isa::Avx2);
            if features.avx512_bw() {
                out.push(Isa::Avx512);
            }
        }
        out
    }

    /// The fastest family this CPU runs.
    pub fn best() -> Isa {
        use std::sync::OnceLock;
        static BEST: OnceLock<Isa> = OnceLock::new();
        *BEST.get_or_init(|| *Isa::available().last().unwrap_or(&Isa::Portable))
    }
}

/// The common f32 step of the block products: `fma(a·b, f32(isum), acc)` — the scale product
/// rounded once, the exact integer sum converted, one fused multiply-add. Every family whose
/// definition takes this step (K-quants, iq2, iq3, the ternary and FP4 types) calls this one
/// function in its portable and SIMD versions, so the sequence cannot drift between them.
#[inline(always)]
pub(crate) fn step(acc: f32, a: f32, b: f32, isum: i32) -> f32 {
    (a * b).mul_add(isum as f32, acc)
}

/// The f32 scale of a q8_K super-block (its first four bytes). For the portable definitions.
#[inline(always)]
pub(crate) fn q8_k_scale(b: &[u8]) -> f32 {
    f32::from_le_bytes([b[0], b[1], b[2], b[3]])
}

/// A q8_K super-block's scale, quants and stored group sums. For the portable definitions.
#[inline(always)]
pub(crate) fn q8_k_parts(b: &[u8; Q8_K_BYTES]) -> (f32, [i8; QK_K], [i16; 16]) {
    let qs = std::array::from_fn(|v| b[4 + v] as i8);
    let bsums = std::array::from_fn(|k| i16::from_le_bytes([b[260 + 2 * k], b[261 + 2 * k]]));
    (q8_k_scale(b), qs, bsums)
}

/// Activation quant bytes read as the signed values they are.
#[inline(always)]
pub(crate) fn as_i8(bytes: &[u8]) -> &[i8] {
    bytemuck::cast_slice(bytes)
}

/// `Σ w_v·y_v` over the shorter of two runs, exactly in `i32`: small integer weights against
/// signed activation quants. For the portable definitions.
#[inline(always)]
pub(crate) fn int_dot<T: Copy + Into<i32>>(w: &[T], y: &[i8]) -> i32 {
    w.iter()
        .zip(y)
        .map(|(&a, &b)| a.into() * i32::from(b))
        .sum()
}

/// The activation type ggml pairs with weights of `dtype` in products, for the types of this
/// module.
pub fn vec_dot_type(dtype: DType) -> Option<DType> {
    match dtype {
        DType::Q5_0 | DType::IQ4_NL | DType::MXFP4 | DType::NVFP4 | DType::Q1_0 | DType::Q2_0 => {
            Some(DType::Q8_0)
        }
        DType::Q4_1 | DType::Q5_1 => Some(DType::Q8_1),
        DType::Q2_K
        | DType::Q3_K
        | DType::Q4_K
        | DType::Q5_K
        | DType::Q6_K
        | DType::IQ4_XS
        | DType::IQ2_XXS
        | DType::IQ2_XS
        | DType::IQ2_S
        | DType::IQ3_XXS
        | DType::IQ3_S
        | DType::IQ1_S
        | DType::IQ1_M
        | DType::TQ1_0
        | DType::TQ2_0 => Some(DType::Q8_K),
        _ => None,
    }
}

/// The product of `dtype` rows with their partner rows in family `isa` (one of
/// [`Isa::available`]), or `None` when the type has no such product.
pub fn dot_fn_with(dtype: DType, isa: Isa) -> Option<DotFn> {
    dot_legacy::dot_fn(dtype, isa)
        .or_else(|| dot_k::dot_fn(dtype, isa))
        .or_else(|| dot_iq2::dot_fn(dtype, isa))
        .or_else(|| dot_iq3::dot_fn(dtype, isa))
        .or_else(|| dot_iq1::dot_fn(dtype, isa))
        .or_else(|| dot_lowbit::dot_fn(dtype, isa))
}

/// The fastest product of `dtype` rows with their partner rows on this CPU.
pub fn dot_fn(dtype: DType) -> Option<DotFn> {
    dot_fn_with(dtype, Isa::best())
}

/// A kernel family's table of its products in one [`Isa`]: the product of `dtype` rows, if
/// the family has one.
pub(crate) type Lookup = fn(DType) -> Option<DotFn>;

/// The body of every family module's `dot_fn`: `portable(dtype)` for [`Isa::Portable`],
/// `avx2(dtype)` for [`Isa::Avx2`] and [`Isa::Avx512`] (for a family without 512-bit
/// kernels). The family's `avx2` lookup (defined with [`avx2_lookup!`]) does its own
/// CPU-feature check and is `None` on other architectures.
#[inline]
pub(crate) fn family_dot_fn(
    dtype: DType,
    isa: Isa,
    portable: Lookup,
    avx2: Lookup,
) -> Option<DotFn> {
    match isa {
        Isa::Portable => portable(dtype),
        Isa::Avx2 | Isa::Avx512 => avx2(dtype),
    }
}

/// [`family_dot_fn`] for a family with 512-bit kernels: `avx512(dtype)` first for
/// [`Isa::Avx512`] (a lookup that checks the CPU's features itself), its AVX2 kernel for the
/// types it lacks.
#[inline]
pub(crate) fn family_dot_fn_wide(
    dtype: DType,
    isa: Isa,
    portable: Lookup,
    avx2: Lookup,
    avx512: Lookup,
) -> Option<DotFn> {
    match isa {
        Isa::Avx512 => avx512(dtype).or_else(|| avx2(dtype)),
        _ => family_dot_fn(dtype, isa, portable, avx2),
    }
}

/// Defines a family module's `fn avx2(dtype: DType) -> Option<DotFn>`, the [`Lookup`] of its
/// AVX2 products for [`family_dot_fn`]: on x86_64 it maps each listed dtype to the named
/// kernel of the module's `x86` submodule once [`super::block_x86::supported`] confirms AVX2,
/// FMA and F16C (`None` for other dtypes, or when the CPU lacks them); on other
/// architectures it is always `None`.
///
/// * `avx2_lookup!(unsafe x86 { Q2_K => q2_k, ... })`: the kernels are
///   `unsafe fn(&[u8], &[u8]) -> f32` whose only requirement is AVX2, FMA and F16C (a
///   `#[target_feature(enable = "avx2,fma,f16c")]` function). The macro also defines a private
///   module `avx2_entry` of safe wrappers with the kernels' names, which `avx2` hands out
///   after its check.
/// * `avx2_lookup!(x86 { Q4_1 => dot_q4_1_q8_1, ... })`: the kernels are already safe
///   `fn(&[u8], &[u8]) -> f32` and are handed out as they are.
macro_rules! avx2_lookup {
    (unsafe x86 { $($dtype:ident => $kernel:ident),+ $(,)? }) => {
        $crate::kernels::block_dot::avx2_lookup!(@lookup $($dtype => avx2_entry::$kernel),+);

        /// Safe entry points to the AVX2 kernels, handed out only by `avx2` after its check
        /// of the CPU's features.
        #[cfg(target_arch = "x86_64")]
        mod avx2_entry {
            $(
                pub(super) fn $kernel(x: &[u8], y: &[u8]) -> f32 {
                    // SAFETY: only `avx2` hands this function out, and only once
                    // `block_x86::supported()` has confirmed AVX2, FMA and F16C, all that the
                    // kernel requires.
                    unsafe { super::x86::$kernel(x, y) }
                }
            )+
        }
    };
    (x86 { $($dtype:ident => $kernel:ident),+ $(,)? }) => {
        $crate::kernels::block_dot::avx2_lookup!(@lookup $($dtype => x86::$kernel),+);
    };
    (@lookup $($dtype:ident => $($path:ident)::+),+) => {
        /// The family's AVX2 products (see `block_dot::avx2_lookup!`).
        #[cfg(target_arch = "x86_64")]
        fn avx2(dtype: $crate::dtype::DType) -> Option<$crate::kernels::block_dot::DotFn> {
            if !$crate::kernels::block_x86::supported() {
                return None;
            }
            Some(match dtype {
                $($crate::dtype::DType::$dtype => $($path)::+,)+
                _ => return None,
            })
        }

        /// The family's AVX2 products: none on this architecture.
        #[cfg(not(target_arch = "x86_64"))]
        fn avx2(_dtype: $crate::dtype::DType) -> Option<$crate::kernels::block_dot::DotFn> {
            None
        }
    };
}
pub(crate) use avx2_lookup;
