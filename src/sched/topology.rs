//! The graph as the scheduler sees it: every tensor under one *unified* index (nodes, then
//! leafs, then operands outside the graph), operands and view roots by index, where each
//! tensor already lives, and a signature of all of it for the plan cache.

use std::collections::hash_map::DefaultHasher;
use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::sync::Arc;

use crate::buffer::{BufferType, BufferUsage};
use crate::graph::{Graph, Position};
use crate::ops::Op;
use crate::tensor::Tensor;

/// No tensor.
pub(crate) const NONE: u32 = u32::MAX;

/// A buffer a tensor already lives in (not one of the scheduler's own).
#[derive(Clone, Debug)]
pub(crate) struct BufInfo {
    pub buft: Arc<dyn BufferType>,
    pub weights: bool,
    pub host: bool,
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
    /// Per unified tensor: the buffer it (or its view root) already lives in.
    pub buf: Vec<Option<BufInfo>>,
}

impl Topology {
    /// Indexes `graph`; tensors bound to a buffer whose id is in `own_buffers` count as
    /// unallocated (they hold a previous graph of this scheduler).
    pub fn build(graph: &Graph, own_buffers: &[u64]) -> Topology {
        let n_nodes = graph.n_nodes();
        let n_leafs = graph.n_leafs();
        let mut extras: Vec<Tensor> = Vec::new();
        let mut extra_index: HashMap<u64, u32> = HashMap::new();
        let mut unified = |t: &Tensor, extras: &mut Vec<Tensor>| -> u32 {
            match graph.position(t) {
                Some(Position::Node(i)) => i as u32,
                Some(Position::Leaf(i)) => (n_nodes + i) as u32,
                None => *extra_index.entry(t.id()).or_insert_with(|| {
                    extras.push(t.clone());
                    (n_nodes + n_leafs + extras.len() - 1) as u32
                }),
            }
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
        let total = n_nodes + n_leafs + extras.len();
        let mut buf: Vec<Option<BufInfo>> = vec![None; total];
        let tensor_at = |u: usize| -> &Tensor {
            if u < n_nodes {
                &graph.nodes()[u]
            } else if u < n_nodes + n_leafs {
                &graph.leafs()[u - n_nodes]
            } else {
                &extras[u - n_nodes - n_leafs]
            }
        };
        for (u, slot) in buf.iter_mut().enumerate() {
            let t = tensor_at(u);
            if t.is_view() {
                continue;
            }
            if let Ok(storage) = t.storage() {
                if !own_buffers.contains(&storage.buffer.id()) {
                    *slot = Some(BufInfo {
                        buft: storage.buffer.buffer_type().clone(),
                        weights: storage.buffer.usage() == BufferUsage::Weights,
                        host: storage.buffer.is_host(),
                    });
                }
            }
        }
        for u in 0..total {
            let root = view_root[u];
            if root != NONE {
                buf[u] = buf[root as usize].clone();
            }
        }
        Topology {
            n_nodes,
            n_leafs,
            extras,
            src_start,
            srcs,
            view_root,
            buf,
        }
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
    pub fn signature(&self, graph: &Graph, pinned: &HashMap<u64, usize>) -> Signature {
        let mut words: Vec<u64> = Vec::with_capacity(self.len() * 14 + self.srcs.len() + 4);
        words.push(self.n_nodes as u64);
        words.push(self.n_leafs as u64);
        words.push(self.extras.len() as u64);
        let mut ops = Vec::with_capacity(self.n_nodes);
        for u in 0..self.len() {
            let t = self.tensor(graph, u);
            if u < self.n_nodes {
                ops.push(t.op().clone());
                words.push(self.src_start[u + 1] as u64 - self.src_start[u] as u64);
                words.extend(self.srcs(u).iter().map(|&s| s as u64));
            }
            words.push(t.dtype() as u64);
            words.extend(t.ne().iter().map(|&n| n as u64));
            words.extend(t.nb().iter().map(|&n| n as u64));
            words.push(u64::from(t.flags()));
            words.push(self.view_root[u] as u64);
            words.push(t.view_offset() as u64);
            words.push(match &self.buf[u] {
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
        let mut hasher = DefaultHasher::new();
        words.hash(&mut hasher);
        for op in &ops {
            op.name().hash(&mut hasher);
        }
        Signature {
            hash: hasher.finish(),
            words,
            ops,
        }
    }
}

/// The shape of a graph as far as scheduling is concerned (see [`Topology::signature`]).
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Signature {
    pub hash: u64,
    words: Vec<u64>,
    ops: Vec<Op>,
}
