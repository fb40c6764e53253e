//! The graph as the scheduler sees it: every tensor under one *unified* index (nodes, then
//! leafs, then operands outside the graph), operands and view roots by index, where each
//! tensor already lives, and a signature of all of it for the plan cache.

use std::hash::{Hash, Hasher};
use std::sync::Arc;

use crate::buffer::{Buffer, BufferType, BufferUsage};
use crate::graph::{Graph, Position};
use crate::ops::Op;
use crate::tensor::{contiguous_strides, Tensor};

/// No tensor.
pub(crate) const NONE: u32 = u32::MAX;

pub(crate) use crate::util::{FastHasher, IdMap};

/// A buffer a tensor already lives in (not one of the scheduler's own).
#[derive(Clone, Debug)]
pub(crate) struct BufInfo {
    pub buft: Arc<dyn BufferType>,
    pub weights: bool,
    pub host: bool,
    /// The buffer itself, to tell cheaply whether the binding is still live.
    pub buffer: Buffer,
}

/// What a tensor looked like when it was indexed, beyond its immutable metadata: its flags and
/// its binding (buffer id and generation; 0 when unbound or bound to one of the scheduler's
/// own buffers). Compared on every cache hit to catch flags set or tensors moved since.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Snap {
    pub flags: u8,
    pub bound: u64,
    pub generation: u64,
}

impl Snap {
    fn of(t: &Tensor, own_buffers: &[u64]) -> Snap {
        let bound = match t.bound_buffer_id() {
            Some(id) if !own_buffers.contains(&id) => id,
            _ => 0,
        };
        Snap {
            flags: t.flags(),
            bound,
            generation: if bound == 0 { 0 } else { t.bound_generation() },
        }
    }
}

#[inline(always)]
fn same_meta(a: &Tensor, b: &Tensor) -> bool {
    a.same_layout(b)
        && a.view_offset() == b.view_offset()
        && a.is_view() == b.is_view()
        && a.op() == b.op()
}

/// Unified indexing of a graph's tensors.
pub(crate) struct Topology {
    pub n_nodes: usize,
    pub n_leafs: usize,
    /// Operands (and view roots) that are not in the graph.
    pub extras: Vec<Tensor>,
    /// `srcs[src_start[i]..src_start[i + 1]]` are node `i`'s operands.
    pub src_start: Vec<u32>,
    pub srcs: Vec<u32>,
    /// Per unified tensor: the tensor it views, or [`NONE`].
    pub view_root: Vec<u32>,
    /// The distinct foreign buffers tensors of the graph already live in.
    pub buffers: Vec<BufInfo>,
    /// Per unified tensor: the index in `buffers` of the buffer it (or its view root) already
    /// lives in, or [`NONE`].
    pub buf: Vec<u32>,
    /// Per unified tensor: flags and binding when indexed.
    pub snap: Vec<Snap>,
}

impl Topology {
    /// Indexes `graph`; tensors bound to a buffer whose id is in `own_buffers` count as
    /// unallocated (they hold a previous graph of this scheduler).
    pub fn build(graph: &Graph, own_buffers: &[u64]) -> Topology {
        let n_nodes = graph.n_nodes();
        let n_leafs = graph.n_leafs();
        let base = n_nodes + n_leafs;
        // Nodes and leafs by the graph's own index; outside operands in first-seen order.
        let mut outside: IdMap<u32> = IdMap::default();
        let mut extras: Vec<Tensor> = Vec::new();
        let mut unified = |t: &Tensor, extras: &mut Vec<Tensor>| -> u32 {
            match graph.position(t) {
                Some(Position::Node(i)) => i as u32,
                Some(Position::Leaf(i)) => (n_nodes + i) as u32,
                None => *outside.entry(t.id()).or_insert_with(|| {
                    extras.push(t.clone());
                    (base + extras.len() - 1) as u32
                }),
            }
        };
        let (nodes, leafs) = (graph.nodes(), graph.leafs());
        let n_srcs = nodes.iter().map(|n| n.srcs().len()).sum::<usize>();
        let mut src_start = Vec::with_capacity(n_nodes + 1);
        let mut srcs = Vec::with_capacity(n_srcs);
        // Two guesses checked by identity before the index is asked: the node just before
        // (chains), and the next leaf not met yet (a graph built by expansion lists its
        // leafs in the order its nodes first read them).
        let mut next_leaf = 0;
        for (i, node) in nodes.iter().enumerate() {
            src_start.push(srcs.len() as u32);
            for src in node.srcs() {
                let u = if i > 0 && nodes[i - 1].same(src) {
                    (i - 1) as u32
                } else if next_leaf < n_leafs && leafs[next_leaf].same(src) {
                    next_leaf += 1;
                    (n_nodes + next_leaf - 1) as u32
                } else {
                    unified(src, &mut extras)
                };
                srcs.push(u);
            }
        }
        src_start.push(srcs.len() as u32);
        let mut view_root = Vec::with_capacity(n_nodes + n_leafs + extras.len());
        for (i, t) in nodes.iter().enumerate() {
            view_root.push(match t.view_src() {
                Some(root) if i > 0 && nodes[i - 1].same(root) => (i - 1) as u32,
                Some(root) => unified(root, &mut extras),
                None => NONE,
            });
        }
        for t in leafs {
            view_root.push(match t.view_src() {
                Some(root) => unified(root, &mut extras),
                None => NONE,
            });
        }
        let mut k = 0;
        while k < extras.len() {
            let root = extras[k].view_src().cloned();
            view_root.push(match root {
                Some(root) => unified(&root, &mut extras),
                None => NONE,
            });
            k += 1;
        }
        let mut topo = Topology {
            n_nodes,
            n_leafs,
            extras,
            src_start,
            srcs,
            view_root,
            buffers: Vec::new(),
            buf: Vec::new(),
            snap: Vec::new(),
        };
        topo.index_state(graph, own_buffers);
        topo
    }

    /// Fills `buffers`, `buf` and `snap` from the tensors' current flags and bindings.
    fn index_state(&mut self, graph: &Graph, own_buffers: &[u64]) {
        let total = self.len();
        let mut buffers: Vec<BufInfo> = Vec::new();
        let mut buf: Vec<u32> = Vec::with_capacity(total);
        let mut snap = Vec::with_capacity(total);
        let tensors = graph
            .nodes()
            .iter()
            .chain(graph.leafs())
            .chain(&self.extras);
        for t in tensors {
            let s = Snap::of(t, own_buffers);
            snap.push(s);
            // Views are never bound; a live foreign binding is the only case to look at.
            let mut slot = NONE;
            if s.bound != 0 {
                if let Some(k) = buffers.iter().position(|b| b.buffer.id() == s.bound) {
                    slot = k as u32;
                } else if let Ok(storage) = t.storage() {
                    buffers.push(BufInfo {
                        buft: storage.buffer.buffer_type().clone(),
                        weights: storage.buffer.usage() == BufferUsage::Weights,
                        host: storage.buffer.is_host(),
                        buffer: storage.buffer,
                    });
                    slot = (buffers.len() - 1) as u32;
                }
            }
            buf.push(slot);
        }
        for u in 0..total {
            let root = self.view_root[u];
            if root != NONE {
                buf[u] = buf[root as usize];
            }
        }
        self.buffers = buffers;
        self.buf = buf;
        self.snap = snap;
    }

    /// The foreign buffer unified tensor `u` (or its view root) already lives in.
    pub fn buf_info(&self, u: usize) -> Option<&BufInfo> {
        match self.buf[u] {
            NONE => None,
            k => Some(&self.buffers[k as usize]),
        }
    }

    /// Whether every tensor's flags and binding are still what was indexed (own buffers
    /// count as unbound), so `buf` and the plans derived from it still hold. Lock-free for
    /// unbound tensors and tensors in the scheduler's buffers.
    pub fn state_matches(&self, graph: &Graph, own_buffers: &[u64]) -> bool {
        let live = self.live_generations();
        graph
            .nodes()
            .iter()
            .chain(graph.leafs())
            .chain(&self.extras)
            .enumerate()
            .all(|(u, t)| self.state_holds(u, t, own_buffers, &live))
    }

    /// Per foreign buffer: its generation while it is neither freed nor of another usage
    /// than when indexed (`None` otherwise). Read once per check instead of once per tensor.
    fn live_generations(&self) -> Vec<Option<u64>> {
        self.buffers
            .iter()
            .map(|info| {
                let usable = !info.buffer.is_freed()
                    && (info.buffer.usage() == BufferUsage::Weights) == info.weights;
                usable.then(|| info.buffer.generation())
            })
            .collect()
    }

    /// Whether unified tensor `u`, now `t`, still has the flags and binding it was indexed
    /// with (`Snap::of(t) == snap[u]`), and a foreign binding is still live (`live`:
    /// [`Topology::live_generations`]).
    #[inline(always)]
    fn state_holds(&self, u: usize, t: &Tensor, own_buffers: &[u64], live: &[Option<u64>]) -> bool {
        let recorded = &self.snap[u];
        if t.flags() != recorded.flags {
            return false;
        }
        let id = t.bound_buffer_id().unwrap_or(0);
        if recorded.bound == 0 {
            // Unbound then: unbound or in one of the scheduler's own buffers now.
            return id == 0 || own_buffers.contains(&id);
        }
        if id != recorded.bound
            || own_buffers.contains(&id)
            || t.bound_generation() != recorded.generation
        {
            return false;
        }
        if self.view_root[u] != NONE {
            return true;
        }
        // Bound to a foreign buffer: still live (or still dead), same usage.
        match self.buf[u] {
            NONE => true,
            k => live[k as usize] == Some(recorded.generation),
        }
    }

    /// Whether outside operand `k` of the new graph is `t`: the first tensor met there
    /// (of the same metadata as the old one, and not in `graph`), the same one after that.
    #[cold]
    fn resolve_outside(
        &self,
        graph: &Graph,
        k: usize,
        t: &Tensor,
        extras: &mut [Option<Tensor>],
    ) -> bool {
        match &extras[k] {
            Some(known) => known.same(t),
            None => {
                if !same_meta(t, &self.extras[k]) || graph.contains(t) {
                    return false;
                }
                extras[k] = Some(t.clone());
                true
            }
        }
    }

    /// Whether tensor `u` of the new graph, `t`, has the view root this topology recorded
    /// (`resolve(index, root)` checks a root against an index).
    #[inline(always)]
    fn root_holds(&self, u: usize, t: &Tensor, resolve: impl FnOnce(u32, &Tensor) -> bool) -> bool {
        match (t.view_src(), self.view_root[u]) {
            (None, NONE) => true,
            (Some(root), e) if e != NONE => resolve(e, root),
            _ => false,
        }
    }

    /// Re-indexes `graph` from this topology of `old`, without hashing: succeeds when `graph`
    /// has the same node and leaf counts, every operand and view source at the same unified
    /// position (checked by identity; outside operands may be other tensors of the same kind),
    /// the same dtype, shape, strides, op and view offset everywhere, and the same flags and
    /// bindings (see [`Topology::state_matches`]). That is everything the signature covers,
    /// so the plan of `old` is the plan of `graph`. Returns the outside operands of `graph`
    /// (this topology with them in place of its own indexes `graph`).
    ///
    /// One pass over the nodes, one over the leafs, one over the outside operands; a tensor
    /// that is the same one in both graphs (a weight) needs no metadata comparison.
    pub fn rebind(&self, old: &Graph, graph: &Graph, own_buffers: &[u64]) -> Option<Vec<Tensor>> {
        let (nodes, leafs) = (graph.nodes(), graph.leafs());
        let (old_nodes, old_leafs) = (old.nodes(), old.leafs());
        if nodes.len() != self.n_nodes
            || leafs.len() != self.n_leafs
            || old_nodes.len() != self.n_nodes
            || old_leafs.len() != self.n_leafs
        {
            return None;
        }
        let n_nodes = self.n_nodes;
        let base = n_nodes + self.n_leafs;
        // The new outside operands by their index (filled where first met; every position
        // names one tensor, checked by identity after that).
        let mut extras: Vec<Option<Tensor>> = vec![None; self.extras.len()];
        let resolve = |e: u32, t: &Tensor, extras: &mut Vec<Option<Tensor>>| -> bool {
            let e = e as usize;
            if e < n_nodes {
                nodes[e].same(t)
            } else if e < base {
                leafs[e - n_nodes].same(t)
            } else {
                self.resolve_outside(graph, e - base, t, extras)
            }
        };
        let live = self.live_generations();
        for (i, (node, before)) in nodes.iter().zip(old_nodes).enumerate() {
            if !node.same(before) && !same_meta(node, before) {
                return None;
            }
            let expected = self.srcs(i);
            let srcs = node.srcs();
            if srcs.len() != expected.len() {
                return None;
            }
            for (src, &e) in srcs.iter().zip(expected) {
                if !resolve(e, src, &mut extras) {
                    return None;
                }
            }
            // After the operands, so outside operands are still met in index order.
            if !self.root_holds(i, node, |e, r| resolve(e, r, &mut extras))
                || !self.state_holds(i, node, own_buffers, &live)
            {
                return None;
            }
        }
        for (j, (leaf, before)) in leafs.iter().zip(old_leafs).enumerate() {
            let u = n_nodes + j;
            if !leaf.same(before) && !same_meta(leaf, before) {
                return None;
            }
            if !self.root_holds(u, leaf, |e, r| resolve(e, r, &mut extras))
                || !self.state_holds(u, leaf, own_buffers, &live)
            {
                return None;
            }
        }
        // Outside operands in index order: each was met before its turn (its index was given
        // when it was first met while indexing, and roots of outside operands come last).
        for k in 0..extras.len() {
            let t = extras[k].clone()?;
            let u = base + k;
            let root_ok = match (t.view_src(), self.view_root[u]) {
                (None, NONE) => true,
                (Some(root), e) if e != NONE => resolve(e, root, &mut extras),
                _ => false,
            };
            if !root_ok || !self.state_holds(u, &t, own_buffers, &live) {
                return None;
            }
        }
        extras.into_iter().collect()
    }

    /// Number of unified tensors.
    pub fn len(&self) -> usize {
        self.n_nodes + self.n_leafs + self.extras.len()
    }

    /// The tensor at unified index `u`.
    pub fn tensor<'a>(&'a self, graph: &'a Graph, u: usize) -> &'a Tensor {
        if u < self.n_nodes {
            &graph.nodes()[u]
        } else if u < self.n_nodes + self.n_leafs {
            &graph.leafs()[u - self.n_nodes]
        } else {
            &self.extras[u - self.n_nodes - self.n_leafs]
        }
    }

    /// Node `i`'s operands (unified indices).
    pub fn srcs(&self, i: usize) -> &[u32] {
        &self.srcs[self.src_start[i] as usize..self.src_start[i + 1] as usize]
    }

    /// The signature of the graph's shape for the plan cache: everything the passes read.
    ///
    /// Per node: its operand count and operands; per tensor: a header word (dtype, flags,
    /// how the shape and strides follow, view root), the shape (two words when every size
    /// fits 32 bits, else four), the strides unless dense (the header says which, so the
    /// encoding stays unambiguous), the view offset, the foreign buffer's type and usage
    /// (0: none), and the pin when any tensor is pinned. The ops are kept beside the words.
    /// Flags and buffers are the ones recorded when the graph was indexed, so a signature
    /// computed later (for a plan cached after the fact) describes the graph as planned.
    pub fn signature(&self, graph: &Graph, pinned: &IdMap<usize>) -> Signature {
        let pins = (!pinned.is_empty()).then_some(pinned);
        // Views are the tensors whose strides may not be dense (four more words each).
        let views = self.view_root.iter().filter(|&&r| r != NONE).count();
        let per_tensor = 5 + usize::from(pins.is_some());
        let mut words: Vec<u64> = Vec::with_capacity(
            3 + self.len() * per_tensor + 4 * views + self.n_nodes + self.srcs.len(),
        );
        words.extend_from_slice(&[
            self.n_nodes as u64,
            self.n_leafs as u64,
            self.extras.len() as u64,
        ]);
        // One word per foreign buffer, shared by every tensor in it.
        let buffer_words: Vec<u64> = self
            .buffers
            .iter()
            .map(|b| {
                (Arc::as_ptr(&b.buft) as *const () as u64)
                    ^ (u64::from(b.weights) << 63)
                    ^ (u64::from(b.host) << 62)
            })
            .collect();
        let mut ops = Vec::with_capacity(self.n_nodes);
        for (u, t) in graph.nodes().iter().enumerate() {
            ops.push(t.op().clone());
            let srcs = self.srcs(u);
            words.push(srcs.len() as u64);
            words.extend(srcs.iter().map(|&s| u64::from(s)));
            self.tensor_words(u, t, &buffer_words, pins, &mut words);
        }
        let base = self.n_nodes;
        for (j, t) in graph.leafs().iter().chain(&self.extras).enumerate() {
            self.tensor_words(base + j, t, &buffer_words, pins, &mut words);
        }
        let mut hasher = FastHasher::default();
        hasher.write_u64(hash_words(&words));
        for op in &ops {
            std::mem::discriminant(op).hash(&mut hasher);
        }
        Signature {
            hash: hasher.finish(),
            words,
            ops,
        }
    }

    /// The words of unified tensor `u` (`t`) in the signature (see [`Topology::signature`]).
    #[inline(always)]
    fn tensor_words(
        &self,
        u: usize,
        t: &Tensor,
        buffer_words: &[u64],
        pins: Option<&IdMap<usize>>,
        words: &mut Vec<u64>,
    ) {
        let (dtype, ne, nb) = (t.dtype(), t.ne(), t.nb());
        let narrow = ne.iter().all(|&n| n <= u32::MAX as usize);
        let dense = contiguous_strides(dtype, &ne) == nb;
        let header = dtype as u64
            | u64::from(self.snap[u].flags) << 8
            | u64::from(narrow) << 16
            | u64::from(dense) << 17
            | u64::from(self.view_root[u]) << 32;
        let buffer = match self.buf[u] {
            NONE => 0,
            k => buffer_words[k as usize],
        };
        let offset = t.view_offset() as u64;
        if narrow && dense {
            words.extend_from_slice(&[
                header,
                ne[0] as u64 | (ne[1] as u64) << 32,
                ne[2] as u64 | (ne[3] as u64) << 32,
                offset,
                buffer,
            ]);
        } else {
            words.push(header);
            if narrow {
                words.push(ne[0] as u64 | (ne[1] as u64) << 32);
                words.push(ne[2] as u64 | (ne[3] as u64) << 32);
            } else {
                words.extend(ne.iter().map(|&n| n as u64));
            }
            if !dense {
                words.extend(nb.iter().map(|&n| n as u64));
            }
            words.extend_from_slice(&[offset, buffer]);
        }
        if let Some(pinned) = pins {
            words.push(pinned.get(&t.id()).map_or(u64::MAX, |&b| b as u64));
        }
    }
}

/// A hash of `words` in four independent lanes (one multiply chain per lane, so the lanes
/// overlap in the pipeline), folded with [`FastHasher`].
fn hash_words(words: &[u64]) -> u64 {
    const K: [u64; 4] = [
        0x9e37_79b9_7f4a_7c15,
        0xc2b2_ae3d_27d4_eb4f,
        0x1656_67b1_9e37_79f9,
        0x85eb_ca77_c2b2_ae63,
    ];
    let mut lanes = K;
    let mut chunks = words.chunks_exact(4);
    for chunk in &mut chunks {
        for ((lane, &w), k) in lanes.iter_mut().zip(chunk).zip(K) {
            *lane = (lane.rotate_left(5) ^ w).wrapping_mul(k);
        }
    }
    let mut hasher = FastHasher::default();
    for lane in lanes.into_iter().chain(chunks.remainder().iter().copied()) {
        hasher.write_u64(lane);
    }
    hasher.write_usize(words.len());
    hasher.finish()
}

/// The shape of a graph as far as scheduling is concerned (see [`Topology::signature`]).
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Signature {
    pub hash: u64,
    words: Vec<u64>,
    ops: Vec<Op>,
}
