//! Element types: sizes, names, and conversion of rows to and from `f32`.
//!
//! Quantized types store values in blocks: a block of `block_size()` elements takes
//! `type_size()` bytes, so a row of `n` elements takes `n / block_size * type_size` bytes and
//! `n` must be a multiple of the block size.

use std::fmt;
use std::str::FromStr;

use half::{bf16, f16};

use crate::error::{Error, Result};
use crate::quant::{iq1, iq2, iq3, kquants, legacy, lowbit};
use crate::{convert, quant};

/// The element type of a tensor.
// Variants keep ggml's spelling of its types (q2_K, iq4_nl), which users search for.
//
// Serialised (the remote devices' wire) as ggml's type id, checked when decoded: an id that
// names no type of ferrograph is an error.
#[allow(non_camel_case_types)]
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize,
)]
#[serde(into = "u32", try_from = "u32")]
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
    /// Blocks of 32 values: an f16 scale, an f16 minimum and 16 bytes of 4-bit values.
    Q4_1,
    /// Blocks of 32 values: an f16 scale, 32 high bits and 16 bytes of low nibbles (5-bit
    /// values offset by 16).
    Q5_0,
    /// Blocks of 32 values: an f16 scale, an f16 minimum, 32 high bits and 16 bytes of low
    /// nibbles.
    Q5_1,
    /// Blocks of 32 values: an f16 scale, an f16 `scale × Σq` and 32 signed bytes (the
    /// activation partner of q4_1 and q5_1).
    Q8_1,
    /// Super-blocks of 256 values: 2-bit values in 16 groups with 4-bit scales and minimums.
    Q2_K,
    /// Super-blocks of 256 values: 3-bit values in 16 groups with 6-bit scales.
    Q3_K,
    /// Super-blocks of 256 values: 4-bit values in 8 groups with 6-bit scales and minimums.
    Q4_K,
    /// Super-blocks of 256 values: 5-bit values in 8 groups with 6-bit scales and minimums.
    Q5_K,
    /// Super-blocks of 256 values: 6-bit values in 16 groups with 8-bit scales.
    Q6_K,
    /// Super-blocks of 256 values: an f32 scale, 256 signed bytes and 16 group sums (the
    /// activation partner of the K-quants).
    Q8_K,
    /// Blocks of 32 values: an f16 scale and 4-bit indices into a fixed non-linear table.
    IQ4_NL,
    /// Super-blocks of 256 values: 4-bit indices into the IQ4_NL table with 6-bit group scales.
    IQ4_XS,
    /// Super-blocks of 256 values at ~2.06 bits each: groups of 8 values from a 256-point grid,
    /// with 7-bit sign patterns and 4-bit group scales.
    IQ2_XXS,
    /// Super-blocks of 256 values at ~2.31 bits each: groups of 8 values from a 512-point grid,
    /// with 7-bit sign patterns and 4-bit scales per 16 values.
    IQ2_XS,
    /// Super-blocks of 256 values at ~3.06 bits each: groups of 4 values from a 256-point grid,
    /// with 7-bit sign patterns and 4-bit group scales.
    IQ3_XXS,
    /// Super-blocks of 256 values at ~1.56 bits each: groups of 8 values in {-1, 0, 1} from a
    /// 2048-point grid, with a shift and a 3-bit scale per 32 values.
    IQ1_S,
    /// Super-blocks of 256 values at ~3.44 bits each: groups of 4 values from a 512-point grid,
    /// with stored 8-bit sign masks and 4-bit scales per 32 values.
    IQ3_S,
    /// Super-blocks of 256 values at ~2.56 bits each: groups of 8 values from a 1024-point grid,
    /// with stored 8-bit sign masks and 4-bit scales per 16 values.
    IQ2_S,
    /// 64-bit IEEE float (a storage type: converted to and from f32).
    F64,
    /// Super-blocks of 256 values at ~1.75 bits each: IQ1_S's grid with a shift per 8 values and
    /// 3-bit scales per 16 values, the f16 super-block scale spread over the scale bits.
    IQ1_M,
    /// Super-blocks of 256 ternary values (-1, 0, 1) packed five per byte in base 3 (~1.69 bits
    /// each) with an f16 scale.
    TQ1_0,
    /// Super-blocks of 256 ternary values (-1, 0, 1) at 2 bits each with an f16 scale.
    TQ2_0,
    /// Blocks of 32 values: an 8-bit power-of-two exponent and 4-bit FP4 (E2M1) values (the OCP
    /// microscaling format).
    MXFP4,
    /// Blocks of 64 values: four FP8 (E4M3) scales, one per 16 values, and 4-bit FP4 (E2M1)
    /// values.
    NVFP4,
    /// Blocks of 128 values at 1 bit each (a sign) with an f16 scale.
    Q1_0,
    /// Blocks of 64 values at 2 bits each (-1, 0, 1, 2) with an f16 scale.
    Q2_0,
}

impl DType {
    /// Every type, in declaration order.
    pub const ALL: [DType; 35] = [
        DType::F32,
        DType::F16,
        DType::BF16,
        DType::I8,
        DType::I16,
        DType::I32,
        DType::I64,
        DType::Q8_0,
        DType::Q4_0,
        DType::Q4_1,
        DType::Q5_0,
        DType::Q5_1,
        DType::Q8_1,
        DType::Q2_K,
        DType::Q3_K,
        DType::Q4_K,
        DType::Q5_K,
        DType::Q6_K,
        DType::Q8_K,
        DType::IQ4_NL,
        DType::IQ4_XS,
        DType::IQ2_XXS,
        DType::IQ2_XS,
        DType::IQ3_XXS,
        DType::IQ1_S,
        DType::IQ3_S,
        DType::IQ2_S,
        DType::F64,
        DType::IQ1_M,
        DType::TQ1_0,
        DType::TQ2_0,
        DType::MXFP4,
        DType::NVFP4,
        DType::Q1_0,
        DType::Q2_0,
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
            DType::Q4_1 => "q4_1",
            DType::Q5_0 => "q5_0",
            DType::Q5_1 => "q5_1",
            DType::Q8_1 => "q8_1",
            DType::Q2_K => "q2_K",
            DType::Q3_K => "q3_K",
            DType::Q4_K => "q4_K",
            DType::Q5_K => "q5_K",
            DType::Q6_K => "q6_K",
            DType::Q8_K => "q8_K",
            DType::IQ4_NL => "iq4_nl",
            DType::IQ4_XS => "iq4_xs",
            DType::IQ2_XXS => "iq2_xxs",
            DType::IQ2_XS => "iq2_xs",
            DType::IQ3_XXS => "iq3_xxs",
            DType::IQ1_S => "iq1_s",
            DType::IQ3_S => "iq3_s",
            DType::IQ2_S => "iq2_s",
            DType::F64 => "f64",
            DType::IQ1_M => "iq1_m",
            DType::TQ1_0 => "tq1_0",
            DType::TQ2_0 => "tq2_0",
            DType::MXFP4 => "mxfp4",
            DType::NVFP4 => "nvfp4",
            DType::Q1_0 => "q1_0",
            DType::Q2_0 => "q2_0",
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
            DType::F64 => Some("float64"),
            _ => None,
        }
    }

    /// Bytes taken by one block (one element for non-quantized types).
    #[inline]
    pub fn type_size(self) -> usize {
        match self {
            DType::F32 | DType::I32 => 4,
            DType::F16 | DType::BF16 | DType::I16 => 2,
            DType::I8 => 1,
            DType::I64 | DType::F64 => 8,
            DType::Q8_0 => std::mem::size_of::<quant::BlockQ8_0>(),
            DType::Q4_0 => std::mem::size_of::<quant::BlockQ4_0>(),
            DType::Q4_1 => legacy::Q4_1_BYTES,
            DType::Q5_0 => legacy::Q5_0_BYTES,
            DType::Q5_1 => legacy::Q5_1_BYTES,
            DType::Q8_1 => legacy::Q8_1_BYTES,
            DType::IQ4_NL => legacy::IQ4_NL_BYTES,
            DType::Q2_K => kquants::Q2_K_BYTES,
            DType::Q3_K => kquants::Q3_K_BYTES,
            DType::Q4_K => kquants::Q4_K_BYTES,
            DType::Q5_K => kquants::Q5_K_BYTES,
            DType::Q6_K => kquants::Q6_K_BYTES,
            DType::Q8_K => kquants::Q8_K_BYTES,
            DType::IQ4_XS => kquants::IQ4_XS_BYTES,
            DType::IQ2_XXS => iq2::IQ2_XXS_BYTES,
            DType::IQ2_XS => iq2::IQ2_XS_BYTES,
            DType::IQ2_S => iq2::IQ2_S_BYTES,
            DType::IQ3_XXS => iq3::IQ3_XXS_BYTES,
            DType::IQ3_S => iq3::IQ3_S_BYTES,
            DType::IQ1_S => iq1::IQ1_S_BYTES,
            DType::IQ1_M => iq1::IQ1_M_BYTES,
            DType::TQ1_0 => lowbit::TQ1_0_BYTES,
            DType::TQ2_0 => lowbit::TQ2_0_BYTES,
            DType::MXFP4 => lowbit::MXFP4_BYTES,
            DType::NVFP4 => lowbit::NVFP4_BYTES,
            DType::Q1_0 => lowbit::Q1_0_BYTES,
            DType::Q2_0 => lowbit::Q2_0_BYTES,
        }
    }

    /// Elements per block (1 for non-quantized types).
    #[inline]
    pub fn block_size(self) -> usize {
        match self {
            DType::Q8_0 => quant::QK8_0,
            DType::Q4_0 => quant::QK4_0,
            DType::Q4_1 | DType::Q5_0 | DType::Q5_1 | DType::Q8_1 | DType::IQ4_NL => 32,
            DType::Q2_K
            | DType::Q3_K
            | DType::Q4_K
            | DType::Q5_K
            | DType::Q6_K
            | DType::Q8_K
            | DType::IQ4_XS
            | DType::IQ2_XXS
            | DType::IQ2_XS
            | DType::IQ2_S
            | DType::IQ3_XXS
            | DType::IQ3_S
            | DType::IQ1_S
            | DType::IQ1_M
            | DType::TQ1_0
            | DType::TQ2_0 => quant::QK_K,
            DType::MXFP4 => lowbit::QK_MXFP4,
            DType::NVFP4 => lowbit::QK_NVFP4,
            DType::Q1_0 => lowbit::QK_Q1_0,
            DType::Q2_0 => lowbit::QK_Q2_0,
            _ => 1,
        }
    }

    /// Whether values are stored in quantized blocks.
    #[inline]
    pub fn is_quantized(self) -> bool {
        self.block_size() > 1
    }

    /// Whether the type is a floating-point type (f32, f16, bf16).
    #[inline]
    pub fn is_float(self) -> bool {
        matches!(self, DType::F32 | DType::F16 | DType::BF16)
    }

    /// Whether f32 values can be converted to the type ([`Self::row_from_f32`]): every type but
    /// the i-quants below 4 bits, which ggml only quantizes with a grid search and an importance
    /// matrix (their codecs have no encoder; the codec is the one place that says so).
    pub fn has_quantizer(self) -> bool {
        quant::codec(self).is_none_or(|codec| codec.from_f32.is_some())
    }

    /// Whether the type can be the weights (first operand) of MUL_MAT, MUL_MAT_ID and OUT_PROD:
    /// every float and block type but the activation-only q8_1 and q8_K.
    pub fn is_weight_type(self) -> bool {
        self.is_float() || (self.is_quantized() && !matches!(self, DType::Q8_1 | DType::Q8_K))
    }

    /// Whether the type is a plain integer type.
    #[inline]
    pub fn is_integer(self) -> bool {
        matches!(self, DType::I8 | DType::I16 | DType::I32 | DType::I64)
    }

    /// Bytes taken by a row of `n` elements; an error if `n` is not a multiple of the block size.
    #[inline]
    pub fn row_size(self, n: usize) -> Result<usize> {
        let block = self.block_size();
        if !n.is_multiple_of(block) {
            return Err(Error::shape(format!(
                "a row of {n} elements is not a whole number of {} blocks of {block}",
                self.name()
            )));
        }
        (n / block)
            .checked_mul(self.type_size())
            .ok_or_else(|| Error::shape(format!("a row of {n} {} elements overflows", self.name())))
    }

    /// Checks that `bytes` is exactly the size of a row of `n` elements ([`Self::row_size`]):
    /// the precondition of every row codec.
    pub fn check_row_bytes(self, n: usize, bytes: usize) -> Result<()> {
        let expected = self.row_size(n)?;
        if bytes != expected {
            return Err(Error::shape(format!(
                "{} row of {n} elements needs {expected} bytes, got {bytes}",
                self.name()
            )));
        }
        Ok(())
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
            "q4_1" => DType::Q4_1,
            "q5_0" => DType::Q5_0,
            "q5_1" => DType::Q5_1,
            "q8_1" => DType::Q8_1,
            "q2_k" => DType::Q2_K,
            "q3_k" => DType::Q3_K,
            "q4_k" => DType::Q4_K,
            "q5_k" => DType::Q5_K,
            "q6_k" => DType::Q6_K,
            "q8_k" => DType::Q8_K,
            "iq4_nl" => DType::IQ4_NL,
            "iq4_xs" => DType::IQ4_XS,
            "f64" | "float64" | "fp64" | "double" | "<f8" => DType::F64,
            "iq2_xxs" => DType::IQ2_XXS,
            "iq2_xs" => DType::IQ2_XS,
            "iq3_xxs" => DType::IQ3_XXS,
            "iq1_s" => DType::IQ1_S,
            "iq3_s" => DType::IQ3_S,
            "iq2_s" => DType::IQ2_S,
            "iq1_m" => DType::IQ1_M,
            "tq1_0" => DType::TQ1_0,
            "tq2_0" => DType::TQ2_0,
            "mxfp4" => DType::MXFP4,
            "nvfp4" => DType::NVFP4,
            "q1_0" => DType::Q1_0,
            "q2_0" => DType::Q2_0,
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
        self.check_row_bytes(dst.len(), src.len())?;
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
            DType::F64 => {
                for (d, s) in dst.iter_mut().zip(src.chunks_exact(8)) {
                    let mut bytes = [0u8; 8];
                    bytes.copy_from_slice(s);
                    // Rounds to nearest even; out of range becomes ±inf.
                    *d = f64::from_ne_bytes(bytes) as f32;
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
            block => {
                let codec = quant::codec(block).ok_or_else(|| no_codec(block))?;
                (codec.to_f32)(src, dst);
            }
        }
        Ok(())
    }

    /// Converts one row of f32 values into `dst` stored as `self` (quantizing where the type is
    /// quantized; integers are truncated toward zero and saturate).
    pub fn row_from_f32(self, src: &[f32], dst: &mut [u8]) -> Result<()> {
        self.check_row_bytes(src.len(), dst.len())?;
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
            DType::F64 => {
                for (d, &s) in dst.chunks_exact_mut(8).zip(src) {
                    d.copy_from_slice(&f64::from(s).to_ne_bytes());
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
            block => {
                let codec = quant::codec(block).ok_or_else(|| no_codec(block))?;
                let from_f32 = codec.from_f32.ok_or_else(|| no_quantizer(block))?;
                from_f32(src, dst);
            }
        }
        Ok(())
    }
}

/// The error for a block type without a byte codec (every type has one; kept as an error
/// rather than a panic so a future type cannot crash a caller).
fn no_codec(dtype: DType) -> Error {
    Error::unsupported(format!("no row conversion for {}", dtype.name()))
}

/// The error for a block type that is read but never written: ggml has no reference quantizer
/// for it (the i-quants' quantizers search their grids with an importance matrix).
fn no_quantizer(dtype: DType) -> Error {
    Error::unsupported(format!(
        "converting f32 to {} is not supported: ferrograph reads and multiplies {} weights but \
         does not quantize to them (ggml's quantizers for this type need an importance matrix \
         or a grid search; quantize the model with llama.cpp)",
        dtype.name(),
        dtype.name()
    ))
}

/// ggml's numbering of its types (`enum ggml_type`), as GGUF files store them.
const GGML_TYPE_IDS: [(DType, u32); 35] = [
    (DType::F32, 0),
    (DType::F16, 1),
    (DType::Q4_0, 2),
    (DType::Q4_1, 3),
    (DType::Q5_0, 6),
    (DType::Q5_1, 7),
    (DType::Q8_0, 8),
    (DType::Q8_1, 9),
    (DType::Q2_K, 10),
    (DType::Q3_K, 11),
    (DType::Q4_K, 12),
    (DType::Q5_K, 13),
    (DType::Q6_K, 14),
    (DType::Q8_K, 15),
    (DType::IQ4_NL, 20),
    (DType::IQ4_XS, 23),
    (DType::I8, 24),
    (DType::I16, 25),
    (DType::I32, 26),
    (DType::I64, 27),
    (DType::BF16, 30),
    (DType::IQ2_XXS, 16),
    (DType::IQ2_XS, 17),
    (DType::IQ3_XXS, 18),
    (DType::IQ1_S, 19),
    (DType::IQ3_S, 21),
    (DType::IQ2_S, 22),
    (DType::F64, 28),
    (DType::IQ1_M, 29),
    (DType::TQ1_0, 34),
    (DType::TQ2_0, 35),
    (DType::MXFP4, 39),
    (DType::NVFP4, 40),
    (DType::Q1_0, 41),
    (DType::Q2_0, 42),
];

/// ggml type ids that once named a type ggml has since removed (older GGUF files may carry
/// them), for error messages.
const GGML_RETIRED_TYPES: [(u32, &str); 8] = [
    (4, "q4_2"),
    (5, "q4_3"),
    (31, "q4_0_4_4"),
    (32, "q4_0_4_8"),
    (33, "q4_0_8_8"),
    (36, "iq4_nl_4_4"),
    (37, "iq4_nl_4_8"),
    (38, "iq4_nl_8_8"),
];

impl DType {
    /// ggml's id of this type (`enum ggml_type`), as GGUF files and ggml's API number it.
    pub fn ggml_type_id(self) -> u32 {
        GGML_TYPE_IDS
            .iter()
            .find(|(d, _)| *d == self)
            .map(|&(_, id)| id)
            .expect("every DType has a ggml id")
    }

    /// The type with ggml's id `id`; an error naming the id (and ggml's name for it, when it
    /// is a type ferrograph does not implement).
    pub fn from_ggml_type_id(id: u32) -> Result<DType> {
        if let Some(&(dtype, _)) = GGML_TYPE_IDS.iter().find(|(_, i)| *i == id) {
            return Ok(dtype);
        }
        match GGML_RETIRED_TYPES.iter().find(|(i, _)| *i == id) {
            Some((_, name)) => Err(Error::DType(format!(
                "ggml type id {id} ({name}) was removed from ggml; convert the file with a \
                 current llama.cpp (it repacks such weights at load time instead)"
            ))),
            None => Err(Error::DType(format!(
                "unknown ggml type id {id} (ferrograph knows ggml's types up to q2_0, id 42)"
            ))),
        }
    }
}

impl From<DType> for u32 {
    /// ggml's id of the type ([`DType::ggml_type_id`]).
    fn from(dtype: DType) -> u32 {
        dtype.ggml_type_id()
    }
}

impl TryFrom<u32> for DType {
    type Error = Error;

    /// The type with ggml's id `id` ([`DType::from_ggml_type_id`]): an error for an id
    /// ferrograph does not implement or ggml does not define.
    fn try_from(id: u32) -> Result<DType> {
        DType::from_ggml_type_id(id)
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
        // 256 values (one K-quant super-block, eight 32-blocks) spread over [-8, 8)
        let src: Vec<f32> = (0..256).map(|i| i as f32 / 16.0 - 8.0).collect();
        for dt in DType::ALL {
            let mut bytes = vec![0u8; dt.row_size(src.len()).unwrap()];
            if dt.has_quantizer() {
                dt.row_from_f32(&src, &mut bytes).unwrap();
            } else {
                let err = dt.row_from_f32(&src, &mut bytes).unwrap_err().to_string();
                assert!(err.contains(dt.name()), "{err}");
                continue;
            }
            let mut back = vec![0f32; src.len()];
            dt.row_to_f32(&bytes, &mut back).unwrap();
            // about one quantization step of each type at this range (the ternary, 1-bit and
            // FP4 types: half their coarsest step, a scale of 8)
            let tolerance = match dt {
                DType::I8 | DType::I16 | DType::I32 | DType::I64 => 1.0,
                DType::Q8_0 | DType::Q8_1 | DType::Q8_K => 0.04,
                DType::Q6_K => 0.2,
                DType::Q5_0 | DType::Q5_1 | DType::Q5_K => 0.5,
                DType::Q4_0 | DType::Q4_1 | DType::Q4_K | DType::IQ4_NL | DType::IQ4_XS => 1.0,
                DType::Q3_K => 2.0,
                DType::Q2_K => 3.0,
                DType::F32 | DType::F16 | DType::BF16 | DType::F64 => 0.0,
                // (MXFP4 clamps a block's top values to 6·2^(e−127), up to a quarter below max)
                DType::MXFP4 => 3.0,
                DType::NVFP4 => 1.5,
                DType::TQ1_0 | DType::TQ2_0 | DType::Q1_0 | DType::Q2_0 => 8.0,
                _ => unreachable!("{dt} has no quantizer"),
            };
            for (a, b) in src.iter().zip(&back) {
                assert!((a - b).abs() <= tolerance, "{dt}: {a} vs {b}");
            }
        }
    }

    #[test]
    fn ggml_type_ids_round_trip() {
        for dt in DType::ALL {
            assert_eq!(DType::from_ggml_type_id(dt.ggml_type_id()).unwrap(), dt);
        }
        // Ids ggml retired (named in the error) or never gave a type.
        for id in [4, 5, 31, 32, 33, 36, 37, 38, 43, 9999] {
            let err = DType::from_ggml_type_id(id).unwrap_err().to_string();
            assert!(err.contains(&format!("id {id}")), "{err}");
        }
        let err = DType::from_ggml_type_id(31).unwrap_err().to_string();
        assert!(err.contains("q4_0_4_4") && err.contains("removed"), "{err}");
    }

    #[test]
    fn serialised_as_ggml_ids_and_checked_when_decoded() {
        for dt in DType::ALL {
            let bytes = postcard::to_stdvec(&dt).unwrap();
            assert_eq!(bytes, postcard::to_stdvec(&dt.ggml_type_id()).unwrap());
            assert_eq!(postcard::from_bytes::<DType>(&bytes).unwrap(), dt);
        }
        for id in [4u32, 31, 9999, u32::MAX] {
            let bytes = postcard::to_stdvec(&id).unwrap();
            assert!(postcard::from_bytes::<DType>(&bytes).is_err(), "{id}");
        }
    }
}
