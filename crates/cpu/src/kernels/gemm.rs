//! The GEMM path of MUL_MAT: `D[j, i] = Σ_k B[j, k] · W[i, k]` for products with enough
//! columns, on register-tiled micro-kernels (AVX-512, AVX2/FMA or portable, chosen at run
//! time).
//!
//! Two layouts:
//!
//! * Main path (every ISA; AVX-512 below [`WIDE_MIN_COLS`] columns). A micro-kernel keeps a
//!   tile of `NR` weight rows × `MR` activation rows in registers (AVX-512: 12 × 32 in 24 zmm
//!   accumulators; AVX2: 6 × 16 in 12 ymm; portable: 4 × 8). The vector dimension runs over
//!   activations, so the activations are the packed operand (`MR` values per `k`, packed once
//!   per task and `k` block) and the weights are *broadcast* one value at a time straight from
//!   their rows: f32 weights are never copied, which is what pays with few columns (each
//!   weight is used by few of them). A tile leaves the registers through one L1-resident tile
//!   and 8 × 8 transposes into the output rows (and comes back the same way for a later `k`
//!   block). f16, bf16, q8_0 and q4_0 weights are converted to f32 a few rows × `KC` at a
//!   time into a small per-thread buffer.
//! * Wide path (AVX-512, from [`WIDE_MIN_COLS`] columns; see [`wide`]). Vectorised over weight
//!   rows instead: each task packs its block of weights into 32-row `k`-major panels (per
//!   call: nothing is cached, so nothing can go stale when a weight's memory is rewritten),
//!   broadcasts activations from their rows in place, and stores a micro-tile's accumulators
//!   straight into output rows, without transposes. Packing is repaid by the many columns.
//!
//! Blocking (main path). `k` is cut into blocks of [`KC`] (the weight rows of one micro-panel
//! stay in L1 across the activation panels), activations into blocks of at most [`MC`] rows
//! (their packed block stays in L2 across the weight rows). Work is split between threads by
//! (batch, activation block, weight-row block) tasks.
//!
//! Determinism. Every output element is one chain of fused multiply-adds over `k` in
//! ascending order, starting from zero: a later `k` block resumes from the partial sums stored
//! in the output (f32 round-trips exactly), and no reduction is ever split. The chain is the
//! same for every tile size, task split, path and ISA, so results are bit-identical for any
//! thread count *and* on the AVX-512 (both paths), AVX2 and portable kernels (the portable
//! path uses `f32::mul_add`).

use std::cell::RefCell;
use std::sync::OnceLock;

use super::par_ranges;
#[cfg(target_arch = "x86_64")]
use super::simd::{Avx2, Avx512, Simd};
use super::view::{load_f32, RawTensor, SendPtr};
use crate::dtype::DType;
use crate::error::Result;

/// Columns (activation rows) from which the GEMM path beats the register-tiled dot products
/// (`dot_tile`).
pub const MIN_COLS: usize = 32;

/// Column counts below [`MIN_COLS`] that f32 weights still take through the GEMM path on
/// AVX2-only CPUs: the ones that fill one 16-row activation panel, where the 6 × 16 kernel
/// reads each weight once (a broadcast) for 15-16 columns. Measured against the register
/// tiles on MiniLM's products with weights streaming from memory (DECISIONS: "Few-column f32
/// products on AVX2"): 15-25% faster at 15-16 columns on 1 and 2 threads, about even at 12-14,
/// slower at 17-28 (a second, mostly empty panel).
const AVX2_ONE_PANEL: std::ops::RangeInclusive<usize> = 15..=16;

/// The fewest columns with which f32 weights take the GEMM path on AVX-512 CPUs. Measured on
/// one-sentence MiniLM calls (Zen 5, 2 threads, weights streaming from memory; DECISIONS:
/// "Few-column f32 products on AVX-512"): the 12 × 32 kernel reads each weight once for up to
/// 16 columns and the 4 × 4 register tiles four times; 11 columns 6% faster on the tiles,
/// 12-13 even, 14-16 6-26% faster on the GEMM, 17-18 even (a second, mostly empty vector),
/// 19-31 16-34% faster on the GEMM.
const AVX512_F32_MIN_COLS: usize = 14;

/// The fewest columns with which dense f16/bf16 weights take the GEMM path on AVX-512 CPUs;
/// fewer go to the register tiles, which widen the 16-bit rows as they load them instead of
/// converting every weight to an f32 panel first. Measured on 14336 × 4096 weights streaming
/// from memory (Zen 5, 2 threads, GB/s of weights, tiles / GEMM; DECISIONS: "Few-column
/// f16/bf16 products"): f16 32 columns 11.5 / 8.1, 48 8.0 / 6.1, 64 5.5 / 5.0, 80 4.0 / 4.2,
/// 96 3.3 / 3.7; bf16 32 11.5 / 7.2, 48 7.9 / 5.5, 64 5.5 / 4.7, 80 4.0 / 3.9, 96 3.2 / 3.4.
/// Decided by the whole product's column count, and the tiles compute every element from its
/// own row and column alone (a tile's last rows are padded), so no split of the product
/// changes a bit.
const AVX512_HALF_MIN_COLS: usize = 72;

/// Whether an f32 product with `n_cols` (below [`MIN_COLS`]) takes the GEMM path on `isa`.
fn f32_few_cols(isa: Isa, n_cols: usize) -> bool {
    match isa {
        Isa::Avx2 => AVX2_ONE_PANEL.contains(&n_cols),
        Isa::Avx512 => n_cols >= AVX512_F32_MIN_COLS,
        Isa::Portable => false,
    }
}

/// Elements of `k` per block: a multiple of the quantized block size (32), so converted
/// quantized weights start each block on a block boundary.
const KC: usize = 768;

/// Activation rows per block: a multiple of every ISA's `MR`.
const MC: usize = 256;
/// [`MC`] for products whose weights are converted (which take whole activation blocks per
/// task): half, so the packed block (`MC × KC` floats, 384 KiB) still leaves room in L2 for
/// the converted weight rows and each thread's scratch stays small.
const MC_CONVERTED: usize = 128;

/// The micro-kernel family.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Isa {
    /// Portable Rust (`f32::mul_add`), 4 weight rows × 8 activation rows.
    Portable,
    /// AVX2 + FMA, 6 × 16.
    Avx2,
    /// AVX-512F, 12 × 32.
    Avx512,
}

impl Isa {
    /// The fastest family this CPU runs (detected once).
    pub fn best() -> Isa {
        static BEST: OnceLock<Isa> = OnceLock::new();
        *BEST.get_or_init(|| *Isa::available().last().unwrap_or(&Isa::Portable))
    }

    /// Every family this CPU runs, slowest first.
    pub fn available() -> Vec<Isa> {
        let mut out = vec![Isa::Portable];
        #[cfg(target_arch = "x86_64")]
        {
            let isa = crate::isa::get();
            if isa.avx2_fma() {
                out.push(Isa::Avx2);
                if isa.avx512f() {
                    out.push(Isa::Avx512);
                }
            }
        }
        out
    }

    /// Activation rows per micro-tile (the vector dimension).
    fn mr(self) -> usize {
        match self {
            Isa::Portable => 8,
            Isa::Avx2 => 16,
            Isa::Avx512 => 32,
        }
    }

    /// Weight rows per micro-tile (the broadcast dimension).
    fn nr(self) -> usize {
        match self {
            Isa::Portable => 4,
            Isa::Avx2 => 6,
            Isa::Avx512 => 12,
        }
    }
}

/// Dense f32 activation rows of one batch: base pointer and row stride in elements.
#[derive(Clone, Copy)]
pub struct F32Rows {
    /// First element of row 0.
    pub ptr: *const f32,
    /// Elements between the starts of consecutive rows.
    pub row_stride: usize,
}

// SAFETY: `F32Rows` is a read-only view of activations that stay alive and unchanged for the
// whole MUL_MAT node; sharing it between the node's worker threads only reads them.
unsafe impl Send for F32Rows {}
// SAFETY: as above.
unsafe impl Sync for F32Rows {}

/// Where the weight rows of one batch are read from.
#[derive(Clone, Copy)]
pub enum WeightRows {
    /// Dense, aligned f32 rows read in place.
    F32 {
        /// Row 0.
        ptr: *const f32,
        /// Elements between rows.
        stride: usize,
    },
    /// Rows of another type (or strided f32), converted a block at a time.
    Convert {
        /// Element type.
        dtype: DType,
        /// Row 0.
        ptr: *const u8,
        /// Bytes between rows.
        row_bytes: usize,
        /// Bytes between elements (quantized: between blocks).
        elem_bytes: usize,
    },
    /// q4_1 rows stored interleaved (see [`super::interleaved`]), converted a block at a
    /// time from their rebuilt plain blocks.
    Interleaved {
        /// The matrix's first stored byte.
        ptr: *const u8,
        /// Its layout.
        layout: super::interleaved::Layout,
    },
}

// SAFETY: read-only views of weights that stay alive and unchanged during the product.
unsafe impl Send for WeightRows {}
// SAFETY: as above.
unsafe impl Sync for WeightRows {}

impl WeightRows {
    /// Elements per block of the stored type (1 for in-place f32 rows).
    pub fn block_size(&self) -> usize {
        match self {
            WeightRows::F32 { .. } => 1,
            WeightRows::Convert { dtype, .. } => dtype.block_size(),
            WeightRows::Interleaved { .. } => super::interleaved::BLOCK_VALUES,
        }
    }

    /// The weights of batch `(i02, i03)` of `a`.
    pub fn of(a: &RawTensor, (i02, i03): (usize, usize)) -> WeightRows {
        // SAFETY: row 0 of the batch lies inside `a` (the caller's batch indices are in range).
        let base = unsafe { a.at(a.row_offset(0, i02, i03)) }.cast_const();
        if weights_direct(a) {
            WeightRows::F32 {
                ptr: base.cast::<f32>(),
                stride: a.nb[1] / 4,
            }
        } else {
            WeightRows::Convert {
                dtype: a.dtype,
                ptr: base,
                row_bytes: a.nb[1],
                elem_bytes: a.nb[0],
            }
        }
    }

    /// Rows `i0..i0 + nr`, elements `pc..pc + kc`, as f32: a pointer and a row stride in
    /// elements (in place, or converted into `buf`).
    ///
    /// # Safety
    /// The rows and elements must exist in the weights this view describes; `pc` must be a
    /// multiple of the block size for quantized weights.
    unsafe fn rows(
        &self,
        i0: usize,
        nr: usize,
        (pc, kc): (usize, usize),
        buf: &mut Vec<f32>,
    ) -> Result<(*const f32, usize)> {
        match *self {
            // SAFETY: the elements exist (caller).
            WeightRows::F32 { ptr, stride } => Ok((unsafe { ptr.add(i0 * stride + pc) }, stride)),
            WeightRows::Convert {
                dtype,
                ptr,
                row_bytes,
                elem_bytes,
            } => {
                buf.resize(nr * kc, 0.0);
                let first = pc / dtype.block_size();
                for (r, out) in buf.chunks_exact_mut(kc).enumerate() {
                    // SAFETY: elements pc..pc + kc of row i0 + r exist (caller); `pc` starts a
                    // block, so the pointer addresses its first byte.
                    unsafe {
                        let row = ptr.add((i0 + r) * row_bytes + first * elem_bytes);
                        load_f32(dtype, row, elem_bytes, out)?;
                    }
                }
                Ok((buf.as_ptr(), kc))
            }
            WeightRows::Interleaved { ptr, layout } => {
                buf.resize(nr * kc, 0.0);
                let values = super::interleaved::BLOCK_VALUES;
                let (first, blocks) = (pc / values, kc.div_ceil(values));
                let mut plain = vec![0u8; blocks * super::interleaved::BLOCK_BYTES];
                for (r, out) in buf.chunks_exact_mut(kc).enumerate() {
                    // SAFETY: the blocks of row i0 + r exist in the matrix (caller) and `ptr`
                    // is its first stored byte.
                    unsafe {
                        super::interleaved::gather_blocks(ptr, &layout, i0 + r, first, &mut plain);
                        load_f32(
                            DType::Q4_1,
                            plain.as_ptr(),
                            super::interleaved::BLOCK_BYTES,
                            out,
                        )?;
                    }
                }
                Ok((buf.as_ptr(), kc))
            }
        }
    }
}

/// Whether the weights' rows can be read in place as f32 (dense, aligned).
fn weights_direct(a: &RawTensor) -> bool {
    a.dtype == DType::F32
        && (a.ne[0] <= 1 || a.nb[0] == 4)
        && (a.ptr.0 as usize).is_multiple_of(4)
        && a.nb[1..].iter().all(|s| s % 4 == 0)
}

/// Whether the GEMM path handles this product.
pub fn applies(a: &RawTensor, dst: &RawTensor, n_cols: usize) -> bool {
    let half_tiles = Isa::best() == Isa::Avx512
        && matches!(a.dtype, DType::F16 | DType::BF16)
        && (a.ne[0] <= 1 || a.nb[0] == 2);
    let min_cols = if half_tiles {
        AVX512_HALF_MIN_COLS
    } else {
        MIN_COLS
    };
    (n_cols >= min_cols || (a.dtype == DType::F32 && f32_few_cols(Isa::best(), n_cols)))
        && a.ne[0] >= 8
        && dst.dtype == DType::F32
        && dst.nb[0] == 4
        && (dst.ptr.0 as usize).is_multiple_of(4)
        && dst.nb[1..].iter().all(|s| s % 4 == 0)
        && a.dtype.is_weight_type()
        && KC.is_multiple_of(a.dtype.block_size())
}

/// One product of a batched GEMM.
#[derive(Clone, Copy)]
pub struct Product {
    /// The weights (`m` rows of `k`).
    pub weights: WeightRows,
    /// The activations (`n` rows of `k`).
    pub b: F32Rows,
    /// Output row 0 (`n` rows of `m`, row stride `dst_stride` elements).
    pub dst: *mut f32,
    /// Elements between output rows.
    pub dst_stride: usize,
}

// SAFETY: the output pointer is shared by tasks that write disjoint elements (see `run`); the
// inputs are read-only.
unsafe impl Send for Product {}
// SAFETY: as above.
unsafe impl Sync for Product {}

/// Per-thread buffers: packed activations and converted weights of a block.
#[derive(Default)]
struct Scratch {
    packed: LineBuf,
    weights: Vec<f32>,
}

/// 16 floats on one cache line.
#[repr(C, align(64))]
#[derive(Clone, Copy)]
struct Line([f32; 16]);

/// An f32 buffer that starts on a cache line. The micro-kernels read packed panels a vector
/// at a time, and a vector split over two lines costs two loads: with `Vec<f32>`'s 16-byte
/// alignment every other load of a 16-wide AVX2 panel row was split, and the kernel ran at
/// 56 GFLOPS on one Zen 3 core instead of 87 (peak 101).
#[derive(Default)]
struct LineBuf {
    lines: Vec<Line>,
    len: usize,
}

impl LineBuf {
    /// The buffer as `len` floats (contents kept up to the old length, the rest unspecified
    /// but initialised).
    fn resize(&mut self, len: usize) -> &mut [f32] {
        self.lines.resize(len.div_ceil(16), Line([0.0; 16]));
        self.len = len;
        self.as_mut_slice()
    }

    fn as_slice(&self) -> &[f32] {
        // SAFETY: `lines` holds at least `len` initialised floats (`Line` is 16 f32s with no
        // padding: `repr(C)`, 64 bytes).
        unsafe { std::slice::from_raw_parts(self.lines.as_ptr().cast::<f32>(), self.len) }
    }

    fn as_mut_slice(&mut self) -> &mut [f32] {
        // SAFETY: as in `as_slice`, borrowed mutably.
        unsafe { std::slice::from_raw_parts_mut(self.lines.as_mut_ptr().cast::<f32>(), self.len) }
    }
}

thread_local! {
    // Kept between calls so a product does not fault in fresh pages every time.
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
    // The activations `run` packs once for all of a product's tasks (on the calling thread).
    static SHARED_PACK: RefCell<LineBuf> = RefCell::new(LineBuf::default());
}

/// Runs `f` with this thread's scratch, taken out of the thread-local for the call: if the
/// thread runs another product meanwhile (a nested call), that one starts from empty buffers instead of finding them borrowed.
fn with_scratch<R>(f: impl FnOnce(&mut Scratch) -> R) -> R {
    let mut scratch = SCRATCH.with(RefCell::take);
    let out = f(&mut scratch);
    SCRATCH.with(|cell| cell.replace(scratch));
    out
}

/// Runs `n_products` products of `m` weight rows × `n` activation rows × `k`, in parallel on
/// the current CPU thread pool, with the micro-kernels of `isa`.
///
/// # Safety
/// Every product's pointers must address the elements implied by `m`, `n`, `k` and their
/// strides, stay valid and (inputs) unchanged for the call; no two products' outputs may
/// overlap each other or any input, and nobody else may access the outputs meanwhile. `isa`
/// must be one of [`Isa::available`].
pub unsafe fn run(
    isa: Isa,
    (m, n, k): (usize, usize, usize),
    n_products: usize,
    product: &(dyn Fn(usize) -> Product + Sync),
) -> Result<()> {
    if m == 0 || n == 0 || n_products == 0 {
        return Ok(());
    }
    let threads = super::current_num_threads().max(1);
    #[cfg(target_arch = "x86_64")]
    // The wide path's `k` blocks (wide::KC) must start on block boundaries of the weights:
    // K-quant super-blocks (256) take the main path.
    if isa == Isa::Avx512
        && n >= WIDE_MIN_COLS
        && wide::KC.is_multiple_of(product(0).weights.block_size())
    {
        // SAFETY: as stated (caller).
        return unsafe { wide::run(threads, (m, n, k), n_products, product) };
    }
    let mr = isa.mr();
    // Tasks split the activations first: each task packs only its own rows and reads the
    // weights in place (cheap to re-read), so nothing is packed twice. Aim for a few tasks
    // per thread; blocks of at most MC rows keep the packed block in L2. The split moves work
    // between threads only: each element's chain of multiply-adds stays the same.
    let want = 3 * threads;
    // Weights that are converted (f16, bf16, quantized) are converted once per activation
    // block: for those, split the weight rows instead, as long as the activations fit in
    // few blocks (a q4_1 prompt of 128 tokens converted every weight four times, and spent a
    // third of its products there).
    let converts = !matches!(product(0).weights, WeightRows::F32 { .. });
    let per_product = if converts {
        1
    } else {
        want.div_ceil(n_products)
    };
    let mc_max = if converts { MC_CONVERTED } else { MC };
    let mc = n
        .div_ceil(per_product)
        .next_multiple_of(mr)
        .clamp(mr, mc_max);
    let j_blocks = n.div_ceil(mc);
    // Too few activation rows for the threads: split the weight rows as well.
    let outer = n_products * j_blocks;
    let i_blocks = if outer >= want || m < 96 {
        1
    } else {
        want.div_ceil(outer).min(m.div_ceil(48))
    };
    let nc = m.div_ceil(i_blocks).next_multiple_of(12).min(m);
    let i_blocks = m.div_ceil(nc);
    let tasks = outer * i_blocks;
    // Weight rows split over tasks that share one activation block: each task would pack the
    // same activations (6 times over at one sentence of 16 tokens, 30% of its products' time),
    // so they are packed once, in parallel, and shared. With several activation blocks
    // (more rows) each task packing its own measured faster (64-128 rows: 4-6%): the packed
    // block stays in the cache of the core that uses it.
    let share = i_blocks > 1 && j_blocks == 1;
    let mut shared = if share {
        SHARED_PACK.with(RefCell::take)
    } else {
        LineBuf::default()
    };
    let panels = n.div_ceil(mr);
    let product_floats = panels * mr * k;
    if share {
        let base = SendPtr(
            shared
                .resize(n_products * product_floats)
                .as_mut_ptr()
                .cast(),
        );
        let k_blocks = k.div_ceil(KC);
        par_ranges(n_products * k_blocks * panels, 1, |range| {
            let out = base; // the whole SendPtr, not its raw field
            for item in range {
                let (q, kb, pi) = (
                    item % panels,
                    (item / panels) % k_blocks,
                    item / (panels * k_blocks),
                );
                let (pc, kc) = (kb * KC, KC.min(k - kb * KC));
                let at = pi * product_floats + pc * panels * mr + q * mr * kc;
                // SAFETY: item `item` alone writes these `mr · kc` floats of the buffer sized
                // above; activation rows q·mr.. hold elements pc..pc + kc (caller).
                unsafe {
                    let panel =
                        std::slice::from_raw_parts_mut(out.0.cast::<f32>().add(at), mr * kc);
                    pack_panel(
                        isa,
                        product(pi).b,
                        q * mr,
                        (n - q * mr).min(mr),
                        (pc, kc),
                        panel,
                    );
                }
            }
            Ok(())
        })?;
    }
    let prepacked = share.then(|| shared.as_slice());
    let result = par_ranges(tasks, 1, |range| {
        with_scratch(|scratch| {
            for task in range {
                let ib = task % i_blocks;
                let jb = (task / i_blocks) % j_blocks;
                let pi = task / (i_blocks * j_blocks);
                let p = product(pi);
                let rows = jb * mc..((jb + 1) * mc).min(n);
                let cols = ib * nc..((ib + 1) * nc).min(m);
                let packed = prepacked
                    .map(|all| (&all[pi * product_floats..(pi + 1) * product_floats], panels));
                // SAFETY: the block lies inside the product (caller), and this task alone
                // writes its output elements (rows × cols).
                unsafe { block(isa, &p, k, rows, cols, packed, scratch)? };
            }
            Ok(())
        })
    });
    if share {
        SHARED_PACK.with(|cell| cell.replace(shared));
    }
    result
}

/// One block: output rows `rows` (activations, at most MC) × columns `cols` (weight rows, at
/// most NC) of `p`. With `prepacked` = (panels, count), the product's activations were packed
/// by [`run`]: `count` panels of `mr` rows per `k` block, the blocks one after the other.
///
/// # Safety
/// As [`run`]; this block's output elements belong to the caller alone.
unsafe fn block(
    isa: Isa,
    p: &Product,
    k: usize,
    rows: std::ops::Range<usize>,
    cols: std::ops::Range<usize>,
    prepacked: Option<(&[f32], usize)>,
    scratch: &mut Scratch,
) -> Result<()> {
    let (mr, nr) = (isa.mr(), isa.nr());
    if k == 0 {
        // Empty sums.
        for j in rows {
            for i in cols.clone() {
                // SAFETY: output element (j, i) belongs to this block (caller).
                unsafe { *p.dst.add(j * p.dst_stride + i) = 0.0 };
            }
        }
        return Ok(());
    }
    let panels = rows.len().div_ceil(mr);
    let Scratch { packed, weights } = scratch;
    // The accumulators of one micro-tile pass through this L1-resident tile on their way to
    // and from the output: nr × mr values, rows padded to a multiple of 8 for the 8 × 8
    // transposes.
    let mut tile = Tile([0.0; TILE]);
    let tile = &mut tile.0[..nr.next_multiple_of(8) * mr];
    for pc in (0..k).step_by(KC) {
        let kc = KC.min(k - pc);
        let packed: &[f32] = match prepacked {
            // Every activation row of the product, packed by `run` the same way: `k` block
            // `pc` holds all its panels, this block's from panel `rows.start / mr` on.
            Some((all, all_panels)) => {
                let at = pc * all_panels * mr + rows.start / mr * mr * kc;
                &all[at..at + panels * mr * kc]
            }
            None => {
                for (q, panel) in packed
                    .resize(panels * mr * kc)
                    .chunks_exact_mut(mr * kc)
                    .enumerate()
                {
                    let j0 = rows.start + q * mr;
                    // SAFETY: rows j0.. of the activations hold at least pc + kc elements
                    // (caller).
                    unsafe {
                        pack_panel(isa, p.b, j0, rows.end.min(j0 + mr) - j0, (pc, kc), panel)
                    };
                }
                packed.as_slice()
            }
        };
        for i0 in cols.clone().step_by(nr) {
            let nr_here = nr.min(cols.end - i0);
            // SAFETY: weight rows i0..i0 + nr_here and elements pc..pc + kc exist; `pc` is a
            // multiple of KC, itself a multiple of every block size.
            let (w, w_stride) = unsafe { p.weights.rows(i0, nr_here, (pc, kc), weights)? };
            // In-place f32 weights: the next micro-panel's rows, prefetched while this one
            // computes with the first activation panel (null: nothing to prefetch).
            let next = match p.weights {
                WeightRows::F32 { .. } if i0 + nr < cols.end => w.wrapping_add(nr * w_stride),
                _ => std::ptr::null(),
            };
            for (q, panel) in packed.chunks_exact(mr * kc).enumerate() {
                let j0 = rows.start + q * mr;
                let rows_here = mr.min(rows.end - j0);
                // SAFETY: `w` holds `nr_here` rows of `kc` elements with stride `w_stride`;
                // `panel` holds `kc` × `mr` packed values; `tile` one padded tile; output rows
                // j0..j0 + rows_here, columns i0..i0 + nr_here lie in the product and belong
                // to this block. A later `k` block resumes from the partial sums the earlier
                // one stored in the output (exact: f32 values round-trip unchanged).
                unsafe {
                    let c = p.dst.add(j0 * p.dst_stride + i0);
                    let shape = (nr_here, rows_here);
                    if pc > 0 {
                        load_tile(isa, c, p.dst_stride, shape, mr, tile);
                    }
                    micro_kernel(
                        isa,
                        nr_here,
                        rows_here,
                        kc,
                        panel,
                        (w, w_stride),
                        tile,
                        pc > 0,
                        if q == 0 { next } else { std::ptr::null() },
                    );
                    store_tile(isa, c, p.dst_stride, shape, mr, tile);
                }
            }
        }
    }
    Ok(())
}

/// Floats in the largest padded micro-tile (AVX-512: 16 × 32).
const TILE: usize = 16 * 32;

/// A micro-tile's accumulators in memory, aligned to a cache line.
#[repr(align(64))]
struct Tile([f32; TILE]);

/// Packs activation rows `j0..j0 + count` (elements `pc..pc + kc`) as `kc` groups of
/// `isa.mr()` values, rows past `count` as zeros.
///
/// # Safety
/// The rows and elements must exist in `b`; the CPU runs `isa`.
unsafe fn pack_panel(
    isa: Isa,
    b: F32Rows,
    j0: usize,
    count: usize,
    (pc, kc): (usize, usize),
    out: &mut [f32],
) {
    // SAFETY: as stated (caller).
    unsafe { pack_rows(isa, isa.mr(), b, j0, count, (pc, kc), out) }
}

/// [`pack_panel`] into groups of `mr` (a multiple of 8) values per `k`.
///
/// # Safety
/// As [`pack_panel`]; `out` holds `kc × mr` values.
unsafe fn pack_rows(
    isa: Isa,
    mr: usize,
    b: F32Rows,
    j0: usize,
    count: usize,
    (pc, kc): (usize, usize),
    out: &mut [f32],
) {
    debug_assert!(out.len() >= kc * mr && count <= mr);
    // SAFETY: row j0 + l has elements pc..pc + kc (caller).
    let row = |l: usize| unsafe { b.ptr.add((j0 + l) * b.row_stride + pc) };
    let mut done = 0;
    #[cfg(target_arch = "x86_64")]
    if isa != Isa::Portable && count == mr {
        // 8 × 8 blocks transposed in registers; the k tail below.
        done = kc / 8 * 8;
        for l0 in (0..mr).step_by(8) {
            let rows: [*const f32; 8] = std::array::from_fn(|i| row(l0 + i));
            for kk in (0..done).step_by(8) {
                // SAFETY: elements kk..kk + 8 < kc of the 8 rows exist; the 8 outputs of
                // 8 floats at (kk + t) * mr + l0 lie inside `out`; the CPU has AVX2.
                unsafe { transpose8(&rows, kk, out.as_mut_ptr().add(kk * mr + l0), mr) };
            }
        }
    }
    for l in 0..mr {
        if l < count {
            let r = row(l);
            for kk in done..kc {
                // SAFETY: element kk < kc of the row exists.
                out[kk * mr + l] = unsafe { *r.add(kk) };
            }
        } else {
            for kk in done..kc {
                out[kk * mr + l] = 0.0;
            }
        }
    }
}

/// `out[t * stride + i] = rows[i][kk + t]` for an 8 × 8 block.
///
/// # Safety
/// Each row has elements kk..kk + 8; `out` addresses 8 groups of 8 writable floats `stride`
/// apart; the CPU has AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn transpose8(rows: &[*const f32; 8], kk: usize, out: *mut f32, stride: usize) {
    use std::arch::x86_64::*;
    // SAFETY: the loads and stores stay inside the ranges the caller guarantees.
    unsafe {
        let r: [__m256; 8] = std::array::from_fn(|i| _mm256_loadu_ps(rows[i].add(kk)));
        for (t, v) in transpose8x8(r).iter().enumerate() {
            _mm256_storeu_ps(out.add(t * stride), *v);
        }
    }
}

/// The transpose of an 8 × 8 block held as 8 row vectors.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn transpose8x8(r: [std::arch::x86_64::__m256; 8]) -> [std::arch::x86_64::__m256; 8] {
    use std::arch::x86_64::*;
    let t0 = _mm256_unpacklo_ps(r[0], r[1]);
    let t1 = _mm256_unpackhi_ps(r[0], r[1]);
    let t2 = _mm256_unpacklo_ps(r[2], r[3]);
    let t3 = _mm256_unpackhi_ps(r[2], r[3]);
    let t4 = _mm256_unpacklo_ps(r[4], r[5]);
    let t5 = _mm256_unpackhi_ps(r[4], r[5]);
    let t6 = _mm256_unpacklo_ps(r[6], r[7]);
    let t7 = _mm256_unpackhi_ps(r[6], r[7]);
    let u0 = _mm256_shuffle_ps::<0x44>(t0, t2);
    let u1 = _mm256_shuffle_ps::<0xEE>(t0, t2);
    let u2 = _mm256_shuffle_ps::<0x44>(t1, t3);
    let u3 = _mm256_shuffle_ps::<0xEE>(t1, t3);
    let u4 = _mm256_shuffle_ps::<0x44>(t4, t6);
    let u5 = _mm256_shuffle_ps::<0xEE>(t4, t6);
    let u6 = _mm256_shuffle_ps::<0x44>(t5, t7);
    let u7 = _mm256_shuffle_ps::<0xEE>(t5, t7);
    [
        _mm256_permute2f128_ps::<0x20>(u0, u4),
        _mm256_permute2f128_ps::<0x20>(u1, u5),
        _mm256_permute2f128_ps::<0x20>(u2, u6),
        _mm256_permute2f128_ps::<0x20>(u3, u7),
        _mm256_permute2f128_ps::<0x31>(u0, u4),
        _mm256_permute2f128_ps::<0x31>(u1, u5),
        _mm256_permute2f128_ps::<0x31>(u2, u6),
        _mm256_permute2f128_ps::<0x31>(u3, u7),
    ]
}

/// [`store_tile`] through 8 × 8 register transposes: whole blocks of 8 tile rows, a masked
/// store for a partial one.
///
/// # Safety
/// As [`store_tile`]; `tile` holds a multiple of 8 rows of `mr` (a multiple of 8) values; the
/// CPU has AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn store_tile_avx2(
    c: *mut f32,
    stride: usize,
    (nr, rows): (usize, usize),
    mr: usize,
    tile: &[f32],
) {
    use std::arch::x86_64::*;
    debug_assert!(tile.len() >= nr.next_multiple_of(8) * mr && mr.is_multiple_of(8));
    let t = tile.as_ptr();
    for r0 in (0..nr).step_by(8) {
        let width = (nr - r0).min(8) as i32;
        for l0 in (0..rows).step_by(8) {
            // SAFETY: tile rows r0..r0 + 8 and lanes l0..l0 + 8 lie inside the tile (caller);
            // output row l < rows, elements r0..r0 + width lie inside the tile's output.
            unsafe {
                let v: [__m256; 8] =
                    std::array::from_fn(|i| _mm256_loadu_ps(t.add((r0 + i) * mr + l0)));
                let cols = transpose8x8(v);
                for (i, col) in cols.iter().enumerate().take(rows - l0) {
                    let dst = c.add((l0 + i) * stride + r0);
                    if width == 8 {
                        _mm256_storeu_ps(dst, *col);
                    } else {
                        store_first(dst, *col, width as usize);
                    }
                }
            }
        }
    }
}

/// Stores the first `width` (1 to 7) lanes of `v` at `dst` with plain 16-, 8- and 4-byte
/// stores: a masked store (`vmaskmovps`) costs tens of cycles on AMD cores, and the 6-row
/// AVX2 tiles store every output row this way (it took an eighth of the GEMM's time).
///
/// # Safety
/// `dst` addresses `width` writable floats; the CPU has AVX.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn store_first(dst: *mut f32, v: std::arch::x86_64::__m256, width: usize) {
    use std::arch::x86_64::*;
    debug_assert!(width < 8);
    let (mut half, mut at, mut left) = (_mm256_castps256_ps128(v), 0, width);
    // SAFETY: each store writes lanes at..at + (4, 2 or 1) < width of `dst` (caller).
    unsafe {
        if left >= 4 {
            _mm_storeu_ps(dst, half);
            half = _mm256_extractf128_ps::<1>(v);
            (at, left) = (4, left - 4);
        }
        if left >= 2 {
            _mm_storel_pd(dst.add(at).cast(), _mm_castps_pd(half));
            half = _mm_movehl_ps(half, half);
            (at, left) = (at + 2, left - 2);
        }
        if left == 1 {
            _mm_store_ss(dst.add(at), half);
        }
    }
}

/// Copies the tile's valid part to the output (`c[l, r] = tile[r * mr + l]`).
///
/// # Safety
/// `c` must address `rows` rows (stride `stride`) of `nr` writable elements nobody else
/// accesses; `tile` holds `nr` rounded up to 8 × `mr` values; the CPU runs `isa`.
unsafe fn store_tile(
    isa: Isa,
    c: *mut f32,
    stride: usize,
    shape: (usize, usize),
    mr: usize,
    tile: &[f32],
) {
    #[cfg(target_arch = "x86_64")]
    if isa != Isa::Portable {
        // SAFETY: as stated (caller); AVX2 runs wherever the non-portable kernels do.
        unsafe { store_tile_avx2(c, stride, shape, mr, tile) };
        return;
    }
    let _ = isa;
    // SAFETY: as stated (caller).
    unsafe { store_tile_portable(c, stride, shape, mr, tile) };
}

/// The inverse of [`store_tile`]: `tile[r * mr + l] = c[l, r]` for the valid part (lanes of
/// rows past `rows` are left as they are: the micro-kernels ignore them).
///
/// # Safety
/// `c` must address `rows` rows (stride `stride`) of `nr` readable elements nobody else
/// writes; `tile` holds `nr` rounded up to 8 × `mr` values; the CPU runs `isa`.
unsafe fn load_tile(
    isa: Isa,
    c: *const f32,
    stride: usize,
    (nr, rows): (usize, usize),
    mr: usize,
    tile: &mut [f32],
) {
    #[cfg(target_arch = "x86_64")]
    if isa != Isa::Portable {
        // SAFETY: as stated (caller); AVX2 runs wherever the non-portable kernels do.
        unsafe { load_tile_avx2(c, stride, (nr, rows), mr, tile) };
        return;
    }
    let _ = isa;
    debug_assert!(tile.len() >= nr * mr && rows <= mr);
    let t = tile.as_mut_ptr();
    for l in 0..rows {
        for r in 0..nr {
            // SAFETY: inside the tile and its output elements (caller).
            unsafe { *t.add(r * mr + l) = *c.add(l * stride + r) };
        }
    }
}

/// [`load_tile`] through 8 × 8 register transposes (masked loads for a partial block).
///
/// # Safety
/// As [`load_tile`]; `tile` holds a multiple of 8 rows of `mr` (a multiple of 8) values; the
/// CPU has AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn load_tile_avx2(
    c: *const f32,
    stride: usize,
    (nr, rows): (usize, usize),
    mr: usize,
    tile: &mut [f32],
) {
    use std::arch::x86_64::*;
    debug_assert!(tile.len() >= nr.next_multiple_of(8) * mr && mr.is_multiple_of(8));
    let t = tile.as_mut_ptr();
    for r0 in (0..nr).step_by(8) {
        let width = (nr - r0).min(8) as i32;
        let lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        let mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(width), lanes);
        for l0 in (0..rows).step_by(8) {
            // SAFETY: output rows l0 + i < rows, elements r0..r0 + width lie inside the
            // tile's output (caller); tile rows r0..r0 + 8 and lanes l0..l0 + 8 inside the
            // tile.
            unsafe {
                let v: [__m256; 8] = std::array::from_fn(|i| {
                    let src = c.add((l0 + i).min(rows - 1) * stride + r0);
                    if l0 + i >= rows {
                        _mm256_setzero_ps()
                    } else if width == 8 {
                        _mm256_loadu_ps(src)
                    } else {
                        _mm256_maskload_ps(src, mask)
                    }
                });
                for (i, row) in transpose8x8(v).iter().enumerate() {
                    _mm256_storeu_ps(t.add((r0 + i) * mr + l0), *row);
                }
            }
        }
    }
}

/// [`store_tile`] element by element.
///
/// # Safety
/// As [`store_tile`].
unsafe fn store_tile_portable(
    c: *mut f32,
    stride: usize,
    (nr, rows): (usize, usize),
    mr: usize,
    tile: &[f32],
) {
    debug_assert!(tile.len() >= nr * mr && rows <= mr);
    let t = tile.as_ptr();
    for l in 0..rows {
        for r in 0..nr {
            // SAFETY: inside the tile and its output elements (caller).
            unsafe { *c.add(l * stride + r) = *t.add(r * mr + l) };
        }
    }
}

/// `tile[r][l] (+)= Σ_kk panel[kk][l] · w[r][kk]` for `nr` weight rows; `rows` activation rows
/// are valid (the rest of the panel is zeros and their lanes are ignored). A non-null `next`
/// is the first of the next micro-panel's weight rows (same stride): the SIMD kernels ask for
/// one of its cache lines per step (a hint; the address is never read through).
///
/// # Safety
/// `panel` holds `kc` × `isa.mr()` values; `w` addresses `nr ≤ isa.nr()` rows of `kc`
/// elements with stride `w_stride`; `tile` holds `isa.nr()` × `isa.mr()` values; the CPU
/// runs `isa`.
#[allow(clippy::too_many_arguments)]
unsafe fn micro_kernel(
    isa: Isa,
    nr: usize,
    rows: usize,
    kc: usize,
    panel: &[f32],
    (w, w_stride): (*const f32, usize),
    tile: &mut [f32],
    accumulate: bool,
    next: *const f32,
) {
    debug_assert!(nr <= isa.nr() && rows <= isa.mr() && panel.len() >= kc * isa.mr());
    let (b, t) = (panel.as_ptr(), tile.as_mut_ptr());
    macro_rules! dispatch {
        ($kernel:ident, $nv:literal, $($n:literal)+) => {
            match nr {
                $($n => $kernel::<$n, $nv>(kc, b, w, w_stride, t, accumulate, next),)+
                _ => unreachable!("tile rows are at most the ISA's NR"),
            }
        };
    }
    // SAFETY: sizes as stated (caller); the ISA's kernels run on this CPU (caller).
    unsafe {
        match isa {
            Isa::Portable => dispatch!(kernel_portable, 1, 1 2 3 4),
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => {
                if rows <= 8 {
                    dispatch!(kernel_avx2, 1, 1 2 3 4 5 6)
                } else {
                    dispatch!(kernel_avx2, 2, 1 2 3 4 5 6)
                }
            }
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => {
                if rows <= 16 {
                    dispatch!(kernel_avx512, 1, 1 2 3 4 5 6 7 8 9 10 11 12)
                } else {
                    dispatch!(kernel_avx512, 2, 1 2 3 4 5 6 7 8 9 10 11 12)
                }
            }
            #[cfg(not(target_arch = "x86_64"))]
            _ => unreachable!("x86 kernels on another architecture"),
        }
    }
}

/// Portable micro-kernel: `NR` weight rows × 8 activation rows (`_NV` is unused).
///
/// # Safety
/// As [`micro_kernel`].
unsafe fn kernel_portable<const NR: usize, const _NV: usize>(
    kc: usize,
    b: *const f32,
    w: *const f32,
    w_stride: usize,
    tile: *mut f32,
    accumulate: bool,
    _next: *const f32,
) {
    const MR: usize = 8;
    let mut acc = [[0f32; MR]; NR];
    if accumulate {
        for (r, row) in acc.iter_mut().enumerate() {
            for (l, v) in row.iter_mut().enumerate() {
                // SAFETY: the tile holds NR × MR values (caller).
                *v = unsafe { *tile.add(r * MR + l) };
            }
        }
    }
    for kk in 0..kc {
        // SAFETY: the panel holds kc × MR values (caller).
        let bv: [f32; MR] = unsafe { *b.add(kk * MR).cast::<[f32; MR]>() };
        for (r, row) in acc.iter_mut().enumerate() {
            // SAFETY: weight row r has kc elements (caller).
            let wv = unsafe { *w.add(r * w_stride + kk) };
            for (v, &x) in row.iter_mut().zip(&bv) {
                *v = x.mul_add(wv, *v);
            }
        }
    }
    for (r, row) in acc.iter().enumerate() {
        for (l, &v) in row.iter().enumerate() {
            // SAFETY: as above.
            unsafe { *tile.add(r * MR + l) = v };
        }
    }
}

/// AVX2 micro-kernel: `NR` (≤ 6) weight rows × `NV` × 8 activation rows.
///
/// # Safety
/// As [`micro_kernel`]; the CPU has AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn kernel_avx2<const NR: usize, const NV: usize>(
    kc: usize,
    b: *const f32,
    w: *const f32,
    w_stride: usize,
    tile: *mut f32,
    accumulate: bool,
    next: *const f32,
) {
    // SAFETY: the CPU has AVX2 and FMA; the rest is forwarded (caller).
    unsafe {
        kernel_simd::<_, NR, NV>(Avx2::assume(), kc, b, (w, w_stride), tile, accumulate, next)
    }
}

/// AVX-512 micro-kernel: `NR` (≤ 12) weight rows × `NV` × 16 activation rows.
///
/// # Safety
/// As [`micro_kernel`]; the CPU has AVX-512F (and AVX2 and FMA).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn kernel_avx512<const NR: usize, const NV: usize>(
    kc: usize,
    b: *const f32,
    w: *const f32,
    w_stride: usize,
    tile: *mut f32,
    accumulate: bool,
    next: *const f32,
) {
    // SAFETY: the CPU has AVX-512F, AVX2 and FMA; the rest is forwarded (caller).
    unsafe {
        kernel_simd::<_, NR, NV>(
            Avx512::assume(),
            kc,
            b,
            (w, w_stride),
            tile,
            accumulate,
            next,
        )
    }
}

/// The micro-kernel for any [`Simd`]: `NR` weight rows × `NV` vectors of activation rows of a
/// panel `MR = 2·LANES` wide. Every tile element is one chain of fused multiply-adds over `k`.
///
/// # Safety
/// As [`micro_kernel`], with `MR = 2·S::LANES`.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn kernel_simd<S: Simd, const NR: usize, const NV: usize>(
    s: S,
    kc: usize,
    b: *const f32,
    (w, w_stride): (*const f32, usize),
    tile: *mut f32,
    accumulate: bool,
    next: *const f32,
) {
    let lanes = S::LANES;
    let mr = 2 * lanes;
    // SAFETY: every pointer below stays inside the panel (kc × MR), the weight rows (NR × kc,
    // stride w_stride) or the tile (NR × MR) (caller).
    unsafe {
        let mut acc = [[s.zero(); NV]; NR];
        if accumulate {
            for (r, row) in acc.iter_mut().enumerate() {
                for (v, x) in row.iter_mut().enumerate() {
                    *x = s.loadu(tile.add(r * mr + v * lanes));
                }
            }
        }
        let mut rows = [w; NR];
        for (r, p) in rows.iter_mut().enumerate() {
            *p = w.add(r * w_stride);
        }
        // One line of the next micro-panel's weights per step (row by row, 16 floats at a
        // time), so its rows are on their way while this one computes.
        let (mut pf_row, mut pf_col) = (0usize, 0usize);
        for kk in 0..kc {
            if !next.is_null() && pf_col < kc {
                super::simd::prefetch_lines(
                    next.wrapping_add(pf_row * w_stride + pf_col).cast(),
                    4,
                );
                pf_row += 1;
                if pf_row == NR {
                    pf_row = 0;
                    pf_col += 16;
                }
            }
            let bp = b.add(kk * mr);
            let mut bv = [s.zero(); NV];
            for (v, x) in bv.iter_mut().enumerate() {
                *x = s.loadu(bp.add(v * lanes));
            }
            for r in 0..NR {
                let wv = s.splat(*rows[r].add(kk));
                for v in 0..NV {
                    acc[r][v] = s.fma(bv[v], wv, acc[r][v]);
                }
            }
        }
        for (r, row) in acc.iter().enumerate() {
            for (v, &x) in row.iter().enumerate() {
                s.storeu(tile.add(r * mr + v * lanes), x);
            }
        }
    }
}

/// Columns (activation rows) from which AVX-512 products take the wide path ([`wide`]).
pub const WIDE_MIN_COLS: usize = 256;

/// The wide path: the AVX-512 GEMM for many activation rows, vectorised over weight rows.
///
/// Weights are packed per task into panels of [`wide::WR`] rows, `k`-major (two zmm per `k`),
/// and the activations are broadcast straight from their rows, [`wide::AR`] rows per
/// micro-tile, so a micro-tile's accumulators are rows of the output and are stored (or, for a
/// later `k` block, reloaded) without any transpose. Packing costs one pass over the task's
/// weights, repaid by the many activation rows that reuse them; products with fewer columns
/// read the weights in place instead (the main path above). Packed weights live only for the
/// call: nothing is cached, so nothing can go stale when the weights' memory changes.
///
/// Blocking: `k` in blocks of [`wide::KC`] (an activation sliver, `AR × KC` floats, stays in
/// L1 across the weight panels), weight rows in blocks of at most [`wide::WC`] (their packed
/// panels stay in L2 across the slivers). Every output element is still one chain of fused
/// multiply-adds over `k` in ascending order (resumed from the output between `k` blocks), the
/// same chain as the other paths, so results are bit-identical to them.
#[cfg(target_arch = "x86_64")]
mod wide {
    use super::{pack_rows, par_ranges, with_scratch, Isa, Product, Result, Scratch};

    /// Weight rows per packed panel: two zmm vectors.
    pub const WR: usize = 16 * NVMAX;
    /// zmm vectors per output row of a micro-tile.
    const NVMAX: usize = 2;
    /// Activation rows per micro-tile: 24 accumulators, two weight vectors and a broadcast
    /// fit the 32 zmm registers.
    pub const AR: usize = 12;
    /// Elements of `k` per block: a sliver of `AR` activation rows (18 KiB) stays in L1; a
    /// multiple of the quantized block size (32).
    pub const KC: usize = 384;
    /// Most weight rows per task block (packed: `WC × KC` floats, 384 KiB, in L2).
    pub const WC: usize = 256;

    /// [`super::run`] on the wide path.
    ///
    /// # Safety
    /// As [`super::run`], with AVX-512F on this CPU.
    pub unsafe fn run(
        threads: usize,
        (m, n, k): (usize, usize, usize),
        n_products: usize,
        product: &(dyn Fn(usize) -> Product + Sync),
    ) -> Result<()> {
        // Weight blocks of equal size (multiples of WR) up to WC rows; then enough activation
        // blocks for a few tasks per thread. Each task packs its weight block once per `k`
        // block and runs it over its activation rows.
        let i_blocks = m.div_ceil(WC);
        let wc = m.div_ceil(i_blocks).next_multiple_of(WR);
        let i_blocks = m.div_ceil(wc);
        let want = 3 * threads;
        let j_blocks = want.div_ceil(n_products * i_blocks).min(n.div_ceil(4 * AR));
        let nc = n.div_ceil(j_blocks.max(1)).next_multiple_of(AR);
        let j_blocks = n.div_ceil(nc);
        let tasks = n_products * i_blocks * j_blocks;
        par_ranges(tasks, 1, |range| {
            with_scratch(|scratch| {
                for task in range {
                    let jb = task % j_blocks;
                    let ib = (task / j_blocks) % i_blocks;
                    let p = product(task / (i_blocks * j_blocks));
                    let rows = jb * nc..((jb + 1) * nc).min(n);
                    let cols = ib * wc..((ib + 1) * wc).min(m);
                    // SAFETY: the block lies inside the product (caller), and this task alone
                    // writes its output elements (rows × cols); the CPU has AVX-512F (caller).
                    unsafe { block(&p, k, rows, cols, scratch)? };
                }
                Ok(())
            })
        })
    }

    /// Output rows `rows` × columns `cols` (at most WC) of `p`.
    ///
    /// # Safety
    /// As [`run`]; this block's output elements belong to the caller alone.
    unsafe fn block(
        p: &Product,
        k: usize,
        rows: std::ops::Range<usize>,
        cols: std::ops::Range<usize>,
        scratch: &mut Scratch,
    ) -> Result<()> {
        if k == 0 {
            for j in rows {
                for i in cols.clone() {
                    // SAFETY: output element (j, i) belongs to this block (caller).
                    unsafe { *p.dst.add(j * p.dst_stride + i) = 0.0 };
                }
            }
            return Ok(());
        }
        let Scratch { packed, weights } = scratch;
        let panels = cols.len().div_ceil(WR);
        for pc in (0..k).step_by(KC) {
            let kc = KC.min(k - pc);
            for (q, panel) in packed
                .resize(panels * WR * kc)
                .chunks_exact_mut(WR * kc)
                .enumerate()
            {
                let i0 = cols.start + q * WR;
                let count = WR.min(cols.end - i0);
                // SAFETY: weight rows i0..i0 + count and elements pc..pc + kc exist; `pc` is
                // a multiple of KC, itself a multiple of every block size. The rows come back
                // as f32 rows (in place or converted into `weights`), packed like activations.
                unsafe {
                    let (w, w_stride) = p.weights.rows(i0, count, (pc, kc), weights)?;
                    let rows = super::F32Rows {
                        ptr: w,
                        row_stride: w_stride,
                    };
                    pack_rows(Isa::Avx512, WR, rows, 0, count, (0, kc), panel);
                }
            }
            for j0 in rows.clone().step_by(AR) {
                let ar = AR.min(rows.end - j0);
                // SAFETY: activation rows j0..j0 + ar hold elements pc..pc + kc (caller).
                let a = unsafe { p.b.ptr.add(j0 * p.b.row_stride + pc) };
                for (q, panel) in packed.as_slice().chunks_exact(WR * kc).enumerate() {
                    let i0 = cols.start + q * WR;
                    // SAFETY: `panel` holds kc × WR packed weights; the activation rows and
                    // the output rows j0..j0 + ar, columns i0..i0 + width belong to this block
                    // (caller); the CPU has AVX-512F (caller).
                    unsafe {
                        let c = p.dst.add(j0 * p.dst_stride + i0);
                        let width = WR.min(cols.end - i0);
                        kernel(
                            ar,
                            kc,
                            panel.as_ptr(),
                            (a, p.b.row_stride),
                            (c, p.dst_stride),
                            width,
                            pc > 0,
                        );
                    }
                }
            }
        }
        Ok(())
    }

    /// Dispatches [`kernel_ar`] by the sliver's row count and the panel's width.
    ///
    /// # Safety
    /// As [`kernel_ar`] with `AR_ = ar ≤ AR`.
    #[allow(clippy::too_many_arguments)]
    unsafe fn kernel(
        ar: usize,
        kc: usize,
        w: *const f32,
        a: (*const f32, usize),
        c: (*mut f32, usize),
        width: usize,
        accumulate: bool,
    ) {
        macro_rules! dispatch {
            ($nv:literal) => {
                match ar {
                    1 => kernel_ar::<1, $nv>(kc, w, a, c, width, accumulate),
                    2 => kernel_ar::<2, $nv>(kc, w, a, c, width, accumulate),
                    3 => kernel_ar::<3, $nv>(kc, w, a, c, width, accumulate),
                    4 => kernel_ar::<4, $nv>(kc, w, a, c, width, accumulate),
                    5 => kernel_ar::<5, $nv>(kc, w, a, c, width, accumulate),
                    6 => kernel_ar::<6, $nv>(kc, w, a, c, width, accumulate),
                    7 => kernel_ar::<7, $nv>(kc, w, a, c, width, accumulate),
                    8 => kernel_ar::<8, $nv>(kc, w, a, c, width, accumulate),
                    9 => kernel_ar::<9, $nv>(kc, w, a, c, width, accumulate),
                    10 => kernel_ar::<10, $nv>(kc, w, a, c, width, accumulate),
                    11 => kernel_ar::<11, $nv>(kc, w, a, c, width, accumulate),
                    _ => kernel_ar::<12, $nv>(kc, w, a, c, width, accumulate),
                }
            };
        }
        debug_assert!((1..=AR).contains(&ar) && (1..=WR).contains(&width));
        // SAFETY: as stated (caller).
        unsafe {
            match width.div_ceil(16) {
                1 => dispatch!(1),
                2 => dispatch!(2),
                3 => dispatch!(3),
                _ => dispatch!(4),
            }
        }
    }

    /// `c[r][0..width] (+)= Σ_kk a[r][kk] · w[kk][0..width]` for `AR_` activation rows `a`
    /// (row stride given) and a packed weight panel `w` (`kc × WR`), each product a fused
    /// multiply-add in ascending `kk`; `NV` zmm vectors per output row (`width ≤ 16 · NV`).
    ///
    /// # Safety
    /// `w` holds `kc × WR` floats; the `AR_` activation rows hold `kc` elements each; `c`
    /// addresses `AR_` output rows (stride given) of `width` elements nobody else accesses;
    /// the CPU has AVX-512F.
    #[target_feature(enable = "avx512f")]
    unsafe fn kernel_ar<const AR_: usize, const NV: usize>(
        kc: usize,
        w: *const f32,
        (a, a_stride): (*const f32, usize),
        (c, c_stride): (*mut f32, usize),
        width: usize,
        accumulate: bool,
    ) {
        use std::arch::x86_64::*;
        let masks: [__mmask16; NV] =
            std::array::from_fn(|v| super::super::simd::lanes16(width.saturating_sub(16 * v)));
        // SAFETY: every access stays inside the panel, the activation rows or the output
        // elements (caller); masked lanes are not touched.
        unsafe {
            let mut acc = [[_mm512_setzero_ps(); NV]; AR_];
            if accumulate {
                for (r, row) in acc.iter_mut().enumerate() {
                    for (v, x) in row.iter_mut().enumerate() {
                        *x = _mm512_maskz_loadu_ps(masks[v], c.add(r * c_stride + v * 16));
                    }
                }
            }
            let rows: [*const f32; AR_] = std::array::from_fn(|r| a.add(r * a_stride));
            for kk in 0..kc {
                let wp = w.add(kk * WR);
                let wv: [__m512; NV] = std::array::from_fn(|v| _mm512_loadu_ps(wp.add(v * 16)));
                for r in 0..AR_ {
                    let x = _mm512_set1_ps(*rows[r].add(kk));
                    for v in 0..NV {
                        acc[r][v] = _mm512_fmadd_ps(x, wv[v], acc[r][v]);
                    }
                }
            }
            for (r, row) in acc.iter().enumerate() {
                for (v, &x) in row.iter().enumerate() {
                    _mm512_mask_storeu_ps(c.add(r * c_stride + v * 16), masks[v], x);
                }
            }
        }
    }
}

/// `dst[j, i] = Σ_k b[j, k] · w[i, k]` for dense row-major slices (`w`: `m × k`, `b`: `n × k`,
/// `dst`: `n × m`) with the micro-kernels of `isa`: the entry point the unit tests use to
/// reach each ISA.
#[cfg(test)]
pub fn sgemm(
    isa: Isa,
    (m, n, k): (usize, usize, usize),
    w: &[f32],
    b: &[f32],
    dst: &mut [f32],
) -> Result<()> {
    if w.len() < m * k || b.len() < n * k || dst.len() < n * m {
        return Err(crate::error::Error::InvalidArgument(format!(
            "sgemm: slices too short for {m}×{n}×{k}"
        )));
    }
    if !Isa::available().contains(&isa) {
        return Err(crate::error::Error::InvalidArgument(format!(
            "sgemm: this CPU does not run the {isa:?} kernels"
        )));
    }
    let p = Product {
        weights: WeightRows::F32 {
            ptr: w.as_ptr(),
            stride: k,
        },
        b: F32Rows {
            ptr: b.as_ptr(),
            row_stride: k,
        },
        dst: dst.as_mut_ptr(),
        dst_stride: m,
    };
    // SAFETY: the slices hold the elements the sizes imply (checked above); `dst` is borrowed
    // mutably, so it overlaps nothing; the ISA is available (checked above).
    unsafe { run(isa, (m, n, k), 1, &|_| p) }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::testing::at_thread_counts;

    fn values(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
            })
            .collect()
    }

    /// The micro-kernel body on every ISA token this CPU has and on the 16-lane stand-in
    /// for AVX-512 (panel 32 wide, as on AVX-512), bit for bit against one fused chain per
    /// element, with and without accumulating onto the tile.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn micro_kernel_bodies_match_fma_chains() {
        use crate::kernels::simd::tests::Emu16;

        /// Runs `kernel_simd::<S, NR, NV>` and checks the tile.
        fn check<S: Simd, const NR: usize, const NV: usize>(
            run: unsafe fn(S, usize, *const f32, (*const f32, usize), *mut f32, bool),
            s: S,
        ) {
            let (mr, kc, w_stride) = (2 * S::LANES, 37usize, 41usize);
            let panel = values(kc * mr, 3 + NR as u64);
            let w = values(NR * w_stride, 5 + NV as u64);
            for accumulate in [false, true] {
                let init = values(NR * mr, 7);
                let mut tile = init.clone();
                // SAFETY: the panel holds kc × MR values, the weights NR rows of kc elements
                // w_stride apart, the tile NR × MR values.
                unsafe {
                    run(
                        s,
                        kc,
                        panel.as_ptr(),
                        (w.as_ptr(), w_stride),
                        tile.as_mut_ptr(),
                        accumulate,
                    )
                };
                for r in 0..NR {
                    for l in 0..NV * S::LANES {
                        let start = if accumulate { init[r * mr + l] } else { 0.0 };
                        let want = (0..kc).fold(start, |a, kk| {
                            panel[kk * mr + l].mul_add(w[r * w_stride + kk], a)
                        });
                        assert_eq!(
                            tile[r * mr + l].to_bits(),
                            want.to_bits(),
                            "lanes={} NR={NR} NV={NV} r={r} l={l} acc={accumulate}",
                            S::LANES
                        );
                    }
                }
            }
        }
        #[target_feature(enable = "avx2,fma")]
        unsafe fn emu<const NR: usize, const NV: usize>(
            s: Emu16,
            kc: usize,
            b: *const f32,
            w: (*const f32, usize),
            tile: *mut f32,
            accumulate: bool,
        ) {
            // SAFETY: forwarded (the weights stand in for a next micro-panel to prefetch: a
            // hint that must leave the results alone).
            unsafe { kernel_simd::<_, NR, NV>(s, kc, b, w, tile, accumulate, w.0) }
        }
        #[target_feature(enable = "avx2,fma")]
        unsafe fn avx2<const NR: usize, const NV: usize>(
            _: Avx2,
            kc: usize,
            b: *const f32,
            (w, w_stride): (*const f32, usize),
            tile: *mut f32,
            accumulate: bool,
        ) {
            // SAFETY: forwarded.
            unsafe { kernel_avx2::<NR, NV>(kc, b, w, w_stride, tile, accumulate, w) }
        }
        #[target_feature(enable = "avx512f,avx2,fma")]
        unsafe fn avx512<const NR: usize, const NV: usize>(
            _: Avx512,
            kc: usize,
            b: *const f32,
            (w, w_stride): (*const f32, usize),
            tile: *mut f32,
            accumulate: bool,
        ) {
            // SAFETY: forwarded.
            unsafe { kernel_avx512::<NR, NV>(kc, b, w, w_stride, tile, accumulate, w) }
        }
        if let Some(s) = Emu16::new() {
            check::<_, 1, 1>(emu::<1, 1>, s);
            check::<_, 5, 2>(emu::<5, 2>, s);
            check::<_, 12, 1>(emu::<12, 1>, s);
            check::<_, 12, 2>(emu::<12, 2>, s);
        }
        if let Some(s) = Avx2::new() {
            check::<_, 1, 1>(avx2::<1, 1>, s);
            check::<_, 6, 2>(avx2::<6, 2>, s);
            check::<_, 4, 1>(avx2::<4, 1>, s);
        }
        if let Some(s) = Avx512::new() {
            check::<_, 1, 1>(avx512::<1, 1>, s);
            check::<_, 12, 2>(avx512::<12, 2>, s);
            check::<_, 7, 1>(avx512::<7, 1>, s);
        }
    }

    /// The scalar reference: one chain of fused multiply-adds per element, k ascending.
    fn reference(m: usize, n: usize, k: usize, w: &[f32], b: &[f32]) -> Vec<f32> {
        let mut out = vec![0f32; n * m];
        for j in 0..n {
            for i in 0..m {
                let mut acc = 0f32;
                for kk in 0..k {
                    acc = b[j * k + kk].mul_add(w[i * k + kk], acc);
                }
                out[j * m + i] = acc;
            }
        }
        out
    }

    #[test]
    fn every_isa_matches_the_fma_reference_bit_for_bit_at_every_thread_count() {
        // Edge tiles in every direction (m not a multiple of 12/6/4, n not a multiple of
        // 32/16/8, several activation blocks), k across several KC blocks, tiny products.
        for (m, n, k) in [
            (1usize, 1usize, 1usize),
            (13, 33, 9),
            (50, 70, 40),
            (100, 300, 1100),
            (384, 40, 64),
            (25, 257, 520),
            // The wide AVX-512 path (n ≥ WIDE_MIN_COLS): partial weight panels (m % 32),
            // partial slivers (n % 12), several weight blocks (m > 256) and k blocks (k > 384).
            (300, 263, 800),
            (7, 300, 33),
            (40, 256, 384),
        ] {
            let w = values(m * k, 1 + m as u64);
            let b = values(n * k, 2 + n as u64);
            let want = reference(m, n, k, &w, &b);
            for isa in Isa::available() {
                let got = at_thread_counts(|| {
                    let mut dst = vec![f32::NAN; n * m];
                    sgemm(isa, (m, n, k), &w, &b, &mut dst).unwrap();
                    dst.iter().map(|x| x.to_bits()).collect::<Vec<u32>>()
                });
                let want_bits: Vec<u32> = want.iter().map(|x| x.to_bits()).collect();
                assert!(
                    got == want_bits,
                    "{isa:?} {m}×{n}×{k} differs from the reference"
                );
            }
        }
    }

    #[test]
    fn sgemm_rejects_short_slices() {
        let mut dst = vec![0f32; 4];
        assert!(sgemm(Isa::Portable, (2, 2, 2), &[0.0; 3], &[0.0; 4], &mut dst).is_err());
    }
}
