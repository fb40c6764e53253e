//! A hand-driven client of the device server's wire protocol, shared by the remote test
//! suites: the real encrypted handshake, then frames written and read one by one (well-formed
//! or not), for refusals, malformed input and hostile clients.

#![allow(dead_code)] // each suite uses a different part

use std::io::Read;
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use ferrograph::error::Error;
use ferrograph::remote::protocol::{
    decode_meta, encode_meta, Command, ErrorReply, FrameHeader, FrameLimits, Hello, Request,
    Welcome, HEADER_LEN, PROTOCOL_VERSION,
};
use ferrograph::remote::secure::{client_handshake, RecordReader, RecordWriter, Role};

/// An authenticated connection driven frame by frame.
pub struct Raw {
    /// The socket (for shutdowns and timeouts).
    pub stream: TcpStream,
    reader: RecordReader<TcpStream>,
    writer: RecordWriter<TcpStream>,
}

impl Raw {
    /// Connects and completes the Noise handshake with `token` in `role` (no HELLO yet).
    pub fn connect(addr: SocketAddr, token: &[u8], role: Role) -> Result<Raw, Error> {
        let mut stream = TcpStream::connect(addr).unwrap();
        stream
            .set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        let keys = client_handshake(
            &mut stream,
            token,
            role,
            PROTOCOL_VERSION,
            &addr.to_string(),
        )?;
        Ok(Raw {
            reader: RecordReader::new(stream.try_clone().unwrap(), keys.clone()),
            writer: RecordWriter::new(stream.try_clone().unwrap(), keys),
            stream,
        })
    }

    /// Sends plaintext bytes inside records (errors ignored: the server may have closed).
    pub fn send_bytes(&mut self, bytes: &[u8]) {
        let _ = self.writer.write_all(bytes);
        let _ = self.writer.flush();
    }

    /// Sends one frame (errors ignored).
    pub fn send(&mut self, command: Command, id: u64, meta: &[u8], payload: &[u8]) {
        let h = FrameHeader {
            command,
            request_id: id,
            meta_len: meta.len() as u32,
            payload_len: payload.len() as u64,
        };
        let _ = self.writer.write_all(&h.encode());
        let _ = self.writer.write_all(meta);
        let _ = self.writer.write_all(payload);
        let _ = self.writer.flush();
    }

    /// Sends a request frame without waiting.
    pub fn send_request(&mut self, id: u64, request: &Request, payload: &[u8]) {
        self.send(
            Command::Request,
            id,
            &encode_meta(request).unwrap(),
            payload,
        );
    }

    /// The next frame, or `None` when the server closed the connection.
    pub fn recv(&mut self) -> Option<(FrameHeader, Vec<u8>, Vec<u8>)> {
        let mut head = [0u8; HEADER_LEN];
        self.reader.read_exact(&mut head).ok()?;
        let limits = FrameLimits {
            max_meta: u32::MAX,
            max_payload: u64::MAX,
        };
        let h = FrameHeader::decode(&head, limits).unwrap();
        let mut meta = vec![0u8; h.meta_len as usize];
        self.reader.read_exact(&mut meta).ok()?;
        let mut payload = vec![0u8; h.payload_len as usize];
        self.reader.read_exact(&mut payload).ok()?;
        Some((h, meta, payload))
    }

    /// Sends HELLO; returns the answer frame.
    pub fn hello(&mut self, version: u32, fingerprint: &str) -> Option<(FrameHeader, Vec<u8>)> {
        let hello = Hello {
            version,
            fingerprint: fingerprint.to_owned(),
        };
        self.send(Command::Hello, 0, &encode_meta(&hello).unwrap(), &[]);
        self.recv().map(|(h, m, _)| (h, m))
    }

    /// A full handshake as a client with `token`; returns the WELCOME or the refusal. Panics
    /// when the token is refused (use [`Raw::connect`] for that).
    pub fn handshake(addr: SocketAddr, token: &[u8]) -> (Raw, Result<Welcome, ErrorReply>) {
        Raw::handshake_as(addr, token, Role::Client)
    }

    /// As [`Raw::handshake`], in `role`.
    pub fn handshake_as(
        addr: SocketAddr,
        token: &[u8],
        role: Role,
    ) -> (Raw, Result<Welcome, ErrorReply>) {
        let mut raw = Raw::connect(addr, token, role).expect("the token is accepted");
        let fp = ferrograph::dynload::abi_fingerprint();
        let (h, m) = raw.hello(PROTOCOL_VERSION, fp).expect("an answer to HELLO");
        let result = if h.command == Command::Welcome {
            Ok(decode_meta(&m).unwrap())
        } else {
            Err(decode_meta(&m).unwrap())
        };
        (raw, result)
    }

    /// Sends a request and waits for its answer (heartbeat answers skipped).
    pub fn request(
        &mut self,
        id: u64,
        request: &Request,
        payload: &[u8],
    ) -> Option<(Command, Vec<u8>, Vec<u8>)> {
        self.send_request(id, request, payload);
        loop {
            let (h, m, p) = self.recv()?;
            if h.command != Command::Pong {
                assert_eq!(h.request_id, id);
                return Some((h.command, m, p));
            }
        }
    }
}

/// The message of an ERROR frame's metadata.
pub fn error_message(meta: &[u8]) -> String {
    decode_meta::<ErrorReply>(meta).unwrap().message
}
