//! ferrograph: ggml's backend layer in Rust.
//!
//! The crate is layered bottom-up (`docs/ARCHITECTURE.md` in the repository has the map):
//! [`dtype`] and [`convert`] describe element types and convert between them, [`tensor`],
//! [`ops`] and [`graph`] describe computations, [`buffer`] holds memory, and [`cpu`] computes
//! graphs on the host.
//!
//! The main types are re-exported at the root. A graph on the CPU (the README's example):
//!
//! ```
//! use ferrograph::{ops, registry, Context, CpuBufferType, DType, Graph, GraphAllocator, UnaryOp};
//!
//! fn main() -> ferrograph::Result<()> {
//!     let ctx = Context::new(true); // describes tensors; the allocator gives them memory
//!     let w = ctx.new_tensor(DType::F32, &[4, 3])?; // ggml order: ne[0] is the row length
//!     let x = ctx.new_tensor(DType::F32, &[4, 2])?;
//!     let y = ops::unary(&ctx, &ops::mul_mat(&ctx, &w, &x)?, UnaryOp::Relu)?;
//!     let graph = Graph::build(std::slice::from_ref(&y));
//!     GraphAllocator::new(CpuBufferType::shared()).alloc_graph(&graph)?;
//!     w.set_f32(&[0.5; 12])?;
//!     x.set_f32(&[1.0; 8])?;
//!     registry::init_by_name("CPU", "n_threads=2")?.graph_compute(&graph)?;
//!     assert_eq!(y.to_f32_vec()?, vec![2.0; 6]);
//!     Ok(())
//! }
//! ```
#![deny(missing_docs, unsafe_op_in_unsafe_fn)]
#![deny(clippy::undocumented_unsafe_blocks)]

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
pub mod gguf;
pub mod graph;
pub mod graph_copy;
pub mod isa;
pub mod ops;
pub mod quant;
pub mod registry;
pub mod remote;
pub mod sched;
pub mod split;
pub mod tensor;
pub mod util;

#[cfg(feature = "python")]
mod python;

pub use error::{Error, Result, Status};

// The main types at the crate root, so a dependent crate writes `ferrograph::Tensor`.
pub use alloc::{GraphAllocator, TensorAllocator};
pub use backend::{Backend, GraphPlan};
pub use buffer::{Buffer, BufferType, BufferUsage, CpuBufferType};
pub use context::Context;
pub use cpu::backend::{CpuBackend, CpuDevice};
pub use cpu::threadpool::{Threadpool, ThreadpoolParams};
pub use device::{BackendParams, Device, DeviceType};
pub use dtype::DType;
pub use event::Event;
pub use graph::Graph;
pub use graph_copy::GraphCopy;
pub use ops::{Op, UnaryOp};
pub use registry::{Extension, Registration};
pub use sched::Scheduler;
pub use split::{SplitBackend, SplitBufferType, SplitDevice, SplitWeight};
pub use tensor::Tensor;

/// The library's version, as in `Cargo.toml`.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");
