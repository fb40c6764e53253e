//! Persistent CPU thread pools (ggml's threadpool API) on top of rayon.
//!
//! A [`Threadpool`] owns a rayon pool of `n_threads` workers that lives until the last handle
//! is dropped; several CPU backends may share one. rayon workers park when idle, so
//! [`Threadpool::pause`] only records the state: a paused pool is resumed by the next
//! computation, as ggml's is.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use crate::error::{Error, Result};

/// Scheduling priority hint of pool threads (recorded; the OS default is used).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ThreadPriority {
    /// OS default.
    #[default]
    Normal,
    /// Above normal.
    Medium,
    /// High.
    High,
    /// Real-time.
    Realtime,
}

/// Parameters of a thread pool.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ThreadpoolParams {
    /// Worker threads.
    pub n_threads: usize,
    /// Priority hint.
    pub priority: ThreadPriority,
    /// Busy-wait level before sleeping (0-100; recorded — rayon's own policy applies).
    pub poll: u32,
    /// Pin threads to CPUs one-to-one (recorded; not applied).
    pub strict_cpu: bool,
    /// Start paused.
    pub paused: bool,
}

impl ThreadpoolParams {
    /// The defaults for `n_threads` threads (ggml's `threadpool_params_default`).
    pub fn new(n_threads: usize) -> Self {
        ThreadpoolParams {
            n_threads,
            priority: ThreadPriority::Normal,
            poll: 50,
            strict_cpu: false,
            paused: false,
        }
    }

    /// Resets `self` to the defaults for `n_threads` (ggml's `threadpool_params_init`).
    pub fn init(&mut self, n_threads: usize) {
        *self = ThreadpoolParams::new(n_threads);
    }

    /// Whether two parameter sets describe interchangeable pools.
    pub fn matches(&self, other: &ThreadpoolParams) -> bool {
        self.n_threads == other.n_threads
            && self.priority == other.priority
            && self.poll == other.poll
            && self.strict_cpu == other.strict_cpu
    }
}

/// A persistent pool of worker threads.
pub struct Threadpool {
    pool: Arc<rayon::ThreadPool>,
    params: ThreadpoolParams,
    paused: AtomicBool,
}

impl Threadpool {
    /// Starts the pool's threads.
    pub fn new(params: &ThreadpoolParams) -> Result<Arc<Threadpool>> {
        if params.n_threads == 0 {
            return Err(Error::InvalidArgument(
                "a thread pool needs at least one thread".into(),
            ));
        }
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(params.n_threads)
            .thread_name(|i| format!("ferrograph-cpu-{i}"))
            .build()
            .map_err(|e| {
                Error::Backend(format!("cannot start {} threads: {e}", params.n_threads))
            })?;
        Ok(Arc::new(Threadpool {
            pool: Arc::new(pool),
            params: params.clone(),
            paused: AtomicBool::new(params.paused),
        }))
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
    if n_threads == 0 {
        return Err(Error::InvalidArgument(format!(
            "a {who} backend needs at least one thread"
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
}
