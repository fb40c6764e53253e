//! The scheduler's decisions as data: why each tensor runs where it runs, the splits, the
//! copies between backends and the memory each backend needs.
//!
//! [`PlanCore`] is what the scheduler caches (index based, no tensor handles, so a rebuilt
//! graph of the same shape reuses it). [`SchedPlan`] is the public, self-contained snapshot
//! with names and buffer sizes, printable ([`fmt::Display`]) and drawable ([`SchedPlan::to_dot`]).

use std::fmt::{self, Write as _};
use std::ops::Range;

/// Why a tensor was given its backend (the pass that decided it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Cause {
    /// Pinned by [`Scheduler::set_tensor_backend`](super::Scheduler::set_tensor_backend).
    Pinned,
    /// The tensor (or the tensor it views) already lives in a buffer; the first backend that
    /// can use that buffer type and run the op takes it.
    Buffer,
    /// A graph input: inputs are filled by the host, so they go to the CPU (last) backend.
    Input,
    /// An operand lives in a weights buffer; the op follows its weight.
    Weight,
    /// The op's weight is in host memory, but a higher-priority backend asked for the op
    /// (the offload policy said yes).
    Offload,
    /// Carried from a neighbouring node on a non-CPU backend (the accelerator sweeps).
    ExpandAccel,
    /// Carried from a neighbouring node on any backend (the final sweeps).
    ExpandAny,
    /// The backend that can read the most of the node's already assigned operands.
    MostOperands,
    /// Moved to a higher-priority backend that shares the buffer type (e.g. BLAS before CPU).
    Upgrade,
    /// A view runs where the tensor it views lives.
    ViewSource,
    /// An unassigned operand follows the node that consumes it.
    Consumer,
    /// Nothing else decided: the first backend that supports the op.
    FirstSupporting,
    /// A leaf no node reads: parked on the CPU backend.
    Unused,
}

impl Cause {
    /// A short tag for dumps.
    pub fn tag(self) -> &'static str {
        match self {
            Cause::Pinned => "pinned",
            Cause::Buffer => "buffer",
            Cause::Input => "input",
            Cause::Weight => "weight",
            Cause::Offload => "offload",
            Cause::ExpandAccel => "expand-accel",
            Cause::ExpandAny => "expand",
            Cause::MostOperands => "most-operands",
            Cause::Upgrade => "upgrade",
            Cause::ViewSource => "view-source",
            Cause::Consumer => "consumer",
            Cause::FirstSupporting => "first-supporting",
            Cause::Unused => "unused",
        }
    }
}

/// A backend choice and its cause.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Assignment {
    /// Index of the backend in the scheduler's list.
    pub backend: usize,
    /// Why.
    pub cause: Cause,
}

/// A tensor of the scheduled graph, by position.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TensorRef {
    /// `graph.nodes()[i]`.
    Node(usize),
    /// `graph.leafs()[i]`.
    Leaf(usize),
    /// An operand that is not part of the graph (the `i`-th such tensor met).
    Outside(usize),
}

/// A run of consecutive nodes computed on one backend.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SplitPlan {
    /// The backend that computes the split.
    pub backend: usize,
    /// The node indices of the caller's graph (view nodes in between included).
    pub nodes: Range<usize>,
    /// Copies (indices into [`SchedPlan::copies`]) made when the split starts.
    pub inputs: Vec<usize>,
}

/// A tensor copied into another backend's memory because that backend cannot read it where
/// it lives. One copy per (tensor, destination backend) serves every later split there.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CopyPlan {
    /// The tensor copied.
    pub source: TensorRef,
    /// The backend the source is assigned to.
    pub from_backend: usize,
    /// The backend the copy lives on.
    pub to_backend: usize,
    /// The split at whose start the copy is made.
    pub split: usize,
    /// The source is a graph input (copied synchronously, so the caller may overwrite it
    /// as soon as compute returns).
    pub user_input: bool,
    /// Bytes copied.
    pub nbytes: usize,
}

/// Where pipelined tensors live with `n_copies > 1`: one slot per copy in a scheduler-owned
/// buffer per backend.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct PipelineEntry {
    /// `Some(copy index)` for a split-input copy, `None` for a graph input itself.
    pub copy: Option<usize>,
    /// Unified tensor index of a graph input (unused for copies).
    pub tensor: usize,
    /// The backend whose buffer holds it.
    pub backend: usize,
    /// Offset of slot 0; slot `c` is at `offset + c * stride`.
    pub offset: usize,
    /// Bytes per slot (aligned).
    pub stride: usize,
}

/// The cached part of a plan: everything derived from the graph's shape, by index.
///
/// Tensor indices are *unified*: nodes `0..n_nodes`, then leafs, then outside operands.
#[derive(Debug, Clone)]
pub(crate) struct PlanCore {
    pub n_nodes: usize,
    pub n_leafs: usize,
    /// Per unified tensor.
    pub assignments: Vec<Assignment>,
    pub splits: Vec<SplitPlan>,
    pub copies: Vec<CopyPlan>,
    /// Unified index of each copy's source.
    pub copy_sources: Vec<usize>,
    /// `(node, operand index, copy)` for every operand read through a copy, sorted by node.
    pub operand_copies: Vec<(usize, usize, usize)>,
    /// Unified indices of graph inputs (INPUT-flagged operands), in first-use order.
    pub graph_inputs: Vec<usize>,
    /// Pipelined tensors (empty with one copy).
    pub pipeline: Vec<PipelineEntry>,
    /// Bytes of the pipeline buffer per backend, for all slots.
    pub pipeline_sizes: Vec<usize>,
}

impl PlanCore {
    pub fn tensor_ref(&self, unified: usize) -> TensorRef {
        if unified < self.n_nodes {
            TensorRef::Node(unified)
        } else if unified < self.n_nodes + self.n_leafs {
            TensorRef::Leaf(unified - self.n_nodes)
        } else {
            TensorRef::Outside(unified - self.n_nodes - self.n_leafs)
        }
    }
}

/// One tensor of a [`SchedPlan`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlannedTensor {
    /// Position in the graph.
    pub tensor: TensorRef,
    /// Its name, or `#<id>`.
    pub name: String,
    /// The op's display name (`"NONE"` for leafs).
    pub op: String,
    /// Whether it is a view.
    pub is_view: bool,
    /// Where it runs and why.
    pub assignment: Assignment,
}

/// A readable snapshot of the scheduler's plan for one graph.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SchedPlan {
    /// The backends' names, by index.
    pub backend_names: Vec<String>,
    /// Pipeline slots per copied tensor.
    pub n_copies: usize,
    /// One entry per node, in graph order.
    pub nodes: Vec<PlannedTensor>,
    /// One entry per leaf, then per operand outside the graph.
    pub leafs: Vec<PlannedTensor>,
    /// The splits, in execution order.
    pub splits: Vec<SplitPlan>,
    /// The copies between backends.
    pub copies: Vec<CopyPlan>,
    /// The graph inputs (INPUT-flagged operands), in first-use order.
    pub graph_inputs: Vec<TensorRef>,
    /// Compute memory per backend in bytes (0 for a backend sharing an earlier backend's
    /// buffer type), pipeline slots included.
    pub buffer_sizes: Vec<usize>,
}

impl SchedPlan {
    /// The entry of a node, leaf or outside operand.
    pub fn entry(&self, tensor: TensorRef) -> Option<&PlannedTensor> {
        match tensor {
            TensorRef::Node(i) => self.nodes.get(i),
            TensorRef::Leaf(_) | TensorRef::Outside(_) => {
                self.leafs.iter().find(|t| t.tensor == tensor)
            }
        }
    }

    fn backend_name(&self, backend: usize) -> &str {
        self.backend_names
            .get(backend)
            .map_or("?", std::string::String::as_str)
    }

    /// A GraphViz description: one cluster per split, nodes filled with their backend's
    /// colour, leafs as boxes, dashed red edges for reads through a copy.
    pub fn to_dot(&self, graph: &crate::graph::Graph) -> String {
        const COLOURS: [&str; 8] = [
            "palegreen",
            "lightblue",
            "gold",
            "pink",
            "lightsalmon",
            "plum",
            "khaki",
            "lightcyan",
        ];
        let colour = |b: usize| COLOURS[b % COLOURS.len()];
        let id_of = |r: TensorRef| match r {
            TensorRef::Node(i) => format!("n{i}"),
            TensorRef::Leaf(i) => format!("l{i}"),
            TensorRef::Outside(i) => format!("o{i}"),
        };
        let mut out = String::from(
            "digraph sched {\n  rankdir=TB;\n  node [fontname=\"monospace\", fontsize=10];\n",
        );
        for (b, name) in self.backend_names.iter().enumerate() {
            let _ = writeln!(
                out,
                "  legend{b} [shape=note, style=filled, fillcolor={}, label=\"backend {b}: {name}\"];",
                colour(b)
            );
        }
        for leaf in &self.leafs {
            let _ = writeln!(
                out,
                "  {} [shape=box, style=filled, fillcolor={}, label=\"{}\\n{}\"];",
                id_of(leaf.tensor),
                colour(leaf.assignment.backend),
                leaf.name,
                leaf.assignment.cause.tag()
            );
        }
        for (s, split) in self.splits.iter().enumerate() {
            let _ = writeln!(
                out,
                "  subgraph cluster_split{s} {{\n    label=\"split {s}: {}\";\n    style=rounded;",
                self.backend_name(split.backend)
            );
            for i in split.nodes.clone() {
                if let Some(node) = self.nodes.get(i) {
                    let _ = writeln!(
                        out,
                        "    n{i} [style=\"filled{}\", fillcolor={}, label=\"{}\\n{} ({})\"];",
                        if node.is_view { ",dashed" } else { "" },
                        colour(node.assignment.backend),
                        node.name,
                        node.op,
                        node.assignment.cause.tag()
                    );
                }
            }
            out.push_str("  }\n");
        }
        // Edges: a read through a copy is drawn red and dashed, labelled with the copy.
        for (i, node) in graph.nodes().iter().enumerate() {
            for (j, src) in node.srcs().iter().enumerate() {
                let from = match graph.position(src) {
                    Some(crate::graph::Position::Node(k)) => TensorRef::Node(k),
                    Some(crate::graph::Position::Leaf(k)) => TensorRef::Leaf(k),
                    None => continue,
                };
                let src_backend = self.entry(from).map(|e| e.assignment.backend);
                let dst_backend = self.nodes.get(i).map(|e| e.assignment.backend);
                let copy = self.copies.iter().position(|c| {
                    c.source == from && Some(c.to_backend) == dst_backend && src_backend.is_some()
                });
                match copy {
                    Some(c) => {
                        let _ = writeln!(
                            out,
                            "  {} -> n{i} [color=red, style=dashed, label=\"{j} (copy {c})\"];",
                            id_of(from)
                        );
                    }
                    None => {
                        let _ = writeln!(out, "  {} -> n{i} [label=\"{j}\"];", id_of(from));
                    }
                }
            }
        }
        out.push_str("}\n");
        out
    }
}

impl fmt::Display for SchedPlan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "SchedPlan: {} splits, {} copies, n_copies={}, {} nodes, {} leafs",
            self.splits.len(),
            self.copies.len(),
            self.n_copies,
            self.nodes.len(),
            self.leafs.len()
        )?;
        for (b, name) in self.backend_names.iter().enumerate() {
            writeln!(
                f,
                "  backend {b}: {name}, compute buffer {} bytes",
                self.buffer_sizes.get(b).copied().unwrap_or(0)
            )?;
        }
        for (s, split) in self.splits.iter().enumerate() {
            write!(
                f,
                "  split {s}: {} nodes {}..{}",
                self.backend_name(split.backend),
                split.nodes.start,
                split.nodes.end
            )?;
            if !split.inputs.is_empty() {
                let inputs: Vec<String> = split
                    .inputs
                    .iter()
                    .filter_map(|&c| self.copies.get(c))
                    .map(|c| {
                        let name = self
                            .entry(c.source)
                            .map_or_else(|| format!("{:?}", c.source), |e| e.name.clone());
                        format!(
                            "{name} ({} -> {}, {} B{})",
                            self.backend_name(c.from_backend),
                            self.backend_name(c.to_backend),
                            c.nbytes,
                            if c.user_input { ", input" } else { "" }
                        )
                    })
                    .collect();
                write!(f, ", inputs: {}", inputs.join(", "))?;
            }
            writeln!(f)?;
            for i in split.nodes.clone() {
                if let Some(node) = self.nodes.get(i) {
                    writeln!(
                        f,
                        "    node {i:>4}: {:<16} {:<20} [{}] ({})",
                        node.op,
                        node.name,
                        self.backend_name(node.assignment.backend),
                        node.assignment.cause.tag()
                    )?;
                }
            }
        }
        for leaf in &self.leafs {
            writeln!(
                f,
                "  leaf {:?}: {:<20} [{}] ({})",
                leaf.tensor,
                leaf.name,
                self.backend_name(leaf.assignment.backend),
                leaf.assignment.cause.tag()
            )?;
        }
        Ok(())
    }
}
