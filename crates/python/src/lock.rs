//! The discipline between the interpreter lock and the core's locks.
//!
//! A Python object that wraps a core object behind a lock (the scheduler, the graph allocator,
//! a graph plan) holds it in a [`CoreLock`]. Two rules keep the interpreter and those locks
//! from waiting on each other:
//!
//! - the lock is only ever waited for, and held, with the interpreter released: a computation
//!   that holds it may need the interpreter (an eval callback, a custom op, a backend or buffer
//!   type written in Python, a log record), so a thread that held the interpreter while it
//!   waited would deadlock with it;
//! - a callback never waits for a busy lock. Re-entrant use (the computation's own callback
//!   asks the same object for something) and use from inside any other callback or from a
//!   compute worker thread while the lock is held elsewhere raise `BusyError` at once: the
//!   holder may be waiting for that very callback to return.
//!
//! [`CallbackScope`] marks the threads that are inside a callback; [`ErrorSlot`] carries a
//! Python exception raised by a callback out to the call that started the computation.

use std::cell::Cell;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, TryLockError};

use pyo3::prelude::*;

use ferrograph::error::Error;

thread_local! {
    /// How many Python callbacks called from Rust are active on this thread.
    static CALLBACK_DEPTH: Cell<usize> = const { Cell::new(0) };
    /// How many [`CoreLock`]s this thread holds (log records are queued meanwhile).
    static LOCKS_HELD: Cell<usize> = const { Cell::new(0) };
    /// A small number naming this thread (0 is nobody).
    static THREAD_TOKEN: u64 = next_token();
}

fn next_token() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

fn thread_token() -> u64 {
    THREAD_TOKEN.with(|t| *t)
}

/// Whether this thread holds a [`CoreLock`] (log records must not reach Python now).
pub(crate) fn holds_core_lock() -> bool {
    LOCKS_HELD.with(Cell::get) > 0
}

/// Whether this thread is inside a callback, or is a compute worker (which only runs Python
/// code as part of a computation that some other thread is waiting for).
fn must_not_wait() -> bool {
    CALLBACK_DEPTH.with(Cell::get) > 0 || ferrograph::pool::in_computation()
}

/// Marks the current thread as running a Python callback for as long as it lives.
pub(crate) struct CallbackScope(());

impl CallbackScope {
    /// Enters a callback.
    pub(crate) fn enter() -> CallbackScope {
        CALLBACK_DEPTH.with(|d| d.set(d.get() + 1));
        CallbackScope(())
    }
}

impl Drop for CallbackScope {
    fn drop(&mut self) {
        CALLBACK_DEPTH.with(|d| d.set(d.get().saturating_sub(1)));
    }
}

/// A core object behind a lock, used from Python under the rules of this module.
pub(crate) struct CoreLock<T> {
    inner: Mutex<T>,
    /// The thread holding the lock (0: none), to recognise re-entrant use.
    owner: AtomicU64,
    /// What the object is called in messages ("the Scheduler").
    what: &'static str,
}

/// Clears the owner and the held count when the locked section ends (also on unwinding).
struct Held<'a> {
    owner: &'a AtomicU64,
}

impl Drop for Held<'_> {
    fn drop(&mut self) {
        self.owner.store(0, Ordering::Release);
        LOCKS_HELD.with(|n| n.set(n.get().saturating_sub(1)));
    }
}

impl<T: Send> CoreLock<T> {
    /// Wraps `value`; `what` names it in `BusyError` messages.
    pub(crate) fn new(value: T, what: &'static str) -> Self {
        CoreLock {
            inner: Mutex::new(value),
            owner: AtomicU64::new(0),
            what,
        }
    }

    fn busy(&self, reentrant: bool) -> PyErr {
        let why = if reentrant {
            "its own computation is running on this thread (a callback of that computation \
             cannot use it)"
        } else {
            "another thread holds it, and a callback or compute worker must not wait for it \
             (the holder may be waiting for this callback)"
        };
        Error::Busy(format!(
            "{} is busy: {why}; use it after the call returns",
            self.what
        ))
        .into()
    }

    /// Runs `f` on the locked value with the interpreter released, then forwards log records
    /// queued meanwhile. Raises `BusyError` instead of waiting where waiting could deadlock.
    pub(crate) fn with<R: Send>(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&mut T) -> R + Send,
    ) -> PyResult<R> {
        if self.owner.load(Ordering::Acquire) == thread_token() {
            return Err(self.busy(true));
        }
        let result = py.detach(|| {
            let mut guard = if must_not_wait() {
                match self.inner.try_lock() {
                    Ok(guard) => guard,
                    Err(TryLockError::Poisoned(p)) => p.into_inner(),
                    Err(TryLockError::WouldBlock) => return Err(()),
                }
            } else {
                self.inner.lock().unwrap_or_else(|p| p.into_inner())
            };
            self.owner.store(thread_token(), Ordering::Release);
            LOCKS_HELD.with(|n| n.set(n.get() + 1));
            let _held = Held { owner: &self.owner };
            Ok(f(&mut guard))
        });
        super::log::flush_queued(py);
        result.map_err(|()| self.busy(false))
    }
}

impl<T: Send> CoreLock<T> {
    /// Runs `f`, a quick read that neither blocks nor calls Python nor logs, on the locked
    /// value: with the interpreter held when the lock is free at once, otherwise as
    /// [`CoreLock::with`]. Holding both is safe because `f` waits for nothing. Why: a Python
    /// thread polling a getter in a loop released and retook the interpreter on every call,
    /// and CPython lets the releasing thread take it straight back, so another thread needing
    /// the interpreter between its own calls (a worker reserving graphs) waited seconds; now
    /// the poller keeps it and hands it over at the interpreter's switch interval.
    pub(crate) fn peek<R: Send>(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&T) -> R + Send,
    ) -> PyResult<R> {
        if self.owner.load(Ordering::Acquire) == thread_token() {
            return Err(self.busy(true));
        }
        match self.inner.try_lock() {
            Ok(guard) => Ok(f(&guard)),
            Err(TryLockError::Poisoned(p)) => Ok(f(&p.into_inner())),
            Err(TryLockError::WouldBlock) => self.with(py, |value| f(value)),
        }
    }
}

/// Runs core work `f` with the interpreter released, marking this thread as holding core
/// locks for its duration: core code may hold its own internal locks (the backend loader's,
/// the registry's) while it logs, so its records are queued and forwarded once `f` returned.
pub(crate) fn detach_quiet<R: Send>(py: Python<'_>, f: impl FnOnce() -> R + Send) -> R {
    let result = py.detach(|| {
        LOCKS_HELD.with(|n| n.set(n.get() + 1));
        let _held = HeldCount;
        f()
    });
    super::log::flush_queued(py);
    result
}

/// Decrements the held count when a [`detach_quiet`] section ends (also on unwinding).
struct HeldCount;

impl Drop for HeldCount {
    fn drop(&mut self) {
        LOCKS_HELD.with(|n| n.set(n.get().saturating_sub(1)));
    }
}

/// One Python exception raised by a callback during a computation, kept for the call that
/// started it (the first one wins; later ones are usually consequences).
#[derive(Default)]
pub(crate) struct ErrorSlot(Mutex<Option<PyErr>>);

impl ErrorSlot {
    /// An empty slot (usable in statics).
    pub(crate) const fn new() -> Self {
        ErrorSlot(Mutex::new(None))
    }

    /// Keeps `err` unless an earlier one is kept.
    pub(crate) fn store(&self, err: PyErr) {
        let unused = {
            let mut slot = self.0.lock().unwrap_or_else(|p| p.into_inner());
            match *slot {
                None => {
                    *slot = Some(err);
                    None
                }
                Some(_) => Some(err),
            }
        };
        // Dropped after the lock is released: dropping an exception may run Python code.
        drop(unused);
    }

    /// Takes the kept exception, if any.
    pub(crate) fn take(&self) -> Option<PyErr> {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).take()
    }
}
