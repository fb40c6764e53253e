//! Forwards Rust `log` records to Python's `logging`.
//!
//! A record with target `ferrograph::cpu::compute` goes to the logger
//! `ferrograph.cpu.compute`. Each record attaches to the interpreter for the duration of one
//! `Logger.log` call, so:
//!
//! - long Rust work must run with the interpreter released (`py.detach`), otherwise a worker
//!   thread that logs would wait for the interpreter held by the caller waiting for that worker;
//!   every binding that runs long work releases it;
//! - hot loops must not log (each record costs an attach and a Python call);
//! - records logged while the interpreter is finalizing, or from inside a logging call on the
//!   same thread, are dropped instead of blocking;
//! - records logged while the thread holds a core lock (a scheduler or allocator working for
//!   Python, see `lock.rs`) are queued, never forwarded on the spot: forwarding attaches to the
//!   interpreter, and a thread holding the interpreter may be about to ask for that lock. The
//!   queue is forwarded when the lock is released (and by the next record logged from a
//!   lock-free point); at most [`QUEUE_LIMIT`] records wait, later ones are counted and
//!   reported as dropped.
//!
//! Beside `logging`, a callable installed with `set_log_callback(fn)` receives every forwarded
//! record as `fn(level, text)` (ggml's `log_set`), under the same rules: it runs only where the
//! thread holds no core lock, and an exception it raises goes to `sys.unraisablehook` (the
//! record cannot be un-logged, and the code that logged it is not the callback's caller).
//!
//! The maximum level forwarded is `DEBUG` by default; `_core.set_log_level("trace")` changes
//! it (Python's logger levels filter further).

use std::cell::Cell;
use std::collections::VecDeque;
use std::sync::Mutex;

use log::{Level, LevelFilter, Log, Metadata, Record};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::PyModule;

struct PythonLogger;

static LOGGER: PythonLogger = PythonLogger;
static LOGGING: PyOnceLock<Py<PyModule>> = PyOnceLock::new();

/// A record waiting to be forwarded.
struct Queued {
    target: String,
    level: Level,
    message: String,
}

/// The callable installed with `set_log_callback`, if any.
static CALLBACK: Mutex<Option<Py<PyAny>>> = Mutex::new(None);

/// Most records that wait in the queue.
const QUEUE_LIMIT: usize = 10_000;

/// Records logged under a core lock, and how many were dropped because the queue was full.
static QUEUE: Mutex<(VecDeque<Queued>, usize)> = Mutex::new((VecDeque::new(), 0));

thread_local! {
    /// Set while this thread is inside a forwarded `logging` call (re-entrancy guard).
    static IN_LOG: Cell<bool> = const { Cell::new(false) };
}

/// The Python logger name for a Rust log target.
///
/// The workspace's crates log under their own names (`ferrograph_base::sched`,
/// `ferrograph_cpu::compute`); Python sees the public module paths (`ferrograph.sched`,
/// `ferrograph.cpu.compute`), as `ferrograph::` re-exports them.
pub(crate) fn logger_name(target: &str) -> String {
    let public = [
        ("ferrograph_base::", "ferrograph::"),
        ("ferrograph_cpu::", "ferrograph::cpu::"),
        ("ferrograph_backends::", "ferrograph::"),
        // The bindings' own crate (`_core`): `ferrograph.python.*`, as before the split.
        ("_core::", "ferrograph::python::"),
    ]
    .iter()
    .find_map(|(krate, path)| {
        target
            .strip_prefix(krate)
            .map(|rest| format!("{path}{rest}"))
    });
    let dotted = public.as_deref().unwrap_or(target).replace("::", ".");
    if dotted == "ferrograph" || dotted.starts_with("ferrograph.") {
        dotted
    } else {
        format!("ferrograph.{dotted}")
    }
}

fn python_level(level: Level) -> i32 {
    match level {
        Level::Error => 40,
        Level::Warn => 30,
        Level::Info => 20,
        Level::Debug => 10,
        Level::Trace => 5,
    }
}

/// Calls the `set_log_callback` callable (if any) with `(level, message)`; an exception it
/// raises is reported through `sys.unraisablehook`.
fn call_log_callback(py: Python<'_>, level: i32, message: &str) {
    // Cloned and released before the call: the callable may install another one.
    let callback = CALLBACK
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .as_ref()
        .map(|cb| cb.clone_ref(py));
    if let Some(callback) = callback {
        let _scope = super::lock::CallbackScope::enter();
        if let Err(err) = callback.call1(py, (level, message)) {
            err.write_unraisable(py, Some(callback.bind(py)));
        }
    }
}

fn forward(py: Python<'_>, target: &str, level: Level, message: &str) -> PyResult<()> {
    call_log_callback(py, python_level(level), message);
    let logging = LOGGING.get_or_try_init(py, || py.import("logging").map(Bound::unbind))?;
    let logger = logging
        .bind(py)
        .call_method1("getLogger", (logger_name(target),))?;
    let level = python_level(level);
    if logger
        .call_method1("isEnabledFor", (level,))?
        .extract::<bool>()?
    {
        // Handlers are Python code: they run as a callback (see `lock.rs`).
        let _scope = super::lock::CallbackScope::enter();
        logger.call_method1("log", (level, "%s", message))?;
    }
    Ok(())
}

fn queue_lock() -> std::sync::MutexGuard<'static, (VecDeque<Queued>, usize)> {
    QUEUE.lock().unwrap_or_else(|p| p.into_inner())
}

/// Forwards the records queued while core locks were held. Call it only where this thread
/// holds no core lock (it runs Python logging handlers).
pub(crate) fn flush_queued(py: Python<'_>) {
    if super::lock::holds_core_lock() || IN_LOG.with(Cell::get) {
        return;
    }
    IN_LOG.with(|flag| flag.set(true));
    loop {
        // One record at a time: the queue's lock is never held while Python runs.
        let next = {
            let mut queue = queue_lock();
            match queue.0.pop_front() {
                Some(record) => Some(record),
                None if queue.1 > 0 => {
                    let dropped = std::mem::take(&mut queue.1);
                    Some(Queued {
                        target: "ferrograph".into(),
                        level: Level::Warn,
                        message: format!("{dropped} log records were dropped (queue full)"),
                    })
                }
                None => None,
            }
        };
        let Some(record) = next else { break };
        if let Err(err) = forward(py, &record.target, record.level, &record.message) {
            err.print(py);
        }
    }
    IN_LOG.with(|flag| flag.set(false));
}

fn enqueue(record: &Record<'_>) {
    let mut queue = queue_lock();
    if queue.0.len() >= QUEUE_LIMIT {
        queue.1 += 1;
    } else {
        queue.0.push_back(Queued {
            target: record.target().to_owned(),
            level: record.level(),
            message: record.args().to_string(),
        });
    }
}

impl Log for PythonLogger {
    fn enabled(&self, metadata: &Metadata<'_>) -> bool {
        metadata.level() <= log::max_level()
    }

    fn log(&self, record: &Record<'_>) {
        if !self.enabled(record.metadata()) || IN_LOG.with(Cell::get) {
            return;
        }
        if super::lock::holds_core_lock() {
            enqueue(record);
            return;
        }
        // `try_attach` returns None while the interpreter is finalizing; never panic here.
        let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            Python::try_attach(|py| {
                flush_queued(py);
                IN_LOG.with(|flag| flag.set(true));
                let message = record.args().to_string();
                if let Err(err) = forward(py, record.target(), record.level(), &message) {
                    // A failing handler must not turn into an exception elsewhere.
                    err.print(py);
                }
                IN_LOG.with(|flag| flag.set(false));
            })
        }));
    }

    fn flush(&self) {}
}

/// Installs the forwarding logger (once per process; a no-op if another logger is set).
pub(crate) fn install() {
    if log::set_logger(&LOGGER).is_ok() {
        log::set_max_level(LevelFilter::Debug);
    }
}

/// Sets the most verbose Rust level forwarded: "off", "error", "warn", "info", "debug",
/// "trace".
#[pyfunction]
fn set_log_level(level: &str) -> PyResult<()> {
    let filter = match level.to_ascii_lowercase().as_str() {
        "off" => LevelFilter::Off,
        "error" => LevelFilter::Error,
        "warn" | "warning" => LevelFilter::Warn,
        "info" => LevelFilter::Info,
        "debug" => LevelFilter::Debug,
        "trace" => LevelFilter::Trace,
        other => {
            return Err(super::errors::invalid(format!(
                "unknown log level {other:?}; expected off, error, warn, info, debug or trace"
            )))
        }
    };
    log::set_max_level(filter);
    Ok(())
}

/// Installs (or with None removes) a callable that receives every forwarded record as
/// `fn(level, text)`, `level` being the `logging` level number (10 debug ... 40 error, 5 trace),
/// beside the `logging` loggers. It is never called while ferrograph holds a lock; an exception
/// it raises is reported through `sys.unraisablehook`. Anything but a callable or None is an
/// ArgumentTypeError.
#[pyfunction]
fn set_log_callback(py: Python<'_>, callback: Option<Py<PyAny>>) -> PyResult<()> {
    if let Some(cb) = &callback {
        super::utils::check_callable(cb.bind(py), "set_log_callback")?;
    }
    let previous = std::mem::replace(
        &mut *CALLBACK.lock().unwrap_or_else(|p| p.into_inner()),
        callback,
    );
    // Dropped after the lock is released: dropping a Python object may run Python code.
    drop(previous);
    Ok(())
}

/// Emits one Rust log record (`target` like `"ferrograph::cpu::compute"`), for tests and for
/// checking a logging setup. The interpreter is released while the record is logged, as it is
/// during real work.
#[pyfunction(name = "log")]
fn log_for_test(py: Python<'_>, target: &str, level: &str, message: &str) -> PyResult<()> {
    let level = match level.to_ascii_lowercase().as_str() {
        "error" => Level::Error,
        "warn" | "warning" => Level::Warn,
        "info" => Level::Info,
        "debug" => Level::Debug,
        "trace" => Level::Trace,
        other => return Err(super::errors::invalid(format!("unknown level {other:?}"))),
    };
    let (target, message) = (target.to_owned(), message.to_owned());
    py.detach(move || log::log!(target: &target, level, "{message}"));
    flush_queued(py);
    Ok(())
}

/// Registers the logging functions.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(set_log_level, m)?)?;
    m.add_function(wrap_pyfunction!(set_log_callback, m)?)?;
    Ok(())
}

/// Registers the test hook `log` in `ferrograph._core._testing`.
pub(crate) fn register_testing(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(log_for_test, m)?)?;
    Ok(())
}
