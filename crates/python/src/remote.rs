//! Remote devices from Python: `remote_connect` (a client's devices of one server),
//! `remote_open` with its `RemoteConnection` handle (the same devices, plus `close()`) and
//! `RemoteServer` (a device server running in this process).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use pyo3::prelude::*;

use super::backend::PyDevice;
use super::errors::invalid;
use ferrograph::device::Device;
use ferrograph::error::Error;
use ferrograph::remote::{self, ClientSettings, RemoteRegistration, Server, ServerConfig};

fn seconds(value: f64, what: &str) -> PyResult<Duration> {
    if value.is_finite() && value > 0.0 && value < 1e9 {
        Ok(Duration::from_secs_f64(value))
    } else {
        Err(invalid(format!(
            "{what} must be a positive number of seconds, got {value}"
        )))
    }
}

#[allow(clippy::too_many_arguments)] // the keyword arguments of the Python functions below
fn open_registration(
    py: Python<'_>,
    endpoint: &str,
    token: Option<&str>,
    connect_timeout: f64,
    heartbeat: f64,
    dead_after: f64,
    request_timeout: f64,
    direct_copies: bool,
) -> PyResult<Arc<RemoteRegistration>> {
    let settings = ClientSettings {
        connect_timeout: seconds(connect_timeout, "connect_timeout")?,
        heartbeat: seconds(heartbeat, "heartbeat")?,
        dead_after: seconds(dead_after, "dead_after")?,
        request_timeout: seconds(request_timeout, "request_timeout")?,
        direct_copies,
    };
    if settings.dead_after <= settings.heartbeat {
        return Err(invalid("dead_after must be longer than heartbeat"));
    }
    Ok(py.detach(|| remote::connect(endpoint, token.map(str::as_bytes), settings))?)
}

fn devices_of(registration: &RemoteRegistration) -> Vec<PyDevice> {
    registration
        .remote_devices()
        .iter()
        .map(|d| PyDevice {
            inner: d.clone() as Arc<dyn Device>,
        })
        .collect()
}

/// Connects to the device server at `endpoint` (`"host:port"`) and returns its devices.
///
/// The token comes from `token` or the `FERROGRAPH_TOKEN` environment variable. The devices
/// keep the connection open; it closes when the last of them (and of their buffers and
/// backends) is gone. A server that dies or stops answering for `dead_after` seconds makes
/// every call on its devices raise `DeviceLostError`. With `direct_copies`, tensors move
/// between two servers directly (the source server pushes them, authenticated with its own
/// token) instead of through this process, which stays the fallback.
#[pyfunction]
#[allow(clippy::too_many_arguments)] // keyword arguments of a Python function
#[pyo3(signature = (endpoint, token = None, *, connect_timeout = 5.0, heartbeat = 0.5, dead_after = 3.0, request_timeout = 600.0, direct_copies = true))]
pub(crate) fn remote_connect(
    py: Python<'_>,
    endpoint: &str,
    token: Option<&str>,
    connect_timeout: f64,
    heartbeat: f64,
    dead_after: f64,
    request_timeout: f64,
    direct_copies: bool,
) -> PyResult<Vec<PyDevice>> {
    let registration = open_registration(
        py,
        endpoint,
        token,
        connect_timeout,
        heartbeat,
        dead_after,
        request_timeout,
        direct_copies,
    )?;
    Ok(devices_of(&registration))
}

/// Connects like `remote_connect` but returns the connection itself, a `RemoteConnection`.
#[pyfunction]
#[allow(clippy::too_many_arguments)] // keyword arguments of a Python function
#[pyo3(signature = (endpoint, token = None, *, connect_timeout = 5.0, heartbeat = 0.5, dead_after = 3.0, request_timeout = 600.0, direct_copies = true))]
pub(crate) fn remote_open(
    py: Python<'_>,
    endpoint: &str,
    token: Option<&str>,
    connect_timeout: f64,
    heartbeat: f64,
    dead_after: f64,
    request_timeout: f64,
    direct_copies: bool,
) -> PyResult<PyRemoteConnection> {
    let registration = open_registration(
        py,
        endpoint,
        token,
        connect_timeout,
        heartbeat,
        dead_after,
        request_timeout,
        direct_copies,
    )?;
    Ok(PyRemoteConnection { registration })
}

/// One client connection to a device server (from `ferrograph.remote.open_connection`).
///
/// `devices` are the server's devices over this connection. `close()` ends the connection at
/// once, as if the server had gone: every later call on its devices, their buffers and
/// backends (including one blocked waiting for a reply) raises `DeviceLostError`, and the
/// server frees what this connection held. Closing again does nothing. Other connections
/// to the same server are not affected. As a context manager it closes on exit.
#[pyclass(name = "RemoteConnection", module = "ferrograph._core", frozen)]
pub(crate) struct PyRemoteConnection {
    registration: Arc<RemoteRegistration>,
}

#[pymethods]
impl PyRemoteConnection {
    /// The `"host:port"` connected to.
    #[getter]
    fn endpoint(&self) -> String {
        self.registration.endpoint().to_owned()
    }

    /// The server's devices over this connection; `DeviceLostError` once it is closed or lost.
    #[getter]
    fn devices(&self) -> PyResult<Vec<PyDevice>> {
        if let Some(reason) = self.registration.lost() {
            return Err(Error::DeviceLost(format!(
                "server {}: {reason}",
                self.registration.endpoint()
            ))
            .into());
        }
        Ok(devices_of(&self.registration))
    }

    /// Why the connection ended (`"closed by the client"` after `close()`), or `None` while
    /// it is open.
    #[getter]
    fn lost(&self) -> Option<String> {
        self.registration.lost()
    }

    /// Whether the connection has ended (closed here, or the server lost).
    #[getter]
    fn closed(&self) -> bool {
        self.registration.lost().is_some()
    }

    /// Closes the connection (idempotent); its devices raise `DeviceLostError` from now on.
    fn close(&self, py: Python<'_>) {
        py.detach(|| self.registration.close());
    }

    fn __enter__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }

    fn __exit__(
        &self,
        py: Python<'_>,
        _exc_type: Option<&Bound<'_, PyAny>>,
        _exc: Option<&Bound<'_, PyAny>>,
        _tb: Option<&Bound<'_, PyAny>>,
    ) -> bool {
        self.close(py);
        false
    }

    fn __repr__(&self) -> String {
        let state = match self.registration.lost() {
            None => "open".to_owned(),
            Some(reason) => format!("closed: {reason}"),
        };
        format!(
            "RemoteConnection(endpoint='{}', devices={}, {state})",
            self.registration.endpoint(),
            self.registration.remote_devices().len()
        )
    }
}

/// A device server running in this process (threads in the background).
///
/// `RemoteServer(token=..., host="127.0.0.1", port=0)` binds at once; `address` is the
/// `"host:port"` it listens on. Uploads of 1 MiB or more are kept by content hash (up to
/// `weight_cache_bytes`, 1 GiB by default) for later clients. `peers` lists the only servers
/// (`"ip:port"`) this one pushes to, authenticated with `peer_token` (default: the token);
/// `limits` sets further bounds by name (`max_meta`, `max_queued_requests`,
/// `max_reply_queue_bytes`, `max_deposit_bytes`, `max_handshakes`, `max_sessions`,
/// `max_graphs`, `max_graph_tensors`, `weight_cache_min_bytes`, `max_peers_per_session`). `serve_forever()` blocks until `stop()` (from another thread)
/// or Ctrl-C. Use as a context manager to stop it on exit.
#[pyclass(name = "RemoteServer", module = "ferrograph._core")]
pub(crate) struct PyRemoteServer {
    server: Mutex<Option<Server>>,
    address: String,
}

impl PyRemoteServer {
    fn lock(&self) -> std::sync::MutexGuard<'_, Option<Server>> {
        self.server.lock().unwrap_or_else(|p| p.into_inner())
    }
}

#[pymethods]
impl PyRemoteServer {
    #[new]
    #[allow(clippy::too_many_arguments)] // keyword arguments of a Python constructor
    #[pyo3(signature = (token = None, host = "127.0.0.1", port = 0, *, n_threads = None, max_frame = None, max_session_bytes = None, weight_cache_bytes = None, peers = None, peer_token = None, limits = None))]
    fn new(
        py: Python<'_>,
        token: Option<&str>,
        host: &str,
        port: u16,
        n_threads: Option<usize>,
        max_frame: Option<u64>,
        max_session_bytes: Option<u64>,
        weight_cache_bytes: Option<u64>,
        peers: Option<Vec<String>>,
        peer_token: Option<&str>,
        limits: Option<std::collections::HashMap<String, u64>>,
    ) -> PyResult<Self> {
        let token = match token {
            Some(t) => t.to_owned(),
            None => std::env::var("FERROGRAPH_TOKEN").unwrap_or_default(),
        };
        let mut config = ServerConfig::new(token.into_bytes());
        config.host = host.to_owned();
        config.port = port;
        if n_threads == Some(0) {
            return Err(invalid("n_threads must be at least 1"));
        }
        config.n_threads = n_threads;
        if let Some(max) = max_frame {
            config.max_payload = max;
        }
        if let Some(max) = max_session_bytes {
            config.max_session_bytes = max;
        }
        if let Some(max) = weight_cache_bytes {
            config.weight_cache_bytes = max;
        }
        for peer in peers.unwrap_or_default() {
            config.peers.push(peer.parse().map_err(|_| {
                invalid(format!("peers expects \"ip:port\" entries, got {peer:?}"))
            })?);
        }
        config.peer_token = peer_token.map(|t| t.as_bytes().to_vec());
        for (name, value) in limits.unwrap_or_default() {
            remote::server::set_limit(&mut config, &name, value)?;
        }
        let server = py.detach(|| Server::start(config))?;
        let address = server.addr().to_string();
        Ok(PyRemoteServer {
            server: Mutex::new(Some(server)),
            address,
        })
    }

    /// The `"host:port"` the server listens on.
    #[getter]
    fn address(&self) -> String {
        self.address.clone()
    }

    /// The port it listens on.
    #[getter]
    fn port(&self) -> u16 {
        self.address
            .rsplit(':')
            .next()
            .and_then(|p| p.parse().ok())
            .unwrap_or(0)
    }

    /// Clients connected right now.
    #[getter]
    fn sessions(&self) -> usize {
        self.lock().as_ref().map_or(0, Server::sessions)
    }

    /// Whether the server is running.
    #[getter]
    fn running(&self) -> bool {
        self.lock().is_some()
    }

    /// Stops the server: every connection is closed at once (clients get `DeviceLostError`).
    fn stop(&self, py: Python<'_>) {
        let taken = self.lock().take();
        if let Some(mut server) = taken {
            py.detach(|| server.stop());
        }
    }

    /// Blocks (without the interpreter lock) until `stop()` is called from another thread;
    /// Ctrl-C (KeyboardInterrupt) stops the server and is raised.
    fn serve_forever(&self, py: Python<'_>) -> PyResult<()> {
        while self.running() {
            py.detach(|| std::thread::sleep(Duration::from_millis(100)));
            if let Err(interrupt) = py.check_signals() {
                self.stop(py);
                return Err(interrupt);
            }
        }
        Ok(())
    }

    fn __enter__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }

    fn __exit__(
        &self,
        py: Python<'_>,
        _exc_type: Option<&Bound<'_, PyAny>>,
        _exc: Option<&Bound<'_, PyAny>>,
        _tb: Option<&Bound<'_, PyAny>>,
    ) -> bool {
        self.stop(py);
        false
    }

    fn __repr__(&self) -> String {
        format!(
            "RemoteServer(address='{}', running={})",
            self.address,
            self.running()
        )
    }
}

/// Registers the remote functions and classes.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(remote_connect, m)?)?;
    m.add_function(wrap_pyfunction!(remote_open, m)?)?;
    m.add_class::<PyRemoteConnection>()?;
    m.add_class::<PyRemoteServer>()?;
    Ok(())
}
