//! A BLAS accelerator backend: large matrix products through a CBLAS library found at run
//! time (ggml's BLAS backend).
//!
//! Nothing is linked when the crate is built. The first time the backend is asked about, the
//! library named by `FERROGRAPH_BLAS_LIB` is tried, then the usual OpenBLAS / reference BLAS
//! names, then an OpenBLAS already mapped into the process (numpy's bundled copy, whose
//! symbols are suffixed and take 64-bit integers). When none is found, the registration
//! simply has no device and says why in the log; nothing fails at startup.
//!
//! The device is an accelerator beside the CPU: it works in the CPU's host memory (its buffer
//! type is [`CpuBufferType`](crate::buffer::CpuBufferType) and it accepts any host buffer
//! type), so a scheduler can hand it large products without copying. It computes MUL_MAT with
//! f32, f16, bf16, q8_0 or q4_0 weights and f32 activations (non-f32 weights are converted to
//! f32 rows first), OUT_PROD on f32 operands, and treats the view ops as no-ops. A product is
//! only accepted when all of its sizes reach a threshold ([`DEFAULT_MIN_DIM`], settable per
//! device and per backend with the `min_dim` parameter), as smaller ones are faster on the
//! CPU kernels.
//!
//! The registry's built-ins stay CPU-only: add this backend in-process with [`register`], or
//! load it as a library (`backends/blas`, see [`crate::dynload`]).

mod backend;
mod gemm;
mod library;

use std::sync::Arc;

pub use backend::{
    as_blas, shared_device, supports_op_with, BlasBackend, BlasDevice, BlasRegistration, BLAS_GUID,
    BLAS_NAME, DEFAULT_MIN_DIM, MIN_DIM_PARAM,
};
pub use library::{find_library, BlasLibrary, BLAS_LIB_ENV, DEFAULT_CANDIDATES, DISABLE_VALUES};

use crate::error::Result;
use crate::registration::Registration;

/// The BLAS registration (zero devices when no BLAS library is found).
pub fn registration() -> Arc<dyn Registration> {
    Arc::new(BlasRegistration)
}

/// Adds the BLAS registration to the global registry; an error if one named "BLAS" is
/// already registered (for example loaded from a library).
pub fn register() -> Result<()> {
    crate::registry::register(registration())
}

/// The process's BLAS library, when one was found.
pub fn library() -> Option<Arc<BlasLibrary>> {
    library::library().ok()
}

/// Why there is no BLAS device, or `None` when there is one.
pub fn unavailable_reason() -> Option<String> {
    library::library().err()
}

/// Whether a BLAS library was found (so the registration has a device).
pub fn is_available() -> bool {
    library::library().is_ok()
}

/// Sets the size threshold of the process's BLAS device (used by its `supports_op` and as
/// the default of backends opened afterwards); a no-op when there is no device.
pub fn set_min_dim(min_dim: usize) {
    if let Some(device) = shared_device() {
        device.set_min_dim(min_dim);
    }
}

/// The score a loadable BLAS library reports: 0 (cannot run here) without a BLAS library,
/// else 1.
pub fn score() -> i32 {
    i32::from(is_available())
}
