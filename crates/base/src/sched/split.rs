//! Cutting the assigned graph into splits and deciding the copies between backends.
//!
//! A split is a run of consecutive nodes on one backend; a new one starts where the backend
//! changes (view ops never start one), or — once the split already has inputs — where a node
//! reads a weight that must be copied in (so the memory of offloaded weights is reused split
//! by split, as ggml does). An operand whose memory the node's backend cannot use gets one
//! copy per (tensor, destination backend), made at the start of the first split that needs
//! it and read by every later split on that backend.

use std::collections::HashMap;

use crate::alloc::dyn_alloc::align_up;
use crate::error::{Error, Result};
use crate::tensor::Tensor;

use super::assign::{AssignInput, Oracle};
use super::plan::{Assignment, CopyPlan, PipelineEntry, PlanCore, SplitPlan};
use super::topology::NONE;

/// Builds the splits, copies and pipeline layout from the final assignments.
pub(crate) fn split(
    oracle: &mut Oracle<'_>,
    assigned: &[Option<Assignment>],
    n_copies: usize,
) -> Result<PlanCore> {
    let input = oracle.input;
    let (graph, topo) = (input.graph, input.topo);
    let n_nodes = topo.n_nodes;
    let mut cut = Cutter::new(oracle, assigned);
    for i in 0..n_nodes {
        if graph.nodes()[i].op().is_view_op() {
            continue;
        }
        let b = cut.backend_of(i);
        if cut.starts_new_split(i, b) {
            cut.open_split(i, b);
        }
        cut.route_operands(i, b)?;
    }
    cut.close_last_split();
    let Cutter {
        splits,
        copies,
        copy_sources,
        operand_copies,
        graph_inputs,
        ..
    } = cut;
    let backend_of = |u: usize| backend_or_last(assigned, input.backends.len(), u);
    let (pipeline, pipeline_sizes) = if n_copies > 1 {
        pipeline_layout(
            input,
            &graph_inputs,
            &copies,
            &copy_sources,
            backend_of,
            n_copies,
        )?
    } else {
        (Vec::new(), vec![0; input.backends.len()])
    };
    Ok(PlanCore {
        n_nodes,
        n_leafs: topo.n_leafs,
        assignments: final_assignments(assigned, input.backends.len()),
        splits,
        copies,
        copy_sources,
        operand_copies,
        graph_inputs,
        pipeline,
        pipeline_sizes,
    })
}

/// A tensor's backend; unassigned tensors (never read) count as the last backend's.
fn backend_or_last(assigned: &[Option<Assignment>], n_backends: usize, u: usize) -> usize {
    assigned[u].map_or(n_backends - 1, |a| a.backend)
}

/// The state of the walk over the nodes that cuts the graph into splits.
struct Cutter<'o, 'a> {
    oracle: &'o mut Oracle<'a>,
    assigned: &'o [Option<Assignment>],
    splits: Vec<SplitPlan>,
    /// The split being filled (pushed to `splits` when the next one opens).
    current: Option<SplitPlan>,
    copies: Vec<CopyPlan>,
    /// Unified index of each copy's source.
    copy_sources: Vec<usize>,
    /// `(node, operand index, copy)`, in node order.
    operand_copies: Vec<(usize, usize, usize)>,
    /// The copy of `(tensor, destination backend)`: one per pair for the whole graph.
    copy_index: HashMap<(usize, usize), usize>,
    graph_inputs: Vec<usize>,
    seen_input: Vec<bool>,
}

impl<'o, 'a> Cutter<'o, 'a> {
    fn new(oracle: &'o mut Oracle<'a>, assigned: &'o [Option<Assignment>]) -> Self {
        let n = oracle.input.topo.len();
        Cutter {
            oracle,
            assigned,
            splits: Vec::new(),
            current: None,
            copies: Vec::new(),
            copy_sources: Vec::new(),
            operand_copies: Vec::new(),
            copy_index: HashMap::new(),
            graph_inputs: Vec::new(),
            seen_input: vec![false; n],
        }
    }

    fn backend_of(&self, u: usize) -> usize {
        backend_or_last(self.assigned, self.oracle.input.backends.len(), u)
    }

    /// Whether node `i` (on backend `b`) starts a split: the backend changes, or the open
    /// split already has inputs and `i` reads a weight that must be copied to `b` and is not
    /// yet (so offloaded weights are copied in split by split, reusing their memory).
    fn starts_new_split(&mut self, i: usize, b: usize) -> bool {
        let Some(open) = self.current.as_ref() else {
            return true;
        };
        if open.backend != b {
            return true;
        }
        if open.inputs.is_empty() {
            return false;
        }
        let topo = self.oracle.input.topo;
        topo.srcs(i).iter().any(|&s| {
            let s = s as usize;
            topo.buf_info(s).is_some_and(|info| info.weights)
                && self.backend_of(s) != b
                && !self.oracle.buffer_supported(b, s, self.assigned)
                && !self.copy_index.contains_key(&(s, b))
        })
    }

    /// Closes the open split (ending before node `i`) and opens one on backend `b` from `i`;
    /// the first split starts at node 0, so leading view nodes belong to it.
    fn open_split(&mut self, i: usize, b: usize) {
        let start = match self.current.take() {
            Some(mut done) => {
                done.nodes.end = i;
                self.splits.push(done);
                i
            }
            None => 0,
        };
        self.current = Some(SplitPlan {
            backend: b,
            nodes: start..i,
            inputs: Vec::new(),
        });
    }

    /// Records node `i`'s graph inputs, and gives every operand whose memory backend `b`
    /// cannot use a copy (made once per tensor and backend, at the start of the open split
    /// when it is the first to need it).
    fn route_operands(&mut self, i: usize, b: usize) -> Result<()> {
        let input = self.oracle.input;
        let (graph, topo) = (input.graph, input.topo);
        let split_index = self.splits.len();
        for (j, &s) in topo.srcs(i).iter().enumerate() {
            let s = s as usize;
            let src = topo.tensor(graph, s);
            if src.is_input() && !self.seen_input[s] {
                self.seen_input[s] = true;
                self.graph_inputs.push(s);
            }
            let from = self.backend_of(s);
            if from == b || self.oracle.buffer_supported(b, s, self.assigned) {
                continue;
            }
            let Some(open) = self.current.as_mut() else {
                return Err(Error::InvalidArgument("internal: no open split".into()));
            };
            let copies = &mut self.copies;
            let copy_sources = &mut self.copy_sources;
            let c = *self.copy_index.entry((s, b)).or_insert_with(|| {
                copies.push(CopyPlan {
                    source: PlanCoreRef::tensor_ref(topo.n_nodes, topo.n_leafs, s),
                    from_backend: from,
                    to_backend: b,
                    split: split_index,
                    user_input: src.is_input(),
                    nbytes: src.nbytes(),
                });
                copy_sources.push(s);
                open.inputs.push(copies.len() - 1);
                copies.len() - 1
            });
            self.operand_copies.push((i, j, c));
        }
        Ok(())
    }

    /// Closes the last split at the graph's end; a graph of view nodes only gets one split
    /// of all of them.
    fn close_last_split(&mut self) {
        let n_nodes = self.oracle.input.topo.n_nodes;
        match self.current.take() {
            Some(mut done) => {
                done.nodes.end = n_nodes;
                self.splits.push(done);
            }
            None if n_nodes > 0 => self.splits.push(SplitPlan {
                backend: self.backend_of(0),
                nodes: 0..n_nodes,
                inputs: Vec::new(),
            }),
            None => {}
        }
    }
}

/// The pipeline slots (with `n_copies` > 1): one per graph input the scheduler places and per
/// copy, `n_copies` strides of it in its backend's pipeline buffer. Returns the slots and the
/// bytes of each backend's buffer.
fn pipeline_layout(
    input: &AssignInput<'_>,
    graph_inputs: &[usize],
    copies: &[CopyPlan],
    copy_sources: &[usize],
    backend_of: impl Fn(usize) -> usize,
    n_copies: usize,
) -> Result<(Vec<PipelineEntry>, Vec<usize>)> {
    let (graph, topo) = (input.graph, input.topo);
    let mut pipeline = Vec::new();
    let mut sizes = vec![0usize; input.backends.len()];
    // `source` is the tensor the slot holds (for a copy, its source: same dtype and shape).
    let mut add = |copy: Option<usize>, tensor: usize, backend: usize, source: &Tensor| {
        let buft = &input.bufts[backend];
        let nbytes = source.nbytes();
        let stride = align_up(buft.alloc_size(source), buft.alignment())
            .ok_or_else(|| Error::alloc(format!("{nbytes} bytes overflow")))?;
        let offset = sizes[backend];
        sizes[backend] = stride
            .checked_mul(n_copies)
            .and_then(|s| s.checked_add(offset))
            .ok_or_else(|| Error::alloc("pipeline buffer size overflows"))?;
        pipeline.push(PipelineEntry {
            copy,
            tensor,
            backend,
            offset,
            stride,
        });
        Ok::<(), Error>(())
    };
    for &u in graph_inputs {
        let t = topo.tensor(graph, u);
        // Views and tensors already in a buffer are not the scheduler's to place.
        if t.is_view() || topo.buf[u] != NONE || topo.view_root[u] != NONE {
            continue;
        }
        add(None, u, backend_of(u), t)?;
    }
    for (c, copy) in copies.iter().enumerate() {
        let source = topo.tensor(graph, copy_sources[c]);
        add(Some(c), copy_sources[c], copy.to_backend, source)?;
    }
    Ok((pipeline, sizes))
}

/// Every tensor's assignment, the unassigned ones (never read) marked unused on the last
/// backend.
fn final_assignments(assigned: &[Option<Assignment>], n_backends: usize) -> Vec<Assignment> {
    assigned
        .iter()
        .map(|a| {
            a.unwrap_or(Assignment {
                backend: n_backends - 1,
                cause: super::plan::Cause::Unused,
            })
        })
        .collect()
}

/// Unified index to [`TensorRef`](super::plan::TensorRef) without a core at hand.
struct PlanCoreRef;

impl PlanCoreRef {
    fn tensor_ref(n_nodes: usize, n_leafs: usize, u: usize) -> super::plan::TensorRef {
        use super::plan::TensorRef;
        if u < n_nodes {
            TensorRef::Node(u)
        } else if u < n_nodes + n_leafs {
            TensorRef::Leaf(u - n_nodes)
        } else {
            TensorRef::Outside(u - n_nodes - n_leafs)
        }
    }
}
