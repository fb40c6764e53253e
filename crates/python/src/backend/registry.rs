//! The Python `Registration` class and the registry functions (`fg.devices()`,
//! `fg.reg_get(i)`, `fg.init_backend(...)`, ...).

use std::sync::Arc;

use pyo3::prelude::*;
use pyo3::types::PyDict;

use super::{
    abort_callback_into, backend_abort_slot, DeviceTypeArg, PyBackend, PyBufferType, PyDevice,
};
use crate::lock::detach_quiet;
use ferrograph::device::check_n_threads;
use ferrograph::error::Error;
use ferrograph::registry::{self, Extension, Registration};

/// A backend registration: one implementation and its devices.
#[pyclass(name = "Registration", module = "ferrograph", frozen)]
pub struct PyRegistration {
    pub(crate) inner: Arc<dyn Registration>,
}

#[pymethods]
impl PyRegistration {
    /// The registration's name (`"CPU"`).
    #[getter]
    fn name(&self) -> String {
        self.inner.name().to_owned()
    }

    /// Its devices.
    fn devices(&self) -> Vec<PyDevice> {
        self.inner
            .devices()
            .into_iter()
            .map(|inner| PyDevice { inner })
            .collect()
    }

    /// Number of devices.
    #[getter]
    fn dev_count(&self) -> usize {
        self.inner.devices().len()
    }

    /// Whether the registration provides the named extension function (ggml's
    /// `get_proc_address`): "set_n_threads", "set_abort_callback", "get_features",
    /// "dev_get_extra_bufts", or the same under ggml's names ("ggml_backend_set_n_threads",
    /// "ggml_backend_set_abort_callback", "ggml_backend_get_features",
    /// "ggml_backend_dev_get_extra_bufts").
    fn has_proc(&self, name: &str) -> bool {
        registry::proc_address(self.inner.as_ref(), name).is_some()
    }

    /// Installs (or with None clears) `backend`'s abort callback through the registration's
    /// "set_abort_callback" extension: as `Backend.set_abort_callback`, for any backend whose
    /// registration provides the extension. UnsupportedOpError when it does not.
    fn set_abort_callback(
        &self,
        py: Python<'_>,
        backend: &PyBackend,
        callback: Option<Py<PyAny>>,
    ) -> PyResult<()> {
        let Some(Extension::SetAbortCallback(set)) =
            registry::proc_address(self.inner.as_ref(), "set_abort_callback")
        else {
            return Err(Error::unsupported(format!(
                "registration {} has no set_abort_callback",
                self.inner.name()
            ))
            .into());
        };
        if let Some(cb) = &callback {
            crate::utils::check_callable(cb.bind(py), "set_abort_callback")?;
        }
        let target = backend.inner.clone();
        let slot = backend_abort_slot(&target);
        let callback = callback.map(|cb| abort_callback_into(cb, move |err| slot.store(err)));
        py.detach(|| set(target.as_ref(), callback))?;
        Ok(())
    }

    /// The registration's features as a dict (its "get_features" extension), or {}.
    fn features<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        if let Some(Extension::Features(f)) =
            registry::proc_address(self.inner.as_ref(), "get_features")
        {
            for (k, v) in f() {
                d.set_item(k, v)?;
            }
        }
        Ok(d)
    }

    /// Extra buffer types its devices offer (its "dev_get_extra_bufts" extension), or [].
    fn extra_buffer_types(&self) -> Vec<PyBufferType> {
        match registry::proc_address(self.inner.as_ref(), "dev_get_extra_bufts") {
            Some(Extension::ExtraBufferTypes(f)) => f()
                .into_iter()
                .map(|inner| PyBufferType { inner })
                .collect(),
            _ => Vec::new(),
        }
    }

    /// Sets a backend's thread count through the registration's extension function.
    fn set_n_threads(&self, py: Python<'_>, backend: &PyBackend, n_threads: usize) -> PyResult<()> {
        check_n_threads(n_threads)?;
        match registry::proc_address(self.inner.as_ref(), "set_n_threads") {
            Some(Extension::SetThreadCount(f)) => {
                let backend = backend.inner.clone();
                // Resizing takes the backend's pool lock: never with the interpreter held.
                Ok(detach_quiet(py, || f(backend.as_ref(), n_threads))?)
            }
            _ => Err(Error::unsupported(format!(
                "registration {} has no set_n_threads",
                self.inner.name()
            ))
            .into()),
        }
    }

    fn __repr__(&self) -> String {
        format!(
            "Registration(name={:?}, devices={})",
            self.inner.name(),
            self.inner.devices().len()
        )
    }
}

/// Every registered device, in registration order.
#[pyfunction]
fn devices() -> Vec<PyDevice> {
    registry::devices()
        .into_iter()
        .map(|inner| PyDevice { inner })
        .collect()
}

/// Number of registered devices.
#[pyfunction]
fn dev_count() -> usize {
    registry::dev_count()
}

/// The device at `index` (OutOfBoundsError past the end).
#[pyfunction]
fn dev_get(index: usize) -> PyResult<PyDevice> {
    Ok(PyDevice {
        inner: registry::dev_get(index)?,
    })
}

/// The device with this name (case-insensitive), or None.
#[pyfunction]
fn dev_by_name(name: &str) -> Option<PyDevice> {
    registry::dev_by_name(name).map(|inner| PyDevice { inner })
}

/// The first device of this type, or None.
#[pyfunction]
fn dev_by_type(device_type: DeviceTypeArg) -> PyResult<Option<PyDevice>> {
    Ok(registry::dev_by_type(device_type.resolve()?).map(|inner| PyDevice { inner }))
}

/// Every registration, in order.
#[pyfunction]
fn registrations() -> Vec<PyRegistration> {
    registry::registrations()
        .into_iter()
        .map(|inner| PyRegistration { inner })
        .collect()
}

/// Number of registrations.
#[pyfunction]
fn reg_count() -> usize {
    registry::reg_count()
}

/// The registration at `index` (OutOfBoundsError past the end).
#[pyfunction]
fn reg_get(index: usize) -> PyResult<PyRegistration> {
    Ok(PyRegistration {
        inner: registry::reg_get(index)?,
    })
}

/// Adds one device to the registry on its own (ggml's `device_register`), e.g. a device of a
/// registration that is not itself registered. BackendError when a device of that name is
/// already registered.
#[pyfunction]
fn device_register(device: &PyDevice) -> PyResult<()> {
    registry::register_device(device.inner.clone())?;
    Ok(())
}

/// The registration with this name (case-insensitive), or None.
#[pyfunction]
fn reg_by_name(name: &str) -> Option<PyRegistration> {
    registry::reg_by_name(name).map(|inner| PyRegistration { inner })
}

/// ggml's parameter text with `n_threads` (if given) appended.
pub(super) fn params_text(params: &str, n_threads: Option<usize>) -> PyResult<String> {
    let Some(n) = n_threads else {
        return Ok(params.to_owned());
    };
    check_n_threads(n)?;
    Ok(if params.trim().is_empty() {
        format!("n_threads={n}")
    } else {
        format!("{params},n_threads={n}")
    })
}

/// Opens a backend on the device with this name (case-insensitive), e.g. `"CPU"`.
/// BackendError names the known devices when there is none by that name.
#[pyfunction]
#[pyo3(signature = (name, params = "", n_threads = None))]
fn init_backend(name: &str, params: &str, n_threads: Option<usize>) -> PyResult<PyBackend> {
    let params = params_text(params, n_threads)?;
    Ok(PyBackend {
        inner: registry::init_by_name(name, &params)?,
    })
}

/// Opens a backend on the first device of this type.
#[pyfunction]
#[pyo3(signature = (device_type, params = "", n_threads = None))]
fn init_by_type(
    device_type: DeviceTypeArg,
    params: &str,
    n_threads: Option<usize>,
) -> PyResult<PyBackend> {
    let params = params_text(params, n_threads)?;
    Ok(PyBackend {
        inner: registry::init_by_type(device_type.resolve()?, &params)?,
    })
}

/// Opens the best backend: a GPU if present, else an integrated GPU, else the CPU.
#[pyfunction]
fn init_best() -> PyResult<PyBackend> {
    Ok(PyBackend {
        inner: registry::init_best()?,
    })
}

/// Registers the classes and functions.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyRegistration>()?;
    m.add_function(wrap_pyfunction!(devices, m)?)?;
    m.add_function(wrap_pyfunction!(dev_count, m)?)?;
    m.add_function(wrap_pyfunction!(dev_get, m)?)?;
    m.add_function(wrap_pyfunction!(dev_by_name, m)?)?;
    m.add_function(wrap_pyfunction!(dev_by_type, m)?)?;
    m.add_function(wrap_pyfunction!(registrations, m)?)?;
    m.add_function(wrap_pyfunction!(reg_by_name, m)?)?;
    m.add_function(wrap_pyfunction!(reg_count, m)?)?;
    m.add_function(wrap_pyfunction!(reg_get, m)?)?;
    m.add_function(wrap_pyfunction!(device_register, m)?)?;
    m.add_function(wrap_pyfunction!(init_backend, m)?)?;
    m.add_function(wrap_pyfunction!(init_by_type, m)?)?;
    m.add_function(wrap_pyfunction!(init_best, m)?)?;
    Ok(())
}
