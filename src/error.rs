//! The crate's error type and the compute status.
//!
//! Every fallible operation returns [`Result`]. Each [`Error`] variant maps to one Python
//! exception class (see `python/ferrograph/errors.py`), so a caller can catch exactly the
//! failures it expects.

use std::fmt;

/// Result alias used throughout the crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in ferrograph.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum Error {
    /// Shapes do not fit together (an op's operands, a view, a copy, a numpy array).
    #[error("shape error: {0}")]
    Shape(String),
    /// An element type that an operation does not accept.
    #[error("dtype error: {0}")]
    DType(String),
    /// Memory could not be provided: a buffer too small, a size above a maximum, a failed
    /// allocation.
    #[error("allocation error: {0}")]
    Alloc(String),
    /// An op (or op/dtype combination) that a device or kernel does not implement.
    #[error("unsupported op: {0}")]
    UnsupportedOp(String),
    /// A backend, device or registry failure (unknown name, failed library load, ...).
    #[error("backend error: {0}")]
    Backend(String),
    /// A read or write outside the bounds of a tensor or buffer.
    #[error("out of bounds: {0}")]
    OutOfBounds(String),
    /// A tensor whose memory was released (buffer freed or reset, allocator reset).
    #[error("stale tensor: {0}")]
    Stale(String),
    /// A tensor that has no memory yet.
    #[error("tensor not allocated: {0}")]
    NotAllocated(String),
    /// A computation that an abort callback (or evaluation callback) stopped.
    #[error("computation aborted")]
    Aborted,
    /// An argument outside its allowed range that is none of the above.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// An argument of the wrong kind (a number where a callable is needed, a string where a
    /// shape is needed, ...); Python raises it as a `TypeError`.
    #[error("{0}")]
    ArgumentType(String),
    /// The object is in use by the current computation: a callback of that computation (or
    /// another callback) asked it for something it cannot give until the computation ends.
    #[error("busy: {0}")]
    Busy(String),
    /// A remote device whose server died, hung past its deadline or closed the connection;
    /// its buffers and queued work are gone (rebuild the scheduler without it).
    #[error("device lost: {0}")]
    DeviceLost(String),
}

impl Error {
    /// The [`Status`] a compute call reports for this error.
    pub fn status(&self) -> Status {
        match self {
            Error::Alloc(_) => Status::AllocFailed,
            Error::Aborted => Status::Aborted,
            _ => Status::Failed,
        }
    }
}

/// Builds an [`Error::Shape`] from format arguments.
#[macro_export]
macro_rules! shape_err {
    ($($arg:tt)*) => { $crate::error::Error::Shape(format!($($arg)*)) };
}

/// Builds an [`Error::DType`] from format arguments.
#[macro_export]
macro_rules! dtype_err {
    ($($arg:tt)*) => { $crate::error::Error::DType(format!($($arg)*)) };
}

/// Outcome of a graph computation, as ggml's `ggml_status`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Status {
    /// Memory for the computation could not be allocated.
    AllocFailed,
    /// The computation failed.
    Failed,
    /// The computation finished.
    Success,
    /// An abort callback stopped the computation.
    Aborted,
}

impl Status {
    /// ggml's numeric code for this status (`-2`, `-1`, `0`, `1`).
    pub fn code(self) -> i32 {
        match self {
            Status::AllocFailed => -2,
            Status::Failed => -1,
            Status::Success => 0,
            Status::Aborted => 1,
        }
    }

    /// A short human-readable description (the counterpart of ggml's status-to-string).
    pub fn as_str(self) -> &'static str {
        match self {
            Status::AllocFailed => "failed: memory could not be allocated",
            Status::Failed => "failed: the computation reported an error",
            Status::Success => "success",
            Status::Aborted => "aborted: an abort callback stopped the computation",
        }
    }
}

impl Status {
    /// The status with ggml's numeric `code`, if there is one.
    pub fn from_code(code: i32) -> Option<Status> {
        [
            Status::Success,
            Status::Aborted,
            Status::Failed,
            Status::AllocFailed,
        ]
        .into_iter()
        .find(|s| s.code() == code)
    }
}

/// The text of a numeric status code, `"unknown status"` for a code that is none of ggml's
/// (as ggml's `status_to_string`).
pub fn status_to_string(code: i32) -> &'static str {
    Status::from_code(code).map_or("unknown status", Status::as_str)
}

impl fmt::Display for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_codes_follow_ggml() {
        assert_eq!(Status::Success.code(), 0);
        assert_eq!(Status::Aborted.code(), 1);
        assert_eq!(Error::Aborted.status(), Status::Aborted);
        assert_eq!(Error::Alloc("x".into()).status(), Status::AllocFailed);
        assert_eq!(shape_err!("a {}", 1), Error::Shape("a 1".into()));
        assert_eq!(status_to_string(-2), Status::AllocFailed.as_str());
        assert_eq!(status_to_string(7), "unknown status");
        assert_eq!(status_to_string(i32::MIN), "unknown status");
    }
}
