//! Copying a graph to another backend, and checking two backends against each other node by
//! node ([`compare_graph_backend`], the tool the test suites use to compare a backend with the
//! CPU).

use std::collections::HashMap;
use std::sync::{Arc, Weak};

use crate::alloc::dyn_alloc::align_up;
use crate::alloc::{view_init, TensorAllocator};
use crate::backend::{tensor_copy, Backend};
use crate::buffer::Buffer;
use crate::error::{Error, Result, Status};
use crate::graph::Graph;
use crate::tensor::{Tensor, TensorSpec};

/// A graph duplicated onto another backend: fresh tensors with the same ops, shapes and names,
/// allocated in one buffer of that backend and holding a copy of the source tensors' data.
pub struct GraphCopy {
    /// The copied graph (same node and leaf order as the source).
    pub graph: Graph,
    /// The buffer holding every copied tensor.
    pub buffer: Buffer,
    map: HashMap<u64, Tensor>,
}

impl GraphCopy {
    /// The copy of `tensor` (a tensor of the source graph), if it was copied.
    pub fn copy_of(&self, tensor: &Tensor) -> Option<&Tensor> {
        self.map.get(&tensor.id())
    }
}

/// Duplicates `tensor` (and, first, everything it depends on) into `map`.
fn duplicate(
    tensor: &Tensor,
    map: &mut HashMap<u64, Tensor>,
    order: &mut Vec<Tensor>,
) -> Result<Tensor> {
    if let Some(done) = map.get(&tensor.id()) {
        return Ok(done.clone());
    }
    // Iterative post-order so deep graphs cannot overflow the stack.
    let mut stack: Vec<(Tensor, bool)> = vec![(tensor.clone(), false)];
    while let Some((t, expanded)) = stack.pop() {
        if map.contains_key(&t.id()) {
            continue;
        }
        let deps: Vec<Tensor> = t.srcs().iter().chain(t.view_src()).cloned().collect();
        if !expanded {
            stack.push((t.clone(), true));
            for d in deps.iter().filter(|d| !map.contains_key(&d.id())) {
                stack.push((d.clone(), false));
            }
            continue;
        }
        let srcs = t
            .srcs()
            .iter()
            .map(|s| map.get(&s.id()).cloned())
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| Error::InvalidArgument("graph copy: operand missing".into()))?;
        let view = match t.view_src() {
            Some(root) => Some((
                map.get(&root.id()).cloned().ok_or_else(|| {
                    Error::InvalidArgument("graph copy: view source missing".into())
                })?,
                t.view_offset(),
            )),
            None => None,
        };
        let copy = Tensor::from_spec(
            TensorSpec {
                dtype: t.dtype(),
                ne: t.ne(),
                nb: Some(t.nb()),
                ndim: t.ndim(),
                op: t.op().clone(),
                srcs,
                view,
            },
            Weak::new(),
        )?;
        copy.set_name(&t.name());
        if t.is_input() {
            copy.set_input();
        }
        if t.is_output() {
            copy.set_output();
        }
        map.insert(t.id(), copy.clone());
        order.push(t);
    }
    map.get(&tensor.id())
        .cloned()
        .ok_or_else(|| Error::InvalidArgument("graph copy failed".into()))
}

/// Copies `graph` to `backend` (ggml's `graph_copy`): every tensor the graph reaches gets a
/// duplicate allocated in one buffer of the backend's default type, and the data of every
/// source tensor that has memory is copied over.
pub fn graph_copy(backend: &dyn Backend, graph: &Graph) -> Result<GraphCopy> {
    let mut map = HashMap::new();
    let mut order = Vec::new();
    for t in graph.leafs().iter().chain(graph.nodes()) {
        duplicate(t, &mut map, &mut order)?;
    }
    let buft = backend.default_buffer_type();
    let alignment = buft.alignment().max(1);
    let mut size = 0usize;
    for t in order.iter().filter(|t| !t.is_view()) {
        let need = align_up(buft.alloc_size(t), alignment)
            .ok_or_else(|| Error::alloc("graph copy: tensor too large"))?;
        size = size
            .checked_add(need)
            .ok_or_else(|| Error::alloc("graph copy: graph too large"))?;
    }
    let buffer = Arc::clone(&buft).alloc_buffer(size)?;
    let mut talloc = TensorAllocator::new(&buffer);
    for t in &order {
        if let Some(copy) = map.get(&t.id()) {
            if t.is_view() {
                view_init(copy)?;
            } else {
                talloc.alloc(copy)?;
            }
        }
    }
    for t in order.iter().filter(|t| !t.is_view() && t.is_allocated()) {
        if let Some(copy) = map.get(&t.id()) {
            tensor_copy(t, copy)?;
        }
    }
    let mut copied = Graph::new();
    for leaf in graph.leafs() {
        if let Some(c) = map.get(&leaf.id()) {
            copied.add_leaf(c)?;
        }
    }
    for node in graph.nodes() {
        if let Some(c) = map.get(&node.id()) {
            copied.add_node(c)?;
        }
    }
    Ok(GraphCopy {
        graph: copied,
        buffer,
        map,
    })
}

/// Computes `graph` on `backend1` (where its tensors live) and a copy of it on `backend2`,
/// one node at a time, calling `callback(index, node_on_1, node_on_2)` after each non-view
/// node; a `false` return stops early. Returns whether every node was compared (true) or the
/// callback stopped it (false). Errors of either backend are returned.
pub fn compare_graph_backend(
    backend1: &dyn Backend,
    backend2: &dyn Backend,
    graph: &Graph,
    mut callback: impl FnMut(usize, &Tensor, &Tensor) -> bool,
) -> Result<bool> {
    let copy = graph_copy(backend2, graph)?;
    for (i, (t1, t2)) in graph.nodes().iter().zip(copy.graph.nodes()).enumerate() {
        let g1 = graph.view(i, i + 1)?;
        let g2 = copy.graph.view(i, i + 1)?;
        for (status, name) in [
            (backend1.graph_compute(&g1)?, backend1.name()),
            (backend2.graph_compute(&g2)?, backend2.name()),
        ] {
            if status != Status::Success {
                return Err(Error::Backend(format!(
                    "compare_graph_backend: {name} returned {status} at node {i}"
                )));
            }
        }
        if t1.op().is_view_op() {
            continue;
        }
        if !callback(i, t1, t2) {
            return Ok(false);
        }
    }
    Ok(true)
}
