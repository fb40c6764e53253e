//! NEON kernels for AArch64.
//!
//! Each kernel converts `min(src.len(), dst.len())` elements: whole blocks with vector
//! instructions, the remainder with the scalar functions of the parent module (same bits).
//!
//! The half-precision conversions are the base-ARMv8 `fcvtn`/`fcvtl` instructions. Rust's
//! intrinsics for them take `float16x4_t`, which is not stable yet, so they are issued with
//! `asm!`. They round by FPCR's mode (round-to-nearest-even by default) and propagate NaNs
//! quieted with a truncated payload; with the default FPCR (FZ = 0, AHP = 0, which Linux and
//! macOS give every thread) subnormals are exact, matching the x86 path. `bf16` uses plain
//! integer NEON arithmetic.
#![deny(unsafe_op_in_unsafe_fn)]

use std::arch::aarch64::*;
use std::arch::asm;

use half::{bf16, f16};

/// `f32 → f16`, 8 elements per iteration.
pub(super) fn f32_to_f16(src: &[f32], dst: &mut [f16]) {
    let n = src.len().min(dst.len());
    let s = src.as_ptr();
    // `f16` is `repr(transparent)` over `u16`.
    let d = dst.as_mut_ptr().cast::<u16>();
    let mut i = 0;
    while i + 8 <= n {
        // SAFETY: `i + 8 <= n <= len` of both slices, so the loads read `src[i..i + 8]` and the
        // store writes `dst[i..i + 8]`. NEON is part of every AArch64 target. The asm touches
        // only registers (it does set FPSR's cumulative exception bits, which is why
        // `preserves_flags` is not claimed); `h` is an `out` operand, so it never shares a
        // register with `a` or `b` and the first instruction cannot clobber `b`.
        unsafe {
            let a = vld1q_f32(s.add(i));
            let b = vld1q_f32(s.add(i + 4));
            let h: uint16x8_t;
            asm!(
                "fcvtn {h:v}.4h, {a:v}.4s",
                "fcvtn2 {h:v}.8h, {b:v}.4s",
                a = in(vreg) a,
                b = in(vreg) b,
                h = out(vreg) h,
                options(pure, nomem, nostack),
            );
            vst1q_u16(d.add(i), h);
        }
        i += 8;
    }
    super::scalar_f32_to_f16(&src[i..n], &mut dst[i..n]);
}

/// `f16 → f32`, 8 elements per iteration.
pub(super) fn f16_to_f32(src: &[f16], dst: &mut [f32]) {
    let n = src.len().min(dst.len());
    let s = src.as_ptr().cast::<u16>();
    let d = dst.as_mut_ptr();
    let mut i = 0;
    while i + 8 <= n {
        // SAFETY: `i + 8 <= n <= len` of both slices: the load reads `src[i..i + 8]`, the two
        // stores write `dst[i..i + 8]`. The asm touches only registers; `lo` and `hi` are
        // `out` operands, distinct from each other and from `h`, so writing `lo` first does
        // not disturb the input of the second instruction.
        unsafe {
            let h = vld1q_u16(s.add(i));
            let lo: float32x4_t;
            let hi: float32x4_t;
            asm!(
                "fcvtl {lo:v}.4s, {h:v}.4h",
                "fcvtl2 {hi:v}.4s, {h:v}.8h",
                h = in(vreg) h,
                lo = out(vreg) lo,
                hi = out(vreg) hi,
                options(pure, nomem, nostack),
            );
            vst1q_f32(d.add(i), lo);
            vst1q_f32(d.add(i + 4), hi);
        }
        i += 8;
    }
    super::scalar_f16_to_f32(&src[i..n], &mut dst[i..n]);
}

/// `f32 → bf16`, 8 elements per iteration: round to nearest even, NaNs quieted.
pub(super) fn f32_to_bf16(src: &[f32], dst: &mut [bf16]) {
    let n = src.len().min(dst.len());
    let s = src.as_ptr().cast::<u32>();
    let d = dst.as_mut_ptr().cast::<u16>();
    let mut i = 0;
    while i + 8 <= n {
        // SAFETY: `i + 8 <= n <= len` of both slices: the loads read `src[i..i + 8]`, the
        // stores write `dst[i..i + 8]`. Everything else is register arithmetic.
        unsafe {
            let a = round_bf16(vld1q_u32(s.add(i)));
            let b = round_bf16(vld1q_u32(s.add(i + 4)));
            vst1q_u16(d.add(i), vcombine_u16(a, b));
        }
        i += 8;
    }
    super::scalar_f32_to_bf16(&src[i..n], &mut dst[i..n]);
}

/// Four `f32` (as integer lanes) to `bf16` bits.
#[inline]
fn round_bf16(x: uint32x4_t) -> uint16x4_t {
    // SAFETY: register arithmetic only; NEON is part of every AArch64 target. (Newer
    // compilers treat these intrinsics as safe, older ones do not, hence the `allow`.)
    #[allow(unused_unsafe)]
    unsafe {
        let lsb = vandq_u32(vshrq_n_u32::<16>(x), vdupq_n_u32(1));
        let rounded = vaddq_u32(vaddq_u32(x, vdupq_n_u32(0x7fff)), lsb);
        let is_nan = vcgtq_u32(
            vandq_u32(x, vdupq_n_u32(0x7fff_ffff)),
            vdupq_n_u32(0x7f80_0000),
        );
        let nan = vorrq_u32(x, vdupq_n_u32(0x0040_0000));
        vshrn_n_u32::<16>(vbslq_u32(is_nan, nan, rounded))
    }
}

/// `bf16 → f32`, 8 elements per iteration: widen, shift, quiet NaNs.
pub(super) fn bf16_to_f32(src: &[bf16], dst: &mut [f32]) {
    let n = src.len().min(dst.len());
    let s = src.as_ptr().cast::<u16>();
    let d = dst.as_mut_ptr().cast::<u32>();
    let mut i = 0;
    while i + 8 <= n {
        // SAFETY: `i + 8 <= n <= len` of both slices: the load reads `src[i..i + 8]`, the
        // stores write `dst[i..i + 8]`. Everything else is register arithmetic.
        unsafe {
            let h = vld1q_u16(s.add(i));
            let a = widen_bf16(vget_low_u16(h));
            let b = widen_bf16(vget_high_u16(h));
            vst1q_u32(d.add(i), a);
            vst1q_u32(d.add(i + 4), b);
        }
        i += 8;
    }
    super::scalar_bf16_to_f32(&src[i..n], &mut dst[i..n]);
}

/// Four `bf16` bit patterns to `f32` bits, NaNs quieted.
#[inline]
fn widen_bf16(h: uint16x4_t) -> uint32x4_t {
    // SAFETY: register arithmetic only; NEON is part of every AArch64 target. (Newer
    // compilers treat these intrinsics as safe, older ones do not, hence the `allow`.)
    #[allow(unused_unsafe)]
    unsafe {
        let x = vshlq_n_u32::<16>(vmovl_u16(h));
        let is_nan = vcgtq_u32(
            vandq_u32(x, vdupq_n_u32(0x7fff_ffff)),
            vdupq_n_u32(0x7f80_0000),
        );
        vorrq_u32(x, vandq_u32(is_nan, vdupq_n_u32(0x0040_0000)))
    }
}
