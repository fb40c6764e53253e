//! Test support shared by the block dot-product tests (`dot_k`, `dot_iq2`, `dot_iq3`,
//! `dot_iq1`, and in part `dot_lowbit`): a reproducible RNG, random weight rows with finite
//! f16 scale fields, q8_K and q8_0 activation rows of several kinds, and the checks every family runs (coverage of
//! `dot_fn`, bit equality of every [`Isa`] with the portable definition, hostile bytes and
//! row lengths, the f64 error bound, and MUL_MAT end to end).
//!
//! The generators consume the RNG in a fixed order, so a test that seeds [`Rng`] the same way
//! sees the same rows run after run.

use super::block_dot::{self, DotFn, Isa};
use super::quant_dot::{quantize_row_q8_0, Q8_0_BYTES};
use crate::dtype::DType;
use crate::quant::codec;
use crate::quant::kquants::Q8_K_BYTES;
use crate::quant::QK_K;

pub(crate) use end_to_end::check_mul_mat;

/// A family's `dot_fn`: the product of `dtype` rows in family `isa`.
pub(crate) type DotLookup = fn(DType, Isa) -> Option<DotFn>;

/// A small xorshift64 generator so the tests are reproducible.
pub(crate) struct Rng(pub(crate) u64);

impl Rng {
    /// The next 64 random bits.
    pub(crate) fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    /// Uniform in `0..n` (up to the modulo bias, irrelevant here).
    pub(crate) fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    /// `n` random bytes.
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
    /// A finite normal f16 of moderate size (exponent `−7..=4`) with a random sign.
    pub(crate) fn f16_normal_bits(&mut self) -> u16 {
        let sign = (self.below(2) as u16) << 15;
        sign | ((8 + self.below(12) as u16) << 10) | self.below(0x400) as u16
    }
    /// A finite f32 scale of moderate size with a random sign (as a q8_K `d`).
    pub(crate) fn f32_scale(&mut self) -> f32 {
        let e = self.below(30) as i32 - 20;
        self.unit() * 2f32.powi(e)
    }
}

/// Where a weight type keeps its f16 super-block scale(s).
#[derive(Clone, Copy, Debug)]
pub(crate) enum Scale {
    /// The f16 at byte 0.
    At0,
    /// An f16 at each of these byte offsets (each drawn separately by [`random_weights`]).
    Fields(&'static [usize]),
    /// iq1_m: nibble `k` of the f16 in the top nibble of the u16 word at `48 + 2k`.
    Iq1m,
}

/// Stores the f16 `bits` as the scale of the block `b` (in every field for
/// [`Scale::Fields`]).
pub(crate) fn set_scale(b: &mut [u8], scale: Scale, bits: u16) {
    match scale {
        Scale::At0 => b[..2].copy_from_slice(&bits.to_le_bytes()),
        Scale::Fields(offsets) => {
            for &at in offsets {
                b[at..at + 2].copy_from_slice(&bits.to_le_bytes());
            }
        }
        Scale::Iq1m => {
            for k in 0..4 {
                let at = 49 + 2 * k;
                b[at] = (b[at] & 0x0F) | ((((bits >> (4 * k)) & 0xF) as u8) << 4);
            }
        }
    }
}

/// `nb` random weight blocks of `size` bytes: every byte random, then finite f16 scales
/// ([`Rng::f16_bits`], one draw per field).
pub(crate) fn random_weights(rng: &mut Rng, size: usize, scale: Scale, nb: usize) -> Vec<u8> {
    let mut w = rng.bytes(nb * size);
    for b in w.chunks_exact_mut(size) {
        match scale {
            Scale::Fields(offsets) => {
                for &at in offsets {
                    let bits = rng.f16_bits();
                    b[at..at + 2].copy_from_slice(&bits.to_le_bytes());
                }
            }
            _ => {
                let bits = rng.f16_bits();
                set_scale(b, scale, bits);
            }
        }
    }
    w
}

/// How an activation row (q8_K or q8_0) is made.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Act {
    /// By the quantizer from random f32 values in [-3, 3).
    Quantized,
    /// Random quants (−128 included), a random finite scale, q8_K group sums recomputed.
    RawConsistent,
    /// Random quants and scale; q8_K group sums random (unrelated to the quants).
    RawInconsistent,
    /// Every quant −128 (the byte whose negation wraps), q8_K group sums consistent.
    AllMin,
    /// Every quant +127, q8_K group sums consistent.
    AllMax,
}

/// The four q8_K kinds the K-quant and i-quant tests cover.
pub(crate) const Q8_K_KINDS: [Act; 4] = [
    Act::Quantized,
    Act::RawConsistent,
    Act::RawInconsistent,
    Act::AllMin,
];

/// A q8_K row of `nb` super-blocks of the given kind (raw kinds: random bytes, then per
/// super-block a scale from [`Rng::f32_scale`]).
pub(crate) fn q8_k_row(rng: &mut Rng, kind: Act, nb: usize) -> Vec<u8> {
    if kind == Act::Quantized {
        let x: Vec<f32> = (0..nb * QK_K).map(|_| rng.unit() * 3.0).collect();
        return quantize_q8_k(&x);
    }
    let mut out = rng.bytes(nb * Q8_K_BYTES);
    for b in out.chunks_exact_mut(Q8_K_BYTES) {
        let d = rng.f32_scale();
        b[..4].copy_from_slice(&d.to_le_bytes());
        match kind {
            Act::AllMin => b[4..260].fill(0x80),
            Act::AllMax => b[4..260].fill(0x7F),
            _ => {}
        }
        if kind != Act::RawInconsistent {
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

/// A q8_0 row of `blocks` blocks of the given kind (raw kinds: random bytes, then per block
/// a scale from [`Rng::f16_normal_bits`]; q8_0 has no group sums, so the two raw kinds are
/// alike).
pub(crate) fn q8_0_row(rng: &mut Rng, kind: Act, blocks: usize) -> Vec<u8> {
    if kind == Act::Quantized {
        let x: Vec<f32> = (0..blocks * 32).map(|_| rng.unit() * 3.0).collect();
        let mut out = vec![0u8; blocks * Q8_0_BYTES];
        quantize_row_q8_0(&x, &mut out);
        return out;
    }
    let mut out = rng.bytes(blocks * Q8_0_BYTES);
    for b in out.chunks_exact_mut(Q8_0_BYTES) {
        let bits = rng.f16_normal_bits();
        b[..2].copy_from_slice(&bits.to_le_bytes());
        match kind {
            Act::AllMin => b[2..].fill(0x80),
            Act::AllMax => b[2..].fill(0x7F),
            _ => {}
        }
    }
    out
}

/// The q8_K row of the f32 values `x` (a multiple of 256 of them), by the codec.
pub(crate) fn quantize_q8_k(x: &[f32]) -> Vec<u8> {
    let mut out = vec![0u8; x.len() / QK_K * Q8_K_BYTES];
    (codec(DType::Q8_K).unwrap().from_f32.unwrap())(x, &mut out);
    out
}

/// Whether two results agree: the same bits, or both NaN (payloads may differ).
pub(crate) fn same_bits(got: f32, want: f32) -> bool {
    got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan())
}

/// Checks that every available family gives `want` (bits, or NaN for NaN) on `w · a`, and
/// on copies of both rows at odd addresses; `what` labels a failure.
pub(crate) fn check_every_isa(
    dot: DotLookup,
    dtype: DType,
    w: &[u8],
    a: &[u8],
    want: f32,
    what: &str,
) {
    for isa in Isa::available() {
        let f = dot(dtype, isa).unwrap();
        let got = f(w, a);
        assert!(
            same_bits(got, want),
            "{dtype} {isa:?} {what}: {got} vs {want}"
        );
        let mut wb = vec![0u8; 1 + w.len()];
        wb[1..].copy_from_slice(w);
        let mut ab = vec![0u8; 3 + a.len()];
        ab[3..].copy_from_slice(a);
        let got = f(&wb[1..], &ab[3..]);
        assert!(
            same_bits(got, want),
            "{dtype} {isa:?} {what}, unaligned: {got} vs {want}"
        );
    }
}

/// `Σ x_v·y_v` in f64.
pub(crate) fn f64_dot(x: &[f32], y: &[f32]) -> f64 {
    x.iter()
        .zip(y)
        .map(|(&p, &q)| f64::from(p) * f64::from(q))
        .sum()
}

/// The values of the q8_K row `a`, decoded by the codec.
pub(crate) fn decode_q8_k(a: &[u8]) -> Vec<f32> {
    let mut y = vec![0f32; a.len() / Q8_K_BYTES * QK_K];
    (codec(DType::Q8_K).unwrap().to_f32)(a, &mut y);
    y
}

/// A weight type under test: its dtype, bytes per super-block, scale field, and the exact
/// magnitude `|x_v|` (f64) of every value of a super-block.
pub(crate) type Case = (DType, usize, Scale, fn(&[u8]) -> Vec<f64>);

/// The super-block counts of the [`Case`] checks (1, 2, 3, 7: odd and even, short and
/// longer).
pub(crate) const COUNTS: [usize; 4] = [1, 2, 3, 7];

/// Defines a family's four standard tests over its `cases` ([`Case`]s) and `dot_fn`:
/// coverage, bit equality of every ISA, hostile bytes and lengths, the f64 bound.
macro_rules! case_tests {
    ($cases:expr, $dot:expr) => {
        #[test]
        fn dot_fn_covers_exactly_these_types() {
            $crate::kernels::dot_test_support::check_coverage(&$cases, $dot);
        }

        #[test]
        fn every_isa_matches_portable_bits() {
            $crate::kernels::dot_test_support::check_isas_match(&$cases, $dot);
        }

        #[test]
        fn hostile_bytes_and_lengths() {
            $crate::kernels::dot_test_support::check_hostile_and_lengths(&$cases, $dot);
        }

        #[test]
        fn portable_matches_dequantized_f64_dot() {
            $crate::kernels::dot_test_support::check_f64_bound(&$cases, $dot);
        }
    };
}
pub(crate) use case_tests;

/// Checks that `dot` covers exactly the types of `cases`, in every available family, and
/// that they are q8_K products reachable through [`block_dot::dot_fn_with`].
pub(crate) fn check_coverage(cases: &[Case], dot: DotLookup) {
    for dt in DType::ALL {
        let mine = cases.iter().any(|c| c.0 == dt);
        assert_eq!(dot(dt, Isa::Portable).is_some(), mine, "{dt}");
        for isa in Isa::available() {
            assert_eq!(dot(dt, isa).is_some(), mine, "{dt} {isa:?}");
        }
        if mine {
            assert_eq!(block_dot::vec_dot_type(dt), Some(DType::Q8_K));
            assert!(block_dot::dot_fn_with(dt, Isa::Portable).is_some());
        }
    }
}

/// Every family gives the portable bits on random rows against every kind of activations,
/// with extreme weight fills and unaligned rows.
pub(crate) fn check_isas_match(cases: &[Case], dot: DotLookup) {
    let mut rng = Rng(0x0123_4567_89AB_CDEF);
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
            for kind in Q8_K_KINDS {
                let a = q8_k_row(&mut rng, kind, nb);
                let want = portable(&w, &a);
                check_every_isa(
                    dot,
                    dtype,
                    &w,
                    &a,
                    want,
                    &format!("{nb} super-blocks, {kind:?}"),
                );
            }
        }
    }
}

/// `reps` rows of 1 to 4 super-blocks of random bytes on both sides (NaN and infinite scales
/// included) neither panic nor disagree beyond NaN payloads.
pub(crate) fn check_random_bytes(
    rng: &mut Rng,
    dot: DotLookup,
    dtype: DType,
    size: usize,
    reps: usize,
) {
    for _ in 0..reps {
        let nb = 1 + rng.below(4) as usize;
        let w = rng.bytes(nb * size);
        let a = rng.bytes(nb * Q8_K_BYTES);
        let want = dot(dtype, Isa::Portable).unwrap()(&w, &a);
        for isa in Isa::available() {
            let got = dot(dtype, isa).unwrap()(&w, &a);
            assert!(same_bits(got, want), "{dtype} {isa:?}: {got} vs {want}");
        }
    }
}

/// Rows of different lengths use the shorter row's whole super-blocks (`w` and `a` hold 3
/// super-blocks each); empty rows give +0.
pub(crate) fn check_lengths(dot: DotLookup, dtype: DType, size: usize, w: &[u8], a: &[u8]) {
    for isa in Isa::available() {
        let f = dot(dtype, isa).unwrap();
        assert_eq!(f(&[], &[]).to_bits(), 0f32.to_bits());
        let two = f(&w[..2 * size], &a[..2 * Q8_K_BYTES]);
        assert_eq!(f(&w[..2 * size], a).to_bits(), two.to_bits());
        assert_eq!(f(w, &a[..2 * Q8_K_BYTES + 5]).to_bits(), two.to_bits());
        assert_eq!(f(&w[..3 * size - 1], a).to_bits(), two.to_bits());
    }
}

/// Random bytes everywhere (NaN and infinite scales included) neither panic nor disagree
/// beyond NaN payloads; rows of different lengths use the shorter row's whole super-blocks.
pub(crate) fn check_hostile_and_lengths(cases: &[Case], dot: DotLookup) {
    let mut rng = Rng(99);
    for &(dtype, size, scale, _) in cases {
        check_random_bytes(&mut rng, dot, dtype, size, 64);
        let w = random_weights(&mut rng, size, scale, 3);
        let a = q8_k_row(&mut rng, Act::Quantized, 3);
        check_lengths(dot, dtype, size, &w, &a);
    }
}

/// Asserts `|got − exact| ≤ tol`; `what` labels a failure.
pub(crate) fn assert_within(got: f64, exact: f64, tol: f64, what: &str) {
    assert!(
        (got - exact).abs() <= tol,
        "{what}: {got} vs {exact} (tolerance {tol})"
    );
}

/// The portable product is the f64 dot product of the dequantized rows within
/// `(4·nb + 16)·2⁻²⁴·S + 10⁻³⁰` (consistent bsums), `S = Σ |x_v|·|dy·y_v|`.
pub(crate) fn check_f64_bound(cases: &[Case], dot: DotLookup) {
    let mut rng = Rng(0xDEAD_BEEF);
    for &(dtype, size, scale, magnitudes) in cases {
        let to_f32 = codec(dtype).unwrap().to_f32;
        for nb in COUNTS {
            for kind in [Act::Quantized, Act::RawConsistent, Act::AllMin] {
                for _ in 0..4 {
                    let w = random_weights(&mut rng, size, scale, nb);
                    let a = q8_k_row(&mut rng, kind, nb);
                    let mut xv = vec![0f32; nb * QK_K];
                    to_f32(&w, &mut xv);
                    let yv = decode_q8_k(&a);
                    let s: f64 = w
                        .chunks_exact(size)
                        .flat_map(magnitudes)
                        .zip(&yv)
                        .map(|(m, &q)| m * f64::from(q).abs())
                        .sum();
                    let tol = (4 * nb + 16) as f64 * 2f64.powi(-24) * s + 1e-30;
                    let got = f64::from(dot(dtype, Isa::Portable).unwrap()(&w, &a));
                    let what = format!("{dtype} {nb} {kind:?}");
                    assert_within(got, f64_dot(&xv, &yv), tol, &what);
                }
            }
        }
    }
}

/// The generators make what their kinds promise (and consume the RNG reproducibly).
#[test]
fn generators_make_their_kinds() {
    for kind in [
        Act::Quantized,
        Act::RawConsistent,
        Act::RawInconsistent,
        Act::AllMin,
        Act::AllMax,
    ] {
        let k = q8_k_row(&mut Rng(3), kind, 2);
        assert_eq!(k, q8_k_row(&mut Rng(3), kind, 2));
        assert_eq!(k.len(), 2 * Q8_K_BYTES);
        let q = q8_0_row(&mut Rng(3), kind, 5);
        assert_eq!(q.len(), 5 * Q8_0_BYTES);
        for (b, c) in k.chunks_exact(Q8_K_BYTES).zip(q.chunks_exact(Q8_0_BYTES)) {
            assert!(f32::from_le_bytes(b[..4].try_into().unwrap()).is_finite());
            assert!(half::f16::from_le_bytes([c[0], c[1]]).is_finite());
            let fill = match kind {
                Act::AllMin => Some(0x80),
                Act::AllMax => Some(0x7F),
                _ => None,
            };
            if let Some(f) = fill {
                assert!(b[4..260].iter().chain(&c[2..]).all(|&v| v == f));
            }
            if kind != Act::RawInconsistent {
                for g in 0..16 {
                    let s: i32 = b[4 + 16 * g..20 + 16 * g]
                        .iter()
                        .map(|&v| i32::from(v as i8))
                        .sum();
                    assert_eq!(
                        i16::from_le_bytes([b[260 + 2 * g], b[261 + 2 * g]]),
                        s as i16
                    );
                }
            }
        }
    }
    let w = random_weights(&mut Rng(4), 84, Scale::Fields(&[80, 82]), 3);
    for b in w.chunks_exact(84) {
        for at in [80, 82] {
            assert!(half::f16::from_le_bytes([b[at], b[at + 1]]).is_finite());
        }
    }
}

/// The end-to-end check, which runs the CPU backend (a higher layer than the kernels: as
/// test code it sits in the trailing `#[cfg(test)]` module that `tests/layers.rs` skips).
#[cfg(test)]
pub(crate) mod end_to_end {
    use super::{quantize_q8_k, random_weights, DotLookup, Rng, Scale};
    use crate::dtype::DType;
    use crate::kernels::block_dot::Isa;
    use crate::quant::QK_K;

    /// End to end: MUL_MAT of `dtype` weights (`size` bytes per super-block, scales as `scale`)
    /// with one or two f32 activation columns on the CPU backend (which quantizes the
    /// activations to q8_K and calls the block products) gives, for every output, the bits of
    /// `dot`'s fastest product of the weight row with the q8_K-quantized column.
    pub(crate) fn check_mul_mat(
        rng: &mut Rng,
        dot: DotLookup,
        dtype: DType,
        size: usize,
        scale: Scale,
    ) {
        use crate::backend::CpuBackend;
        use ferrograph_base::alloc::GraphAllocator;
        use ferrograph_base::backend::Backend;
        use ferrograph_base::buffer::CpuBufferType;
        use ferrograph_base::context::Context;
        use ferrograph_base::graph::Graph;
        use ferrograph_base::ops;
        let (k, m, n) = (512usize, 5usize, 2usize);
        let w_bytes = random_weights(rng, size, scale, m * k / QK_K);
        let x: Vec<f32> = (0..k * n).map(|_| rng.unit()).collect();
        let ctx = Context::new(true);
        let w = ctx.new_tensor(dtype, &[k, m]).unwrap();
        let xt = ctx.new_tensor(DType::F32, &[k, n]).unwrap();
        let y = ops::mul_mat(&ctx, &w, &xt).unwrap();
        let graph = Graph::build(std::slice::from_ref(&y));
        GraphAllocator::new(CpuBufferType::shared())
            .alloc_graph(&graph)
            .unwrap();
        w.write_bytes(0, &w_bytes).unwrap();
        xt.set_f32(&x).unwrap();
        CpuBackend::new(2).unwrap().graph_compute(&graph).unwrap();
        let out = y.to_f32_vec().unwrap();
        let dot = dot(dtype, Isa::best()).unwrap();
        for j in 0..n {
            let q8 = quantize_q8_k(&x[j * k..(j + 1) * k]);
            for i in 0..m {
                let row = &w_bytes[i * (k / QK_K) * size..(i + 1) * (k / QK_K) * size];
                let want = dot(row, &q8);
                assert_eq!(
                    out[j * m + i].to_bits(),
                    want.to_bits(),
                    "{dtype} ({i}, {j})"
                );
            }
        }
    }
}
