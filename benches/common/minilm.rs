//! The MiniLM-shaped encoder graph the allocator and scheduler benches share: 6 layers,
//! hidden 384, 12 heads, intermediate 1536, sequence 128, f16 weights in a host buffer marked
//! as weights, ≈198 nodes per graph.

use ferrograph::alloc::alloc_ctx_tensors_from_buft;
use ferrograph::buffer::{Buffer, BufferUsage, CpuBufferType};
use ferrograph::context::Context;
use ferrograph::dtype::DType;
use ferrograph::graph::Graph;
use ferrograph::ops::{self, UnaryOp};
use ferrograph::tensor::Tensor;
use ferrograph::Result;

const LAYERS: usize = 6;
const HIDDEN: usize = 384;
const HEADS: usize = 12;
const HEAD_DIM: usize = HIDDEN / HEADS;
const INTERMEDIATE: usize = 1536;
const SEQ: usize = 128;

/// One layer's weights: projections (q, k, v, o, ffn up, ffn down), their biases, and the two
/// layer norms' gains and biases.
struct Layer {
    w: [Tensor; 6],
    b: [Tensor; 6],
    ln: [Tensor; 4],
}

/// The weights of every layer, kept alive with their context and buffers.
pub struct Weights {
    layers: Vec<Layer>,
    _ctx: Context,
    _buffers: Vec<Buffer>,
}

/// Weights in their own host buffer, marked [`BufferUsage::Weights`].
pub fn weights() -> Result<Weights> {
    let ctx = Context::new(true);
    let mut layers = Vec::new();
    for _ in 0..LAYERS {
        let sq = || ctx.new_tensor(DType::F16, &[HIDDEN, HIDDEN]);
        let v = |n: usize| ctx.new_tensor(DType::F32, &[n]);
        layers.push(Layer {
            w: [
                sq()?,
                sq()?,
                sq()?,
                sq()?,
                ctx.new_tensor(DType::F16, &[HIDDEN, INTERMEDIATE])?,
                ctx.new_tensor(DType::F16, &[INTERMEDIATE, HIDDEN])?,
            ],
            b: [
                v(HIDDEN)?,
                v(HIDDEN)?,
                v(HIDDEN)?,
                v(HIDDEN)?,
                v(INTERMEDIATE)?,
                v(HIDDEN)?,
            ],
            ln: [v(HIDDEN)?, v(HIDDEN)?, v(HIDDEN)?, v(HIDDEN)?],
        });
    }
    let buffers = alloc_ctx_tensors_from_buft(&ctx, CpuBufferType::shared())?;
    for b in &buffers {
        b.set_usage(BufferUsage::Weights);
    }
    Ok(Weights {
        layers,
        _ctx: ctx,
        _buffers: buffers,
    })
}

/// The encoder graph for `batch` sequences of the bench's length (128), in a fresh context.
#[allow(dead_code)] // each bench uses one of the two builders
pub fn encoder(w: &Weights, batch: usize) -> Result<Graph> {
    encoder_seq(w, batch, SEQ)
}

/// The encoder graph for `batch` sequences of `seq` tokens, built in a fresh context.
pub fn encoder_seq(w: &Weights, batch: usize, seq: usize) -> Result<Graph> {
    let ctx = Context::new(true);
    let mut x = ctx.new_tensor(DType::F32, &[HIDDEN, seq, batch])?;
    x.set_input();
    x.set_name("embeddings");
    let mask = ctx.new_tensor(DType::F32, &[seq, seq])?;
    mask.set_input();
    mask.set_name("mask");
    let scale = 1.0 / (HEAD_DIM as f32).sqrt();
    for l in &w.layers {
        let proj = |i: usize, x: &Tensor| -> Result<Tensor> {
            ops::add(&ctx, &ops::mul_mat(&ctx, &l.w[i], x)?, &l.b[i])
        };
        let heads = |t: Tensor| -> Result<Tensor> {
            let t = ops::reshape(&ctx, &t, &[HEAD_DIM, HEADS, seq, batch])?;
            ops::permute(&ctx, &t, [0, 2, 1, 3])
        };
        let q = heads(proj(0, &x)?)?;
        let k = heads(proj(1, &x)?)?;
        let v = ops::reshape(&ctx, &proj(2, &x)?, &[HEAD_DIM, HEADS, seq, batch])?;
        let v = ops::cont(&ctx, &ops::permute(&ctx, &v, [1, 2, 0, 3])?)?; // [seq, HEAD_DIM, HEADS, batch]
        let kq = ops::mul_mat(&ctx, &k, &q)?; // [seq_k, seq_q, HEADS, batch]
        let kq = ops::soft_max(&ctx, &kq, Some(&mask), scale, 0.0)?;
        let kqv = ops::mul_mat(&ctx, &v, &kq)?; // [HEAD_DIM, seq, HEADS, batch]
        let merged = ops::permute(&ctx, &kqv, [0, 2, 1, 3])?;
        let merged = ops::cont_shape(&ctx, &merged, &[HIDDEN, seq, batch])?;
        let h = ops::add(&ctx, &proj(3, &merged)?, &x)?;
        let h = ops::norm(&ctx, &h, 1e-12)?;
        let h = ops::add(&ctx, &ops::mul(&ctx, &h, &l.ln[0])?, &l.ln[1])?;
        let ff = ops::unary(&ctx, &proj(4, &h)?, UnaryOp::Gelu)?;
        let out = ops::add(&ctx, &proj(5, &ff)?, &h)?;
        let out = ops::norm(&ctx, &out, 1e-12)?;
        x = ops::add(&ctx, &ops::mul(&ctx, &out, &l.ln[2])?, &l.ln[3])?;
    }
    x.set_output();
    x.set_name("hidden_states");
    Ok(Graph::build(&[x]))
}
