//! Python classes for devices: `DeviceType` (and the `DeviceTypeArg` argument form) and
//! `Device`, a source of buffer types and backends.

use std::sync::Arc;

use pyo3::prelude::*;
use pyo3::types::PyDict;

use super::buffer::{check_array_alignment, host_array_memory, ArrayOwner};
use super::registry::params_text;
use super::{PyBackend, PyBuffer, PyBufferType, PyEvent, PyRegistration};
use crate::tensor::PyTensor;
use ferrograph::device::{BackendParams, Device, DeviceType};
use ferrograph::registry;

/// The kind of a device.
#[pyclass(
    name = "DeviceType",
    module = "ferrograph",
    eq,
    eq_int,
    frozen,
    hash,
    from_py_object
)]
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
#[allow(clippy::upper_case_acronyms)]
pub enum PyDeviceType {
    /// The host CPU.
    CPU,
    /// A discrete GPU with its own memory.
    GPU,
    /// An integrated GPU sharing host memory.
    IGPU,
    /// An accelerator used beside the CPU (BLAS, NPU, ...).
    ACCEL,
}

impl From<DeviceType> for PyDeviceType {
    fn from(t: DeviceType) -> Self {
        match t {
            DeviceType::Cpu => PyDeviceType::CPU,
            DeviceType::Gpu => PyDeviceType::GPU,
            DeviceType::IGpu => PyDeviceType::IGPU,
            DeviceType::Accel => PyDeviceType::ACCEL,
        }
    }
}

impl From<PyDeviceType> for DeviceType {
    fn from(t: PyDeviceType) -> Self {
        match t {
            PyDeviceType::CPU => DeviceType::Cpu,
            PyDeviceType::GPU => DeviceType::Gpu,
            PyDeviceType::IGPU => DeviceType::IGpu,
            PyDeviceType::ACCEL => DeviceType::Accel,
        }
    }
}

#[pymethods]
impl PyDeviceType {
    /// The upper-case name (`"CPU"`).
    #[getter]
    fn name(&self) -> &'static str {
        DeviceType::from(*self).name()
    }

    /// ggml's name for an integrated GPU: the same member as `IGPU`.
    #[classattr]
    #[allow(non_snake_case)]
    fn GPU_UMA() -> PyDeviceType {
        PyDeviceType::IGPU
    }
}

/// A device type given as `fg.DeviceType.CPU` or a name (`"cpu"`, `"gpu"`, ...).
pub(crate) enum DeviceTypeArg {
    Typed(PyDeviceType),
    Named(String),
}

impl<'a, 'py> FromPyObject<'a, 'py> for DeviceTypeArg {
    type Error = PyErr;

    fn extract(obj: pyo3::Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        if let Ok(t) = obj.extract::<PyDeviceType>() {
            return Ok(DeviceTypeArg::Typed(t));
        }
        if let Ok(name) = obj.extract::<String>() {
            return Ok(DeviceTypeArg::Named(name));
        }
        Err(crate::utils::type_error(format!(
            "expected a DeviceType or a device type name ('cpu', 'gpu', 'igpu', 'accel'), got {}",
            crate::utils::type_name(&obj)
        )))
    }
}

impl DeviceTypeArg {
    pub(super) fn resolve(self) -> ferrograph::Result<DeviceType> {
        match self {
            DeviceTypeArg::Typed(t) => Ok(t.into()),
            DeviceTypeArg::Named(name) => DeviceType::from_name(&name),
        }
    }
}

/// A device: a source of buffer types and backends.
#[pyclass(name = "Device", module = "ferrograph", frozen)]
pub struct PyDevice {
    pub(crate) inner: Arc<dyn Device>,
}

#[pymethods]
impl PyDevice {
    /// Short unique name (`"CPU"`).
    #[getter]
    fn name(&self) -> String {
        self.inner.name().to_owned()
    }

    /// Human-readable description (the CPU model for the CPU).
    #[getter]
    fn description(&self) -> String {
        self.inner.description()
    }

    /// `(free, total)` memory in bytes.
    #[getter]
    fn memory(&self) -> PyResult<(usize, usize)> {
        // A Python device's failure or malformed answer is raised here (BackendError).
        Ok(crate::plugin::checked(|| self.inner.memory())?)
    }

    /// The kind of device.
    #[getter]
    fn r#type(&self) -> PyDeviceType {
        self.inner.device_type().into()
    }

    /// The registration providing the device, or None for a device added on its own with
    /// `device_register` whose registration is not registered.
    #[getter]
    fn registration(&self) -> Option<PyRegistration> {
        registry::reg_by_name(self.inner.registration_name()).map(|inner| PyRegistration { inner })
    }

    /// The name of the registration providing the device.
    #[getter]
    fn registration_name(&self) -> String {
        self.inner.registration_name().to_owned()
    }

    /// A buffer of this device over the memory of a writable, C-contiguous numpy array,
    /// without copying (ggml's `dev_buffer_from_host_ptr`); the buffer keeps the array alive.
    /// `max_tensor_size` is the largest tensor that will be placed in it (0: unknown).
    /// BackendError when the device cannot wrap host memory (see `props()["caps"]`).
    #[pyo3(signature = (array, max_tensor_size = 0))]
    fn buffer_from_host_ptr(
        &self,
        array: &Bound<'_, PyAny>,
        max_tensor_size: usize,
    ) -> PyResult<PyBuffer> {
        let (address, size) = host_array_memory(array, "buffer_from_host_ptr")?;
        let alignment = self.inner.buffer_type().alignment();
        check_array_alignment(address, size, alignment)?;
        // SAFETY: `host_array_memory` checked that the array is writeable and C-contiguous, so
        // `address` points at `size` bytes it owns; `keep_alive` below stores a strong
        // reference to the array in the buffer, which keeps that memory valid for as long as
        // the buffer lives (numpy cannot resize an array that has other references).
        let buffer = unsafe {
            self.inner
                .buffer_from_host_ptr(address as *mut u8, size, max_tensor_size)?
        };
        buffer.keep_alive(Box::new(ArrayOwner(array.clone().unbind())));
        Ok(PyBuffer { inner: buffer })
    }

    /// Every property at once: name, description, memory_free, memory_total, type and caps
    /// (async, host_buffer, buffer_from_host_ptr, events).
    fn props<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let p = self.inner.props();
        let d = PyDict::new(py);
        d.set_item("name", p.name)?;
        d.set_item("description", p.description)?;
        d.set_item("memory_free", p.memory_free)?;
        d.set_item("memory_total", p.memory_total)?;
        d.set_item("type", PyDeviceType::from(p.device_type))?;
        let caps = PyDict::new(py);
        caps.set_item("async", p.caps.async_ops)?;
        caps.set_item("host_buffer", p.caps.host_buffer)?;
        caps.set_item("buffer_from_host_ptr", p.caps.buffer_from_host_ptr)?;
        caps.set_item("events", p.caps.events)?;
        d.set_item("caps", caps)?;
        Ok(d)
    }

    /// Opens a backend on this device. `params` is ggml's `"key=value,..."` text;
    /// `n_threads` overrides the thread count where the device has one.
    #[pyo3(signature = (params = "", n_threads = None))]
    fn init_backend(&self, params: &str, n_threads: Option<usize>) -> PyResult<PyBackend> {
        let parsed = BackendParams::parse(&params_text(params, n_threads)?)?;
        registry::check_params(self.inner.as_ref(), &parsed)?;
        Ok(PyBackend {
            inner: self.inner.init_backend(&parsed)?,
        })
    }

    /// The device's main buffer type.
    #[getter]
    fn buffer_type(&self) -> PyBufferType {
        PyBufferType {
            inner: self.inner.buffer_type(),
        }
    }

    /// A host buffer type for faster transfers to this device, or None.
    #[getter]
    fn host_buffer_type(&self) -> Option<PyBufferType> {
        self.inner
            .host_buffer_type()
            .map(|inner| PyBufferType { inner })
    }

    /// Whether the device computes the op that produces `tensor`.
    fn supports_op(&self, tensor: &PyTensor) -> PyResult<bool> {
        // A Python device's failure or non-bool answer is raised here (BackendError).
        Ok(crate::plugin::checked(|| {
            self.inner.supports_op(&tensor.inner)
        })?)
    }

    /// Whether the device's backends can use memory of `buffer_type` directly.
    fn supports_buft(&self, buffer_type: &PyBufferType) -> bool {
        self.inner.supports_buft(buffer_type.inner.as_ref())
    }

    /// Whether the scheduler should move this op here although its weights are in host memory.
    fn offload_op(&self, tensor: &PyTensor) -> bool {
        self.inner.offload_op(&tensor.inner)
    }

    /// A new event for synchronising this device's backends (BackendError if it has none).
    fn event_new(&self) -> PyResult<PyEvent> {
        Ok(PyEvent {
            inner: self.inner.event_new()?,
        })
    }

    fn __eq__(&self, other: &Bound<'_, PyAny>) -> bool {
        other
            .cast::<PyDevice>()
            .is_ok_and(|o| Arc::ptr_eq(&o.get().inner, &self.inner))
    }

    fn __hash__(&self) -> u64 {
        Arc::as_ptr(&self.inner) as *const u8 as usize as u64
    }

    fn __repr__(&self) -> String {
        let (free, total) = self.inner.memory();
        format!(
            "Device(name={:?}, type=DeviceType.{}, description={:?}, memory={:.1}/{:.1} GiB free)",
            self.inner.name(),
            self.inner.device_type().name(),
            self.inner.description(),
            free as f64 / (1u64 << 30) as f64,
            total as f64 / (1u64 << 30) as f64
        )
    }
}

/// Registers the classes and functions.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyDeviceType>()?;
    m.add_class::<PyDevice>()?;
    Ok(())
}
