//! Graphs and tensors on the wire, and the server's validator that rebuilds them.
//!
//! A [`GraphDesc`] lists tensors in dependency order (every operand and view source before its
//! users) with 64-bit shapes, strides and offsets, the op and its parameters, and for tensors
//! that own memory the (buffer handle, offset) they are bound to. Nothing on the wire is
//! trusted: [`build_graph`] re-creates every tensor with the crate's own op builders (which
//! check operand counts, dtypes and shapes), then insists that the result has exactly the
//! dtype, shape, strides and view offset the wire claimed, binds owners through
//! [`Tensor::bind`] (bounds and alignment checked) to buffers looked up in the session's own
//! table, and only accepts node lists that are in dependency order.

use std::cell::Cell;
use std::collections::{HashMap, HashSet};

use serde::{Deserialize, Deserializer, Serialize};

use crate::buffer::Buffer;
use crate::context::Context;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::graph::Graph;
use crate::ops::{self, GluOp, Op, RopeMode, RopeParams, UnaryOp};
use crate::tensor::{flags, Tensor, TensorSpec, MAX_DIMS};

/// Element types by wire number: `DType::ALL`, whose order is append-only for this reason.
const DTYPES: [DType; DType::ALL.len()] = DType::ALL;

const GLU_OPS: [GluOp; 3] = [GluOp::Reglu, GluOp::Geglu, GluOp::Swiglu];

fn dtype_code(dtype: DType) -> u8 {
    DTYPES.iter().position(|&d| d == dtype).unwrap_or(0) as u8
}

fn dtype_from_code(code: u8) -> Result<DType> {
    DTYPES
        .get(code as usize)
        .copied()
        .ok_or_else(|| Error::DType(format!("unknown dtype number {code}")))
}

fn bad(message: String) -> Error {
    Error::InvalidArgument(message)
}

/// An op and its parameters.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[allow(missing_docs)]
pub enum OpDesc {
    /// A tensor this graph does not compute but reads (a previous split's result, an input
    /// copied earlier): its layout as is, bound to memory or a view of an earlier tensor.
    External,
    None,
    Dup,
    Add,
    Sub,
    Mul,
    Div,
    Add1,
    Acc {
        nb1: u64,
        nb2: u64,
        nb3: u64,
        offset: u64,
    },
    Sqr,
    Sqrt,
    Log,
    Sin,
    Cos,
    Sum,
    SumRows,
    Mean,
    Argmax,
    Repeat,
    Concat {
        dim: u8,
    },
    Unary(u8),
    LeakyRelu(f32),
    Glu {
        op: u8,
        swapped: bool,
    },
    Norm(f32),
    RmsNorm(f32),
    GroupNorm {
        n_groups: u64,
        eps: f32,
    },
    L2Norm(f32),
    MulMat,
    MulMatId,
    OutProd,
    Scale {
        s: f32,
        b: f32,
    },
    Cpy,
    Cont,
    Reshape,
    View,
    Permute([u8; 4]),
    Transpose,
    GetRows,
    SetRows,
    DiagMaskInf(u64),
    SoftMax {
        scale: f32,
        max_bias: f32,
    },
    Rope {
        n_dims: u64,
        neox: bool,
        n_ctx_orig: u64,
        freq_base: f32,
        freq_scale: f32,
        ext_factor: f32,
        attn_factor: f32,
        beta_fast: f32,
        beta_slow: f32,
    },
    Clamp {
        min: f32,
        max: f32,
    },
    FlashAttnExt {
        scale: f32,
        max_bias: f32,
        logit_softcap: f32,
    },
}

/// One tensor.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TensorDesc {
    /// Element type (wire number).
    pub dtype: u8,
    /// Elements per dimension, ggml order.
    pub ne: [u64; MAX_DIMS],
    /// Byte strides, ggml order.
    pub nb: [u64; MAX_DIMS],
    /// Dimensions the user sees.
    pub ndim: u8,
    /// The op.
    pub op: OpDesc,
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

fn op_desc(op: &Op) -> Result<OpDesc> {
    let f = |x: usize| x as u64;
    Ok(match op {
        Op::None => OpDesc::None,
        Op::Dup => OpDesc::Dup,
        Op::Add => OpDesc::Add,
        Op::Sub => OpDesc::Sub,
        Op::Mul => OpDesc::Mul,
        Op::Div => OpDesc::Div,
        Op::Add1 => OpDesc::Add1,
        &Op::Acc {
            nb1,
            nb2,
            nb3,
            offset,
        } => OpDesc::Acc {
            nb1: f(nb1),
            nb2: f(nb2),
            nb3: f(nb3),
            offset: f(offset),
        },
        Op::Sqr => OpDesc::Sqr,
        Op::Sqrt => OpDesc::Sqrt,
        Op::Log => OpDesc::Log,
        Op::Sin => OpDesc::Sin,
        Op::Cos => OpDesc::Cos,
        Op::Sum => OpDesc::Sum,
        Op::SumRows => OpDesc::SumRows,
        Op::Mean => OpDesc::Mean,
        Op::Argmax => OpDesc::Argmax,
        Op::Repeat => OpDesc::Repeat,
        &Op::Concat { dim } => OpDesc::Concat { dim: dim as u8 },
        Op::Unary(u) => OpDesc::Unary(UnaryOp::ALL.iter().position(|x| x == u).unwrap_or(0) as u8),
        &Op::LeakyRelu { negative_slope } => OpDesc::LeakyRelu(negative_slope),
        &Op::Glu { op, swapped } => OpDesc::Glu {
            op: GLU_OPS.iter().position(|&x| x == op).unwrap_or(0) as u8,
            swapped,
        },
        &Op::Norm { eps } => OpDesc::Norm(eps),
        &Op::RmsNorm { eps } => OpDesc::RmsNorm(eps),
        &Op::GroupNorm { n_groups, eps } => OpDesc::GroupNorm {
            n_groups: f(n_groups),
            eps,
        },
        &Op::L2Norm { eps } => OpDesc::L2Norm(eps),
        Op::MulMat => OpDesc::MulMat,
        Op::MulMatId => OpDesc::MulMatId,
        Op::OutProd => OpDesc::OutProd,
        &Op::Scale { s, b } => OpDesc::Scale { s, b },
        Op::Cpy => OpDesc::Cpy,
        Op::Cont => OpDesc::Cont,
        Op::Reshape => OpDesc::Reshape,
        Op::View => OpDesc::View,
        Op::Permute { axes } => OpDesc::Permute(axes.map(|a| a as u8)),
        Op::Transpose => OpDesc::Transpose,
        Op::GetRows => OpDesc::GetRows,
        Op::SetRows => OpDesc::SetRows,
        &Op::DiagMaskInf { n_past } => OpDesc::DiagMaskInf(f(n_past)),
        &Op::SoftMax { scale, max_bias } => OpDesc::SoftMax { scale, max_bias },
        Op::Rope(p) => OpDesc::Rope {
            n_dims: f(p.n_dims),
            neox: p.mode == RopeMode::Neox,
            n_ctx_orig: f(p.n_ctx_orig),
            freq_base: p.freq_base,
            freq_scale: p.freq_scale,
            ext_factor: p.ext_factor,
            attn_factor: p.attn_factor,
            beta_fast: p.beta_fast,
            beta_slow: p.beta_slow,
        },
        &Op::Clamp { min, max } => OpDesc::Clamp { min, max },
        &Op::FlashAttnExt {
            scale,
            max_bias,
            logit_softcap,
        } => OpDesc::FlashAttnExt {
            scale,
            max_bias,
            logit_softcap,
        },
        Op::Custom(c) => {
            return Err(Error::UnsupportedOp(format!(
                "custom op {} runs Python or Rust code of this process and cannot be sent to a \
                 remote device",
                c.0.name()
            )))
        }
    })
}

/// Maps a tensor's memory to (server buffer handle, offset); `None` leaves it unbound.
pub type Resolver<'a> = dyn Fn(&Tensor) -> Result<Option<(u64, u64)>> + 'a;

/// Builds descriptions of tensors on the client side.
///
/// Tensors of the graph (its nodes and leafs) are described with their op and operands;
/// anything else they read is [`OpDesc::External`]: its layout and memory only, so a split
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
            self.desc.tensors.push(TensorDesc {
                dtype: dtype_code(t.dtype()),
                ne: t.ne().map(|x| x as u64),
                nb: t.nb().map(|x| x as u64),
                ndim: t.ndim() as u8,
                op: if member {
                    op_desc(t.op())?
                } else {
                    OpDesc::External
                },
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

/// Checks explicit strides: the span they give must be computable without overflow, elements
/// must not overlap, and quantized rows must be dense blocks (their kernels read whole blocks).
fn check_strides(dtype: DType, ne: &[usize; MAX_DIMS], nb: &[usize; MAX_DIMS]) -> Result<()> {
    crate::tensor::check_shape(dtype, ne, "external tensor")?;
    if dtype.is_quantized() && nb[0] != dtype.type_size() {
        return Err(bad(format!(
            "quantized ({dtype}) rows must be dense, got element stride {}",
            nb[0]
        )));
    }
    let span = (0..MAX_DIMS).try_fold(dtype.type_size(), |acc, i| {
        ne[i]
            .saturating_sub(1)
            .checked_mul(nb[i])
            .and_then(|x| acc.checked_add(x))
    });
    if span.is_none_or(|s| s > isize::MAX as usize) {
        return Err(bad(format!("strides {nb:?} of shape {ne:?} overflow")));
    }
    // No two elements may share bytes: kernels write such tensors from several threads.
    let mut dims: Vec<(usize, usize)> = (0..MAX_DIMS)
        .map(|i| {
            let n = if i == 0 {
                ne[0] / dtype.block_size()
            } else {
                ne[i]
            };
            (n, nb[i])
        })
        .filter(|&(n, _)| n > 1)
        .collect();
    dims.sort_by_key(|&(_, stride)| stride);
    let mut extent = dtype.type_size();
    for (n, stride) in dims {
        if stride < extent {
            return Err(bad(format!(
                "strides {nb:?} of shape {ne:?} make elements overlap"
            )));
        }
        extent += (n - 1) * stride;
    }
    Ok(())
}

/// Re-creates one tensor with the op builders from already built operands.
fn build_tensor(ctx: &Context, t: &TensorDesc, built: &[Tensor]) -> Result<Tensor> {
    let dtype = dtype_from_code(t.dtype)?;
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
    let src = |k: usize| -> Result<&Tensor> {
        let i = *t
            .srcs
            .get(k)
            .ok_or_else(|| bad(format!("{:?} is missing operand {k}", t.op)))?;
        built
            .get(i as usize)
            .ok_or_else(|| bad(format!("operand index {i} does not name an earlier tensor")))
    };
    let n_srcs = |allowed: &[usize]| -> Result<()> {
        if allowed.contains(&t.srcs.len()) {
            Ok(())
        } else {
            Err(bad(format!(
                "{:?} takes {allowed:?} operands, got {}",
                t.op,
                t.srcs.len()
            )))
        }
    };
    let opt = |k: usize| -> Result<Option<&Tensor>> {
        if t.srcs.len() > k {
            src(k).map(Some)
        } else {
            Ok(None)
        }
    };
    let u = |x: u64, what: &str| to_usize(x, what);
    let result = match &t.op {
        OpDesc::External => {
            n_srcs(&[0])?;
            check_strides(dtype, &ne, &nb)?;
            // Any strides: the span they give is checked against the viewed tensor here, or
            // against the buffer when bound.
            let view = match t.view {
                Some((v, offset)) => Some((
                    built
                        .get(v as usize)
                        .ok_or_else(|| bad(format!("view source {v} is not an earlier tensor")))?
                        .clone(),
                    u(offset, "view offset")?,
                )),
                None => None,
            };
            ctx.create(TensorSpec {
                dtype,
                ne,
                nb: Some(nb),
                ndim,
                op: Op::None,
                srcs: Vec::new(),
                view,
            })?
        }
        OpDesc::None => {
            n_srcs(&[0])?;
            if t.view.is_some() {
                return Err(bad("a leaf cannot be a view".into()));
            }
            ctx.new_tensor(dtype, &ne[..ndim])?
        }
        OpDesc::Dup => {
            n_srcs(&[1])?;
            ops::dup(ctx, src(0)?)?
        }
        OpDesc::Add | OpDesc::Sub | OpDesc::Mul | OpDesc::Div => {
            n_srcs(&[2])?;
            let (a, b) = (src(0)?, src(1)?);
            match t.op {
                OpDesc::Add => ops::add(ctx, a, b)?,
                OpDesc::Sub => ops::sub(ctx, a, b)?,
                OpDesc::Mul => ops::mul(ctx, a, b)?,
                _ => ops::div(ctx, a, b)?,
            }
        }
        OpDesc::Add1 => {
            n_srcs(&[2])?;
            ops::add1(ctx, src(0)?, src(1)?)?
        }
        &OpDesc::Acc {
            nb1,
            nb2,
            nb3,
            offset,
        } => {
            n_srcs(&[2])?;
            let region = [4, u(nb1, "stride")?, u(nb2, "stride")?, u(nb3, "stride")?];
            check_strides(DType::F32, &src(1)?.ne(), &region)?;
            ops::acc(
                ctx,
                src(0)?,
                src(1)?,
                region[1],
                region[2],
                region[3],
                u(offset, "offset")?,
            )?
        }
        OpDesc::Sqr | OpDesc::Sqrt | OpDesc::Log | OpDesc::Sin | OpDesc::Cos => {
            n_srcs(&[1])?;
            let a = src(0)?;
            match t.op {
                OpDesc::Sqr => ops::sqr(ctx, a)?,
                OpDesc::Sqrt => ops::sqrt(ctx, a)?,
                OpDesc::Log => ops::log(ctx, a)?,
                OpDesc::Sin => ops::sin(ctx, a)?,
                _ => ops::cos(ctx, a)?,
            }
        }
        OpDesc::Sum | OpDesc::SumRows | OpDesc::Mean | OpDesc::Argmax => {
            n_srcs(&[1])?;
            let a = src(0)?;
            match t.op {
                OpDesc::Sum => ops::sum(ctx, a)?,
                OpDesc::SumRows => ops::sum_rows(ctx, a)?,
                OpDesc::Mean => ops::mean(ctx, a)?,
                _ => ops::argmax(ctx, a)?,
            }
        }
        OpDesc::Repeat => {
            n_srcs(&[2])?;
            ops::repeat(ctx, src(0)?, src(1)?)?
        }
        &OpDesc::Concat { dim } => {
            n_srcs(&[2])?;
            ops::concat(ctx, src(0)?, src(1)?, dim as usize)?
        }
        &OpDesc::Unary(code) => {
            n_srcs(&[1])?;
            let op = *UnaryOp::ALL
                .get(code as usize)
                .ok_or_else(|| bad(format!("unknown unary op {code}")))?;
            ops::unary(ctx, src(0)?, op)?
        }
        &OpDesc::LeakyRelu(slope) => {
            n_srcs(&[1])?;
            ops::leaky_relu(ctx, src(0)?, slope)?
        }
        &OpDesc::Glu { op, swapped } => {
            n_srcs(&[1, 2])?;
            let op = *GLU_OPS
                .get(op as usize)
                .ok_or_else(|| bad(format!("unknown GLU op {op}")))?;
            match opt(1)? {
                None => ops::glu(ctx, src(0)?, op, swapped)?,
                Some(b) if !swapped => ops::glu_split(ctx, src(0)?, b, op)?,
                Some(_) => return Err(bad("a split GLU cannot be swapped".into())),
            }
        }
        &OpDesc::Norm(eps) => {
            n_srcs(&[1])?;
            ops::norm(ctx, src(0)?, eps)?
        }
        &OpDesc::RmsNorm(eps) => {
            n_srcs(&[1])?;
            ops::rms_norm(ctx, src(0)?, eps)?
        }
        &OpDesc::GroupNorm { n_groups, eps } => {
            n_srcs(&[1])?;
            ops::group_norm(ctx, src(0)?, u(n_groups, "n_groups")?, eps)?
        }
        &OpDesc::L2Norm(eps) => {
            n_srcs(&[1])?;
            ops::l2_norm(ctx, src(0)?, eps)?
        }
        OpDesc::MulMat => {
            n_srcs(&[2])?;
            ops::mul_mat(ctx, src(0)?, src(1)?)?
        }
        OpDesc::MulMatId => {
            n_srcs(&[3])?;
            ops::mul_mat_id(ctx, src(0)?, src(1)?, src(2)?)?
        }
        OpDesc::OutProd => {
            n_srcs(&[2])?;
            ops::out_prod(ctx, src(0)?, src(1)?)?
        }
        &OpDesc::Scale { s, b } => {
            n_srcs(&[1])?;
            ops::scale(ctx, src(0)?, s, b)?
        }
        OpDesc::Cpy => {
            n_srcs(&[2])?;
            ops::cpy(ctx, src(0)?, src(1)?)?
        }
        OpDesc::Cont => {
            n_srcs(&[1])?;
            ops::cont_shape(ctx, src(0)?, &ne[..ndim])?
        }
        OpDesc::Reshape => {
            n_srcs(&[1])?;
            ops::reshape(ctx, src(0)?, &ne[..ndim])?
        }
        OpDesc::View => {
            n_srcs(&[1])?;
            check_strides(dtype, &ne, &nb)?;
            let a = src(0)?;
            let (_, offset) = t
                .view
                .ok_or_else(|| bad("a VIEW needs a view source".into()))?;
            // The wire offset is from the root; the builder takes it from the operand.
            let offset = u(offset, "view offset")?
                .checked_sub(a.view_offset())
                .ok_or_else(|| bad("view offset before its operand's".into()))?;
            ops::view(ctx, a, &ne[..ndim], &nb[1..ndim], offset)?
        }
        OpDesc::Permute(axes) => {
            n_srcs(&[1])?;
            ops::permute(ctx, src(0)?, axes.map(|a| a as usize))?
        }
        OpDesc::Transpose => {
            n_srcs(&[1])?;
            ops::transpose(ctx, src(0)?)?
        }
        OpDesc::GetRows => {
            n_srcs(&[2])?;
            ops::get_rows(ctx, src(0)?, src(1)?)?
        }
        OpDesc::SetRows => {
            n_srcs(&[3])?;
            ops::set_rows(ctx, src(0)?, src(1)?, src(2)?)?
        }
        &OpDesc::DiagMaskInf(n_past) => {
            n_srcs(&[1])?;
            ops::diag_mask_inf(ctx, src(0)?, u(n_past, "n_past")?)?
        }
        &OpDesc::SoftMax { scale, max_bias } => {
            n_srcs(&[1, 2])?;
            ops::soft_max(ctx, src(0)?, opt(1)?, scale, max_bias)?
        }
        &OpDesc::Rope {
            n_dims,
            neox,
            n_ctx_orig,
            freq_base,
            freq_scale,
            ext_factor,
            attn_factor,
            beta_fast,
            beta_slow,
        } => {
            n_srcs(&[2, 3])?;
            let params = RopeParams {
                n_dims: u(n_dims, "n_dims")?,
                mode: if neox {
                    RopeMode::Neox
                } else {
                    RopeMode::Normal
                },
                n_ctx_orig: u(n_ctx_orig, "n_ctx_orig")?,
                freq_base,
                freq_scale,
                ext_factor,
                attn_factor,
                beta_fast,
                beta_slow,
            };
            ops::rope(ctx, src(0)?, src(1)?, opt(2)?, params)?
        }
        &OpDesc::Clamp { min, max } => {
            n_srcs(&[1])?;
            ops::clamp(ctx, src(0)?, min, max)?
        }
        &OpDesc::FlashAttnExt {
            scale,
            max_bias,
            logit_softcap,
        } => {
            n_srcs(&[3, 4])?;
            ops::flash_attn_ext(
                ctx,
                src(0)?,
                src(1)?,
                src(2)?,
                opt(3)?,
                scale,
                max_bias,
                logit_softcap,
            )?
        }
    };
    // The builder decided dtype, shape, strides and view; the wire must agree exactly.
    let same_strides = (0..MAX_DIMS).all(|i| ne[i] <= 1 || result.nb()[i] == nb[i]);
    if result.dtype() != dtype || result.ne() != ne || !same_strides {
        return Err(Error::Shape(format!(
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
    match (&t.view, result.view_src()) {
        (None, None) => {}
        (Some((v, offset)), Some(root)) => {
            let claimed = built
                .get(*v as usize)
                .ok_or_else(|| bad(format!("view source {v} is not an earlier tensor")))?;
            let claimed_root = claimed.view_src().unwrap_or(claimed);
            if !claimed_root.same(root) || result.view_offset() as u64 != *offset {
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
            Error::Shape(m) => Error::Shape(format!("tensor {i}: {m}")),
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
        if desc.tensors[i as usize].op == OpDesc::External {
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
