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
    if core.copies.is_empty() && topo.extras.is_empty() {
        return identity(graph, topo, core);
    }
    let mut builder = Builder::new(graph, topo, core, slot, n_copies, backend_names)?;
    for split in &core.splits {
        for &c in &split.inputs {
            builder.add_copy(c)?;
        }
        let mut split_graph = Graph::new();
        for i in split.nodes.clone() {
            let node = builder.add_node(i)?;
            split_graph.add_node(&node)?;
        }
        builder.split_graphs.push(split_graph);
    }
    builder.finish()
}

/// The internal graph of a plan without copies or outside operands: the caller's graph itself,
/// each split a view of its nodes.
fn identity(graph: &Graph, topo: &Topology, core: &PlanCore) -> Result<Internal> {
    let n_nodes = topo.n_nodes;
    let backend_of = |u: usize| core.assignments[u].backend;
    let mut split_graphs = Vec::with_capacity(core.splits.len());
    for split in &core.splits {
        // One split of the whole graph computes the graph itself (a clone shares the tensors
        // and copies the index instead of rebuilding it).
        split_graphs.push(if split.nodes.start == 0 && split.nodes.end == n_nodes {
            graph.clone()
        } else {
            graph.view(split.nodes.start, split.nodes.end)?
        });
    }
    Ok(Internal {
        graph: None,
        node_ids: (0..n_nodes).map(backend_of).collect(),
        leaf_ids: (n_nodes..n_nodes + topo.n_leafs).map(backend_of).collect(),
        split_graphs,
        copies: Vec::new(),
        bindings: Vec::new(),
    })
}

/// The internal graph being built, split by split.
struct Builder<'a> {
    graph: &'a Graph,
    topo: &'a Topology,
    core: &'a PlanCore,
    slot: usize,
    n_copies: usize,
    backend_names: &'a [String],
    internal: Graph,
    node_ids: Vec<usize>,
    leaf_ids: Vec<usize>,
    /// Per unified tensor: its shadow, once it has one.
    subst: Vec<Option<Tensor>>,
    /// Per copy of the plan: its tensor, once made.
    copies: Vec<Option<Tensor>>,
    bindings: Vec<(Tensor, Tensor)>,
    split_graphs: Vec<Graph>,
    /// The first entry of `core.operand_copies` not yet used (they are in node order).
    next_operand_copy: usize,
}

impl<'a> Builder<'a> {
    /// Starts the internal graph with every leaf and outside operand of the caller's graph.
    fn new(
        graph: &'a Graph,
        topo: &'a Topology,
        core: &'a PlanCore,
        slot: usize,
        n_copies: usize,
        backend_names: &'a [String],
    ) -> Result<Self> {
        let (n_nodes, total) = (topo.n_nodes, topo.len());
        let mut internal = Graph::new();
        let mut leaf_ids = Vec::with_capacity(total - n_nodes);
        for u in n_nodes..total {
            internal.add_leaf(topo.tensor(graph, u))?;
            leaf_ids.push(core.assignments[u].backend);
        }
        Ok(Builder {
            graph,
            topo,
            core,
            slot,
            n_copies,
            backend_names,
            internal,
            node_ids: Vec::with_capacity(n_nodes + core.copies.len()),
            leaf_ids,
            subst: vec![None; total],
            copies: vec![None; core.copies.len()],
            bindings: Vec::new(),
            split_graphs: Vec::with_capacity(core.splits.len()),
            next_operand_copy: 0,
        })
    }

    /// Tensor `u` as the internal graph sees it: its shadow if it has one.
    fn current(&self, u: usize) -> Tensor {
        self.subst[u]
            .clone()
            .unwrap_or_else(|| self.topo.tensor(self.graph, u).clone())
    }

    /// Adds the tensor of copy `c`: op NONE reading its source (so the allocator keeps the
    /// source alive until the copy is made), named `<backend>#<source>#<slot>`, and marked
    /// input and output when pipelined (its memory must not be reused within the graph).
    fn add_copy(&mut self, c: usize) -> Result<()> {
        let plan = &self.core.copies[c];
        let source_index = self.core.copy_sources[c];
        let source = self.current(source_index);
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
        let original = self.topo.tensor(self.graph, source_index);
        let name = original.name();
        let name = if name.is_empty() {
            format!("#{}", original.id())
        } else {
            name
        };
        let backend = self
            .backend_names
            .get(plan.to_backend)
            .map_or("?", String::as_str);
        copy.set_name(&format!("{backend}#{name}#{}", self.slot));
        if self.n_copies > 1 {
            copy.set_input();
            copy.set_output();
        }
        self.internal.add_node(&copy)?;
        self.node_ids.push(plan.to_backend);
        self.copies[c] = Some(copy);
        Ok(())
    }

    /// Adds node `i` (its shadow when it needs one) and returns what was added.
    fn add_node(&mut self, i: usize) -> Result<Tensor> {
        let first = self.next_operand_copy;
        let operand_copies = &self.core.operand_copies;
        while self.next_operand_copy < operand_copies.len()
            && operand_copies[self.next_operand_copy].0 == i
        {
            self.next_operand_copy += 1;
        }
        let through_copy = &operand_copies[first..self.next_operand_copy];
        if self.needs_shadow(i, through_copy) {
            self.add_shadow(i, through_copy)?;
        }
        let node = self.current(i);
        self.internal.add_node(&node)?;
        self.node_ids.push(self.core.assignments[i].backend);
        Ok(node)
    }

    /// Whether node `i` must be shadowed: it reads an operand through a copy, an operand that
    /// is shadowed, or is a view of a shadowed tensor.
    fn needs_shadow(&self, i: usize, through_copy: &[(usize, usize, usize)]) -> bool {
        let root = self.topo.view_root[i];
        !through_copy.is_empty()
            || self
                .topo
                .srcs(i)
                .iter()
                .any(|&s| self.subst[s as usize].is_some())
            || (root != NONE && self.subst[root as usize].is_some())
    }

    /// Makes node `i`'s shadow: its metadata and op, operands replaced by their copies
    /// (`through_copy`) or shadows, a view of its root's shadow. Non-view nodes are bound to
    /// their shadow's storage later (`bindings`).
    fn add_shadow(&mut self, i: usize, through_copy: &[(usize, usize, usize)]) -> Result<()> {
        let original = &self.graph.nodes()[i];
        let mut srcs = Vec::with_capacity(original.srcs().len());
        for (j, &s) in self.topo.srcs(i).iter().enumerate() {
            let via = through_copy
                .iter()
                .find(|&&(_, k, _)| k == j)
                .and_then(|&(_, _, c)| self.copies[c].clone());
            srcs.push(via.unwrap_or_else(|| self.current(s as usize)));
        }
        let root = self.topo.view_root[i];
        let view = (root != NONE).then(|| (self.current(root as usize), original.view_offset()));
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
            self.bindings.push((original.clone(), shadow.clone()));
        }
        self.subst[i] = Some(shadow);
        Ok(())
    }

    /// The finished internal graph; every copy of the plan must have been made.
    fn finish(self) -> Result<Internal> {
        let copies = self
            .copies
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
            graph: Some(self.internal),
            node_ids: self.node_ids,
            leaf_ids: self.leaf_ids,
            split_graphs: self.split_graphs,
            copies,
            bindings: self.bindings,
        })
    }
}
