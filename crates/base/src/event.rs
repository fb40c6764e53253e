//! Events: markers a backend records in its stream, that the host or another backend waits on.
//!
//! Devices without events make the same calls fall back to synchronising the backend, so
//! callers (the scheduler) can be written once: see [`record_or_sync`] and [`wait_or_sync`].

use std::sync::{Arc, Condvar, Mutex};

use crate::backend::Backend;
use crate::error::Result;

/// A synchronisation marker of a device.
pub trait Event: Send + Sync {
    /// Marks the current end of `backend`'s queued work.
    fn record(&self, backend: &dyn Backend) -> Result<()>;
    /// Blocks the host until the recorded work is done.
    fn synchronize(&self) -> Result<()>;
    /// Makes `backend` wait (without blocking the host where possible) for the recorded work.
    fn wait(&self, backend: &dyn Backend) -> Result<()>;
}

/// An event for backends whose work is done when their calls return, or that can signal
/// completion from a worker thread: `record` clears the flag and `signal` (or a synchronous
/// record) sets it.
#[derive(Default)]
pub struct HostEvent {
    done: Mutex<bool>,
    changed: Condvar,
}

impl HostEvent {
    /// A new, signalled event.
    pub fn new() -> Arc<HostEvent> {
        Arc::new(HostEvent {
            done: Mutex::new(true),
            changed: Condvar::new(),
        })
    }

    /// Marks the recorded work as finished and wakes waiters.
    pub fn signal(&self) {
        let mut done = self.done.lock().unwrap_or_else(|p| p.into_inner());
        *done = true;
        self.changed.notify_all();
    }

    /// Whether the recorded work is finished.
    pub fn is_done(&self) -> bool {
        *self.done.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl Event for HostEvent {
    fn record(&self, backend: &dyn Backend) -> Result<()> {
        *self.done.lock().unwrap_or_else(|p| p.into_inner()) = false;
        // A host backend's queued work completes at synchronize.
        let result = backend.synchronize();
        self.signal();
        result
    }

    fn synchronize(&self) -> Result<()> {
        let mut done = self.done.lock().unwrap_or_else(|p| p.into_inner());
        while !*done {
            done = self.changed.wait(done).unwrap_or_else(|p| p.into_inner());
        }
        Ok(())
    }

    fn wait(&self, _backend: &dyn Backend) -> Result<()> {
        self.synchronize()
    }
}

/// Records `event` on `backend`, or synchronises the backend when there is no event.
pub fn record_or_sync(event: Option<&Arc<dyn Event>>, backend: &dyn Backend) -> Result<()> {
    match event {
        Some(event) => event.record(backend),
        None => backend.synchronize(),
    }
}

/// Makes `backend` wait for `event`, or synchronises `producer` when there is no event.
pub fn wait_or_sync(
    event: Option<&Arc<dyn Event>>,
    backend: &dyn Backend,
    producer: &dyn Backend,
) -> Result<()> {
    match event {
        Some(event) => event.wait(backend),
        None => producer.synchronize(),
    }
}
