//! An independent checker for [`MemoryPlan`]s: recomputes lifetimes from the graph and
//! verifies that no two tensors alive at the same time share bytes.

use std::collections::HashMap;

use crate::alloc::plan::{MemoryPlan, TensorPlan};
use crate::error::{Error, Result};
use crate::graph::Graph;
use crate::tensor::Tensor;

/// Node index standing for "to the end of the graph".
const END: usize = usize::MAX;

/// (buffer id, chunk) of a placement.
type ChunkKey = (usize, usize);
/// (first, last) node index of a tensor's life.
type Lifetime = (usize, usize);

/// Lifetimes `(first, last)` in node indices, computed from the graph alone:
///
/// * leafs and inputs are defined before the first node (index 0); a node at its index; an
///   operand outside the graph at its first consumer;
/// * a tensor lives until its last consumer; a view extends its source's life to the view's
///   own index and to the view's last consumer;
/// * outputs (and sources of output views) live to the end.
pub fn lifetimes(graph: &Graph) -> HashMap<u64, (usize, usize)> {
    let mut life: HashMap<u64, (usize, usize)> = HashMap::new();
    fn define(life: &mut HashMap<u64, (usize, usize)>, t: &Tensor, at: usize) {
        let at = if t.is_input() { 0 } else { at };
        let entry = life.entry(t.id()).or_insert((at, at));
        entry.0 = entry.0.min(at);
        if t.is_output() {
            entry.1 = END;
        }
    }
    fn use_at(life: &mut HashMap<u64, (usize, usize)>, t: &Tensor, at: usize) {
        define(life, t, at);
        if let Some(e) = life.get_mut(&t.id()) {
            e.1 = e.1.max(at);
        }
        if let Some(root) = t.view_src() {
            define(life, root, at);
            let end = if t.is_output() { END } else { at };
            if let Some(e) = life.get_mut(&root.id()) {
                e.1 = e.1.max(end);
            }
        }
    }
    for leaf in graph.leafs() {
        use_at(&mut life, leaf, 0);
    }
    for (i, node) in graph.nodes().iter().enumerate() {
        use_at(&mut life, node, i);
        for src in node.srcs() {
            use_at(&mut life, src, i);
        }
    }
    life
}

fn describe(t: &TensorPlan) -> String {
    if t.name.is_empty() {
        format!("#{}", t.id)
    } else {
        format!("#{} '{}'", t.id, t.name)
    }
}

/// Checks `plan` against `graph`:
///
/// * every placed tensor belongs to the graph, lies inside an existing chunk of a buffer id
///   that is not shared, and has an offset aligned to that buffer's alignment;
/// * two tensors whose byte ranges overlap in the same buffer and chunk are never alive at
///   the same time ([`lifetimes`]), unless one is the in-place successor of the other;
/// * every non-view tensor of the graph is either placed or already has memory.
pub fn check_plan(graph: &Graph, plan: &MemoryPlan) -> Result<()> {
    let life = lifetimes(graph);
    let fail = |m: String| Err(Error::alloc(format!("plan check failed: {m}")));
    let mut by_chunk: HashMap<ChunkKey, Vec<(&TensorPlan, Lifetime)>> = HashMap::new();
    for t in &plan.tensors {
        let Some(&lifetime) = life.get(&t.id) else {
            return fail(format!(
                "{} is placed but not part of the graph",
                describe(t)
            ));
        };
        let Some(buffer) = plan.buffers.get(t.buffer_id) else {
            return fail(format!(
                "{} is in buffer {}, which does not exist",
                describe(t),
                t.buffer_id
            ));
        };
        if buffer.shared_with.is_some() {
            return fail(format!(
                "{} is recorded under shared buffer id {}",
                describe(t),
                t.buffer_id
            ));
        }
        if t.size > 0 {
            let Some(&chunk_size) = buffer.chunk_sizes.get(t.chunk) else {
                return fail(format!(
                    "{} is in chunk {}, which does not exist",
                    describe(t),
                    t.chunk
                ));
            };
            if t.offset
                .checked_add(t.size)
                .is_none_or(|end| end > chunk_size)
            {
                return fail(format!(
                    "{} at offset {} with {} bytes exceeds chunk {} of {} bytes",
                    describe(t),
                    t.offset,
                    t.size,
                    t.chunk,
                    chunk_size
                ));
            }
            if t.offset % buffer.alignment.max(1) != 0 {
                return fail(format!(
                    "{} at offset {} is not aligned to {}",
                    describe(t),
                    t.offset,
                    buffer.alignment
                ));
            }
            by_chunk
                .entry((t.buffer_id, t.chunk))
                .or_default()
                .push((t, lifetime));
        }
    }
    for list in by_chunk.values_mut() {
        list.sort_by_key(|(t, _)| t.offset);
        for (i, (a, la)) in list.iter().enumerate() {
            let a_end = a.offset + a.size;
            for (b, lb) in list[i + 1..].iter().take_while(|(b, _)| b.offset < a_end) {
                let live_together = la.0 <= lb.1 && lb.0 <= la.1;
                let inplace = a.inplace_parent == Some(b.id) || b.inplace_parent == Some(a.id);
                if live_together && !inplace {
                    return fail(format!(
                        "{} [{}, {}) alive at nodes {}..={} overlaps {} [{}, {}) alive at \
                         nodes {}..={} in buffer {} chunk {}",
                        describe(a),
                        a.offset,
                        a_end,
                        la.0,
                        la.1,
                        describe(b),
                        b.offset,
                        b.offset + b.size,
                        lb.0,
                        lb.1,
                        a.buffer_id,
                        a.chunk
                    ));
                }
            }
        }
    }
    let placed: std::collections::HashSet<u64> = plan.tensors.iter().map(|t| t.id).collect();
    let all = graph
        .leafs()
        .iter()
        .chain(graph.nodes())
        .chain(graph.nodes().iter().flat_map(|n| n.srcs()));
    for t in all {
        if !t.is_view() && !placed.contains(&t.id()) && !t.is_allocated() {
            return fail(format!("{} has neither a placement nor memory", t.label()));
        }
    }
    Ok(())
}
