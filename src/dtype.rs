//! Element types: sizes, names, and conversion of rows to and from `f32`.
//!
//! Quantized types store values in blocks: a block of `block_size()` elements takes
//! `type_size()` bytes, so a row of `n` elements takes `n / block_size * type_size` bytes and
//! `n` must be a multiple of the block size.

use std::fmt;
use std::str::FromStr;

use half::{bf16, f16};

use crate::error::{Error, Result};
use crate::{convert, quant};

/// The element type of a tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum DType {
    /// 32-bit IEEE float.
    F32,
    /// 16-bit IEEE float (half precision).
    F16,
    /// bfloat16: the top 16 bits of an f32.
    BF16,
    /// Signed 8-bit integer.
    I8,
    /// Signed 16-bit integer.
    I16,
    /// Signed 32-bit integer.
    I32,
    /// Signed 64-bit integer (row indices of SET_ROWS).
    I64,
    /// Blocks of 32 values: an f16 scale and 32 signed bytes.
    Q8_0,
    /// Blocks of 32 values: an f16 scale and 16 bytes of 4-bit values offset by 8.
    Q4_0,
}

impl DType {
    /// Every type, in declaration order.
    pub const ALL: [DType; 9] = [
        DType::F32,
        DType::F16,
        DType::BF16,
        DType::I8,
        DType::I16,
        DType::I32,
        DType::I64,
        DType::Q8_0,
        DType::Q4_0,
    ];

    /// The short name, as ggml spells it (`"f32"`, `"q8_0"`, ...).
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::I8 => "i8",
            DType::I16 => "i16",
            DType::I32 => "i32",
            DType::I64 => "i64",
            DType::Q8_0 => "q8_0",
            DType::Q4_0 => "q4_0",
        }
    }

    /// The numpy name of the element type, or `None` for block-quantized types.
    pub fn numpy_name(self) -> Option<&'static str> {
        match self {
            DType::F32 => Some("float32"),
            DType::F16 => Some("float16"),
            DType::BF16 => Some("bfloat16"),
            DType::I8 => Some("int8"),
            DType::I16 => Some("int16"),
            DType::I32 => Some("int32"),
            DType::I64 => Some("int64"),
            DType::Q8_0 | DType::Q4_0 => None,
        }
    }

    /// Bytes taken by one block (one element for non-quantized types).
    pub fn type_size(self) -> usize {
        match self {
            DType::F32 | DType::I32 => 4,
            DType::F16 | DType::BF16 | DType::I16 => 2,
            DType::I8 => 1,
            DType::I64 => 8,
            DType::Q8_0 => std::mem::size_of::<quant::BlockQ8_0>(),
            DType::Q4_0 => std::mem::size_of::<quant::BlockQ4_0>(),
        }
    }

    /// Elements per block (1 for non-quantized types).
    pub fn block_size(self) -> usize {
        match self {
            DType::Q8_0 => quant::QK8_0,
            DType::Q4_0 => quant::QK4_0,
            _ => 1,
        }
    }

    /// Whether values are stored in quantized blocks.
    pub fn is_quantized(self) -> bool {
        self.block_size() > 1
    }

    /// Whether the type is a floating-point type (f32, f16, bf16).
    pub fn is_float(self) -> bool {
        matches!(self, DType::F32 | DType::F16 | DType::BF16)
    }

    /// Whether the type is a plain integer type.
    pub fn is_integer(self) -> bool {
        matches!(self, DType::I8 | DType::I16 | DType::I32 | DType::I64)
    }

    /// Bytes taken by a row of `n` elements; an error if `n` is not a multiple of the block size.
    pub fn row_size(self, n: usize) -> Result<usize> {
        let block = self.block_size();
        if !n.is_multiple_of(block) {
            return Err(Error::Shape(format!(
                "a row of {n} elements is not a whole number of {} blocks of {block}",
                self.name()
            )));
        }
        (n / block)
            .checked_mul(self.type_size())
            .ok_or_else(|| Error::Shape(format!("a row of {n} {} elements overflows", self.name())))
    }

    /// Parses any accepted spelling: ggml's (`"f16"`), numpy's (`"float16"`), and a few common
    /// aliases (`"half"`, `"fp16"`, `"float"`, `"int"`).
    pub fn from_name(name: &str) -> Result<DType> {
        let lower = name.trim().to_ascii_lowercase();
        let dtype = match lower.as_str() {
            "f32" | "float32" | "fp32" | "float" | "<f4" => DType::F32,
            "f16" | "float16" | "fp16" | "half" | "<f2" => DType::F16,
            "bf16" | "bfloat16" => DType::BF16,
            "i8" | "int8" => DType::I8,
            "i16" | "int16" | "<i2" => DType::I16,
            "i32" | "int32" | "int" | "<i4" => DType::I32,
            "i64" | "int64" | "<i8" => DType::I64,
            "q8_0" => DType::Q8_0,
            "q4_0" => DType::Q4_0,
            _ => {
                return Err(Error::DType(format!(
                    "unknown dtype {name:?}; expected one of {}",
                    DType::ALL.map(DType::name).join(", ")
                )))
            }
        };
        Ok(dtype)
    }

    /// Converts one row of `n` elements stored as `self` in `src` into `dst` as f32.
    ///
    /// `src` must hold exactly `row_size(dst.len())` bytes. Integers convert exactly where
    /// f32 can represent them.
    pub fn row_to_f32(self, src: &[u8], dst: &mut [f32]) -> Result<()> {
        let expected = self.row_size(dst.len())?;
        if src.len() != expected {
            return Err(Error::Shape(format!(
                "{} row of {} elements needs {expected} bytes, got {}",
                self.name(),
                dst.len(),
                src.len()
            )));
        }
        match self {
            DType::F32 => {
                for (d, s) in dst.iter_mut().zip(src.chunks_exact(4)) {
                    *d = f32::from_ne_bytes([s[0], s[1], s[2], s[3]]);
                }
            }
            DType::F16 => {
                let halves: Vec<f16> = src
                    .chunks_exact(2)
                    .map(|s| f16::from_bits(u16::from_ne_bytes([s[0], s[1]])))
                    .collect();
                convert::fp16_to_fp32_row(&halves, dst)?;
            }
            DType::BF16 => {
                let halves: Vec<bf16> = src
                    .chunks_exact(2)
                    .map(|s| bf16::from_bits(u16::from_ne_bytes([s[0], s[1]])))
                    .collect();
                convert::bf16_to_fp32_row(&halves, dst)?;
            }
            DType::I8 => {
                for (d, &s) in dst.iter_mut().zip(src) {
                    *d = s as i8 as f32;
                }
            }
            DType::I16 => {
                for (d, s) in dst.iter_mut().zip(src.chunks_exact(2)) {
                    *d = i16::from_ne_bytes([s[0], s[1]]) as f32;
                }
            }
            DType::I32 => {
                for (d, s) in dst.iter_mut().zip(src.chunks_exact(4)) {
                    *d = i32::from_ne_bytes([s[0], s[1], s[2], s[3]]) as f32;
                }
            }
            DType::I64 => {
                for (d, s) in dst.iter_mut().zip(src.chunks_exact(8)) {
                    let mut bytes = [0u8; 8];
                    bytes.copy_from_slice(s);
                    *d = i64::from_ne_bytes(bytes) as f32;
                }
            }
            DType::Q8_0 => {
                let blocks = quant::blocks_q8_0(src)?;
                quant::dequantize_row_q8_0(blocks, dst)?;
            }
            DType::Q4_0 => {
                let blocks = quant::blocks_q4_0(src)?;
                quant::dequantize_row_q4_0(blocks, dst)?;
            }
        }
        Ok(())
    }

    /// Converts one row of f32 values into `dst` stored as `self` (quantizing where the type is
    /// quantized; integers are truncated toward zero and saturate).
    pub fn row_from_f32(self, src: &[f32], dst: &mut [u8]) -> Result<()> {
        let expected = self.row_size(src.len())?;
        if dst.len() != expected {
            return Err(Error::Shape(format!(
                "{} row of {} elements needs {expected} bytes, got {}",
                self.name(),
                src.len(),
                dst.len()
            )));
        }
        match self {
            DType::F32 => {
                for (d, s) in dst.chunks_exact_mut(4).zip(src) {
                    d.copy_from_slice(&s.to_ne_bytes());
                }
            }
            DType::F16 => {
                let mut halves = vec![f16::ZERO; src.len()];
                convert::fp32_to_fp16_row(src, &mut halves)?;
                for (d, h) in dst.chunks_exact_mut(2).zip(&halves) {
                    d.copy_from_slice(&h.to_bits().to_ne_bytes());
                }
            }
            DType::BF16 => {
                let mut halves = vec![bf16::ZERO; src.len()];
                convert::fp32_to_bf16_row(src, &mut halves)?;
                for (d, h) in dst.chunks_exact_mut(2).zip(&halves) {
                    d.copy_from_slice(&h.to_bits().to_ne_bytes());
                }
            }
            DType::I8 => {
                for (d, &s) in dst.iter_mut().zip(src) {
                    *d = (s as i8) as u8;
                }
            }
            DType::I16 => {
                for (d, &s) in dst.chunks_exact_mut(2).zip(src) {
                    d.copy_from_slice(&(s as i16).to_ne_bytes());
                }
            }
            DType::I32 => {
                for (d, &s) in dst.chunks_exact_mut(4).zip(src) {
                    d.copy_from_slice(&(s as i32).to_ne_bytes());
                }
            }
            DType::I64 => {
                for (d, &s) in dst.chunks_exact_mut(8).zip(src) {
                    d.copy_from_slice(&(s as i64).to_ne_bytes());
                }
            }
            DType::Q8_0 => {
                let blocks = quant::blocks_q8_0_mut(dst)?;
                quant::quantize_row_q8_0_ref(src, blocks)?;
            }
            DType::Q4_0 => {
                let blocks = quant::blocks_q4_0_mut(dst)?;
                quant::quantize_row_q4_0_ref(src, blocks)?;
            }
        }
        Ok(())
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for DType {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        DType::from_name(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_and_names() {
        assert_eq!(DType::F32.type_size(), 4);
        assert_eq!(DType::Q8_0.type_size(), 34);
        assert_eq!(DType::Q4_0.type_size(), 18);
        assert_eq!(DType::Q4_0.row_size(64).unwrap(), 36);
        assert!(DType::Q8_0.row_size(33).is_err());
        for dt in DType::ALL {
            assert_eq!(DType::from_name(dt.name()).unwrap(), dt);
            if let Some(np) = dt.numpy_name() {
                assert_eq!(DType::from_name(np).unwrap(), dt);
            }
        }
        assert!(DType::from_name("complex64").is_err());
    }

    #[test]
    fn rows_round_trip_through_bytes() {
        let src: Vec<f32> = (0..64).map(|i| i as f32 * 0.25 - 8.0).collect();
        for dt in DType::ALL {
            let mut bytes = vec![0u8; dt.row_size(src.len()).unwrap()];
            dt.row_from_f32(&src, &mut bytes).unwrap();
            let mut back = vec![0f32; src.len()];
            dt.row_to_f32(&bytes, &mut back).unwrap();
            let tolerance = match dt {
                DType::I8 | DType::I16 | DType::I32 | DType::I64 => 1.0,
                DType::Q4_0 => 1.0,
                DType::Q8_0 => 0.04,
                _ => 0.0,
            };
            for (a, b) in src.iter().zip(&back) {
                assert!((a - b).abs() <= tolerance, "{dt}: {a} vs {b}");
            }
        }
    }
}
