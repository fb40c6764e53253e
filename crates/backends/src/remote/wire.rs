//! Graphs and tensors on the wire, and the server's validator that rebuilds them.
//!
//! A [`GraphDesc`] lists tensors in dependency order (every operand and view source before its
//! users) with 64-bit shapes, strides and offsets, the op itself (the op IR of [`crate::op`],
//! serialised by serde like the rest of the metadata) and for tensors that own memory the
//! (buffer handle, offset) they are bound to. Nothing on the wire is trusted: [`build_graph`]
//! re-creates every tensor with [`ops::rebuild`], i.e. with the crate's own op builders (which
//! check operand counts, dtypes, shapes and parameters), then insists that the result has
//! exactly the dtype, shape, strides and view offset the wire claimed, binds owners through
//! [`Tensor::bind`] (bounds and alignment checked) to buffers looked up in the session's own
//! table, and only accepts node lists that are in dependency order. What stays here is what only
//! the wire has: tensors it reads but does not compute (layout and memory only), strides it
//! states explicitly, bindings to the session's buffers, and the bounds on how much it may ask.

use std::cell::Cell;
use std::collections::{HashMap, HashSet};

use serde::{Deserialize, Deserializer, Serialize};

use crate::buffer::Buffer;
use crate::context::Context;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::graph::Graph;
use crate::op::Op;
use crate::ops::{self, Layout};
use crate::tensor::{flags, Tensor, TensorSpec, MAX_DIMS};

fn bad(message: String) -> Error {
    Error::InvalidArgument(message)
}

/// One tensor.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TensorDesc {
    /// Element type (on the wire: ggml's type id, checked when decoded).
    pub dtype: DType,
    /// Elements per dimension, ggml order.
    pub ne: [u64; MAX_DIMS],
    /// Byte strides, ggml order.
    pub nb: [u64; MAX_DIMS],
    /// Dimensions the user sees.
    pub ndim: u8,
    /// The op computing the tensor, with its parameters; `None` for an *external* tensor: one
    /// this graph reads but does not compute (a previous split's result, an input copied
    /// earlier), described by its layout and memory only, bound or a view of an earlier tensor.
    pub op: Option<Op>,
    /// Operands: indices of earlier tensors.
    pub srcs: Vec<u32>,
    /// The viewed tensor (an earlier index) and the byte offset into it, for views.
    pub view: Option<(u32, u64)>,
    /// (buffer handle, byte offset) for a tensor that owns its memory.
    pub binding: Option<(u64, u64)>,
    /// Input/output flags.
    pub flags: u8,
}

thread_local! {
    /// The most tensors a graph may have while decoding on this thread (see
    /// [`with_decode_limit`]).
    static DECODE_MAX_TENSORS: Cell<usize> = const { Cell::new(usize::MAX) };
    /// The tensor count a decode refused (the decoder's own error loses the message).
    static DECODE_REFUSED: Cell<Option<usize>> = const { Cell::new(None) };
}

/// Runs `f` (a decode of metadata) with graphs limited to `max_tensors` tensors: a longer
/// tensor list is refused as soon as its length is read, before any tensor is decoded, with an
/// error that says so.
pub fn with_decode_limit<T>(max_tensors: usize, f: impl FnOnce() -> Result<T>) -> Result<T> {
    let before = DECODE_MAX_TENSORS.with(|c| c.replace(max_tensors));
    DECODE_REFUSED.with(|c| c.set(None));
    let result = f();
    DECODE_MAX_TENSORS.with(|c| c.set(before));
    match (result, DECODE_REFUSED.with(Cell::take)) {
        (Err(_), Some(n)) => Err(Error::InvalidArgument(format!(
            "a graph of {n} tensors exceeds the limit of {max_tensors}"
        ))),
        (result, _) => result,
    }
}

fn bounded_tensors<'de, D: Deserializer<'de>>(
    deserializer: D,
) -> std::result::Result<Vec<TensorDesc>, D::Error> {
    struct Bounded;
    impl<'de> serde::de::Visitor<'de> for Bounded {
        type Value = Vec<TensorDesc>;

        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("a list of tensors")
        }

        fn visit_seq<A: serde::de::SeqAccess<'de>>(
            self,
            mut seq: A,
        ) -> std::result::Result<Self::Value, A::Error> {
            use serde::de::Error as _;
            let max = DECODE_MAX_TENSORS.with(Cell::get);
            let too_many = |n: usize| {
                DECODE_REFUSED.with(|c| c.set(Some(n)));
                A::Error::custom(format!("a graph of {n} tensors exceeds the limit of {max}"))
            };
            let announced = seq.size_hint().unwrap_or(0);
            if announced > max {
                return Err(too_many(announced));
            }
            let mut tensors = Vec::with_capacity(announced.min(1024));
            while let Some(t) = seq.next_element()? {
                if tensors.len() == max {
                    return Err(too_many(max + 1));
                }
                tensors.push(t);
            }
            Ok(tensors)
        }
    }
    deserializer.deserialize_seq(Bounded)
}

/// A graph: tensors in dependency order, and which of them are nodes and leafs.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct GraphDesc {
    /// Every tensor the graph touches (decoding stops at the limit of [`with_decode_limit`]).
    #[serde(deserialize_with = "bounded_tensors")]
    pub tensors: Vec<TensorDesc>,
    /// Indices of the nodes, in execution order.
    pub nodes: Vec<u32>,
    /// Indices of the leafs.
    pub leafs: Vec<u32>,
}

/// Maps a tensor's memory to (server buffer handle, offset); `None` leaves it unbound.
pub type Resolver<'a> = dyn Fn(&Tensor) -> Result<Option<(u64, u64)>> + 'a;

/// Builds descriptions of tensors on the client side.
///
/// Tensors of the graph (its nodes and leafs) are described with their op and operands;
/// anything else they read is *external* (`op: None`): its layout and memory only, so a split
/// never drags its predecessors' history onto the wire.
pub struct Describer<'a> {
    desc: GraphDesc,
    index: HashMap<u64, u32>,
    members: HashSet<u64>,
    resolve: &'a Resolver<'a>,
}

impl<'a> Describer<'a> {
    /// A describer that binds owners through `resolve`.
    pub fn new(resolve: &'a Resolver<'a>) -> Self {
        Describer {
            desc: GraphDesc::default(),
            index: HashMap::new(),
            members: HashSet::new(),
            resolve,
        }
    }

    /// Adds `tensor` and, first, everything it depends on; returns its index.
    pub fn add(&mut self, tensor: &Tensor) -> Result<u32> {
        if let Some(&i) = self.index.get(&tensor.id()) {
            return Ok(i);
        }
        // Iterative post-order over operands and view sources (deep graphs must not recurse).
        let mut stack: Vec<(Tensor, bool)> = vec![(tensor.clone(), false)];
        while let Some((t, expanded)) = stack.pop() {
            if self.index.contains_key(&t.id()) {
                continue;
            }
            let member = self.members.contains(&t.id());
            if !expanded {
                stack.push((t.clone(), true));
                let srcs = if member { t.srcs() } else { &[] };
                for dep in srcs.iter().rev().chain(t.view_src()) {
                    if !self.index.contains_key(&dep.id()) {
                        stack.push((dep.clone(), false));
                    }
                }
                continue;
            }
            let idx = |x: &Tensor, index: &HashMap<u64, u32>| {
                index
                    .get(&x.id())
                    .copied()
                    .ok_or_else(|| bad("internal: operand not described".into()))
            };
            let srcs = if member {
                t.srcs()
                    .iter()
                    .map(|s| idx(s, &self.index))
                    .collect::<Result<Vec<_>>>()?
            } else {
                Vec::new()
            };
            let view = match t.view_src() {
                Some(v) => Some((idx(v, &self.index)?, t.view_offset() as u64)),
                None => None,
            };
            let binding = if t.is_view() {
                None
            } else {
                (self.resolve)(&t)?
            };
            let i = u32::try_from(self.desc.tensors.len())
                .map_err(|_| bad("graph has too many tensors".into()))?;
            let op = if member {
                t.op().check_portable()?;
                Some(t.op().clone())
            } else {
                None
            };
            self.desc.tensors.push(TensorDesc {
                dtype: t.dtype(),
                ne: t.ne().map(|x| x as u64),
                nb: t.nb().map(|x| x as u64),
                ndim: t.ndim() as u8,
                op,
                srcs,
                view,
                binding,
                flags: t.flags() & (flags::INPUT | flags::OUTPUT),
            });
            self.index.insert(t.id(), i);
        }
        Ok(self.index[&tensor.id()])
    }

    /// Describes a whole graph.
    pub fn graph(mut self, graph: &Graph) -> Result<GraphDesc> {
        self.members = graph
            .leafs()
            .iter()
            .chain(graph.nodes())
            .map(Tensor::id)
            .collect();
        for leaf in graph.leafs() {
            let i = self.add(leaf)?;
            self.desc.leafs.push(i);
        }
        for node in graph.nodes() {
            let i = self.add(node)?;
            self.desc.nodes.push(i);
        }
        Ok(self.desc)
    }

    /// Describes one op with its operands, unbound (for `supports_op` questions).
    pub fn single(mut self, op: &Tensor) -> Result<GraphDesc> {
        self.members.insert(op.id());
        let i = self.add(op)?;
        self.desc.nodes.push(i);
        Ok(self.desc)
    }
}

/// Limits the validator applies.
#[derive(Debug, Clone, Copy)]
pub struct GraphLimits {
    /// Most tensors in one graph.
    pub max_tensors: usize,
}

fn to_usize(x: u64, what: &str) -> Result<usize> {
    usize::try_from(x).map_err(|_| bad(format!("{what} {x} does not fit this machine")))
}

/// Re-creates one tensor from already built operands: an external tensor from its layout, any
/// other through [`ops::rebuild`], then checks that the result is exactly what the wire said.
fn build_tensor(ctx: &Context, t: &TensorDesc, built: &[Tensor]) -> Result<Tensor> {
    let dtype = t.dtype;
    let ndim = t.ndim as usize;
    if !(1..=MAX_DIMS).contains(&ndim) {
        return Err(bad(format!("ndim {ndim} is outside 1..={MAX_DIMS}")));
    }
    let mut ne = [0usize; MAX_DIMS];
    let mut nb = [0usize; MAX_DIMS];
    for i in 0..MAX_DIMS {
        ne[i] = to_usize(t.ne[i], "dimension")?;
        nb[i] = to_usize(t.nb[i], "stride")?;
    }
    if ne[ndim..].iter().any(|&n| n != 1) {
        return Err(bad(format!(
            "shape {ne:?} has dimensions beyond ndim {ndim}"
        )));
    }
    let earlier = |i: u32, what: &str| -> Result<Tensor> {
        built
            .get(i as usize)
            .cloned()
            .ok_or_else(|| bad(format!("{what} {i} does not name an earlier tensor")))
    };
    let view = match t.view {
        Some((v, offset)) => Some((earlier(v, "view source")?, to_usize(offset, "view offset")?)),
        None => None,
    };
    let result = match &t.op {
        None => {
            if !t.srcs.is_empty() {
                return Err(bad("an external tensor has no operands".into()));
            }
            // Any strides: the span they give is checked against the viewed tensor here, or
            // against the buffer when bound.
            ops::check_strides(dtype, &ne, &nb, "external tensor")?;
            ctx.create(TensorSpec {
                dtype,
                ne,
                nb: Some(nb),
                ndim,
                op: Op::None,
                srcs: Vec::new(),
                view: view.clone(),
            })?
        }
        Some(op) => {
            if matches!(op, Op::View) {
                // The only op whose strides come from the wire: checked like an external
                // tensor's (a view may be an operand a kernel writes through).
                ops::check_strides(dtype, &ne, &nb, "VIEW")?;
            }
            let srcs = t
                .srcs
                .iter()
                .map(|&i| earlier(i, "operand index"))
                .collect::<Result<Vec<_>>>()?;
            let layout = Layout {
                dtype,
                ne,
                nb,
                ndim,
                view_offset: view.as_ref().map_or(0, |(_, offset)| *offset),
            };
            ops::rebuild(ctx, op, &srcs, &layout)?
        }
    };
    // The builder decided dtype, shape, strides and view; the wire must agree exactly.
    let same_strides = (0..MAX_DIMS).all(|i| ne[i] <= 1 || result.nb()[i] == nb[i]);
    if result.dtype() != dtype || result.ne() != ne || !same_strides {
        return Err(Error::shape(format!(
            "{} of {:?} would be {} {:?} (strides {:?}), the request said {} {:?} (strides {:?})",
            result.op().name(),
            result.srcs().iter().map(|s| s.shape()).collect::<Vec<_>>(),
            result.dtype(),
            result.ne(),
            result.nb(),
            dtype,
            ne,
            nb
        )));
    }
    match (&view, result.view_src()) {
        (None, None) => {}
        (Some((claimed, offset)), Some(root)) => {
            let claimed_root = claimed.view_src().unwrap_or(claimed);
            if !claimed_root.same(root) || result.view_offset() != *offset {
                return Err(bad(format!(
                    "{} views another tensor or offset than the request said",
                    result.op().name()
                )));
            }
        }
        _ => {
            return Err(bad(format!(
                "{} is {}a view, the request said otherwise",
                result.op().name(),
                if result.is_view() { "" } else { "not " }
            )))
        }
    }
    Ok(result)
}

/// A validated graph rebuilt on the server.
pub struct BuiltGraph {
    /// The graph, its tensors bound to session buffers.
    pub graph: Graph,
    /// Handles of the buffers it uses (freeing one invalidates the graph).
    pub buffers: Vec<u64>,
    /// Keeps the tensors' context alive.
    pub context: Context,
}

/// Validates `desc` and rebuilds it: every tensor through the op builders, owners bound to
/// buffers from `lookup` (unless `bind` is false, for `supports_op` questions), nodes in
/// dependency order.
pub fn build_graph(
    desc: &GraphDesc,
    lookup: &dyn Fn(u64) -> Result<Buffer>,
    bind: bool,
    limits: GraphLimits,
) -> Result<BuiltGraph> {
    if desc.tensors.len() > limits.max_tensors {
        return Err(bad(format!(
            "graph of {} tensors exceeds the limit of {}",
            desc.tensors.len(),
            limits.max_tensors
        )));
    }
    let context = Context::new(true);
    let mut built: Vec<Tensor> = Vec::with_capacity(desc.tensors.len());
    let mut buffers: Vec<u64> = Vec::new();
    for (i, t) in desc.tensors.iter().enumerate() {
        if t.srcs
            .iter()
            .chain(t.view.as_ref().map(|(v, _)| v))
            .any(|&s| s as usize >= i)
        {
            return Err(bad(format!(
                "tensor {i} refers to a tensor that is not before it"
            )));
        }
        let tensor = build_tensor(&context, t, &built).map_err(|e| match e {
            Error::ShapeMismatch { message: m, .. } => Error::shape(format!("tensor {i}: {m}")),
            Error::DType(m) => Error::DType(format!("tensor {i}: {m}")),
            Error::InvalidArgument(m) => Error::InvalidArgument(format!("tensor {i}: {m}")),
            other => other,
        })?;
        if t.flags & flags::INPUT != 0 {
            tensor.set_input();
        }
        if t.flags & flags::OUTPUT != 0 {
            tensor.set_output();
        }
        match (tensor.is_view(), t.binding, bind) {
            (true, Some(_), _) => {
                return Err(bad(format!("tensor {i} is a view and cannot be bound")))
            }
            (false, Some((handle, offset)), true) => {
                let buffer = lookup(handle)?;
                tensor.bind(&buffer, to_usize(offset, "offset")?)?;
                if !buffers.contains(&handle) {
                    buffers.push(handle);
                }
            }
            (false, None, true) => {
                return Err(Error::NotAllocated(format!(
                    "tensor {i} ({}) has no memory on this server",
                    tensor.op().name()
                )))
            }
            _ => {}
        }
        built.push(tensor);
    }
    let mut graph = Graph::new();
    let mut last_node: Option<u32> = None;
    let mut in_graph = vec![false; built.len()];
    for &i in &desc.nodes {
        // Strictly increasing indices: every operand was described (so computed) earlier.
        if last_node.is_some_and(|last| i <= last) || i as usize >= built.len() {
            return Err(bad(format!(
                "node list is not in dependency order (or names tensor {i} twice)"
            )));
        }
        last_node = Some(i);
        if desc.tensors[i as usize].op.is_none() {
            return Err(bad(format!("node {i} is an external tensor")));
        }
        in_graph[i as usize] = true;
        graph.add_node(&built[i as usize])?;
    }
    for &i in &desc.leafs {
        let Some(tensor) = built.get(i as usize) else {
            return Err(bad(format!("leaf {i} is not a tensor of the graph")));
        };
        if in_graph[i as usize] {
            return Err(bad(format!("tensor {i} is listed twice")));
        }
        in_graph[i as usize] = true;
        graph.add_leaf(tensor)?;
    }
    Ok(BuiltGraph {
        graph,
        buffers,
        context,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::samples::one_of_each;
    use crate::remote::protocol::{decode_meta, encode_meta};
    use proptest::prelude::*;

    fn unbound(_: &Tensor) -> Result<Option<(u64, u64)>> {
        Ok(None)
    }

    fn no_buffers(h: u64) -> Result<Buffer> {
        Err(bad(format!("no buffer {h}")))
    }

    const LIMITS: GraphLimits = GraphLimits { max_tensors: 256 };

    #[test]
    fn every_op_survives_the_wire() {
        let ctx = Context::new(true);
        let originals = one_of_each(&ctx);
        let (custom, portable) = originals.split_last().unwrap();
        for t in portable {
            let what = t.op().display_name();
            let desc = Describer::new(&unbound).single(t).unwrap();
            let bytes = encode_meta(&desc).unwrap();
            let decoded: GraphDesc = decode_meta(&bytes).unwrap();
            assert_eq!(decoded, desc, "{what}");
            let built = build_graph(&decoded, &no_buffers, false, LIMITS)
                .unwrap_or_else(|e| panic!("{what}: {e}"));
            let r = &built.graph.nodes()[0];
            assert_eq!(r.op(), t.op(), "{what}");
            assert_eq!(r.dtype(), t.dtype(), "{what}");
            assert_eq!((r.ne(), r.ndim()), (t.ne(), t.ndim()), "{what}");
            assert_eq!(r.is_view(), t.is_view(), "{what}");
            assert_eq!(r.view_offset(), t.view_offset(), "{what}");
            for (a, b) in r.srcs().iter().zip(t.srcs()) {
                assert_eq!((a.dtype(), a.ne()), (b.dtype(), b.ne()), "{what}");
            }
        }
        // A custom op stays home, with an error that says why.
        let err = Describer::new(&unbound).single(custom).err().unwrap();
        assert!(
            err.to_string()
                .contains("custom ops cannot be sent to a remote device"),
            "{err}"
        );
        assert!(encode_meta(custom.op()).is_err());
    }

    /// One bound graph of every portable op, encoded, and the buffer it is bound to.
    fn valid_frame() -> (Vec<u8>, Buffer) {
        let ctx = Context::new(true);
        let mut tensors = one_of_each(&ctx);
        tensors.pop(); // the custom op
        let next = Cell::new(0u64);
        let resolve = |t: &Tensor| {
            let at = next.get();
            next.set(at + (t.nbytes() as u64).div_ceil(64) * 64);
            Ok(Some((0, at)))
        };
        let desc = Describer::new(&resolve)
            .graph(&Graph::build(&tensors))
            .unwrap();
        let buffer = crate::buffer::alloc_cpu_buffer(next.get() as usize).unwrap();
        (encode_meta(&desc).unwrap(), buffer)
    }

    /// Decodes and rebuilds `bytes` as the server does; any outcome but a panic is fine.
    fn decode_and_build(bytes: &[u8], buffer: &Buffer) -> Result<()> {
        let desc: GraphDesc = with_decode_limit(LIMITS.max_tensors, || decode_meta(bytes))?;
        let lookup = |h: u64| {
            if h == 0 {
                Ok(buffer.clone())
            } else {
                no_buffers(h)
            }
        };
        build_graph(&desc, &lookup, false, LIMITS)?;
        build_graph(&desc, &lookup, true, LIMITS).map(|_| ())
    }

    #[test]
    fn the_valid_frame_is_accepted() {
        let (bytes, buffer) = valid_frame();
        decode_and_build(&bytes, &buffer).unwrap();
    }

    #[test]
    fn unknown_dtypes_and_ops_are_decode_errors() {
        let (bytes, buffer) = valid_frame();
        let desc: GraphDesc = decode_meta(&bytes).unwrap();
        // The first tensor's dtype is its first byte after the list's length (one byte).
        assert_eq!(bytes[1], DType::F32.ggml_type_id() as u8);
        for id in [31u8, 99, 127] {
            let mut b = bytes.clone();
            b[1] = id;
            let err = decode_and_build(&b, &buffer).unwrap_err();
            assert!(err.to_string().contains("malformed"), "{err}");
        }
        // An op number past the last portable op (the custom op's, and beyond).
        let mut t = desc.tensors[0].clone();
        t.op = None;
        let external = encode_meta(&t).unwrap();
        t.op = Some(Op::Dup);
        let mut one = encode_meta(&t).unwrap();
        // Where the two differ is the option's tag; the op's number follows it.
        let tag = (0..external.len())
            .find(|&i| external[i] != one[i])
            .unwrap();
        let at = tag + 1;
        assert_eq!(one[at], 1, "DUP is op 1");
        for n in [43u8, 44, 127] {
            one[at] = n;
            assert!(decode_meta::<TensorDesc>(&one).is_err(), "op {n}");
        }
    }

    #[derive(Debug, Clone)]
    enum Mutation {
        Set(usize, u8),
        Flip(usize, u8),
        Insert(usize, u8),
        Remove(usize),
        Truncate(usize),
    }

    fn mutation() -> impl Strategy<Value = Mutation> {
        prop_oneof![
            (any::<usize>(), any::<u8>()).prop_map(|(i, b)| Mutation::Set(i, b)),
            (any::<usize>(), 0u8..8).prop_map(|(i, bit)| Mutation::Flip(i, bit)),
            (any::<usize>(), any::<u8>()).prop_map(|(i, b)| Mutation::Insert(i, b)),
            any::<usize>().prop_map(Mutation::Remove),
            any::<usize>().prop_map(Mutation::Truncate),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

        /// Random bytes decode to an error or to a graph that is rebuilt or refused.
        #[test]
        fn random_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..400)) {
            let buffer = crate::buffer::alloc_cpu_buffer(4096).unwrap();
            let _ = decode_and_build(&bytes, &buffer);
        }

        /// A valid frame with a few bytes changed, inserted or removed: still never a panic.
        #[test]
        fn mutated_frames_never_panic(mutations in prop::collection::vec(mutation(), 1..5)) {
            let (mut bytes, buffer) = valid_frame();
            for m in mutations {
                let n = bytes.len().max(1);
                match m {
                    Mutation::Set(i, b) => {
                        if let Some(x) = bytes.get_mut(i % n) {
                            *x = b;
                        }
                    }
                    Mutation::Flip(i, bit) => {
                        if let Some(x) = bytes.get_mut(i % n) {
                            *x ^= 1 << bit;
                        }
                    }
                    Mutation::Insert(i, b) => bytes.insert(i % (bytes.len() + 1), b),
                    Mutation::Remove(i) => {
                        if !bytes.is_empty() {
                            bytes.remove(i % n);
                        }
                    }
                    Mutation::Truncate(i) => bytes.truncate(i % n),
                }
            }
            let _ = decode_and_build(&bytes, &buffer);
        }
    }
}
