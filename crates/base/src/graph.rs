//! Computation graphs: the tensors needed for some outputs, in an order that computes every
//! operand before its consumers.
//!
//! Leafs are tensors no op computes (op NONE, not parameters); nodes are everything else. Both
//! are kept in topological order with an index from tensor identity to position. There is no
//! size limit.

use std::collections::HashMap;
use std::fmt::{self, Write as _};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crate::error::{Error, Result};
use crate::op::Op;
use crate::tensor::Tensor;
use crate::util::IdMap;

/// Where a tensor sits in a graph.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Position {
    /// Index into [`Graph::nodes`].
    Node(usize),
    /// Index into [`Graph::leafs`].
    Leaf(usize),
}

/// A computation graph.
///
/// Clones share the node and leaf lists (a clone is one reference count, not one per tensor);
/// adding to a shared graph copies them first.
#[derive(Clone, Default)]
pub struct Graph {
    body: Arc<Body>,
    /// See [`Graph::epoch`].
    epoch: u64,
}

/// The tensors of a [`Graph`] and the index from tensor id to position.
#[derive(Clone, Default)]
struct Body {
    nodes: Vec<Tensor>,
    leafs: Vec<Tensor>,
    index: IdMap<Position>,
}

/// Source of graph epochs (0 is the empty graph's).
static NEXT_GRAPH_EPOCH: AtomicU64 = AtomicU64::new(1);

fn next_epoch() -> u64 {
    NEXT_GRAPH_EPOCH.fetch_add(1, Ordering::Relaxed)
}

impl Graph {
    /// An empty graph.
    pub fn new() -> Graph {
        Graph::default()
    }

    /// The graph that computes all `outputs` (ggml's build-forward-expand of each in turn).
    pub fn build(outputs: &[Tensor]) -> Graph {
        let mut graph = Graph::new();
        for output in outputs {
            graph.expand(output);
        }
        graph
    }

    /// Adds `tensor` and every tensor it depends on that is not yet in the graph, operands
    /// first (left to right), so that the node order is a valid execution order.
    pub fn expand(&mut self, tensor: &Tensor) {
        // Iterative depth-first post-order: deep graphs must not overflow the stack.
        let mut stack: Vec<(Tensor, usize)> = Vec::new();
        if self.body.index.contains_key(&tensor.id()) {
            return;
        }
        stack.push((tensor.clone(), 0));
        let mut on_stack = std::collections::HashSet::new();
        on_stack.insert(tensor.id());
        while let Some((current, next_src)) = stack.pop() {
            if next_src < current.srcs().len() {
                let src = current.srcs()[next_src].clone();
                stack.push((current, next_src + 1));
                if !self.body.index.contains_key(&src.id()) && on_stack.insert(src.id()) {
                    stack.push((src, 0));
                }
                continue;
            }
            self.push(current);
        }
    }

    fn push(&mut self, tensor: Tensor) {
        let is_leaf = matches!(tensor.op(), Op::None) && !tensor.is_param();
        let body = Arc::make_mut(&mut self.body);
        let id = tensor.id();
        let position = if is_leaf {
            body.leafs.push(tensor);
            Position::Leaf(body.leafs.len() - 1)
        } else {
            body.nodes.push(tensor);
            Position::Node(body.nodes.len() - 1)
        };
        body.index.insert(id, position);
        self.epoch = next_epoch();
    }

    /// Appends one node without visiting its operands (ggml's `graph_add_node`).
    pub fn add_node(&mut self, tensor: &Tensor) -> Result<()> {
        if self.body.index.contains_key(&tensor.id()) {
            return Err(Error::InvalidArgument(format!(
                "{} is already in the graph",
                tensor.label()
            )));
        }
        let body = Arc::make_mut(&mut self.body);
        body.nodes.push(tensor.clone());
        body.index
            .insert(tensor.id(), Position::Node(body.nodes.len() - 1));
        self.epoch = next_epoch();
        Ok(())
    }

    /// Appends one leaf without visiting anything (for graphs assembled by hand, such as the
    /// scheduler's internal graph).
    pub fn add_leaf(&mut self, tensor: &Tensor) -> Result<()> {
        if self.body.index.contains_key(&tensor.id()) {
            return Err(Error::InvalidArgument(format!(
                "{} is already in the graph",
                tensor.label()
            )));
        }
        let body = Arc::make_mut(&mut self.body);
        body.leafs.push(tensor.clone());
        body.index
            .insert(tensor.id(), Position::Leaf(body.leafs.len() - 1));
        self.epoch = next_epoch();
        Ok(())
    }

    /// A stamp of the graph's contents: it changes (to a process-unique value) whenever a
    /// node or leaf is added, and clones keep it. Two graphs with the same epoch therefore
    /// hold the same tensors in the same order (0: an empty graph that was never modified).
    /// Lets callers such as the scheduler recognise a graph they indexed before without
    /// walking it. Tensor flags and storage bindings are not covered.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// The computed tensors, in execution order.
    pub fn nodes(&self) -> &[Tensor] {
        &self.body.nodes
    }

    /// The tensors no op computes (weights, inputs, constants).
    pub fn leafs(&self) -> &[Tensor] {
        &self.body.leafs
    }

    /// Number of nodes.
    pub fn n_nodes(&self) -> usize {
        self.body.nodes.len()
    }

    /// Number of leafs.
    pub fn n_leafs(&self) -> usize {
        self.body.leafs.len()
    }

    /// The node at `i`; negative indices count from the end (`-1` is the last node).
    pub fn node(&self, i: isize) -> Result<&Tensor> {
        let n = self.body.nodes.len() as isize;
        let index = if i < 0 { n + i } else { i };
        if index < 0 || index >= n {
            return Err(Error::out_of_bounds(format!(
                "node index {i} outside a graph of {n} nodes"
            )));
        }
        Ok(&self.body.nodes[index as usize])
    }

    /// Where `tensor` is in the graph, if it is.
    pub fn position(&self, tensor: &Tensor) -> Option<Position> {
        self.body.index.get(&tensor.id()).copied()
    }

    /// Whether `tensor` is in the graph.
    pub fn contains(&self, tensor: &Tensor) -> bool {
        self.body.index.contains_key(&tensor.id())
    }

    /// The first node or leaf with this name.
    pub fn get_tensor(&self, name: &str) -> Option<&Tensor> {
        self.body
            .nodes
            .iter()
            .chain(self.body.leafs.iter())
            .find(|t| t.name() == name)
    }

    /// A graph of the nodes `start..end` only (no leafs), as ggml's graph view.
    pub fn view(&self, start: usize, end: usize) -> Result<Graph> {
        if start > end || end > self.body.nodes.len() {
            return Err(Error::out_of_bounds(format!(
                "node range {start}..{end} outside a graph of {} nodes",
                self.body.nodes.len()
            )));
        }
        let mut body = Body::default();
        for tensor in &self.body.nodes[start..end] {
            body.nodes.push(tensor.clone());
            body.index
                .insert(tensor.id(), Position::Node(body.nodes.len() - 1));
        }
        let epoch = if body.nodes.is_empty() {
            0
        } else {
            next_epoch()
        };
        Ok(Graph {
            body: Arc::new(body),
            epoch,
        })
    }

    /// For each node, how many nodes of this graph use it as an operand.
    pub fn consumer_counts(&self) -> HashMap<u64, usize> {
        let mut counts = HashMap::new();
        for node in &self.body.nodes {
            for src in node.srcs() {
                *counts.entry(src.id()).or_insert(0) += 1;
            }
        }
        counts
    }

    /// A GraphViz DOT description: leafs as boxes, nodes as ellipses, edges from operands.
    pub fn to_dot(&self) -> String {
        let mut out = String::from(
            "digraph ferrograph {\n  rankdir=TB;\n  node [fontname=\"monospace\", fontsize=10];\n",
        );
        let label = |t: &Tensor| {
            let name = t.name();
            let title = if name.is_empty() {
                format!("#{}", t.id())
            } else {
                name
            };
            format!(
                "{title}\\n{} {:?}\\n{}",
                t.dtype(),
                t.shape(),
                t.op().display_name()
            )
        };
        for leaf in &self.body.leafs {
            let colour = if leaf.is_input() {
                "lightblue"
            } else {
                "lightgrey"
            };
            let _ = writeln!(
                out,
                "  t{} [shape=box, style=filled, fillcolor={colour}, label=\"{}\"];",
                leaf.id(),
                label(leaf)
            );
        }
        for node in &self.body.nodes {
            let colour = if node.is_output() {
                "gold"
            } else if node.is_view() {
                "white"
            } else {
                "palegreen"
            };
            let _ = writeln!(
                out,
                "  t{} [style=filled, fillcolor={colour}, label=\"{}\"];",
                node.id(),
                label(node)
            );
        }
        for node in &self.body.nodes {
            for (i, src) in node.srcs().iter().enumerate() {
                if self.contains(src) {
                    let _ = writeln!(out, "  t{} -> t{} [label=\"{i}\"];", src.id(), node.id());
                }
            }
        }
        out.push_str("}\n");
        out
    }
}

impl fmt::Display for Graph {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "Graph: {} nodes, {} leafs",
            self.body.nodes.len(),
            self.body.leafs.len()
        )?;
        for (i, node) in self.body.nodes.iter().enumerate() {
            let srcs: Vec<String> = node.srcs().iter().map(|s| format!("#{}", s.id())).collect();
            writeln!(
                f,
                "  node {i:>4}: #{:<5} {:<14} {:<5} {:<16} <- [{}] {}{}",
                node.id(),
                node.op().display_name(),
                node.dtype().name(),
                format!("{:?}", node.shape()),
                srcs.join(", "),
                node.name(),
                if node.is_output() { " (output)" } else { "" }
            )?;
        }
        for (i, leaf) in self.body.leafs.iter().enumerate() {
            writeln!(
                f,
                "  leaf {i:>4}: #{:<5} {:<5} {:<16} {}{}",
                leaf.id(),
                leaf.dtype().name(),
                format!("{:?}", leaf.shape()),
                leaf.name(),
                if leaf.is_input() { " (input)" } else { "" }
            )?;
        }
        Ok(())
    }
}

impl fmt::Debug for Graph {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "Graph(nodes={}, leafs={})",
            self.body.nodes.len(),
            self.body.leafs.len()
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::context::Context;
    use crate::dtype::DType;
    use crate::ops;

    #[test]
    fn topological_order_and_lookup() {
        let ctx = Context::new(true);
        let a = ctx.new_tensor(DType::F32, &[4, 3]).unwrap();
        a.set_name("a");
        let b = ctx.new_tensor(DType::F32, &[4, 3]).unwrap();
        let s = ops::add(&ctx, &a, &b).unwrap();
        let m = ops::mul(&ctx, &s, &a).unwrap();
        let out = ops::add(&ctx, &m, &s).unwrap();
        let g = Graph::build(std::slice::from_ref(&out));
        assert_eq!(g.n_leafs(), 2);
        assert_eq!(g.n_nodes(), 3);
        assert_eq!(g.node(-1).unwrap(), &out);
        assert!(g.node(3).is_err());
        for (i, node) in g.nodes().iter().enumerate() {
            for src in node.srcs() {
                if let Some(Position::Node(j)) = g.position(src) {
                    assert!(j < i);
                }
            }
        }
        assert_eq!(g.get_tensor("a"), Some(&a));
        assert_eq!(g.consumer_counts()[&s.id()], 2);
        let v = g.view(1, 3).unwrap();
        assert_eq!(v.n_nodes(), 2);
        assert!(g.to_dot().contains("digraph"));
        assert!(format!("{g}").contains("ADD"));
    }

    #[test]
    fn deep_chains_do_not_overflow() {
        let ctx = Context::new(true);
        let mut t = ctx.new_tensor(DType::F32, &[2]).unwrap();
        for _ in 0..100_000 {
            t = ops::unary(&ctx, &t, ops::UnaryOp::Neg).unwrap();
        }
        let g = Graph::build(&[t]);
        assert_eq!(g.n_nodes(), 100_000);
    }
}
