//! The wire protocol between a device server and its clients.
//!
//! Every message is a frame: a fixed 28-byte header, then `meta_len` bytes of metadata (one
//! postcard-encoded value whose type the command names), then `payload_len` raw bytes (tensor
//! data, never interpreted). All integers are little-endian.
//!
//! ```text
//! offset  size  field
//!      0     4  magic "FGRD"
//!      4     2  command (see [`Command`])
//!      6     2  reserved, must be 0
//!      8     8  request id (a reply carries the id of its request)
//!     16     4  metadata length
//!     20     8  payload length
//! ```
//!
//! Frames travel inside the encrypted records of [`super::secure`], after its Noise handshake
//! (both sides prove the token, bound to the connection's keys). The first frame is the
//! client's HELLO (protocol version and build fingerprint, so a mismatch is refused with a
//! message naming both, and only to a client that authenticated); the server answers WELCOME
//! or a fatal ERROR. After WELCOME, requests are processed in order per connection and every
//! request gets exactly one REPLY or ERROR with its id, except PING, which is answered (PONG)
//! at once even while a computation runs: that is the heartbeat.
//!
//! Buffers and cached graphs are named by opaque 64-bit handles that the server draws itself;
//! they are looked up in the session's own tables, so a handle from another session or a
//! guessed number is only ever "unknown". Sizes, offsets, shapes and strides are 64-bit.

use serde::{Deserialize, Serialize};

use crate::error::{Error, ErrorKind, Result};

/// The protocol version; a client and server of different versions refuse each other.
pub const PROTOCOL_VERSION: u32 = 3;

/// The first four bytes of every frame.
pub const MAGIC: [u8; 4] = *b"FGRD";

/// Bytes in a frame header.
pub const HEADER_LEN: usize = 28;

/// Largest metadata accepted before the handshake completes.
pub const HANDSHAKE_META_LIMIT: u32 = 4096;

/// Bytes drawn by [`nonce`].
pub const NONCE_LEN: usize = 32;

/// Commands (the header's `command` field).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u16)]
pub enum Command {
    /// Client → server, first frame: version and fingerprint ([`Hello`]).
    Hello = 1,
    /// Server → client: what the server offers ([`Welcome`]).
    Welcome = 4,
    /// Heartbeat request (no metadata); answered at once.
    Ping = 5,
    /// Heartbeat answer (no metadata).
    Pong = 6,
    /// Client → server: a [`Request`] (payload: tensor bytes for `Set`).
    Request = 7,
    /// Server → client: the [`Reply`] to the request with the same id (payload: bytes for
    /// `Get`).
    Reply = 8,
    /// Server → client: the request with the same id failed ([`ErrorReply`]).
    Error = 9,
}

impl Command {
    /// The command with this number.
    pub fn from_u16(value: u16) -> Option<Command> {
        Some(match value {
            1 => Command::Hello,
            4 => Command::Welcome,
            5 => Command::Ping,
            6 => Command::Pong,
            7 => Command::Request,
            8 => Command::Reply,
            9 => Command::Error,
            _ => return None,
        })
    }
}

/// A decoded frame header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FrameHeader {
    /// What the frame carries.
    pub command: Command,
    /// The request id (replies repeat their request's).
    pub request_id: u64,
    /// Bytes of postcard metadata that follow the header.
    pub meta_len: u32,
    /// Raw bytes that follow the metadata.
    pub payload_len: u64,
}

/// Size limits a reader applies to incoming frames.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FrameLimits {
    /// Largest metadata.
    pub max_meta: u32,
    /// Largest payload.
    pub max_payload: u64,
}

impl FrameHeader {
    /// The 28 header bytes.
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut out = [0u8; HEADER_LEN];
        out[0..4].copy_from_slice(&MAGIC);
        out[4..6].copy_from_slice(&(self.command as u16).to_le_bytes());
        out[8..16].copy_from_slice(&self.request_id.to_le_bytes());
        out[16..20].copy_from_slice(&self.meta_len.to_le_bytes());
        out[20..28].copy_from_slice(&self.payload_len.to_le_bytes());
        out
    }

    /// Decodes and checks a header against `limits`: magic, known command, zero reserved
    /// bits and both lengths.
    pub fn decode(bytes: &[u8; HEADER_LEN], limits: FrameLimits) -> Result<FrameHeader> {
        if bytes[0..4] != MAGIC {
            return Err(Error::InvalidArgument(
                "not a ferrograph frame (bad magic): is this a ferrograph server/client?".into(),
            ));
        }
        let word = |r: std::ops::Range<usize>| {
            let mut b = [0u8; 8];
            b[..r.len()].copy_from_slice(&bytes[r]);
            u64::from_le_bytes(b)
        };
        let raw_command = word(4..6) as u16;
        let command = Command::from_u16(raw_command).ok_or_else(|| {
            Error::InvalidArgument(format!("unknown frame command {raw_command}"))
        })?;
        if word(6..8) != 0 {
            return Err(Error::InvalidArgument(
                "reserved header bits are set".into(),
            ));
        }
        let header = FrameHeader {
            command,
            request_id: word(8..16),
            meta_len: word(16..20) as u32,
            payload_len: word(20..28),
        };
        if header.meta_len > limits.max_meta {
            return Err(Error::InvalidArgument(format!(
                "frame metadata of {} bytes exceeds the limit of {}",
                header.meta_len, limits.max_meta
            )));
        }
        if header.payload_len > limits.max_payload {
            return Err(Error::InvalidArgument(format!(
                "frame payload of {} bytes exceeds the limit of {}",
                header.payload_len, limits.max_payload
            )));
        }
        Ok(header)
    }
}

/// Encodes a metadata value.
pub fn encode_meta<T: Serialize>(value: &T) -> Result<Vec<u8>> {
    postcard::to_stdvec(value)
        .map_err(|e| Error::InvalidArgument(format!("cannot encode frame metadata: {e}")))
}

/// Decodes a metadata value; trailing bytes are an error (a frame holds exactly one value).
pub fn decode_meta<'a, T: Deserialize<'a>>(bytes: &'a [u8]) -> Result<T> {
    let (value, rest) = postcard::take_from_bytes(bytes)
        .map_err(|e| Error::InvalidArgument(format!("malformed frame metadata: {e}")))?;
    if !rest.is_empty() {
        return Err(Error::InvalidArgument(format!(
            "{} unexpected bytes after the frame metadata",
            rest.len()
        )));
    }
    Ok(value)
}

/// HELLO: the client's first frame, sent once the connection is authenticated.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Hello {
    /// [`PROTOCOL_VERSION`] of the client.
    pub version: u32,
    /// The client's build fingerprint (see `crate::dynload::abi_fingerprint`).
    pub fingerprint: String,
}

/// What a server device offers.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DeviceInfo {
    /// The server-side device name (`"CPU"`).
    pub name: String,
    /// Its description (CPU model, ...).
    pub description: String,
    /// Free memory in bytes.
    pub memory_free: u64,
    /// Total memory in bytes.
    pub memory_total: u64,
    /// Name of its buffer type.
    pub buffer_type: String,
    /// Alignment of tensor offsets in its buffers.
    pub alignment: u64,
    /// Largest buffer it allocates (already capped by the session limit).
    pub max_size: u64,
}

/// WELCOME: the session's terms.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Welcome {
    /// The server's devices, by index.
    pub devices: Vec<DeviceInfo>,
    /// Largest frame payload the server accepts.
    pub max_payload: u64,
    /// Largest metadata the server accepts.
    pub max_meta: u32,
    /// Bytes of buffers a session may hold at once.
    pub max_session_bytes: u64,
    /// Graphs a session may keep cached at once.
    pub max_graphs: u32,
}

/// A request after the handshake.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Request {
    /// Allocates a buffer of `size` bytes on device `device` → [`Reply::Buffer`].
    Alloc {
        /// Device index.
        device: u32,
        /// Bytes.
        size: u64,
    },
    /// Frees a buffer; graphs that use it are dropped → [`Reply::Done`].
    Free {
        /// Buffer handle.
        buffer: u64,
    },
    /// Writes the frame's payload at `offset` → [`Reply::Done`].
    Set {
        /// Buffer handle.
        buffer: u64,
        /// Byte offset.
        offset: u64,
    },
    /// Reads `len` bytes at `offset` → [`Reply::Data`] with the bytes as payload.
    Get {
        /// Buffer handle.
        buffer: u64,
        /// Byte offset.
        offset: u64,
        /// Bytes.
        len: u64,
    },
    /// Fills `len` bytes at `offset` with `value` → [`Reply::Done`].
    Memset {
        /// Buffer handle.
        buffer: u64,
        /// Byte offset.
        offset: u64,
        /// Bytes.
        len: u64,
        /// Fill byte.
        value: u8,
    },
    /// Copies `len` bytes between two buffers of this session → [`Reply::Done`].
    Copy {
        /// Source buffer handle.
        src: u64,
        /// Source byte offset.
        src_offset: u64,
        /// Destination buffer handle.
        dst: u64,
        /// Destination byte offset.
        dst_offset: u64,
        /// Bytes.
        len: u64,
    },
    /// Computes a graph on device `device` → [`Reply::Status`]. With `desc`, the graph is
    /// validated, built and cached under `graph` (a client-chosen number, unique in the
    /// session); without, the cached graph `graph` is computed again.
    Compute {
        /// Device index.
        device: u32,
        /// Cache key.
        graph: u64,
        /// The graph, when not cached yet.
        desc: Option<super::wire::GraphDesc>,
    },
    /// Forgets a cached graph → [`Reply::Done`].
    DropGraph {
        /// Cache key.
        graph: u64,
    },
    /// Whether device `device` computes the last tensor of `desc` (an unbound graph of the
    /// op and its operands) → [`Reply::Supported`].
    SupportsOp {
        /// Device index.
        device: u32,
        /// The op.
        desc: super::wire::GraphDesc,
    },
    /// The device's free and total memory → [`Reply::Memory`].
    Memory {
        /// Device index.
        device: u32,
    },
    /// Writes `len` bytes with SHA-256 `hash` at `offset` from the server's weight cache, if it
    /// holds them (re-hashed before use) → [`Reply::Cached`].
    SetCached {
        /// Buffer handle.
        buffer: u64,
        /// Byte offset.
        offset: u64,
        /// Bytes.
        len: u64,
        /// SHA-256 of the bytes.
        hash: [u8; 32],
    },
    /// Sends `len` bytes at `offset` straight to another server (`to`, `host:port`, reached
    /// with this server's own token), which holds them under `ticket` until a `Claim`
    /// → [`Reply::Done`] once they are there.
    Push {
        /// Buffer handle.
        buffer: u64,
        /// Byte offset.
        offset: u64,
        /// Bytes.
        len: u64,
        /// The receiving server.
        to: String,
        /// A random name for the transfer.
        ticket: [u8; 16],
    },
    /// Server → server: holds the payload under `ticket` for a later `Claim` → [`Reply::Done`].
    Deposit {
        /// The transfer's name.
        ticket: [u8; 16],
    },
    /// Writes the bytes deposited under `ticket` at `offset` → [`Reply::Done`].
    Claim {
        /// Buffer handle.
        buffer: u64,
        /// Byte offset.
        offset: u64,
        /// The transfer's name.
        ticket: [u8; 16],
    },
    /// As `Set`, and keeps the payload in the weight cache under `hash` when the payload
    /// really hashes to it (a mismatch is an error and nothing is written) → [`Reply::Done`].
    SetAndCache {
        /// Buffer handle.
        buffer: u64,
        /// Byte offset.
        offset: u64,
        /// SHA-256 of the payload.
        hash: [u8; 32],
    },
}

/// A successful answer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Reply {
    /// Done, nothing to say.
    Done,
    /// A new buffer.
    Buffer {
        /// Its handle.
        handle: u64,
        /// Its size in bytes.
        size: u64,
    },
    /// The requested bytes are the payload.
    Data,
    /// A graph computation's status code (`Status::code`).
    Status(i32),
    /// Whether an op is supported.
    Supported(bool),
    /// Whether a `SetCached` found its bytes.
    Cached(bool),
    /// Free and total bytes.
    Memory {
        /// Free bytes.
        free: u64,
        /// Total bytes.
        total: u64,
    },
}

/// A failed request: the error's kind and message; `fatal` when the server closes the
/// connection after sending it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ErrorReply {
    /// Which [`Error`] variant (see [`error_kind`]).
    pub kind: u8,
    /// The message.
    pub message: String,
    /// Whether the connection is closed after this reply.
    pub fatal: bool,
}

/// The wire number of an error's kind: its [`ErrorKind::number`] plus one (0 is never sent).
/// The facts of structured variants do not travel: the message carries them, and the client
/// rebuilds an error of the same kind (and so of the same Python class).
pub fn error_kind(err: &Error) -> u8 {
    err.kind().number() + 1
}

/// Rebuilds an error from its wire number and message, prefixed with where it happened; an
/// unknown number is a backend error.
pub fn error_from_reply(reply: &ErrorReply, endpoint: &str) -> Error {
    let m = format!("server {endpoint}: {}", reply.message);
    let kind = reply
        .kind
        .checked_sub(1)
        .and_then(ErrorKind::from_number)
        .unwrap_or(ErrorKind::Backend);
    Error::of_kind(kind, m)
}

/// Fresh random bytes (transfer tickets).
pub fn nonce() -> Result<[u8; NONCE_LEN]> {
    let mut n = [0u8; NONCE_LEN];
    getrandom::fill(&mut n).map_err(|e| Error::Backend(format!("no randomness available: {e}")))?;
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMITS: FrameLimits = FrameLimits {
        max_meta: 1024,
        max_payload: 1 << 20,
    };

    #[test]
    fn header_round_trip_and_limits() {
        let h = FrameHeader {
            command: Command::Request,
            request_id: u64::MAX - 3,
            meta_len: 1000,
            payload_len: 1 << 20,
        };
        assert_eq!(FrameHeader::decode(&h.encode(), LIMITS).unwrap(), h);
        let big = FrameHeader {
            payload_len: (1 << 20) + 1,
            ..h
        };
        assert!(FrameHeader::decode(&big.encode(), LIMITS).is_err());
        let mut bytes = h.encode();
        bytes[0] = b'X';
        assert!(FrameHeader::decode(&bytes, LIMITS).is_err());
        let mut bytes = h.encode();
        bytes[4] = 99;
        assert!(FrameHeader::decode(&bytes, LIMITS).is_err());
        let mut bytes = h.encode();
        bytes[7] = 1;
        assert!(FrameHeader::decode(&bytes, LIMITS).is_err());
    }

    #[test]
    fn meta_rejects_trailing_bytes() {
        let mut bytes = encode_meta(&Request::Free { buffer: 7 }).unwrap();
        assert_eq!(
            decode_meta::<Request>(&bytes).unwrap(),
            Request::Free { buffer: 7 }
        );
        bytes.push(0);
        assert!(decode_meta::<Request>(&bytes).is_err());
        assert!(decode_meta::<Request>(&[200, 1, 2]).is_err());
    }
}
