//! Dynamic backend loading with the library built from `backends/blas`.
//!
//! Build the library first: `cargo build -p ferrograph-blas` (same target directory and
//! profile as the tests). Without it the tests that need it skip with a message, except
//! under CI (env `CI` set), where they fail.

use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard, OnceLock};

use ferrograph::backend::Backend;
use ferrograph::blas;
use ferrograph::context::Context;
use ferrograph::cpu::backend::CpuBackend;
use ferrograph::device::DeviceType;
use ferrograph::dtype::DType;
use ferrograph::dynload;
use ferrograph::graph::Graph;
use ferrograph::ops;
use ferrograph::registry;

/// The registry is process-wide: tests that change or count it run one at a time.
fn serial() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|p| p.into_inner())
}

/// Log records seen by this process (the loader's and the library's, forwarded).
fn records() -> &'static Mutex<Vec<(log::Level, String, String)>> {
    static RECORDS: OnceLock<Mutex<Vec<(log::Level, String, String)>>> = OnceLock::new();
    RECORDS.get_or_init(|| Mutex::new(Vec::new()))
}

struct Capture;

impl log::Log for Capture {
    fn enabled(&self, metadata: &log::Metadata<'_>) -> bool {
        metadata.level() <= log::Level::Debug
    }

    fn log(&self, record: &log::Record<'_>) {
        if self.enabled(record.metadata()) {
            records().lock().unwrap_or_else(|p| p.into_inner()).push((
                record.level(),
                record.target().to_owned(),
                record.args().to_string(),
            ));
        }
    }

    fn flush(&self) {}
}

fn capture_logs() {
    static LOGGER: Capture = Capture;
    if log::set_logger(&LOGGER).is_ok() {
        log::set_max_level(log::LevelFilter::Debug);
    }
}

fn take_records() -> Vec<(log::Level, String, String)> {
    std::mem::take(&mut *records().lock().unwrap_or_else(|p| p.into_inner()))
}

fn library_file_name() -> String {
    format!(
        "{}ferrograph_blas{}",
        std::env::consts::DLL_PREFIX,
        std::env::consts::DLL_SUFFIX
    )
}

/// `libferrograph_blas.so` beside this test's build: the test executable lives in
/// `<target>/<profile>/deps/`, the library in `<target>/<profile>/`.
fn blas_library() -> Option<PathBuf> {
    let name = library_file_name();
    let mut candidates = Vec::new();
    if let Some(dir) = std::env::current_exe()
        .ok()
        .and_then(|exe| exe.parent()?.parent().map(Path::to_path_buf))
    {
        candidates.push(dir.join(&name));
    }
    if let Some(target) = Path::new(env!("CARGO_TARGET_TMPDIR")).parent() {
        candidates.push(target.join("debug").join(&name));
    }
    if let Some(found) = candidates.iter().find(|p| p.is_file()) {
        return Some(found.clone());
    }
    let message = format!(
        "{name} not found (looked at {candidates:?}); build it with `cargo build -p \
         ferrograph-blas` using the same target directory"
    );
    if std::env::var_os("CI").is_some() {
        panic!("CI is set: {message}");
    }
    eprintln!("skipping: {message}");
    None
}

/// A shared library that is certainly not a ferrograph backend (the C maths library).
fn system_libm() -> Option<PathBuf> {
    let from_maps = std::fs::read_to_string("/proc/self/maps")
        .ok()
        .and_then(|maps| {
            maps.lines()
                .filter_map(|line| line.split_whitespace().nth(5))
                .find(|path| {
                    path.rsplit('/')
                        .next()
                        .is_some_and(|f| f.starts_with("libm.so"))
                })
                .map(PathBuf::from)
        });
    from_maps.or_else(|| {
        [
            "/lib/x86_64-linux-gnu/libm.so.6",
            "/usr/lib/x86_64-linux-gnu/libm.so.6",
            "/lib/aarch64-linux-gnu/libm.so.6",
            "/usr/lib/aarch64-linux-gnu/libm.so.6",
            "/lib64/libm.so.6",
            "/usr/lib64/libm.so.6",
            "/usr/lib/libm.dylib",
        ]
        .iter()
        .map(PathBuf::from)
        .find(|p| p.is_file())
    })
}

fn registry_snapshot() -> (Vec<String>, Vec<String>) {
    (
        registry::registrations()
            .iter()
            .map(|r| r.name().to_owned())
            .collect(),
        registry::devices()
            .iter()
            .map(|d| d.name().to_owned())
            .collect(),
    )
}

/// A fresh empty directory under the target's scratch space.
fn scratch_dir(name: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("dynload-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Computes a product on the loaded BLAS backend and on the CPU and compares them.
fn product_through(backend: &dyn Backend) {
    let ctx = Context::new(false);
    let a = ctx.new_tensor(DType::F16, &[64, 48]).unwrap();
    let b = ctx.new_tensor(DType::F32, &[64, 40]).unwrap();
    a.set_f32(
        &(0..64 * 48)
            .map(|i| ((i % 7) as f32 - 3.0) / 8.0)
            .collect::<Vec<_>>(),
    )
    .unwrap();
    b.set_f32(
        &(0..64 * 40)
            .map(|i| ((i % 5) as f32 - 2.0) / 4.0)
            .collect::<Vec<_>>(),
    )
    .unwrap();
    let out = ops::mul_mat(&ctx, &a, &b).unwrap();
    let reference = ops::mul_mat(&ctx, &a, &b).unwrap();
    assert!(backend.supports_op(&out));
    backend
        .graph_compute(&Graph::build(std::slice::from_ref(&out)))
        .unwrap();
    CpuBackend::new(1)
        .unwrap()
        .graph_compute(&Graph::build(std::slice::from_ref(&reference)))
        .unwrap();
    let (got, want) = (out.to_f32_vec().unwrap(), reference.to_f32_vec().unwrap());
    for (g, w) in got.iter().zip(&want) {
        assert!((g - w).abs() <= 1e-4 * (1.0 + w.abs()), "{g} vs {w}");
    }
}

#[test]
fn load_use_unload_and_discover_the_blas_library() {
    let _guard = serial();
    capture_logs();
    let Some(path) = blas_library() else {
        return;
    };
    let have_blas = blas::is_available();
    let before = registry_snapshot();
    take_records();

    let loaded = dynload::load(&path);
    if !have_blas {
        // No BLAS library on this machine: the library scores 0 and is refused.
        let err = loaded.expect_err("a library that cannot run here is refused");
        assert!(err.to_string().contains("score 0"), "{err}");
        assert_eq!(registry_snapshot(), before);
        return;
    }
    let registration = loaded.unwrap();
    assert_eq!(registration.name(), "BLAS");
    let device = registry::dev_by_name("BLAS").expect("the loaded device is registered");
    assert_eq!(device.device_type(), DeviceType::Accel);
    assert_eq!(device.registration_name(), "BLAS");
    assert!(device.buffer_type().is_host());
    assert_eq!(
        dynload::loaded(),
        vec![dynload::LoadedBackend {
            name: "BLAS".into(),
            path: std::fs::canonicalize(&path).unwrap(),
            score: 1,
        }]
    );
    // The library's own log records reach this process's logger.
    let seen = take_records();
    assert!(
        seen.iter().any(
            |(_, target, msg)| target == "ferrograph_backends::dynload::__export"
                && msg.contains("created registration BLAS")
        ),
        "no forwarded record from the library in {seen:?}"
    );

    // Code from the library computes on tensors from this process.
    let backend = registry::init_by_name("BLAS", "n_threads=2").unwrap();
    product_through(backend.as_ref());

    // A second load of the same file is refused and changes nothing.
    let during = registry_snapshot();
    let err = dynload::load(&path).unwrap_err();
    assert!(err.to_string().contains("already loaded"), "{err}");
    assert_eq!(registry_snapshot(), during);

    // Unload: the registration and device go; the backend opened before still works because
    // the library stays mapped.
    dynload::unload("blas").unwrap();
    assert!(registry::reg_by_name("BLAS").is_none());
    assert!(registry::dev_by_name("BLAS").is_none());
    assert!(dynload::loaded().is_empty());
    assert_eq!(registry_snapshot(), before);
    product_through(backend.as_ref());
    assert!(dynload::unload("BLAS").is_err());
    assert!(dynload::unload("CPU").is_err(), "the CPU was not loaded");

    // Discovery in the library's directory finds and registers it again.
    let dir = path.parent().unwrap();
    let found = dynload::load_all_from_path(dir).unwrap();
    assert_eq!(
        found
            .iter()
            .map(|r| r.name().to_owned())
            .collect::<Vec<_>>(),
        vec!["BLAS".to_owned()]
    );
    assert!(registry::dev_by_name("BLAS").is_some());
    // ...and skips it when asked again, as a BLAS backend is already registered.
    take_records();
    assert!(dynload::load_all_from_path(dir).unwrap().is_empty());
    assert!(take_records()
        .iter()
        .any(|(_, _, msg)| msg.contains("already registered")));
    dynload::unload("BLAS").unwrap();

    // Variants of one backend: only the best-scoring one (here the first of equals) loads.
    let variants = scratch_dir("variants");
    for variant in ["libferrograph-blas-a.so", "libferrograph-blas-b.so"] {
        std::fs::copy(&path, variants.join(variant)).unwrap();
    }
    let found = dynload::load_all_from_path(&variants).unwrap();
    assert_eq!(found.len(), 1);
    let loaded = dynload::loaded();
    assert_eq!(loaded.len(), 1);
    assert!(loaded[0].path.ends_with("libferrograph-blas-a.so"));
    dynload::unload("BLAS").unwrap();
    assert_eq!(registry_snapshot(), before);
    let _ = std::fs::remove_dir_all(&variants);
}

#[test]
fn a_library_that_is_not_a_backend_is_refused() {
    let _guard = serial();
    capture_logs();
    let Some(libm) = system_libm() else {
        eprintln!("skipping: no system libm found");
        return;
    };
    let before = registry_snapshot();
    let err = dynload::load(&libm).unwrap_err();
    let text = err.to_string();
    assert!(text.contains("not a ferrograph backend"), "{text}");
    assert!(text.contains("ferrograph_backend_abi_version"), "{text}");
    assert_eq!(registry_snapshot(), before);

    // The same file under a backend's name is skipped by discovery, with the reason logged.
    let dir = scratch_dir("impostor");
    std::fs::copy(&libm, dir.join("libferrograph_impostor.so")).unwrap();
    std::fs::write(dir.join("libferrograph_empty.so"), b"").unwrap();
    std::fs::write(dir.join("README.txt"), b"not a library").unwrap();
    take_records();
    assert!(dynload::load_all_from_path(&dir).unwrap().is_empty());
    let seen = take_records();
    assert!(
        seen.iter()
            .any(|(_, _, msg)| msg.contains("impostor") && msg.contains("not a ferrograph backend")),
        "{seen:?}"
    );
    assert!(
        seen.iter()
            .any(|(_, _, msg)| msg.contains("libferrograph_empty.so") && msg.contains("skipping")),
        "{seen:?}"
    );
    assert_eq!(registry_snapshot(), before);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn missing_files_and_directories_are_errors() {
    let _guard = serial();
    let before = registry_snapshot();
    let missing = Path::new(env!("CARGO_TARGET_TMPDIR")).join("no-such-backend.so");
    let err = dynload::load(&missing).unwrap_err();
    assert!(err.to_string().contains("no-such-backend.so"), "{err}");
    assert!(dynload::load_all_from_path(missing.with_extension("dir")).is_err());
    let empty = scratch_dir("empty");
    assert!(dynload::load_all_from_path(&empty).unwrap().is_empty());
    let _ = std::fs::remove_dir_all(&empty);
    assert_eq!(registry_snapshot(), before);
}

#[test]
fn load_all_searches_the_configured_directories() {
    let _guard = serial();
    // Only reads the environment it was given; the directories must include the current one.
    let dirs = dynload::search_paths();
    let cwd = std::env::current_dir().unwrap();
    assert!(dirs.iter().any(|d| d == &cwd), "{dirs:?}");
    let exe_dir = std::env::current_exe()
        .unwrap()
        .parent()
        .unwrap()
        .to_path_buf();
    assert!(dirs.iter().any(|d| d == &exe_dir), "{dirs:?}");
    // Whatever it finds there (cargo also keeps the backend library in `deps/`, the test
    // executable's directory) is unloaded again, leaving the registry as it was.
    if std::env::var_os(dynload::BACKEND_PATH_ENV).is_none() {
        let before = registry_snapshot();
        let found = dynload::load_all();
        for registration in &found {
            dynload::unload(registration.name()).unwrap();
        }
        assert_eq!(registry_snapshot(), before);
    }
}

#[test]
fn abi_mismatches_are_refused_with_both_fingerprints() {
    assert!(dynload::check_abi(dynload::ABI_VERSION, dynload::abi_fingerprint()).is_ok());
    let err = dynload::check_abi(dynload::ABI_VERSION + 1, dynload::abi_fingerprint())
        .unwrap_err()
        .to_string();
    assert!(err.contains("version mismatch"), "{err}");
    let other = "ferrograph 0.0.1; rustc 1.70.0 (00000000 2023-06-01); x86_64-unknown-linux-gnu";
    let err = dynload::check_abi(dynload::ABI_VERSION, other)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains(other) && err.contains(dynload::abi_fingerprint()),
        "{err}"
    );
}
