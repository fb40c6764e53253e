//! The CPU backend: feature detection, kernels and graph compute.

pub mod features;
