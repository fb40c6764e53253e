//! PLACEHOLDER (replaced before this lands): ternary, FP4 and 1-bit types.
use super::BlockCodec;
use crate::dtype::DType;
/// Placeholder.
pub const TQ1_0_BYTES: usize = 54;
/// Placeholder.
pub const TQ2_0_BYTES: usize = 66;
/// Placeholder.
pub const MXFP4_BYTES: usize = 17;
/// Placeholder.
pub const NVFP4_BYTES: usize = 36;
/// Placeholder.
pub const Q1_0_BYTES: usize = 18;
/// Placeholder.
pub const QK_MXFP4: usize = 32;
/// Placeholder.
pub const QK_NVFP4: usize = 64;
/// Placeholder.
pub const QK_Q1_0: usize = 128;
/// Placeholder.
pub fn codec(_dtype: DType) -> Option<BlockCodec> {
    None
}
/// Placeholder.
pub const Q2_0_BYTES: usize = 18;
/// Placeholder.
pub const QK_Q2_0: usize = 64;
