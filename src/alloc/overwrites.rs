//! Which tensors of an allocated graph lose their bytes to a later node: for every tensor, the
//! first later tensor (in graph order: leafs, then nodes) whose binding overlaps its own.
//!
//! The graph allocator reuses an intermediate's memory once its consumers are done, so after
//! a compute that intermediate's bytes hold the later node's value. Recording the overwriting
//! node on the tensor ([`Tensor::check_current`]) lets a read notice; the cost is paid once
//! per allocation, not per compute.

use std::collections::{BTreeMap, HashMap};

use crate::graph::Graph;
use crate::tensor::Tensor;

/// Records, on every leaf and node of `graph` bound to memory, the first later tensor of the
/// graph whose bytes overlap its own (replacing what was recorded before).
///
/// A sweep in graph order over the bound byte ranges of each buffer, keeping the current
/// occupant of every byte as disjoint intervals: a tensor placed over occupied bytes is the
/// overwriter of their occupants. O(n log n) for n tensors, whatever the overlaps.
pub fn record_overwrites(graph: &Graph) {
    record_in_order(graph.leafs().iter().chain(graph.nodes()).collect());
}

/// [`record_overwrites`] for a graph some of whose tensors stand in for others bound to the
/// same bytes (the scheduler's shadows, `(original, stand_in)` pairs): each stand-in counts
/// as its original, so what is recorded is about the caller's tensors, and the copies the
/// scheduler placed between them count as the later tensors they are.
pub fn record_overwrites_as(graph: &Graph, stand_ins: &[(Tensor, Tensor)]) {
    let original: HashMap<u64, &Tensor> = stand_ins.iter().map(|(o, s)| (s.id(), o)).collect();
    let tensors = graph
        .leafs()
        .iter()
        .chain(graph.nodes())
        .map(|t| original.get(&t.id()).copied().unwrap_or(t))
        .collect();
    record_in_order(tensors);
}

/// The sweep over `tensors`, given in the order their values are produced.
fn record_in_order(tensors: Vec<&Tensor>) {
    // Current occupants per buffer: start -> (end, tensor index).
    let mut occupants: HashMap<u64, BTreeMap<usize, (usize, usize)>> = HashMap::new();
    let mut has_overwriter = vec![false; tensors.len()];
    for t in &tensors {
        t.clear_overwritten_by();
    }
    for (index, tensor) in tensors.iter().enumerate() {
        let Some((buffer, start, len)) = tensor.bound_span() else {
            continue;
        };
        if len == 0 {
            continue;
        }
        let end = start.saturating_add(len);
        let map = occupants.entry(buffer).or_default();
        // Occupants overlapping [start, end): disjoint intervals sorted by start, so walk back
        // from the last one starting before `end` until one ends at or before `start`.
        let overlapping: Vec<(usize, usize, usize)> = map
            .range(..end)
            .rev()
            .take_while(|(_, &(e, _))| e > start)
            .map(|(&s, &(e, i))| (s, e, i))
            .collect();
        for (s, e, occupant) in overlapping {
            map.remove(&s);
            if occupant != index && !has_overwriter[occupant] {
                tensors[occupant].set_overwritten_by(tensor);
                has_overwriter[occupant] = true;
            }
            if s < start {
                map.insert(s, (start, occupant));
            }
            if e > end {
                map.insert(end, (e, occupant));
            }
        }
        map.insert(start, (end, index));
    }
}
