//! The interface a backend implementation registers through (ggml's `ggml_backend_reg`): a
//! [`Registration`] names an implementation and lists its devices; typed [`Extension`]s stand
//! for ggml's `get_proc_address` functions. The global table of registrations is
//! `registry` (in the backends layer, since it knows the CPU and the loaders).

use std::fmt;
use std::sync::Arc;

use crate::backend::Backend;
use crate::buffer::BufferType;
use crate::device::Device;
use crate::error::Result;

/// A callback polled between nodes; returning true stops the computation.
pub type AbortCallback = Arc<dyn Fn() -> bool + Send + Sync>;

/// A named extension function of a registration (ggml's `get_proc_address`), typed.
#[derive(Clone)]
pub enum Extension {
    /// Sets a backend's thread count.
    SetThreadCount(fn(&dyn Backend, usize) -> Result<()>),
    /// Installs (or clears) a backend's abort callback.
    SetAbortCallback(fn(&dyn Backend, Option<AbortCallback>) -> Result<()>),
    /// Lists the registration's features as name/value pairs.
    Features(fn() -> Vec<(String, String)>),
    /// Extra buffer types a device offers beside its main one.
    ExtraBufferTypes(fn() -> Vec<Arc<dyn BufferType>>),
}

impl fmt::Debug for Extension {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let name = match self {
            Extension::SetThreadCount(_) => "SetThreadCount",
            Extension::SetAbortCallback(_) => "SetAbortCallback",
            Extension::Features(_) => "Features",
            Extension::ExtraBufferTypes(_) => "ExtraBufferTypes",
        };
        write!(f, "Extension::{name}")
    }
}

/// A backend registration: one implementation and the devices it provides.
pub trait Registration: Send + Sync {
    /// The registration's name (`"CPU"`).
    fn name(&self) -> &str;
    /// Its devices.
    fn devices(&self) -> Vec<Arc<dyn Device>>;
    /// A named extension function, if provided.
    fn proc_address(&self, name: &str) -> Option<Extension> {
        let _ = name;
        None
    }
}

/// The extension names registrations answer to, each with ggml's name for it.
pub const PROC_NAMES: [(&str, &str); 4] = [
    ("set_n_threads", "ggml_backend_set_n_threads"),
    ("set_abort_callback", "ggml_backend_set_abort_callback"),
    ("get_features", "ggml_backend_get_features"),
    ("dev_get_extra_bufts", "ggml_backend_dev_get_extra_bufts"),
];

/// `registration`'s extension function `name`, looked up under either of its names: the short
/// one (`"set_abort_callback"`) or ggml's (`"ggml_backend_set_abort_callback"`), whichever the
/// registration implements. Prefer this to calling [`Registration::proc_address`] directly.
pub fn proc_address(registration: &dyn Registration, name: &str) -> Option<Extension> {
    if let Some(found) = registration.proc_address(name) {
        return Some(found);
    }
    let other = PROC_NAMES.iter().find_map(|&(short, ggml)| {
        if name == short {
            Some(ggml)
        } else if name == ggml {
            Some(short)
        } else {
            None
        }
    })?;
    registration.proc_address(other)
}

impl fmt::Debug for dyn Registration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Registration({})", self.name())
    }
}
