//! A graph on the CPU: `y = relu(W x)` built in a context, allocated by a graph allocator,
//! computed by the CPU backend and checked against a plain Rust loop.
//!
//! Run with `cargo run --example cpu_graph`.

use ferrograph::{ops, registry, Context, CpuBufferType, DType, Graph, GraphAllocator, UnaryOp};

fn main() -> ferrograph::Result<()> {
    let (k, m, n) = (4, 3, 2);
    // A context that only describes tensors (`no_alloc`): memory comes from the allocator.
    let ctx = Context::new(true);
    // ggml's order: `ne[0]` is the innermost (row) length. W has m rows of k, x has n of k.
    let w = ctx.new_tensor(DType::F32, &[k, m])?;
    let x = ctx.new_tensor(DType::F32, &[k, n])?;
    let y = ops::unary(&ctx, &ops::mul_mat(&ctx, &w, &x)?, UnaryOp::Relu)?;
    let graph = Graph::build(std::slice::from_ref(&y));

    let mut allocator = GraphAllocator::new(CpuBufferType::shared());
    allocator.alloc_graph(&graph)?;
    let w_data: Vec<f32> = (0..k * m).map(|i| i as f32 * 0.5 - 2.0).collect();
    let x_data: Vec<f32> = (0..k * n).map(|i| 1.0 - i as f32 * 0.25).collect();
    w.set_f32(&w_data)?;
    x.set_f32(&x_data)?;

    let backend = registry::init_by_name("CPU", "n_threads=2")?;
    backend.graph_compute(&graph)?;
    let got = y.to_f32_vec()?;

    // y[j][i] = relu(sum_t W[i][t] * x[j][t]): output row j holds the m results for column j.
    let mut expected = Vec::with_capacity(m * n);
    for j in 0..n {
        for i in 0..m {
            let dot: f32 = (0..k).map(|t| w_data[i * k + t] * x_data[j * k + t]).sum();
            expected.push(dot.max(0.0));
        }
    }
    println!("relu(W x) = {got:?}");
    if got != expected {
        eprintln!("mismatch: expected {expected:?}");
        std::process::exit(1);
    }
    println!("matches the scalar loop");
    Ok(())
}
