//! The device server: exposes this process's host devices (CPU, and BLAS when registered) to
//! remote clients over TCP.
//!
//! Each connection first completes the encrypted handshake of [`super::secure`] (a connection
//! that does not, within the handshake deadline, is closed; at most
//! [`ServerConfig::max_handshakes`] may be in progress, and a new one evicts the oldest). Then
//! it is a session: a tokio task reads and checks frames, answers heartbeats at once and hands
//! requests, in order, to the session's own worker thread, which owns the session's buffers,
//! cached graphs and backends and runs the computations. Replies go through a writer task.
//!
//! Everything a session makes the server hold is bounded and counted:
//!
//! * requests waiting for the worker: at most [`ServerConfig::max_queued_requests`], and their
//!   payload plus their metadata (charged at [`META_DECODE_FACTOR`] times its wire size, what
//!   it may decode to) within one frame's worth of bytes; the reader stops reading until the
//!   worker catches up;
//! * replies waiting for the client: within [`ServerConfig::max_reply_queue_bytes`]; the
//!   worker waits (and so the reader) until the client reads, and a client that reads nothing
//!   for the idle time loses its connection;
//! * buffers, cached graphs and deposits count against [`ServerConfig::max_session_bytes`]
//!   at what they cost, a per-object overhead included (a zero-byte buffer is not free);
//! * graphs are refused at decode time once they list more tensors than allowed.
//!
//! When the connection ends (or breaks), the session is *gone*: the computation in progress is
//! aborted through the backend's abort callback, queued requests are dropped, and every buffer
//! and deposit of the session is freed. A frame that cannot be decoded gets an error reply and
//! the connection is closed; a request that fails (bad handle, out of bounds, a graph that
//! does not validate, a computation error) gets an error reply and the session goes on.
//! Nothing a client sends can stop the server or affect another session.
//!
//! Server-to-server copies (`Push`) go only to peers on the server's allow-list
//! ([`ServerConfig::peers`]), over a connection authenticated with the peer key (the
//! [`Role::Peer`] key of [`ServerConfig::peer_token`]); only such connections may deposit.
//!
//! The server's threads never log: inside a Python process (`python -m ferrograph serve`, a
//! `RemoteServer` in a test) a log record needs the interpreter, which a thread waiting for
//! this server may hold. Errors go to the client that caused them.

use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc as tmpsc, Notify, OwnedSemaphorePermit, Semaphore};

use super::connection::{ClientSettings, Connection};
use super::protocol::{
    decode_meta, encode_meta, error_kind, Command, DeviceInfo, ErrorReply, FrameHeader,
    FrameLimits, Hello, Reply, Request, Welcome, HANDSHAKE_META_LIMIT, HEADER_LEN,
    PROTOCOL_VERSION,
};
use super::secure::{
    handshake_record, handshake_state, into_keys, parse_preamble, preamble, psk, Keys,
    RecordReader, Role, Sealer, MAX_HANDSHAKE_RECORD, PREAMBLE_LEN,
};
use super::weight_cache::WeightCache;
use super::wire::{build_graph, with_decode_limit, BuiltGraph, GraphLimits};
use crate::backend::Backend;
use crate::buffer::Buffer;
use crate::device::{BackendParams, Device};
use crate::error::{Error, Result, Status};
use crate::registry::{self, Extension};

/// Bytes charged per buffer beyond its size (rounded up to 64): the allocation's bookkeeping.
pub const BUFFER_OVERHEAD: u64 = 512;

/// Bytes charged per tensor of a cached graph (its description and the rebuilt tensor).
pub const GRAPH_TENSOR_COST: u64 = 1024;

/// Bytes charged per deposit beyond its content.
pub const DEPOSIT_OVERHEAD: u64 = 256;

/// Metadata is charged this many times its wire size while queued (what it decodes to).
pub const META_DECODE_FACTOR: u64 = 16;

/// Bytes charged per heartbeat answer waiting to be sent.
const PONG_COST_KIB: u32 = 1;

/// Settings of a device server.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// Address to bind (`127.0.0.1` unless told otherwise).
    pub host: String,
    /// Port to bind (0 picks a free one).
    pub port: u16,
    /// The shared secret clients must prove they hold (never sent over the wire).
    pub token: Vec<u8>,
    /// The secret servers of this cluster use with each other (pushes and deposits); `None`:
    /// the token. A separate one keeps clients from depositing.
    pub peer_token: Option<Vec<u8>>,
    /// The only servers this one pushes to (`ip:port`, matched exactly); empty: no pushes
    /// (clients then copy between servers through themselves).
    pub peers: Vec<SocketAddr>,
    /// Largest frame payload (tensor bytes in one request).
    pub max_payload: u64,
    /// Largest frame metadata (a serialized graph).
    pub max_meta: u32,
    /// Bytes one session may hold at once: buffers, cached graphs and deposits, each with
    /// its overhead.
    pub max_session_bytes: u64,
    /// Graphs one session may keep cached.
    pub max_graphs: u32,
    /// Tensors in one graph.
    pub max_graph_tensors: usize,
    /// Requests one session may have waiting for its worker.
    pub max_queued_requests: usize,
    /// Bytes of replies one session may have waiting for its client (one larger reply is
    /// still sent alone).
    pub max_reply_queue_bytes: u64,
    /// Bytes of unclaimed deposits the server holds for all sessions, overhead included.
    pub max_deposit_bytes: u64,
    /// Peers one session may have the server connect to.
    pub max_peers_per_session: usize,
    /// Connections still in their handshake; beyond, the oldest is dropped.
    pub max_handshakes: usize,
    /// Authenticated sessions at once.
    pub max_sessions: usize,
    /// Bytes of uploads kept by content hash for later sessions, overhead included (0: no
    /// cache).
    pub weight_cache_bytes: u64,
    /// Smallest upload the weight cache keeps.
    pub weight_cache_min_bytes: u64,
    /// Threads of each session's compute backends (`None`: the device's default).
    pub n_threads: Option<usize>,
    /// Time a client has to complete the handshake.
    pub handshake_timeout: Duration,
    /// A session that receives nothing (clients ping every half second), or whose client reads
    /// nothing, for this long is closed.
    pub idle_timeout: Duration,
}

impl ServerConfig {
    /// Defaults: 127.0.0.1, a free port, no peers, 1 GiB frames, 16 MiB metadata, 64 GiB per
    /// session, 256 cached graphs of up to a million tensors, 64 queued requests, 64 MiB of
    /// queued replies, 1 GiB of deposits, 8 peers per session, 64 handshakes, 256 sessions, a
    /// 1 GiB weight cache of uploads from 64 KiB, 5 s handshake, 60 s idle limit.
    pub fn new(token: impl Into<Vec<u8>>) -> ServerConfig {
        ServerConfig {
            host: "127.0.0.1".into(),
            port: 0,
            token: token.into(),
            peer_token: None,
            peers: Vec::new(),
            max_payload: 1 << 30,
            max_meta: 16 << 20,
            max_session_bytes: 64 << 30,
            max_graphs: 256,
            max_graph_tensors: 1 << 20,
            max_queued_requests: 64,
            max_reply_queue_bytes: 64 << 20,
            max_deposit_bytes: 1 << 30,
            max_peers_per_session: 8,
            max_handshakes: 64,
            max_sessions: 256,
            weight_cache_bytes: 1 << 30,
            weight_cache_min_bytes: 64 << 10,
            n_threads: None,
            handshake_timeout: Duration::from_secs(5),
            idle_timeout: Duration::from_secs(60),
        }
    }

    fn peer_token(&self) -> &[u8] {
        self.peer_token.as_deref().unwrap_or(&self.token)
    }
}

/// The names [`set_limit`] knows.
pub const LIMIT_NAMES: [&str; 10] = [
    "max_meta",
    "max_queued_requests",
    "max_reply_queue_bytes",
    "max_deposit_bytes",
    "max_handshakes",
    "max_sessions",
    "max_graphs",
    "max_graph_tensors",
    "weight_cache_min_bytes",
    "max_peers_per_session",
];

/// Sets the limit called `name` (one of [`LIMIT_NAMES`]) to `value`; an unknown name or a value
/// out of the field's range is an error.
pub fn set_limit(config: &mut ServerConfig, name: &str, value: u64) -> Result<()> {
    let too_large = || Error::InvalidArgument(format!("{name} = {value} is too large"));
    let small = |v: u64| usize::try_from(v).map_err(|_| too_large());
    let word = |v: u64| u32::try_from(v).map_err(|_| too_large());
    match name {
        "max_meta" => config.max_meta = word(value)?,
        "max_queued_requests" => config.max_queued_requests = small(value)?,
        "max_reply_queue_bytes" => config.max_reply_queue_bytes = value,
        "max_deposit_bytes" => config.max_deposit_bytes = value,
        "max_handshakes" => config.max_handshakes = small(value)?,
        "max_sessions" => config.max_sessions = small(value)?,
        "max_graphs" => config.max_graphs = word(value)?,
        "max_graph_tensors" => config.max_graph_tensors = small(value)?,
        "weight_cache_min_bytes" => config.weight_cache_min_bytes = value,
        "max_peers_per_session" => config.max_peers_per_session = small(value)?,
        other => {
            return Err(Error::InvalidArgument(format!(
                "unknown server limit {other:?} (known: {})",
                LIMIT_NAMES.join(", ")
            )))
        }
    }
    Ok(())
}

/// Bytes pushed here by another server, until claimed.
struct Deposit {
    bytes: Vec<u8>,
    at: Instant,
    /// The (peer) session that deposited them; they go when it ends.
    owner: u64,
}

impl Deposit {
    fn cost(&self) -> u64 {
        self.bytes.len() as u64 + DEPOSIT_OVERHEAD
    }
}

/// Unclaimed deposits, with what they cost in total and per depositing session.
#[derive(Default)]
struct Deposits {
    by_ticket: HashMap<[u8; 16], Deposit>,
    by_owner: HashMap<u64, u64>,
    total: u64,
}

impl Deposits {
    fn remove(&mut self, ticket: &[u8; 16]) -> Option<Deposit> {
        let deposit = self.by_ticket.remove(ticket)?;
        let cost = deposit.cost();
        self.total -= cost;
        if let Some(owned) = self.by_owner.get_mut(&deposit.owner) {
            *owned -= cost;
            if *owned == 0 {
                self.by_owner.remove(&deposit.owner);
            }
        }
        Some(deposit)
    }

    /// Drops deposits older than [`DEPOSIT_LIFETIME`].
    fn prune(&mut self) {
        let old: Vec<[u8; 16]> = self
            .by_ticket
            .iter()
            .filter(|(_, d)| d.at.elapsed() >= DEPOSIT_LIFETIME)
            .map(|(t, _)| *t)
            .collect();
        for ticket in old {
            self.remove(&ticket);
        }
    }

    /// Drops every deposit of session `owner`.
    fn drop_owner(&mut self, owner: u64) {
        if !self.by_owner.contains_key(&owner) {
            return;
        }
        let owned: Vec<[u8; 16]> = self
            .by_ticket
            .iter()
            .filter(|(_, d)| d.owner == owner)
            .map(|(t, _)| *t)
            .collect();
        for ticket in owned {
            self.remove(&ticket);
        }
    }
}

/// Deposits not claimed within this time are dropped.
const DEPOSIT_LIFETIME: Duration = Duration::from_secs(60);

/// State shared by the server's tasks and its handle.
struct Shared {
    config: ServerConfig,
    devices: Vec<Arc<dyn Device>>,
    /// Test hook: while set, sessions stop reading and answering (a hung server).
    frozen: AtomicBool,
    /// Connections open (handshaking or in session).
    sessions: AtomicUsize,
    /// Authenticated sessions.
    authenticated: AtomicUsize,
    /// Session ids, in order of acceptance.
    next_id: AtomicU64,
    /// Connections in their handshake, oldest first, with the signal that evicts them.
    handshaking: Mutex<VecDeque<(u64, Arc<Notify>)>>,
    weights: WeightCache,
    deposits: Mutex<Deposits>,
}

impl Shared {
    fn deposits(&self) -> MutexGuard<'_, Deposits> {
        self.deposits.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn handshaking(&self) -> MutexGuard<'_, VecDeque<(u64, Arc<Notify>)>> {
        self.handshaking.lock().unwrap_or_else(|p| p.into_inner())
    }
}

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
        if config.token.is_empty() || config.peer_token.as_ref().is_some_and(|t| t.is_empty()) {
            return Err(Error::InvalidArgument(
                "a device server needs a token (--token-file or FERROGRAPH_TOKEN)".into(),
            ));
        }
        if config.max_payload == 0 || config.max_meta < HANDSHAKE_META_LIMIT {
            return Err(Error::InvalidArgument(format!(
                "max_payload must be positive and max_meta at least {HANDSHAKE_META_LIMIT}"
            )));
        }
        if config.max_queued_requests == 0
            || config.max_handshakes == 0
            || config.max_sessions == 0
            || config.max_reply_queue_bytes < 1024
        {
            return Err(Error::InvalidArgument(
                "max_queued_requests, max_handshakes and max_sessions must be positive and \
                 max_reply_queue_bytes at least 1024"
                    .into(),
            ));
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
            authenticated: AtomicUsize::new(0),
            next_id: AtomicU64::new(1),
            handshaking: Mutex::new(VecDeque::new()),
            deposits: Mutex::new(Deposits::default()),
            weights: WeightCache::new(
                usize::try_from(config.weight_cache_bytes).unwrap_or(usize::MAX),
                usize::try_from(config.weight_cache_min_bytes).unwrap_or(usize::MAX),
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

    /// Connections open (in their handshake or in session).
    pub fn sessions(&self) -> usize {
        self.shared.sessions.load(Ordering::Relaxed)
    }

    /// Bytes held in the weight cache, overhead included.
    pub fn weight_cache_bytes(&self) -> usize {
        self.shared.weights.bytes()
    }

    /// Bytes of unclaimed deposits, overhead included.
    pub fn deposit_bytes(&self) -> u64 {
        self.shared.deposits().total
    }

    /// Test hook: while frozen, sessions neither read nor answer, as a hung server.
    pub fn set_frozen(&self, frozen: bool) {
        self.shared.frozen.store(frozen, Ordering::Relaxed);
    }

    /// Stops the server: no new connections, every connection closed at once (from a client's
    /// view, the server died). Computations already running are aborted.
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
                let id = shared.next_id.fetch_add(1, Ordering::Relaxed);
                let evict = Arc::new(Notify::new());
                {
                    let mut handshaking = shared.handshaking();
                    // Full: the oldest unauthenticated connection makes room (a flood of idle
                    // connections delays a real client by no more than its own handshake).
                    while handshaking.len() >= shared.config.max_handshakes {
                        match handshaking.pop_front() {
                            Some((_, oldest)) => oldest.notify_one(),
                            None => break,
                        }
                    }
                    handshaking.push_back((id, evict.clone()));
                }
                let shared = shared.clone();
                tokio::spawn(async move {
                    shared.sessions.fetch_add(1, Ordering::Relaxed);
                    serve_connection(stream, &shared, id, &evict).await;
                    shared.handshaking().retain(|(i, _)| *i != id);
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
    /// Its share of the reply queue, given back once written.
    _permit: Option<OwnedSemaphorePermit>,
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
            _permit: None,
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

/// Writes the sealed records collected so far; a write that makes no progress for `stall`
/// (a client that reads nothing) fails.
async fn write_sealed(
    wr: &mut OwnedWriteHalf,
    sealer: &mut Sealer,
    stall: Duration,
) -> std::io::Result<()> {
    if sealer.out.is_empty() {
        return Ok(());
    }
    tokio::time::timeout(stall, wr.write_all(&sealer.out))
        .await
        .map_err(|_| std::io::Error::from(std::io::ErrorKind::TimedOut))??;
    sealer.out.clear();
    Ok(())
}

async fn write_loop(
    mut wr: OwnedWriteHalf,
    keys: Keys,
    mut rx: tmpsc::UnboundedReceiver<OutFrame>,
    stall: Duration,
) {
    let mut sealer = Sealer::new(keys);
    while let Some(frame) = rx.recv().await {
        let header = FrameHeader {
            command: frame.command,
            request_id: frame.request_id,
            meta_len: frame.meta.len() as u32,
            payload_len: frame.payload.len() as u64,
        };
        let written = async {
            sealer.write(&header.encode())?;
            sealer.write(&frame.meta)?;
            for chunk in frame.payload.chunks(1 << 20) {
                sealer.write(chunk)?;
                write_sealed(&mut wr, &mut sealer, stall).await?;
            }
            if rx.is_empty() || frame.last {
                sealer.seal_pending()?;
                write_sealed(&mut wr, &mut sealer, stall).await?;
                wr.flush().await?;
            }
            std::io::Result::Ok(())
        }
        .await;
        if written.is_err() {
            break;
        }
        if frame.last {
            let _ = wr.shutdown().await;
            break;
        }
    }
}

/// Why reading a frame stopped.
enum ReadError {
    /// The peer closed the connection (or it broke, or a record failed authentication).
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
        .map_err(|_| ReadError::Bad(Error::alloc(format!("cannot hold a {len}-byte payload"))))?;
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

/// The server's side of the Noise handshake (see [`super::secure`]): the transport keys and
/// the connecting side's role, or `None` (the connection is closed without a word: nothing is
/// revealed to a peer that cannot authenticate).
async fn noise_handshake(
    rd: &mut OwnedReadHalf,
    wr: &mut OwnedWriteHalf,
    config: &ServerConfig,
) -> Option<(Keys, Role)> {
    let mut theirs = [0u8; PREAMBLE_LEN];
    rd.read_exact(&mut theirs).await.ok()?;
    let (version, role) = parse_preamble(&theirs).ok()?;
    // Only the protocol version is said before authentication, so a client of another
    // version learns why it fails.
    wr.write_all(&preamble(PROTOCOL_VERSION, Role::Client))
        .await
        .ok()?;
    if version != PROTOCOL_VERSION {
        return None;
    }
    let token = match role {
        Role::Client => &config.token[..],
        Role::Peer => config.peer_token(),
    };
    let mut state = handshake_state(&psk(token, role), &theirs, false).ok()?;
    let mut len = [0u8; 2];
    rd.read_exact(&mut len).await.ok()?;
    let len = u16::from_be_bytes(len) as usize;
    if len > MAX_HANDSHAKE_RECORD {
        return None;
    }
    let mut message = vec![0u8; len];
    rd.read_exact(&mut message).await.ok()?;
    let mut payload = [0u8; MAX_HANDSHAKE_RECORD];
    if state.read_message(&message, &mut payload).is_err() {
        // Slow down guessing a little.
        tokio::time::sleep(Duration::from_millis(200)).await;
        return None;
    }
    let n = state.write_message(&[], &mut payload).ok()?;
    wr.write_all(&handshake_record(&payload[..n])).await.ok()?;
    into_keys(state).ok().map(|keys| (keys, role))
}

/// Counts one authenticated session while alive.
struct Authenticated<'a>(&'a AtomicUsize);

impl Drop for Authenticated<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

async fn serve_connection(stream: TcpStream, shared: &Arc<Shared>, id: u64, evict: &Notify) {
    let _ = stream.set_nodelay(true);
    let (mut rd, mut wr) = stream.into_split();
    let config = &shared.config;
    let deadline = tokio::time::Instant::now() + config.handshake_timeout;
    let keys = tokio::select! {
        done = tokio::time::timeout_at(deadline, noise_handshake(&mut rd, &mut wr, config)) => {
            done.ok().flatten()
        }
        _ = evict.notified() => None,
    };
    let Some((keys, role)) = keys else {
        return;
    };
    let mut reader = RecordReader::new(rd, keys.clone());
    let (out_tx, out_rx) = tmpsc::unbounded_channel::<OutFrame>();
    let mut writer = tokio::spawn(write_loop(wr, keys, out_rx, config.idle_timeout));
    let reply_kib = (config.max_reply_queue_bytes / 1024).min(u32::MAX as u64 / 2) as u32;
    let link = Link {
        out: out_tx,
        budget: Arc::new(Semaphore::new(reply_kib as usize)),
        budget_kib: reply_kib,
        gone: Arc::new(AtomicBool::new(false)),
    };
    let ended = tokio::select! {
        ended = session(&mut reader, &link, shared, role, id, deadline) => ended,
        _ = evict.notified() => Ok(()),
    };
    // The client left (or is sent away): cancel what its worker still does.
    link.gone.store(true, Ordering::Relaxed);
    if let Err((request_id, err)) = ended {
        let _ = link.out.send(OutFrame::error(request_id, &err, true));
    }
    let budget = link.budget.clone();
    drop(link);
    // The worker may still hold a sender while it finishes: give the writer a moment to flush
    // the last frames, then close regardless.
    if tokio::time::timeout(Duration::from_secs(2), &mut writer)
        .await
        .is_err()
    {
        writer.abort();
    }
    // A worker waiting for room in the reply queue gives up.
    budget.close();
}

/// What a session's reader and worker share: the way out and the session's fate.
struct Link {
    out: tmpsc::UnboundedSender<OutFrame>,
    /// The reply queue's room, in KiB.
    budget: Arc<Semaphore>,
    /// Its size.
    budget_kib: u32,
    /// Set once the connection ended: the worker aborts and stops.
    gone: Arc<AtomicBool>,
}

/// Work for the session's worker thread.
struct Job {
    request_id: u64,
    request: Request,
    payload: Vec<u8>,
    /// Counts the payload and metadata against the session's queue until the job is done.
    _permit: OwnedSemaphorePermit,
}

/// Runs a session: HELLO, then requests until the peer leaves. `Err` carries the request id
/// and the error to send before closing.
async fn session(
    rd: &mut RecordReader<OwnedReadHalf>,
    link: &Link,
    shared: &Arc<Shared>,
    role: Role,
    id: u64,
    deadline: tokio::time::Instant,
) -> std::result::Result<(), (u64, Error)> {
    let config = &shared.config;
    let out = &link.out;
    let handshake = FrameLimits {
        max_meta: HANDSHAKE_META_LIMIT,
        max_payload: 0,
    };
    let bad = |id: u64, e: Error| (id, e);

    // HELLO, the first frame of an authenticated connection: versions and builds.
    let (header, meta) = match tokio::time::timeout_at(deadline, read_head(rd, handshake)).await {
        Err(_) => {
            return Err((
                0,
                Error::InvalidArgument("handshake timed out waiting for HELLO".into()),
            ))
        }
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
    shared.handshaking().retain(|(i, _)| *i != id);
    let sessions = shared.authenticated.fetch_add(1, Ordering::Relaxed) + 1;
    let _counted = Authenticated(&shared.authenticated);
    if sessions > config.max_sessions {
        return Err(bad(
            header.request_id,
            Error::Backend(format!(
                "the server is busy: it serves its maximum of {} sessions",
                config.max_sessions
            )),
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
        devices,
        max_payload: config.max_payload,
        max_meta: config.max_meta,
        max_session_bytes: config.max_session_bytes,
        max_graphs: config.max_graphs,
    };
    let _ = out.send(OutFrame::new(Command::Welcome, header.request_id, &welcome));

    // Requests: decoded here, run in order by the worker thread.
    let (jobs, job_rx) = tmpsc::channel::<Job>(config.max_queued_requests);
    let worker_link = WorkerLink {
        out: out.clone(),
        budget: link.budget.clone(),
        budget_kib: link.budget_kib,
        gone: link.gone.clone(),
        runtime: tokio::runtime::Handle::current(),
    };
    let worker_shared = shared.clone();
    std::thread::Builder::new()
        .name("ferrograph-session".into())
        .spawn(move || worker(job_rx, worker_link, worker_shared, id))
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
    // Bytes queued for the worker (payloads, and metadata at what it decodes to), in KiB: at
    // most about one largest frame (or 64 MiB) waits at a time.
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
                // Answers queue like replies: a client that never reads them stops being read.
                let permit = link
                    .budget
                    .clone()
                    .acquire_many_owned(PONG_COST_KIB)
                    .await
                    .map_err(|_| bad(id, Error::Backend("the reply queue closed".into())))?;
                let _ = out.send(OutFrame {
                    command: Command::Pong,
                    request_id: id,
                    meta: Vec::new(),
                    payload: Vec::new(),
                    last: false,
                    _permit: Some(permit),
                });
            }
            Command::Request => {
                let request: Request =
                    with_decode_limit(config.max_graph_tensors, || decode_meta(&meta))
                        .map_err(|e| bad(id, e))?;
                let is_deposit = matches!(request, Request::Deposit { .. });
                if (role == Role::Peer) != is_deposit {
                    return Err(bad(
                        id,
                        Error::InvalidArgument(
                            "deposits come only from servers of this cluster, and servers only \
                             deposit"
                                .into(),
                        ),
                    ));
                }
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
                let cost = header
                    .payload_len
                    .saturating_add(u64::from(header.meta_len) * META_DECODE_FACTOR);
                let kib = cost.div_ceil(1024).clamp(1, queue_kib as u64) as u32;
                let permit = queued
                    .clone()
                    .acquire_many_owned(kib)
                    .await
                    .map_err(|_| bad(id, Error::Backend("queue closed".into())))?;
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
                if jobs.send(job).await.is_err() {
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

/// The worker's end of a [`Link`], with the runtime it waits on.
struct WorkerLink {
    out: tmpsc::UnboundedSender<OutFrame>,
    budget: Arc<Semaphore>,
    budget_kib: u32,
    gone: Arc<AtomicBool>,
    runtime: tokio::runtime::Handle,
}

impl WorkerLink {
    /// Waits for room for a reply of `bytes` in the reply queue; `None` once the connection is
    /// gone.
    fn room(&self, bytes: u64) -> Option<OwnedSemaphorePermit> {
        let kib = bytes.div_ceil(1024).clamp(1, self.budget_kib as u64) as u32;
        self.runtime
            .block_on(self.budget.clone().acquire_many_owned(kib))
            .ok()
    }
}

/// A cached graph and what it costs the session.
struct CachedGraph {
    built: BuiltGraph,
    cost: u64,
}

/// What a buffer of `size` bytes costs a session.
fn buffer_cost(size: u64) -> u64 {
    size.div_ceil(64)
        .saturating_mul(64)
        .saturating_add(BUFFER_OVERHEAD)
}

/// A session's state, owned by its worker thread.
struct Session {
    shared: Arc<Shared>,
    /// This session's id (deposits it makes are its own).
    id: u64,
    /// Set when the client is gone: computations abort.
    gone: Arc<AtomicBool>,
    /// Connections to other servers, for pushes.
    peers: HashMap<SocketAddr, Arc<Connection>>,
    backends: Vec<Option<Arc<dyn Backend>>>,
    buffers: HashMap<u64, Buffer>,
    /// What the buffers and cached graphs cost, overhead included.
    cost: u64,
    next_handle: u64,
    graphs: HashMap<u64, CachedGraph>,
}

fn worker(mut jobs: tmpsc::Receiver<Job>, link: WorkerLink, shared: Arc<Shared>, id: u64) {
    let mut session = Session {
        backends: vec![None; shared.devices.len()],
        peers: HashMap::new(),
        shared,
        id,
        gone: link.gone.clone(),
        buffers: HashMap::new(),
        cost: 0,
        next_handle: 1,
        graphs: HashMap::new(),
    };
    while let Some(job) = jobs.blocking_recv() {
        if link.gone.load(Ordering::Relaxed) {
            break;
        }
        let id = job.request_id;
        // Room for the reply first (a read's bytes included), so nothing is read for a client
        // that does not take its replies.
        let reply_bytes = match &job.request {
            Request::Get { len, .. } => *len,
            _ => 0,
        };
        let Some(permit) = link.room(reply_bytes.saturating_add(HEADER_LEN as u64)) else {
            break;
        };
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
        if link
            .out
            .send(OutFrame {
                _permit: Some(permit),
                ..frame
            })
            .is_err()
        {
            break;
        }
    }
    // Disconnected: release everything the session held, its deposits included.
    drop(jobs);
    session.graphs.clear();
    session.peers.clear();
    for (_, buffer) in session.buffers.drain() {
        buffer.free();
    }
    session.shared.deposits().drop_owner(session.id);
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
        // A computation whose client left is aborted (between nodes).
        let set_abort = registry::registrations()
            .into_iter()
            .find(|r| r.name() == device.registration_name())
            .and_then(|r| registry::proc_address(r.as_ref(), "set_abort_callback"));
        if let Some(Extension::SetAbortCallback(set)) = set_abort {
            let gone = self.gone.clone();
            set(
                backend.as_ref(),
                Some(Arc::new(move || gone.load(Ordering::Relaxed))),
            )?;
        }
        *slot = Some(backend.clone());
        Ok(backend)
    }

    /// Refuses `extra` more bytes when the session would exceed its limit.
    fn charge(&self, extra: u64, what: &str) -> Result<()> {
        let limit = self.shared.config.max_session_bytes;
        if self.cost.checked_add(extra).is_none_or(|t| t > limit) {
            return Err(Error::alloc(format!(
                "{what} ({extra} bytes with overhead) would exceed the session limit of {limit} \
                 bytes ({} in use)",
                self.cost
            )));
        }
        Ok(())
    }

    /// Forgets cached graphs for which `drop` holds, giving back what they cost.
    fn drop_graphs(&mut self, drop: impl Fn(u64, &CachedGraph) -> bool) {
        let mut freed = 0;
        self.graphs.retain(|&k, g| {
            let gone = drop(k, g);
            if gone {
                freed += g.cost;
            }
            !gone
        });
        self.cost -= freed;
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
            return Err(Error::out_of_bounds(format!(
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
                let cost = buffer_cost(size);
                self.charge(cost, &format!("a buffer of {size} bytes"))?;
                let size_usize = usize::try_from(size)
                    .ok()
                    .filter(|&s| s <= buft.max_size())
                    .ok_or_else(|| {
                        Error::alloc(format!(
                            "{size} bytes exceed the largest buffer of {} ({} bytes)",
                            buft.name(),
                            buft.max_size()
                        ))
                    })?;
                let buffer = buft.alloc_buffer(size_usize)?;
                let handle = self.next_handle;
                self.next_handle += 1;
                self.cost += cost;
                self.buffers.insert(handle, buffer);
                Ok((Reply::Buffer { handle, size }, Vec::new()))
            }
            Request::Free { buffer } => {
                let removed = self.buffers.remove(&buffer).ok_or_else(|| {
                    Error::InvalidArgument(format!(
                        "buffer handle {buffer} is not one of this session's"
                    ))
                })?;
                self.cost -= buffer_cost(removed.size() as u64);
                // Graphs bound to it would read freed memory: forget them.
                self.drop_graphs(|_, g| g.built.buffers.contains(&buffer));
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
                    Error::alloc(format!("cannot copy {len} bytes through the host"))
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
                    self.drop_graphs(|k, _| k == graph);
                    let cost = (desc.tensors.len() as u64 + 1).saturating_mul(GRAPH_TENSOR_COST);
                    self.charge(cost, "caching this graph")?;
                    let limits = self.limits();
                    let built = build_graph(&desc, &|h| self.buffer(h).cloned(), true, limits)?;
                    self.cost += cost;
                    self.graphs.insert(graph, CachedGraph { built, cost });
                }
                let cached = self.graphs.get(&graph).ok_or_else(|| {
                    Error::InvalidArgument(format!("graph {graph} is not cached in this session"))
                })?;
                match backend.graph_compute(&cached.built.graph)? {
                    Status::Success => Ok((Reply::Status(Status::Success.code()), Vec::new())),
                    Status::Aborted => Err(Error::Aborted),
                    other => Err(Error::Backend(format!("the computation {other}"))),
                }
            }
            Request::DropGraph { graph } => {
                self.drop_graphs(|k, _| k == graph);
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
                // Only to an allow-listed peer, named exactly (no name lookups): the server
                // connects nowhere else on a client's say-so.
                let target = to
                    .parse::<SocketAddr>()
                    .ok()
                    .filter(|addr| config.peers.contains(addr))
                    .ok_or_else(|| {
                        Error::InvalidArgument(format!(
                            "cannot push to {to:?}: not one of this server's peers (--peers)"
                        ))
                    })?;
                let (source, offset, len) = self.range(buffer, offset, len)?;
                let mut data = vec![0u8; len];
                source.read(offset, &mut data)?;
                let peer = match self.peers.get(&target) {
                    Some(peer) if peer.lost().is_none() => peer.clone(),
                    _ => {
                        self.peers.retain(|_, p| p.lost().is_none());
                        if self.peers.len() >= config.max_peers_per_session {
                            return Err(Error::InvalidArgument(format!(
                                "this session already reaches {} peers (the limit)",
                                self.peers.len()
                            )));
                        }
                        let settings = ClientSettings {
                            connect_timeout: Duration::from_secs(2),
                            ..ClientSettings::default()
                        };
                        let peer = Connection::open_as(
                            &target.to_string(),
                            config.peer_token(),
                            Role::Peer,
                            settings,
                        )
                        // One answer for every failure: a port that is closed, silent or
                        // something else looks the same.
                        .map_err(|_| {
                            Error::Backend(format!(
                                "cannot push to {target}: it did not authenticate as a server \
                                 of this cluster"
                            ))
                        })?;
                        self.peers.insert(target, peer.clone());
                        peer
                    }
                };
                peer.call(&Request::Deposit { ticket }, &data)?;
                done
            }
            Request::Deposit { ticket } => {
                let cost = payload.len() as u64 + DEPOSIT_OVERHEAD;
                let mut deposits = shared.deposits();
                deposits.prune();
                let owned = deposits.by_owner.get(&self.id).copied().unwrap_or(0);
                if owned + cost > config.max_session_bytes {
                    return Err(Error::alloc(format!(
                        "a deposit of {} bytes would exceed the session limit of {} bytes",
                        payload.len(),
                        config.max_session_bytes
                    )));
                }
                if deposits.total + cost > config.max_deposit_bytes {
                    return Err(Error::alloc(format!(
                        "the server holds its maximum of {} bytes of unclaimed deposits",
                        config.max_deposit_bytes
                    )));
                }
                if deposits.by_ticket.contains_key(&ticket) {
                    return Err(Error::InvalidArgument("this ticket is taken".into()));
                }
                deposits.total += cost;
                *deposits.by_owner.entry(self.id).or_insert(0) += cost;
                deposits.by_ticket.insert(
                    ticket,
                    Deposit {
                        bytes: payload,
                        at: Instant::now(),
                        owner: self.id,
                    },
                );
                done
            }
            Request::Claim {
                buffer,
                offset,
                ticket,
            } => {
                let mut deposits = shared.deposits();
                deposits.prune();
                let len = deposits
                    .by_ticket
                    .get(&ticket)
                    .map(|d| d.bytes.len())
                    .ok_or_else(|| Error::InvalidArgument("no deposit under this ticket".into()))?;
                // Checked before the deposit is taken: a bad claim leaves it in place.
                let (target, offset, _) = self.range(buffer, offset, len as u64)?;
                let target = target.clone();
                let deposit = deposits.remove(&ticket);
                drop(deposits);
                if let Some(deposit) = deposit {
                    target.write(offset, &deposit.bytes)?;
                }
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
