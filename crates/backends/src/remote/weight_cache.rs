//! The server's weight cache: large uploads kept by SHA-256 content hash, shared by every
//! session, so a reconnecting or second client uploads no weight twice.
//!
//! An entry is only ever stored under the hash its bytes really have (computed by the server
//! on upload, so a client cannot plant bytes under another content's hash), and it is hashed
//! again each time it is used, so memory corruption is caught instead of computed with.
//!
//! The cache is content-addressed on purpose and shared across the sessions of one token:
//! reading an entry back needs its SHA-256, which a session only knows if it knows the
//! content (hashes travel encrypted). It does tell a token holder whether some session
//! uploaded a given content (a membership test); servers whose clients must not learn that
//! run with `weight_cache_bytes = 0`.
//!
//! The cap counts what an entry costs, not only its bytes: each entry is charged
//! [`ENTRY_OVERHEAD`] more, and entries under `min_bytes` are not kept at all. The least
//! recently used entry goes first, found in O(log n) through an ordered index of last uses.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};

use sha2::{Digest, Sha256};

/// Bytes charged per entry beyond its content (the maps' nodes, the allocation's header).
pub const ENTRY_OVERHEAD: usize = 256;

/// SHA-256 of `bytes`.
pub fn content_hash(bytes: &[u8]) -> [u8; 32] {
    Sha256::digest(bytes).into()
}

struct Entry {
    bytes: Arc<Vec<u8>>,
    last_use: u64,
}

fn cost(len: usize) -> usize {
    len.saturating_add(ENTRY_OVERHEAD)
}

#[derive(Default)]
struct Inner {
    entries: HashMap<[u8; 32], Entry>,
    /// Entries by last use (ticks are unique): the first is the least recently used.
    by_use: BTreeMap<u64, [u8; 32]>,
    /// Cost of every entry held.
    total: usize,
    tick: u64,
}

impl Inner {
    fn touch(&mut self, hash: &[u8; 32]) -> Option<Arc<Vec<u8>>> {
        self.tick += 1;
        let tick = self.tick;
        let entry = self.entries.get_mut(hash)?;
        self.by_use.remove(&entry.last_use);
        entry.last_use = tick;
        self.by_use.insert(tick, *hash);
        Some(entry.bytes.clone())
    }

    fn remove(&mut self, hash: &[u8; 32]) {
        if let Some(entry) = self.entries.remove(hash) {
            self.by_use.remove(&entry.last_use);
            self.total -= cost(entry.bytes.len());
        }
    }
}

/// A size-capped content-addressed store of byte blocks.
pub struct WeightCache {
    capacity: usize,
    min_bytes: usize,
    inner: Mutex<Inner>,
}

impl WeightCache {
    /// A cache of at most `capacity` bytes, overhead included (0 disables it), keeping only
    /// entries of at least `min_bytes`.
    pub fn new(capacity: usize, min_bytes: usize) -> WeightCache {
        WeightCache {
            capacity,
            min_bytes,
            inner: Mutex::new(Inner::default()),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// What the entries cost, overhead included.
    pub fn bytes(&self) -> usize {
        self.lock().total
    }

    /// Entries held.
    pub fn len(&self) -> usize {
        self.lock().entries.len()
    }

    /// Whether the cache holds nothing.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The bytes stored under `hash`, verified: an entry that no longer hashes to its key is
    /// dropped and reported missing.
    pub fn get(&self, hash: &[u8; 32]) -> Option<Arc<Vec<u8>>> {
        let bytes = self.lock().touch(hash)?;
        // Hashed outside the lock: other sessions keep going meanwhile.
        if content_hash(&bytes) == *hash {
            return Some(bytes);
        }
        // Failed verification (memory corrupted): dropped, the client uploads again.
        self.lock().remove(hash);
        None
    }

    /// Stores `bytes` under `hash` when they hash to it and are worth keeping (at least
    /// `min_bytes`, at most the capacity); returns whether they hash to it (a mismatch stores
    /// nothing).
    pub fn insert(&self, hash: [u8; 32], bytes: &[u8]) -> bool {
        if content_hash(bytes) != hash {
            return false;
        }
        if bytes.len() < self.min_bytes || cost(bytes.len()) > self.capacity {
            return true;
        }
        let mut inner = self.lock();
        if inner.touch(&hash).is_some() {
            return true;
        }
        while inner.total + cost(bytes.len()) > self.capacity {
            let Some((_, oldest)) = inner.by_use.first_key_value().map(|(t, h)| (*t, *h)) else {
                break;
            };
            inner.remove(&oldest);
        }
        inner.tick += 1;
        let tick = inner.tick;
        inner.total += cost(bytes.len());
        inner.by_use.insert(tick, hash);
        inner.entries.insert(
            hash,
            Entry {
                bytes: Arc::new(bytes.to_vec()),
                last_use: tick,
            },
        );
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stores_verified_bytes_within_the_cap() {
        let cache = WeightCache::new(10 + 2 * ENTRY_OVERHEAD - 1, 4);
        let a = [1u8; 6];
        let b = [2u8; 6];
        assert!(!cache.insert([0; 32], &a), "wrong hash refused");
        assert!(cache.get(&[0; 32]).is_none());
        assert!(cache.insert(content_hash(&a), &a));
        assert_eq!(cache.get(&content_hash(&a)).unwrap().as_slice(), &a);
        assert!(cache.insert(content_hash(&b), &b));
        assert!(cache.get(&content_hash(&a)).is_none(), "evicted for b");
        assert_eq!(cache.bytes(), cost(6));
        let big = [3u8; 10 + ENTRY_OVERHEAD];
        assert!(cache.insert(content_hash(&big), &big), "too big: not kept");
        assert_eq!(cache.bytes(), cost(6));
        assert!(
            cache.insert(content_hash(&[4u8; 3]), &[4u8; 3]),
            "too small"
        );
        assert_eq!(cache.len(), 1);
    }

    #[test]
    fn the_least_recently_used_entry_goes_first() {
        let cache = WeightCache::new(3 * cost(8), 1);
        let blocks: Vec<[u8; 8]> = (0..4u8).map(|i| [i; 8]).collect();
        for b in &blocks[..3] {
            cache.insert(content_hash(b), b);
        }
        // Using the first makes the second the oldest.
        assert!(cache.get(&content_hash(&blocks[0])).is_some());
        cache.insert(content_hash(&blocks[3]), &blocks[3]);
        assert!(cache.get(&content_hash(&blocks[1])).is_none());
        for i in [0, 2, 3] {
            assert!(cache.get(&content_hash(&blocks[i])).is_some(), "{i}");
        }
        assert_eq!(cache.len(), 3);
        assert_eq!(cache.bytes(), 3 * cost(8));
    }
}
