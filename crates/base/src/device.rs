//! Devices: what a piece of hardware offers (memory, buffer types, ops) and how to open a
//! backend (a stream) on it.

use std::fmt;
use std::sync::Arc;

use crate::backend::Backend;
use crate::buffer::{Buffer, BufferType};
use crate::error::{Error, Result};
use crate::event::Event;
use crate::tensor::Tensor;

/// The kind of a device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DeviceType {
    /// The host CPU.
    Cpu,
    /// A discrete GPU with its own memory.
    Gpu,
    /// An integrated GPU that shares host memory.
    IGpu,
    /// An accelerator used beside the CPU (BLAS, NPU, ...).
    Accel,
}

impl DeviceType {
    /// Upper-case name (`"CPU"`, `"GPU"`, `"IGPU"`, `"ACCEL"`).
    pub fn name(self) -> &'static str {
        match self {
            DeviceType::Cpu => "CPU",
            DeviceType::Gpu => "GPU",
            DeviceType::IGpu => "IGPU",
            DeviceType::Accel => "ACCEL",
        }
    }

    /// Parses a name (case-insensitive; `"GPU_UMA"` is accepted for IGPU).
    pub fn from_name(name: &str) -> Result<DeviceType> {
        match name.to_ascii_uppercase().as_str() {
            "CPU" => Ok(DeviceType::Cpu),
            "GPU" => Ok(DeviceType::Gpu),
            "IGPU" | "GPU_UMA" => Ok(DeviceType::IGpu),
            "ACCEL" => Ok(DeviceType::Accel),
            _ => Err(Error::InvalidArgument(format!(
                "unknown device type {name:?}; expected CPU, GPU, IGPU or ACCEL"
            ))),
        }
    }
}

impl fmt::Display for DeviceType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Optional abilities of a device.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DeviceCaps {
    /// Asynchronous set/get/compute.
    pub async_ops: bool,
    /// Pinned host buffers for faster transfers.
    pub host_buffer: bool,
    /// Buffers that wrap existing host memory.
    pub buffer_from_host_ptr: bool,
    /// Events for synchronisation between backends.
    pub events: bool,
}

/// A snapshot of a device's description.
#[derive(Debug, Clone, PartialEq)]
pub struct DeviceProps {
    /// Short name.
    pub name: String,
    /// Human-readable description.
    pub description: String,
    /// Free memory in bytes.
    pub memory_free: usize,
    /// Total memory in bytes.
    pub memory_total: usize,
    /// Kind of device.
    pub device_type: DeviceType,
    /// Optional abilities.
    pub caps: DeviceCaps,
}

/// Parameters for opening a backend, parsed from ggml's `"key=value,key=value"` text.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BackendParams {
    /// Threads the backend may use (`None`: the device's default).
    pub n_threads: Option<usize>,
    /// Every key/value pair given, for device-specific settings.
    pub extra: Vec<(String, String)>,
}

pub use crate::pool::{check_n_threads, MAX_THREADS};

/// Whether `key` can name a backend parameter: an ASCII letter or `_` first, then letters,
/// digits, `_`, `-` or `.`.
fn is_param_key(key: &str) -> bool {
    let mut chars = key.chars();
    chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.'))
}

impl BackendParams {
    /// Parses `"n_threads=4,other=x"`; an empty string gives the defaults. Every item must be
    /// `key=value` with a non-empty value and a key made of letters, digits, `_`, `-` and `.`,
    /// each key at most once; `n_threads` must be 1 to [`MAX_THREADS`].
    pub fn parse(text: &str) -> Result<BackendParams> {
        let mut params = BackendParams::default();
        let items: Vec<&str> = text.split([',', ';']).map(str::trim).collect();
        let all_empty = items.iter().all(|s| s.is_empty());
        for (i, &item) in items.iter().enumerate() {
            if item.is_empty() {
                // "a=1," (a trailing separator) is fine; an empty item between two is not.
                if all_empty || i + 1 == items.len() {
                    continue;
                }
                return Err(Error::InvalidArgument(format!(
                    "backend parameters {text:?}: empty item {i}; expected key=value,..."
                )));
            }
            let (key, value) = item.split_once('=').ok_or_else(|| {
                Error::InvalidArgument(format!("backend parameter {item:?} is not key=value"))
            })?;
            let (key, value) = (key.trim(), value.trim());
            if !is_param_key(key) {
                return Err(Error::InvalidArgument(format!(
                    "backend parameter {item:?}: {key:?} is not a parameter name (letters, \
                     digits, '_', '-', '.')"
                )));
            }
            if value.is_empty() {
                return Err(Error::InvalidArgument(format!(
                    "backend parameter {key:?} has no value"
                )));
            }
            if params.extra.iter().any(|(k, _)| k == key) {
                return Err(Error::InvalidArgument(format!(
                    "backend parameter {key:?} is given twice"
                )));
            }
            if key == "n_threads" {
                let n: usize = value.parse().map_err(|_| {
                    Error::InvalidArgument(format!(
                        "n_threads must be an integer from 1 to {MAX_THREADS}, got {value:?}"
                    ))
                })?;
                params.n_threads = Some(check_n_threads(n)?);
            }
            params.extra.push((key.to_owned(), value.to_owned()));
        }
        Ok(params)
    }
}

/// A device: a source of buffer types and backends.
pub trait Device: Send + Sync + fmt::Debug {
    /// Short unique name (`"CPU"`).
    fn name(&self) -> &str;
    /// Human-readable description (e.g. the CPU model).
    fn description(&self) -> String;
    /// `(free, total)` memory in bytes.
    fn memory(&self) -> (usize, usize);
    /// The kind of device.
    fn device_type(&self) -> DeviceType;
    /// Optional abilities.
    fn caps(&self) -> DeviceCaps;
    /// Name of the registration that provides this device.
    fn registration_name(&self) -> &str;
    /// Opens a backend (stream) on this device.
    fn init_backend(&self, params: &BackendParams) -> Result<Arc<dyn Backend>>;
    /// The device's main buffer type.
    fn buffer_type(&self) -> Arc<dyn BufferType>;
    /// A host buffer type that speeds up transfers to this device, if any.
    fn host_buffer_type(&self) -> Option<Arc<dyn BufferType>> {
        None
    }
    /// Wraps host memory the caller owns; the default says the device cannot.
    ///
    /// # Safety
    /// `ptr` must point to `size` bytes that stay valid and writable while the buffer (or any
    /// tensor bound to it) lives.
    unsafe fn buffer_from_host_ptr(
        &self,
        ptr: *mut u8,
        size: usize,
        max_tensor_size: usize,
    ) -> Result<Buffer> {
        let _ = (ptr, size, max_tensor_size);
        Err(Error::Backend(format!(
            "device {} cannot wrap host memory",
            self.name()
        )))
    }
    /// Whether the device computes this op (with these operand dtypes and layouts).
    fn supports_op(&self, op: &Tensor) -> bool;
    /// Whether the device's backends can use memory of this buffer type directly.
    fn supports_buft(&self, buffer_type: &dyn BufferType) -> bool;
    /// Whether the scheduler should move this op here even though its weights are in host
    /// memory (worth the copy).
    fn offload_op(&self, op: &Tensor) -> bool {
        let _ = op;
        false
    }
    /// A new event for synchronising this device's backends, where supported.
    fn event_new(&self) -> Result<Arc<dyn Event>> {
        Err(Error::Backend(format!(
            "device {} has no events",
            self.name()
        )))
    }

    /// All descriptive fields at once.
    fn props(&self) -> DeviceProps {
        let (memory_free, memory_total) = self.memory();
        DeviceProps {
            name: self.name().to_owned(),
            description: self.description(),
            memory_free,
            memory_total,
            device_type: self.device_type(),
            caps: self.caps(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn params_parse() {
        let p = BackendParams::parse("n_threads=3, foo = bar").unwrap();
        assert_eq!(p.n_threads, Some(3));
        assert_eq!(p.extra[1], ("foo".into(), "bar".into()));
        assert!(BackendParams::parse("n_threads=0").is_err());
        assert!(BackendParams::parse("junk").is_err());
        assert_eq!(BackendParams::parse("").unwrap(), BackendParams::default());
        assert_eq!(DeviceType::from_name("gpu_uma").unwrap(), DeviceType::IGpu);
    }
}
