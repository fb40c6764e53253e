//! The BLAS device, its backend and its registration.

use std::any::Any;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use super::gemm;
use super::library::{self, BlasLibrary};
use crate::backend::{Backend, Guid};
use crate::buffer::BufferType;
use crate::device::{BackendParams, Device, DeviceCaps, DeviceType};
use crate::dtype::DType;
use crate::error::{Error, Result, Status};
use crate::graph::Graph;
use crate::host::RawTensor;
use crate::ops::Op;
use crate::pool::default_n_threads;
use crate::pool::{Threadpool, ThreadpoolParams};
use crate::registration::{Extension, Registration};
use crate::tensor::Tensor;

/// The BLAS backend's GUID.
pub const BLAS_GUID: Guid = *b"ferrograph-blas1";

/// The registration's and the device's name.
pub const BLAS_NAME: &str = "BLAS";

/// ggml's rule for when a matrix product is worth a BLAS call: the result's two sizes and the
/// inner size must all reach this.
pub const DEFAULT_MIN_DIM: usize = 32;

/// The backend-parameter key that overrides the size threshold for one backend
/// (`"min_dim=64"`).
pub const MIN_DIM_PARAM: &str = "min_dim";

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|p| p.into_inner())
}

fn is_weight_type(dtype: DType) -> bool {
    matches!(
        dtype,
        DType::F32 | DType::F16 | DType::BF16 | DType::Q8_0 | DType::Q4_0
    )
}

/// Whether a BLAS backend computes `op` when products must reach `min_dim` in every size.
pub fn supports_op_with(op: &Tensor, min_dim: usize) -> bool {
    let srcs = op.srcs();
    match op.op() {
        Op::None | Op::View | Op::Reshape | Op::Permute { .. } | Op::Transpose => true,
        Op::MulMat => {
            let (Some(a), Some(b)) = (srcs.first(), srcs.get(1)) else {
                return false;
            };
            let ne = op.ne();
            is_weight_type(a.dtype())
                && b.dtype() == DType::F32
                && op.dtype() == DType::F32
                && a.is_contiguous()
                && b.is_contiguous()
                && ne[0] >= min_dim
                && ne[1] >= min_dim
                && b.ne()[0] >= min_dim
        }
        Op::OutProd => {
            let (Some(a), Some(b)) = (srcs.first(), srcs.get(1)) else {
                return false;
            };
            a.dtype() == DType::F32
                && b.dtype() == DType::F32
                && op.dtype() == DType::F32
                && a.is_contiguous()
                && (b.is_contiguous() || b.is_transposed())
        }
        _ => false,
    }
}

/// The BLAS device: products on the host through the process's BLAS library, on the CPU's
/// memory. It has no device when no library was found.
#[derive(Debug)]
pub struct BlasDevice {
    library: Arc<BlasLibrary>,
    min_dim: AtomicUsize,
}

impl BlasDevice {
    /// A device on `library`, with the default size threshold.
    pub fn new(library: Arc<BlasLibrary>) -> BlasDevice {
        BlasDevice {
            library,
            min_dim: AtomicUsize::new(DEFAULT_MIN_DIM),
        }
    }

    /// The library products go through.
    pub fn library(&self) -> &Arc<BlasLibrary> {
        &self.library
    }

    /// The size threshold new backends start with and [`Device::supports_op`] applies.
    pub fn min_dim(&self) -> usize {
        self.min_dim.load(Ordering::Relaxed)
    }

    /// Sets the size threshold (0 or 1 accepts every product).
    pub fn set_min_dim(&self, min_dim: usize) {
        self.min_dim.store(min_dim, Ordering::Relaxed);
    }
}

impl Device for BlasDevice {
    fn name(&self) -> &str {
        BLAS_NAME
    }

    fn description(&self) -> String {
        self.library.describe()
    }

    fn memory(&self) -> (usize, usize) {
        // Like ggml's: the device owns no memory of its own; it computes in host memory.
        (0, 0)
    }

    fn device_type(&self) -> DeviceType {
        DeviceType::Accel
    }

    fn caps(&self) -> DeviceCaps {
        DeviceCaps {
            async_ops: false,
            host_buffer: false,
            buffer_from_host_ptr: true,
            events: false,
        }
    }

    fn registration_name(&self) -> &str {
        BLAS_NAME
    }

    fn init_backend(&self, params: &BackendParams) -> Result<Arc<dyn Backend>> {
        let mut min_dim = self.min_dim();
        for (key, value) in &params.extra {
            if key == MIN_DIM_PARAM {
                min_dim = value.parse().map_err(|_| {
                    Error::InvalidArgument(format!(
                        "{MIN_DIM_PARAM} must be a non-negative integer, got {value:?}"
                    ))
                })?;
            }
        }
        let backend = BlasBackend::new(
            self.library.clone(),
            params.n_threads.unwrap_or_else(default_n_threads),
        )?;
        backend.set_min_dim(min_dim);
        Ok(Arc::new(backend))
    }

    ferrograph_base::host_memory_device!();

    fn supports_op(&self, op: &Tensor) -> bool {
        supports_op_with(op, self.min_dim())
    }
}

/// A BLAS backend: computes matrix products with the library's GEMM. Weight conversion runs
/// on a pool of `n_threads` workers, and the library is told to use as many threads.
pub struct BlasBackend {
    device: Arc<BlasDevice>,
    pool: Mutex<Arc<Threadpool>>,
    min_dim: AtomicUsize,
    scratch: Mutex<Vec<f32>>,
}

impl BlasBackend {
    /// A backend on `library` with `n_threads` threads.
    pub fn new(library: Arc<BlasLibrary>, n_threads: usize) -> Result<BlasBackend> {
        if n_threads == 0 {
            return Err(Error::InvalidArgument(
                "a BLAS backend needs at least one thread".into(),
            ));
        }
        let device = match shared_device() {
            Some(device) if Arc::ptr_eq(device.library(), &library) => device,
            _ => Arc::new(BlasDevice::new(library)),
        };
        Ok(BlasBackend {
            min_dim: AtomicUsize::new(device.min_dim()),
            device,
            pool: Mutex::new(Threadpool::new(&ThreadpoolParams::new(n_threads))?),
            scratch: Mutex::new(Vec::new()),
        })
    }

    /// Threads used for conversions and by the library.
    pub fn n_threads(&self) -> usize {
        lock(&self.pool).n_threads()
    }

    /// Sets the thread count (ggml's `set_n_threads` for BLAS).
    pub fn set_n_threads(&self, n_threads: usize) -> Result<()> {
        crate::pool::resize_pool(&self.pool, n_threads, "BLAS")
    }

    /// This backend's size threshold for matrix products.
    pub fn min_dim(&self) -> usize {
        self.min_dim.load(Ordering::Relaxed)
    }

    /// Sets this backend's size threshold (0 or 1 accepts every product).
    pub fn set_min_dim(&self, min_dim: usize) {
        self.min_dim.store(min_dim, Ordering::Relaxed);
    }

    fn compute_node(&self, node: &Tensor, pool: &Threadpool) -> Result<()> {
        let op = node.op();
        if matches!(op, Op::None) || op.is_view_op() {
            return Ok(());
        }
        if !matches!(op, Op::MulMat | Op::OutProd) {
            return Err(Error::unsupported(format!(
                "the BLAS backend computes only MUL_MAT and OUT_PROD, not {} ({})",
                op.display_name(),
                node.label()
            )));
        }
        let srcs = node.srcs();
        let (Some(a), Some(b)) = (srcs.first(), srcs.get(1)) else {
            return Err(Error::unsupported(format!(
                "{} has fewer than two operands",
                node.label()
            )));
        };
        if node.is_empty() {
            return Ok(());
        }
        let (dst, a, b) = (
            RawTensor::new(node)?,
            RawTensor::new(a)?,
            RawTensor::new(b)?,
        );
        let library = self.device.library();
        match op {
            Op::MulMat => {
                let mut scratch = lock(&self.scratch);
                gemm::mul_mat(library, pool.rayon()?, dst, a, b, &mut scratch)
            }
            _ => gemm::out_prod(library, dst, a, b),
        }
    }
}

impl Backend for BlasBackend {
    fn guid(&self) -> Guid {
        BLAS_GUID
    }

    fn name(&self) -> &str {
        BLAS_NAME
    }

    fn device(&self) -> Arc<dyn Device> {
        self.device.clone()
    }

    fn as_any(&self) -> &dyn Any {
        self
    }

    fn graph_compute_async(&self, graph: &Graph) -> Result<Status> {
        let pool = lock(&self.pool).clone();
        // The library's thread count is process-wide; set it for this computation, as ggml
        // does before each graph.
        self.device.library().set_threads(pool.n_threads());
        for node in graph.nodes() {
            self.compute_node(node, &pool)?;
        }
        crate::tensor::mark_computed(graph.nodes());
        Ok(Status::Success)
    }

    fn supports_op(&self, op: &Tensor) -> bool {
        supports_op_with(op, self.min_dim())
    }

    fn supports_buft(&self, buffer_type: &dyn BufferType) -> bool {
        buffer_type.is_host()
    }

    fn offload_op(&self, _op: &Tensor) -> bool {
        false
    }
}

/// Returns the BLAS backend inside `backend`, or an error naming what it is.
pub fn as_blas(backend: &dyn Backend) -> Result<&BlasBackend> {
    backend
        .as_any()
        .downcast_ref::<BlasBackend>()
        .ok_or_else(|| Error::Backend(format!("backend {} is not a BLAS backend", backend.name())))
}

/// The process's BLAS device, or `None` when no BLAS library was found (the reason is logged
/// once and available from [`super::unavailable_reason`]).
pub fn shared_device() -> Option<Arc<BlasDevice>> {
    static DEVICE: OnceLock<Option<Arc<BlasDevice>>> = OnceLock::new();
    DEVICE
        .get_or_init(|| {
            library::library()
                .ok()
                .map(|l| Arc::new(BlasDevice::new(l)))
        })
        .clone()
}

/// The BLAS registration: one device when a BLAS library was found, none otherwise.
#[derive(Debug, Default)]
pub struct BlasRegistration;

fn ext_set_threads(backend: &dyn Backend, n_threads: usize) -> Result<()> {
    as_blas(backend)?.set_n_threads(n_threads)
}

fn ext_features() -> Vec<(String, String)> {
    match library::library() {
        Ok(library) => {
            let mut out = vec![
                ("BLAS_LIBRARY".to_owned(), library.file().to_owned()),
                ("BLAS_SGEMM".to_owned(), library.sgemm_symbol().to_owned()),
            ];
            if let Some(config) = library.config() {
                out.push(("BLAS_CONFIG".to_owned(), config.to_owned()));
            }
            out
        }
        Err(_) => Vec::new(),
    }
}

impl Registration for BlasRegistration {
    fn name(&self) -> &str {
        BLAS_NAME
    }

    fn devices(&self) -> Vec<Arc<dyn Device>> {
        match shared_device() {
            Some(device) => vec![device as Arc<dyn Device>],
            None => Vec::new(),
        }
    }

    fn proc_address(&self, name: &str) -> Option<Extension> {
        match name {
            "set_n_threads" | "ggml_backend_set_n_threads" => {
                Some(Extension::SetThreadCount(ext_set_threads))
            }
            "get_features" | "ggml_backend_get_features" => Some(Extension::Features(ext_features)),
            "dev_get_extra_bufts" => Some(Extension::ExtraBufferTypes(Vec::new)),
            _ => None,
        }
    }
}
