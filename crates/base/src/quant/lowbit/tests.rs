use super::*;
use crate::quant::test_support::{f32s, read_data, sections, Rng};

/// (type, values per block, bytes per block)
const TYPES: [(DType, usize, usize); 6] = [
    (DType::TQ1_0, QK_K, TQ1_0_BYTES),
    (DType::TQ2_0, QK_K, TQ2_0_BYTES),
    (DType::MXFP4, QK_MXFP4, MXFP4_BYTES),
    (DType::NVFP4, QK_NVFP4, NVFP4_BYTES),
    (DType::Q1_0, QK_Q1_0, Q1_0_BYTES),
    (DType::Q2_0, QK_Q2_0, Q2_0_BYTES),
];

fn codec_of(dtype: DType) -> BlockCodec {
    codec(dtype).expect("a low-bit codec")
}

fn shape(dtype: DType) -> (usize, usize) {
    let (_, qk, size) = TYPES.iter().find(|t| t.0 == dtype).copied().unwrap();
    (qk, size)
}

fn encode(dtype: DType, x: &[f32]) -> Vec<u8> {
    let (qk, size) = shape(dtype);
    let mut out = vec![0xA5u8; x.len() / qk * size];
    (codec_of(dtype).from_f32.unwrap())(x, &mut out);
    out
}

fn decode(dtype: DType, bytes: &[u8]) -> Vec<f32> {
    let (qk, size) = shape(dtype);
    let mut out = vec![f32::NAN; bytes.len() / size * qk];
    (codec_of(dtype).to_f32)(bytes, &mut out);
    out
}

/// A section of `tests/data/lowbit_blocks.bin` (see `scripts/make_lowbit_fixtures.py`).
struct Section {
    kind: u32,
    id: u32,
    n: usize,
    size: usize,
    qk: usize,
    bytes: Vec<u8>,
    values: Vec<f32>,
}

fn fixture() -> Vec<Section> {
    let data = read_data("lowbit_blocks.bin");
    // Header: kind, type id, block count, bytes per block, values per block; then the block
    // bytes and the f32 values (kind 0), or the values first (kinds 1 and 2).
    sections(&data, b"LBF1", 4, 5, |h| {
        let (nb, nv) = (
            h[2] as usize * h[3] as usize,
            h[2] as usize * h[4] as usize * 4,
        );
        if h[0] == 0 {
            vec![nb, nv]
        } else {
            vec![nv, nb]
        }
    })
    .into_iter()
    .map(|s| {
        let [kind, id, n, size, qk] = s.header[..] else {
            unreachable!()
        };
        let (bytes, values) = if kind == 0 {
            (&s.parts[0], &s.parts[1])
        } else {
            (&s.parts[1], &s.parts[0])
        };
        Section {
            kind,
            id,
            n: n as usize,
            size: size as usize,
            qk: qk as usize,
            bytes: bytes.clone(),
            values: f32s(values),
        }
    })
    .collect()
}

fn dtype_of(id: u32) -> DType {
    match id {
        34 => DType::TQ1_0,
        35 => DType::TQ2_0,
        39 => DType::MXFP4,
        40 => DType::NVFP4,
        41 => DType::Q1_0,
        _ => panic!("unexpected ggml type id {id}"),
    }
}

#[test]
fn sizes_match_the_dtype() {
    for (dtype, qk, size) in TYPES {
        assert_eq!(dtype.block_size(), qk, "{dtype:?}");
        assert_eq!(dtype.type_size(), size, "{dtype:?}");
        assert!(codec(dtype).is_some_and(|c| c.from_f32.is_some()));
    }
    assert!(codec(DType::Q8_0).is_none());
    assert!(codec(DType::F32).is_none());
}

#[test]
fn decoding_matches_gguf_bit_for_bit() {
    let mut seen = Vec::new();
    for s in fixture().iter().filter(|s| s.kind == 0) {
        let dtype = dtype_of(s.id);
        assert_eq!(shape(dtype), (s.qk, s.size));
        let got = decode(dtype, &s.bytes);
        assert_eq!(got.len(), s.values.len());
        for (i, (a, b)) in got.iter().zip(&s.values).enumerate() {
            assert_eq!(
                a.to_bits(),
                b.to_bits(),
                "{dtype:?} value {i} (block {}): {a} vs gguf {b}",
                i / s.qk
            );
        }
        seen.push((dtype, s.n));
    }
    let kinds: Vec<DType> = seen.iter().map(|s| s.0).collect();
    assert_eq!(
        kinds,
        [DType::TQ1_0, DType::TQ2_0, DType::MXFP4, DType::NVFP4]
    );
}

#[test]
fn quantization_matches_gguf_bit_for_bit() {
    let mut seen = Vec::new();
    for s in fixture().iter().filter(|s| s.kind == 1) {
        let dtype = dtype_of(s.id);
        let got = encode(dtype, &s.values);
        assert_eq!(got.len(), s.bytes.len());
        for (b, (ours, theirs)) in got
            .chunks_exact(s.size)
            .zip(s.bytes.chunks_exact(s.size))
            .enumerate()
        {
            assert_eq!(
                ours,
                theirs,
                "{dtype:?} block {b}: input {:?}",
                &s.values[b * s.qk..(b + 1) * s.qk]
            );
        }
        seen.push(dtype);
    }
    assert_eq!(seen, [DType::TQ1_0, DType::TQ2_0, DType::MXFP4]);
}

#[test]
fn ue4m3_rounding_matches_gguf() {
    let s = fixture()
        .into_iter()
        .find(|s| s.kind == 2)
        .expect("ue4m3 section");
    assert!(s.n > 1000);
    for (&x, &b) in s.values.iter().zip(&s.bytes) {
        assert_eq!(f32_to_ue4m3(x), b, "{x:e} ({:#x})", x.to_bits());
    }
}

#[test]
fn scale_bytes_decode_exactly() {
    for e in 0..=255u8 {
        let want = 2f64.powi(i32::from(e) - 128);
        assert_eq!(f64::from(e8m0_half(e)), want, "e8m0 {e}");
    }
    for b in 0..=255u8 {
        let (x, m) = (i32::from((b >> 3) & 15), f64::from(b & 7));
        let raw = if x == 0 {
            m * 2f64.powi(-9)
        } else {
            (1.0 + m / 8.0) * 2f64.powi(x - 7)
        };
        let want = if b == 0 || b == 0x7F { 0.0 } else { raw * 0.5 };
        assert_eq!(f64::from(ue4m3_half(b)), want, "ue4m3 {b:#x}");
    }
    // Encoding a decoded scale (doubled back) returns its code, for the codes the
    // quantizer writes below its saturation code 0x7E (exponent field below 15).
    for b in 1..0x78u8 {
        assert_eq!(f32_to_ue4m3(2.0 * ue4m3_half(b)), b, "{b:#x}");
    }
}

#[test]
fn mxfp4_exponent_rules() {
    assert_eq!(mxfp4_exponent(0.0), 0);
    assert_eq!(mxfp4_exponent(-1.0), 0);
    assert_eq!(mxfp4_exponent(f32::NAN), 0);
    assert_eq!(mxfp4_exponent(1.0), 125);
    assert_eq!(mxfp4_exponent(1.999), 125);
    assert_eq!(mxfp4_exponent(6.0), 127);
    // Just below 2, log2 ≈ 1 − 1.7e-7 is still below 1 in f32 (the grid is fine there).
    assert_eq!(mxfp4_exponent(f32::from_bits(2.0f32.to_bits() - 1)), 125);
    // Far from 1, a few steps below the power of two still round up (log2 near 100 has a
    // coarse f32 grid), as gguf-py's numpy and ggml's log2f do.
    let big = 2f32.powi(101);
    assert_eq!(
        mxfp4_exponent(f32::from_bits(big.to_bits() - 20)),
        101 + 125
    );
    assert_eq!(
        mxfp4_exponent(f32::from_bits(big.to_bits() - 60)),
        100 + 125
    );
    // Below 2^-125 the exponent wraps.
    assert_eq!(mxfp4_exponent(2f32.powi(-126)), 255);
    assert_eq!(mxfp4_exponent(2f32.powi(-149)), (-24i32) as u8);
    // Non-finite: no panic.
    let _ = mxfp4_exponent(f32::INFINITY);
}

/// Random rows of a few magnitudes.
fn random_rows(rng: &mut Rng, n: usize, block: usize) -> Vec<f32> {
    let mut x = Vec::with_capacity(n);
    while x.len() < n {
        let scale = [1e-3f32, 0.5, 3.0, 200.0][(rng.next() % 4) as usize];
        x.extend((0..block).map(|_| rng.unit() * scale));
    }
    x
}

#[test]
fn ternary_roundtrip_within_bound() {
    let mut rng = Rng(0x1234_5678_9ABC_DEF1);
    for (dtype, block) in [
        (DType::TQ1_0, QK_K),
        (DType::TQ2_0, QK_K),
        (DType::Q2_0, QK_Q2_0),
    ] {
        let x = random_rows(&mut rng, 16 * QK_K, block);
        let y = decode(dtype, &encode(dtype, &x));
        for (xb, yb) in x.chunks_exact(block).zip(y.chunks_exact(block)) {
            let d = xb.iter().fold(0f32, |m, v| m.max(v.abs()));
            let dt = f16::from_f32(d).to_f32();
            let bound = f64::from(d) / 2.0 + f64::from((d - dt).abs()) + 1e-6 * f64::from(d);
            for (&a, &b) in xb.iter().zip(yb) {
                let err = (f64::from(a) - f64::from(b)).abs();
                assert!(err <= bound, "{dtype:?}: {a} -> {b}, bound {bound}");
            }
        }
        // Idempotent: decoded values are exact multiples of the stored scale.
        let q = encode(dtype, &x);
        assert_eq!(encode(dtype, &decode(dtype, &q)), q, "{dtype:?}");
    }
}

/// Checks the FP4 bound `|x − x̂| ≤ 2u + max(0, |x| − 12u)` per group of `group` values
/// sharing the scale `scale(block, group index)`.
fn check_fp4_bound(x: &[f32], y: &[f32], group: usize, scale: impl Fn(usize) -> f32) {
    for (g, (xb, yb)) in x.chunks_exact(group).zip(y.chunks_exact(group)).enumerate() {
        let u = f64::from(scale(g));
        for (&a, &b) in xb.iter().zip(yb) {
            let a64 = f64::from(a);
            let bound = 2.0 * u + (a64.abs() - 12.0 * u).max(0.0);
            let err = (a64 - f64::from(b)).abs();
            assert!(err <= bound * (1.0 + 1e-6), "{a} -> {b}, u = {u}");
        }
    }
}

#[test]
fn fp4_roundtrip_within_bound_and_idempotent() {
    let mut rng = Rng(0x0DDB_A11C_0FFE_E123);
    let x = random_rows(&mut rng, 64 * QK_NVFP4, QK_NVFP4_SUB);

    let q = encode(DType::MXFP4, &x);
    let y = decode(DType::MXFP4, &q);
    check_fp4_bound(&x, &y, QK_MXFP4, |g| e8m0_half(q[g * MXFP4_BYTES]));
    // Largest magnitude: the clamp costs less than a quarter of it.
    for (xb, yb) in x.chunks_exact(QK_MXFP4).zip(y.chunks_exact(QK_MXFP4)) {
        let amax = fp4_amax(xb);
        for (&a, &b) in xb.iter().zip(yb) {
            assert!((a - b).abs() <= amax / 4.0 * (1.0 + 1e-6));
        }
    }
    assert_eq!(encode(DType::MXFP4, &y), q, "mxfp4 idempotence");

    let q = encode(DType::NVFP4, &x);
    let y = decode(DType::NVFP4, &q);
    check_fp4_bound(&x, &y, QK_NVFP4_SUB, |g| {
        ue4m3_half(q[(g / 4) * NVFP4_BYTES + g % 4])
    });
    for (xb, yb) in x
        .chunks_exact(QK_NVFP4_SUB)
        .zip(y.chunks_exact(QK_NVFP4_SUB))
    {
        // Normal-range scales: the largest level is within 1/16 of the largest magnitude,
        // and the largest magnitude itself lands on ±12u.
        let amax = fp4_amax(xb);
        if amax / 6.0 >= 2f32.powi(-6) {
            let m = yb.iter().fold(0f32, |m, v| m.max(v.abs()));
            assert!(
                (m - amax).abs() <= amax / 16.0 * (1.0 + 1e-6),
                "{amax} vs {m}"
            );
        }
    }
    // Idempotent while every sub-block's scale is in UE4M3's normal range (the largest
    // value then decodes to ±12u, and (12u)/6 encodes back to the same byte).
    assert_eq!(encode(DType::NVFP4, &y), q, "nvfp4 idempotence");
}

#[test]
fn fp4_known_bytes() {
    // amax = 6: e = floor(log2 6) − 2 + 127 = 127, s = 2^-1, levels K·0.5.
    let mut x = [0f32; 32];
    x[..8].copy_from_slice(&[6.0, -6.0, 0.5, -0.25, 0.75, 2.5, 5.0, -0.0]);
    x[16] = 1.25; // between 1.0 (code 2) and 1.5 (code 3): a tie, the first code wins
    let q = encode(DType::MXFP4, &x);
    assert_eq!(q[0], 127);
    // 6 → 7, −6 → 15, 0.5 → 1, −0.25 → tie between 0 (code 0) and −0.5 (code 9): code 0,
    // 0.75 → tie 0.5/1.0: code 1, 2.5 → tie 2/3: code 4, 5 → tie 4/6: code 6, −0 → 0.
    assert_eq!(&q[1..9], &[0x27, 0x0F, 0x01, 0x00, 0x01, 0x04, 0x06, 0x00]);
    let y = decode(DType::MXFP4, &q);
    assert_eq!(&y[..8], &[6.0, -6.0, 0.5, 0.0, 0.5, 2.0, 4.0, 0.0]);
    assert_eq!(y[16], 1.0);

    // NVFP4: amax = 6 → 6/6 = 1.0 → UE4M3 0x38, u = 0.5.
    let mut x = [0f32; 64];
    x[0] = 6.0;
    x[8] = -3.0;
    x[16] = 0.1; // sub-block 1: 0.1/6 is subnormal in UE4M3
    let q = encode(DType::NVFP4, &x);
    assert_eq!(&q[..4], &[0x38, f32_to_ue4m3(0.1 / 6.0), 0, 0]);
    assert_eq!(q[4], 0xD7, "6 → code 7 low, −3 → code 13 high");
    let y = decode(DType::NVFP4, &q);
    assert_eq!((y[0], y[8]), (6.0, -3.0));
}

#[test]
fn q1_0_signs_and_mean_magnitude() {
    let mut rng = Rng(0xC0DE_1234_5555_0001);
    let mut x = random_rows(&mut rng, 8 * QK_Q1_0, QK_Q1_0);
    x[3] = -0.0;
    x[4] = 0.0;
    let q = encode(DType::Q1_0, &x);
    let y = decode(DType::Q1_0, &q);
    for (b, (xb, yb)) in x
        .chunks_exact(QK_Q1_0)
        .zip(y.chunks_exact(QK_Q1_0))
        .enumerate()
    {
        let sum = xb.iter().fold(0f32, |s, v| s + v.abs());
        let d = f16::from_f32(sum / 128.0).to_f32();
        assert_eq!(f16_at(&q[b * Q1_0_BYTES..], 0), d);
        for (&a, &v) in xb.iter().zip(yb) {
            assert_eq!(v, if a >= 0.0 { d } else { -d }, "{a}");
        }
    }
    assert_eq!((y[3], y[4]), (y[4], y[4]), "±0 both decode to +d");
    assert_eq!(encode(DType::Q1_0, &y), q, "idempotent for a nonzero scale");

    // Known bytes: 1.0 everywhere but value 9 (−3.0): sum = 130, d = 130/128.
    let mut x = [1f32; 128];
    x[9] = -3.0;
    let q = encode(DType::Q1_0, &x);
    assert_eq!(f16_at(&q, 0), f16::from_f32(130.0 / 128.0).to_f32());
    assert_eq!(q[3], 0xFD);
    assert!(q[2..].iter().enumerate().all(|(i, &b)| i == 1 || b == 0xFF));
}

#[test]
fn ternary_packing_known_bytes() {
    // TQ2_0: value 128h + 32l + m sits in bits 2l of byte 32h + m.
    let mut x = [0f32; 256];
    x[0] = 1.0; // byte 0, field 0 → 2
    x[32] = -1.0; // byte 0, field 1 → 0
    x[128 + 96 + 5] = 0.6; // byte 37, field 3 → 2 (0.6 rounds to 1)
    let q = encode(DType::TQ2_0, &x);
    assert_eq!(q[0], 0b01_01_00_10);
    assert_eq!(q[37], 0b10_01_01_01);
    assert_eq!(f16_at(&q, 64), 1.0);
    let y = decode(DType::TQ2_0, &q);
    assert_eq!((y[0], y[32], y[229], y[1]), (1.0, -1.0, 1.0, 0.0));

    // TQ1_0: all zero trits (t = 1) pack to ⌈256·121/243⌉ = 128; the qh bytes hold 4 trits
    // then a zero: T = 1·81 + 27 + 9 + 3 = 120 → ⌈256·120/243⌉ = 127.
    let q = encode(DType::TQ1_0, &[0f32; 256]);
    assert!(q[..48].iter().all(|&b| b == 128));
    assert!(q[48..52].iter().all(|&b| b == 127));
    assert_eq!(&q[52..], &[0, 0]);
    assert_eq!(decode(DType::TQ1_0, &q), vec![0f32; 256]);
    // Every byte decodes to trits in 0..=2, and every trit pattern round-trips.
    for t in 0..243u16 {
        let digits: [u8; 5] = std::array::from_fn(|k| ((t / 3u16.pow(4 - k as u32)) % 3) as u8);
        let b = pack_trits(digits);
        for (k, &dgt) in digits.iter().enumerate() {
            assert_eq!(trit(b, k), dgt as i8, "T = {t}, trit {k}");
        }
    }
}

#[test]
fn any_bytes_and_any_floats_do_not_panic() {
    let mut rng = Rng(0xFEED_FACE_CAFE_BEEF);
    for (dtype, qk, size) in TYPES {
        let bytes = rng.bytes(size * 64);
        let _ = decode(dtype, &bytes);
        let specials = [
            f32::NAN,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::MAX,
            -f32::MAX,
        ];
        let mut x = random_rows(&mut rng, qk * 4, qk);
        for (i, v) in x.iter_mut().enumerate().step_by(7) {
            *v = specials[i % specials.len()];
        }
        let q = encode(dtype, &x);
        let _ = decode(dtype, &q);
        let tiny: Vec<f32> = (0..qk).map(|i| f32::from_bits(i as u32)).collect();
        let _ = encode(dtype, &tiny);
    }
}
