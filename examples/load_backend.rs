//! A backend library loaded at run time: `libferrograph_blas.so` (built by
//! `cargo build -p ferrograph-blas`) or the path given as the first argument. The example lists
//! the loaded registration's devices and computes a matrix product on its first device.
//!
//! Run with `cargo build -p ferrograph-blas && cargo run --example load_backend [path]`.

use std::path::PathBuf;

use ferrograph::{dynload, ops, Context, DType, Graph, GraphAllocator};

/// The library given on the command line, else the one `cargo build -p ferrograph-blas` puts
/// in the target directory (this example runs from `<target>/<profile>/examples/`).
fn library_path() -> Option<PathBuf> {
    if let Some(arg) = std::env::args_os().nth(1) {
        return Some(PathBuf::from(arg));
    }
    let name = format!(
        "{}ferrograph_blas{}",
        std::env::consts::DLL_PREFIX,
        std::env::consts::DLL_SUFFIX
    );
    let profile_dir = std::env::current_exe()
        .ok()?
        .parent()?
        .parent()?
        .to_path_buf();
    let path = profile_dir.join(name);
    path.is_file().then_some(path)
}

fn main() -> ferrograph::Result<()> {
    let Some(path) = library_path() else {
        println!("no backend library found: build one with `cargo build -p ferrograph-blas`");
        return Ok(());
    };
    let registration = match dynload::load(&path) {
        Ok(registration) => registration,
        // The BLAS backend cannot run without a BLAS library on the machine, and says so.
        Err(e) if !ferrograph::blas::is_available() => {
            println!(
                "could not load {} (no BLAS on this machine): {e}",
                path.display()
            );
            return Ok(());
        }
        Err(e) => return Err(e),
    };
    let devices = registration.devices();
    println!("loaded {} from {}", registration.name(), path.display());
    for device in &devices {
        println!("  device {}: {}", device.name(), device.description());
    }
    let Some(device) = devices.first() else {
        println!("the registration has no devices");
        return Ok(());
    };
    let backend = device.init_backend(&Default::default())?;

    let ctx = Context::new(true);
    // Every size at least 32: the BLAS backend leaves smaller products to the CPU.
    let a = ctx.new_tensor(DType::F32, &[64, 32])?;
    let b = ctx.new_tensor(DType::F32, &[64, 32])?;
    let c = ops::mul_mat(&ctx, &a, &b)?;
    let graph = Graph::build(std::slice::from_ref(&c));
    let mut allocator = GraphAllocator::new(backend.default_buffer_type());
    allocator.alloc_graph(&graph)?;
    a.set_f32(&vec![0.5; 64 * 32])?;
    b.set_f32(&vec![2.0; 64 * 32])?;
    if !backend.supports_op(&c) {
        eprintln!("{} does not run this MUL_MAT", backend.name());
        std::process::exit(1);
    }
    backend.graph_compute(&graph)?;
    let out = c.to_f32_vec()?;
    println!(
        "computed {} values on {}; c[0] = {}",
        out.len(),
        backend.name(),
        out[0]
    );
    if out.iter().any(|&v| (v - 64.0).abs() > 1e-3) {
        eprintln!("wrong result: every value should be 64");
        std::process::exit(1);
    }
    Ok(())
}
