//! ferrograph: ggml's backend layer in Rust.
//!
//! The crate is layered bottom-up (see `ARCHITECTURE.md`): [`dtype`] and [`convert`] describe
//! element types and convert between them, [`tensor`], [`ops`] and [`graph`] describe
//! computations, [`buffer`] holds memory, and [`cpu`] computes graphs on the host.
#![warn(missing_docs)]

pub mod alloc;
pub mod backend;
pub mod blas;
pub mod buffer;
pub mod context;
pub mod convert;
pub mod cpu;
pub mod device;
pub mod dtype;
pub mod dynload;
pub mod error;
pub mod event;
pub mod graph;
pub mod graph_copy;
pub mod ops;
pub mod quant;
pub mod registry;
pub mod remote;
pub mod sched;
pub mod tensor;
pub mod util;

#[cfg(feature = "python")]
mod python;

pub use error::{Error, Result};

/// The library's version, as in `Cargo.toml`.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");
