//! `Tensor::check_current`: a read of a result before its compute, of an intermediate a later
//! node overwrote, or of a result older than its input is an `Error::Stale`; outputs and
//! recomputed results are current.

use ferrograph::alloc::GraphAllocator;
use ferrograph::backend::Backend;
use ferrograph::buffer::CpuBufferType;
use ferrograph::context::Context;
use ferrograph::cpu::backend::CpuBackend;
use ferrograph::dtype::DType;
use ferrograph::graph::Graph;
use ferrograph::ops::{self, UnaryOp};
use ferrograph::sched::Scheduler;
use ferrograph::tensor::Tensor;
use ferrograph::{Error, Result};
use std::sync::Arc;

fn stale_message(t: &Tensor) -> String {
    match t.check_current() {
        Err(Error::Stale(message)) => message,
        other => panic!("expected a stale error for {t:?}, got {other:?}"),
    }
}

#[test]
fn reads_are_checked_against_computes_overwrites_and_inputs() -> Result<()> {
    let ctx = Context::new(true);
    let x = ctx.new_tensor(DType::F32, &[4])?;
    x.set_input();
    x.set_name("x");
    let m = ops::scale(&ctx, &x, 3.0, 0.0)?;
    m.set_name("m");
    // neg takes m's memory in place (m's only consumer, same layout).
    let n = ops::unary(&ctx, &m, UnaryOp::Neg)?;
    let z = ops::unary(&ctx, &n, UnaryOp::Relu)?;
    z.set_output();
    let graph = Graph::build(std::slice::from_ref(&z));
    let mut galloc = GraphAllocator::new(CpuBufferType::shared());
    galloc.alloc_graph(&graph)?;
    x.set_f32(&[0.0, -1.0, 2.0, -3.0])?;
    assert!(stale_message(&z).contains("has not been computed"));
    x.check_current()?; // a leaf holds what was written

    let cpu = CpuBackend::new(1)?;
    cpu.graph_compute(&graph)?;
    z.check_current()?;
    assert_eq!(z.to_f32_vec()?, vec![0.0, 3.0, 0.0, 9.0]);
    let message = stale_message(&m);
    assert!(
        message.contains("tensor 'm'") && message.contains("set_output()"),
        "{message}"
    );

    x.set_f32(&[1.0, 1.0, 1.0, 1.0])?;
    let message = stale_message(&z);
    assert!(
        message.contains("before tensor 'x' was last set"),
        "{message}"
    );
    cpu.graph_compute(&graph)?;
    z.check_current()?;
    assert_eq!(z.to_f32_vec()?, vec![0.0; 4]);

    // Allocating again binds afresh: nothing computed since.
    galloc.alloc_graph(&graph)?;
    assert!(stale_message(&z).contains("has not been computed"));
    Ok(())
}

#[test]
fn an_output_intermediate_is_never_overwritten() -> Result<()> {
    let ctx = Context::new(true);
    let x = ctx.new_tensor(DType::F32, &[8])?;
    x.set_input();
    let m = ops::scale(&ctx, &x, 2.0, 0.0)?;
    m.set_output();
    let z = ops::unary(&ctx, &m, UnaryOp::Neg)?;
    z.set_output();
    let graph = Graph::build(std::slice::from_ref(&z));
    let mut galloc = GraphAllocator::new(CpuBufferType::shared());
    galloc.alloc_graph(&graph)?;
    x.set_f32(&[1.0; 8])?;
    CpuBackend::new(1)?.graph_compute(&graph)?;
    m.check_current()?;
    z.check_current()?;
    assert_eq!(m.to_f32_vec()?, vec![2.0; 8]);
    Ok(())
}

/// How the replayed graph of [`a_replayed_allocation_records_overwrites_again`] is allocated.
enum Allocator {
    Graph(Box<GraphAllocator>),
    Sched(Box<Scheduler>),
}

impl Allocator {
    fn alloc(&mut self, graph: &Graph) -> Result<()> {
        match self {
            Allocator::Graph(galloc) => galloc.alloc_graph(graph),
            Allocator::Sched(sched) => sched.alloc_graph(graph),
        }
    }
}

/// Allocating the same graph again with the same plan may skip recording overwrites (a decode
/// loop replays one graph per step), but not after another graph's allocation changed what is
/// recorded on a shared tensor: here a second graph reading the intermediate `m` records that
/// nothing of its own overwrites `m`, and the replay of the first graph must record again
/// that its in-place node does.
#[test]
fn a_replayed_allocation_records_overwrites_again() -> Result<()> {
    let cpu: Arc<dyn Backend> = Arc::new(CpuBackend::new(1)?);
    let allocators = [
        Allocator::Graph(Box::new(GraphAllocator::new(CpuBufferType::shared()))),
        Allocator::Sched(Box::new(Scheduler::new(
            vec![cpu.clone()],
            None,
            16,
            false,
            false,
        )?)),
    ];
    for mut first in allocators {
        let ctx = Context::new(true);
        let x = ctx.new_tensor(DType::F32, &[4])?;
        x.set_input();
        let m = ops::scale(&ctx, &x, 3.0, 0.0)?;
        m.set_name("m");
        // neg takes m's memory in place.
        let z = ops::unary(&ctx, &ops::unary(&ctx, &m, UnaryOp::Neg)?, UnaryOp::Relu)?;
        z.set_output();
        let graph = Graph::build(std::slice::from_ref(&z));
        let step = |first: &mut Allocator| -> Result<()> {
            first.alloc(&graph)?;
            x.set_f32(&[1.0, -1.0, 2.0, -2.0])?;
            cpu.graph_compute(&graph)?;
            assert_eq!(z.to_f32_vec()?, vec![0.0, 3.0, 0.0, 6.0]);
            assert!(stale_message(&m).contains("tensor 'm'"));
            Ok(())
        };
        step(&mut first)?;
        // The same graph again, nothing in between.
        step(&mut first)?;
        // Another graph over m, in its own memory: nothing of it overwrites m.
        let y = ops::scale(&ctx, &m, 1.0, 0.0)?;
        y.set_output();
        let other = Graph::build(std::slice::from_ref(&y));
        let mut second = GraphAllocator::new(CpuBufferType::shared());
        second.alloc_graph(&other)?;
        cpu.graph_compute(&other)?;
        m.check_current()?;
        // The replay must record m's overwriter again.
        step(&mut first)?;
        step(&mut first)?;
    }
    Ok(())
}
