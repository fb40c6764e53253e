//! The CPU backend: feature detection, kernels and graph compute.

pub mod backend;
pub mod compute;
pub mod features;
pub mod repack;
// Crate-private: nothing outside the crate calls the kernels directly. `gemm::sgemm` (the
// per-ISA entry point) is called only by the kernels' own unit tests, so it is dead code in
// other builds; the allowance could be narrowed to that function inside src/cpu/kernels.
#[cfg_attr(not(test), allow(dead_code))]
pub(crate) mod kernels;
pub mod sysinfo;
pub mod type_traits;

pub use compute::{compute_graph, compute_node, supports_op, work_size, ComputeOptions};
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
