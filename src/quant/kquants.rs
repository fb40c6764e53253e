//! ggml's K-quants (super-blocks of 256 values): q2_K, q3_K, q4_K, q5_K, q6_K, q8_K, and
//! iq4_xs.

use super::BlockCodec;
use crate::dtype::DType;

/// The codec of `dtype` if it is one of this module's types.
pub fn codec(dtype: DType) -> Option<BlockCodec> {
    let _ = dtype;
    None
}
