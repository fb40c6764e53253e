//! ggml's 32-value block types beyond q8_0/q4_0: q4_1, q5_0, q5_1, q8_1 and iq4_nl.

use super::BlockCodec;
use crate::dtype::DType;

/// The codec of `dtype` if it is one of this module's types.
pub fn codec(dtype: DType) -> Option<BlockCodec> {
    let _ = dtype;
    None
}
