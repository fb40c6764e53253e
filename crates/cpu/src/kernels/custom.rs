//! Op::Custom: calls the user's [`CustomOp::compute`](crate::ops::CustomOp::compute).

use crate::error::Result;
use crate::ops::CustomOpRef;
use crate::tensor::Tensor;

/// Runs a custom op for `node` (its operands are `node.srcs()`), on the current pool.
pub fn custom(op: &CustomOpRef, node: &Tensor) -> Result<()> {
    op.0.compute(node, node.srcs())
}
