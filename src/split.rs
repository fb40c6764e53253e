//! Weights split by rows across the devices of one registration (ggml's split buffer type): a
//! matrix too large for one device keeps rows `r0..r1` on the first device, `r1..r2` on the
//! next, ..., in proportions the caller chooses, and a matrix product with it runs one
//! `MUL_MAT` per part on that part's device, the results gathered in row order.
//!
//! This is the mechanism on its own: a [`SplitWeight`] is a set of ordinary tensors (one per
//! device, in that device's buffer type); the scheduler and graph allocator do not place split
//! weights themselves.

use std::ops::Range;
use std::sync::Arc;

use crate::alloc::{alloc_ctx_tensors_from_buft, GraphAllocator};
use crate::buffer::Buffer;
use crate::context::Context;
use crate::device::{BackendParams, Device};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::graph::Graph;
use crate::ops;
use crate::registry::Registration;
use crate::tensor::Tensor;

/// How the rows of weights are divided among the devices of one registration.
#[derive(Debug, Clone)]
pub struct SplitBufferType {
    registration: String,
    devices: Vec<Arc<dyn Device>>,
    /// Where each device's share starts, as a fraction of the rows (ascending, first 0).
    starts: Vec<f64>,
}

impl SplitBufferType {
    /// Splits over every device of `registration`, device `i` taking a share proportional to
    /// `tensor_split[i]` (ggml's `tensor_split`); an empty or all-zero list gives equal
    /// shares. Shares must be finite and not negative, one per device.
    pub fn new(registration: &dyn Registration, tensor_split: &[f32]) -> Result<SplitBufferType> {
        Self::from_devices(registration.name(), registration.devices(), tensor_split)
    }

    /// Splits over `devices` (in that order), as [`SplitBufferType::new`] does over a
    /// registration's; `name` says where they come from (the registration's name, or any label
    /// for devices gathered from several registrations, e.g. remote servers). The mechanism only
    /// needs each device's buffer type and backends, so the devices need not share a
    /// registration.
    pub fn from_devices(
        name: &str,
        devices: Vec<Arc<dyn Device>>,
        tensor_split: &[f32],
    ) -> Result<SplitBufferType> {
        if devices.is_empty() {
            return Err(Error::InvalidArgument(format!(
                "{name} has no devices to split over"
            )));
        }
        let weights: Vec<f64> = if tensor_split.iter().all(|&w| w == 0.0) {
            vec![1.0; devices.len()]
        } else if tensor_split.len() != devices.len() {
            return Err(Error::InvalidArgument(format!(
                "tensor_split has {} shares for {} devices",
                tensor_split.len(),
                devices.len()
            )));
        } else if tensor_split.iter().any(|w| !w.is_finite() || *w < 0.0) {
            return Err(Error::InvalidArgument(format!(
                "tensor_split shares must be finite and not negative, got {tensor_split:?}"
            )));
        } else {
            tensor_split.iter().map(|&w| f64::from(w)).collect()
        };
        let total: f64 = weights.iter().sum();
        let mut starts = Vec::with_capacity(weights.len());
        let mut acc = 0.0;
        for w in &weights {
            starts.push(acc / total);
            acc += w;
        }
        Ok(SplitBufferType {
            registration: name.to_owned(),
            devices,
            starts,
        })
    }

    /// The registration's name (or the label given to [`SplitBufferType::from_devices`]).
    pub fn registration(&self) -> &str {
        &self.registration
    }

    /// The devices, in split order.
    pub fn devices(&self) -> &[Arc<dyn Device>] {
        &self.devices
    }

    /// The rows each device holds of a matrix of `nrows` rows (contiguous, in order, covering
    /// every row once; a device may get none).
    pub fn row_ranges(&self, nrows: usize) -> Vec<Range<usize>> {
        let bound = |i: usize| -> usize {
            match self.starts.get(i) {
                Some(&f) => ((f * nrows as f64).round() as usize).min(nrows),
                None => nrows,
            }
        };
        (0..self.devices.len())
            .map(|i| bound(i)..bound(i + 1).max(bound(i)))
            .collect()
    }

    /// A weight of `dtype` with rows of `row_len` elements and `nrows` rows (ggml's
    /// `ne = [row_len, nrows]`), each device's rows allocated in its buffer type.
    pub fn alloc_weight(&self, dtype: DType, row_len: usize, nrows: usize) -> Result<SplitWeight> {
        let row_bytes = dtype.row_size(row_len)?;
        let mut parts = Vec::new();
        for (device, rows) in self.devices.iter().zip(self.row_ranges(nrows)) {
            if rows.is_empty() {
                continue;
            }
            let ctx = Context::new(true);
            let tensor = ctx.new_tensor(dtype, &[row_len, rows.len()])?;
            let buffers = alloc_ctx_tensors_from_buft(&ctx, device.buffer_type())?;
            parts.push(SplitPart {
                device: device.clone(),
                rows,
                tensor,
                _buffers: buffers,
            });
        }
        Ok(SplitWeight {
            dtype,
            row_len,
            nrows,
            row_bytes,
            parts,
        })
    }
}

/// One device's rows of a [`SplitWeight`].
pub struct SplitPart {
    /// The device holding them.
    pub device: Arc<dyn Device>,
    /// Which rows of the whole weight.
    pub rows: Range<usize>,
    /// The rows, as a tensor in the device's memory (`ne = [row_len, rows.len()]`).
    pub tensor: Tensor,
    _buffers: Vec<Buffer>,
}

/// A weight matrix whose rows are spread over several devices (see [`SplitBufferType`]).
pub struct SplitWeight {
    dtype: DType,
    row_len: usize,
    nrows: usize,
    row_bytes: usize,
    parts: Vec<SplitPart>,
}

impl SplitWeight {
    /// The parts, in row order.
    pub fn parts(&self) -> &[SplitPart] {
        &self.parts
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// `[row_len, nrows]`, ggml's order.
    pub fn ne(&self) -> [usize; 2] {
        [self.row_len, self.nrows]
    }

    /// Sets the whole weight from its bytes (rows in order, as a contiguous tensor of the same
    /// dtype and shape holds them); each device receives its rows.
    pub fn set_bytes(&self, data: &[u8]) -> Result<()> {
        let expected = self.row_bytes.checked_mul(self.nrows);
        if expected != Some(data.len()) {
            return Err(Error::Shape(format!(
                "a {} weight of {} rows of {} needs {} bytes, got {}",
                self.dtype.name(),
                self.nrows,
                self.row_len,
                self.row_bytes * self.nrows,
                data.len()
            )));
        }
        for part in &self.parts {
            let bytes = &data[part.rows.start * self.row_bytes..part.rows.end * self.row_bytes];
            part.tensor.write_bytes(0, bytes)?;
        }
        Ok(())
    }

    /// `W x` with ggml's MUL_MAT meaning: `x` holds `n_cols` columns of `row_len` f32 values
    /// (`ne = [row_len, n_cols]`); the result holds `n_cols` rows of `nrows` values. Each part
    /// is multiplied on a backend of its own device; the rows are gathered in order.
    pub fn mul_mat(&self, x: &[f32], n_cols: usize) -> Result<Vec<f32>> {
        if self.row_len.checked_mul(n_cols) != Some(x.len()) {
            return Err(Error::Shape(format!(
                "x must hold {n_cols} columns of {} values, got {} values",
                self.row_len,
                x.len()
            )));
        }
        let mut out = vec![0f32; self.nrows * n_cols];
        for part in &self.parts {
            let backend = part.device.init_backend(&BackendParams::default())?;
            let ctx = Context::new(true);
            let xt = ctx.new_tensor(DType::F32, &[self.row_len, n_cols])?;
            let y = ops::mul_mat(&ctx, &part.tensor, &xt)?;
            let graph = Graph::build(std::slice::from_ref(&y));
            let mut allocator = GraphAllocator::new(backend.default_buffer_type());
            allocator.alloc_graph(&graph)?;
            xt.set_f32(x)?;
            backend.graph_compute(&graph)?;
            let values = y.to_f32_vec()?;
            let rows = part.rows.len();
            for j in 0..n_cols {
                out[j * self.nrows + part.rows.start..j * self.nrows + part.rows.end]
                    .copy_from_slice(&values[j * rows..(j + 1) * rows]);
            }
        }
        Ok(out)
    }
}
