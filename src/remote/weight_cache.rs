//! The server's weight cache: large uploads kept by SHA-256 content hash, shared by every
//! session, so a reconnecting or second client uploads no weight twice.
//!
//! An entry is only ever stored under the hash its bytes really have (computed by the server
//! on upload, so a client cannot plant bytes under another content's hash), and it is hashed
//! again each time it is used, so memory corruption is caught instead of computed with. The
//! cache is capped in bytes; the least recently used entries go first.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use sha2::{Digest, Sha256};

/// SHA-256 of `bytes`.
pub fn content_hash(bytes: &[u8]) -> [u8; 32] {
    Sha256::digest(bytes).into()
}

struct Entry {
    bytes: Arc<Vec<u8>>,
    last_use: u64,
}

#[derive(Default)]
struct Inner {
    entries: HashMap<[u8; 32], Entry>,
    total: usize,
    tick: u64,
}

/// A size-capped content-addressed store of byte blocks.
pub struct WeightCache {
    capacity: usize,
    inner: Mutex<Inner>,
}

impl WeightCache {
    /// A cache of at most `capacity` bytes (0 disables it).
    pub fn new(capacity: usize) -> WeightCache {
        WeightCache {
            capacity,
            inner: Mutex::new(Inner::default()),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        self.lock().total
    }

    /// The bytes stored under `hash`, verified: an entry that no longer hashes to its key is
    /// dropped and reported missing.
    pub fn get(&self, hash: &[u8; 32]) -> Option<Arc<Vec<u8>>> {
        let bytes = {
            let mut inner = self.lock();
            inner.tick += 1;
            let tick = inner.tick;
            let entry = inner.entries.get_mut(hash)?;
            entry.last_use = tick;
            entry.bytes.clone()
        };
        // Hashed outside the lock: other sessions keep going meanwhile.
        if content_hash(&bytes) == *hash {
            return Some(bytes);
        }
        // Failed verification (memory corrupted): dropped, the client uploads again.
        let mut inner = self.lock();
        if let Some(entry) = inner.entries.remove(hash) {
            inner.total -= entry.bytes.len();
        }
        None
    }

    /// Stores `bytes` under `hash` when they hash to it and fit; returns whether they hash to
    /// it (a mismatch stores nothing).
    pub fn insert(&self, hash: [u8; 32], bytes: &[u8]) -> bool {
        if content_hash(bytes) != hash {
            return false;
        }
        if bytes.len() > self.capacity {
            return true;
        }
        let mut inner = self.lock();
        inner.tick += 1;
        let tick = inner.tick;
        if let Some(entry) = inner.entries.get_mut(&hash) {
            entry.last_use = tick;
            return true;
        }
        while inner.total + bytes.len() > self.capacity {
            let Some(oldest) = inner
                .entries
                .iter()
                .min_by_key(|(_, e)| e.last_use)
                .map(|(h, _)| *h)
            else {
                break;
            };
            if let Some(entry) = inner.entries.remove(&oldest) {
                inner.total -= entry.bytes.len();
            }
        }
        inner.total += bytes.len();
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
        let cache = WeightCache::new(10);
        let a = [1u8; 6];
        let b = [2u8; 6];
        assert!(!cache.insert([0; 32], &a), "wrong hash refused");
        assert!(cache.get(&[0; 32]).is_none());
        assert!(cache.insert(content_hash(&a), &a));
        assert_eq!(cache.get(&content_hash(&a)).unwrap().as_slice(), &a);
        assert!(cache.insert(content_hash(&b), &b));
        assert!(cache.get(&content_hash(&a)).is_none(), "evicted for b");
        assert_eq!(cache.bytes(), 6);
        assert!(
            cache.insert(content_hash(&[3u8; 11]), &[3u8; 11]),
            "too big: not kept"
        );
        assert_eq!(cache.bytes(), 6);
    }
}
