//! Graph compute on the CPU: op dispatch, support queries and scratch sizing.
//!
//! [`compute_graph`] walks a graph's nodes in order on the calling thread, which joins the
//! given [`Threadpool`] for the call: kernels split their work over the pool's threads.
//! Kernels live in [`super::kernels`], one module per op family.

use super::kernels::{
    attention, binary, copy, custom, matmul, norm, reduce, rope, softmax, unary, view::RawTensor,
};
use super::repack::StoredLayout;
use crate::dtype::DType;
use crate::error::{Error, Result, Status};
use crate::graph::Graph;
use crate::ops::Op;
use crate::pool::Threadpool;
use crate::tensor::Tensor;
use matmul::{InterleavedProduct, PlainProduct};
use std::time::{Duration, Instant};

/// Options of a CPU compute call.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ComputeOptions {
    /// Use the scalar reference kernels (no SIMD dispatch) where a kernel has both, as
    /// ggml's `use_ref` does for its reference backend in tests.
    pub use_reference: bool,
    /// Every node of the graph is known to have a kernel (an earlier successful compute of a
    /// graph with the same epoch checked them): skip the per-node check. Ops and types of a
    /// graph's nodes never change, so the check's answer cannot either.
    pub ops_checked: bool,
}

fn is_float(dtype: DType) -> bool {
    dtype.is_float()
}

/// Whether the CPU kernels implement this node's op with its operand and result dtypes.
pub fn supports_op(node: &Tensor) -> bool {
    let srcs = node.srcs();
    let src = |i: usize| srcs.get(i).map(Tensor::dtype);
    let dst = node.dtype();
    let f32_only = |i: usize| src(i) == Some(DType::F32);
    let float = |i: usize| src(i).is_some_and(is_float);
    match node.op() {
        Op::None | Op::Reshape | Op::View | Op::Permute { .. } | Op::Transpose => true,
        Op::Dup | Op::Cont | Op::Cpy => src(0).is_some_and(|s| copy::supports(s, dst)),
        Op::Add | Op::Sub | Op::Mul | Op::Div => {
            float(0) && src(0) == Some(dst) && (f32_only(1) || src(1) == src(0))
        }
        Op::Add1 => float(0) && float(1) && src(0) == Some(dst),
        Op::Acc { .. } => f32_only(0) && f32_only(1) && dst == DType::F32,
        Op::Sqr
        | Op::Sqrt
        | Op::Log
        | Op::Sin
        | Op::Cos
        | Op::Clamp { .. }
        | Op::Scale { .. }
        | Op::Unary(_)
        | Op::LeakyRelu { .. } => float(0) && src(0) == Some(dst),
        Op::Glu { .. } => float(0) && src(0) == Some(dst) && (srcs.len() == 1 || src(1) == src(0)),
        Op::Sum | Op::SumRows | Op::Mean => float(0) && dst == DType::F32,
        Op::Argmax => f32_only(0) && dst == DType::I32,
        Op::Repeat => src(0).is_some_and(|s| !s.is_quantized()) && src(0) == Some(dst),
        Op::Concat { .. } => {
            src(0).is_some_and(|s| !s.is_quantized()) && src(0) == src(1) && src(0) == Some(dst)
        }
        Op::Norm { .. } | Op::RmsNorm { .. } | Op::GroupNorm { .. } | Op::L2Norm { .. } => {
            f32_only(0) && dst == DType::F32
        }
        Op::MulMat | Op::OutProd => {
            src(0).is_some_and(DType::is_weight_type) && f32_only(1) && dst == DType::F32
        }
        Op::MulMatId => {
            src(0).is_some_and(DType::is_weight_type)
                && f32_only(1)
                && src(2) == Some(DType::I32)
                && dst == DType::F32
        }
        Op::GetRows => {
            src(1) == Some(DType::I32)
                && src(0).is_some_and(|s| {
                    (s == DType::I32 && dst == DType::I32) || (s != DType::I32 && dst == DType::F32)
                })
        }
        Op::SetRows => {
            f32_only(1)
                && matches!(src(2), Some(DType::I32 | DType::I64))
                && src(0) == Some(dst)
                && copy::supports(DType::F32, dst)
        }
        Op::DiagMaskInf { .. } => f32_only(0) && dst == DType::F32,
        Op::SoftMax { .. } => {
            f32_only(0)
                && dst == DType::F32
                && (srcs.len() < 2 || matches!(src(1), Some(DType::F32 | DType::F16)))
        }
        Op::Rope(_) => {
            matches!(src(0), Some(DType::F32 | DType::F16))
                && src(0) == Some(dst)
                && src(1) == Some(DType::I32)
                && (srcs.len() < 3 || f32_only(2))
        }
        Op::FlashAttnExt { .. } => {
            f32_only(0)
                && src(1).is_some_and(crate::ops::is_attention_kv_type)
                && src(2).is_some_and(crate::ops::is_attention_kv_type)
                && (srcs.len() < 4 || matches!(src(3), Some(DType::F32 | DType::F16)))
                && dst == DType::F32
        }
        Op::Custom(_) => true,
    }
}

/// Scratch bytes a node needs (converted or quantized activations of a matrix product).
fn node_work_size(node: &Tensor) -> usize {
    match node.op() {
        Op::MulMat | Op::MulMatId => match (node.srcs().first(), node.srcs().get(1)) {
            (Some(a), Some(b)) => matmul::scratch_bytes(a.dtype(), &b.ne(), b.is_contiguous()),
            _ => 0,
        },
        _ => 0,
    }
}

/// Scratch bytes a graph needs with `n_threads` threads: the largest per-node need (matrix
/// products convert their activations once per node, shared by all threads). Per-task row
/// buffers are small and allocated by the tasks themselves.
pub fn work_size(graph: &Graph, n_threads: usize) -> usize {
    let _ = n_threads;
    graph.nodes().iter().map(node_work_size).max().unwrap_or(0)
}

fn unsupported(node: &Tensor) -> Error {
    let dtypes: Vec<&str> = node.srcs().iter().map(|s| s.dtype().name()).collect();
    let message = format!(
        "the CPU backend has no kernel for {} with operands ({}) producing {} ({})",
        node.op().display_name(),
        dtypes.join(", "),
        node.dtype().name(),
        node.label()
    );
    let all_dtypes = std::iter::once(node.dtype().name())
        .chain(dtypes)
        .map(str::to_owned)
        .collect();
    Error::op_unsupported(
        message,
        node.op().display_name(),
        all_dtypes,
        Some("CPU".to_owned()),
    )
}

/// Computes every node of `graph` in order on `pool` (the calling thread is one of its threads).
///
/// Leaves and pure view ops are skipped. `abort` is polled before each node; when it returns
/// true the call returns `Ok(Status::Aborted)` with the nodes computed so far intact. An op or
/// dtype combination without a kernel returns [`Error::UnsupportedOp`]; a node or operand
/// without host memory returns its storage error.
pub fn compute_graph(
    graph: &Graph,
    pool: &Threadpool,
    options: &ComputeOptions,
    abort: Option<&(dyn Fn() -> bool + Sync)>,
) -> Result<Status> {
    let mut workspace = Workspace {
        scratch: Vec::with_capacity(work_size(graph, pool.n_threads())),
        ..Workspace::default()
    };
    compute_graph_in(graph, pool, options, abort, &mut workspace)
}

/// What a backend keeps from one compute to the next: the scratch for converted operands
/// (grown as nodes need it) and the operands it resolved for the last graph.
#[derive(Default)]
pub struct Workspace {
    /// Bytes for converted operands and prepared activations.
    pub scratch: Vec<u8>,
    operands: OperandCache,
}

/// [`compute_graph`] with the caller's workspace, which a backend keeps from one compute to
/// the next: computing the same graph again reuses its resolved operands.
pub fn compute_graph_in(
    graph: &Graph,
    pool: &Threadpool,
    options: &ComputeOptions,
    abort: Option<&(dyn Fn() -> bool + Sync)>,
    workspace: &mut Workspace,
) -> Result<Status> {
    walk_graph(graph, pool, options, abort, workspace, None)
}

/// [`compute_graph_in`] that also returns the wall time of each node of `graph`, read inside
/// the same walk (nodes run exactly as in a normal compute): seconds per node, 0 for leaves
/// and views. A fused run of mat-vecs is timed as a whole and its time shared among its
/// products in proportion to their weight bytes (what a mat-vec's time follows).
pub fn compute_graph_timed(
    graph: &Graph,
    pool: &Threadpool,
    options: &ComputeOptions,
    abort: Option<&(dyn Fn() -> bool + Sync)>,
    workspace: &mut Workspace,
) -> Result<(Status, Vec<f64>)> {
    let mut seconds = vec![0.0; graph.n_nodes()];
    let status = walk_graph(graph, pool, options, abort, workspace, Some(&mut seconds))?;
    Ok((status, seconds))
}

/// The compute loop: every node of `graph` in order on `pool`, fused runs of mat-vecs where
/// they form; with `seconds`, each node's wall time is written there (two clock reads per
/// computed node or run, nothing else changes).
fn walk_graph(
    graph: &Graph,
    pool: &Threadpool,
    options: &ComputeOptions,
    abort: Option<&(dyn Fn() -> bool + Sync)>,
    workspace: &mut Workspace,
    mut seconds: Option<&mut [f64]>,
) -> Result<Status> {
    let nodes = graph.nodes();
    let Workspace { scratch, operands } = workspace;
    let mut cache = operands.for_graph(graph, options);
    // No hand-over: this thread walks the graph and runs small nodes alone; a node that splits
    // its work shares it with the pool's workers (spinning between nodes, or woken).
    pool.run(|| {
        let mut i = 0;
        while i < nodes.len() {
            let node = &nodes[i];
            if abort.is_some_and(|f| f()) {
                return Ok(Status::Aborted);
            }
            if is_noop(node) {
                i += 1;
                continue;
            }
            let start = seconds.is_some().then(Instant::now);
            let run = match cache.as_deref_mut() {
                Some(cache) => {
                    cache.revalidate();
                    cache.run_at(nodes, i, options)
                }
                None => find_mat_vec_run(nodes, i, options),
            };
            let next = match run {
                Some((run, b, next)) => {
                    run.compute(b, scratch)?;
                    next
                }
                None => {
                    match cache.as_deref_mut() {
                        Some(cache) => cache.compute_node(node, i, options, scratch)?,
                        None => compute_in_pool(node, options, scratch)?,
                    }
                    i + 1
                }
            };
            if let (Some(seconds), Some(start)) = (seconds.as_deref_mut(), start) {
                share_time(&nodes[i..next], &mut seconds[i..next], start.elapsed());
            }
            i = next;
        }
        Ok(Status::Success)
    })
    .inspect(|status| {
        if *status == Status::Success {
            crate::tensor::mark_computed(nodes);
        }
    })
}

/// The operands a backend resolved for one graph, node by node, and the fused runs found in
/// it: valid while the graph's epoch and the process's bindings epoch
/// ([`crate::tensor::bindings_epoch`]) are those it was filled under. A decoding step computes
/// the same graph each token, and resolving a node's operands through their bindings cost
/// 120-420 ns per node there (locks and buffer fields the weight stream has evicted from the
/// caches): ~3% of a SmolLM2 step.
#[derive(Default)]
struct OperandCache {
    graph_epoch: u64,
    bindings_epoch: u64,
    reference: bool,
    /// Per node: its resolved operands, once computed through the cache (`None`: not yet, or
    /// not cacheable: operands copied out of a repacked layout, or more than the inline count).
    nodes: Vec<Option<Resolved>>,
    /// Per node: whether a fused run starts there (outer `None`: not looked at yet; boxed,
    /// as few nodes start one).
    runs: Vec<Option<Option<Box<FoundRun>>>>,
}

impl OperandCache {
    /// The cache ready for `graph` (emptied when the graph, the bindings or the options
    /// changed), or `None` for a graph it cannot recognise (epoch 0: never built).
    fn for_graph(&mut self, graph: &Graph, options: &ComputeOptions) -> Option<&mut Self> {
        let graph_epoch = graph.epoch();
        if graph_epoch == 0 {
            return None;
        }
        let bindings_epoch = crate::tensor::bindings_epoch();
        let n = graph.n_nodes();
        if self.graph_epoch != graph_epoch
            || self.bindings_epoch != bindings_epoch
            || self.reference != options.use_reference
            || self.nodes.len() != n
        {
            self.graph_epoch = graph_epoch;
            self.bindings_epoch = bindings_epoch;
            self.reference = options.use_reference;
            self.nodes.clear();
            self.nodes.resize(n, None);
            self.runs.clear();
            self.runs.resize(n, None);
        }
        Some(self)
    }

    /// Forgets every entry when a binding changed since they were resolved: checked before
    /// each node, so a callback of this very computation (a custom op) that moves or releases
    /// memory is seen by the next node, as when every node resolved its operands afresh.
    fn revalidate(&mut self) {
        let now = crate::tensor::bindings_epoch();
        if now != self.bindings_epoch {
            self.bindings_epoch = now;
            self.nodes.iter_mut().for_each(|n| *n = None);
            self.runs.iter_mut().for_each(|r| *r = None);
        }
    }

    /// The fused run starting at node `i`, looked up once per graph.
    fn run_at(&mut self, nodes: &[Tensor], i: usize, options: &ComputeOptions) -> Option<FoundRun> {
        self.runs[i]
            .get_or_insert_with(|| find_mat_vec_run(nodes, i, options).map(Box::new))
            .as_deref()
            .cloned()
    }

    /// Computes node `i` with its operands resolved once per graph.
    fn compute_node(
        &mut self,
        node: &Tensor,
        i: usize,
        options: &ComputeOptions,
        scratch: &mut Vec<u8>,
    ) -> Result<()> {
        if let Some(resolved) = self.nodes[i] {
            return run_resolved(node, &resolved, options, scratch);
        }
        if !options.ops_checked && !supports_op(node) {
            return Err(unsupported(node));
        }
        match resolve(node)? {
            Resolution::Inline(resolved) => {
                self.nodes[i] = Some(resolved);
                run_resolved(node, &resolved, options, scratch)
            }
            other => compute_resolution(node, other, options, scratch),
        }
    }
}

/// Writes the wall time `elapsed` of `nodes` (one node, or a fused run of mat-vecs with
/// skipped views between) into `seconds`: all of it for one node, else shared among the
/// products by their weights' bytes (views get none).
fn share_time(nodes: &[Tensor], seconds: &mut [f64], elapsed: Duration) {
    let elapsed = elapsed.as_secs_f64();
    if let [_] = nodes {
        seconds[0] = elapsed;
        return;
    }
    let weight = |n: &Tensor| {
        if is_noop(n) {
            0
        } else {
            n.srcs().first().map_or(0, Tensor::nbytes)
        }
    };
    let total: usize = nodes.iter().map(weight).sum();
    for (node, slot) in nodes.iter().zip(seconds) {
        *slot = if total == 0 {
            0.0
        } else {
            elapsed * weight(node) as f64 / total as f64
        };
    }
}

/// One product of a fused run of mat-vecs: interleaved weights (the repacking buffer type's
/// q4_1 layout) or plainly stored quantized weights.
#[derive(Clone, Copy)]
enum RunProduct {
    Interleaved(InterleavedProduct),
    Plain(PlainProduct),
}

impl RunProduct {
    /// The weights as the product reads them.
    fn weights(&self) -> &RawTensor {
        match self {
            RunProduct::Interleaved(p) => &p.a,
            RunProduct::Plain(p) => &p.a,
        }
    }

    /// Whether `self`'s weights have `other`'s type and row length.
    fn matches(&self, other: &RunProduct) -> bool {
        let (a, b) = (self.weights(), other.weights());
        a.dtype == b.dtype && a.ne[0] == b.ne[0]
    }
}

/// Products per fused run at most (a layer's q, k, v; its gate and up).
const MAX_RUN: usize = 4;

/// The products of a fused run, all of one kind, in place (no allocation per run): the
/// first `len` entries of the array.
#[derive(Clone)]
enum Run {
    Interleaved([InterleavedProduct; MAX_RUN], usize),
    Plain([PlainProduct; MAX_RUN], usize),
}

impl Run {
    /// A run of one product.
    fn new(first: RunProduct) -> Run {
        match first {
            RunProduct::Interleaved(p) => Run::Interleaved([p; MAX_RUN], 1),
            RunProduct::Plain(p) => Run::Plain([p; MAX_RUN], 1),
        }
    }

    /// Products in the run.
    fn len(&self) -> usize {
        match self {
            Run::Interleaved(_, len) | Run::Plain(_, len) => *len,
        }
    }

    /// Adds `product` if it is of the run's kind and the run is not full; false (nothing
    /// added) otherwise.
    fn push(&mut self, product: RunProduct) -> bool {
        match (self, product) {
            (Run::Interleaved(products, len), RunProduct::Interleaved(p)) if *len < MAX_RUN => {
                products[*len] = p;
                *len += 1;
            }
            (Run::Plain(products, len), RunProduct::Plain(p)) if *len < MAX_RUN => {
                products[*len] = p;
                *len += 1;
            }
            _ => return false,
        }
        true
    }

    /// Computes every product of the run with the activations `b`.
    fn compute(&self, b: RawTensor, scratch: &mut Vec<u8>) -> Result<()> {
        match self {
            Run::Interleaved(products, len) => {
                matmul::mul_mat_interleaved_run(&products[..*len], b, scratch)
            }
            Run::Plain(products, len) => matmul::mul_mat_plain_run(&products[..*len], b, scratch),
        }
    }
}

/// The id of a MUL_MAT node's activations (its second source); `None` for any other node.
fn mul_mat_activations(node: &Tensor) -> Option<u64> {
    (matches!(node.op(), Op::MulMat) && node.srcs().len() == 2).then(|| node.srcs()[1].id())
}

/// A mat-vec that may join a fused run, and its activations.
fn run_product(node: &Tensor, options: &ComputeOptions) -> Option<(RunProduct, RawTensor)> {
    if mul_mat_activations(node).is_none() || node.is_empty() {
        return None;
    }
    let (a, b) = (&node.srcs()[0], &node.srcs()[1]);
    let dst = RawTensor::live(node)?;
    let b = RawTensor::live(b)?;
    // Host weights first (the common case, one binding read); the repacking buffer has no
    // host pointer, so only weights without one are looked up there.
    if let Some(a) = RawTensor::live(a) {
        return matmul::joins_plain_run(&dst, &a, &b, options.use_reference)
            .then_some((RunProduct::Plain(PlainProduct { dst, a }), b));
    }
    let Some(super::repack::StoredView::LaidOut(ptr, StoredLayout::Interleaved(layout))) =
        super::repack::stored_view(a)
    else {
        return None;
    };
    let a = RawTensor {
        ptr: super::kernels::view::SendPtr(ptr),
        dtype: a.dtype(),
        ne: a.ne(),
        nb: a.nb(),
    };
    matmul::joins_interleaved_run(&dst, &a, &layout, &b, options.use_reference).then_some((
        RunProduct::Interleaved(InterleavedProduct { dst, a, layout }),
        b,
    ))
}

/// A fused run of mat-vecs: its products, their shared activations and the index of the node
/// after the run.
type FoundRun = (Run, RawTensor, usize);

/// The fused run of mat-vecs starting at node `i`, if node `i` and the mat-vecs after it (view
/// nodes between are skipped) read the same activations with weights of the same kind, type
/// and row length ([`matmul::mul_mat_interleaved_run`], [`matmul::mul_mat_plain_run`]): the
/// run, its activations and the index of the node after it; `None` when node `i` starts no run
/// of two or more. Safe to run early: every product reads only the shared activations
/// (computed before node `i`) and its quantized weights (never another product's f32 output,
/// nor a view of one), and none reads another's output.
fn find_mat_vec_run(nodes: &[Tensor], i: usize, options: &ComputeOptions) -> Option<FoundRun> {
    // Cheap test first (ids only): a product with no partner reading its activations, the
    // common case, resolves no operands here; `compute_in_pool` does that once.
    let activations = mul_mat_activations(&nodes[i])?;
    let partner = nodes[i + 1..].iter().find(|n| !is_noop(n));
    if partner.and_then(mul_mat_activations) != Some(activations) {
        return None;
    }
    let (first, b) = run_product(&nodes[i], options)?;
    let mut run = Run::new(first);
    // The run's outputs (ids): a later product reading one of them cannot join.
    let mut outputs = [nodes[i].id(); MAX_RUN];
    let mut next = i + 1;
    let mut j = i + 1;
    while j < nodes.len() && run.len() < MAX_RUN {
        let node = &nodes[j];
        j += 1;
        if is_noop(node) {
            continue;
        }
        let joins = mul_mat_activations(node) == Some(activations)
            && !outputs[..run.len()].contains(&node.srcs()[0].id());
        match run_product(node, options).filter(|(p, _)| joins && first.matches(p)) {
            Some((product, _)) if run.push(product) => {
                outputs[run.len() - 1] = node.id();
                next = j;
            }
            _ => break,
        }
    }
    (run.len() >= 2).then_some((run, b, next))
}

/// Leaves and view ops: nothing to compute.
fn is_noop(node: &Tensor) -> bool {
    matches!(node.op(), Op::None) || node.op().is_view_op()
}

/// Computes one node on `pool`, using `scratch` for converted operands (grown as needed).
///
/// The node and its operands must be allocated host tensors; leaves and view ops do nothing.
pub fn compute_node(
    node: &Tensor,
    pool: &Threadpool,
    options: &ComputeOptions,
    scratch: &mut Vec<u8>,
) -> Result<()> {
    if is_noop(node) {
        return Ok(());
    }
    pool.run(|| compute_in_pool(node, options, scratch))
}

/// Computes one non-view node on the pool this thread computes on.
fn compute_in_pool(node: &Tensor, options: &ComputeOptions, scratch: &mut Vec<u8>) -> Result<()> {
    if !options.ops_checked && !supports_op(node) {
        return Err(unsupported(node));
    }
    compute_resolution(node, resolve(node)?, options, scratch)
}

/// A node's operands as the kernels read them: host views of the output and of up to
/// [`MAX_INLINE_SRCS`] sources, and the layout of repacked weights read in place.
#[derive(Clone, Copy)]
struct Resolved {
    dst: RawTensor,
    srcs: [RawTensor; MAX_INLINE_SRCS],
    n_srcs: usize,
    laid_out: Option<StoredLayout>,
}

/// How a node's operands were resolved.
enum Resolution {
    /// Views into the tensors' own memory: valid as long as their bindings.
    Inline(Resolved),
    /// Some operand copied out of a repacked layout: the views point into `copies`.
    Copied(Resolved, Vec<Vec<u64>>),
    /// A custom op with more operands than the inline count.
    Many(RawTensor, Vec<RawTensor>),
}

/// Resolves the output and operands of `node` (a non-view node) to host views.
fn resolve(node: &Tensor) -> Result<Resolution> {
    let dst = RawTensor::new(node)?;
    let n_srcs = node.srcs().len();
    if n_srcs > MAX_INLINE_SRCS {
        // Custom ops may take any number of operands.
        let srcs = node
            .srcs()
            .iter()
            .map(RawTensor::new)
            .collect::<Result<Vec<_>>>()?;
        return Ok(Resolution::Many(dst, srcs));
    }
    // Operand views on the stack: no allocation per node.
    let mut srcs = [dst; MAX_INLINE_SRCS];
    // Plain copies of operands stored in a repacking buffer's layout (rarely any).
    let mut copies = Vec::new();
    let mut laid_out = None;
    for (i, (slot, src)) in srcs.iter_mut().zip(node.srcs()).enumerate() {
        *slot = match RawTensor::live(src) {
            Some(view) => view,
            None => {
                let weight_of_product = i == 0 && matches!(node.op(), Op::MulMat);
                match repacked_operand(src, weight_of_product, &mut copies)? {
                    Some((view, layout)) => {
                        laid_out = laid_out.or(layout);
                        view
                    }
                    // Neither: the error says why (unbound, stale, not host memory).
                    None => RawTensor::new(src)?,
                }
            }
        };
    }
    let resolved = Resolved {
        dst,
        srcs,
        n_srcs,
        laid_out,
    };
    Ok(if copies.is_empty() {
        Resolution::Inline(resolved)
    } else {
        Resolution::Copied(resolved, copies)
    })
}

/// Computes `node` with its resolved operands (the copies they point into, if any, live until
/// it is done).
fn compute_resolution(
    node: &Tensor,
    resolution: Resolution,
    options: &ComputeOptions,
    scratch: &mut Vec<u8>,
) -> Result<()> {
    match resolution {
        Resolution::Inline(resolved) => run_resolved(node, &resolved, options, scratch),
        Resolution::Copied(resolved, copies) => {
            let out = run_resolved(node, &resolved, options, scratch);
            drop(copies);
            out
        }
        Resolution::Many(dst, srcs) => {
            if node.is_empty() {
                return Ok(());
            }
            run(node, dst, &srcs, options, scratch)
        }
    }
}

/// Runs the kernel of `node` on resolved operands.
fn run_resolved(
    node: &Tensor,
    resolved: &Resolved,
    options: &ComputeOptions,
    scratch: &mut Vec<u8>,
) -> Result<()> {
    if node.is_empty() {
        return Ok(());
    }
    let Resolved {
        dst,
        srcs,
        n_srcs,
        laid_out,
    } = *resolved;
    if let Some(layout) = laid_out {
        let reference = options.use_reference;
        return matmul::mul_mat_laid_out(dst, srcs[0], &layout, srcs[1], reference, scratch);
    }
    run(node, dst, &srcs[..n_srcs], options, scratch)
}

/// The view of an operand stored in the CPU's repacking buffer ([`super::repack`]), or `None`
/// when it is not. Plainly stored tensors are read in place; a laid-out matrix (interleaved or
/// packed panels) is read in place, with its layout, only as the weights of a MUL_MAT
/// (`weight_of_product`); otherwise the operand's plain bytes are copied into `copies`, which
/// must outlive the computation.
fn repacked_operand(
    src: &Tensor,
    weight_of_product: bool,
    copies: &mut Vec<Vec<u64>>,
) -> Result<Option<(RawTensor, Option<StoredLayout>)>> {
    use super::kernels::view::SendPtr;
    use super::repack::StoredView;
    let view = |ptr: *mut u8| RawTensor {
        ptr: SendPtr(ptr),
        dtype: src.dtype(),
        ne: src.ne(),
        nb: src.nb(),
    };
    Ok(match super::repack::stored_view(src) {
        None => None,
        Some(StoredView::Plain(ptr)) => Some((view(ptr), None)),
        Some(StoredView::LaidOut(ptr, layout)) if weight_of_product => {
            Some((view(ptr), Some(layout)))
        }
        Some(_) => {
            let n = src.nbytes();
            let mut plain = vec![0u64; n.div_ceil(8)];
            // SAFETY: `plain` holds at least `n` bytes; u64s viewed as bytes are valid.
            let bytes =
                unsafe { std::slice::from_raw_parts_mut(plain.as_mut_ptr().cast::<u8>(), n) };
            src.read_bytes(0, bytes)?;
            let ptr = bytes.as_mut_ptr();
            copies.push(plain);
            Some((view(ptr), None))
        }
    })
}

/// Operands resolved without a heap allocation (every built-in op has at most four).
const MAX_INLINE_SRCS: usize = 6;

fn run(
    node: &Tensor,
    dst: RawTensor,
    srcs: &[RawTensor],
    options: &ComputeOptions,
    scratch: &mut Vec<u8>,
) -> Result<()> {
    let src = |i: usize| srcs.get(i).copied().ok_or_else(|| unsupported(node));
    match node.op() {
        Op::None | Op::Reshape | Op::View | Op::Permute { .. } | Op::Transpose => Ok(()),
        Op::Dup | Op::Cont | Op::Cpy => copy::copy(dst, src(0)?),
        Op::GetRows => copy::get_rows(dst, src(0)?, src(1)?),
        Op::SetRows => copy::set_rows(dst, src(1)?, src(2)?),
        Op::Add | Op::Sub | Op::Mul | Op::Div => binary::binary(node.op(), dst, src(0)?, src(1)?),
        Op::Add1 => binary::add1(dst, src(0)?, src(1)?),
        Op::Acc {
            nb1,
            nb2,
            nb3,
            offset,
        } => binary::acc(dst, src(0)?, src(1)?, [*nb1, *nb2, *nb3], *offset),
        Op::Sqr
        | Op::Sqrt
        | Op::Log
        | Op::Sin
        | Op::Cos
        | Op::Clamp { .. }
        | Op::Scale { .. }
        | Op::Unary(_)
        | Op::LeakyRelu { .. } => {
            unary::elementwise(node.op(), dst, src(0)?, options.use_reference)
        }
        Op::Glu { op, swapped } => unary::glu(
            *op,
            *swapped,
            dst,
            src(0)?,
            srcs.get(1).copied(),
            options.use_reference,
        ),
        Op::Sum => reduce::sum(dst, src(0)?),
        Op::SumRows => reduce::sum_rows(dst, src(0)?, false),
        Op::Mean => reduce::sum_rows(dst, src(0)?, true),
        Op::Argmax => reduce::argmax(dst, src(0)?),
        Op::Repeat => reduce::repeat(dst, src(0)?),
        Op::Concat { dim } => reduce::concat(dst, src(0)?, src(1)?, *dim),
        Op::Norm { eps } => norm::norm(dst, src(0)?, *eps),
        Op::RmsNorm { eps } => norm::rms_norm(dst, src(0)?, *eps),
        Op::GroupNorm { n_groups, eps } => norm::group_norm(dst, src(0)?, *n_groups, *eps),
        Op::L2Norm { eps } => norm::l2_norm(dst, src(0)?, *eps),
        Op::MulMat => matmul::mul_mat(dst, src(0)?, src(1)?, options.use_reference, scratch),
        Op::MulMatId => matmul::mul_mat_id(
            dst,
            src(0)?,
            src(1)?,
            src(2)?,
            options.use_reference,
            scratch,
        ),
        Op::OutProd => matmul::out_prod(dst, src(0)?, src(1)?),
        Op::DiagMaskInf { n_past } => softmax::diag_mask_inf(dst, src(0)?, *n_past),
        Op::SoftMax { scale, max_bias } => {
            softmax::soft_max(dst, src(0)?, srcs.get(1).copied(), *scale, *max_bias)
        }
        Op::Rope(params) => rope::rope(dst, src(0)?, src(1)?, srcs.get(2).copied(), params),
        Op::FlashAttnExt {
            scale,
            max_bias,
            logit_softcap,
        } => attention::flash_attn_ext(
            dst,
            src(0)?,
            src(1)?,
            src(2)?,
            srcs.get(3).copied(),
            *scale,
            *max_bias,
            *logit_softcap,
        ),
        Op::Custom(op) => custom::custom(op, node),
    }
}
