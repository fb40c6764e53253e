//! Small utilities: version, clocks, cycle counters, and the id-keyed hash map.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::OnceLock;
use std::time::Instant;

/// A multiplicative (Fx-style) hasher for integer keys and word streams: tensor and buffer ids
/// are process-unique counters, so SipHash's protection buys nothing and costs most of the
/// indexing time of the scheduler and the graph allocator.
#[derive(Default, Clone, Copy)]
pub(crate) struct FastHasher(u64);

const SEED: u64 = 0x51_7c_c1_b7_27_22_0a_95;

impl Hasher for FastHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for chunk in bytes.chunks(8) {
            let mut word = [0u8; 8];
            word[..chunk.len()].copy_from_slice(chunk);
            self.write_u64(u64::from_le_bytes(word));
        }
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = (self.0.rotate_left(5) ^ n).wrapping_mul(SEED);
    }

    fn write_u32(&mut self, n: u32) {
        self.write_u64(u64::from(n));
    }

    fn write_u8(&mut self, n: u8) {
        self.write_u64(u64::from(n));
    }

    fn write_usize(&mut self, n: usize) {
        self.write_u64(n as u64);
    }
}

/// A hash map keyed by tensor ids (or other counters) with [`FastHasher`].
pub(crate) type IdMap<V> = HashMap<u64, V, BuildHasherDefault<FastHasher>>;

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
