//! Persistent CPU thread pools (ggml's threadpool API) on top of rayon.
//!
//! A [`Threadpool`] owns a rayon pool of `n_threads` workers that lives until the last handle
//! is dropped; several CPU backends may share one. rayon workers park when idle, so
//! [`Threadpool::pause`] only records the state: a paused pool is resumed by the next
//! computation, as ggml's is.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use crate::error::{Error, Result};

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
    /// Busy-wait level before sleeping (0-100). Recorded only: rayon's workers spin briefly
    /// and then sleep by their own policy.
    pub poll: u32,
    /// Pin each worker to one CPU of the mask (worker `i` to the `i`-th allowed CPU, round
    /// robin) instead of letting every worker run on any CPU of the mask.
    pub strict_cpu: bool,
    /// The CPUs the workers may run on (`cpumask[c]` for CPU `c`); empty or all false means
    /// every CPU the process may use. At most [`crate::device::MAX_THREADS`] entries.
    pub cpumask: Vec<bool>,
    /// Start paused.
    pub paused: bool,
}

impl Default for ThreadpoolParams {
    fn default() -> Self {
        ThreadpoolParams::new(crate::cpu::backend::default_n_threads())
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

    /// Checks the ranges: 1 to MAX_THREADS threads, poll at most 100, a mask of at most
    /// MAX_THREADS CPUs.
    pub fn check(&self) -> Result<()> {
        crate::device::check_n_threads(self.n_threads)?;
        if self.poll > 100 {
            return Err(Error::InvalidArgument(format!(
                "poll must be 0 to 100, got {}",
                self.poll
            )));
        }
        if self.cpumask.len() > crate::device::MAX_THREADS {
            return Err(Error::InvalidArgument(format!(
                "a CPU mask has at most {} entries, got {}",
                crate::device::MAX_THREADS,
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
        cpus = (0..crate::cpu::backend::default_n_threads()).collect();
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

/// A persistent pool of worker threads.
pub struct Threadpool {
    pool: Arc<rayon::ThreadPool>,
    params: ThreadpoolParams,
    paused: AtomicBool,
    refused: Arc<Mutex<Vec<String>>>,
}

impl Threadpool {
    /// Starts the pool's threads.
    ///
    /// Each worker applies the CPU placement and priority of `params` when it starts; what the
    /// OS refuses is kept in [`Threadpool::placement_errors`] (not logged from the worker: a log
    /// record may need the Python interpreter, which the creating thread may hold).
    pub fn new(params: &ThreadpoolParams) -> Result<Arc<Threadpool>> {
        // Thread count (1 to MAX_THREADS), poll and mask ranges, before any thread starts.
        params.check()?;
        let refused = Arc::new(Mutex::new(Vec::new()));
        let placement = (params.clone(), refused.clone());
        let needs_placement = params.strict_cpu
            || !params.allowed_cpus().is_empty()
            || params.priority != ThreadPriority::Normal;
        let mut builder = rayon::ThreadPoolBuilder::new()
            .num_threads(params.n_threads)
            .thread_name(|i| format!("ferrograph-cpu-{i}"));
        if needs_placement {
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
            Error::Backend(format!("cannot start {} threads: {e}", params.n_threads))
        })?;
        Ok(Arc::new(Threadpool {
            pool: Arc::new(pool),
            params: params.clone(),
            paused: AtomicBool::new(params.paused),
            refused,
        }))
    }

    /// What the OS refused when the workers applied the pool's placement and priority (one
    /// line per refusal; empty when everything was applied). Workers start asynchronously, so
    /// this is complete once the pool has run a computation.
    pub fn placement_errors(&self) -> Vec<String> {
        self.refused
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Number of worker threads.
    pub fn n_threads(&self) -> usize {
        self.pool.current_num_threads()
    }

    /// The parameters the pool was made with.
    pub fn params(&self) -> &ThreadpoolParams {
        &self.params
    }

    /// Marks the pool paused (its idle threads sleep).
    pub fn pause(&self) {
        self.paused.store(true, Ordering::Release);
    }

    /// Marks the pool running.
    pub fn resume(&self) {
        self.paused.store(false, Ordering::Release);
    }

    /// Whether the pool is paused.
    pub fn is_paused(&self) -> bool {
        self.paused.load(Ordering::Acquire)
    }

    /// The rayon pool, resuming the pool first (computations run on it).
    pub fn rayon(&self) -> &Arc<rayon::ThreadPool> {
        if self.paused.swap(false, Ordering::AcqRel) {
            log::debug!("resuming a paused thread pool for a computation");
        }
        &self.pool
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
pub(crate) fn resize_pool(
    slot: &Mutex<Arc<Threadpool>>,
    n_threads: usize,
    who: &str,
) -> Result<()> {
    // Checked before the lock and whatever the current size: 1 to MAX_THREADS.
    if crate::device::check_n_threads(n_threads).is_err() {
        return Err(Error::InvalidArgument(format!(
            "a {who} backend needs 1 to {} threads, got {n_threads}",
            crate::device::MAX_THREADS
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
        let sum: usize = pool.rayon().install(|| (1..=10usize).sum());
        assert_eq!(sum, 55);
        assert!(!pool.is_paused(), "computations resume the pool");
        pool.pause();
        pool.resume();
        assert!(!pool.is_paused());
        assert!(Threadpool::new(&ThreadpoolParams::new(0)).is_err());
    }

    /// The CPUs the calling thread may run on.
    #[cfg(target_os = "linux")]
    fn current_affinity() -> Vec<usize> {
        // SAFETY: all zeroes is the empty set; sched_getaffinity fills it for this thread.
        let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
        // SAFETY: `set` is valid for the size passed; pid 0 is the calling thread.
        let rc =
            unsafe { libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) };
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
        let allowed = current_affinity();
        let cpu = allowed[0];
        let mut mask = vec![false; cpu + 1];
        mask[cpu] = true;
        let params = ThreadpoolParams {
            strict_cpu: true,
            cpumask: mask,
            ..ThreadpoolParams::new(2)
        };
        let pool = Threadpool::new(&params).unwrap();
        let seen: Vec<Vec<usize>> = pool.rayon().broadcast(|_| current_affinity());
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
}
