//! `ferrograph._core.WordPieceAscii`: the work of `ferrograph.models.wordpiece`'s fast path
//! (BERT's WordPiece tokenization of ASCII text, the same ids as `tokenizers`). The Python
//! side decides when a tokenizer's pipeline is the one reproduced here; this side only runs
//! it, in one pass over the text's bytes: after a graph has run, a query's tokenization is
//! cache-cold, and one tight loop touches far less than the library's pipeline or Python code.

use std::collections::HashMap;

use pyo3::prelude::*;
use pyo3::types::PyString;

use super::errors;

/// Longest text accepted, in bytes: longer text goes to the library (``encode`` returns
/// ``None``), so one call's work stays bounded.
const MAX_TEXT_BYTES: usize = 1 << 20;

/// BERT's WordPiece tokenization of ASCII text with a fixed vocabulary (see
/// ``ferrograph.models.wordpiece.FastWordPiece``, which builds it from a ``tokenizers``
/// tokenizer after checking that its pipeline is exactly this one).
///
/// Per text: control characters are dropped, tab/newline/carriage return are spaces, letters
/// are lowercased if ``lowercase``; words are runs of letters and digits, and every other
/// printable character is a word of its own; each word becomes its greedy longest-match-first
/// pieces (``prefix`` before every piece but the first), or ``unk_id`` if it is longer than
/// ``max_word_chars`` or some part matches nothing; at most ``max_pieces`` pieces are kept,
/// between ``cls_id`` and ``sep_id``.
#[pyclass(name = "WordPieceAscii", module = "ferrograph._core", frozen)]
pub struct PyWordPieceAscii {
    vocab: HashMap<Vec<u8>, u32>,
    /// Bytes of the longest vocabulary entry: no longer candidate piece is looked up, which
    /// bounds a word's work by its length times this (the result is the same: a longer
    /// piece cannot match).
    longest: usize,
    prefix: Vec<u8>,
    unk_id: u32,
    cls_id: u32,
    sep_id: u32,
    max_word_chars: usize,
    lowercase: bool,
    max_pieces: Option<usize>,
    /// ASCII bytes whose presence sends a text to the library (first characters of added
    /// tokens).
    triggers: [bool; 128],
}

/// What one byte of (ASCII) text is to the tokenizer.
enum Byte {
    /// Dropped by the text cleaning (control characters).
    Dropped,
    /// Ends a word (whitespace).
    Space,
    /// A word of its own.
    Punctuation,
    /// Part of a word (letters and digits).
    Word,
}

fn classify(b: u8) -> Byte {
    match b {
        b'\t' | b'\n' | b'\r' | b' ' => Byte::Space,
        0..=0x1F | 0x7F => Byte::Dropped,
        b'0'..=b'9' | b'A'..=b'Z' | b'a'..=b'z' => Byte::Word,
        _ => Byte::Punctuation,
    }
}

impl PyWordPieceAscii {
    /// Appends the pieces of `word` (already lowercased if asked) to `out`.
    fn push_word(&self, word: &[u8], piece: &mut Vec<u8>, out: &mut Vec<u32>) {
        if word.is_empty() {
            return;
        }
        if word.len() > self.max_word_chars {
            out.push(self.unk_id);
            return;
        }
        if let Some(&id) = self.vocab.get(word) {
            out.push(id);
            return;
        }
        let first = out.len();
        let mut start = 0;
        while start < word.len() {
            let mut found = None;
            let room = if start > 0 {
                self.longest.saturating_sub(self.prefix.len())
            } else {
                self.longest
            };
            let mut end = word.len().min(start + room);
            while start < end {
                piece.clear();
                if start > 0 {
                    piece.extend_from_slice(&self.prefix);
                }
                piece.extend_from_slice(&word[start..end]);
                if let Some(&id) = self.vocab.get(piece.as_slice()) {
                    found = Some(id);
                    break;
                }
                end -= 1;
            }
            match found {
                Some(id) => {
                    out.push(id);
                    start = end;
                }
                None => {
                    out.truncate(first);
                    out.push(self.unk_id);
                    return;
                }
            }
        }
    }
}

#[pymethods]
impl PyWordPieceAscii {
    #[new]
    #[pyo3(signature = (vocab, *, prefix, unk_id, cls_id, sep_id, max_word_chars, lowercase, max_pieces, triggers))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        vocab: HashMap<String, u32>,
        prefix: String,
        unk_id: u32,
        cls_id: u32,
        sep_id: u32,
        max_word_chars: usize,
        lowercase: bool,
        max_pieces: Option<usize>,
        triggers: String,
    ) -> PyResult<Self> {
        let mut trigger_set = [false; 128];
        for c in triggers.chars() {
            if !c.is_ascii() {
                return Err(errors::invalid(format!(
                    "WordPieceAscii: trigger {c:?} is not an ASCII character"
                )));
            }
            trigger_set[c as usize] = true;
        }
        let longest = vocab.keys().map(String::len).max().unwrap_or(0);
        Ok(Self {
            vocab: vocab
                .into_iter()
                .map(|(k, v)| (k.into_bytes(), v))
                .collect(),
            longest,
            prefix: prefix.into_bytes(),
            unk_id,
            cls_id,
            sep_id,
            max_word_chars,
            lowercase,
            max_pieces,
            triggers: trigger_set,
        })
    }

    /// ``[cls_id, pieces..., sep_id]`` for ``text``, or ``None`` when ``text`` is not ASCII
    /// (or not encodable at all), holds a trigger character or is longer than 1 MiB (the caller
    /// uses the library).
    fn encode(&self, text: &Bound<'_, PyString>) -> PyResult<Option<Vec<u32>>> {
        // Text Python cannot encode as UTF-8 (lone surrogates) is the library's to judge.
        let Ok(text) = text.to_str() else {
            return Ok(None);
        };
        let text = text.as_bytes();
        if text.len() > MAX_TEXT_BYTES
            || !text.is_ascii()
            || text.iter().any(|&b| self.triggers[usize::from(b)])
        {
            return Ok(None);
        }
        let mut out = Vec::with_capacity(text.len() / 4 + 2);
        out.push(self.cls_id);
        let mut word = Vec::with_capacity(32);
        let mut piece = Vec::with_capacity(32);
        for &b in text {
            match classify(b) {
                Byte::Dropped => {}
                Byte::Space => {
                    self.push_word(&word, &mut piece, &mut out);
                    word.clear();
                }
                Byte::Punctuation => {
                    self.push_word(&word, &mut piece, &mut out);
                    word.clear();
                    self.push_word(&[b], &mut piece, &mut out);
                }
                Byte::Word => word.push(if self.lowercase {
                    b.to_ascii_lowercase()
                } else {
                    b
                }),
            }
        }
        self.push_word(&word, &mut piece, &mut out);
        if let Some(max) = self.max_pieces {
            out.truncate(max + 1);
        }
        out.push(self.sep_id);
        Ok(Some(out))
    }

    fn __repr__(&self) -> String {
        format!(
            "WordPieceAscii(vocab={}, lowercase={}, max_pieces={:?})",
            self.vocab.len(),
            self.lowercase,
            self.max_pieces
        )
    }
}

/// Adds the class to `_core`.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyWordPieceAscii>()
}
