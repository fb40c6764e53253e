//! PLACEHOLDER (replaced before this lands): the i-quants below 4 bits.
use super::BlockCodec;
use crate::dtype::DType;
/// Placeholder.
pub const IQ2_XXS_BYTES: usize = 66;
/// Placeholder.
pub const IQ2_XS_BYTES: usize = 74;
/// Placeholder.
pub const IQ2_S_BYTES: usize = 82;
/// Placeholder.
pub const IQ3_XXS_BYTES: usize = 98;
/// Placeholder.
pub const IQ3_S_BYTES: usize = 110;
/// Placeholder.
pub const IQ1_S_BYTES: usize = 50;
/// Placeholder.
pub const IQ1_M_BYTES: usize = 56;
/// Placeholder.
pub fn codec(_dtype: DType) -> Option<BlockCodec> {
    None
}
