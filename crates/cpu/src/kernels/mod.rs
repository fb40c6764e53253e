//! CPU kernels, one module per op family.
//!
//! Every kernel receives raw views ([`view::RawTensor`]) of its output and sources, already
//! checked to be allocated host tensors, and runs on the pool the caller computes on. Work is split
//! over rows (or output tiles) so that no two tasks write the same bytes; ops that may run in
//! place read each row completely before writing it.

pub mod attention;
pub mod binary;
pub mod block_dot;
#[cfg(target_arch = "x86_64")]
pub(crate) mod block_x86;
pub mod copy;
pub mod custom;
pub mod dot_iq1;
pub mod dot_iq2;
pub mod dot_iq3;
pub mod dot_k;
pub mod dot_legacy;
pub mod dot_lowbit;
pub mod dot_tile;
pub mod gemm;
pub mod gemm_bf16;
pub mod gemm_q8;
pub mod interleaved;
pub mod math;
pub mod matmul;
pub mod norm;
pub mod peak;
pub mod quant_dot;
pub mod reduce;
pub mod rope;
pub(crate) mod simd;
pub mod softmax;
pub mod stored_layout;
pub mod unary;
pub mod view;

use std::ops::Range;

/// Defines a function whose body is compiled twice, for the baseline target and with AVX2+FMA
/// enabled, the latter chosen at run time when the CPU has them. For loops the compiler
/// auto-vectorises: a portable build then still runs 8-wide (the body must not depend on
/// which copy runs, only get faster).
macro_rules! simd_fn {
    ($(#[$meta:meta])* $vis:vis fn $name:ident($($arg:ident: $ty:ty),* $(,)?) $(-> $ret:ty)? $body:block) => {
        $(#[$meta])*
        $vis fn $name($($arg: $ty),*) $(-> $ret)? {
            #[inline(always)]
            fn body($($arg: $ty),*) $(-> $ret)? $body
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx2,fma")]
                unsafe fn avx2($($arg: $ty),*) $(-> $ret)? {
                    body($($arg),*)
                }
                if $crate::isa::get().avx2_fma() {
                    // SAFETY: the CPU supports AVX2 and FMA (checked just above).
                    return unsafe { avx2($($arg),*) };
                }
            }
            body($($arg),*)
        }
    };
}
pub(crate) use simd_fn;

use crate::error::Result;

pub(crate) use crate::pool::current_num_threads;

/// Elements a task should handle at least, so scheduling costs stay small.
pub(crate) const MIN_TASK_ELEMENTS: usize = 16 * 1024;

/// Rows per task for rows of `row_len` elements.
pub(crate) fn row_grain(row_len: usize) -> usize {
    (MIN_TASK_ELEMENTS / row_len.max(1)).max(1)
}

/// Runs `f` over `0..n` split into ranges of at least `grain` items, in parallel on the
/// threads of the pool the calling thread computes on (on the calling thread alone when
/// there is one range, outside a computation, or inside another split: nested calls never
/// wait for other threads). The ranges depend on `n`, `grain` and the pool's size only. The
/// first error is returned.
pub(crate) fn par_ranges<F>(n: usize, grain: usize, f: F) -> Result<()>
where
    F: Fn(Range<usize>) -> Result<()> + Sync,
{
    split_ranges(n, grain, false, f)
}

/// [`par_ranges`] for even tasks that read memory in order (a mat-vec's weight rows, the int8
/// GEMM's weight panels, a decoding step's attention over the KV cache): one range per thread.
/// Every range costs a claim and a done-count on lines the threads share, and restarts the
/// core's prefetch stream; decoding SmolLM2 (2 threads, Zen 5) measured 8-9% faster per token
/// with one range per thread than with four (paired blocks in one process). On a pool with
/// more threads than the CPUs it may run on, some thread always waits for a CPU and nothing
/// could take over its one range (3 threads on 2 cores: 7% slower than four ranges), so there
/// the split stays as [`par_ranges`] makes it.
pub(crate) fn par_ranges_streaming<F>(n: usize, grain: usize, f: F) -> Result<()>
where
    F: Fn(Range<usize>) -> Result<()> + Sync,
{
    split_ranges(n, grain, true, f)
}

/// [`par_ranges`] with about four ranges per thread, or one per thread for a `streaming` split
/// whose threads have a CPU each (see [`par_ranges_streaming`]); fewer when `grain` says so.
fn split_ranges<F>(n: usize, grain: usize, streaming: bool, f: F) -> Result<()>
where
    F: Fn(Range<usize>) -> Result<()> + Sync,
{
    if n == 0 {
        return Ok(());
    }
    let threads = current_num_threads().max(1);
    let per_thread = if streaming && crate::pool::current_threads_have_cpus() {
        1
    } else {
        4
    };
    let chunk = grain.max(n.div_ceil(threads * per_thread)).max(1);
    let n_chunks = n.div_ceil(chunk);
    if n_chunks <= 1 || threads == 1 {
        return f(0..n);
    }
    crate::pool::run_chunks(n, chunk, &f)
}

/// Runs `f(r, row, buf)` for every `row_len`-element row `r` of `out` (its length a multiple of
/// `row_len`), split over the pool as [`par_ranges`] splits rows; `buf` is a per-task scratch
/// made by `init`. Each row is written by one task alone.
pub(crate) fn par_rows_mut<T, B, I, F>(out: &mut [T], row_len: usize, init: I, f: F) -> Result<()>
where
    T: Send,
    I: Fn() -> B + Sync,
    F: Fn(usize, &mut [T], &mut B) -> Result<()> + Sync,
{
    if row_len == 0 {
        return Ok(());
    }
    debug_assert!(out.len().is_multiple_of(row_len));
    let n_rows = out.len() / row_len;
    let base = view::SendPtr(out.as_mut_ptr().cast::<u8>());
    par_ranges(n_rows, row_grain(row_len), |rows| {
        let ptr = base; // the whole SendPtr, not its raw field
        let mut buf = init();
        for r in rows {
            // SAFETY: `out` holds `n_rows` rows of `row_len` elements and stays mutably
            // borrowed for this call; ranges are disjoint, so row `r` is this task's alone.
            let row = unsafe {
                std::slice::from_raw_parts_mut(ptr.0.cast::<T>().add(r * row_len), row_len)
            };
            f(r, row, &mut buf)?;
        }
        Ok(())
    })
}

/// Test support shared by the kernel unit tests.
#[cfg(test)]
pub(crate) mod testing {
    use crate::pool::{Threadpool, ThreadpoolParams};

    /// Thread counts kernel results are compared at.
    pub const THREAD_COUNTS: [usize; 3] = [1, 2, 3];

    /// A reproducible xorshift32 stream from `seed` (0 counts as 1).
    pub fn xorshift32(seed: u32) -> impl Iterator<Item = u32> {
        let mut s = seed.max(1);
        std::iter::repeat_with(move || {
            s ^= s << 13;
            s ^= s >> 17;
            s ^= s << 5;
            s
        })
    }

    /// `n` reproducible bytes from `seed`.
    pub fn bytes(n: usize, seed: u32) -> Vec<u8> {
        xorshift32(seed).take(n).map(|s| (s >> 7) as u8).collect()
    }

    /// Checks a stored layout's byte mapping over `plain` (the matrix's plain bytes, written
    /// whole into `stored` already): the whole matrix reads back, then 300 arbitrary ranges
    /// (up to three blocks of `block` bytes) read back what was last written and take fresh
    /// bytes, and the whole matrix reads back those at the end.
    pub fn check_range_mapping(
        plain: &[u8],
        block: usize,
        stored: &mut [u8],
        copy_in: impl Fn(&mut [u8], usize, &[u8]),
        copy_out: impl Fn(&[u8], usize, &mut [u8]),
    ) {
        let mut back = vec![0u8; plain.len()];
        copy_out(stored, 0, &mut back);
        assert_eq!(back, plain);
        let mut expect = plain.to_vec();
        let mut s = 3usize;
        for i in 0..300 {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let a = (s >> 20) % plain.len();
            let b = a + (s >> 40) % (plain.len() - a + 1).min(3 * block);
            let mut piece = vec![0u8; b - a];
            copy_out(stored, a, &mut piece);
            assert_eq!(piece, expect[a..b], "read {a}..{b}");
            let fresh = bytes(b - a, i + 1);
            copy_in(stored, a, &fresh);
            expect[a..b].copy_from_slice(&fresh);
        }
        let mut whole = vec![0u8; plain.len()];
        copy_out(stored, 0, &mut whole);
        assert_eq!(whole, expect);
    }

    /// `n` reproducible values in [-1, 1] from `seed`.
    pub fn values(n: usize, seed: u32) -> Vec<f32> {
        xorshift32(seed)
            .take(n)
            .map(|s| (s as f32 / u32::MAX as f32) * 2.0 - 1.0)
            .collect()
    }

    /// Runs `f` on pools of 1, 2 and 3 threads, asserts that every run returns the same
    /// value (compare bit patterns for floats), and returns it.
    pub fn at_thread_counts<T: PartialEq>(f: impl Fn() -> T + Sync) -> T {
        let mut results = THREAD_COUNTS.iter().map(|&threads| {
            Threadpool::new(&ThreadpoolParams::new(threads))
                .expect("thread pool")
                .run(&f)
        });
        let first = results.next().expect("at least one thread count");
        for (got, threads) in results.zip(&THREAD_COUNTS[1..]) {
            assert!(
                got == first,
                "the result at {threads} threads differs from 1 thread"
            );
        }
        first
    }
}

/// Test support shared by the block dot-product tests.
#[cfg(test)]
pub(crate) mod dot_test_support;
