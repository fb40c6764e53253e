//! [`MemoryPlan`]: an inspectable record of where a [`GraphAllocator`](super::GraphAllocator)
//! placed each tensor and for how long.

use std::collections::HashMap;
use std::fmt;

/// The memory of one buffer id.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BufferPlan {
    /// The buffer id (index into the allocator's buffer types).
    pub buffer_id: usize,
    /// The buffer type's name.
    pub buffer_type: String,
    /// Alignment of every offset in this buffer.
    pub alignment: usize,
    /// Set when an earlier buffer id has the same buffer type: both share that id's memory,
    /// and tensors of this id are recorded under the earlier id.
    pub shared_with: Option<usize>,
    /// The size each chunk's buffer needs (the planner's high-water marks); empty when the
    /// memory is shared or nothing was placed.
    pub chunk_sizes: Vec<usize>,
}

impl BufferPlan {
    /// Sum of the chunk sizes.
    pub fn size(&self) -> usize {
        self.chunk_sizes.iter().sum()
    }
}

/// Where one tensor lives and when.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorPlan {
    /// The tensor's identity ([`Tensor::id`](crate::tensor::Tensor::id)).
    pub id: u64,
    /// Its name at planning time ("" if none).
    pub name: String,
    /// The buffer id whose memory holds it (the first id of a shared buffer type).
    pub buffer_id: usize,
    /// The chunk of that buffer.
    pub chunk: usize,
    /// Byte offset in the chunk.
    pub offset: usize,
    /// Bytes reserved (the buffer type's allocation size, rounded up to the alignment).
    pub size: usize,
    /// The node index at which the memory is taken (0 for leafs and inputs, which are placed
    /// before the first node).
    pub first_use: usize,
    /// The node index after which the memory returns to the pool (or passes to an in-place
    /// successor); `None` when it is held to the end (outputs, tensors without consumers).
    pub last_use: Option<usize>,
    /// The tensor whose memory this one took over by computing in place, if any.
    pub inplace_parent: Option<u64>,
}

impl TensorPlan {
    /// Whether the tensor holds its memory at node index `step`.
    pub fn live_at(&self, step: usize) -> bool {
        self.first_use <= step && self.last_use.is_none_or(|last| step <= last)
    }
}

/// The placements of one planned graph (see [`GraphAllocator::plan`](super::GraphAllocator::plan)).
///
/// Views and tensors that already had memory (external) take no memory and are not listed.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct MemoryPlan {
    /// Per buffer id, its chunks.
    pub buffers: Vec<BufferPlan>,
    /// Every tensor the plan placed, in placement order.
    pub tensors: Vec<TensorPlan>,
    /// Number of nodes of the planned graph.
    pub n_nodes: usize,
}

impl MemoryPlan {
    /// The placement of the tensor with this id.
    pub fn tensor(&self, id: u64) -> Option<&TensorPlan> {
        self.tensors.iter().find(|t| t.id == id)
    }

    /// Bytes of all chunks of all buffers (the memory the plan needs).
    pub fn total(&self) -> usize {
        self.buffers.iter().map(BufferPlan::size).sum()
    }

    /// Sum of the sizes of all placed tensors (what the graph would need without reuse).
    pub fn tensor_bytes(&self) -> usize {
        self.tensors.iter().map(|t| t.size).sum()
    }

    /// The largest number of bytes in use at any one node index: per node index, the union
    /// of the byte ranges of the tensors live there (so an in-place pair counts once), summed
    /// over buffers and chunks; the maximum over node indices.
    pub fn peak_live_bytes(&self) -> usize {
        let mut by_chunk: HashMap<(usize, usize), Vec<&TensorPlan>> = HashMap::new();
        for t in self.tensors.iter().filter(|t| t.size > 0) {
            by_chunk.entry((t.buffer_id, t.chunk)).or_default().push(t);
        }
        for list in by_chunk.values_mut() {
            list.sort_by_key(|t| t.offset);
        }
        let steps = self.n_nodes.max(1);
        (0..steps)
            .map(|step| {
                by_chunk
                    .values()
                    .map(|list| {
                        let mut covered = 0usize;
                        let mut end = 0usize;
                        for t in list.iter().filter(|t| t.live_at(step)) {
                            let t_end = t.offset + t.size;
                            if t_end > end {
                                covered += t_end - t.offset.max(end);
                                end = t_end;
                            }
                        }
                        covered
                    })
                    .sum::<usize>()
            })
            .max()
            .unwrap_or(0)
    }

    /// `1 − peak_live_bytes / total`: the fraction of the planned memory that is never in
    /// use at the busiest node (0 when the buffers are exactly as large as the peak demand;
    /// 0 for an empty plan). Alignment padding counts as used.
    pub fn fragmentation(&self) -> f64 {
        let total = self.total();
        if total == 0 {
            return 0.0;
        }
        1.0 - self.peak_live_bytes() as f64 / total as f64
    }
}

impl fmt::Display for MemoryPlan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "MemoryPlan: {} nodes, {} tensors, total {} bytes, tensors {} bytes, peak live {} \
             bytes, fragmentation {:.3}",
            self.n_nodes,
            self.tensors.len(),
            self.total(),
            self.tensor_bytes(),
            self.peak_live_bytes(),
            self.fragmentation()
        )?;
        for b in &self.buffers {
            match b.shared_with {
                Some(first) => writeln!(
                    f,
                    "  buffer {} ({}): shares buffer {first}",
                    b.buffer_id, b.buffer_type
                )?,
                None => writeln!(
                    f,
                    "  buffer {} ({}, align {}): chunks {:?}",
                    b.buffer_id, b.buffer_type, b.alignment, b.chunk_sizes
                )?,
            }
        }
        writeln!(
            f,
            "  {:>6} {:<20} {:>3} {:>5} {:>12} {:>12} {:>5} {:>5} {:>8}",
            "id", "name", "buf", "chunk", "offset", "size", "first", "last", "inplace"
        )?;
        for t in &self.tensors {
            let last = t
                .last_use
                .map_or_else(|| "end".to_owned(), |l| l.to_string());
            let inplace = t
                .inplace_parent
                .map_or_else(|| "-".to_owned(), |p| format!("#{p}"));
            writeln!(
                f,
                "  {:>6} {:<20} {:>3} {:>5} {:>12} {:>12} {:>5} {:>5} {:>8}",
                format!("#{}", t.id),
                t.name,
                t.buffer_id,
                t.chunk,
                t.offset,
                t.size,
                t.first_use,
                last,
                inplace
            )?;
        }
        Ok(())
    }
}
