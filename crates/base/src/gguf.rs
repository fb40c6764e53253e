//! GGUF files, versions 2 and 3: reading (memory-mapped), binding the tensors to a device
//! without copying where the device can wrap host memory, and writing (version 3).
//!
//! # The format
//!
//! Everything is little-endian. A file is a header (the magic `"GGUF"`, a `u32` version, a
//! `u64` tensor count and a `u64` metadata count), the metadata as key/value pairs (a string
//! key, a `u32` value type, the value), the tensor infos (a string name, a `u32` dimension
//! count, that many `u64` dimensions in ggml's order, a `u32` ggml type id and a `u64` offset
//! into the data section), padding to the file's alignment, and the data section. Strings are
//! a `u64` byte length and UTF-8 bytes; arrays are a `u32` element type, a `u64` count and the
//! elements. The alignment is the `u32` metadata value `general.alignment`, 32 without it.
//! Version 1 (32-bit counts) is refused; version 3 differs from 2 only in allowing big-endian
//! files, which are refused too (their version reads as a huge number, and the message says
//! so).
//!
//! # Hostile input
//!
//! The reader treats the file as untrusted. Every count, length and dimension is checked
//! against the bytes that remain *before* anything is allocated or looped over: `n` items
//! whose smallest encoding takes `m` bytes need `n·m` bytes left, so memory and time stay
//! proportional to the file's size (metadata takes at most a few times its encoded size in
//! memory). Arrays nest at most [`MAX_ARRAY_NESTING`] deep. Dimension products use checked
//! arithmetic. Each failure is an [`Error::Gguf`] whose message names the file, the field and
//! its byte offset. The choices beyond ggml's own checks:
//!
//! * dimensions may be 0 (an empty tensor, as ggml allows) but must fit ggml's signed 64-bit
//!   element count; a tensor has 0 to 4 dimensions;
//! * tensors may come in any order and with gaps between them (ggml's reader insists on
//!   ggml's own packed order), but every tensor's data must lie inside the file, start at a
//!   multiple of the alignment, and not overlap another tensor's data;
//! * keys, tensor names and string values must be valid UTF-8, as the format says; a `bool`
//!   byte other than 0 reads as true (as ggml reads it);
//! * `general.alignment` must be a `u32`, a power of two, at most [`MAX_ALIGNMENT`] (1 MiB,
//!   ggml's bound too);
//! * ggml type ids that name no type (ggml's retired ones, such as q4_0_4_4, by name) are
//!   refused.
//!
//! # Binding without copying
//!
//! [`GgufFile::load`] gives every tensor of the file a place on a device. When the device can
//! wrap host memory (`DeviceCaps::buffer_from_host_ptr`, which the CPU and BLAS devices have)
//! and its buffer type is host memory, the file's data section is mapped once more, privately
//! and copy-on-write, and wrapped in one buffer: no byte is copied, the pages are shared with
//! the page cache (and every other process mapping the file) until a tensor is written to, and
//! a write changes only this process's copy, never the file. The copy-on-write mapping is what
//! makes the memory writable, which `buffer_from_host_ptr` requires. Other devices (remote
//! ones, Python plug-ins) get one buffer of their own type, and the tensors are copied in.

use std::collections::HashMap;
use std::fmt;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::alloc::dyn_alloc::align_up;
use crate::buffer::{Buffer, BufferType, BufferUsage};
use crate::context::Context;
use crate::device::Device;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::tensor::{Tensor, MAX_DIMS};

/// The four bytes every GGUF file starts with.
pub const GGUF_MAGIC: [u8; 4] = *b"GGUF";

/// The version [`write_gguf`] writes.
pub const GGUF_VERSION: u32 = 3;

/// The alignment of a file without `general.alignment`.
pub const DEFAULT_ALIGNMENT: usize = 32;

/// The largest alignment accepted (1 MiB, as ggml): a larger one would only pad.
pub const MAX_ALIGNMENT: usize = 1 << 20;

/// How deep arrays may nest: an array of arrays of arrays of arrays, no deeper.
pub const MAX_ARRAY_NESTING: usize = 4;

/// The metadata key holding the alignment.
pub const ALIGNMENT_KEY: &str = "general.alignment";

/// The address alignment every tensor must have for [`GgufFile::load`] to wrap the file in
/// place: enough for the natural alignment of every element type and for 256-bit loads. Files
/// with the default alignment (32) or a multiple of it always qualify.
pub const ZERO_COPY_ALIGNMENT: usize = 32;

/// Tensors of at most this many bytes that would stay in the file's map beside tensors copied
/// elsewhere are copied too ([`GgufFile::load_into_placed`]). Reading an in-place tensor maps
/// the page-cache folios around it (up to 2 MiB each side on kernels with large folios), which
/// can bring back the released pages of its copied neighbours: SmolLM2's norm vectors, read
/// every token, kept 25 MiB of its repacked matrices resident. Copying a tensor this small
/// costs no more memory than it could pin.
pub const SMALL_IN_PLACE_BYTES: usize = 4 << 20;

/// Bytes of the header: magic, version, tensor count, metadata count.
const HEADER_SIZE: usize = 24;

/// The smallest encoding of a tensor info: an empty name (8), no dimensions (4), the type (4)
/// and the offset (8).
const MIN_TENSOR_INFO_SIZE: usize = 24;

/// The smallest encoding of a key/value pair: an empty key (8), the type (4), a one-byte value.
const MIN_KV_SIZE: usize = 13;

/// The type of a metadata value, with the format's numbering.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GgufType {
    /// `u8` (0).
    U8,
    /// `i8` (1).
    I8,
    /// `u16` (2).
    U16,
    /// `i16` (3).
    I16,
    /// `u32` (4).
    U32,
    /// `i32` (5).
    I32,
    /// `f32` (6).
    F32,
    /// `bool`, one byte (7).
    Bool,
    /// A UTF-8 string (8).
    String,
    /// An array (9).
    Array,
    /// `u64` (10).
    U64,
    /// `i64` (11).
    I64,
    /// `f64` (12).
    F64,
}

impl GgufType {
    /// Every type, in the order of their ids (0 to 12).
    pub const ALL: [GgufType; 13] = [
        GgufType::U8,
        GgufType::I8,
        GgufType::U16,
        GgufType::I16,
        GgufType::U32,
        GgufType::I32,
        GgufType::F32,
        GgufType::Bool,
        GgufType::String,
        GgufType::Array,
        GgufType::U64,
        GgufType::I64,
        GgufType::F64,
    ];

    /// The id the format stores.
    pub fn id(self) -> u32 {
        self as u32
    }

    /// The type with the format's id `id`.
    pub fn from_id(id: u32) -> Option<GgufType> {
        Self::ALL.get(usize::try_from(id).ok()?).copied()
    }

    /// A short name: `"u8"`, `"i8"`, `"u16"`, `"i16"`, `"u32"`, `"i32"`, `"f32"`, `"bool"`,
    /// `"str"`, `"array"`, `"u64"`, `"i64"`, `"f64"`.
    pub fn name(self) -> &'static str {
        match self {
            GgufType::U8 => "u8",
            GgufType::I8 => "i8",
            GgufType::U16 => "u16",
            GgufType::I16 => "i16",
            GgufType::U32 => "u32",
            GgufType::I32 => "i32",
            GgufType::F32 => "f32",
            GgufType::Bool => "bool",
            GgufType::String => "str",
            GgufType::Array => "array",
            GgufType::U64 => "u64",
            GgufType::I64 => "i64",
            GgufType::F64 => "f64",
        }
    }

    /// The type named `name` (see [`GgufType::name`]; `"string"` is accepted for `"str"`).
    pub fn from_name(name: &str) -> Option<GgufType> {
        if name == "string" {
            return Some(GgufType::String);
        }
        Self::ALL.into_iter().find(|t| t.name() == name)
    }

    /// The fewest bytes a value of this type takes in a file (a string's length, an array's
    /// element type and count).
    pub fn min_encoded_size(self) -> usize {
        match self {
            GgufType::U8 | GgufType::I8 | GgufType::Bool => 1,
            GgufType::U16 | GgufType::I16 => 2,
            GgufType::U32 | GgufType::I32 | GgufType::F32 => 4,
            GgufType::U64 | GgufType::I64 | GgufType::F64 | GgufType::String => 8,
            GgufType::Array => 12,
        }
    }
}

impl fmt::Display for GgufType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum GgufValue {
    /// `u8`.
    U8(u8),
    /// `i8`.
    I8(i8),
    /// `u16`.
    U16(u16),
    /// `i16`.
    I16(i16),
    /// `u32`.
    U32(u32),
    /// `i32`.
    I32(i32),
    /// `f32`.
    F32(f32),
    /// `bool`.
    Bool(bool),
    /// A string.
    String(String),
    /// An array (of one element type).
    Array(GgufArray),
    /// `u64`.
    U64(u64),
    /// `i64`.
    I64(i64),
    /// `f64`.
    F64(f64),
}

/// An array value: its elements, all of one type (the elements of an array of arrays are
/// arrays, each with its own element type).
#[derive(Debug, Clone, PartialEq)]
pub enum GgufArray {
    /// `u8` elements.
    U8(Vec<u8>),
    /// `i8` elements.
    I8(Vec<i8>),
    /// `u16` elements.
    U16(Vec<u16>),
    /// `i16` elements.
    I16(Vec<i16>),
    /// `u32` elements.
    U32(Vec<u32>),
    /// `i32` elements.
    I32(Vec<i32>),
    /// `f32` elements.
    F32(Vec<f32>),
    /// `bool` elements.
    Bool(Vec<bool>),
    /// String elements.
    String(Vec<String>),
    /// Array elements.
    Array(Vec<GgufArray>),
    /// `u64` elements.
    U64(Vec<u64>),
    /// `i64` elements.
    I64(Vec<i64>),
    /// `f64` elements.
    F64(Vec<f64>),
}

impl GgufArray {
    /// The type of the elements.
    pub fn element_type(&self) -> GgufType {
        match self {
            GgufArray::U8(_) => GgufType::U8,
            GgufArray::I8(_) => GgufType::I8,
            GgufArray::U16(_) => GgufType::U16,
            GgufArray::I16(_) => GgufType::I16,
            GgufArray::U32(_) => GgufType::U32,
            GgufArray::I32(_) => GgufType::I32,
            GgufArray::F32(_) => GgufType::F32,
            GgufArray::Bool(_) => GgufType::Bool,
            GgufArray::String(_) => GgufType::String,
            GgufArray::Array(_) => GgufType::Array,
            GgufArray::U64(_) => GgufType::U64,
            GgufArray::I64(_) => GgufType::I64,
            GgufArray::F64(_) => GgufType::F64,
        }
    }

    /// The number of elements.
    pub fn len(&self) -> usize {
        match self {
            GgufArray::U8(v) => v.len(),
            GgufArray::I8(v) => v.len(),
            GgufArray::U16(v) => v.len(),
            GgufArray::I16(v) => v.len(),
            GgufArray::U32(v) => v.len(),
            GgufArray::I32(v) => v.len(),
            GgufArray::F32(v) => v.len(),
            GgufArray::Bool(v) => v.len(),
            GgufArray::String(v) => v.len(),
            GgufArray::Array(v) => v.len(),
            GgufArray::U64(v) => v.len(),
            GgufArray::I64(v) => v.len(),
            GgufArray::F64(v) => v.len(),
        }
    }

    /// Whether the array has no element.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// How deep arrays nest in this one: 1 for an array of scalars.
    pub fn depth(&self) -> usize {
        match self {
            GgufArray::Array(items) => 1 + items.iter().map(GgufArray::depth).max().unwrap_or(0),
            _ => 1,
        }
    }

    /// The elements as values (a copy).
    pub fn to_values(&self) -> Vec<GgufValue> {
        fn all<T: Clone>(v: &[T], f: impl Fn(T) -> GgufValue) -> Vec<GgufValue> {
            v.iter().cloned().map(f).collect()
        }
        match self {
            GgufArray::U8(v) => all(v, GgufValue::U8),
            GgufArray::I8(v) => all(v, GgufValue::I8),
            GgufArray::U16(v) => all(v, GgufValue::U16),
            GgufArray::I16(v) => all(v, GgufValue::I16),
            GgufArray::U32(v) => all(v, GgufValue::U32),
            GgufArray::I32(v) => all(v, GgufValue::I32),
            GgufArray::F32(v) => all(v, GgufValue::F32),
            GgufArray::Bool(v) => all(v, GgufValue::Bool),
            GgufArray::String(v) => all(v, GgufValue::String),
            GgufArray::Array(v) => all(v, GgufValue::Array),
            GgufArray::U64(v) => all(v, GgufValue::U64),
            GgufArray::I64(v) => all(v, GgufValue::I64),
            GgufArray::F64(v) => all(v, GgufValue::F64),
        }
    }
}

impl GgufValue {
    /// The value's type.
    pub fn value_type(&self) -> GgufType {
        match self {
            GgufValue::U8(_) => GgufType::U8,
            GgufValue::I8(_) => GgufType::I8,
            GgufValue::U16(_) => GgufType::U16,
            GgufValue::I16(_) => GgufType::I16,
            GgufValue::U32(_) => GgufType::U32,
            GgufValue::I32(_) => GgufType::I32,
            GgufValue::F32(_) => GgufType::F32,
            GgufValue::Bool(_) => GgufType::Bool,
            GgufValue::String(_) => GgufType::String,
            GgufValue::Array(_) => GgufType::Array,
            GgufValue::U64(_) => GgufType::U64,
            GgufValue::I64(_) => GgufType::I64,
            GgufValue::F64(_) => GgufType::F64,
        }
    }

    /// The type as written in messages: `"u32"`, `"array[str]"`, `"array[array[u8]]"`.
    pub fn type_label(&self) -> String {
        fn array_label(a: &GgufArray) -> String {
            match a {
                GgufArray::Array(items) => match items.first() {
                    Some(first) => format!("array[{}]", array_label(first)),
                    None => "array[array]".to_owned(),
                },
                other => format!("array[{}]", other.element_type()),
            }
        }
        match self {
            GgufValue::Array(a) => array_label(a),
            other => other.value_type().name().to_owned(),
        }
    }

    /// The string, if this is one.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            GgufValue::String(s) => Some(s),
            _ => None,
        }
    }

    /// The array, if this is one.
    pub fn as_array(&self) -> Option<&GgufArray> {
        match self {
            GgufValue::Array(a) => Some(a),
            _ => None,
        }
    }
}

/// Typed accessors: `as_u32` and the like give the value only if it has exactly that type.
macro_rules! scalar_accessors {
    ($($name:ident: $variant:ident => $t:ty),* $(,)?) => {
        impl GgufValue {
            $(
                #[doc = concat!("The value, if it is a `", stringify!($t), "`.")]
                pub fn $name(&self) -> Option<$t> {
                    match self {
                        GgufValue::$variant(v) => Some(*v),
                        _ => None,
                    }
                }
            )*
        }
    };
}

scalar_accessors!(
    as_u8: U8 => u8,
    as_i8: I8 => i8,
    as_u16: U16 => u16,
    as_i16: I16 => i16,
    as_u32: U32 => u32,
    as_i32: I32 => i32,
    as_f32: F32 => f32,
    as_bool: Bool => bool,
    as_u64: U64 => u64,
    as_i64: I64 => i64,
    as_f64: F64 => f64,
);

/// What the file says about one tensor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GgufTensorInfo {
    /// The tensor's name.
    pub name: String,
    /// Its element type.
    pub dtype: DType,
    /// Its dimensions in ggml's order (fastest first), padded with ones to four.
    pub ne: [usize; MAX_DIMS],
    /// How many dimensions the file gives (0 to 4).
    pub n_dims: usize,
    /// The offset of its data inside the data section.
    pub offset: usize,
    /// The offset of its data in the file.
    pub file_offset: usize,
    /// The size of its data in bytes.
    pub nbytes: usize,
}

impl GgufTensorInfo {
    /// The numpy-order shape (the file's `n_dims` dimensions, slowest first).
    pub fn shape(&self) -> Vec<usize> {
        self.ne[..self.n_dims].iter().rev().copied().collect()
    }

    /// The number of elements.
    pub fn nelements(&self) -> usize {
        self.ne.iter().product()
    }
}

/// The bytes a file was read from: a read-only memory map of an open file (kept open, so that
/// [`GgufFile::load`] maps the same file again rather than whatever the path names by then),
/// or bytes in memory.
enum Source {
    Map { map: memmap2::Mmap, file: File },
    Bytes(Vec<u8>),
}

impl Source {
    fn bytes(&self) -> &[u8] {
        match self {
            Source::Map { map, .. } => map,
            Source::Bytes(bytes) => bytes,
        }
    }
}

/// A parsed GGUF file: its metadata and tensor infos, with the bytes mapped (not read) from
/// disk. Cheap to share behind an `Arc`; every accessor borrows.
pub struct GgufFile {
    path: String,
    source: Source,
    version: u32,
    alignment: usize,
    data_offset: usize,
    metadata: Vec<(String, GgufValue)>,
    keys: HashMap<String, usize>,
    tensors: Vec<GgufTensorInfo>,
    names: HashMap<String, usize>,
}

impl fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "GgufFile(path={:?}, version={}, alignment={}, metadata={}, tensors={}, data at {})",
            self.path,
            self.version,
            self.alignment,
            self.metadata.len(),
            self.tensors.len(),
            self.data_offset
        )
    }
}

/// A byte reader over the file that checks every read against what remains.
struct Reader<'a> {
    bytes: &'a [u8],
    pos: usize,
    path: &'a str,
}

impl<'a> Reader<'a> {
    fn remaining(&self) -> usize {
        self.bytes.len() - self.pos
    }

    fn error(&self, field: impl Into<String>, at: usize, problem: impl fmt::Display) -> Error {
        Error::gguf(self.path, field, Some(at as u64), problem)
    }

    /// The next `n` bytes.
    fn take(&mut self, n: usize, field: &dyn Fn() -> String) -> Result<&'a [u8]> {
        if n > self.remaining() {
            return Err(self.error(
                field(),
                self.pos,
                format!(
                    "needs {n} bytes but the file ends {} bytes later (truncated?)",
                    self.remaining()
                ),
            ));
        }
        let bytes = &self.bytes[self.pos..self.pos + n];
        self.pos += n;
        Ok(bytes)
    }

    fn array<const N: usize>(&mut self, field: &dyn Fn() -> String) -> Result<[u8; N]> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N, field)?);
        Ok(out)
    }

    fn u32(&mut self, field: &dyn Fn() -> String) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array(field)?))
    }

    fn u64(&mut self, field: &dyn Fn() -> String) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array(field)?))
    }

    /// A `u64` count of items that each take at least `per_item` bytes, checked against the
    /// bytes that remain after it.
    fn count(&mut self, field: &dyn Fn() -> String, per_item: usize, what: &str) -> Result<usize> {
        let at = self.pos;
        let n = self.u64(field)?;
        let remaining = self.remaining();
        usize::try_from(n)
            .ok()
            .filter(|&n| n.checked_mul(per_item).is_some_and(|b| b <= remaining))
            .ok_or_else(|| {
                self.error(
                    field(),
                    at,
                    format!(
                        "{n} {what} need at least {per_item} byte{} each, but only {remaining} \
                         bytes follow",
                        if per_item == 1 { "" } else { "s" }
                    ),
                )
            })
    }

    /// A length-prefixed UTF-8 string.
    fn string(&mut self, field: &dyn Fn() -> String) -> Result<String> {
        let length_field = || format!("{} (string length)", field());
        let len = self.count(&length_field, 1, "bytes")?;
        let at = self.pos;
        let raw = self.take(len, field)?;
        match std::str::from_utf8(raw) {
            Ok(s) => Ok(s.to_owned()),
            Err(e) => Err(self.error(
                field(),
                at + e.valid_up_to(),
                format!(
                    "is not valid UTF-8 (byte {} of the {len}-byte string)",
                    e.valid_up_to()
                ),
            )),
        }
    }

    /// A value type id.
    fn value_type(&mut self, field: &dyn Fn() -> String) -> Result<GgufType> {
        let at = self.pos;
        let id = self.u32(field)?;
        GgufType::from_id(id).ok_or_else(|| {
            self.error(
                field(),
                at,
                format!("unknown value type {id} (the format has types 0 to 12)"),
            )
        })
    }

    /// A value of type `ty`; `depth` is how many arrays enclose it.
    fn value(
        &mut self,
        ty: GgufType,
        field: &dyn Fn() -> String,
        depth: usize,
    ) -> Result<GgufValue> {
        Ok(match ty {
            GgufType::U8 => GgufValue::U8(u8::from_le_bytes(self.array(field)?)),
            GgufType::I8 => GgufValue::I8(i8::from_le_bytes(self.array(field)?)),
            GgufType::U16 => GgufValue::U16(u16::from_le_bytes(self.array(field)?)),
            GgufType::I16 => GgufValue::I16(i16::from_le_bytes(self.array(field)?)),
            GgufType::U32 => GgufValue::U32(u32::from_le_bytes(self.array(field)?)),
            GgufType::I32 => GgufValue::I32(i32::from_le_bytes(self.array(field)?)),
            GgufType::F32 => GgufValue::F32(f32::from_le_bytes(self.array(field)?)),
            GgufType::Bool => GgufValue::Bool(self.array::<1>(field)?[0] != 0),
            GgufType::String => GgufValue::String(self.string(field)?),
            GgufType::Array => GgufValue::Array(self.array_value(field, depth + 1)?),
            GgufType::U64 => GgufValue::U64(u64::from_le_bytes(self.array(field)?)),
            GgufType::I64 => GgufValue::I64(i64::from_le_bytes(self.array(field)?)),
            GgufType::F64 => GgufValue::F64(f64::from_le_bytes(self.array(field)?)),
        })
    }

    /// An array (element type, count, elements) at nesting depth `depth` (1 for an array that
    /// is not inside another).
    fn array_value(&mut self, field: &dyn Fn() -> String, depth: usize) -> Result<GgufArray> {
        let at = self.pos;
        if depth > MAX_ARRAY_NESTING {
            return Err(self.error(
                field(),
                at,
                format!("arrays nest more than {MAX_ARRAY_NESTING} deep"),
            ));
        }
        let type_field = || format!("{} (array element type)", field());
        let elem = self.value_type(&type_field)?;
        let count_field = || format!("{} (array length)", field());
        let n = self.count(&count_field, elem.min_encoded_size(), "elements")?;
        // `n` elements of `elem` fit in what remains: fixed-size elements are sliced at once.
        macro_rules! numbers {
            ($variant:ident, $t:ty) => {{
                const SIZE: usize = std::mem::size_of::<$t>();
                let raw = self.take(n * SIZE, field)?;
                GgufArray::$variant(
                    raw.chunks_exact(SIZE)
                        .map(|c| {
                            let mut b = [0u8; SIZE];
                            b.copy_from_slice(c);
                            <$t>::from_le_bytes(b)
                        })
                        .collect(),
                )
            }};
        }
        Ok(match elem {
            GgufType::U8 => GgufArray::U8(self.take(n, field)?.to_vec()),
            GgufType::I8 => GgufArray::I8(self.take(n, field)?.iter().map(|&b| b as i8).collect()),
            GgufType::U16 => numbers!(U16, u16),
            GgufType::I16 => numbers!(I16, i16),
            GgufType::U32 => numbers!(U32, u32),
            GgufType::I32 => numbers!(I32, i32),
            GgufType::F32 => numbers!(F32, f32),
            GgufType::U64 => numbers!(U64, u64),
            GgufType::I64 => numbers!(I64, i64),
            GgufType::F64 => numbers!(F64, f64),
            GgufType::Bool => {
                GgufArray::Bool(self.take(n, field)?.iter().map(|&b| b != 0).collect())
            }
            GgufType::String => {
                let mut items = Vec::with_capacity(n);
                for i in 0..n {
                    items.push(self.string(&|| format!("{}[{i}]", field()))?);
                }
                GgufArray::String(items)
            }
            GgufType::Array => {
                let mut items = Vec::with_capacity(n);
                for i in 0..n {
                    items.push(self.array_value(&|| format!("{}[{i}]", field()), depth + 1)?);
                }
                GgufArray::Array(items)
            }
        })
    }
}

/// The version check: 2 and 3 are read; anything else is explained.
fn check_version(reader: &Reader<'_>, version: u32) -> Result<()> {
    let problem = match version {
        2 | 3 => return Ok(()),
        1 => "version 1 (GGUF v1, with 32-bit counts) is no longer supported; convert the file \
              with a current GGUF tool"
            .to_owned(),
        v if v & 0xffff == 0 => {
            let swapped = v.swap_bytes();
            format!(
                "the version reads as {v}, far beyond any GGUF version: the file is big-endian \
                 (version {swapped} written on a big-endian machine), and only little-endian \
                 files are supported"
            )
        }
        v => format!("unsupported version {v}: ferrograph reads versions 2 and 3"),
    };
    Err(reader.error("header.version", 4, problem))
}

/// Everything the parser finds.
struct Parsed {
    version: u32,
    alignment: usize,
    data_offset: usize,
    metadata: Vec<(String, GgufValue)>,
    keys: HashMap<String, usize>,
    tensors: Vec<GgufTensorInfo>,
    names: HashMap<String, usize>,
}

/// Parses and checks the header, metadata and tensor infos of `bytes` (a whole file).
fn parse(bytes: &[u8], path: &str) -> Result<Parsed> {
    let mut r = Reader {
        bytes,
        pos: 0,
        path,
    };
    if bytes.len() < 4 || bytes[..4] != GGUF_MAGIC {
        let found = &bytes[..bytes.len().min(4)];
        let problem = if bytes.len() < 4 {
            format!(
                "the file has only {} bytes; a GGUF file starts with the magic \"GGUF\"",
                bytes.len()
            )
        } else {
            format!(
                "expected the magic \"GGUF\", found \"{}\": not a GGUF file",
                found.escape_ascii()
            )
        };
        return Err(r.error("header.magic", 0, problem));
    }
    r.pos = 4;
    let version = r.u32(&|| "header.version".to_owned())?;
    check_version(&r, version)?;
    let tensor_count_field = || "header.tensor_count".to_owned();
    let n_tensors = r.count(&tensor_count_field, MIN_TENSOR_INFO_SIZE, "tensor infos")?;
    let n_kv = r.count(
        &|| "header.metadata_kv_count".to_owned(),
        MIN_KV_SIZE,
        "key/value pairs",
    )?;
    debug_assert_eq!(r.pos, HEADER_SIZE);

    // Metadata.
    let mut metadata: Vec<(String, GgufValue)> = Vec::with_capacity(n_kv.min(1 << 12));
    let mut keys: HashMap<String, usize> = HashMap::with_capacity(n_kv.min(1 << 12));
    let mut alignment_at = None;
    for i in 0..n_kv {
        let key_at = r.pos;
        let key = r.string(&|| format!("metadata[{i}].key"))?;
        if let Some(&first) = keys.get(&key) {
            return Err(r.error(
                format!("metadata[{i}].key"),
                key_at,
                format!("duplicate key {key:?} (already metadata[{first}])"),
            ));
        }
        let field = || format!("metadata {key:?}");
        let ty = r.value_type(&|| format!("metadata {key:?} (value type)"))?;
        if key == ALIGNMENT_KEY {
            alignment_at = Some(r.pos);
        }
        let value = r.value(ty, &field, 0)?;
        keys.insert(key.clone(), i);
        metadata.push((key, value));
    }

    let alignment = match (keys.get(ALIGNMENT_KEY), alignment_at) {
        (Some(&i), Some(at)) => {
            let field = format!("metadata {ALIGNMENT_KEY:?}");
            let value = &metadata[i].1;
            let a = value.as_u32().ok_or_else(|| {
                r.error(
                    field.clone(),
                    at,
                    format!("must be a u32, found a {}", value.type_label()),
                )
            })?;
            if a == 0 || !a.is_power_of_two() || a as usize > MAX_ALIGNMENT {
                return Err(r.error(
                    field,
                    at,
                    format!("{a} is not a power of two from 1 to {MAX_ALIGNMENT}"),
                ));
            }
            a as usize
        }
        _ => DEFAULT_ALIGNMENT,
    };

    // Tensor infos. The count was checked against the bytes after the header; check it again
    // against what the metadata left.
    if n_tensors
        .checked_mul(MIN_TENSOR_INFO_SIZE)
        .is_none_or(|b| b > r.remaining())
    {
        return Err(r.error(
            tensor_count_field(),
            8,
            format!(
                "{n_tensors} tensor infos need at least {MIN_TENSOR_INFO_SIZE} bytes each, but \
                 only {} bytes follow the metadata",
                r.remaining()
            ),
        ));
    }
    let mut tensors: Vec<GgufTensorInfo> = Vec::with_capacity(n_tensors.min(1 << 12));
    let mut names: HashMap<String, usize> = HashMap::with_capacity(n_tensors.min(1 << 12));
    let mut offset_positions: Vec<usize> = Vec::with_capacity(n_tensors.min(1 << 12));
    for i in 0..n_tensors {
        let name_at = r.pos;
        let name = r.string(&|| format!("tensor_infos[{i}].name"))?;
        if let Some(&first) = names.get(&name) {
            return Err(r.error(
                format!("tensor_infos[{i}].name"),
                name_at,
                format!("duplicate tensor name {name:?} (already tensor_infos[{first}])"),
            ));
        }
        let tfield = |what: &str| format!("tensor {name:?}.{what}");
        let n_dims_at = r.pos;
        let n_dims = r.u32(&|| tfield("n_dims"))? as usize;
        if n_dims > MAX_DIMS {
            return Err(r.error(
                tfield("n_dims"),
                n_dims_at,
                format!("{n_dims} dimensions; at most {MAX_DIMS} are allowed"),
            ));
        }
        let mut ne = [1usize; MAX_DIMS];
        for (j, n) in ne.iter_mut().enumerate().take(n_dims) {
            let at = r.pos;
            let dim = r.u64(&|| tfield(&format!("dims[{j}]")))?;
            *n = usize::try_from(dim)
                .ok()
                .filter(|_| dim <= i64::MAX as u64)
                .ok_or_else(|| {
                    r.error(
                        tfield(&format!("dims[{j}]")),
                        at,
                        format!(
                            "{dim} elements (negative as ggml's signed 64-bit count, or too \
                             large)"
                        ),
                    )
                })?;
        }
        let type_at = r.pos;
        let type_id = r.u32(&|| tfield("type"))?;
        let dtype = DType::from_ggml_type_id(type_id).map_err(|e| {
            let detail = match e {
                Error::DType(m) => m,
                other => other.to_string(),
            };
            r.error(tfield("type"), type_at, detail)
        })?;
        let shape_error = |problem: String| r.error(tfield("dims"), n_dims_at + 4, problem);
        if !ne[0].is_multiple_of(dtype.block_size()) {
            return Err(shape_error(format!(
                "the row length {} is not a multiple of the {} block size {}",
                ne[0],
                dtype.name(),
                dtype.block_size()
            )));
        }
        // As ggml: the element count must fit a signed 64-bit integer, and (as ferrograph's
        // tensors require) the elements times the type size must fit an isize.
        let elements = ne.iter().try_fold(1usize, |acc, &n| acc.checked_mul(n));
        let fits = elements
            .filter(|&e| e <= i64::MAX as usize)
            .and_then(|e| e.checked_mul(dtype.type_size()))
            .is_some_and(|b| b <= isize::MAX as usize);
        if !fits {
            return Err(shape_error(format!(
                "the shape {:?} ({} dims) has more elements than a tensor can hold",
                &ne[..n_dims],
                dtype.name()
            )));
        }
        let nbytes = dtype
            .row_size(ne[0])
            .ok()
            .and_then(|row| ne[1..].iter().try_fold(row, |acc, &n| acc.checked_mul(n)))
            .ok_or_else(|| shape_error(format!("the shape {:?} is too large", &ne[..n_dims])))?;
        let offset_at = r.pos;
        let offset = r.u64(&|| tfield("offset"))?;
        let offset = usize::try_from(offset)
            .ok()
            .filter(|o| o.is_multiple_of(alignment))
            .ok_or_else(|| {
                r.error(
                    tfield("offset"),
                    offset_at,
                    format!("{offset} is not a multiple of the file's alignment {alignment}"),
                )
            })?;
        names.insert(name.clone(), i);
        offset_positions.push(offset_at);
        tensors.push(GgufTensorInfo {
            name,
            dtype,
            ne,
            n_dims,
            offset,
            file_offset: 0,
            nbytes,
        });
    }

    // The data section starts at the next multiple of the alignment.
    let infos_end = r.pos;
    let data_offset = align_up(infos_end, alignment).ok_or_else(|| {
        r.error(
            "data section",
            infos_end,
            "the aligned start overflows".to_owned(),
        )
    })?;
    if !tensors.is_empty() && data_offset > bytes.len() {
        return Err(r.error(
            "data section",
            infos_end,
            format!(
                "starts at byte {data_offset} (the next multiple of {alignment}), past the end \
                 of the file ({} bytes; truncated?)",
                bytes.len()
            ),
        ));
    }
    let data_len = bytes.len().saturating_sub(data_offset);
    for (info, &at) in tensors.iter_mut().zip(&offset_positions) {
        let end = info.offset.checked_add(info.nbytes);
        if end.is_none_or(|end| end > data_len) {
            return Err(r.error(
                format!("tensor {:?}.offset", info.name),
                at,
                format!(
                    "its {} bytes at offset {} of the data section (byte {} of the file) end \
                     past the end of the file ({} bytes; truncated?)",
                    info.nbytes,
                    info.offset,
                    data_offset as u128 + info.offset as u128,
                    bytes.len()
                ),
            ));
        }
        info.file_offset = data_offset + info.offset;
    }
    // No two tensors may share bytes.
    let mut order: Vec<usize> = (0..tensors.len())
        .filter(|&i| tensors[i].nbytes > 0)
        .collect();
    order.sort_by_key(|&i| tensors[i].offset);
    for pair in order.windows(2) {
        let (a, b) = (&tensors[pair[0]], &tensors[pair[1]]);
        if b.offset < a.offset + a.nbytes {
            return Err(r.error(
                format!("tensor {:?}.offset", b.name),
                offset_positions[pair[1]],
                format!(
                    "its data at {}..{} overlaps tensor {:?} at {}..{} (offsets in the data \
                     section)",
                    b.offset,
                    b.offset + b.nbytes,
                    a.name,
                    a.offset,
                    a.offset + a.nbytes
                ),
            ));
        }
    }
    Ok(Parsed {
        version,
        alignment,
        data_offset,
        metadata,
        keys,
        tensors,
        names,
    })
}

/// A failure to read `path` itself (not its contents).
fn io_error(path: &str, what: &str, err: std::io::Error) -> Error {
    Error::gguf(path, "file", None, format!("cannot {what}: {err}"))
}

impl GgufFile {
    /// Opens and checks the GGUF file at `path`, mapping it read-only (nothing of the data
    /// section is read until it is used).
    ///
    /// Like every memory map, the mapping assumes no other process truncates or rewrites the
    /// file while it is open (ggml and llama.cpp make the same assumption).
    pub fn open(path: impl AsRef<Path>) -> Result<GgufFile> {
        let path_ref = path.as_ref();
        let shown = path_ref.display().to_string();
        let file = File::open(path_ref).map_err(|e| io_error(&shown, "open it", e))?;
        let meta = file
            .metadata()
            .map_err(|e| io_error(&shown, "read its size", e))?;
        if !meta.is_file() {
            return Err(Error::gguf(&shown, "file", None, "is not a regular file"));
        }
        // SAFETY: the map is read-only and private to this value; the bytes are only ever read
        // through `&[u8]`. Memory maps of files carry one unavoidable caveat, documented on
        // this function: another process truncating the file while it is mapped makes reads
        // past the new end fault.
        let map = unsafe { memmap2::MmapOptions::new().map(&file) }
            .map_err(|e| io_error(&shown, "map it into memory", e))?;
        let parsed = parse(&map, &shown)?;
        Ok(Self::assemble(shown, Source::Map { map, file }, parsed))
    }

    /// Reads a GGUF file held in memory; `name` stands for its path in messages. Its tensors
    /// are copied when loaded ([`GgufFile::load`]).
    pub fn from_bytes(name: impl Into<String>, bytes: Vec<u8>) -> Result<GgufFile> {
        let name = name.into();
        let parsed = parse(&bytes, &name)?;
        Ok(Self::assemble(name, Source::Bytes(bytes), parsed))
    }

    fn assemble(path: String, source: Source, parsed: Parsed) -> GgufFile {
        GgufFile {
            path,
            source,
            version: parsed.version,
            alignment: parsed.alignment,
            data_offset: parsed.data_offset,
            metadata: parsed.metadata,
            keys: parsed.keys,
            tensors: parsed.tensors,
            names: parsed.names,
        }
    }

    /// The path (as given to [`GgufFile::open`]).
    pub fn path(&self) -> &str {
        &self.path
    }

    /// The format version (2 or 3).
    pub fn version(&self) -> u32 {
        self.version
    }

    /// The alignment of the data section and of tensor offsets.
    pub fn alignment(&self) -> usize {
        self.alignment
    }

    /// Where the data section starts in the file.
    pub fn data_offset(&self) -> usize {
        self.data_offset
    }

    /// The file's size in bytes.
    pub fn size(&self) -> usize {
        self.source.bytes().len()
    }

    /// Every key/value pair, in file order.
    pub fn metadata(&self) -> &[(String, GgufValue)] {
        &self.metadata
    }

    /// The value of `key`.
    pub fn get(&self, key: &str) -> Option<&GgufValue> {
        self.keys.get(key).map(|&i| &self.metadata[i].1)
    }

    /// The value of `key` through `convert`: `Ok(None)` when the key is missing, an error
    /// naming the key when its value has another type.
    fn typed<'s, T>(
        &'s self,
        key: &str,
        expected: &str,
        convert: impl FnOnce(&'s GgufValue) -> Option<T>,
    ) -> Result<Option<T>> {
        match self.get(key) {
            None => Ok(None),
            Some(value) => convert(value).map(Some).ok_or_else(|| {
                Error::gguf(
                    &self.path,
                    format!("metadata {key:?}"),
                    None,
                    format!("is a {}, not a {expected}", value.type_label()),
                )
            }),
        }
    }

    /// The `u32` value of `key` (`None` when missing; an error when it has another type).
    pub fn get_u32(&self, key: &str) -> Result<Option<u32>> {
        self.typed(key, "u32", GgufValue::as_u32)
    }

    /// The `u64` value of `key` (`None` when missing; an error when it has another type).
    pub fn get_u64(&self, key: &str) -> Result<Option<u64>> {
        self.typed(key, "u64", GgufValue::as_u64)
    }

    /// The `i32` value of `key` (`None` when missing; an error when it has another type).
    pub fn get_i32(&self, key: &str) -> Result<Option<i32>> {
        self.typed(key, "i32", GgufValue::as_i32)
    }

    /// The `f32` value of `key` (`None` when missing; an error when it has another type).
    pub fn get_f32(&self, key: &str) -> Result<Option<f32>> {
        self.typed(key, "f32", GgufValue::as_f32)
    }

    /// The `bool` value of `key` (`None` when missing; an error when it has another type).
    pub fn get_bool(&self, key: &str) -> Result<Option<bool>> {
        self.typed(key, "bool", GgufValue::as_bool)
    }

    /// The string value of `key` (`None` when missing; an error when it has another type).
    pub fn get_str(&self, key: &str) -> Result<Option<&str>> {
        self.typed(key, "str", GgufValue::as_str)
    }

    /// The array value of `key` (`None` when missing; an error when it has another type).
    pub fn get_array(&self, key: &str) -> Result<Option<&GgufArray>> {
        self.typed(key, "array", GgufValue::as_array)
    }

    /// Every tensor info, in file order.
    pub fn tensors(&self) -> &[GgufTensorInfo] {
        &self.tensors
    }

    /// The info of the tensor named `name`.
    pub fn tensor_info(&self, name: &str) -> Option<&GgufTensorInfo> {
        self.names.get(name).map(|&i| &self.tensors[i])
    }

    /// The bytes of the tensor named `name`: a slice of the map, nothing copied.
    pub fn tensor_data(&self, name: &str) -> Option<&[u8]> {
        self.tensor_info(name).map(|info| self.data_of(info))
    }

    fn data_of(&self, info: &GgufTensorInfo) -> &[u8] {
        // The parser checked that the range lies inside the file.
        &self.source.bytes()[info.file_offset..info.file_offset + info.nbytes]
    }

    /// The tensor named `name` as f32 values in ggml order (block types dequantized, integers
    /// converted): an error for an unknown name, or a type without a dequantizer.
    pub fn tensor_to_f32(&self, name: &str) -> Result<Vec<f32>> {
        let info = self.tensor_info(name).ok_or_else(|| self.no_tensor(name))?;
        let data = self.data_of(info);
        let (n, row) = (info.nelements(), info.ne[0]);
        let mut out = vec![0f32; n];
        if n == 0 {
            return Ok(out);
        }
        let row_bytes = info.dtype.row_size(row)?;
        // Block decoders read their blocks in place and need them aligned (a file with an
        // alignment below 8 can place a tensor anywhere): such rows go through aligned scratch.
        let mut scratch: Vec<u64> = Vec::new();
        for (src, dst) in data.chunks_exact(row_bytes).zip(out.chunks_exact_mut(row)) {
            if (src.as_ptr() as usize).is_multiple_of(8) {
                info.dtype.row_to_f32(src, dst)?;
            } else {
                scratch.resize(row_bytes.div_ceil(8), 0);
                let aligned = &mut bytemuck::cast_slice_mut::<u64, u8>(&mut scratch)[..row_bytes];
                aligned.copy_from_slice(src);
                info.dtype.row_to_f32(aligned, dst)?;
            }
        }
        Ok(out)
    }

    fn no_tensor(&self, name: &str) -> Error {
        Error::InvalidArgument(format!("{}: no tensor named {name:?}", self.path))
    }

    /// Gives every tensor of the file a place on `device`, in a new context (see
    /// [`GgufFile::load_into`]).
    pub fn load(&self, device: &dyn Device) -> Result<GgufWeights> {
        self.load_into(device, &Context::new(true))
    }

    /// Creates the file's tensors in `ctx` (which must not allocate: `no_alloc`), named as in
    /// the file and in file order, and binds them to one buffer of `device`, marked as
    /// weights:
    ///
    /// * without copying when the file was opened from disk, the device can wrap host memory
    ///   (`DeviceCaps::buffer_from_host_ptr`), its buffer type is host memory and every
    ///   tensor starts at a multiple of [`ZERO_COPY_ALIGNMENT`] in the file: the data section
    ///   is mapped copy-on-write and wrapped (see the module's documentation);
    /// * otherwise in a buffer of the device's buffer type holding all tensors (each at its
    ///   aligned offset), into which each tensor is copied.
    ///
    /// On an error, tensors already created stay in `ctx`, unbound.
    pub fn load_into(&self, device: &dyn Device, ctx: &Context) -> Result<GgufWeights> {
        self.load_into_placed(device, ctx, &HashMap::new())
    }

    /// [`load_into`](Self::load_into), except that each tensor named in `placed` goes to a
    /// buffer of the buffer type given for it (such as the CPU's repacking type, which stores
    /// matrices in its kernels' layout), its data copied in; the rest are bound as
    /// `load_into` binds them. The file's pages that only the placed tensors used are released
    /// from this process's memory after the copy; when the rest stay in the file's map, those
    /// of at most [`SMALL_IN_PLACE_BYTES`] are copied into a buffer of the device's own type
    /// too, so reading them cannot map the released pages again. Unknown names are an error.
    pub fn load_into_placed(
        &self,
        device: &dyn Device,
        ctx: &Context,
        placed: &HashMap<String, Arc<dyn BufferType>>,
    ) -> Result<GgufWeights> {
        if let Some(name) = placed.keys().find(|n| !self.names.contains_key(*n)) {
            return Err(self.no_tensor(name));
        }
        if !ctx.no_alloc() {
            return Err(Error::InvalidArgument(
                "GGUF tensors are loaded into a no_alloc context (their memory is the file's \
                 or one buffer of the device); this context allocates its tensors"
                    .into(),
            ));
        }
        let mut tensors = Vec::with_capacity(self.tensors.len());
        for info in &self.tensors {
            let tensor = ctx.new_tensor(info.dtype, &info.ne[..info.n_dims.max(1)])?;
            tensor.set_name(&info.name);
            tensors.push(tensor);
        }
        let wrap = self.can_wrap(device);
        // With pages released (some tensors copied) and the rest in the map, the small ones
        // are copied into the device's own buffer type as well (see SMALL_IN_PLACE_BYTES).
        let mut copied = placed.clone();
        if !placed.is_empty() && wrap.is_some() {
            for info in &self.tensors {
                if info.nbytes <= SMALL_IN_PLACE_BYTES && !placed.contains_key(&info.name) {
                    copied.insert(info.name.clone(), device.buffer_type());
                }
            }
        }
        let is_placed: Vec<bool> = self
            .tensors
            .iter()
            .map(|info| copied.contains_key(&info.name))
            .collect();
        let extra_buffers = self.copy_placed(&tensors, &copied)?;
        let rest: Vec<(&GgufTensorInfo, &Tensor)> = self
            .tensors
            .iter()
            .zip(&tensors)
            .zip(&is_placed)
            .filter(|(_, &p)| !p)
            .map(|(pair, _)| pair)
            .collect();
        let (buffer, zero_copy) = match wrap {
            Some(file) => match self.wrap_map(device, file, &rest) {
                Ok(buffer) => (buffer, true),
                Err(e) => {
                    log::warn!(
                        "{}: wrapping the file's data for device {} failed ({e}); copying it",
                        self.path,
                        device.name()
                    );
                    for (_, tensor) in &rest {
                        tensor.unbind();
                    }
                    (self.copy_to(device.buffer_type(), &rest, false)?, false)
                }
            },
            None => (self.copy_to(device.buffer_type(), &rest, false)?, false),
        };
        log::debug!(
            "{}: {} tensors ({} bytes) on {} {}",
            self.path,
            tensors.len(),
            buffer.size(),
            device.name(),
            if zero_copy {
                "in place (copy-on-write map)"
            } else {
                "copied"
            }
        );
        Ok(GgufWeights {
            buffer,
            extra_buffers,
            context: ctx.clone(),
            tensors,
            index: self.names.clone(),
            zero_copy,
        })
    }

    /// The open file when `device` can use the data in place.
    fn can_wrap(&self, device: &dyn Device) -> Option<&File> {
        let Source::Map { file, .. } = &self.source else {
            return None;
        };
        let aligned = self
            .tensors
            .iter()
            .all(|t| t.file_offset.is_multiple_of(ZERO_COPY_ALIGNMENT));
        (device.caps().buffer_from_host_ptr && device.buffer_type().is_host() && aligned)
            .then_some(file)
    }

    /// Maps `file` copy-on-write, wraps its data section in a buffer of `device` and binds
    /// each tensor at its offset.
    fn wrap_map(
        &self,
        device: &dyn Device,
        file: &File,
        tensors: &[(&GgufTensorInfo, &Tensor)],
    ) -> Result<Buffer> {
        // SAFETY: a private (copy-on-write) mapping: writes through it change this process's
        // pages only, never the file or other mappings. The file is the one parsed (kept
        // open); its size and header bytes are compared with the parsed ones below, and the
        // usual caveat of file maps applies (see `open`).
        let mut map = unsafe { memmap2::MmapOptions::new().map_copy(file) }
            .map_err(|e| io_error(&self.path, "map it copy-on-write", e))?;
        let parsed = self.source.bytes();
        if map.len() != parsed.len()
            || map[..self.data_offset.min(map.len())]
                != parsed[..self.data_offset.min(parsed.len())]
        {
            return Err(Error::gguf(
                &self.path,
                "file",
                None,
                "changed on disk since it was opened",
            ));
        }
        let size = map.len().saturating_sub(self.data_offset);
        let max_tensor = self.tensors.iter().map(|t| t.nbytes).max().unwrap_or(0);
        // The pointer is taken from the exclusive `MmapMut` once; from here on the mapping is
        // reached only through it (by the buffer), never through `map`'s own borrows.
        // SAFETY: the offset is clamped to the map's length, so `base` stays inside the
        // mapping or one past its end (then `size` is 0).
        let base = unsafe { map.as_mut_ptr().add(self.data_offset.min(map.len())) };
        // SAFETY: `base` points at `size` bytes of a private, writable mapping that stays
        // mapped while `map` lives; `map` is moved into the buffer's keep-alive list right
        // below (moving an `MmapMut` does not move the mapping), so the memory stays valid and
        // writable for as long as the buffer or any tensor bound to it lives. If the call
        // fails, `map` is dropped here and nothing refers to the memory.
        let buffer = unsafe { device.buffer_from_host_ptr(base, size, max_tensor)? };
        buffer.keep_alive(Box::new(map));
        buffer.set_usage(BufferUsage::Weights);
        for (info, tensor) in tensors {
            tensor.bind_with_alignment(&buffer, info.offset, ZERO_COPY_ALIGNMENT)?;
        }
        Ok(buffer)
    }

    /// Copies the tensors named in `placed` into buffers of their buffer types (one per type),
    /// releasing the file pages each alone used after its copy; returns the buffers.
    fn copy_placed(
        &self,
        tensors: &[Tensor],
        placed: &HashMap<String, Arc<dyn BufferType>>,
    ) -> Result<Vec<Buffer>> {
        let mut by_type: Vec<(Arc<dyn BufferType>, Vec<TensorPair<'_>>)> = Vec::new();
        for (info, tensor) in self.tensors.iter().zip(tensors) {
            let Some(buft) = placed.get(&info.name) else {
                continue;
            };
            match by_type.iter_mut().find(|(b, _)| Arc::ptr_eq(b, buft)) {
                Some((_, list)) => list.push((info, tensor)),
                None => by_type.push((buft.clone(), vec![(info, tensor)])),
            }
        }
        let mut buffers = Vec::with_capacity(by_type.len());
        for (buft, list) in &by_type {
            buffers.push(self.copy_to(buft.clone(), list, true)?);
        }
        Ok(buffers)
    }

    /// Drops from this process's memory the pages of the file's map that lie wholly inside
    /// `info`'s bytes (a tensor copied elsewhere: nothing reads them again). A failure only
    /// costs memory, so it is logged.
    fn release_pages(&self, info: &GgufTensorInfo) {
        let Source::Map { map, .. } = &self.source else {
            return;
        };
        // SAFETY: sysconf has no preconditions.
        let page = usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) })
            .unwrap_or(4096)
            .max(1);
        let start = info.file_offset.div_ceil(page) * page;
        let end = (info.file_offset + info.nbytes) / page * page;
        if end <= start {
            return;
        }
        // SAFETY: a read-only shared file mapping: dropping its pages changes no content (a
        // later read faults them in from the file again), and the range lies inside the map
        // (the parser checked the tensor's bytes).
        let advised = unsafe {
            map.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, start, end - start)
        };
        if let Err(e) = advised {
            log::debug!("{}: releasing copied pages failed: {e}", self.path);
        }
    }

    /// Allocates buffers of type `buft` for `tensors` and copies their data in; with
    /// `release`, each tensor's file pages are released right after its copy (see
    /// [`Self::release_pages`]), so the peak memory holds one tensor twice at most.
    fn copy_to(
        &self,
        buft: Arc<dyn BufferType>,
        tensors: &[(&GgufTensorInfo, &Tensor)],
        release: bool,
    ) -> Result<Buffer> {
        let alignment = buft.alignment().max(1);
        let max_size = buft.max_size();
        // Greedy ranges of tensors that each fit one buffer (one range unless the total
        // exceeds the type's maximum size).
        let mut ranges: Vec<(usize, usize, usize)> = Vec::new(); // (first, end, bytes)
        let mut start = 0;
        let mut bytes = 0usize;
        for (i, (_, tensor)) in tensors.iter().enumerate() {
            let size = align_up(buft.alloc_size(tensor), alignment)
                .filter(|&s| s <= max_size)
                .ok_or_else(|| {
                    Error::alloc_failed(
                        format!(
                            "{}: tensor {:?} needs more than the largest buffer of {} ({max_size} \
                             bytes)",
                            self.path,
                            tensor.name(),
                            buft.name()
                        ),
                        buft.alloc_size(tensor),
                        Some(max_size),
                        buft.name(),
                    )
                })?;
            if i > start && bytes.checked_add(size).is_none_or(|b| b > max_size) {
                ranges.push((start, i, bytes));
                start = i;
                bytes = 0;
            }
            bytes += size;
        }
        ranges.push((start, tensors.len(), bytes));
        let mut parts = Vec::with_capacity(ranges.len());
        for &(first, end, size) in &ranges {
            let buffer = buft.clone().alloc_buffer(size)?;
            // Weights first: a remote device sends weight bytes through its weight cache.
            buffer.set_usage(BufferUsage::Weights);
            let mut talloc = crate::alloc::tensor_alloc::TensorAllocator::new(&buffer);
            for (_, tensor) in &tensors[first..end] {
                talloc.alloc(tensor)?;
            }
            parts.push(buffer);
        }
        if release {
            // Placed tensors are usually repacked on the way in: a few threads share them.
            let threads = std::thread::available_parallelism()
                .map_or(1, |n| n.get())
                .clamp(1, 4)
                .min(tensors.len().max(1));
            let per = tensors.len().div_ceil(threads).max(1);
            std::thread::scope(|scope| {
                let handles: Vec<_> = tensors
                    .chunks(per)
                    .map(|chunk| {
                        scope.spawn(move || -> Result<()> {
                            for (info, tensor) in chunk {
                                tensor.write_bytes(0, self.data_of(info))?;
                                self.release_pages(info);
                            }
                            Ok(())
                        })
                    })
                    .collect();
                handles.into_iter().try_for_each(|h| {
                    h.join()
                        .unwrap_or_else(|_| Err(Error::Backend("a copying thread panicked".into())))
                })
            })?;
        } else {
            for (info, tensor) in tensors {
                tensor.write_bytes(0, self.data_of(info))?;
            }
        }
        if parts.len() == 1 {
            Ok(parts.remove(0))
        } else {
            Buffer::multi(parts)
        }
    }
}

/// A tensor's entry in the file and the tensor made for it.
type TensorPair<'a> = (&'a GgufTensorInfo, &'a Tensor);

/// The tensors of a GGUF file bound to a device ([`GgufFile::load`]).
#[derive(Debug, Clone)]
pub struct GgufWeights {
    /// The buffer holding every tensor (wrapping the file's map, or a copy) but the placed
    /// ones and the small ones copied beside them ([`GgufFile::load_into_placed`]).
    pub buffer: Buffer,
    /// The buffers of the placed tensors (and of the small ones copied beside them), one per
    /// buffer type.
    pub extra_buffers: Vec<Buffer>,
    /// The context the tensors belong to; tensors reach their context only while it lives.
    pub context: Context,
    /// The tensors, in file order, named as in the file.
    pub tensors: Vec<Tensor>,
    index: HashMap<String, usize>,
    /// Whether the buffer wraps the file's map (no copy) rather than holding a copy.
    pub zero_copy: bool,
}

impl GgufWeights {
    /// The tensor named `name`.
    pub fn get(&self, name: &str) -> Option<&Tensor> {
        self.index.get(name).map(|&i| &self.tensors[i])
    }
}

/// A tensor to write with [`write_gguf`].
#[derive(Debug, Clone)]
pub struct GgufTensorToWrite<'a> {
    /// Its name (unique in the file).
    pub name: String,
    /// Its element type.
    pub dtype: DType,
    /// Its dimensions in ggml's order (fastest first), 0 to 4 of them.
    pub ne: Vec<usize>,
    /// Its bytes: exactly `dtype.row_size(ne[0]) × ne[1] × ...`.
    pub data: &'a [u8],
}

/// Writes `metadata` then one value.
fn encode_value(out: &mut Vec<u8>, value: &GgufValue) {
    match value {
        GgufValue::U8(v) => out.push(*v),
        GgufValue::I8(v) => out.extend_from_slice(&v.to_le_bytes()),
        GgufValue::U16(v) => out.extend_from_slice(&v.to_le_bytes()),
        GgufValue::I16(v) => out.extend_from_slice(&v.to_le_bytes()),
        GgufValue::U32(v) => out.extend_from_slice(&v.to_le_bytes()),
        GgufValue::I32(v) => out.extend_from_slice(&v.to_le_bytes()),
        GgufValue::F32(v) => out.extend_from_slice(&v.to_le_bytes()),
        GgufValue::Bool(v) => out.push(u8::from(*v)),
        GgufValue::String(s) => encode_string(out, s),
        GgufValue::Array(a) => encode_array(out, a),
        GgufValue::U64(v) => out.extend_from_slice(&v.to_le_bytes()),
        GgufValue::I64(v) => out.extend_from_slice(&v.to_le_bytes()),
        GgufValue::F64(v) => out.extend_from_slice(&v.to_le_bytes()),
    }
}

fn encode_string(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

fn encode_array(out: &mut Vec<u8>, array: &GgufArray) {
    out.extend_from_slice(&array.element_type().id().to_le_bytes());
    out.extend_from_slice(&(array.len() as u64).to_le_bytes());
    macro_rules! each {
        ($v:expr) => {
            for x in $v {
                out.extend_from_slice(&x.to_le_bytes());
            }
        };
    }
    match array {
        GgufArray::U8(v) => out.extend_from_slice(v),
        GgufArray::I8(v) => each!(v),
        GgufArray::U16(v) => each!(v),
        GgufArray::I16(v) => each!(v),
        GgufArray::U32(v) => each!(v),
        GgufArray::I32(v) => each!(v),
        GgufArray::F32(v) => each!(v),
        GgufArray::Bool(v) => out.extend(v.iter().map(|&b| u8::from(b))),
        GgufArray::String(v) => v.iter().for_each(|s| encode_string(out, s)),
        GgufArray::Array(v) => v.iter().for_each(|a| encode_array(out, a)),
        GgufArray::U64(v) => each!(v),
        GgufArray::I64(v) => each!(v),
        GgufArray::F64(v) => each!(v),
    }
}

/// Writes a version 3 GGUF file at `path`: `metadata` in the given order, then the tensors in
/// the given order, each tensor's data at the next multiple of `alignment` (the layout ggml
/// writes and expects).
///
/// The inputs are checked first, each failure an [`Error::Gguf`] naming the field: keys and
/// tensor names unique, tensors of 0 to 4 dimensions whose row length is a whole number of
/// blocks and whose `data` has exactly the size the shape needs, arrays nested at most
/// [`MAX_ARRAY_NESTING`] deep, `alignment` a power of two up to [`MAX_ALIGNMENT`]. An
/// alignment other than 32 is recorded as `general.alignment` (appended unless `metadata`
/// has it already; a `general.alignment` in `metadata` must be the `u32` `alignment`).
///
/// The file is written to a temporary file beside `path` and renamed over it once complete,
/// so a reader never sees half a file and a failed write leaves `path` as it was.
pub fn write_gguf(
    path: impl AsRef<Path>,
    metadata: &[(String, GgufValue)],
    tensors: &[GgufTensorToWrite<'_>],
    alignment: usize,
) -> Result<()> {
    let path = path.as_ref();
    let shown = path.display().to_string();
    let fail = |field: String, problem: String| Error::gguf(&shown, field, None, problem);

    if alignment == 0 || !alignment.is_power_of_two() || alignment > MAX_ALIGNMENT {
        return Err(fail(
            "alignment".into(),
            format!("{alignment} is not a power of two from 1 to {MAX_ALIGNMENT}"),
        ));
    }
    let mut seen: HashMap<&str, usize> = HashMap::new();
    let mut has_alignment = false;
    for (i, (key, value)) in metadata.iter().enumerate() {
        if let Some(first) = seen.insert(key, i) {
            return Err(fail(
                format!("metadata[{i}].key"),
                format!("duplicate key {key:?} (already metadata[{first}])"),
            ));
        }
        if let GgufValue::Array(a) = value {
            if a.depth() > MAX_ARRAY_NESTING {
                return Err(fail(
                    format!("metadata {key:?}"),
                    format!("arrays nest more than {MAX_ARRAY_NESTING} deep"),
                ));
            }
        }
        if key == ALIGNMENT_KEY {
            if value.as_u32().map(|a| a as usize) != Some(alignment) {
                return Err(fail(
                    format!("metadata {key:?}"),
                    format!(
                        "is the {} {}, but the file is written with alignment {alignment} (give \
                         it as a u32 equal to the alignment, or leave it out)",
                        value.type_label(),
                        describe(value)
                    ),
                ));
            }
            has_alignment = true;
        }
    }
    let mut names: HashMap<&str, usize> = HashMap::new();
    for (i, t) in tensors.iter().enumerate() {
        let field = |what: &str| format!("tensors[{i}] {:?}.{what}", t.name);
        if let Some(first) = names.insert(&t.name, i) {
            return Err(fail(
                field("name"),
                format!("duplicate tensor name (already tensors[{first}])"),
            ));
        }
        if t.ne.len() > MAX_DIMS {
            return Err(fail(
                field("ne"),
                format!("{} dimensions; at most {MAX_DIMS} are allowed", t.ne.len()),
            ));
        }
        let mut ne = [1usize; MAX_DIMS];
        ne[..t.ne.len()].copy_from_slice(&t.ne);
        crate::tensor::check_shape(t.dtype, &ne, &t.name)
            .map_err(|e| fail(field("ne"), e.to_string()))?;
        if ne.iter().any(|&n| n as u64 > i64::MAX as u64) {
            return Err(fail(field("ne"), format!("{:?} is too large", t.ne)));
        }
        let expected = t
            .dtype
            .row_size(ne[0])
            .ok()
            .and_then(|row| ne[1..].iter().try_fold(row, |acc, &n| acc.checked_mul(n)))
            .ok_or_else(|| fail(field("ne"), format!("{:?} is too large", t.ne)))?;
        if t.data.len() != expected {
            return Err(fail(
                field("data"),
                format!(
                    "has {} bytes, but {} {:?} takes {expected}",
                    t.data.len(),
                    t.dtype.name(),
                    t.ne
                ),
            ));
        }
    }

    // Everything before the data section, built in memory.
    let mut head = Vec::new();
    head.extend_from_slice(&GGUF_MAGIC);
    head.extend_from_slice(&GGUF_VERSION.to_le_bytes());
    head.extend_from_slice(&(tensors.len() as u64).to_le_bytes());
    let extra = usize::from(alignment != DEFAULT_ALIGNMENT && !has_alignment);
    head.extend_from_slice(&((metadata.len() + extra) as u64).to_le_bytes());
    for (key, value) in metadata {
        encode_string(&mut head, key);
        head.extend_from_slice(&value.value_type().id().to_le_bytes());
        encode_value(&mut head, value);
    }
    if extra == 1 {
        encode_string(&mut head, ALIGNMENT_KEY);
        head.extend_from_slice(&GgufType::U32.id().to_le_bytes());
        head.extend_from_slice(&(alignment as u32).to_le_bytes());
    }
    let mut offset = 0usize;
    let mut offsets = Vec::with_capacity(tensors.len());
    for t in tensors {
        encode_string(&mut head, &t.name);
        head.extend_from_slice(&(t.ne.len() as u32).to_le_bytes());
        for &n in &t.ne {
            head.extend_from_slice(&(n as u64).to_le_bytes());
        }
        head.extend_from_slice(&t.dtype.ggml_type_id().to_le_bytes());
        head.extend_from_slice(&(offset as u64).to_le_bytes());
        offsets.push(offset);
        offset = offset
            .checked_add(t.data.len())
            .and_then(|o| align_up(o, alignment))
            .ok_or_else(|| fail("tensors".into(), "the data section overflows".into()))?;
    }
    let padded =
        align_up(head.len(), alignment).ok_or_else(|| fail("header".into(), "overflows".into()))?;
    head.resize(padded, 0);

    write_atomically(path, &shown, |w| {
        w.write_all(&head)?;
        let mut written = 0usize;
        let zeros = vec![0u8; alignment];
        for (t, &at) in tensors.iter().zip(&offsets) {
            w.write_all(&zeros[..at - written])?;
            w.write_all(t.data)?;
            written = at + t.data.len();
        }
        w.write_all(&zeros[..offset - written])?;
        Ok(())
    })
}

/// A short rendering of a scalar value for messages.
fn describe(value: &GgufValue) -> String {
    match value {
        GgufValue::String(s) => format!("{s:?}"),
        GgufValue::Array(a) => format!("of {} elements", a.len()),
        GgufValue::U8(v) => v.to_string(),
        GgufValue::I8(v) => v.to_string(),
        GgufValue::U16(v) => v.to_string(),
        GgufValue::I16(v) => v.to_string(),
        GgufValue::U32(v) => v.to_string(),
        GgufValue::I32(v) => v.to_string(),
        GgufValue::F32(v) => v.to_string(),
        GgufValue::Bool(v) => v.to_string(),
        GgufValue::U64(v) => v.to_string(),
        GgufValue::I64(v) => v.to_string(),
        GgufValue::F64(v) => v.to_string(),
    }
}

/// Writes a file through `body` into a temporary file beside `path`, then renames it over
/// `path`; the temporary file is removed on any failure.
fn write_atomically(
    path: &Path,
    shown: &str,
    body: impl FnOnce(&mut BufWriter<&File>) -> std::io::Result<()>,
) -> Result<()> {
    static COUNTER: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let dir = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let file_name = path
        .file_name()
        .ok_or_else(|| Error::gguf(shown, "path", None, "names no file"))?;
    let n = COUNTER.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let tmp = dir.join(format!(
        ".{}.{}.{n}.tmp",
        file_name.to_string_lossy(),
        std::process::id()
    ));
    let result = (|| -> std::io::Result<()> {
        let file = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&tmp)?;
        let mut w = BufWriter::with_capacity(1 << 20, &file);
        body(&mut w)?;
        w.flush()?;
        drop(w);
        file.sync_all()?;
        std::fs::rename(&tmp, path)
    })();
    result.map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        io_error(shown, "write it", e)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tmp_path(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("ferrograph-gguf-unit-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        dir.join(name)
    }

    #[test]
    fn type_ids_and_names_round_trip() {
        for (i, t) in GgufType::ALL.iter().enumerate() {
            assert_eq!(t.id() as usize, i);
            assert_eq!(GgufType::from_id(t.id()), Some(*t));
            assert_eq!(GgufType::from_name(t.name()), Some(*t));
        }
        assert_eq!(GgufType::from_id(13), None);
        assert_eq!(GgufType::from_id(u32::MAX), None);
    }

    #[test]
    fn empty_file_round_trips() {
        let path = tmp_path("empty.gguf");
        write_gguf(&path, &[], &[], 32).unwrap();
        let bytes = std::fs::read(&path).unwrap();
        assert_eq!(bytes.len(), 32, "24 header bytes padded to 32");
        let file = GgufFile::open(&path).unwrap();
        assert_eq!(file.version(), 3);
        assert!(file.metadata().is_empty() && file.tensors().is_empty());
        assert_eq!(file.alignment(), 32);
    }

    #[test]
    fn version_and_magic_messages() {
        let mut bytes = b"GGUF".to_vec();
        bytes.extend_from_slice(&3u32.to_be_bytes());
        bytes.extend_from_slice(&[0; 16]);
        let err = GgufFile::from_bytes("be.gguf", bytes).unwrap_err();
        let text = err.to_string();
        assert!(
            text.contains("be.gguf") && text.contains("big-endian"),
            "{text}"
        );
        assert!(text.contains("header.version at byte 4"), "{text}");
        let err = GgufFile::from_bytes("x.bin", b"GGML0000".to_vec()).unwrap_err();
        assert!(err.to_string().contains("header.magic at byte 0"), "{err}");
    }
}
