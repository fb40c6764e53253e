//! The client side: a [`Registration`] per server endpoint with one [`Device`] per server
//! device, and the buffer type, buffers, backend and events over the connection.
//!
//! Writes, fills, copies and graph computations are asynchronous (sent without waiting; a
//! failure surfaces at the next synchronisation); reads wait for their bytes. Events record a
//! fence (the id of the last request sent), so the scheduler waits for one split's work instead
//! of a whole backend. A graph is serialized, hashed (SHA-256 of its description, bindings
//! included) and cached on the server under a key the first time; computing it again sends
//! only the key. Freeing a buffer drops the cached graphs that use it on both sides.

use std::any::Any;
use std::collections::HashMap;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use sha2::{Digest, Sha256};

use super::connection::{ClientSettings, Connection};
use super::protocol::{encode_meta, nonce, DeviceInfo, Reply, Request};
use super::weight_cache::content_hash;
use super::wire::{Describer, GraphDesc};
use crate::backend::{Backend, Guid};
use crate::buffer::{Buffer, BufferMemory, BufferType, BufferUsage};
use crate::device::{BackendParams, Device, DeviceCaps, DeviceType};
use crate::error::{Error, Result, Status};
use crate::event::Event;
use crate::graph::Graph;
use crate::registration::Registration;
use crate::tensor::Tensor;

/// The remote backend implementation's GUID.
pub const REMOTE_GUID: Guid = *b"ferrograph-rmt\x00\x01";

/// Writes of at least this many bytes into weight buffers go through the server's weight
/// cache.
pub const CACHED_WRITE_MIN: usize = 1 << 20;

/// Graphs a client keeps cached per connection before dropping the least recently used.
const CLIENT_GRAPH_CACHE: usize = 64;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

struct CachedGraph {
    key: u64,
    buffers: Vec<u64>,
    last_use: u64,
}

/// Client-side state shared by everything made from one connection.
struct Shared {
    conn: Arc<Connection>,
    /// Local buffer id → server handle.
    buffers: Mutex<HashMap<u64, u64>>,
    graphs: Mutex<(HashMap<[u8; 32], CachedGraph>, u64)>,
}

impl Shared {
    /// The server handle and offset of a tensor's bytes, or an error when they live elsewhere.
    fn locate(&self, tensor: &Tensor) -> Result<(u64, u64)> {
        let storage = tensor.storage()?;
        let (buffer, offset) = if storage.buffer.is_multi() {
            // Find the part holding the tensor; a tensor never straddles parts.
            let mut start = 0usize;
            let mut found = None;
            for part in storage.buffer.parts() {
                if storage.offset >= start
                    && storage.offset + tensor.nbytes() <= start + part.size()
                {
                    found = Some((part.clone(), storage.offset - start));
                    break;
                }
                start += part.size();
            }
            found.ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "{} straddles the parts of a multi-buffer",
                    tensor.label()
                ))
            })?
        } else {
            (storage.buffer, storage.offset)
        };
        let handle = lock(&self.buffers)
            .get(&buffer.id())
            .copied()
            .ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "{} lives in a {} buffer, not on server {}",
                    tensor.label(),
                    buffer.buffer_type().name(),
                    self.conn.endpoint()
                ))
            })?;
        Ok((handle, offset as u64))
    }

    fn forget_buffer(&self, handle: u64) {
        lock(&self.buffers).retain(|_, h| *h != handle);
        lock(&self.graphs)
            .0
            .retain(|_, g| !g.buffers.contains(&handle));
    }
}

/// The devices of one server endpoint.
pub struct RemoteRegistration {
    name: String,
    shared: Arc<Shared>,
    devices: Vec<Arc<RemoteDevice>>,
}

impl std::fmt::Debug for RemoteRegistration {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "RemoteRegistration({})", self.name)
    }
}

/// Connects to a device server at `endpoint` (`host:port`) with `token` (or, when `None`,
/// the `FERROGRAPH_TOKEN` environment variable).
pub fn connect(
    endpoint: &str,
    token: Option<&[u8]>,
    settings: ClientSettings,
) -> Result<Arc<RemoteRegistration>> {
    let from_env;
    let token = match token {
        Some(t) => t,
        None => {
            from_env = std::env::var("FERROGRAPH_TOKEN").unwrap_or_default();
            from_env.as_bytes()
        }
    };
    let conn = Connection::open(endpoint, token, settings)?;
    log::info!(
        "connected to device server {endpoint} ({} device(s))",
        conn.welcome().devices.len()
    );
    let shared = Arc::new(Shared {
        conn: conn.clone(),
        buffers: Mutex::new(HashMap::new()),
        graphs: Mutex::new((HashMap::new(), 0)),
    });
    let name = format!("remote@{endpoint}");
    let devices = conn
        .welcome()
        .devices
        .iter()
        .enumerate()
        .map(|(i, info)| {
            let full_name = format!("{}@{endpoint}", info.name);
            Arc::new_cyclic(|me| RemoteDevice {
                index: i as u32,
                name: full_name.clone(),
                registration: name.clone(),
                info: info.clone(),
                shared: shared.clone(),
                buffer_type: Arc::new(RemoteBufferType {
                    index: i as u32,
                    name: full_name.clone(),
                    alignment: info.alignment as usize,
                    max_size: usize::try_from(info.max_size).unwrap_or(usize::MAX),
                    shared: shared.clone(),
                    device: me.clone(),
                }),
                supported: Mutex::new(HashMap::new()),
            })
        })
        .collect();
    Ok(Arc::new(RemoteRegistration {
        name,
        shared,
        devices,
    }))
}

impl RemoteRegistration {
    /// The connection's endpoint.
    pub fn endpoint(&self) -> &str {
        self.shared.conn.endpoint()
    }

    /// The remote devices, by server index.
    pub fn remote_devices(&self) -> &[Arc<RemoteDevice>] {
        &self.devices
    }

    /// Why the connection was lost, if it was.
    pub fn lost(&self) -> Option<String> {
        self.shared.conn.lost()
    }

    /// Closes the connection (as if the server had gone): later calls fail with
    /// [`Error::DeviceLost`]; the server frees the session's buffers.
    pub fn close(&self) {
        self.shared.conn.mark_lost("closed by the client");
    }
}

impl Registration for RemoteRegistration {
    fn name(&self) -> &str {
        &self.name
    }

    fn devices(&self) -> Vec<Arc<dyn Device>> {
        self.devices
            .iter()
            .map(|d| d.clone() as Arc<dyn Device>)
            .collect()
    }
}

/// A device of a server.
pub struct RemoteDevice {
    index: u32,
    name: String,
    registration: String,
    info: DeviceInfo,
    shared: Arc<Shared>,
    buffer_type: Arc<RemoteBufferType>,
    /// `supports_op` answers by op description.
    supported: Mutex<HashMap<Vec<u8>, bool>>,
}

impl std::fmt::Debug for RemoteDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "RemoteDevice({})", self.name)
    }
}

impl RemoteDevice {
    /// The connection's endpoint.
    pub fn endpoint(&self) -> &str {
        self.shared.conn.endpoint()
    }
}

impl Device for RemoteDevice {
    fn name(&self) -> &str {
        &self.name
    }

    fn description(&self) -> String {
        format!("{} on {}", self.info.description, self.endpoint())
    }

    fn memory(&self) -> (usize, usize) {
        match self
            .shared
            .conn
            .call(&Request::Memory { device: self.index }, &[])
        {
            Ok((Reply::Memory { free, total }, _)) => (free as usize, total as usize),
            _ => (0, 0),
        }
    }

    /// Remote memory is not host memory, whatever the server runs on.
    fn device_type(&self) -> DeviceType {
        DeviceType::Gpu
    }

    fn caps(&self) -> DeviceCaps {
        DeviceCaps {
            async_ops: true,
            host_buffer: false,
            buffer_from_host_ptr: false,
            events: true,
        }
    }

    fn registration_name(&self) -> &str {
        &self.registration
    }

    fn init_backend(&self, _params: &BackendParams) -> Result<Arc<dyn Backend>> {
        if let Some(reason) = self.shared.conn.lost() {
            return Err(Error::DeviceLost(format!(
                "server {}: {reason}",
                self.endpoint()
            )));
        }
        Ok(Arc::new(RemoteBackend {
            device: self
                .buffer_type
                .device
                .upgrade()
                .ok_or_else(|| Error::Backend("internal: the remote device is gone".into()))?,
        }))
    }

    fn buffer_type(&self) -> Arc<dyn BufferType> {
        self.buffer_type.clone()
    }

    /// Asks the server (once per distinct op, operand layouts included).
    fn supports_op(&self, op: &Tensor) -> bool {
        let none = |_: &Tensor| Ok(None);
        let Ok(desc) = Describer::new(&none).single(op) else {
            return false;
        };
        let Ok(key) = encode_meta(&desc) else {
            return false;
        };
        if let Some(&known) = lock(&self.supported).get(&key) {
            return known;
        }
        let request = Request::SupportsOp {
            device: self.index,
            desc,
        };
        let answer = matches!(
            self.shared.conn.call(&request, &[]),
            Ok((Reply::Supported(true), _))
        );
        if self.shared.conn.lost().is_none() {
            lock(&self.supported).insert(key, answer);
        }
        answer
    }

    fn supports_buft(&self, buffer_type: &dyn BufferType) -> bool {
        std::ptr::addr_eq(
            buffer_type as *const dyn BufferType,
            Arc::as_ptr(&self.buffer_type),
        )
    }

    fn event_new(&self) -> Result<Arc<dyn Event>> {
        Ok(Arc::new(RemoteEvent {
            shared: self.shared.clone(),
            fence: AtomicU64::new(0),
        }))
    }
}

/// The buffer type of a remote device.
pub struct RemoteBufferType {
    index: u32,
    name: String,
    alignment: usize,
    max_size: usize,
    shared: Arc<Shared>,
    device: std::sync::Weak<RemoteDevice>,
}

impl std::fmt::Debug for RemoteBufferType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "RemoteBufferType({})", self.name)
    }
}

impl BufferType for RemoteBufferType {
    fn name(&self) -> &str {
        &self.name
    }

    fn alloc_buffer(self: Arc<Self>, size: usize) -> Result<Buffer> {
        if size > self.max_size {
            return Err(Error::alloc(format!(
                "{size} bytes exceed the largest buffer of {} ({} bytes)",
                self.name, self.max_size
            )));
        }
        let request = Request::Alloc {
            device: self.index,
            size: size as u64,
        };
        let handle = match self.shared.conn.call(&request, &[])? {
            (Reply::Buffer { handle, size: got }, _) if got == size as u64 => handle,
            other => {
                return Err(Error::Backend(format!(
                    "server {} answered an allocation with {:?}",
                    self.shared.conn.endpoint(),
                    other.0
                )))
            }
        };
        let memory = RemoteMemory {
            shared: self.shared.clone(),
            handle,
            size,
            weights: AtomicBool::new(false),
        };
        let shared = self.shared.clone();
        let buffer = Buffer::new(Box::new(memory), self);
        lock(&shared.buffers).insert(buffer.id(), handle);
        Ok(buffer)
    }

    fn alignment(&self) -> usize {
        self.alignment
    }

    fn max_size(&self) -> usize {
        self.max_size
    }

    fn is_host(&self) -> bool {
        false
    }
}

/// A buffer's memory on the server; dropping it frees it there.
struct RemoteMemory {
    shared: Arc<Shared>,
    handle: u64,
    size: usize,
    /// Whether the buffer holds weights (only those go through the weight cache).
    weights: AtomicBool,
}

impl BufferMemory for RemoteMemory {
    fn size(&self) -> usize {
        self.size
    }

    fn host_ptr(&self) -> Option<NonNull<u8>> {
        None
    }

    /// Large writes into weight buffers go by content hash: the server's cache may hold them
    /// already, from this or an earlier session. Other writes (inputs, activations) are sent
    /// as they are, so they never crowd weights out of the cache.
    fn write(&self, offset: usize, data: &[u8]) -> Result<()> {
        let (buffer, offset) = (self.handle, offset as u64);
        if data.len() < CACHED_WRITE_MIN || !self.weights.load(Ordering::Relaxed) {
            let request = Request::Set { buffer, offset };
            return self.shared.conn.call_async(&request, data).map(|_| ());
        }
        let hash = content_hash(data);
        let len = data.len() as u64;
        let probe = Request::SetCached {
            buffer,
            offset,
            len,
            hash,
        };
        if let (Reply::Cached(true), _) = self.shared.conn.call(&probe, &[])? {
            return Ok(());
        }
        let upload = Request::SetAndCache {
            buffer,
            offset,
            hash,
        };
        self.shared.conn.call_async(&upload, data).map(|_| ())
    }

    fn read(&self, offset: usize, out: &mut [u8]) -> Result<()> {
        let request = Request::Get {
            buffer: self.handle,
            offset: offset as u64,
            len: out.len() as u64,
        };
        let (reply, data) = self.shared.conn.call(&request, &[])?;
        if reply != Reply::Data || data.len() != out.len() {
            return Err(Error::Backend(format!(
                "server {} answered a read of {} bytes with {} bytes",
                self.shared.conn.endpoint(),
                out.len(),
                data.len()
            )));
        }
        out.copy_from_slice(&data);
        Ok(())
    }

    fn usage_changed(&self, usage: BufferUsage) {
        self.weights
            .store(usage == BufferUsage::Weights, Ordering::Relaxed);
    }

    fn fill(&self, offset: usize, len: usize, value: u8) -> Result<()> {
        let request = Request::Memset {
            buffer: self.handle,
            offset: offset as u64,
            len: len as u64,
            value,
        };
        self.shared.conn.call_async(&request, &[]).map(|_| ())
    }
}

impl Drop for RemoteMemory {
    fn drop(&mut self) {
        self.shared.forget_buffer(self.handle);
        if self.shared.conn.lost().is_none() {
            let _ = self.shared.conn.call_async(
                &Request::Free {
                    buffer: self.handle,
                },
                &[],
            );
        }
    }
}

/// A stream of work on a remote device.
pub struct RemoteBackend {
    device: Arc<RemoteDevice>,
}

impl RemoteBackend {
    fn shared(&self) -> &Arc<Shared> {
        &self.device.shared
    }

    /// Sends `graph` for computation: its key when the server has it cached, else the
    /// description.
    fn send_graph(&self, graph: &Graph) -> Result<()> {
        let shared = self.shared();
        let locate = |t: &Tensor| shared.locate(t).map(Some);
        let desc: GraphDesc = Describer::new(&locate).graph(graph)?;
        let bytes = encode_meta(&desc)?;
        let hash: [u8; 32] = Sha256::digest(&bytes).into();
        let mut evicted = None;
        let (key, desc) = {
            let mut cache = lock(&shared.graphs);
            cache.1 += 1;
            let tick = cache.1;
            if let Some(entry) = cache.0.get_mut(&hash) {
                entry.last_use = tick;
                (entry.key, None)
            } else {
                if cache.0.len()
                    >= CLIENT_GRAPH_CACHE.min(shared.conn.welcome().max_graphs as usize)
                {
                    let oldest = cache
                        .0
                        .iter()
                        .min_by_key(|(_, g)| g.last_use)
                        .map(|(h, _)| *h);
                    if let Some(oldest) = oldest {
                        evicted = cache.0.remove(&oldest).map(|g| g.key);
                    }
                }
                let mut buffers: Vec<u64> = desc
                    .tensors
                    .iter()
                    .filter_map(|t| t.binding.map(|(h, _)| h))
                    .collect();
                buffers.sort_unstable();
                buffers.dedup();
                cache.0.insert(
                    hash,
                    CachedGraph {
                        key: tick,
                        buffers,
                        last_use: tick,
                    },
                );
                (tick, Some(desc))
            }
        };
        if let Some(old) = evicted {
            shared
                .conn
                .call_async(&Request::DropGraph { graph: old }, &[])?;
        }
        let sent = shared.conn.call_async(
            &Request::Compute {
                device: self.device.index,
                graph: key,
                desc,
            },
            &[],
        );
        if sent.is_err() {
            lock(&shared.graphs).0.remove(&hash);
        }
        sent.map(|_| ())
    }
}

impl RemoteBackend {
    /// Copies `src` (on another server, `from`) into `dst` (on ours) server to server: the
    /// source server pushes the bytes to ours under a random ticket, then ours claims them in
    /// its request stream. `Ok(false)` when the servers cannot do it (the caller copies
    /// through this process instead); a lost device is an error.
    fn push_direct(&self, from: &RemoteBackend, src: &Tensor, dst: &Tensor) -> Result<bool> {
        let (to, source) = (self.shared(), from.shared());
        let (Ok((src_handle, src_offset)), Ok((dst_handle, dst_offset))) =
            (source.locate(src), to.locate(dst))
        else {
            return Ok(false);
        };
        let mut ticket = [0u8; 16];
        ticket.copy_from_slice(&nonce()?[..16]);
        let push = Request::Push {
            buffer: src_handle,
            offset: src_offset,
            len: src.nbytes() as u64,
            to: to.conn.endpoint().to_owned(),
            ticket,
        };
        match source.conn.call(&push, &[]) {
            Ok(_) => {}
            Err(err @ Error::DeviceLost(_)) => return Err(err),
            Err(err) => {
                log::info!(
                    "direct copy {} -> {} failed ({err}); copying through this process",
                    source.conn.endpoint(),
                    to.conn.endpoint()
                );
                return Ok(false);
            }
        }
        let claim = Request::Claim {
            buffer: dst_handle,
            offset: dst_offset,
            ticket,
        };
        to.conn.call_async(&claim, &[])?;
        Ok(true)
    }
}

impl Backend for RemoteBackend {
    fn guid(&self) -> Guid {
        REMOTE_GUID
    }

    fn name(&self) -> &str {
        &self.device.name
    }

    fn device(&self) -> Arc<dyn Device> {
        self.device.clone()
    }

    fn as_any(&self) -> &dyn Any {
        self
    }

    fn set_tensor_async(&self, tensor: &Tensor, offset: usize, data: &[u8]) -> Result<()> {
        tensor.write_bytes(offset, data)
    }

    fn cpy_tensor_async(
        &self,
        src_backend: &dyn Backend,
        src: &Tensor,
        dst: &Tensor,
    ) -> Result<bool> {
        let shared = self.shared();
        let Ok((dst_handle, dst_offset)) = shared.locate(dst) else {
            return Ok(false);
        };
        let nbytes = src.nbytes();
        if let Ok((src_handle, src_offset)) = shared.locate(src) {
            // Both on this server: copied there.
            shared.conn.call_async(
                &Request::Copy {
                    src: src_handle,
                    src_offset,
                    dst: dst_handle,
                    dst_offset,
                    len: nbytes as u64,
                },
                &[],
            )?;
            return Ok(true);
        }
        let src_remote = src_backend.as_any().downcast_ref::<RemoteBackend>();
        if let Some(src_remote) = src_remote {
            if shared.conn.settings().direct_copies && self.push_direct(src_remote, src, dst)? {
                return Ok(true);
            }
        } else {
            src_backend.synchronize()?;
        }
        // Through this process: read it (a remote source's reads are ordered after its work;
        // any other backend was synchronised) and send the bytes.
        let mut data = vec![0u8; nbytes];
        src.read_bytes(0, &mut data)?;
        shared.conn.call_async(
            &Request::Set {
                buffer: dst_handle,
                offset: dst_offset,
            },
            &data,
        )?;
        Ok(true)
    }

    fn synchronize(&self) -> Result<()> {
        self.shared().conn.synchronize()
    }

    fn graph_compute_async(&self, graph: &Graph) -> Result<Status> {
        self.send_graph(graph)?;
        crate::tensor::mark_computed(graph.nodes());
        Ok(Status::Success)
    }
}

/// An event of a remote device: a fence in its connection's request stream.
pub struct RemoteEvent {
    shared: Arc<Shared>,
    fence: AtomicU64,
}

impl Event for RemoteEvent {
    fn record(&self, _backend: &dyn Backend) -> Result<()> {
        self.fence
            .store(self.shared.conn.fence(), Ordering::Release);
        Ok(())
    }

    fn synchronize(&self) -> Result<()> {
        self.shared
            .conn
            .wait_fence(self.fence.load(Ordering::Acquire))
    }

    fn wait(&self, backend: &dyn Backend) -> Result<()> {
        // Requests on one connection run in order: nothing to wait for on the same server.
        let same = backend
            .as_any()
            .downcast_ref::<RemoteBackend>()
            .is_some_and(|b| Arc::ptr_eq(b.shared(), &self.shared));
        if same {
            Ok(())
        } else {
            self.synchronize()
        }
    }
}
