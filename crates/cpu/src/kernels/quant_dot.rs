//! Dot products (f32, q8_0·q8_0, q4_0·q8_0) and the kernels' own q8_0/q4_0 block codecs.
//!
//! Blocks follow ggml's layout byte for byte: q8_0 is an f16 scale `d` then 32 signed bytes;
//! q4_0 is an f16 scale then 16 bytes whose low nibble holds element `j` and high nibble
//! element `j + 16`, offset by 8. Quantization follows ggml's reference rounding. The SIMD
//! paths use AVX2/FMA when the CPU has them (checked at run time); the scalar paths are the
//! reference.
//!
//! The q4_0 mat-vec kernel (`dot_q4_0_pairs`) reads activations prepared once per product in
//! its own lane order (`prepare_q4_pairs`), so that two q4_0 blocks take one 512-bit
//! `vpdpbusd` (or two 256-bit `maddubs`), with the nibbles' offset folded in; its arithmetic
//! is defined lane by lane and its portable, AVX2 and AVX-512 VNNI versions give identical
//! bits.

use half::f16;

use crate::dtype::DType;
use crate::error::Result;
use crate::kernels::block_dot::DotColsFn;

/// Elements per q8_0 / q4_0 block.
pub const QK: usize = 32;
/// Bytes of one q8_0 block.
pub const Q8_0_BYTES: usize = 2 + QK;
/// Bytes of one q4_0 block.
pub const Q4_0_BYTES: usize = 2 + QK / 2;

/// Exact f16 → f32 conversion of raw bits without a function call or table (F. Giesen's
/// branch-light method); handles zeros, subnormals, infinities and NaN.
#[inline(always)]
pub fn f16_bits_to_f32(h: u16) -> f32 {
    let magic = f32::from_bits(113 << 23);
    let shifted_exp = 0x7c00u32 << 13;
    let mut o = ((h as u32) & 0x7fff) << 13;
    let exp = shifted_exp & o;
    o += (127 - 15) << 23;
    if exp == shifted_exp {
        o += (128 - 16) << 23;
    } else if exp == 0 {
        o += 1 << 23;
        o = (f32::from_bits(o) - magic).to_bits();
    }
    f32::from_bits(o | (((h as u32) & 0x8000) << 16))
}

#[inline(always)]
fn read_d(block: &[u8]) -> f32 {
    f16_bits_to_f32(u16::from_ne_bytes([block[0], block[1]]))
}

fn write_d(block: &mut [u8], d: f32) {
    block[..2].copy_from_slice(&f16::from_f32(d).to_bits().to_ne_bytes());
}

/// Quantizes `x` (a multiple of 32 values) into q8_0 blocks in `out` (ggml's reference
/// rounding; the AVX2 form gives the same bytes).
pub fn quantize_row_q8_0(x: &[f32], out: &mut [u8]) {
    #[cfg(target_arch = "x86_64")]
    if crate::isa::get().avx2_fma_f16c() {
        // SAFETY: AVX2 was detected at run time.
        unsafe { x86::quantize_blocks::<false>(x, out) };
        return;
    }
    quantize_row_q8_0_ref(x, out);
}

/// [`quantize_row_q8_0`] in scalar code: the reference.
pub fn quantize_row_q8_0_ref(x: &[f32], out: &mut [u8]) {
    for (xs, block) in x.chunks_exact(QK).zip(out.chunks_exact_mut(Q8_0_BYTES)) {
        // A NaN in the block makes the scale NaN, so the products it enters are NaN too
        // (`f32::max` alone would skip it and quantize the block as if it were finite).
        let amax = xs.iter().fold(0f32, |m, v| {
            if m.is_nan() || v.is_nan() {
                f32::NAN
            } else {
                m.max(v.abs())
            }
        });
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        write_d(block, d);
        for (q, &v) in block[2..].iter_mut().zip(xs) {
            *q = crate::quant::round_to_i8(v * id) as u8;
        }
    }
}

/// One f32 row into `dtype` with this CPU's fastest codec: the vectorised q8_0/q8_1 quantizers
/// below (the references' bytes), else the type's reference codec. The CPU's `from_float` and
/// the products' activation rows both quantize through it. Errors as the reference codec does
/// (a length that is no whole number of blocks, `out` of another size).
pub fn quantize_row(dtype: DType, x: &[f32], out: &mut [u8]) -> Result<()> {
    let fast: fn(&[f32], &mut [u8]) = match dtype {
        DType::Q8_0 => quantize_row_q8_0,
        DType::Q8_1 => quantize_row_q8_1,
        _ => return dtype.row_from_f32(x, out),
    };
    dtype.check_row_bytes(x.len(), out.len())?;
    fast(x, out);
    Ok(())
}

/// Quantizes `x` (a multiple of 32 values) into q8_1 blocks in `out`: the same bytes as the
/// reference codec (`DType::Q8_1`'s), with AVX2 where the CPU has it. The mat-vec products of
/// q4_1/q5_1 weights quantize their activation row with it on every call, where the scalar
/// form took 2 µs of a 576-wide row's 8 µs product.
pub fn quantize_row_q8_1(x: &[f32], out: &mut [u8]) {
    #[cfg(target_arch = "x86_64")]
    if crate::isa::get().avx2_fma_f16c() {
        // SAFETY: AVX2 was detected at run time.
        unsafe { x86::quantize_blocks::<true>(x, out) };
        return;
    }
    crate::quant::legacy::quantize_row_q8_1(x, out);
}

super::simd_fn! {
    /// Dequantizes q8_0 blocks into `out` (a multiple of 32 values). Compiled 8 lanes wide
    /// where the CPU has AVX2 (the same products, so the same bits): the weights of products
    /// with more than a couple of columns are converted a panel at a time, and the 4-lane
    /// baseline build took 0.17 ns per value against 0.07 (Zen 3), a third of the f32 tiles'
    /// work at 16 columns.
    pub fn dequantize_row_q8_0(blocks: &[u8], out: &mut [f32]) {
        for (ys, block) in out
            .chunks_exact_mut(QK)
            .zip(blocks.chunks_exact(Q8_0_BYTES))
        {
            let d = read_d(block);
            for (y, &q) in ys.iter_mut().zip(&block[2..]) {
                *y = (q as i8) as f32 * d;
            }
        }
    }
}

/// Quantizes `x` into q4_0 blocks (ggml's reference: the value of largest magnitude maps to −8).
pub fn quantize_row_q4_0(x: &[f32], out: &mut [u8]) {
    for (xs, block) in x.chunks_exact(QK).zip(out.chunks_exact_mut(Q4_0_BYTES)) {
        let mut amax = 0f32;
        let mut max = 0f32;
        for &v in xs {
            if amax < v.abs() {
                amax = v.abs();
                max = v;
            }
        }
        let d = max / -8.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        write_d(block, d);
        for j in 0..QK / 2 {
            let x0 = ((xs[j] * id + 8.5) as i8).min(15) as u8;
            let x1 = ((xs[j + QK / 2] * id + 8.5) as i8).min(15) as u8;
            block[2 + j] = x0 | (x1 << 4);
        }
    }
}

super::simd_fn! {
    /// Dequantizes q4_0 blocks into `out` (8 lanes wide with AVX2, as q8_0's).
    pub fn dequantize_row_q4_0(blocks: &[u8], out: &mut [f32]) {
        for (ys, block) in out
            .chunks_exact_mut(QK)
            .zip(blocks.chunks_exact(Q4_0_BYTES))
        {
            let d = read_d(block);
            for j in 0..QK / 2 {
                let q = block[2 + j];
                ys[j] = ((q & 0x0f) as i32 - 8) as f32 * d;
                ys[j + QK / 2] = ((q >> 4) as i32 - 8) as f32 * d;
            }
        }
    }
}

/// Dot product of `a` (widened to f32 by `widen`) with `b`, with 8 accumulators: the
/// scalar reference shared by the f32 and f16 kernels.
fn dot_widened_ref<T: Copy>(a: &[T], b: &[f32], widen: impl Fn(T) -> f32) -> f32 {
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let mut acc = [0f32; 8];
    let mut ca = a.chunks_exact(8);
    let mut cb = b.chunks_exact(8);
    for (x, y) in (&mut ca).zip(&mut cb) {
        for k in 0..8 {
            acc[k] += widen(x[k]) * y[k];
        }
    }
    let mut sum: f32 = acc.iter().sum();
    for (&x, y) in ca.remainder().iter().zip(cb.remainder()) {
        sum += widen(x) * y;
    }
    sum
}

/// f32 dot product, scalar reference with 8 accumulators.
pub fn dot_f32_ref(a: &[f32], b: &[f32]) -> f32 {
    dot_widened_ref(a, b, |x| x)
}

/// f32 dot product, SIMD when available.
pub fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if crate::isa::get().avx2_fma() {
        // SAFETY: AVX2 and FMA were detected at run time.
        return unsafe { x86::dot_f32(a, b) };
    }
    dot_f32_ref(a, b)
}

/// f16 (as raw bits) · f32 dot product, scalar reference with 8 accumulators.
pub fn dot_f16_f32_ref(a: &[u16], b: &[f32]) -> f32 {
    dot_widened_ref(a, b, f16_bits_to_f32)
}

/// bf16 bits widened to f32 (exact: the bits shifted into place).
pub(crate) fn bf16_bits_widened(h: u16) -> f32 {
    f32::from_bits(u32::from(h) << 16)
}

/// bf16 (as raw bits) · f32 dot product, scalar reference with 8 accumulators.
pub fn dot_bf16_f32_ref(a: &[u16], b: &[f32]) -> f32 {
    dot_widened_ref(a, b, bf16_bits_widened)
}

/// bf16 · f32 dot product (weights read as bf16, widened in registers: no f32 copy), SIMD when
/// available.
pub fn dot_bf16_f32(a: &[u16], b: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if has_f16c() {
        // SAFETY: AVX2, FMA and F16C were detected at run time.
        return unsafe { x86::dot_bf16_f32(a, b) };
    }
    dot_bf16_f32_ref(a, b)
}

/// Whether the AVX512-VNNI q4_0 dot product (256-bit `vpdpbusd`, which needs AVX512-VL too,
/// besides the AVX2/FMA/F16C of the rest of the kernel) can run on this CPU.
fn has_avx512_vnni() -> bool {
    crate::isa::get().avx512_vnni_vl_avx2_f16c()
}

/// Whether the CPU has AVX2, FMA and F16C (the F16C paths of [`dot_f16_f32`] and of the
/// attention's f16 rows).
pub(crate) fn has_f16c() -> bool {
    crate::isa::get().avx2_fma_f16c()
}

/// f16 · f32 dot product (weights read as f16, no f32 copy), SIMD when available.
pub fn dot_f16_f32(a: &[u16], b: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if has_f16c() {
        // SAFETY: AVX2, FMA and F16C were detected at run time.
        return unsafe { x86::dot_f16_f32(a, b) };
    }
    dot_f16_f32_ref(a, b)
}

/// q8_0 · q8_0 over whole blocks, scalar reference (integer products per block).
pub fn dot_q8_0_q8_0_ref(a: &[u8], b: &[u8]) -> f32 {
    let mut sum = 0f32;
    for (x, y) in a.chunks_exact(Q8_0_BYTES).zip(b.chunks_exact(Q8_0_BYTES)) {
        let mut isum = 0i32;
        for k in 0..QK {
            isum += (x[2 + k] as i8) as i32 * (y[2 + k] as i8) as i32;
        }
        sum += isum as f32 * (read_d(x) * read_d(y));
    }
    sum
}

/// q4_0 · q8_0 over whole blocks, scalar reference.
pub fn dot_q4_0_q8_0_ref(a: &[u8], b: &[u8]) -> f32 {
    let mut sum = 0f32;
    for (x, y) in a.chunks_exact(Q4_0_BYTES).zip(b.chunks_exact(Q8_0_BYTES)) {
        let mut isum = 0i32;
        for j in 0..QK / 2 {
            let q = x[2 + j];
            isum += ((q & 0x0f) as i32 - 8) * (y[2 + j] as i8) as i32;
            isum += ((q >> 4) as i32 - 8) * (y[2 + j + QK / 2] as i8) as i32;
        }
        sum += isum as f32 * (read_d(x) * read_d(y));
    }
    sum
}

/// q8_0 · q8_0, SIMD when available.
pub fn dot_q8_0_q8_0(a: &[u8], b: &[u8]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if has_f16c() {
        // SAFETY: AVX2, FMA and F16C were detected at run time.
        return unsafe { x86::dot_q8_0_q8_0(a, b) };
    }
    dot_q8_0_q8_0_ref(a, b)
}

/// q4_0 · q8_0, SIMD when available.
pub fn dot_q4_0_q8_0(a: &[u8], b: &[u8]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if has_avx512_vnni() {
        // SAFETY: AVX2, FMA, F16C, AVX512-VNNI and AVX512-VL were detected at run time.
        return unsafe { x86::dot_q4_0_q8_0_vnni(a, b) };
    }
    #[cfg(target_arch = "x86_64")]
    if has_f16c() {
        // SAFETY: AVX2, FMA and F16C were detected at run time.
        return unsafe { x86::dot_q4_0_q8_0(a, b) };
    }
    dot_q4_0_q8_0_ref(a, b)
}

/// The product of one q8_0 weight row with `C` q8_0 activation rows at once (each weight block
/// loaded once for all of them; column `c` has the bits of [`dot_q8_0_q8_0`] with `ys[c]`),
/// on CPUs with AVX-512F/BW and VNNI.
pub fn dot_q8_0_cols_fn<const C: usize>() -> Option<DotColsFn<C>> {
    #[cfg(target_arch = "x86_64")]
    if has_vnni512() && has_f16c() {
        return Some(columns_entry::q8_0::<C>);
    }
    None
}

/// The product of one q4_0 weight row with `C` activation rows prepared by
/// [`prepare_q4_pairs`] at once (each pair of blocks unpacked once for all of them; column
/// `c` has the bits of [`dot_q4_0_pairs`] with `ys[c]`), on CPUs with AVX-512F/BW and VNNI.
pub fn dot_q4_0_pairs_cols_fn<const C: usize>() -> Option<DotColsFn<C>> {
    #[cfg(target_arch = "x86_64")]
    if has_vnni512() && has_f16c() {
        return Some(columns_entry::q4_0_pairs::<C>);
    }
    None
}

/// Safe entry points to the several-column kernels, handed out only after the checks above.
#[cfg(target_arch = "x86_64")]
mod columns_entry {
    use super::{columns, PAIR_BYTES, Q4_0_BYTES};

    pub(super) fn q8_0<const C: usize>(a: &[u8], ys: [&[u8]; C]) -> [f32; C] {
        // SAFETY: only `dot_q8_0_cols_fn` hands this out, once AVX-512F/BW/VNNI, AVX2, FMA
        // and F16C are confirmed; the kernel reads only the blocks every row holds.
        unsafe { columns::q8_0_cols(a, ys) }
    }

    pub(super) fn q4_0_pairs<const C: usize>(a: &[u8], ys: [&[u8]; C]) -> [f32; C] {
        let pairs = (a.len() / Q4_0_BYTES).div_ceil(2);
        assert!(
            ys.iter().all(|y| y.len() >= pairs * PAIR_BYTES),
            "prepared q4_0 activation rows shorter than the weight row"
        );
        // SAFETY: only `dot_q4_0_pairs_cols_fn` hands this out, once the kernel's features are
        // confirmed; every row of `ys` holds the weight row's pairs (asserted above).
        unsafe { columns::q4_0_pairs_cols(a, ys) }
    }
}

#[cfg(target_arch = "x86_64")]
mod columns;

/// Bytes per pair of blocks of an activation row prepared for [`dot_q4_0_pairs`]: 64 quant
/// bytes, 16 i32 offset corrections, 16 f32 scales.
pub const PAIR_BYTES: usize = 192;

/// Bytes of one activation row of `k` elements prepared for [`dot_q4_0_pairs`].
pub fn q4_pairs_row_bytes(k: usize) -> usize {
    (k / QK).div_ceil(2) * PAIR_BYTES
}

/// The block (0 or 1 of a pair) and the element offset inside the block of the 16 bytes of
/// chunk `c` (0..4) of a pair's lanes: chunks hold elements 0..16 of block 0, 0..16 of block
/// 1, 16..32 of block 0, 16..32 of block 1 — the order in which the 512-bit kernel unpacks
/// two q4_0 blocks (low nibbles of both, then high nibbles of both).
fn pair_chunk(c: usize) -> (usize, usize) {
    (c & 1, (c >> 1) * 16)
}

/// Quantizes the f32 row `x` (a multiple of 32 values) to q8_0 (the rounding of
/// [`quantize_row_q8_0`]) in the lane layout of [`dot_q4_0_pairs`]: per pair of blocks, the
/// quants in chunk order (see [`pair_chunk`]), per lane `−8 ·` the sum of its four quants (the
/// nibbles' offset, folded in as the integer sum's starting value), and per lane its block's
/// scale. An odd last block is paired with zeros.
pub fn prepare_q4_pairs(x: &[f32], out: &mut [u8]) {
    let nb = x.len() / QK;
    let mut blocks = [[0u8; Q8_0_BYTES]; 2];
    for (p, pair) in out[..q4_pairs_row_bytes(x.len())]
        .chunks_exact_mut(PAIR_BYTES)
        .enumerate()
    {
        let mut d = [0f32; 2];
        for h in 0..2 {
            let b = 2 * p + h;
            if b < nb {
                quantize_row_q8_0(&x[b * QK..(b + 1) * QK], &mut blocks[h]);
                d[h] = read_d(&blocks[h]);
            } else {
                blocks[h] = [0; Q8_0_BYTES];
            }
        }
        let (quants, rest) = pair.split_at_mut(64);
        let (comp, scales) = rest.split_at_mut(64);
        for c in 0..4 {
            let (h, at) = pair_chunk(c);
            quants[16 * c..16 * c + 16].copy_from_slice(&blocks[h][2 + at..2 + at + 16]);
            for g in 0..4 {
                let lane = 4 * c + g;
                let sum: i32 = quants[4 * lane..4 * lane + 4]
                    .iter()
                    .map(|&q| i32::from(q as i8))
                    .sum();
                comp[4 * lane..4 * lane + 4].copy_from_slice(&(-8 * sum).to_ne_bytes());
                scales[4 * lane..4 * lane + 4].copy_from_slice(&d[h].to_ne_bytes());
            }
        }
    }
}

/// Sums 16 lanes in the fixed order of the 512-bit kernel: halves, then quarters, ...
fn reduce16(acc: &[f32; 16]) -> f32 {
    let mut t = *acc;
    for width in [8, 4, 2, 1] {
        for i in 0..width {
            t[i] += t[i + width];
        }
    }
    t[0]
}

/// q4_0 weight row `a` · activation row `y` prepared by [`prepare_q4_pairs`], portable: per
/// pair of blocks and lane `l` (4 elements of one block), the exact integer sum
/// `Σ nibble · y − 8 Σ y`, then `acc[l] = fma(sum, dx · dy, acc[l])`; the 16 lanes are summed
/// by [`reduce16`]. Every path computes exactly this.
#[inline(always)]
fn dot_q4_0_pairs_portable(a: &[u8], y: &[u8]) -> f32 {
    let nb = a.len() / Q4_0_BYTES;
    let mut acc = [0f32; 16];
    for (p, pair) in y.chunks_exact(PAIR_BYTES).take(nb.div_ceil(2)).enumerate() {
        let dx: [f32; 2] = std::array::from_fn(|h| {
            let b = 2 * p + h;
            if b < nb {
                read_d(&a[b * Q4_0_BYTES..])
            } else {
                0.0
            }
        });
        for (lane, slot) in acc.iter_mut().enumerate() {
            let (h, at) = pair_chunk(lane / 4);
            let b = 2 * p + h;
            let word = |o: usize| {
                i32::from_ne_bytes(pair[o + 4 * lane..o + 4 * lane + 4].try_into().expect("4"))
            };
            let mut sum = word(64);
            if b < nb {
                let x = &a[b * Q4_0_BYTES + 2..(b + 1) * Q4_0_BYTES];
                for t in 0..4 {
                    let j = at + 4 * (lane % 4) + t;
                    let nib = if j < 16 { x[j] & 15 } else { x[j - 16] >> 4 };
                    sum += i32::from(nib) * i32::from(pair[4 * lane + t] as i8);
                }
            }
            let dy = f32::from_bits(word(128) as u32);
            *slot = (sum as f32).mul_add(dx[h] * dy, *slot);
        }
    }
    reduce16(&acc)
}

/// The kernel families of [`dot_q4_0_pairs_with`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PairsIsa {
    /// Portable Rust.
    Portable,
    /// AVX2: the 16 lanes as two 256-bit halves, `maddubs` + `madd` for each half's sums.
    Avx2,
    /// AVX-512 with VNNI: two blocks per 512-bit `vpdpbusd`.
    Vnni512,
}

impl PairsIsa {
    /// Every family this CPU runs, slowest first.
    pub fn available() -> Vec<PairsIsa> {
        let mut out = vec![PairsIsa::Portable];
        if has_f16c() {
            out.push(PairsIsa::Avx2);
        }
        if has_vnni512() {
            out.push(PairsIsa::Vnni512);
        }
        out
    }

    /// The fastest family this CPU runs (detected once).
    pub fn best() -> PairsIsa {
        use std::sync::OnceLock;
        static BEST: OnceLock<PairsIsa> = OnceLock::new();
        *BEST.get_or_init(|| *PairsIsa::available().last().unwrap_or(&PairsIsa::Portable))
    }
}

/// Whether the 512-bit VNNI kernels can run on this CPU.
fn has_vnni512() -> bool {
    crate::isa::get().avx512_bw_vnni_f16c()
}

/// q4_0 row `a` · prepared activation row `y` (see [`dot_q4_0_pairs_portable`] for the
/// arithmetic) with the kernels of `isa` (one of [`PairsIsa::available`]).
pub fn dot_q4_0_pairs_with(isa: PairsIsa, a: &[u8], y: &[u8]) -> f32 {
    let nb = a.len() / Q4_0_BYTES;
    assert!(y.len() >= nb.div_ceil(2) * PAIR_BYTES);
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: chosen only when the CPU has the features; `y` holds the row's pairs.
        PairsIsa::Vnni512 => unsafe { x86::dot_q4_0_pairs(a, y) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: chosen only when the CPU has AVX2, FMA and F16C.
        PairsIsa::Avx2 => unsafe { x86::dot_q4_0_pairs_avx2(a, y) },
        #[allow(unreachable_patterns)]
        _ => dot_q4_0_pairs_portable(a, y),
    }
}

/// q4_0 row · prepared activation row with the fastest kernel this CPU runs.
pub fn dot_q4_0_pairs(a: &[u8], y: &[u8]) -> f32 {
    dot_q4_0_pairs_with(PairsIsa::best(), a, y)
}

#[cfg(target_arch = "x86_64")]
/// x86-64 kernels: AVX2/FMA/F16C, and AVX512-VNNI for q4_0 (each function says what it needs).
mod x86 {
    use super::{write_d, Q4_0_BYTES, Q8_0_BYTES, QK};
    use crate::kernels::simd::{Avx2, Simd};
    use crate::quant::legacy::Q8_1_BYTES;
    use std::arch::x86_64::*;

    /// `round_to_i8(v)` per lane (C's `roundf`, then a saturating cast; NaN → 0) as integers,
    /// by the scalar form's steps: truncate, add or subtract one where the exact fraction
    /// reaches ±½, clamp. Inputs are first clamped to ±200 (NaN kept), which changes no result.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn round_to_i8_lanes(v: __m256) -> __m256i {
        let vc = _mm256_min_ps(
            _mm256_set1_ps(200.0),
            _mm256_max_ps(_mm256_set1_ps(-200.0), v),
        );
        let t = _mm256_round_ps::<{ _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC }>(vc);
        let f = _mm256_sub_ps(vc, t);
        let one = _mm256_set1_ps(1.0);
        let up = _mm256_and_ps(_mm256_cmp_ps::<_CMP_GE_OQ>(f, _mm256_set1_ps(0.5)), one);
        let down = _mm256_and_ps(_mm256_cmp_ps::<_CMP_LE_OQ>(f, _mm256_set1_ps(-0.5)), one);
        let r = _mm256_sub_ps(_mm256_add_ps(t, up), down);
        let r = _mm256_min_ps(
            _mm256_set1_ps(127.0),
            _mm256_max_ps(_mm256_set1_ps(-128.0), r),
        );
        // NaN lanes (unordered with themselves) become 0.
        let r = _mm256_and_ps(r, _mm256_cmp_ps::<_CMP_ORD_Q>(v, v));
        _mm256_cvttps_epi32(r)
    }

    /// q8_0 (`SUM` false: NaN in a block makes its scale NaN) or q8_1 (`SUM` true: NaN skipped
    /// by the block maximum, the scaled sum of the quants stored after the scale) blocks of
    /// `x` into `out`, byte for byte the scalar references: the same maximum, the same scalar
    /// divisions, the same per-value product and rounding; the f16 fields through the same
    /// scalar conversion.
    ///
    /// # Safety
    /// The CPU must support AVX2.
    #[target_feature(enable = "avx2")]
    pub unsafe fn quantize_blocks<const SUM: bool>(x: &[f32], out: &mut [u8]) {
        let block_bytes = if SUM { Q8_1_BYTES } else { Q8_0_BYTES };
        let abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fff_ffff));
        for (xs, block) in x.chunks_exact(QK).zip(out.chunks_exact_mut(block_bytes)) {
            // SAFETY: the chunk holds 32 floats; unaligned loads.
            let v: [__m256; 4] =
                std::array::from_fn(|i| unsafe { _mm256_loadu_ps(xs.as_ptr().add(8 * i)) });
            let mut m = _mm256_setzero_ps();
            let mut nan = _mm256_setzero_ps();
            for &vi in &v {
                // `maxps` returns its second operand when one is NaN: the running maximum,
                // so NaN values are skipped as `f32::max` skips them.
                m = _mm256_max_ps(_mm256_and_ps(vi, abs_mask), m);
                nan = _mm256_or_ps(nan, _mm256_cmp_ps::<_CMP_UNORD_Q>(vi, vi));
            }
            let amax = if !SUM && _mm256_movemask_ps(nan) != 0 {
                f32::NAN
            } else {
                // SAFETY: AVX (this function's features).
                unsafe { super::super::simd::hmax8(m) }
            };
            let d = amax / 127.0;
            let id = if d != 0.0 { 1.0 / d } else { 0.0 };
            let idv = _mm256_set1_ps(id);
            let q: [__m256i; 4] =
                std::array::from_fn(|i| round_to_i8_lanes(_mm256_mul_ps(v[i], idv)));
            // i32 → i16 → i8 with saturation (values are in range), then the lanes back in
            // order (the packs work within 128-bit halves).
            let p01 = _mm256_packs_epi32(q[0], q[1]);
            let p23 = _mm256_packs_epi32(q[2], q[3]);
            let bytes = _mm256_permutevar8x32_epi32(
                _mm256_packs_epi16(p01, p23),
                _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7),
            );
            let head = if SUM { 4 } else { 2 };
            // SAFETY: the block holds 32 quant bytes after its head; unaligned store.
            unsafe { _mm256_storeu_si256(block.as_mut_ptr().add(head).cast(), bytes) };
            if SUM {
                let s =
                    _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
                let s = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256::<1>(s));
                let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b01_00_11_10>(s));
                let sum =
                    _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32::<0b10_11_00_01>(s)));
                // |sum| ≤ 32·127, exact in f32.
                write_d(&mut block[2..], sum as f32 * d);
            }
            write_d(block, d);
        }
    }

    /// The eight lanes of `v` summed: halves, then pairs, then the last two.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn hsum(v: __m256) -> f32 {
        let lo = _mm256_castps256_ps128(v);
        let hi = _mm256_extractf128_ps(v, 1);
        let s = _mm_add_ps(lo, hi);
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
        _mm_cvtss_f32(s)
    }

    /// # Safety
    /// The CPU must support AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
        let n = a.len().min(b.len());
        let (pa, pb) = (a.as_ptr(), b.as_ptr());
        let mut acc = [_mm256_setzero_ps(); 4];
        let mut i = 0;
        // SAFETY: every load reads 8 floats below `n` from both slices.
        unsafe {
            while i + 32 <= n {
                for (k, slot) in acc.iter_mut().enumerate() {
                    let x = _mm256_loadu_ps(pa.add(i + 8 * k));
                    let y = _mm256_loadu_ps(pb.add(i + 8 * k));
                    *slot = _mm256_fmadd_ps(x, y, *slot);
                }
                i += 32;
            }
            while i + 8 <= n {
                let x = _mm256_loadu_ps(pa.add(i));
                let y = _mm256_loadu_ps(pb.add(i));
                acc[0] = _mm256_fmadd_ps(x, y, acc[0]);
                i += 8;
            }
        }
        let total = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
        // SAFETY: AVX2 is enabled for this function.
        let mut sum = unsafe { hsum(total) };
        while i < n {
            sum += a[i] * b[i];
            i += 1;
        }
        sum
    }

    /// [`super::dot_f16_f32`].
    ///
    /// # Safety
    /// The CPU must support AVX2, FMA and F16C.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_f16_f32(a: &[u16], b: &[f32]) -> f32 {
        // SAFETY: forwarded (the features are this function's).
        unsafe { dot_half::<false>(a, b) }
    }

    /// [`super::dot_bf16_f32`].
    ///
    /// # Safety
    /// As [`dot_f16_f32`].
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_bf16_f32(a: &[u16], b: &[f32]) -> f32 {
        // SAFETY: forwarded.
        unsafe { dot_half::<true>(a, b) }
    }

    /// A 16-bit float row (`BF16`: bf16, widened by a shift; else f16, by `vcvtph2ps`) dotted
    /// with an f32 row: [`dot_f32`]'s loop and lanes on the widened values, so the result is
    /// the f32 dot of the widened row bit for bit.
    ///
    /// # Safety
    /// As [`dot_f16_f32`].
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn dot_half<const BF16: bool>(a: &[u16], b: &[f32]) -> f32 {
        let n = a.len().min(b.len());
        let (pa, pb) = (a.as_ptr(), b.as_ptr());
        let mut acc = [_mm256_setzero_ps(); 4];
        let mut i = 0;
        // SAFETY: the CPU has AVX2 and FMA (this function's features).
        let s = unsafe { Avx2::assume() };
        // Eight values widened (F16C: this function's features; inlined into it).
        macro_rules! widen {
            ($at:expr) => {
                s.load_half::<BF16>(pa.add($at), 8)
            };
        }
        // SAFETY: every load reads 8 elements below `n` from both slices.
        unsafe {
            while i + 32 <= n {
                // The weights ahead: one line per 32 values (64 bytes).
                super::super::simd::prefetch_ahead(pa.add(i).cast::<u8>(), 64);
                for (k, slot) in acc.iter_mut().enumerate() {
                    let x = widen!(i + 8 * k);
                    let y = _mm256_loadu_ps(pb.add(i + 8 * k));
                    *slot = _mm256_fmadd_ps(x, y, *slot);
                }
                i += 32;
            }
            while i + 8 <= n {
                let x = widen!(i);
                let y = _mm256_loadu_ps(pb.add(i));
                acc[0] = _mm256_fmadd_ps(x, y, acc[0]);
                i += 8;
            }
        }
        let total = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
        // SAFETY: AVX2 is enabled for this function.
        let mut sum = unsafe { hsum(total) };
        while i < n {
            let w = if BF16 {
                super::bf16_bits_widened(a[i])
            } else {
                super::f16_bits_to_f32(a[i])
            };
            sum += w * b[i];
            i += 1;
        }
        sum
    }

    /// The integer part of a block product, per ISA: 8 i32 lanes, lane `l` the exact sum of
    /// bytes `4l..4l+4` of `x·y`. Integer sums are exact, so every implementation gives the
    /// same lanes and [`blocks_dot`] the same bits on every ISA.
    ///
    /// # Safety
    /// A value of an implementing type may only exist on a CPU with AVX2, FMA and F16C (and
    /// the implementation's own instructions).
    unsafe trait BlockSums: Copy {
        /// Signed bytes `x` (q8_0) times signed bytes `y`.
        fn i8_sums(self, x: __m256i, y: __m256i) -> __m256i;
        /// Nibbles `q` (0..15, standing for `q − 8`: q4_0) times signed bytes `y`.
        fn q4_sums(self, q: __m256i, y: __m256i) -> __m256i;
    }

    /// AVX2: `maddubs` on |x| and y·sign(x) (pairs in i16, which cannot saturate for these
    /// ranges), then a multiply-add of the pairs by 1.
    #[derive(Clone, Copy)]
    struct Avx2Sums;

    // SAFETY: made only by the AVX2/FMA/F16C entry points below.
    unsafe impl BlockSums for Avx2Sums {
        #[inline(always)]
        fn i8_sums(self, x: __m256i, y: __m256i) -> __m256i {
            // SAFETY: AVX2 (the type's contract).
            unsafe {
                let ax = _mm256_sign_epi8(x, x);
                let sy = _mm256_sign_epi8(y, x);
                _mm256_madd_epi16(_mm256_maddubs_epi16(ax, sy), _mm256_set1_epi16(1))
            }
        }
        #[inline(always)]
        fn q4_sums(self, q: __m256i, y: __m256i) -> __m256i {
            // SAFETY: AVX2 (the type's contract).
            let x = unsafe { _mm256_sub_epi8(q, _mm256_set1_epi8(8)) };
            self.i8_sums(x, y)
        }
    }

    /// AVX512-VNNI on 256-bit vectors: the nibbles stay unsigned and `vpdpbusd` multiplies
    /// them by the signed activations and sums fours in one instruction; the −8 offset is a
    /// second `vpdpbusd` (8·y) subtracted — instead of two sign fixes, a multiply-add of pairs
    /// and a widening add per block.
    #[derive(Clone, Copy)]
    struct VnniSums;

    // SAFETY: made only by the entry point that enables AVX512-VNNI/VL besides AVX2/FMA/F16C.
    unsafe impl BlockSums for VnniSums {
        #[inline(always)]
        fn i8_sums(self, x: __m256i, y: __m256i) -> __m256i {
            // SAFETY: AVX2 and AVX512-VNNI/VL (the type's contract).
            unsafe {
                let ax = _mm256_sign_epi8(x, x);
                let sy = _mm256_sign_epi8(y, x);
                _mm256_dpbusd_epi32(_mm256_setzero_si256(), ax, sy)
            }
        }
        #[inline(always)]
        fn q4_sums(self, q: __m256i, y: __m256i) -> __m256i {
            // SAFETY: AVX2 and AVX512-VNNI/VL (the type's contract).
            unsafe {
                let zero = _mm256_setzero_si256();
                _mm256_sub_epi32(
                    _mm256_dpbusd_epi32(zero, q, y),
                    _mm256_dpbusd_epi32(zero, _mm256_set1_epi8(8), y),
                )
            }
        }
    }

    /// The product of the f16 scales at the start of blocks `x` and `y`, in f32: both
    /// converted by one F16C instruction from one general register. (Converting each through
    /// `_mm_cvtsi32_si128` let the compiler merge it into a register holding the previous
    /// block's result with `vpinsrw`, which chained every block to the one before and cost
    /// half the kernel's speed.)
    #[inline(always)]
    fn scales(x: &[u8], y: &[u8]) -> f32 {
        let bits = u32::from(u16::from_ne_bytes([x[0], x[1]]))
            | (u32::from(u16::from_ne_bytes([y[0], y[1]])) << 16);
        // SAFETY: F16C, which every `BlockSums` implementation implies (only they call this).
        unsafe {
            let v = _mm_cvtph_ps(_mm_cvtsi32_si128(bits as i32));
            _mm_cvtss_f32(_mm_mul_ss(v, _mm_movehdup_ps(v)))
        }
    }

    /// The exact integer sums of block `x` (q4_0 when `Q4`, else q8_0) times the q8_0 block
    /// `y`, eight i32 lanes.
    #[inline(always)]
    fn block_sums<const Q4: bool, K: BlockSums>(k: K, x: &[u8], y: &[u8]) -> __m256i {
        // SAFETY: AVX2 (the `BlockSums` contract); a q8_0 block holds 32 quant bytes after its
        // 2-byte scale, a q4_0 block 16 (the callers pass whole blocks).
        unsafe {
            let qy = _mm256_loadu_si256(y.as_ptr().add(2).cast());
            if Q4 {
                let packed = _mm_loadu_si128(x.as_ptr().add(2).cast());
                // Low nibbles are elements 0..16, high nibbles 16..32.
                let both = _mm256_set_m128i(_mm_srli_epi16(packed, 4), packed);
                k.q4_sums(_mm256_and_si256(both, _mm256_set1_epi8(0x0f)), qy)
            } else {
                k.i8_sums(_mm256_loadu_si256(x.as_ptr().add(2).cast()), qy)
            }
        }
    }

    /// The f16 scales of four consecutive blocks (`stride` bytes apart, from the start of
    /// `blocks`) as one 64-bit word, block `j` in bits `16j..16j + 16`.
    #[inline(always)]
    fn four_scales(blocks: &[u8], stride: usize) -> i64 {
        let mut word = 0u64;
        for j in 0..4 {
            let at = j * stride;
            word |= u64::from(u16::from_ne_bytes([blocks[at], blocks[at + 1]])) << (16 * j);
        }
        word as i64
    }

    /// Blocks `x` and `y` times the scale `d`, added to `acc`.
    #[inline(always)]
    fn block_step<const Q4: bool, K: BlockSums>(
        k: K,
        x: &[u8],
        y: &[u8],
        d: __m256,
        acc: __m256,
    ) -> __m256 {
        // SAFETY: AVX and FMA (the `BlockSums` contract).
        unsafe { _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(block_sums::<Q4, K>(k, x, y)), acc) }
    }

    /// The dot product of the weight row `a` (q4_0 when `Q4`, else q8_0) with the q8_0 row
    /// `b`, written once for every [`BlockSums`]. Four blocks per step, block `j` of a step
    /// into accumulator `j` (independent multiply-add chains), with the eight f16 scales of
    /// the step converted by one instruction: per block, converting its two scales and
    /// multiplying them took as many vector instructions as the integer product (four-block
    /// steps measured ~12% faster than two-block steps with per-block scales, q8_0 rows in
    /// L2 on Zen 3). The last `n mod 4` blocks go to accumulators `0..` one by one. One row at
    /// a time: sharing each activation block between two weight rows was measured 1.4-2x
    /// slower on mat-vec products (two interleaved weight streams). No closures: a closure is
    /// a separate function without the enabled features, and calling one per block made this
    /// 2x slower.
    #[inline(always)]
    fn blocks_dot<const Q4: bool, K: BlockSums>(k: K, a: &[u8], b: &[u8]) -> f32 {
        let a_block = if Q4 { Q4_0_BYTES } else { Q8_0_BYTES };
        let n = (a.len() / a_block).min(b.len() / Q8_0_BYTES);
        // SAFETY: AVX (the `BlockSums` contract).
        let mut acc = unsafe { [_mm256_setzero_ps(); 4] };
        let mut i = 0;
        while i + 4 <= n {
            let xs = &a[i * a_block..(i + 4) * a_block];
            let ys = &b[i * Q8_0_BYTES..(i + 4) * Q8_0_BYTES];
            // The weights ahead: a step reads 136 bytes (q8_0) or 72 (q4_0).
            super::super::simd::prefetch_ahead(xs.as_ptr(), 4 * a_block);
            // SAFETY: AVX2 and F16C (the `BlockSums` contract).
            let d = unsafe {
                let halves = _mm_set_epi64x(four_scales(ys, Q8_0_BYTES), four_scales(xs, a_block));
                let both = _mm256_cvtph_ps(halves);
                let d = _mm_mul_ps(_mm256_castps256_ps128(both), _mm256_extractf128_ps(both, 1));
                _mm256_castps128_ps256(d)
            };
            for (j, acc) in acc.iter_mut().enumerate() {
                // SAFETY: AVX2 (the `BlockSums` contract); lane j < 4 of `d` is defined.
                let dj = unsafe { _mm256_permutevar8x32_ps(d, _mm256_set1_epi32(j as i32)) };
                let x = &xs[j * a_block..(j + 1) * a_block];
                let y = &ys[j * Q8_0_BYTES..(j + 1) * Q8_0_BYTES];
                *acc = block_step::<Q4, K>(k, x, y, dj, *acc);
            }
            i += 4;
        }
        // The last n mod 4 blocks, accumulator j for block i + j, with constant indices: an
        // accumulator picked by a variable index lives in memory (a store and a load in each
        // row's chains).
        macro_rules! tail_step {
            ($j:literal) => {
                if n - i > $j {
                    let x = &a[(i + $j) * a_block..(i + $j + 1) * a_block];
                    let y = &b[(i + $j) * Q8_0_BYTES..(i + $j + 1) * Q8_0_BYTES];
                    // SAFETY: AVX (the `BlockSums` contract).
                    let d = unsafe { _mm256_set1_ps(scales(x, y)) };
                    acc[$j] = block_step::<Q4, K>(k, x, y, d, acc[$j]);
                }
            };
        }
        tail_step!(0);
        tail_step!(1);
        tail_step!(2);
        // SAFETY: AVX2 and FMA (the `BlockSums` contract).
        unsafe {
            hsum(_mm256_add_ps(
                _mm256_add_ps(acc[0], acc[1]),
                _mm256_add_ps(acc[2], acc[3]),
            ))
        }
    }

    /// # Safety
    /// The CPU must support AVX2, FMA and F16C.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_q8_0_q8_0(a: &[u8], b: &[u8]) -> f32 {
        blocks_dot::<false, _>(Avx2Sums, a, b)
    }

    /// # Safety
    /// The CPU must support AVX2, FMA and F16C.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_q4_0_q8_0(a: &[u8], b: &[u8]) -> f32 {
        blocks_dot::<true, _>(Avx2Sums, a, b)
    }

    /// q4_0 · q8_0 with VNNI ([`VnniSums`]): the same body and the same bits as
    /// [`dot_q4_0_q8_0`].
    ///
    /// # Safety
    /// The CPU must support AVX2, FMA, F16C, AVX512-VNNI and AVX512-VL.
    #[target_feature(enable = "avx2,fma,f16c,avx512vnni,avx512vl")]
    pub unsafe fn dot_q4_0_q8_0_vnni(a: &[u8], b: &[u8]) -> f32 {
        blocks_dot::<true, _>(VnniSums, a, b)
    }

    /// Blocks `$b` and `$b + 1` (a zero block and scale when `$both` is false) of the q4_0 row
    /// at `$pa`: `(low nibbles of both, high nibbles of both, d0 bits, d1 bits)`, the nibbles
    /// of block `$b` in each vector's low half. A macro so it expands inside each kernel with
    /// that kernel's target features; the caller's `unsafe` block covers the reads.
    macro_rules! q4_0_pair {
        ($pa:expr, $b:expr, $both:expr, $low:expr) => {{
            let (pa, b) = ($pa, $b);
            let x0 = _mm_loadu_si128(pa.add(b * Q4_0_BYTES + 2).cast());
            let d0 = u32::from(pa.add(b * Q4_0_BYTES).cast::<u16>().read_unaligned());
            let (x1, d1) = if $both {
                (
                    _mm_loadu_si128(pa.add((b + 1) * Q4_0_BYTES + 2).cast()),
                    u32::from(pa.add((b + 1) * Q4_0_BYTES).cast::<u16>().read_unaligned()),
                )
            } else {
                (_mm_setzero_si128(), 0)
            };
            let x = _mm256_set_m128i(x1, x0);
            let lo = _mm256_and_si256(x, $low);
            let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(x), $low);
            (lo, hi, d0, d1)
        }};
    }
    pub(super) use q4_0_pair;

    /// [`super::dot_q4_0_pairs_portable`] with AVX2: per pair of blocks, the 32 packed bytes
    /// are unpacked into the low nibbles of both blocks (lanes 0-7) and the high nibbles
    /// (lanes 8-15); `maddubs` (nibbles unsigned × activations signed, pairs in `i16`:
    /// `|2 · 15 · 128| < 2^15`) and a multiply-add by 1 give each lane's exact sum of four
    /// products, the prepared offset corrections are added, and one FMA per half scales them.
    /// The lanes, their arithmetic and the final reduction are the 512-bit kernel's, so the
    /// bits are too. The weights are prefetched ([`super::super::simd::prefetch_ahead`]).
    ///
    /// # Safety
    /// The CPU must support AVX2, FMA and F16C; `y` holds `ceil(nb / 2)` prepared pairs for
    /// the `nb` blocks of `a`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_q4_0_pairs_avx2(a: &[u8], y: &[u8]) -> f32 {
        use super::PAIR_BYTES;
        let nb = a.len() / Q4_0_BYTES;
        let low = _mm256_set1_epi8(0x0f);
        let ones = _mm256_set1_epi16(1);
        let spread = _mm256_set_epi32(1, 1, 1, 1, 0, 0, 0, 0);
        let (mut acc_lo, mut acc_hi) = (_mm256_setzero_ps(), _mm256_setzero_ps());
        let (pa, py) = (a.as_ptr(), y.as_ptr());
        for p in 0..nb.div_ceil(2) {
            let b = 2 * p;
            let both = b + 1 < nb;
            // SAFETY: block b (and b + 1 when `both`) lies inside `a`; pair p inside `y`.
            unsafe {
                super::super::simd::prefetch_ahead(pa.add(b * Q4_0_BYTES), 2 * Q4_0_BYTES);
                let (lo, hi, d0, d1) = q4_0_pair!(pa, b, both, low);
                let pair = py.add(p * PAIR_BYTES);
                // One half's 8 lanes (a macro: a closure would not inherit the features).
                macro_rules! sums {
                    ($nibbles:expr, $at:expr) => {{
                        let quants = _mm256_loadu_si256(pair.add($at).cast());
                        let comp = _mm256_loadu_si256(pair.add(64 + $at).cast());
                        let pairs = _mm256_maddubs_epi16($nibbles, quants);
                        let products = _mm256_madd_epi16(pairs, ones);
                        _mm256_cvtepi32_ps(_mm256_add_epi32(comp, products))
                    }};
                }
                let (s_lo, s_hi) = (sums!(lo, 0), sums!(hi, 32));
                let dx2 = _mm_cvtph_ps(_mm_cvtsi32_si128((d0 | (d1 << 16)) as i32));
                let dx = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(dx2), spread);
                let dy_lo = _mm256_loadu_ps(pair.add(128).cast());
                let dy_hi = _mm256_loadu_ps(pair.add(160).cast());
                acc_lo = _mm256_fmadd_ps(s_lo, _mm256_mul_ps(dx, dy_lo), acc_lo);
                acc_hi = _mm256_fmadd_ps(s_hi, _mm256_mul_ps(dx, dy_hi), acc_hi);
            }
        }
        // The fixed order of `reduce16`: halves, quarters, pairs, then the last two.
        let h8 = _mm256_add_ps(acc_lo, acc_hi);
        let h4 = _mm_add_ps(_mm256_castps256_ps128(h8), _mm256_extractf128_ps::<1>(h8));
        let h2 = _mm_add_ps(h4, _mm_movehl_ps(h4, h4));
        let h1 = _mm_add_ss(h2, _mm_shuffle_ps::<1>(h2, h2));
        _mm_cvtss_f32(h1)
    }

    /// [`super::dot_q4_0_pairs_portable`] with 512-bit VNNI: per pair of blocks, the 32 packed
    /// bytes are unpacked into one vector (low nibbles of both blocks, then high nibbles),
    /// one `vpdpbusd` (nibbles unsigned × activations signed, starting from the prepared
    /// offset corrections) gives the 16 lanes' exact sums, and one FMA scales them.
    ///
    /// # Safety
    /// The CPU must support AVX-512F/BW/VNNI and F16C; `y` holds `ceil(nb / 2)` prepared pairs
    /// for the `nb` blocks of `a`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,f16c")]
    pub unsafe fn dot_q4_0_pairs(a: &[u8], y: &[u8]) -> f32 {
        use super::PAIR_BYTES;
        let nb = a.len() / Q4_0_BYTES;
        let low = _mm256_set1_epi8(0x0f);
        let spread = _mm512_set_epi32(1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0);
        let mut acc = _mm512_setzero_ps();
        let (pa, py) = (a.as_ptr(), y.as_ptr());
        for p in 0..nb.div_ceil(2) {
            let b = 2 * p;
            let both = b + 1 < nb;
            // SAFETY: block b (and b + 1 when `both`) lies inside `a`; pair p inside `y`.
            unsafe {
                let (lo, hi, d0, d1) = q4_0_pair!(pa, b, both, low);
                let nibbles = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi);
                let pair = py.add(p * PAIR_BYTES);
                let quants = _mm512_loadu_si512(pair.cast());
                let comp = _mm512_loadu_si512(pair.add(64).cast());
                let dy = _mm512_loadu_ps(pair.add(128).cast());
                let sums = _mm512_dpbusd_epi32(comp, nibbles, quants);
                let dx2 = _mm_cvtph_ps(_mm_cvtsi32_si128((d0 | (d1 << 16)) as i32));
                let dx = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(dx2));
                acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), _mm512_mul_ps(dx, dy), acc);
            }
        }
        reduce16(acc)
    }

    /// The 16 lanes of `acc` summed in the fixed order of [`super::reduce16`]: halves,
    /// quarters, pairs, then the last two.
    #[inline]
    #[target_feature(enable = "avx512f,avx")]
    pub(super) fn reduce16(acc: __m512) -> f32 {
        let h8 = _mm256_add_ps(
            _mm512_castps512_ps256(acc),
            _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(acc))),
        );
        let h4 = _mm_add_ps(_mm256_castps256_ps128(h8), _mm256_extractf128_ps::<1>(h8));
        let h2 = _mm_add_ps(h4, _mm_movehl_ps(h4, h4));
        let h1 = _mm_add_ss(h2, _mm_shuffle_ps::<1>(h2, h2));
        _mm_cvtss_f32(h1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::testing::values;

    /// Every quant value under scales of every kind (normal, subnormal, zero, infinite, NaN):
    /// the dispatched dequantizers (AVX2 where the CPU has it) give the bits of one product
    /// per value, `q as f32 * d`.
    #[test]
    fn dequantized_rows_are_the_products_of_quants_and_scales() {
        let scales: [u16; 8] = [
            0x3c00, 0x1234, 0x0001, 0x83ff, 0x0000, 0x7c00, 0xfc00, 0x7e00,
        ];
        let (mut q8, mut q4) = (Vec::new(), Vec::new());
        for (i, d) in scales.iter().enumerate() {
            for half in 0..8 {
                q8.extend_from_slice(&d.to_ne_bytes());
                q8.extend((0..QK).map(|j| (half * QK + j + i) as u8));
                q4.extend_from_slice(&d.to_ne_bytes());
                q4.extend((0..QK / 2).map(|j| (half * QK / 2 + j * 7 + i) as u8));
            }
        }
        let n = scales.len() * 8 * QK;
        let same = |a: f32, b: f32| a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan());
        let mut out = vec![0f32; n];
        dequantize_row_q8_0(&q8, &mut out);
        for (b, block) in q8.chunks_exact(Q8_0_BYTES).enumerate() {
            let d = f16::from_bits(u16::from_ne_bytes([block[0], block[1]])).to_f32();
            for j in 0..QK {
                let want = f32::from(block[2 + j] as i8) * d;
                assert!(same(out[b * QK + j], want), "q8_0 block {b} value {j}");
            }
        }
        dequantize_row_q4_0(&q4, &mut out);
        for (b, block) in q4.chunks_exact(Q4_0_BYTES).enumerate() {
            let d = f16::from_bits(u16::from_ne_bytes([block[0], block[1]])).to_f32();
            for j in 0..QK / 2 {
                let q = block[2 + j];
                let lo = ((q & 0x0f) as i32 - 8) as f32 * d;
                let hi = ((q >> 4) as i32 - 8) as f32 * d;
                assert!(same(out[b * QK + j], lo), "q4_0 block {b} value {j}");
                assert!(
                    same(out[b * QK + j + QK / 2], hi),
                    "q4_0 block {b} value {}",
                    j + 16
                );
            }
        }
    }

    /// The vectorised q8_0 and q8_1 quantizers give the scalar references' bytes: random
    /// blocks at many scales, and blocks with NaN, ±∞, zeros, subnormals, huge values and
    /// values whose scaled form lands exactly on or next to a rounding half.
    #[test]
    fn fast_quantizers_match_the_references_byte_for_byte() {
        let mut rng = 0x2545_f491_4f6c_dd1du64;
        let mut next = move || {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng
        };
        let mut x: Vec<f32> = Vec::new();
        for b in 0..400 {
            let scale = 10f32.powi(b % 13 - 6);
            x.extend((0..QK).map(|_| ((next() >> 11) as f32 / (1u64 << 53) as f32 - 0.5) * scale));
        }
        // Blocks whose maximum is 127 · 2^e: every value a multiple of ½ in scaled units.
        for e in [-3i32, 0, 5] {
            x.extend((0..QK).map(|i| {
                (i as f32 - 15.5) * 2f32.powi(e) + if i == 31 { 111.0 * 2f32.powi(e) } else { 0.0 }
            }));
            x.extend((0..QK).map(|i| {
                if i == 0 {
                    127.0
                } else {
                    (i as f32 - 16.0) + 0.5
                }
            }));
        }
        let specials = [
            f32::NAN,
            f32::INFINITY,
            f32::NEG_INFINITY,
            0.0,
            -0.0,
            1e-40,
            -1e-45,
            3e38,
            -3e38,
            0.49999997,
            -0.5,
            2.5,
        ];
        for (i, &sp) in specials.iter().enumerate() {
            let mut block: Vec<f32> = (0..QK).map(|j| (j as f32 - 10.0) * 0.3).collect();
            block[(i * 7) % QK] = sp;
            x.extend(&block);
            x.extend(std::iter::repeat_n(sp, QK));
        }
        let n = x.len() / QK;
        let (mut fast, mut reference) = (vec![0u8; n * Q8_0_BYTES], vec![0u8; n * Q8_0_BYTES]);
        quantize_row_q8_0(&x, &mut fast);
        quantize_row_q8_0_ref(&x, &mut reference);
        for (b, (f, r)) in fast
            .chunks(Q8_0_BYTES)
            .zip(reference.chunks(Q8_0_BYTES))
            .enumerate()
        {
            assert_eq!(f, r, "q8_0 block {b}: {:?}", &x[b * QK..(b + 1) * QK]);
        }
        let bytes = crate::quant::legacy::Q8_1_BYTES;
        let (mut fast, mut reference) = (vec![0u8; n * bytes], vec![0u8; n * bytes]);
        quantize_row_q8_1(&x, &mut fast);
        crate::quant::legacy::quantize_row_q8_1(&x, &mut reference);
        for (b, (f, r)) in fast.chunks(bytes).zip(reference.chunks(bytes)).enumerate() {
            assert_eq!(f, r, "q8_1 block {b}: {:?}", &x[b * QK..(b + 1) * QK]);
        }
        // The dispatching form gives the same bytes, and the reference codec's errors.
        let mut via = vec![0u8; n * bytes];
        quantize_row(DType::Q8_1, &x, &mut via).unwrap();
        assert_eq!(via, reference);
        assert!(quantize_row(DType::Q8_1, &x[..31], &mut via[..36]).is_err());
        assert!(quantize_row(DType::Q8_0, &x[..32], &mut via[..35]).is_err());
        assert!(quantize_row(DType::Q8_1, &x[..32], &mut via[..37]).is_err());
    }

    #[test]
    fn fast_f16_decode_is_exact() {
        for bits in 0..=u16::MAX {
            let want = f16::from_bits(bits).to_f32();
            let got = f16_bits_to_f32(bits);
            assert!(
                got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()),
                "{bits:#x}: {got} vs {want}"
            );
        }
    }

    #[test]
    fn a_nan_activation_makes_the_products_nan() {
        let mut x = values(QK, 3);
        x[7] = f32::NAN;
        let mut qa = vec![0u8; Q8_0_BYTES];
        quantize_row_q8_0(&x, &mut qa);
        let mut qw = vec![0u8; Q8_0_BYTES];
        quantize_row_q8_0(&values(QK, 4), &mut qw);
        assert!(dot_q8_0_q8_0_ref(&qw, &qa).is_nan());
        let mut q4 = vec![0u8; Q4_0_BYTES];
        quantize_row_q4_0(&values(QK, 4), &mut q4);
        assert!(dot_q4_0_q8_0_ref(&q4, &qa).is_nan());
    }

    /// Every SIMD path this CPU has (AVX2 and, where present, VNNI), over odd and even block
    /// counts around the four-block steps, against the integer reference.
    #[test]
    fn every_quant_dot_path_matches_reference() {
        for blocks in [1usize, 2, 3, 4, 5, 6, 7, 8, 9, 13] {
            let n = blocks * QK;
            let x = values(n, 5 + blocks as u32);
            let y = values(n, 6 + blocks as u32);
            let mut qa = vec![0u8; blocks * Q8_0_BYTES];
            let mut qb = vec![0u8; blocks * Q8_0_BYTES];
            let mut q4 = vec![0u8; blocks * Q4_0_BYTES];
            quantize_row_q8_0(&x, &mut qa);
            quantize_row_q8_0(&y, &mut qb);
            quantize_row_q4_0(&x, &mut q4);
            let r8 = dot_q8_0_q8_0_ref(&qa, &qb);
            let r4 = dot_q4_0_q8_0_ref(&q4, &qb);
            let close = |got: f32, want: f32, what: &str| {
                assert!(
                    (got - want).abs() <= 1e-5 * want.abs().max(1.0),
                    "{what}, {blocks} blocks: {got} vs {want}"
                );
            };
            close(dot_q8_0_q8_0(&qa, &qb), r8, "q8_0 dispatch");
            close(dot_q4_0_q8_0(&q4, &qb), r4, "q4_0 dispatch");
            #[cfg(target_arch = "x86_64")]
            if has_f16c() {
                // SAFETY: AVX2, FMA and F16C were detected.
                unsafe {
                    close(x86::dot_q8_0_q8_0(&qa, &qb), r8, "q8_0 avx2");
                    close(x86::dot_q4_0_q8_0(&q4, &qb), r4, "q4_0 avx2");
                }
            }
            #[cfg(target_arch = "x86_64")]
            if has_avx512_vnni() {
                // SAFETY: the VNNI path's features were detected.
                close(
                    unsafe { x86::dot_q4_0_q8_0_vnni(&q4, &qb) },
                    r4,
                    "q4_0 vnni",
                );
            }
        }
    }

    /// A small xorshift generator for raw block bytes.
    struct Bytes(u64);

    impl Bytes {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }

        /// `blocks` raw blocks of `size` bytes: random quants, and f16 scales drawn from
        /// every kind (normal, tiny, subnormal, zero, the largest, infinite) when `wild`.
        fn blocks(&mut self, blocks: usize, size: usize, wild: bool) -> Vec<u8> {
            const SCALES: [u16; 8] = [
                0x2E66, 0xB800, 0x0001, 0x0000, 0x7BFF, 0x7C00, 0x3C00, 0x1400,
            ];
            let mut out: Vec<u8> = (0..blocks * size).map(|_| self.next() as u8).collect();
            for b in out.chunks_exact_mut(size) {
                let d = if wild {
                    SCALES[(self.next() % 8) as usize]
                } else {
                    0x2000 | (self.next() as u16 & 0x0FFF)
                };
                b[..2].copy_from_slice(&d.to_le_bytes());
            }
            out
        }
    }

    /// The several-column q8_0 product gives every column the bits of the single-row product
    /// (block counts around its four-block steps, random and extreme quants, scales of every
    /// kind, columns of different content side by side).
    #[test]
    fn q8_0_column_products_match_single_row_bits() {
        let (Some(two), Some(four)) = (dot_q8_0_cols_fn::<2>(), dot_q8_0_cols_fn::<4>()) else {
            return;
        };
        let mut rng = Bytes(0x0C0F_FEE5);
        for blocks in [1usize, 2, 3, 4, 5, 6, 7, 8, 9, 13, 128] {
            for round in 0..6 {
                let wild = round >= 3;
                let mut w = rng.blocks(blocks, Q8_0_BYTES, wild);
                if round == 1 {
                    // the extreme bytes: every weight −128 against ±127 / −128 activations
                    for b in w.chunks_exact_mut(Q8_0_BYTES) {
                        b[2..].fill(0x80);
                    }
                }
                // Activations come from the q8_0 quantizer, whose quants lie in −127..=127
                // (the single-row kernel's sign trick relies on it).
                let ys: [Vec<u8>; 4] = std::array::from_fn(|c| {
                    let mut y = rng.blocks(blocks, Q8_0_BYTES, wild);
                    for b in y.chunks_exact_mut(Q8_0_BYTES) {
                        for q in &mut b[2..] {
                            if round == 1 {
                                *q = [0x81, 0x7F, 0x81, 0x00][c];
                            } else if *q == 0x80 {
                                *q = 0x81;
                            }
                        }
                    }
                    y
                });
                let want: Vec<u32> = ys.iter().map(|y| dot_q8_0_q8_0(&w, y).to_bits()).collect();
                let got4 = four(&w, ys.each_ref().map(|y| &y[..]));
                let got2 = two(&w, [&ys[2][..], &ys[3][..]]);
                for c in 0..4 {
                    assert_eq!(
                        got4[c].to_bits(),
                        want[c],
                        "{blocks} blocks, column {c} of 4"
                    );
                }
                for c in 0..2 {
                    assert_eq!(
                        got2[c].to_bits(),
                        want[2 + c],
                        "{blocks} blocks, column {c} of 2"
                    );
                }
            }
        }
    }

    /// The several-column q4_0 product gives every column the bits of the single-row mat-vec
    /// on prepared pairs (odd and even block counts, raw nibbles under scales of every kind,
    /// activations from tiny to overflowing their f16 scale).
    #[test]
    fn q4_0_column_products_match_single_row_bits() {
        let (Some(two), Some(four)) =
            (dot_q4_0_pairs_cols_fn::<2>(), dot_q4_0_pairs_cols_fn::<4>())
        else {
            return;
        };
        let mut rng = Bytes(0x9A1E_5EED);
        for blocks in [1usize, 2, 3, 4, 5, 7, 8, 13, 128] {
            for round in 0..4 {
                let n = blocks * QK;
                let w = rng.blocks(blocks, Q4_0_BYTES, round >= 2);
                let ys: [Vec<u8>; 4] = std::array::from_fn(|c| {
                    let scale = [1.0f32, 1e-6, 3e4, 1e7][(c + round) % 4];
                    let x: Vec<f32> = values(n, (17 * blocks + 5 * c + round) as u32)
                        .iter()
                        .map(|v| v * scale)
                        .collect();
                    let mut y = vec![0u8; q4_pairs_row_bytes(n)];
                    prepare_q4_pairs(&x, &mut y);
                    y
                });
                let want: Vec<u32> = ys.iter().map(|y| dot_q4_0_pairs(&w, y).to_bits()).collect();
                let got4 = four(&w, ys.each_ref().map(|y| &y[..]));
                let got2 = two(&w, [&ys[1][..], &ys[3][..]]);
                for c in 0..4 {
                    assert_eq!(
                        got4[c].to_bits(),
                        want[c],
                        "{blocks} blocks, column {c} of 4"
                    );
                }
                assert_eq!(got2[0].to_bits(), want[1], "{blocks} blocks, column 0 of 2");
                assert_eq!(got2[1].to_bits(), want[3], "{blocks} blocks, column 1 of 2");
            }
        }
    }

    /// Every q4_0 mat-vec kernel family agrees bit for bit with the portable arithmetic
    /// (odd and even block counts, extreme nibbles and activations), and the result is
    /// close to the q4_0 · q8_0 reference.
    #[test]
    fn q4_0_pairs_kernels_agree_bit_for_bit() {
        for blocks in [1usize, 2, 3, 7, 128] {
            let n = blocks * QK;
            let mut x = values(n, 9 + blocks as u32);
            let mut y = values(n, 10 + blocks as u32);
            x[0] = 3.0;
            y[1] = -2.0;
            let mut q4 = vec![0u8; blocks * Q4_0_BYTES];
            quantize_row_q4_0(&x, &mut q4);
            let mut prepared = vec![0u8; q4_pairs_row_bytes(n)];
            prepare_q4_pairs(&y, &mut prepared);
            let want = dot_q4_0_pairs_with(PairsIsa::Portable, &q4, &prepared);
            for isa in PairsIsa::available() {
                let got = dot_q4_0_pairs_with(isa, &q4, &prepared);
                assert_eq!(got.to_bits(), want.to_bits(), "{isa:?} {blocks} blocks");
            }
            let mut q8 = vec![0u8; blocks * Q8_0_BYTES];
            quantize_row_q8_0(&y, &mut q8);
            let r = dot_q4_0_q8_0_ref(&q4, &q8);
            assert!((want - r).abs() <= 1e-5 * r.abs().max(1.0), "{want} vs {r}");
        }
    }

    /// Raw weight bytes (every nibble value, scales normal, subnormal, zero, infinite, NaN)
    /// against activations with full-range quants: every kernel family gives the portable
    /// definition's bits, odd block counts included.
    #[test]
    fn q4_0_pairs_kernels_agree_on_wild_rows() {
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        for trial in 0..400 {
            let blocks = 1 + (next() % 19) as usize;
            let n = blocks * QK;
            let mut q4: Vec<u8> = (0..blocks * Q4_0_BYTES).map(|_| next() as u8).collect();
            for b in q4.chunks_exact_mut(Q4_0_BYTES) {
                let bits: u16 = match next() % 12 {
                    0 => 0x7C00,
                    1 => 0xFE01,
                    2 => 0x0001,
                    3 => 0x8000,
                    _ => half::f16::from_f32((next() % 4000) as f32 / 1000.0 - 2.0).to_bits(),
                };
                b[..2].copy_from_slice(&bits.to_le_bytes());
            }
            let scale = [1.0f32, 1e-3, 300.0][trial % 3];
            let y: Vec<f32> = (0..n)
                .map(|_| ((next() % 2001) as f32 / 1000.0 - 1.0) * scale)
                .collect();
            let mut prepared = vec![0u8; q4_pairs_row_bytes(n)];
            prepare_q4_pairs(&y, &mut prepared);
            let want = dot_q4_0_pairs_with(PairsIsa::Portable, &q4, &prepared);
            for isa in PairsIsa::available() {
                let got = dot_q4_0_pairs_with(isa, &q4, &prepared);
                assert!(
                    got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()),
                    "{isa:?}, {blocks} blocks, trial {trial}: {got} vs {want}"
                );
            }
        }
    }

    #[test]
    fn simd_dots_match_reference() {
        for n in [0usize, 1, 7, 8, 33, 64, 100] {
            let a = values(n, 1);
            let b = values(n, 2);
            let d = dot_f32(&a, &b) - dot_f32_ref(&a, &b);
            assert!(d.abs() < 1e-4, "n={n} diff {d}");
            let h: Vec<u16> = a
                .iter()
                .map(|&v| half::f16::from_f32(v).to_bits())
                .collect();
            let d = dot_f16_f32(&h, &b) - dot_f16_f32_ref(&h, &b);
            assert!(d.abs() < 1e-4, "f16 n={n} diff {d}");
            let h: Vec<u16> = a
                .iter()
                .map(|&v| half::bf16::from_f32(v).to_bits())
                .collect();
            let d = dot_bf16_f32(&h, &b) - dot_bf16_f32_ref(&h, &b);
            assert!(d.abs() < 1e-4, "bf16 n={n} diff {d}");
            // The widened dot is the f32 dot of the widened values, bit for bit.
            let wide: Vec<f32> = h.iter().map(|&x| bf16_bits_widened(x)).collect();
            assert_eq!(dot_bf16_f32(&h, &b).to_bits(), dot_f32(&wide, &b).to_bits());
        }
        let x = values(128, 3);
        let y = values(128, 4);
        let mut qa = vec![0u8; 4 * Q8_0_BYTES];
        let mut qb = vec![0u8; 4 * Q8_0_BYTES];
        let mut q4 = vec![0u8; 4 * Q4_0_BYTES];
        quantize_row_q8_0(&x, &mut qa);
        quantize_row_q8_0(&y, &mut qb);
        quantize_row_q4_0(&x, &mut q4);
        let r8 = dot_q8_0_q8_0_ref(&qa, &qb);
        assert!((dot_q8_0_q8_0(&qa, &qb) - r8).abs() < 1e-4 * r8.abs().max(1.0));
        let r4 = dot_q4_0_q8_0_ref(&q4, &qb);
        assert!((dot_q4_0_q8_0(&q4, &qb) - r4).abs() < 1e-4 * r4.abs().max(1.0));
        let exact = dot_f32_ref(&x, &y);
        assert!((r8 - exact).abs() < 0.05 * exact.abs().max(1.0));
        let mut back = vec![0f32; 128];
        dequantize_row_q4_0(&q4, &mut back);
        for (a, b) in x.iter().zip(&back) {
            // One step is |max|/8; values of the sign opposite to the largest clip at 7 steps.
            assert!((a - b).abs() < 0.13, "{a} {b}");
        }
    }
}
