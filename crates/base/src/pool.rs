//! Persistent thread pools (ggml's threadpool API) that the computing thread joins: the
//! parallel-for below every layer that splits work (the CPU kernels, row conversions, BLAS),
//! with the thread-count rules ([`MAX_THREADS`], [`check_n_threads`], [`default_n_threads`]).
//!
//! A [`Threadpool`] of `n_threads` threads starts `n_threads - 1` workers that live until the
//! last handle is dropped; several CPU backends may share one. The thread that computes on the
//! pool ([`Threadpool::run`], used by `compute_graph`) is its thread 0 for the call: it walks
//! the graph and runs each node's kernel itself. A kernel splitting its work
//! (`par_ranges` in the CPU kernels) publishes a job (a closure and a count of fixed
//! chunks); every thread, the caller included, claims chunks through one atomic counter until
//! none is left, and the caller waits for the chunks others took. Nothing ever waits for a
//! worker to wake up: a job the caller finishes alone is done, so a small graph costs no
//! hand-over at all, and the chunks (not the threads that run them) fix the results.
//!
//! Idle workers spin between jobs (up to `poll` × 2 µs while a computation runs, and up to
//! `poll` × 20 µs after it has returned, counted from its end, so a caller computing one small
//! graph after another finds them awake), then sleep until the next job. The computing thread
//! spins as long for the chunks others are finishing before it sleeps. [`Threadpool::pause`]
//! makes the workers sleep at once; the next computation resumes the pool, as ggml's does.

use std::cell::{Cell, UnsafeCell};
use std::ops::Range;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock, TryLockError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::error::{Error, Result};

/// The most threads a backend or thread pool may be asked for (ggml's `GGML_MAX_N_THREADS`):
/// a larger count is a mistake (it would try to start that many OS threads), not a request.
pub const MAX_THREADS: usize = 512;

/// Checks a thread count: 1 to [`MAX_THREADS`].
pub fn check_n_threads(n_threads: usize) -> Result<usize> {
    if n_threads == 0 || n_threads > MAX_THREADS {
        return Err(Error::InvalidArgument(format!(
            "n_threads must be between 1 and {MAX_THREADS}, got {n_threads}"
        )));
    }
    Ok(n_threads)
}

/// The default thread count: the usable hardware threads.
pub fn default_n_threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// Scheduling priority of pool threads (ggml's `ggml_sched_priority`), applied to each worker
/// when it starts; a priority the OS refuses (raising one needs privileges) is recorded in
/// [`Threadpool::placement_errors`] and the thread keeps the default.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ThreadPriority {
    /// Below normal (nice +5).
    Low,
    /// OS default.
    #[default]
    Normal,
    /// Above normal (nice -5).
    Medium,
    /// High (nice -10).
    High,
    /// Real-time (the FIFO scheduling class).
    Realtime,
}

impl ThreadPriority {
    /// ggml's numeric value (-1 low to 3 real-time).
    pub fn code(self) -> i32 {
        match self {
            ThreadPriority::Low => -1,
            ThreadPriority::Normal => 0,
            ThreadPriority::Medium => 1,
            ThreadPriority::High => 2,
            ThreadPriority::Realtime => 3,
        }
    }

    /// The priority of ggml's numeric value.
    pub fn from_code(code: i32) -> Result<ThreadPriority> {
        Ok(match code {
            -1 => ThreadPriority::Low,
            0 => ThreadPriority::Normal,
            1 => ThreadPriority::Medium,
            2 => ThreadPriority::High,
            3 => ThreadPriority::Realtime,
            _ => {
                return Err(Error::InvalidArgument(format!(
                    "thread priority must be -1 (low) to 3 (real-time), got {code}"
                )))
            }
        })
    }
}

/// Parameters of a thread pool (ggml's `ggml_threadpool_params`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ThreadpoolParams {
    /// Worker threads.
    pub n_threads: usize,
    /// Scheduling priority of the workers.
    pub priority: ThreadPriority,
    /// Busy-wait level before sleeping (0-100): idle workers spin up to `poll` × 2 µs between
    /// jobs of a computation and up to `poll` × 20 µs after it returns before they sleep (0:
    /// sleep at once).
    pub poll: u32,
    /// Pin each worker to one CPU of the mask (worker `i` to the `i`-th allowed CPU, round
    /// robin) instead of letting every worker run on any CPU of the mask.
    pub strict_cpu: bool,
    /// The CPUs the workers may run on (`cpumask[c]` for CPU `c`); empty or all false means
    /// every CPU the process may use. At most [`MAX_THREADS`] entries.
    pub cpumask: Vec<bool>,
    /// Start paused.
    pub paused: bool,
}

impl Default for ThreadpoolParams {
    fn default() -> Self {
        ThreadpoolParams::new(default_n_threads())
    }
}

impl ThreadpoolParams {
    /// The defaults for `n_threads` threads (ggml's `threadpool_params_default`).
    pub fn new(n_threads: usize) -> Self {
        ThreadpoolParams {
            n_threads,
            priority: ThreadPriority::Normal,
            poll: 50,
            strict_cpu: false,
            cpumask: Vec::new(),
            paused: false,
        }
    }

    /// Resets `self` to the defaults for `n_threads` (ggml's `threadpool_params_init`).
    pub fn init(&mut self, n_threads: usize) {
        *self = ThreadpoolParams::new(n_threads);
    }

    /// Whether two parameter sets describe interchangeable pools (ggml's
    /// `threadpool_params_match`): everything but `paused`, with an empty mask equal to an
    /// all-false one.
    pub fn matches(&self, other: &ThreadpoolParams) -> bool {
        self.n_threads == other.n_threads
            && self.priority == other.priority
            && self.poll == other.poll
            && self.strict_cpu == other.strict_cpu
            && self.allowed_cpus() == other.allowed_cpus()
    }

    /// The CPUs of the mask, in order (empty: no restriction).
    pub fn allowed_cpus(&self) -> Vec<usize> {
        (0..self.cpumask.len())
            .filter(|&c| self.cpumask[c])
            .collect()
    }

    /// How many CPUs the pool's threads may share: the mask's (at most those the process may
    /// use), or every CPU the process may use without a mask.
    pub fn cpus_for_workers(&self) -> usize {
        let process = default_n_threads();
        match self.allowed_cpus().len() {
            0 => process,
            masked => masked.min(process),
        }
    }

    /// Checks the ranges: 1 to MAX_THREADS threads, poll at most 100, a mask of at most
    /// MAX_THREADS CPUs.
    pub fn check(&self) -> Result<()> {
        check_n_threads(self.n_threads)?;
        if self.poll > 100 {
            return Err(Error::InvalidArgument(format!(
                "poll must be 0 to 100, got {}",
                self.poll
            )));
        }
        if self.cpumask.len() > MAX_THREADS {
            return Err(Error::InvalidArgument(format!(
                "a CPU mask has at most {} entries, got {}",
                MAX_THREADS,
                self.cpumask.len()
            )));
        }
        Ok(())
    }
}

/// Applies `params`' CPU placement and priority to the calling thread, worker `index` of its
/// pool; returns what the OS refused.
fn place_current_thread(index: usize, params: &ThreadpoolParams) -> Vec<String> {
    let mut refused = Vec::new();
    let mut cpus = params.allowed_cpus();
    if params.strict_cpu && cpus.is_empty() {
        cpus = (0..default_n_threads()).collect();
    }
    if params.strict_cpu && !cpus.is_empty() {
        cpus = vec![cpus[index % cpus.len()]];
    }
    if !cpus.is_empty() {
        if let Err(e) = set_affinity(&cpus) {
            refused.push(format!("worker {index}: CPUs {cpus:?}: {e}"));
        }
    }
    if params.priority != ThreadPriority::Normal {
        if let Err(e) = set_priority(params.priority) {
            refused.push(format!(
                "worker {index}: priority {:?}: {e}",
                params.priority
            ));
        }
    }
    refused
}

#[cfg(target_os = "linux")]
fn set_affinity(cpus: &[usize]) -> std::io::Result<()> {
    // SAFETY: `cpu_set_t` is a plain bit array for which all zeroes is the empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    for &cpu in cpus {
        if cpu >= libc::CPU_SETSIZE as usize {
            return Err(std::io::Error::from_raw_os_error(libc::EINVAL));
        }
        // SAFETY: `cpu` is below CPU_SETSIZE (checked above), so the bit lies inside `set`.
        unsafe { libc::CPU_SET(cpu, &mut set) };
    }
    // SAFETY: `set` is a valid, initialised cpu set of the size passed; pid 0 is this thread.
    let rc = unsafe { libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

#[cfg(not(target_os = "linux"))]
fn set_affinity(_cpus: &[usize]) -> std::io::Result<()> {
    Err(std::io::Error::new(
        std::io::ErrorKind::Unsupported,
        "CPU placement is implemented on Linux only",
    ))
}

#[cfg(target_os = "linux")]
fn set_priority(priority: ThreadPriority) -> std::io::Result<()> {
    let rc = if priority == ThreadPriority::Realtime {
        let param = libc::sched_param { sched_priority: 1 };
        // SAFETY: `param` is a valid sched_param; pid 0 is this thread.
        unsafe { libc::sched_setscheduler(0, libc::SCHED_FIFO, &param) }
    } else {
        let nice = match priority {
            ThreadPriority::Low => 5,
            ThreadPriority::Medium => -5,
            ThreadPriority::High => -10,
            ThreadPriority::Normal | ThreadPriority::Realtime => 0,
        };
        // SAFETY: gettid has no preconditions.
        let tid = unsafe { libc::gettid() };
        // SAFETY: setpriority only reads its arguments; on Linux PRIO_PROCESS with a thread id
        // sets that thread's nice value.
        unsafe { libc::setpriority(libc::PRIO_PROCESS, tid as libc::id_t, nice) }
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

#[cfg(not(target_os = "linux"))]
fn set_priority(_priority: ThreadPriority) -> std::io::Result<()> {
    Err(std::io::Error::new(
        std::io::ErrorKind::Unsupported,
        "thread priorities are implemented on Linux only",
    ))
}

/// Spin time per `poll` level after a computation has returned, counted from its end (poll
/// 50, the default: 1 ms): long enough for a caller computing graph after graph (one query
/// after another, with its tokenization and inputs in between; the scheduler's splits) to find
/// the workers awake instead of paying their wake-up in every call, short enough to give the
/// core back soon when the calls stop.
const TAIL_SPIN_PER_POLL: Duration = Duration::from_micros(20);

/// The least the computing thread spins for chunks other threads are finishing before it
/// sleeps until the last one is done (on a busy machine a worker may lose its core mid-chunk).
const OWNER_SPIN: Duration = Duration::from_micros(30);

/// How long a thread spins before its spinning starts yielding the core now and then (see
/// [`spin_pause`]).
const YIELD_AFTER: Duration = Duration::from_micros(10);

/// One step of a spin-wait that began at `since`, `spins` steps ago: a pause, and every 64
/// steps after the first [`YIELD_AFTER`] a yield of the core. On an idle core the yield
/// returns at once (nothing else is runnable); when the other threads of the computation share
/// this core (a machine with more runnable threads than cores) it hands the core over, so the
/// thread being waited for runs now instead of after this one's time slice.
fn spin_pause(spins: u32, since: Instant) {
    if spins.is_multiple_of(64) && since.elapsed() >= YIELD_AFTER {
        std::thread::yield_now();
    } else {
        std::hint::spin_loop();
    }
}

/// Spin time per `poll` level while a computation runs (poll 50, the default: 100 µs), for the
/// workers between jobs and for the computing thread waiting for others' chunks.
const SPIN_PER_POLL: Duration = Duration::from_micros(2);

/// The closure of a job: runs one chunk (a range of item indices).
type ChunkFn<'a> = dyn Fn(Range<usize>) -> Result<()> + Sync + 'a;

/// The job being split: written by the owner only while no chunk of it can be claimed.
struct Job {
    /// The closure, its lifetime erased: valid until every claimed chunk is done (the owner
    /// waits for that before its `run_job` returns).
    f: *const ChunkFn<'static>,
    /// Items `0..n`, in chunks of `chunk` (the last one shorter).
    n: usize,
    chunk: usize,
}

/// Bits of the job counter: generation (upper 32) | chunk count (16) | next chunk (16).
const COUNT_BITS: u32 = 16;
const COUNT_MASK: u64 = (1 << COUNT_BITS) - 1;
/// Most chunks a job may have (the counter's field width).
const MAX_CHUNKS: usize = COUNT_MASK as usize;

/// What the threads of one pool share.
struct Shared {
    n_threads: usize,
    /// Whether every thread of the pool can have a CPU of its own (see
    /// [`current_threads_have_cpus`]).
    cpu_each: bool,
    /// The job counter: generation, chunk count and next unclaimed chunk, in one word so a
    /// claim (compare-and-swap) can only take a chunk of the job it looked at.
    state: AtomicU64,
    job: UnsafeCell<Job>,
    /// Chunks of the current job finished (run, failed or skipped).
    done: AtomicUsize,
    /// A chunk of the current job failed: the rest are skipped, the error is in `error`.
    failed: AtomicBool,
    error: Mutex<Option<Error>>,
    /// A computation is running (workers spin up to `spin` between jobs, else up to
    /// `tail_spin` from its end).
    computing: AtomicBool,
    paused: AtomicBool,
    shutdown: AtomicBool,
    /// Workers asleep (or about to sleep) on `wake`.
    sleepers: AtomicUsize,
    sleep_lock: Mutex<()>,
    wake: Condvar,
    /// The owner sleeps on `finished` for the last chunk (set and checked under `finish_lock`).
    owner_sleeping: AtomicBool,
    finish_lock: Mutex<()>,
    finished: Condvar,
    spin: Duration,
    tail_spin: Duration,
    /// Held by the thread computing on the pool (one computation at a time).
    busy: Mutex<()>,
}

// SAFETY: every field but `job` is Sync. `job` is written only by the thread holding `busy`
// (the owner), and only while no chunk of the current job can be claimed and every claimed
// chunk is done; workers read it only between claiming a chunk (an Acquire compare-and-swap
// on `state`, which the owner stored with the new job after writing it) and marking that
// chunk done (a Release increment of `done`, which the owner waits for before writing again).
// The closure it points to is Sync.
unsafe impl Sync for Shared {}
// SAFETY: as above; the raw closure pointer is only dereferenced under that protocol.
unsafe impl Send for Shared {}

impl Shared {
    /// Whether the current job has a chunk left to claim.
    fn claimable(&self) -> bool {
        let s = self.state.load(Ordering::SeqCst);
        (s & COUNT_MASK) < ((s >> COUNT_BITS) & COUNT_MASK)
    }

    /// Claims the next chunk of the current job, if any.
    fn claim(&self) -> Option<usize> {
        let mut s = self.state.load(Ordering::Acquire);
        loop {
            let next = s & COUNT_MASK;
            if next >= (s >> COUNT_BITS) & COUNT_MASK {
                return None;
            }
            match self
                .state
                .compare_exchange_weak(s, s + 1, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => return Some(next as usize),
                Err(now) => s = now,
            }
        }
    }

    /// Runs chunk `index` of the current job (claimed by this thread), records its error and
    /// marks it done.
    fn run_chunk(&self, index: usize) {
        // SAFETY: this thread claimed a chunk of the current job and has not marked it done,
        // so the owner neither rewrites `job` nor returns (freeing the closure) meanwhile.
        let (f, range, n_chunks) = unsafe {
            let job = &*self.job.get();
            (
                &*job.f,
                index * job.chunk..((index + 1) * job.chunk).min(job.n),
                job.n.div_ceil(job.chunk),
            )
        };
        if !self.failed.load(Ordering::Relaxed) {
            let outcome = in_chunk(|| catch_unwind(AssertUnwindSafe(|| f(range))));
            let error = match outcome {
                Ok(Ok(())) => None,
                Ok(Err(e)) => Some(e),
                Err(panic) => Some(Error::Backend(format!(
                    "a CPU kernel panicked: {}",
                    panic_message(&*panic)
                ))),
            };
            if let Some(e) = error {
                let mut slot = self.error.lock().unwrap_or_else(|p| p.into_inner());
                if slot.is_none() {
                    *slot = Some(e);
                }
                self.failed.store(true, Ordering::Relaxed);
            }
        }
        // SeqCst, with the owner's store of `owner_sleeping` and load of `done`: either it sees
        // this chunk done or this thread sees it asleep and wakes it.
        let finished = self.done.fetch_add(1, Ordering::SeqCst) + 1;
        if finished == n_chunks && self.owner_sleeping.load(Ordering::SeqCst) {
            let _guard = self.finish_lock.lock().unwrap_or_else(|p| p.into_inner());
            self.finished.notify_one();
        }
    }

    /// Splits `0..n` into chunks of `chunk` items and runs `f` on each, on this thread (the
    /// owner, holding `busy`) and whichever workers claim chunks; returns the first error.
    fn run_job(&self, n: usize, chunk: usize, f: &ChunkFn<'_>) -> Result<()> {
        let chunk = chunk.max(n.div_ceil(MAX_CHUNKS)).max(1);
        let n_chunks = n.div_ceil(chunk);
        // SAFETY: only a reference's lifetime is erased; this function does not return before
        // every claimed chunk is done, and no chunk can be claimed after that (all are).
        let f: *const ChunkFn<'static> =
            unsafe { std::mem::transmute::<&ChunkFn<'_>, &'static ChunkFn<'static>>(f) };
        // SAFETY: this thread owns the pool (holds `busy`) and the previous job is over: all
        // its chunks were claimed and done before its `run_job` returned (see `Shared`).
        unsafe { *self.job.get() = Job { f, n, chunk } };
        self.done.store(0, Ordering::Relaxed);
        self.failed.store(false, Ordering::Relaxed);
        let generation = (self.state.load(Ordering::Relaxed) >> 32).wrapping_add(1);
        let state = (generation << 32) | ((n_chunks as u64) << COUNT_BITS);
        // SeqCst, with the load of `sleepers` below and the worker's store/check: either the
        // worker sees this job before sleeping or this thread sees the sleeper and wakes it.
        self.state.store(state, Ordering::SeqCst);
        if self.sleepers.load(Ordering::SeqCst) > 0 {
            let _guard = self.sleep_lock.lock().unwrap_or_else(|p| p.into_inner());
            self.wake.notify_all();
        }
        while let Some(index) = self.claim() {
            self.run_chunk(index);
        }
        // Chunks other threads took: at most one chunk long each (they started before this
        // thread ran out), so spin as long as a worker would between jobs (a small node's
        // chunks take tens of microseconds, less than a sleep and wake-up), then sleep until
        // the last one is done.
        let spin_start = Instant::now();
        let owner_spin = self.spin.max(OWNER_SPIN);
        let mut spins = 0u32;
        while self.done.load(Ordering::Acquire) < n_chunks {
            spins = spins.wrapping_add(1);
            if spins.is_multiple_of(64) && spin_start.elapsed() >= owner_spin {
                let mut guard = self.finish_lock.lock().unwrap_or_else(|p| p.into_inner());
                self.owner_sleeping.store(true, Ordering::SeqCst);
                while self.done.load(Ordering::SeqCst) < n_chunks {
                    guard = self.finished.wait(guard).unwrap_or_else(|p| p.into_inner());
                }
                self.owner_sleeping.store(false, Ordering::SeqCst);
                break;
            }
            spin_pause(spins, spin_start);
        }
        if self.failed.load(Ordering::Relaxed) {
            let error = self.error.lock().unwrap_or_else(|p| p.into_inner()).take();
            return Err(error.unwrap_or_else(|| Error::Backend("a CPU kernel failed".into())));
        }
        Ok(())
    }
}

fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = panic.downcast_ref::<&str>() {
        (*s).to_owned()
    } else if let Some(s) = panic.downcast_ref::<String>() {
        s.clone()
    } else {
        "(no message)".to_owned()
    }
}

/// A worker's life: claim and run chunks; between jobs spin a while, then sleep.
fn worker_main(shared: Arc<Shared>) {
    CONTEXT.set(Context {
        pool: Arc::as_ptr(&shared),
        n_threads: shared.n_threads,
        role: Role::Worker,
        in_chunk: false,
    });
    let mut idle_since = Instant::now();
    let mut spins = 0u32;
    // Whether the last look found a computation running: the tail after it counts from when
    // this worker sees it end, not from its last chunk (which may be long before the end).
    let mut saw_computing = false;
    loop {
        if let Some(index) = shared.claim() {
            shared.run_chunk(index);
            idle_since = Instant::now();
            spins = 0;
            continue;
        }
        if shared.shutdown.load(Ordering::Acquire) {
            return;
        }
        spins = spins.wrapping_add(1);
        if spins.is_multiple_of(64) {
            let computing = shared.computing.load(Ordering::Relaxed);
            if saw_computing && !computing {
                idle_since = Instant::now();
            }
            saw_computing = computing;
            let limit = if shared.paused.load(Ordering::Relaxed) {
                Duration::ZERO
            } else if computing {
                shared.spin
            } else {
                shared.tail_spin
            };
            if idle_since.elapsed() >= limit {
                sleep_until_work(&shared);
                idle_since = Instant::now();
                saw_computing = false;
            }
        }
        spin_pause(spins, idle_since);
    }
}

/// Sleeps until a job has a chunk to claim or the pool shuts down.
fn sleep_until_work(shared: &Shared) {
    let mut guard = shared.sleep_lock.lock().unwrap_or_else(|p| p.into_inner());
    shared.sleepers.fetch_add(1, Ordering::SeqCst);
    while !shared.claimable() && !shared.shutdown.load(Ordering::SeqCst) {
        guard = shared.wake.wait(guard).unwrap_or_else(|p| p.into_inner());
    }
    shared.sleepers.fetch_sub(1, Ordering::SeqCst);
}

/// What the current thread is to a pool.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Role {
    /// Not computing.
    None,
    /// Computing a graph: the pool's thread 0 (`pool` null: alone, without workers).
    Owner,
    /// A worker of `pool`.
    Worker,
}

#[derive(Clone, Copy)]
struct Context {
    pool: *const Shared,
    n_threads: usize,
    role: Role,
    /// Running a chunk of a job: nested splits run on this thread alone.
    in_chunk: bool,
}

impl Context {
    const NONE: Context = Context {
        pool: std::ptr::null(),
        n_threads: 1,
        role: Role::None,
        in_chunk: false,
    };
}

thread_local! {
    static CONTEXT: Cell<Context> = const { Cell::new(Context::NONE) };
}

/// Runs `f` marked as inside a chunk (nested splits then stay on this thread).
fn in_chunk<R>(f: impl FnOnce() -> R) -> R {
    let before = CONTEXT.get();
    let _restore = RestoreContext(before);
    CONTEXT.set(Context {
        in_chunk: true,
        ..before
    });
    f()
}

/// Puts a thread's context back when dropped (also when unwinding).
struct RestoreContext(Context);

impl Drop for RestoreContext {
    fn drop(&mut self) {
        CONTEXT.set(self.0);
    }
}

/// Threads a split on the current thread may use now: the pool's size on the thread computing
/// on it, 1 inside a chunk or outside any computation.
#[inline]
pub fn current_num_threads() -> usize {
    let context = CONTEXT.get();
    if context.role == Role::Owner && !context.in_chunk && !context.pool.is_null() {
        context.n_threads
    } else {
        1
    }
}

/// Whether each thread a split on the current thread may use can run on a CPU of its own:
/// false on a pool with more threads than the CPUs it may run on (its mask, or the process's
/// CPUs), where some thread always waits for a CPU and work given to it alone waits too.
#[inline]
pub fn current_threads_have_cpus() -> bool {
    let context = CONTEXT.get();
    if context.role == Role::Owner && !context.in_chunk && !context.pool.is_null() {
        // SAFETY: an owner's context points at the pool it computes on, kept alive by the
        // `run` call that set the context.
        unsafe { &*context.pool }.cpu_each
    } else {
        true
    }
}

/// Whether this thread is computing on a pool or is a pool's worker (Python callbacks run
/// from here must not wait for locks the computation's caller may hold).
#[inline]
pub fn in_computation() -> bool {
    CONTEXT.get().role != Role::None
}

/// Runs `f` over `0..n` in chunks of `chunk` items on the current pool (every thread of it,
/// this one included), or chunk after chunk on this thread when it computes alone (see
/// [`current_num_threads`]). Returns the first error.
pub fn run_chunks(n: usize, chunk: usize, f: &ChunkFn<'_>) -> Result<()> {
    let context = CONTEXT.get();
    if context.role == Role::Owner && !context.in_chunk && !context.pool.is_null() {
        // SAFETY: an owner's context points at the pool it computes on, which the `run` call
        // that set the context keeps alive (it borrows the Threadpool holding it).
        let shared = unsafe { &*context.pool };
        return shared.run_job(n, chunk, f);
    }
    let chunk = chunk.max(1);
    (0..n.div_ceil(chunk)).try_for_each(|c| f(c * chunk..((c + 1) * chunk).min(n)))
}

/// A persistent pool of worker threads that the computing thread joins.
pub struct Threadpool {
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
    worker_tids: Vec<i64>,
    params: ThreadpoolParams,
    refused: Arc<Mutex<Vec<String>>>,
    /// A rayon pool of the same size and placement, made on first use (the BLAS backend
    /// converts operands on it).
    rayon: OnceLock<Arc<rayon::ThreadPool>>,
}

impl Threadpool {
    /// Starts the pool's `n_threads - 1` workers (the computing thread is the last one) and
    /// waits until each has applied the CPU placement and priority of `params`; what the OS
    /// refused is kept in [`Threadpool::placement_errors`] (not logged from the worker: a log
    /// record may need the Python interpreter, which the creating thread may hold).
    pub fn new(params: &ThreadpoolParams) -> Result<Arc<Threadpool>> {
        // Thread count (1 to MAX_THREADS), poll and mask ranges, before any thread starts.
        params.check()?;
        let refused = Arc::new(Mutex::new(Vec::new()));
        let shared = Arc::new(Shared {
            n_threads: params.n_threads,
            cpu_each: params.n_threads <= params.cpus_for_workers(),
            state: AtomicU64::new(0),
            job: UnsafeCell::new(Job {
                f: &no_job as &ChunkFn<'static>,
                n: 0,
                chunk: 1,
            }),
            done: AtomicUsize::new(0),
            failed: AtomicBool::new(false),
            error: Mutex::new(None),
            computing: AtomicBool::new(false),
            paused: AtomicBool::new(params.paused),
            shutdown: AtomicBool::new(false),
            sleepers: AtomicUsize::new(0),
            sleep_lock: Mutex::new(()),
            wake: Condvar::new(),
            owner_sleeping: AtomicBool::new(false),
            finish_lock: Mutex::new(()),
            finished: Condvar::new(),
            spin: SPIN_PER_POLL * params.poll,
            tail_spin: TAIL_SPIN_PER_POLL * params.poll,
            busy: Mutex::new(()),
        });
        let mut pool = Threadpool {
            shared: shared.clone(),
            workers: Vec::with_capacity(params.n_threads - 1),
            worker_tids: Vec::with_capacity(params.n_threads - 1),
            params: params.clone(),
            refused: refused.clone(),
            rayon: OnceLock::new(),
        };
        let needs_placement = needs_placement(params);
        let (started_tx, started) = std::sync::mpsc::channel();
        for index in 1..params.n_threads {
            let (shared, refused, placement, started_tx) = (
                shared.clone(),
                refused.clone(),
                params.clone(),
                started_tx.clone(),
            );
            let spawned = std::thread::Builder::new()
                .name(format!("ferrograph-cpu-{index}"))
                .spawn(move || {
                    if needs_placement {
                        let errors = place_current_thread(index, &placement);
                        if !errors.is_empty() {
                            refused
                                .lock()
                                .unwrap_or_else(|p| p.into_inner())
                                .extend(errors);
                        }
                    }
                    let _ = started_tx.send(current_tid());
                    worker_main(shared);
                });
            match spawned {
                Ok(handle) => pool.workers.push(handle),
                // Dropping `pool` stops and joins the workers started so far.
                Err(e) => {
                    return Err(Error::Backend(format!(
                        "cannot start {} threads: {e}",
                        params.n_threads
                    )))
                }
            }
        }
        drop(started_tx);
        for _ in 0..pool.workers.len() {
            match started.recv() {
                Ok(tid) => pool.worker_tids.push(tid),
                Err(_) => break,
            }
        }
        Ok(Arc::new(pool))
    }

    /// What the OS refused when the workers applied the pool's placement and priority (one
    /// line per refusal; empty when everything was applied).
    pub fn placement_errors(&self) -> Vec<String> {
        self.refused
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Number of threads computing on the pool (its workers and the caller).
    pub fn n_threads(&self) -> usize {
        self.shared.n_threads
    }

    /// The parameters the pool was made with.
    pub fn params(&self) -> &ThreadpoolParams {
        &self.params
    }

    /// Marks the pool paused: its idle workers sleep at once instead of spinning.
    pub fn pause(&self) {
        self.shared.paused.store(true, Ordering::Release);
    }

    /// Marks the pool running.
    pub fn resume(&self) {
        self.shared.paused.store(false, Ordering::Release);
    }

    /// Whether the pool is paused.
    pub fn is_paused(&self) -> bool {
        self.shared.paused.load(Ordering::Acquire)
    }

    /// Runs `f` on the calling thread as the pool's thread 0, resuming the pool first: splits
    /// of work inside `f` (`par_ranges` in the CPU kernels) run on all of the pool's
    /// threads. One computation runs on a pool at a time; another thread's call waits for it.
    ///
    /// Nested calls never wait: from inside `f` on the same pool, `f` runs as part of the
    /// current computation; while computing on another pool, a busy pool is not waited for
    /// (the call computes on this thread alone); inside a chunk of split work, always alone.
    pub fn run<R>(&self, f: impl FnOnce() -> R) -> R {
        let before = CONTEXT.get();
        let me = Arc::as_ptr(&self.shared);
        let alone = Context {
            pool: std::ptr::null(),
            n_threads: 1,
            role: Role::Owner,
            in_chunk: false,
        };
        if before.role == Role::Worker || before.in_chunk {
            // Inside a chunk: everything below stays on this thread.
            return f();
        }
        if before.role == Role::Owner && before.pool == me {
            return f();
        }
        let busy = if before.role == Role::Owner {
            match self.shared.busy.try_lock() {
                Ok(guard) => guard,
                Err(TryLockError::Poisoned(p)) => p.into_inner(),
                Err(TryLockError::WouldBlock) => {
                    let _restore = RestoreContext(before);
                    CONTEXT.set(alone);
                    return f();
                }
            }
        } else {
            self.shared.busy.lock().unwrap_or_else(|p| p.into_inner())
        };
        if self.shared.paused.swap(false, Ordering::AcqRel) {
            log::debug!("resuming a paused thread pool for a computation");
        }
        let _session = Session {
            shared: &self.shared,
            _busy: busy,
            _restore: RestoreContext(before),
        };
        self.shared.computing.store(true, Ordering::Relaxed);
        CONTEXT.set(Context {
            pool: me,
            n_threads: self.shared.n_threads,
            role: Role::Owner,
            in_chunk: false,
        });
        f()
    }

    /// A rayon pool of the same size and placement, started on first use (for code that
    /// splits its work with rayon, such as the BLAS backend's operand conversions).
    pub fn rayon(&self) -> Result<&Arc<rayon::ThreadPool>> {
        if let Some(pool) = self.rayon.get() {
            return Ok(pool);
        }
        let placement = (self.params.clone(), self.refused.clone());
        let mut builder = rayon::ThreadPoolBuilder::new()
            .num_threads(self.params.n_threads)
            .thread_name(|i| format!("ferrograph-rayon-{i}"));
        if needs_placement(&self.params) {
            builder = builder.start_handler(move |index| {
                let errors = place_current_thread(index, &placement.0);
                if !errors.is_empty() {
                    placement
                        .1
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .extend(errors);
                }
            });
        }
        let pool = builder.build().map_err(|e| {
            Error::Backend(format!(
                "cannot start {} threads: {e}",
                self.params.n_threads
            ))
        })?;
        Ok(self.rayon.get_or_init(|| Arc::new(pool)))
    }

    /// The OS thread ids of the workers (for tests of their placement).
    #[cfg(test)]
    fn worker_tids(&self) -> &[i64] {
        &self.worker_tids
    }
}

/// The end of a computation on a pool: workers told to stop spinning soon, the pool released,
/// the thread's context restored (in that order: the context last).
struct Session<'a> {
    shared: &'a Shared,
    _busy: MutexGuard<'a, ()>,
    _restore: RestoreContext,
}

impl Drop for Session<'_> {
    fn drop(&mut self) {
        self.shared.computing.store(false, Ordering::Relaxed);
    }
}

/// The closure of the empty job a pool starts with (never run: it has no chunks).
fn no_job(_: Range<usize>) -> Result<()> {
    Ok(())
}

fn needs_placement(params: &ThreadpoolParams) -> bool {
    params.strict_cpu
        || !params.allowed_cpus().is_empty()
        || params.priority != ThreadPriority::Normal
}

#[cfg(target_os = "linux")]
fn current_tid() -> i64 {
    // SAFETY: gettid has no preconditions.
    i64::from(unsafe { libc::gettid() })
}

#[cfg(not(target_os = "linux"))]
fn current_tid() -> i64 {
    0
}

impl Drop for Threadpool {
    fn drop(&mut self) {
        self.shared.shutdown.store(true, Ordering::SeqCst);
        {
            let _guard = self
                .shared
                .sleep_lock
                .lock()
                .unwrap_or_else(|p| p.into_inner());
            self.shared.wake.notify_all();
        }
        let on_a_worker =
            CONTEXT.get().role == Role::Worker && CONTEXT.get().pool == Arc::as_ptr(&self.shared);
        for worker in self.workers.drain(..) {
            // A worker dropping its own pool cannot join itself: the workers then exit alone.
            if !on_a_worker {
                let _ = worker.join();
            }
        }
    }
}

impl std::fmt::Debug for Threadpool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Threadpool(n_threads={}, paused={})",
            self.n_threads(),
            self.is_paused()
        )
    }
}

/// Replaces the pool in `slot` by one of `n_threads` workers unless it already has that many
/// (the thread-count setter of the CPU and BLAS backends); `who` names the backend in errors.
pub fn resize_pool(slot: &Mutex<Arc<Threadpool>>, n_threads: usize, who: &str) -> Result<()> {
    // Checked before the lock and whatever the current size: 1 to MAX_THREADS.
    if check_n_threads(n_threads).is_err() {
        return Err(Error::InvalidArgument(format!(
            "a {who} backend needs 1 to {} threads, got {n_threads}",
            MAX_THREADS
        )));
    }
    let mut pool = slot.lock().unwrap_or_else(|p| p.into_inner());
    if pool.n_threads() != n_threads {
        *pool = Threadpool::new(&ThreadpoolParams::new(n_threads))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn params_and_pause() {
        let mut params = ThreadpoolParams::new(2);
        assert!(params.matches(&ThreadpoolParams::new(2)));
        assert!(!params.matches(&ThreadpoolParams::new(3)));
        params.init(1);
        assert_eq!(params.n_threads, 1);
        let pool = Threadpool::new(&ThreadpoolParams {
            paused: true,
            ..ThreadpoolParams::new(2)
        })
        .unwrap();
        assert_eq!(pool.n_threads(), 2);
        assert!(pool.is_paused());
        let sum: usize = pool.run(|| (1..=10usize).sum());
        assert_eq!(sum, 55);
        assert!(!pool.is_paused(), "computations resume the pool");
        pool.pause();
        pool.resume();
        assert!(!pool.is_paused());
        assert!(Threadpool::new(&ThreadpoolParams::new(0)).is_err());
    }

    /// The CPUs thread `tid` (0: the calling thread) may run on.
    #[cfg(target_os = "linux")]
    fn affinity_of(tid: i64) -> Vec<usize> {
        // SAFETY: all zeroes is the empty set; sched_getaffinity fills it for the thread.
        let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
        // SAFETY: `set` is valid for the size passed; `tid` is 0 or a thread of this process.
        let rc = unsafe {
            libc::sched_getaffinity(
                tid as libc::pid_t,
                std::mem::size_of::<libc::cpu_set_t>(),
                &mut set,
            )
        };
        assert_eq!(rc, 0);
        (0..libc::CPU_SETSIZE as usize)
            .filter(|&c| {
                // SAFETY: `c` is below CPU_SETSIZE.
                unsafe { libc::CPU_ISSET(c, &set) }
            })
            .collect()
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn strict_placement_pins_workers_to_the_mask() {
        let allowed = affinity_of(0);
        let cpu = allowed[0];
        let mut mask = vec![false; cpu + 1];
        mask[cpu] = true;
        let params = ThreadpoolParams {
            strict_cpu: true,
            cpumask: mask,
            ..ThreadpoolParams::new(2)
        };
        let pool = Threadpool::new(&params).unwrap();
        let seen: Vec<Vec<usize>> = pool.worker_tids().iter().map(|&t| affinity_of(t)).collect();
        assert_eq!(seen, vec![vec![cpu]; 1], "{:?}", pool.placement_errors());
        // The lazily made rayon pool (the BLAS backend's) is placed alike.
        let seen: Vec<Vec<usize>> = pool.rayon().unwrap().broadcast(|_| affinity_of(0));
        assert_eq!(seen, vec![vec![cpu]; 2], "{:?}", pool.placement_errors());
        assert!(pool.placement_errors().is_empty());
    }

    #[test]
    fn params_are_checked_and_matched() {
        let a = ThreadpoolParams {
            cpumask: vec![false; 4],
            ..ThreadpoolParams::new(2)
        };
        assert!(
            a.matches(&ThreadpoolParams::new(2)),
            "all-false mask is no mask"
        );
        let b = ThreadpoolParams {
            cpumask: vec![true],
            ..ThreadpoolParams::new(2)
        };
        assert!(!a.matches(&b));
        let strict = ThreadpoolParams {
            strict_cpu: true,
            ..ThreadpoolParams::new(2)
        };
        assert!(!strict.matches(&ThreadpoolParams::new(2)));
        assert!(ThreadpoolParams {
            poll: 101,
            ..ThreadpoolParams::new(1)
        }
        .check()
        .is_err());
        assert!(ThreadpoolParams {
            cpumask: vec![true; 513],
            ..ThreadpoolParams::new(1)
        }
        .check()
        .is_err());
        assert!(ThreadPriority::from_code(4).is_err());
        assert_eq!(ThreadPriority::from_code(-1).unwrap(), ThreadPriority::Low);
    }

    /// Runs a job of `n` items in chunks of `chunk` on `pool` and returns how often each item
    /// was visited, the threads that ran chunks and the job's result.
    fn visit(
        pool: &Threadpool,
        n: usize,
        chunk: usize,
        each: impl Fn(usize) -> Result<()> + Sync,
    ) -> (Vec<usize>, usize, Result<()>) {
        let seen: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
        let threads = Mutex::new(std::collections::HashSet::new());
        let result = pool.run(|| {
            run_chunks(n, chunk, &|range: Range<usize>| {
                threads.lock().unwrap().insert(std::thread::current().id());
                assert_eq!(current_num_threads(), 1, "nested splits stay on the thread");
                for i in range {
                    seen[i].fetch_add(1, Ordering::Relaxed);
                    each(i)?;
                }
                Ok(())
            })
        });
        let seen = seen.into_iter().map(AtomicUsize::into_inner).collect();
        (seen, threads.into_inner().unwrap().len(), result)
    }

    #[test]
    fn jobs_run_every_chunk_once_on_all_threads() {
        let pool = Threadpool::new(&ThreadpoolParams::new(3)).unwrap();
        assert_eq!(current_num_threads(), 1, "outside a computation");
        assert_eq!(pool.run(current_num_threads), 3);
        // Chunks long enough that sleeping workers wake up and take some.
        let (seen, threads, result) = visit(&pool, 40, 2, |_| {
            std::thread::sleep(Duration::from_millis(1));
            Ok(())
        });
        result.unwrap();
        assert_eq!(seen, vec![1; 40]);
        assert!(threads > 1, "only the caller ran chunks");
        // Many short jobs in a row (the between-node pattern), each complete when it returns.
        for n in [1, 7, 64, 1000] {
            let (seen, _, result) = visit(&pool, n, 3, |_| Ok(()));
            result.unwrap();
            assert_eq!(seen, vec![1; n]);
        }
    }

    #[test]
    fn pools_know_whether_their_threads_have_a_cpu_each() {
        assert!(current_threads_have_cpus(), "outside a computation");
        let cpus = default_n_threads();
        let fits = Threadpool::new(&ThreadpoolParams::new(cpus.min(MAX_THREADS))).unwrap();
        assert!(fits.run(current_threads_have_cpus));
        // Two threads on a mask of one CPU share it.
        let one_cpu = Threadpool::new(&ThreadpoolParams {
            cpumask: vec![true],
            ..ThreadpoolParams::new(2)
        })
        .unwrap();
        assert!(!one_cpu.run(current_threads_have_cpus));
        // More threads than the process's CPUs.
        if cpus < MAX_THREADS {
            let over = Threadpool::new(&ThreadpoolParams::new(cpus + 1)).unwrap();
            assert!(!over.run(current_threads_have_cpus));
            // Inside a chunk a split stays on its thread: nothing to share.
            over.run(|| {
                run_chunks(4, 1, &|_| {
                    assert!(current_threads_have_cpus());
                    Ok(())
                })
            })
            .unwrap();
        }
    }

    #[test]
    fn the_first_error_or_panic_of_a_job_is_returned() {
        let pool = Threadpool::new(&ThreadpoolParams::new(2)).unwrap();
        let (_, _, result) = visit(&pool, 100, 1, |i| {
            if i == 37 {
                Err(Error::InvalidArgument("item 37".into()))
            } else {
                Ok(())
            }
        });
        assert!(result.unwrap_err().to_string().contains("item 37"));
        let (_, _, result) = visit(&pool, 100, 1, |i| {
            assert_ne!(i, 50, "item 50");
            Ok(())
        });
        let message = result.unwrap_err().to_string();
        assert!(
            message.contains("panicked") && message.contains("item 50"),
            "{message}"
        );
        // The pool still works after both.
        let (seen, _, result) = visit(&pool, 10, 1, |_| Ok(()));
        result.unwrap();
        assert_eq!(seen, vec![1; 10]);
    }

    #[test]
    fn nested_runs_do_not_wait() {
        let pool = Threadpool::new(&ThreadpoolParams::new(2)).unwrap();
        let other = Threadpool::new(&ThreadpoolParams::new(3)).unwrap();
        // The same pool again from its computing thread: part of the same computation.
        let threads = pool.run(|| pool.run(current_num_threads));
        assert_eq!(threads, 2);
        // Another, idle pool from inside a computation: used.
        assert_eq!(pool.run(|| other.run(current_num_threads)), 3);
        // Any pool from inside a chunk: computed on that thread alone.
        let inside = Mutex::new(Vec::new());
        pool.run(|| {
            run_chunks(4, 1, &|_| {
                let n = pool.run(|| {
                    let (seen, _, result) = visit(&other, 5, 1, |_| Ok(()));
                    result.map(|()| (seen, current_num_threads()))
                })?;
                inside.lock().unwrap().push(n);
                Ok(())
            })
        })
        .unwrap();
        assert_eq!(inside.into_inner().unwrap(), vec![(vec![1; 5], 1); 4]);
        // A busy pool from inside a computation on another pool: alone, not waited for.
        let (started_tx, started) = std::sync::mpsc::channel();
        let (finish_tx, finish) = std::sync::mpsc::channel::<()>();
        std::thread::scope(|scope| {
            let other = &other;
            let holder = scope.spawn(move || {
                other.run(|| {
                    started_tx.send(()).unwrap();
                    finish.recv().unwrap();
                })
            });
            started.recv().unwrap();
            assert_eq!(pool.run(|| other.run(current_num_threads)), 1);
            finish_tx.send(()).unwrap();
            holder.join().unwrap();
        });
    }

    #[test]
    fn concurrent_callers_take_turns() {
        let pool = Threadpool::new(&ThreadpoolParams::new(2)).unwrap();
        std::thread::scope(|scope| {
            for _ in 0..3 {
                scope.spawn(|| {
                    for n in 1..60 {
                        let (seen, _, result) = visit(&pool, n, 1, |_| Ok(()));
                        result.unwrap();
                        assert_eq!(seen, vec![1; n]);
                    }
                });
            }
        });
    }

    /// The scheduling state of thread `tid` of this process ('R' running, 'S' sleeping, ...),
    /// or None once it has exited.
    #[cfg(target_os = "linux")]
    fn thread_state(tid: i64) -> Option<char> {
        let stat = std::fs::read_to_string(format!("/proc/self/task/{tid}/stat")).ok()?;
        // "tid (name) S ...": the state follows the closing parenthesis.
        stat.rsplit_once(')')?.1.trim_start().chars().next()
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn workers_sleep_after_a_computation_and_exit_with_the_pool() {
        let pool = Threadpool::new(&ThreadpoolParams::new(3)).unwrap();
        let tids = pool.worker_tids().to_vec();
        assert_eq!(tids.len(), 2);
        for _ in 0..20 {
            let (_, _, result) = visit(&pool, 64, 1, |_| Ok(()));
            result.unwrap();
        }
        // The tail is 1 ms (poll 50); a busy machine may leave a spinning worker waiting for a
        // core a while before it notices, so allow up to 2 s (a worker that never sleeps fails).
        let start = Instant::now();
        loop {
            std::thread::sleep(Duration::from_millis(20));
            let states: Vec<Option<char>> = tids.iter().map(|&t| thread_state(t)).collect();
            if states.iter().all(|&s| s == Some('S')) {
                break;
            }
            assert!(
                start.elapsed() < Duration::from_secs(2),
                "workers still run after the computation: {states:?}"
            );
        }
        drop(pool);
        // Dropping the pool joins its workers: their code has returned. The kernel may list
        // an exiting thread (state 'R') for a moment after the join returns, so the entry is
        // given up to a second to go.
        let start = Instant::now();
        for &tid in &tids {
            while thread_state(tid).is_some() && start.elapsed() < Duration::from_secs(1) {
                std::thread::sleep(Duration::from_millis(1));
            }
            assert_eq!(thread_state(tid), None, "worker {tid} outlived its pool");
        }
    }
}
