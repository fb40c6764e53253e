//! A client's connection to one device server: the handshake, request ids, replies matched
//! to their requests, asynchronous requests with fences, the heartbeat and loss detection.
//!
//! Requests are written in id order under one lock, so the server (which runs them in arrival
//! order) completes them in id order too; a fence is simply an id. A reader thread matches
//! replies to waiting callers; a heartbeat thread pings every [`ClientSettings::heartbeat`].
//! When nothing has been heard from the server and no write has progressed for
//! [`ClientSettings::dead_after`], when the connection breaks, or when the server sends a fatal
//! error, the connection is *lost*: every waiting and later call fails with
//! [`Error::DeviceLost`] at once.
//!
//! Nothing here logs from the reader or heartbeat thread: in a Python process a log record
//! needs the interpreter, which the caller waiting for that very thread may hold.

use std::collections::{BTreeSet, HashMap};
use std::io::{ErrorKind, Read};
use std::net::{Shutdown, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};

use super::protocol::{
    decode_meta, encode_meta, error_from_reply, Command, ErrorReply, FrameHeader, FrameLimits,
    Hello, Reply, Request, Welcome, HEADER_LEN, PROTOCOL_VERSION,
};
use super::secure::{client_handshake, RecordReader, RecordWriter, Role};
use crate::error::{Error, Result};

/// Timing settings of a client connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClientSettings {
    /// Time allowed to connect and complete the handshake.
    pub connect_timeout: Duration,
    /// Interval between heartbeats.
    pub heartbeat: Duration,
    /// Silence after which the server counts as dead (or hung).
    pub dead_after: Duration,
    /// Longest wait for any one reply (a computation included) while the server is alive.
    pub request_timeout: Duration,
    /// Copy between two servers directly (server to server) instead of through this process.
    pub direct_copies: bool,
}

impl Default for ClientSettings {
    /// 5 s to connect, a heartbeat every 0.5 s, lost after 3 s of silence, 10 min per reply,
    /// direct copies between servers.
    fn default() -> Self {
        ClientSettings {
            connect_timeout: Duration::from_secs(5),
            heartbeat: Duration::from_millis(500),
            dead_after: Duration::from_secs(3),
            request_timeout: Duration::from_secs(600),
            direct_copies: true,
        }
    }
}

/// Bytes written to the socket per call, so write progress is visible to loss detection.
const WRITE_CHUNK: usize = 1 << 20;

type Answer = std::result::Result<(Reply, Vec<u8>), Error>;

struct State {
    lost: Option<String>,
    /// Requests someone waits for, and their answer once it came.
    waiting: HashMap<u64, Option<Answer>>,
    /// Asynchronous requests not answered yet.
    outstanding: BTreeSet<u64>,
    /// The first failure of an asynchronous request, reported at the next wait.
    async_error: Option<Error>,
    /// Last time bytes arrived from the server or a write made progress.
    last_alive: Instant,
}

/// A connection to one device server.
pub struct Connection {
    endpoint: String,
    stream: TcpStream,
    /// The write side (sealing records); the next request id is drawn under this lock.
    writer: Mutex<(RecordWriter<TcpStream>, u64)>,
    state: Mutex<State>,
    changed: Condvar,
    last_sent: AtomicU64,
    welcome: Welcome,
    settings: ClientSettings,
}

impl std::fmt::Debug for Connection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Connection({})", self.endpoint)
    }
}

fn io_lost(endpoint: &str, what: &str, e: std::io::Error) -> Error {
    Error::DeviceLost(format!("server {endpoint}: {what}: {e}"))
}

fn write_frame(
    stream: &mut RecordWriter<TcpStream>,
    command: Command,
    request_id: u64,
    meta: &[u8],
    payload: &[u8],
    mut progress: impl FnMut(),
) -> std::io::Result<()> {
    let header = FrameHeader {
        command,
        request_id,
        meta_len: meta.len() as u32,
        payload_len: payload.len() as u64,
    };
    let mut head = Vec::with_capacity(HEADER_LEN + meta.len());
    head.extend_from_slice(&header.encode());
    head.extend_from_slice(meta);
    stream.write_all(&head)?;
    for chunk in payload.chunks(WRITE_CHUNK) {
        stream.write_all(chunk)?;
        progress();
    }
    stream.flush()
}

/// Reads one whole frame during the handshake (the socket has a read timeout).
fn read_handshake_frame(stream: &mut impl Read) -> std::io::Result<(FrameHeader, Vec<u8>)> {
    let mut head = [0u8; HEADER_LEN];
    stream.read_exact(&mut head)?;
    let limits = FrameLimits {
        max_meta: 1 << 20,
        max_payload: 0,
    };
    let header = FrameHeader::decode(&head, limits)
        .map_err(|e| std::io::Error::new(ErrorKind::InvalidData, e.to_string()))?;
    let mut meta = vec![0u8; header.meta_len as usize];
    stream.read_exact(&mut meta)?;
    Ok((header, meta))
}

/// The answer to a handshake step: the expected frame's metadata, or the server's refusal.
fn handshake_step<T: serde::de::DeserializeOwned>(
    stream: &mut impl Read,
    endpoint: &str,
    expected: Command,
) -> Result<T> {
    let (header, meta) = read_handshake_frame(stream)
        .map_err(|e| Error::Backend(format!("handshake with {endpoint} failed: {e}")))?;
    match header.command {
        c if c == expected => decode_meta(&meta),
        Command::Error => {
            let refusal: ErrorReply = decode_meta(&meta)?;
            Err(error_from_reply(&refusal, endpoint))
        }
        other => Err(Error::Backend(format!(
            "handshake with {endpoint}: expected {expected:?}, got {other:?}"
        ))),
    }
}

impl Connection {
    /// Connects to `endpoint` (`host:port`) as a client: the encrypted handshake proves the
    /// token both ways (see [`super::secure`]), then the version and build fingerprint are
    /// checked.
    pub fn open(endpoint: &str, token: &[u8], settings: ClientSettings) -> Result<Arc<Connection>> {
        Connection::open_as(endpoint, token, Role::Client, settings)
    }

    /// As [`Connection::open`], in `role` (a server pushing to a peer uses [`Role::Peer`]).
    pub fn open_as(
        endpoint: &str,
        token: &[u8],
        role: Role,
        settings: ClientSettings,
    ) -> Result<Arc<Connection>> {
        if token.is_empty() {
            return Err(Error::InvalidArgument(
                "a token is required to connect (token= or FERROGRAPH_TOKEN)".into(),
            ));
        }
        let addrs: Vec<_> = endpoint
            .to_socket_addrs()
            .map_err(|e| {
                Error::InvalidArgument(format!("cannot resolve {endpoint:?} (host:port): {e}"))
            })?
            .collect();
        let mut last_err = None;
        let mut stream = None;
        for addr in &addrs {
            match TcpStream::connect_timeout(addr, settings.connect_timeout) {
                Ok(s) => {
                    stream = Some(s);
                    break;
                }
                Err(e) => last_err = Some(e),
            }
        }
        let Some(mut stream) = stream else {
            return Err(Error::Backend(format!(
                "cannot connect to {endpoint}: {}",
                last_err.map_or("no address".to_owned(), |e| e.to_string())
            )));
        };
        let setup = |s: &TcpStream| -> std::io::Result<()> {
            s.set_nodelay(true)?;
            s.set_read_timeout(Some(settings.connect_timeout))?;
            s.set_write_timeout(Some(settings.connect_timeout))
        };
        setup(&stream).map_err(|e| Error::Backend(format!("socket setup failed: {e}")))?;
        let keys = client_handshake(&mut stream, token, role, PROTOCOL_VERSION, endpoint)?;
        let clone = |s: &TcpStream| {
            s.try_clone()
                .map_err(|e| Error::Backend(format!("cannot share the socket: {e}")))
        };
        let mut writer = RecordWriter::new(clone(&stream)?, keys.clone());
        let mut reader = RecordReader::new(clone(&stream)?, keys);

        let hello = Hello {
            version: PROTOCOL_VERSION,
            fingerprint: crate::dynload::abi_fingerprint().to_owned(),
        };
        write_frame(
            &mut writer,
            Command::Hello,
            0,
            &encode_meta(&hello)?,
            &[],
            || {},
        )
        .map_err(|e| Error::Backend(format!("handshake with {endpoint} failed: {e}")))?;
        let welcome: Welcome = handshake_step(&mut reader, endpoint, Command::Welcome)?;

        // Reads wake up every heartbeat to check liveness; writes give up after the dead time.
        let tune = |s: &TcpStream| -> std::io::Result<()> {
            s.set_read_timeout(Some(settings.heartbeat))?;
            s.set_write_timeout(Some(settings.dead_after))
        };
        // (The reader's and writer's sockets are clones of this one: same socket, same options.)
        tune(&stream).map_err(|e| Error::Backend(format!("socket setup failed: {e}")))?;
        let conn = Arc::new(Connection {
            endpoint: endpoint.to_owned(),
            writer: Mutex::new((writer, 1)),
            stream,
            state: Mutex::new(State {
                lost: None,
                waiting: HashMap::new(),
                outstanding: BTreeSet::new(),
                async_error: None,
                last_alive: Instant::now(),
            }),
            changed: Condvar::new(),
            last_sent: AtomicU64::new(0),
            welcome,
            settings,
        });
        let weak = Arc::downgrade(&conn);
        std::thread::Builder::new()
            .name("ferrograph-remote-read".into())
            .spawn(move || read_loop(reader, weak))
            .map_err(|e| Error::Backend(format!("cannot start the reader thread: {e}")))?;
        let weak = Arc::downgrade(&conn);
        std::thread::Builder::new()
            .name("ferrograph-remote-heartbeat".into())
            .spawn(move || heartbeat_loop(weak))
            .map_err(|e| Error::Backend(format!("cannot start the heartbeat thread: {e}")))?;
        Ok(conn)
    }

    /// The `host:port` this connection reaches.
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// What the server offered in its WELCOME.
    pub fn welcome(&self) -> &Welcome {
        &self.welcome
    }

    /// The settings the connection runs with.
    pub fn settings(&self) -> ClientSettings {
        self.settings
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Why the connection was lost, if it was.
    pub fn lost(&self) -> Option<String> {
        self.lock().lost.clone()
    }

    fn lost_error(&self, reason: &str) -> Error {
        Error::DeviceLost(format!("server {}: {reason}", self.endpoint))
    }

    /// Marks the connection lost (first reason wins), wakes every waiter and closes the socket.
    pub fn mark_lost(&self, reason: &str) {
        {
            let mut state = self.lock();
            if state.lost.is_some() {
                return;
            }
            state.lost = Some(reason.to_owned());
        }
        self.changed.notify_all();
        let _ = self.stream.shutdown(Shutdown::Both);
    }

    fn alive(&self) {
        self.lock().last_alive = Instant::now();
    }

    /// Sends a request; `waited` registers it for [`Connection::wait_reply`], else it is an
    /// asynchronous request completed by a later fence. Returns its id.
    fn send(&self, request: &Request, payload: &[u8], waited: bool) -> Result<u64> {
        if payload.len() as u64 > self.welcome.max_payload {
            return Err(Error::InvalidArgument(format!(
                "{} bytes exceed the server's frame limit of {} bytes",
                payload.len(),
                self.welcome.max_payload
            )));
        }
        let meta = encode_meta(request)?;
        if meta.len() as u64 > self.welcome.max_meta as u64 {
            return Err(Error::InvalidArgument(format!(
                "a request of {} bytes exceeds the server's metadata limit of {} bytes",
                meta.len(),
                self.welcome.max_meta
            )));
        }
        let mut writer = self.writer.lock().unwrap_or_else(|p| p.into_inner());
        let id = writer.1;
        {
            let mut state = self.lock();
            if let Some(reason) = &state.lost {
                return Err(self.lost_error(reason));
            }
            if waited {
                state.waiting.insert(id, None);
            } else {
                state.outstanding.insert(id);
            }
        }
        writer.1 += 1;
        self.last_sent.store(id, Ordering::Release);
        let written = write_frame(&mut writer.0, Command::Request, id, &meta, payload, || {
            self.alive()
        });
        drop(writer);
        if let Err(e) = written {
            let err = io_lost(&self.endpoint, "sending failed", e);
            self.mark_lost(&err.to_string());
            return Err(err);
        }
        Ok(id)
    }

    fn wait_reply(&self, id: u64) -> Result<(Reply, Vec<u8>)> {
        let deadline = Instant::now() + self.settings.request_timeout;
        let mut state = self.lock();
        loop {
            if let Some(Some(_)) = state.waiting.get(&id) {
                let answer = state.waiting.remove(&id).flatten();
                let earlier = state.async_error.take();
                drop(state);
                return match (earlier, answer) {
                    (Some(err), _) => Err(err),
                    (None, Some(answer)) => answer,
                    (None, None) => Err(Error::Backend("internal: reply vanished".into())),
                };
            }
            if let Some(reason) = state.lost.clone() {
                state.waiting.remove(&id);
                return Err(self.lost_error(&reason));
            }
            let now = Instant::now();
            if now >= deadline {
                state.waiting.remove(&id);
                drop(state);
                let reason = format!(
                    "no reply within {:?} (request_timeout)",
                    self.settings.request_timeout
                );
                self.mark_lost(&reason);
                return Err(self.lost_error(&reason));
            }
            state = self
                .changed
                .wait_timeout(state, deadline - now)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }

    /// Sends a request and waits for its reply (an earlier asynchronous failure is reported
    /// first).
    pub fn call(&self, request: &Request, payload: &[u8]) -> Result<(Reply, Vec<u8>)> {
        let id = self.send(request, payload, true)?;
        self.wait_reply(id)
    }

    /// Sends a request without waiting; its failure is reported by the next wait.
    pub fn call_async(&self, request: &Request, payload: &[u8]) -> Result<u64> {
        self.send(request, payload, false)
    }

    /// The id of the last request sent (0 before any): a fence covering everything so far.
    pub fn fence(&self) -> u64 {
        self.last_sent.load(Ordering::Acquire)
    }

    /// Waits until every asynchronous request up to `fence` is answered; reports the first
    /// asynchronous failure.
    pub fn wait_fence(&self, fence: u64) -> Result<()> {
        let deadline = Instant::now() + self.settings.request_timeout;
        let mut state = self.lock();
        loop {
            if let Some(reason) = &state.lost {
                return Err(self.lost_error(reason));
            }
            if state.outstanding.range(..=fence).next().is_none() {
                return match state.async_error.take() {
                    Some(err) => Err(err),
                    None => Ok(()),
                };
            }
            let now = Instant::now();
            if now >= deadline {
                drop(state);
                let reason = "asynchronous work did not finish within request_timeout";
                self.mark_lost(reason);
                return Err(self.lost_error(reason));
            }
            state = self
                .changed
                .wait_timeout(state, deadline - now)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }

    /// Waits for everything sent so far.
    pub fn synchronize(&self) -> Result<()> {
        self.wait_fence(u64::MAX)
    }

    fn deliver(&self, id: u64, answer: Answer) {
        let mut state = self.lock();
        state.last_alive = Instant::now();
        if let Some(slot) = state.waiting.get_mut(&id) {
            *slot = Some(answer);
        } else if state.outstanding.remove(&id) {
            if let Err(err) = answer {
                state.async_error.get_or_insert(err);
            }
        }
        drop(state);
        self.changed.notify_all();
    }
}

impl Drop for Connection {
    fn drop(&mut self) {
        let _ = self.stream.shutdown(Shutdown::Both);
    }
}

/// Reads exactly `buf.len()` bytes; on each read timeout checks that the server still counts
/// as alive. `Err` is the reason the connection is lost.
fn read_full(
    stream: &mut impl Read,
    buf: &mut [u8],
    conn: &Weak<Connection>,
) -> std::result::Result<(), String> {
    let mut filled = 0;
    while filled < buf.len() {
        match stream.read(&mut buf[filled..]) {
            Ok(0) => return Err("the server closed the connection".into()),
            Ok(n) => {
                filled += n;
                if let Some(conn) = conn.upgrade() {
                    conn.alive();
                }
            }
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                let Some(conn) = conn.upgrade() else {
                    return Err("the connection was dropped".into());
                };
                let state = conn.lock();
                if let Some(reason) = &state.lost {
                    return Err(reason.clone());
                }
                let silent = state.last_alive.elapsed();
                if silent > conn.settings.dead_after {
                    return Err(format!(
                        "no answer (not even to heartbeats) for {:.1} s: the server died or hangs",
                        silent.as_secs_f64()
                    ));
                }
            }
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => return Err(format!("the connection broke: {e}")),
        }
    }
    Ok(())
}

fn read_loop(mut stream: RecordReader<TcpStream>, conn: Weak<Connection>) {
    let reason = loop {
        let mut head = [0u8; HEADER_LEN];
        if let Err(reason) = read_full(&mut stream, &mut head, &conn) {
            break reason;
        }
        let Some(strong) = conn.upgrade() else {
            return;
        };
        let limits = FrameLimits {
            max_meta: u32::MAX,
            // Replies carry at most what we asked for, itself under the server's limit.
            max_payload: strong.welcome.max_payload,
        };
        drop(strong);
        let header = match FrameHeader::decode(&head, limits) {
            Ok(h) => h,
            Err(e) => break format!("the server sent a bad frame: {e}"),
        };
        let mut meta = vec![0u8; header.meta_len.min(1 << 26) as usize];
        if header.meta_len > 1 << 26 {
            break "the server sent oversized metadata".into();
        }
        if let Err(reason) = read_full(&mut stream, &mut meta, &conn) {
            break reason;
        }
        let mut payload = vec![0u8; header.payload_len as usize];
        if let Err(reason) = read_full(&mut stream, &mut payload, &conn) {
            break reason;
        }
        let Some(strong) = conn.upgrade() else {
            return;
        };
        match header.command {
            Command::Pong => strong.alive(),
            Command::Reply => match decode_meta::<Reply>(&meta) {
                Ok(reply) => strong.deliver(header.request_id, Ok((reply, payload))),
                Err(e) => break format!("the server sent a bad reply: {e}"),
            },
            Command::Error => match decode_meta::<ErrorReply>(&meta) {
                Ok(reply) => {
                    let err = error_from_reply(&reply, &strong.endpoint);
                    if reply.fatal {
                        break format!("the server closed the session: {}", reply.message);
                    }
                    strong.deliver(header.request_id, Err(err));
                }
                Err(e) => break format!("the server sent a bad error reply: {e}"),
            },
            other => break format!("the server sent an unexpected {other:?} frame"),
        }
    };
    if let Some(conn) = conn.upgrade() {
        conn.mark_lost(&reason);
    }
}

fn heartbeat_loop(conn: Weak<Connection>) {
    loop {
        let Some(strong) = conn.upgrade() else {
            return;
        };
        if strong.lost().is_some() {
            return;
        }
        let interval = strong.settings.heartbeat;
        // A writer busy with a large payload already shows progress; skip the ping then.
        if let Ok(mut writer) = strong.writer.try_lock() {
            let id = writer.1;
            let sent = write_frame(&mut writer.0, Command::Ping, id, &[], &[], || {});
            drop(writer);
            if let Err(e) = sent {
                strong.mark_lost(&format!("heartbeat failed: {e}"));
                return;
            }
        }
        drop(strong);
        std::thread::sleep(interval);
    }
}
