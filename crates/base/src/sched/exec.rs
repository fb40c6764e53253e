//! Running the splits: inputs copied in (user inputs synchronously, the rest asynchronously
//! where the backend can), each split computed on its backend, events recorded so the next
//! use of a pipeline slot waits for the work that read it.

use std::sync::Arc;
use std::time::Instant;

use crate::backend::{tensor_copy, tensor_copy_async, Backend};
use crate::error::{Result, Status};
use crate::event::{wait_or_sync, Event};
use crate::graph::Graph;
use crate::tensor::Tensor;

use super::internal::Internal;
use super::plan::PlanCore;
use super::profile::Timed;
use super::topology::Topology;

/// The evaluation callback: `(tensor, ask)`. With `ask = true` it answers whether it wants
/// to see the tensor once computed; with `ask = false` it receives the computed tensor and
/// returns `false` to cancel the whole computation.
pub type EvalCallback = Box<dyn FnMut(&Tensor, bool) -> bool + Send>;

/// Everything a run needs.
pub(crate) struct Run<'a> {
    pub backends: &'a [Arc<dyn Backend>],
    pub graph: &'a Graph,
    pub topo: &'a Topology,
    pub core: &'a PlanCore,
    pub internal: &'a Internal,
    /// `events[backend][slot]`.
    pub events: &'a [Vec<Option<Arc<dyn Event>>>],
    pub slot: usize,
}

impl Run<'_> {
    fn event(&self, backend: usize) -> Option<&Arc<dyn Event>> {
        self.events
            .get(backend)
            .and_then(|row| row.get(self.slot))
            .and_then(Option::as_ref)
    }

    fn wait_host(&self, backend: usize) -> Result<()> {
        match self.event(backend) {
            Some(event) => event.synchronize(),
            None => self.backends[backend].synchronize(),
        }
    }

    /// Computes every split; stops at the first status other than success. With `profile`,
    /// every node is computed on its own and its wall time appended there.
    pub fn compute(
        &self,
        mut callback: Option<&mut EvalCallback>,
        mut profile: Option<&mut Vec<Timed>>,
    ) -> Result<Status> {
        let splits = &self.core.splits;
        for (k, split) in splits.iter().enumerate() {
            let b = split.backend;
            let backend = self.backends[b].as_ref();
            // An input-less split may reuse memory the previous backend is still reading.
            if split.inputs.is_empty() && k > 0 && splits[k - 1].backend != b {
                self.wait_host(splits[k - 1].backend)?;
            }
            for &c in &split.inputs {
                let plan = &self.core.copies[c];
                let source = self.topo.tensor(self.graph, self.core.copy_sources[c]);
                let copy = &self.internal.copies[c];
                if plan.user_input {
                    // Copied now, so the caller may overwrite the input once we return.
                    self.wait_host(b)?;
                    tensor_copy(source, copy)?;
                } else {
                    wait_or_sync(self.event(b), backend, backend)?;
                    let from = self.backends[plan.from_backend].as_ref();
                    tensor_copy_async(from, backend, source, copy)?;
                }
            }
            let split_graph = &self.internal.split_graphs[k];
            // One branch per split: the unprofiled path is unchanged.
            let status = match (callback.as_deref_mut(), profile.as_deref_mut()) {
                (None, None) => backend.graph_compute_async(split_graph)?,
                (Some(cb), None) => {
                    self.compute_observed(backend, split_graph, split.nodes.start, cb)?
                }
                (None, Some(times)) => {
                    self.compute_timed_inside(b, split_graph, split.nodes.start, times)?
                }
                (cb, Some(times)) => {
                    self.compute_timed(b, split_graph, split.nodes.start, cb, times)?
                }
            };
            if status != Status::Success {
                return Ok(status);
            }
            // The caller's nodes of the split hold their results now (shadows computed into
            // their memory), before the next split's copies are written.
            crate::tensor::mark_computed(&self.graph.nodes()[split.nodes.clone()]);
            if let Some(event) = self.event(b) {
                event.record(backend)?;
            }
        }
        Ok(Status::Success)
    }

    /// Computes a split in pieces that end at the nodes the callback wants to observe.
    fn compute_observed(
        &self,
        backend: &dyn Backend,
        split_graph: &Graph,
        first_node: usize,
        callback: &mut EvalCallback,
    ) -> Result<Status> {
        let n = split_graph.n_nodes();
        let original = |j: usize| &self.graph.nodes()[first_node + j];
        let mut start = 0;
        while start < n {
            let mut wanted = start;
            while wanted < n && !callback(original(wanted), true) {
                wanted += 1;
            }
            let end = (wanted + 1).min(n);
            let status = backend.graph_compute_async(&split_graph.view(start, end)?)?;
            if status != Status::Success {
                return Ok(status);
            }
            backend.synchronize()?;
            // The callback may read the node it asked for: it is computed now.
            crate::tensor::mark_computed(&self.graph.nodes()[first_node + start..first_node + end]);
            if wanted < n && !callback(original(wanted), false) {
                return Ok(Status::Aborted);
            }
            start = end;
        }
        Ok(Status::Success)
    }

    /// Computes a split as a normal run, its backend timing the nodes inside that run, and
    /// records their times; a backend that cannot ([`Backend::graph_compute_timed`] gives
    /// `None`) is timed one node at a time ([`Self::compute_timed`]).
    fn compute_timed_inside(
        &self,
        b: usize,
        split_graph: &Graph,
        first_node: usize,
        times: &mut Vec<Timed>,
    ) -> Result<Status> {
        let Some((status, seconds)) = self.backends[b].graph_compute_timed(split_graph)? else {
            return self.compute_timed(b, split_graph, first_node, None, times);
        };
        times.extend(seconds.into_iter().enumerate().map(|(j, seconds)| Timed {
            index: first_node + j,
            backend: b,
            seconds,
        }));
        Ok(status)
    }

    /// Computes a split one node at a time, waiting for each, and records its wall time
    /// (the callback, if any, still sees the nodes it asks for).
    fn compute_timed(
        &self,
        b: usize,
        split_graph: &Graph,
        first_node: usize,
        mut callback: Option<&mut EvalCallback>,
        times: &mut Vec<Timed>,
    ) -> Result<Status> {
        let backend = self.backends[b].as_ref();
        for j in 0..split_graph.n_nodes() {
            let original = &self.graph.nodes()[first_node + j];
            let wanted = match callback.as_deref_mut() {
                Some(cb) => cb(original, true),
                None => false,
            };
            let one = split_graph.view(j, j + 1)?;
            let start = Instant::now();
            let status = backend.graph_compute_async(&one)?;
            backend.synchronize()?;
            times.push(Timed {
                index: first_node + j,
                backend: b,
                seconds: start.elapsed().as_secs_f64(),
            });
            if status != Status::Success {
                return Ok(status);
            }
            crate::tensor::mark_computed(std::slice::from_ref(original));
            if wanted {
                if let Some(cb) = callback.as_deref_mut() {
                    if !cb(original, false) {
                        return Ok(Status::Aborted);
                    }
                }
            }
        }
        Ok(Status::Success)
    }
}
