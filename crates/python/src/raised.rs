//! Python exceptions that cross the core on their way back to Python.
//!
//! A custom op or a Python plugin method runs deep inside core code (a compute, an
//! allocation, a scheduler pass) whose errors are plain [`ferrograph::Error`] values, possibly
//! made on a worker thread and wrapped into other messages on the way out. The exception is
//! kept here under a number that the error's message carries as a marker; when the error
//! becomes a Python exception ([`restore`], called by the `Error` → `PyErr` conversion) the
//! marker is removed from the message and the kept exception becomes its `__cause__`.
//!
//! The table is bounded: an error that never reaches Python (logged and dropped) lets its
//! exception be pushed out by later ones.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use pyo3::prelude::*;
use pyo3::types::{PyString, PyTuple};

/// Text before the number in a message's marker.
const MARK: &str = " [python exception #";

/// How many exceptions are kept at most.
const MAX_KEPT: usize = 64;

static KEPT: Mutex<VecDeque<(u64, PyErr)>> = Mutex::new(VecDeque::new());
static NEXT_ID: AtomicU64 = AtomicU64::new(1);

/// Keeps `err` and returns the marker to append to the message of the core error that
/// reports it.
pub(crate) fn keep(err: PyErr) -> String {
    let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
    let evicted = {
        let mut kept = KEPT.lock().unwrap_or_else(|p| p.into_inner());
        kept.push_back((id, err));
        if kept.len() > MAX_KEPT {
            kept.pop_front()
        } else {
            None
        }
    };
    // Dropped after the lock is released: dropping an exception may run Python code.
    drop(evicted);
    format!("{MARK}{id}]")
}

/// Removes every marker from `message`, returning the clean text and the first number.
fn split_markers(message: &str) -> (String, Option<u64>) {
    let mut clean = String::with_capacity(message.len());
    let mut first = None;
    let mut rest = message;
    while let Some(at) = rest.find(MARK) {
        let after = &rest[at + MARK.len()..];
        let digits = after.bytes().take_while(u8::is_ascii_digit).count();
        if digits == 0 || !after[digits..].starts_with(']') {
            clean.push_str(&rest[..at + MARK.len()]);
            rest = after;
            continue;
        }
        clean.push_str(&rest[..at]);
        if first.is_none() {
            first = after[..digits].parse().ok();
        }
        rest = &after[digits + 1..];
    }
    clean.push_str(rest);
    (clean, first)
}

fn take(id: u64) -> Option<PyErr> {
    let mut kept = KEPT.lock().unwrap_or_else(|p| p.into_inner());
    let at = kept.iter().position(|(k, _)| *k == id)?;
    kept.remove(at).map(|(_, err)| err)
}

/// Gives `exc` (a ferrograph exception made from a core error) the Python exception its
/// message marks as `__cause__`, and takes the marker out of its message.
pub(crate) fn restore(py: Python<'_>, exc: PyErr) -> PyErr {
    let value = exc.value(py);
    let Ok(args) = value.getattr("args") else {
        return exc;
    };
    let Ok(args) = args.cast_into::<PyTuple>() else {
        return exc;
    };
    let Some(message) = args
        .get_item(0)
        .ok()
        .and_then(|m| m.extract::<String>().ok())
    else {
        return exc;
    };
    if !message.contains(MARK) {
        return exc;
    }
    let (clean, id) = split_markers(&message);
    let mut new_args: Vec<Bound<'_, PyAny>> = vec![PyString::new(py, &clean).into_any()];
    new_args.extend(args.iter().skip(1));
    if let Ok(tuple) = PyTuple::new(py, new_args) {
        let _ = value.setattr("args", tuple);
    }
    if let Some(cause) = id.and_then(take) {
        exc.set_cause(py, Some(cause));
    }
    exc
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn markers_are_removed_and_the_first_number_found() {
        let text = format!("a{MARK}12] b{MARK}3]");
        assert_eq!(split_markers(&text), ("a b".to_owned(), Some(12)));
        let odd = format!("x{MARK}y]");
        assert_eq!(split_markers(&odd), (odd.clone(), None));
    }
}
