use super::*;
use crate::quant::iq3::tests::check_fixture;
use crate::quant::test_support::Rng;

#[test]
fn decode_matches_gguf_bit_for_bit() {
    check_fixture(&[DType::IQ1_S, DType::IQ1_M], codec);
}

#[test]
fn codec_only_for_these_types() {
    for dt in DType::ALL {
        let mine = matches!(dt, DType::IQ1_S | DType::IQ1_M);
        assert_eq!(codec(dt).is_some(), mine, "{dt}");
        if mine {
            assert!(codec(dt).unwrap().from_f32.is_none());
            assert!(!dt.has_quantizer());
            assert_eq!(dt.block_size(), QK_K);
        }
    }
    assert_eq!(DType::IQ1_S.type_size(), IQ1_S_BYTES);
    assert_eq!(DType::IQ1_M.type_size(), IQ1_M_BYTES);
}

#[test]
fn grid_structure() {
    for (i, &c) in IQ1_CODES.iter().enumerate() {
        for j in 0..8 {
            assert_ne!(
                (c >> (2 * j)) & 3,
                3,
                "point {i} uses the unused level index"
            );
        }
    }
    for &p in IQ1_GRID.iter() {
        assert!(p.to_le_bytes().iter().all(|&b| matches!(b as i8, -1..=1)));
    }
    let mut sorted = IQ1_GRID.to_vec();
    sorted.sort_unstable();
    sorted.dedup();
    assert_eq!(sorted.len(), 2048, "distinct points");
    // Known entries of ggml's iq1s_grid.
    assert_eq!(IQ1_GRID[0], 0xffff_ffff_ffff_ffff);
    assert_eq!(IQ1_GRID[2047], 0x0101_0101_0101_0101);
}

#[test]
fn iq1_m_scale_from_nibbles() {
    let mut b = [0u8; IQ1_M_BYTES];
    // 1.0 = 0x3C00: nibbles 0, 0, 0xC, 0x3 in words 0..4.
    b[53] = 0xC0;
    b[55] = 0x30;
    assert_eq!(iq1_m_scale(&b).to_f32(), 1.0);
    b[48..].fill(0xFF);
    assert!(iq1_m_scale(&b).is_nan());
}

#[test]
fn random_bytes_never_panic() {
    let bytes = Rng(0xFEED_FACE).bytes(50 * 56 * 4);
    for dt in [DType::IQ1_S, DType::IQ1_M] {
        let n = bytes.len() / dt.type_size();
        let mut out = vec![0f32; n * QK_K];
        (codec(dt).unwrap().to_f32)(&bytes[..n * dt.type_size()], &mut out);
    }
}
