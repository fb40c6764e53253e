//! The device server: exposes this process's host devices (CPU, and BLAS when registered) to
//! remote clients over TCP.
//!
//! Each connection is a session: a tokio task reads and checks frames, answers heartbeats at
//! once and hands requests, in order, to the session's own worker thread, which owns the
//! session's buffers, cached graphs and backends and runs the computations. Replies go through
//! a writer task. When the connection ends (or breaks), the worker finishes what it was doing,
//! then every buffer of the session is freed. A frame that cannot be decoded gets an error
//! reply and the connection is closed; a request that fails (bad handle, out of bounds, a graph
//! that does not validate, a computation error) gets an error reply and the session goes on.
//! Nothing a client sends can stop the server or affect another session.
//!
//! The server's threads never log: inside a Python process (`python -m ferrograph serve`, a
//! `RemoteServer` in a test) a log record needs the interpreter, which a thread waiting for
//! this server may hold. Errors go to the client that caused them.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt, BufWriter};
use tokio::net::tcp::OwnedWriteHalf;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc as tmpsc, OwnedSemaphorePermit, Semaphore};

use super::connection::{ClientSettings, Connection};
use super::protocol::{
    decode_meta, encode_meta, error_kind, nonce, proof, proof_matches, Auth, Challenge, Command,
    DeviceInfo, ErrorReply, FrameHeader, FrameLimits, Hello, Reply, Request, Welcome,
    HANDSHAKE_META_LIMIT, HEADER_LEN, PROTOCOL_VERSION,
};
use super::weight_cache::WeightCache;
use super::wire::{build_graph, BuiltGraph, GraphLimits};
use crate::backend::Backend;
use crate::buffer::Buffer;
use crate::device::{BackendParams, Device};
use crate::error::{Error, Result, Status};

/// Settings of a device server.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// Address to bind (`127.0.0.1` unless told otherwise).
    pub host: String,
    /// Port to bind (0 picks a free one).
    pub port: u16,
    /// The shared secret clients must prove they hold (never sent over the wire).
    pub token: Vec<u8>,
    /// Largest frame payload (tensor bytes in one request).
    pub max_payload: u64,
    /// Largest frame metadata (a serialized graph).
    pub max_meta: u32,
    /// Bytes of buffers one session may hold at once.
    pub max_session_bytes: u64,
    /// Graphs one session may keep cached.
    pub max_graphs: u32,
    /// Tensors in one graph.
    pub max_graph_tensors: usize,
    /// Bytes of uploads kept by content hash for later sessions (0: no cache).
    pub weight_cache_bytes: u64,
    /// Threads of each session's compute backends (`None`: the device's default).
    pub n_threads: Option<usize>,
    /// Time a client has to complete the handshake.
    pub handshake_timeout: Duration,
    /// A session that receives nothing (clients ping every half second) for this long is
    /// closed.
    pub idle_timeout: Duration,
}

impl ServerConfig {
    /// Defaults: 127.0.0.1, a free port, 1 GiB frames, 64 MiB metadata, 64 GiB per session,
    /// 256 cached graphs of up to a million tensors, a 1 GiB weight cache, 5 s handshake,
    /// 60 s idle limit.
    pub fn new(token: impl Into<Vec<u8>>) -> ServerConfig {
        ServerConfig {
            host: "127.0.0.1".into(),
            port: 0,
            token: token.into(),
            max_payload: 1 << 30,
            max_meta: 64 << 20,
            max_session_bytes: 64 << 30,
            max_graphs: 256,
            max_graph_tensors: 1 << 20,
            weight_cache_bytes: 1 << 30,
            n_threads: None,
            handshake_timeout: Duration::from_secs(5),
            idle_timeout: Duration::from_secs(60),
        }
    }
}

/// State shared by the server's tasks and its handle.
struct Shared {
    config: ServerConfig,
    devices: Vec<Arc<dyn Device>>,
    /// Test hook: while set, sessions stop reading and answering (a hung server).
    frozen: AtomicBool,
    sessions: AtomicUsize,
    weights: WeightCache,
    /// Bytes other servers pushed here, by ticket, until claimed (or too old).
    deposits: Mutex<HashMap<[u8; 16], Deposit>>,
}

/// Bytes another server pushed here, and when.
type Deposit = (Vec<u8>, std::time::Instant);

/// Deposits not claimed within this time are dropped.
const DEPOSIT_LIFETIME: Duration = Duration::from_secs(60);

/// A running device server; dropping it stops it.
pub struct Server {
    addr: SocketAddr,
    shared: Arc<Shared>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl std::fmt::Debug for Server {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Server({})", self.addr)
    }
}

/// The devices a server exposes: every registered device with host memory.
fn host_devices() -> Vec<Arc<dyn Device>> {
    crate::registry::devices()
        .into_iter()
        .filter(|d| d.buffer_type().is_host())
        .collect()
}

impl Server {
    /// Binds and starts serving in background threads; returns once the port is bound.
    pub fn start(config: ServerConfig) -> Result<Server> {
        if config.token.is_empty() {
            return Err(Error::InvalidArgument(
                "a device server needs a token (--token-file or FERROGRAPH_TOKEN)".into(),
            ));
        }
        if config.max_payload == 0 || config.max_meta < HANDSHAKE_META_LIMIT {
            return Err(Error::InvalidArgument(format!(
                "max_payload must be positive and max_meta at least {HANDSHAKE_META_LIMIT}"
            )));
        }
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("ferrograph-serve")
            .enable_all()
            .build()
            .map_err(|e| Error::Backend(format!("cannot start the server runtime: {e}")))?;
        let listener = runtime
            .block_on(TcpListener::bind((config.host.as_str(), config.port)))
            .map_err(|e| {
                Error::Backend(format!(
                    "cannot listen on {}:{}: {e}",
                    config.host, config.port
                ))
            })?;
        let addr = listener
            .local_addr()
            .map_err(|e| Error::Backend(format!("cannot read the bound address: {e}")))?;
        let shared = Arc::new(Shared {
            devices: host_devices(),
            frozen: AtomicBool::new(false),
            sessions: AtomicUsize::new(0),
            deposits: Mutex::new(HashMap::new()),
            weights: WeightCache::new(
                usize::try_from(config.weight_cache_bytes).unwrap_or(usize::MAX),
            ),
            config,
        });
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let task_shared = shared.clone();
        let thread = std::thread::Builder::new()
            .name("ferrograph-serve".into())
            .spawn(move || {
                runtime.block_on(async move {
                    tokio::select! {
                        _ = accept_loop(listener, task_shared) => {}
                        _ = stop_rx => {}
                    }
                });
                // Drops every connection task at once: clients see their connection close.
                runtime.shutdown_background();
            })
            .map_err(|e| Error::Backend(format!("cannot start the server thread: {e}")))?;
        log::info!("ferrograph device server listening on {addr}");
        Ok(Server {
            addr,
            shared,
            stop: Some(stop_tx),
            thread: Some(thread),
        })
    }

    /// The address the server listens on.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Sessions currently connected.
    pub fn sessions(&self) -> usize {
        self.shared.sessions.load(Ordering::Relaxed)
    }

    /// Bytes held in the weight cache.
    pub fn weight_cache_bytes(&self) -> usize {
        self.shared.weights.bytes()
    }

    /// Test hook: while frozen, sessions neither read nor answer, as a hung server.
    pub fn set_frozen(&self, frozen: bool) {
        self.shared.frozen.store(frozen, Ordering::Relaxed);
    }

    /// Stops the server: no new connections, every connection closed at once (from a client's
    /// view, the server died). Computations already running finish in the background.
    pub fn stop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }

    /// Blocks until the server stops (from another thread's [`Server::stop`]) or `until`
    /// returns true (polled every 100 ms).
    pub fn wait(&self, until: impl Fn() -> bool) {
        while self.thread.as_ref().is_some_and(|t| !t.is_finished()) && !until() {
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop();
    }
}

async fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
    loop {
        match listener.accept().await {
            Ok((stream, _peer)) => {
                let shared = shared.clone();
                tokio::spawn(async move {
                    shared.sessions.fetch_add(1, Ordering::Relaxed);
                    serve_connection(stream, &shared).await;
                    shared.sessions.fetch_sub(1, Ordering::Relaxed);
                });
            }
            Err(_) => {
                // Out of file descriptors and the like: wait instead of spinning.
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

/// A frame on its way out.
struct OutFrame {
    command: Command,
    request_id: u64,
    meta: Vec<u8>,
    payload: Vec<u8>,
    /// Close the connection after writing it.
    last: bool,
}

impl OutFrame {
    fn new<T: serde::Serialize>(command: Command, request_id: u64, meta: &T) -> OutFrame {
        OutFrame {
            command,
            request_id,
            // Our own metadata types always encode.
            meta: encode_meta(meta).unwrap_or_default(),
            payload: Vec::new(),
            last: false,
        }
    }

    fn error(request_id: u64, err: &Error, fatal: bool) -> OutFrame {
        let reply = ErrorReply {
            kind: error_kind(err),
            message: err.to_string(),
            fatal,
        };
        OutFrame {
            last: fatal,
            ..OutFrame::new(Command::Error, request_id, &reply)
        }
    }
}

async fn write_loop(wr: OwnedWriteHalf, mut rx: tmpsc::UnboundedReceiver<OutFrame>) {
    let mut w = BufWriter::with_capacity(1 << 16, wr);
    while let Some(frame) = rx.recv().await {
        let header = FrameHeader {
            command: frame.command,
            request_id: frame.request_id,
            meta_len: frame.meta.len() as u32,
            payload_len: frame.payload.len() as u64,
        };
        let written = async {
            w.write_all(&header.encode()).await?;
            w.write_all(&frame.meta).await?;
            w.write_all(&frame.payload).await?;
            if rx.is_empty() || frame.last {
                w.flush().await?;
            }
            std::io::Result::Ok(())
        }
        .await;
        if written.is_err() {
            break;
        }
        if frame.last {
            let _ = w.shutdown().await;
            break;
        }
    }
}

/// Why reading a frame stopped.
enum ReadError {
    /// The peer closed the connection (or it broke).
    Closed,
    /// The bytes are not a valid frame.
    Bad(Error),
}

async fn read_head<R: AsyncRead + Unpin>(
    r: &mut R,
    limits: FrameLimits,
) -> std::result::Result<(FrameHeader, Vec<u8>), ReadError> {
    let mut head = [0u8; HEADER_LEN];
    r.read_exact(&mut head)
        .await
        .map_err(|_| ReadError::Closed)?;
    let header = FrameHeader::decode(&head, limits).map_err(ReadError::Bad)?;
    let mut meta = vec![0u8; header.meta_len as usize];
    r.read_exact(&mut meta)
        .await
        .map_err(|_| ReadError::Closed)?;
    Ok((header, meta))
}

async fn read_payload<R: AsyncRead + Unpin>(
    r: &mut R,
    len: u64,
) -> std::result::Result<Vec<u8>, ReadError> {
    let mut payload = Vec::new();
    payload
        .try_reserve_exact(len as usize)
        .map_err(|_| ReadError::Bad(Error::Alloc(format!("cannot hold a {len}-byte payload"))))?;
    (&mut *r)
        .take(len)
        .read_to_end(&mut payload)
        .await
        .map_err(|_| ReadError::Closed)?;
    if payload.len() as u64 != len {
        return Err(ReadError::Closed);
    }
    Ok(payload)
}

async fn serve_connection(stream: TcpStream, shared: &Arc<Shared>) {
    let _ = stream.set_nodelay(true);
    let (mut rd, wr) = stream.into_split();
    let (out_tx, out_rx) = tmpsc::unbounded_channel::<OutFrame>();
    let mut writer = tokio::spawn(write_loop(wr, out_rx));
    if let Err((id, err)) = session(&mut rd, &out_tx, shared).await {
        let _ = out_tx.send(OutFrame::error(id, &err, true));
    }
    drop(out_tx);
    // The worker may still hold a sender while it finishes a computation: give the writer a
    // moment to flush the last frames, then close regardless.
    if tokio::time::timeout(Duration::from_secs(2), &mut writer)
        .await
        .is_err()
    {
        writer.abort();
    }
}

/// Work for the session's worker thread.
struct Job {
    request_id: u64,
    request: Request,
    payload: Vec<u8>,
    /// Counts the payload against the session's queued bytes until the job is done.
    _permit: Option<OwnedSemaphorePermit>,
}

/// Runs a session: handshake, then requests until the peer leaves. `Err` carries the request
/// id and the error to send before closing.
async fn session(
    rd: &mut tokio::net::tcp::OwnedReadHalf,
    out: &tmpsc::UnboundedSender<OutFrame>,
    shared: &Arc<Shared>,
) -> std::result::Result<(), (u64, Error)> {
    let config = &shared.config;
    let handshake = FrameLimits {
        max_meta: HANDSHAKE_META_LIMIT,
        max_payload: 0,
    };
    let deadline = tokio::time::Instant::now() + config.handshake_timeout;
    let timed_out = |what: &str| {
        (
            0,
            Error::InvalidArgument(format!("handshake timed out waiting for {what}")),
        )
    };
    let bad = |id: u64, e: Error| (id, e);

    // HELLO: versions first, so an old client learns why it is refused.
    let (header, meta) = match tokio::time::timeout_at(deadline, read_head(rd, handshake)).await {
        Err(_) => return Err(timed_out("HELLO")),
        Ok(Err(ReadError::Closed)) => return Ok(()),
        Ok(Err(ReadError::Bad(e))) => return Err(bad(0, e)),
        Ok(Ok(frame)) => frame,
    };
    if header.command != Command::Hello {
        return Err(bad(
            header.request_id,
            Error::InvalidArgument("the first frame must be HELLO".into()),
        ));
    }
    let hello: Hello = decode_meta(&meta).map_err(|e| bad(header.request_id, e))?;
    if hello.version != PROTOCOL_VERSION {
        return Err(bad(
            header.request_id,
            Error::InvalidArgument(format!(
                "protocol version mismatch: the client speaks {}, this server {PROTOCOL_VERSION}",
                hello.version
            )),
        ));
    }
    let fingerprint = crate::dynload::abi_fingerprint();
    if hello.fingerprint != fingerprint {
        return Err(bad(
            header.request_id,
            Error::InvalidArgument(format!(
                "build fingerprint mismatch: the client is [{}], this server is [{fingerprint}]; \
                 run the same ferrograph build on both sides",
                hello.fingerprint
            )),
        ));
    }
    let server_nonce = nonce().map_err(|e| bad(header.request_id, e))?;
    let _ = out.send(OutFrame::new(
        Command::Challenge,
        header.request_id,
        &Challenge { server_nonce },
    ));

    // AUTH: the client's proof over both nonces.
    let (header, meta) = match tokio::time::timeout_at(deadline, read_head(rd, handshake)).await {
        Err(_) => return Err(timed_out("AUTH")),
        Ok(Err(ReadError::Closed)) => return Ok(()),
        Ok(Err(ReadError::Bad(e))) => return Err(bad(0, e)),
        Ok(Ok(frame)) => frame,
    };
    let auth: Auth = if header.command == Command::Auth {
        decode_meta(&meta).map_err(|e| bad(header.request_id, e))?
    } else {
        return Err(bad(
            header.request_id,
            Error::InvalidArgument("expected AUTH".into()),
        ));
    };
    if !proof_matches(
        &config.token,
        b"ferrograph client",
        &server_nonce,
        &hello.client_nonce,
        &auth.mac,
    ) {
        // Slow down guessing a little; the message says nothing about the token.
        tokio::time::sleep(Duration::from_millis(200)).await;
        return Err(bad(
            header.request_id,
            Error::InvalidArgument("authentication failed: wrong token".into()),
        ));
    }
    let devices: Vec<DeviceInfo> = shared
        .devices
        .iter()
        .map(|d| {
            let buft = d.buffer_type();
            let (free, total) = d.memory();
            DeviceInfo {
                name: d.name().to_owned(),
                description: d.description(),
                memory_free: free as u64,
                memory_total: total as u64,
                buffer_type: buft.name().to_owned(),
                alignment: buft.alignment() as u64,
                max_size: (buft.max_size() as u64).min(config.max_session_bytes),
            }
        })
        .collect();
    let welcome = Welcome {
        mac: proof(
            &config.token,
            b"ferrograph server",
            &hello.client_nonce,
            &server_nonce,
        ),
        devices,
        max_payload: config.max_payload,
        max_meta: config.max_meta,
        max_session_bytes: config.max_session_bytes,
        max_graphs: config.max_graphs,
    };
    let _ = out.send(OutFrame::new(Command::Welcome, header.request_id, &welcome));

    // Requests: decoded here, run in order by the worker thread.
    let (jobs, job_rx) = mpsc::channel::<Job>();
    let worker_out = out.clone();
    let worker_shared = shared.clone();
    std::thread::Builder::new()
        .name("ferrograph-session".into())
        .spawn(move || worker(job_rx, worker_out, worker_shared))
        .map_err(|e| {
            bad(
                0,
                Error::Backend(format!("cannot start a session thread: {e}")),
            )
        })?;
    let limits = FrameLimits {
        max_meta: config.max_meta,
        max_payload: config.max_payload,
    };
    // Payload bytes queued for the worker, in KiB: at most about one largest frame (or 64 MiB)
    // waits at a time, so a fast sender cannot pile up memory.
    let queue_kib = (config.max_payload.max(64 << 20) / 1024).min(u32::MAX as u64 / 2) as u32;
    let queued = Arc::new(Semaphore::new(queue_kib as usize));
    loop {
        while shared.frozen.load(Ordering::Relaxed) {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let (header, meta) = match tokio::time::timeout(config.idle_timeout, read_head(rd, limits))
            .await
        {
            Err(_) => {
                return Err(bad(
                    0,
                    Error::InvalidArgument("no frame (not even a heartbeat) for too long".into()),
                ))
            }
            Ok(Err(ReadError::Closed)) => return Ok(()),
            Ok(Err(ReadError::Bad(e))) => return Err(bad(0, e)),
            Ok(Ok(frame)) => frame,
        };
        while shared.frozen.load(Ordering::Relaxed) {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let id = header.request_id;
        match header.command {
            Command::Ping if header.meta_len == 0 && header.payload_len == 0 => {
                let _ = out.send(OutFrame {
                    command: Command::Pong,
                    request_id: id,
                    meta: Vec::new(),
                    payload: Vec::new(),
                    last: false,
                });
            }
            Command::Request => {
                let request: Request = decode_meta(&meta).map_err(|e| bad(id, e))?;
                let takes_payload = matches!(
                    request,
                    Request::Set { .. } | Request::SetAndCache { .. } | Request::Deposit { .. }
                );
                if !takes_payload && header.payload_len != 0 {
                    return Err(bad(
                        id,
                        Error::InvalidArgument("this request takes no payload".into()),
                    ));
                }
                let permit = if header.payload_len > 0 {
                    let kib = header.payload_len.div_ceil(1024).min(queue_kib as u64) as u32;
                    Some(
                        queued
                            .clone()
                            .acquire_many_owned(kib)
                            .await
                            .map_err(|_| bad(id, Error::Backend("queue closed".into())))?,
                    )
                } else {
                    None
                };
                let payload = match read_payload(rd, header.payload_len).await {
                    Ok(p) => p,
                    Err(ReadError::Closed) => return Ok(()),
                    Err(ReadError::Bad(e)) => return Err(bad(id, e)),
                };
                let job = Job {
                    request_id: id,
                    request,
                    payload,
                    _permit: permit,
                };
                if jobs.send(job).is_err() {
                    return Err(bad(id, Error::Backend("the session worker stopped".into())));
                }
            }
            other => {
                return Err(bad(
                    id,
                    Error::InvalidArgument(format!("unexpected {other:?} frame in a session")),
                ))
            }
        }
    }
}

/// A session's state, owned by its worker thread.
struct Session {
    shared: Arc<Shared>,
    /// Connections to other servers, for pushes.
    peers: HashMap<String, Arc<Connection>>,
    backends: Vec<Option<Arc<dyn Backend>>>,
    buffers: HashMap<u64, Buffer>,
    allocated: u64,
    next_handle: u64,
    graphs: HashMap<u64, BuiltGraph>,
}

fn worker(jobs: mpsc::Receiver<Job>, out: tmpsc::UnboundedSender<OutFrame>, shared: Arc<Shared>) {
    let mut session = Session {
        backends: vec![None; shared.devices.len()],
        peers: HashMap::new(),
        shared,
        buffers: HashMap::new(),
        allocated: 0,
        next_handle: 1,
        graphs: HashMap::new(),
    };
    while let Ok(job) = jobs.recv() {
        let id = job.request_id;
        let result = catch_unwind(AssertUnwindSafe(|| {
            session.handle(job.request, job.payload)
        }))
        .unwrap_or_else(|_| {
            Err(Error::Backend(
                "internal error (panic) in the server".into(),
            ))
        });
        let frame = match result {
            Ok((reply, payload)) => OutFrame {
                payload,
                ..OutFrame::new(Command::Reply, id, &reply)
            },
            Err(err) => OutFrame::error(id, &err, false),
        };
        if out.send(frame).is_err() {
            break;
        }
    }
    // Disconnected: release everything the session held.
    session.graphs.clear();
    for (_, buffer) in session.buffers.drain() {
        buffer.free();
    }
}

impl Session {
    fn device(&self, index: u32) -> Result<&Arc<dyn Device>> {
        self.shared.devices.get(index as usize).ok_or_else(|| {
            Error::InvalidArgument(format!(
                "device {index} does not exist (the server has {})",
                self.shared.devices.len()
            ))
        })
    }

    fn backend(&mut self, index: u32) -> Result<Arc<dyn Backend>> {
        let device = self.device(index)?.clone();
        let slot = &mut self.backends[index as usize];
        if let Some(backend) = slot {
            return Ok(backend.clone());
        }
        let params = BackendParams {
            n_threads: self.shared.config.n_threads,
            extra: Vec::new(),
        };
        let backend = device.init_backend(&params)?;
        *slot = Some(backend.clone());
        Ok(backend)
    }

    fn buffer(&self, handle: u64) -> Result<&Buffer> {
        self.buffers.get(&handle).ok_or_else(|| {
            Error::InvalidArgument(format!(
                "buffer handle {handle} is not one of this session's"
            ))
        })
    }

    fn range(&self, handle: u64, offset: u64, len: u64) -> Result<(&Buffer, usize, usize)> {
        let buffer = self.buffer(handle)?;
        let end = offset.checked_add(len);
        if end.is_none_or(|end| end > buffer.size() as u64) {
            return Err(Error::OutOfBounds(format!(
                "{len} bytes at offset {offset} exceed the buffer's {} bytes",
                buffer.size()
            )));
        }
        Ok((buffer, offset as usize, len as usize))
    }

    fn limits(&self) -> GraphLimits {
        GraphLimits {
            max_tensors: self.shared.config.max_graph_tensors,
        }
    }

    fn handle(&mut self, request: Request, payload: Vec<u8>) -> Result<(Reply, Vec<u8>)> {
        let shared = self.shared.clone();
        let config = &shared.config;
        let done = Ok((Reply::Done, Vec::new()));
        match request {
            Request::Alloc { device, size } => {
                let buft = self.device(device)?.buffer_type();
                let total = self.allocated.checked_add(size);
                if total.is_none_or(|t| t > config.max_session_bytes) {
                    return Err(Error::Alloc(format!(
                        "a buffer of {size} bytes would exceed the session limit of {} bytes \
                         ({} in use)",
                        config.max_session_bytes, self.allocated
                    )));
                }
                let size_usize = usize::try_from(size)
                    .ok()
                    .filter(|&s| s <= buft.max_size())
                    .ok_or_else(|| {
                        Error::Alloc(format!(
                            "{size} bytes exceed the largest buffer of {} ({} bytes)",
                            buft.name(),
                            buft.max_size()
                        ))
                    })?;
                let buffer = buft.alloc_buffer(size_usize)?;
                let handle = self.next_handle;
                self.next_handle += 1;
                self.allocated += size;
                self.buffers.insert(handle, buffer);
                Ok((Reply::Buffer { handle, size }, Vec::new()))
            }
            Request::Free { buffer } => {
                let removed = self.buffers.remove(&buffer).ok_or_else(|| {
                    Error::InvalidArgument(format!(
                        "buffer handle {buffer} is not one of this session's"
                    ))
                })?;
                self.allocated -= removed.size() as u64;
                // Graphs bound to it would read freed memory: forget them.
                self.graphs.retain(|_, g| !g.buffers.contains(&buffer));
                removed.free();
                done
            }
            Request::Set { buffer, offset } => {
                let (buffer, offset, _) = self.range(buffer, offset, payload.len() as u64)?;
                buffer.write(offset, &payload)?;
                done
            }
            Request::Get {
                buffer,
                offset,
                len,
            } => {
                if len > config.max_payload {
                    return Err(Error::InvalidArgument(format!(
                        "a read of {len} bytes exceeds the frame limit of {}",
                        config.max_payload
                    )));
                }
                let (buffer, offset, len) = self.range(buffer, offset, len)?;
                let mut data = vec![0u8; len];
                buffer.read(offset, &mut data)?;
                Ok((Reply::Data, data))
            }
            Request::Memset {
                buffer,
                offset,
                len,
                value,
            } => {
                let (buffer, offset, len) = self.range(buffer, offset, len)?;
                buffer.fill(offset, len, value)?;
                done
            }
            Request::Copy {
                src,
                src_offset,
                dst,
                dst_offset,
                len,
            } => {
                let (source, src_offset, len) = self.range(src, src_offset, len)?;
                let (target, dst_offset, _) = self.range(dst, dst_offset, len as u64)?;
                let mut bounce = Vec::new();
                bounce.try_reserve_exact(len).map_err(|_| {
                    Error::Alloc(format!("cannot copy {len} bytes through the host"))
                })?;
                bounce.resize(len, 0);
                source.read(src_offset, &mut bounce)?;
                target.write(dst_offset, &bounce)?;
                done
            }
            Request::Compute {
                device,
                graph,
                desc,
            } => {
                let backend = self.backend(device)?;
                if let Some(desc) = desc {
                    if !self.graphs.contains_key(&graph)
                        && self.graphs.len() >= config.max_graphs as usize
                    {
                        return Err(Error::InvalidArgument(format!(
                            "the session already caches {} graphs (the limit)",
                            self.graphs.len()
                        )));
                    }
                    let limits = self.limits();
                    let built = build_graph(&desc, &|h| self.buffer(h).cloned(), true, limits)?;
                    self.graphs.insert(graph, built);
                }
                let cached = self.graphs.get(&graph).ok_or_else(|| {
                    Error::InvalidArgument(format!("graph {graph} is not cached in this session"))
                })?;
                match backend.graph_compute(&cached.graph)? {
                    Status::Success => Ok((Reply::Status(Status::Success.code()), Vec::new())),
                    Status::Aborted => Err(Error::Aborted),
                    other => Err(Error::Backend(format!("the computation {other}"))),
                }
            }
            Request::DropGraph { graph } => {
                self.graphs.remove(&graph);
                done
            }
            Request::SupportsOp { device, desc } => {
                let device = self.device(device)?.clone();
                let no_buffers = |h: u64| -> Result<Buffer> {
                    Err(Error::InvalidArgument(format!("unexpected buffer {h}")))
                };
                let supported = match build_graph(&desc, &no_buffers, false, self.limits()) {
                    Ok(built) => built
                        .graph
                        .nodes()
                        .last()
                        .is_some_and(|op| device.supports_op(op)),
                    Err(_) => false,
                };
                Ok((Reply::Supported(supported), Vec::new()))
            }
            Request::SetCached {
                buffer,
                offset,
                len,
                hash,
            } => {
                let (buffer, offset, len) = self.range(buffer, offset, len)?;
                match shared.weights.get(&hash) {
                    Some(bytes) if bytes.len() == len => {
                        buffer.write(offset, &bytes)?;
                        Ok((Reply::Cached(true), Vec::new()))
                    }
                    _ => Ok((Reply::Cached(false), Vec::new())),
                }
            }
            Request::SetAndCache {
                buffer,
                offset,
                hash,
            } => {
                let (buffer, offset, _) = self.range(buffer, offset, payload.len() as u64)?;
                if !shared.weights.insert(hash, &payload) {
                    return Err(Error::InvalidArgument(
                        "the payload does not have the content hash it was sent with".into(),
                    ));
                }
                buffer.write(offset, &payload)?;
                done
            }
            Request::Push {
                buffer,
                offset,
                len,
                to,
                ticket,
            } => {
                if len > config.max_payload {
                    return Err(Error::InvalidArgument(format!(
                        "a push of {len} bytes exceeds the frame limit of {}",
                        config.max_payload
                    )));
                }
                let (source, offset, len) = self.range(buffer, offset, len)?;
                let mut data = vec![0u8; len];
                source.read(offset, &mut data)?;
                let peer = match self.peers.get(&to) {
                    Some(peer) if peer.lost().is_none() => peer.clone(),
                    _ => {
                        let peer = Connection::open(&to, &config.token, ClientSettings::default())?;
                        self.peers.insert(to.clone(), peer.clone());
                        peer
                    }
                };
                peer.call(&Request::Deposit { ticket }, &data)?;
                done
            }
            Request::Deposit { ticket } => {
                let mut deposits = shared.deposits.lock().unwrap_or_else(|p| p.into_inner());
                deposits.retain(|_, (_, at)| at.elapsed() < DEPOSIT_LIFETIME);
                let held: usize = deposits.values().map(|(d, _)| d.len()).sum();
                if held as u64 + payload.len() as u64 > config.max_payload.max(1 << 30) {
                    return Err(Error::Alloc("too many unclaimed deposits".into()));
                }
                deposits.insert(ticket, (payload, std::time::Instant::now()));
                done
            }
            Request::Claim {
                buffer,
                offset,
                ticket,
            } => {
                let deposit = shared
                    .deposits
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .remove(&ticket);
                let (data, _) = deposit
                    .ok_or_else(|| Error::InvalidArgument("no deposit under this ticket".into()))?;
                let (target, offset, _) = self.range(buffer, offset, data.len() as u64)?;
                target.write(offset, &data)?;
                done
            }
            Request::Memory { device } => {
                let (free, total) = self.device(device)?.memory();
                Ok((
                    Reply::Memory {
                        free: free as u64,
                        total: total as u64,
                    },
                    Vec::new(),
                ))
            }
        }
    }
}
