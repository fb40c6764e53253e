use super::*;
use crate::quant::test_support::{
    check_decodes_to, f32s, read_data, type_sections, Rng, TypeSection,
};

/// The types with a codec here, with their bytes per super-block.
const TYPES: [(DType, usize); 7] = [
    (DType::Q2_K, Q2_K_BYTES),
    (DType::Q3_K, Q3_K_BYTES),
    (DType::Q4_K, Q4_K_BYTES),
    (DType::Q5_K, Q5_K_BYTES),
    (DType::Q6_K, Q6_K_BYTES),
    (DType::Q8_K, Q8_K_BYTES),
    (DType::IQ4_XS, IQ4_XS_BYTES),
];

fn codec_of(dtype: DType) -> BlockCodec {
    codec(dtype).expect("a K-quant codec")
}

fn encode(dtype: DType, x: &[f32]) -> Vec<u8> {
    let mut out = vec![0xA5u8; dtype.row_size(x.len()).unwrap()];
    (codec_of(dtype).from_f32.unwrap())(x, &mut out);
    out
}

fn decode(dtype: DType, bytes: &[u8]) -> Vec<f32> {
    let n = bytes.len() / dtype.type_size() * QK_K;
    let mut out = vec![f32::NAN; n];
    (codec_of(dtype).to_f32)(bytes, &mut out);
    out
}

/// The sections of `tests/data/kquant_blocks.bin` (see `scripts/make_kquant_fixtures.py`).
fn fixture() -> Vec<TypeSection> {
    type_sections("kquant_blocks.bin", b"KQF1")
}

#[test]
fn codec_only_for_k_types() {
    for dt in DType::ALL {
        let mine = TYPES.iter().any(|&(t, _)| t == dt);
        assert_eq!(codec(dt).is_some(), mine, "{dt}");
        if mine {
            assert_eq!(dt.block_size(), QK_K);
        }
    }
    for (dt, size) in TYPES {
        assert_eq!(dt.type_size(), size, "{dt}");
    }
}

/// Every decoded value equals gguf-py's `dequantize` bit for bit, at any alignment.
#[test]
fn decode_matches_gguf_bit_for_bit() {
    let mut seen = 0;
    for (id, n, size, payload) in fixture() {
        if id == 15 {
            continue;
        }
        let dtype = DType::from_ggml_type_id(id).unwrap();
        assert_eq!(dtype.type_size(), size);
        let (bytes, values) = payload.split_at(n * size);
        let want = f32s(values);
        check_decodes_to(dtype, codec_of(dtype).to_f32, bytes, &want);
        seen += 1;
    }
    assert_eq!(seen, 6, "q2_K..q6_K and iq4_xs");
}

/// q8_K bytes equal a numpy restatement of ggml's reference quantizer.
#[test]
fn q8_k_matches_reference_bytes() {
    let (_, n, size, payload) = fixture()
        .into_iter()
        .find(|s| s.0 == 15)
        .expect("q8_K section");
    let (input, want) = payload.split_at(n * QK_K * 4);
    let x = f32s(input);
    let got = encode(DType::Q8_K, &x);
    assert_eq!(got.len(), n * size);
    for b in 0..n {
        assert_eq!(
            got[b * size..(b + 1) * size],
            want[b * size..(b + 1) * size],
            "q8_K super-block {b}"
        );
    }
}

/// Every encoder produces exactly the bytes of ggml's compiled reference quantizers
/// (`quantize_row_*_ref`, fixture `tests/data/kquant_ggml_quantized.bin` made by
/// `scripts/make_kquant_fixtures.py --ggml-lib`): the synthetic row, normal, uniform and
/// spiky rows, an empty super-block with one outlier.
#[test]
fn encoders_match_ggml_reference_bytes() {
    let data = read_data("kquant_ggml_quantized.bin");
    let n = u32::from_le_bytes(data[..4].try_into().unwrap()) as usize;
    let x = f32s(&data[4..4 + 4 * n]);
    let mut at = 4 + 4 * n;
    for (dtype, size) in TYPES {
        let want = &data[at..at + n / QK_K * size];
        at += want.len();
        let got = encode(dtype, &x);
        for (b, (g, w)) in got.chunks(size).zip(want.chunks(size)).enumerate() {
            assert_eq!(g, w, "{dtype} super-block {b}");
        }
    }
    assert_eq!(at, data.len());
}

/// The synthetic row of ggml's `test-quantize-fns`.
fn synthetic(n: usize, offset: f32) -> Vec<f32> {
    (0..n)
        .map(|i| 0.1 + 2.0 * (i as f32 + offset).cos())
        .collect()
}

/// ggml's `array_rmse` of `test-quantize-fns`: `sqrt(Σ(a − b)²) / n` (not the RMS
/// `sqrt(Σ(a − b)²/n)`: it is the RMS divided by `sqrt(n)`, so its limits hold for ggml's
/// `n = 4096` only).
fn ggml_error(a: &[f32], b: &[f32]) -> f64 {
    sq_sum(a, b).sqrt() / a.len() as f64
}

/// The plain RMS error `sqrt(Σ(a − b)²/n)`.
fn rms(a: &[f32], b: &[f32]) -> f64 {
    (sq_sum(a, b) / a.len() as f64).sqrt()
}

fn sq_sum(a: &[f32], b: &[f32]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(&x, &y)| (f64::from(x) - f64::from(y)).powi(2))
        .sum()
}

/// ggml's `test-quantize-fns` limits on the error of a round trip of its synthetic row of
/// 4096 values (measured as ggml measures it), for several phases of the row; and the plain
/// RMS error, against limits a little above what ggml's algorithms reach here (a regression
/// guard; measured: q2_K 0.299, q3_K 0.161, q4_K 0.063, q5_K 0.034, q6_K 0.0167, q8_K 0.0048,
/// iq4_xs 0.081).
#[test]
fn quantizers_within_ggml_error_limits() {
    let limits = [
        (DType::Q2_K, 0.0075, 0.31),
        (DType::Q3_K, 0.0040, 0.17),
        (DType::Q4_K, 0.002, 0.066),
        (DType::Q5_K, 0.002, 0.036),
        (DType::Q6_K, 0.002, 0.018),
        (DType::Q8_K, 0.002, 0.0052),
        (DType::IQ4_XS, 0.002, 0.085),
    ];
    for (dtype, limit, rms_limit) in limits {
        for offset in [0.0f32, 0.5, 3.25, 100.0] {
            let x = synthetic(4096, offset);
            let y = decode(dtype, &encode(dtype, &x));
            let (err, rms) = (ggml_error(&x, &y), rms(&x, &y));
            eprintln!("{dtype:7} offset {offset:6}: ggml error {err:.6}, rms {rms:.5}");
            assert!(
                err < limit,
                "{dtype} offset={offset}: error {err} ≥ {limit}"
            );
            assert!(
                rms < rms_limit,
                "{dtype} offset={offset}: rms {rms} ≥ {rms_limit}"
            );
        }
    }
}

#[test]
fn q8_k_bsums_and_bound() {
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    for scale in [1e-6f32, 1.0, 3e3] {
        let x: Vec<f32> = (0..QK_K * 3).map(|_| rng.unit() * scale).collect();
        let bytes = encode(DType::Q8_K, &x);
        let y = decode(DType::Q8_K, &bytes);
        for (b, block) in bytes.chunks_exact(Q8_K_BYTES).enumerate() {
            let d = f32_at(block, 0);
            let qs = &block[4..260];
            assert!(
                qs.iter().all(|&q| q as i8 != i8::MIN),
                "q8_K never stores -128"
            );
            for g in 0..16 {
                let sum: i32 = qs[16 * g..16 * g + 16]
                    .iter()
                    .map(|&q| i32::from(q as i8))
                    .sum();
                let stored = i16::from_le_bytes([block[260 + 2 * g], block[261 + 2 * g]]);
                assert_eq!(i32::from(stored), sum, "bsum {g} of block {b}");
            }
            for j in 0..QK_K {
                let (a, z) = (x[b * QK_K + j], y[b * QK_K + j]);
                let bound = d.abs() / 2.0 + 2e-7 * a.abs().max(z.abs());
                assert!((a - z).abs() <= bound, "{a} vs {z} (d = {d})");
            }
            // The first value of largest magnitude maps to -127 exactly.
            let xs = &x[b * QK_K..(b + 1) * QK_K];
            let amax = xs.iter().fold(0f32, |m, v| m.max(v.abs()));
            let i = xs.iter().position(|v| v.abs() == amax).unwrap();
            assert_eq!(qs[i] as i8, -127);
        }
    }
}

#[test]
fn all_zero_super_blocks() {
    let x = vec![0f32; 2 * QK_K];
    for (dtype, _) in TYPES {
        let bytes = encode(dtype, &x);
        let y = decode(dtype, &bytes);
        assert!(y.iter().all(|&v| v == 0.0), "{dtype}: {:?}", &y[..8]);
        if matches!(dtype, DType::Q6_K | DType::Q8_K) {
            assert!(bytes.iter().all(|&b| b == 0), "{dtype} stores zeros");
        }
    }
}

#[test]
fn single_outlier_super_blocks() {
    for (dtype, _) in TYPES {
        for (at, big) in [(5usize, 1000.0f32), (200, -37.5), (255, 6.0e4)] {
            let mut x = vec![0f32; 2 * QK_K];
            x[at] = big;
            let y = decode(dtype, &encode(dtype, &x));
            let err = (y[at] - big).abs();
            assert!(
                err <= big.abs() * 4e-3,
                "{dtype}: outlier {big} decoded as {}",
                y[at]
            );
            for (j, &v) in y.iter().enumerate() {
                if j != at {
                    // iq4_xs has no exact zero level: zeros become the group's smallest step.
                    assert!(v.abs() <= big.abs() * 0.01, "{dtype}: value {j} is {v}");
                }
            }
            assert!(y[QK_K..].iter().all(|&v| v == 0.0), "{dtype}: second block");
            // With small noise around it as well.
            let mut rng = Rng(at as u64 + 7);
            let noisy: Vec<f32> = x.iter().map(|&v| v + 0.01 * rng.unit()).collect();
            let y = decode(dtype, &encode(dtype, &noisy));
            assert!(
                (y[at] - noisy[at]).abs() <= big.abs() * 5e-3,
                "{dtype} noisy outlier"
            );
        }
    }
}

/// Random bytes (NaN and infinite scales included) decode, and odd inputs (non-finite, huge,
/// subnormal) encode, without panicking.
#[test]
fn never_panics() {
    let mut rng = Rng(42);
    for (dtype, size) in TYPES {
        for _ in 0..64 {
            let bytes = rng.bytes(3 * size);
            let y = decode(dtype, &bytes);
            assert_eq!(y.len(), 3 * QK_K);
        }
        let mut x: Vec<f32> = (0..4 * QK_K).map(|_| rng.unit()).collect();
        x[3] = f32::NAN;
        x[QK_K + 9] = f32::INFINITY;
        x[QK_K + 10] = f32::NEG_INFINITY;
        for v in &mut x[2 * QK_K..3 * QK_K] {
            *v *= 3e38;
        }
        for v in &mut x[3 * QK_K..] {
            *v *= 1e-40;
        }
        let bytes = encode(dtype, &x);
        let _ = decode(dtype, &bytes);
        // Each super-block alone, too (a non-finite value only spoils its own super-block).
        let y = decode(dtype, &encode(dtype, &x[3 * QK_K..]));
        assert!(y.iter().all(|v| v.is_finite()), "{dtype}: subnormal input");
    }
}

/// Encoding writes every byte (the output buffer's previous contents do not matter) and
/// accepts unaligned output.
#[test]
fn encode_defines_every_byte() {
    let x = synthetic(2 * QK_K, 1.0);
    for (dtype, size) in TYPES {
        let a = encode(dtype, &x);
        let mut buf = vec![0x5Au8; 1 + 2 * size];
        (codec_of(dtype).from_f32.unwrap())(&x, &mut buf[1..]);
        assert_eq!(a, buf[1..], "{dtype}");
    }
}

/// Known bytes: a q8_K super-block with max 127 has d = 1 and copies the (rounded) values.
#[test]
fn q8_k_known_bytes() {
    let mut x = vec![0f32; QK_K];
    x[0] = -127.0;
    x[1] = 2.5; // ties to even: 2
    x[2] = 3.5; // 4
    x[3] = -0.5; // -0
    x[17] = 100.4;
    let b = encode(DType::Q8_K, &x);
    // iscale = -127/-127 = 1, d = 1.
    assert_eq!(f32_at(&b, 0), 1.0);
    assert_eq!(&b[4..8], &[0x81, 2, 4, 0]);
    assert_eq!(b[4 + 17], 100);
    assert_eq!(i16::from_le_bytes([b[260], b[261]]), -127 + 2 + 4);
    assert_eq!(i16::from_le_bytes([b[262], b[263]]), 100);
}

/// Layout spot checks: hand-made super-blocks decode as the module docs say.
#[test]
fn layout_spot_checks() {
    // q4_K: d = 1, dmin = 0.5, group 5 scale 3 / min 2 (high bits in bytes 1 and 5), value
    // 64·2 + 32 + 1 = 161 is the high nibble of qs[64 + 1].
    let mut b = vec![0u8; Q4_K_BYTES];
    b[0..2].copy_from_slice(&0x3C00u16.to_le_bytes());
    b[2..4].copy_from_slice(&0x3800u16.to_le_bytes());
    b[4 + 9] = 0x23; // group 5: low nibbles of scale (3) and min (2)
    b[16 + 64 + 1] = 0x70;
    let y = decode(DType::Q4_K, &b);
    assert_eq!(y[161], 3.0 * 7.0 - 0.5 * 2.0);
    assert_eq!(y[160], -1.0);
    // q6_K: d = 2, scale of group 9 is -3; value 128 + 64 + 5 = 197 takes the high nibble of
    // ql[64 + 5] and bits 4..6 of qh[32 + 5].
    let mut b = vec![0u8; Q6_K_BYTES];
    b[208..210].copy_from_slice(&0x4000u16.to_le_bytes());
    b[192 + 12] = (-3i8) as u8; // group 12 holds values 192..208
    b[64 + 5] = 0xA0;
    b[128 + 32 + 5] = 0b0010_0000;
    let y = decode(DType::Q6_K, &b);
    assert_eq!(y[197], 2.0 * -3.0 * ((0x0A | (2 << 4)) as f32 - 32.0));
    // iq4_xs: d = 1, group 3 scale = 0b10_0101 - 32 = 5; value 3·32 + 16 + 2 = 114 is the
    // high nibble of qs[48 + 2].
    let mut b = vec![0u8; IQ4_XS_BYTES];
    b[0..2].copy_from_slice(&0x3C00u16.to_le_bytes());
    b[2..4].copy_from_slice(&(0b10u16 << 6).to_le_bytes());
    b[4 + 1] = 0x50;
    b[8 + 48 + 2] = 0xF0;
    let y = decode(DType::IQ4_XS, &b);
    assert_eq!(y[114], 5.0 * 113.0);
}
