//! Small utilities: version, clocks and cycle counters.

use std::sync::OnceLock;
use std::time::Instant;

/// The library version (from `Cargo.toml`).
pub fn version() -> &'static str {
    env!("CARGO_PKG_VERSION")
}

/// The git commit the library was built from (`"unknown"` outside a git checkout).
pub fn commit() -> &'static str {
    option_env!("FERROGRAPH_GIT_COMMIT").unwrap_or("unknown")
}

fn epoch() -> &'static Instant {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    EPOCH.get_or_init(Instant::now)
}

/// Starts the clocks (optional: the first clock call does it).
pub fn time_init() {
    epoch();
}

/// Milliseconds since the clocks started.
pub fn time_ms() -> i64 {
    epoch().elapsed().as_millis() as i64
}

/// Microseconds since the clocks started.
pub fn time_us() -> i64 {
    epoch().elapsed().as_micros() as i64
}

/// A cycle counter: the time-stamp counter on x86-64, nanoseconds elsewhere.
pub fn cycles() -> i64 {
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: RDTSC is available on every x86-64 CPU and has no memory effects.
        unsafe { std::arch::x86_64::_rdtsc() as i64 }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        epoch().elapsed().as_nanos() as i64
    }
}

/// Cycles of [`cycles`] per millisecond, measured once over a short interval.
pub fn cycles_per_ms() -> i64 {
    static RATE: OnceLock<i64> = OnceLock::new();
    *RATE.get_or_init(|| {
        let start_time = Instant::now();
        let start = cycles();
        while start_time.elapsed().as_micros() < 2_000 {
            std::hint::spin_loop();
        }
        let elapsed_us = start_time.elapsed().as_micros().max(1) as i64;
        ((cycles() - start) * 1_000 / elapsed_us).max(1)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clocks_advance() {
        time_init();
        let (us, c) = (time_us(), cycles());
        std::thread::sleep(std::time::Duration::from_millis(2));
        assert!(time_us() >= us + 1_000);
        assert!(time_ms() >= 2);
        assert!(cycles() > c);
        assert!(cycles_per_ms() > 0);
        assert!(!version().is_empty() && !commit().is_empty());
    }
}
