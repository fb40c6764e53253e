//! Throughput of the row conversions, in bytes of output per second, next to a plain memcpy of
//! the same number of output bytes.
//!
//! Large rows (16M elements) run on a dedicated 2-thread rayon pool, so they take the threaded
//! path; small rows (4096 elements) stay on one thread. Run with `cargo bench --bench convert`.

use std::hint::black_box;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use ferrograph::convert::*;
use half::{bf16, f16};
use rayon::prelude::*;

const LARGE: usize = 16 << 20;
const SMALL: usize = 4096;

fn inputs(n: usize) -> (Vec<f32>, Vec<f16>, Vec<bf16>) {
    // Ordinary values spread over several binades, like activations or weights.
    let f: Vec<f32> = (0..n)
        .map(|i| ((i as f32) * 0.618_034).sin() * 100.0)
        .collect();
    let h: Vec<f16> = f.iter().map(|&x| fp32_to_fp16(x)).collect();
    let b: Vec<bf16> = f.iter().map(|&x| fp32_to_bf16(x)).collect();
    (f, h, b)
}

/// memcpy split across the current pool: the bandwidth peer of the threaded conversions.
fn par_copy<T: Copy + Send + Sync>(src: &[T], dst: &mut [T]) {
    let chunk = src.len().div_ceil(rayon::current_num_threads());
    dst.par_chunks_mut(chunk)
        .zip(src.par_chunks(chunk))
        .for_each(|(d, s)| d.copy_from_slice(s));
}

/// The four conversions and the memcpy peers for rows of `n` elements, each iteration run
/// through `run` (which installs the pool to use).
fn bench_rows(c: &mut Criterion, name: &str, n: usize, run: &dyn Fn(&mut (dyn FnMut() + Send))) {
    let (f, h, b) = inputs(n);
    let mut out_f = vec![0f32; n];
    let mut out_h = vec![f16::ZERO; n];
    let mut out_b = vec![bf16::ZERO; n];
    let src_u16: Vec<u16> = h.iter().map(|x| x.to_bits()).collect();
    let mut dst_u16 = vec![0u16; n];
    let mut dst_f = vec![0f32; n];
    let large = n >= LARGE;

    let mut g = c.benchmark_group(name);
    g.sample_size(10)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_millis(if large { 2000 } else { 1000 }));

    // Two output bytes per element.
    g.throughput(Throughput::Bytes((n * 2) as u64));
    g.bench_function("f32_to_f16", |bch| {
        bch.iter(|| run(&mut || fp32_to_fp16_row(black_box(&f), &mut out_h).unwrap()))
    });
    g.bench_function("f32_to_bf16", |bch| {
        bch.iter(|| run(&mut || fp32_to_bf16_row(black_box(&f), &mut out_b).unwrap()))
    });
    g.bench_function("memcpy_2B", |bch| {
        bch.iter(|| dst_u16.copy_from_slice(black_box(&src_u16)))
    });
    if large {
        g.bench_function("memcpy_2B_pool", |bch| {
            bch.iter(|| run(&mut || par_copy(black_box(&src_u16), &mut dst_u16)))
        });
    }

    // Four output bytes per element.
    g.throughput(Throughput::Bytes((n * 4) as u64));
    g.bench_function("f16_to_f32", |bch| {
        bch.iter(|| run(&mut || fp16_to_fp32_row(black_box(&h), &mut out_f).unwrap()))
    });
    g.bench_function("bf16_to_f32", |bch| {
        bch.iter(|| run(&mut || bf16_to_fp32_row(black_box(&b), &mut out_f).unwrap()))
    });
    g.bench_function("memcpy_4B", |bch| {
        bch.iter(|| dst_f.copy_from_slice(black_box(&f)))
    });
    if large {
        g.bench_function("memcpy_4B_pool", |bch| {
            bch.iter(|| run(&mut || par_copy(black_box(&f), &mut dst_f)))
        });
    }
    g.finish();
}

fn benches(c: &mut Criterion) {
    eprintln!("simd path: {}", simd_path());
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(2)
        .build()
        .expect("thread pool");
    bench_rows(c, "convert_16M_2threads", LARGE, &|f| pool.install(f));
    bench_rows(c, "convert_4096", SMALL, &|f| f());
}

criterion_group!(convert_benches, benches);
criterion_main!(convert_benches);
