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

use super::assign::Oracle;
use super::plan::{Assignment, CopyPlan, PipelineEntry, PlanCore, SplitPlan};
use super::topology::NONE;

/// Builds the splits, copies and pipeline layout from the final assignments.
pub(crate) fn split(
    oracle: &mut Oracle<'_>,
    assigned: &[Option<Assignment>],
    n_copies: usize,
) -> Result<PlanCore> {
    let input = oracle.input;
    let graph = input.graph;
    let topo = input.topo;
    let n_nodes = topo.n_nodes;
    let backend_of = |u: usize| assigned[u].map_or(input.backends.len() - 1, |a| a.backend);
    let mut splits: Vec<SplitPlan> = Vec::new();
    let mut copies: Vec<CopyPlan> = Vec::new();
    let mut copy_sources: Vec<usize> = Vec::new();
    let mut operand_copies: Vec<(usize, usize, usize)> = Vec::new();
    let mut copy_index: HashMap<(usize, usize), usize> = HashMap::new();
    let mut graph_inputs: Vec<usize> = Vec::new();
    let mut seen_input = vec![false; topo.len()];
    let mut current: Option<SplitPlan> = None;

    for i in 0..n_nodes {
        let node = &graph.nodes()[i];
        if node.op().is_view_op() {
            continue;
        }
        let b = backend_of(i);
        let mut start_new = current.as_ref().is_none_or(|c| c.backend != b);
        if !start_new && current.as_ref().is_some_and(|c| !c.inputs.is_empty()) {
            for &s in topo.srcs(i) {
                let s = s as usize;
                let is_weight = topo.buf_info(s).is_some_and(|info| info.weights);
                if is_weight
                    && backend_of(s) != b
                    && !oracle.buffer_supported(b, s, assigned)
                    && !copy_index.contains_key(&(s, b))
                {
                    start_new = true;
                    break;
                }
            }
        }
        if start_new {
            let start = match current.take() {
                Some(mut done) => {
                    done.nodes.end = i;
                    splits.push(done);
                    i
                }
                None => 0,
            };
            current = Some(SplitPlan {
                backend: b,
                nodes: start..i,
                inputs: Vec::new(),
            });
        }
        let Some(cur) = current.as_mut() else {
            return Err(Error::InvalidArgument("internal: no open split".into()));
        };
        for (j, &s) in topo.srcs(i).iter().enumerate() {
            let s = s as usize;
            let src = topo.tensor(graph, s);
            if src.is_input() && !seen_input[s] {
                seen_input[s] = true;
                graph_inputs.push(s);
            }
            let from = backend_of(s);
            if from == b || oracle.buffer_supported(b, s, assigned) {
                continue;
            }
            let split_index = splits.len();
            let c = *copy_index.entry((s, b)).or_insert_with(|| {
                copies.push(CopyPlan {
                    source: PlanCoreRef::tensor_ref(n_nodes, topo.n_leafs, s),
                    from_backend: from,
                    to_backend: b,
                    split: split_index,
                    user_input: src.is_input(),
                    nbytes: src.nbytes(),
                });
                copy_sources.push(s);
                cur.inputs.push(copies.len() - 1);
                copies.len() - 1
            });
            operand_copies.push((i, j, c));
        }
    }
    match current.take() {
        Some(mut done) => {
            done.nodes.end = n_nodes;
            splits.push(done);
        }
        None if n_nodes > 0 => splits.push(SplitPlan {
            backend: backend_of(0),
            nodes: 0..n_nodes,
            inputs: Vec::new(),
        }),
        None => {}
    }

    // Pipeline slots: graph inputs the scheduler places, and every copy.
    let n_backends = input.backends.len();
    let mut pipeline = Vec::new();
    let mut pipeline_sizes = vec![0usize; n_backends];
    if n_copies > 1 {
        // `source` is the tensor the slot holds (for a copy, its source: same dtype and shape).
        let mut add = |copy: Option<usize>, tensor: usize, backend: usize, source: &Tensor| {
            let buft = &input.bufts[backend];
            let nbytes = source.nbytes();
            let stride = align_up(buft.alloc_size(source), buft.alignment())
                .ok_or_else(|| Error::Alloc(format!("{nbytes} bytes overflow")))?;
            let offset = pipeline_sizes[backend];
            pipeline_sizes[backend] = stride
                .checked_mul(n_copies)
                .and_then(|s| s.checked_add(offset))
                .ok_or_else(|| Error::Alloc("pipeline buffer size overflows".into()))?;
            pipeline.push(PipelineEntry {
                copy,
                tensor,
                backend,
                offset,
                stride,
            });
            Ok::<(), Error>(())
        };
        for &u in &graph_inputs {
            let t = topo.tensor(graph, u);
            if t.is_view() || topo.buf[u] != NONE || topo.view_root[u] != NONE {
                continue;
            }
            add(None, u, backend_of(u), t)?;
        }
        for (c, copy) in copies.iter().enumerate() {
            let source = topo.tensor(graph, copy_sources[c]);
            add(Some(c), copy_sources[c], copy.to_backend, source)?;
        }
    }

    Ok(PlanCore {
        n_nodes,
        n_leafs: topo.n_leafs,
        assignments: assigned
            .iter()
            .map(|a| {
                a.unwrap_or(Assignment {
                    backend: n_backends - 1,
                    cause: super::plan::Cause::Unused,
                })
            })
            .collect(),
        splits,
        copies,
        copy_sources,
        operand_copies,
        graph_inputs,
        pipeline,
        pipeline_sizes,
    })
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
