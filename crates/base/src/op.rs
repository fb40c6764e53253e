//! The op IR: the closed set of ops and their parameters, as plain serialisable values.
//!
//! An [`Op`] says what computes a tensor and with which parameters; the tensor's operands,
//! dtype and shape live on the tensor itself. This module holds only the description: the
//! builders that validate operands and create tensors are in [`crate::ops`], which re-exports
//! every type here, and [`crate::ops::rebuild`] turns an `Op` value back into the builder call
//! that makes it. Nothing here creates tensors or touches a context, so the tensor and context
//! modules can name these types without depending on the builders.
//!
//! The types derive serde's `Serialize`/`Deserialize`: the remote devices' wire carries them
//! as they are (postcard numbers enum variants by position, so variants are appended, never
//! reordered, and the protocol version changes with them). A custom op ([`Op::Custom`]) holds
//! code of this process and cannot be serialised: [`Op::check_portable`] says so with a clear
//! error, and serialising one anyway is a serde error, never a panic.

use std::fmt;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
// The custom-op trait's signature names tensors, and permutations have one entry per
// dimension; neither brings in the builders or contexts.
use crate::tensor::{Tensor, MAX_DIMS};

/// Element-wise functions of one operand.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum UnaryOp {
    /// |x|
    Abs,
    /// sign(x) (0 at 0)
    Sgn,
    /// −x
    Neg,
    /// 1 if x > 0 else 0
    Step,
    /// tanh(x)
    Tanh,
    /// x if x > 0 else eˣ − 1
    Elu,
    /// max(x, 0)
    Relu,
    /// 1 / (1 + e⁻ˣ)
    Sigmoid,
    /// GELU, tanh approximation
    Gelu,
    /// GELU, exact (erf) form
    GeluErf,
    /// GELU, sigmoid approximation x·σ(1.702x)
    GeluQuick,
    /// x·σ(x)
    Silu,
    /// x·min(max(x + 3, 0), 6) / 6
    Hardswish,
    /// min(max(x + 3, 0), 6) / 6
    Hardsigmoid,
    /// eˣ
    Exp,
}

impl UnaryOp {
    /// Every unary op.
    pub const ALL: [UnaryOp; 15] = [
        UnaryOp::Abs,
        UnaryOp::Sgn,
        UnaryOp::Neg,
        UnaryOp::Step,
        UnaryOp::Tanh,
        UnaryOp::Elu,
        UnaryOp::Relu,
        UnaryOp::Sigmoid,
        UnaryOp::Gelu,
        UnaryOp::GeluErf,
        UnaryOp::GeluQuick,
        UnaryOp::Silu,
        UnaryOp::Hardswish,
        UnaryOp::Hardsigmoid,
        UnaryOp::Exp,
    ];

    /// The upper-case name (`"GELU_ERF"`).
    pub fn name(self) -> &'static str {
        match self {
            UnaryOp::Abs => "ABS",
            UnaryOp::Sgn => "SGN",
            UnaryOp::Neg => "NEG",
            UnaryOp::Step => "STEP",
            UnaryOp::Tanh => "TANH",
            UnaryOp::Elu => "ELU",
            UnaryOp::Relu => "RELU",
            UnaryOp::Sigmoid => "SIGMOID",
            UnaryOp::Gelu => "GELU",
            UnaryOp::GeluErf => "GELU_ERF",
            UnaryOp::GeluQuick => "GELU_QUICK",
            UnaryOp::Silu => "SILU",
            UnaryOp::Hardswish => "HARDSWISH",
            UnaryOp::Hardsigmoid => "HARDSIGMOID",
            UnaryOp::Exp => "EXP",
        }
    }
}

/// Gated linear units: `act(x) · g`, where `x` and `g` are the two halves of a row (fused
/// form) or two tensors (split form).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum GluOp {
    /// ReLU gate.
    Reglu,
    /// GELU (tanh) gate.
    Geglu,
    /// SiLU gate.
    Swiglu,
}

impl GluOp {
    /// The upper-case name.
    pub fn name(self) -> &'static str {
        match self {
            GluOp::Reglu => "REGLU",
            GluOp::Geglu => "GEGLU",
            GluOp::Swiglu => "SWIGLU",
        }
    }

    /// The activation applied to the gated half.
    pub fn activation(self) -> UnaryOp {
        match self {
            GluOp::Reglu => UnaryOp::Relu,
            GluOp::Geglu => UnaryOp::Gelu,
            GluOp::Swiglu => UnaryOp::Silu,
        }
    }
}

/// Rotary position embedding modes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum RopeMode {
    /// Rotate adjacent pairs (x₀, x₁).
    Normal,
    /// Rotate pairs split across halves (x₀, x_{n/2}) as GPT-NeoX does.
    Neox,
}

/// Parameters of [`Op::Rope`].
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct RopeParams {
    /// Number of leading dimensions rotated (even, ≤ `ne[0]`).
    pub n_dims: usize,
    /// Pair layout.
    pub mode: RopeMode,
    /// Context length the model was trained with (YaRN).
    pub n_ctx_orig: usize,
    /// Base of the rotation frequencies (e.g. 10000).
    pub freq_base: f32,
    /// Position scaling (1 = none).
    pub freq_scale: f32,
    /// YaRN extrapolation mix (0 = off).
    pub ext_factor: f32,
    /// Magnitude scale.
    pub attn_factor: f32,
    /// YaRN ramp start (rotations).
    pub beta_fast: f32,
    /// YaRN ramp end (rotations).
    pub beta_slow: f32,
}

impl RopeParams {
    /// Plain RoPE over `n_dims` dimensions with the usual defaults.
    pub fn new(n_dims: usize, mode: RopeMode) -> Self {
        RopeParams {
            n_dims,
            mode,
            n_ctx_orig: 0,
            freq_base: 10000.0,
            freq_scale: 1.0,
            ext_factor: 0.0,
            attn_factor: 1.0,
            beta_fast: 32.0,
            beta_slow: 1.0,
        }
    }
}

/// A user-defined op computed on the host (ggml's MAP_CUSTOM family).
pub trait CustomOp: Send + Sync {
    /// A short name for dumps and errors.
    fn name(&self) -> &str;
    /// Computes `dst` from `srcs`; all are allocated host tensors when called.
    fn compute(&self, dst: &Tensor, srcs: &[Tensor]) -> Result<()>;
}

/// A shared custom op.
#[derive(Clone)]
pub struct CustomOpRef(pub Arc<dyn CustomOp>);

impl fmt::Debug for CustomOpRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "CustomOp({})", self.0.name())
    }
}

impl PartialEq for CustomOpRef {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

/// The operation that produces a tensor, with its parameters.
///
/// Serialised by variant position: new variants go before [`Op::Custom`], which stays last
/// (it is never deserialised, and a skipped variant must not shift the others' numbers).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Op {
    /// A leaf: no computation.
    None,
    /// Copy into a new tensor of the same layout.
    Dup,
    /// Add with broadcasting of the second operand.
    Add,
    /// Subtract with broadcasting.
    Sub,
    /// Multiply with broadcasting.
    Mul,
    /// Divide with broadcasting.
    Div,
    /// Add a one-element tensor.
    Add1,
    /// Add `b` into a strided region of a copy of `a`.
    Acc {
        /// Region stride of dimension 1 in bytes.
        nb1: usize,
        /// Region stride of dimension 2 in bytes.
        nb2: usize,
        /// Region stride of dimension 3 in bytes.
        nb3: usize,
        /// Region start in bytes.
        offset: usize,
    },
    /// x².
    Sqr,
    /// √x.
    Sqrt,
    /// ln x.
    Log,
    /// sin x.
    Sin,
    /// cos x.
    Cos,
    /// Sum of all elements.
    Sum,
    /// Sum of each row.
    SumRows,
    /// Mean of each row.
    Mean,
    /// Index of each row's maximum.
    Argmax,
    /// Tile `a` to the shape of `b`.
    Repeat,
    /// Join along a dimension.
    Concat {
        /// ggml-order dimension joined along.
        dim: usize,
    },
    /// An element-wise function.
    Unary(UnaryOp),
    /// x if x > 0 else slope·x.
    LeakyRelu {
        /// Slope for negative inputs.
        negative_slope: f32,
    },
    /// Gated linear unit (one operand: fused halves; two: split form).
    Glu {
        /// The gate's activation.
        op: GluOp,
        /// Fused form: the activation applies to the second half instead of the first.
        swapped: bool,
    },
    /// Normalise each row to zero mean and unit variance.
    Norm {
        /// Added to the variance.
        eps: f32,
    },
    /// Divide each row by its root mean square.
    RmsNorm {
        /// Added to the mean square.
        eps: f32,
    },
    /// Normalise groups of channels (dimension 2).
    GroupNorm {
        /// Number of groups.
        n_groups: usize,
        /// Added to the variance.
        eps: f32,
    },
    /// Divide each row by its L2 norm.
    L2Norm {
        /// Lower bound of the norm.
        eps: f32,
    },
    /// Matrix product `b · aᵀ` per batch.
    MulMat,
    /// Mixture-of-experts matrix product selected by expert ids.
    MulMatId,
    /// Outer product summed over dimension 1.
    OutProd,
    /// `x·s + b`.
    Scale {
        /// Multiplier.
        s: f32,
        /// Bias.
        b: f32,
    },
    /// Copy `a` into `b`'s memory (result is a view of `b`).
    Cpy,
    /// Make a contiguous copy.
    Cont,
    /// Same memory, new contiguous shape.
    Reshape,
    /// Same memory, explicit shape, strides and offset.
    View,
    /// Same memory, dimensions reordered.
    Permute {
        /// `axes[i]` is where source dimension `i` goes.
        axes: [usize; MAX_DIMS],
    },
    /// Same memory, dimensions 0 and 1 swapped.
    Transpose,
    /// Gather rows by index.
    GetRows,
    /// Scatter rows by index into the destination (result is a view of it).
    SetRows,
    /// Set elements above the diagonal (offset by `n_past`) to −∞.
    DiagMaskInf {
        /// Columns visible beyond the diagonal.
        n_past: usize,
    },
    /// Softmax of each row of `a·scale + mask (+ ALiBi)`.
    SoftMax {
        /// Input scale.
        scale: f32,
        /// ALiBi maximum bias (0 = off).
        max_bias: f32,
    },
    /// Rotary position embedding.
    Rope(RopeParams),
    /// Clamp to [min, max].
    Clamp {
        /// Lower bound.
        min: f32,
        /// Upper bound.
        max: f32,
    },
    /// Fused attention `softmax(q·kᵀ·scale + mask) · v`.
    FlashAttnExt {
        /// Scale of q·kᵀ.
        scale: f32,
        /// ALiBi maximum bias (0 = off).
        max_bias: f32,
        /// Soft cap of the logits (0 = off).
        logit_softcap: f32,
    },
    /// A user-defined host computation. Not portable: it runs code of this process, so
    /// serialising it is an error and no decoder produces it.
    #[serde(serialize_with = "refuse_custom", skip_deserializing)]
    Custom(CustomOpRef),
}

/// The message for a custom op that was to leave the process.
fn custom_not_portable(op: &CustomOpRef) -> String {
    format!(
        "custom op {} runs code of this process: custom ops cannot be sent to a remote device",
        op.0.name()
    )
}

fn refuse_custom<S: serde::Serializer>(
    op: &CustomOpRef,
    _: S,
) -> std::result::Result<S::Ok, S::Error> {
    Err(serde::ser::Error::custom(custom_not_portable(op)))
}

impl Op {
    /// Whether the op can be serialised and rebuilt in another process: every op but a
    /// custom one, which is an [`Error::UnsupportedOp`] saying so.
    pub fn check_portable(&self) -> Result<()> {
        match self {
            Op::Custom(c) => Err(Error::unsupported(custom_not_portable(c))),
            _ => Ok(()),
        }
    }

    /// The upper-case name (`"MUL_MAT"`, `"UNARY"`, ...).
    pub fn name(&self) -> &'static str {
        match self {
            Op::None => "NONE",
            Op::Dup => "DUP",
            Op::Add => "ADD",
            Op::Sub => "SUB",
            Op::Mul => "MUL",
            Op::Div => "DIV",
            Op::Add1 => "ADD1",
            Op::Acc { .. } => "ACC",
            Op::Sqr => "SQR",
            Op::Sqrt => "SQRT",
            Op::Log => "LOG",
            Op::Sin => "SIN",
            Op::Cos => "COS",
            Op::Sum => "SUM",
            Op::SumRows => "SUM_ROWS",
            Op::Mean => "MEAN",
            Op::Argmax => "ARGMAX",
            Op::Repeat => "REPEAT",
            Op::Concat { .. } => "CONCAT",
            Op::Unary(_) => "UNARY",
            Op::LeakyRelu { .. } => "LEAKY_RELU",
            Op::Glu { .. } => "GLU",
            Op::Norm { .. } => "NORM",
            Op::RmsNorm { .. } => "RMS_NORM",
            Op::GroupNorm { .. } => "GROUP_NORM",
            Op::L2Norm { .. } => "L2_NORM",
            Op::MulMat => "MUL_MAT",
            Op::MulMatId => "MUL_MAT_ID",
            Op::OutProd => "OUT_PROD",
            Op::Scale { .. } => "SCALE",
            Op::Cpy => "CPY",
            Op::Cont => "CONT",
            Op::Reshape => "RESHAPE",
            Op::View => "VIEW",
            Op::Permute { .. } => "PERMUTE",
            Op::Transpose => "TRANSPOSE",
            Op::GetRows => "GET_ROWS",
            Op::SetRows => "SET_ROWS",
            Op::DiagMaskInf { .. } => "DIAG_MASK_INF",
            Op::SoftMax { .. } => "SOFT_MAX",
            Op::Rope(_) => "ROPE",
            Op::Clamp { .. } => "CLAMP",
            Op::FlashAttnExt { .. } => "FLASH_ATTN_EXT",
            Op::Custom(_) => "CUSTOM",
        }
    }

    /// A name that includes the unary / GLU sub-op (`"GELU"` rather than `"UNARY"`).
    pub fn display_name(&self) -> String {
        match self {
            Op::Unary(u) => u.name().to_owned(),
            Op::Glu { op, .. } => op.name().to_owned(),
            Op::Custom(c) => format!("CUSTOM({})", c.0.name()),
            other => other.name().to_owned(),
        }
    }

    /// Ops that only reinterpret memory and need no kernel work.
    pub fn is_view_op(&self) -> bool {
        matches!(
            self,
            Op::Reshape | Op::View | Op::Permute { .. } | Op::Transpose
        )
    }

    /// Whether the op's output may share memory with its first operand: each output element
    /// depends only on input elements at the same position or the same row, read before written.
    pub fn can_inplace(&self) -> bool {
        matches!(
            self,
            Op::Scale { .. }
                | Op::DiagMaskInf { .. }
                | Op::Add
                | Op::Add1
                | Op::Sub
                | Op::Mul
                | Op::Div
                | Op::Sqr
                | Op::Sqrt
                | Op::Log
                | Op::Sin
                | Op::Cos
                | Op::Clamp { .. }
                | Op::Unary(_)
                | Op::LeakyRelu { .. }
                | Op::Rope(_)
                | Op::RmsNorm { .. }
                | Op::SoftMax { .. }
        )
    }

    /// A short text of the op's parameters, for dumps (`""` when there are none).
    pub fn params_text(&self) -> String {
        match self {
            Op::Acc {
                nb1,
                nb2,
                nb3,
                offset,
            } => format!("nb=({nb1},{nb2},{nb3}) offset={offset}"),
            Op::Concat { dim } => format!("dim={dim}"),
            Op::LeakyRelu { negative_slope } => format!("slope={negative_slope}"),
            Op::Glu { swapped, .. } => format!("swapped={swapped}"),
            Op::Norm { eps } | Op::RmsNorm { eps } | Op::L2Norm { eps } => format!("eps={eps}"),
            Op::GroupNorm { n_groups, eps } => format!("groups={n_groups} eps={eps}"),
            Op::Scale { s, b } => format!("s={s} b={b}"),
            Op::Permute { axes } => format!("axes={axes:?}"),
            Op::DiagMaskInf { n_past } => format!("n_past={n_past}"),
            Op::SoftMax { scale, max_bias } => format!("scale={scale} max_bias={max_bias}"),
            Op::Rope(p) => format!("n_dims={} mode={:?} base={}", p.n_dims, p.mode, p.freq_base),
            Op::Clamp { min, max } => format!("min={min} max={max}"),
            Op::FlashAttnExt {
                scale,
                max_bias,
                logit_softcap,
            } => {
                format!("scale={scale} max_bias={max_bias} softcap={logit_softcap}")
            }
            _ => String::new(),
        }
    }
}
