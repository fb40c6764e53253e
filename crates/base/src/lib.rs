//! ferrograph's base layer (ggml's `ggml-base`): what every backend shares.
//!
//! Bottom-up: [`error`], [`util`], [`isa`] (the CPU's extensions, probed once), [`pool`] (the
//! parallel-for every layer splits work with) and [`host`] (host memory and tensor views);
//! element types ([`dtype`], [`quant`], [`convert`]); the description of computations
//! ([`op`], [`tensor`], [`context`], [`graph`]) and its validating builders ([`ops`]), with
//! the memory and device interfaces they refer to ([`buffer`], [`device`], [`backend`],
//! [`event`], [`registration`]); then [`alloc`], [`sched`] and [`graph_copy`], and [`gguf`]
//! files. No module here knows a concrete backend: the CPU and the others build on this crate.
#![deny(missing_docs, unsafe_op_in_unsafe_fn)]
#![deny(clippy::undocumented_unsafe_blocks)]

pub mod alloc;
pub mod backend;
pub mod buffer;
pub mod context;
pub mod convert;
pub mod device;
pub mod dtype;
pub mod error;
pub mod event;
pub mod gguf;
pub mod graph;
pub mod graph_copy;
pub mod host;
pub mod isa;
pub mod op;
pub mod ops;
pub mod pool;
pub mod quant;
pub mod registration;
pub mod sched;
pub mod tensor;
pub mod util;
