//! ferrograph's CPU backend (ggml's `ggml-cpu`): the CPU device and backend, feature
//! detection, the kernels and graph compute, and the repacking buffer type.
#![deny(missing_docs, unsafe_op_in_unsafe_fn)]
#![deny(clippy::undocumented_unsafe_blocks)]

// The base layer's modules under their own names, so `crate::tensor::Tensor` reads the same
// here as in the base crate (all of them sit below this crate).
use ferrograph_base::{
    buffer, convert, device, dtype, error, event, graph, host, isa, ops, pool, quant, registration,
    tensor,
};

pub mod backend;
pub mod compute;
pub mod features;
pub mod repack;
// Crate-private: nothing outside the crate calls the kernels directly (the CPU backend does;
// BLAS reads rows through the re-exported `RowIo`).
pub(crate) mod kernels;
pub mod sysinfo;
pub mod type_traits;

pub use compute::{compute_graph, compute_node, supports_op, work_size, ComputeOptions};
pub use kernels::matmul::direct_dot_max_cols;
pub use kernels::peak::{fma_peak_gflops, int8_peak_gops};
pub use kernels::view::RowIo;

/// Prepares the CPU backend (ggml's `cpu_init`): probes the CPU features and chooses the
/// conversion path now rather than on first use. Optional and idempotent.
pub fn cpu_init() {
    let _ = features::CpuFeatures::detect();
    let _ = crate::convert::simd_path();
}

/// The CPU backend registration (always present in the registry).
pub fn registration() -> std::sync::Arc<dyn crate::registration::Registration> {
    std::sync::Arc::new(backend::CpuRegistration)
}
