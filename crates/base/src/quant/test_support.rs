//! Test support shared by the codec tests of this module's files: a reproducible RNG and a
//! reader of the fixture files in `tests/data/` (written by the `scripts/make_*_fixtures.py`
//! scripts).
//!
//! Every fixture file has the same frame: a 4-byte magic, a little-endian u32 count of
//! sections at a known offset, then the sections one after another, each a header of u32
//! words followed by parts whose lengths the header gives. [`sections`] reads that frame with
//! the file's magic and section layout as parameters; [`type_sections`] is the layout the
//! K-quant, iq2 and iq3/iq1 files share.

use super::QK_K;

/// A small xorshift64 generator so the tests need no extra crates and are reproducible.
pub(crate) struct Rng(pub(crate) u64);

impl Rng {
    /// The next 64 random bits.
    pub(crate) fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    /// `n` random bytes (the low byte of each draw).
    pub(crate) fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next() as u8).collect()
    }
    /// Uniform in [-1, 1).
    pub(crate) fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
}

/// Asserts that `to_f32` decodes `bytes` (whole super-blocks of `dtype`) to `want` bit for bit
/// at byte offsets 0, 1 and 3, and that `DType::row_to_f32` (the same codec) does too.
pub(crate) fn check_decodes_to(
    dtype: crate::dtype::DType,
    to_f32: fn(&[u8], &mut [f32]),
    bytes: &[u8],
    want: &[f32],
) {
    let n = bytes.len() / dtype.type_size() * QK_K;
    for offset in [0usize, 1, 3] {
        let mut buf = vec![0u8; offset + bytes.len()];
        buf[offset..].copy_from_slice(bytes);
        let mut got = vec![f32::NAN; n];
        to_f32(&buf[offset..], &mut got);
        assert_eq!(got.len(), want.len());
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            assert_eq!(
                g.to_bits(),
                w.to_bits(),
                "{dtype} value {i} (block {}): {g} vs gguf {w}",
                i / QK_K
            );
        }
    }
    let mut row = vec![0f32; n];
    dtype.row_to_f32(bytes, &mut row).unwrap();
    assert!(row
        .iter()
        .zip(want)
        .all(|(a, b)| a.to_bits() == b.to_bits()));
}

/// The bytes of `tests/data/<name>` (panics if the file is missing).
pub(crate) fn read_data(name: &str) -> Vec<u8> {
    let path = format!("{}/../../tests/data/{name}", env!("CARGO_MANIFEST_DIR"));
    std::fs::read(&path).unwrap_or_else(|e| panic!("fixture file {path}: {e}"))
}

/// Little-endian f32 values.
pub(crate) fn f32s(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

/// One section of a fixture file: its header words and its parts.
pub(crate) struct Section {
    /// The u32 words of the section header.
    pub(crate) header: Vec<u32>,
    /// The parts that follow the header, as long as `part_lens` said.
    pub(crate) parts: Vec<Vec<u8>>,
}

/// The sections of a fixture file `data`: it starts with `magic`, the u32 at `count_at`
/// counts the sections, which start right after it; each is `header_words` u32 words and
/// then parts of the byte lengths `part_lens(header)`. Asserts that nothing trails.
pub(crate) fn sections(
    data: &[u8],
    magic: &[u8; 4],
    count_at: usize,
    header_words: usize,
    part_lens: impl Fn(&[u32]) -> Vec<usize>,
) -> Vec<Section> {
    assert_eq!(&data[..4], magic, "fixture magic");
    let u32_at = |at: usize| u32::from_le_bytes(data[at..at + 4].try_into().unwrap());
    let count = u32_at(count_at) as usize;
    let mut at = count_at + 4;
    let mut out = Vec::with_capacity(count);
    for _ in 0..count {
        let header: Vec<u32> = (0..header_words).map(|k| u32_at(at + 4 * k)).collect();
        at += 4 * header_words;
        let parts = part_lens(&header)
            .into_iter()
            .map(|len| {
                let part = data[at..at + len].to_vec();
                at += len;
                part
            })
            .collect();
        out.push(Section { header, parts });
    }
    assert_eq!(at, data.len(), "trailing bytes in the fixture");
    out
}

/// One section of a block fixture: (ggml type id, super-block count, bytes per
/// super-block, payload of `count·bytes` block bytes and `count·256` f32 values; the q8_K
/// section of the K-quant file stores the values first).
pub(crate) type TypeSection = (u32, usize, usize, Vec<u8>);

/// The sections of the block fixture `tests/data/<name>` with magic `magic`: a header of
/// (type id, super-block count, bytes per super-block), then one payload.
pub(crate) fn type_sections(name: &str, magic: &[u8; 4]) -> Vec<TypeSection> {
    let data = read_data(name);
    sections(&data, magic, 4, 3, |h| {
        vec![h[1] as usize * h[2] as usize + h[1] as usize * QK_K * 4]
    })
    .into_iter()
    .map(|mut s| {
        let payload = s.parts.pop().unwrap();
        (
            s.header[0],
            s.header[1] as usize,
            s.header[2] as usize,
            payload,
        )
    })
    .collect()
}
