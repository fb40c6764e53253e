//! The CPU backend: feature detection, kernels and graph compute.

pub mod compute;
pub mod features;
pub mod kernels;

pub use compute::{compute_graph, compute_node, supports_op, work_size, ComputeOptions};
