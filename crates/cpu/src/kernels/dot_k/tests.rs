use super::*;
use crate::kernels::dot_test_support::{
    assert_within, check_every_isa, check_lengths, check_mul_mat, check_random_bytes, decode_q8_k,
    f64_dot, q8_k_row, quantize_q8_k, random_weights, set_scale, Act, Rng, Scale, Q8_K_KINDS,
};
use crate::quant::codec;

/// The weight types of this module with their bytes per super-block and the byte offsets
/// of their f16 scale fields.
const TYPES: [(DType, usize, Scale); 6] = [
    (DType::Q2_K, Q2_K_BYTES, Scale::Fields(&[80, 82])),
    (DType::Q3_K, Q3_K_BYTES, Scale::Fields(&[108])),
    (DType::Q4_K, Q4_K_BYTES, Scale::Fields(&[0, 2])),
    (DType::Q5_K, Q5_K_BYTES, Scale::Fields(&[0, 2])),
    (DType::Q6_K, Q6_K_BYTES, Scale::Fields(&[208])),
    (DType::IQ4_XS, IQ4_XS_BYTES, Scale::Fields(&[0])),
];

/// The super-block counts of the tests (1, 2, 3, 7, 17: odd and even, short and longer).
const COUNTS: [usize; 5] = [1, 2, 3, 7, 17];

#[test]
fn dot_fn_covers_exactly_these_types() {
    for dt in DType::ALL {
        let mine = TYPES.iter().any(|&(t, _, _)| t == dt);
        for isa in Isa::available() {
            assert_eq!(dot_fn(dt, isa).is_some(), mine, "{dt} {isa:?}");
        }
        // Every type with an activation partner has a product, and no other type has one.
        assert_eq!(
            super::super::block_dot::dot_fn_with(dt, Isa::Portable).is_some(),
            super::super::block_dot::vec_dot_type(dt).is_some(),
            "{dt}"
        );
    }
}

/// Every family gives the portable bits on random rows (every byte random, finite scales)
/// against every kind of activation row.
#[test]
fn every_isa_matches_portable_bits() {
    let mut rng = Rng(0x0123_4567_89AB_CDEF);
    for (dtype, size, scale) in TYPES {
        let portable = dot_fn(dtype, Isa::Portable).unwrap();
        for nb in COUNTS {
            for kind in Q8_K_KINDS {
                for _ in 0..4 {
                    let w = random_weights(&mut rng, size, scale, nb);
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

/// The several-column products give every column the portable single-row bits (random
/// rows, every activation kind, columns of different kinds side by side), including NaN and
/// infinite results from non-finite scales.
#[test]
fn column_products_match_single_row_bits() {
    let mut rng = Rng(0x5EED_C015);
    for (dtype, size, scale) in TYPES {
        let portable = dot_fn(dtype, Isa::Portable).unwrap();
        let (Some(two), Some(four)) = (dot_cols_fn::<2>(dtype), dot_cols_fn::<4>(dtype)) else {
            continue;
        };
        for nb in COUNTS {
            for round in 0..6 {
                let mut w = random_weights(&mut rng, size, scale, nb);
                if round == 5 {
                    // a non-finite scale in the last super-block
                    w[(nb - 1) * size..][..2].copy_from_slice(&0x7C00u16.to_le_bytes());
                }
                let ys: [Vec<u8>; 4] = std::array::from_fn(|c| {
                    q8_k_row(&mut rng, Q8_K_KINDS[c % Q8_K_KINDS.len()], nb)
                });
                let want: Vec<u32> = ys.iter().map(|y| portable(&w, y).to_bits()).collect();
                let got4 = four(&w, ys.each_ref().map(|y| &y[..]));
                let got2 = two(&w, [&ys[0][..], &ys[1][..]]);
                for c in 0..4 {
                    assert_eq!(
                        got4[c].to_bits(),
                        want[c],
                        "{dtype} nb {nb} column {c} of 4"
                    );
                }
                for c in 0..2 {
                    assert_eq!(
                        got2[c].to_bits(),
                        want[c],
                        "{dtype} nb {nb} column {c} of 2"
                    );
                }
            }
        }
    }
}

/// Extreme weight bytes (all bits set / clear, with the largest f16 scales) against
/// extreme activations, and unaligned rows.
#[test]
fn extremes_and_alignment() {
    let mut rng = Rng(77);
    for (dtype, size, scale) in TYPES {
        for fill in [0x00u8, 0xFF, 0x80, 0x7F, 0x55] {
            for d16 in [0x7BFFu16, 0xFBFF, 0x0001, 0x3C00] {
                let nb = 3;
                let mut w = vec![fill; nb * size];
                for b in w.chunks_exact_mut(size) {
                    set_scale(b, scale, d16);
                }
                for kind in [Act::AllMin, Act::RawInconsistent, Act::Quantized] {
                    let a = q8_k_row(&mut rng, kind, nb);
                    let want = dot_fn(dtype, Isa::Portable).unwrap()(&w, &a);
                    let what = format!("fill {fill:#x} d {d16:#x} {kind:?}");
                    check_every_isa(dot_fn, dtype, &w, &a, want, &what);
                }
            }
        }
    }
}

/// Non-finite scales (possible in hostile bytes) neither panic nor disagree beyond NaN
/// payloads.
#[test]
fn non_finite_scales() {
    let mut rng = Rng(99);
    for (dtype, size, _) in TYPES {
        check_random_bytes(&mut rng, dot_fn, dtype, size, 32);
    }
}

/// Rows of different lengths use the shorter row's whole super-blocks; empty rows give 0.
#[test]
fn lengths() {
    let mut rng = Rng(5);
    for (dtype, size, scale) in TYPES {
        let w = random_weights(&mut rng, size, scale, 3);
        let a = q8_k_row(&mut rng, Act::Quantized, 3);
        check_lengths(dot_fn, dtype, size, &w, &a);
    }
}

/// The portable product is the f64 dot product of the dequantized rows, within the f32
/// rounding bound of the module docs (consistent bsums).
#[test]
fn portable_matches_dequantized_f64_dot() {
    let mut rng = Rng(0xDEAD_BEEF);
    for (dtype, size, scale) in TYPES {
        let to_f32 = codec(dtype).unwrap().to_f32;
        for nb in COUNTS {
            for kind in [Act::Quantized, Act::RawConsistent, Act::AllMin] {
                let w = random_weights(&mut rng, size, scale, nb);
                let a = q8_k_row(&mut rng, kind, nb);
                let mut xv = vec![0f32; nb * QK_K];
                to_f32(&w, &mut xv);
                let yv = decode_q8_k(&a);
                // S bounds every product and both terms of each super-block's step.
                let s: f64 = magnitudes(dtype, &w)
                    .iter()
                    .zip(&yv)
                    .map(|(&m, &q)| m * f64::from(q).abs())
                    .sum();
                let tol = (4 * nb + 16) as f64 * 2f64.powi(-24) * s + 1e-30;
                let got = f64::from(dot_fn(dtype, Isa::Portable).unwrap()(&w, &a));
                assert_within(
                    got,
                    f64_dot(&xv, &yv),
                    tol,
                    &format!("{dtype} {nb} {kind:?}"),
                );
            }
        }
    }
}

/// Per value, `|d·sc·q| + |dmin·m|` in f64 (the size of both terms of its decoding).
fn magnitudes(dtype: DType, w: &[u8]) -> Vec<f64> {
    use crate::quant::kquants::f16_at as h;
    let size = dtype.type_size();
    let mut out = Vec::new();
    for b in w.chunks_exact(size) {
        let vals: Vec<f64> = match dtype {
            DType::Q2_K => {
                let q = unpack_2bit(&b[16..80]);
                (0..QK_K)
                    .map(|v| {
                        let s = b[v / 16];
                        (f64::from(h(b, 80)) * f64::from(s & 15) * f64::from(q[v])).abs()
                            + (f64::from(h(b, 82)) * f64::from(s >> 4)).abs()
                    })
                    .collect()
            }
            DType::Q3_K => {
                let q = q3_k_quants(&b[0..32], &b[32..96]);
                let sc = q3_k_scales(&b[96..108]);
                (0..QK_K)
                    .map(|v| (f64::from(h(b, 108)) * f64::from(sc[v / 16]) * f64::from(q[v])).abs())
                    .collect()
            }
            DType::Q4_K | DType::Q5_K => {
                let q = if dtype == DType::Q4_K {
                    unpack_4bit(&b[16..144])
                } else {
                    q5_k_quants(&b[16..48], &b[48..176])
                };
                let (sc, m) = k4_scales_mins(&b[4..16]);
                (0..QK_K)
                    .map(|v| {
                        (f64::from(h(b, 0)) * f64::from(sc[v / 32]) * f64::from(q[v])).abs()
                            + (f64::from(h(b, 2)) * f64::from(m[v / 32])).abs()
                    })
                    .collect()
            }
            DType::Q6_K => {
                let q = q6_k_quants(&b[0..128], &b[128..192]);
                (0..QK_K)
                    .map(|v| {
                        let sc = f64::from(b[192 + v / 16] as i8);
                        (f64::from(h(b, 208)) * sc * f64::from(q[v])).abs()
                    })
                    .collect()
            }
            DType::IQ4_XS => {
                let q = iq4_xs_quants(&b[8..136]);
                let sc = iq4_xs_scales(u16::from_le_bytes([b[2], b[3]]), &b[4..8]);
                (0..QK_K)
                    .map(|v| (f64::from(h(b, 0)) * f64::from(sc[v / 32]) * f64::from(q[v])).abs())
                    .collect()
            }
            _ => unreachable!(),
        };
        out.extend(vals);
    }
    out
}

/// Quantized rows: the K-quant · q8_K product tracks the f32 dot product of the original
/// rows (ggml's `test-quantize-fns` allows 0.02 on its synthetic rows; 2-bit 0.04).
#[test]
fn quantized_rows_track_f32_dot() {
    let n = 4096;
    let x: Vec<f32> = (0..n).map(|i| 0.1 + 2.0 * (i as f32).cos()).collect();
    let yv: Vec<f32> = (0..n).map(|i| 0.1 + 2.0 * (i as f32 + 1.0).cos()).collect();
    let a = quantize_q8_k(&yv);
    let exact = f64_dot(&x, &yv);
    for (dtype, size, _) in TYPES {
        let mut w = vec![0u8; n / QK_K * size];
        (codec(dtype).unwrap().from_f32.unwrap())(&x, &mut w);
        let limit = if dtype == DType::Q2_K { 0.04 } else { 0.02 };
        for isa in Isa::available() {
            let got = f64::from(dot_fn(dtype, isa).unwrap()(&w, &a));
            // ggml's measure: |a − b| / n.
            let err = (got - exact).abs() / n as f64;
            assert!(err < limit, "{dtype} {isa:?}: {got} vs {exact} ({err})");
        }
    }
}

/// Single-thread throughput on a 4096 × 14336 weight (rows streamed one after another)
/// against a plain streaming read of the same bytes, in GB/s of weight bytes, best of five
/// passes. Times are the thread's CPU time (so other processes on a shared machine do not
/// count) and wall time. Run with
/// `cargo test --release --lib kernels::dot_k::tests::bench -- --ignored --nocapture`.
#[test]
#[ignore]
fn bench_mat_vec_bandwidth() {
    let (rows, k) = (4096usize, 14336usize);
    let nb = k / QK_K;
    let mut rng = Rng(1234);
    let act = q8_k_row(&mut rng, Act::Quantized, nb);
    for (dtype, size, scale) in TYPES {
        let row_bytes = nb * size;
        let w = random_weights(&mut rng, size, scale, rows * nb);
        let gb = w.len() as f64 / 1e9;
        let rate = |(cpu, wall): (f64, f64)| format!("{:5.1} ({:4.1})", gb / cpu, gb / wall);
        let mut line = format!(
            "{:6} {:5.1} MB  stream {}",
            dtype.name(),
            gb * 1e3,
            rate(best_time(&|| stream_read(&w)))
        );
        for isa in Isa::available() {
            let dot = dot_fn(dtype, isa).unwrap();
            let t = best_time(&|| {
                w.chunks_exact(row_bytes)
                    .map(|row| dot(row, &act))
                    .fold(0f32, |s, v| s + v)
            });
            line += &format!("  {isa:?} {}", rate(t));
        }
        // The kernels' own speed: the first 32 rows (at most 242 KB, inside L2) 128 times.
        let hot = &w[..32 * row_bytes];
        for isa in Isa::available() {
            let dot = dot_fn(dtype, isa).unwrap();
            let (cpu, _) = best_time(&|| {
                (0..128)
                    .flat_map(|_| hot.chunks_exact(row_bytes))
                    .map(|row| dot(row, &act))
                    .fold(0f32, |s, v| s + v)
            });
            line += &format!(
                "  in-cache {isa:?} {:5.1}",
                128.0 * hot.len() as f64 / 1e9 / cpu
            );
        }
        println!("{line}   GB/s: thread CPU time (wall)");
    }
}

/// The best (thread CPU seconds, wall seconds) of five runs of `f`.
fn best_time(f: &dyn Fn() -> f32) -> (f64, f64) {
    let cpu_now = || {
        let mut ts = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: `ts` is a valid timespec to write; the clock id is a constant libc defines.
        unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
        ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
    };
    let (mut cpu, mut wall) = (f64::INFINITY, f64::INFINITY);
    let mut sink = 0f32;
    for _ in 0..5 {
        let (c, t) = (cpu_now(), std::time::Instant::now());
        sink += f();
        wall = wall.min(t.elapsed().as_secs_f64());
        cpu = cpu.min(cpu_now() - c);
    }
    std::hint::black_box(sink);
    (cpu, wall)
}

/// Reads every byte of `w` once (XOR-folded in 8 independent lanes, which the compiler
/// vectorizes) and returns something that depends on all of them.
fn stream_read(w: &[u8]) -> f32 {
    let mut acc = [0u64; 8];
    let mut chunks = w.chunks_exact(64);
    for c in &mut chunks {
        for (a, word) in acc.iter_mut().zip(c.chunks_exact(8)) {
            *a ^= u64::from_le_bytes(word.try_into().unwrap());
        }
    }
    let x = acc.iter().fold(0u64, |s, &v| s ^ v) ^ chunks.remainder().len() as u64;
    (x & 0xFFFF) as f32
}

/// End to end: MUL_MAT of K-quant weights with one or two f32 activation columns on the CPU
/// backend (which then quantizes the activations to q8_K and calls these products; more
/// columns go through f32 paths) gives, for every output, the bits of this module's product of
/// the weight row with the q8_K-quantized activation column.
#[test]
fn mul_mat_uses_these_products() {
    let mut rng = Rng(2024);
    for (dtype, size, scale) in TYPES {
        check_mul_mat(&mut rng, dot_fn, dtype, size, scale);
    }
}
