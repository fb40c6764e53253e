//! Which tensors of an allocated graph lose their bytes to a later node: for every tensor, the
//! first later tensor (in graph order: leafs, then nodes) whose binding overlaps its own.
//!
//! The graph allocator reuses an intermediate's memory once its consumers are done, so after
//! a compute that intermediate's bytes hold the later node's value. Recording the overwriting
//! node on the tensor ([`Tensor::check_current`]) lets a read notice; the cost is paid once
//! per allocation, not per compute.
//!
//! # Replays
//!
//! A graph allocated again with the same plan (a decode loop replaying one graph per step)
//! would get the same records, so an allocator keeps a [`SweepMemo`] and skips the sweep when
//! nothing it depends on can have changed. What a sweep records depends only on the graph's
//! tensors (fixed by the graph's epoch) and on their bound byte ranges; the records themselves
//! are changed only by sweeps and by binding a tensor to a new place. Both bump one process
//! wide counter, the *layout epoch* ([`note_layout_changed`]); a memo is valid while the graph
//! is the one it swept and the counter still reads what it read right after that sweep.
//! Binding a tensor again to the place it already has (a replayed plan) changes neither its
//! byte range nor its record, so it does not bump the counter. Any other sweep in between (of
//! another graph sharing a tensor or the memory) or any tensor moved anywhere invalidates
//! every memo: coarse, but never wrong.
//!
//! A rebuilt graph of the same plan (new tensors, same places) has another epoch, but the
//! sweep's result — which position overwrites which — is a function of the bound byte ranges
//! in order and nothing else. The memo keeps the ranges and that result of its last sweep; when
//! the ranges read now are the same, the result is applied to the new tensors without the
//! sweep (one lock per tensor to read its range, instead of ordered-map work).

use std::collections::{BTreeMap, HashMap};

use crate::graph::Graph;
use crate::tensor::Tensor;
use crate::tensor::{layout_epoch, note_layout_changed};

/// A tensor's own bound byte range: `(buffer id, offset, nbytes)`; `None` for views and
/// unbound tensors.
type Span = Option<(u64, usize, usize)>;

/// What an allocator's last sweep covered, to skip or replay an identical one (module
/// documentation, "Replays").
#[derive(Debug, Default, Clone)]
pub(crate) struct SweepMemo {
    /// `(graph epoch, layout epoch right after the sweep)`; `None` before any.
    last: Option<(u64, u64)>,
    /// The byte ranges the last sweep saw, in sweep order.
    spans: Vec<Span>,
    /// Its result: `(position, position of the first later tensor over its bytes)`, ascending
    /// by position, at most one per position.
    overwrites: Vec<(usize, usize)>,
}

/// How [`SweepMemo::record`] got the records right.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Recorded {
    /// The same graph, nothing moved since its last sweep: the records stand.
    Kept,
    /// The same byte ranges as the last sweep: its result applied to these tensors.
    Replayed,
    /// A full sweep.
    Swept,
}

impl SweepMemo {
    /// Records the overwrites of `graph` exactly as [`record_overwrites_as`] does, reusing
    /// this memo's last sweep when it is the same graph with nothing moved since, or the same
    /// byte ranges (module documentation, "Replays"). `stand_ins` must be tied to the graph:
    /// the same graph epoch always comes with the same stand-ins.
    pub(crate) fn record(&mut self, graph: &Graph, stand_ins: &[(Tensor, Tensor)]) -> Recorded {
        let epoch = graph.epoch();
        let before = layout_epoch();
        if epoch != 0 && self.last == Some((epoch, before)) {
            return Recorded::Kept;
        }
        let originals: HashMap<u64, &Tensor>;
        let tensors: Vec<&Tensor> = if stand_ins.is_empty() {
            graph.leafs().iter().chain(graph.nodes()).collect()
        } else {
            originals = stand_ins.iter().map(|(o, s)| (s.id(), o)).collect();
            graph
                .leafs()
                .iter()
                .chain(graph.nodes())
                .map(|t| originals.get(&t.id()).copied().unwrap_or(t))
                .collect()
        };
        let same_spans = self.spans.len() == tensors.len()
            && tensors
                .iter()
                .zip(&self.spans)
                .all(|(t, span)| t.bound_span() == *span);
        let how = if same_spans {
            // Each tensor's record replaced under one lock: the replayed overwriter, if any
            // (positions ascend in `overwrites`, one entry per occupant), else none.
            let mut next = self.overwrites.iter().peekable();
            for (at, t) in tensors.iter().enumerate() {
                let later = next.next_if(|&&(occupant, _)| occupant == at);
                t.replace_overwritten_by(later.map(|&(_, l)| tensors[l]));
            }
            Recorded::Replayed
        } else {
            self.spans.clear();
            self.spans.extend(tensors.iter().map(|t| t.bound_span()));
            self.overwrites = sweep(&tensors, &self.spans);
            Recorded::Swept
        };
        note_layout_changed();
        // One bump is ours; any other meanwhile (another thread's binding or sweep) leaves the
        // epoch memo empty rather than trusting a mixed state. The ranges stay valid keys.
        let after = layout_epoch();
        self.last = (after == before + 1 && epoch != 0).then_some((epoch, after));
        how
    }
}

/// Records, on every leaf and node of `graph` bound to memory, the first later tensor of the
/// graph whose bytes overlap its own (replacing what was recorded before).
///
/// A sweep in graph order over the bound byte ranges of each buffer, keeping the current
/// occupant of every byte as disjoint intervals: a tensor placed over occupied bytes is the
/// overwriter of their occupants. O(n log n) for n tensors, whatever the overlaps.
pub fn record_overwrites(graph: &Graph) {
    record_overwrites_as(graph, &[]);
}

/// [`record_overwrites`] for a graph some of whose tensors stand in for others bound to the
/// same bytes (the scheduler's shadows, `(original, stand_in)` pairs): each stand-in counts
/// as its original, so what is recorded is about the caller's tensors, and the copies the
/// scheduler placed between them count as the later tensors they are.
pub fn record_overwrites_as(graph: &Graph, stand_ins: &[(Tensor, Tensor)]) {
    SweepMemo::default().record(graph, stand_ins);
}

/// The occupants of one buffer's bytes: start -> (end, tensor position), disjoint intervals.
type Occupants = BTreeMap<usize, (usize, usize)>;

/// The sweep over `tensors` (given in the order their values are produced, with their bound
/// ranges `spans`): clears every record, sets the new ones and returns them as positions,
/// ascending by occupant.
fn sweep(tensors: &[&Tensor], spans: &[Span]) -> Vec<(usize, usize)> {
    // Current occupants per buffer (a graph touches few).
    let mut occupants: Vec<(u64, Occupants)> = Vec::new();
    let mut has_overwriter = vec![false; tensors.len()];
    let mut overwrites = Vec::new();
    let mut overlapping: Vec<(usize, usize, usize)> = Vec::new();
    for t in tensors {
        t.clear_overwritten_by();
    }
    for (index, (tensor, span)) in tensors.iter().zip(spans).enumerate() {
        let Some((buffer, start, len)) = *span else {
            continue;
        };
        if len == 0 {
            continue;
        }
        let end = start.saturating_add(len);
        let k = match occupants.iter().position(|(id, _)| *id == buffer) {
            Some(k) => k,
            None => {
                occupants.push((buffer, BTreeMap::new()));
                occupants.len() - 1
            }
        };
        let map = &mut occupants[k].1;
        // Occupants overlapping [start, end): disjoint intervals sorted by start, so walk back
        // from the last one starting before `end` until one ends at or before `start`.
        overlapping.clear();
        overlapping.extend(
            map.range(..end)
                .rev()
                .take_while(|(_, &(e, _))| e > start)
                .map(|(&s, &(e, i))| (s, e, i)),
        );
        for &(s, e, occupant) in &overlapping {
            map.remove(&s);
            if occupant != index && !has_overwriter[occupant] {
                tensors[occupant].set_overwritten_by(tensor);
                has_overwriter[occupant] = true;
                overwrites.push((occupant, index));
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
    // By occupant (each at most once), the order a replay applies them in.
    overwrites.sort_unstable();
    overwrites
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::alloc::GraphAllocator;
    use crate::buffer::CpuBufferType;
    use crate::context::Context;
    use crate::dtype::DType;
    use crate::ops::{self, UnaryOp};

    /// x -> m = 3x -> neg (in place over m) -> relu, allocated; returns the graph and `m`.
    fn chain(galloc: &mut GraphAllocator) -> (Graph, Tensor, Context) {
        let ctx = Context::new(true);
        let x = ctx.new_tensor(DType::F32, &[4]).unwrap();
        x.set_input();
        let m = ops::scale(&ctx, &x, 3.0, 0.0).unwrap();
        let z = ops::unary(
            &ctx,
            &ops::unary(&ctx, &m, UnaryOp::Neg).unwrap(),
            UnaryOp::Relu,
        );
        let z = z.unwrap();
        z.set_output();
        let graph = Graph::build(std::slice::from_ref(&z));
        galloc.alloc_graph(&graph).unwrap();
        (graph, m, ctx)
    }

    fn overwriter(t: &Tensor) -> Option<u64> {
        t.overwritten_by().map(|later| later.id())
    }

    /// The same graph is kept or replayed, a rebuilt graph with the same places replayed, and
    /// either way the records are a full sweep's.
    #[test]
    fn replays_record_what_a_sweep_records() {
        let mut galloc = GraphAllocator::new(CpuBufferType::shared());
        let (graph, m, _ctx) = chain(&mut galloc);
        let mut memo = SweepMemo::default();
        assert_eq!(memo.record(&graph, &[]), Recorded::Swept);
        let expected = overwriter(&m);
        assert!(expected.is_some(), "m is overwritten in place");
        // Another thread's binding may turn Kept into Replayed; never a sweep.
        assert_ne!(memo.record(&graph, &[]), Recorded::Swept);
        assert_eq!(overwriter(&m), expected);

        let (rebuilt, m2, _ctx2) = chain(&mut galloc);
        assert_eq!(memo.record(&rebuilt, &[]), Recorded::Replayed);
        let fresh = overwriter(&m2);
        record_overwrites(&rebuilt);
        assert_eq!(overwriter(&m2), fresh);
        assert!(fresh.is_some() && fresh != expected);
    }

    /// A graph bound in one batch moves the layout epoch by the time the batch ends (before
    /// the records are read), and binding a recorded tensor to a new place forgets its
    /// overwriter whether or not the binding is batched.
    #[test]
    fn batched_bindings_change_the_epoch_and_forget_records() {
        use crate::tensor::{layout_epoch, BindBatch};
        let mut galloc = GraphAllocator::new(CpuBufferType::shared());
        let (graph, m, _ctx) = chain(&mut galloc);
        let mut memo = SweepMemo::default();
        memo.record(&graph, &[]);
        assert!(overwriter(&m).is_some());
        let buffer = CpuBufferType::shared().alloc_buffer(1024).unwrap();
        let before = layout_epoch();
        {
            let batch = BindBatch::new();
            m.bind_in(&buffer, 512, &batch).unwrap();
            assert!(layout_epoch() > before, "the first move bumps at once");
            assert_eq!(overwriter(&m), None, "a moved tensor has no record");
            let mid = layout_epoch();
            drop(batch);
            assert!(
                layout_epoch() > mid,
                "the end of a batch that moved bumps again"
            );
        }
        // A recorded tensor (now bound outside the allocator's memory, so it keeps that
        // place) forgets its record on a plain binding elsewhere too.
        let later = graph.nodes().last().unwrap().clone();
        m.set_overwritten_by(&later);
        assert_eq!(overwriter(&m), Some(later.id()));
        m.bind(&buffer, 256).unwrap();
        assert_eq!(overwriter(&m), None);
    }
}
