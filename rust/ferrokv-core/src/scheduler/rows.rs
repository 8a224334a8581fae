//! The link between a running sequence and its batch row: giving and taking rows, bringing a
//! sequence up to date with its row, and prefetching the chains of rows a pass will visit.
//!
//! Invariants: a running sequence has exactly one row, the only home of its computed count,
//! block table, tail block and staged tokens. A sequence is brought up to date in one place,
//! `flush_row` (its staged tokens appended), before anything reads its tokens and when it
//! leaves the batch; leaving, its count moves back into it (`take_row`), after its blocks were
//! released or swapped out (the row held the only copy of its table).
//! Costs: O(1) per row, plus the staged tokens moved and, on entry, the table copied in once.

use super::Scheduler;
use crate::batch::{Batch, Moved, RowInit, SeqRef, NO_ROW};
use crate::block_pool::BlockId;
use crate::request::{Request, RowStop, Sequence};

impl Scheduler {
    /// The row of a sequence whose tokens are all in `s.tokens` (nothing staged).
    pub(super) fn row_init(req: &Request, s: &Sequence, computed: usize, max_model_len: usize) -> RowInit {
        RowInit {
            req_id: req.request_id,
            sample_index: s.sample_index,
            prompt_len: req.prompt_len,
            computed,
            num_tokens: s.tokens.len(),
            last_token: *s.tokens.last().expect("a sequence has at least one token"),
            stop: RowStop::new(&req.stop, req.prompt_len, max_model_len),
            sampling: req.sampling,
        }
    }

    /// Brings a running sequence up to date with its row (before anything reads its tokens):
    /// appends the tokens staged in the row.
    #[inline]
    pub(super) fn flush_row(batch: &mut Batch, s: &mut Sequence) {
        if s.row != NO_ROW {
            batch.flush_tokens(s.row as usize, &mut s.tokens);
        }
    }

    /// Gives sequence `pos` of request `slot` a row holding `blocks` (its table moves in: a
    /// swap-in's ids, or none) and its computed count.
    pub(super) fn give_row(&mut self, slot: u32, pos: usize, blocks: &[BlockId]) {
        let req = self.requests[slot as usize].as_mut().expect("live slot");
        let s = &req.seqs[pos];
        debug_assert_eq!(s.row, NO_ROW);
        debug_assert_eq!(blocks.len(), self.bm.blocks_for(s.num_computed), "a table covers the computed tokens");
        let init = Self::row_init(req, s, s.num_computed, self.cfg.max_model_len);
        let row = self.batch.push(SeqRef { slot, seq_id: s.seq_id }, init, blocks.iter().map(|b| b.0));
        req.seqs[pos].row = row;
    }

    /// Takes a sequence's row away: its staged tokens and computed count go back into the
    /// sequence. Its blocks must be released or swapped out first. While a step is in flight
    /// (or `update` runs) the row is only marked dead, so that the step's arrays, which index
    /// rows, stay valid; it is compacted when the step ends.
    pub(super) fn take_row(&mut self, slot: u32, pos: usize) {
        self.flush_seq(slot, pos);
        let s = &mut self.requests[slot as usize].as_mut().expect("live slot").seqs[pos];
        let row = std::mem::replace(&mut s.row, NO_ROW);
        if row == NO_ROW {
            return;
        }
        s.num_computed = self.batch.rows[row as usize].computed as usize;
        if self.defer_row_removal || self.in_flight.is_some() {
            self.batch.mark_dead(row);
        } else if let Some(m) = self.batch.swap_remove(row) {
            self.fix_moved(m);
        }
    }

    /// Releases every block of sequence `pos` of request `slot` (its row's, or its CPU blocks).
    pub(super) fn free_seq_blocks(&mut self, slot: u32, pos: usize) {
        let s = &mut self.requests[slot as usize].as_mut().expect("live slot").seqs[pos];
        if s.row == NO_ROW {
            self.kv.free(&mut s.kv, &Vec::new());
        } else {
            self.kv.free(&mut s.kv, &self.batch.ids(s.row as usize));
        }
    }

    /// A live row's request and the position of its sequence in it.
    pub(super) fn row_req(requests: &mut [Option<Request>], seq: SeqRef) -> (&mut Request, usize) {
        let req = requests[seq.slot as usize].as_mut().expect("a live row's request is live");
        let pos = req.seq_pos(seq.seq_id).expect("a live row's sequence is live");
        (req, pos)
    }

    /// A live row's sequence.
    pub(super) fn seq_of(requests: &mut [Option<Request>], seq: SeqRef) -> &mut Sequence {
        let (req, pos) = Self::row_req(requests, seq);
        &mut req.seqs[pos]
    }

    /// While row `rows[i]` is being worked on, starts fetching what the work on the rows after
    /// it will touch, level by level: the request 8 rows ahead, the sequence 4 ahead (its
    /// request fetched by then), the ends of its token and hash lists 3 ahead. Rows that
    /// cross a block boundary in one step each need that chain; pipelined, the misses overlap
    /// instead of queueing one chain after another.
    #[inline]
    pub(super) fn prefetch_ahead(&self, rows: &[u32], i: usize) {
        const DISTANCE: [usize; 3] = [8, 4, 3]; // per level
        for (level, d) in DISTANCE.into_iter().enumerate() {
            // The first row primes the pipeline with the rows before that distance too.
            let from = if i == 0 { 0 } else { d };
            for &r in rows.iter().skip(i + from).take(d + 1 - from) {
                self.prefetch_row_level(r, level as u8);
            }
        }
    }

    /// One level of `prefetch_ahead` for one row: 0 the request, 1 the sequence, 2 the ends
    /// of its token and hash lists (each level reads what the one before fetched).
    #[inline]
    pub(super) fn prefetch_row_level(&self, r: u32, level: u8) {
        use crate::prefetch::{read, read_range, read_value};
        let SeqRef { slot, seq_id } = self.batch.owner[r as usize];
        let entry = &self.requests[slot as usize];
        match (level, entry) {
            (0, _) => read_value(entry),
            // The first sequence, without reading it (usually the only one).
            (1, Some(req)) => read_range(req.seqs.as_ptr() as *const u8, std::mem::size_of::<Sequence>()),
            (_, Some(req)) => {
                if let Some(s) = req.seqs.iter().find(|s| s.seq_id == seq_id) {
                    read(s.tokens.as_ptr().wrapping_add(s.tokens.len()) as *const u8);
                    s.kv.prefetch_tail();
                }
            }
            _ => {}
        }
    }

    pub(super) fn fix_moved(&mut self, m: Moved) {
        Self::seq_of(&mut self.requests, m.seq).row = m.to;
    }

    /// Removes the rows marked dead (the end of `update` or `cancel_step`).
    pub(super) fn compact_dead_rows(&mut self) {
        self.defer_row_removal = false;
        if self.batch.has_dead() {
            let mut moves = Vec::new();
            self.batch.compact(|m| moves.push(m));
            for m in moves {
                self.fix_moved(m);
            }
        }
    }

    /// Brings a running sequence up to date with its row (`flush_row`).
    pub(super) fn flush_seq(&mut self, slot: u32, pos: usize) {
        let s = &mut self.requests[slot as usize].as_mut().expect("live slot").seqs[pos];
        Self::flush_row(&mut self.batch, s);
    }

}

#[cfg(test)]
mod tests {
    use super::super::test_util::*;
    use super::super::*;
    use crate::batch::NO_ROW;
    use crate::kv_cache_manager::BlockIds;

    /// Two running requests (block size 16) whose rows stage the tokens of their three steps.
    fn staged() -> Scheduler {
        let mut s = with_requests(cfg(16, 16, 32), [req(1, 3, 10), req(2, 3, 10)]);
        for t in 1..=3 {
            step(&mut s, t);
        }
        s
    }

    #[test]
    fn take_row_moves_the_count_and_staged_tokens_into_the_sequence_and_give_row_moves_them_back() {
        let mut s = staged();
        let (seq, other) = (only_seq(&s, 1), only_seq(&s, 2));
        let (slot, pos) = s.locate_seq(seq).unwrap();
        let row = row_of(&s, seq);
        assert_eq!(s.batch.pending(row), [1, 2, 3], "the tokens of the three steps are staged");
        let tokens = s.seq_tokens(seq).unwrap();
        let computed = s.batch.rows[row].computed as usize;
        let blocks = s.batch.ids(row).to_vec();
        assert_ne!(s.req(slot).seqs[pos].num_computed, computed, "the row holds the only count");
        s.take_row(slot, pos);
        let q = &s.req(slot).seqs[pos];
        assert_eq!((q.row, q.num_computed, &q.tokens), (NO_ROW, computed, &tokens));
        assert_eq!((s.batch.len(), row_of(&s, other)), (1, row), "the last row moved into the hole");
        s.give_row(slot, pos, &blocks);
        let row = row_of(&s, seq);
        let h = s.batch.rows[row];
        assert_eq!((row, h.computed as usize, h.num_tokens as usize), (1, computed, tokens.len()));
        assert_eq!((s.batch.last_token[row], s.batch.ids(row).to_vec()), (3, blocks));
        s.check_invariants().unwrap();
    }

    #[test]
    fn take_row_while_update_runs_marks_the_row_dead_and_moves_no_other_row() {
        let mut s = staged();
        let (seq, other) = (only_seq(&s, 1), only_seq(&s, 2));
        let (slot, pos) = s.locate_seq(seq).unwrap();
        let other_row = row_of(&s, other);
        s.defer_row_removal = true;
        s.take_row(slot, pos);
        assert_eq!((s.batch.len(), row_of(&s, other)), (2, other_row));
        assert!(s.batch.has_dead());
        assert_eq!(s.req(slot).seqs[pos].row, NO_ROW);
    }

    #[test]
    fn a_failed_admission_gives_its_rows_back_and_the_request_keeps_waiting() {
        // 5 usable blocks of 4 tokens: request 1 holds 3 once it decodes; request 2's prompt
        // needs 4.
        let mut s = with_requests(cfg(6, 4, 32), [req(1, 8, 4)]);
        step(&mut s, 1);
        s.add_request(req(2, 16, 1)).unwrap();
        let o = s.schedule().unwrap();
        assert_eq!(o.req_ids, vec![1]);
        let (slot, pos) = s.locate_seq(only_seq(&s, 2)).unwrap();
        assert_eq!((s.batch.len(), s.req(slot).seqs[pos].row), (1, NO_ROW));
        assert_eq!((s.num_waiting(), s.num_running_seqs(), s.num_free_blocks()), (1, 1, 2));
        s.check_invariants().unwrap();
    }
}
