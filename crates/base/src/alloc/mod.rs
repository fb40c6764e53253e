//! Memory allocation for tensors: a linear allocator for one buffer ([`TensorAllocator`]),
//! the offset planner ([`DynAllocator`]), the graph allocator ([`GraphAllocator`]) with its
//! inspectable [`MemoryPlan`] and checker ([`check_plan`]), and allocation of whole contexts
//! ([`alloc_ctx_tensors_from_buft`]), and the record of which tensors a graph's later nodes
//! overwrite ([`record_overwrites`]).

pub mod check;
pub mod ctx_alloc;
pub mod dyn_alloc;
pub mod graph_alloc;
pub mod overwrites;
pub mod plan;
pub mod tensor_alloc;

pub use check::check_plan;
pub use ctx_alloc::{alloc_ctx_tensors_from_buft, ctx_tensors_size};
pub use dyn_alloc::DynAllocator;
pub use graph_alloc::{GraphAllocator, POISON_BYTE};
pub use overwrites::{record_overwrites, record_overwrites_as};
pub use plan::{BufferPlan, MemoryPlan, TensorPlan};
pub use tensor_alloc::{tensor_alloc, view_init, TensorAllocator};
