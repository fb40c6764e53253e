use super::*;
use crate::kernels::dot_test_support::{case_tests, Case, Scale};
use crate::quant::codec;
use crate::quant::iq1::IQ1_DELTA;
use crate::quant::QK_K;

/// `|dx·ls·(g + σ/8)|` per value of an iq1_s super-block.
fn mag_iq1_s(b: &[u8]) -> Vec<f64> {
    let b: &[u8; IQ1_S_BYTES] = b.try_into().unwrap();
    let d = f64::from(f16_at(b, 0)).abs();
    let (g, ls, neg) = iq1_s_parts(b);
    (0..QK_K)
        .map(|v| {
            let delta = if neg[v / 32] { -IQ1_DELTA } else { IQ1_DELTA };
            d * f64::from(ls[v / 32]) * (f64::from(g[v]) + f64::from(delta)).abs()
        })
        .collect()
}

/// `|dx·ls·(g + σ/8)|` per value of an iq1_m super-block.
fn mag_iq1_m(b: &[u8]) -> Vec<f64> {
    let b: &[u8; IQ1_M_BYTES] = b.try_into().unwrap();
    let d = f64::from(iq1_m_scale(b).to_f32()).abs();
    let (g, ls, neg) = iq1_m_parts(b);
    (0..QK_K)
        .map(|v| {
            let delta = if neg[v / 8] { -IQ1_DELTA } else { IQ1_DELTA };
            d * f64::from(ls[v / 16]) * (f64::from(g[v]) + f64::from(delta)).abs()
        })
        .collect()
}

const CASES: [Case; 2] = [
    (DType::IQ1_S, IQ1_S_BYTES, Scale::At0, mag_iq1_s),
    (DType::IQ1_M, IQ1_M_BYTES, Scale::Iq1m, mag_iq1_m),
];

case_tests!(CASES, dot_fn);

/// iq1_s reads the shift term from the stored bsums, not from the quants: changing only the
/// bsums changes the product by exactly `dx·dy·ls·σ·Δbsum/8`.
#[test]
fn iq1_s_uses_stored_bsums() {
    // An all-zero block (grid point 0 = all −1, ls = 1,
    // positive shift, d = 1; activations all zero with d = 1 and bsum_0 = 8.
    let mut w = vec![0u8; IQ1_S_BYTES];
    w[..2].copy_from_slice(&0x3C00u16.to_le_bytes());
    let mut a = vec![0u8; Q8_K_BYTES];
    a[..4].copy_from_slice(&1f32.to_le_bytes());
    a[260..262].copy_from_slice(&8i16.to_le_bytes());
    for isa in Isa::available() {
        // msum = 1·(+1)·8 → t = 8/8 = 1.
        assert_eq!(dot_fn(DType::IQ1_S, isa).unwrap()(&w, &a), 1.0, "{isa:?}");
    }
    // A negative shift in sub-block 0 flips it.
    w[35] = 0x80;
    for isa in Isa::available() {
        assert_eq!(dot_fn(DType::IQ1_S, isa).unwrap()(&w, &a), -1.0, "{isa:?}");
    }
}

/// iq1_m: the shift sums come from the quants per run of 8; the f16 scale from the nibbles.
#[test]
fn iq1_m_known_value() {
    // All-zero bytes: grid point 0 (all −1), ls = 1, positive shifts, then d = 2.0 (0x4000:
    // nibble 4 in the top of word 3). Activations: value 0 is 8, the rest 0, d = 1:
    // isum = −8, msum = 8, t = (−64 + 8)/8 = −7, result 2·(−7) = −14 = 2·(−1 + 1/8)·8.
    let mut w = vec![0u8; IQ1_M_BYTES];
    w[55] = 0x40;
    let mut a = vec![0u8; Q8_K_BYTES];
    a[..4].copy_from_slice(&1f32.to_le_bytes());
    a[4] = 8;
    for isa in Isa::available() {
        assert_eq!(dot_fn(DType::IQ1_M, isa).unwrap()(&w, &a), -14.0, "{isa:?}");
    }
    let mut x = vec![0f32; QK_K];
    (codec(DType::IQ1_M).unwrap().to_f32)(&w, &mut x);
    assert_eq!(x[0] * 8.0, -14.0);
}
