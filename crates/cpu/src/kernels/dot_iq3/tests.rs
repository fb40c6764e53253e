//! Tests of the iq3 products (the harness is [`crate::kernels::dot_test_support`]).

use super::*;
use crate::kernels::dot_test_support::{case_tests, Case, Scale};
use crate::quant::codec;
use crate::quant::iq3::IQ3_XXS_BYTES;

fn mag_iq3_xxs(b: &[u8]) -> Vec<f64> {
    let b: &[u8; IQ3_XXS_BYTES] = b.try_into().unwrap();
    let d = f64::from(f16_at(b, 0)).abs();
    let (q, ls) = iq3_xxs_quants(b);
    (0..QK_K)
        .map(|v| d * f64::from(ls[v / 32]) * f64::from(q[v]).abs() / 4.0)
        .collect()
}

fn mag_iq3_s(b: &[u8]) -> Vec<f64> {
    let b: &[u8; IQ3_S_BYTES] = b.try_into().unwrap();
    let d = f64::from(f16_at(b, 0)).abs();
    let (q, ls) = iq3_s_quants(b);
    (0..QK_K)
        .map(|v| d * f64::from(ls[v / 32]) * f64::from(q[v]).abs())
        .collect()
}

const CASES: [Case; 2] = [
    (DType::IQ3_XXS, IQ3_XXS_BYTES, Scale::At0, mag_iq3_xxs),
    (DType::IQ3_S, IQ3_S_BYTES, Scale::At0, mag_iq3_s),
];

case_tests!(CASES, dot_fn);

/// A hand-made super-block: grid point 0 (all 4s) everywhere, scale nibble 1 (ls = 3),
/// sign index 1 (values 0 and 7 of each run negative), d = 1; activations all 1 with
/// d = 1. Each run sums 4·(8 − 4) = 16, so isum = 3·4·16·8 = 1536 and the result
/// 0.25·1536 = 384.
#[test]
fn iq3_xxs_known_value() {
    let mut w = vec![0u8; IQ3_XXS_BYTES];
    w[..2].copy_from_slice(&0x3C00u16.to_le_bytes());
    let word: u32 = (1 << 28) | 1 | (1 << 7) | (1 << 14) | (1 << 21);
    for s in 0..8 {
        w[66 + 4 * s..70 + 4 * s].copy_from_slice(&word.to_le_bytes());
    }
    let mut a = vec![1u8; Q8_K_BYTES];
    a[..4].copy_from_slice(&1f32.to_le_bytes());
    for isa in Isa::available() {
        assert_eq!(
            dot_fn(DType::IQ3_XXS, isa).unwrap()(&w, &a),
            384.0,
            "{isa:?}"
        );
    }
    let mut x = vec![0f32; QK_K];
    (codec(DType::IQ3_XXS).unwrap().to_f32)(&w, &mut x);
    assert_eq!(x.iter().sum::<f32>(), 384.0);
}
