//! Finding a CBLAS library at run time and resolving the few symbols the backend calls.
//!
//! Nothing is linked at build time: the library is opened with `libloading` the first time
//! the BLAS backend is asked about, and the outcome (a library or the reason there is none)
//! is kept for the life of the process.

use std::ffi::{c_char, c_int, CStr};
use std::sync::{Arc, OnceLock};

use libloading::Library;

use crate::error::{Error, Result};

/// Environment variable naming a BLAS library (a file name or a path) to try first; `none`,
/// `off` or `0` disable the backend instead.
pub const BLAS_LIB_ENV: &str = "FERROGRAPH_BLAS_LIB";

/// Library names tried, in order, after [`BLAS_LIB_ENV`].
#[cfg(all(unix, not(target_os = "macos")))]
pub const DEFAULT_CANDIDATES: &[&str] = &[
    "libopenblas.so.0",
    "libopenblas.so",
    "libblas.so.3",
    "libcblas.so.3",
];

/// Library names tried, in order, after [`BLAS_LIB_ENV`].
#[cfg(target_os = "macos")]
pub const DEFAULT_CANDIDATES: &[&str] = &[
    "libopenblas.0.dylib",
    "libopenblas.dylib",
    "/System/Library/Frameworks/Accelerate.framework/Accelerate",
    "libblas.dylib",
];

/// Library names tried, in order, after [`BLAS_LIB_ENV`].
#[cfg(windows)]
pub const DEFAULT_CANDIDATES: &[&str] = &["libopenblas.dll", "openblas.dll", "cblas.dll"];

// CBLAS enumeration values (the C header's numbering).
pub(crate) const CBLAS_ROW_MAJOR: c_int = 101;
pub(crate) const CBLAS_NO_TRANS: c_int = 111;
pub(crate) const CBLAS_TRANS: c_int = 112;

type SgemmLp64 = unsafe extern "C" fn(
    c_int,
    c_int,
    c_int,
    i32,
    i32,
    i32,
    f32,
    *const f32,
    i32,
    *const f32,
    i32,
    f32,
    *mut f32,
    i32,
);

type SgemmIlp64 = unsafe extern "C" fn(
    c_int,
    c_int,
    c_int,
    i64,
    i64,
    i64,
    f32,
    *const f32,
    i64,
    *const f32,
    i64,
    f32,
    *mut f32,
    i64,
);

type SetThreads = unsafe extern "C" fn(c_int);
type GetConfig = unsafe extern "C" fn() -> *const c_char;

/// `cblas_sgemm` in one of the two integer widths a library may be built with.
#[derive(Clone, Copy)]
enum Sgemm {
    /// 32-bit dimensions (the usual `cblas_sgemm`).
    Lp64(SgemmLp64),
    /// 64-bit dimensions (OpenBLAS built with `INTERFACE64`, e.g. numpy's bundled copy).
    Ilp64(SgemmIlp64),
}

/// The operands of one row-major `C = op(A) · op(B)` (alpha 1, beta 0).
#[derive(Debug, Clone, Copy)]
pub(crate) struct GemmCall {
    /// Whether `A` is read transposed.
    pub trans_a: bool,
    /// Whether `B` is read transposed.
    pub trans_b: bool,
    /// Rows of `op(A)` and `C`.
    pub m: usize,
    /// Columns of `op(B)` and `C`.
    pub n: usize,
    /// Columns of `op(A)`, rows of `op(B)`.
    pub k: usize,
    /// First matrix.
    pub a: *const f32,
    /// Its row stride in elements.
    pub lda: usize,
    /// Second matrix.
    pub b: *const f32,
    /// Its row stride in elements.
    pub ldb: usize,
    /// Output.
    pub c: *mut f32,
    /// Its row stride in elements.
    pub ldc: usize,
}

/// An opened BLAS library with its resolved entry points.
pub struct BlasLibrary {
    // Kept so the function pointers below stay valid; never closed before the process ends
    // (the value lives in a static).
    _library: Library,
    file: String,
    sgemm_symbol: &'static str,
    sgemm: Sgemm,
    set_threads: Option<SetThreads>,
    config: Option<String>,
}

impl std::fmt::Debug for BlasLibrary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BlasLibrary")
            .field("file", &self.file)
            .field("sgemm", &self.sgemm_symbol)
            .field("set_threads", &self.set_threads.is_some())
            .field("config", &self.config)
            .finish()
    }
}

impl BlasLibrary {
    /// Opens `file` (a name the dynamic loader searches for, or a path) and resolves its GEMM.
    pub fn open(file: &str) -> Result<BlasLibrary> {
        // SAFETY: opening a shared library runs its initialisers. The candidates are BLAS
        // libraries (or a library the user named on purpose), whose initialisers only set up
        // their own state; this is the documented risk of choosing a library at run time.
        let library = unsafe { Library::new(file) }
            .map_err(|e| Error::Backend(format!("cannot open {file}: {e}")))?;
        let (sgemm_symbol, sgemm) = resolve_sgemm(&library).ok_or_else(|| {
            Error::Backend(format!(
                "{file} has no cblas_sgemm (nor an OpenBLAS 64-bit-integer variant of it)"
            ))
        })?;
        let set_threads = [
            "openblas_set_num_threads",
            "scipy_openblas_set_num_threads64_",
            "openblas_set_num_threads64_",
        ]
        .iter()
        .find_map(|name| {
            // SAFETY: every name listed is OpenBLAS's `void f(int)` thread setter.
            unsafe { library.get::<SetThreads>(name.as_bytes()) }
                .ok()
                .map(|s| *s)
        });
        let config = ["openblas_get_config", "scipy_openblas_get_config64_"]
            .iter()
            .find_map(|name| {
                // SAFETY: OpenBLAS's `const char *f(void)` returning a static string.
                let get = unsafe { library.get::<GetConfig>(name.as_bytes()) }.ok()?;
                // SAFETY: the symbol has the type above; it takes no arguments.
                let text = unsafe { get() };
                if text.is_null() {
                    return None;
                }
                // SAFETY: a non-null result is a NUL-terminated string owned by the library,
                // which stays loaded while we copy it.
                Some(
                    unsafe { CStr::from_ptr(text) }
                        .to_string_lossy()
                        .trim()
                        .to_owned(),
                )
            });
        Ok(BlasLibrary {
            _library: library,
            file: file.to_owned(),
            sgemm_symbol,
            sgemm,
            set_threads,
            config,
        })
    }

    /// The file name or path the library was opened by.
    pub fn file(&self) -> &str {
        &self.file
    }

    /// The GEMM symbol in use (`cblas_sgemm`, or a 64-bit-integer variant).
    pub fn sgemm_symbol(&self) -> &str {
        self.sgemm_symbol
    }

    /// OpenBLAS's build description, when the library is OpenBLAS.
    pub fn config(&self) -> Option<&str> {
        self.config.as_deref()
    }

    /// Whether the library's thread count can be set.
    pub fn can_set_threads(&self) -> bool {
        self.set_threads.is_some()
    }

    /// Sets the library's thread count (process-wide, as the library keeps it); a no-op when
    /// the library has no setter.
    pub fn set_threads(&self, n_threads: usize) {
        if let Some(set) = self.set_threads {
            let n = c_int::try_from(n_threads.max(1)).unwrap_or(c_int::MAX);
            // SAFETY: the setter has the type it was resolved with and accepts any positive
            // count; the library stays loaded (`self` owns it).
            unsafe { set(n) };
        }
    }

    /// A one-line description: the file and, for OpenBLAS, its build.
    pub fn describe(&self) -> String {
        match &self.config {
            Some(config) => format!("BLAS ({}, {config})", self.file),
            None => format!("BLAS ({}, {})", self.file, self.sgemm_symbol),
        }
    }

    /// Runs one GEMM.
    ///
    /// # Safety
    /// The pointers must address matrices of the stated sizes and strides (`op(A)` is
    /// `m × k`, `op(B)` is `k × n`, `C` is `m × n`, all row-major), `C` must be writable and
    /// not overlap `A` or `B`, and no one else may touch `C` during the call.
    pub(crate) unsafe fn sgemm(&self, call: &GemmCall) -> Result<()> {
        let trans = |t: bool| if t { CBLAS_TRANS } else { CBLAS_NO_TRANS };
        // The LP64 and ILP64 entry points differ only in their integer type.
        macro_rules! call_sgemm {
            ($f:expr, $int:ty) => {{
                let int = |v: usize| {
                    <$int>::try_from(v).map_err(|_| {
                        Error::InvalidArgument(format!(
                            "{v} does not fit the {}-bit sizes of {}",
                            <$int>::BITS,
                            self.file
                        ))
                    })
                };
                let (m, n, k) = (int(call.m)?, int(call.n)?, int(call.k)?);
                let (lda, ldb, ldc) = (int(call.lda)?, int(call.ldb)?, int(call.ldc)?);
                // SAFETY: the sizes fit the library's integers, and the caller guarantees
                // the pointers and strides describe valid matrices (see above).
                unsafe {
                    $f(
                        CBLAS_ROW_MAJOR,
                        trans(call.trans_a),
                        trans(call.trans_b),
                        m,
                        n,
                        k,
                        1.0,
                        call.a,
                        lda,
                        call.b,
                        ldb,
                        0.0,
                        call.c,
                        ldc,
                    )
                };
            }};
        }
        match self.sgemm {
            Sgemm::Lp64(f) => call_sgemm!(f, i32),
            Sgemm::Ilp64(f) => call_sgemm!(f, i64),
        }
        Ok(())
    }
}

fn resolve_sgemm(library: &Library) -> Option<(&'static str, Sgemm)> {
    // SAFETY: `cblas_sgemm` has the standard CBLAS signature with 32-bit integers.
    if let Ok(f) = unsafe { library.get::<SgemmLp64>(b"cblas_sgemm") } {
        return Some(("cblas_sgemm", Sgemm::Lp64(*f)));
    }
    for name in ["scipy_cblas_sgemm64_", "cblas_sgemm64_"] {
        // SAFETY: OpenBLAS's suffixed `*64_` symbols are its INTERFACE64 builds, whose CBLAS
        // integers are 64-bit.
        if let Ok(f) = unsafe { library.get::<SgemmIlp64>(name.as_bytes()) } {
            return Some((name, Sgemm::Ilp64(*f)));
        }
    }
    None
}

/// An OpenBLAS already mapped into this process (e.g. the copy numpy ships), found through
/// `/proc/self/maps`. Opening it again by path reuses the loaded copy.
fn mapped_openblas() -> Vec<String> {
    let Ok(maps) = std::fs::read_to_string("/proc/self/maps") else {
        return Vec::new();
    };
    let mut found: Vec<String> = Vec::new();
    for path in maps
        .lines()
        .filter_map(|line| line.split_whitespace().nth(5))
    {
        let file = path.rsplit('/').next().unwrap_or(path);
        if file.contains("openblas") && file.contains(".so") && !found.iter().any(|p| p == path) {
            found.push(path.to_owned());
        }
    }
    found
}

/// Values of [`BLAS_LIB_ENV`] that turn the BLAS backend off (no device).
pub const DISABLE_VALUES: &[&str] = &["none", "off", "0"];

/// Tries every candidate in order; the first that opens and has a GEMM wins. The error names
/// everything tried.
pub fn find_library() -> Result<BlasLibrary> {
    let mut candidates: Vec<String> = Vec::new();
    if let Ok(file) = std::env::var(BLAS_LIB_ENV) {
        let file = file.trim();
        if DISABLE_VALUES.iter().any(|v| file.eq_ignore_ascii_case(v)) {
            return Err(Error::Backend(format!(
                "BLAS is disabled by {BLAS_LIB_ENV}={file}"
            )));
        }
        if !file.is_empty() {
            candidates.push(file.to_owned());
        }
    }
    candidates.extend(DEFAULT_CANDIDATES.iter().map(|s| (*s).to_owned()));
    candidates.extend(mapped_openblas());
    let mut failures = Vec::new();
    for file in &candidates {
        match BlasLibrary::open(file) {
            Ok(library) => {
                log::debug!(
                    "BLAS: using {file} ({}, thread control: {})",
                    library.sgemm_symbol,
                    if library.can_set_threads() {
                        "yes"
                    } else {
                        "no"
                    }
                );
                return Ok(library);
            }
            Err(e) => {
                log::debug!("BLAS: {e}");
                failures.push(e.to_string());
            }
        }
    }
    Err(Error::Backend(format!(
        "no BLAS library found (set {BLAS_LIB_ENV} to one); tried: {}",
        failures.join("; ")
    )))
}

/// The process's BLAS library, searched for once; the error says why there is none.
pub fn library() -> std::result::Result<Arc<BlasLibrary>, String> {
    static LIBRARY: OnceLock<std::result::Result<Arc<BlasLibrary>, String>> = OnceLock::new();
    LIBRARY
        .get_or_init(|| match find_library() {
            Ok(library) => {
                log::info!("BLAS backend: {}", library.describe());
                Ok(Arc::new(library))
            }
            Err(e) => {
                log::info!("BLAS backend has no device: {e}");
                Err(e.to_string())
            }
        })
        .clone()
}
