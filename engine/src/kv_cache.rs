//! Paged KV cache bookkeeping: a pool of fixed-size blocks and each sequence's block table. Plain
//! integers only — the tensors live in the backend's `KvStore` — so the scheduler can be tested alone.
//!
//! Prefix caching lives here too: a full block whose keys and values are computed can be
//! registered under a hash chained over every token up to its end ([`chain_hash`]); blocks are
//! shared by reference count, and a registered block nobody holds stays cached (idle) until the
//! pool needs it, least recently released first. A block never registered returns to the free
//! list when its last holder lets go, as before.

use std::collections::{BTreeMap, HashMap};
use std::hash::{Hash, Hasher};

use crate::error::{Error, Result};

/// The hash of a full block: the previous block's hash and this block's tokens, so equal hashes
/// mean equal prefixes up to the block's end (collisions aside: 64 bits, within one process).
pub fn chain_hash(previous: u64, tokens: &[u32]) -> u64 {
    // SipHash with fixed keys: the same in every run, which tests rely on.
    #[allow(deprecated)]
    let mut h = std::hash::SipHasher::new();
    previous.hash(&mut h);
    tokens.hash(&mut h);
    h.finish()
}

/// Hands out physical block ids from a fixed pool, and keeps the prefix cache's blocks.
#[derive(Debug, Clone)]
pub struct BlockAllocator {
    block_size: usize,
    total: usize,
    /// Blocks holding nothing worth keeping.
    free: Vec<u32>,
    /// Holders of each block.
    refs: Vec<u32>,
    /// The hash a block is registered under.
    hash_of: Vec<Option<u64>>,
    by_hash: HashMap<u64, u32>,
    /// Registered blocks nobody holds, by release order (oldest first), and each one's key.
    idle: BTreeMap<u64, u32>,
    idle_at: Vec<u64>,
    clock: u64,
    /// Cached blocks given up to make room, since the start.
    pub evictions: u64,
}

impl BlockAllocator {
    pub fn new(total_blocks: usize, block_size: usize) -> Self {
        assert!(block_size > 0, "block size must be positive");
        BlockAllocator {
            block_size,
            total: total_blocks,
            // Pop from the end: low ids first, which keeps a fresh cache's blocks contiguous.
            free: (0..total_blocks as u32).rev().collect(),
            refs: vec![0; total_blocks],
            hash_of: vec![None; total_blocks],
            by_hash: HashMap::new(),
            idle: BTreeMap::new(),
            idle_at: vec![0; total_blocks],
            clock: 0,
            evictions: 0,
        }
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }
    pub fn total(&self) -> usize {
        self.total
    }
    /// Blocks a sequence can get: free ones and cached ones nobody holds.
    pub fn num_free(&self) -> usize {
        self.free.len() + self.idle.len()
    }
    /// Blocks registered in the prefix cache (held or idle).
    pub fn num_cached(&self) -> usize {
        self.by_hash.len()
    }
    /// Blocks needed to hold `tokens` tokens.
    pub fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.block_size)
    }

    fn allocate(&mut self, n: usize) -> Result<Vec<u32>> {
        if n > self.num_free() {
            return Err(Error::KvCacheFull {
                needed: n,
                free: self.num_free(),
            });
        }
        // Free blocks first; then the cached ones released longest ago.
        while self.free.len() < n {
            let Some((_, b)) = self.idle.pop_first() else {
                break;
            };
            if let Some(h) = self.hash_of[b as usize].take() {
                self.by_hash.remove(&h);
            }
            self.evictions += 1;
            self.free.push(b);
        }
        let taken = self.free.split_off(self.free.len() - n);
        for &b in &taken {
            self.refs[b as usize] = 1;
        }
        Ok(taken)
    }

    fn release(&mut self, blocks: impl IntoIterator<Item = u32>) {
        for b in blocks {
            let i = b as usize;
            self.refs[i] = self.refs[i].saturating_sub(1);
            if self.refs[i] > 0 {
                continue;
            }
            if self.hash_of[i].is_some() {
                self.clock += 1;
                self.idle_at[i] = self.clock;
                self.idle.insert(self.clock, b);
            } else {
                self.free.push(b);
            }
        }
    }

    /// The blocks cached under `hashes`, as far as they go from the first: each is now held
    /// once more by the caller.
    pub fn take_cached(&mut self, hashes: &[u64]) -> Vec<u32> {
        let mut out = Vec::new();
        for h in hashes {
            let Some(&b) = self.by_hash.get(h) else {
                break;
            };
            let i = b as usize;
            if self.refs[i] == 0 {
                self.idle.remove(&self.idle_at[i]);
            }
            self.refs[i] += 1;
            out.push(b);
        }
        out
    }

    /// Registers a held, full, computed block under `hash`; a hash already cached (another
    /// sequence computed the same prefix) keeps its block, and this one stays private.
    pub fn register(&mut self, block: u32, hash: u64) {
        let i = block as usize;
        if i >= self.total || self.hash_of[i].is_some() || self.by_hash.contains_key(&hash) {
            return;
        }
        self.hash_of[i] = Some(hash);
        self.by_hash.insert(hash, block);
    }
}

/// One sequence's blocks: `table[i]` holds its tokens `i * block_size ..(i + 1) * block_size`.
#[derive(Debug, Default, Clone)]
pub struct SeqBlocks {
    pub table: Vec<u32>,
}

impl SeqBlocks {
    /// Grows the table so `n_tokens` tokens fit; on failure nothing is allocated.
    pub fn reserve(&mut self, alloc: &mut BlockAllocator, n_tokens: usize) -> Result<()> {
        let need = alloc.blocks_for(n_tokens);
        if need > self.table.len() {
            let more = alloc.allocate(need - self.table.len())?;
            self.table.extend(more);
        }
        Ok(())
    }

    /// Keeps only the blocks holding the first `n_tokens` tokens (speculation rollback, preemption).
    pub fn truncate(&mut self, alloc: &mut BlockAllocator, n_tokens: usize) {
        let keep = alloc.blocks_for(n_tokens);
        if keep < self.table.len() {
            alloc.release(self.table.drain(keep..));
        }
    }

    pub fn release(&mut self, alloc: &mut BlockAllocator) {
        alloc.release(self.table.drain(..));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reserve_truncate_release_round_trip() {
        let mut a = BlockAllocator::new(4, 16);
        let mut s = SeqBlocks::default();
        s.reserve(&mut a, 17).expect("fits");
        assert_eq!(s.table.len(), 2);
        assert_eq!(a.num_free(), 2);
        s.reserve(&mut a, 32).expect("fits");
        assert_eq!(s.table.len(), 2, "32 tokens still fit in two blocks");
        s.truncate(&mut a, 10);
        assert_eq!((s.table.len(), a.num_free()), (1, 3));
        s.release(&mut a);
        assert_eq!(a.num_free(), 4);
    }

    #[test]
    fn full_pool_is_an_error_and_allocates_nothing() {
        let mut a = BlockAllocator::new(2, 16);
        let mut s = SeqBlocks::default();
        let err = s.reserve(&mut a, 48).expect_err("must fail");
        assert!(matches!(err, Error::KvCacheFull { needed: 3, free: 2 }));
        assert_eq!(a.num_free(), 2);
        assert!(s.table.is_empty());
    }

    #[test]
    fn a_registered_prefix_is_shared_kept_idle_and_evicted_oldest_first() {
        let mut a = BlockAllocator::new(4, 2);
        let mut x = SeqBlocks::default();
        x.reserve(&mut a, 4).expect("fits");
        let h0 = chain_hash(0, &[1, 2]);
        let h1 = chain_hash(h0, &[3, 4]);
        assert_ne!(
            h1,
            chain_hash(chain_hash(0, &[1, 9]), &[3, 4]),
            "chained over the prefix"
        );
        a.register(x.table[0], h0);
        a.register(x.table[1], h1);
        // Another sequence with the same first two blocks shares them.
        let mut y = SeqBlocks {
            table: a.take_cached(&[h0, h1, 77]),
        };
        assert_eq!(y.table, x.table);
        assert_eq!((a.num_free(), a.num_cached()), (2, 2));
        // Both let go: the blocks stay cached and count as free.
        x.release(&mut a);
        assert_eq!(a.num_free(), 2);
        y.release(&mut a);
        assert_eq!((a.num_free(), a.num_cached()), (4, 2));
        let mut z = SeqBlocks {
            table: a.take_cached(&[h0]),
        };
        assert_eq!(z.table.len(), 1, "still cached after release");
        // Needing three blocks: two free, then the idle h1 block goes (h0 is held).
        let mut w = SeqBlocks::default();
        w.reserve(&mut a, 6).expect("fits");
        assert_eq!((a.evictions, a.num_cached()), (1, 1));
        assert!(a.take_cached(&[h1]).is_empty());
        z.release(&mut a);
        w.release(&mut a);
        assert_eq!(a.num_free(), 4);
    }

    #[test]
    fn blocks_are_distinct_across_sequences() {
        let mut a = BlockAllocator::new(8, 4);
        let (mut x, mut y) = (SeqBlocks::default(), SeqBlocks::default());
        x.reserve(&mut a, 10).expect("fits");
        y.reserve(&mut a, 10).expect("fits");
        let mut all: Vec<u32> = x.table.iter().chain(&y.table).copied().collect();
        all.sort_unstable();
        all.dedup();
        assert_eq!(all.len(), 6);
    }
}
