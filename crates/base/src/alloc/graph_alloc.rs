//! The graph allocator (ggml's `gallocr`): plans the offsets of a graph's tensors from their
//! lifetimes once, then replays the plan on every graph of the same shape.
//!
//! # Planning ([`GraphAllocator::reserve_n`])
//!
//! * Tensors that already have memory (a live storage binding to a buffer that is not one of
//!   this allocator's) are *external* and left alone; views take no memory (their storage
//!   resolves through their source).
//! * Leafs, then graph inputs ([`Tensor::is_input`]: input nodes and input operands), are
//!   placed first, before any node, so they never overlap each other.
//! * Nodes are placed in order. For each tensor the planner counts its consumers and the views
//!   of it among the graph's nodes (ggml's `n_children` / `n_views`); after a node is placed,
//!   each operand whose consumers and views are all done returns its memory to the pool (a
//!   finished view releases its source once the source's consumers and views are done).
//!   Outputs ([`Tensor::is_output`]) are never released, nor is the source of an output view. Leafs and inputs are released after
//!   their last consumer like any other tensor (as in ggml); set inputs after `alloc_graph`.
//! * In place: a node whose op [`can_inplace`](crate::ops::Op::can_inplace) takes the memory
//!   of its **first** operand when that operand is placed by this allocator in the same buffer,
//!   has this node as its only consumer and no views, has the node's layout
//!   ([`Tensor::same_layout`]), and is neither an output, a leaf nor an input. When the first
//!   operand is a view at offset 0 of a source that is otherwise finished (no consumers left,
//!   this view its only view, same rules for the source), the node takes the source's memory
//!   and the unused tail of the source's block returns to the pool.
//! * Offsets come from one [`DynAllocator`] per distinct buffer type (ids with the same
//!   `Arc<dyn BufferType>` share memory); each chunk becomes one buffer.
//!
//! # Replay ([`GraphAllocator::alloc_graph`])
//!
//! The plan is stored by position: per leaf and per node its placement, op, input/output flags
//! and the positions of its operands, plus the graph's node and leaf counts. A graph (the same
//! one, or a rebuilt one with new tensors) whose structure matches and whose tensors are no
//! larger than planned is bound with [`Tensor::bind`] without replanning. Otherwise, with one
//! buffer type the graph is re-reserved automatically; with several, `alloc_graph` returns
//! [`Error::Alloc`] asking for [`GraphAllocator::reserve_n`].
//!
//! # Buffers and stale tensors
//!
//! Buffers grow when a plan needs more and never shrink unless [`GraphAllocator::shrink`] or
//! [`GraphAllocator::release`] is called. A buffer that is replaced is freed. **Every
//! `reserve*` and every `alloc_graph` calls [`Buffer::reset`] on the buffers it keeps**: the
//! compute memory is about to be reused, so every tensor bound to it before (the previous
//! graph's tensors, including its outputs) becomes stale and errors out instead of reading
//! reused bytes. Read outputs before allocating the next graph.
//!
//! With several chunks for one buffer id (a buffer type with a maximum size), the allocator
//! keeps one [`Buffer`] per chunk ([`GraphAllocator::buffers`]); there is no multi-buffer
//! wrapper yet.
//!
//! # Poison
//!
//! [`GraphAllocator::set_poison`]: when on, `alloc_graph` fills every compute buffer of this
//! allocator with [`POISON_BYTE`] (0xCD) after the reset and before binding, so a kernel that
//! reads a tensor before it is written (or memory reused too early) sees 0xCDCDCDCD patterns
//! (f32 ≈ −4.3e8) instead of plausible old values. Inputs must be set after `alloc_graph`
//! anyway; with poison on, that is enforced in practice.

use crate::util::IdMap;
use std::sync::Arc;

use crate::alloc::dyn_alloc::{align_up, DynAllocator};
use crate::alloc::overwrites::SweepMemo;
use crate::alloc::plan::{BufferPlan, MemoryPlan, TensorPlan};
use crate::buffer::{same_buffer_type, Buffer, BufferType, BufferUsage};
use crate::error::{Error, Result};
use crate::graph::{Graph, Position};
use crate::ops::Op;
use crate::tensor::{flags, BindBatch, Tensor};

/// The byte [`GraphAllocator::set_poison`] fills compute buffers with.
pub const POISON_BYTE: u8 = 0xCD;

/// Memory chosen for one tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Alloc {
    slot: usize,
    chunk: usize,
    offset: usize,
    size: usize,
}

/// How a tensor gets its memory at replay.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Place {
    /// A view: nothing to do.
    View,
    /// Memory provided by the caller; it must still be bound at replay.
    External,
    /// Bound by the allocator.
    Planned(Alloc),
}

/// An operand of a node, by position in the graph or (outside the graph) by placement.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SrcRef {
    InGraph(Position),
    /// A tensor outside the graph; for a view, also its source's placement.
    Outside {
        place: Place,
        root: Option<Place>,
    },
}

#[derive(Debug, Clone)]
struct NodeEntry {
    op: std::mem::Discriminant<Op>,
    flags: u8,
    place: Place,
    srcs: Vec<SrcRef>,
    /// The node computes in place over its first operand (layout rechecked at replay).
    inplace: bool,
}

#[derive(Debug, Clone)]
struct LeafEntry {
    flags: u8,
    place: Place,
}

/// A plan as stored for replay.
#[derive(Debug, Clone)]
struct StoredPlan {
    leafs: Vec<LeafEntry>,
    nodes: Vec<NodeEntry>,
    memory: MemoryPlan,
    /// The epoch of the graph last found to match this plan (planned from it, or checked).
    matched_epoch: Option<u64>,
}

/// Flags that change a plan.
const PLAN_FLAGS: u8 = flags::INPUT | flags::OUTPUT;

/// One distinct buffer type: its planner and its buffers (one per chunk).
#[derive(Debug)]
struct Slot {
    buft: Arc<dyn BufferType>,
    first_id: usize,
    planner: DynAllocator,
    buffers: Vec<Buffer>,
}

/// Allocates the intermediate tensors of graphs in compute buffers of one or more buffer
/// types, reusing memory of tensors whose lifetime ended (see the module documentation).
#[derive(Debug)]
pub struct GraphAllocator {
    slot_of: Vec<usize>,
    slots: Vec<Slot>,
    stored: Option<StoredPlan>,
    poison: bool,
    /// The last overwrite sweep, skipped when a replay would repeat it.
    sweep: SweepMemo,
}

/// Per-tensor planning state (ggml's hash node).
#[derive(Debug, Clone, Default)]
struct Info {
    n_children: usize,
    n_views: usize,
    /// This view was counted in its source's `n_views`.
    counted_view: bool,
    external: bool,
    /// Currently holds memory from the planner (ggml's "allocated"/"own").
    own: bool,
    alloc: Option<Alloc>,
    record: Option<usize>,
    inplace: bool,
}

/// Planner state for one `plan_graph` call.
struct Planning<'a> {
    slots: &'a [Slot],
    planners: Vec<DynAllocator>,
    info: IdMap<Info>,
    records: Vec<TensorPlan>,
    our_buffers: Vec<u64>,
}

impl Planning<'_> {
    fn info(&mut self, tensor: &Tensor) -> &mut Info {
        let our_buffers = &self.our_buffers;
        self.info.entry(tensor.id()).or_insert_with(|| Info {
            external: !tensor.is_view() && is_external(tensor, our_buffers),
            ..Info::default()
        })
    }

    fn alloc_size(&self, tensor: &Tensor, slot: usize) -> Result<usize> {
        let buft = &self.slots[slot].buft;
        let size = buft.alloc_size(tensor);
        align_up(size, buft.alignment())
            .ok_or_else(|| Error::alloc(format!("{} needs {size} bytes, too many", tensor.label())))
    }

    /// Gives `tensor` memory in `slot` at node `step` unless it is a view, external or
    /// already placed (ggml's `allocate_node`).
    fn allocate(&mut self, tensor: &Tensor, slot: usize, step: usize) -> Result<()> {
        if let Some(root) = tensor.view_src() {
            // A view whose source nothing placed (a source outside the graph): place it.
            let root_info = self.info(root);
            if !root_info.external && root_info.alloc.is_none() {
                let root = root.clone();
                return self.allocate(&root, slot, step);
            }
            return Ok(());
        }
        let info = self.info(tensor);
        if info.external || info.alloc.is_some() {
            return Ok(());
        }
        let size = self.alloc_size(tensor, slot)?;
        if let Some((parent_id, parent_alloc)) = self.inplace_parent(tensor, slot) {
            let parent = self.info.entry(parent_id).or_default();
            parent.own = false;
            if let Some(r) = parent.record {
                self.records[r].last_use = Some(step);
            }
            if parent_alloc.size > size {
                self.planners[slot].free(
                    parent_alloc.chunk,
                    parent_alloc.offset + size,
                    parent_alloc.size - size,
                )?;
            }
            let alloc = Alloc {
                size,
                ..parent_alloc
            };
            self.place(tensor, alloc, step, Some(parent_id));
            return Ok(());
        }
        let (chunk, offset) = self.planners[slot].alloc(size).map_err(|e| match e {
            Error::AllocFailed { message: m, .. } => {
                Error::alloc(format!("{}: {m}", tensor.label()))
            }
            other => other,
        })?;
        let alloc = Alloc {
            slot,
            chunk,
            offset,
            size,
        };
        self.place(tensor, alloc, step, None);
        Ok(())
    }

    fn place(&mut self, tensor: &Tensor, alloc: Alloc, step: usize, parent: Option<u64>) {
        let record = TensorPlan {
            id: tensor.id(),
            name: tensor.name(),
            buffer_id: self.slots[alloc.slot].first_id,
            chunk: alloc.chunk,
            offset: alloc.offset,
            size: alloc.size,
            first_use: step,
            last_use: None,
            inplace_parent: parent,
        };
        self.records.push(record);
        let index = self.records.len() - 1;
        let info = self.info(tensor);
        info.alloc = Some(alloc);
        info.own = true;
        info.record = Some(index);
        info.inplace = parent.is_some();
    }

    /// The tensor (id and memory) whose block `node` may take over, following ggml's rules
    /// (see the module documentation).
    fn inplace_parent(&mut self, node: &Tensor, slot: usize) -> Option<(u64, Alloc)> {
        if !node.op().can_inplace() {
            return None;
        }
        let parent = node.srcs().first()?;
        let reusable = |t: &Tensor| !t.is_output() && !t.is_input() && !matches!(t.op(), Op::None);
        if !reusable(parent) || !node.same_layout(parent) {
            return None;
        }
        let p = self.info.get(&parent.id())?;
        if p.n_children != 1 || p.n_views != 0 {
            return None;
        }
        let (owner, expect_views) = match parent.view_src() {
            Some(root) if parent.view_offset() == 0 && reusable(root) => (root, 1),
            Some(_) => return None,
            None => (parent, 0),
        };
        let o = self.info.get(&owner.id())?;
        let children_left = if owner.same(parent) { 1 } else { 0 };
        let alloc = o.alloc?;
        if o.own && alloc.slot == slot && o.n_views == expect_views && o.n_children == children_left
        {
            Some((owner.id(), alloc))
        } else {
            None
        }
    }

    /// Returns `tensor`'s memory to the pool if this planner placed it and still owns it
    /// (ggml's `free_node`); outputs are kept.
    fn release(&mut self, tensor: &Tensor, step: usize) -> Result<()> {
        if tensor.is_output() {
            return Ok(());
        }
        let info = self.info(tensor);
        if !info.own {
            return Ok(());
        }
        info.own = false;
        let record = info.record;
        if let Some(a) = info.alloc {
            self.planners[a.slot].free(a.chunk, a.offset, a.size)?;
        }
        if let Some(r) = record {
            self.records[r].last_use = Some(step);
        }
        Ok(())
    }

    /// After node `step` ran: one consumer of `src` is done.
    fn consumed(&mut self, src: &Tensor, step: usize) -> Result<()> {
        let info = self.info(src);
        info.n_children = info.n_children.saturating_sub(1);
        if info.n_children != 0 || info.n_views != 0 {
            return Ok(());
        }
        match src.view_src() {
            Some(root) => {
                // An output view keeps its source alive to the end (ggml would release the
                // source here, since only the view carries the output flag).
                if !info.counted_view || src.is_output() {
                    return Ok(());
                }
                info.counted_view = false;
                let root_info = self.info(root);
                root_info.n_views = root_info.n_views.saturating_sub(1);
                if root_info.n_views == 0 && root_info.n_children == 0 {
                    let root = root.clone();
                    self.release(&root, step)?;
                }
                Ok(())
            }
            None => self.release(src, step),
        }
    }

    fn count_view(&mut self, view: &Tensor) {
        let Some(root) = view.view_src() else { return };
        let info = self.info(view);
        if info.counted_view {
            return;
        }
        info.counted_view = true;
        self.info(root).n_views += 1;
    }
}

/// Whether the non-view `tensor` is bound to live memory that is not one of `our_buffers`
/// (the buffer id is read lock-free; only a foreign binding takes the lock to check it is
/// live).
fn is_external(tensor: &Tensor, our_buffers: &[u64]) -> bool {
    match tensor.bound_buffer_id() {
        None => false,
        Some(id) => !our_buffers.contains(&id) && tensor.binding_is_live(),
    }
}

/// Whether `t` sits at `pos` in `graph` (a pointer comparison, no index lookup).
fn at_position(graph: &Graph, pos: Position, t: &Tensor) -> bool {
    match pos {
        Position::Node(i) => graph.nodes().get(i).is_some_and(|n| n.same(t)),
        Position::Leaf(i) => graph.leafs().get(i).is_some_and(|l| l.same(t)),
    }
}

impl GraphAllocator {
    /// An allocator for one buffer type (every tensor goes to buffer id 0).
    pub fn new(buft: Arc<dyn BufferType>) -> GraphAllocator {
        GraphAllocator::new_n(&[buft])
    }

    /// An allocator for several buffer types; buffer id `i` is `bufts[i]`. Ids with the same
    /// buffer type (see [`same_buffer_type`]) share one planner and one set of buffers.
    pub fn new_n(bufts: &[Arc<dyn BufferType>]) -> GraphAllocator {
        let mut slots: Vec<Slot> = Vec::new();
        let mut slot_of = Vec::with_capacity(bufts.len());
        for (id, buft) in bufts.iter().enumerate() {
            let existing = slots.iter().position(|s| same_buffer_type(&s.buft, buft));
            let slot = existing.unwrap_or_else(|| {
                slots.push(Slot {
                    buft: buft.clone(),
                    first_id: id,
                    planner: DynAllocator::new(buft.alignment(), buft.max_size()),
                    buffers: Vec::new(),
                });
                slots.len() - 1
            });
            slot_of.push(slot);
        }
        GraphAllocator {
            slot_of,
            slots,
            stored: None,
            poison: false,
            sweep: SweepMemo::default(),
        }
    }

    /// Number of buffer ids.
    pub fn n_buffers(&self) -> usize {
        self.slot_of.len()
    }

    /// Turns poisoning on or off (see the module documentation): `alloc_graph` then fills the
    /// compute buffers with [`POISON_BYTE`] before binding.
    pub fn set_poison(&mut self, on: bool) {
        self.poison = on;
    }

    /// Whether poisoning is on.
    pub fn poison(&self) -> bool {
        self.poison
    }

    fn our_buffer_ids(&self) -> Vec<u64> {
        self.slots
            .iter()
            .flat_map(|s| s.buffers.iter().map(Buffer::id))
            .collect()
    }

    fn check_ids(&self, ids: &[usize], n: usize, what: &str) -> Result<Vec<usize>> {
        if ids.is_empty() {
            return Ok(vec![0; n]);
        }
        if ids.len() != n {
            return Err(Error::InvalidArgument(format!(
                "{} {what} buffer ids for a graph with {n} {what}s",
                ids.len()
            )));
        }
        match ids.iter().find(|&&id| id >= self.slot_of.len()) {
            Some(bad) => Err(Error::InvalidArgument(format!(
                "{what} buffer id {bad} but the allocator has {} buffer types",
                self.slot_of.len()
            ))),
            None => Ok(ids.iter().map(|&id| self.slot_of[id]).collect()),
        }
    }

    /// Plans `graph` (ggml's `alloc_graph_impl`) without touching buffers or the stored plan.
    fn plan_graph(
        &self,
        graph: &Graph,
        node_ids: &[usize],
        leaf_ids: &[usize],
    ) -> Result<(StoredPlan, Vec<DynAllocator>)> {
        if self.slots.is_empty() {
            return Err(Error::InvalidArgument(
                "the graph allocator has no buffer types".into(),
            ));
        }
        let node_slots = self.check_ids(node_ids, graph.n_nodes(), "node")?;
        let leaf_slots = self.check_ids(leaf_ids, graph.n_leafs(), "leaf")?;
        let mut p = Planning {
            slots: &self.slots,
            planners: self
                .slots
                .iter()
                .map(|s| DynAllocator::new(s.planner.alignment(), s.planner.max_chunk_size()))
                .collect(),
            info: IdMap::with_capacity_and_hasher(
                graph.n_nodes() + graph.n_leafs(),
                Default::default(),
            ),
            records: Vec::with_capacity(graph.n_nodes() + graph.n_leafs()),
            our_buffers: self.our_buffer_ids(),
        };
        // 1. Leafs.
        for (leaf, &slot) in graph.leafs().iter().zip(&leaf_slots) {
            p.allocate(leaf, slot, 0)?;
        }
        // 2. Count views and consumers; place inputs.
        for (node, &slot) in graph.nodes().iter().zip(&node_slots) {
            if node.is_view() {
                p.count_view(node);
            }
            if node.is_input() {
                p.allocate(node, slot, 0)?;
            }
            for src in node.srcs() {
                if src.is_view() && !graph.contains(src) {
                    p.count_view(src);
                }
                p.info(src).n_children += 1;
                if src.is_input() {
                    p.allocate(src, slot, 0)?;
                }
            }
        }
        // 3. Place nodes in order; release operands after their last consumer.
        for (step, (node, &slot)) in graph.nodes().iter().zip(&node_slots).enumerate() {
            for src in node.srcs() {
                p.allocate(src, slot, step)?;
            }
            p.allocate(node, slot, step)?;
            for src in node.srcs() {
                p.consumed(src, step)?;
            }
        }
        // The stored plan.
        let place_of = |p: &Planning<'_>, t: &Tensor| -> Result<Place> {
            if t.is_view() {
                return Ok(Place::View);
            }
            match p.info.get(&t.id()) {
                Some(i) if i.external => Ok(Place::External),
                Some(Info { alloc: Some(a), .. }) => Ok(Place::Planned(*a)),
                _ => Err(Error::alloc(format!("{} was not placed", t.label()))),
            }
        };
        let mut leafs = Vec::with_capacity(graph.n_leafs());
        for leaf in graph.leafs() {
            leafs.push(LeafEntry {
                flags: leaf.flags() & PLAN_FLAGS,
                place: place_of(&p, leaf)?,
            });
        }
        let mut nodes = Vec::with_capacity(graph.n_nodes());
        for node in graph.nodes() {
            let mut srcs = Vec::with_capacity(node.srcs().len());
            for src in node.srcs() {
                srcs.push(match graph.position(src) {
                    Some(pos) => SrcRef::InGraph(pos),
                    None => SrcRef::Outside {
                        place: place_of(&p, src)?,
                        root: match src.view_src() {
                            Some(root) => Some(place_of(&p, root)?),
                            None => None,
                        },
                    },
                });
            }
            nodes.push(NodeEntry {
                op: std::mem::discriminant(node.op()),
                flags: node.flags() & PLAN_FLAGS,
                place: place_of(&p, node)?,
                srcs,
                inplace: p.info.get(&node.id()).is_some_and(|i| i.inplace),
            });
        }
        let buffers = self
            .slot_of
            .iter()
            .enumerate()
            .map(|(id, &slot)| {
                let s = &self.slots[slot];
                let shared = (s.first_id != id).then_some(s.first_id);
                BufferPlan {
                    buffer_id: id,
                    buffer_type: s.buft.name().to_owned(),
                    alignment: s.planner.alignment(),
                    shared_with: shared,
                    chunk_sizes: if shared.is_some() {
                        Vec::new()
                    } else {
                        p.planners[slot].chunk_sizes()
                    },
                }
            })
            .collect();
        let memory = MemoryPlan {
            buffers,
            tensors: p.records,
            n_nodes: graph.n_nodes(),
        };
        Ok((
            StoredPlan {
                leafs,
                nodes,
                memory,
                matched_epoch: None,
            },
            p.planners,
        ))
    }

    /// Plans `graph` with every tensor in buffer id 0 and sizes the buffers for it.
    pub fn reserve(&mut self, graph: &Graph) -> Result<()> {
        self.reserve_n(graph, &[], &[])
    }

    /// Plans `graph` with node `i` in buffer id `node_buffer_ids[i]` and leaf `i` in
    /// `leaf_buffer_ids[i]` (empty slices mean all 0), stores the plan and grows the buffers
    /// to fit it. Buffers that are kept are reset (their tensors become stale); buffers that
    /// must grow are freed and replaced.
    pub fn reserve_n(
        &mut self,
        graph: &Graph,
        node_buffer_ids: &[usize],
        leaf_buffer_ids: &[usize],
    ) -> Result<()> {
        let (stored, planners) = self.plan_graph(graph, node_buffer_ids, leaf_buffer_ids)?;
        self.stored = None;
        for (slot, planner) in self.slots.iter_mut().zip(planners) {
            let n = planner.n_chunks().max(1);
            for chunk in 0..n {
                let need = planner.max_size_of_chunk(chunk);
                match slot.buffers.get(chunk) {
                    Some(b) if b.size() >= need && !b.is_freed() => b.reset(),
                    _ => {
                        let buffer = slot.buft.clone().alloc_buffer(need)?;
                        buffer.set_usage(BufferUsage::Compute);
                        if let Some(old) = slot.buffers.get(chunk) {
                            old.free();
                            slot.buffers[chunk] = buffer;
                        } else {
                            slot.buffers.push(buffer);
                        }
                    }
                }
            }
            for extra in slot.buffers.iter().skip(n) {
                extra.reset();
            }
            slot.planner = planner;
        }
        self.stored = Some(stored);
        Ok(())
    }

    /// The bytes each buffer id would need for `graph` (a shared buffer counts under its first
    /// id, 0 for the others). Measures only: no buffer is allocated and the stored plan is
    /// unchanged.
    pub fn reserve_n_size(
        &self,
        graph: &Graph,
        node_buffer_ids: &[usize],
        leaf_buffer_ids: &[usize],
    ) -> Result<Vec<usize>> {
        let (stored, _) = self.plan_graph(graph, node_buffer_ids, leaf_buffer_ids)?;
        Ok(stored.memory.buffers.iter().map(BufferPlan::size).collect())
    }

    /// Why the stored plan cannot be replayed on `graph`, or `None` if it can.
    fn mismatch(&self, graph: &Graph, our_buffers: &[u64]) -> Option<String> {
        let Some(stored) = &self.stored else {
            return Some("nothing was reserved".into());
        };
        if stored.nodes.len() != graph.n_nodes() || stored.leafs.len() != graph.n_leafs() {
            return Some(format!(
                "the graph has {} nodes and {} leafs, the plan {} and {}",
                graph.n_nodes(),
                graph.n_leafs(),
                stored.nodes.len(),
                stored.leafs.len()
            ));
        }
        let fits = |t: &Tensor, place: &Place| -> bool {
            match place {
                Place::View => t.is_view(),
                Place::External => !t.is_view() && is_external(t, our_buffers),
                Place::Planned(a) => {
                    !t.is_view()
                        && (is_external(t, our_buffers) || {
                            let buft = &self.slots[a.slot].buft;
                            align_up(buft.alloc_size(t), buft.alignment())
                                .is_some_and(|s| s <= a.size)
                        })
                }
            }
        };
        for (i, (leaf, entry)) in graph.leafs().iter().zip(&stored.leafs).enumerate() {
            if leaf.flags() & PLAN_FLAGS != entry.flags || !fits(leaf, &entry.place) {
                return Some(format!("leaf {i} ({}) differs from the plan", leaf.label()));
            }
        }
        for (i, (node, entry)) in graph.nodes().iter().zip(&stored.nodes).enumerate() {
            let same_srcs = node.srcs().len() == entry.srcs.len()
                && node.srcs().iter().zip(&entry.srcs).all(|(src, r)| match r {
                    SrcRef::InGraph(pos) => at_position(graph, *pos, src),
                    SrcRef::Outside { place, root } => {
                        !graph.contains(src)
                            && fits(src, place)
                            && match (src.view_src(), root) {
                                (Some(r), Some(root)) => fits(r, root),
                                (None, None) => true,
                                _ => false,
                            }
                    }
                });
            let inplace_ok = !entry.inplace
                || node
                    .srcs()
                    .first()
                    .is_some_and(|p| node.same_layout(p) && (!p.is_view() || p.view_offset() == 0));
            if std::mem::discriminant(node.op()) != entry.op
                || node.flags() & PLAN_FLAGS != entry.flags
                || !same_srcs
                || !inplace_ok
                || !fits(node, &entry.place)
            {
                return Some(format!(
                    "node {i} ({}, {}) differs from the plan or outgrew it",
                    node.label(),
                    node.op().name()
                ));
            }
        }
        None
    }

    /// Binds every tensor of `graph` that needs memory to its planned place.
    ///
    /// Replays the stored plan when `graph` matches it (see the module documentation);
    /// otherwise re-reserves automatically with one buffer type, or fails with
    /// [`Error::Alloc`] with several. Resets the compute buffers first (tensors bound to them
    /// before become stale) and, with poison on, fills them with [`POISON_BYTE`]. Inputs it
    /// places (leafs and outside sources without live memory of their own, e.g. after their
    /// buffer was freed) are zero-filled, so one read before it is set reads zeros.
    pub fn alloc_graph(&mut self, graph: &Graph) -> Result<()> {
        self.alloc_graph_with(graph, false)?;
        // Which tensors later nodes overwrite: reads of them after a compute raise.
        self.sweep.record(graph, &[]);
        Ok(())
    }

    /// [`GraphAllocator::alloc_graph`] without recording overwrites: for a caller that
    /// records them itself, about other tensors (the scheduler's shadows stand for the
    /// caller's nodes).
    pub(crate) fn alloc_graph_unrecorded(&mut self, graph: &Graph) -> Result<()> {
        self.alloc_graph_with(graph, false)
    }

    /// [`GraphAllocator::alloc_graph`] for a caller that has checked that no tensor of `graph`
    /// changed its flags or its binding outside this allocator's buffers since `graph` was
    /// last planned or allocated here (the scheduler does, for the graph it allocated last):
    /// when the plan's last match is this very graph (same epoch), the match is not checked
    /// again. Overwrites are not recorded (as [`GraphAllocator::alloc_graph_unrecorded`]).
    pub(crate) fn alloc_graph_unchanged(&mut self, graph: &Graph) -> Result<()> {
        self.alloc_graph_with(graph, true)
    }

    fn alloc_graph_with(&mut self, graph: &Graph, unchanged: bool) -> Result<()> {
        let mut our_buffers = self.our_buffer_ids();
        let matched = self
            .stored
            .as_ref()
            .and_then(|s| s.matched_epoch)
            .is_some_and(|e| e != 0 && e == graph.epoch());
        let mismatch = if unchanged && matched {
            None
        } else {
            self.mismatch(graph, &our_buffers)
        };
        if let Some(reason) = mismatch {
            if self.slot_of.len() != 1 {
                return Err(Error::alloc(format!(
                    "the graph does not match the reserved plan ({reason}); call reserve_n \
                     with the graph first"
                )));
            }
            log::debug!("graph allocator: re-reserving ({reason})");
            self.reserve(graph)?;
            our_buffers = self.our_buffer_ids();
        }
        for slot in &self.slots {
            for buffer in &slot.buffers {
                buffer.reset();
                if self.poison {
                    buffer.clear(POISON_BYTE)?;
                }
            }
        }
        if let Some(stored) = &mut self.stored {
            stored.matched_epoch = Some(graph.epoch());
        }
        let Some(stored) = &self.stored else {
            return Err(Error::alloc("no plan after reserving"));
        };
        // One change of the layout for the whole graph (see `BindBatch`).
        let batch = BindBatch::new();
        for (leaf, entry) in graph.leafs().iter().zip(&stored.leafs) {
            // A leaf given compute memory here (an input never allocated elsewhere, or one
            // whose own buffer was freed) starts as zeros: its old bytes are gone and the
            // compute memory holds another tensor's leftovers (or poison). Reading it before
            // it is set is defined (zeros), never uninitialised memory.
            if self.bind(leaf, &entry.place, &our_buffers, &batch)? {
                leaf.fill_bytes(0, leaf.nbytes(), 0)?;
            }
        }
        for (node, entry) in graph.nodes().iter().zip(&stored.nodes) {
            for (src, r) in node.srcs().iter().zip(&entry.srcs) {
                if let SrcRef::Outside { place, root } = r {
                    // Sources outside the graph are inputs too: zeros, as leafs.
                    if let (Some(r), Some(root)) = (src.view_src(), root) {
                        if self.bind(r, root, &our_buffers, &batch)? {
                            r.fill_bytes(0, r.nbytes(), 0)?;
                        }
                    }
                    if self.bind(src, place, &our_buffers, &batch)? {
                        src.fill_bytes(0, src.nbytes(), 0)?;
                    }
                }
            }
            self.bind(node, &entry.place, &our_buffers, &batch)?;
        }
        Ok(())
    }

    /// Binds `tensor` to its planned place in compute memory; whether it did (false for
    /// external tensors and views).
    fn bind(
        &self,
        tensor: &Tensor,
        place: &Place,
        our_buffers: &[u64],
        batch: &BindBatch,
    ) -> Result<bool> {
        match place {
            Place::Planned(a) if !is_external(tensor, our_buffers) => {
                let buffer = self.slots[a.slot].buffers.get(a.chunk).ok_or_else(|| {
                    Error::alloc(format!(
                        "chunk {} of the plan has no buffer; call reserve",
                        a.chunk
                    ))
                })?;
                tensor.bind_in(buffer, a.offset, batch).map(|()| true)
            }
            _ => Ok(false),
        }
    }

    /// The stored plan, if any.
    pub fn plan(&self) -> Option<&MemoryPlan> {
        self.stored.as_ref().map(|s| &s.memory)
    }

    /// Bytes of compute memory buffer id `id` holds (all its chunk buffers). An id sharing its
    /// buffer type with an earlier id reports 0, so sums do not count memory twice.
    pub fn buffer_size(&self, id: usize) -> usize {
        match self.slot_of.get(id) {
            Some(&slot) if self.slots[slot].first_id == id => {
                self.slots[slot].buffers.iter().map(Buffer::size).sum()
            }
            _ => 0,
        }
    }

    /// The buffer of id `id` (its first chunk; see [`GraphAllocator::buffers`] for all).
    pub fn buffer(&self, id: usize) -> Option<&Buffer> {
        let slot = *self.slot_of.get(id)?;
        self.slots[slot].buffers.first()
    }

    /// All buffers of id `id`, one per chunk (empty before the first reserve).
    pub fn buffers(&self, id: usize) -> &[Buffer] {
        match self.slot_of.get(id) {
            Some(&slot) => &self.slots[slot].buffers,
            None => &[],
        }
    }

    /// Replaces every buffer larger than the current plan needs by one of the exact size (the
    /// old buffers are freed, so tensors bound to them become stale; call `alloc_graph`
    /// again). Without a plan, releases everything.
    pub fn shrink(&mut self) -> Result<()> {
        if self.stored.is_none() {
            self.release();
            return Ok(());
        }
        for slot in &mut self.slots {
            let n = slot.planner.n_chunks().max(1);
            for extra in slot.buffers.drain(n.min(slot.buffers.len())..) {
                extra.free();
            }
            for (chunk, buffer) in slot.buffers.iter_mut().enumerate() {
                let need = slot.planner.max_size_of_chunk(chunk);
                if buffer.size() > need {
                    let smaller = slot.buft.clone().alloc_buffer(need)?;
                    smaller.set_usage(BufferUsage::Compute);
                    buffer.free();
                    *buffer = smaller;
                }
            }
        }
        Ok(())
    }

    /// Frees every buffer and forgets the plan (tensors bound by this allocator become stale).
    pub fn release(&mut self) {
        for slot in &mut self.slots {
            for buffer in slot.buffers.drain(..) {
                buffer.free();
            }
            slot.planner.reset();
        }
        self.stored = None;
    }
}
