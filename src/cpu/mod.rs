//! The CPU backend: feature detection, kernels and graph compute.

pub mod backend;
pub mod compute;
pub mod features;
pub(crate) mod kernels;
pub mod sysinfo;
pub mod threadpool;
pub mod type_traits;

pub use compute::{compute_graph, compute_node, supports_op, work_size, ComputeOptions};

/// Prepares the CPU backend (ggml's `cpu_init`): probes the CPU features and chooses the
/// conversion path now rather than on first use. Optional and idempotent.
pub fn cpu_init() {
    let _ = features::CpuFeatures::detect();
    let _ = crate::convert::simd_path();
}

/// The CPU backend registration (always present in the registry).
pub fn registration() -> std::sync::Arc<dyn crate::registry::Registration> {
    std::sync::Arc::new(backend::CpuRegistration)
}
