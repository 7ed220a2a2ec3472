//! Paged KV cache bookkeeping: a pool of fixed-size blocks and each sequence's block table. Plain
//! integers only — the tensors live in the backend's `KvStore` — so the scheduler can be tested alone.

use crate::error::{Error, Result};

/// Hands out physical block ids from a fixed pool.
#[derive(Debug, Clone)]
pub struct BlockAllocator {
    block_size: usize,
    total: usize,
    free: Vec<u32>,
}

impl BlockAllocator {
    pub fn new(total_blocks: usize, block_size: usize) -> Self {
        assert!(block_size > 0, "block size must be positive");
        BlockAllocator {
            block_size,
            total: total_blocks,
            // Pop from the end: low ids first, which keeps a fresh cache's blocks contiguous.
            free: (0..total_blocks as u32).rev().collect(),
        }
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }
    pub fn total(&self) -> usize {
        self.total
    }
    pub fn num_free(&self) -> usize {
        self.free.len()
    }
    /// Blocks needed to hold `tokens` tokens.
    pub fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.block_size)
    }

    fn allocate(&mut self, n: usize) -> Result<Vec<u32>> {
        if n > self.free.len() {
            return Err(Error::KvCacheFull {
                needed: n,
                free: self.free.len(),
            });
        }
        Ok(self.free.split_off(self.free.len() - n))
    }

    fn release(&mut self, blocks: impl IntoIterator<Item = u32>) {
        self.free.extend(blocks);
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
