//! The graph as the scheduler sees it: every tensor under one *unified* index (nodes, then
//! leafs, then operands outside the graph), operands and view roots by index, where each
//! tensor already lives, and a signature of all of it for the plan cache.

use std::hash::{Hash, Hasher};
use std::sync::Arc;

use crate::buffer::{Buffer, BufferType, BufferUsage};
use crate::graph::Graph;
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
        let mut index = UnifiedIndex::new(graph);
        let mut extras: Vec<Tensor> = Vec::new();
        let mut unified = |t: &Tensor, extras: &mut Vec<Tensor>| -> u32 {
            index.get_or_insert(t.id(), || {
                extras.push(t.clone());
                (n_nodes + n_leafs + extras.len() - 1) as u32
            })
        };
        let mut src_start = Vec::with_capacity(n_nodes + 1);
        let mut srcs = Vec::with_capacity(n_nodes * 2);
        for node in graph.nodes() {
            src_start.push(srcs.len() as u32);
            for src in node.srcs() {
                srcs.push(unified(src, &mut extras));
            }
        }
        src_start.push(srcs.len() as u32);
        let mut view_root = Vec::with_capacity(n_nodes + n_leafs + extras.len());
        for t in graph.nodes().iter().chain(graph.leafs()) {
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
        self.state_matches_with(graph, &self.extras, own_buffers)
    }

    /// [`Topology::state_matches`] with other outside operands.
    fn state_matches_with(&self, graph: &Graph, extras: &[Tensor], own_buffers: &[u64]) -> bool {
        let base = self.n_nodes + self.n_leafs;
        let tensors = graph.nodes().iter().chain(graph.leafs()).chain(extras);
        tensors.enumerate().all(|(u, t)| {
            debug_assert!(u < base + self.extras.len());
            let recorded = self.snap[u];
            if Snap::of(t, own_buffers) != recorded {
                return false;
            }
            if recorded.bound == 0 || self.view_root[u] != NONE {
                return true;
            }
            // Bound to a foreign buffer: still live (or still dead), same usage.
            match self.buf_info(u) {
                Some(info) => {
                    !info.buffer.is_freed()
                        && info.buffer.generation() == recorded.generation
                        && (info.buffer.usage() == BufferUsage::Weights) == info.weights
                }
                None => true,
            }
        })
    }

    /// Re-indexes `graph` from this topology of `old`, without hashing: succeeds when `graph`
    /// has the same node and leaf counts, every operand and view source at the same unified
    /// position (checked by identity; outside operands may be other tensors of the same kind),
    /// the same dtype, shape, strides, op and view offset everywhere, and the same flags and
    /// bindings (see [`Topology::state_matches`]). That is everything the signature covers,
    /// so the plan of `old` is the plan of `graph`. Returns the outside operands of `graph`
    /// (this topology with them in place of its own indexes `graph`).
    pub fn rebind(&self, old: &Graph, graph: &Graph, own_buffers: &[u64]) -> Option<Vec<Tensor>> {
        if graph.n_nodes() != self.n_nodes || graph.n_leafs() != self.n_leafs {
            return None;
        }
        let base = self.n_nodes + self.n_leafs;
        let mut extras: Vec<Tensor> = Vec::with_capacity(self.extras.len());
        // Whether `t` is what unified index `e` is in the new graph (extras in first-seen order).
        let mut resolve = |e: u32, t: &Tensor, extras: &mut Vec<Tensor>| -> bool {
            let e = e as usize;
            if e < base {
                let now = if e < self.n_nodes {
                    &graph.nodes()[e]
                } else {
                    &graph.leafs()[e - self.n_nodes]
                };
                return now.same(t);
            }
            let k = e - base;
            if k < extras.len() {
                return extras[k].same(t);
            }
            if k != extras.len() || !same_meta(t, &self.extras[k]) || graph.contains(t) {
                return false;
            }
            extras.push(t.clone());
            true
        };
        for (i, (node, before)) in graph.nodes().iter().zip(old.nodes()).enumerate() {
            let expected = self.srcs(i);
            if !same_meta(node, before) || node.srcs().len() != expected.len() {
                return None;
            }
            for (src, &e) in node.srcs().iter().zip(expected) {
                if !resolve(e, src, &mut extras) {
                    return None;
                }
            }
        }
        for (leaf, before) in graph.leafs().iter().zip(old.leafs()) {
            if !same_meta(leaf, before) {
                return None;
            }
        }
        let roots_ok =
            |u: usize,
             t: &Tensor,
             extras: &mut Vec<Tensor>,
             resolve: &mut dyn FnMut(u32, &Tensor, &mut Vec<Tensor>) -> bool| {
                match (t.view_src(), self.view_root[u]) {
                    (None, NONE) => true,
                    (Some(root), e) if e != NONE => resolve(e, root, extras),
                    _ => false,
                }
            };
        for (u, t) in graph.nodes().iter().chain(graph.leafs()).enumerate() {
            if !roots_ok(u, t, &mut extras, &mut resolve) {
                return None;
            }
        }
        let mut k = 0;
        while k < extras.len() {
            let t = extras[k].clone();
            if !roots_ok(base + k, &t, &mut extras, &mut resolve) {
                return None;
            }
            k += 1;
        }
        if extras.len() != self.extras.len() {
            return None;
        }
        self.state_matches_with(graph, &extras, own_buffers)
            .then_some(extras)
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
    pub fn signature(&self, graph: &Graph, pinned: &IdMap<usize>) -> Signature {
        let mut words: Vec<u64> = Vec::with_capacity(self.len() * 6 + self.srcs.len() + 4);
        words.push(self.n_nodes as u64);
        words.push(self.n_leafs as u64);
        words.push(self.extras.len() as u64);
        let mut ops = Vec::with_capacity(self.n_nodes);
        let tensors = graph
            .nodes()
            .iter()
            .chain(graph.leafs())
            .chain(&self.extras);
        for (u, t) in tensors.enumerate() {
            if u < self.n_nodes {
                ops.push(t.op().clone());
                words.push(self.src_start[u + 1] as u64 - self.src_start[u] as u64);
                words.extend(self.srcs(u).iter().map(|&s| s as u64));
            }
            // Header: dtype, flags, how ne and nb follow, view root. Shapes whose sizes fit 32
            // bits go as two words, strides of a dense layout as none (the header says which,
            // so the encoding stays unambiguous).
            let (ne, nb) = (t.ne(), t.nb());
            let narrow = ne.iter().all(|&n| n <= u32::MAX as usize);
            let dense = contiguous_strides(t.dtype(), &ne) == nb;
            words.push(
                t.dtype() as u64
                    | u64::from(t.flags()) << 8
                    | u64::from(narrow) << 16
                    | u64::from(dense) << 17
                    | u64::from(self.view_root[u]) << 32,
            );
            if narrow {
                words.push(ne[0] as u64 | (ne[1] as u64) << 32);
                words.push(ne[2] as u64 | (ne[3] as u64) << 32);
            } else {
                words.extend(ne.iter().map(|&n| n as u64));
            }
            if !dense {
                words.extend(nb.iter().map(|&n| n as u64));
            }
            words.push(t.view_offset() as u64);
            words.push(match self.buf_info(u) {
                Some(b) => {
                    (Arc::as_ptr(&b.buft) as *const () as u64)
                        ^ (u64::from(b.weights) << 63)
                        ^ (u64::from(b.host) << 62)
                }
                None => 0,
            });
            if !pinned.is_empty() {
                words.push(pinned.get(&t.id()).map_or(u64::MAX, |&b| b as u64));
            }
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

/// Tensor id → unified index while a topology is built. Tensor ids come from one counter, so
/// a graph's tensors fall into a few narrow id ranges (the nodes made together, the weights made
/// together long before): each such cluster is a dense table (no hashing); ids outside them go
/// to a hash map.
struct UnifiedIndex {
    /// Dense tables over disjoint id ranges, the largest first.
    windows: Vec<Window>,
    sparse: IdMap<u32>,
}

/// Unified indices of the ids `base..base + slots.len()` ([`NONE`]: not seen yet).
struct Window {
    base: u64,
    slots: Vec<u32>,
}

/// Ids further apart than this start a new cluster (so a table holds at most this many slots
/// per tensor).
const CLUSTER_GAP: u64 = 16;

/// Clusters of fewer tensors than this are left to the hash map.
const MIN_CLUSTER: usize = 8;

/// Tables kept at most (each lookup tries them in turn).
const MAX_WINDOWS: usize = 4;

impl UnifiedIndex {
    /// Indexes `graph`'s nodes, then leafs, in unified order.
    fn new(graph: &Graph) -> UnifiedIndex {
        let (nodes, leafs) = (graph.nodes(), graph.leafs());
        let mut ids: Vec<u64> = nodes.iter().chain(leafs).map(Tensor::id).collect();
        ids.sort(); // adaptive: nodes and leafs come in a few ascending runs
        let mut clusters: Vec<(u64, u64, usize)> = Vec::new();
        let mut first = 0;
        for i in 1..=ids.len() {
            if i == ids.len() || ids[i] - ids[i - 1] > CLUSTER_GAP {
                if i - first >= MIN_CLUSTER {
                    clusters.push((ids[first], ids[i - 1], i - first));
                }
                first = i;
            }
        }
        clusters.sort_unstable_by_key(|&(_, _, n)| std::cmp::Reverse(n));
        clusters.truncate(MAX_WINDOWS);
        let windows = clusters
            .into_iter()
            .map(|(lo, hi, _)| Window {
                base: lo,
                slots: vec![NONE; (hi - lo + 1) as usize],
            })
            .collect();
        let mut index = UnifiedIndex {
            windows,
            sparse: IdMap::default(),
        };
        for (u, t) in nodes.iter().chain(leafs).enumerate() {
            index.get_or_insert(t.id(), || u as u32);
        }
        index
    }

    /// The index of `id`, inserting `make()` when it has none yet.
    fn get_or_insert(&mut self, id: u64, make: impl FnOnce() -> u32) -> u32 {
        for window in &mut self.windows {
            let slot = id
                .checked_sub(window.base)
                .and_then(|k| window.slots.get_mut(usize::try_from(k).ok()?));
            if let Some(slot) = slot {
                if *slot == NONE {
                    *slot = make();
                }
                return *slot;
            }
        }
        *self.sparse.entry(id).or_insert_with(make)
    }
}
