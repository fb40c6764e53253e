use super::*;
use crate::quant::test_support::{check_decodes_to, f32s, type_sections, Rng};

/// One section of the fixture: (ggml type id, super-block count, bytes per super-block, block
/// bytes, decoded values).
pub(crate) type Section = (u32, usize, usize, Vec<u8>, Vec<f32>);

/// The sections of `tests/data/iq3_iq1_blocks.bin` (see `scripts/make_iq3_iq1_fixtures.py`).
pub(crate) fn fixture() -> Vec<Section> {
    type_sections("iq3_iq1_blocks.bin", b"IQF1")
        .into_iter()
        .map(|(id, n, size, mut bytes)| {
            let values = f32s(&bytes.split_off(n * size));
            (id, n, size, bytes, values)
        })
        .collect()
}

/// Decodes every section of `types` from the fixture (also unaligned, and through
/// `DType::row_to_f32`) and compares the bits with gguf's values.
pub(crate) fn check_fixture(types: &[DType], codec: fn(DType) -> Option<BlockCodec>) {
    let mut seen = 0;
    for (id, n, size, bytes, want) in fixture() {
        let dtype = DType::from_ggml_type_id(id).unwrap();
        if !types.contains(&dtype) {
            continue;
        }
        assert_eq!(dtype.type_size(), size);
        assert_eq!(bytes.len(), n * size);
        check_decodes_to(dtype, codec(dtype).expect("codec").to_f32, &bytes, &want);
        seen += 1;
    }
    assert_eq!(seen, types.len());
}

#[test]
fn decode_matches_gguf_bit_for_bit() {
    check_fixture(&[DType::IQ3_XXS, DType::IQ3_S], codec);
}

#[test]
fn codec_only_for_these_types() {
    for dt in DType::ALL {
        let mine = matches!(dt, DType::IQ3_XXS | DType::IQ3_S);
        assert_eq!(codec(dt).is_some(), mine, "{dt}");
        if mine {
            assert!(codec(dt).unwrap().from_f32.is_none());
            assert!(!dt.has_quantizer());
            assert_eq!(dt.block_size(), QK_K);
        }
    }
    assert_eq!(DType::IQ3_XXS.type_size(), IQ3_XXS_BYTES);
    assert_eq!(DType::IQ3_S.type_size(), IQ3_S_BYTES);
}

#[test]
fn grids_structure() {
    let levels = |grid: &[u32], allowed: &[u8]| {
        for &p in grid {
            assert!(
                p.to_le_bytes().iter().all(|b| allowed.contains(b)),
                "{p:#x}"
            );
        }
        // The points are distinct.
        let mut sorted = grid.to_vec();
        sorted.sort_unstable();
        sorted.dedup();
        assert_eq!(sorted.len(), grid.len());
    };
    levels(&IQ3_XXS_GRID, &[4, 12, 20, 28, 36, 44, 52, 62]);
    levels(&IQ3_S_GRID, &[1, 3, 5, 7, 9, 11, 13, 15]);
    // Known ends of ggml's tables.
    assert_eq!(IQ3_XXS_GRID[0], 0x0404_0404);
    assert_eq!(IQ3_XXS_GRID[255], 0x3E34_1C04);
    assert_eq!(IQ3_S_GRID[0], 0x0101_0101);
    assert_eq!(IQ3_S_GRID[511], 0x0F0F_0101);
}

#[test]
fn sign_bytes_have_even_parity() {
    for i in 0..128u32 {
        let s = sign_byte(i);
        assert_eq!(u32::from(s & 0x7F), i);
        assert_eq!(s.count_ones() % 2, 0);
    }
    // A few entries of ggml's ksigns_iq2xs.
    assert_eq!(sign_byte(1), 0x81);
    assert_eq!(sign_byte(3), 0x03);
    assert_eq!(sign_byte(127), 0xFF);
    assert_eq!(sign_byte(0x85), 0x05, "only the low 7 bits are read");
}

#[test]
fn random_bytes_never_panic() {
    let bytes = Rng(0x0123_4567_89AB_CDEF).bytes(98 * 110 * 4);
    for dt in [DType::IQ3_XXS, DType::IQ3_S] {
        let n = bytes.len() / dt.type_size();
        let mut out = vec![0f32; n * QK_K];
        (codec(dt).unwrap().to_f32)(&bytes[..n * dt.type_size()], &mut out);
    }
}
