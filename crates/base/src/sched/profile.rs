//! A per-op profile of one scheduler run ([`Scheduler::graph_compute_profiled`]): wall time of
//! every node, totals per op type, and a readable table, so users can see where time goes
//! without an external profiler.
//!
//! # What is timed
//!
//! A split on a backend that times nodes inside its own run ([`Backend::graph_compute_timed`]:
//! the CPU backend) is computed exactly as in a normal run, the clock read around each node,
//! so node times include what the run really spends on them (a fused run of mat-vecs is timed
//! whole and shared among its products by weight bytes) and the time between nodes is the
//! run's own bookkeeping. On other backends, or with an eval callback, every node of the split
//! is computed as its own one-node graph and waited for before the clock is read, so each
//! node's time is well defined (nodes never overlap) but each costs one dispatch and one wait:
//! such a run is slower than a normal one, most visibly on graphs of many tiny nodes. Copies
//! of split inputs between backends are not node time; they are part of
//! [`Profile::total_seconds`] (the wall time of the whole call), so the node times always sum
//! to at most the total. A normal run takes none of this path: it checks one branch per
//! split.
//!
//! [`Backend::graph_compute_timed`]: crate::backend::Backend::graph_compute_timed

use std::collections::HashMap;
use std::fmt;
use std::time::Instant;

use crate::error::{Result, Status};
use crate::graph::Graph;

use super::Scheduler;

/// The time of one node of a profiled run.
#[derive(Debug, Clone, PartialEq)]
pub struct NodeTime {
    /// Position of the node in the caller's graph.
    pub index: usize,
    /// The node's name ("" when none was set).
    pub name: String,
    /// The op's display name (e.g. `MUL_MAT`, `UNARY(GELU)`).
    pub op: String,
    /// The node's numpy-order shape.
    pub shape: Vec<usize>,
    /// Name of the backend that computed it.
    pub backend: String,
    /// Wall time of the node, in seconds.
    pub seconds: f64,
}

/// Totals of one op type.
#[derive(Debug, Clone, PartialEq)]
pub struct OpTotal {
    /// The op's display name.
    pub op: String,
    /// How many nodes ran it.
    pub count: usize,
    /// Their summed wall time, in seconds.
    pub seconds: f64,
}

/// Timings of one profiled run (see the module documentation for what is timed).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Profile {
    /// One entry per computed node, in execution order.
    pub nodes: Vec<NodeTime>,
    /// Wall time of the whole call (allocation, input copies and all nodes), in seconds.
    pub total_seconds: f64,
}

impl Profile {
    /// Summed node time, in seconds (at most [`Profile::total_seconds`]).
    pub fn node_seconds(&self) -> f64 {
        self.nodes.iter().map(|n| n.seconds).sum()
    }

    /// Per op type totals, slowest first (ties by name, so the order is stable).
    pub fn by_op(&self) -> Vec<OpTotal> {
        let mut totals: HashMap<&str, OpTotal> = HashMap::new();
        for node in &self.nodes {
            let entry = totals.entry(&node.op).or_insert_with(|| OpTotal {
                op: node.op.clone(),
                count: 0,
                seconds: 0.0,
            });
            entry.count += 1;
            entry.seconds += node.seconds;
        }
        let mut totals: Vec<OpTotal> = totals.into_values().collect();
        totals.sort_by(|a, b| b.seconds.total_cmp(&a.seconds).then(a.op.cmp(&b.op)));
        totals
    }

    /// The `n` slowest nodes, slowest first (ties by position).
    pub fn top(&self, n: usize) -> Vec<&NodeTime> {
        let mut nodes: Vec<&NodeTime> = self.nodes.iter().collect();
        nodes.sort_by(|a, b| b.seconds.total_cmp(&a.seconds).then(a.index.cmp(&b.index)));
        nodes.truncate(n);
        nodes
    }

    /// Adds another run's timings (node positions are kept; totals add up), so repeated runs
    /// of one model (e.g. one per batch) read as one profile.
    pub fn merge(&mut self, other: &Profile) {
        self.nodes.extend(other.nodes.iter().cloned());
        self.total_seconds += other.total_seconds;
    }

    /// The table [`fmt::Display`] prints, with the `top` slowest nodes.
    pub fn table(&self, top: usize) -> String {
        let total = self.total_seconds;
        let share = |s: f64| if total > 0.0 { 100.0 * s / total } else { 0.0 };
        let mut out = format!(
            "profile: {} nodes, {:.3} ms total, {:.3} ms in nodes ({:.1}%)\n",
            self.nodes.len(),
            total * 1e3,
            self.node_seconds() * 1e3,
            share(self.node_seconds())
        );
        out.push_str(&format!(
            "{:<24} {:>6} {:>12} {:>7}\n",
            "op", "count", "ms", "%"
        ));
        for t in self.by_op() {
            out.push_str(&format!(
                "{:<24} {:>6} {:>12.3} {:>6.1}%\n",
                t.op,
                t.count,
                t.seconds * 1e3,
                share(t.seconds)
            ));
        }
        let slowest = self.top(top);
        if !slowest.is_empty() {
            out.push_str(&format!("top {} nodes:\n", slowest.len()));
            out.push_str(&format!(
                "{:>5} {:<20} {:<16} {:<18} {:<6} {:>10}\n",
                "node", "name", "op", "shape", "backend", "ms"
            ));
            for n in slowest {
                let shape = match n.shape.as_slice() {
                    [one] => format!("({one},)"),
                    dims => format!(
                        "({})",
                        dims.iter()
                            .map(usize::to_string)
                            .collect::<Vec<_>>()
                            .join(", ")
                    ),
                };
                out.push_str(&format!(
                    "{:>5} {:<20} {:<16} {:<18} {:<6} {:>10.3}\n",
                    n.index,
                    if n.name.is_empty() { "-" } else { &n.name },
                    n.op,
                    shape,
                    n.backend,
                    n.seconds * 1e3
                ));
            }
        }
        out
    }
}

impl fmt::Display for Profile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.table(10))
    }
}

/// A node's time as the run records it: names and shapes are looked up after the clock stops,
/// so building the profile costs the run nothing.
pub(super) struct Timed {
    /// Position of the node in the caller's graph.
    pub index: usize,
    /// Index of the backend that computed it, in the scheduler's list.
    pub backend: usize,
    /// Wall time of the node, in seconds.
    pub seconds: f64,
}

impl Scheduler {
    /// Computes `graph` like [`Scheduler::graph_compute`] and returns, with the status, the
    /// wall time of every node (see the module documentation for how nodes are timed).
    pub fn graph_compute_profiled(&mut self, graph: &Graph) -> Result<(Status, Profile)> {
        let start = Instant::now();
        let mut timed = Vec::with_capacity(graph.n_nodes());
        let status = self.compute_with(graph, Some(&mut timed))?;
        self.synchronize()?;
        let total_seconds = start.elapsed().as_secs_f64();
        let nodes = graph.nodes();
        let nodes = timed
            .into_iter()
            .filter_map(|t| {
                let node = nodes.get(t.index)?;
                Some(NodeTime {
                    index: t.index,
                    name: node.name(),
                    op: node.op().display_name(),
                    shape: node.shape(),
                    backend: self.backends.get(t.backend)?.name().to_owned(),
                    seconds: t.seconds,
                })
            })
            .collect();
        Ok((
            status,
            Profile {
                nodes,
                total_seconds,
            },
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(index: usize, op: &str, seconds: f64) -> NodeTime {
        NodeTime {
            index,
            name: format!("n{index}"),
            op: op.into(),
            shape: vec![2, 3],
            backend: "CPU".into(),
            seconds,
        }
    }

    #[test]
    fn totals_and_top_are_ordered() {
        let p = Profile {
            nodes: vec![
                node(0, "ADD", 1.0),
                node(1, "MUL_MAT", 3.0),
                node(2, "ADD", 0.5),
            ],
            total_seconds: 5.0,
        };
        let ops = p.by_op();
        assert_eq!(ops[0].op, "MUL_MAT");
        assert_eq!((ops[1].op.as_str(), ops[1].count), ("ADD", 2));
        assert!((ops[1].seconds - 1.5).abs() < 1e-12);
        let top: Vec<usize> = p.top(2).iter().map(|n| n.index).collect();
        assert_eq!(top, vec![1, 0]);
        let text = p.to_string();
        assert!(text.contains("MUL_MAT") && text.contains("n1") && text.contains("3 nodes"));
    }
}
