//! Backend assignment: ggml's passes, over unified tensor indices (see
//! [`Topology`](super::topology::Topology)), each decision recorded with its [`Cause`].
//!
//! Backends are in priority order (0 first); the last one is the CPU.
//!
//! 1. *From the tensor*: pinned tensors keep their backend; a tensor already in a buffer goes
//!    to the first backend that can use that buffer type and run the op; graph inputs go to
//!    the CPU; an op with an operand in a weights buffer follows the weight, unless the weight
//!    is in host memory and the offload policy hands the op to a higher-priority backend.
//! 2. *Expansion*: assignments spread to unassigned neighbours — first only non-CPU ones (down,
//!    then up the node list), then any (down, then up) — where the backend supports the op.
//! 3. *Best operands / upgrade*: an unassigned node goes to the backend that can read most of
//!    its assigned operands; an assigned (not pinned) node moves to the first higher-priority
//!    backend with the same buffer type that runs the op and reads all operands.
//! 4. *Leftovers*: views follow what they view, operands follow their consumer, and a node
//!    still unassigned goes to the first backend that runs it (an error if none does).
//!
//! View ops (reshape, view, permute, transpose) are skipped by passes 2 and 3.

use std::sync::Arc;

use crate::backend::Backend;
use crate::buffer::{same_buffer_type, BufferType};
use crate::error::{Error, Result};
use crate::graph::Graph;
use crate::ops::Op;
use crate::tensor::Tensor;

use super::plan::{Assignment, Cause};
use super::topology::{IdMap, Topology, NONE};
use super::OffloadPolicy;

/// Inputs of the passes.
pub(crate) struct AssignInput<'a> {
    pub graph: &'a Graph,
    pub topo: &'a Topology,
    pub backends: &'a [Arc<dyn Backend>],
    pub bufts: &'a [Arc<dyn BufferType>],
    /// `buft_ok[b][k]`: backend `b` can use `bufts[k]`.
    pub buft_ok: &'a [Vec<bool>],
    pub pinned: &'a IdMap<usize>,
    pub op_offload: bool,
    pub policy: OffloadPolicy,
}

/// Memoised `supports_op` / `supports_buft` answers.
pub(crate) struct Oracle<'a> {
    pub input: &'a AssignInput<'a>,
    supports: Vec<u8>,
    foreign_bufts: Vec<(usize, Vec<bool>)>,
}

impl<'a> Oracle<'a> {
    pub fn new(input: &'a AssignInput<'a>) -> Oracle<'a> {
        Oracle {
            input,
            supports: vec![0; input.topo.len() * input.backends.len()],
            foreign_bufts: Vec::new(),
        }
    }

    fn tensor(&self, u: usize) -> &'a Tensor {
        self.input.topo.tensor(self.input.graph, u)
    }

    /// Whether backend `b` runs tensor `u`'s op.
    pub fn supports_op(&mut self, b: usize, u: usize) -> bool {
        let key = u * self.input.backends.len() + b;
        match self.supports[key] {
            1 => true,
            2 => false,
            _ => {
                let yes = self.input.backends[b].supports_op(self.tensor(u));
                self.supports[key] = if yes { 1 } else { 2 };
                yes
            }
        }
    }

    /// Whether backend `b` can use memory of `buft`.
    pub fn supports_buft(&mut self, b: usize, buft: &Arc<dyn BufferType>) -> bool {
        if let Some(k) = self.input.bufts.iter().position(|x| Arc::ptr_eq(x, buft)) {
            return self.input.buft_ok[b][k];
        }
        let key = Arc::as_ptr(buft) as *const () as usize;
        if let Some((_, row)) = self.foreign_bufts.iter().find(|(k, _)| *k == key) {
            return row[b];
        }
        let row: Vec<bool> = self
            .input
            .backends
            .iter()
            .map(|backend| backend.supports_buft(buft.as_ref()))
            .collect();
        let yes = row[b];
        self.foreign_bufts.push((key, row));
        yes
    }

    /// ggml's `buffer_supported`: backend `b` can read tensor `u` where it lives (its buffer,
    /// or the buffer type of the backend it is assigned to).
    pub fn buffer_supported(
        &mut self,
        b: usize,
        u: usize,
        assigned: &[Option<Assignment>],
    ) -> bool {
        if let Some(info) = self.input.topo.buf_info(u) {
            return self.supports_buft(b, &info.buft);
        }
        let mut owner = assigned[u].map(|a| a.backend);
        if owner.is_none() {
            let root = self.input.topo.view_root[u];
            if root != NONE {
                owner = assigned[root as usize].map(|a| a.backend);
            }
        }
        match owner {
            Some(k) => self.input.buft_ok[b][k],
            None => false,
        }
    }

    /// The first backend that can use `u`'s buffer and run the op.
    fn backend_from_buffer(&mut self, u: usize) -> Option<usize> {
        let info = self.input.topo.buf_info(u)?;
        (0..self.input.backends.len())
            .find(|&b| self.supports_buft(b, &info.buft) && self.supports_op(b, u))
    }
}

/// The "batch" ggml's offload heuristics look at.
pub(crate) fn op_batch(t: &Tensor) -> usize {
    match t.op() {
        Op::MulMat => t.ne()[1],
        Op::MulMatId | Op::Rope(_) => t.ne()[2],
        Op::GetRows => 0,
        _ => t.nrows(),
    }
}

fn is_view_op(t: &Tensor) -> bool {
    t.op().is_view_op()
}

/// Whether pass 1 must not place `t` by its weight operand: ROPE's weight-buffer operand is
/// its frequency-factor table and FLASH_ATTN_EXT's its sinks, tiny tables whose home says
/// nothing about where the (large) op should run (ggml skips ROPE for the same reason). Such
/// ops are placed by the later passes, from their neighbours and operands.
fn weight_does_not_decide(t: &Tensor) -> bool {
    matches!(t.op(), Op::Rope(_) | Op::FlashAttnExt { .. })
}

/// The assignments made so far, one slot per unified tensor.
type Assigned = Vec<Option<Assignment>>;

fn set(assigned: &mut Assigned, u: usize, backend: usize, cause: Cause) {
    assigned[u] = Some(Assignment { backend, cause });
}

/// Runs all passes (see the module doc); returns one assignment per unified tensor (all
/// `Some`).
pub(crate) fn assign(oracle: &mut Oracle<'_>) -> Result<Vec<Option<Assignment>>> {
    let mut assigned: Assigned = vec![None; oracle.input.topo.len()];
    assign_pinned(oracle, &mut assigned)?;
    assign_from_tensors(oracle, &mut assigned)?;
    let mut nodes: Vec<usize> = Vec::with_capacity(oracle.input.topo.n_nodes);
    nodes.extend(
        (0..oracle.input.topo.n_nodes).filter(|&i| !is_view_op(&oracle.input.graph.nodes()[i])),
    );
    expand(oracle, &mut assigned, &nodes);
    assign_by_operands(oracle, &mut assigned, &nodes);
    assign_leftovers(oracle, &mut assigned)?;
    Ok(assigned)
}

/// Pinned tensors keep their backend (an error if it cannot run them).
fn assign_pinned(oracle: &mut Oracle<'_>, assigned: &mut Assigned) -> Result<()> {
    let input = oracle.input;
    if input.pinned.is_empty() {
        return Ok(());
    }
    for u in 0..assigned.len() {
        let t = input.topo.tensor(input.graph, u);
        if let Some(&b) = input.pinned.get(&t.id()) {
            if !oracle.supports_op(b, u) {
                return Err(Error::unsupported(format!(
                    "{} ({}) is pinned to backend {} ({}), which cannot run it",
                    t.label(),
                    t.op().display_name(),
                    b,
                    input.backends[b].name()
                )));
            }
            set(assigned, u, b, Cause::Pinned);
        }
    }
    Ok(())
}

/// Pass 1, from the tensor itself: leafs (and outside operands), then nodes.
fn assign_from_tensors(oracle: &mut Oracle<'_>, assigned: &mut Assigned) -> Result<()> {
    let input = oracle.input;
    let (graph, topo) = (input.graph, input.topo);
    let n_backends = input.backends.len();
    let cpu = n_backends - 1;
    let n_nodes = topo.n_nodes;
    for u in (n_nodes..topo.len()).chain(0..n_nodes) {
        if assigned[u].is_some() {
            continue;
        }
        let t = topo.tensor(graph, u);
        if topo.buf[u] != NONE {
            match oracle.backend_from_buffer(u) {
                Some(b) => set(assigned, u, b, Cause::Buffer),
                None => {
                    return Err(Error::unsupported(format!(
                        "{} ({}) already lives in a {} buffer, and no backend that can use \
                         that memory runs the op",
                        t.label(),
                        t.op().display_name(),
                        topo.buf_info(u).map_or("?", |b| b.buft.name())
                    )))
                }
            }
            continue;
        }
        if t.is_input() {
            set(assigned, u, cpu, Cause::Input);
            continue;
        }
        if u >= n_nodes {
            continue;
        }
        if let Some(b) = split_operand_backend(oracle, u)? {
            set(assigned, u, b, Cause::Weight);
            continue;
        }
        if weight_does_not_decide(t) {
            continue;
        }
        // The first operand in a weights buffer decides.
        let weight = topo
            .srcs(u)
            .iter()
            .map(|&s| s as usize)
            .find(|&s| topo.buf_info(s).is_some_and(|b| b.weights));
        let Some(info) = weight.and_then(|w| topo.buf_info(w)) else {
            continue;
        };
        let from_weight = (0..n_backends)
            .find(|&b| oracle.supports_buft(b, &info.buft) && oracle.supports_op(b, u));
        let Some(b) = from_weight else { continue };
        if input.op_offload && b == cpu && info.host {
            let offload = (0..cpu).find(|&k| {
                oracle.supports_op(k, u) && input.policy.offload(input.backends[k].as_ref(), t)
            });
            if let Some(k) = offload {
                set(assigned, u, k, Cause::Offload);
                continue;
            }
        }
        set(assigned, u, b, Cause::Weight);
    }
    Ok(())
}

/// A weight split by rows over several devices (a split buffer) is read only by a backend
/// that runs the op on it (the split buffer type's own, for `MUL_MAT`), whatever the buffer's
/// usage: copying it whole to another backend would gather on one device what was split
/// because it does not fit one. `Some(backend)` for a node reading one, an error if none can.
fn split_operand_backend(oracle: &mut Oracle<'_>, u: usize) -> Result<Option<usize>> {
    let topo = oracle.input.topo;
    for &s in topo.srcs(u) {
        let Some(info) = topo.buf_info(s as usize).filter(|i| i.buft.is_split()) else {
            continue;
        };
        let buft = info.buft.clone();
        if let Some(b) = (0..oracle.input.backends.len())
            .find(|&b| oracle.supports_buft(b, &buft) && oracle.supports_op(b, u))
        {
            return Ok(Some(b));
        }
        let t = topo.tensor(oracle.input.graph, u);
        let w = topo.tensor(oracle.input.graph, s as usize);
        let message = format!(
            "{} ({}) reads {}, a weight split by rows in a {} buffer: only MUL_MAT with the whole \
             split weight as its first operand runs on it, on the split buffer type's backend \
             (give the scheduler `buffer_type.device().init_backend()`)",
            t.label(),
            t.op().display_name(),
            w.label(),
            buft.name()
        );
        let dtypes = t
            .srcs()
            .iter()
            .map(|s| s.dtype().name().to_owned())
            .collect();
        return Err(Error::op_unsupported(
            message,
            t.op().display_name(),
            dtypes,
            None,
        ));
    }
    Ok(None)
}

/// Pass 2, expansion over the non-view `nodes`: first only non-CPU assignments spread (down,
/// then up), then any.
fn expand(oracle: &mut Oracle<'_>, assigned: &mut Assigned, nodes: &[usize]) {
    let cpu = oracle.input.backends.len() - 1;
    for accel_only in [true, false] {
        let cause = if accel_only {
            Cause::ExpandAccel
        } else {
            Cause::ExpandAny
        };
        for down in [true, false] {
            let mut carry: Option<usize> = None;
            let mut step =
                |i: usize, assigned: &mut Assigned, oracle: &mut Oracle<'_>| match assigned[i] {
                    Some(a) => {
                        carry = if accel_only && a.backend == cpu {
                            None
                        } else {
                            Some(a.backend)
                        };
                    }
                    None => {
                        if let Some(b) = carry {
                            if oracle.supports_op(b, i) {
                                set(assigned, i, b, cause);
                            }
                        }
                    }
                };
            if down {
                for &i in nodes {
                    step(i, assigned, oracle);
                }
            } else {
                for &i in nodes.iter().rev() {
                    step(i, assigned, oracle);
                }
            }
        }
    }
}

/// Pass 3 over the non-view `nodes`: an unassigned node goes to the backend that reads most of
/// its assigned operands; an assigned (not pinned) one moves to the first higher-priority
/// backend with the same buffer type that runs it and reads all its operands.
fn assign_by_operands(oracle: &mut Oracle<'_>, assigned: &mut Assigned, nodes: &[usize]) {
    let input = oracle.input;
    let topo = input.topo;
    let n_backends = input.backends.len();
    for &i in nodes {
        match assigned[i] {
            None => {
                let mut best: Option<(usize, usize)> = None;
                for b in 0..n_backends {
                    if !oracle.supports_op(b, i) {
                        continue;
                    }
                    let n = topo
                        .srcs(i)
                        .iter()
                        .map(|&s| s as usize)
                        .filter(|&s| {
                            let root = topo.view_root[s];
                            let known = assigned[s].is_some()
                                || (root != NONE && assigned[root as usize].is_some());
                            known && oracle.buffer_supported(b, s, assigned)
                        })
                        .count();
                    if best.is_none_or(|(_, m)| n > m) {
                        best = Some((b, n));
                    }
                }
                if let Some((b, _)) = best {
                    set(assigned, i, b, Cause::MostOperands);
                }
            }
            Some(a) if a.cause != Cause::Pinned => {
                let cur = a.backend;
                for b in 0..cur {
                    if !same_buffer_type(&input.bufts[b], &input.bufts[cur])
                        || !oracle.supports_op(b, i)
                    {
                        continue;
                    }
                    if topo
                        .srcs(i)
                        .iter()
                        .all(|&s| oracle.buffer_supported(b, s as usize, assigned))
                    {
                        set(assigned, i, b, Cause::Upgrade);
                        break;
                    }
                }
            }
            Some(_) => {}
        }
    }
}

/// Pass 4: views follow what they view, operands their consumer, a node still unassigned the
/// first backend that runs it (an error if none does), and whatever is left the CPU.
fn assign_leftovers(oracle: &mut Oracle<'_>, assigned: &mut Assigned) -> Result<()> {
    let input = oracle.input;
    let (graph, topo) = (input.graph, input.topo);
    let n_backends = input.backends.len();
    let cpu = n_backends - 1;
    for i in 0..topo.n_nodes {
        if assigned[i].is_none() {
            let root = topo.view_root[i];
            if root != NONE {
                if let Some(a) = assigned[root as usize] {
                    set(assigned, i, a.backend, Cause::ViewSource);
                }
            }
        }
        if assigned[i].is_none() {
            match (0..n_backends).find(|&b| oracle.supports_op(b, i)) {
                Some(b) => set(assigned, i, b, Cause::FirstSupporting),
                None => return Err(no_backend_runs(&graph.nodes()[i])),
            }
        }
        let node_backend = assigned[i].map_or(cpu, |a| a.backend);
        for &s in topo.srcs(i) {
            let s = s as usize;
            if assigned[s].is_some() {
                continue;
            }
            let root = topo.view_root[s];
            let from_root = if root != NONE {
                assigned[root as usize].map(|a| a.backend)
            } else {
                None
            };
            match from_root {
                Some(b) => set(assigned, s, b, Cause::ViewSource),
                None => set(assigned, s, node_backend, Cause::Consumer),
            }
        }
    }
    // Whatever is left (leafs nobody reads, view roots outside the graph).
    for a in assigned.iter_mut() {
        if a.is_none() {
            *a = Some(Assignment {
                backend: cpu,
                cause: Cause::Unused,
            });
        }
    }
    Ok(())
}

/// The error for a node no backend of the scheduler runs, with the op and dtypes as facts.
fn no_backend_runs(t: &Tensor) -> Error {
    let dtypes: Vec<&str> = t.srcs().iter().map(|s| s.dtype().name()).collect();
    let message = format!(
        "no backend of the scheduler runs {} ({} with operands ({}) producing {})",
        t.label(),
        t.op().display_name(),
        dtypes.join(", "),
        t.dtype().name()
    );
    let all = std::iter::once(t.dtype().name())
        .chain(dtypes)
        .map(str::to_owned)
        .collect();
    Error::op_unsupported(message, t.op().display_name(), all, None)
}
