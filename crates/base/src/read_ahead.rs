//! Reading ahead on idle workers: the computing thread names the memory its next large job
//! will read (a product's weights), and a pool worker with nothing to claim pulls those cache
//! lines in while the computing thread runs the small nodes before that job alone.
//!
//! Decoding a language model alternates bandwidth-bound mat-vecs (both threads streaming
//! weights from memory) with short single-threaded nodes (norms, RoPE, cache writes, adds)
//! during which the other thread spins. Reading the next product's first few hundred KiB in
//! that gap moves part of the stream into time that was otherwise idle; the product then finds
//! those lines on chip. Software prefetch instructions alone did not do it (measured: the
//! worker issued them far faster than memory returned lines, and most were dropped), so the
//! worker loads one byte per line.
//!
//! The loads are inline assembly, not Rust reads: the named memory may be written by another
//! thread meanwhile (a graph may write into anything), and an assembly load is a plain
//! hardware load whose value is discarded, outside the language's data-race rules.
//!
//! Lifetime: the memory must stay mapped while a worker may read it. The computing thread
//! withdraws its hint before its computation ends ([`ReadAhead::withdraw`], which waits for
//! readers to leave); a worker registers as a reader before it looks at the hint, so it either
//! sees the withdrawal or is waited for.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard};

/// Bytes a worker reads between looks at whether work arrived (a few tens of nanoseconds of
/// loads at memory speed).
const BATCH: usize = 2048;

/// Cache line size assumed for the loads (one load per 64 bytes).
const LINE: usize = 64;

/// The current read-ahead hint of one pool.
#[derive(Default)]
pub(crate) struct ReadAhead {
    /// Address and length of the named memory; `None` when withdrawn.
    range: Mutex<Option<(usize, usize)>>,
    /// Bumped with every new hint and every withdrawal: workers notice a change cheaply.
    seq: AtomicUsize,
    /// Workers between registering as readers and leaving.
    readers: AtomicUsize,
}

/// One worker's progress through the current hint.
#[derive(Default)]
pub(crate) struct Reader {
    /// The hint sequence number this state belongs to.
    seq: usize,
    range: Option<(usize, usize)>,
    /// Bytes of `range` read so far.
    done: usize,
}

impl ReadAhead {
    fn range(&self) -> MutexGuard<'_, Option<(usize, usize)>> {
        self.range.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Names `len` bytes at `addr` as the next memory to read ahead (replacing any earlier
    /// hint). The caller keeps that memory mapped until it calls [`ReadAhead::withdraw`].
    pub(crate) fn post(&self, addr: usize, len: usize) {
        *self.range() = Some((addr, len));
        self.seq.fetch_add(1, Ordering::SeqCst);
    }

    /// Withdraws the hint and waits until no worker reads it: afterwards the named memory may
    /// be freed.
    pub(crate) fn withdraw(&self) {
        if self.range().take().is_none() {
            // Nothing named since the last withdrawal (which bumped `seq`): a reader now
            // rereads the range and finds none.
            return;
        }
        // SeqCst with the reader's registration in `read`: either the reader registered first
        // (counted here, and waited for) or it sees this bump and rereads the (empty) range.
        self.seq.fetch_add(1, Ordering::SeqCst);
        while self.readers.load(Ordering::SeqCst) > 0 {
            std::hint::spin_loop();
        }
    }

    /// Whether the hint changed since `reader` last looked, or `reader` has part of it left.
    pub(crate) fn has_work(&self, reader: &Reader) -> bool {
        self.seq.load(Ordering::Relaxed) != reader.seq
            || reader.range.is_some_and(|(_, len)| reader.done < len)
    }

    /// Reads the hint's lines from where `reader` left off until done or `interrupted` says
    /// work arrived (checked every [`BATCH`] bytes).
    pub(crate) fn read(&self, reader: &mut Reader, interrupted: impl Fn() -> bool) {
        self.readers.fetch_add(1, Ordering::SeqCst);
        let seq = self.seq.load(Ordering::SeqCst);
        if seq != reader.seq {
            *reader = Reader {
                seq,
                range: *self.range(),
                done: 0,
            };
        }
        if let Some((addr, len)) = reader.range {
            while reader.done < len && !interrupted() && self.seq.load(Ordering::Relaxed) == seq {
                let end = (reader.done + BATCH).min(len);
                touch_lines(addr + reader.done, end - reader.done);
                reader.done = end;
            }
        }
        self.readers.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Loads one byte of every cache line of `len` bytes at `addr`, discarding the values.
#[cfg(target_arch = "x86_64")]
fn touch_lines(addr: usize, len: usize) {
    let mut at = addr;
    while at < addr + len {
        // SAFETY: the address lies in memory the computing thread named and keeps mapped
        // until it withdraws the hint, which waits for this reader (see the module docs). The
        // load reads one byte and writes only a scratch register; concurrent writes by other
        // threads are fine for a hardware load whose value is thrown away.
        unsafe {
            std::arch::asm!(
                "mov {scratch}, byte ptr [{at}]",
                at = in(reg) at,
                scratch = out(reg_byte) _,
                options(nostack, readonly, preserves_flags),
            );
        }
        at += LINE;
    }
}

/// Elsewhere reading ahead is not done (the loads need assembly per architecture).
#[cfg(not(target_arch = "x86_64"))]
fn touch_lines(_addr: usize, _len: usize) {}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn a_withdrawn_hint_is_not_read_and_readers_resume_where_they_stopped() {
        let data = vec![1u8; 64 * 1024];
        let ahead = ReadAhead::default();
        let mut reader = Reader::default();
        assert!(!ahead.has_work(&reader));
        ahead.post(data.as_ptr() as usize, data.len());
        assert!(ahead.has_work(&reader));
        // Interrupted after the first batch: the rest is left for later.
        let calls = std::cell::Cell::new(0);
        ahead.read(&mut reader, || {
            calls.set(calls.get() + 1);
            calls.get() > 1
        });
        assert_eq!(reader.done, BATCH);
        assert!(ahead.has_work(&reader));
        ahead.read(&mut reader, || false);
        assert_eq!(reader.done, data.len());
        assert!(!ahead.has_work(&reader));
        // Withdrawn: the reader notices, finds no range and reads nothing.
        ahead.withdraw();
        assert!(ahead.has_work(&reader));
        ahead.read(&mut reader, || false);
        assert_eq!(reader.range, None);
        assert!(!ahead.has_work(&reader));
    }

    #[test]
    fn withdrawal_waits_for_a_reader_in_progress() {
        // A reader on another thread over a large range; the withdrawal returns only after it
        // left, and then the memory can be dropped.
        let data = Arc::new(vec![0u8; 32 << 20]);
        let ahead = Arc::new(ReadAhead::default());
        for _ in 0..20 {
            ahead.post(data.as_ptr() as usize, data.len());
            let worker = {
                let ahead = ahead.clone();
                std::thread::spawn(move || {
                    let mut reader = Reader::default();
                    ahead.read(&mut reader, || false);
                    reader.done
                })
            };
            std::thread::yield_now();
            ahead.withdraw();
            assert_eq!(ahead.readers.load(Ordering::SeqCst), 0);
            let done = worker.join().unwrap();
            assert!(done <= data.len());
        }
    }
}
