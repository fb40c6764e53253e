//! The machine's measured peaks: what the GEMM kernels are judged against.
//!
//! Each of `n` threads runs independent chains of one instruction from registers only, all
//! threads started together; the peak is their operations over the slowest thread's wall
//! time. [`fma_peak_gflops`]: f32 fused multiply-adds on the widest vector ISA the kernels use
//! (AVX-512 where present, else AVX2), 2 operations per lane. [`int8_peak_gops`]: the integer
//! GEMM's byte products — `vpdpbusd` (AVX-512 VNNI: 64 products and their sums per
//! instruction) where present, else the AVX2 kernel's `vpmaddwd` + `vpaddd` (16), 2 operations
//! per product. Enough chains (12) are in flight to cover the latency on every x86 core this
//! project runs on (4 cycles, two pipes: 8 needed).

use crate::error::{Error, Result};
use std::time::{Duration, Instant};

/// Independent accumulation chains per thread.
const CHAINS: usize = 12;

/// The f32 GFLOPS of `n_threads` threads running fused multiply-adds together for about
/// `min_seconds` (at least 1 ms), best of three such runs. Errors for a thread count outside
/// `1..=MAX_THREADS` and on CPUs without AVX2 and FMA (no vector multiply-add to measure).
pub fn fma_peak_gflops(n_threads: usize, min_seconds: f64) -> Result<f64> {
    check_arguments("fma_peak_gflops", n_threads, min_seconds)?;
    let chains = Chains::detect().ok_or_else(|| {
        Error::unsupported("fma_peak_gflops needs AVX2 and FMA (or AVX-512)".to_string())
    })?;
    let ops = (CHAINS * chains.lanes() * 2) as f64;
    measure(n_threads, min_seconds, ops, |iters| {
        std::hint::black_box(chains.run(iters));
    })
}

/// The integer GEMM's peak in giga-operations per second (a byte product and its sum are two)
/// of `n_threads` threads, measured as [`fma_peak_gflops`] is: `vpdpbusd` chains on CPUs with
/// AVX-512 VNNI, else the AVX2 kernel's `vpmaddwd` + `vpaddd`. Errors as
/// [`fma_peak_gflops`] (no AVX2: nothing to measure).
pub fn int8_peak_gops(n_threads: usize, min_seconds: f64) -> Result<f64> {
    check_arguments("int8_peak_gops", n_threads, min_seconds)?;
    #[cfg(target_arch = "x86_64")]
    {
        let isa = crate::isa::get();
        if isa.avx512_bw_vnni() {
            let ops = (CHAINS * 64 * 2) as f64;
            return measure(n_threads, min_seconds, ops, |iters| {
                // SAFETY: the CPU has AVX-512F/BW/VNNI (checked).
                std::hint::black_box(unsafe { entry::dpbusd_chains(iters) });
            });
        }
        if isa.avx2_fma() {
            let ops = (CHAINS * 16 * 2) as f64;
            return measure(n_threads, min_seconds, ops, |iters| {
                // SAFETY: the CPU has AVX2 (checked).
                std::hint::black_box(unsafe { entry::maddwd_chains(iters) });
            });
        }
    }
    Err(Error::unsupported(
        "int8_peak_gops needs AVX2 (or AVX-512 VNNI)".to_string(),
    ))
}

/// A thread count in `1..=MAX_THREADS` and a finite, non-negative duration, or the error
/// naming `what` was called with what.
fn check_arguments(what: &str, n_threads: usize, min_seconds: f64) -> Result<()> {
    crate::pool::check_n_threads(n_threads)?;
    if !min_seconds.is_finite() || min_seconds < 0.0 {
        return Err(Error::InvalidArgument(format!(
            "{what}: seconds must be a finite non-negative number, got {min_seconds}"
        )));
    }
    Ok(())
}

/// Runs `run(iters)` (`ops` operations per iteration) on `n_threads` threads started
/// together for about `min_seconds` (at least 1 ms), best of three runs: operations per second
/// over the slowest thread's time, in billions.
fn measure(n_threads: usize, min_seconds: f64, ops: f64, run: impl Fn(u64) + Sync) -> Result<f64> {
    let target = Duration::from_secs_f64(min_seconds.clamp(1e-3, 60.0));
    // Calibrate on one thread: iterations that take about a tenth of the target, then scale.
    let mut iters = 1u64 << 12;
    loop {
        let t = Instant::now();
        run(iters);
        let took = t.elapsed();
        if took >= target / 10 || iters >= 1 << 40 {
            let scale = target.as_secs_f64() / took.as_secs_f64().max(1e-9);
            iters = ((iters as f64 * scale) as u64).clamp(1, 1 << 42);
            break;
        }
        iters *= 4;
    }
    let total = n_threads as f64 * iters as f64 * ops;
    let mut best = f64::INFINITY;
    for _ in 0..3 {
        let start = std::sync::Barrier::new(n_threads);
        let slowest = std::thread::scope(|scope| {
            let handles: Vec<_> = (0..n_threads)
                .map(|_| {
                    scope.spawn(|| {
                        start.wait();
                        let t = Instant::now();
                        run(iters);
                        t.elapsed()
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().unwrap_or(Duration::MAX))
                .max()
                .unwrap_or(Duration::MAX)
        });
        best = best.min(slowest.as_secs_f64());
    }
    Ok(total / best / 1e9)
}

/// The ISA the chains run on: the widest the kernels use.
#[derive(Clone, Copy)]
enum Chains {
    /// 16 lanes.
    #[cfg(target_arch = "x86_64")]
    Avx512(super::simd::Avx512),
    /// 8 lanes.
    #[cfg(target_arch = "x86_64")]
    Avx2(super::simd::Avx2),
}

impl Chains {
    /// The widest ISA this CPU runs, if it has a vector multiply-add.
    fn detect() -> Option<Chains> {
        #[cfg(target_arch = "x86_64")]
        {
            use super::simd::{Avx2, Avx512};
            if let Some(t) = Avx512::new() {
                return Some(Chains::Avx512(t));
            }
            if let Some(t) = Avx2::new() {
                return Some(Chains::Avx2(t));
            }
        }
        None
    }

    /// f32 lanes per vector.
    fn lanes(self) -> usize {
        use super::simd::Simd;
        match self {
            #[cfg(target_arch = "x86_64")]
            Chains::Avx512(_) => super::simd::Avx512::LANES,
            #[cfg(target_arch = "x86_64")]
            Chains::Avx2(_) => super::simd::Avx2::LANES,
        }
    }

    /// `iters` rounds of [`CHAINS`] multiply-adds; returns a value that depends on every
    /// chain.
    fn run(self, iters: u64) -> f32 {
        match self {
            // SAFETY: the token proves AVX-512F.
            #[cfg(target_arch = "x86_64")]
            Chains::Avx512(t) => unsafe { entry::chains_avx512(t, iters) },
            // SAFETY: the token proves AVX2 and FMA.
            #[cfg(target_arch = "x86_64")]
            Chains::Avx2(t) => unsafe { entry::chains_avx2(t, iters) },
        }
    }
}

/// The chains, written once for every [`super::simd::Simd`].
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn chains<S: super::simd::Simd>(s: S, iters: u64) -> f32 {
    // x ← x·a + b converges to b / (1 − a) without overflow or subnormals.
    let (a, b) = (s.splat(0.999_9), s.splat(1e-4));
    let mut acc: [S::V; CHAINS] = std::array::from_fn(|i| s.splat(i as f32));
    for _ in 0..iters {
        for v in acc.iter_mut() {
            *v = s.fma(*v, a, b);
        }
    }
    let total = acc.iter().fold(s.zero(), |t, &v| s.add(t, v));
    super::simd::reduce_add(s, total)
}

/// Each ISA's compiled copy of [`chains`].
#[cfg(target_arch = "x86_64")]
mod entry {
    use super::super::simd::{Avx2, Avx512};

    /// [`super::chains`] with AVX2 and FMA.
    ///
    /// # Safety
    /// None beyond the token, which proves the features (`target_feature` makes it unsafe).
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn chains_avx2(t: Avx2, iters: u64) -> f32 {
        super::chains(t, iters)
    }

    /// [`super::chains`] with AVX-512F.
    ///
    /// # Safety
    /// As [`chains_avx2`].
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn chains_avx512(t: Avx512, iters: u64) -> f32 {
        super::chains(t, iters)
    }

    /// `iters` rounds of [`super::CHAINS`] `vpdpbusd`s (operands unknown to the compiler, so
    /// nothing folds); the lanes wrap, which is harmless.
    ///
    /// # Safety
    /// The CPU must have AVX-512F/BW/VNNI.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    pub(super) unsafe fn dpbusd_chains(iters: u64) -> i32 {
        use std::arch::x86_64::*;
        let a = _mm512_set1_epi8(std::hint::black_box(1));
        let b = _mm512_set1_epi8(std::hint::black_box(2));
        let mut acc = [_mm512_setzero_si512(); super::CHAINS];
        for _ in 0..iters {
            for v in acc.iter_mut() {
                *v = _mm512_dpbusd_epi32(*v, a, b);
            }
        }
        let total = acc
            .iter()
            .fold(_mm512_setzero_si512(), |t, &v| _mm512_add_epi32(t, v));
        _mm512_reduce_add_epi32(total)
    }

    /// `iters` rounds of [`super::CHAINS`] `vpmaddwd` + `vpaddd` pairs (the AVX2 integer
    /// kernel's step).
    ///
    /// # Safety
    /// The CPU must have AVX2.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn maddwd_chains(iters: u64) -> i32 {
        use std::arch::x86_64::*;
        let a = _mm256_set1_epi16(std::hint::black_box(1));
        let b = _mm256_set1_epi16(std::hint::black_box(2));
        let mut acc = [_mm256_setzero_si256(); super::CHAINS];
        for _ in 0..iters {
            for v in acc.iter_mut() {
                // The product reads the chain, so it cannot be hoisted out of the loop.
                *v = _mm256_add_epi32(_mm256_madd_epi16(*v, b), a);
            }
        }
        let total = acc
            .iter()
            .fold(_mm256_setzero_si256(), |t, &v| _mm256_add_epi32(t, v));
        let mut lanes = [0i32; 8];
        // SAFETY: `lanes` holds 8 i32.
        unsafe { _mm256_storeu_si256(lanes.as_mut_ptr().cast(), total) };
        lanes.iter().fold(0i32, |t, &v| t.wrapping_add(v))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_peak_is_a_positive_figure_and_bad_arguments_are_errors() {
        let Some(chains) = Chains::detect() else {
            assert!(fma_peak_gflops(1, 0.001).is_err());
            return;
        };
        for n in [1, 2, 3] {
            let g = fma_peak_gflops(n, 0.001).unwrap();
            assert!(g.is_finite() && g > 0.0, "{n} threads: {g}");
        }
        assert!(fma_peak_gflops(0, 0.01).is_err());
        assert!(fma_peak_gflops(1, f64::NAN).is_err());
        assert!(fma_peak_gflops(1, -1.0).is_err());
        for n in [1, 2] {
            let g = int8_peak_gops(n, 0.001).unwrap();
            assert!(g.is_finite() && g > 0.0, "{n} threads: {g}");
        }
        assert!(int8_peak_gops(0, 0.01).is_err());
        assert!(int8_peak_gops(1, f64::INFINITY).is_err());
        // The chains converge to b / (1 − a) = 1 in every lane.
        let v = chains.run(100_000) / (chains.lanes() * CHAINS) as f32;
        assert!((v - 1.0).abs() < 1e-3, "{v}");
    }
}
