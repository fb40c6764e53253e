//! The CPU's repacking buffer type (`CPU_REPACK`): interleaved q4_1 matrices read and write
//! exactly as plain bytes, and every op that reads them gives the plain layout's bits at 1, 2
//! and 3 threads (the group mat-vec, the many-column and reference paths, lookups and views).

use std::sync::Arc;

use ferrograph::alloc::{alloc_ctx_tensors_from_buft, GraphAllocator};
use ferrograph::backend::Backend;
use ferrograph::buffer::{BufferType, CpuBufferType};
use ferrograph::context::Context;
use ferrograph::cpu::backend::{CpuBackend, CpuDevice};
use ferrograph::cpu::repack::{self, RepackBufferType};
use ferrograph::device::Device;
use ferrograph::dtype::DType;
use ferrograph::graph::Graph;
use ferrograph::ops;
use ferrograph::tensor::Tensor;
use ferrograph::Result;

/// xorshift64, so the test needs no randomness crate.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    }
    fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next() as u8).collect()
    }
}

/// q4_1 bytes of a random `rows` × `k` matrix.
fn q4_1_matrix(rng: &mut Rng, rows: usize, k: usize) -> Vec<u8> {
    let x: Vec<f32> = (0..rows * k).map(|_| rng.unit()).collect();
    let mut out = vec![0u8; DType::Q4_1.row_size(k).unwrap() * rows];
    DType::Q4_1.row_from_f32(&x, &mut out).unwrap();
    out
}

/// A weight context: one q4_1 matrix allocated in `buft`, holding `data`.
fn weight(
    buft: Arc<dyn BufferType>,
    rows: usize,
    k: usize,
    data: &[u8],
) -> Result<(Context, Tensor)> {
    weight_of(buft, DType::Q4_1, rows, k, data)
}

/// A weight context: one `dtype` matrix allocated in `buft`, holding `data`.
fn weight_of(
    buft: Arc<dyn BufferType>,
    dtype: DType,
    rows: usize,
    k: usize,
    data: &[u8],
) -> Result<(Context, Tensor)> {
    let ctx = Context::new(true);
    let w = ctx.new_tensor(dtype, &[k, rows])?;
    w.set_name("w");
    alloc_ctx_tensors_from_buft(&ctx, buft)?;
    w.write_bytes(0, data)?;
    Ok((ctx, w))
}

/// The f32 result of `build(ctx, w)` on a CPU backend of `threads` threads.
fn compute(
    w: &Tensor,
    threads: usize,
    build: &dyn Fn(&Context, &Tensor) -> Result<Tensor>,
) -> Result<Vec<u32>> {
    let ctx = Context::new(true);
    let out = build(&ctx, w)?;
    out.set_output();
    let graph = Graph::build(std::slice::from_ref(&out));
    let mut galloc = GraphAllocator::new(CpuBufferType::shared());
    galloc.alloc_graph(&graph)?;
    for leaf in graph.leafs() {
        if leaf.name() == "x" {
            leaf.set_f32(&input_values(leaf.nelements()))?;
        }
        if leaf.name() == "ids" {
            let ids: Vec<u8> = [5i32, 0, 18, 9]
                .iter()
                .flat_map(|v| v.to_le_bytes())
                .collect();
            leaf.write_bytes(0, &ids)?;
        }
    }
    CpuBackend::new(threads)?.graph_compute(&graph)?;
    Ok(out.to_f32_vec()?.iter().map(|v| v.to_bits()).collect())
}

/// The values every test input holds.
fn input_values(n: usize) -> Vec<f32> {
    (0..n)
        .map(|i| ((i * 7919) % 1013) as f32 / 500.0 - 1.0)
        .collect()
}

/// The bits of each product `w · x` (`x`: `n` columns of [`input_values`], one input per row
/// length), all in one graph on a backend of `threads` threads, in the order given: adjacent
/// products sharing an input may run as one job.
fn products_in_one_graph(weights: &[&Tensor], n: usize, threads: usize) -> Result<Vec<Vec<u32>>> {
    let ctx = Context::new(true);
    let mut inputs: Vec<Tensor> = Vec::new();
    let mut outs = Vec::new();
    for &w in weights {
        let len = Tensor::ne(w)[0];
        let x = match inputs.iter().find(|x| Tensor::ne(x)[0] == len) {
            Some(x) => x.clone(),
            None => {
                inputs.push(input(&ctx, len, n)?);
                inputs[inputs.len() - 1].clone()
            }
        };
        let out = ops::mul_mat(&ctx, w, &x)?;
        out.set_output();
        outs.push(out);
    }
    let graph = Graph::build(&outs);
    let mut galloc = GraphAllocator::new(CpuBufferType::shared());
    galloc.alloc_graph(&graph)?;
    for x in &inputs {
        x.set_f32(&input_values(x.nelements()))?;
    }
    CpuBackend::new(threads)?.graph_compute(&graph)?;
    outs.iter()
        .map(|out| Ok(out.to_f32_vec()?.iter().map(|v| v.to_bits()).collect()))
        .collect()
}

/// Asserts that the products of `weights` computed in one graph (adjacent ones sharing an input
/// may run as one job) have, at 1, 2 and 3 threads and 1, 2 and 5 columns, the bits of each
/// `alone[i]` (the same matrix, maybe stored otherwise) computed by itself.
fn assert_each_keeps_its_bits(weights: &[&Tensor], alone: &[&Tensor], what: &str) -> Result<()> {
    for n in [1usize, 2, 5] {
        let expect = alone
            .iter()
            .map(|w| Ok(products_in_one_graph(&[w], n, 1)?.remove(0)))
            .collect::<Result<Vec<_>>>()?;
        for threads in [1, 2, 3] {
            let got = products_in_one_graph(weights, n, threads)?;
            for (i, (got, want)) in got.iter().zip(&expect).enumerate() {
                assert_eq!(got, want, "{what} product {i}, n={n}, {threads} threads");
            }
        }
    }
    Ok(())
}

fn input(ctx: &Context, k: usize, n: usize) -> Result<Tensor> {
    let x = ctx.new_tensor(DType::F32, &[k, n])?;
    x.set_name("x");
    x.set_input();
    Ok(x)
}

#[test]
fn the_cpu_device_offers_and_reads_the_repacking_type() {
    let cpu = CpuDevice::shared();
    let repack = RepackBufferType::shared();
    assert!(cpu.supports_buft(repack.as_ref()));
    assert!(!repack.is_host());
    assert!(repack::is_repack(repack.as_ref()));
    assert_eq!(
        repack.device().map(|d| d.name().to_owned()),
        Some(cpu.name().to_owned())
    );
}

#[test]
fn bytes_written_in_pieces_read_back_exactly() -> Result<()> {
    let mut rng = Rng(3);
    // 19 rows: two groups of 8 and three plain rows; an f32 vector beside it, stored plainly.
    let (k, rows) = (96, 19);
    let ctx = Context::new(true);
    let w = ctx.new_tensor(DType::Q4_1, &[k, rows])?;
    let v = ctx.new_tensor(DType::F32, &[37])?;
    let buffers = alloc_ctx_tensors_from_buft(&ctx, RepackBufferType::shared())?;
    let plain = rng.bytes(w.nbytes());
    for chunk_start in (0..plain.len()).step_by(13) {
        let end = (chunk_start + 13).min(plain.len());
        w.write_bytes(chunk_start, &plain[chunk_start..end])?;
    }
    let vbytes = rng.bytes(v.nbytes());
    v.write_bytes(0, &vbytes)?;
    assert!(matches!(
        repack::stored_view(&w),
        Some(repack::StoredView::LaidOut(
            _,
            repack::StoredLayout::Interleaved(_)
        ))
    ));
    assert!(matches!(
        repack::stored_view(&v),
        Some(repack::StoredView::Plain(_))
    ));
    let mut back = vec![0u8; plain.len()];
    w.read_bytes(0, &mut back)?;
    assert_eq!(back, plain);
    for _ in 0..100 {
        let a = rng.next() as usize % plain.len();
        let b = a + rng.next() as usize % (plain.len() - a + 1);
        let mut piece = vec![0u8; b - a];
        w.read_bytes(a, &mut piece)?;
        assert_eq!(piece, plain[a..b]);
    }
    let mut vback = vec![0u8; vbytes.len()];
    v.read_bytes(0, &mut vback)?;
    assert_eq!(vback, vbytes);
    // The buffer read as a whole maps the same way: the matrix's plain bytes at its offset.
    let buffer = &buffers[0];
    let mut raw = vec![0u8; buffer.size()];
    buffer.read(0, &mut raw)?;
    let at = w.storage()?.offset;
    assert_eq!(raw[at..at + plain.len()], plain[..]);
    w.fill_bytes(0, w.nbytes(), 0x5A)?;
    w.read_bytes(0, &mut back)?;
    assert!(back.iter().all(|&b| b == 0x5A));
    Ok(())
}

#[test]
fn products_lookups_and_views_equal_the_plain_layout_bit_for_bit() -> Result<()> {
    let mut rng = Rng(9);
    for (rows, k) in [(19usize, 96usize), (64, 576), (40, 32)] {
        let data = q4_1_matrix(&mut rng, rows, k);
        let (_pc, plain) = weight(CpuBufferType::shared(), rows, k, &data)?;
        let (_rc, packed) = weight(RepackBufferType::shared(), rows, k, &data)?;
        type Build = Box<dyn Fn(&Context, &Tensor) -> Result<Tensor>>;
        let mut cases: Vec<(String, Build)> = Vec::new();
        for n in [1usize, 2, 3, 4, 6, 8, 9, 17, 32, 45] {
            cases.push((
                format!("mul_mat n={n}"),
                Box::new(move |c: &Context, w: &Tensor| ops::mul_mat(c, w, &input(c, k, n)?)),
            ));
        }
        cases.push((
            "get_rows".into(),
            Box::new(move |c: &Context, w: &Tensor| {
                let ids = c.new_tensor(DType::I32, &[4])?;
                ids.set_name("ids");
                ids.set_input();
                ops::get_rows(c, w, &ids)
            }),
        ));
        cases.push((
            "view of rows 8..16".into(),
            Box::new(move |c: &Context, w: &Tensor| {
                let row_bytes = w.nb()[1];
                let v = ops::view(c, w, &[k, 8], &[row_bytes], 8 * row_bytes)?;
                ops::mul_mat(c, &v, &input(c, k, 1)?)
            }),
        ));
        for (what, build) in &cases {
            let expect = compute(&plain, 1, build.as_ref())?;
            for threads in [1, 2, 3] {
                let got = compute(&packed, threads, build.as_ref())?;
                assert_eq!(got, expect, "{what}, {rows}x{k}, {threads} threads");
            }
        }
    }
    Ok(())
}

/// Adjacent mat-vecs reading the same activations (a layer's q, k, v) run as one job on the
/// CPU backend; each result keeps the bits of its product alone, at 1, 2 and 3 threads, for
/// row counts with partial groups and tiles, two columns, and a run broken by a product of
/// another row length or with plain weights.
#[test]
fn adjacent_mat_vecs_sharing_activations_keep_their_bits() -> Result<()> {
    let mut rng = Rng(21);
    let k = 96;
    // (rows, row length, repacked): the 4th has another row length, the 5th plain weights.
    let shapes = [
        (40usize, k, true),
        (19, k, true),
        (8, k, true),
        (24, 64, true),
        (16, k, false),
    ];
    let weights = shapes
        .iter()
        .map(|&(rows, len, packed)| {
            let data = q4_1_matrix(&mut rng, rows, len);
            let buft: Arc<dyn BufferType> = if packed {
                RepackBufferType::shared()
            } else {
                CpuBufferType::shared()
            };
            let (ctx, w) = weight(buft, rows, len, &data)?;
            let (plain_ctx, plain) = weight(CpuBufferType::shared(), rows, len, &data)?;
            Ok((ctx, w, plain_ctx, plain))
        })
        .collect::<Result<Vec<_>>>()?;
    let packed: Vec<&Tensor> = weights.iter().map(|(_, w, _, _)| w).collect();
    let plain: Vec<&Tensor> = weights.iter().map(|(_, _, _, w)| w).collect();
    assert_each_keeps_its_bits(&packed, &plain, "q4_1")?;
    Ok(())
}

/// The same for plainly stored weights of other block types (the direct dot path): adjacent
/// mat-vecs of one type reading the same activations run as one job, each with its bits alone,
/// and a product of another type or row length ends the run.
#[test]
fn adjacent_plain_mat_vecs_sharing_activations_keep_their_bits() -> Result<()> {
    let mut rng = Rng(33);
    let k = 512;
    for dtype in [
        DType::Q4_0,
        DType::Q8_0,
        DType::Q4_K,
        DType::Q6_K,
        DType::IQ4_NL,
    ] {
        // (rows, type, row length): the 4th is another type, the 5th another row length.
        let shapes = [
            (40usize, dtype, k),
            (19, dtype, k),
            (8, dtype, k),
            (24, DType::Q5_1, k),
            (16, dtype, 256),
            (33, dtype, k),
        ];
        let weights = shapes
            .iter()
            .map(|&(rows, t, len)| {
                let x: Vec<f32> = (0..rows * len).map(|_| rng.unit()).collect();
                let mut data = vec![0u8; t.row_size(len)? * rows];
                t.row_from_f32(&x, &mut data)?;
                weight_of(CpuBufferType::shared(), t, rows, len, &data)
            })
            .collect::<Result<Vec<_>>>()?;
        let plain: Vec<&Tensor> = weights.iter().map(|(_, w)| w).collect();
        assert_each_keeps_its_bits(&plain, &plain, &dtype.to_string())?;
    }
    Ok(())
}

/// `dtype` bytes of a random `rows` × `k` matrix.
fn matrix_of(rng: &mut Rng, dtype: DType, rows: usize, k: usize) -> Vec<u8> {
    let x: Vec<f32> = (0..rows * k).map(|_| rng.unit()).collect();
    let mut out = vec![0u8; dtype.row_size(k).unwrap() * rows];
    dtype.row_from_f32(&x, &mut out).unwrap();
    out
}

#[test]
fn q8_0_and_q4_0_panels_read_write_and_fill_exactly() -> Result<()> {
    let mut rng = Rng(5);
    for (dtype, rows, k) in [(DType::Q8_0, 45usize, 96usize), (DType::Q4_0, 33, 64)] {
        let ctx = Context::new(true);
        let v = ctx.new_tensor(DType::F32, &[37])?;
        let w = ctx.new_tensor(dtype, &[k, rows])?;
        let after = ctx.new_tensor(DType::F32, &[11])?;
        let repack = RepackBufferType::shared();
        // The panels take more bytes than the plain matrix (a 64-row panel area, f32 scales).
        assert!(repack.alloc_size(&w) > w.nbytes());
        let _buffers = alloc_ctx_tensors_from_buft(&ctx, repack)?;
        assert!(matches!(
            repack::stored_view(&w),
            Some(repack::StoredView::LaidOut(
                _,
                repack::StoredLayout::Panels(_) | repack::StoredLayout::Nibbles(_)
            ))
        ));
        let (vbytes, abytes) = (rng.bytes(v.nbytes()), rng.bytes(after.nbytes()));
        v.write_bytes(0, &vbytes)?;
        after.write_bytes(0, &abytes)?;
        let mut plain = rng.bytes(w.nbytes());
        for chunk_start in (0..plain.len()).step_by(13) {
            let end = (chunk_start + 13).min(plain.len());
            w.write_bytes(chunk_start, &plain[chunk_start..end])?;
        }
        let mut back = vec![0u8; plain.len()];
        w.read_bytes(0, &mut back)?;
        assert_eq!(back, plain, "{dtype}");
        for _ in 0..100 {
            let a = rng.next() as usize % plain.len();
            let b = a + rng.next() as usize % (plain.len() - a + 1);
            let mut piece = vec![0u8; b - a];
            w.read_bytes(a, &mut piece)?;
            assert_eq!(piece, plain[a..b], "{dtype} {a}..{b}");
        }
        // A fill of part of the matrix is that part's bytes, nothing else.
        w.fill_bytes(50, 77, 0x5A)?;
        plain[50..127].fill(0x5A);
        w.read_bytes(0, &mut back)?;
        assert_eq!(back, plain, "{dtype} after a partial fill");
        // Its neighbours were not touched.
        let mut vback = vec![0u8; vbytes.len()];
        v.read_bytes(0, &mut vback)?;
        assert_eq!(vback, vbytes);
        let mut aback = vec![0u8; abytes.len()];
        after.read_bytes(0, &mut aback)?;
        assert_eq!(aback, abytes);
    }
    Ok(())
}

#[test]
fn products_with_panels_equal_the_plain_layout() -> Result<()> {
    let mut rng = Rng(13);
    for (dtype, rows, k) in [
        (DType::Q8_0, 45usize, 96usize),
        (DType::Q4_0, 70, 64),
        (DType::Q8_0, 32, 384),
        (DType::Q4_0, 7, 32),
    ] {
        let data = matrix_of(&mut rng, dtype, rows, k);
        let (_pc, plain) = weight_of(CpuBufferType::shared(), dtype, rows, k, &data)?;
        let (_rc, packed) = weight_of(RepackBufferType::shared(), dtype, rows, k, &data)?;
        for n in [1usize, 2, 3, 6, 17, 32, 45] {
            let build = move |c: &Context, w: &Tensor| ops::mul_mat(c, w, &input(c, k, n)?);
            let expect = compute(&plain, 1, &build)?;
            let first = compute(&packed, 1, &build)?;
            for threads in [2, 3] {
                assert_eq!(
                    compute(&packed, threads, &build)?,
                    first,
                    "{dtype} {rows}x{k} n={n}: {threads} threads"
                );
            }
            if n > 2 {
                // Both take the integer GEMM: the same bits.
                assert_eq!(first, expect, "{dtype} {rows}x{k} n={n}");
            } else {
                // The plain layout takes the dot products there; the panels the GEMM, whose
                // block sums are the same integers accumulated in another order.
                for (g, e) in first.iter().zip(&expect) {
                    let (g, e) = (f32::from_bits(*g), f32::from_bits(*e));
                    assert!(
                        (g - e).abs() <= 1e-5 * (1.0 + e.abs()),
                        "{dtype} n={n}: {g} {e}"
                    );
                }
            }
        }
        // Lookups and views read the plain bytes.
        let lookup = move |c: &Context, w: &Tensor| {
            let ids = c.new_tensor(DType::I32, &[4])?;
            ids.set_name("ids");
            ids.set_input();
            ops::get_rows(c, w, &ids)
        };
        if rows > 18 {
            assert_eq!(compute(&packed, 2, &lookup)?, compute(&plain, 1, &lookup)?);
        }
        let view = move |c: &Context, w: &Tensor| {
            let row_bytes = w.nb()[1];
            let v = ops::view(c, w, &[k, 4], &[row_bytes], 2 * row_bytes)?;
            ops::mul_mat(c, &v, &input(c, k, 5)?)
        };
        assert_eq!(compute(&packed, 3, &view)?, compute(&plain, 1, &view)?);
    }
    Ok(())
}
