use super::*;
use crate::quant::test_support::{check_decodes_to, f32s, type_sections, Rng, TypeSection};

/// This module's types with their bytes per super-block and lattice tables.
const TYPES: [(DType, usize, &[u64]); 3] = [
    (DType::IQ2_XXS, IQ2_XXS_BYTES, &IQ2XXS_GRID),
    (DType::IQ2_XS, IQ2_XS_BYTES, &IQ2XS_GRID),
    (DType::IQ2_S, IQ2_S_BYTES, &IQ2S_GRID),
];

fn decode(dtype: DType, bytes: &[u8]) -> Vec<f32> {
    let n = bytes.len() / dtype.type_size() * QK_K;
    let mut out = vec![f32::NAN; n];
    (codec(dtype).expect("an iq2 codec").to_f32)(bytes, &mut out);
    out
}

/// The sections of `tests/data/iq2_blocks.bin` (see `scripts/make_iq2_fixtures.py`).
fn fixture() -> Vec<TypeSection> {
    type_sections("iq2_blocks.bin", b"IQ2F")
}

#[test]
fn codec_only_for_iq2_types() {
    for dt in DType::ALL {
        let mine = TYPES.iter().any(|&(t, _, _)| t == dt);
        assert_eq!(codec(dt).is_some(), mine, "{dt}");
        if mine {
            assert_eq!(dt.block_size(), QK_K);
            assert!(codec(dt).unwrap().from_f32.is_none(), "{dt} is decode-only");
            assert!(!dt.has_quantizer());
        }
    }
    for (dt, size, _) in TYPES {
        assert_eq!(dt.type_size(), size, "{dt}");
    }
    assert_eq!(DType::IQ2_XXS.ggml_type_id(), 16);
    assert_eq!(DType::IQ2_XS.ggml_type_id(), 17);
    assert_eq!(DType::IQ2_S.ggml_type_id(), 22);
}

/// Every decoded value equals gguf-py's `dequantize` bit for bit, at any alignment.
#[test]
fn decode_matches_gguf_bit_for_bit() {
    let mut seen = Vec::new();
    for (id, n, size, payload) in fixture() {
        let dtype = DType::from_ggml_type_id(id).unwrap();
        assert_eq!(dtype.type_size(), size);
        let (bytes, values) = payload.split_at(n * size);
        let want = f32s(values);
        check_decodes_to(
            dtype,
            codec(dtype).expect("an iq2 codec").to_f32,
            bytes,
            &want,
        );
        // Negative zeros are in the data (d = -0 or +0 with minus signs), so the comparison
        // above also checks the signs of zeros.
        assert!(want.iter().any(|v| v.to_bits() == 0x8000_0000), "{dtype}");
        seen.push(dtype);
    }
    assert_eq!(seen, [DType::IQ2_XXS, DType::IQ2_XS, DType::IQ2_S]);
}

/// Structural facts of the generated tables: sizes, every byte one of the three levels,
/// points distinct, the first point all 8s.
#[test]
fn grids_are_lattice_points() {
    for (dtype, _, grid) in TYPES {
        let n = match dtype {
            DType::IQ2_XXS => 256,
            DType::IQ2_XS => 512,
            _ => 1024,
        };
        assert_eq!(grid.len(), n, "{dtype}");
        assert_eq!(grid[0], 0x0808_0808_0808_0808, "{dtype}");
        for &p in grid {
            for j in 0..8 {
                let m = (p >> (8 * j)) as u8;
                assert!(GRID_LEVELS.contains(&m), "{dtype}: point {p:#018x}");
            }
        }
        let mut sorted = grid.to_vec();
        sorted.sort_unstable();
        sorted.dedup();
        assert_eq!(sorted.len(), n, "{dtype}: points are distinct");
    }
    // The three lattices are different point sets (a generator mixing tables up would fail).
    assert_ne!(&IQ2XXS_GRID[..], &IQ2XS_GRID[..256]);
    assert_ne!(&IQ2XS_GRID[..], &IQ2S_GRID[..512]);
}

#[test]
fn sign_bytes_have_even_parity() {
    for i in 0..128u32 {
        let s = sign_byte(i);
        assert_eq!(u32::from(s & 0x7F), i);
        assert_eq!(s.count_ones() % 2, 0, "{i}");
        assert_eq!(sign_byte(i | 0x180), s, "high bits are ignored");
    }
    assert_eq!(sign_byte(0), 0);
    assert_eq!(sign_byte(1), 0x81);
    assert_eq!(sign_byte(3), 0x03);
    assert_eq!(sign_byte(127), 0xFF);
}

/// Random bytes (NaN and infinite scales included) decode without panicking; finite scales
/// give finite values.
#[test]
fn never_panics() {
    let mut rng = Rng(42);
    for (dtype, size, _) in TYPES {
        for _ in 0..64 {
            let mut bytes = rng.bytes(3 * size);
            let y = decode(dtype, &bytes);
            assert_eq!(y.len(), 3 * QK_K);
            for b in bytes.chunks_exact_mut(size) {
                b[1] &= 0x7B; // exponent below 31: finite
            }
            assert!(decode(dtype, &bytes).iter().all(|v| v.is_finite()));
        }
        // Infinite and NaN scales.
        for d in [0x7C00u16, 0xFC00, 0x7E00] {
            let mut b = vec![0x5Au8; size];
            b[..2].copy_from_slice(&d.to_le_bytes());
            let y = decode(dtype, &b);
            assert!(y.iter().all(|v| !v.is_finite()), "{dtype} {d:#x}");
        }
    }
}

/// Hand-made super-blocks decode as the module docs say.
#[test]
fn layout_spot_checks() {
    let one = 0x3C00u16.to_le_bytes();
    let db = |s: u8| (0.5 + f32::from(s)) * 0.25;
    let point = |grid: &[u64], i: usize, j: usize| f32::from((grid[i] >> (8 * j)) as u8);

    // iq2_xxs: sub-block 2, run 4·2 + 1 = 9 uses lattice index b[2 + 16 + 1]; its sign index is
    // bits 7..14 of the u32 at 2 + 16 + 4; the scale is that u32's top nibble.
    let mut b = vec![0u8; IQ2_XXS_BYTES];
    b[..2].copy_from_slice(&one);
    b[2 + 16 + 1] = 200;
    let w: u32 = (9 << 28) | (0b000_0101 << 7);
    b[2 + 16 + 4..2 + 16 + 8].copy_from_slice(&w.to_le_bytes());
    let y = decode(DType::IQ2_XXS, &b);
    for j in 0..8 {
        // Sign index 5 = bits 0 and 2, parity even: the sign byte is 5.
        let sign = if j == 0 || j == 2 { -1.0 } else { 1.0 };
        assert_eq!(y[72 + j], db(9) * point(&IQ2XXS_GRID, 200, j) * sign, "{j}");
    }
    // The other runs of sub-block 2 use lattice point 0 and the same scale.
    assert_eq!(y[64], db(9) * 8.0);
    // Sub-block 0: scale 0, point 0, sign index 0.
    assert_eq!(y[0], db(0) * 8.0);

    // iq2_xs: run 21 is the u16 at 2 + 42: index 0x1FF, sign index 1 (sign byte 0x81); value
    // 8·21 = 168 lies in sub-block 5, first half: the low nibble of b[66 + 5]; values
    // 176..192 (second half) take the high nibble.
    let mut b = vec![0u8; IQ2_XS_BYTES];
    b[..2].copy_from_slice(&one);
    let q: u16 = 0x1FF | (1 << 9);
    b[2 + 42..2 + 44].copy_from_slice(&q.to_le_bytes());
    b[66 + 5] = 0xC3;
    let y = decode(DType::IQ2_XS, &b);
    assert_eq!(y[168], -db(3) * point(&IQ2XS_GRID, 511, 0));
    assert_eq!(y[175], -db(3) * point(&IQ2XS_GRID, 511, 7));
    assert_eq!(y[169], db(3) * point(&IQ2XS_GRID, 511, 1));
    assert_eq!(y[160], db(3) * 8.0);
    assert_eq!(y[176], db(12) * 8.0);
    assert_eq!(y[159], db(0) * 8.0);

    // iq2_s: run 6 (sub-block 1, l = 2): low index byte b[2 + 6], top bits at bits 4..6 of
    // b[66 + 1], sign byte b[34 + 6]; values 48..56, the second half of sub-block 1.
    let mut b = vec![0u8; IQ2_S_BYTES];
    b[..2].copy_from_slice(&one);
    b[2 + 6] = 0x34;
    b[66 + 1] = 0b11 << 4;
    b[34 + 6] = 0b1000_0001;
    b[74 + 1] = 0x70;
    let y = decode(DType::IQ2_S, &b);
    let idx = 0x334;
    assert_eq!(y[48], -db(7) * point(&IQ2S_GRID, idx, 0));
    assert_eq!(y[55], -db(7) * point(&IQ2S_GRID, idx, 7));
    assert_eq!(y[50], db(7) * point(&IQ2S_GRID, idx, 2));
    assert_eq!(y[32], db(0) * 8.0);
}

/// The unpacked form agrees with the decoder: `x_v = d·(0.5 + s)·0.25·value_v`.
#[test]
fn unpacked_matches_decoded() {
    let mut rng = Rng(7);
    for (dtype, size, _) in TYPES {
        let unpack = match dtype {
            DType::IQ2_XXS => unpack_iq2_xxs,
            DType::IQ2_XS => unpack_iq2_xs,
            _ => unpack_iq2_s,
        };
        for _ in 0..16 {
            let mut b = rng.bytes(size);
            b[..2].copy_from_slice(&0x3555u16.to_le_bytes());
            let u = unpack(&b);
            let y = decode(dtype, &b);
            let d = f16_at(&b, 0);
            for (v, (&yv, &w)) in y.iter().zip(&u.values).enumerate() {
                let s = u.scales[v / 16];
                assert!(s < 16);
                assert!(GRID_LEVELS.contains(&w.unsigned_abs()));
                assert_eq!(yv, d * (0.5 + f32::from(s)) * 0.25 * f32::from(w));
            }
            // Every run has an even number of minus signs for the 7-bit-index types.
            if dtype != DType::IQ2_S {
                for run in u.values.chunks_exact(8) {
                    assert_eq!(run.iter().filter(|&&v| v < 0).count() % 2, 0);
                }
            }
        }
    }
}
