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

/// Runs all passes; returns one assignment per unified tensor (all `Some`).
pub(crate) fn assign(oracle: &mut Oracle<'_>) -> Result<Vec<Option<Assignment>>> {
    let input = oracle.input;
    let graph = input.graph;
    let topo = input.topo;
    let n_backends = input.backends.len();
    let cpu = n_backends - 1;
    let total = topo.len();
    let n_nodes = topo.n_nodes;
    let mut assigned: Vec<Option<Assignment>> = vec![None; total];
    let set = |assigned: &mut Vec<Option<Assignment>>, u: usize, backend: usize, cause: Cause| {
        assigned[u] = Some(Assignment { backend, cause });
    };

    // Pinned tensors.
    if !input.pinned.is_empty() {
        for (u, slot) in assigned.iter_mut().enumerate() {
            let t = topo.tensor(graph, u);
            if let Some(&b) = input.pinned.get(&t.id()) {
                if !oracle.supports_op(b, u) {
                    return Err(Error::UnsupportedOp(format!(
                        "{} ({}) is pinned to backend {} ({}), which cannot run it",
                        t.label(),
                        t.op().display_name(),
                        b,
                        input.backends[b].name()
                    )));
                }
                *slot = Some(Assignment {
                    backend: b,
                    cause: Cause::Pinned,
                });
            }
        }
    }

    // Pass 1: leafs (and outside operands), then nodes.
    let order = (n_nodes..total).chain(0..n_nodes);
    for u in order {
        if assigned[u].is_some() {
            continue;
        }
        let t = topo.tensor(graph, u);
        if topo.buf[u] != NONE {
            match oracle.backend_from_buffer(u) {
                Some(b) => set(&mut assigned, u, b, Cause::Buffer),
                None => {
                    return Err(Error::UnsupportedOp(format!(
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
            set(&mut assigned, u, cpu, Cause::Input);
            continue;
        }
        if u >= n_nodes || matches!(t.op(), Op::Rope(_) | Op::FlashAttnExt { .. }) {
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
                set(&mut assigned, u, k, Cause::Offload);
                continue;
            }
        }
        set(&mut assigned, u, b, Cause::Weight);
    }

    // Pass 2: expansion.
    let nodes: Vec<usize> = (0..n_nodes)
        .filter(|&i| !is_view_op(&graph.nodes()[i]))
        .collect();
    for accel_only in [true, false] {
        for down in [true, false] {
            let mut carry: Option<usize> = None;
            let mut step =
                |i: usize, assigned: &mut Vec<Option<Assignment>>, oracle: &mut Oracle<'_>| {
                    match assigned[i] {
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
                                    let cause = if accel_only {
                                        Cause::ExpandAccel
                                    } else {
                                        Cause::ExpandAny
                                    };
                                    assigned[i] = Some(Assignment { backend: b, cause });
                                }
                            }
                        }
                    }
                };
            if down {
                for &i in &nodes {
                    step(i, &mut assigned, oracle);
                }
            } else {
                for &i in nodes.iter().rev() {
                    step(i, &mut assigned, oracle);
                }
            }
        }
    }

    // Pass 3: best operands for the unassigned; upgrades for the assigned.
    for &i in &nodes {
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
                            known && oracle.buffer_supported(b, s, &assigned)
                        })
                        .count();
                    if best.is_none_or(|(_, m)| n > m) {
                        best = Some((b, n));
                    }
                }
                if let Some((b, _)) = best {
                    set(&mut assigned, i, b, Cause::MostOperands);
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
                    let srcs = topo.srcs(i);
                    if srcs
                        .iter()
                        .all(|&s| oracle.buffer_supported(b, s as usize, &assigned))
                    {
                        set(&mut assigned, i, b, Cause::Upgrade);
                        break;
                    }
                }
            }
            Some(_) => {}
        }
    }

    // Pass 4: views, operands, leftovers.
    for i in 0..n_nodes {
        if assigned[i].is_none() {
            let root = topo.view_root[i];
            if root != NONE {
                if let Some(a) = assigned[root as usize] {
                    set(&mut assigned, i, a.backend, Cause::ViewSource);
                }
            }
        }
        if assigned[i].is_none() {
            match (0..n_backends).find(|&b| oracle.supports_op(b, i)) {
                Some(b) => set(&mut assigned, i, b, Cause::FirstSupporting),
                None => {
                    let t = &graph.nodes()[i];
                    let dtypes: Vec<&str> = t.srcs().iter().map(|s| s.dtype().name()).collect();
                    return Err(Error::UnsupportedOp(format!(
                        "no backend of the scheduler runs {} ({} with operands ({}) producing {})",
                        t.label(),
                        t.op().display_name(),
                        dtypes.join(", "),
                        t.dtype().name()
                    )));
                }
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
                Some(b) => set(&mut assigned, s, b, Cause::ViewSource),
                None => set(&mut assigned, s, node_backend, Cause::Consumer),
            }
        }
    }
    // Whatever is left (leafs nobody reads, view roots outside the graph).
    for a in &mut assigned {
        if a.is_none() {
            *a = Some(Assignment {
                backend: cpu,
                cause: Cause::Unused,
            });
        }
    }
    Ok(assigned)
}
