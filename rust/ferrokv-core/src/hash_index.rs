//! The prefix cache's index from a block hash to the block holding it.
//!
//! Open addressing with linear probing over a power-of-two table kept at most half full. Keys
//! are xxh3 hashes already, so a key's low bits are its home slot. A slot is 16 bytes (key and
//! block id), four to a cache line: an operation usually touches one line, and `prefetch` can
//! start that miss early. Deletion shifts the following run back instead of leaving a
//! tombstone, so probe lengths never degrade however much the cache churns (a general-purpose
//! map with tombstones slowly fills with them under constant insert/evict and then rehashes
//! everything in one step).
//!
//! Invariants: block 0 (the null block, never cached) marks an empty slot; every key sits in
//! the probe run that starts at its home slot, with no empty slot in between; at most
//! `capacity / 2` keys.
//!
//! Costs: O(1) expected for get, insert and remove; no allocation after construction.

use crate::block_pool::BlockId;

#[derive(Debug, Clone, Copy, Default)]
#[repr(C, align(16))]
struct Slot {
    key: u64,
    /// 0 = empty.
    block: u32,
}

pub struct HashIndex {
    mask: usize,
    slots: Vec<Slot>,
    len: usize,
    max_len: usize,
}

impl HashIndex {
    /// An index for up to `max_len` keys.
    pub fn new(max_len: usize) -> Self {
        Self::try_new(max_len).expect("hash index allocation")
    }

    /// `new`, or `None` when its slots cannot be allocated.
    pub fn try_new(max_len: usize) -> Option<Self> {
        let cap = max_len.max(1).checked_mul(2)?.checked_next_power_of_two()?;
        Some(HashIndex { mask: cap - 1, slots: crate::block_pool::try_filled(cap, Slot::default())?, len: 0, max_len })
    }

    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    #[inline]
    fn home(&self, key: u64) -> usize {
        key as usize & self.mask
    }

    /// The slot holding `key` (`Ok`), or the empty slot ending its run (`Err`).
    #[inline]
    fn find(&self, key: u64) -> Result<usize, usize> {
        let mut i = self.home(key);
        loop {
            let s = self.slots[i];
            if s.block == 0 {
                return Err(i);
            }
            if s.key == key {
                return Ok(i);
            }
            i = (i + 1) & self.mask;
        }
    }

    pub fn get(&self, key: u64) -> Option<BlockId> {
        self.find(key).ok().map(|i| BlockId(self.slots[i].block))
    }

    /// Adds `key -> b` unless the key is present (then returns false and changes nothing).
    pub fn insert(&mut self, key: u64, b: BlockId) -> bool {
        debug_assert!(b.0 != 0, "block 0 marks empty slots");
        match self.find(key) {
            Ok(_) => false,
            Err(i) => {
                assert!(self.len < self.max_len, "hash index over capacity");
                self.slots[i] = Slot { key, block: b.0 };
                self.len += 1;
                true
            }
        }
    }

    /// Removes `key`; the entries after it in its run move back to close the gap.
    pub fn remove(&mut self, key: u64) -> Option<BlockId> {
        let i = self.find(key).ok()?;
        let removed = BlockId(self.slots[i].block);
        let mut hole = i;
        let mut j = i;
        loop {
            j = (j + 1) & self.mask;
            let s = self.slots[j];
            if s.block == 0 {
                break;
            }
            // `s` may move into the hole only if its home is not cyclically in (hole, j].
            let home = self.home(s.key);
            let stays = if hole <= j { hole < home && home <= j } else { hole < home || home <= j };
            if !stays {
                self.slots[hole] = s;
                hole = j;
            }
        }
        self.slots[hole] = Slot::default();
        self.len -= 1;
        Some(removed)
    }

    /// Starts fetching the line where `key` lives (or would be inserted).
    #[inline]
    pub fn prefetch(&self, key: u64) {
        crate::prefetch::read(&self.slots[self.home(key)] as *const Slot as *const u8);
    }

    pub fn clear(&mut self) {
        self.slots.fill(Slot::default());
        self.len = 0;
    }

    pub fn iter(&self) -> impl Iterator<Item = (u64, BlockId)> + '_ {
        self.slots.iter().filter(|s| s.block != 0).map(|s| (s.key, BlockId(s.block)))
    }

    /// Every key is reachable from its home slot (tests).
    pub fn check(&self) -> Result<(), String> {
        let mut n = 0;
        for (i, s) in self.slots.iter().enumerate().filter(|(_, s)| s.block != 0) {
            n += 1;
            let mut j = self.home(s.key);
            while j != i {
                if self.slots[j].block == 0 {
                    return Err(format!("key {:#x} at slot {i} is cut off from its home by an empty slot {j}", s.key));
                }
                j = (j + 1) & self.mask;
            }
        }
        if n != self.len {
            return Err(format!("hash index holds {n} keys but counts {}", self.len));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashMap;

    #[test]
    fn colliding_keys_probe_on_and_removal_closes_the_gap() {
        let mut h = HashIndex::new(4); // 8 slots
        // Keys 1, 9 and 17 share home slot 1; 2 lives in 2 and is pushed on by the run.
        assert!(h.insert(1, BlockId(10)));
        assert!(h.insert(9, BlockId(11)));
        assert!(h.insert(2, BlockId(12)));
        assert!(h.insert(17, BlockId(13)));
        assert!(!h.insert(9, BlockId(99)), "present keys are not replaced");
        assert_eq!(h.get(17), Some(BlockId(13)));
        assert_eq!(h.remove(1), Some(BlockId(10)));
        assert_eq!((h.get(9), h.get(2), h.get(17)), (Some(BlockId(11)), Some(BlockId(12)), Some(BlockId(13))));
        assert_eq!(h.remove(1), None);
        h.check().unwrap();
        assert_eq!(h.len(), 3);
    }

    #[test]
    fn runs_wrap_around_the_end_of_the_table() {
        let mut h = HashIndex::new(4); // 8 slots
        for (k, b) in [(7u64, 1u32), (15, 2), (23, 3), (6, 4)] {
            assert!(h.insert(k, BlockId(b)));
        }
        assert_eq!(h.remove(7), Some(BlockId(1)));
        assert_eq!((h.get(15), h.get(23), h.get(6)), (Some(BlockId(2)), Some(BlockId(3)), Some(BlockId(4))));
        h.check().unwrap();
    }

    proptest! {
        #[test]
        fn behaves_like_a_map_under_churn(ops in prop::collection::vec((0u8..3, 0u64..40), 1..400)) {
            let mut h = HashIndex::new(32);
            let mut m: HashMap<u64, u32> = HashMap::new();
            let mut next = 1u32;
            for (op, k) in ops {
                // Few distinct low bits: long runs that wrap and collide.
                let key = k.wrapping_mul(0x1000) | (k % 5);
                match op {
                    0 if m.len() < 32 => {
                        let fresh = !m.contains_key(&key);
                        prop_assert_eq!(h.insert(key, BlockId(next)), fresh);
                        m.entry(key).or_insert(next);
                        next += 1;
                    }
                    1 => prop_assert_eq!(h.remove(key).map(|b| b.0), m.remove(&key)),
                    _ => prop_assert_eq!(h.get(key).map(|b| b.0), m.get(&key).copied()),
                }
                h.check().map_err(TestCaseError::fail)?;
                prop_assert_eq!(h.len(), m.len());
            }
        }
    }
}
