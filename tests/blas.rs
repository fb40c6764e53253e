//! The BLAS backend: products against an f64 reference, support rules, the registration.
//!
//! Tests skip (with a printed reason) when no BLAS library is found, except under CI (env
//! `CI` set), where a missing library is a failure.

use std::sync::Arc;
use std::time::Instant;

use ferrograph::backend::Backend;
use ferrograph::blas::{self, BlasBackend};
use ferrograph::buffer::CpuBufferType;
use ferrograph::context::Context;
use ferrograph::cpu::backend::CpuBackend;
use ferrograph::device::{BackendParams, Device, DeviceType};
use ferrograph::dtype::DType;
use ferrograph::error::Error;
use ferrograph::graph::Graph;
use ferrograph::ops;
use ferrograph::registry;
use ferrograph::tensor::Tensor;

/// The BLAS backend, or `None` (after saying why) when there is no BLAS library here.
fn blas_backend(n_threads: usize) -> Option<Arc<BlasBackend>> {
    match blas::library() {
        Some(library) => Some(Arc::new(BlasBackend::new(library, n_threads).unwrap())),
        None => {
            let reason = blas::unavailable_reason().unwrap_or_default();
            if std::env::var_os("CI").is_some() {
                panic!("CI is set but no BLAS library was found: {reason}");
            }
            eprintln!("skipping: no BLAS library ({reason})");
            None
        }
    }
}

/// Deterministic values in [-1, 1).
fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut state = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((state >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

fn nmse(got: &[f32], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len());
    let err: f64 = got
        .iter()
        .zip(want)
        .map(|(&g, &w)| (g as f64 - w).powi(2))
        .sum();
    let norm: f64 = want.iter().map(|w| w * w).sum();
    err / norm.max(f64::MIN_POSITIVE)
}

/// ggml's MUL_MAT in f64 on the values the tensors actually hold.
fn mul_mat_reference(a: &Tensor, b: &Tensor) -> Vec<f64> {
    let (na, nb) = (a.ne(), b.ne());
    let (av, bv) = (a.to_f32_vec().unwrap(), b.to_f32_vec().unwrap());
    let (k, m, n) = (na[0], na[1], nb[1]);
    let (r2, r3) = (nb[2] / na[2], nb[3] / na[3]);
    let mut out = Vec::with_capacity(m * n * nb[2] * nb[3]);
    for i3 in 0..nb[3] {
        for i2 in 0..nb[2] {
            let abase = ((i3 / r3) * na[2] + i2 / r2) * m * k;
            let bbase = (i3 * nb[2] + i2) * n * k;
            for j in 0..n {
                for i in 0..m {
                    let arow = &av[abase + i * k..abase + (i + 1) * k];
                    let brow = &bv[bbase + j * k..bbase + (j + 1) * k];
                    out.push(
                        arow.iter()
                            .zip(brow)
                            .map(|(&x, &y)| x as f64 * y as f64)
                            .sum(),
                    );
                }
            }
        }
    }
    out
}

fn check_mul_mat(backend: &BlasBackend, dtype: DType, a_ne: [usize; 4], b_ne: [usize; 4]) {
    let ctx = Context::new(false);
    let a = ctx.new_tensor(dtype, &a_ne).unwrap();
    let b = ctx.new_tensor(DType::F32, &b_ne).unwrap();
    a.set_f32(&values(a.nelements(), 1)).unwrap();
    b.set_f32(&values(b.nelements(), 2)).unwrap();
    let out = ops::mul_mat(&ctx, &a, &b).unwrap();
    assert!(
        backend.supports_op(&out),
        "{dtype:?} {a_ne:?} x {b_ne:?} should be supported"
    );
    let graph = Graph::build(std::slice::from_ref(&out));
    backend.graph_compute(&graph).unwrap();
    let got = out.to_f32_vec().unwrap();
    let want = mul_mat_reference(&a, &b);
    let error = nmse(&got, &want);
    assert!(
        error <= 5e-4,
        "{dtype:?} {a_ne:?} x {b_ne:?}: NMSE {error:e}"
    );
}

#[test]
fn mul_mat_matches_reference_for_every_weight_type() {
    let Some(backend) = blas_backend(2) else {
        return;
    };
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        check_mul_mat(&backend, dtype, [71, 37, 1, 1], [71, 33, 1, 1]);
    }
    for dtype in [DType::Q8_0, DType::Q4_0] {
        check_mul_mat(&backend, dtype, [96, 37, 1, 1], [96, 35, 1, 1]);
    }
}

#[test]
fn mul_mat_broadcasts_batches() {
    let Some(backend) = blas_backend(2) else {
        return;
    };
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        // a: 2 x 3 batches, b: 4 x 3 batches (r2 = 2, r3 = 1)
        check_mul_mat(&backend, dtype, [45, 41, 2, 3], [45, 39, 4, 3]);
        // a: one batch shared by 2 x 2 batches of b
        check_mul_mat(&backend, dtype, [33, 32, 1, 1], [33, 47, 2, 2]);
    }
    for dtype in [DType::Q8_0, DType::Q4_0] {
        check_mul_mat(&backend, dtype, [64, 33, 2, 1], [64, 35, 4, 2]);
    }
}

#[test]
fn mul_mat_agrees_with_the_cpu_backend() {
    let Some(backend) = blas_backend(2) else {
        return;
    };
    let cpu = CpuBackend::new(2).unwrap();
    let ctx = Context::new(false);
    let a = ctx.new_tensor(DType::F16, &[128, 65, 2]).unwrap();
    let b = ctx.new_tensor(DType::F32, &[128, 40, 2]).unwrap();
    a.set_f32(&values(a.nelements(), 3)).unwrap();
    b.set_f32(&values(b.nelements(), 4)).unwrap();
    let out_blas = ops::mul_mat(&ctx, &a, &b).unwrap();
    let out_cpu = ops::mul_mat(&ctx, &a, &b).unwrap();
    backend
        .graph_compute(&Graph::build(std::slice::from_ref(&out_blas)))
        .unwrap();
    cpu.graph_compute(&Graph::build(std::slice::from_ref(&out_cpu)))
        .unwrap();
    let want: Vec<f64> = out_cpu
        .to_f32_vec()
        .unwrap()
        .iter()
        .map(|&v| v as f64)
        .collect();
    let error = nmse(&out_blas.to_f32_vec().unwrap(), &want);
    assert!(error <= 1e-6, "NMSE {error:e}");
}

fn out_prod_reference(a: &Tensor, b: &Tensor) -> Vec<f64> {
    let (na, nb) = (a.ne(), b.ne());
    let (av, bv) = (a.to_f32_vec().unwrap(), b.to_f32_vec().unwrap());
    let (n0, kk, n1) = (na[0], na[1], nb[0]);
    let mut out = Vec::with_capacity(n0 * n1);
    for i1 in 0..n1 {
        for i0 in 0..n0 {
            out.push(
                (0..kk)
                    .map(|k| av[k * n0 + i0] as f64 * bv[k * n1 + i1] as f64)
                    .sum(),
            );
        }
    }
    out
}

#[test]
fn out_prod_plain_and_transposed() {
    let Some(backend) = blas_backend(2) else {
        return;
    };
    let ctx = Context::new(false);
    let (n0, kk, n1) = (37, 45, 33);
    let a = ctx.new_tensor(DType::F32, &[n0, kk]).unwrap();
    let b = ctx.new_tensor(DType::F32, &[n1, kk]).unwrap();
    a.set_f32(&values(a.nelements(), 5)).unwrap();
    b.set_f32(&values(b.nelements(), 6)).unwrap();
    // `bt` views a [kk, n1] tensor transposed: the same values as `b` in another layout.
    let c = ctx.new_tensor(DType::F32, &[kk, n1]).unwrap();
    let bv = b.to_f32_vec().unwrap();
    let mut cv = vec![0f32; kk * n1];
    for k in 0..kk {
        for i1 in 0..n1 {
            cv[i1 * kk + k] = bv[k * n1 + i1];
        }
    }
    c.set_f32(&cv).unwrap();
    let bt = ops::transpose(&ctx, &c).unwrap();
    let want = out_prod_reference(&a, &b);
    for operand in [&b, &bt] {
        let out = ops::out_prod(&ctx, &a, operand).unwrap();
        assert!(backend.supports_op(&out));
        backend
            .graph_compute(&Graph::build(std::slice::from_ref(&out)))
            .unwrap();
        let error = nmse(&out.to_f32_vec().unwrap(), &want);
        assert!(error <= 5e-4, "NMSE {error:e}");
    }
}

#[test]
fn support_rules_follow_the_size_threshold() {
    let Some(backend) = blas_backend(1) else {
        return;
    };
    let ctx = Context::new(true);
    let product = |k: usize, m: usize, n: usize, dtype: DType| {
        let a = ctx.new_tensor(dtype, &[k, m]).unwrap();
        let b = ctx.new_tensor(DType::F32, &[k, n]).unwrap();
        ops::mul_mat(&ctx, &a, &b).unwrap()
    };
    assert_eq!(backend.min_dim(), blas::DEFAULT_MIN_DIM);
    assert!(backend.supports_op(&product(32, 32, 32, DType::F32)));
    assert!(backend.supports_op(&product(64, 32, 32, DType::Q8_0)));
    assert!(!backend.supports_op(&product(31, 64, 64, DType::F32)));
    assert!(!backend.supports_op(&product(64, 31, 64, DType::F32)));
    assert!(!backend.supports_op(&product(64, 64, 31, DType::F32)));
    let small = product(16, 8, 8, DType::F32);
    assert!(!backend.supports_op(&small));
    backend.set_min_dim(8);
    assert!(backend.supports_op(&small));
    assert!(!product_i32_supported(&ctx, &backend));

    // a non-contiguous activation operand is left to the CPU
    let a = ctx.new_tensor(DType::F32, &[64, 64]).unwrap();
    let bt = ctx.new_tensor(DType::F32, &[64, 64]).unwrap();
    let b = ops::transpose(&ctx, &bt).unwrap();
    let prod = ops::mul_mat(&ctx, &a, &b).unwrap();
    assert!(!backend.supports_op(&prod));

    // views are no-ops, other ops are not supported
    assert!(backend.supports_op(&ops::transpose(&ctx, &a).unwrap()));
    assert!(!backend.supports_op(&ops::add(&ctx, &a, &a).unwrap()));
    assert!(!backend.offload_op(&prod));
    assert!(backend.supports_buft(CpuBufferType::shared().as_ref()));

    // the threshold can be given as a backend parameter
    let device = blas::shared_device().unwrap();
    let tuned = device
        .init_backend(&BackendParams::parse("n_threads=1,min_dim=4").unwrap())
        .unwrap();
    assert!(tuned.supports_op(&small));
    assert!(device
        .init_backend(&BackendParams::parse("min_dim=x").unwrap())
        .is_err());
}

fn product_i32_supported(ctx: &Context, backend: &BlasBackend) -> bool {
    let a = ctx.new_tensor(DType::F32, &[64, 64]).unwrap();
    let s = ops::sum_rows(ctx, &a).unwrap();
    backend.supports_op(&s)
}

#[test]
fn unsupported_nodes_are_errors_not_panics() {
    let Some(backend) = blas_backend(1) else {
        return;
    };
    let ctx = Context::new(false);
    let a = ctx.new_tensor(DType::F32, &[4, 4]).unwrap();
    a.set_f32(&[1.0; 16]).unwrap();
    let sum = ops::add(&ctx, &a, &a).unwrap();
    let err = backend
        .graph_compute(&Graph::build(std::slice::from_ref(&sum)))
        .unwrap_err();
    assert!(matches!(err, Error::OpUnsupported { .. }), "{err}");
}

#[test]
fn registration_and_device() {
    let Some(_backend) = blas_backend(1) else {
        assert!(blas::registration().devices().is_empty());
        return;
    };
    let reg = blas::registration();
    assert_eq!(reg.name(), "BLAS");
    let devices = reg.devices();
    assert_eq!(devices.len(), 1);
    let device = &devices[0];
    assert_eq!(device.name(), "BLAS");
    assert_eq!(device.device_type(), DeviceType::Accel);
    let library = blas::library().unwrap();
    assert!(
        device.description().contains(library.file()),
        "{}",
        device.description()
    );
    assert!(device.buffer_type().is_host());
    assert!(device.supports_buft(CpuBufferType::shared().as_ref()));

    // in-process registration beside the CPU
    blas::register().unwrap();
    assert!(blas::register().is_err(), "a second BLAS registration");
    let found = registry::dev_by_type(DeviceType::Accel).unwrap();
    assert_eq!(found.name(), "BLAS");
    let backend = registry::init_by_name("blas", "n_threads=2").unwrap();
    assert_eq!(backend.name(), "BLAS");
    match reg.proc_address("set_n_threads") {
        Some(registry::Extension::SetThreadCount(set)) => set(backend.as_ref(), 1).unwrap(),
        other => panic!("unexpected {other:?}"),
    }
    assert_eq!(blas::as_blas(backend.as_ref()).unwrap().n_threads(), 1);
    registry::unregister("BLAS").unwrap();
    assert!(registry::dev_by_name("BLAS").is_none());
}

/// One-off timing of a 4096×4096×512 f32 product (run with
/// `cargo test --release --test blas -- --ignored --nocapture`).
#[test]
#[ignore = "timing; run explicitly in release mode"]
fn timing_4096x4096x512() {
    let Some(backend) = blas_backend(ferrograph::cpu::backend::default_n_threads()) else {
        return;
    };
    let cpu = CpuBackend::new(ferrograph::cpu::backend::default_n_threads()).unwrap();
    let (k, m, n) = (4096, 4096, 512);
    let ctx = Context::new(false);
    let a = ctx.new_tensor(DType::F32, &[k, m]).unwrap();
    let b = ctx.new_tensor(DType::F32, &[k, n]).unwrap();
    a.set_f32(&values(k * m, 7)).unwrap();
    b.set_f32(&values(k * n, 8)).unwrap();
    let flops = 2.0 * (k * m * n) as f64;
    let mut results = Vec::new();
    for (name, backend) in [
        ("BLAS", backend.clone() as Arc<dyn Backend>),
        ("CPU", Arc::new(cpu) as Arc<dyn Backend>),
    ] {
        let out = ops::mul_mat(&ctx, &a, &b).unwrap();
        let graph = Graph::build(std::slice::from_ref(&out));
        backend.graph_compute(&graph).unwrap(); // warm-up
        let runs = 3;
        let start = Instant::now();
        for _ in 0..runs {
            backend.graph_compute(&graph).unwrap();
        }
        let seconds = start.elapsed().as_secs_f64() / runs as f64;
        println!(
            "{name}: {:.1} ms, {:.1} GFLOPS",
            seconds * 1e3,
            flops / seconds / 1e9
        );
        results.push(out.to_f32_vec().unwrap());
    }
    let want: Vec<f64> = results[1].iter().map(|&v| v as f64).collect();
    assert!(nmse(&results[0], &want) <= 1e-6);
}
