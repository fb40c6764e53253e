//! The global registry of backend registrations and their devices.
//!
//! The CPU registration is always present. Others are added with [`register`] (statically, by
//! a crate or a Python plugin) and found by name (case-insensitive) or by device type.

use std::sync::{Arc, OnceLock, RwLock, RwLockReadGuard, RwLockWriteGuard};

use crate::backend::Backend;
use crate::device::{BackendParams, Device, DeviceType};
use crate::error::{Error, Result};

pub use crate::registration::{proc_address, AbortCallback, Extension, Registration, PROC_NAMES};

#[derive(Default)]
struct RegistryState {
    registrations: Vec<Arc<dyn Registration>>,
    devices: Vec<Arc<dyn Device>>,
}

fn state() -> &'static RwLock<RegistryState> {
    static STATE: OnceLock<RwLock<RegistryState>> = OnceLock::new();
    STATE.get_or_init(|| {
        let mut state = RegistryState::default();
        let cpu = crate::cpu::registration();
        state.devices.extend(cpu.devices());
        state.registrations.push(cpu);
        RwLock::new(state)
    })
}

fn read() -> RwLockReadGuard<'static, RegistryState> {
    state().read().unwrap_or_else(|p| p.into_inner())
}

fn write() -> RwLockWriteGuard<'static, RegistryState> {
    state().write().unwrap_or_else(|p| p.into_inner())
}

/// Checks a registration or device name: not empty or blank, no control characters (NUL
/// included), at most 128 bytes.
fn check_name(what: &str, name: &str) -> Result<()> {
    let problem = if name.trim().is_empty() {
        Some("is empty")
    } else if name.chars().any(char::is_control) {
        Some("contains a control character (NUL, newline, ...)")
    } else if name.len() > 128 {
        Some("is longer than 128 bytes")
    } else {
        None
    };
    match problem {
        Some(problem) => Err(Error::InvalidArgument(format!(
            "{what} name {name:?} {problem}"
        ))),
        None => Ok(()),
    }
}

/// Adds a registration and its devices. A second registration of the same name is a
/// BackendError; an empty, blank or control-character name, and a device name that is used
/// twice (within the registration or by a registered device, case-insensitively) are
/// InvalidArgument errors. A rejected registration leaves the registry unchanged.
pub fn register(registration: Arc<dyn Registration>) -> Result<()> {
    check_name("backend", registration.name())?;
    let devices = registration.devices();
    for (i, device) in devices.iter().enumerate() {
        check_name("device", device.name())?;
        if devices[..i]
            .iter()
            .any(|d| d.name().eq_ignore_ascii_case(device.name()))
        {
            return Err(Error::InvalidArgument(format!(
                "backend {:?} lists two devices named {:?}",
                registration.name(),
                device.name()
            )));
        }
    }
    {
        let mut state = write();
        if state
            .registrations
            .iter()
            .any(|r| r.name().eq_ignore_ascii_case(registration.name()))
        {
            return Err(Error::Backend(format!(
                "a backend named {:?} is already registered",
                registration.name()
            )));
        }
        if let Some(clash) = devices.iter().find(|d| {
            state
                .devices
                .iter()
                .any(|e| e.name().eq_ignore_ascii_case(d.name()))
        }) {
            return Err(Error::InvalidArgument(format!(
                "a device named {:?} is already registered",
                clash.name()
            )));
        }
        state.devices.extend(devices.iter().cloned());
        state.registrations.push(registration.clone());
    }
    // Logged after the lock is released: a log record may be forwarded to Python.
    log::info!(
        "registered backend {} with {} device(s)",
        registration.name(),
        devices.len()
    );
    Ok(())
}

/// Removes a registration (by name) and its devices; the CPU cannot be removed.
pub fn unregister(name: &str) -> Result<()> {
    if name.eq_ignore_ascii_case("CPU") {
        return Err(Error::Backend(
            "the CPU backend is built in and cannot be removed".into(),
        ));
    }
    let reg_name = {
        let mut state = write();
        let Some(index) = state
            .registrations
            .iter()
            .position(|r| r.name().eq_ignore_ascii_case(name))
        else {
            return Err(Error::Backend(format!(
                "no backend named {name:?} is registered"
            )));
        };
        let registration = state.registrations.remove(index);
        let reg_name = registration.name().to_owned();
        state.devices.retain(|d| d.registration_name() != reg_name);
        reg_name
    };
    log::info!("unregistered backend {reg_name}");
    Ok(())
}

/// Adds a single device (ggml's `device_register`).
pub fn register_device(device: Arc<dyn Device>) -> Result<()> {
    check_name("device", device.name())?;
    let mut state = write();
    if state
        .devices
        .iter()
        .any(|d| d.name().eq_ignore_ascii_case(device.name()))
    {
        return Err(Error::Backend(format!(
            "a device named {:?} is already registered",
            device.name()
        )));
    }
    state.devices.push(device);
    Ok(())
}

/// Number of registrations.
pub fn reg_count() -> usize {
    read().registrations.len()
}

/// The registration at `index`.
pub fn reg_get(index: usize) -> Result<Arc<dyn Registration>> {
    let state = read();
    state.registrations.get(index).cloned().ok_or_else(|| {
        Error::out_of_bounds(format!(
            "registration index {index} out of {}",
            state.registrations.len()
        ))
    })
}

/// Every registration, in registration order.
pub fn registrations() -> Vec<Arc<dyn Registration>> {
    read().registrations.clone()
}

/// The registration with this name (case-insensitive).
pub fn reg_by_name(name: &str) -> Option<Arc<dyn Registration>> {
    read()
        .registrations
        .iter()
        .find(|r| r.name().eq_ignore_ascii_case(name))
        .cloned()
}

/// Number of devices.
pub fn dev_count() -> usize {
    read().devices.len()
}

/// The device at `index`.
pub fn dev_get(index: usize) -> Result<Arc<dyn Device>> {
    let state = read();
    state.devices.get(index).cloned().ok_or_else(|| {
        Error::out_of_bounds(format!(
            "device index {index} out of {}",
            state.devices.len()
        ))
    })
}

/// Every device, in registration order.
pub fn devices() -> Vec<Arc<dyn Device>> {
    read().devices.clone()
}

/// The device with this name (case-insensitive).
pub fn dev_by_name(name: &str) -> Option<Arc<dyn Device>> {
    read()
        .devices
        .iter()
        .find(|d| d.name().eq_ignore_ascii_case(name))
        .cloned()
}

/// The first device of this type.
pub fn dev_by_type(device_type: DeviceType) -> Option<Arc<dyn Device>> {
    read()
        .devices
        .iter()
        .find(|d| d.device_type() == device_type)
        .cloned()
}

/// Checks `params` against what `device` understands: the built-in CPU device knows only
/// `n_threads`, so any other key is a mistake (a typo such as `n_thread`) rather than a setting;
/// other devices receive every key and judge for themselves.
pub fn check_params(device: &dyn Device, params: &BackendParams) -> Result<()> {
    if device.registration_name() == "CPU" && device.device_type() == DeviceType::Cpu {
        if let Some((key, _)) = params.extra.iter().find(|(k, _)| k != "n_threads") {
            return Err(Error::InvalidArgument(format!(
                "the CPU backend has no parameter {key:?} (it takes n_threads)"
            )));
        }
    }
    Ok(())
}

/// Opens a backend on the device named `name` (or the first device of the registration named
/// `name`), with `"key=value"` parameters.
pub fn init_by_name(name: &str, params: &str) -> Result<Arc<dyn Backend>> {
    let params = BackendParams::parse(params)?;
    let device = dev_by_name(name)
        .or_else(|| reg_by_name(name).and_then(|r| r.devices().into_iter().next()))
        .ok_or_else(|| {
            let known: Vec<String> = devices().iter().map(|d| d.name().to_owned()).collect();
            Error::Backend(format!(
                "no backend device named {name:?}; available: {}",
                known.join(", ")
            ))
        })?;
    check_params(device.as_ref(), &params)?;
    device.init_backend(&params)
}

/// Opens a backend on the first device of `device_type`.
pub fn init_by_type(device_type: DeviceType, params: &str) -> Result<Arc<dyn Backend>> {
    let params = BackendParams::parse(params)?;
    let device = dev_by_type(device_type)
        .ok_or_else(|| Error::Backend(format!("no device of type {device_type} is registered")))?;
    check_params(device.as_ref(), &params)?;
    device.init_backend(&params)
}

/// Opens the best backend: a GPU, else an integrated GPU, else the CPU.
pub fn init_best() -> Result<Arc<dyn Backend>> {
    let device = dev_by_type(DeviceType::Gpu)
        .or_else(|| dev_by_type(DeviceType::IGpu))
        .or_else(|| dev_by_type(DeviceType::Cpu))
        .ok_or_else(|| Error::Backend("no device is registered".into()))?;
    device.init_backend(&BackendParams::default())
}
