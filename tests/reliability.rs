//! Bad input to the core gives an error before anything is allocated or read: sizes and
//! offsets past a buffer or tensor (including ones that overflow), thread and copy counts,
//! backend parameter text, registry names, and views that would cut elements or blocks.

use std::sync::Arc;

use ferrograph::buffer::alloc_cpu_buffer;
use ferrograph::context::Context;
use ferrograph::device::{check_n_threads, BackendParams, Device, MAX_THREADS};
use ferrograph::dtype::DType;
use ferrograph::error::Error;
use ferrograph::ops;
use ferrograph::registry::{self, Registration};
use ferrograph::sched::{Scheduler, MAX_COPIES};

#[test]
fn buffer_and_tensor_ranges_are_checked_without_overflow() {
    let buffer = alloc_cpu_buffer(64).unwrap();
    for (offset, len) in [
        (0, 65),
        (60, 8),
        (usize::MAX, 1),
        (1, usize::MAX),
        (0, 1 << 62),
    ] {
        let err = buffer.check_range(offset, len, "read").unwrap_err();
        assert_eq!(
            err.kind(),
            ferrograph::error::ErrorKind::OutOfBounds,
            "{err}"
        );
        assert!(err.to_string().contains("64 bytes"), "{err}");
    }
    buffer.check_range(0, 64, "read").unwrap();
    buffer.check_range(64, 0, "read").unwrap();
    let mut out = [0u8; 8];
    assert!(buffer.read(60, &mut out).is_err());

    let ctx = Context::new(false);
    let t = ctx.new_tensor(DType::F32, &[4]).unwrap();
    assert!(matches!(
        t.check_byte_range(usize::MAX - 2, 4, "read"),
        Err(Error::OutOfRange { .. })
    ));
    assert!(t.check_byte_range(0, 17, "read").is_err());
    t.check_byte_range(0, 16, "read").unwrap();
    assert!(t.read_bytes(12, &mut out).is_err());
    assert!(t.fill_bytes(usize::MAX, 2, 0).is_err());
    buffer.free();
    assert!(matches!(
        buffer.check_range(0, 1, "read"),
        Err(Error::Stale(_))
    ));
}

#[test]
fn thread_and_copy_counts_are_bounded() {
    assert!(check_n_threads(0).is_err());
    assert!(check_n_threads(MAX_THREADS + 1).is_err());
    assert!(check_n_threads(1 << 40).is_err());
    assert_eq!(check_n_threads(MAX_THREADS).unwrap(), MAX_THREADS);
    assert!(registry::init_by_name("CPU", "n_threads=1099511627776").is_err());

    let cpu = registry::init_by_name("CPU", "n_threads=1").unwrap();
    let mut sched = Scheduler::new(vec![cpu], None, 16, false, true).unwrap();
    for bad in [0, MAX_COPIES + 1, 1 << 40] {
        let err = sched.set_n_copies(bad).unwrap_err();
        assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
    }
    sched.set_n_copies(MAX_COPIES).unwrap();
    assert_eq!(sched.n_copies(), MAX_COPIES);
}

/// The thread-count limit holds in the Rust constructors themselves, not only in the
/// bindings: every way of making or resizing a CPU pool refuses 0 and more than MAX_THREADS
/// before starting a thread, and a refused resize leaves the pool as it was.
#[test]
fn rust_constructors_bound_the_thread_count() {
    use ferrograph::cpu::backend::graph_compute_with_ctx;
    use ferrograph::{CpuBackend, Threadpool, ThreadpoolParams};
    for bad in [0, MAX_THREADS + 1, 1 << 40, usize::MAX] {
        let err = CpuBackend::new(bad).map(|_| ()).unwrap_err();
        assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
        assert!(err.to_string().contains(&bad.to_string()), "{err}");
        let err = Threadpool::new(&ThreadpoolParams::new(bad))
            .map(|_| ())
            .unwrap_err();
        assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
    }
    let cpu = CpuBackend::new(2).unwrap();
    for bad in [0, MAX_THREADS + 1, 1 << 40] {
        let err = cpu.set_n_threads(bad).unwrap_err();
        assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
        assert_eq!(cpu.n_threads(), 2);
    }
    cpu.set_n_threads(1).unwrap();
    assert_eq!(cpu.n_threads(), 1);

    let ctx = Context::new(false);
    let a = ctx.new_tensor(DType::F32, &[4]).unwrap();
    let b = ops::add(&ctx, &a, &a).unwrap();
    let graph = ferrograph::Graph::build(&[b]);
    for bad in [0, MAX_THREADS + 1, 1 << 40] {
        let err = graph_compute_with_ctx(&graph, bad).unwrap_err();
        assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
    }
}

#[test]
fn backend_params_are_parsed_strictly() {
    for bad in [
        "garbage=,,=x",
        "=x",
        "a=",
        "a=1,,b=2",
        "a=1,a=2",
        "n_threads=abc",
        "n_threads=0",
        "n_threads=100000",
        "bad key=1",
        "junk",
    ] {
        let err = BackendParams::parse(bad).unwrap_err();
        assert!(matches!(err, Error::InvalidArgument(_)), "{bad:?}: {err}");
    }
    let p = BackendParams::parse(" n_threads = 3 ; x.y-z=1,").unwrap();
    assert_eq!(p.n_threads, Some(3));
    assert_eq!(p.extra.len(), 2);
    assert_eq!(
        BackendParams::parse(" , ").unwrap(),
        BackendParams::default()
    );
    // The CPU knows only n_threads.
    let err = registry::init_by_name("CPU", "n_thread=2").err().unwrap();
    assert!(err.to_string().contains("n_thread"), "{err}");
}

/// A registration whose devices are clones of the CPU device under other names.
struct Named {
    name: String,
    devices: Vec<String>,
}

#[derive(Debug)]
struct RenamedCpu {
    name: String,
    cpu: Arc<dyn Device>,
}

impl Device for RenamedCpu {
    fn name(&self) -> &str {
        &self.name
    }
    fn description(&self) -> String {
        "test".into()
    }
    fn memory(&self) -> (usize, usize) {
        self.cpu.memory()
    }
    fn device_type(&self) -> ferrograph::device::DeviceType {
        ferrograph::device::DeviceType::Accel
    }
    fn caps(&self) -> ferrograph::device::DeviceCaps {
        self.cpu.caps()
    }
    fn registration_name(&self) -> &str {
        "TEST"
    }
    fn init_backend(
        &self,
        params: &BackendParams,
    ) -> ferrograph::Result<Arc<dyn ferrograph::backend::Backend>> {
        self.cpu.init_backend(params)
    }
    fn buffer_type(&self) -> Arc<dyn ferrograph::buffer::BufferType> {
        self.cpu.buffer_type()
    }
    fn supports_op(&self, op: &ferrograph::tensor::Tensor) -> bool {
        self.cpu.supports_op(op)
    }
    fn supports_buft(&self, buft: &dyn ferrograph::buffer::BufferType) -> bool {
        self.cpu.supports_buft(buft)
    }
}

impl Registration for Named {
    fn name(&self) -> &str {
        &self.name
    }
    fn devices(&self) -> Vec<Arc<dyn Device>> {
        let cpu = registry::dev_by_name("CPU").unwrap();
        self.devices
            .iter()
            .map(|n| {
                Arc::new(RenamedCpu {
                    name: n.clone(),
                    cpu: cpu.clone(),
                }) as Arc<dyn Device>
            })
            .collect()
    }
}

#[test]
fn registry_names_are_validated_and_a_refusal_changes_nothing() {
    let before = registry::dev_count();
    let cases: [(&str, &[&str]); 6] = [
        ("", &["OK1"]),
        ("R\0", &["OK2"]),
        ("REG_A", &[""]),
        ("REG_B", &["  "]),
        ("REG_C", &["D\0X"]),
        ("REG_D", &["TWIN", "twin"]),
    ];
    for (reg, devs) in cases {
        let r = Named {
            name: reg.into(),
            devices: devs.iter().map(|d| d.to_string()).collect(),
        };
        let err = registry::register(Arc::new(r)).unwrap_err();
        assert!(matches!(err, Error::InvalidArgument(_)), "{reg:?}: {err}");
        assert_eq!(registry::dev_count(), before);
    }
    let clash = Named {
        name: "REG_E".into(),
        devices: vec!["cpu".into()],
    };
    assert!(registry::register(Arc::new(clash)).is_err());
    assert_eq!(registry::dev_count(), before);
}

#[test]
fn views_that_cut_elements_or_blocks_are_refused() {
    let ctx = Context::new(true);
    let f = ctx.new_tensor(DType::F32, &[8, 4]).unwrap();
    // Offsets and strides that are not multiples of 4 bytes.
    for (offset, stride) in [(2, 32), (0, 30), (1, 32)] {
        let err = ops::view(&ctx, &f, &[4, 2], &[stride], offset).unwrap_err();
        assert!(matches!(err, Error::ShapeMismatch { .. }), "{err}");
    }
    ops::view(&ctx, &f, &[4, 2], &[32], 4).unwrap();
    let h = ctx.new_tensor(DType::F16, &[8]).unwrap();
    assert!(ops::view(&ctx, &h, &[2], &[], 1).is_err());
    ops::view(&ctx, &h, &[2], &[], 2).unwrap();

    for q in [DType::Q8_0, DType::Q4_0] {
        let t = ctx.new_tensor(q, &[64, 4]).unwrap();
        let block = q.type_size();
        assert!(ops::transpose(&ctx, &t).is_err(), "{q:?} transpose");
        assert!(ops::permute(&ctx, &t, [1, 0, 2, 3]).is_err());
        ops::permute(&ctx, &t, [0, 2, 1, 3]).unwrap();
        // Square single-block rows: the transposed strides look contiguous, still refused.
        let square = ctx.new_tensor(q, &[32, 32]).unwrap();
        assert!(ops::transpose(&ctx, &square).is_err());
        assert!(ops::view(&ctx, &t, &[32], &[], 1).is_err());
        assert!(ops::view(&ctx, &t, &[32, 2], &[block + 1], 0).is_err());
        ops::view(&ctx, &t, &[32, 2], &[block], block).unwrap();
        assert!(ops::view(&ctx, &t, &[16], &[], 0).is_err());
    }
}

#[test]
fn builders_refuse_empty_argmax_rows_and_say_what_mul_mat_needs() {
    let ctx = Context::new(true);
    let empty = ctx.new_tensor(DType::F32, &[0, 3]).unwrap();
    assert!(matches!(
        ops::argmax(&ctx, &empty),
        Err(Error::ShapeMismatch { .. })
    ));
    let w = ctx.new_tensor(DType::F32, &[0, 4]).unwrap();
    let x = ctx.new_tensor(DType::F32, &[0, 2]).unwrap();
    let err = ops::mul_mat(&ctx, &w, &x).unwrap_err();
    assert!(!err.to_string().contains("transposed"), "{err}");
    let a = ctx.new_tensor(DType::F32, &[4]).unwrap();
    let b = ctx.new_tensor(DType::I32, &[4]).unwrap();
    let err = ops::add(&ctx, &a, &b).unwrap_err();
    assert!(!err.to_string().contains("f32 or f32"), "{err}");
}
