//! The persistent batch: one row per running sequence, in row-indexed arrays.
//!
//! A sequence gets a row when its request starts running (or when it is forked off a running
//! one) and keeps it until it finishes, is dropped or is preempted. Rows are dense: row `r` is
//! live for `r < len()`, and a leaving row is replaced by the last one (swap-remove), so a
//! decode step walks `0..len()` contiguously and never touches a request that is not running.
//!
//! Each row holds:
//! - its sequence's block table, the only copy of it: one row of a matrix of `capacity *
//!   width` block ids (`width` = the most blocks a sequence can ever hold). The runner reads
//!   `[S, M]` views of it directly, so a step never rebuilds the batch's block tables. Only the
//!   KV-cache manager writes a table, through `RowIds`;
//! - the hot state of a decode step, whose only home is the row while the sequence runs:
//!   computed tokens, its last block and whether it is known unshared (so that a decode inside
//!   it reads neither the matrix nor the block pool), token count and last token, its stop
//!   thresholds, ids, and up to `PENDING_TOKENS` sampled tokens not yet appended to the
//!   sequence (they are flushed into it when the stage is full, when a block completes and
//!   whenever anything reads the sequence's tokens), so that a decode step does not touch the
//!   sequence at all;
//! - this step's plan: tokens scheduled, whether the row samples, extra samples to fan out.
//!
//! Invariants (checked by the scheduler's `check_invariants`): row `r` of the matrix holds the
//! sequence's blocks in `[0, num_blocks[r])` and the null block after them; rows `>= len()` are
//! all null; `tail_block` is the last of them. The matrix is allocated once and never moves, so
//! views of it stay valid for the scheduler's lifetime (their contents change with the batch).
//!
//! Costs: a row's table moves in once (a fork's or a swap-in's ids) and is written in place
//! after; swap-remove copies one row. The matrix is zero-allocated, so pages of rows never used
//! are never touched.

use crate::block_pool::BlockId;
use crate::kv_cache_manager::{BlockIds, BlockIdsMut};
use crate::request::RowStop;
use crate::sampling::SamplingSpec;
use std::sync::atomic::{AtomicI32, Ordering::Relaxed};

/// Sampled tokens a row stages before they are appended to its sequence.
pub const PENDING_TOKENS: usize = 16;

/// `n` zeroed block ids, allocated zeroed (calloc: pages never touched cost nothing) and
/// fallibly (a huge configuration is an error, not an abort).
fn zeroed_table(n: usize) -> Option<Box<[AtomicI32]>> {
    if n == 0 {
        return Some(Box::new([]));
    }
    let layout = std::alloc::Layout::array::<AtomicI32>(n).ok()?;
    // SAFETY: the layout is non-zero-sized; a null result is handled; zeroed memory is a valid
    // AtomicI32 (same size, alignment and bit validity as i32), and a Box<[T]> may own memory
    // the global allocator returned for `Layout::array::<T>(n)`.
    unsafe {
        let p = std::alloc::alloc_zeroed(layout) as *mut AtomicI32;
        if p.is_null() {
            return None;
        }
        Some(Box::from_raw(std::ptr::slice_from_raw_parts_mut(p, n)))
    }
}

/// A running sequence: its request's slot and its id.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SeqRef {
    pub slot: u32,
    pub seq_id: u64,
}

/// The scalar state a row starts with.
#[derive(Debug, Clone, Copy)]
pub struct RowInit {
    pub req_id: u64,
    pub sample_index: u32,
    pub prompt_len: usize,
    pub computed: usize,
    pub num_tokens: usize,
    pub last_token: u32,
    pub stop: RowStop,
    pub sampling: SamplingSpec,
}

/// The no-row marker of a sequence that is not running.
pub const NO_ROW: u32 = u32::MAX;

/// What a row was before `swap_remove` moved the last row into it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Moved {
    pub from: u32,
    pub to: u32,
    pub seq: SeqRef,
}

/// The per-row state a step reads and writes, packed so that a row costs one cache line and
/// one bounds check per pass.
#[derive(Debug, Clone, Copy)]
pub struct RowState {
    /// Tokens whose KV is computed (authoritative while the sequence has a row).
    pub computed: u32,
    /// The sequence's token count (staged tokens included).
    pub num_tokens: u32,
    pub prompt_len: u32,
    /// Blocks in the row (= ceil(computed / block_size)).
    pub num_blocks: u32,
    /// The row's last block (0 when it has none): a decode step writing inside it reads
    /// neither the matrix nor the block pool.
    pub tail_block: u32,
    /// This step's plan: tokens scheduled, the row's own sampled token, extra samples of an
    /// `n > 1` request to fork off it when its prompt completes (their sampled tokens follow).
    pub new_tokens: u32,
    pub logits_row: u32,
    pub fan_out: u32,
    pub samples: bool,
    /// Left while a step was in flight; removed by `compact`.
    pub is_dead: bool,
    pub num_pending: u8,
    /// The last block's ref count is known to be 1 (it was appended fresh, or seen at 1 and
    /// not forked since; a fork clears it). False means "unknown", never "shared": it may be
    /// stale only for a full last block, which a cache hit can share but no write touches.
    pub tail_owned: bool,
    pub stop: RowStop,
}

/// Read access to the block-table matrix while the rows are borrowed mutably.
pub struct TableRef<'a> {
    table: &'a [AtomicI32],
    width: usize,
}

impl TableRef<'_> {
    #[inline]
    pub fn block(&self, row: usize, i: usize) -> i32 {
        self.table[row * self.width + i].load(Relaxed)
    }
}

/// A row's block ids as `BlockIds`, read-only.
#[derive(Clone, Copy)]
pub struct RowIdsRef<'a> {
    cells: &'a [AtomicI32],
}

impl BlockIds for RowIdsRef<'_> {
    #[inline]
    fn len(&self) -> usize {
        self.cells.len()
    }
    #[inline]
    fn at(&self, i: usize) -> BlockId {
        BlockId(self.cells[i].load(Relaxed) as u32)
    }
}

/// A row's block ids as `BlockIdsMut`: the KV-cache manager writes a running sequence's
/// table here, and the row's tail fields follow every write.
pub struct RowIds<'a> {
    /// The whole row (`width` cells); the first `h.num_blocks` are the table.
    cells: &'a [AtomicI32],
    h: &'a mut RowState,
}

impl RowIds<'_> {
    fn append(&mut self, b: BlockId, fresh: bool) {
        let n = self.h.num_blocks as usize;
        self.cells[n].store(b.0 as i32, Relaxed);
        (self.h.num_blocks, self.h.tail_block, self.h.tail_owned) = (n as u32 + 1, b.0, fresh);
    }
}

impl BlockIds for RowIds<'_> {
    #[inline]
    fn len(&self) -> usize {
        self.h.num_blocks as usize
    }
    #[inline]
    fn at(&self, i: usize) -> BlockId {
        debug_assert!(i < self.len());
        BlockId(self.cells[i].load(Relaxed) as u32)
    }
}

impl BlockIdsMut for RowIds<'_> {
    fn set(&mut self, i: usize, b: BlockId) {
        debug_assert!(i < self.len());
        self.cells[i].store(b.0 as i32, Relaxed);
        if i + 1 == self.len() {
            (self.h.tail_block, self.h.tail_owned) = (b.0, false);
        }
    }
    fn push(&mut self, b: BlockId) {
        self.append(b, false);
    }
    /// A fresh block's ref count is 1: the row may write into it without asking the pool.
    fn push_fresh(&mut self, b: BlockId) {
        self.append(b, true);
    }
    fn pop(&mut self) -> Option<BlockId> {
        let n = self.len().checked_sub(1)?;
        let b = BlockId(self.cells[n].swap(0, Relaxed) as u32);
        let tail = if n == 0 { 0 } else { self.cells[n - 1].load(Relaxed) as u32 };
        (self.h.num_blocks, self.h.tail_block, self.h.tail_owned) = (n as u32, tail, false);
        Some(b)
    }
}

impl RowState {
    /// The row's next step is one decode token: all tokens but the last are computed, and the
    /// last is a sampled one (not the prompt's last token).
    #[inline]
    pub fn is_decode(&self) -> bool {
        self.computed + 1 == self.num_tokens && self.num_tokens > self.prompt_len
    }
}

pub struct Batch {
    width: usize,
    capacity: usize,
    /// `capacity * width` block ids, row-major. Atomics (plain loads and stores on every target
    /// we build for) because numpy views read it while the scheduler runs with the GIL released.
    table: Box<[AtomicI32]>,
    pub rows: Vec<RowState>,
    /// Row-indexed arrays the step's output copies in bulk.
    pub owner: Vec<SeqRef>,
    pub req_id: Vec<i64>,
    pub seq_id: Vec<i64>,
    pub sample_index: Vec<i32>,
    pub last_token: Vec<i64>,
    /// Seq id of the first fanned-out sample (see `RowState::fan_out`).
    pub fan_out_first: Vec<u64>,
    /// The request's sampling parameters, copied in when the row is given.
    pub sampling: Vec<SamplingSpec>,
    /// `capacity * PENDING_TOKENS` staged tokens; row `r` has `rows[r].num_pending` of them.
    pub(crate) pending: Vec<u32>,
    dead: Vec<u32>,
}

impl Batch {
    /// `None` when the matrix cannot be allocated.
    pub fn new(capacity: usize, width: usize) -> Option<Self> {
        let table = zeroed_table(capacity.checked_mul(width)?)?;
        Some(Batch {
            width,
            capacity,
            table,
            rows: Vec::with_capacity(capacity),
            owner: Vec::with_capacity(capacity),
            req_id: Vec::with_capacity(capacity),
            seq_id: Vec::with_capacity(capacity),
            sample_index: Vec::with_capacity(capacity),
            last_token: Vec::with_capacity(capacity),
            fan_out_first: Vec::with_capacity(capacity),
            sampling: Vec::with_capacity(capacity),
            pending: vec![0; capacity * PENDING_TOKENS],
            dead: Vec::new(),
        })
    }

    pub fn len(&self) -> usize {
        self.rows.len()
    }
    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }
    pub fn width(&self) -> usize {
        self.width
    }
    pub fn capacity(&self) -> usize {
        self.capacity
    }
    pub fn has_dead(&self) -> bool {
        !self.dead.is_empty()
    }

    /// The matrix: `capacity` rows of `width` block ids (for zero-copy views).
    pub fn table_ptr(&self) -> *const i32 {
        self.table.as_ptr() as *const i32
    }

    #[inline]
    pub fn block(&self, row: usize, i: usize) -> i32 {
        self.table[row * self.width + i].load(Relaxed)
    }

    #[inline]
    fn set(&self, row: usize, i: usize, b: i32) {
        self.table[row * self.width + i].store(b, Relaxed);
    }

    /// The rows' state, a read view of the matrix and the rows' owners, borrowed apart.
    pub fn rows_and_table(&mut self) -> (&mut [RowState], TableRef<'_>, &[SeqRef]) {
        (&mut self.rows, TableRef { table: &self.table, width: self.width }, &self.owner)
    }

    /// The live part of a row.
    pub fn row_blocks(&self, row: usize) -> impl Iterator<Item = i32> + '_ {
        let start = row * self.width;
        self.table[start..start + self.rows[row].num_blocks as usize].iter().map(|b| b.load(Relaxed))
    }

    /// Appends a row for a sequence with an empty plan; `blocks` is its block table (a
    /// sequence's ids move into its row: a fork's or a swap-in's, or none).
    pub fn push(&mut self, seq: SeqRef, init: RowInit, blocks: impl ExactSizeIterator<Item = u32>) -> u32 {
        let r = self.len();
        assert!(r < self.capacity, "more running sequences than max_num_seqs");
        debug_assert!(blocks.len() <= self.width);
        let n = blocks.len();
        let mut tail = 0;
        for (i, b) in blocks.enumerate() {
            self.set(r, i, b as i32);
            tail = b;
        }
        self.rows.push(RowState {
            computed: init.computed as u32,
            num_tokens: init.num_tokens as u32,
            prompt_len: init.prompt_len as u32,
            num_blocks: n as u32,
            tail_block: tail,
            new_tokens: 0,
            logits_row: 0,
            fan_out: 0,
            samples: false,
            is_dead: false,
            num_pending: 0,
            tail_owned: false,
            stop: init.stop,
        });
        self.owner.push(seq);
        self.req_id.push(init.req_id as i64);
        self.seq_id.push(seq.seq_id as i64);
        self.sample_index.push(init.sample_index as i32);
        self.last_token.push(init.last_token as i64);
        self.fan_out_first.push(0);
        self.sampling.push(init.sampling);
        r as u32
    }

    /// Row `row`'s block ids, read-only.
    #[inline]
    pub fn ids(&self, row: usize) -> RowIdsRef<'_> {
        let start = row * self.width;
        RowIdsRef { cells: &self.table[start..start + self.rows[row].num_blocks as usize] }
    }

    /// Row `row`'s block ids, for the KV-cache manager to write.
    #[inline]
    pub fn ids_mut(&mut self, row: usize) -> RowIds<'_> {
        let start = row * self.width;
        RowIds { cells: &self.table[start..start + self.width], h: &mut self.rows[row] }
    }

    /// Stages a sampled token; false when the stage is full (flush it first).
    #[inline]
    pub fn stage_token(&mut self, row: usize, token: u32) -> bool {
        let n = self.rows[row].num_pending as usize;
        if n == PENDING_TOKENS {
            return false;
        }
        self.pending[row * PENDING_TOKENS + n] = token;
        self.rows[row].num_pending = n as u8 + 1;
        true
    }

    /// The row's staged tokens, oldest first.
    pub fn pending(&self, row: usize) -> &[u32] {
        let start = row * PENDING_TOKENS;
        &self.pending[start..start + self.rows[row].num_pending as usize]
    }

    /// Moves the row's staged tokens to the end of `tokens`.
    #[inline]
    pub fn flush_tokens(&mut self, row: usize, tokens: &mut Vec<u32>) {
        if self.rows[row].num_pending > 0 {
            tokens.extend_from_slice(self.pending(row));
            self.rows[row].num_pending = 0;
        }
    }

    /// Marks a row as leaving while a step is in flight; `compact` removes it later.
    pub fn mark_dead(&mut self, row: u32) {
        if !self.rows[row as usize].is_dead {
            self.rows[row as usize].is_dead = true;
            self.dead.push(row);
        }
    }

    /// Removes the dead rows (highest first, so that a moved row is never a dead one).
    /// Calls `moved` for every row moved into a hole.
    pub fn compact(&mut self, mut moved: impl FnMut(Moved)) {
        let mut dead = std::mem::take(&mut self.dead);
        dead.sort_unstable_by(|a, b| b.cmp(a));
        for &r in &dead {
            if let Some(m) = self.swap_remove(r) {
                moved(m);
            }
        }
        dead.clear();
        self.dead = dead;
    }

    /// Removes row `r` now: the last row moves into it. Returns the move, if any.
    pub fn swap_remove(&mut self, r: u32) -> Option<Moved> {
        let r = r as usize;
        let last = self.len() - 1;
        let old = self.rows[r].num_blocks as usize;
        if r != last {
            let n = self.rows[last].num_blocks as usize;
            for i in 0..n {
                self.set(r, i, self.block(last, i));
            }
            for i in n..old {
                self.set(r, i, 0);
            }
            for i in 0..n {
                self.set(last, i, 0);
            }
            let (k, src) = (self.rows[last].num_pending as usize, last * PENDING_TOKENS);
            self.pending.copy_within(src..src + k, r * PENDING_TOKENS);
        } else {
            for i in 0..old {
                self.set(r, i, 0);
            }
        }
        self.rows.swap_remove(r);
        self.owner.swap_remove(r);
        self.req_id.swap_remove(r);
        self.seq_id.swap_remove(r);
        self.sample_index.swap_remove(r);
        self.last_token.swap_remove(r);
        self.fan_out_first.swap_remove(r);
        self.sampling.swap_remove(r);
        (r != last).then(|| Moved { from: last as u32, to: r as u32, seq: self.owner[r] })
    }

    /// Checks the padding invariant of every row (O(capacity * width); tests only).
    pub fn check_padding(&self) -> Result<(), String> {
        for r in 0..self.capacity {
            let from = if r < self.len() { self.rows[r].num_blocks as usize } else { 0 };
            if let Some(i) = (from..self.width).find(|&i| self.block(r, i) != 0) {
                return Err(format!("batch row {r}: block {i} is {} past its {from} blocks", self.block(r, i)));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(b: &Batch, r: usize) -> Vec<i32> {
        (0..b.width()).map(|i| b.block(r, i)).collect()
    }

    fn seq(slot: u32, seq_id: u64) -> SeqRef {
        SeqRef { slot, seq_id }
    }

    fn init(req_id: u64, computed: usize, num_tokens: usize) -> RowInit {
        let stop = RowStop { min_len: 0, stop_len: 100, eos: None, has_stop_ids: false };
        RowInit { req_id, sample_index: 0, prompt_len: 1, computed, num_tokens, last_token: 0, stop, sampling: SamplingSpec::default() }
    }

    #[test]
    fn staged_tokens_flush_in_order_and_move_with_their_row() {
        let mut b = Batch::new(2, 1).unwrap();
        b.push(seq(0, 1), init(1, 1, 2), [1u32].into_iter());
        b.push(seq(1, 2), init(2, 1, 2), [2u32].into_iter());
        for t in 0..PENDING_TOKENS as u32 {
            assert!(b.stage_token(1, 100 + t));
        }
        assert!(!b.stage_token(1, 999), "a full stage refuses");
        b.stage_token(0, 5);
        b.swap_remove(0);
        let mut tokens = vec![7];
        b.flush_tokens(0, &mut tokens);
        assert_eq!(tokens[1..], (100..100 + PENDING_TOKENS as u32).collect::<Vec<_>>()[..]);
        assert_eq!(b.rows[0].num_pending, 0);
        assert!(b.stage_token(0, 3));
        assert_eq!(b.pending(0), &[3]);
    }

    #[test]
    fn rows_stay_dense_and_padded_through_swap_remove() {
        let mut b = Batch::new(4, 3).unwrap();
        assert_eq!(b.push(seq(0, 10), init(100, 8, 9), [5u32, 6].into_iter()), 0);
        assert_eq!(b.push(seq(1, 11), init(101, 3, 4), [7u32].into_iter()), 1);
        assert_eq!(b.push(seq(2, 12), init(102, 9, 10), [8u32, 9, 1].into_iter()), 2);
        assert_eq!(row(&b, 0), vec![5, 6, 0]);
        // Removing row 0 moves row 2 into it and clears row 2.
        assert_eq!(b.swap_remove(0), Some(Moved { from: 2, to: 0, seq: seq(2, 12) }));
        assert_eq!(row(&b, 0), vec![8, 9, 1]);
        assert_eq!(row(&b, 2), vec![0, 0, 0]);
        assert_eq!(b.seq_id, vec![12, 11]);
        assert_eq!(b.rows.iter().map(|h| h.computed).collect::<Vec<_>>(), vec![9, 3]);
        // Removing the last row moves nothing.
        assert_eq!(b.swap_remove(1), None);
        assert_eq!(row(&b, 1), vec![0, 0, 0]);
        b.check_padding().unwrap();
    }

    #[test]
    fn a_shorter_row_moved_over_a_longer_one_is_padded() {
        let mut b = Batch::new(2, 4).unwrap();
        b.push(seq(0, 1), init(1, 16, 17), [1u32, 2, 3, 4].into_iter());
        b.push(seq(1, 2), init(2, 1, 2), [9u32].into_iter());
        b.swap_remove(0);
        assert_eq!(row(&b, 0), vec![9, 0, 0, 0]);
        b.check_padding().unwrap();
    }

    #[test]
    fn row_ids_write_the_matrix_and_the_tail_follows_every_change() {
        let mut b = Batch::new(2, 4).unwrap();
        b.push(seq(0, 1), init(1, 6, 7), [4u32, 5].into_iter());
        b.push(seq(1, 2), init(2, 0, 1), std::iter::empty());
        let tail = |b: &Batch, r: usize| (b.rows[r].tail_block, b.rows[r].tail_owned);
        assert_eq!((tail(&b, 0), tail(&b, 1)), ((5, false), (0, false)));
        b.ids_mut(0).push_fresh(BlockId(9));
        assert_eq!(tail(&b, 0), (9, true));
        assert_eq!(row(&b, 0), vec![4, 5, 9, 0]);
        b.ids_mut(0).set(1, BlockId(7)); // a copy-on-write inside the table
        assert_eq!(tail(&b, 0), (9, true));
        b.ids_mut(0).set(2, BlockId(8)); // ... and of the tail: ownership unknown again
        assert_eq!(tail(&b, 0), (8, false));
        b.ids_mut(0).push(BlockId(6)); // a revived cache hit may be shared
        assert_eq!(tail(&b, 0), (6, false));
        assert_eq!(row(&b, 0), vec![4, 7, 8, 6]);
        assert_eq!(b.ids(0).to_vec(), [4, 7, 8, 6].map(BlockId));
        b.ids_mut(1).push_fresh(BlockId(3));
        b.swap_remove(0);
        assert_eq!(tail(&b, 0), (3, true));
        assert_eq!(row(&b, 0), vec![3, 0, 0, 0]);
        b.check_padding().unwrap();
    }

    #[test]
    fn dead_rows_are_compacted_highest_first() {
        let mut b = Batch::new(4, 1).unwrap();
        for i in 0..4u32 {
            b.push(seq(i, i as u64), init(i as u64, 1, 2), [i + 1].into_iter());
        }
        b.mark_dead(0);
        b.mark_dead(3);
        b.mark_dead(0);
        let mut moves = vec![];
        b.compact(|m| moves.push(m));
        // Row 3 goes first (nothing moves), then row 2 moves into row 0.
        assert_eq!(moves, vec![Moved { from: 2, to: 0, seq: seq(2, 2) }]);
        assert_eq!(b.seq_id, vec![2, 1]);
        assert_eq!(row(&b, 0), vec![3]);
        assert!(!b.has_dead());
        b.check_padding().unwrap();
    }
}
