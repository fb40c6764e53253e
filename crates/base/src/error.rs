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
    /// An element type that an operation does not accept.
    #[error("dtype error: {0}")]
    DType(String),
    /// A backend, device or registry failure (unknown name, failed library load, ...).
    #[error("backend error: {0}")]
    Backend(String),
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

    // The variants below carry the facts of the failure where the code that fails knows them
    // (None or empty where it does not). Build them with [`Error::alloc_failed`],
    // [`Error::op_unsupported`], [`Error::out_of_range`] and [`Error::shapes_mismatch`], or
    // with only a message: [`Error::alloc`], [`Error::unsupported`], [`Error::out_of_bounds`],
    // [`Error::shape`].
    /// Memory could not be provided: a buffer too small, a size above a maximum, a failed
    /// allocation ([`ErrorKind::Alloc`]).
    #[error("allocation error: {message}")]
    AllocFailed {
        /// What failed, in words.
        message: String,
        /// Bytes asked for, where known.
        requested: Option<usize>,
        /// The most the buffer type (or buffer) can give, where known.
        limit: Option<usize>,
        /// The buffer type's name, where known.
        buffer_type: Option<String>,
    },
    /// An op (or op/dtype combination) that a device or kernel does not run
    /// ([`ErrorKind::UnsupportedOp`]).
    #[error("unsupported op: {message}")]
    OpUnsupported {
        /// What failed, in words.
        message: String,
        /// The op's name (`"MUL_MAT"`), where known.
        op: Option<String>,
        /// The dtypes of the result and its operands, in that order.
        dtypes: Vec<String>,
        /// The backend or device that refused it, where one did.
        backend: Option<String>,
    },
    /// A read or write outside the bounds of a tensor or buffer ([`ErrorKind::OutOfBounds`]).
    #[error("out of bounds: {message}")]
    OutOfRange {
        /// What failed, in words.
        message: String,
        /// Start of the range, where known.
        offset: Option<usize>,
        /// Its length in bytes, where known.
        size: Option<usize>,
        /// The size in bytes of what it must fit in, where known.
        limit: Option<usize>,
    },
    /// Shapes that do not fit together: an op's operands, a view, a copy, a numpy array
    /// ([`ErrorKind::Shape`]).
    #[error("shape error: {message}")]
    ShapeMismatch {
        /// What failed, in words.
        message: String,
        /// The operands' names (empty for unnamed tensors), in operand order; no names when
        /// the failure is not about operands.
        names: Vec<String>,
        /// Their shapes (numpy order), in the same order.
        shapes: Vec<Vec<usize>>,
    },
    /// A GGUF file that cannot be read (malformed, truncated, hostile, an unsupported version)
    /// or a writer's input that would not make a valid file ([`ErrorKind::Gguf`]). Build it
    /// with [`Error::gguf`]: the message names the file, the field and the byte offset.
    #[error("GGUF error: {message}")]
    Gguf {
        /// What failed, in words, with the file, field and offset.
        message: String,
        /// The file (as given to the reader or writer).
        path: String,
        /// The field of the format that is wrong (`"header.version"`,
        /// `"tensor 'w'.dims[1]"`, ...).
        field: String,
        /// The byte offset of that field in the file, where there is one.
        offset: Option<u64>,
    },
}

/// The kind of an [`Error`]: one per Python exception class. A failure with facts has the
/// kind of its message-only counterpart (`AllocFailed` is [`ErrorKind::Alloc`], ...).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum ErrorKind {
    /// [`Error::Shape`] and [`Error::ShapeMismatch`].
    Shape,
    /// [`Error::DType`].
    DType,
    /// [`Error::Alloc`] and [`Error::AllocFailed`].
    Alloc,
    /// [`Error::UnsupportedOp`] and [`Error::OpUnsupported`].
    UnsupportedOp,
    /// [`Error::Backend`].
    Backend,
    /// [`Error::OutOfBounds`] and [`Error::OutOfRange`].
    OutOfBounds,
    /// [`Error::Stale`].
    Stale,
    /// [`Error::NotAllocated`].
    NotAllocated,
    /// [`Error::Aborted`].
    Aborted,
    /// [`Error::InvalidArgument`].
    InvalidArgument,
    /// [`Error::ArgumentType`].
    ArgumentType,
    /// [`Error::Busy`].
    Busy,
    /// [`Error::DeviceLost`].
    DeviceLost,
    /// [`Error::Gguf`].
    Gguf,
}

impl ErrorKind {
    /// Every kind in declaration order. A kind's position here is its stable number, which the
    /// Python exception table and the remote wire format share.
    pub const ALL: [ErrorKind; 14] = [
        ErrorKind::Shape,
        ErrorKind::DType,
        ErrorKind::Alloc,
        ErrorKind::UnsupportedOp,
        ErrorKind::Backend,
        ErrorKind::OutOfBounds,
        ErrorKind::Stale,
        ErrorKind::NotAllocated,
        ErrorKind::Aborted,
        ErrorKind::InvalidArgument,
        ErrorKind::ArgumentType,
        ErrorKind::Busy,
        ErrorKind::DeviceLost,
        ErrorKind::Gguf,
    ];

    /// This kind's position in [`ErrorKind::ALL`].
    pub fn number(self) -> u8 {
        self as u8
    }

    /// The kind at position `number` of [`ErrorKind::ALL`], if there is one.
    pub fn from_number(number: u8) -> Option<ErrorKind> {
        Self::ALL.get(usize::from(number)).copied()
    }
}

impl Error {
    /// A message-only error of `kind` (the facts of structured variants are not rebuilt).
    pub fn of_kind(kind: ErrorKind, message: String) -> Error {
        match kind {
            ErrorKind::Shape => Error::shape(message),
            ErrorKind::DType => Error::DType(message),
            ErrorKind::Alloc => Error::alloc(message),
            ErrorKind::UnsupportedOp => Error::unsupported(message),
            ErrorKind::Backend => Error::Backend(message),
            ErrorKind::OutOfBounds => Error::out_of_bounds(message),
            ErrorKind::Stale => Error::Stale(message),
            ErrorKind::NotAllocated => Error::NotAllocated(message),
            ErrorKind::Aborted => Error::Aborted,
            ErrorKind::InvalidArgument => Error::InvalidArgument(message),
            ErrorKind::ArgumentType => Error::ArgumentType(message),
            ErrorKind::Busy => Error::Busy(message),
            ErrorKind::DeviceLost => Error::DeviceLost(message),
            ErrorKind::Gguf => Error::Gguf {
                message,
                path: String::new(),
                field: String::new(),
                offset: None,
            },
        }
    }

    /// The [`Status`] a compute call reports for this error.
    pub fn status(&self) -> Status {
        match self.kind() {
            ErrorKind::Alloc => Status::AllocFailed,
            ErrorKind::Aborted => Status::Aborted,
            _ => Status::Failed,
        }
    }

    /// The error's kind (its Python class).
    pub fn kind(&self) -> ErrorKind {
        match self {
            Error::ShapeMismatch { .. } => ErrorKind::Shape,
            Error::DType(_) => ErrorKind::DType,
            Error::AllocFailed { .. } => ErrorKind::Alloc,
            Error::OpUnsupported { .. } => ErrorKind::UnsupportedOp,
            Error::Backend(_) => ErrorKind::Backend,
            Error::OutOfRange { .. } => ErrorKind::OutOfBounds,
            Error::Stale(_) => ErrorKind::Stale,
            Error::NotAllocated(_) => ErrorKind::NotAllocated,
            Error::Aborted => ErrorKind::Aborted,
            Error::InvalidArgument(_) => ErrorKind::InvalidArgument,
            Error::ArgumentType(_) => ErrorKind::ArgumentType,
            Error::Busy(_) => ErrorKind::Busy,
            Error::DeviceLost(_) => ErrorKind::DeviceLost,
            Error::Gguf { .. } => ErrorKind::Gguf,
        }
    }

    /// An allocation of `requested` bytes from `buffer_type` that failed; `limit` is the most
    /// it can give, where known.
    pub fn alloc_failed(
        message: impl Into<String>,
        requested: usize,
        limit: Option<usize>,
        buffer_type: impl Into<String>,
    ) -> Error {
        Error::AllocFailed {
            message: message.into(),
            requested: Some(requested),
            limit,
            buffer_type: Some(buffer_type.into()),
        }
    }

    /// Memory that could not be provided, with only a message.
    pub fn alloc(message: impl Into<String>) -> Error {
        Error::AllocFailed {
            message: message.into(),
            requested: None,
            limit: None,
            buffer_type: None,
        }
    }

    /// An op that is not run: `dtypes` are the result's then the operands', `backend` the
    /// backend or device that refused it.
    pub fn op_unsupported(
        message: impl Into<String>,
        op: impl Into<String>,
        dtypes: Vec<String>,
        backend: Option<String>,
    ) -> Error {
        Error::OpUnsupported {
            message: message.into(),
            op: Some(op.into()),
            dtypes,
            backend,
        }
    }

    /// An op (or op/dtype combination) that is not run, with only a message.
    pub fn unsupported(message: impl Into<String>) -> Error {
        Error::OpUnsupported {
            message: message.into(),
            op: None,
            dtypes: Vec::new(),
            backend: None,
        }
    }

    /// `size` bytes at `offset` that do not fit in `limit` bytes.
    pub fn out_of_range(
        message: impl Into<String>,
        offset: usize,
        size: usize,
        limit: usize,
    ) -> Error {
        Error::OutOfRange {
            message: message.into(),
            offset: Some(offset),
            size: Some(size),
            limit: Some(limit),
        }
    }

    /// A read or write out of bounds, with only a message.
    pub fn out_of_bounds(message: impl Into<String>) -> Error {
        Error::OutOfRange {
            message: message.into(),
            offset: None,
            size: None,
            limit: None,
        }
    }

    /// A GGUF failure in `path` at `field` (at byte `offset` of the file, where there is
    /// one): `problem` says what is wrong; the message reads `"{path}: {field} at byte
    /// {offset}: {problem}"`.
    pub fn gguf(
        path: impl Into<String>,
        field: impl Into<String>,
        offset: Option<u64>,
        problem: impl fmt::Display,
    ) -> Error {
        let (path, field) = (path.into(), field.into());
        let message = match offset {
            Some(at) => format!("{path}: {field} at byte {at}: {problem}"),
            None => format!("{path}: {field}: {problem}"),
        };
        Error::Gguf {
            message,
            path,
            field,
            offset,
        }
    }

    /// Operands (by name, in order) whose shapes (numpy order) do not fit together.
    pub fn shapes_mismatch(
        message: impl Into<String>,
        names: Vec<String>,
        shapes: Vec<Vec<usize>>,
    ) -> Error {
        Error::ShapeMismatch {
            message: message.into(),
            names,
            shapes,
        }
    }

    /// Shapes that do not fit together, with only a message.
    pub fn shape(message: impl Into<String>) -> Error {
        Error::ShapeMismatch {
            message: message.into(),
            names: Vec::new(),
            shapes: Vec::new(),
        }
    }
}

/// Builds a shape error ([`Error::shape`]) from format arguments.
#[macro_export]
macro_rules! shape_err {
    ($($arg:tt)*) => { $crate::error::Error::shape(format!($($arg)*)) };
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
    fn kinds_have_stable_numbers_and_round_trip() {
        for (i, kind) in ErrorKind::ALL.iter().enumerate() {
            assert_eq!(usize::from(kind.number()), i);
            assert_eq!(ErrorKind::from_number(kind.number()), Some(*kind));
            assert_eq!(Error::of_kind(*kind, "m".into()).kind(), *kind);
        }
        assert_eq!(ErrorKind::from_number(ErrorKind::ALL.len() as u8), None);
    }

    #[test]
    fn status_codes_follow_ggml() {
        assert_eq!(Status::Success.code(), 0);
        assert_eq!(Status::Aborted.code(), 1);
        assert_eq!(Error::Aborted.status(), Status::Aborted);
        assert_eq!(Error::alloc("x").status(), Status::AllocFailed);
        assert_eq!(shape_err!("a {}", 1), Error::shape("a 1"));
        assert_eq!(status_to_string(-2), Status::AllocFailed.as_str());
        assert_eq!(status_to_string(7), "unknown status");
        assert_eq!(status_to_string(i32::MIN), "unknown status");
    }
}

/// Errors as Python exceptions (feature `python`, which the bindings crate turns on).
///
/// The bindings return PyO3's `PyResult` and use `?` on this crate's [`Result`]s, which needs
/// `From<Error> for PyErr` — an impl only the crate defining [`Error`] may write. The exception
/// classes themselves (`fg.Error`'s hierarchy) are made by the bindings, which install the
/// conversion with [`set_converter`](python::set_converter) when their module loads.
#[cfg(feature = "python")]
pub mod python {
    use std::sync::OnceLock;

    use super::Error;

    static CONVERTER: OnceLock<fn(&Error) -> pyo3::PyErr> = OnceLock::new();

    /// Installs the conversion of errors into Python exceptions (the first call wins).
    pub fn set_converter(convert: fn(&Error) -> pyo3::PyErr) {
        let _ = CONVERTER.set(convert);
    }

    impl From<Error> for pyo3::PyErr {
        fn from(err: Error) -> pyo3::PyErr {
            match CONVERTER.get() {
                Some(convert) => convert(&err),
                // Only before the bindings have loaded, which is before any Python call.
                None => pyo3::exceptions::PyRuntimeError::new_err(err.to_string()),
            }
        }
    }
}
