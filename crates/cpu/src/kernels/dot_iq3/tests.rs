//! Tests of the iq3 products, and the shared harness the iq1 tests use too.

use super::*;
use crate::quant::codec;
use crate::quant::iq3::IQ3_XXS_BYTES;

/// The super-block counts of the tests (1, 2, 3, 7: odd and even, short and longer).
pub(crate) const COUNTS: [usize; 4] = [1, 2, 3, 7];

/// A small xorshift generator so the tests are reproducible.
pub(crate) struct Rng(pub(crate) u64);

impl Rng {
    pub(crate) fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    pub(crate) fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    pub(crate) fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next() as u8).collect()
    }
    /// Uniform in [-1, 1).
    pub(crate) fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
    /// A finite f16 bit pattern: mostly moderate normals, sometimes subnormal, zero or large.
    pub(crate) fn f16_bits(&mut self) -> u16 {
        let sign = (self.below(2) as u16) << 15;
        let mant = self.below(0x400) as u16;
        match self.below(10) {
            0 => sign | mant,
            1 => sign,
            2 => sign | ((24 + self.below(7) as u16) << 10) | mant,
            _ => sign | ((5 + self.below(13) as u16) << 10) | mant,
        }
    }
    /// A finite f32 scale of moderate size with a random sign (as a q8_K `d`).
    fn f32_scale(&mut self) -> f32 {
        let e = self.below(30) as i32 - 20;
        self.unit() * 2f32.powi(e)
    }
}

/// Where a weight type keeps its f16 super-block scale.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Scale {
    /// The f16 at byte 0.
    At0,
    /// iq1_m: nibble `k` of the f16 in the top nibble of the u16 word at `48 + 2k`.
    Iq1m,
}

/// Stores the f16 `bits` as the scale of the super-block `b`.
pub(crate) fn set_scale(b: &mut [u8], scale: Scale, bits: u16) {
    match scale {
        Scale::At0 => b[..2].copy_from_slice(&bits.to_le_bytes()),
        Scale::Iq1m => {
            for k in 0..4 {
                let at = 49 + 2 * k;
                b[at] = (b[at] & 0x0F) | ((((bits >> (4 * k)) & 0xF) as u8) << 4);
            }
        }
    }
}

/// `nb` random weight super-blocks: every byte random, then finite f16 scales.
pub(crate) fn random_weights(rng: &mut Rng, size: usize, scale: Scale, nb: usize) -> Vec<u8> {
    let mut w = rng.bytes(nb * size);
    for b in w.chunks_exact_mut(size) {
        let bits = rng.f16_bits();
        set_scale(b, scale, bits);
    }
    w
}

/// How a q8_K activation row is made.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Act {
    /// By the quantizer from random f32 values.
    Quantized,
    /// Random quants (−128 included), a random finite scale, bsums recomputed.
    RawConsistent,
    /// Random quants, scale and bsums (bsums unrelated to the quants).
    RawInconsistent,
    /// Every quant −128, bsums consistent (−2048).
    AllMin,
}

/// A q8_K row of `nb` super-blocks of the given kind.
pub(crate) fn activations(rng: &mut Rng, kind: Act, nb: usize) -> Vec<u8> {
    match kind {
        Act::Quantized => {
            let x: Vec<f32> = (0..nb * QK_K).map(|_| rng.unit() * 3.0).collect();
            let mut out = vec![0u8; nb * Q8_K_BYTES];
            (codec(DType::Q8_K).unwrap().from_f32.unwrap())(&x, &mut out);
            out
        }
        Act::RawConsistent | Act::RawInconsistent | Act::AllMin => {
            let mut out = rng.bytes(nb * Q8_K_BYTES);
            for b in out.chunks_exact_mut(Q8_K_BYTES) {
                let d = rng.f32_scale();
                b[..4].copy_from_slice(&d.to_le_bytes());
                if matches!(kind, Act::AllMin) {
                    b[4..260].fill(0x80);
                }
                if !matches!(kind, Act::RawInconsistent) {
                    for g in 0..16 {
                        let s: i32 = b[4 + 16 * g..20 + 16 * g]
                            .iter()
                            .map(|&q| i32::from(q as i8))
                            .sum();
                        b[260 + 2 * g..262 + 2 * g].copy_from_slice(&(s as i16).to_le_bytes());
                    }
                }
            }
            out
        }
    }
}

/// A weight type under test: its dtype, bytes per super-block, scale field, and the exact
/// magnitude `|x_v|` (f64) of every value of a super-block.
pub(crate) type Case = (DType, usize, Scale, fn(&[u8]) -> Vec<f64>);

/// Checks that `dot` covers exactly the types of `cases`, in every available family.
pub(crate) fn check_coverage(cases: &[Case], dot: fn(DType, Isa) -> Option<DotFn>) {
    for dt in DType::ALL {
        let mine = cases.iter().any(|c| c.0 == dt);
        assert_eq!(dot(dt, Isa::Portable).is_some(), mine, "{dt}");
        for isa in Isa::available() {
            assert_eq!(dot(dt, isa).is_some(), mine, "{dt} {isa:?}");
        }
        if mine {
            assert_eq!(
                crate::kernels::block_dot::vec_dot_type(dt),
                Some(DType::Q8_K)
            );
            assert!(crate::kernels::block_dot::dot_fn_with(dt, Isa::Portable).is_some());
        }
    }
}

/// Every family gives the portable bits on random rows against every kind of activations,
/// with extreme weight fills and unaligned rows.
pub(crate) fn check_isas_match(cases: &[Case], dot: fn(DType, Isa) -> Option<DotFn>) {
    let mut rng = Rng(0x0123_4567_89AB_CDEF);
    let kinds = [
        Act::Quantized,
        Act::RawConsistent,
        Act::RawInconsistent,
        Act::AllMin,
    ];
    for &(dtype, size, scale, _) in cases {
        let portable = dot(dtype, Isa::Portable).unwrap();
        let mut rows: Vec<Vec<u8>> = Vec::new();
        for nb in COUNTS {
            for _ in 0..6 {
                rows.push(random_weights(&mut rng, size, scale, nb));
            }
        }
        for fill in [0x00u8, 0xFF, 0x80, 0x7F, 0x55] {
            for d16 in [0x7BFFu16, 0xFBFF, 0x0001, 0x3C00] {
                let mut w = vec![fill; 3 * size];
                for b in w.chunks_exact_mut(size) {
                    set_scale(b, scale, d16);
                }
                rows.push(w);
            }
        }
        for w in rows {
            let nb = w.len() / size;
            for kind in kinds {
                let a = activations(&mut rng, kind, nb);
                let want = portable(&w, &a);
                for isa in Isa::available() {
                    let f = dot(dtype, isa).unwrap();
                    let got = f(&w, &a);
                    assert!(
                        got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()),
                        "{dtype} {isa:?} {nb} super-blocks, {kind:?}: {got} vs {want}"
                    );
                    let mut wb = vec![0u8; 1 + w.len()];
                    wb[1..].copy_from_slice(&w);
                    let mut ab = vec![0u8; 3 + a.len()];
                    ab[3..].copy_from_slice(&a);
                    let got = f(&wb[1..], &ab[3..]);
                    assert!(got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()));
                }
            }
        }
    }
}

/// Random bytes everywhere (NaN and infinite scales included) neither panic nor disagree
/// beyond NaN payloads; rows of different lengths use the shorter row's whole super-blocks.
pub(crate) fn check_hostile_and_lengths(cases: &[Case], dot: fn(DType, Isa) -> Option<DotFn>) {
    let mut rng = Rng(99);
    for &(dtype, size, scale, _) in cases {
        for _ in 0..64 {
            let nb = 1 + rng.below(4) as usize;
            let w = rng.bytes(nb * size);
            let a = rng.bytes(nb * Q8_K_BYTES);
            let want = dot(dtype, Isa::Portable).unwrap()(&w, &a);
            for isa in Isa::available() {
                let got = dot(dtype, isa).unwrap()(&w, &a);
                assert!(got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()));
            }
        }
        let w = random_weights(&mut rng, size, scale, 3);
        let a = activations(&mut rng, Act::Quantized, 3);
        for isa in Isa::available() {
            let f = dot(dtype, isa).unwrap();
            assert_eq!(f(&[], &[]), 0.0);
            let two = f(&w[..2 * size], &a[..2 * Q8_K_BYTES]);
            assert_eq!(f(&w[..2 * size], &a).to_bits(), two.to_bits());
            assert_eq!(f(&w, &a[..2 * Q8_K_BYTES + 5]).to_bits(), two.to_bits());
            assert_eq!(f(&w[..3 * size - 1], &a).to_bits(), two.to_bits());
        }
    }
}

/// The portable product is the f64 dot product of the dequantized rows within
/// `(4·nb + 16)·2⁻²⁴·S + 10⁻³⁰` (consistent bsums), `S = Σ |x_v|·|dy·y_v|`.
pub(crate) fn check_f64_bound(cases: &[Case], dot: fn(DType, Isa) -> Option<DotFn>) {
    let mut rng = Rng(0xDEAD_BEEF);
    let q8_to_f32 = codec(DType::Q8_K).unwrap().to_f32;
    for &(dtype, size, scale, magnitudes) in cases {
        let to_f32 = codec(dtype).unwrap().to_f32;
        for nb in COUNTS {
            for kind in [Act::Quantized, Act::RawConsistent, Act::AllMin] {
                for _ in 0..4 {
                    let w = random_weights(&mut rng, size, scale, nb);
                    let a = activations(&mut rng, kind, nb);
                    let mut xv = vec![0f32; nb * QK_K];
                    let mut yv = vec![0f32; nb * QK_K];
                    to_f32(&w, &mut xv);
                    q8_to_f32(&a, &mut yv);
                    let exact: f64 = xv
                        .iter()
                        .zip(&yv)
                        .map(|(&p, &q)| f64::from(p) * f64::from(q))
                        .sum();
                    let s: f64 = w
                        .chunks_exact(size)
                        .flat_map(magnitudes)
                        .zip(&yv)
                        .map(|(m, &q)| m * f64::from(q).abs())
                        .sum();
                    let tol = (4 * nb + 16) as f64 * 2f64.powi(-24) * s + 1e-30;
                    let got = f64::from(dot(dtype, Isa::Portable).unwrap()(&w, &a));
                    assert!(
                        (got - exact).abs() <= tol,
                        "{dtype} {nb} {kind:?}: {got} vs {exact} (tolerance {tol})"
                    );
                }
            }
        }
    }
}

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

#[test]
fn dot_fn_covers_exactly_these_types() {
    check_coverage(&CASES, dot_fn);
}

#[test]
fn every_isa_matches_portable_bits() {
    check_isas_match(&CASES, dot_fn);
}

#[test]
fn hostile_bytes_and_lengths() {
    check_hostile_and_lengths(&CASES, dot_fn);
}

#[test]
fn portable_matches_dequantized_f64_dot() {
    check_f64_bound(&CASES, dot_fn);
}

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
