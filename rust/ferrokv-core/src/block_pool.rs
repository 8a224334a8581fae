//! Physical KV blocks: reference counts and an intrusive, doubly-linked free list.
//!
//! Invariants:
//! - A block is in the free list iff its reference count is 0 (block 0, the null block used as
//!   padding, when reserved, is never free and never referenced).
//! - The free list is the eviction order: allocation pops the head. Blocks that hold nothing
//!   worth keeping are pushed at the head (reused first); blocks that still hold a cached prefix
//!   are pushed at the tail, so among cached blocks the least recently freed is evicted first.
//! - A block with ref count 0 can be revived (`incref`) straight out of the middle of the list.
//!
//! Costs: allocate, free, revive are O(1); nothing allocates after construction.

/// Index of a physical block in the KV cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockId(pub u32);

/// The padding block. Block tables are padded with it; it is never handed out.
pub const NULL_BLOCK: BlockId = BlockId(0);

const NIL: u32 = u32::MAX;

/// Position → (block, offset) by shift and mask: block sizes are powers of two (a 64-bit
/// division per row would cost more than the rest of a decode row's work).
#[derive(Debug, Clone, Copy)]
pub struct BlockMath {
    size: usize,
    shift: u32,
}

impl BlockMath {
    pub fn new(size: usize) -> Self {
        assert!(size.is_power_of_two(), "block_size must be a power of two");
        BlockMath { size, shift: size.trailing_zeros() }
    }
    #[inline]
    pub fn size(self) -> usize {
        self.size
    }
    /// The block holding position `pos`.
    #[inline]
    pub fn block(self, pos: usize) -> usize {
        pos >> self.shift
    }
    #[inline]
    pub fn offset(self, pos: usize) -> usize {
        pos & (self.size - 1)
    }
    /// Blocks that hold `tokens` tokens.
    #[inline]
    pub fn blocks_for(self, tokens: usize) -> usize {
        (tokens + self.size - 1) >> self.shift
    }
    /// The slot of position `pos` in block `block`.
    #[inline]
    pub fn slot(self, block: i32, pos: usize) -> i64 {
        ((block as usize) * self.size + self.offset(pos)) as i64
    }
}

#[derive(Debug, Clone)]
struct Block {
    ref_cnt: u32,
    prev: u32,
    next: u32,
    in_free_list: bool,
}

#[derive(Debug, Clone)]
pub struct BlockPool {
    blocks: Vec<Block>,
    head: u32,
    tail: u32,
    num_free: usize,
    first_usable: u32,
}

/// `n` copies of `v`, or `None` when that much memory cannot be had (a typed error upstream,
/// never an abort).
pub(crate) fn try_filled<T: Clone>(n: usize, v: T) -> Option<Vec<T>> {
    let mut out = Vec::new();
    out.try_reserve_exact(n).ok()?;
    out.resize(n, v);
    Some(out)
}

/// `n` zeros, allocated zeroed (pages never touched cost nothing) and fallibly.
pub(crate) fn try_zeroed(n: usize) -> Option<Vec<u32>> {
    if n == 0 {
        return Some(Vec::new());
    }
    let layout = std::alloc::Layout::array::<u32>(n).ok()?;
    // SAFETY: the layout is non-zero-sized and a null result is handled; zeroed memory is a
    // valid u32, and a Vec may own memory the global allocator returned for
    // `Layout::array::<u32>(n)` with length and capacity n.
    unsafe {
        let p = std::alloc::alloc_zeroed(layout) as *mut u32;
        (!p.is_null()).then(|| Vec::from_raw_parts(p, n, n))
    }
}

impl BlockPool {
    /// `num_blocks` physical blocks; with `reserve_null`, block 0 is kept back as padding.
    /// Initially the free list holds the usable blocks in increasing id order.
    pub fn new(num_blocks: usize, reserve_null: bool) -> Self {
        Self::try_new(num_blocks, reserve_null).expect("block pool allocation")
    }

    /// `new`, or `None` when its bookkeeping cannot be allocated.
    pub fn try_new(num_blocks: usize, reserve_null: bool) -> Option<Self> {
        assert!(num_blocks < NIL as usize, "num_blocks must fit in u32");
        let first_usable = u32::from(reserve_null && num_blocks > 0);
        let mut pool = BlockPool {
            blocks: try_filled(num_blocks, Block { ref_cnt: 0, prev: NIL, next: NIL, in_free_list: false })?,
            head: NIL,
            tail: NIL,
            num_free: 0,
            first_usable,
        };
        for id in first_usable..num_blocks as u32 {
            pool.push_back(id);
        }
        Some(pool)
    }

    pub fn num_blocks(&self) -> usize {
        self.blocks.len()
    }

    /// Blocks that can ever be handed out (all but the null block).
    pub fn num_usable(&self) -> usize {
        self.blocks.len() - self.first_usable as usize
    }

    pub fn num_free(&self) -> usize {
        self.num_free
    }

    pub fn ref_count(&self, id: BlockId) -> u32 {
        self.blocks[id.0 as usize].ref_cnt
    }

    /// Starts fetching block `id`'s entry (before a burst of reference-count updates).
    #[inline]
    pub fn prefetch(&self, id: BlockId) {
        if let Some(b) = self.blocks.get(id.0 as usize) {
            crate::prefetch::read(b as *const Block as *const u8);
        }
    }

    pub fn is_free(&self, id: BlockId) -> bool {
        self.blocks[id.0 as usize].in_free_list
    }

    /// The block that `allocate` would return next, without taking it.
    pub fn peek_free(&self) -> Option<BlockId> {
        (self.head != NIL).then_some(BlockId(self.head))
    }

    /// The block after the head of the free list (the allocation after next).
    pub fn peek_second_free(&self) -> Option<BlockId> {
        if self.head == NIL {
            return None;
        }
        let next = self.blocks[self.head as usize].next;
        (next != NIL).then_some(BlockId(next))
    }

    /// Pops the head of the free list with ref count 1. The caller must drop any cached prefix
    /// the block still holds (the pool does not know about prefixes).
    pub fn allocate(&mut self) -> Option<BlockId> {
        if self.head == NIL {
            return None;
        }
        let id = self.head;
        self.unlink(id);
        let b = &mut self.blocks[id as usize];
        debug_assert_eq!(b.ref_cnt, 0);
        b.ref_cnt = 1;
        // The next allocation unlinks the new head, which touches the block after it: start
        // that miss now (allocations come in bursts when many sequences enter a new block).
        if let Some(after) = self.peek_second_free() {
            self.prefetch(after);
        }
        Some(BlockId(id))
    }

    /// Adds a reference; a block with no references is taken out of the free list (cache hit).
    pub fn incref(&mut self, id: BlockId) {
        debug_assert!(id.0 >= self.first_usable, "null block is never referenced");
        if self.blocks[id.0 as usize].ref_cnt == 0 {
            self.unlink(id.0);
        }
        self.blocks[id.0 as usize].ref_cnt += 1;
    }

    /// Drops a reference. When the last one goes, the block joins the free list: at the tail
    /// when it still holds a cached prefix (`keep_cached`), else at the head. Returns whether
    /// the block became free.
    pub fn decref(&mut self, id: BlockId, keep_cached: bool) -> bool {
        let b = &mut self.blocks[id.0 as usize];
        debug_assert!(b.ref_cnt > 0, "decref of a free block {}", id.0);
        b.ref_cnt -= 1;
        if b.ref_cnt > 0 {
            return false;
        }
        if keep_cached {
            self.push_back(id.0);
        } else {
            self.push_front(id.0);
        }
        true
    }

    /// Free-list order from head (next evicted) to tail; for tests and invariant checks.
    pub fn free_list(&self) -> Vec<BlockId> {
        let mut out = Vec::with_capacity(self.num_free);
        let mut cur = self.head;
        while cur != NIL {
            out.push(BlockId(cur));
            cur = self.blocks[cur as usize].next;
        }
        out
    }

    /// Checks the pool's own invariants against the expected ref counts (indexed by block id).
    pub fn check(&self, expected_refs: &[u32]) -> Result<(), String> {
        let listed = self.free_list();
        if listed.len() != self.num_free {
            return Err(format!("free list has {} blocks, counter says {}", listed.len(), self.num_free));
        }
        for (i, b) in self.blocks.iter().enumerate() {
            if (i as u32) < self.first_usable {
                if b.ref_cnt != 0 || b.in_free_list {
                    return Err("null block is referenced or free".into());
                }
                continue;
            }
            if b.ref_cnt != expected_refs[i] {
                return Err(format!("block {i}: ref count {} but {} tables hold it", b.ref_cnt, expected_refs[i]));
            }
            if b.in_free_list != (b.ref_cnt == 0) {
                return Err(format!("block {i}: ref count {} but in_free_list={}", b.ref_cnt, b.in_free_list));
            }
        }
        Ok(())
    }

    fn push_back(&mut self, id: u32) {
        let old_tail = self.tail;
        {
            let b = &mut self.blocks[id as usize];
            debug_assert!(!b.in_free_list);
            b.prev = old_tail;
            b.next = NIL;
            b.in_free_list = true;
        }
        if old_tail == NIL {
            self.head = id;
        } else {
            self.blocks[old_tail as usize].next = id;
        }
        self.tail = id;
        self.num_free += 1;
    }

    fn push_front(&mut self, id: u32) {
        let old_head = self.head;
        {
            let b = &mut self.blocks[id as usize];
            debug_assert!(!b.in_free_list);
            b.prev = NIL;
            b.next = old_head;
            b.in_free_list = true;
        }
        if old_head == NIL {
            self.tail = id;
        } else {
            self.blocks[old_head as usize].prev = id;
        }
        self.head = id;
        self.num_free += 1;
    }

    fn unlink(&mut self, id: u32) {
        let (prev, next) = {
            let b = &mut self.blocks[id as usize];
            debug_assert!(b.in_free_list);
            b.in_free_list = false;
            let pn = (b.prev, b.next);
            b.prev = NIL;
            b.next = NIL;
            pn
        };
        if prev == NIL {
            self.head = next;
        } else {
            self.blocks[prev as usize].next = next;
        }
        if next == NIL {
            self.tail = prev;
        } else {
            self.blocks[next as usize].prev = prev;
        }
        self.num_free -= 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(v: &[u32]) -> Vec<BlockId> {
        v.iter().map(|&i| BlockId(i)).collect()
    }

    #[test]
    fn null_block_is_reserved_and_allocation_is_in_id_order() {
        let mut p = BlockPool::new(5, true);
        assert_eq!(p.num_free(), 4);
        assert_eq!(p.num_usable(), 4);
        assert_eq!(p.allocate(), Some(BlockId(1)));
        assert_eq!(p.allocate(), Some(BlockId(2)));
        assert_eq!(p.allocate(), Some(BlockId(3)));
        assert_eq!(p.allocate(), Some(BlockId(4)));
        assert_eq!(p.allocate(), None);
        assert_eq!(p.ref_count(BlockId(0)), 0);
    }

    #[test]
    fn uncached_blocks_are_reused_first_cached_ones_evicted_lru() {
        let mut p = BlockPool::new(6, true);
        let all: Vec<_> = (0..5).map(|_| p.allocate().unwrap()).collect();
        assert_eq!(all, ids(&[1, 2, 3, 4, 5]));
        // Free 2 and 3 as cached (tail), then 4 uncached (head), then 1 cached (tail).
        assert!(p.decref(BlockId(2), true));
        assert!(p.decref(BlockId(3), true));
        assert!(p.decref(BlockId(4), false));
        assert!(p.decref(BlockId(1), true));
        assert_eq!(p.free_list(), ids(&[4, 2, 3, 1]));
        assert_eq!(p.allocate(), Some(BlockId(4)));
        assert_eq!(p.allocate(), Some(BlockId(2)));
        assert_eq!(p.num_free(), 2);
    }

    #[test]
    fn incref_revives_a_free_block_from_the_middle() {
        let mut p = BlockPool::new(5, true);
        let _ = (0..4).map(|_| p.allocate().unwrap()).count();
        for i in 1..=4 {
            p.decref(BlockId(i), true);
        }
        p.incref(BlockId(3));
        assert_eq!(p.ref_count(BlockId(3)), 1);
        assert_eq!(p.free_list(), ids(&[1, 2, 4]));
        p.incref(BlockId(3));
        assert_eq!(p.ref_count(BlockId(3)), 2);
        assert!(!p.decref(BlockId(3), true));
        assert!(p.decref(BlockId(3), true));
        assert_eq!(p.free_list(), ids(&[1, 2, 4, 3]));
        let mut refs = vec![0u32; 5];
        p.incref(BlockId(1));
        refs[1] = 1;
        p.check(&refs).unwrap();
    }

    #[test]
    fn pool_without_null_block_uses_every_block() {
        let mut p = BlockPool::new(3, false);
        assert_eq!(p.allocate(), Some(BlockId(0)));
        assert_eq!(p.num_free(), 2);
    }

    #[test]
    fn the_peeks_name_the_next_two_allocations() {
        let mut p = BlockPool::new(4, true);
        assert_eq!((p.peek_free(), p.peek_second_free()), (Some(BlockId(1)), Some(BlockId(2))));
        assert!(p.is_free(BlockId(1)) && !p.is_free(BlockId(0)));
        let a = p.allocate().unwrap();
        assert!(!p.is_free(a));
        assert_eq!((p.peek_free(), p.peek_second_free()), (Some(BlockId(2)), Some(BlockId(3))));
        p.allocate();
        assert_eq!((p.peek_free(), p.peek_second_free()), (Some(BlockId(3)), None));
        p.allocate();
        assert_eq!((p.peek_free(), p.peek_second_free()), (None, None));
    }

    #[test]
    fn check_rejects_a_null_block_that_is_referenced_or_free() {
        let mut p = BlockPool::new(3, true);
        let refs = vec![0u32; 3];
        p.check(&refs).unwrap();
        p.blocks[0].ref_cnt = 1;
        assert!(p.check(&refs).unwrap_err().contains("null block"));
        (p.blocks[0].ref_cnt, p.blocks[0].in_free_list) = (0, true);
        assert!(p.check(&refs).unwrap_err().contains("null block"));
    }
}
