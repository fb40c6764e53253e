//! The offset planner (ggml's `dyn_tallocr`): pure bookkeeping of offsets inside one or more
//! *chunks* of a virtual buffer, no memory involved.
//!
//! * Sizes are rounded up to the alignment, so every offset is aligned.
//! * A chunk never grows beyond the buffer type's maximum size; a request that does not fit
//!   the existing chunks opens a new chunk. A single request above the maximum is an error.
//! * Allocation prefers freed memory over growth: first the best fit among the free blocks
//!   inside the chunks (those below each chunk's high-water mark), then the tail of a chunk
//!   where it fits under the high-water mark (tightest fit), then the tail that grows the
//!   high-water mark the least, and only then a new chunk.
//! * Freeing merges the block with its free neighbours.
//! * There is no cap on the number of free blocks or chunks.
//!
//! Each chunk's high-water mark ([`DynAllocator::max_size_of_chunk`]) is the size its real
//! buffer needs.

use crate::error::{Error, Result};

/// A free range `[offset, offset + size)` inside a chunk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct FreeBlock {
    offset: usize,
    size: usize,
}

/// One chunk: its free blocks (sorted by offset, never adjacent) and its high-water mark.
///
/// The last free block always extends to the chunk's capacity while the chunk still has room
/// at its end (the "tail"); allocating from it may raise the high-water mark.
#[derive(Debug, Clone)]
struct Chunk {
    free: Vec<FreeBlock>,
    high_water: usize,
}

/// Where a request is placed.
#[derive(Debug, Clone, Copy)]
struct Candidate {
    chunk: usize,
    block: usize,
}

/// The offset planner: best fit over free blocks, merging on free, chunks of at most the
/// buffer type's maximum size.
#[derive(Debug, Clone)]
pub struct DynAllocator {
    alignment: usize,
    max_chunk_size: usize,
    chunks: Vec<Chunk>,
}

/// Rounds `size` up to a multiple of `alignment` (which is at least 1); `None` on overflow.
pub(crate) fn align_up(size: usize, alignment: usize) -> Option<usize> {
    let alignment = alignment.max(1);
    size.checked_add(alignment - 1)
        .map(|s| s / alignment * alignment)
}

impl DynAllocator {
    /// A planner for offsets aligned to `alignment` in chunks of at most `max_size` bytes
    /// (`usize::MAX` for no limit; internally capped at `usize::MAX / 2` so sums cannot
    /// overflow).
    pub fn new(alignment: usize, max_size: usize) -> DynAllocator {
        DynAllocator {
            alignment: alignment.max(1),
            max_chunk_size: max_size.min(usize::MAX / 2),
            chunks: Vec::new(),
        }
    }

    /// The alignment of every offset.
    pub fn alignment(&self) -> usize {
        self.alignment
    }

    /// The largest chunk (and so the largest single request) allowed.
    pub fn max_chunk_size(&self) -> usize {
        self.max_chunk_size
    }

    /// Forgets every allocation and chunk.
    pub fn reset(&mut self) {
        self.chunks.clear();
    }

    /// Number of chunks opened so far.
    pub fn n_chunks(&self) -> usize {
        self.chunks.len()
    }

    /// The high-water mark of chunk `i`: the bytes its buffer needs (0 for an unknown chunk).
    pub fn max_size_of_chunk(&self, i: usize) -> usize {
        self.chunks.get(i).map_or(0, |c| c.high_water)
    }

    /// The high-water marks of all chunks.
    pub fn chunk_sizes(&self) -> Vec<usize> {
        self.chunks.iter().map(|c| c.high_water).collect()
    }

    /// Sum of the high-water marks of all chunks.
    pub fn total_size(&self) -> usize {
        self.chunks.iter().map(|c| c.high_water).sum()
    }

    /// Reserves `size` bytes (rounded up to the alignment) and returns `(chunk, offset)`.
    ///
    /// A zero-byte request returns `(0, 0)` without reserving anything (it opens no chunk).
    /// A request above the maximum chunk size is an [`Error::Alloc`].
    pub fn alloc(&mut self, size: usize) -> Result<(usize, usize)> {
        if size == 0 {
            return Ok((0, 0));
        }
        let size = align_up(size, self.alignment)
            .filter(|&s| s <= self.max_chunk_size)
            .ok_or_else(|| {
                Error::alloc(format!(
                    "a tensor of {size} bytes is larger than the buffer type's maximum buffer \
                     size of {} bytes",
                    self.max_chunk_size
                ))
            })?;
        let candidate = self.best_inner_fit(size).or_else(|| self.best_tail(size));
        let Candidate { chunk, block } = match candidate {
            Some(c) => c,
            None => {
                self.chunks.push(Chunk {
                    free: vec![FreeBlock {
                        offset: 0,
                        size: self.max_chunk_size,
                    }],
                    high_water: 0,
                });
                Candidate {
                    chunk: self.chunks.len() - 1,
                    block: 0,
                }
            }
        };
        let chunk_ref = &mut self.chunks[chunk];
        let free = &mut chunk_ref.free[block];
        let offset = free.offset;
        free.offset += size;
        free.size -= size;
        if free.size == 0 {
            chunk_ref.free.remove(block);
        }
        chunk_ref.high_water = chunk_ref.high_water.max(offset + size);
        Ok((chunk, offset))
    }

    /// Best fit among blocks below the high-water mark of each chunk (freed memory): the
    /// smallest block that fits, over all chunks (ties: the lowest chunk and offset).
    fn best_inner_fit(&self, size: usize) -> Option<Candidate> {
        let mut best: Option<(usize, Candidate)> = None;
        for (c, chunk) in self.chunks.iter().enumerate() {
            for (b, block) in chunk.free.iter().enumerate() {
                let inner = block.offset + block.size <= chunk.high_water;
                if inner && block.size >= size && best.is_none_or(|(s, _)| block.size < s) {
                    best = Some((block.size, Candidate { chunk: c, block: b }));
                }
            }
        }
        best.map(|(_, c)| c)
    }

    /// A block reaching past the high-water mark (a chunk's tail): the tightest fit under the
    /// high-water mark, else the least growth.
    fn best_tail(&self, size: usize) -> Option<Candidate> {
        // (grows, amount): reuse without growth sorts first, then the smallest amount.
        let mut best: Option<((bool, usize), Candidate)> = None;
        for (c, chunk) in self.chunks.iter().enumerate() {
            for (b, block) in chunk.free.iter().enumerate() {
                if block.offset + block.size <= chunk.high_water || block.size < size {
                    continue;
                }
                let end = block.offset + size;
                let score = if end <= chunk.high_water {
                    (false, chunk.high_water - end)
                } else {
                    (true, end - chunk.high_water)
                };
                if best.is_none_or(|(s, _)| score < s) {
                    best = Some((score, Candidate { chunk: c, block: b }));
                }
            }
        }
        best.map(|(_, c)| c)
    }

    /// Returns `size` bytes (rounded up to the alignment) at `offset` of `chunk` to the pool,
    /// merging with adjacent free blocks. Freeing zero bytes does nothing.
    ///
    /// Errors if the range is outside the chunk or overlaps free memory (a double free).
    pub fn free(&mut self, chunk: usize, offset: usize, size: usize) -> Result<()> {
        if size == 0 {
            return Ok(());
        }
        let size = align_up(size, self.alignment)
            .ok_or_else(|| Error::alloc(format!("free of {size} bytes overflows")))?;
        let max_chunk_size = self.max_chunk_size;
        let chunk_ref = self
            .chunks
            .get_mut(chunk)
            .ok_or_else(|| Error::alloc(format!("free in chunk {chunk}, which does not exist")))?;
        let end = offset
            .checked_add(size)
            .filter(|&e| e <= max_chunk_size)
            .ok_or_else(|| {
                Error::alloc(format!(
                    "free of {size} bytes at offset {offset} is outside chunk {chunk}"
                ))
            })?;
        let free = &mut chunk_ref.free;
        // First block starting after the freed range.
        let next = free.partition_point(|b| b.offset < offset);
        let overlaps_prev = next > 0 && free[next - 1].offset + free[next - 1].size > offset;
        let overlaps_next = next < free.len() && free[next].offset < end;
        if overlaps_prev || overlaps_next {
            return Err(Error::alloc(format!(
                "free of {size} bytes at offset {offset} in chunk {chunk} overlaps free memory"
            )));
        }
        let merges_prev = next > 0 && free[next - 1].offset + free[next - 1].size == offset;
        let merges_next = next < free.len() && free[next].offset == end;
        match (merges_prev, merges_next) {
            (true, true) => {
                let following = free.remove(next);
                free[next - 1].size += size + following.size;
            }
            (true, false) => free[next - 1].size += size,
            (false, true) => {
                free[next].offset = offset;
                free[next].size += size;
            }
            (false, false) => free.insert(next, FreeBlock { offset, size }),
        }
        Ok(())
    }

    /// Number of free blocks in chunk `i` (for tests and inspection).
    pub fn n_free_blocks(&self, i: usize) -> usize {
        self.chunks.get(i).map_or(0, |c| c.free.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aligned_linear_growth() {
        let mut a = DynAllocator::new(16, usize::MAX);
        assert_eq!(a.alloc(10).unwrap(), (0, 0));
        assert_eq!(a.alloc(20).unwrap(), (0, 16));
        assert_eq!(a.max_size_of_chunk(0), 48);
        assert_eq!(a.n_chunks(), 1);
        assert_eq!(a.alloc(0).unwrap(), (0, 0));
        assert_eq!(a.max_size_of_chunk(0), 48);
    }

    #[test]
    fn free_merges_neighbours() {
        let mut a = DynAllocator::new(8, usize::MAX);
        let x = a.alloc(8).unwrap();
        let y = a.alloc(8).unwrap();
        let z = a.alloc(8).unwrap();
        let _w = a.alloc(8).unwrap();
        a.free(x.0, x.1, 8).unwrap();
        a.free(z.0, z.1, 8).unwrap();
        assert_eq!(a.n_free_blocks(0), 3); // x, z, tail
        a.free(y.0, y.1, 8).unwrap();
        assert_eq!(a.n_free_blocks(0), 2); // x+y+z merged, tail
                                           // The merged 24 bytes are reused without growth.
        assert_eq!(a.alloc(24).unwrap(), (0, 0));
        assert_eq!(a.max_size_of_chunk(0), 32);
        // Double free is detected.
        a.free(0, 0, 8).unwrap();
        assert!(a.free(0, 0, 8).is_err());
    }

    #[test]
    fn best_fit_prefers_smallest_hole() {
        let mut a = DynAllocator::new(1, usize::MAX);
        let big = a.alloc(100).unwrap();
        let _sep1 = a.alloc(1).unwrap();
        let small = a.alloc(30).unwrap();
        let _sep2 = a.alloc(1).unwrap();
        a.free(big.0, big.1, 100).unwrap();
        a.free(small.0, small.1, 30).unwrap();
        assert_eq!(a.alloc(25).unwrap(), small);
        assert_eq!(a.alloc(90).unwrap(), big);
        assert_eq!(a.max_size_of_chunk(0), 132);
    }

    #[test]
    fn chunks_respect_max_size() {
        let mut a = DynAllocator::new(4, 64);
        assert_eq!(a.alloc(40).unwrap(), (0, 0));
        assert_eq!(a.alloc(40).unwrap(), (1, 0));
        assert_eq!(a.alloc(24).unwrap(), (0, 40));
        assert_eq!(a.alloc(24).unwrap(), (1, 40));
        assert_eq!(a.alloc(4).unwrap(), (2, 0));
        assert!(a.alloc(65).is_err());
        assert_eq!(a.chunk_sizes(), vec![64, 64, 4]);
    }

    #[test]
    fn tail_reuse_under_high_water_before_growth() {
        let mut a = DynAllocator::new(1, usize::MAX);
        let x = a.alloc(50).unwrap();
        a.free(x.0, x.1, 50).unwrap();
        assert_eq!(a.alloc(20).unwrap(), (0, 0));
        assert_eq!(a.alloc(20).unwrap(), (0, 20));
        assert_eq!(a.max_size_of_chunk(0), 50);
        assert_eq!(a.alloc(20).unwrap(), (0, 40));
        assert_eq!(a.max_size_of_chunk(0), 60);
    }
}
