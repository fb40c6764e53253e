use super::*;
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

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next() as u8).collect()
    }
    /// Uniform in [-1, 1).
    fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
    /// A finite f16 bit pattern: mostly moderate normals, sometimes subnormal, zero or large.
    fn f16_bits(&mut self) -> u16 {
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

/// `nb` random weight super-blocks: every byte random, then a finite f16 scale.
fn random_weights(rng: &mut Rng, size: usize, nb: usize) -> Vec<u8> {
    let mut w = rng.bytes(nb * size);
    for b in w.chunks_exact_mut(size) {
        b[..2].copy_from_slice(&rng.f16_bits().to_le_bytes());
    }
    w
}

/// How a q8_K activation row is made.
#[derive(Clone, Copy, Debug)]
enum Act {
    /// By the quantizer from random f32 values.
    Quantized,
    /// Random quants (−128 included), a random finite scale, random group sums.
    Raw,
    /// Every quant −128 (the byte whose negation wraps).
    AllMin,
    /// Every quant +127.
    AllMax,
}

const KINDS: [Act; 4] = [Act::Quantized, Act::Raw, Act::AllMin, Act::AllMax];

fn activations(rng: &mut Rng, kind: Act, nb: usize) -> Vec<u8> {
    match kind {
        Act::Quantized => {
            let x: Vec<f32> = (0..nb * QK_K).map(|_| rng.unit() * 3.0).collect();
            let mut out = vec![0u8; nb * Q8_K_BYTES];
            (codec(DType::Q8_K).unwrap().from_f32.unwrap())(&x, &mut out);
            out
        }
        Act::Raw | Act::AllMin | Act::AllMax => {
            let mut out = rng.bytes(nb * Q8_K_BYTES);
            for b in out.chunks_exact_mut(Q8_K_BYTES) {
                b[..4].copy_from_slice(&rng.f32_scale().to_le_bytes());
                match kind {
                    Act::AllMin => b[4..260].fill(0x80),
                    Act::AllMax => b[4..260].fill(0x7F),
                    _ => {}
                }
            }
            out
        }
    }
}

/// Every family this CPU runs.
fn isas() -> Vec<Isa> {
    Isa::available()
}

#[test]
fn dot_fn_covers_exactly_these_types() {
    for dt in DType::ALL {
        let mine = TYPES.iter().any(|&(t, _)| t == dt);
        assert_eq!(dot_fn(dt, Isa::Portable).is_some(), mine, "{dt}");
        for isa in isas() {
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
                    let w = random_weights(&mut rng, size, nb);
                    let a = activations(&mut rng, kind, nb);
                    let want = portable(&w, &a);
                    assert!(want.is_finite(), "{dtype} {kind:?}: {want}");
                    for isa in isas() {
                        let got = dot_fn(dtype, isa).unwrap()(&w, &a);
                        assert_eq!(
                            got.to_bits(),
                            want.to_bits(),
                            "{dtype} {isa:?} {nb} super-blocks, {kind:?}: {got} vs {want}"
                        );
                    }
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
                    b[..2].copy_from_slice(&d16.to_le_bytes());
                }
                for kind in KINDS {
                    let a = activations(&mut rng, kind, nb);
                    let want = dot_fn(dtype, Isa::Portable).unwrap()(&w, &a);
                    for isa in isas() {
                        let dot = dot_fn(dtype, isa).unwrap();
                        let got = dot(&w, &a);
                        assert!(
                            got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()),
                            "{dtype} {isa:?} fill {fill:#x} d {d16:#x} {kind:?}: {got} vs {want}"
                        );
                        let mut wb = vec![0u8; 1 + w.len()];
                        wb[1..].copy_from_slice(&w);
                        let mut ab = vec![0u8; 3 + a.len()];
                        ab[3..].copy_from_slice(&a);
                        let got = dot(&wb[1..], &ab[3..]);
                        assert!(got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()));
                    }
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
        for _ in 0..64 {
            let nb = 1 + rng.below(4) as usize;
            let w = rng.bytes(nb * size);
            let a = rng.bytes(nb * Q8_K_BYTES);
            let want = dot_fn(dtype, Isa::Portable).unwrap()(&w, &a);
            for isa in isas() {
                let got = dot_fn(dtype, isa).unwrap()(&w, &a);
                assert!(got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()));
            }
        }
    }
}

/// Rows of different lengths use the shorter row's whole super-blocks; empty rows give 0.
#[test]
fn lengths() {
    let mut rng = Rng(5);
    for (dtype, size) in TYPES {
        let w = random_weights(&mut rng, size, 3);
        let a = activations(&mut rng, Act::Quantized, 3);
        for isa in isas() {
            let dot = dot_fn(dtype, isa).unwrap();
            assert_eq!(dot(&[], &[]).to_bits(), 0f32.to_bits());
            let two = dot(&w[..2 * size], &a[..2 * Q8_K_BYTES]);
            assert_eq!(dot(&w[..2 * size], &a).to_bits(), two.to_bits());
            assert_eq!(dot(&w, &a[..2 * Q8_K_BYTES + 5]).to_bits(), two.to_bits());
            assert_eq!(dot(&w[..2 * size + 7], &a).to_bits(), two.to_bits());
        }
    }
}

/// The portable product is the f64 dot product of the dequantized rows within the bound of
/// the module docs, `(nb + 6)·2⁻²⁴·S`.
#[test]
fn portable_matches_dequantized_f64_dot() {
    let mut rng = Rng(0xDEAD_BEEF);
    let q8_to_f32 = codec(DType::Q8_K).unwrap().to_f32;
    for (dtype, size) in TYPES {
        let to_f32 = codec(dtype).unwrap().to_f32;
        for nb in COUNTS {
            for kind in KINDS {
                for _ in 0..4 {
                    let w = random_weights(&mut rng, size, nb);
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
                    let s: f64 = xv
                        .iter()
                        .zip(&yv)
                        .map(|(&p, &q)| (f64::from(p) * f64::from(q)).abs())
                        .sum();
                    let tol = (nb + 6) as f64 * 2f64.powi(-24) * s + 1e-30;
                    let got = f64::from(dot_fn(dtype, Isa::Portable).unwrap()(&w, &a));
                    assert!(
                        (got - exact).abs() <= tol,
                        "{dtype} {nb} {kind:?}: {got} vs {exact} (tolerance {tol})"
                    );
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
    for isa in isas() {
        assert_eq!(dot_fn(DType::IQ2_XS, isa).unwrap()(&w, &a), want, "{isa:?}");
    }
    // Sign index 127 (the sign byte 0xFF) on run 0: values 0..8 turn negative, so group 0's
    // sum drops by 2·8·8 (its ls is 1).
    w[2..4].copy_from_slice(&(127u16 << 9).to_le_bytes());
    let want = 0.125 * 0.5 * (isum - 2 * 8 * 8) as f32;
    for isa in isas() {
        assert_eq!(dot_fn(DType::IQ2_XS, isa).unwrap()(&w, &a), want, "{isa:?}");
    }
}

/// End to end: MUL_MAT of iq2 weights with one or two f32 activation columns on the CPU
/// backend (which quantizes the activations to q8_K and calls these products) gives, for
/// every output, the bits of this module's product with the q8_K-quantized column.
#[test]
fn mul_mat_uses_these_products() {
    use crate::backend::CpuBackend;
    use ferrograph_base::alloc::GraphAllocator;
    use ferrograph_base::backend::Backend;
    use ferrograph_base::buffer::CpuBufferType;
    use ferrograph_base::context::Context;
    use ferrograph_base::graph::Graph;
    use ferrograph_base::ops;
    let mut rng = Rng(2024);
    let (k, m, n) = (512usize, 5usize, 2usize);
    for (dtype, size) in TYPES {
        let w_bytes = random_weights(&mut rng, size, m * k / QK_K);
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
        let dot = dot_fn(dtype, Isa::best()).unwrap();
        for j in 0..n {
            let mut q8 = vec![0u8; k / QK_K * Q8_K_BYTES];
            (codec(DType::Q8_K).unwrap().from_f32.unwrap())(&x[j * k..(j + 1) * k], &mut q8);
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
