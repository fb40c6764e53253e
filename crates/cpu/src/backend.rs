//! The CPU device, its backend (a persistent thread pool per backend), and its registration.

use std::any::Any;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, RwLock};

use crate::compute::{self, ComputeOptions};
use crate::device::{BackendParams, Device, DeviceCaps, DeviceType};
use crate::error::{Error, Result, Status};
use crate::event::{Event, HostEvent};
use crate::graph::Graph;
use crate::pool::{Threadpool, ThreadpoolParams};
use crate::registration::{AbortCallback, Extension, Registration};
use crate::sysinfo;
use crate::tensor::Tensor;
use ferrograph_base::backend::{Backend, GraphPlan, Guid};

/// The CPU backend's GUID.
pub const CPU_GUID: Guid = *b"ferrograph-cpu01";

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|p| p.into_inner())
}

/// A process-wide abort callback, polled by every CPU backend beside its own.
fn global_abort() -> &'static RwLock<Option<AbortCallback>> {
    static GLOBAL: OnceLock<RwLock<Option<AbortCallback>>> = OnceLock::new();
    GLOBAL.get_or_init(|| RwLock::new(None))
}

/// Installs (or clears) the process-wide abort callback.
pub fn set_global_abort_callback(callback: Option<AbortCallback>) {
    *global_abort().write().unwrap_or_else(|p| p.into_inner()) = callback;
}

pub use crate::pool::default_n_threads;

/// The host CPU as a device.
#[derive(Debug, Default)]
pub struct CpuDevice;

impl CpuDevice {
    /// The shared instance.
    pub fn shared() -> Arc<CpuDevice> {
        static DEVICE: OnceLock<Arc<CpuDevice>> = OnceLock::new();
        DEVICE
            .get_or_init(|| {
                let device = Arc::new(CpuDevice);
                crate::buffer::set_host_device(device.clone());
                device
            })
            .clone()
    }
}

impl Device for CpuDevice {
    fn name(&self) -> &str {
        "CPU"
    }

    fn description(&self) -> String {
        sysinfo::cpu_model_name()
    }

    fn memory(&self) -> (usize, usize) {
        sysinfo::system_memory()
    }

    fn device_type(&self) -> DeviceType {
        DeviceType::Cpu
    }

    fn caps(&self) -> DeviceCaps {
        DeviceCaps {
            async_ops: false,
            host_buffer: false,
            buffer_from_host_ptr: true,
            // `event_new` gives host events, so say so (ggml's CPU device has none, but a
            // capability that disagrees with `event_new` misleads callers).
            events: true,
        }
    }

    fn registration_name(&self) -> &str {
        "CPU"
    }

    fn init_backend(&self, params: &BackendParams) -> Result<Arc<dyn Backend>> {
        Ok(Arc::new(CpuBackend::new(
            params.n_threads.unwrap_or_else(default_n_threads),
        )?))
    }

    ferrograph_base::host_memory_device!(|buffer_type| crate::repack::is_repack(buffer_type));

    fn supports_op(&self, op: &Tensor) -> bool {
        compute::supports_op(op)
    }

    fn event_new(&self) -> Result<Arc<dyn Event>> {
        Ok(HostEvent::new())
    }
}

/// A CPU backend: a persistent pool of worker threads kept for the backend's life (or one
/// shared with other backends through [`CpuBackend::set_threadpool`]).
pub struct CpuBackend {
    pool: Mutex<Arc<Threadpool>>,
    abort: Mutex<Option<AbortCallback>>,
    use_reference: AtomicBool,
    /// The epoch of the last graph computed successfully (every node's kernel checked), so
    /// replaying it — a language model's decoding graph, once per token — skips the check.
    checked_epoch: AtomicU64,
    /// Scratch kept between computes (converted activations of matrix products).
    workspace: Mutex<compute::Workspace>,
}

/// A prepared CPU computation (ggml's CPU graph plan).
pub struct CpuGraphPlan {
    graph: Graph,
    work_size: usize,
    n_threads: usize,
}

impl CpuGraphPlan {
    /// Threads the plan was made for.
    pub fn n_threads(&self) -> usize {
        self.n_threads
    }
}

impl GraphPlan for CpuGraphPlan {
    fn graph(&self) -> &Graph {
        &self.graph
    }

    fn work_size(&self) -> usize {
        self.work_size
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

impl CpuBackend {
    /// A backend with `n_threads` workers.
    pub fn new(n_threads: usize) -> Result<CpuBackend> {
        // Checked here, not only by the bindings: 1 to MAX_THREADS.
        crate::device::check_n_threads(n_threads)?;
        Ok(CpuBackend {
            pool: Mutex::new(Threadpool::new(&ThreadpoolParams::new(n_threads))?),
            abort: Mutex::new(None),
            use_reference: AtomicBool::new(false),
            checked_epoch: AtomicU64::new(0),
            workspace: Mutex::new(compute::Workspace::default()),
        })
    }

    /// Threads in the pool.
    pub fn n_threads(&self) -> usize {
        lock(&self.pool).n_threads()
    }

    /// Replaces the pool with one of `n_threads` workers (no-op if unchanged).
    pub fn set_n_threads(&self, n_threads: usize) -> Result<()> {
        crate::pool::resize_pool(&self.pool, n_threads, "CPU")
    }

    /// Runs computations on `threadpool` (which other backends may share).
    pub fn set_threadpool(&self, threadpool: Arc<Threadpool>) {
        *lock(&self.pool) = threadpool;
    }

    /// The thread pool computations run on.
    pub fn threadpool(&self) -> Arc<Threadpool> {
        lock(&self.pool).clone()
    }

    /// Installs (or clears) the abort callback polled between nodes.
    pub fn set_abort_callback(&self, callback: Option<AbortCallback>) {
        *lock(&self.abort) = callback;
    }

    /// Selects the scalar reference kernels (for testing) instead of the fast ones.
    pub fn set_use_reference(&self, use_reference: bool) {
        self.use_reference.store(use_reference, Ordering::Relaxed);
    }

    /// Whether the reference kernels are selected.
    pub fn use_reference(&self) -> bool {
        self.use_reference.load(Ordering::Relaxed)
    }

    fn run(&self, graph: &Graph) -> Result<Status> {
        self.run_with(graph, |graph, pool, options, abort, workspace| {
            compute::compute_graph_in(graph, pool, options, abort, workspace)
                .map(|status| (status, ()))
        })
        .map(|(status, ())| status)
    }

    /// Runs `walk` (a compute loop) on `graph` with this backend's pool, options, abort
    /// callbacks and scratch; remembers a successful graph's checked ops.
    fn run_with<T>(
        &self,
        graph: &Graph,
        walk: impl FnOnce(
            &Graph,
            &Threadpool,
            &ComputeOptions,
            Option<&(dyn Fn() -> bool + Sync)>,
            &mut compute::Workspace,
        ) -> Result<(Status, T)>,
    ) -> Result<(Status, T)> {
        let pool = self.threadpool();
        // Epoch 0 is every empty graph's: nothing to remember.
        let epoch = graph.epoch();
        let options = ComputeOptions {
            use_reference: self.use_reference(),
            ops_checked: epoch != 0 && self.checked_epoch.load(Ordering::Relaxed) == epoch,
        };
        let own = lock(&self.abort).clone();
        let global = global_abort()
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        let abort =
            move || own.as_ref().is_some_and(|f| f()) || global.as_ref().is_some_and(|f| f());
        // Computes on one backend from several threads take turns on the pool; one that
        // finds the scratch taken uses its own.
        let mut own_workspace = compute::Workspace::default();
        let mut kept = self.workspace.try_lock().ok();
        let workspace = kept.as_deref_mut().unwrap_or(&mut own_workspace);
        let (status, out) = walk(graph, &pool, &options, Some(&abort), workspace)?;
        if status == Status::Success {
            self.checked_epoch.store(epoch, Ordering::Relaxed);
        }
        Ok((status, out))
    }
}

impl Backend for CpuBackend {
    fn guid(&self) -> Guid {
        CPU_GUID
    }

    fn name(&self) -> &str {
        "CPU"
    }

    fn device(&self) -> Arc<dyn Device> {
        CpuDevice::shared()
    }

    fn as_any(&self) -> &dyn Any {
        self
    }

    fn graph_plan_create(&self, graph: &Graph) -> Result<Box<dyn GraphPlan>> {
        let n_threads = self.n_threads();
        Ok(Box::new(CpuGraphPlan {
            graph: graph.clone(),
            work_size: compute::work_size(graph, n_threads),
            n_threads,
        }))
    }

    fn graph_compute_async(&self, graph: &Graph) -> Result<Status> {
        self.run(graph)
    }

    fn graph_compute_timed(&self, graph: &Graph) -> Result<Option<(Status, Vec<f64>)>> {
        self.run_with(graph, compute::compute_graph_timed).map(Some)
    }
}

/// Returns the CPU backend inside `backend`, or an error naming what it is.
pub fn as_cpu(backend: &dyn Backend) -> Result<&CpuBackend> {
    backend
        .as_any()
        .downcast_ref::<CpuBackend>()
        .ok_or_else(|| Error::Backend(format!("backend {} is not a CPU backend", backend.name())))
}

/// The CPU registration.
pub struct CpuRegistration;

fn ext_set_threads(backend: &dyn Backend, n_threads: usize) -> Result<()> {
    as_cpu(backend)?.set_n_threads(n_threads)
}

fn ext_set_abort(backend: &dyn Backend, callback: Option<AbortCallback>) -> Result<()> {
    as_cpu(backend)?.set_abort_callback(callback);
    Ok(())
}

fn ext_features() -> Vec<(String, String)> {
    let features = crate::features::CpuFeatures::detect();
    let mut out: Vec<(String, String)> = features
        .as_pairs()
        .into_iter()
        .filter(|(_, on)| *on)
        .map(|(name, _)| (name.to_uppercase(), "1".to_owned()))
        .collect();
    out.push((
        "SIMD_PATH".to_owned(),
        crate::convert::simd_path().to_owned(),
    ));
    out
}

/// The CPU device's extra buffer types: the repacking type (weights in its kernels' layout).
fn extra_buffer_types() -> Vec<Arc<dyn crate::buffer::BufferType>> {
    vec![crate::repack::RepackBufferType::shared()]
}

impl Registration for CpuRegistration {
    fn name(&self) -> &str {
        "CPU"
    }

    fn devices(&self) -> Vec<Arc<dyn Device>> {
        vec![CpuDevice::shared()]
    }

    fn proc_address(&self, name: &str) -> Option<Extension> {
        match name {
            "set_n_threads" | "ggml_backend_set_n_threads" => {
                Some(Extension::SetThreadCount(ext_set_threads))
            }
            "set_abort_callback" => Some(Extension::SetAbortCallback(ext_set_abort)),
            "get_features" | "ggml_backend_get_features" => Some(Extension::Features(ext_features)),
            "dev_get_extra_bufts" => Some(Extension::ExtraBufferTypes(extra_buffer_types)),
            _ => None,
        }
    }
}

/// Computes `graph` on the host with `n_threads` threads, without a backend object (ggml's
/// `graph_compute_with_ctx`); every tensor must already have host memory, e.g. from a
/// `Context::new(false)`. Pools are kept per thread count and reused.
pub fn graph_compute_with_ctx(graph: &Graph, n_threads: usize) -> Result<Status> {
    static POOLS: OnceLock<Mutex<Vec<Arc<Threadpool>>>> = OnceLock::new();
    crate::device::check_n_threads(n_threads)?;
    let pool = {
        let mut pools = lock(POOLS.get_or_init(|| Mutex::new(Vec::new())));
        match pools.iter().find(|p| p.n_threads() == n_threads) {
            Some(pool) => pool.clone(),
            None => {
                let pool = Threadpool::new(&ThreadpoolParams::new(n_threads))?;
                pools.push(pool.clone());
                pool
            }
        }
    };
    let global = global_abort()
        .read()
        .unwrap_or_else(|p| p.into_inner())
        .clone();
    let abort = move || global.as_ref().is_some_and(|f| f());
    compute::compute_graph(graph, &pool, &ComputeOptions::default(), Some(&abort))
}
