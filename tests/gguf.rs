//! GGUF files: round trips through the writer and reader (every value type, every tensor
//! type, several alignments), binding to the CPU without copying and with a copy, one
//! hand-written case per class of malformed or hostile input (each message naming the file,
//! the field and the byte offset), and a property test that mutates a valid file (byte flips,
//! truncations, huge counts and lengths, overflowing dimensions) and must only ever get `Ok` or
//! `Err`: no panic, no hang, no outsized allocation.

use std::path::PathBuf;
use std::sync::Arc;

use ferrograph::backend::Backend;
use ferrograph::buffer::{BufferType, BufferUsage, CpuBufferType};
use ferrograph::device::{BackendParams, Device, DeviceCaps, DeviceType};
use ferrograph::error::ErrorKind;
use ferrograph::gguf::{
    write_gguf, GgufArray, GgufFile, GgufTensorToWrite, GgufType, GgufValue, MAX_ARRAY_NESTING,
};
use ferrograph::{ops, registry, CpuDevice, DType, Error, Graph, GraphAllocator, Tensor};
use proptest::prelude::*;

fn tmp_dir() -> PathBuf {
    let dir = std::env::temp_dir().join(format!("ferrograph-gguf-tests-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn tmp(name: &str) -> PathBuf {
    tmp_dir().join(name)
}

/// A deterministic byte pattern.
fn pattern(n: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect()
}

fn every_value() -> Vec<(String, GgufValue)> {
    let s = |v: &str| v.to_owned();
    vec![
        (s("u8"), GgufValue::U8(255)),
        (s("i8"), GgufValue::I8(-128)),
        (s("u16"), GgufValue::U16(65535)),
        (s("i16"), GgufValue::I16(-32768)),
        (s("u32"), GgufValue::U32(u32::MAX)),
        (s("i32"), GgufValue::I32(i32::MIN)),
        (s("f32"), GgufValue::F32(-1.5e-30)),
        (s("bool.true"), GgufValue::Bool(true)),
        (s("bool.false"), GgufValue::Bool(false)),
        (s("str"), GgufValue::String(s("hello"))),
        (s("str.empty"), GgufValue::String(String::new())),
        (
            s("str.unicode"),
            GgufValue::String(s("Grüße, 世界 🦀\u{0}")),
        ),
        (s("u64"), GgufValue::U64(u64::MAX)),
        (s("i64"), GgufValue::I64(i64::MIN)),
        (s("f64"), GgufValue::F64(std::f64::consts::PI)),
        (
            s("arr.u8"),
            GgufValue::Array(GgufArray::U8(vec![0, 1, 255])),
        ),
        (s("arr.i8"), GgufValue::Array(GgufArray::I8(vec![-1, 2]))),
        (
            s("arr.u16"),
            GgufValue::Array(GgufArray::U16(vec![1, 65535])),
        ),
        (s("arr.i16"), GgufValue::Array(GgufArray::I16(vec![-7]))),
        (
            s("arr.u32"),
            GgufValue::Array(GgufArray::U32(vec![1, 2, 3])),
        ),
        (
            s("arr.i32"),
            GgufValue::Array(GgufArray::I32(vec![-1, 0, 1])),
        ),
        (
            s("arr.f32"),
            GgufValue::Array(GgufArray::F32(vec![0.5, -0.0, 1e30])),
        ),
        (
            s("arr.bool"),
            GgufValue::Array(GgufArray::Bool(vec![true, false, true])),
        ),
        (
            s("arr.str"),
            GgufValue::Array(GgufArray::String(vec![s("a"), String::new(), s("ü")])),
        ),
        (
            s("arr.u64"),
            GgufValue::Array(GgufArray::U64(vec![u64::MAX])),
        ),
        (
            s("arr.i64"),
            GgufValue::Array(GgufArray::I64(vec![i64::MIN, 5])),
        ),
        (
            s("arr.f64"),
            GgufValue::Array(GgufArray::F64(vec![1e300, -2.0])),
        ),
        (s("arr.empty.u8"), GgufValue::Array(GgufArray::U8(vec![]))),
        (
            s("arr.empty.str"),
            GgufValue::Array(GgufArray::String(vec![])),
        ),
        (
            s("arr.empty.arr"),
            GgufValue::Array(GgufArray::Array(vec![])),
        ),
        (
            s("arr.nested"),
            GgufValue::Array(GgufArray::Array(vec![
                GgufArray::U32(vec![1, 2]),
                GgufArray::String(vec![s("x")]),
                GgufArray::Array(vec![GgufArray::Array(vec![GgufArray::F64(vec![0.25])])]),
                GgufArray::Bool(vec![]),
            ])),
        ),
        (s(""), GgufValue::String(s("an empty key is allowed"))),
    ]
}

#[test]
fn every_value_type_round_trips() {
    let metadata = every_value();
    for alignment in [1usize, 8, 32, 64, 4096] {
        let path = tmp(&format!("values-{alignment}.gguf"));
        write_gguf(&path, &metadata, &[], alignment).unwrap();
        let file = GgufFile::open(&path).unwrap();
        let mut expected = metadata.clone();
        if alignment != 32 {
            expected.push(("general.alignment".into(), GgufValue::U32(alignment as u32)));
        }
        assert_eq!(file.metadata(), expected.as_slice());
        assert_eq!(file.alignment(), alignment);
        assert_eq!(file.version(), 3);
        assert_eq!(file.get_u32("u32").unwrap(), Some(u32::MAX));
        assert_eq!(
            file.get_str("str.unicode").unwrap(),
            Some("Grüße, 世界 🦀\u{0}")
        );
        assert_eq!(file.get_f32("f32").unwrap(), Some(-1.5e-30));
        assert_eq!(file.get_bool("bool.true").unwrap(), Some(true));
        assert_eq!(file.get_u32("missing").unwrap(), None);
        assert_eq!(file.get_array("arr.u32").unwrap().unwrap().len(), 3);
        let err = file.get_u32("str").unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Gguf);
        assert!(err.to_string().contains("\"str\"") && err.to_string().contains("not a u32"));
        assert_eq!(
            file.get("arr.nested").unwrap().type_label(),
            "array[array[u32]]"
        );
    }
}

/// Every tensor type, with bytes of the exact size, at several alignments.
fn every_tensor() -> Vec<(String, DType, Vec<usize>, Vec<u8>)> {
    DType::ALL
        .iter()
        .enumerate()
        .map(|(i, &dt)| {
            let ne = vec![dt.block_size() * 2, 3];
            let bytes = dt.row_size(ne[0]).unwrap() * 3;
            (format!("t.{}", dt.name()), dt, ne, pattern(bytes, i as u64))
        })
        .chain([
            (
                "scalar".to_owned(),
                DType::F32,
                vec![],
                7f32.to_le_bytes().to_vec(),
            ),
            ("empty".to_owned(), DType::F16, vec![0, 4], vec![]),
            (
                "four_d".to_owned(),
                DType::I16,
                vec![2, 3, 1, 2],
                pattern(24, 99),
            ),
        ])
        .collect()
}

fn write_tensors(path: &PathBuf, alignment: usize, meta: &[(String, GgufValue)]) {
    let tensors = every_tensor();
    let to_write: Vec<GgufTensorToWrite<'_>> = tensors
        .iter()
        .map(|(name, dtype, ne, data)| GgufTensorToWrite {
            name: name.clone(),
            dtype: *dtype,
            ne: ne.clone(),
            data,
        })
        .collect();
    write_gguf(path, meta, &to_write, alignment).unwrap();
}

#[test]
fn every_tensor_type_round_trips() {
    for alignment in [1usize, 32, 64, 256] {
        let path = tmp(&format!("tensors-{alignment}.gguf"));
        write_tensors(&path, alignment, &[]);
        let file = GgufFile::open(&path).unwrap();
        let expected = every_tensor();
        assert_eq!(file.tensors().len(), expected.len());
        for (info, (name, dtype, ne, data)) in file.tensors().iter().zip(&expected) {
            assert_eq!(&info.name, name);
            assert_eq!(info.dtype, *dtype);
            assert_eq!(info.n_dims, ne.len());
            assert_eq!(&info.ne[..ne.len()], ne.as_slice());
            assert_eq!(info.nbytes, data.len());
            assert_eq!(info.offset % alignment, 0);
            assert_eq!(info.file_offset, file.data_offset() + info.offset);
            assert_eq!(file.tensor_data(name).unwrap(), data.as_slice());
            let shape: Vec<usize> = ne.iter().rev().copied().collect();
            assert_eq!(info.shape(), shape);
            // Dequantization agrees with the row conversion (or fails like it, for a type
            // whose codec is not there yet).
            let rows = info.nelements().checked_div(info.ne[0]).unwrap_or(0);
            let mut direct = Ok(vec![0f32; info.nelements()]);
            if let Ok(values) = direct.as_mut() {
                let row_bytes = dtype.row_size(info.ne[0]).unwrap();
                for r in 0..rows {
                    let (a, b) = (r * info.ne[0], (r + 1) * info.ne[0]);
                    if let Err(e) = dtype
                        .row_to_f32(&data[r * row_bytes..(r + 1) * row_bytes], &mut values[a..b])
                    {
                        direct = Err(e);
                        break;
                    }
                }
            }
            match (file.tensor_to_f32(name), direct) {
                (Ok(got), Ok(want)) => {
                    let (g, w): (Vec<u32>, Vec<u32>) = (
                        got.iter().map(|v| v.to_bits()).collect(),
                        want.iter().map(|v| v.to_bits()).collect(),
                    );
                    assert_eq!(g, w, "{name}");
                }
                (Err(a), Err(b)) => assert_eq!(a.kind(), b.kind()),
                (a, b) => panic!("{name}: {a:?} vs {b:?}"),
            }
        }
        assert!(file.tensor_data("missing").is_none());
        assert!(file.tensor_to_f32("missing").is_err());
    }
}

#[test]
fn writer_refuses_bad_inputs() {
    let path = tmp("refused.gguf");
    let t = |name: &str, dtype: DType, ne: Vec<usize>, data: &'static [u8]| GgufTensorToWrite {
        name: name.into(),
        dtype,
        ne,
        data,
    };
    // (metadata, tensors, alignment, the field the error names)
    type Case<'a> = (
        Vec<(String, GgufValue)>,
        Vec<GgufTensorToWrite<'a>>,
        usize,
        &'static str,
    );
    let cases: Vec<Case<'_>> = vec![
        (vec![], vec![], 3, "alignment"),
        (vec![], vec![], 0, "alignment"),
        (vec![], vec![], 1 << 21, "alignment"),
        (
            vec![
                ("k".into(), GgufValue::U8(1)),
                ("k".into(), GgufValue::U8(2)),
            ],
            vec![],
            32,
            "metadata[1].key",
        ),
        (
            vec![("general.alignment".into(), GgufValue::U64(32))],
            vec![],
            32,
            "general.alignment",
        ),
        (
            vec![("general.alignment".into(), GgufValue::U32(64))],
            vec![],
            32,
            "general.alignment",
        ),
        (
            vec![],
            vec![
                t("a", DType::F32, vec![2], &[0; 8]),
                t("a", DType::F32, vec![2], &[0; 8]),
            ],
            32,
            "name",
        ),
        (
            vec![],
            vec![t("a", DType::F32, vec![3], &[0; 8])],
            32,
            "data",
        ),
        (
            vec![],
            vec![t("a", DType::Q8_0, vec![2], &[0; 8])],
            32,
            "ne",
        ),
        (
            vec![],
            vec![t("a", DType::F32, vec![1, 1, 1, 1, 2], &[0; 8])],
            32,
            "ne",
        ),
        (
            vec![],
            vec![t("a", DType::F32, vec![usize::MAX / 2, 4], &[0; 8])],
            32,
            "ne",
        ),
    ];
    for (meta, tensors, alignment, field) in cases {
        let err = write_gguf(&path, &meta, &tensors, alignment).unwrap_err();
        let Error::Gguf {
            field: f, path: p, ..
        } = &err
        else {
            panic!("{err:?}");
        };
        assert!(f.contains(field), "{field}: {err}");
        assert!(p.ends_with("refused.gguf") && err.to_string().contains("refused.gguf"));
        assert!(!path.exists(), "nothing is written on refusal");
    }
    let deep = (0..=MAX_ARRAY_NESTING).fold(GgufArray::U8(vec![1]), |inner, _| {
        GgufArray::Array(vec![inner])
    });
    let err = write_gguf(&path, &[("deep".into(), GgufValue::Array(deep))], &[], 32).unwrap_err();
    assert!(err.to_string().contains("nest"), "{err}");
}

#[test]
fn writes_are_atomic_and_replace_the_file() {
    let path = tmp("replace.gguf");
    std::fs::write(&path, b"old contents").unwrap();
    write_gguf(&path, &[("a".into(), GgufValue::U8(1))], &[], 32).unwrap();
    let file = GgufFile::open(&path).unwrap();
    assert_eq!(file.get("a"), Some(&GgufValue::U8(1)));
    // Only this file's temporaries: other tests write into the same directory concurrently
    // (a `.names.gguf.*.tmp` of a write in progress once failed this test).
    let leftovers: Vec<_> = std::fs::read_dir(tmp_dir())
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            name.starts_with(".replace.gguf.") && name.ends_with(".tmp")
        })
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
}

// ---- binding to devices ------------------------------------------------------------------

/// A device whose memory is the CPU's but which cannot wrap host memory (as a remote device or
/// a Python plug-in): loading copies.
#[derive(Debug)]
struct NoWrapDevice;

impl Device for NoWrapDevice {
    fn name(&self) -> &str {
        "NOWRAP"
    }
    fn description(&self) -> String {
        "test device without buffer_from_host_ptr".into()
    }
    fn memory(&self) -> (usize, usize) {
        (0, 0)
    }
    fn device_type(&self) -> DeviceType {
        DeviceType::Accel
    }
    fn caps(&self) -> DeviceCaps {
        DeviceCaps::default()
    }
    fn registration_name(&self) -> &str {
        "NOWRAP"
    }
    fn init_backend(&self, _params: &BackendParams) -> ferrograph::Result<Arc<dyn Backend>> {
        Err(Error::Backend("no backend".into()))
    }
    fn buffer_type(&self) -> Arc<dyn BufferType> {
        CpuBufferType::shared()
    }
    fn supports_op(&self, _op: &Tensor) -> bool {
        false
    }
    fn supports_buft(&self, buffer_type: &dyn BufferType) -> bool {
        buffer_type.is_host()
    }
}

fn read_all(t: &Tensor) -> Vec<u8> {
    let mut out = vec![0u8; t.nbytes()];
    t.read_bytes(0, &mut out).unwrap();
    out
}

#[test]
fn load_binds_in_place_on_the_cpu_and_copies_elsewhere() {
    for alignment in [32usize, 64, 1, 4] {
        let path = tmp(&format!("load-{alignment}.gguf"));
        write_tensors(&path, alignment, &[]);
        let file = GgufFile::open(&path).unwrap();
        let cpu = CpuDevice::shared();
        let weights = file.load(cpu.as_ref()).unwrap();
        let in_place = file
            .tensors()
            .iter()
            .all(|t| t.file_offset % ferrograph::gguf::ZERO_COPY_ALIGNMENT == 0);
        assert_eq!(weights.zero_copy, in_place, "alignment {alignment}");
        if alignment >= 32 {
            assert!(weights.zero_copy);
            let map_base = weights.buffer.base().unwrap().as_ptr() as usize;
            assert_eq!(weights.buffer.size(), file.size() - file.data_offset());
            let w = weights.get("t.f32").unwrap();
            assert_eq!(
                w.host_ptr().unwrap() as usize,
                map_base + file.tensor_info("t.f32").unwrap().offset
            );
        }
        assert_eq!(weights.buffer.usage(), BufferUsage::Weights);
        assert_eq!(weights.context.len(), file.tensors().len());
        for (info, t) in file.tensors().iter().zip(&weights.tensors) {
            assert_eq!(t.name(), info.name);
            assert_eq!(t.dtype(), info.dtype);
            assert_eq!(t.ne(), info.ne);
            assert_eq!(read_all(t), file.tensor_data(&info.name).unwrap());
        }
        let copied = file.load(&NoWrapDevice).unwrap();
        assert!(!copied.zero_copy);
        assert_eq!(copied.buffer.usage(), BufferUsage::Weights);
        for (info, t) in file.tensors().iter().zip(&copied.tensors) {
            assert_eq!(read_all(t), file.tensor_data(&info.name).unwrap());
        }
    }
}

#[test]
fn small_tensors_beside_placed_ones_are_copied_and_large_ones_stay_in_place() {
    // Two matrices over SMALL_IN_PLACE_BYTES around a small vector: with the first placed
    // elsewhere (its file pages released), the small one is copied too, the large second one
    // stays in the map; with nothing placed, everything stays in the map.
    let big = ferrograph::gguf::SMALL_IN_PLACE_BYTES / 4 + 64;
    let a = pattern(big * 4, 1);
    let v = pattern(64 * 4, 2);
    let b = pattern(big * 4, 3);
    let path = tmp("placed-small.gguf");
    let to_write =
        [("a", &a, big), ("v", &v, 64), ("b", &b, big)].map(|(name, data, n)| GgufTensorToWrite {
            name: name.into(),
            dtype: DType::F32,
            ne: vec![n],
            data,
        });
    write_gguf(&path, &[], &to_write, 32).unwrap();
    let file = GgufFile::open(&path).unwrap();
    let cpu = CpuDevice::shared();
    let in_map = |w: &ferrograph::gguf::GgufWeights, name: &str| {
        let base = w.buffer.base().unwrap().as_ptr() as usize;
        let ptr = w.get(name).unwrap().host_ptr().unwrap() as usize;
        (base..base + w.buffer.size()).contains(&ptr)
    };
    let plain = file.load(cpu.as_ref()).unwrap();
    assert!(plain.zero_copy && plain.extra_buffers.is_empty());
    assert!(["a", "v", "b"].iter().all(|n| in_map(&plain, n)));
    let placed = std::collections::HashMap::from([("a".to_string(), CpuBufferType::shared())]);
    let ctx = ferrograph::Context::new(true);
    let w = file.load_into_placed(cpu.as_ref(), &ctx, &placed).unwrap();
    assert!(w.zero_copy);
    assert!(!in_map(&w, "a") && !in_map(&w, "v") && in_map(&w, "b"));
    for (name, data) in [("a", &a), ("v", &v), ("b", &b)] {
        assert_eq!(&read_all(w.get(name).unwrap()), data, "{name}");
    }
}

#[test]
fn in_place_tensors_are_copy_on_write_and_outlive_the_file() {
    let path = tmp("cow.gguf");
    write_tensors(&path, 32, &[]);
    let before = std::fs::read(&path).unwrap();
    let weights = {
        let file = GgufFile::open(&path).unwrap();
        file.load(CpuDevice::shared().as_ref()).unwrap()
    };
    assert!(weights.zero_copy);
    let t = weights.get("t.f32").unwrap();
    t.fill_bytes(0, t.nbytes(), 0xAB).unwrap();
    assert!(read_all(t).iter().all(|&b| b == 0xAB));
    assert_eq!(
        std::fs::read(&path).unwrap(),
        before,
        "the file is never written"
    );
    // A second load sees the file's bytes, not the first one's private copy.
    let again = GgufFile::open(&path).unwrap();
    let fresh = again.load(CpuDevice::shared().as_ref()).unwrap();
    assert_ne!(read_all(fresh.get("t.f32").unwrap()), read_all(t));
}

#[test]
fn from_bytes_loads_by_copying() {
    let path = tmp("bytes.gguf");
    write_tensors(&path, 32, &[]);
    let file = GgufFile::from_bytes("in-memory", std::fs::read(&path).unwrap()).unwrap();
    let weights = file.load(CpuDevice::shared().as_ref()).unwrap();
    assert!(!weights.zero_copy);
    assert_eq!(
        read_all(weights.get("t.q8_0").unwrap()),
        file.tensor_data("t.q8_0").unwrap()
    );
    let allocating = ferrograph::Context::new(false);
    assert!(file
        .load_into(CpuDevice::shared().as_ref(), &allocating)
        .is_err());
}

#[test]
fn loaded_weights_compute() {
    // y = W x with W (3 × 4, f32) and a q8_0 weight from the file, against a direct product.
    let w: Vec<f32> = (0..12).map(|i| i as f32 * 0.5 - 2.0).collect();
    let w_bytes: Vec<u8> = w.iter().flat_map(|v| v.to_le_bytes()).collect();
    let q_src: Vec<f32> = (0..64).map(|i| (i as f32 * 0.37).sin()).collect();
    let mut q_bytes = vec![0u8; DType::Q8_0.row_size(32).unwrap() * 2];
    DType::Q8_0.row_from_f32(&q_src, &mut q_bytes).unwrap();
    let path = tmp("compute.gguf");
    write_gguf(
        &path,
        &[],
        &[
            GgufTensorToWrite {
                name: "w".into(),
                dtype: DType::F32,
                ne: vec![4, 3],
                data: &w_bytes,
            },
            GgufTensorToWrite {
                name: "q".into(),
                dtype: DType::Q8_0,
                ne: vec![32, 2],
                data: &q_bytes,
            },
        ],
        32,
    )
    .unwrap();
    let file = GgufFile::open(&path).unwrap();
    let weights = file.load(CpuDevice::shared().as_ref()).unwrap();
    assert!(weights.zero_copy);
    let ctx = &weights.context;
    let x = ctx.new_tensor(DType::F32, &[4, 1]).unwrap();
    let xq = ctx.new_tensor(DType::F32, &[32, 1]).unwrap();
    let y = ops::mul_mat(ctx, weights.get("w").unwrap(), &x).unwrap();
    let yq = ops::mul_mat(ctx, weights.get("q").unwrap(), &xq).unwrap();
    let graph = Graph::build(&[y.clone(), yq.clone()]);
    GraphAllocator::new(CpuBufferType::shared())
        .alloc_graph(&graph)
        .unwrap();
    let xs = [1.0f32, -1.0, 2.0, 0.5];
    x.set_f32(&xs).unwrap();
    let xqs: Vec<f32> = (0..32).map(|i| i as f32 / 32.0).collect();
    xq.set_f32(&xqs).unwrap();
    registry::init_by_name("CPU", "n_threads=2")
        .unwrap()
        .graph_compute(&graph)
        .unwrap();
    let want: Vec<f32> = (0..3)
        .map(|r| (0..4).map(|c| w[r * 4 + c] * xs[c]).sum())
        .collect();
    assert_eq!(y.to_f32_vec().unwrap(), want);
    let deq = file.tensor_to_f32("q").unwrap();
    let got = yq.to_f32_vec().unwrap();
    for r in 0..2 {
        let want: f32 = (0..32).map(|c| deq[r * 32 + c] * xqs[c]).sum();
        assert!((got[r] - want).abs() < 0.05, "{} vs {want}", got[r]);
    }
}

// ---- malformed and hostile files ----------------------------------------------------------

/// Builds files by hand, field by field.
#[derive(Clone, Default)]
struct Raw(Vec<u8>);

impl Raw {
    fn header(version: u32, n_tensors: u64, n_kv: u64) -> Raw {
        Raw::default()
            .bytes(b"GGUF")
            .u32(version)
            .u64(n_tensors)
            .u64(n_kv)
    }
    fn bytes(mut self, b: &[u8]) -> Raw {
        self.0.extend_from_slice(b);
        self
    }
    fn u32(self, v: u32) -> Raw {
        self.bytes(&v.to_le_bytes())
    }
    fn u64(self, v: u64) -> Raw {
        self.bytes(&v.to_le_bytes())
    }
    fn str(self, s: &str) -> Raw {
        self.u64(s.len() as u64).bytes(s.as_bytes())
    }
    fn kv_u32(self, key: &str, v: u32) -> Raw {
        self.str(key).u32(GgufType::U32.id()).u32(v)
    }
    fn info(self, name: &str, dims: &[u64], type_id: u32, offset: u64) -> Raw {
        let mut r = self.str(name).u32(dims.len() as u32);
        for &d in dims {
            r = r.u64(d);
        }
        r.u32(type_id).u64(offset)
    }
    fn pad(self, alignment: usize) -> Raw {
        let n = self.0.len().div_ceil(alignment) * alignment - self.0.len();
        self.bytes(&vec![0u8; n])
    }
    fn len(&self) -> usize {
        self.0.len()
    }
}

/// Asserts that `bytes` are refused with a GGUF error at `field` (a substring) and byte
/// `offset`, and that the message names the file, the field and the offset.
fn refused(bytes: &[u8], field: &str, offset: usize) -> String {
    let err = GgufFile::from_bytes("hostile.gguf", bytes.to_vec()).unwrap_err();
    let Error::Gguf {
        message,
        path,
        field: f,
        offset: at,
    } = &err
    else {
        panic!("not a GGUF error: {err:?}");
    };
    assert_eq!(err.kind(), ErrorKind::Gguf);
    assert_eq!(path, "hostile.gguf");
    assert!(f.contains(field), "field {f:?} lacks {field:?}: {message}");
    assert_eq!(*at, Some(offset as u64), "{message}");
    assert!(
        message.contains("hostile.gguf")
            && message.contains(f.as_str())
            && message.contains(&format!("at byte {offset}")),
        "{message}"
    );
    message.clone()
}

#[test]
fn bad_magic_and_versions() {
    refused(b"", "header.magic", 0);
    refused(b"GG", "header.magic", 0);
    let msg = refused(b"GGML\x03\0\0\0", "header.magic", 0);
    assert!(msg.contains("not a GGUF file"), "{msg}");
    let msg = refused(&Raw::header(1, 0, 0).0, "header.version", 4);
    assert!(msg.contains("version 1"), "{msg}");
    let msg = refused(&Raw::header(4, 0, 0).0, "header.version", 4);
    assert!(msg.contains("unsupported version 4"), "{msg}");
    refused(&Raw::header(0, 0, 0).0, "header.version", 4);
    let big_endian = Raw::default()
        .bytes(b"GGUF")
        .bytes(&3u32.to_be_bytes())
        .bytes(&0u64.to_be_bytes())
        .bytes(&0u64.to_be_bytes());
    let msg = refused(&big_endian.0, "header.version", 4);
    assert!(
        msg.contains("big-endian") && msg.contains("50331648"),
        "{msg}"
    );
    // Version 2 and 3 files read the same.
    for v in [2, 3] {
        let f = GgufFile::from_bytes("v.gguf", Raw::header(v, 0, 0).0).unwrap();
        assert_eq!(f.version(), v);
    }
}

#[test]
fn truncated_everywhere() {
    let path = tmp("trunc.gguf");
    let meta = vec![
        ("name".into(), GgufValue::String("abc".into())),
        (
            "list".into(),
            GgufValue::Array(GgufArray::Array(vec![GgufArray::U16(vec![1, 2])])),
        ),
    ];
    write_tensors(&path, 32, &meta);
    let bytes = std::fs::read(&path).unwrap();
    let file = GgufFile::from_bytes("t", bytes.clone()).unwrap();
    let last_end = file
        .tensors()
        .iter()
        .map(|t| t.file_offset + t.nbytes)
        .max()
        .unwrap();
    for len in 0..bytes.len() {
        match GgufFile::from_bytes("hostile.gguf", bytes[..len].to_vec()) {
            // Only the padding after the last tensor may go.
            Ok(_) => assert!(len >= last_end, "truncated to {len} bytes but accepted"),
            Err(e) => {
                assert_eq!(e.kind(), ErrorKind::Gguf);
                assert!(e.to_string().contains("hostile.gguf"), "{e}");
                assert!(e.to_string().contains("at byte"), "{e}");
            }
        }
    }
}

#[test]
fn huge_counts_and_lengths() {
    let msg = refused(&Raw::header(3, u64::MAX, 0).0, "header.tensor_count", 8);
    assert!(msg.contains("only 8 bytes follow"), "{msg}");
    refused(
        &Raw::header(3, 0, 1 << 40).0,
        "header.metadata_kv_count",
        16,
    );
    // A tensor count that fits the header's remainder but not what the metadata leaves.
    let r = Raw::header(3, 1, 1).kv_u32("k", 1).bytes(&[0; 10]);
    refused(&r.0, "header.tensor_count", 8);
    // A key whose length exceeds the file.
    let r = Raw::header(3, 0, 1).u64(u64::MAX).bytes(&[0; 16]);
    refused(&r.0, "metadata[0].key (string length)", 24);
    // A string value, an array, and an array whose byte size overflows.
    let r = Raw::header(3, 0, 1).str("s").u32(8).u64(1 << 50);
    refused(&r.0, "metadata \"s\" (string length)", 24 + 9 + 4);
    let r = Raw::header(3, 0, 1)
        .str("a")
        .u32(9)
        .u32(4)
        .u64(1 << 40)
        .bytes(&[0; 16]);
    refused(&r.0, "metadata \"a\" (array length)", 24 + 9 + 8);
    let r = Raw::header(3, 0, 1)
        .str("a")
        .u32(9)
        .u32(10)
        .u64((1 << 61) + 1)
        .bytes(&[0; 16]);
    refused(&r.0, "(array length)", 24 + 9 + 8);
    // Strings inside an array: each needs 8 bytes.
    let r = Raw::header(3, 0, 1)
        .str("a")
        .u32(9)
        .u32(8)
        .u64(3)
        .u64(0)
        .u64(0)
        .u64(100);
    refused(
        &r.0,
        "metadata \"a\"[2] (string length)",
        24 + 9 + 4 + 4 + 8 + 16,
    );
    let r = Raw::header(3, 0, 1)
        .str("a")
        .u32(9)
        .u32(8)
        .u64(3)
        .u64(0)
        .u64(0);
    refused(&r.0, "metadata \"a\" (array length)", 24 + 9 + 4 + 4);
    // Arrays nested too deep (and an array inside an array with an unknown type).
    let mut r = Raw::header(3, 0, 1).str("deep").u32(9);
    for _ in 0..MAX_ARRAY_NESTING {
        r = r.u32(9).u64(1);
    }
    let at = r.len();
    let r = r.u32(0).u64(0);
    let msg = refused(&r.0, "metadata \"deep\"[0][0][0]", at);
    assert!(msg.contains("nest more than"), "{msg}");
    let r = Raw::header(3, 0, 1).str("a").u32(9).u32(13).u64(0);
    refused(&r.0, "(array element type)", 24 + 9 + 4);
    let r = Raw::header(3, 0, 1).str("a").u32(99).u32(0);
    refused(&r.0, "(value type)", 24 + 9);
}

#[test]
fn bad_keys_names_and_strings() {
    let r = Raw::header(3, 0, 2).kv_u32("k", 1).kv_u32("k", 2);
    let msg = refused(&r.0, "metadata[1].key", 24 + 17);
    assert!(msg.contains("duplicate key \"k\""), "{msg}");
    let r = Raw::header(3, 0, 1)
        .u64(3)
        .bytes(&[b'a', 0xC3, 0x28])
        .u32(4)
        .u32(1);
    refused(&r.0, "metadata[0].key", 32 + 1);
    let r = Raw::header(3, 0, 1).str("s").u32(8).u64(3).bytes(b"a\xffb");
    refused(&r.0, "metadata \"s\"", 24 + 9 + 4 + 8 + 1);
    let r = Raw::header(3, 1, 0)
        .u64(1)
        .bytes(&[0x80])
        .u32(1)
        .u64(4)
        .u32(0)
        .u64(0);
    refused(&r.0, "tensor_infos[0].name", 32);
    let r = Raw::header(3, 2, 0)
        .info("w", &[8], 0, 0)
        .info("w", &[8], 0, 32);
    let second = r.len() - (8 + 1 + 4 + 8 + 4 + 8);
    let msg = refused(&r.pad(32).bytes(&[0; 64]).0, "tensor_infos[1].name", second);
    assert!(msg.contains("duplicate tensor name \"w\""), "{msg}");
}

#[test]
fn bad_alignment_values() {
    let value_at = 24 + 8 + "general.alignment".len() + 4;
    let r = Raw::header(3, 0, 1).kv_u32("general.alignment", 0);
    refused(&r.0, "general.alignment", value_at);
    let r = Raw::header(3, 0, 1).kv_u32("general.alignment", 48);
    refused(&r.0, "general.alignment", value_at);
    let r = Raw::header(3, 0, 1).kv_u32("general.alignment", 1 << 21);
    refused(&r.0, "general.alignment", value_at);
    let r = Raw::header(3, 0, 1)
        .str("general.alignment")
        .u32(GgufType::U64.id())
        .u64(32);
    let msg = refused(&r.0, "general.alignment", value_at);
    assert!(msg.contains("must be a u32, found a u64"), "{msg}");
    let r = Raw::header(3, 0, 1)
        .str("general.alignment")
        .u32(GgufType::String.id())
        .str("32");
    refused(&r.0, "general.alignment", value_at);
}

/// One tensor info `w` at the end of a 24-byte header; returns the file and where the info's
/// dims start.
fn one_tensor(dims: &[u64], type_id: u32, offset: u64, data: usize) -> (Vec<u8>, usize) {
    let r = Raw::header(3, 1, 0).info("w", dims, type_id, offset);
    (r.pad(32).bytes(&vec![0u8; data]).0, 24 + 9 + 4)
}

#[test]
fn bad_tensor_infos() {
    let (f, dims_at) = one_tensor(&[1, 1, 1, 1, 1], 0, 0, 64);
    refused(&f, "tensor \"w\".n_dims", dims_at - 4);
    let (f, dims_at) = one_tensor(&[4, 1 << 63], 0, 0, 64);
    refused(&f, "tensor \"w\".dims[1]", dims_at + 8);
    let (f, dims_at) = one_tensor(&[1 << 32, 1 << 32, 1 << 32], 0, 0, 64);
    let msg = refused(&f, "tensor \"w\".dims", dims_at);
    assert!(msg.contains("more elements"), "{msg}");
    let (f, dims_at) = one_tensor(&[1 << 31, 1 << 31], 0, 0, 64);
    refused(&f, "tensor \"w\".dims", dims_at); // 2^62 f32 elements: too many bytes
    let (f, dims_at) = one_tensor(&[33], 8, 0, 64);
    let msg = refused(&f, "tensor \"w\".dims", dims_at);
    assert!(msg.contains("q8_0 block size 32"), "{msg}");
    let (f, dims_at) = one_tensor(&[4], 999, 0, 64);
    let msg = refused(&f, "tensor \"w\".type", dims_at + 8);
    assert!(msg.contains("unknown ggml type id 999"), "{msg}");
    let (f, dims_at) = one_tensor(&[256], 36, 0, 64);
    let msg = refused(&f, "tensor \"w\".type", dims_at + 8);
    assert!(
        msg.contains("iq4_nl_4_4") && msg.contains("removed"),
        "{msg}"
    );
    let (f, dims_at) = one_tensor(&[4], 0, 16, 64);
    let msg = refused(&f, "tensor \"w\".offset", dims_at + 12);
    assert!(
        msg.contains("not a multiple of the file's alignment 32"),
        "{msg}"
    );
    let (f, dims_at) = one_tensor(&[4], 0, 32, 40);
    let msg = refused(&f, "tensor \"w\".offset", dims_at + 12);
    assert!(msg.contains("past the end of the file"), "{msg}");
    let (f, dims_at) = one_tensor(&[4], 0, u64::MAX - 31, 64);
    refused(&f, "tensor \"w\".offset", dims_at + 12);
    // Zero dimensions and an empty dimension are fine.
    let (f, _) = one_tensor(&[], 0, 0, 4);
    let file = GgufFile::from_bytes("ok", f).unwrap();
    assert_eq!(file.tensors()[0].shape(), Vec::<usize>::new());
    let (f, _) = one_tensor(&[0, 5], 1, 0, 0);
    assert_eq!(
        GgufFile::from_bytes("ok", f).unwrap().tensors()[0].nbytes,
        0
    );
    // The data section itself past the end of the file.
    let r = Raw::header(3, 1, 0).info("w", &[4], 0, 0);
    let at = r.len();
    let msg = refused(&r.0, "data section", at);
    assert!(msg.contains("past the end"), "{msg}");
}

#[test]
fn overlapping_tensors_are_refused_but_any_order_is_fine() {
    let r = Raw::header(3, 2, 0)
        .info("a", &[16], 0, 0)
        .info("b", &[16], 0, 32);
    let b_offset_at = r.len() - 8;
    let msg = refused(
        &r.pad(32).bytes(&[0; 128]).0,
        "tensor \"b\".offset",
        b_offset_at,
    );
    assert!(msg.contains("overlaps tensor \"a\""), "{msg}");
    let r = Raw::header(3, 2, 0)
        .info("a", &[8], 0, 64)
        .info("b", &[8], 0, 0);
    let file = GgufFile::from_bytes("ok", r.pad(32).bytes(&[0; 128]).0).unwrap();
    assert_eq!(file.tensor_info("a").unwrap().offset, 64);
}

#[test]
fn unknown_names_are_errors_not_panics() {
    let path = tmp("names.gguf");
    write_tensors(&path, 32, &[]);
    let file = GgufFile::open(&path).unwrap();
    assert!(file.tensor_info("nope").is_none());
    assert!(GgufFile::open(tmp("does-not-exist.gguf")).is_err());
    let err = GgufFile::open(tmp_dir()).unwrap_err();
    assert!(err.to_string().contains("not a regular file"), "{err}");
}

// ---- the fuzz ----------------------------------------------------------------------------

fn seed_file() -> Vec<u8> {
    let path = tmp("seed.gguf");
    let meta = vec![
        ("general.name".into(), GgufValue::String("seed".into())),
        ("n".into(), GgufValue::U32(7)),
        (
            "tokens".into(),
            GgufValue::Array(GgufArray::String(vec!["a".into(), "bc".into()])),
        ),
        (
            "nested".into(),
            GgufValue::Array(GgufArray::Array(vec![
                GgufArray::I32(vec![1, -2]),
                GgufArray::Array(vec![GgufArray::F32(vec![0.5])]),
            ])),
        ),
        ("f".into(), GgufValue::F64(1.0)),
    ];
    let w: Vec<u8> = pattern(4 * 8 * 2, 1);
    let q: Vec<u8> = pattern(DType::Q8_0.row_size(32).unwrap() * 2, 2);
    let b: Vec<u8> = pattern(2 * 6, 3);
    write_gguf(
        &path,
        &meta,
        &[
            GgufTensorToWrite {
                name: "w".into(),
                dtype: DType::F32,
                ne: vec![8, 2],
                data: &w,
            },
            GgufTensorToWrite {
                name: "q".into(),
                dtype: DType::Q8_0,
                ne: vec![32, 2],
                data: &q,
            },
            GgufTensorToWrite {
                name: "b".into(),
                dtype: DType::BF16,
                ne: vec![3, 2],
                data: &b,
            },
        ],
        32,
    )
    .unwrap();
    std::fs::read(&path).unwrap()
}

/// Opens mutated bytes and, when they are accepted, uses everything: accessors, dequantizing,
/// loading on the CPU (a copy, from bytes).
fn exercise(bytes: Vec<u8>) {
    let Ok(file) = GgufFile::from_bytes("fuzz.gguf", bytes) else {
        return;
    };
    for (key, value) in file.metadata() {
        let _ = (key.len(), value.type_label());
    }
    for info in file.tensors().to_vec() {
        assert!(file.tensor_data(&info.name).unwrap().len() == info.nbytes);
        let _ = file.tensor_to_f32(&info.name);
    }
    let _ = file.load(CpuDevice::shared().as_ref());
}

/// Peak resident memory of this process in KiB (Linux), for the bound on allocations.
fn peak_rss_kib() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

/// Values that break counts, lengths and dimensions.
fn hostile_u64() -> impl Strategy<Value = u64> {
    prop_oneof![
        Just(u64::MAX),
        Just(u64::MAX - 31),
        Just(1u64 << 63),
        Just((1u64 << 61) + 1),
        Just(i64::MAX as u64),
        Just(1u64 << 32),
        Just(1u64 << 40),
        Just(0u64),
        any::<u64>(),
        0u64..4096,
    ]
}

#[derive(Debug, Clone)]
enum Mutation {
    Flip(usize, u8),
    Put64(usize, u64),
    Put32(usize, u32),
    Truncate(usize),
    Insert(usize, Vec<u8>),
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        4 => (any::<usize>(), 1u8..=255).prop_map(|(i, x)| Mutation::Flip(i, x)),
        3 => (any::<usize>(), hostile_u64()).prop_map(|(i, v)| Mutation::Put64(i, v)),
        2 => (any::<usize>(), prop_oneof![any::<u32>(), 0u32..40, Just(u32::MAX)])
            .prop_map(|(i, v)| Mutation::Put32(i, v)),
        1 => any::<usize>().prop_map(Mutation::Truncate),
        1 => (any::<usize>(), prop::collection::vec(any::<u8>(), 1..16))
            .prop_map(|(i, b)| Mutation::Insert(i, b)),
    ]
}

fn apply(bytes: &mut Vec<u8>, m: &Mutation, header_len: usize) {
    // Positions mostly land in the header and infos, where the counts are.
    let pos = |i: usize, len: usize| {
        if len == 0 {
            0
        } else if !i.is_multiple_of(4) {
            i % header_len.min(len)
        } else {
            i % len
        }
    };
    match m {
        Mutation::Flip(i, x) => {
            if !bytes.is_empty() {
                let p = pos(*i, bytes.len());
                bytes[p] ^= x;
            }
        }
        Mutation::Put64(i, v) => {
            if bytes.len() >= 8 {
                let p = pos(*i, bytes.len() - 7);
                bytes[p..p + 8].copy_from_slice(&v.to_le_bytes());
            }
        }
        Mutation::Put32(i, v) => {
            if bytes.len() >= 4 {
                let p = pos(*i, bytes.len() - 3);
                bytes[p..p + 4].copy_from_slice(&v.to_le_bytes());
            }
        }
        Mutation::Truncate(i) => {
            let n = i % (bytes.len() + 1);
            bytes.truncate(n);
        }
        Mutation::Insert(i, b) => {
            let p = pos(*i, bytes.len() + 1);
            bytes.splice(p..p, b.iter().copied());
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 3000, ..ProptestConfig::default() })]

    #[test]
    fn mutated_files_never_panic(mutations in prop::collection::vec(mutation(), 1..6)) {
        let seed = seed_file_cached();
        let header_len = GgufFile::from_bytes("seed", seed.clone()).unwrap().data_offset();
        let mut bytes = seed.clone();
        for m in &mutations {
            apply(&mut bytes, m, header_len);
        }
        exercise(bytes);
        // Nothing allocated anywhere near what the hostile counts ask for (terabytes).
        if let Some(kib) = peak_rss_kib() {
            prop_assert!(kib < 1 << 20, "peak RSS {kib} KiB");
        }
    }
}

fn seed_file_cached() -> Vec<u8> {
    static SEED: std::sync::OnceLock<Vec<u8>> = std::sync::OnceLock::new();
    SEED.get_or_init(seed_file).clone()
}

#[test]
fn hostile_counts_at_every_count_position() {
    // The seed's count fields, found by walking its layout: every u64 position in the header
    // and tensor infos gets each hostile value.
    let seed = seed_file_cached();
    let header_len = GgufFile::from_bytes("seed", seed.clone())
        .unwrap()
        .data_offset();
    let values = [
        u64::MAX,
        u64::MAX - 31,
        1 << 63,
        (1 << 61) + 1,
        i64::MAX as u64,
        1 << 32,
        1 << 40,
    ];
    for p in 0..header_len - 8 {
        for v in values {
            let mut bytes = seed.clone();
            bytes[p..p + 8].copy_from_slice(&v.to_le_bytes());
            exercise(bytes);
        }
    }
    if let Some(kib) = peak_rss_kib() {
        assert!(kib < 1 << 20, "peak RSS {kib} KiB");
    }
}
