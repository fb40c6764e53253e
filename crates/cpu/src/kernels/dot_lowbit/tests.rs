//! Tests of the low-bit products (shared pieces from [`crate::kernels::dot_test_support`];
//! the wild scale bytes, the MXFP4 exponent clamp and the every-UE4M3-byte test are this
//! module's own).

use super::*;
use crate::kernels::dot_test_support::{
    assert_within, check_every_isa, f64_dot, q8_0_row, q8_k_row, Act, Rng,
};
use crate::quant::codec;
use crate::quant::kquants::Q8_K_BYTES;
use crate::quant::lowbit::{QK_MXFP4, QK_NVFP4, QK_Q1_0, QK_Q2_0};
use crate::quant::QK_K;

/// The weight types of this module: values and bytes per block, the byte offset of an f16
/// scale (if any), and how many q8_0 blocks (or q8_K super-blocks) one block meets.
const TYPES: [(DType, usize, usize, Option<usize>); 6] = [
    (DType::TQ1_0, QK_K, TQ1_0_BYTES, Some(52)),
    (DType::TQ2_0, QK_K, TQ2_0_BYTES, Some(64)),
    (DType::MXFP4, QK_MXFP4, MXFP4_BYTES, None),
    (DType::NVFP4, QK_NVFP4, NVFP4_BYTES, None),
    (DType::Q1_0, QK_Q1_0, Q1_0_BYTES, Some(0)),
    (DType::Q2_0, QK_Q2_0, Q2_0_BYTES, Some(0)),
];

/// Block counts of the tests: short and longer, multiples of 4 and not (the AVX2 MXFP4
/// kernel takes four blocks at a time).
const COUNTS: [usize; 6] = [1, 2, 3, 4, 9, 33];

fn partner(dtype: DType) -> DType {
    if matches!(dtype, DType::TQ1_0 | DType::TQ2_0) {
        DType::Q8_K
    } else {
        DType::Q8_0
    }
}

/// `nb` random weight blocks: every byte random, then moderate f16 scales (the FP4 scale
/// bytes stay random: every byte is a finite scale, but the largest E8M0 exponents overflow
/// products, so those are kept to a moderate range unless `wild`).
fn random_weights(rng: &mut Rng, dtype: DType, nb: usize, wild: bool) -> Vec<u8> {
    let (_, _, size, f16_at) = TYPES.iter().copied().find(|t| t.0 == dtype).unwrap();
    let mut w = rng.bytes(nb * size);
    for b in w.chunks_exact_mut(size) {
        if let Some(at) = f16_at {
            let bits = if wild {
                rng.next() as u16
            } else {
                rng.f16_normal_bits()
            };
            b[at..at + 2].copy_from_slice(&bits.to_le_bytes());
        }
        if dtype == DType::MXFP4 && !wild {
            b[0] = 100 + rng.below(50) as u8;
        }
    }
    w
}

/// Activations for `n` values of the given kind ([`q8_k_row`] or [`q8_0_row`]); if `wild`,
/// every scale field is then overwritten with random bits (NaN and infinities included).
fn activations(rng: &mut Rng, dtype: DType, n: usize, kind: Act, wild: bool) -> Vec<u8> {
    let p = partner(dtype);
    let blocks = n / p.block_size();
    let mut out = if p == DType::Q8_K {
        q8_k_row(rng, kind, blocks)
    } else {
        q8_0_row(rng, kind, blocks)
    };
    if wild {
        let scale_bytes = if p == DType::Q8_K { 4 } else { 2 };
        for b in out.chunks_exact_mut(p.type_size()) {
            let bits = rng.next().to_le_bytes();
            b[..scale_bytes].copy_from_slice(&bits[..scale_bytes]);
        }
    }
    out
}

/// The raw or the quantized kind of activations.
fn kind(raw: bool) -> Act {
    if raw {
        Act::RawConsistent
    } else {
        Act::Quantized
    }
}

/// The values of a row of `dtype` (weights, q8_0 or q8_K), decoded.
fn dequantize(dtype: DType, bytes: &[u8]) -> Vec<f32> {
    let n = bytes.len() / dtype.type_size() * dtype.block_size();
    let mut out = vec![0f32; n];
    if dtype == DType::Q8_0 {
        crate::kernels::quant_dot::dequantize_row_q8_0(bytes, &mut out);
    } else {
        (codec(dtype).unwrap().to_f32)(bytes, &mut out);
    }
    out
}

#[test]
fn dot_fn_covers_exactly_these_types() {
    for dt in DType::ALL {
        let mine = TYPES.iter().any(|t| t.0 == dt);
        for isa in Isa::available() {
            assert_eq!(dot_fn(dt, isa).is_some(), mine, "{dt} {isa:?}");
        }
    }
    for (dt, ..) in TYPES {
        assert_eq!(super::super::block_dot::vec_dot_type(dt), Some(partner(dt)));
    }
}

#[test]
fn every_isa_matches_portable_bits() {
    let mut rng = Rng(0x0123_4567_89AB_CDEF);
    for (dtype, qk, _, _) in TYPES {
        let portable = dot_fn(dtype, Isa::Portable).unwrap();
        for nb in COUNTS {
            for raw in [false, true] {
                for wild in [false, true] {
                    for _ in 0..3 {
                        let w = random_weights(&mut rng, dtype, nb, wild);
                        let a = activations(&mut rng, dtype, nb * qk, kind(raw), wild && raw);
                        let want = portable(&w, &a);
                        if !wild {
                            assert!(want.is_finite(), "{dtype}: {want}");
                        }
                        let what = format!("{nb} blocks raw {raw} wild {wild}");
                        check_every_isa(dot_fn, dtype, &w, &a, want, &what);
                    }
                }
            }
        }
    }
}

#[test]
fn extreme_bytes_match_portable() {
    let mut rng = Rng(77);
    for (dtype, qk, size, f16_at) in TYPES {
        for fill in [0x00u8, 0xFF, 0x80, 0x7F, 0x55, 0xAA] {
            let nb = 5;
            let mut w = vec![fill; nb * size];
            if let Some(at) = f16_at {
                for b in w.chunks_exact_mut(size) {
                    b[at..at + 2].copy_from_slice(&0x3C00u16.to_le_bytes());
                }
            }
            for yfill in [Act::AllMin, Act::AllMax] {
                let a = activations(&mut rng, dtype, nb * qk, yfill, false);
                let want = dot_fn(dtype, Isa::Portable).unwrap()(&w, &a);
                let what = format!("fill {fill:#x} y {yfill:?}");
                check_every_isa(dot_fn, dtype, &w, &a, want, &what);
            }
        }
    }
}

#[test]
fn portable_close_to_f64_dot_of_decoded_rows() {
    let mut rng = Rng(0xDEAD_BEEF_0BAD_F00D);
    for (dtype, qk, _, _) in TYPES {
        let dot = dot_fn(dtype, Isa::Portable).unwrap();
        for nb in COUNTS {
            for raw in [false, true] {
                let w = random_weights(&mut rng, dtype, nb, false);
                let a = activations(&mut rng, dtype, nb * qk, kind(raw), false);
                let xw = dequantize(dtype, &w);
                let ya = dequantize(partner(dtype), &a);
                let s: f64 = xw
                    .iter()
                    .zip(&ya)
                    .map(|(&p, &q)| (f64::from(p) * f64::from(q)).abs())
                    .sum();
                let steps = if dtype == DType::NVFP4 { 4 * nb } else { nb } as f64;
                let bound = (2.0 * steps + 16.0) * 2f64.powi(-24) * s;
                let what = format!("{dtype} {nb} blocks raw {raw} (S {s})");
                assert_within(f64::from(dot(&w, &a)), f64_dot(&xw, &ya), bound, &what);
            }
        }
    }
}

#[test]
fn short_rows_use_whole_blocks_only() {
    let mut rng = Rng(5);
    for (dtype, qk, size, _) in TYPES {
        let w = random_weights(&mut rng, dtype, 3, false);
        let a = activations(&mut rng, dtype, 3 * qk, Act::RawConsistent, false);
        let ps = partner(dtype).type_size() * (qk / partner(dtype).block_size());
        for isa in Isa::available() {
            let dot = dot_fn(dtype, isa).unwrap();
            let two = dot(&w[..2 * size], &a[..2 * ps]);
            assert_eq!(
                dot(&w, &a[..2 * ps + ps - 1]).to_bits(),
                two.to_bits(),
                "{dtype}"
            );
            assert_eq!(
                dot(&w[..3 * size - 1], &a).to_bits(),
                two.to_bits(),
                "{dtype}"
            );
            assert_eq!(dot(&[], &a), 0.0);
        }
    }
}

#[test]
fn known_values() {
    // MXFP4: e = 127 (s = 0.5), all codes 7 (level 12, value 6.0); q8_0 scale 1, quants 1:
    // 32 · 6 = 192.
    let mut w = vec![0x77u8; MXFP4_BYTES];
    w[0] = 127;
    let mut a = vec![1u8; Q8_0_BYTES];
    a[..2].copy_from_slice(&0x3C00u16.to_le_bytes());
    for isa in Isa::available() {
        assert_eq!(dot_fn(DType::MXFP4, isa).unwrap()(&w, &a), 192.0);
    }
    // Q1_0: d = 2, bits alternate (+,−,...): Σ ±y with y = 3 is 0 over each pair; make the
    // first q8_0 block all ones instead: 16·1 − 16·1 = 0; set bits all → 128·3·2 = 768.
    let mut w = vec![0xFFu8; Q1_0_BYTES];
    w[..2].copy_from_slice(&0x4000u16.to_le_bytes());
    let mut a = vec![3u8; 4 * Q8_0_BYTES];
    for k in 0..4 {
        a[k * Q8_0_BYTES..k * Q8_0_BYTES + 2].copy_from_slice(&0x3C00u16.to_le_bytes());
    }
    for isa in Isa::available() {
        assert_eq!(dot_fn(DType::Q1_0, isa).unwrap()(&w, &a), 768.0);
    }
    // TQ2_0 with every field 3 (+2) and d = 1 against q8_K quants 1, scale 0.5: 256.
    let mut w = vec![0xFFu8; TQ2_0_BYTES];
    w[64..].copy_from_slice(&0x3C00u16.to_le_bytes());
    let mut a = vec![1u8; Q8_K_BYTES];
    a[..4].copy_from_slice(&0.5f32.to_le_bytes());
    for isa in Isa::available() {
        assert_eq!(dot_fn(DType::TQ2_0, isa).unwrap()(&w, &a), 256.0);
    }
}

#[test]
fn nvfp4_every_scale_byte_matches_portable() {
    let mut rng = Rng(0x5CA1E);
    let nb = 3;
    for byte in 0..=255u8 {
        let mut w = random_weights(&mut rng, DType::NVFP4, nb, false);
        for (i, b) in w.chunks_exact_mut(NVFP4_BYTES).enumerate() {
            b[i % 4] = byte;
            b[(i + 2) % 4] = byte;
        }
        let a = activations(
            &mut rng,
            DType::NVFP4,
            nb * QK_NVFP4,
            Act::RawConsistent,
            false,
        );
        let want = dot_nvfp4(&w, &a);
        // No UE4M3 byte is NaN, so `want` is a number and the check is one of bits.
        assert!(!want.is_nan(), "{byte:#x}: {want}");
        check_every_isa(dot_fn, DType::NVFP4, &w, &a, want, &format!("{byte:#x}"));
    }
}
