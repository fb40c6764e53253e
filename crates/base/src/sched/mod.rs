//! The multi-backend scheduler (ggml's `ggml_backend_sched`): assigns each tensor of a graph
//! to one of several backends, cuts the graph into splits, copies tensors between backends
//! that cannot read each other's memory, allocates everything with one
//! [`GraphAllocator`], and runs the splits in order.
//!
//! Backends are given in priority order (index 0 first); the **last must be a CPU backend**.
//!
//! # The caller's graph is never rewritten
//!
//! Tensor metadata is immutable, and the scheduler keeps it that way. Its decisions live in a
//! [`SchedPlan`] beside the graph. Where a node must read a copy, the scheduler builds a
//! *shadow* of the node (same op and parameters, operands replaced by the copies) in an
//! internal graph; after allocation every shadowed node of the caller's graph is bound to its
//! shadow's memory, so results are read from the caller's own tensors. Graphs without copies
//! are allocated and computed as they are. The private `internal` module has the details.
//!
//! # Differences from ggml
//!
//! * Errors instead of aborts (unsupported ops, bad pins, a list without a CPU backend).
//! * No caps on backends, splits or inputs; `n_copies` is a runtime value
//!   ([`Scheduler::set_n_copies`], at most [`MAX_COPIES`]).
//! * Plans are cached by graph shape: allocating a rebuilt graph of the same topology, shapes,
//!   dtypes, flags and buffers skips the assignment and split passes.
//! * The op offload policy is a value ([`OffloadPolicy`]).
//! * Pinned tensors ([`Scheduler::set_tensor_backend`]) are never moved by the upgrade pass,
//!   and pinning after allocation makes the next compute re-allocate instead of silently
//!   ignoring the pin.
//! * A `false` from the evaluation callback stops the whole computation
//!   ([`Status::Aborted`]); ggml only skips the rest of the current split.
//! * Computing after [`Scheduler::reset`] without [`Scheduler::alloc_graph`] is an
//!   [`Error::NotAllocated`].
//! * With `n_copies > 1`, graph inputs and copies live in a separate scheduler-owned buffer
//!   per backend (one slot per copy), outside the graph allocator.
//!
//! Set `FERROGRAPH_SCHED_DEBUG` to log every new plan (at `info` level).

mod assign;
mod exec;
mod internal;
mod plan;
mod profile;
mod split;
mod topology;

use std::sync::Arc;

use crate::alloc::overwrites::SweepMemo;
use crate::alloc::GraphAllocator;
use crate::backend::Backend;
use crate::buffer::{Buffer, BufferType, BufferUsage};
use crate::device::DeviceType;
use crate::error::{Error, Result, Status};
use crate::event::Event;
use crate::graph::{Graph, Position};
use crate::tensor::{BindBatch, Tensor};

pub use exec::EvalCallback;
pub use profile::{NodeTime, OpTotal, Profile};

/// Most pipeline slots per copied tensor (ggml fixes 4 at compile time; each slot holds a copy
/// of every copied input, so a larger count only multiplies memory and events).
pub const MAX_COPIES: usize = 64;
pub use plan::{Assignment, Cause, CopyPlan, PlannedTensor, SchedPlan, SplitPlan, TensorRef};

use assign::{AssignInput, Oracle};
use internal::Internal;
use plan::PlanCore;
use topology::{IdMap, Signature, Topology};

/// Pipeline slots used when the scheduler is created with `parallel = true`.
pub const DEFAULT_PARALLEL_COPIES: usize = 4;

/// Plans kept in the cache before it is cleared.
const PLAN_CACHE_LIMIT: usize = 64;

/// When an op whose weight sits in host memory moves to a higher-priority backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OffloadPolicy {
    /// Ask the backend ([`Backend::offload_op`]).
    Device,
    /// Offload when the op's batch (ggml's measure: `ne[1]` of a matrix product, `ne[2]` of
    /// MUL_MAT_ID and ROPE, rows otherwise) is at least this.
    MinBatch(usize),
    /// Never offload.
    Never,
    /// Always offload to the first higher-priority backend that supports the op.
    Always,
}

impl OffloadPolicy {
    /// Whether `backend` should take `op`.
    pub fn offload(&self, backend: &dyn Backend, op: &Tensor) -> bool {
        match *self {
            OffloadPolicy::Device => backend.offload_op(op),
            OffloadPolicy::MinBatch(min) => assign::op_batch(op) >= min,
            OffloadPolicy::Never => false,
            OffloadPolicy::Always => true,
        }
    }
}

/// Where the scheduler is in its reset → alloc → compute cycle.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Nothing allocated; compute allocates automatically.
    Fresh,
    /// A graph is allocated.
    Allocated,
    /// [`Scheduler::reset`] was called; compute needs [`Scheduler::alloc_graph`] first.
    Reset,
}

struct CachedPlan {
    signature: Signature,
    core: Arc<PlanCore>,
}

/// The current graph: its indexing, plan and internal graphs per slot.
struct Instance {
    graph: Graph,
    /// The scheduler's [`Scheduler::plan_epoch`] when the plan was chosen.
    plan_epoch: u64,
    topo: Topology,
    core: Arc<PlanCore>,
    slots: Vec<Option<Internal>>,
    /// The plan is not in the cache yet: it was made while the cache was empty, so no lookup
    /// needed the graph's signature then. It is computed (from the instance, which keeps
    /// the recorded flags and bindings) and the plan cached when a later graph needs the
    /// cache or before the pins change; a change of other planning settings (which empties
    /// the cache) drops it.
    unsigned: bool,
}

/// The multi-backend scheduler (see the module documentation).
pub struct Scheduler {
    backends: Vec<Arc<dyn Backend>>,
    bufts: Vec<Arc<dyn BufferType>>,
    buft_ok: Vec<Vec<bool>>,
    backend_names: Vec<String>,
    galloc: GraphAllocator,
    /// The last overwrite sweep, skipped when a replay would repeat it.
    sweep: SweepMemo,
    reserved_core: Option<Arc<PlanCore>>,
    n_copies: usize,
    cur_copy: usize,
    next_copy: usize,
    op_offload: bool,
    policy: OffloadPolicy,
    events: Vec<Vec<Option<Arc<dyn Event>>>>,
    pinned: IdMap<usize>,
    /// Bumped whenever pins or planning settings change: a current graph planned under an
    /// older epoch must be planned again.
    plan_epoch: u64,
    cache: IdMap<Vec<CachedPlan>>,
    cache_len: usize,
    cache_hits: u64,
    cache_misses: u64,
    /// The last `split_graph` found the current graph itself again, with no tensor's flags or
    /// foreign binding changed: the graph allocator may skip re-checking its plan.
    unchanged: bool,
    instance: Option<Instance>,
    pipeline_buffers: Vec<Option<Buffer>>,
    state: State,
    callback: Option<EvalCallback>,
    debug: bool,
}

impl std::fmt::Debug for Scheduler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Scheduler")
            .field("backends", &self.backend_names)
            .field("n_copies", &self.n_copies)
            .field("n_splits", &self.n_splits())
            .field("state", &self.state)
            .finish()
    }
}

fn same_arc<T: ?Sized>(a: &Arc<T>, b: &Arc<T>) -> bool {
    std::ptr::eq(Arc::as_ptr(a) as *const (), Arc::as_ptr(b) as *const ())
}

fn same_graph(a: &Graph, b: &Graph) -> bool {
    a.n_nodes() == b.n_nodes()
        && a.n_leafs() == b.n_leafs()
        && a.nodes().iter().zip(b.nodes()).all(|(x, y)| x.same(y))
        && a.leafs().iter().zip(b.leafs()).all(|(x, y)| x.same(y))
}

impl Scheduler {
    /// A scheduler over `backends` (priority order; the last must be a CPU backend).
    ///
    /// `bufts` overrides each backend's compute buffer type (it must be usable by that
    /// backend); `graph_size_hint` sizes internal tables (no limit is implied); `parallel`
    /// turns on pipelining with [`DEFAULT_PARALLEL_COPIES`] slots; `op_offload` lets
    /// higher-priority backends take ops whose weights are in host memory (see
    /// [`OffloadPolicy`]).
    pub fn new(
        backends: Vec<Arc<dyn Backend>>,
        bufts: Option<Vec<Arc<dyn BufferType>>>,
        graph_size_hint: usize,
        parallel: bool,
        op_offload: bool,
    ) -> Result<Scheduler> {
        let Some(last) = backends.last() else {
            return Err(Error::InvalidArgument(
                "the scheduler needs at least one backend (the last must be a CPU backend)".into(),
            ));
        };
        if last.device().device_type() != DeviceType::Cpu {
            return Err(Error::InvalidArgument(format!(
                "the last backend of a scheduler must be a CPU backend, got {} ({})",
                last.name(),
                last.device().device_type()
            )));
        }
        let bufts = match bufts {
            Some(bufts) => {
                if bufts.len() != backends.len() {
                    return Err(Error::InvalidArgument(format!(
                        "{} buffer types given for {} backends",
                        bufts.len(),
                        backends.len()
                    )));
                }
                for (i, (backend, buft)) in backends.iter().zip(&bufts).enumerate() {
                    if !backend.supports_buft(buft.as_ref()) {
                        return Err(Error::InvalidArgument(format!(
                            "backend {i} ({}) cannot use buffer type {}",
                            backend.name(),
                            buft.name()
                        )));
                    }
                }
                bufts
            }
            None => backends.iter().map(|b| b.default_buffer_type()).collect(),
        };
        let buft_ok = backends
            .iter()
            .map(|b| bufts.iter().map(|t| b.supports_buft(t.as_ref())).collect())
            .collect();
        let backend_names = backends.iter().map(|b| b.name().to_owned()).collect();
        let n_backends = backends.len();
        let galloc = GraphAllocator::new_n(&bufts);
        let mut scheduler = Scheduler {
            backends,
            bufts,
            buft_ok,
            backend_names,
            galloc,
            sweep: SweepMemo::default(),
            reserved_core: None,
            n_copies: 1,
            cur_copy: 0,
            next_copy: 0,
            op_offload,
            policy: OffloadPolicy::Device,
            events: Vec::new(),
            pinned: IdMap::with_capacity_and_hasher(
                graph_size_hint.min(1 << 16) / 8,
                Default::default(),
            ),
            plan_epoch: 0,
            cache: IdMap::default(),
            cache_len: 0,
            cache_hits: 0,
            unchanged: false,
            cache_misses: 0,
            instance: None,
            pipeline_buffers: vec![None; n_backends],
            state: State::Fresh,
            callback: None,
            debug: std::env::var_os("FERROGRAPH_SCHED_DEBUG").is_some(),
        };
        scheduler.set_n_copies(if parallel { DEFAULT_PARALLEL_COPIES } else { 1 })?;
        Ok(scheduler)
    }

    /// Number of backends.
    pub fn n_backends(&self) -> usize {
        self.backends.len()
    }

    /// Backend `i`.
    pub fn backend(&self, i: usize) -> Option<&Arc<dyn Backend>> {
        self.backends.get(i)
    }

    /// The index of `backend` in the scheduler's list (by identity).
    pub fn backend_index(&self, backend: &Arc<dyn Backend>) -> Option<usize> {
        self.backends.iter().position(|b| same_arc(b, backend))
    }

    fn index_of(&self, backend: &Arc<dyn Backend>) -> Result<usize> {
        self.backend_index(backend).ok_or_else(|| {
            Error::InvalidArgument(format!(
                "backend {} is not one of this scheduler's backends",
                backend.name()
            ))
        })
    }

    /// Number of splits of the current graph (0 before any).
    pub fn n_splits(&self) -> usize {
        self.instance.as_ref().map_or(0, |i| i.core.splits.len())
    }

    /// Pipeline slots per copied tensor.
    pub fn n_copies(&self) -> usize {
        self.n_copies
    }

    /// Changes the number of pipeline slots (at least 1). Forgets the current allocation and
    /// the plan cache.
    pub fn set_n_copies(&mut self, n_copies: usize) -> Result<()> {
        if n_copies == 0 || n_copies > MAX_COPIES {
            return Err(Error::InvalidArgument(format!(
                "n_copies must be between 1 and {MAX_COPIES}, got {n_copies}"
            )));
        }
        self.synchronize_backends()?;
        self.n_copies = n_copies;
        self.cur_copy = 0;
        self.next_copy = 0;
        self.events = self
            .backends
            .iter()
            .map(|b| {
                (0..n_copies)
                    .map(|_| {
                        if n_copies > 1 {
                            b.device().event_new().ok()
                        } else {
                            None
                        }
                    })
                    .collect()
            })
            .collect();
        self.forget_plans();
        self.instance = None;
        self.reserved_core = None;
        for buffer in self.pipeline_buffers.iter_mut().filter_map(Option::take) {
            buffer.free();
        }
        if self.state == State::Allocated {
            self.state = State::Fresh;
        }
        Ok(())
    }

    /// Whether ops with host weights may be offloaded.
    pub fn op_offload(&self) -> bool {
        self.op_offload
    }

    /// Turns op offload on or off (applies to the next plan).
    pub fn set_op_offload(&mut self, on: bool) {
        if self.op_offload != on {
            self.op_offload = on;
            self.forget_plans();
        }
    }

    /// The offload policy.
    pub fn offload_policy(&self) -> OffloadPolicy {
        self.policy
    }

    /// Sets the offload policy (applies to the next plan).
    pub fn set_offload_policy(&mut self, policy: OffloadPolicy) {
        if self.policy != policy {
            self.policy = policy;
            self.forget_plans();
        }
    }

    /// The compute buffer type of `backend`.
    pub fn buffer_type(&self, backend: &Arc<dyn Backend>) -> Result<Arc<dyn BufferType>> {
        Ok(self.bufts[self.index_of(backend)?].clone())
    }

    /// Bytes of compute memory `backend` holds (0 when it shares an earlier backend's buffer
    /// type), pipeline slots included.
    pub fn buffer_size(&self, backend: &Arc<dyn Backend>) -> Result<usize> {
        let b = self.index_of(backend)?;
        Ok(self.buffer_size_of(b))
    }

    fn buffer_size_of(&self, b: usize) -> usize {
        self.galloc.buffer_size(b) + self.pipeline_buffers[b].as_ref().map_or(0, Buffer::size)
    }

    /// Forgets every cached plan (the next graph is planned from scratch).
    pub fn clear_plan_cache(&mut self) {
        self.forget_plans();
    }

    /// Empties the cache and makes the current graph's plan stale.
    fn forget_plans(&mut self) {
        self.cache.clear();
        self.cache_len = 0;
        self.plan_epoch += 1;
    }

    /// `(hits, misses)` of the plan cache.
    pub fn plan_cache_stats(&self) -> (u64, u64) {
        (self.cache_hits, self.cache_misses)
    }

    /// Pins `tensor` to `backend` for the following graphs (until [`Scheduler::reset`]).
    pub fn set_tensor_backend(
        &mut self,
        tensor: &Tensor,
        backend: &Arc<dyn Backend>,
    ) -> Result<()> {
        let b = self.index_of(backend)?;
        if !backend.supports_op(tensor) {
            let dtypes = std::iter::once(tensor)
                .chain(tensor.srcs().iter())
                .map(|t| t.dtype().name().to_owned())
                .collect();
            return Err(Error::op_unsupported(
                format!(
                    "cannot pin {} ({}) to backend {}, which does not run it",
                    tensor.label(),
                    tensor.op().display_name(),
                    backend.name()
                ),
                tensor.op().display_name(),
                dtypes,
                Some(backend.name().to_owned()),
            ));
        }
        if self.pinned.get(&tensor.id()) != Some(&b) {
            // The current plan was made under the pins so far: cached under them first.
            self.sign_current();
            self.pinned.insert(tensor.id(), b);
            self.plan_epoch += 1;
            if self.state == State::Allocated {
                self.state = State::Fresh;
            }
        }
        Ok(())
    }

    /// The backend `tensor` is pinned to or was assigned to in the current graph; `None` for
    /// a tensor of neither, and after [`Scheduler::reset`] until a graph is allocated again
    /// (ggml's reset forgets the assignments).
    pub fn get_tensor_backend(&self, tensor: &Tensor) -> Option<Arc<dyn Backend>> {
        self.get_tensor_backend_index(tensor)
            .map(|b| self.backends[b].clone())
    }

    /// As [`Scheduler::get_tensor_backend`], by index.
    pub fn get_tensor_backend_index(&self, tensor: &Tensor) -> Option<usize> {
        if let Some(&b) = self.pinned.get(&tensor.id()) {
            return Some(b);
        }
        if self.state == State::Reset {
            return None;
        }
        let inst = self.instance.as_ref()?;
        let u = match inst.graph.position(tensor) {
            Some(Position::Node(i)) => i,
            Some(Position::Leaf(i)) => inst.topo.n_nodes + i,
            None => {
                let k = inst.topo.extras.iter().position(|t| t.same(tensor))?;
                inst.topo.n_nodes + inst.topo.n_leafs + k
            }
        };
        inst.core.assignments.get(u).map(|a| a.backend)
    }

    /// Installs (or removes) the evaluation callback.
    pub fn set_eval_callback(&mut self, callback: Option<EvalCallback>) {
        self.callback = callback;
    }

    fn own_buffer_ids(&self) -> Vec<u64> {
        let mut ids: Vec<u64> = (0..self.backends.len())
            .flat_map(|b| self.galloc.buffers(b).iter().map(Buffer::id))
            .collect();
        ids.extend(self.pipeline_buffers.iter().flatten().map(Buffer::id));
        ids
    }

    fn synchronize_backends(&self) -> Result<()> {
        for backend in &self.backends {
            backend.synchronize()?;
        }
        Ok(())
    }

    /// Assigns backends and cuts splits for `graph` (using the plan cache), making it the
    /// current graph. Nothing is allocated.
    pub fn split_graph(&mut self, graph: &Graph) -> Result<()> {
        let own = self.own_buffer_ids();
        self.unchanged = false;
        // The current graph again (same epoch: same tensors), nothing changed since.
        if let Some(inst) = &self.instance {
            if inst.plan_epoch == self.plan_epoch
                && inst.graph.epoch() == graph.epoch()
                && inst.topo.state_matches(graph, &own)
            {
                self.cache_hits += 1;
                self.unchanged = true;
                if self.state == State::Allocated {
                    self.state = State::Fresh;
                }
                return Ok(());
            }
        }
        // A rebuilt graph of the current graph's structure: re-indexed by identity checks
        // against the current topology, no hashing. (Pins are by tensor, so only without any.)
        if let Some(inst) = &self.instance {
            if inst.plan_epoch == self.plan_epoch && self.pinned.is_empty() {
                if let Some(extras) = inst.topo.rebind(&inst.graph, graph, &own) {
                    if let Some(old) = self.instance.take() {
                        let mut topo = old.topo;
                        topo.extras = extras;
                        self.cache_hits += 1;
                        self.install(graph, topo, old.core, old.unsigned);
                        return Ok(());
                    }
                }
            }
        }
        // The cache is about to be consulted: a plan made without a signature goes in first.
        self.sign_current();
        let topo = Topology::build(graph, &own);
        // With nothing cached, no lookup can hit: the signature waits until it is needed.
        let signature = (self.cache_len > 0).then(|| topo.signature(graph, &self.pinned));
        let cached = signature.as_ref().and_then(|signature| {
            self.cache.get(&signature.hash).and_then(|bucket| {
                bucket
                    .iter()
                    .find(|c| c.signature == *signature)
                    .map(|c| c.core.clone())
            })
        });
        if let Some(core) = cached {
            self.cache_hits += 1;
            self.install(graph, topo, core, false);
            return Ok(());
        }
        self.cache_misses += 1;
        let input = AssignInput {
            graph,
            topo: &topo,
            backends: &self.backends,
            bufts: &self.bufts,
            buft_ok: &self.buft_ok,
            pinned: &self.pinned,
            op_offload: self.op_offload,
            policy: self.policy,
        };
        let mut oracle = Oracle::new(&input);
        let assigned = assign::assign(&mut oracle)?;
        let core = Arc::new(split::split(&mut oracle, &assigned, self.n_copies)?);
        let unsigned = match signature {
            Some(signature) => {
                self.cache_plan(signature, core.clone());
                false
            }
            None => true,
        };
        self.install(graph, topo, core, unsigned);
        Ok(())
    }

    /// Adds a plan to the cache (emptied first when full).
    fn cache_plan(&mut self, signature: Signature, core: Arc<PlanCore>) {
        if self.cache_len >= PLAN_CACHE_LIMIT {
            self.cache.clear();
            self.cache_len = 0;
        }
        self.cache_len += 1;
        self.cache
            .entry(signature.hash)
            .or_default()
            .push(CachedPlan { signature, core });
    }

    /// Caches the current graph's plan if it was made without a signature (see
    /// [`Instance::unsigned`]) under the current planning settings; a plan of older settings
    /// (pins, offload, copies, or a cleared cache since) is never cached.
    fn sign_current(&mut self) {
        let Some(inst) = self.instance.as_mut() else {
            return;
        };
        if !std::mem::take(&mut inst.unsigned) || inst.plan_epoch != self.plan_epoch {
            return;
        }
        let signature = inst.topo.signature(&inst.graph, &self.pinned);
        let core = inst.core.clone();
        self.cache_plan(signature, core);
    }

    /// Makes `graph` (indexed as `topo`, planned as `core`) the current graph. Internal graphs
    /// are kept when the graph and plan are the same as before. `unsigned`: the plan is not
    /// cached yet ([`Instance::unsigned`]).
    fn install(&mut self, graph: &Graph, topo: Topology, core: Arc<PlanCore>, unsigned: bool) {
        let keep = self
            .instance
            .as_ref()
            .is_some_and(|i| Arc::ptr_eq(&i.core, &core) && same_graph(&i.graph, graph));
        match self.instance.as_mut() {
            Some(inst) if keep => {
                inst.topo = topo;
                inst.plan_epoch = self.plan_epoch;
                inst.unsigned = unsigned;
            }
            _ => {
                let is_new = self
                    .instance
                    .as_ref()
                    .is_none_or(|i| !Arc::ptr_eq(&i.core, &core));
                self.instance = Some(Instance {
                    graph: graph.clone(),
                    plan_epoch: self.plan_epoch,
                    topo,
                    core,
                    slots: (0..self.n_copies).map(|_| None).collect(),
                    unsigned,
                });
                if self.debug && is_new {
                    if let Some(plan) = self.plan() {
                        log::info!("{plan}");
                    }
                }
            }
        }
        if self.state == State::Allocated {
            self.state = State::Fresh;
        }
    }

    /// Builds the internal graph of the current instance for `slot` and binds its pipelined
    /// tensors. Returns nothing; the internal graph stays in the instance.
    fn prepare_slot(&mut self, slot: usize, batch: &BindBatch) -> Result<()> {
        let Some(inst) = self.instance.as_mut() else {
            return Err(Error::InvalidArgument("internal: no current graph".into()));
        };
        if inst.slots[slot].is_none() {
            let internal = internal::build(
                &inst.graph,
                &inst.topo,
                &inst.core,
                slot,
                self.n_copies,
                &self.backend_names,
            )?;
            inst.slots[slot] = Some(internal);
        }
        // Pipeline buffers.
        if !inst.core.pipeline.is_empty() {
            for (b, &need) in inst.core.pipeline_sizes.iter().enumerate() {
                if need == 0 {
                    continue;
                }
                let fits = self.pipeline_buffers[b]
                    .as_ref()
                    .is_some_and(|buf| buf.size() >= need && !buf.is_freed());
                if !fits {
                    let buffer = self.bufts[b].clone().alloc_buffer(need)?;
                    buffer.set_usage(BufferUsage::Compute);
                    if let Some(old) = self.pipeline_buffers[b].replace(buffer) {
                        old.free();
                    }
                }
            }
            let Some(internal) = inst.slots[slot].as_ref() else {
                return Err(Error::InvalidArgument("internal: slot not built".into()));
            };
            for entry in &inst.core.pipeline {
                let Some(buffer) = self.pipeline_buffers[entry.backend].as_ref() else {
                    return Err(Error::alloc("pipeline buffer missing"));
                };
                let tensor = match entry.copy {
                    Some(c) => &internal.copies[c],
                    None => inst.topo.tensor(&inst.graph, entry.tensor),
                };
                tensor.bind_in(buffer, entry.offset + slot * entry.stride, batch)?;
            }
        }
        Ok(())
    }

    /// Plans the current graph's memory in the allocator (growing its buffers).
    fn reserve_current(&mut self, slot: usize) -> Result<()> {
        let Some(inst) = self.instance.as_ref() else {
            return Err(Error::InvalidArgument("internal: no current graph".into()));
        };
        let Some(internal) = inst.slots[slot].as_ref() else {
            return Err(Error::InvalidArgument("internal: slot not built".into()));
        };
        let graph = internal.graph.as_ref().unwrap_or(&inst.graph);
        self.galloc
            .reserve_n(graph, &internal.node_ids, &internal.leaf_ids)?;
        self.reserved_core = Some(inst.core.clone());
        Ok(())
    }

    /// Plans `graph` and sizes the compute buffers for it (a worst-case graph, typically),
    /// without allocating its tensors. Tensors allocated by this scheduler before become
    /// stale.
    pub fn reserve(&mut self, graph: &Graph) -> Result<()> {
        self.synchronize_backends()?;
        self.split_graph(graph)?;
        self.prepare_slot(self.cur_copy, &BindBatch::new())?;
        self.reserve_current(self.cur_copy)?;
        self.state = State::Fresh;
        Ok(())
    }

    /// The compute bytes each backend would need for `graph` (pipeline slots included),
    /// without allocating anything.
    pub fn reserve_size(&mut self, graph: &Graph) -> Result<Vec<usize>> {
        self.split_graph(graph)?;
        self.prepare_slot(self.cur_copy, &BindBatch::new())?;
        let Some(inst) = self.instance.as_ref() else {
            return Err(Error::InvalidArgument("internal: no current graph".into()));
        };
        let Some(internal) = inst.slots[self.cur_copy].as_ref() else {
            return Err(Error::InvalidArgument("internal: slot not built".into()));
        };
        let g = internal.graph.as_ref().unwrap_or(&inst.graph);
        let mut sizes = self
            .galloc
            .reserve_n_size(g, &internal.node_ids, &internal.leaf_ids)?;
        for (size, pipeline) in sizes.iter_mut().zip(&inst.core.pipeline_sizes) {
            *size += pipeline;
        }
        Ok(sizes)
    }

    /// Splits (or reuses the cached plan of) `graph` and allocates its tensors. The next
    /// pipeline slot is used.
    pub fn alloc_graph(&mut self, graph: &Graph) -> Result<()> {
        self.split_graph(graph)?;
        self.cur_copy = self.next_copy;
        self.next_copy = (self.next_copy + 1) % self.n_copies;
        self.alloc_current()?;
        self.state = State::Allocated;
        Ok(())
    }

    fn alloc_current(&mut self) -> Result<()> {
        let slot = self.cur_copy;
        // Every binding of this allocation (pipeline slots, shadows, the caller's tensors) is
        // one change of the layout (see `BindBatch`; the graph allocator's own batch nests
        // inside), over before the records at the end read the layout epoch.
        let batch = BindBatch::new();
        self.prepare_slot(slot, &batch)?;
        let own = self.own_buffer_ids();
        let needs_reserve = match (&self.reserved_core, &self.instance) {
            (Some(reserved), Some(inst)) => !Arc::ptr_eq(reserved, &inst.core),
            _ => true,
        };
        if needs_reserve {
            self.synchronize_backends()?;
            self.reserve_current(slot)?;
        }
        let Some(inst) = self.instance.as_ref() else {
            return Err(Error::InvalidArgument("internal: no current graph".into()));
        };
        let Some(internal) = inst.slots[slot].as_ref() else {
            return Err(Error::InvalidArgument("internal: slot not built".into()));
        };
        // Shadows of nodes the caller allocated themselves share that memory.
        for (original, shadow) in &internal.bindings {
            if let Ok(storage) = original.storage() {
                if !own.contains(&storage.buffer.id()) {
                    shadow.bind_in(&storage.buffer, storage.offset, &batch)?;
                }
            }
        }
        let graph = internal.graph.as_ref().unwrap_or(&inst.graph);
        let first_try = if self.unchanged {
            self.galloc.alloc_graph_unchanged(graph)
        } else {
            self.galloc.alloc_graph_unrecorded(graph)
        };
        if let Err(first) = first_try {
            log::debug!("scheduler: re-reserving after allocation failed ({first})");
            self.synchronize_backends()?;
            self.galloc
                .reserve_n(graph, &internal.node_ids, &internal.leaf_ids)?;
            self.reserved_core = Some(inst.core.clone());
            self.galloc.alloc_graph_unrecorded(graph)?;
        }
        let own = self.own_buffer_ids();
        for (original, shadow) in &internal.bindings {
            let external = original
                .storage()
                .is_ok_and(|s| !own.contains(&s.buffer.id()));
            if !external {
                let storage = shadow.storage()?;
                original.bind_in(&storage.buffer, storage.offset, &batch)?;
            }
        }
        drop(batch);
        // The caller's tensors now share the shadows' memory: record which ones later nodes
        // or copies overwrite, so reading them after a compute raises instead of returning
        // other bytes. A replay of the graph swept last, with nothing moved since, keeps the
        // records that sweep left (`alloc::overwrites`, "Replays"). The internal graph's epoch
        // stands for its bindings: both are built together, once per slot.
        let allocated = internal.graph.as_ref().unwrap_or(&inst.graph);
        self.sweep.record(allocated, &internal.bindings);
        Ok(())
    }

    /// Whether `graph` is the allocated graph: its inputs may be set again and it computed
    /// again without another [`Scheduler::alloc_graph`] (which would redo the same plan).
    /// False after a reset, a new reservation or pin, or once another graph was split.
    pub fn is_allocated(&self, graph: &Graph) -> bool {
        self.state == State::Allocated
            && self
                .instance
                .as_ref()
                .is_some_and(|i| same_graph(&i.graph, graph))
    }

    /// Queues the computation of `graph`, allocating it first when nothing is allocated (or
    /// another graph is). After [`Scheduler::reset`], call [`Scheduler::alloc_graph`] first.
    pub fn graph_compute_async(&mut self, graph: &Graph) -> Result<Status> {
        self.compute_with(graph, None)
    }

    /// [`Scheduler::graph_compute_async`], appending node times to `profile` when given.
    fn compute_with(
        &mut self,
        graph: &Graph,
        profile: Option<&mut Vec<profile::Timed>>,
    ) -> Result<Status> {
        let current = self
            .instance
            .as_ref()
            .is_some_and(|i| same_graph(&i.graph, graph));
        match self.state {
            State::Reset => {
                return Err(Error::NotAllocated(
                    "the scheduler was reset; call alloc_graph before computing".into(),
                ))
            }
            State::Allocated if current => {}
            State::Allocated | State::Fresh => self.alloc_graph(graph)?,
        }
        let Some(inst) = self.instance.as_ref() else {
            return Err(Error::NotAllocated("no graph is allocated".into()));
        };
        let Some(internal) = inst.slots[self.cur_copy].as_ref() else {
            return Err(Error::NotAllocated("no graph is allocated".into()));
        };
        let run = exec::Run {
            backends: &self.backends,
            graph: &inst.graph,
            topo: &inst.topo,
            core: &inst.core,
            internal,
            events: &self.events,
            slot: self.cur_copy,
        };
        run.compute(self.callback.as_mut(), profile)
    }

    /// Computes `graph` and waits for it (see [`Scheduler::graph_compute_async`]).
    pub fn graph_compute(&mut self, graph: &Graph) -> Result<Status> {
        let status = self.graph_compute_async(graph)?;
        self.synchronize()?;
        Ok(status)
    }

    /// Waits for every backend. When nothing is allocated, the next allocation starts again
    /// at pipeline slot 0.
    pub fn synchronize(&mut self) -> Result<()> {
        self.synchronize_backends()?;
        if self.state != State::Allocated {
            self.next_copy = 0;
        }
        Ok(())
    }

    /// Forgets the current allocation and every pin; the next graph must be allocated with
    /// [`Scheduler::alloc_graph`] before computing. Cached plans are kept.
    ///
    /// Unlike ggml, the compute memory is invalidated at once: tensors the last allocation
    /// placed become stale, so reading one after a reset is an error instead of a read of
    /// memory the next graph may reuse.
    pub fn reset(&mut self) {
        if !self.pinned.is_empty() {
            // The current plan was made under these pins: cached under them first.
            self.sign_current();
            self.pinned.clear();
            self.plan_epoch += 1;
        }
        self.state = State::Reset;
        for id in 0..self.bufts.len() {
            for buffer in self.galloc.buffers(id) {
                buffer.reset();
            }
        }
        for buffer in self.pipeline_buffers.iter().flatten() {
            buffer.reset();
        }
    }

    /// The plan of the current graph, with names and buffer sizes.
    pub fn plan(&self) -> Option<SchedPlan> {
        let inst = self.instance.as_ref()?;
        let core = &inst.core;
        let entry = |u: usize| {
            let t = inst.topo.tensor(&inst.graph, u);
            let name = t.name();
            PlannedTensor {
                tensor: core.tensor_ref(u),
                name: if name.is_empty() {
                    format!("#{}", t.id())
                } else {
                    name
                },
                op: t.op().display_name(),
                is_view: t.is_view(),
                assignment: core.assignments[u],
            }
        };
        Some(SchedPlan {
            backend_names: self.backend_names.clone(),
            n_copies: self.n_copies,
            nodes: (0..core.n_nodes).map(entry).collect(),
            leafs: (core.n_nodes..inst.topo.len()).map(entry).collect(),
            splits: core.splits.clone(),
            copies: core.copies.clone(),
            graph_inputs: core
                .graph_inputs
                .iter()
                .map(|&u| core.tensor_ref(u))
                .collect(),
            buffer_sizes: (0..self.backends.len())
                .map(|b| self.buffer_size_of(b))
                .collect(),
        })
    }

    /// The graph allocator's memory plan for the scheduler's current (internal) graph:
    /// offsets, lifetimes and sizes per backend buffer id.
    pub fn memory_plan(&self) -> Option<&crate::alloc::MemoryPlan> {
        self.galloc.plan()
    }

    /// The plan of the current graph as GraphViz DOT (see [`SchedPlan::to_dot`]).
    pub fn to_dot(&self) -> Option<String> {
        let inst = self.instance.as_ref()?;
        Some(self.plan()?.to_dot(&inst.graph))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::context::Context;
    use crate::dtype::DType;
    use crate::ops;

    /// The plan-cache signature encodes shapes and strides compactly (dense strides as a flag):
    /// graphs that differ only in a view's strides, or in a shape beyond 32 bits, must not
    /// share a signature, and identical rebuilt graphs must.
    #[test]
    fn signature_tells_strides_and_wide_shapes_apart() {
        let sig = |row_stride: usize, wide: bool| {
            let ctx = Context::new(true);
            let x = ctx.new_tensor(DType::F32, &[8, 4]).unwrap();
            let v = ops::view(&ctx, &x, &[4, 2], &[row_stride], 0).unwrap();
            let mut outs = vec![ops::scale(&ctx, &v, 2.0, 0.0).unwrap()];
            if wide {
                // Metadata only (no_alloc): a shape past 32 bits is never materialised.
                let big = ctx.new_tensor(DType::F32, &[1usize << 33]).unwrap();
                outs.push(ops::scale(&ctx, &big, 1.0, 0.0).unwrap());
            }
            let g = Graph::build(&outs);
            let topo = Topology::build(&g, &[]);
            topo.signature(&g, &IdMap::default())
        };
        assert_eq!(sig(32, false), sig(32, false), "identical graphs");
        assert_ne!(sig(32, false), sig(16, false), "row strides 32 vs 16 bytes");
        assert_eq!(sig(16, true), sig(16, true), "identical wide graphs");
        assert_ne!(sig(16, true), sig(16, false));
    }

    #[test]
    fn cause_tags_are_distinct() {
        let causes = [
            Cause::Pinned,
            Cause::Buffer,
            Cause::Input,
            Cause::Weight,
            Cause::Offload,
            Cause::ExpandAccel,
            Cause::ExpandAny,
            Cause::MostOperands,
            Cause::Upgrade,
            Cause::ViewSource,
            Cause::Consumer,
            Cause::FirstSupporting,
            Cause::Unused,
        ];
        let mut tags: Vec<&str> = causes.iter().map(|c| c.tag()).collect();
        tags.sort_unstable();
        tags.dedup();
        assert_eq!(tags.len(), causes.len());
    }

    /// The batch an op works on (the count the offload policy compares): a product's columns.
    #[test]
    fn op_batch_of_a_product_is_its_columns() {
        let ctx = Context::new(true);
        let a = ctx.new_tensor(DType::F32, &[4, 3]).unwrap();
        let b = ctx.new_tensor(DType::F32, &[4, 5]).unwrap();
        let m = ops::mul_mat(&ctx, &a, &b).unwrap();
        assert_eq!(assign::op_batch(&m), 5);
    }
}
