//! Remote devices: a device server ([`server`]) that exposes this machine's host devices over
//! TCP, and a client ([`client`]) that makes each server device a [`crate::device::Device`]
//! the scheduler drives like any other.
//!
//! * [`secure`]: the Noise handshake (token as pre-shared key, mutual authentication bound to
//!   the session keys) and the encrypted records every frame travels in.
//! * [`protocol`]: frames (fixed header, postcard metadata, raw tensor bytes), requests and
//!   replies.
//! * [`wire`]: graphs and tensors on the wire, and the server's validator that rebuilds them
//!   with the crate's op builders.
//! * [`server`]: sessions, limits, heartbeats, graph caching.
//! * [`weight_cache`]: uploads kept by content hash across sessions.
//! * [`connection`]: the client's connection (request ids, fences, heartbeat, loss detection).
//! * [`client`]: registration, devices, buffer types, buffers, backends and events.

pub mod client;
pub mod connection;
pub mod protocol;
pub mod secure;
pub mod server;
pub mod weight_cache;
pub mod wire;

pub use client::{connect, RemoteBackend, RemoteDevice, RemoteRegistration};
pub use connection::ClientSettings;
pub use server::{Server, ServerConfig};
