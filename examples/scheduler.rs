//! Two backends under the scheduler: the BLAS backend (when a BLAS library is installed) or a
//! second CPU backend in front of the CPU. The matrix product is pinned to the first backend and
//! the final sum to the CPU, so the graph is split in two; the result is compared with the same
//! graph on the CPU alone.
//!
//! Run with `cargo run --example scheduler`.

use std::sync::Arc;

use ferrograph::{
    blas, ops, registry, Backend, Context, CpuBackend, DType, Graph, Scheduler, UnaryOp,
};

/// Builds `tanh(A B) + A B` for fresh tensors and returns (inputs, output, graph).
fn build(
    ctx: &Context,
) -> ferrograph::Result<(Vec<ferrograph::Tensor>, ferrograph::Tensor, Graph)> {
    // Every size at least 32: the BLAS backend leaves smaller products to the CPU.
    let a = ctx.new_tensor(DType::F32, &[64, 48])?;
    let b = ctx.new_tensor(DType::F32, &[64, 40])?;
    let ab = ops::mul_mat(ctx, &a, &b)?;
    let out = ops::add(ctx, &ops::unary(ctx, &ab, UnaryOp::Tanh)?, &ab)?;
    let graph = Graph::build(std::slice::from_ref(&out));
    Ok((vec![a, b], out, graph))
}

fn run(backends: Vec<Arc<dyn Backend>>, pin_first: bool) -> ferrograph::Result<(Vec<f32>, usize)> {
    let ctx = Context::new(true);
    let (inputs, out, graph) = build(&ctx)?;
    let mut sched = Scheduler::new(backends.clone(), None, 0, false, false)?;
    if pin_first {
        // The MUL_MAT node (computed first) on the first backend, the sum (last) on the CPU.
        let nodes = graph.nodes();
        sched.set_tensor_backend(&nodes[0], &backends[0])?;
        sched.set_tensor_backend(&nodes[nodes.len() - 1], &backends[backends.len() - 1])?;
    }
    sched.alloc_graph(&graph)?;
    for (i, t) in inputs.iter().enumerate() {
        let values: Vec<f32> = (0..t.nelements())
            .map(|j| ((i * 7 + j) % 11) as f32 * 0.1 - 0.5)
            .collect();
        t.set_f32(&values)?;
    }
    sched.graph_compute(&graph)?;
    Ok((out.to_f32_vec()?, sched.n_splits()))
}

fn main() -> ferrograph::Result<()> {
    let cpu: Arc<dyn Backend> = registry::init_by_name("CPU", "n_threads=2")?;
    let first: Arc<dyn Backend> = if blas::is_available() {
        blas::register()?;
        registry::init_by_name("BLAS", "")?
    } else {
        println!(
            "no BLAS library ({}); using a second CPU backend",
            blas::unavailable_reason().unwrap_or_default()
        );
        Arc::new(CpuBackend::new(1)?)
    };
    println!("backends: {} and {}", first.name(), cpu.name());
    let (two, splits) = run(vec![first, cpu.clone()], true)?;
    let (one, _) = run(vec![cpu], false)?;
    println!("{splits} split(s); first values {:?}", &two[..4]);
    if splits < 2 {
        eprintln!("expected the graph split across the two backends");
        std::process::exit(1);
    }
    let worst = two
        .iter()
        .zip(&one)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    // BLAS may sum the 64 products in another order than the CPU.
    if worst > 1e-4 {
        eprintln!("the two-backend result differs from the CPU's by {worst}");
        std::process::exit(1);
    }
    println!("equal to the CPU alone (max difference {worst:e})");
    Ok(())
}
