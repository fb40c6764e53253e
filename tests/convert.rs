//! Integration tests of `ferrograph::convert`: scalar semantics on hand-computed values, the
//! SIMD and threaded row paths against the scalar functions, tails, and errors.

use ferrograph::convert::*;
use ferrograph::Error;
use half::{bf16, f16};

/// SplitMix64, for reproducible pseudo-random bit patterns.
fn splitmix(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

fn random_f32(n: usize, seed: u64) -> Vec<f32> {
    let mut st = seed;
    (0..n)
        .map(|_| f32::from_bits((splitmix(&mut st) >> 32) as u32))
        .collect()
}

fn all_f16() -> Vec<f16> {
    (0..=u16::MAX).map(f16::from_bits).collect()
}

fn all_bf16() -> Vec<bf16> {
    (0..=u16::MAX).map(bf16::from_bits).collect()
}

fn f32_bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn f16_bits(v: &[f16]) -> Vec<u16> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn bf16_bits(v: &[bf16]) -> Vec<u16> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Asserts two bit vectors are equal, reporting the first difference rather than dumping
/// millions of elements.
fn assert_same<T: PartialEq + std::fmt::LowerHex>(got: &[T], want: &[T], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    if let Some(i) = (0..got.len()).find(|&i| got[i] != want[i]) {
        panic!(
            "{what}: element {i} differs: got {:#x}, want {:#x}",
            got[i], want[i]
        );
    }
}

// ----------------------------------------------------------------------------------------
// Exhaustive 16-bit patterns
// ----------------------------------------------------------------------------------------

#[test]
fn every_f16_round_trips_through_f32() {
    for h in all_f16() {
        let f = fp16_to_fp32(h);
        let back = fp32_to_fp16(f);
        if h.is_nan() {
            assert!(f.is_nan() && back.is_nan(), "{:#06x}", h.to_bits());
            // Quiet, same sign, and the payload bits below the quiet bit survive.
            assert_eq!(back.to_bits(), h.to_bits() | 0x0200);
        } else {
            assert_eq!(back.to_bits(), h.to_bits(), "{:#06x}", h.to_bits());
        }
    }
}

#[test]
fn every_f16_row_matches_scalar() {
    let src = all_f16();
    let mut row = vec![0f32; src.len()];
    fp16_to_fp32_row(&src, &mut row).unwrap();
    let scalar: Vec<f32> = src.iter().map(|&h| fp16_to_fp32(h)).collect();
    assert_same(&f32_bits(&row), &f32_bits(&scalar), "f16->f32 row");

    let mut back = vec![f16::ZERO; src.len()];
    fp32_to_fp16_row(&row, &mut back).unwrap();
    let scalar_back: Vec<f16> = row.iter().map(|&x| fp32_to_fp16(x)).collect();
    assert_same(&f16_bits(&back), &f16_bits(&scalar_back), "f32->f16 row");

    // And the single-threaded kernels agree too.
    let mut slice = vec![0f32; src.len()];
    fp16_to_fp32_slice(&src, &mut slice);
    assert_same(&f32_bits(&slice), &f32_bits(&scalar), "f16->f32 slice");
}

#[test]
fn every_bf16_round_trips_through_f32() {
    for b in all_bf16() {
        let f = bf16_to_fp32(b);
        let back = fp32_to_bf16(f);
        if b.is_nan() {
            assert!(f.is_nan() && back.is_nan(), "{:#06x}", b.to_bits());
            assert_eq!(back.to_bits(), b.to_bits() | 0x0040);
        } else {
            assert_eq!(back.to_bits(), b.to_bits(), "{:#06x}", b.to_bits());
            assert_eq!(f.to_bits(), u32::from(b.to_bits()) << 16);
        }
    }
}

#[test]
fn every_bf16_row_matches_scalar() {
    let src = all_bf16();
    let mut row = vec![0f32; src.len()];
    bf16_to_fp32_row(&src, &mut row).unwrap();
    let scalar: Vec<f32> = src.iter().map(|&b| bf16_to_fp32(b)).collect();
    assert_same(&f32_bits(&row), &f32_bits(&scalar), "bf16->f32 row");

    let mut back = vec![bf16::ZERO; src.len()];
    fp32_to_bf16_row(&row, &mut back).unwrap();
    let mut reference = vec![bf16::ZERO; src.len()];
    fp32_to_bf16_row_ref(&row, &mut reference).unwrap();
    assert_same(&bf16_bits(&back), &bf16_bits(&reference), "f32->bf16 row");
}

// ----------------------------------------------------------------------------------------
// Hand-computed edge values
// ----------------------------------------------------------------------------------------

/// (f32 bits, expected f16 bits, why)
const F16_CASES: &[(u32, u16, &str)] = &[
    (0x0000_0000, 0x0000, "+0"),
    (0x8000_0000, 0x8000, "-0"),
    (0x7f80_0000, 0x7c00, "+inf"),
    (0xff80_0000, 0xfc00, "-inf"),
    (0x3f80_0000, 0x3c00, "1.0"),
    (0xc000_0000, 0xc000, "-2.0"),
    (0x3dcc_cccd, 0x2e66, "0.1"),
    (0x477f_e000, 0x7bff, "65504 = f16 max"),
    (0x477f_e001, 0x7bff, "just above max, rounds down to max"),
    (0x477f_efff, 0x7bff, "just below 65520, rounds to max"),
    (0x477f_f000, 0x7c00, "65520: halfway, odd max -> even inf"),
    (0xc77f_f000, 0xfc00, "-65520 -> -inf"),
    (0x4780_0000, 0x7c00, "65536 overflows"),
    (0x7f7f_ffff, 0x7c00, "f32 max overflows"),
    (0x3880_0000, 0x0400, "2^-14 smallest normal"),
    (0x387f_c000, 0x03ff, "largest subnormal"),
    (
        0x387f_e000,
        0x0400,
        "halfway between largest subnormal (odd) and min normal",
    ),
    (0x387f_dfff, 0x03ff, "just below that halfway"),
    (0x3380_0000, 0x0001, "2^-24 smallest subnormal"),
    (0xb380_0000, 0x8001, "-2^-24"),
    (
        0x3300_0000,
        0x0000,
        "2^-25: halfway between 0 and 2^-24, ties to 0",
    ),
    (0xb300_0000, 0x8000, "-2^-25 -> -0"),
    (0x3300_0001, 0x0001, "just above 2^-25 rounds up"),
    (0x32ff_ffff, 0x0000, "just below 2^-25 rounds down"),
    (0x33c0_0000, 0x0002, "1.5 * 2^-24: halfway 1|2, ties to 2"),
    (0x3420_0000, 0x0002, "2.5 * 2^-24: halfway 2|3, ties to 2"),
    (0x3460_0000, 0x0004, "3.5 * 2^-24: halfway 3|4, ties to 4"),
    (0x0000_0001, 0x0000, "f32 smallest subnormal -> 0"),
    (0x8080_0000, 0x8000, "-f32 smallest normal -> -0"),
    (0x3f80_1000, 0x3c00, "1 + 2^-11: halfway, even lsb stays"),
    (0x3f80_1001, 0x3c01, "1 + 2^-11 + ulp rounds up"),
    (
        0x3f80_3000,
        0x3c02,
        "1 + 3*2^-11: halfway, odd lsb rounds up",
    ),
    (0x3f80_2fff, 0x3c01, "just below that halfway"),
    (0x3fff_f000, 0x4000, "carry from mantissa into exponent"),
    (
        0x4479_f000,
        0x63d0,
        "999.75 -> 999.5 or 1000? halfway, ties to even 1000",
    ),
];

#[test]
fn f32_to_f16_edge_values() {
    let src: Vec<f32> = F16_CASES.iter().map(|c| f32::from_bits(c.0)).collect();
    let mut row = vec![f16::ZERO; src.len()];
    fp32_to_fp16_row(&src, &mut row).unwrap();
    for (i, &(bits, want, why)) in F16_CASES.iter().enumerate() {
        let got = fp32_to_fp16(f32::from_bits(bits)).to_bits();
        assert_eq!(got, want, "scalar {why} ({bits:#010x}): got {got:#06x}");
        assert_eq!(row[i].to_bits(), want, "row {why} ({bits:#010x})");
    }
    // The same values through the 8-wide SIMD loop: repeat each one 8 times.
    let wide: Vec<f32> = src.iter().flat_map(|&x| [x; 8]).collect();
    let mut out = vec![f16::ZERO; wide.len()];
    fp32_to_fp16_slice(&wide, &mut out);
    for (i, o) in out.iter().enumerate() {
        assert_eq!(
            o.to_bits(),
            F16_CASES[i / 8].1,
            "simd {}",
            F16_CASES[i / 8].2
        );
    }
}

/// (f32 bits, expected bf16 bits, why)
const BF16_CASES: &[(u32, u16, &str)] = &[
    (0x0000_0000, 0x0000, "+0"),
    (0x8000_0000, 0x8000, "-0"),
    (0x7f80_0000, 0x7f80, "+inf"),
    (0xff80_0000, 0xff80, "-inf"),
    (0x3f80_0000, 0x3f80, "1.0"),
    (0x3dcc_cccd, 0x3dcd, "0.1"),
    (0x3f80_8000, 0x3f80, "halfway, even lsb stays"),
    (0x3f80_8001, 0x3f81, "just above halfway"),
    (0x3f81_8000, 0x3f82, "halfway, odd lsb rounds up"),
    (0x3f81_7fff, 0x3f81, "just below halfway"),
    (0xbf81_8000, 0xbf82, "negative halfway, odd"),
    (0x7f7f_0000, 0x7f7f, "bf16 max"),
    (0x7f7f_7fff, 0x7f7f, "just below halfway to inf stays max"),
    (0x7f7f_8000, 0x7f80, "halfway above max (odd) -> inf"),
    (0x7f7f_ffff, 0x7f80, "f32 max -> inf"),
    (0xff7f_ffff, 0xff80, "-f32 max -> -inf"),
    (0x7f7e_8000, 0x7f7e, "halfway below max, even stays"),
    (0x0080_0000, 0x0080, "f32 smallest normal is exact"),
    (0x0000_0001, 0x0000, "f32 smallest subnormal -> 0"),
    (0x0000_8000, 0x0000, "subnormal halfway 0|1 ties to 0"),
    (0x0000_8001, 0x0001, "just above that halfway"),
    (0x0001_0000, 0x0001, "bf16 smallest subnormal"),
    (0x0001_8000, 0x0002, "subnormal halfway 1|2 ties to 2"),
    (0x0002_8000, 0x0002, "subnormal halfway 2|3 ties to 2"),
    (
        0x007f_ffff,
        0x0080,
        "largest f32 subnormal rounds up to min normal",
    ),
    (0x807f_ffff, 0x8080, "negative of that"),
    (0x007f_7fff, 0x007f, "rounds down to largest bf16 subnormal"),
];

#[test]
fn f32_to_bf16_edge_values() {
    let src: Vec<f32> = BF16_CASES.iter().map(|c| f32::from_bits(c.0)).collect();
    let wide: Vec<f32> = src.iter().flat_map(|&x| [x; 16]).collect();
    let mut row = vec![bf16::ZERO; src.len()];
    let mut reference = vec![bf16::ZERO; src.len()];
    let mut simd = vec![bf16::ZERO; wide.len()];
    fp32_to_bf16_row(&src, &mut row).unwrap();
    fp32_to_bf16_row_ref(&src, &mut reference).unwrap();
    fp32_to_bf16_slice(&wide, &mut simd);
    for (i, &(bits, want, why)) in BF16_CASES.iter().enumerate() {
        let got = fp32_to_bf16(f32::from_bits(bits)).to_bits();
        assert_eq!(got, want, "scalar {why} ({bits:#010x}): got {got:#06x}");
        assert_eq!(row[i].to_bits(), want, "row {why}");
        assert_eq!(reference[i].to_bits(), want, "ref {why}");
        for j in 0..16 {
            assert_eq!(simd[i * 16 + j].to_bits(), want, "simd {why}");
        }
    }
}

#[test]
fn f16_and_bf16_to_f32_known_values() {
    let f16_cases: &[(u16, u32)] = &[
        (0x0000, 0x0000_0000),
        (0x8000, 0x8000_0000),
        (0x0001, 0x3380_0000), // 2^-24
        (0x8001, 0xb380_0000),
        (0x0003, 0x3440_0000), // 3 * 2^-24
        (0x03ff, 0x387f_c000), // largest subnormal
        (0x0400, 0x3880_0000), // 2^-14
        (0x3c00, 0x3f80_0000),
        (0x7bff, 0x477f_e000), // 65504
        (0x7c00, 0x7f80_0000),
        (0xfc00, 0xff80_0000),
        (0x7e00, 0x7fc0_0000), // quiet NaN
        (0x7c01, 0x7fc0_2000), // signalling NaN is quieted, payload kept
        (0xfd00, 0xffe0_0000), // negative signalling NaN
    ];
    let src: Vec<f16> = f16_cases.iter().map(|c| f16::from_bits(c.0)).collect();
    let wide: Vec<f16> = src.iter().flat_map(|&x| [x; 8]).collect();
    let mut simd = vec![0f32; wide.len()];
    fp16_to_fp32_slice(&wide, &mut simd);
    for (i, &(h, want)) in f16_cases.iter().enumerate() {
        assert_eq!(fp16_to_fp32(f16::from_bits(h)).to_bits(), want, "{h:#06x}");
        assert_eq!(simd[i * 8].to_bits(), want, "simd {h:#06x}");
    }

    let bf16_cases: &[(u16, u32)] = &[
        (0x0000, 0x0000_0000),
        (0x8000, 0x8000_0000),
        (0x0001, 0x0001_0000),
        (0x3f80, 0x3f80_0000),
        (0x7f7f, 0x7f7f_0000),
        (0x7f80, 0x7f80_0000),
        (0xff80, 0xff80_0000),
        (0x7fc0, 0x7fc0_0000),
        (0x7f81, 0x7fc1_0000), // signalling NaN is quieted, payload kept
        (0xff81, 0xffc1_0000),
    ];
    let src: Vec<bf16> = bf16_cases.iter().map(|c| bf16::from_bits(c.0)).collect();
    let wide: Vec<bf16> = src.iter().flat_map(|&x| [x; 16]).collect();
    let mut simd = vec![0f32; wide.len()];
    bf16_to_fp32_slice(&wide, &mut simd);
    for (i, &(b, want)) in bf16_cases.iter().enumerate() {
        assert_eq!(bf16_to_fp32(bf16::from_bits(b)).to_bits(), want, "{b:#06x}");
        assert_eq!(simd[i * 16].to_bits(), want, "simd {b:#06x}");
    }
}

#[test]
fn nans_stay_nan_and_become_quiet() {
    // (f32 bits, f16 bits, bf16 bits)
    let cases: &[(u32, u16, u16)] = &[
        (0x7fc0_0000, 0x7e00, 0x7fc0), // canonical quiet NaN
        (0xffc0_0000, 0xfe00, 0xffc0), // negative quiet NaN
        (0x7f80_0001, 0x7e00, 0x7fc0), // signalling, payload only in low bits
        (0xff80_0001, 0xfe00, 0xffc0),
        (0x7fa0_0000, 0x7f00, 0x7fe0), // signalling with a high payload bit
        (0x7f81_0000, 0x7e08, 0x7fc1), // payload bit 16
        (0x7fff_ffff, 0x7fff, 0x7fff), // all ones
    ];
    let src: Vec<f32> = cases
        .iter()
        .flat_map(|c| [f32::from_bits(c.0); 16])
        .collect();
    let mut h = vec![f16::ZERO; src.len()];
    let mut b = vec![bf16::ZERO; src.len()];
    fp32_to_fp16_row(&src, &mut h).unwrap();
    fp32_to_bf16_row(&src, &mut b).unwrap();
    for (i, &(bits, want_h, want_b)) in cases.iter().enumerate() {
        let x = f32::from_bits(bits);
        assert_eq!(fp32_to_fp16(x).to_bits(), want_h, "f16 scalar {bits:#010x}");
        assert_eq!(
            fp32_to_bf16(x).to_bits(),
            want_b,
            "bf16 scalar {bits:#010x}"
        );
        assert_eq!(h[i * 16].to_bits(), want_h, "f16 simd {bits:#010x}");
        assert_eq!(b[i * 16].to_bits(), want_b, "bf16 simd {bits:#010x}");
        assert!(fp16_to_fp32(f16::from_bits(want_h)).is_nan());
        assert!(bf16_to_fp32(bf16::from_bits(want_b)).is_nan());
    }
}

// ----------------------------------------------------------------------------------------
// SIMD rows against the scalar functions
// ----------------------------------------------------------------------------------------

#[test]
fn random_f32_rows_match_scalar_bit_for_bit() {
    const N: usize = 4 << 20; // four million random bit patterns, NaNs included
    let src = random_f32(N, 0xfe_ed_fa_ce);

    let mut h = vec![f16::ZERO; N];
    fp32_to_fp16_row(&src, &mut h).unwrap();
    let want: Vec<u16> = src.iter().map(|&x| fp32_to_fp16(x).to_bits()).collect();
    assert_same(&f16_bits(&h), &want, "f32->f16 random");

    let mut b = vec![bf16::ZERO; N];
    let mut r = vec![bf16::ZERO; N];
    fp32_to_bf16_row(&src, &mut b).unwrap();
    fp32_to_bf16_row_ref(&src, &mut r).unwrap();
    assert_same(&bf16_bits(&b), &bf16_bits(&r), "f32->bf16 random");
    let want: Vec<u16> = src.iter().map(|&x| fp32_to_bf16(x).to_bits()).collect();
    assert_same(&bf16_bits(&r), &want, "bf16 ref vs scalar");
}

#[test]
fn random_f32_near_f16_range_match_scalar() {
    // Concentrate on exponents where f16 rounding, subnormals and overflow happen.
    let mut st = 0xabcdef;
    let src: Vec<f32> = (0..1 << 20)
        .map(|_| {
            let r = splitmix(&mut st);
            let exp = 96 + ((r >> 8) % 50) as u32;
            f32::from_bits(((r >> 32) as u32 & 0x807f_ffff) | (exp << 23))
        })
        .collect();
    let mut h = vec![f16::ZERO; src.len()];
    fp32_to_fp16_row(&src, &mut h).unwrap();
    let want: Vec<u16> = src.iter().map(|&x| fp32_to_fp16(x).to_bits()).collect();
    assert_same(&f16_bits(&h), &want, "f32->f16 near range");
}

/// Runs all four row conversions on `src` and checks them against the scalar functions.
fn check_all_rows(src: &[f32]) {
    let n = src.len();
    let mut h = vec![f16::ZERO; n];
    fp32_to_fp16_row(src, &mut h).unwrap();
    let want_h: Vec<f16> = src.iter().map(|&x| fp32_to_fp16(x)).collect();
    assert_same(
        &f16_bits(&h),
        &f16_bits(&want_h),
        &format!("f32->f16 n={n}"),
    );

    let mut f = vec![0f32; n];
    fp16_to_fp32_row(&want_h, &mut f).unwrap();
    let want_f: Vec<f32> = want_h.iter().map(|&x| fp16_to_fp32(x)).collect();
    assert_same(
        &f32_bits(&f),
        &f32_bits(&want_f),
        &format!("f16->f32 n={n}"),
    );

    let mut b = vec![bf16::ZERO; n];
    fp32_to_bf16_row(src, &mut b).unwrap();
    let want_b: Vec<bf16> = src.iter().map(|&x| fp32_to_bf16(x)).collect();
    assert_same(
        &bf16_bits(&b),
        &bf16_bits(&want_b),
        &format!("f32->bf16 n={n}"),
    );

    fp32_to_bf16_row_ref(src, &mut b).unwrap();
    assert_same(&bf16_bits(&b), &bf16_bits(&want_b), &format!("ref n={n}"));

    bf16_to_fp32_row(&want_b, &mut f).unwrap();
    let want_f: Vec<f32> = want_b.iter().map(|&x| bf16_to_fp32(x)).collect();
    assert_same(
        &f32_bits(&f),
        &f32_bits(&want_f),
        &format!("bf16->f32 n={n}"),
    );
}

#[test]
fn odd_lengths_exercise_tails() {
    let big = random_f32(1_000_003 + 1, 42);
    for n in [
        0, 1, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 65, 1000, 1_000_003,
    ] {
        check_all_rows(&big[..n]);
        // Start one element in, so the rows are not aligned the way the allocator gave them.
        check_all_rows(&big[1..n + 1]);
    }
}

#[test]
fn tails_do_not_write_past_the_row() {
    // Convert into the middle of a larger buffer: elements outside must stay untouched.
    for n in [0, 1, 7, 9, 17, 33] {
        let src = random_f32(n, 7);
        let mut h = vec![f16::from_bits(0x5555); n + 2];
        fp32_to_fp16_slice(&src, &mut h[1..n + 1]);
        assert_eq!(h[0].to_bits(), 0x5555);
        assert_eq!(h[n + 1].to_bits(), 0x5555);
        let mut b = vec![bf16::from_bits(0x5555); n + 2];
        fp32_to_bf16_slice(&src, &mut b[1..n + 1]);
        assert_eq!((b[0].to_bits(), b[n + 1].to_bits()), (0x5555, 0x5555));
        let hs: Vec<f16> = vec![f16::ONE; n];
        let mut f = vec![-7.0f32; n + 2];
        fp16_to_fp32_slice(&hs, &mut f[1..n + 1]);
        assert_eq!((f[0], f[n + 1]), (-7.0, -7.0));
        let bs: Vec<bf16> = vec![bf16::ONE; n];
        bf16_to_fp32_slice(&bs, &mut f[1..n + 1]);
        assert_eq!((f[0], f[n + 1]), (-7.0, -7.0));
    }
}

#[test]
fn threaded_path_matches_scalar() {
    // Pools of several sizes, including ones whose chunk count does not divide the row.
    let src = random_f32((1 << 20) + 37, 99);
    for threads in [1, 2, 3, 5] {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        pool.install(|| {
            check_all_rows(&src);
            check_all_rows(&src[3..]);
        });
    }
    // The threshold itself and one below it.
    check_all_rows(&src[..PARALLEL_MIN_ELEMS]);
    check_all_rows(&src[..PARALLEL_MIN_ELEMS - 1]);
}

// ----------------------------------------------------------------------------------------
// Errors and the CPU utility forms
// ----------------------------------------------------------------------------------------

fn assert_shape_err(r: ferrograph::Result<()>, a: usize, b: usize) {
    match r {
        Err(Error::ShapeMismatch { message: msg, .. }) => {
            assert!(
                msg.contains(&a.to_string()) && msg.contains(&b.to_string()),
                "message should name both lengths: {msg}"
            );
        }
        other => panic!("expected a shape error, got {other:?}"),
    }
}

#[test]
fn length_mismatch_is_a_shape_error() {
    let f = vec![0f32; 5];
    let mut f_out = vec![0f32; 3];
    let h = vec![f16::ZERO; 3];
    let mut h_out = vec![f16::ZERO; 4];
    let b = vec![bf16::ZERO; 3];
    let mut b_out = vec![bf16::ZERO; 4];
    let mut i_out = vec![0i32; 6];
    assert_shape_err(fp32_to_fp16_row(&f, &mut h_out), 5, 4);
    assert_shape_err(fp16_to_fp32_row(&h, &mut f_out[..2]), 3, 2);
    assert_shape_err(fp32_to_bf16_row(&f, &mut b_out), 5, 4);
    assert_shape_err(fp32_to_bf16_row_ref(&f, &mut b_out), 5, 4);
    assert_shape_err(bf16_to_fp32_row(&b, &mut f_out[..1]), 3, 1);
    assert_shape_err(cpu_fp32_to_fp32(&f, &mut f_out), 5, 3);
    assert_shape_err(cpu_fp32_to_i32(&f, &mut i_out), 5, 6);
    assert_shape_err(cpu_fp32_to_fp16(&f, &mut h_out), 5, 4);
    assert_shape_err(cpu_fp16_to_fp32(&h, &mut f_out[..2]), 3, 2);
    assert_shape_err(cpu_fp32_to_bf16(&f, &mut b_out), 5, 4);
    assert_shape_err(cpu_bf16_to_fp32(&b, &mut f_out[..1]), 3, 1);
    // Nothing was written on error.
    assert!(h_out.iter().all(|x| x.to_bits() == 0));
    assert!(i_out.iter().all(|&x| x == 0));
}

#[test]
fn cpu_fp32_to_i32_truncates_and_saturates() {
    let src = [
        0.0,
        -0.0,
        1.9,
        -1.9,
        2.5,
        -2.5,
        1e10,
        -1e10,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
        -f32::NAN,
        2147483520.0, // largest f32 below 2^31
        2147483648.0, // 2^31 saturates
        -2147483648.0,
        1e-40,
    ];
    let want = [
        0,
        0,
        1,
        -1,
        2,
        -2,
        i32::MAX,
        i32::MIN,
        i32::MAX,
        i32::MIN,
        0,
        0,
        2147483520,
        i32::MAX,
        i32::MIN,
        0,
    ];
    let mut dst = [7i32; 16];
    cpu_fp32_to_i32(&src, &mut dst).unwrap();
    assert_eq!(dst, want);
}

#[test]
fn cpu_forms_match_rows() {
    let src = random_f32(1001, 5);
    let mut copy = vec![0f32; src.len()];
    cpu_fp32_to_fp32(&src, &mut copy).unwrap();
    assert_same(&f32_bits(&copy), &f32_bits(&src), "copy");

    let mut a = vec![f16::ZERO; src.len()];
    let mut b = vec![f16::ZERO; src.len()];
    cpu_fp32_to_fp16(&src, &mut a).unwrap();
    fp32_to_fp16_row(&src, &mut b).unwrap();
    assert_same(&f16_bits(&a), &f16_bits(&b), "cpu f16");
    let mut fa = vec![0f32; src.len()];
    let mut fb = vec![0f32; src.len()];
    cpu_fp16_to_fp32(&a, &mut fa).unwrap();
    fp16_to_fp32_row(&a, &mut fb).unwrap();
    assert_same(&f32_bits(&fa), &f32_bits(&fb), "cpu f16->f32");

    let mut c = vec![bf16::ZERO; src.len()];
    let mut d = vec![bf16::ZERO; src.len()];
    cpu_fp32_to_bf16(&src, &mut c).unwrap();
    fp32_to_bf16_row(&src, &mut d).unwrap();
    assert_same(&bf16_bits(&c), &bf16_bits(&d), "cpu bf16");
    cpu_bf16_to_fp32(&c, &mut fa).unwrap();
    bf16_to_fp32_row(&c, &mut fb).unwrap();
    assert_same(&f32_bits(&fa), &f32_bits(&fb), "cpu bf16->f32");
}

#[test]
fn simd_path_is_reported() {
    let p = simd_path();
    assert!(["avx2+f16c", "neon", "scalar"].contains(&p), "{p}");
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2")
        && std::arch::is_x86_feature_detected!("f16c")
        && std::arch::is_x86_feature_detected!("fma")
    {
        assert_eq!(p, "avx2+f16c");
    }
    #[cfg(target_arch = "aarch64")]
    assert_eq!(p, "neon");
}

/// Every one of the 2^32 f32 bit patterns through the SIMD rows, against the scalar
/// functions. Slow in a debug build; run it with
/// `cargo test --release --test convert -- --ignored`.
#[test]
#[ignore]
fn exhaustive_f32_patterns_match_scalar() {
    const BLOCK: usize = 1 << 24;
    let mut src = vec![0f32; BLOCK];
    let mut h = vec![f16::ZERO; BLOCK];
    let mut b = vec![bf16::ZERO; BLOCK];
    for block in 0..(1u64 << 32) / BLOCK as u64 {
        let base = (block * BLOCK as u64) as u32;
        for (i, x) in src.iter_mut().enumerate() {
            *x = f32::from_bits(base + i as u32);
        }
        fp32_to_fp16_row(&src, &mut h).unwrap();
        fp32_to_bf16_row(&src, &mut b).unwrap();
        for i in 0..BLOCK {
            let x = src[i];
            assert_eq!(
                h[i].to_bits(),
                fp32_to_fp16(x).to_bits(),
                "{:#x}",
                x.to_bits()
            );
            assert_eq!(
                b[i].to_bits(),
                fp32_to_bf16(x).to_bits(),
                "{:#x}",
                x.to_bits()
            );
        }
    }
}

/// The streaming-store forms (used above `STREAM_MIN_BYTES`) at odd lengths and misaligned
/// starts, against the scalar functions.
#[test]
fn streaming_path_matches_scalar() {
    // Just past the threshold for f32 -> f16 (6 bytes per element).
    let n = STREAM_MIN_BYTES / 6 + 77;
    let src = random_f32(n + 3, 2024);
    for start in [0, 1, 3] {
        let s = &src[start..start + n];
        let mut h = vec![f16::ZERO; n + 1];
        // A destination that starts 2 bytes past the allocation's alignment.
        fp32_to_fp16_slice(s, &mut h[1..]);
        let want: Vec<u16> = s.iter().map(|&x| fp32_to_fp16(x).to_bits()).collect();
        assert_same(&f16_bits(&h[1..]), &want, "f32->f16 streaming");
        let mut b = vec![bf16::ZERO; n + 1];
        fp32_to_bf16_slice(s, &mut b[1..]);
        let want: Vec<u16> = s.iter().map(|&x| fp32_to_bf16(x).to_bits()).collect();
        assert_same(&bf16_bits(&b[1..]), &want, "f32->bf16 streaming");

        let hs: Vec<f16> = s
            .iter()
            .map(|&x| f16::from_bits(x.to_bits() as u16))
            .collect();
        let mut f = vec![0f32; n + 1];
        fp16_to_fp32_slice(&hs, &mut f[1..]);
        let want: Vec<u32> = hs.iter().map(|&x| fp16_to_fp32(x).to_bits()).collect();
        assert_same(&f32_bits(&f[1..]), &want, "f16->f32 streaming");
        let bs: Vec<bf16> = s
            .iter()
            .map(|&x| bf16::from_bits(x.to_bits() as u16))
            .collect();
        bf16_to_fp32_slice(&bs, &mut f[1..]);
        let want: Vec<u32> = bs.iter().map(|&x| bf16_to_fp32(x).to_bits()).collect();
        assert_same(&f32_bits(&f[1..]), &want, "bf16->f32 streaming");
    }
}

/// The SIMD kernels ignore MXCSR: with flush-to-zero, denormals-are-zero and round-toward-zero
/// set on this thread they still give the scalar (round-to-nearest-even, no flushing) bits.
#[cfg(target_arch = "x86_64")]
#[test]
#[allow(deprecated)] // _mm_getcsr/_mm_setcsr: there is no other way to set MXCSR
fn simd_ignores_mxcsr_modes() {
    use std::arch::x86_64::{_mm_getcsr, _mm_setcsr};
    let mut src: Vec<f32> = F16_CASES
        .iter()
        .chain(BF16_CASES)
        .map(|c| f32::from_bits(c.0))
        .collect();
    src.extend(random_f32(10_000, 77));
    src.extend((0..4096u32).map(|i| f32::from_bits(i * 0x101 + 1))); // f32 subnormals
    let h_in: Vec<f16> = (0..=u16::MAX).map(f16::from_bits).collect();
    let b_in: Vec<bf16> = (0..=u16::MAX).map(bf16::from_bits).collect();

    let mut h = vec![f16::ZERO; src.len()];
    let mut b = vec![bf16::ZERO; src.len()];
    let mut fh = vec![0f32; h_in.len()];
    let mut fb = vec![0f32; b_in.len()];
    // SAFETY: MXCSR is per thread; it is restored below before anything else runs here.
    let saved = unsafe { _mm_getcsr() };
    // FTZ (bit 15), DAZ (bit 6), rounding control = toward zero (bits 13-14).
    // SAFETY: changes only this thread's MXCSR, restored below; no memory is touched.
    unsafe { _mm_setcsr(saved | 0x8000 | 0x0040 | 0x6000) };
    fp32_to_fp16_slice(&src, &mut h);
    fp32_to_bf16_slice(&src, &mut b);
    fp16_to_fp32_slice(&h_in, &mut fh);
    bf16_to_fp32_slice(&b_in, &mut fb);
    // SAFETY: restores this thread's original MXCSR.
    unsafe { _mm_setcsr(saved) };

    let want: Vec<u16> = src.iter().map(|&x| fp32_to_fp16(x).to_bits()).collect();
    assert_same(&f16_bits(&h), &want, "f32->f16 under FTZ/DAZ/RZ");
    let want: Vec<u16> = src.iter().map(|&x| fp32_to_bf16(x).to_bits()).collect();
    assert_same(&bf16_bits(&b), &want, "f32->bf16 under FTZ/DAZ/RZ");
    let want: Vec<u32> = h_in.iter().map(|&x| fp16_to_fp32(x).to_bits()).collect();
    assert_same(&f32_bits(&fh), &want, "f16->f32 under FTZ/DAZ/RZ");
    let want: Vec<u32> = b_in.iter().map(|&x| bf16_to_fp32(x).to_bits()).collect();
    assert_same(&f32_bits(&fb), &want, "bf16->f32 under FTZ/DAZ/RZ");
}
