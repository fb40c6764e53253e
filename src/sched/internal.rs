//! The scheduler's own graph for one caller graph and one pipeline slot, built beside the
//! caller's graph without touching it.
//!
//! Tensor metadata is immutable, so a node that must read a *copy* of an operand cannot be
//! rewired. Instead the scheduler makes a **shadow**: a new tensor with the same dtype, shape,
//! strides, op and parameters whose operands are the copies (or the shadows of operands that
//! were themselves shadowed; a view of a shadowed tensor is shadowed as a view of the shadow).
//! Only nodes downstream of a copy get shadows; everything else appears as itself.
//!
//! The internal graph is, per split: the split's copy tensors (op NONE, reading their source
//! so the allocator keeps the source alive until the copy is made), then the split's nodes
//! (shadow or original). The graph allocator plans it like any graph; afterwards each
//! original node that has a shadow is bound to the shadow's storage, so the caller reads the
//! results from their own tensors. Backends compute the per-split graphs of this internal
//! graph.

use std::sync::Weak;

use crate::error::Result;
use crate::graph::Graph;
use crate::tensor::{flags, Tensor, TensorSpec};

use super::plan::PlanCore;
use super::topology::{Topology, NONE};

/// The internal graph of one caller graph for one pipeline slot.
pub(crate) struct Internal {
    /// The allocation graph; `None` when it would equal the caller's graph (no copies).
    pub graph: Option<Graph>,
    pub node_ids: Vec<usize>,
    pub leaf_ids: Vec<usize>,
    /// Per split, the graph its backend computes.
    pub split_graphs: Vec<Graph>,
    /// Per copy of the plan, the tensor holding it in this slot.
    pub copies: Vec<Tensor>,
    /// `(original, shadow)` for every shadowed non-view node.
    pub bindings: Vec<(Tensor, Tensor)>,
}

fn copy_flags(from: &Tensor, to: &Tensor) {
    let bits = from.flags();
    if bits & flags::INPUT != 0 {
        to.set_input();
    }
    if bits & flags::OUTPUT != 0 {
        to.set_output();
    }
    if bits & flags::PARAM != 0 {
        to.set_param();
    }
    if bits & flags::LOSS != 0 {
        to.set_loss();
    }
}

/// Builds the internal graph of `graph` under `core` for pipeline slot `slot`.
pub(crate) fn build(
    graph: &Graph,
    topo: &Topology,
    core: &PlanCore,
    slot: usize,
    n_copies: usize,
    backend_names: &[String],
) -> Result<Internal> {
    let n_nodes = topo.n_nodes;
    let backend_of = |u: usize| core.assignments[u].backend;
    let identity = core.copies.is_empty() && topo.extras.is_empty();
    if identity {
        let mut split_graphs = Vec::with_capacity(core.splits.len());
        for split in &core.splits {
            // One split of the whole graph computes the graph itself (a clone shares the
            // tensors and copies the index instead of rebuilding it).
            split_graphs.push(if split.nodes.start == 0 && split.nodes.end == n_nodes {
                graph.clone()
            } else {
                graph.view(split.nodes.start, split.nodes.end)?
            });
        }
        return Ok(Internal {
            graph: None,
            node_ids: (0..n_nodes).map(backend_of).collect(),
            leaf_ids: (n_nodes..n_nodes + topo.n_leafs).map(backend_of).collect(),
            split_graphs,
            copies: Vec::new(),
            bindings: Vec::new(),
        });
    }

    let total = topo.len();
    let mut internal = Graph::new();
    let mut node_ids = Vec::with_capacity(n_nodes + core.copies.len());
    let mut leaf_ids = Vec::with_capacity(total - n_nodes);
    for u in n_nodes..total {
        internal.add_leaf(topo.tensor(graph, u))?;
        leaf_ids.push(backend_of(u));
    }
    let mut subst: Vec<Option<Tensor>> = vec![None; total];
    let mut copies: Vec<Option<Tensor>> = vec![None; core.copies.len()];
    let mut bindings = Vec::new();
    let mut split_graphs = Vec::with_capacity(core.splits.len());
    let mut next_operand_copy = 0usize;
    let current = |u: usize, subst: &[Option<Tensor>]| -> Tensor {
        subst[u]
            .clone()
            .unwrap_or_else(|| topo.tensor(graph, u).clone())
    };

    for split in &core.splits {
        for &c in &split.inputs {
            let plan = &core.copies[c];
            let source_index = core.copy_sources[c];
            let source = current(source_index, &subst);
            let copy = Tensor::from_spec(
                TensorSpec {
                    dtype: source.dtype(),
                    ne: source.ne(),
                    nb: Some(source.nb()),
                    ndim: source.ndim(),
                    op: crate::ops::Op::None,
                    srcs: vec![source.clone()],
                    view: None,
                },
                Weak::new(),
            )?;
            let name = topo.tensor(graph, source_index).name();
            let name = if name.is_empty() {
                format!("#{}", topo.tensor(graph, source_index).id())
            } else {
                name
            };
            copy.set_name(&format!(
                "{}#{}#{}",
                backend_names
                    .get(plan.to_backend)
                    .map_or("?", String::as_str),
                name,
                slot
            ));
            if n_copies > 1 {
                copy.set_input();
                copy.set_output();
            }
            internal.add_node(&copy)?;
            node_ids.push(plan.to_backend);
            copies[c] = Some(copy);
        }
        let mut split_graph = Graph::new();
        for i in split.nodes.clone() {
            let original = &graph.nodes()[i];
            let first_copy = next_operand_copy;
            while next_operand_copy < core.operand_copies.len()
                && core.operand_copies[next_operand_copy].0 == i
            {
                next_operand_copy += 1;
            }
            let through_copy = &core.operand_copies[first_copy..next_operand_copy];
            let root = topo.view_root[i];
            let needs_shadow = !through_copy.is_empty()
                || topo.srcs(i).iter().any(|&s| subst[s as usize].is_some())
                || (root != NONE && subst[root as usize].is_some());
            if needs_shadow {
                let mut srcs = Vec::with_capacity(original.srcs().len());
                for (j, &s) in topo.srcs(i).iter().enumerate() {
                    let via = through_copy
                        .iter()
                        .find(|&&(_, k, _)| k == j)
                        .and_then(|&(_, _, c)| copies[c].clone());
                    srcs.push(via.unwrap_or_else(|| current(s as usize, &subst)));
                }
                let view = if root != NONE {
                    Some((current(root as usize, &subst), original.view_offset()))
                } else {
                    None
                };
                let shadow = Tensor::from_spec(
                    TensorSpec {
                        dtype: original.dtype(),
                        ne: original.ne(),
                        nb: Some(original.nb()),
                        ndim: original.ndim(),
                        op: original.op().clone(),
                        srcs,
                        view,
                    },
                    Weak::new(),
                )?;
                shadow.set_name(&original.name());
                copy_flags(original, &shadow);
                if !original.is_view() {
                    bindings.push((original.clone(), shadow.clone()));
                }
                subst[i] = Some(shadow);
            }
            let node = current(i, &subst);
            internal.add_node(&node)?;
            node_ids.push(backend_of(i));
            split_graph.add_node(&node)?;
        }
        split_graphs.push(split_graph);
    }
    let copies = copies
        .into_iter()
        .map(|c| {
            c.ok_or_else(|| {
                crate::error::Error::InvalidArgument(
                    "internal: a copy of the plan was not made".into(),
                )
            })
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(Internal {
        graph: Some(internal),
        node_ids,
        leaf_ids,
        split_graphs,
        copies,
        bindings,
    })
}
