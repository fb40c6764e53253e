//! Conversions between `f32` and the 16-bit float types [`f16`] (IEEE binary16) and [`bf16`]
//! (bfloat16), one value at a time or a row at a time.
//!
//! # Rounding and special values
//!
//! Every narrowing conversion rounds to nearest, ties to even. Subnormals are converted exactly
//! in both directions (nothing is flushed to zero), `±0` and `±inf` keep their sign, and a
//! finite value too large for the narrow type becomes `±inf`. For every input that is not a NaN
//! the `f16` results are bit-for-bit those of numpy's `astype(np.float16)` and the `bf16`
//! results those of `ml_dtypes.bfloat16`.
//!
//! NaNs stay NaNs and always come out *quiet*:
//!
//! * `f32 → f16`: the sign and the top ten mantissa bits are kept and the quiet bit is set
//!   (what x86's F16C and AArch64's `fcvtn` do in hardware). numpy's software conversion keeps
//!   a signalling NaN signalling instead (it sets the lowest mantissa bit when the kept bits
//!   would all be zero), so only signalling-NaN inputs can differ from numpy.
//! * `f16 → f32`: the sign and the payload are kept and the quiet bit is set; numpy keeps
//!   signalling NaNs signalling here as well.
//! * `f32 → bf16`: the sign and the top seven mantissa bits are kept and the quiet bit is set.
//!   `ml_dtypes` instead returns the canonical NaN `0x7fc0`/`0xffc0` (sign kept, payload
//!   dropped).
//! * `bf16 → f32`: the payload is kept and the quiet bit is set.
//!
//! The scalar functions ([`fp16_to_fp32`], ...) follow the same rules as the SIMD paths, bit
//! for bit, including NaN payloads, so either can serve as the oracle for the other.
//!
//! # Speed
//!
//! The row functions choose a SIMD path once per process ([`simd_path`]): AVX2 + F16C on
//! x86-64, NEON on AArch64, plain Rust otherwise. Rows of at least [`PARALLEL_MIN_ELEMS`]
//! elements are split in chunks whose lengths are multiples of 64 elements, on the CPU
//! computation's thread pool inside a kernel and on rayon's pool elsewhere. The `*_slice` functions are the single-threaded kernels, for callers that
//! already run on their own chunk of a larger job.
//!
//! On x86-64, a call whose source and destination together span at least
//! [`STREAM_MIN_BYTES`] writes its output with non-temporal stores: such data cannot stay in
//! the caches anyway, and skipping the read-for-ownership of the destination lines roughly
//! doubled the widening conversions' throughput and helped the narrowing ones. Smaller calls use
//! ordinary stores, so their output is still cached for whatever reads it next.

use std::ops::Range;
use std::sync::OnceLock;

use half::{bf16, f16};
use rayon::prelude::*;

use crate::error::Result;
use crate::pool;

#[cfg(target_arch = "aarch64")]
mod aarch64;
#[cfg(target_arch = "x86_64")]
mod x86;

// ---------------------------------------------------------------------------------------------
// Scalar conversions (bit level). These are the reference semantics for every path.
// ---------------------------------------------------------------------------------------------

/// `f16` bits to `f32` bits: exact, NaNs quieted.
#[inline]
const fn f16_bits_to_f32_bits(h: u16) -> u32 {
    let sign = ((h & 0x8000) as u32) << 16;
    let exp = ((h >> 10) & 0x1f) as u32;
    let man = (h & 0x03ff) as u32;
    if exp == 0x1f {
        if man == 0 {
            sign | 0x7f80_0000
        } else {
            sign | 0x7fc0_0000 | (man << 13)
        }
    } else if exp != 0 {
        // Normal: re-bias the exponent from 15 to 127.
        sign | ((exp + 112) << 23) | (man << 13)
    } else if man == 0 {
        sign
    } else {
        // Subnormal: the value is man * 2^-24. With its highest set bit at position p (0..=9),
        // it is 1.f * 2^(p - 24), so the f32 exponent field is p + 103; the bits below p become
        // the top of the f32 mantissa.
        let lz = man.leading_zeros(); // 22..=31, p = 31 - lz
        let shift = lz - 21; // moves bit p to bit 10
        sign | ((134 - lz) << 23) | (((man << shift) & 0x03ff) << 13)
    }
}

/// `f32` bits to `f16` bits: round to nearest even, NaNs quieted.
#[inline]
const fn f32_bits_to_f16_bits(x: u32) -> u16 {
    let sign = ((x >> 16) & 0x8000) as u16;
    let abs = x & 0x7fff_ffff;
    if abs > 0x7f80_0000 {
        // NaN: keep the top ten mantissa bits and set the quiet bit.
        return sign | 0x7e00 | ((abs >> 13) & 0x03ff) as u16;
    }
    if abs >= 0x477f_f000 {
        // 65520 and above (including inf): 65520 lies halfway between the largest f16, 65504
        // (odd mantissa), and 65536, so the tie goes up to infinity.
        return sign | 0x7c00;
    }
    if abs >= 0x3880_0000 {
        // Result is a normal f16 (|x| >= 2^-14, or it rounds up to it). Add just under half an
        // f16 ulp, plus one if the kept lsb is odd, then drop the 13 extra bits and re-bias.
        // A carry out of the mantissa correctly bumps the exponent.
        let lsb = (abs >> 13) & 1;
        let rounded = abs + 0x0fff + lsb;
        return sign | ((rounded >> 13) - (112 << 10)) as u16;
    }
    if abs <= 0x3300_0000 {
        // At most 2^-25, half the smallest subnormal: rounds to zero (the tie goes to even 0).
        return sign;
    }
    // Subnormal result: in units of 2^-24 the value is m * 2^(e - 126), with m the 24-bit
    // significand and e the biased exponent (102..=112 here), so shift right by 126 - e.
    let e = abs >> 23;
    let m = (abs & 0x007f_ffff) | 0x0080_0000;
    let shift = 126 - e; // 14..=24
    let q = m >> shift;
    let rem = m & ((1 << shift) - 1);
    let half = 1 << (shift - 1);
    let up = rem > half || (rem == half && (q & 1) == 1);
    // q + 1 may reach 0x400, which is exactly the smallest normal f16.
    sign | (q + up as u32) as u16
}

/// `bf16` bits to `f32` bits: exact, NaNs quieted.
#[inline]
const fn bf16_bits_to_f32_bits(b: u16) -> u32 {
    let x = (b as u32) << 16;
    if (b & 0x7fff) > 0x7f80 {
        x | 0x0040_0000
    } else {
        x
    }
}

/// `f32` bits to `bf16` bits: round to nearest even, NaNs quieted.
#[inline]
const fn f32_bits_to_bf16_bits(x: u32) -> u16 {
    if (x & 0x7fff_ffff) > 0x7f80_0000 {
        // NaN: keep the top seven mantissa bits and set the quiet bit (bit 6 of bf16).
        return ((x >> 16) | 0x0040) as u16;
    }
    // Add 0x7fff, plus one when the kept lsb is odd, and truncate. The largest finite values
    // carry into the exponent and become inf, as round-to-nearest requires; inf stays inf.
    let lsb = (x >> 16) & 1;
    (x.wrapping_add(0x7fff + lsb) >> 16) as u16
}

/// Converts one `f16` to `f32`. Exact for every finite value, subnormals included; a NaN stays
/// NaN (sign and payload kept) with its quiet bit set.
#[inline]
pub fn fp16_to_fp32(x: f16) -> f32 {
    f32::from_bits(f16_bits_to_f32_bits(x.to_bits()))
}

/// Converts one `f32` to `f16`, rounding to nearest with ties to even.
///
/// Values whose magnitude rounds past the largest `f16` (65504), i.e. `|x| >= 65520`, become
/// `±inf`; tiny values round to subnormals or `±0` (never flushed early). A NaN stays NaN with
/// its sign and top ten mantissa bits kept and the quiet bit set.
#[inline]
pub fn fp32_to_fp16(x: f32) -> f16 {
    f16::from_bits(f32_bits_to_f16_bits(x.to_bits()))
}

/// Converts one `bf16` to `f32`. Exact; a NaN stays NaN (payload kept) with its quiet bit set.
#[inline]
pub fn bf16_to_fp32(x: bf16) -> f32 {
    f32::from_bits(bf16_bits_to_f32_bits(x.to_bits()))
}

/// Converts one `f32` to `bf16`, rounding to nearest with ties to even (subnormals kept,
/// overflow to `±inf`). A NaN stays NaN with its sign and top seven mantissa bits kept and the
/// quiet bit set.
#[inline]
pub fn fp32_to_bf16(x: f32) -> bf16 {
    bf16::from_bits(f32_bits_to_bf16_bits(x.to_bits()))
}

// ---------------------------------------------------------------------------------------------
// Scalar row loops (reference, and the fallback path).
// ---------------------------------------------------------------------------------------------

fn scalar_f16_to_f32(src: &[f16], dst: &mut [f32]) {
    for (d, s) in dst.iter_mut().zip(src) {
        *d = fp16_to_fp32(*s);
    }
}

fn scalar_f32_to_f16(src: &[f32], dst: &mut [f16]) {
    for (d, s) in dst.iter_mut().zip(src) {
        *d = fp32_to_fp16(*s);
    }
}

fn scalar_bf16_to_f32(src: &[bf16], dst: &mut [f32]) {
    for (d, s) in dst.iter_mut().zip(src) {
        *d = bf16_to_fp32(*s);
    }
}

fn scalar_f32_to_bf16(src: &[f32], dst: &mut [bf16]) {
    for (d, s) in dst.iter_mut().zip(src) {
        *d = fp32_to_bf16(*s);
    }
}

// ---------------------------------------------------------------------------------------------
// Run-time path selection.
// ---------------------------------------------------------------------------------------------

/// Which conversion kernels this process uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Path {
    /// Plain Rust loops.
    Scalar,
    /// AVX2 + F16C (+ FMA) on x86-64.
    #[cfg(target_arch = "x86_64")]
    Avx2F16c,
    /// NEON on AArch64 (always present there).
    #[cfg(target_arch = "aarch64")]
    Neon,
}

fn detect() -> Path {
    #[cfg(target_arch = "x86_64")]
    {
        if crate::isa::get().avx2_fma_f16c() {
            return Path::Avx2F16c;
        }
    }
    #[cfg(target_arch = "aarch64")]
    {
        if crate::isa::get().neon {
            return Path::Neon;
        }
    }
    Path::Scalar
}

#[inline]
fn path() -> Path {
    static PATH: OnceLock<Path> = OnceLock::new();
    *PATH.get_or_init(detect)
}

/// The name of the SIMD path the row conversions use in this process: `"avx2+f16c"`, `"neon"`
/// or `"scalar"`. Detected once, on first use.
pub fn simd_path() -> &'static str {
    match path() {
        Path::Scalar => "scalar",
        #[cfg(target_arch = "x86_64")]
        Path::Avx2F16c => "avx2+f16c",
        #[cfg(target_arch = "aarch64")]
        Path::Neon => "neon",
    }
}

/// Calls whose source and destination together span at least this many bytes write their
/// output with non-temporal (streaming) stores where the SIMD path has them.
///
/// Such a call's data cannot all stay in the caches anyway (this is half the 32 MiB L3 of the
/// machine it was tuned on), so streaming the output saves the read-for-ownership of every
/// destination line and keeps the source's lines cached. Below it, ordinary stores win clearly,
/// since the output is then usually still in cache when it is read next.
pub const STREAM_MIN_BYTES: usize = 16 << 20;

/// Whether a call converting `src` into `dst` should use streaming stores.
#[inline]
fn stream<S, D>(src: &[S], dst: &[D]) -> bool {
    std::mem::size_of_val(src) + std::mem::size_of_val(dst) >= STREAM_MIN_BYTES
}

// ---------------------------------------------------------------------------------------------
// Kernel dispatch. `nt` asks for streaming stores where the path has them.
// ---------------------------------------------------------------------------------------------

/// Defines `$name(src, dst, nt)`, which runs the conversion kernel `$kernel` of the path
/// chosen at run time (`x86::$kernel`, `aarch64::$kernel`) or the scalar `$scalar`. The four
/// conversions differ only in these names and element types.
macro_rules! dispatch {
    ($name:ident, $src:ty, $dst:ty, $kernel:ident, $scalar:ident) => {
        fn $name(src: &[$src], dst: &mut [$dst], nt: bool) {
            #[cfg(not(target_arch = "x86_64"))]
            let _ = nt;
            match path() {
                #[cfg(target_arch = "x86_64")]
                // SAFETY: `Path::Avx2F16c` is only chosen after run-time detection of avx2,
                // f16c and fma, the features the kernels are compiled for.
                Path::Avx2F16c => unsafe {
                    if nt {
                        x86::$kernel::<true>(src, dst)
                    } else {
                        x86::$kernel::<false>(src, dst)
                    }
                },
                #[cfg(target_arch = "aarch64")]
                Path::Neon => aarch64::$kernel(src, dst),
                Path::Scalar => $scalar(src, dst),
            }
        }
    };
}

dispatch!(f16_to_f32_with, f16, f32, f16_to_f32, scalar_f16_to_f32);
dispatch!(f32_to_f16_with, f32, f16, f32_to_f16, scalar_f32_to_f16);
dispatch!(bf16_to_f32_with, bf16, f32, bf16_to_f32, scalar_bf16_to_f32);
dispatch!(f32_to_bf16_with, f32, bf16, f32_to_bf16, scalar_f32_to_bf16);

// ---------------------------------------------------------------------------------------------
// Single-threaded kernels.
// ---------------------------------------------------------------------------------------------

/// Converts `src` into `dst` (`f16 → f32`) on the calling thread with the SIMD path.
///
/// Meant for CPU kernels that already work on their own chunk. The slices are expected to have
/// equal lengths: a debug build panics if they do not, a release build converts the first
/// `min(src.len(), dst.len())` elements and leaves the rest of `dst` untouched.
pub fn fp16_to_fp32_slice(src: &[f16], dst: &mut [f32]) {
    debug_assert_eq!(src.len(), dst.len(), "fp16_to_fp32_slice: length mismatch");
    f16_to_f32_with(src, dst, stream(src, dst));
}

/// Converts `src` into `dst` (`f32 → f16`, round to nearest even) on the calling thread with
/// the SIMD path.
///
/// Meant for CPU kernels that already work on their own chunk. The slices are expected to have
/// equal lengths: a debug build panics if they do not, a release build converts the first
/// `min(src.len(), dst.len())` elements and leaves the rest of `dst` untouched.
pub fn fp32_to_fp16_slice(src: &[f32], dst: &mut [f16]) {
    debug_assert_eq!(src.len(), dst.len(), "fp32_to_fp16_slice: length mismatch");
    f32_to_f16_with(src, dst, stream(src, dst));
}

/// Converts `src` into `dst` (`bf16 → f32`) on the calling thread with the SIMD path.
///
/// Meant for CPU kernels that already work on their own chunk. The slices are expected to have
/// equal lengths: a debug build panics if they do not, a release build converts the first
/// `min(src.len(), dst.len())` elements and leaves the rest of `dst` untouched.
pub fn bf16_to_fp32_slice(src: &[bf16], dst: &mut [f32]) {
    debug_assert_eq!(src.len(), dst.len(), "bf16_to_fp32_slice: length mismatch");
    bf16_to_f32_with(src, dst, stream(src, dst));
}

/// Converts `src` into `dst` (`f32 → bf16`, round to nearest even) on the calling thread with
/// the SIMD path.
///
/// Meant for CPU kernels that already work on their own chunk. The slices are expected to have
/// equal lengths: a debug build panics if they do not, a release build converts the first
/// `min(src.len(), dst.len())` elements and leaves the rest of `dst` untouched.
pub fn fp32_to_bf16_slice(src: &[f32], dst: &mut [bf16]) {
    debug_assert_eq!(src.len(), dst.len(), "fp32_to_bf16_slice: length mismatch");
    f32_to_bf16_with(src, dst, stream(src, dst));
}

// ---------------------------------------------------------------------------------------------
// Rows: length check, then single-threaded or split across the current pool.
// ---------------------------------------------------------------------------------------------

/// Rows with at least this many elements are split across the current pool; shorter
/// rows are converted on the calling thread.
///
/// While a row fits in the caches the kernels convert 10 to 40 elements per nanosecond, so a
/// row of 64K elements takes only a few microseconds: about what it costs to wake a sleeping
/// pool thread and join it again. On the 2-core AVX2 machine the crate was tuned on (busy with
/// other builds at the time), splitting rows of 64K to 1M elements gained nothing and lost
/// slightly, so the split starts at 256K elements, where the single-threaded time (tens of
/// microseconds) clearly outweighs the hand-off on an idle machine.
pub const PARALLEL_MIN_ELEMS: usize = 1 << 18;

/// Chunk lengths handed to the pool are multiples of this many elements, so that every chunk
/// but the last is a whole number of SIMD blocks and starts on a 64-element boundary.
const CHUNK_ALIGN: usize = 64;

fn check_len(what: &str, src: usize, dst: usize) -> Result<()> {
    if src == dst {
        Ok(())
    } else {
        Err(crate::shape_err!(
            "{what}: source has {src} elements but destination has {dst}"
        ))
    }
}

/// Runs `kernel` over the row, in parallel when the row is large and the pool has threads.
/// Whether to stream the output is decided once, from the size of the whole row.
///
/// Inside a CPU computation (a kernel loading or storing rows) the split runs on that
/// computation's own thread pool, so a backend's thread count holds and a row converted inside
/// another split stays on its thread; elsewhere (a caller's own conversion) on rayon's pool.
fn run_row<S: Sync, D: Send>(
    src: &[S],
    dst: &mut [D],
    kernel: fn(&[S], &mut [D], bool),
) -> Result<()> {
    let n = dst.len();
    let nt = stream(src, dst);
    // Short rows (a kernel's K/V rows, GET_ROWS) go straight to the kernel, before any look at
    // the pools: those lookups cost more than converting a few hundred values.
    if n < PARALLEL_MIN_ELEMS {
        kernel(src, dst, nt);
        return Ok(());
    }
    let in_computation = pool::in_computation();
    let threads = if in_computation {
        pool::current_num_threads()
    } else {
        rayon::current_num_threads()
    };
    if threads < 2 {
        kernel(src, dst, nt);
        return Ok(());
    }
    // One chunk per thread: the work is uniform, and fewer, larger chunks keep each thread's
    // memory streams long.
    let chunk = n.div_ceil(threads).next_multiple_of(CHUNK_ALIGN);
    if !in_computation {
        dst.par_chunks_mut(chunk)
            .zip(src.par_chunks(chunk))
            .for_each(|(d, s)| kernel(s, d, nt));
        return Ok(());
    }
    let out = SendMutPtr(dst.as_mut_ptr());
    // The pool returns a chunk's panic as an error.
    pool::run_chunks(n, chunk, &|range: Range<usize>| {
        // The whole wrapper, not its raw field (closures capture fields on their own).
        let out = &out;
        // SAFETY: `dst` holds `n` elements and stays mutably borrowed for this call; the chunks'
        // ranges are disjoint, so this one's elements are written by this task alone.
        let d = unsafe { std::slice::from_raw_parts_mut(out.0.add(range.start), range.len()) };
        kernel(&src[range], d, nt);
        Ok(())
    })
}

/// A row's destination shared by the chunks of one split (each writes its own range).
struct SendMutPtr<D>(*mut D);
// SAFETY: the pointer is only dereferenced for disjoint ranges of a `&mut [D]` with `D: Send`
// (see `run_row`), which is what sending the sub-slices to other threads would allow.
unsafe impl<D: Send> Sync for SendMutPtr<D> {}

/// Converts a row of `f16` to `f32` (exact; see the module docs for NaNs).
///
/// # Errors
/// [`Error::Shape`](crate::error::Error::Shape) if the lengths differ.
pub fn fp16_to_fp32_row(src: &[f16], dst: &mut [f32]) -> Result<()> {
    check_len("fp16_to_fp32_row", src.len(), dst.len())?;
    run_row(src, dst, f16_to_f32_with)
}

/// Converts a row of `f32` to `f16`, rounding to nearest even.
///
/// # Errors
/// [`Error::Shape`](crate::error::Error::Shape) if the lengths differ.
pub fn fp32_to_fp16_row(src: &[f32], dst: &mut [f16]) -> Result<()> {
    check_len("fp32_to_fp16_row", src.len(), dst.len())?;
    run_row(src, dst, f32_to_f16_with)
}

/// Converts a row of `bf16` to `f32` (exact; see the module docs for NaNs).
///
/// # Errors
/// [`Error::Shape`](crate::error::Error::Shape) if the lengths differ.
pub fn bf16_to_fp32_row(src: &[bf16], dst: &mut [f32]) -> Result<()> {
    check_len("bf16_to_fp32_row", src.len(), dst.len())?;
    run_row(src, dst, bf16_to_f32_with)
}

/// Converts a row of `f32` to `bf16`, rounding to nearest even.
///
/// # Errors
/// [`Error::Shape`](crate::error::Error::Shape) if the lengths differ.
pub fn fp32_to_bf16_row(src: &[f32], dst: &mut [bf16]) -> Result<()> {
    check_len("fp32_to_bf16_row", src.len(), dst.len())?;
    run_row(src, dst, f32_to_bf16_with)
}

/// The plain scalar reference for [`fp32_to_bf16_row`]: no SIMD, no threads, the same bits.
///
/// # Errors
/// [`Error::Shape`](crate::error::Error::Shape) if the lengths differ.
pub fn fp32_to_bf16_row_ref(src: &[f32], dst: &mut [bf16]) -> Result<()> {
    check_len("fp32_to_bf16_row_ref", src.len(), dst.len())?;
    scalar_f32_to_bf16(src, dst);
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// The CPU backend's utility forms.
// ---------------------------------------------------------------------------------------------

/// Copies a row of `f32` (the identity conversion).
///
/// # Errors
/// [`Error::Shape`](crate::error::Error::Shape) if the lengths differ.
pub fn cpu_fp32_to_fp32(src: &[f32], dst: &mut [f32]) -> Result<()> {
    check_len("cpu_fp32_to_fp32", src.len(), dst.len())?;
    dst.copy_from_slice(src);
    Ok(())
}

/// Converts a row of `f32` to `i32` the way Rust's `as` does: the fraction is truncated toward
/// zero, values outside the `i32` range saturate to `i32::MIN` / `i32::MAX` (so `±inf` gives
/// the bounds), and NaN gives `0`.
///
/// # Errors
/// [`Error::Shape`](crate::error::Error::Shape) if the lengths differ.
pub fn cpu_fp32_to_i32(src: &[f32], dst: &mut [i32]) -> Result<()> {
    check_len("cpu_fp32_to_i32", src.len(), dst.len())?;
    for (d, s) in dst.iter_mut().zip(src) {
        *d = *s as i32;
    }
    Ok(())
}

/// The CPU backend's name for [`fp32_to_fp16_row`].
///
/// # Errors
/// [`Error::Shape`](crate::error::Error::Shape) if the lengths differ.
pub fn cpu_fp32_to_fp16(src: &[f32], dst: &mut [f16]) -> Result<()> {
    fp32_to_fp16_row(src, dst)
}

/// The CPU backend's name for [`fp16_to_fp32_row`].
///
/// # Errors
/// [`Error::Shape`](crate::error::Error::Shape) if the lengths differ.
pub fn cpu_fp16_to_fp32(src: &[f16], dst: &mut [f32]) -> Result<()> {
    fp16_to_fp32_row(src, dst)
}

/// The CPU backend's name for [`fp32_to_bf16_row`].
///
/// # Errors
/// [`Error::Shape`](crate::error::Error::Shape) if the lengths differ.
pub fn cpu_fp32_to_bf16(src: &[f32], dst: &mut [bf16]) -> Result<()> {
    fp32_to_bf16_row(src, dst)
}

/// The CPU backend's name for [`bf16_to_fp32_row`].
///
/// # Errors
/// [`Error::Shape`](crate::error::Error::Shape) if the lengths differ.
pub fn cpu_bf16_to_fp32(src: &[bf16], dst: &mut [f32]) -> Result<()> {
    bf16_to_fp32_row(src, dst)
}

#[cfg(test)]
mod tests;
