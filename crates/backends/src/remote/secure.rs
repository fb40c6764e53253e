//! The encrypted, mutually authenticated transport under the frame protocol.
//!
//! A connection opens with a 9-byte cleartext *preamble* from each side (`"FGRN"`, the protocol
//! version as a little-endian `u32`, and, from the connecting side, its [`Role`]), then a Noise
//! handshake (`Noise_NNpsk0_25519_ChaChaPoly_BLAKE2s`, through the `snow` crate) keyed by a
//! pre-shared key derived from the token ([`psk`]). Both ephemeral keys and the PSK enter the
//! session keys, so:
//!
//! * only a holder of the token can complete the handshake on either side (mutual
//!   authentication), and the proof is bound to this connection's keys: replaying or relaying a
//!   transcript yields nothing a third party can read or extend;
//! * everything after the handshake travels in authenticated, encrypted *records*: a 2-byte
//!   big-endian length, then at most 65,535 bytes of ciphertext (payload plus a 16-byte tag).
//!   Records carry a byte stream in which the frames of [`super::protocol`] follow each other.
//!
//! The client's preamble is the Noise prologue, so changing it in flight breaks the handshake.
//! Nothing but the protocol version is sent before authentication; the build fingerprint, the
//! devices and every error message travel encrypted.
//!
//! Nonces are per-direction record counters; the transport state is stateless in `snow`'s
//! sense, so one connection's reader and writer run on different threads without a lock.

use std::io::{ErrorKind, Read, Write};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use sha2::{Digest, Sha256};
use snow::{HandshakeState, StatelessTransportState};
use tokio::io::{AsyncRead, ReadBuf};

use crate::error::{Error, Result};

/// The Noise protocol name: pre-shared key first, ephemeral keys only.
pub const NOISE_PARAMS: &str = "Noise_NNpsk0_25519_ChaChaPoly_BLAKE2s";

/// The first four bytes of a preamble.
pub const PREAMBLE_MAGIC: [u8; 4] = *b"FGRN";

/// Bytes in a preamble.
pub const PREAMBLE_LEN: usize = 9;

/// Largest record (ciphertext with its tag), Noise's message limit.
pub const MAX_RECORD: usize = 65535;

/// Bytes of the authentication tag in every record.
pub const TAG_LEN: usize = 16;

/// Largest plaintext in one record.
pub const MAX_PLAIN: usize = MAX_RECORD - TAG_LEN;

/// Largest handshake message accepted (the two messages are 48 and 48 bytes).
pub const MAX_HANDSHAKE_RECORD: usize = 256;

/// Who opens a connection: a client, or a server pushing to a peer of its cluster. Each role
/// has its own key, so a server tells a peer from a client cryptographically.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Role {
    /// A client of the device server.
    Client = 0,
    /// Another server of the same cluster (deposits only).
    Peer = 1,
}

impl Role {
    fn label(self) -> &'static [u8] {
        match self {
            Role::Client => b"ferrograph v2 client psk\0",
            Role::Peer => b"ferrograph v2 peer psk\0",
        }
    }
}

/// The pre-shared key of `role` derived from `token`: SHA-256 over a role label and the token.
/// The token should carry at least 128 random bits: whoever records a handshake can test
/// guesses of the token against it offline.
pub fn psk(token: &[u8], role: Role) -> [u8; 32] {
    let mut h = Sha256::new();
    h.update(role.label());
    h.update(token);
    h.finalize().into()
}

/// The preamble: magic, `version`, `role` (the server's own preamble says `Client` there and
/// the field is ignored).
pub fn preamble(version: u32, role: Role) -> [u8; PREAMBLE_LEN] {
    let mut out = [0u8; PREAMBLE_LEN];
    out[..4].copy_from_slice(&PREAMBLE_MAGIC);
    out[4..8].copy_from_slice(&version.to_le_bytes());
    out[8] = role as u8;
    out
}

/// Decodes a preamble: its version and role. `Err` for a wrong magic or unknown role.
pub fn parse_preamble(bytes: &[u8; PREAMBLE_LEN]) -> Result<(u32, Role)> {
    if bytes[..4] != PREAMBLE_MAGIC {
        return Err(Error::InvalidArgument(
            "not a ferrograph connection (bad preamble): is this a ferrograph server/client?"
                .into(),
        ));
    }
    let version = u32::from_le_bytes([bytes[4], bytes[5], bytes[6], bytes[7]]);
    let role = match bytes[8] {
        0 => Role::Client,
        1 => Role::Peer,
        other => {
            return Err(Error::InvalidArgument(format!(
                "unknown connection role {other}"
            )))
        }
    };
    Ok((version, role))
}

fn noise_error(what: &str, e: snow::Error) -> Error {
    Error::Backend(format!("{what}: {e}"))
}

/// A Noise handshake state keyed by `key`, bound to `prologue`; `initiator` for the side that
/// connects.
pub fn handshake_state(key: &[u8; 32], prologue: &[u8], initiator: bool) -> Result<HandshakeState> {
    let params = NOISE_PARAMS
        .parse()
        .map_err(|e| noise_error("bad Noise parameters", e))?;
    let builder = snow::Builder::new(params)
        .psk(0, key)
        .map_err(|e| noise_error("bad pre-shared key", e))?
        .prologue(prologue)
        .map_err(|e| noise_error("bad prologue", e))?;
    if initiator {
        builder.build_initiator()
    } else {
        builder.build_responder()
    }
    .map_err(|e| noise_error("cannot start the handshake", e))
}

/// Writes `message` as a handshake record (2-byte big-endian length first) into `out`.
pub fn handshake_record(message: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(2 + message.len());
    out.extend_from_slice(&(message.len() as u16).to_be_bytes());
    out.extend_from_slice(message);
    out
}

/// The keys of an established connection, shared by its reader and writer.
pub type Keys = Arc<StatelessTransportState>;

/// Ends a finished handshake: the transport keys.
pub fn into_keys(state: HandshakeState) -> Result<Keys> {
    state
        .into_stateless_transport_mode()
        .map(Arc::new)
        .map_err(|e| noise_error("the handshake did not finish", e))
}

/// Turns plaintext into records: buffers up to one record of plaintext, seals full records at
/// once and the rest on [`Sealer::seal_pending`]. Sealed bytes collect in [`Sealer::out`] for
/// the caller to write.
pub struct Sealer {
    keys: Keys,
    nonce: u64,
    pending: Vec<u8>,
    /// Sealed records not written yet (the caller writes and clears them).
    pub out: Vec<u8>,
}

impl Sealer {
    /// A sealer with these keys, its record counter at 0.
    pub fn new(keys: Keys) -> Sealer {
        Sealer {
            keys,
            nonce: 0,
            pending: Vec::with_capacity(MAX_PLAIN),
            out: Vec::new(),
        }
    }

    fn seal(&mut self, plain_from_pending: bool, data: &[u8]) -> std::io::Result<()> {
        let plain = if plain_from_pending {
            &self.pending[..]
        } else {
            data
        };
        let start = self.out.len();
        self.out.resize(start + 2 + plain.len() + TAG_LEN, 0);
        let n = self
            .keys
            .write_message(self.nonce, plain, &mut self.out[start + 2..])
            .map_err(|e| std::io::Error::other(format!("cannot encrypt a record: {e}")))?;
        self.out[start..start + 2].copy_from_slice(&(n as u16).to_be_bytes());
        self.out.truncate(start + 2 + n);
        self.nonce += 1;
        if plain_from_pending {
            self.pending.clear();
        }
        Ok(())
    }

    /// Adds plaintext; whole records are sealed into [`Sealer::out`] as they fill.
    pub fn write(&mut self, mut data: &[u8]) -> std::io::Result<()> {
        while !data.is_empty() {
            if self.pending.is_empty() && data.len() >= MAX_PLAIN {
                self.seal(false, &data[..MAX_PLAIN])?;
                data = &data[MAX_PLAIN..];
                continue;
            }
            let take = (MAX_PLAIN - self.pending.len()).min(data.len());
            self.pending.extend_from_slice(&data[..take]);
            data = &data[take..];
            if self.pending.len() == MAX_PLAIN {
                self.seal(true, &[])?;
            }
        }
        Ok(())
    }

    /// Seals the buffered plaintext (if any) as one last record.
    pub fn seal_pending(&mut self) -> std::io::Result<()> {
        if self.pending.is_empty() {
            return Ok(());
        }
        self.seal(true, &[])
    }
}

/// Turns records back into plaintext. Keeps a partly read record across calls, so a read
/// that times out can be resumed.
struct Opener {
    keys: Keys,
    nonce: u64,
    /// The record being read: its length prefix, then its ciphertext.
    record: Vec<u8>,
    /// Bytes of `record` filled so far.
    filled: usize,
    plain: Vec<u8>,
    /// Bytes of `plain` already handed out.
    taken: usize,
}

impl Opener {
    fn new(keys: Keys) -> Opener {
        Opener {
            keys,
            nonce: 0,
            record: vec![0u8; 2],
            filled: 0,
            plain: Vec::with_capacity(MAX_PLAIN),
            taken: 0,
        }
    }

    /// Where the next bytes of the current record go.
    fn space(&mut self) -> &mut [u8] {
        &mut self.record[self.filled..]
    }

    /// Records that `n` bytes arrived; decrypts a completed record into `plain`.
    fn advance(&mut self, n: usize) -> std::io::Result<()> {
        self.filled += n;
        if self.filled < self.record.len() {
            return Ok(());
        }
        if self.record.len() == 2 {
            let len = u16::from_be_bytes([self.record[0], self.record[1]]) as usize;
            if len < TAG_LEN {
                return Err(std::io::Error::new(
                    ErrorKind::InvalidData,
                    "a record shorter than its tag",
                ));
            }
            self.record.resize(2 + len, 0);
            return Ok(());
        }
        self.plain.resize(self.record.len() - 2 - TAG_LEN, 0);
        let n = self
            .keys
            .read_message(self.nonce, &self.record[2..], &mut self.plain)
            .map_err(|_| {
                std::io::Error::new(
                    ErrorKind::InvalidData,
                    "a record failed authentication (tampered, replayed or out of order)",
                )
            })?;
        self.plain.truncate(n);
        self.taken = 0;
        self.nonce += 1;
        self.record.truncate(2);
        self.filled = 0;
        Ok(())
    }

    /// Copies buffered plaintext into `buf`; 0 when none is buffered.
    fn take(&mut self, buf: &mut [u8]) -> usize {
        let n = (self.plain.len() - self.taken).min(buf.len());
        buf[..n].copy_from_slice(&self.plain[self.taken..self.taken + n]);
        self.taken += n;
        n
    }

    fn mid_record(&self) -> bool {
        self.filled > 0
    }
}

/// The plaintext side of a blocking socket: [`Read`] over the records arriving on it.
pub struct RecordReader<R> {
    inner: R,
    opener: Opener,
}

impl<R> RecordReader<R> {
    /// Reads records from `inner` with these keys.
    pub fn new(inner: R, keys: Keys) -> Self {
        RecordReader {
            inner,
            opener: Opener::new(keys),
        }
    }
}

impl<R: Read> Read for RecordReader<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        if buf.is_empty() {
            return Ok(0);
        }
        loop {
            let n = self.opener.take(buf);
            if n > 0 {
                return Ok(n);
            }
            let got = self.inner.read(self.opener.space())?;
            if got == 0 {
                if self.opener.mid_record() {
                    return Err(ErrorKind::UnexpectedEof.into());
                }
                return Ok(0);
            }
            self.opener.advance(got)?;
        }
    }
}

impl<R: AsyncRead + Unpin> AsyncRead for RecordReader<R> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        loop {
            let n = this.opener.take(buf.initialize_unfilled());
            if n > 0 {
                buf.advance(n);
                return Poll::Ready(Ok(()));
            }
            if buf.remaining() == 0 {
                return Poll::Ready(Ok(()));
            }
            let mut space = ReadBuf::new(this.opener.space());
            match Pin::new(&mut this.inner).poll_read(cx, &mut space) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Ready(Ok(())) => {
                    let got = space.filled().len();
                    if got == 0 {
                        if this.opener.mid_record() {
                            return Poll::Ready(Err(ErrorKind::UnexpectedEof.into()));
                        }
                        return Poll::Ready(Ok(()));
                    }
                    this.opener.advance(got)?;
                }
            }
        }
    }
}

/// The plaintext side of a blocking socket for writing: frames go in with
/// [`RecordWriter::write_all`], and out (sealed) on [`RecordWriter::flush`] or as records fill.
pub struct RecordWriter<W> {
    inner: W,
    sealer: Sealer,
}

impl<W: Write> RecordWriter<W> {
    /// Writes records to `inner` with these keys.
    pub fn new(inner: W, keys: Keys) -> Self {
        RecordWriter {
            inner,
            sealer: Sealer::new(keys),
        }
    }

    /// Adds plaintext, writing every record that fills.
    pub fn write_all(&mut self, data: &[u8]) -> std::io::Result<()> {
        self.sealer.write(data)?;
        if !self.sealer.out.is_empty() {
            self.inner.write_all(&self.sealer.out)?;
            self.sealer.out.clear();
        }
        Ok(())
    }

    /// Seals and writes everything buffered.
    pub fn flush(&mut self) -> std::io::Result<()> {
        self.sealer.seal_pending()?;
        if !self.sealer.out.is_empty() {
            self.inner.write_all(&self.sealer.out)?;
            self.sealer.out.clear();
        }
        self.inner.flush()
    }
}

/// Reads one handshake record (length-prefixed) from a blocking socket.
fn read_handshake_record(stream: &mut impl Read) -> std::io::Result<Vec<u8>> {
    let mut len = [0u8; 2];
    stream.read_exact(&mut len)?;
    let len = u16::from_be_bytes(len) as usize;
    if len > MAX_HANDSHAKE_RECORD {
        return Err(std::io::Error::new(
            ErrorKind::InvalidData,
            "oversized handshake message",
        ));
    }
    let mut message = vec![0u8; len];
    stream.read_exact(&mut message)?;
    Ok(message)
}

/// The connecting side's handshake on a blocking socket (with its timeouts already set):
/// sends the preamble and the first Noise message, checks the server's version and proof.
/// Returns the transport keys. Errors say whether the version differs or the server could not
/// authenticate (wrong token, or not a ferrograph server).
pub fn client_handshake<S: Read + Write>(
    stream: &mut S,
    token: &[u8],
    role: Role,
    version: u32,
    endpoint: &str,
) -> Result<Keys> {
    let failed = |what: &str| Error::Backend(format!("handshake with {endpoint} failed: {what}"));
    let ours = preamble(version, role);
    let mut state = handshake_state(&psk(token, role), &ours, true)?;
    let mut message = [0u8; MAX_HANDSHAKE_RECORD];
    let n = state
        .write_message(&[], &mut message)
        .map_err(|e| noise_error("cannot write the handshake", e))?;
    let mut opening = ours.to_vec();
    opening.extend_from_slice(&handshake_record(&message[..n]));
    stream
        .write_all(&opening)
        .and_then(|_| stream.flush())
        .map_err(|e| failed(&e.to_string()))?;
    let mut theirs = [0u8; PREAMBLE_LEN];
    stream.read_exact(&mut theirs).map_err(|e| {
        Error::InvalidArgument(format!(
            "authentication failed: {endpoint} closed the connection ({e}): a wrong token, \
             or not a ferrograph server"
        ))
    })?;
    let (server_version, _) = parse_preamble(&theirs)?;
    if server_version != version {
        return Err(Error::InvalidArgument(format!(
            "protocol version mismatch: this client speaks {version}, the server at {endpoint} \
             {server_version}"
        )));
    }
    let reply = read_handshake_record(stream).map_err(|e| {
        Error::InvalidArgument(format!(
            "authentication failed: {endpoint} refused the handshake ({e}): wrong token?"
        ))
    })?;
    let mut payload = [0u8; MAX_HANDSHAKE_RECORD];
    state.read_message(&reply, &mut payload).map_err(|_| {
        Error::InvalidArgument(format!(
            "authentication failed: the server at {endpoint} could not prove it holds the token"
        ))
    })?;
    into_keys(state)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pair() -> (Keys, Keys) {
        let key = psk(b"token", Role::Client);
        let mut i = handshake_state(&key, b"p", true).unwrap();
        let mut r = handshake_state(&key, b"p", false).unwrap();
        let mut m = [0u8; 256];
        let mut p = [0u8; 256];
        let n = i.write_message(&[], &mut m).unwrap();
        r.read_message(&m[..n], &mut p).unwrap();
        let n = r.write_message(&[], &mut m).unwrap();
        i.read_message(&m[..n], &mut p).unwrap();
        (into_keys(i).unwrap(), into_keys(r).unwrap())
    }

    #[test]
    fn records_round_trip_and_tampering_is_caught() {
        let (ik, rk) = pair();
        let mut sealer = Sealer::new(ik);
        let data: Vec<u8> = (0..200_000u32).map(|i| i as u8).collect();
        sealer.write(&data[..10]).unwrap();
        sealer.write(&data[10..]).unwrap();
        sealer.seal_pending().unwrap();
        let wire = sealer.out.clone();
        assert!(!wire.windows(64).any(|w| w == &data[1000..1064]));
        let mut back = Vec::new();
        RecordReader::new(&wire[..], rk.clone())
            .read_to_end(&mut back)
            .unwrap();
        assert_eq!(back, data);
        let mut bad = wire.clone();
        bad[100] ^= 1;
        let mut sink = Vec::new();
        assert!(RecordReader::new(&bad[..], rk.clone())
            .read_to_end(&mut sink)
            .is_err());
        // A truncated stream is an error, not a short read.
        assert!(RecordReader::new(&wire[..wire.len() - 1], rk)
            .read_to_end(&mut sink)
            .is_err());
    }

    #[test]
    fn a_wrong_key_or_prologue_fails_the_handshake() {
        let mut i = handshake_state(&psk(b"a", Role::Client), b"p", true).unwrap();
        let mut r = handshake_state(&psk(b"b", Role::Client), b"p", false).unwrap();
        let mut m = [0u8; 256];
        let mut p = [0u8; 256];
        let n = i.write_message(&[], &mut m).unwrap();
        assert!(r.read_message(&m[..n], &mut p).is_err());
        let mut i = handshake_state(&psk(b"a", Role::Client), b"p", true).unwrap();
        let mut r = handshake_state(&psk(b"a", Role::Peer), b"p", false).unwrap();
        let n = i.write_message(&[], &mut m).unwrap();
        assert!(r.read_message(&m[..n], &mut p).is_err());
        let mut i = handshake_state(&psk(b"a", Role::Client), b"p", true).unwrap();
        let mut r = handshake_state(&psk(b"a", Role::Client), b"q", false).unwrap();
        let n = i.write_message(&[], &mut m).unwrap();
        assert!(r.read_message(&m[..n], &mut p).is_err());
    }
}
