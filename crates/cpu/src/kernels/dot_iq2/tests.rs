use super::*;
use crate::kernels::dot_test_support::{
    assert_within, check_every_isa, check_lengths, check_mul_mat, check_random_bytes, decode_q8_k,
    f64_dot, q8_k_row, random_weights, set_scale, Act, Rng, Scale,
};
use crate::quant::codec;

/// The weight types of this module with their bytes per super-block (each has its f16 scale
/// at byte 0).
const TYPES: [(DType, usize); 3] = [
    (DType::IQ2_XXS, IQ2_XXS_BYTES),
    (DType::IQ2_XS, IQ2_XS_BYTES),
    (DType::IQ2_S, IQ2_S_BYTES),
];

/// The super-block counts of the tests.
const COUNTS: [usize; 5] = [1, 2, 3, 7, 17];

/// The activation kinds of the tests (the q8_K group sums are not used by these products).
const KINDS: [Act; 4] = [
    Act::Quantized,
    Act::RawInconsistent,
    Act::AllMin,
    Act::AllMax,
];

#[test]
fn dot_fn_covers_exactly_these_types() {
    for dt in DType::ALL {
        let mine = TYPES.iter().any(|&(t, _)| t == dt);
        assert_eq!(dot_fn(dt, Isa::Portable).is_some(), mine, "{dt}");
        for isa in Isa::available() {
            assert_eq!(dot_fn(dt, isa).is_some(), mine, "{dt} {isa:?}");
        }
        if mine {
            assert_eq!(super::super::block_dot::vec_dot_type(dt), Some(DType::Q8_K));
            assert!(super::super::block_dot::dot_fn_with(dt, Isa::Portable).is_some());
        }
    }
    // AVX2 only where the CPU has it.
    if !crate::isa::get().avx2_fma_f16c() {
        assert!(dot_fn(DType::IQ2_XXS, Isa::Avx2).is_none());
    }
}

/// Every family gives the portable bits on random rows (every byte random, finite scales)
/// against every kind of activation row.
#[test]
fn every_isa_matches_portable_bits() {
    let mut rng = Rng(0x0123_4567_89AB_CDEF);
    for (dtype, size) in TYPES {
        let portable = dot_fn(dtype, Isa::Portable).unwrap();
        for nb in COUNTS {
            for kind in KINDS {
                for _ in 0..6 {
                    let w = random_weights(&mut rng, size, Scale::At0, nb);
                    let a = q8_k_row(&mut rng, kind, nb);
                    let want = portable(&w, &a);
                    assert!(want.is_finite(), "{dtype} {kind:?}: {want}");
                    let what = format!("{nb} super-blocks, {kind:?}");
                    check_every_isa(dot_fn, dtype, &w, &a, want, &what);
                }
            }
        }
    }
}

/// Extreme weight bytes (all bits set / clear / alternating, with the largest f16 scales)
/// against extreme activations, and unaligned rows.
#[test]
fn extremes_and_alignment() {
    let mut rng = Rng(77);
    for (dtype, size) in TYPES {
        for fill in [0x00u8, 0xFF, 0x80, 0x7F, 0x55, 0xAA] {
            for d16 in [0x7BFFu16, 0xFBFF, 0x0001, 0x3C00, 0x8000] {
                let nb = 3;
                let mut w = vec![fill; nb * size];
                for b in w.chunks_exact_mut(size) {
                    set_scale(b, Scale::At0, d16);
                }
                for kind in KINDS {
                    let a = q8_k_row(&mut rng, kind, nb);
                    let want = dot_fn(dtype, Isa::Portable).unwrap()(&w, &a);
                    let what = format!("fill {fill:#x} d {d16:#x} {kind:?}");
                    check_every_isa(dot_fn, dtype, &w, &a, want, &what);
                }
            }
        }
    }
}

/// Entirely random bytes (NaN and infinite scales possible on both sides) neither panic nor
/// disagree beyond NaN payloads.
#[test]
fn random_bytes_never_panic() {
    let mut rng = Rng(99);
    for (dtype, size) in TYPES {
        check_random_bytes(&mut rng, dot_fn, dtype, size, 64);
    }
}

/// Rows of different lengths use the shorter row's whole super-blocks; empty rows give 0.
#[test]
fn lengths() {
    let mut rng = Rng(5);
    for (dtype, size) in TYPES {
        let w = random_weights(&mut rng, size, Scale::At0, 3);
        let a = q8_k_row(&mut rng, Act::Quantized, 3);
        check_lengths(dot_fn, dtype, size, &w, &a);
        for isa in Isa::available() {
            let dot = dot_fn(dtype, isa).unwrap();
            let two = dot(&w[..2 * size], &a[..2 * Q8_K_BYTES]);
            assert_eq!(dot(&w[..2 * size + 7], &a).to_bits(), two.to_bits());
        }
    }
}

/// The portable product is the f64 dot product of the dequantized rows within the bound of
/// the module docs, `(nb + 6)·2⁻²⁴·S`.
#[test]
fn portable_matches_dequantized_f64_dot() {
    let mut rng = Rng(0xDEAD_BEEF);
    for (dtype, size) in TYPES {
        let to_f32 = codec(dtype).unwrap().to_f32;
        for nb in COUNTS {
            for kind in KINDS {
                for _ in 0..4 {
                    let w = random_weights(&mut rng, size, Scale::At0, nb);
                    let a = q8_k_row(&mut rng, kind, nb);
                    let mut xv = vec![0f32; nb * QK_K];
                    to_f32(&w, &mut xv);
                    let yv = decode_q8_k(&a);
                    let s: f64 = xv
                        .iter()
                        .zip(&yv)
                        .map(|(&p, &q)| (f64::from(p) * f64::from(q)).abs())
                        .sum();
                    let tol = (nb + 6) as f64 * 2f64.powi(-24) * s + 1e-30;
                    let got = f64::from(dot_fn(dtype, Isa::Portable).unwrap()(&w, &a));
                    let what = format!("{dtype} {nb} {kind:?}");
                    assert_within(got, f64_dot(&xv, &yv), tol, &what);
                }
            }
        }
    }
}

/// A hand-computed case: one iq2_xs super-block with d = 1, every lattice index 0 (all 8s),
/// no signs, scales 0 (ls = 1) and 15 (ls = 31) alternating by halves, against q8_K with
/// d = 0.5 and every quant 1: isum = 8·16·1 + 8·16·31 per sub-block, times 8 sub-blocks;
/// result = 0.125·(1·0.5)·isum.
#[test]
fn known_value() {
    let mut w = vec![0u8; IQ2_XS_BYTES];
    w[..2].copy_from_slice(&0x3C00u16.to_le_bytes());
    w[66..74].fill(0xF0);
    let mut a = vec![0u8; Q8_K_BYTES];
    a[..4].copy_from_slice(&0.5f32.to_le_bytes());
    a[4..260].fill(1);
    let isum = 8 * (8 * 16 + 8 * 16 * 31);
    let want = 0.125 * 0.5 * isum as f32;
    for isa in Isa::available() {
        assert_eq!(dot_fn(DType::IQ2_XS, isa).unwrap()(&w, &a), want, "{isa:?}");
    }
    // Sign index 127 (the sign byte 0xFF) on run 0: values 0..8 turn negative, so group 0's
    // sum drops by 2·8·8 (its ls is 1).
    w[2..4].copy_from_slice(&(127u16 << 9).to_le_bytes());
    let want = 0.125 * 0.5 * (isum - 2 * 8 * 8) as f32;
    for isa in Isa::available() {
        assert_eq!(dot_fn(DType::IQ2_XS, isa).unwrap()(&w, &a), want, "{isa:?}");
    }
}

/// End to end: MUL_MAT of iq2 weights with one or two f32 activation columns on the CPU
/// backend (which quantizes the activations to q8_K and calls these products) gives, for
/// every output, the bits of this module's product with the q8_K-quantized column.
#[test]
fn mul_mat_uses_these_products() {
    let mut rng = Rng(2024);
    for (dtype, size) in TYPES {
        check_mul_mat(&mut rng, dot_fn, dtype, size, Scale::At0);
    }
}
