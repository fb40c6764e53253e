//! ferrograph: ggml's backend layer in Rust.
//!
//! This crate is the public face of a workspace whose crates are its layers
//! (`docs/ARCHITECTURE.md` in the repository has the map): `ferrograph-base` (element types
//! and conversions, tensors, ops, graphs, buffers, the device/backend/event interfaces,
//! allocators, the scheduler, GGUF files), `ferrograph-cpu` (the CPU backend) and
//! `ferrograph-backends` (BLAS, the row-split buffer type, remote devices, backend libraries
//! loaded at run time, the global registry). Each of their modules is re-exported here under the
//! same name, so `ferrograph::tensor::Tensor` and `ferrograph::cpu::CpuBackend` name the same
//! items wherever they live.
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
#![deny(missing_docs)]

// The base layer (ggml-base).
pub use ferrograph_base::{
    alloc, backend, buffer, context, convert, device, dtype, error, event, gguf, graph, graph_copy,
    host, isa, op, ops, pool, quant, registration, sched, tensor, util,
};
// The CPU backend (ggml-cpu).
pub use ferrograph_cpu as cpu;
// The backends beside the CPU, and the registry over all of them.
pub use ferrograph_backends::{blas, dynload, export_backend, registry, remote, row_split};

pub use error::{Error, Result, Status};

// The main types at the crate root, so a dependent crate writes `ferrograph::Tensor`.
pub use alloc::{GraphAllocator, TensorAllocator};
pub use backend::{Backend, GraphPlan};
pub use buffer::{Buffer, BufferType, BufferUsage, CpuBufferType};
pub use context::Context;
pub use cpu::backend::{CpuBackend, CpuDevice};
pub use device::{BackendParams, Device, DeviceType};
pub use dtype::DType;
pub use event::Event;
pub use graph::Graph;
pub use graph_copy::GraphCopy;
pub use op::{Op, UnaryOp};
pub use pool::{Threadpool, ThreadpoolParams};
pub use registration::{Extension, Registration};
pub use row_split::{SplitBackend, SplitBufferType, SplitDevice, SplitWeight};
pub use sched::Scheduler;
pub use tensor::Tensor;

/// The library's version, as in `Cargo.toml`.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");
