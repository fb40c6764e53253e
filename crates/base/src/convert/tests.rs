//! Unit tests of the scalar conversions against independent oracles written with `f64`
//! arithmetic (no bit tricks shared with the implementation).

use super::*;

/// Exact value of an `f16` bit pattern that is not NaN, computed as `m * 2^(e - 25)`.
fn f16_value(h: u16) -> f64 {
    let sign = if h & 0x8000 != 0 { -1.0 } else { 1.0 };
    let exp = i32::from((h >> 10) & 0x1f);
    let man = f64::from(h & 0x3ff);
    if exp == 0x1f {
        return sign * f64::INFINITY;
    }
    if exp == 0 {
        sign * man * 2f64.powi(-24)
    } else {
        sign * (man + 1024.0) * 2f64.powi(exp - 25)
    }
}

/// Nearest `f16` to a finite non-NaN `f32`, ties to even, by scaling in `f64`.
fn nearest_f16(x: f32) -> u16 {
    let sign = if x.is_sign_negative() { 0x8000 } else { 0 };
    let a = f64::from(x.abs());
    if a >= 65520.0 {
        return sign | 0x7c00;
    }
    if a == 0.0 {
        return sign;
    }
    // Exponent of a's leading bit, clamped to the f16 minimum normal exponent.
    let biased = (x.to_bits() >> 23) & 0xff;
    let e = if biased == 0 {
        -149
    } else {
        biased as i32 - 127
    }
    .max(-14);
    let q = (a * 2f64.powi(10 - e)).round_ties_even(); // exact scaling by a power of two
    let q = q as u32;
    if e == -14 && q < 1024 {
        return sign | q as u16; // subnormal (or zero)
    }
    let (e, q) = if q == 2048 { (e + 1, 1024) } else { (e, q) };
    if e > 15 {
        return sign | 0x7c00;
    }
    sign | (((e + 15) as u16) << 10) | (q - 1024) as u16
}

/// Nearest `bf16` to a finite non-NaN `f32`, ties to even, by scaling in `f64`.
fn nearest_bf16(x: f32) -> u16 {
    let sign = if x.is_sign_negative() { 0x8000 } else { 0 };
    let a = f64::from(x.abs());
    if a == 0.0 {
        return sign;
    }
    let biased = (x.to_bits() >> 23) & 0xff;
    let e = if biased == 0 {
        -126
    } else {
        biased as i32 - 127
    }
    .max(-126);
    let q = (a * 2f64.powi(7 - e)).round_ties_even() as u32;
    if e == -126 && q < 128 {
        return sign | q as u16;
    }
    let (e, q) = if q == 256 { (e + 1, 128) } else { (e, q) };
    if e > 127 {
        return sign | 0x7f80;
    }
    sign | (((e + 127) as u16) << 7) | (q - 128) as u16
}

/// SplitMix64, for reproducible pseudo-random bit patterns.
fn splitmix(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

#[test]
fn f16_to_f32_is_exact_for_every_pattern() {
    for h in 0..=u16::MAX {
        let got = fp16_to_fp32(f16::from_bits(h));
        let is_nan = (h & 0x7c00) == 0x7c00 && (h & 0x03ff) != 0;
        if is_nan {
            assert!(got.is_nan(), "{h:#06x}");
            assert_eq!(
                got.to_bits() & 0x0040_0000,
                0x0040_0000,
                "{h:#06x} not quiet"
            );
            assert_eq!(got.is_sign_negative(), h & 0x8000 != 0);
            assert_eq!(
                (got.to_bits() >> 13) & 0x1ff,
                u32::from(h & 0x1ff),
                "payload"
            );
        } else {
            assert_eq!(f64::from(got), f16_value(h), "{h:#06x}");
            assert_eq!(got.is_sign_negative(), h & 0x8000 != 0, "{h:#06x} sign");
        }
    }
}

#[test]
fn f32_to_f16_ties_around_every_f16() {
    // For each pair of neighbouring non-negative finite f16 values, the exact midpoint (which
    // an f32 represents) must round to the even one, and its f32 neighbours to the nearer.
    for h in 0..0x7bffu16 {
        let lo = f16_value(h);
        let hi = f16_value(h + 1);
        let mid = ((lo + hi) / 2.0) as f32;
        assert_eq!(f64::from(mid), (lo + hi) / 2.0, "midpoint not exact");
        let even = if h & 1 == 0 { h } else { h + 1 };
        for sign in [0u32, 0x8000_0000] {
            let s16 = (sign >> 16) as u16;
            let m = f32::from_bits(mid.to_bits() | sign);
            let below = f32::from_bits((mid.to_bits() - 1) | sign);
            let above = f32::from_bits((mid.to_bits() + 1) | sign);
            assert_eq!(fp32_to_fp16(m).to_bits(), even | s16, "tie above {h:#06x}");
            assert_eq!(fp32_to_fp16(below).to_bits(), h | s16, "below mid {h:#06x}");
            assert_eq!(
                fp32_to_fp16(above).to_bits(),
                (h + 1) | s16,
                "above mid {h:#06x}"
            );
            // And the f16 values themselves come back unchanged.
            let exact = f32::from_bits((lo as f32).to_bits() | sign);
            assert_eq!(fp32_to_fp16(exact).to_bits(), h | s16);
        }
    }
}

#[test]
fn f32_to_f16_matches_f64_oracle_on_random_values() {
    let mut st = 0x1234_5678_9abc_def0;
    for _ in 0..400_000 {
        let r = splitmix(&mut st);
        // Half the samples anywhere, half with exponents near the f16 range.
        let bits = if r & 1 == 0 {
            (r >> 32) as u32
        } else {
            let exp = 98 + ((r >> 8) % 48) as u32; // 2^-29 .. 2^18
            ((r >> 32) as u32 & 0x807f_ffff) | (exp << 23)
        };
        let x = f32::from_bits(bits);
        if x.is_nan() {
            continue;
        }
        assert_eq!(
            fp32_to_fp16(x).to_bits(),
            nearest_f16(x),
            "x = {x:e} ({bits:#010x})"
        );
    }
}

#[test]
fn f32_to_bf16_matches_f64_oracle_on_random_values() {
    let mut st = 0x0fed_cba9_8765_4321;
    for _ in 0..400_000 {
        let r = splitmix(&mut st);
        let bits = (r >> 32) as u32;
        let x = f32::from_bits(bits);
        if x.is_nan() {
            continue;
        }
        assert_eq!(
            fp32_to_bf16(x).to_bits(),
            nearest_bf16(x),
            "x = {x:e} ({bits:#010x})"
        );
    }
    // Every f32 subnormal exponent/mantissa boundary region, and the top of the range.
    for bits in (0..0x0100_0000u32)
        .step_by(97)
        .chain(0x7f7f_0000..=0x7f7f_ffff)
    {
        let x = f32::from_bits(bits);
        assert_eq!(fp32_to_bf16(x).to_bits(), nearest_bf16(x), "{bits:#010x}");
    }
}

#[test]
fn bf16_to_f32_is_exact_for_every_pattern() {
    for b in 0..=u16::MAX {
        let got = bf16_to_fp32(bf16::from_bits(b));
        let is_nan = (b & 0x7f80) == 0x7f80 && (b & 0x007f) != 0;
        if is_nan {
            assert!(got.is_nan());
            assert_eq!(got.to_bits(), (u32::from(b) << 16) | 0x0040_0000);
        } else {
            assert_eq!(got.to_bits(), u32::from(b) << 16);
        }
    }
}

#[test]
fn oracles_agree_with_each_other_on_f16_values() {
    // Sanity check of the oracles themselves: every finite f16 maps back to itself.
    for h in 0..0x7c00u16 {
        for s in [0u16, 0x8000] {
            let x = f16_value(h | s) as f32;
            assert_eq!(nearest_f16(x), h | s);
        }
    }
}

#[test]
fn path_is_cached_and_named() {
    let a = simd_path();
    let b = simd_path();
    assert_eq!(a, b);
    assert!(["avx2+f16c", "neon", "scalar"].contains(&a));
}

#[test]
fn streaming_threshold_is_by_footprint() {
    let n = STREAM_MIN_BYTES / 6 + 77;
    let f = vec![0f32; n];
    let h = vec![f16::ZERO; n];
    assert!(stream(&f, &h));
    assert!(stream(&h, &f));
    assert!(!stream(&f[..n / 2], &h[..n / 2]));
}
