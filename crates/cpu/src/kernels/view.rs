//! Raw tensor views for kernels, a `Send`-able pointer, and row conversion to and from f32.
//!
//! A [`RawTensor`] is a tensor's host address with its dtype, shape and byte strides. Kernels
//! compute addresses with [`RawTensor::offset`] and read or write whole rows through
//! [`RowIo::load_row`] / [`RowIo::store_row`], which convert any supported dtype
//! (f32, f16, bf16, i8, i16, i32, i64, q8_0, q4_0) to and from f32 and follow `nb[0]`.

use half::{bf16, f16};

use super::quant_dot;
use crate::convert;
use crate::dtype::DType;
use crate::error::{Error, Result};
pub use crate::host::{RawTensor, SendPtr};

/// Row reads and writes in f32 for a host tensor view, converting from and to its dtype (with
/// the kernels' conversions): the CPU kernels' and the BLAS backend's access to rows.
pub trait RowIo {
    /// Reads row (i1, i2, i3) into `out` as f32 (`out.len()` elements from the row start).
    ///
    /// # Safety
    /// The row must lie within the tensor, and no other task may write it concurrently.
    unsafe fn load_row(&self, i1: usize, i2: usize, i3: usize, out: &mut [f32]) -> Result<()>;

    /// Writes `src` (f32) into row (i1, i2, i3), converting to the dtype.
    ///
    /// # Safety
    /// The row must lie within the tensor, and no other task may read or write it
    /// concurrently.
    unsafe fn store_row(&self, i1: usize, i2: usize, i3: usize, src: &[f32]) -> Result<()>;
}

impl RowIo for RawTensor {
    /// Reads row (i1, i2, i3) into `out` as f32 (`out.len()` elements from the row start).
    ///
    /// # Safety
    /// The row must lie within the tensor, and no other task may write it concurrently.
    unsafe fn load_row(&self, i1: usize, i2: usize, i3: usize, out: &mut [f32]) -> Result<()> {
        // SAFETY: the row is inside the tensor (caller), so its address and `out.len()`
        // elements at stride `nb[0]` are readable.
        unsafe {
            load_f32(
                self.dtype,
                self.at(self.row_offset(i1, i2, i3)),
                self.nb[0],
                out,
            )
        }
    }

    /// Writes `src` (f32) into row (i1, i2, i3), converting to the dtype.
    ///
    /// # Safety
    /// The row must lie within the tensor, and no other task may read or write it
    /// concurrently.
    unsafe fn store_row(&self, i1: usize, i2: usize, i3: usize, src: &[f32]) -> Result<()> {
        // SAFETY: as for `load_row`, with exclusive access to the row.
        unsafe {
            store_f32(
                self.dtype,
                self.at(self.row_offset(i1, i2, i3)),
                self.nb[0],
                src,
            )
        }
    }
}

fn aligned<T>(ptr: *const u8) -> bool {
    (ptr as usize).is_multiple_of(std::mem::align_of::<T>())
}

/// Reads `out.len()` elements of `dtype` starting at `ptr`, `stride` bytes apart (ignored for
/// quantized types, whose blocks are adjacent), as f32.
///
/// # Safety
/// `ptr` must point to that many readable elements laid out as described.
pub unsafe fn load_f32(dtype: DType, ptr: *const u8, stride: usize, out: &mut [f32]) -> Result<()> {
    let n = out.len();
    if n == 0 {
        return Ok(());
    }
    let size = dtype.type_size();
    let dense = stride == size;
    match dtype {
        DType::F32 if dense => {
            // SAFETY: `n` f32 values are readable at `ptr` (caller); `out` is a distinct
            // allocation owned by this task.
            unsafe { std::ptr::copy_nonoverlapping(ptr, out.as_mut_ptr().cast::<u8>(), n * 4) };
        }
        DType::F16 if dense && aligned::<f16>(ptr) => {
            // SAFETY: `n` aligned f16 values are readable at `ptr` (caller, alignment checked).
            let src = unsafe { std::slice::from_raw_parts(ptr.cast::<f16>(), n) };
            convert::fp16_to_fp32_row(src, out)?;
        }
        DType::BF16 if dense && aligned::<bf16>(ptr) => {
            // SAFETY: `n` aligned bf16 values are readable at `ptr` (caller, alignment checked).
            let src = unsafe { std::slice::from_raw_parts(ptr.cast::<bf16>(), n) };
            convert::bf16_to_fp32_row(src, out)?;
        }
        block if block.is_quantized() => {
            let bytes = dtype.row_size(n)?;
            // SAFETY: a row of `n` quantized elements spans `bytes` readable bytes (caller).
            let src = unsafe { std::slice::from_raw_parts(ptr, bytes) };
            match block {
                DType::Q8_0 => quant_dot::dequantize_row_q8_0(src, out),
                DType::Q4_0 => quant_dot::dequantize_row_q4_0(src, out),
                _ => block.row_to_f32(src, out)?,
            }
        }
        _ => {
            for (i, value) in out.iter_mut().enumerate() {
                // SAFETY: element `i` lies at `ptr + i*stride` inside the readable row.
                let p = unsafe { ptr.add(i * stride) };
                // SAFETY: each read is of one element inside the row; unaligned reads are used
                // because views may start at any byte.
                *value = unsafe {
                    match dtype {
                        DType::F32 => p.cast::<f32>().read_unaligned(),
                        DType::F16 => f16::from_bits(p.cast::<u16>().read_unaligned()).to_f32(),
                        DType::BF16 => bf16::from_bits(p.cast::<u16>().read_unaligned()).to_f32(),
                        DType::I8 => p.cast::<i8>().read() as f32,
                        DType::I16 => p.cast::<i16>().read_unaligned() as f32,
                        DType::I32 => p.cast::<i32>().read_unaligned() as f32,
                        DType::I64 => p.cast::<i64>().read_unaligned() as f32,
                        _ => {
                            return Err(Error::unsupported(format!(
                                "strided {} rows",
                                dtype.name()
                            )))
                        }
                    }
                };
            }
        }
    }
    Ok(())
}

/// Writes `src` as `dtype` at `ptr`, elements `stride` bytes apart (quantized types are
/// quantized a row at a time, blocks adjacent). Integers are truncated toward zero and
/// saturate.
///
/// # Safety
/// `ptr` must point to `src.len()` writable elements laid out as described, which no other
/// task accesses concurrently.
pub unsafe fn store_f32(dtype: DType, ptr: *mut u8, stride: usize, src: &[f32]) -> Result<()> {
    let n = src.len();
    if n == 0 {
        return Ok(());
    }
    let size = dtype.type_size();
    let dense = stride == size;
    match dtype {
        DType::F32 if dense => {
            // SAFETY: `n` f32 slots are writable at `ptr` (caller); `src` is a task-local buffer
            // that does not overlap them.
            unsafe { std::ptr::copy_nonoverlapping(src.as_ptr().cast::<u8>(), ptr, n * 4) };
        }
        DType::F16 if dense && aligned::<f16>(ptr) => {
            // SAFETY: `n` aligned f16 slots are exclusively writable at `ptr` (caller).
            let dst = unsafe { std::slice::from_raw_parts_mut(ptr.cast::<f16>(), n) };
            convert::fp32_to_fp16_row(src, dst)?;
        }
        DType::BF16 if dense && aligned::<bf16>(ptr) => {
            // SAFETY: `n` aligned bf16 slots are exclusively writable at `ptr` (caller).
            let dst = unsafe { std::slice::from_raw_parts_mut(ptr.cast::<bf16>(), n) };
            convert::fp32_to_bf16_row(src, dst)?;
        }
        block if block.is_quantized() => {
            let bytes = dtype.row_size(n)?;
            // SAFETY: the quantized row spans `bytes` exclusively writable bytes (caller).
            let dst = unsafe { std::slice::from_raw_parts_mut(ptr, bytes) };
            match block {
                DType::Q8_0 => quant_dot::quantize_row_q8_0(src, dst),
                DType::Q4_0 => quant_dot::quantize_row_q4_0(src, dst),
                _ => block.row_from_f32(src, dst)?,
            }
        }
        _ => {
            for (i, &value) in src.iter().enumerate() {
                // SAFETY: element `i` lies at `ptr + i*stride` inside the writable row.
                let p = unsafe { ptr.add(i * stride) };
                // SAFETY: each write is of one element inside the row (unaligned-safe).
                unsafe {
                    match dtype {
                        DType::F32 => p.cast::<f32>().write_unaligned(value),
                        DType::F16 => p
                            .cast::<u16>()
                            .write_unaligned(f16::from_f32(value).to_bits()),
                        DType::BF16 => p
                            .cast::<u16>()
                            .write_unaligned(bf16::from_f32(value).to_bits()),
                        DType::I8 => p.cast::<i8>().write(value as i8),
                        DType::I16 => p.cast::<i16>().write_unaligned(value as i16),
                        DType::I32 => p.cast::<i32>().write_unaligned(value as i32),
                        DType::I64 => p.cast::<i64>().write_unaligned(value as i64),
                        _ => {
                            return Err(Error::unsupported(format!(
                                "strided {} rows",
                                dtype.name()
                            )))
                        }
                    }
                }
            }
        }
    }
    Ok(())
}

/// Reads an integer index (i32 or i64) at `ptr`.
///
/// # Safety
/// `ptr` must point to a readable element of `dtype`.
pub unsafe fn read_index(dtype: DType, ptr: *const u8) -> i64 {
    // SAFETY: guaranteed by the caller; unaligned reads tolerate any view offset.
    unsafe {
        match dtype {
            DType::I64 => ptr.cast::<i64>().read_unaligned(),
            _ => ptr.cast::<i32>().read_unaligned() as i64,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strided_rows_round_trip_every_dtype() {
        let values = [1.5f32, -2.0, 3.25, 0.0, 7.0];
        for dtype in [
            DType::F32,
            DType::F16,
            DType::BF16,
            DType::I8,
            DType::I16,
            DType::I32,
            DType::I64,
        ] {
            let stride = dtype.type_size() * 3 + 1; // odd stride: unaligned elements
            let mut bytes = vec![0xA5u8; stride * values.len() + 8];
            // SAFETY: `bytes` holds 5 elements at `stride` starting at offset 1.
            unsafe {
                store_f32(dtype, bytes.as_mut_ptr().add(1), stride, &values).unwrap();
            }
            let mut back = [0f32; 5];
            // SAFETY: as above.
            unsafe { load_f32(dtype, bytes.as_ptr().add(1), stride, &mut back).unwrap() };
            let want: Vec<f32> = if dtype.is_integer() {
                values.iter().map(|v| v.trunc()).collect()
            } else {
                values.to_vec()
            };
            assert_eq!(back.to_vec(), want, "{dtype}");
            assert_eq!(bytes[0], 0xA5, "{dtype}: byte before the row");
        }
    }

    #[test]
    fn quantized_rows_round_trip() {
        let values: Vec<f32> = (0..64).map(|i| (i as f32 - 31.5) / 8.0).collect();
        for dtype in [DType::Q8_0, DType::Q4_0] {
            let mut bytes = vec![0u8; dtype.row_size(64).unwrap()];
            let mut back = vec![0f32; 64];
            // SAFETY: `bytes` holds exactly one quantized row of 64 elements.
            unsafe {
                store_f32(dtype, bytes.as_mut_ptr(), dtype.type_size(), &values).unwrap();
                load_f32(dtype, bytes.as_ptr(), dtype.type_size(), &mut back).unwrap();
            }
            let step = if dtype == DType::Q8_0 {
                4.0 / 127.0
            } else {
                0.5
            };
            for (a, b) in values.iter().zip(&back) {
                assert!((a - b).abs() <= step, "{dtype}: {a} vs {b}");
            }
        }
    }
}
