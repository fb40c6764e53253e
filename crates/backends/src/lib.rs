//! ferrograph's backends beside the CPU and the registry over all of them: the BLAS accelerator
//! ([`blas`]), the row-split buffer type ([`row_split`]), the global registry ([`registry`]),
//! backend libraries loaded at run time ([`dynload`]) and remote devices ([`remote`]).
#![deny(missing_docs, unsafe_op_in_unsafe_fn)]
#![deny(clippy::undocumented_unsafe_blocks)]

// The lower crates' modules under their own names, so paths read `crate::tensor::Tensor` and
// `crate::cpu::CpuBackend` here as they do in the crates that define them.
use ferrograph_base::{
    alloc, backend, buffer, context, device, dtype, error, event, graph, host, op, ops, pool,
    registration, tensor,
};
use ferrograph_cpu as cpu;

pub mod blas;
pub mod dynload;
pub mod registry;
pub mod remote;
pub mod row_split;
