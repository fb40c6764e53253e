//! Contexts: factories that create tensors and remember them in creation order.
//!
//! With `no_alloc` (the default) a context creates metadata only; memory comes later from an
//! allocator or a scheduler. With `no_alloc` off, every non-view tensor the context creates gets
//! host memory at once, so small experiments need no backend at all.
//!
//! Through an ordinary handle a context *owns* what it creates (ggml's meaning: listed, and
//! alive as long as the context). Through a [`Context::borrowing`] handle it creates tensors it
//! neither lists nor keeps: they live as long as something else holds them (a caller's handle,
//! a later op's sources, a graph) and, in an allocating context, get their own host memory,
//! freed with them, instead of a slice of the context's arena. They still name the context as
//! theirs ([`Tensor::context`]), so later ops can follow it. The Python op builders use a
//! borrowing handle when the caller named no context, so building a graph per request against
//! a long-lived weights context keeps memory flat.

use std::sync::{Arc, Mutex, MutexGuard};

use crate::buffer::{alloc_cpu_buffer, Buffer, HOST_ALIGNMENT};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::op::Op;
use crate::tensor::{Tensor, TensorSpec, MAX_DIMS};

/// Host memory chunks of a context that allocates its tensors.
#[derive(Default)]
struct HostArena {
    chunks: Vec<Buffer>,
    used_in_last: usize,
}

/// Smallest chunk a context allocates at a time.
const ARENA_CHUNK: usize = 1 << 20;

impl HostArena {
    fn place(&mut self, nbytes: usize) -> Result<(Buffer, usize)> {
        let aligned = nbytes.div_ceil(HOST_ALIGNMENT) * HOST_ALIGNMENT;
        if let Some(last) = self.chunks.last() {
            if self.used_in_last + aligned <= last.size() {
                let offset = self.used_in_last;
                self.used_in_last += aligned;
                return Ok((last.clone(), offset));
            }
        }
        let chunk = alloc_cpu_buffer(aligned.max(ARENA_CHUNK))?;
        self.chunks.push(chunk.clone());
        self.used_in_last = aligned;
        Ok((chunk, 0))
    }
}

pub(crate) struct ContextInner {
    no_alloc: bool,
    tensors: Mutex<Vec<Tensor>>,
    arena: Mutex<HostArena>,
}

/// A tensor factory; cheap to clone (a shared handle).
#[derive(Clone)]
pub struct Context {
    inner: Arc<ContextInner>,
    /// Whether tensors created through this handle are owned (listed and kept alive) by the
    /// context, or left to their holders (see [`Context::borrowing`]).
    owns: bool,
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl Default for Context {
    fn default() -> Self {
        Context::new(true)
    }
}

/// Converts a numpy-order shape to ggml's `ne` (fastest first), padded with ones.
pub fn ne_from_shape(shape: &[usize]) -> Result<[usize; MAX_DIMS]> {
    if shape.len() > MAX_DIMS {
        return Err(Error::shape(format!(
            "shape {shape:?} has {} dimensions; at most {MAX_DIMS} are supported",
            shape.len()
        )));
    }
    let mut ne = [1usize; MAX_DIMS];
    for (i, &n) in shape.iter().rev().enumerate() {
        ne[i] = n;
    }
    Ok(ne)
}

impl Context {
    /// A new context; with `no_alloc` false it gives each tensor host memory.
    pub fn new(no_alloc: bool) -> Context {
        Context {
            inner: Arc::new(ContextInner {
                no_alloc,
                tensors: Mutex::new(Vec::new()),
                arena: Mutex::new(HostArena::default()),
            }),
            owns: true,
        }
    }

    pub(crate) fn from_inner(inner: Arc<ContextInner>) -> Context {
        Context { inner, owns: true }
    }

    /// A handle to the same context through which new tensors are *borrowed*: the context
    /// neither lists them ([`Context::tensors`], [`Context::get_tensor`], context allocation)
    /// nor keeps them alive; they live as long as something else holds them, and still report
    /// this context as theirs. In an allocating context each borrowed non-view tensor gets its
    /// own host memory, freed with the tensor.
    pub fn borrowing(&self) -> Context {
        Context {
            inner: self.inner.clone(),
            owns: false,
        }
    }

    /// Whether tensors created through this handle are kept alive by the context.
    pub fn owns_new_tensors(&self) -> bool {
        self.owns
    }

    /// Whether tensors are created without memory.
    pub fn no_alloc(&self) -> bool {
        self.inner.no_alloc
    }

    /// Every tensor the context owns, in creation order.
    pub fn tensors(&self) -> Vec<Tensor> {
        lock(&self.inner.tensors).clone()
    }

    /// How many tensors the context owns.
    pub fn len(&self) -> usize {
        lock(&self.inner.tensors).len()
    }

    /// Whether the context owns no tensor.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The first owned tensor with this name.
    pub fn get_tensor(&self, name: &str) -> Option<Tensor> {
        lock(&self.inner.tensors)
            .iter()
            .find(|t| t.name() == name)
            .cloned()
    }

    /// Bytes of host memory the context holds for its owned tensors (borrowed tensors hold
    /// their own).
    pub fn host_bytes(&self) -> usize {
        lock(&self.inner.arena)
            .chunks
            .iter()
            .map(Buffer::size)
            .sum()
    }

    /// An identity for the shared context (equal for handles of the same context).
    pub fn id(&self) -> usize {
        Arc::as_ptr(&self.inner) as usize
    }

    /// Whether both handles are the same context.
    pub fn same(&self, other: &Context) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }

    /// Creates a tensor from a spec, records it if this handle owns what it creates, and
    /// (without `no_alloc`) gives it memory.
    pub fn create(&self, spec: TensorSpec) -> Result<Tensor> {
        let is_view = spec.view.is_some();
        let tensor = Tensor::from_spec(spec, Arc::downgrade(&self.inner))?;
        if !self.inner.no_alloc && !is_view {
            if self.owns {
                let (buffer, offset) = lock(&self.inner.arena).place(tensor.nbytes())?;
                tensor.bind(&buffer, offset)?;
            } else {
                // Its own memory, so it is freed with the tensor rather than held by the arena.
                let buffer = alloc_cpu_buffer(tensor.nbytes().max(HOST_ALIGNMENT))?;
                tensor.bind(&buffer, 0)?;
            }
        }
        if self.owns {
            lock(&self.inner.tensors).push(tensor.clone());
        }
        Ok(tensor)
    }

    /// A new leaf tensor with ggml-order dimensions `ne` (1 to 4 entries, fastest first).
    pub fn new_tensor(&self, dtype: DType, ne: &[usize]) -> Result<Tensor> {
        if ne.is_empty() || ne.len() > MAX_DIMS {
            return Err(Error::shape(format!(
                "a tensor needs 1 to {MAX_DIMS} dimensions, got {}",
                ne.len()
            )));
        }
        let mut full = [1usize; MAX_DIMS];
        full[..ne.len()].copy_from_slice(ne);
        self.create(TensorSpec {
            dtype,
            ne: full,
            nb: None,
            ndim: ne.len(),
            op: Op::None,
            srcs: Vec::new(),
            view: None,
        })
    }

    /// A new leaf tensor with a numpy-order shape (last axis fastest); an empty shape makes a
    /// one-element tensor.
    pub fn new_tensor_shape(&self, dtype: DType, shape: &[usize]) -> Result<Tensor> {
        let ne = ne_from_shape(shape)?;
        let tensor = self.create(TensorSpec {
            dtype,
            ne,
            nb: None,
            ndim: shape.len().max(1),
            op: Op::None,
            srcs: Vec::new(),
            view: None,
        })?;
        Ok(tensor)
    }

    /// A 1-d tensor of `ne0` elements.
    pub fn new_tensor_1d(&self, dtype: DType, ne0: usize) -> Result<Tensor> {
        self.new_tensor(dtype, &[ne0])
    }

    /// A 2-d tensor (`ne0` fastest).
    pub fn new_tensor_2d(&self, dtype: DType, ne0: usize, ne1: usize) -> Result<Tensor> {
        self.new_tensor(dtype, &[ne0, ne1])
    }

    /// A 3-d tensor (`ne0` fastest).
    pub fn new_tensor_3d(
        &self,
        dtype: DType,
        ne0: usize,
        ne1: usize,
        ne2: usize,
    ) -> Result<Tensor> {
        self.new_tensor(dtype, &[ne0, ne1, ne2])
    }

    /// A 4-d tensor (`ne0` fastest).
    pub fn new_tensor_4d(
        &self,
        dtype: DType,
        ne0: usize,
        ne1: usize,
        ne2: usize,
        ne3: usize,
    ) -> Result<Tensor> {
        self.new_tensor(dtype, &[ne0, ne1, ne2, ne3])
    }

    /// A new leaf with the same dtype and shape as `like`.
    pub fn dup_tensor(&self, like: &Tensor) -> Result<Tensor> {
        self.create(TensorSpec {
            dtype: like.dtype(),
            ne: like.ne(),
            nb: None,
            ndim: like.ndim(),
            op: Op::None,
            srcs: Vec::new(),
            view: None,
        })
    }

    /// A one-element f32 tensor holding `value` (needs a context that allocates).
    pub fn new_f32(&self, value: f32) -> Result<Tensor> {
        let tensor = self.new_tensor(DType::F32, &[1])?;
        if !self.no_alloc() {
            tensor.set_f32(&[value])?;
        }
        Ok(tensor)
    }

    /// A one-element i32 tensor holding `value` (needs a context that allocates).
    pub fn new_i32(&self, value: i32) -> Result<Tensor> {
        let tensor = self.new_tensor(DType::I32, &[1])?;
        if !self.no_alloc() {
            tensor.write_bytes(0, &value.to_ne_bytes())?;
        }
        Ok(tensor)
    }

    /// A text listing of the context's tensors (ggml's debug print of a context).
    pub fn describe(&self) -> String {
        let tensors = self.tensors();
        let mut out = format!(
            "Context(no_alloc={}, tensors={}, host_bytes={})\n",
            self.no_alloc(),
            tensors.len(),
            self.host_bytes()
        );
        for t in tensors {
            out.push_str(&format!(
                "  #{:<5} {:<12} {:<5} shape={:?} op={}{}\n",
                t.id(),
                t.name(),
                t.dtype().name(),
                t.shape(),
                t.op().name(),
                if t.is_allocated() { " [allocated]" } else { "" }
            ));
        }
        out
    }
}

impl std::fmt::Debug for Context {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Context(no_alloc={}, tensors={})",
            self.no_alloc(),
            self.len()
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops;

    #[test]
    fn borrowed_results_are_neither_listed_nor_kept() {
        let ctx = Context::new(true);
        let w = ctx.new_tensor(DType::F32, &[8, 4]).unwrap();
        let kept = ops::unary(&ctx.borrowing(), &w, ops::UnaryOp::Relu).unwrap();
        for _ in 0..1000 {
            let x = Context::new(true).new_tensor(DType::F32, &[8, 2]).unwrap();
            let y = ops::mul_mat(&ctx.borrowing(), &w, &x).unwrap();
            assert!(y.context().unwrap().same(&ctx));
        }
        assert_eq!(ctx.tensors(), vec![w.clone()]);
        assert!(kept.context().unwrap().same(&ctx));
        // Owned tensors outlive their handles.
        drop(ops::unary(&ctx, &w, ops::UnaryOp::Relu).unwrap());
        assert_eq!(ctx.len(), 2);
        // A borrowed tensor does not keep its context alive either.
        drop(ctx);
        assert!(kept.context().is_none());
    }

    #[test]
    fn borrowed_results_of_an_allocating_context_hold_their_own_memory() {
        let ctx = Context::new(false);
        let a = ctx.new_tensor(DType::F32, &[4]).unwrap();
        a.set_f32(&[1.0, -2.0, 3.0, -4.0]).unwrap();
        let before = ctx.host_bytes();
        for _ in 0..100 {
            let y = ops::unary(&ctx.borrowing(), &a, ops::UnaryOp::Relu).unwrap();
            assert!(y.is_allocated());
        }
        assert_eq!(ctx.host_bytes(), before);
        assert_eq!(ctx.len(), 1);
    }
}
