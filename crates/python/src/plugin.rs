//! Backends written in Python: core trait implementations (`Registration`, `Device`,
//! `BufferType`, buffer memory, `Backend`) that forward to Python objects following the protocol
//! documented in `python/ferrograph/plugins.py`.
//!
//! Every call re-attaches to the interpreter, so these objects work from compute threads that
//! released it. A Python exception becomes [`Error::Backend`] naming the plugin and the method,
//! so a failing plugin never takes the process (or the registry) down.

use std::any::Any;
use std::fmt;
use std::ptr::NonNull;
use std::sync::{Arc, Weak};

use pyo3::exceptions::PyMemoryError;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyBytes, PyDict};

use super::backend::PyDeviceType;
use super::graph::PyGraph;
use super::lock::CallbackScope;
use super::tensor::PyTensor;
use ferrograph::backend::{Backend, Guid};
use ferrograph::buffer::{Buffer, BufferMemory, BufferType};
use ferrograph::device::{BackendParams, Device, DeviceCaps, DeviceType};
use ferrograph::error::{Error, Result, Status};
use ferrograph::graph::Graph;
use ferrograph::registration::Registration;
use ferrograph::tensor::Tensor;

/// Why a call into a plugin failed: the plugin raised, or it returned something the
/// protocol does not allow (described by the text, e.g. "returned str 'junk'; ...").
enum CallError {
    Raised(PyErr),
    Returned(String),
    /// A name or text of the right type but unusable content (empty, NUL).
    Invalid(String),
}

impl From<PyErr> for CallError {
    fn from(err: PyErr) -> Self {
        CallError::Raised(err)
    }
}

type CallResult<T> = std::result::Result<T, CallError>;

/// Turns a failed call of `plugin.method` into a core error: an exception the plugin raised
/// travels with it (the Python exception's `__cause__`, see [`super::raised`]) and a
/// `MemoryError` makes an allocation error; a return value that breaks the protocol is a
/// backend error naming the method and the value.
fn plugin_error(plugin: &str, method: &str, err: CallError) -> Error {
    match err {
        CallError::Raised(err) => {
            let message = format!("Python backend {plugin:?}: {method} raised {err}");
            let out_of_memory = Python::attach(|py| err.is_instance_of::<PyMemoryError>(py));
            let message = message + &super::raised::keep(err);
            if out_of_memory {
                Error::alloc(message)
            } else {
                Error::Backend(message)
            }
        }
        CallError::Returned(what) => {
            Error::Backend(format!("Python backend {plugin:?}: {method} {what}"))
        }
        CallError::Invalid(what) => {
            Error::InvalidArgument(format!("Python backend {plugin:?}: {method} {what}"))
        }
    }
}

/// "returned <type> <repr>; <rule>", the text of a protocol violation.
fn returned(value: &Bound<'_, PyAny>, rule: &str) -> CallError {
    let repr = value
        .repr()
        .map(|r| r.to_string())
        .unwrap_or_else(|_| "?".into());
    let repr: String = if repr.chars().count() > 80 {
        repr.chars().take(80).chain("...".chars()).collect()
    } else {
        repr
    };
    CallError::Returned(format!(
        "returned {} {repr}; {rule}",
        super::utils::type_name(value)
    ))
}

/// A `bool` (not merely something truthy).
fn expect_bool(value: &Bound<'_, PyAny>, method: &str) -> CallResult<bool> {
    match value.cast::<PyBool>() {
        Ok(b) => Ok(b.is_true()),
        Err(_) => Err(returned(value, &format!("{method} must return a bool"))),
    }
}

/// A non-negative `int` (not a bool) of at most `max`.
fn expect_size(value: &Bound<'_, PyAny>, what: &str, max: usize) -> CallResult<usize> {
    let rule = || format!("{what} must be an int from 0 to {max}");
    if value.cast::<PyBool>().is_ok() || value.cast::<pyo3::types::PyInt>().is_err() {
        return Err(returned(value, &rule()));
    }
    match value.extract::<usize>() {
        Ok(n) if n <= max => Ok(n),
        _ => Err(returned(value, &rule())),
    }
}

/// A `str` without NUL characters, non-empty when `non_empty`: another type is a protocol
/// error (BackendError), unusable text an invalid argument (as the registry treats names).
fn expect_text(value: &Bound<'_, PyAny>, what: &str, non_empty: bool) -> CallResult<String> {
    let text = expect_str(value, what)?;
    if text.contains('\0') || (non_empty && text.trim().is_empty()) {
        let rule = if non_empty {
            "non-empty, without NUL characters"
        } else {
            "without NUL characters"
        };
        return Err(CallError::Invalid(format!(
            "returned {text:?}; {what} must be {rule}"
        )));
    }
    Ok(text)
}

/// A `str` (a device's or registration's name, which the registry itself checks for
/// emptiness and control characters: InvalidArgumentError).
fn expect_str(value: &Bound<'_, PyAny>, what: &str) -> CallResult<String> {
    match value.cast::<pyo3::types::PyString>() {
        Ok(text) => Ok(text.to_str()?.to_owned()),
        Err(_) => Err(returned(value, &format!("{what} must be a str"))),
    }
}

/// Calls `obj.method(*args)` and extracts the result, mapping exceptions to [`Error`].
fn call<T>(
    plugin: &str,
    obj: &Py<PyAny>,
    method: &str,
    args: impl for<'py> FnOnce(Python<'py>) -> PyResult<Bound<'py, pyo3::types::PyTuple>>,
    extract: impl for<'py> FnOnce(&Bound<'py, PyAny>) -> CallResult<T>,
) -> Result<T> {
    Python::attach(|py| {
        let _scope = CallbackScope::enter();
        let run = || -> CallResult<T> {
            let args = args(py)?;
            let result = obj.bind(py).call_method1(method, args)?;
            extract(&result)
        };
        run().map_err(|e| plugin_error(plugin, method, e))
    })
}

/// Reads attribute `name` of `obj` (calling it when it is a method).
fn attr<'py, T>(
    plugin: &str,
    obj: &Bound<'py, PyAny>,
    name: &str,
    extract: impl FnOnce(&Bound<'py, PyAny>) -> CallResult<T>,
) -> Result<T> {
    let _scope = CallbackScope::enter();
    let run = || -> CallResult<T> {
        let mut value = obj.getattr(name)?;
        if value.is_callable() {
            value = value.call0()?;
        }
        extract(&value)
    };
    run().map_err(|e| plugin_error(plugin, name, e))
}

thread_local! {
    /// The failure of the last plugin call on this thread whose core interface cannot
    /// return an error (`supports_op`, `memory`, `get_alloc_size`): it is logged and a safe
    /// answer given, and the binding that asked directly raises it ([`checked`]).
    static UNREPORTED: std::cell::RefCell<Option<Error>> = const { std::cell::RefCell::new(None) };
}

/// Logs `err` with the fallback used, and keeps it for [`checked`].
fn unreported(err: Error, fallback: &str) {
    log::warn!("{err}; {fallback}");
    UNREPORTED.with(|u| *u.borrow_mut() = Some(err));
}

/// Runs `f` (a core query that may call a Python plugin, e.g. `Device::supports_op`) and
/// returns the plugin's failure instead of the safe answer it was replaced with.
pub(crate) fn checked<T>(f: impl FnOnce() -> T) -> Result<T> {
    UNREPORTED.with(|u| u.borrow_mut().take());
    let value = f();
    match UNREPORTED.with(|u| u.borrow_mut().take()) {
        Some(err) => Err(err),
        None => Ok(value),
    }
}

/// The memory of a buffer made by a Python buffer type (`read`/`write`/`fill` methods).
struct PluginMemory {
    plugin: String,
    obj: Py<PyAny>,
    size: usize,
}

impl BufferMemory for PluginMemory {
    fn size(&self) -> usize {
        self.size
    }

    fn host_ptr(&self) -> Option<NonNull<u8>> {
        None
    }

    fn write(&self, offset: usize, data: &[u8]) -> Result<()> {
        call(
            &self.plugin,
            &self.obj,
            "write",
            |py| (offset, PyBytes::new(py, data)).into_pyobject(py),
            |_| Ok(()),
        )
    }

    fn read(&self, offset: usize, out: &mut [u8]) -> Result<()> {
        let len = out.len();
        let bytes: Vec<u8> = call(
            &self.plugin,
            &self.obj,
            "read",
            |py| (offset, len).into_pyobject(py),
            |r| {
                if let Ok(b) = r.cast::<PyBytes>() {
                    Ok(b.as_bytes().to_vec())
                } else if let Ok(b) = r.cast::<pyo3::types::PyByteArray>() {
                    Ok(b.to_vec())
                } else {
                    Err(returned(r, "read must return bytes or a bytearray"))
                }
            },
        )?;
        if bytes.len() != len {
            return Err(Error::Backend(format!(
                "Python backend {:?}: read({offset}, {len}) returned {} bytes",
                self.plugin,
                bytes.len()
            )));
        }
        out.copy_from_slice(&bytes);
        Ok(())
    }

    fn fill(&self, offset: usize, len: usize, value: u8) -> Result<()> {
        call(
            &self.plugin,
            &self.obj,
            "fill",
            |py| (offset, len, value).into_pyobject(py),
            |_| Ok(()),
        )
    }
}

/// The largest alignment a Python buffer type may ask for (1 GiB).
const MAX_ALIGNMENT: usize = 1 << 30;

/// A buffer type implemented in Python (`alloc_buffer(size)`, `alignment`, `max_size`).
pub(crate) struct PluginBufferType {
    plugin: String,
    obj: Py<PyAny>,
    name: String,
    alignment: usize,
    max_size: usize,
    /// Whether the object defines `get_alloc_size(tensor)` (padding by dtype or shape).
    has_alloc_size: bool,
    /// The device the type belongs to (set once the device exists).
    device: std::sync::OnceLock<Weak<PluginDevice>>,
}

impl fmt::Debug for PluginBufferType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "PluginBufferType({})", self.name)
    }
}

impl PluginBufferType {
    fn new(plugin: &str, obj: &Bound<'_, PyAny>) -> Result<Self> {
        let name = attr(plugin, obj, "name", |v| {
            expect_text(v, "a buffer type's name", true)
        })?;
        let alignment = attr(plugin, obj, "alignment", |v| {
            expect_size(v, "alignment", MAX_ALIGNMENT)
        })?;
        let max_size = if obj.hasattr("max_size").unwrap_or(false) {
            attr(plugin, obj, "max_size", |v| {
                expect_size(v, "max_size", usize::MAX)
            })?
        } else {
            usize::MAX
        };
        if alignment == 0 || !alignment.is_power_of_two() {
            return Err(Error::Backend(format!(
                "Python backend {plugin:?}: buffer type alignment must be a power of two, got {alignment}"
            )));
        }
        if max_size == 0 {
            return Err(Error::Backend(format!(
                "Python backend {plugin:?}: buffer type max_size must be at least 1"
            )));
        }
        Ok(PluginBufferType {
            plugin: plugin.to_owned(),
            obj: obj.clone().unbind(),
            name,
            alignment,
            max_size,
            has_alloc_size: obj.hasattr("get_alloc_size").unwrap_or(false),
            device: std::sync::OnceLock::new(),
        })
    }
}

impl BufferType for PluginBufferType {
    fn name(&self) -> &str {
        &self.name
    }

    fn alloc_buffer(self: Arc<Self>, size: usize) -> Result<Buffer> {
        if size > self.max_size {
            return Err(Error::alloc(format!(
                "{} bytes exceed the maximum buffer size {} of {}",
                size, self.max_size, self.name
            )));
        }
        let memory = call(
            &self.plugin,
            &self.obj,
            "alloc_buffer",
            |py| (size,).into_pyobject(py),
            |r| {
                // The protocol: an object with read, write and fill methods.
                let missing: Vec<&str> = ["read", "write", "fill"]
                    .into_iter()
                    .filter(|m| !r.getattr(*m).is_ok_and(|f| f.is_callable()))
                    .collect();
                if missing.is_empty() {
                    Ok(r.clone().unbind())
                } else {
                    Err(returned(
                        r,
                        &format!(
                            "alloc_buffer must return a buffer object (no callable {})",
                            missing.join(", ")
                        ),
                    ))
                }
            },
        )?;
        let memory = PluginMemory {
            plugin: self.plugin.clone(),
            obj: memory,
            size,
        };
        Ok(Buffer::new(Box::new(memory), self))
    }

    fn alignment(&self) -> usize {
        self.alignment
    }

    fn max_size(&self) -> usize {
        self.max_size
    }

    /// The object's `get_alloc_size(tensor)` where it has one, never less than the tensor's
    /// bytes (a smaller answer would make tensors overlap); a failing call is logged and the
    /// tensor's bytes are used.
    fn alloc_size(&self, tensor: &Tensor) -> usize {
        let nbytes = tensor.nbytes();
        if !self.has_alloc_size {
            return nbytes;
        }
        let size = call(
            &self.plugin,
            &self.obj,
            "get_alloc_size",
            |py| (PyTensor::wrap(py, tensor.clone())?,).into_pyobject(py),
            |r| expect_size(r, "get_alloc_size", self.max_size),
        );
        match size {
            Ok(size) => size.max(nbytes),
            Err(e) => {
                unreported(e, &format!("using the tensor's {nbytes} bytes"));
                nbytes
            }
        }
    }

    fn is_host(&self) -> bool {
        false
    }

    fn device(&self) -> Option<Arc<dyn Device>> {
        let device = self.device.get()?.upgrade()?;
        Some(device)
    }
}

/// A device implemented in Python.
pub(crate) struct PluginDevice {
    registration: String,
    obj: Py<PyAny>,
    name: String,
    description: String,
    device_type: DeviceType,
    buffer_type: Arc<dyn BufferType>,
    accepts_host_buffers: bool,
    /// The device's own handle, for the backends it opens.
    me: Weak<PluginDevice>,
}

impl fmt::Debug for PluginDevice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "PluginDevice({})", self.name)
    }
}

impl PluginDevice {
    fn new(registration: &str, obj: &Bound<'_, PyAny>) -> Result<Arc<Self>> {
        let name = attr(registration, obj, "name", |v| {
            expect_str(v, "a device's name")
        })?;
        let description = if obj.hasattr("description").unwrap_or(false) {
            attr(registration, obj, "description", |v| {
                expect_text(v, "description", false)
            })?
        } else {
            format!("{name} (Python backend)")
        };
        let device_type = if obj.hasattr("type").unwrap_or(false) {
            attr(registration, obj, "type", |v| {
                if let Ok(t) = v.extract::<PyDeviceType>() {
                    return Ok(DeviceType::from(t));
                }
                let name = expect_text(v, "type must be a DeviceType or a name; a name", true)?;
                DeviceType::from_name(&name).map_err(|e| CallError::Returned(e.to_string()))
            })?
        } else {
            DeviceType::Accel
        };
        let buft_obj = attr(registration, obj, "buffer_type", |v| Ok(v.clone()))?;
        let plugin_buffer_type = Arc::new(PluginBufferType::new(registration, &buft_obj)?);
        let buffer_type: Arc<dyn BufferType> = plugin_buffer_type.clone();
        let accepts_host_buffers = if obj.hasattr("accepts_host_buffers").unwrap_or(false) {
            attr(registration, obj, "accepts_host_buffers", |v| {
                expect_bool(v, "accepts_host_buffers")
            })?
        } else {
            false
        };
        let device = Arc::new_cyclic(|me| PluginDevice {
            registration: registration.to_owned(),
            obj: obj.clone().unbind(),
            name,
            description,
            device_type,
            buffer_type,
            accepts_host_buffers,
            me: me.clone(),
        });
        // A weak link: the device owns its buffer type.
        let _ = plugin_buffer_type.device.set(Arc::downgrade(&device));
        Ok(device)
    }
}

impl Device for PluginDevice {
    fn name(&self) -> &str {
        &self.name
    }

    fn description(&self) -> String {
        self.description.clone()
    }

    fn memory(&self) -> (usize, usize) {
        Python::attach(|py| {
            let obj = self.obj.bind(py);
            if !obj.hasattr("memory").unwrap_or(false) {
                return (0, 0);
            }
            attr(&self.registration, obj, "memory", |v| {
                let rule = "memory must return (free, total): two ints with free <= total";
                let Ok(pair) = v.cast::<pyo3::types::PyTuple>() else {
                    return Err(returned(v, rule));
                };
                if pair.len() != 2 {
                    return Err(returned(v, rule));
                }
                let free = expect_size(&pair.get_item(0)?, "free memory", usize::MAX)?;
                let total = expect_size(&pair.get_item(1)?, "total memory", usize::MAX)?;
                if free > total {
                    return Err(returned(v, rule));
                }
                Ok((free, total))
            })
            .unwrap_or_else(|e| {
                unreported(e, "reporting (0, 0)");
                (0, 0)
            })
        })
    }

    fn device_type(&self) -> DeviceType {
        self.device_type
    }

    fn caps(&self) -> DeviceCaps {
        DeviceCaps::default()
    }

    fn registration_name(&self) -> &str {
        &self.registration
    }

    fn init_backend(&self, params: &BackendParams) -> Result<Arc<dyn Backend>> {
        let me = self
            .me
            .upgrade()
            .ok_or_else(|| Error::Backend(format!("device {} is gone", self.name)))?;
        let backend = call(
            &self.registration,
            &self.obj,
            "init_backend",
            |py| {
                let d = PyDict::new(py);
                for (k, v) in &params.extra {
                    d.set_item(k, v)?;
                }
                (d,).into_pyobject(py)
            },
            |r| {
                // The protocol: an object with a callable graph_compute(graph).
                let ok = !r.is_none()
                    && r.getattr("graph_compute")
                        .map(|m| m.is_callable())
                        .unwrap_or(false);
                if ok {
                    Ok(r.clone().unbind())
                } else {
                    Err(returned(
                        r,
                        "init_backend must return a backend object with a callable \
                         graph_compute(graph)",
                    ))
                }
            },
        )?;
        let name = Python::attach(|py| {
            let obj = backend.bind(py);
            if obj.hasattr("name").unwrap_or(false) {
                attr(&self.registration, obj, "name", |v| {
                    expect_text(v, "a backend's name", true)
                })
                .map(Some)
            } else {
                Ok(None)
            }
        })?
        .unwrap_or_else(|| self.name.clone());
        Ok(Arc::new(PluginBackend {
            obj: backend,
            name,
            device: me,
        }))
    }

    fn buffer_type(&self) -> Arc<dyn BufferType> {
        self.buffer_type.clone()
    }

    fn supports_op(&self, op: &Tensor) -> bool {
        let result = call(
            &self.registration,
            &self.obj,
            "supports_op",
            |py| (PyTensor::wrap(py, op.clone())?,).into_pyobject(py),
            |r| expect_bool(r, "supports_op"),
        );
        result.unwrap_or_else(|e| {
            unreported(e, "treating the op as unsupported");
            false
        })
    }

    fn supports_buft(&self, buffer_type: &dyn BufferType) -> bool {
        let own = std::ptr::addr_eq(
            Arc::as_ptr(&self.buffer_type),
            buffer_type as *const dyn BufferType,
        );
        own || (self.accepts_host_buffers && buffer_type.is_host())
    }
}

/// A backend implemented in Python (`graph_compute(graph)`, optional `synchronize()`).
pub(crate) struct PluginBackend {
    obj: Py<PyAny>,
    name: String,
    device: Arc<PluginDevice>,
}

/// GUID of every Python backend (they are told apart by name).
const PLUGIN_GUID: Guid = *b"ferrograph-py-be";

impl Backend for PluginBackend {
    fn guid(&self) -> Guid {
        PLUGIN_GUID
    }

    fn name(&self) -> &str {
        &self.name
    }

    fn device(&self) -> Arc<dyn Device> {
        self.device.clone()
    }

    fn as_any(&self) -> &dyn Any {
        self
    }

    fn graph_compute_async(&self, graph: &Graph) -> Result<Status> {
        let aborted = call(
            &self.name,
            &self.obj,
            "graph_compute",
            |py| {
                let g = Bound::new(
                    py,
                    PyGraph {
                        inner: graph.clone(),
                    },
                )?;
                (g,).into_pyobject(py)
            },
            |r| {
                // True or None: done; False: aborted; anything else breaks the protocol.
                if r.is_none() {
                    Ok(false)
                } else if let Ok(b) = r.cast::<PyBool>() {
                    Ok(!b.is_true())
                } else {
                    Err(returned(
                        r,
                        "graph_compute must return True, False (aborted) or None",
                    ))
                }
            },
        )?;
        if aborted {
            return Ok(Status::Aborted);
        }
        ferrograph::tensor::mark_computed(graph.nodes());
        Ok(Status::Success)
    }

    fn synchronize(&self) -> Result<()> {
        Python::attach(|py| {
            let _scope = CallbackScope::enter();
            let obj = self.obj.bind(py);
            if obj.hasattr("synchronize").unwrap_or(false) {
                obj.call_method0("synchronize")
                    .map(|_| ())
                    .map_err(|e| plugin_error(&self.name, "synchronize", e.into()))
            } else {
                Ok(())
            }
        })
    }
}

/// A registration implemented in Python (`name`, `devices()`).
pub(crate) struct PluginRegistration {
    name: String,
    devices: Vec<Arc<dyn Device>>,
}

impl Registration for PluginRegistration {
    fn name(&self) -> &str {
        &self.name
    }

    fn devices(&self) -> Vec<Arc<dyn Device>> {
        self.devices.clone()
    }
}

/// Registers a backend written in Python: `registration` has a `name` and a `devices()`
/// method (see `ferrograph.plugins`). Its devices join `fg.devices()`, and
/// `fg.init_backend(name)` opens them. A registration whose objects break the protocol is
/// rejected with BackendError and leaves the registry unchanged.
#[pyfunction]
pub(crate) fn register_backend<'py>(registration: &Bound<'py, PyAny>) -> PyResult<()> {
    let name = attr("?", registration, "name", |v| {
        expect_str(v, "a registration's name")
    })?;
    let device_objs = attr(&name, registration, "devices", |v| {
        let Ok(items) = v.try_iter() else {
            return Err(returned(v, "devices must return an iterable of devices"));
        };
        Ok(items.collect::<PyResult<Vec<Bound<'py, PyAny>>>>()?)
    })?;
    let devices = device_objs
        .iter()
        .map(|d| PluginDevice::new(&name, d).map(|d| d as Arc<dyn Device>))
        .collect::<Result<Vec<_>>>()?;
    ferrograph::registry::register(Arc::new(PluginRegistration { name, devices }))?;
    Ok(())
}

/// Removes a registration (and its devices) by name.
#[pyfunction]
pub(crate) fn unregister_backend(name: &str) -> PyResult<()> {
    ferrograph::registry::unregister(name)?;
    Ok(())
}

/// Registers the functions.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(register_backend, m)?)?;
    m.add_function(wrap_pyfunction!(unregister_backend, m)?)?;
    Ok(())
}
