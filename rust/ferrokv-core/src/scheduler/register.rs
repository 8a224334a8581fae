//! Prefix-cache registration at planning time: a full block is registered as soon as the step
//! that computes its last tokens is planned, so that a request admitted later in the same
//! `schedule()` (and any later step) takes it as a cache hit. Eight prompts that share a system
//! prompt and arrive together compute it once.
//!
//! Why it is safe: a step's forward pass writes, layer by layer, the K/V of all the step's
//! tokens before that layer's attention reads any of them (every attention backend does; its
//! tests check it), so a sequence that took such a block as a hit reads it after it is written.
//! Registration follows the plan in order, so that each admission sees what was planned before
//! it: the rows the decode row pass planned (once the pass stands), then each request the
//! ordered walk or the admission plans, right after `record`. A planned sequence never leaves
//! the step before it runs: the walk preempts only requests it has not planned yet, and a
//! request aborted or dropped mid-step keeps its rows (dead) in the step's arrays, so its K/V is
//! written all the same. A step that does not run is cancelled, and `cancel_step` undoes its
//! registrations (`undo_registrations`) and recomputes the requests that took its blocks as
//! hits, so no cached block ever holds KV that was not written.
//!
//! Invariants: a sequence never has more blocks registered than the full blocks of its computed
//! count (the planned tokens included; `check_invariants`); every registration of the step in
//! flight is in its undo record: each registering sequence's progress before it, and each block
//! it cached with its cache incarnation. Costs: O(rows that complete a block): a flush of the
//! row's staged tokens, one hash and one insert per block, pipelined over the rows.

use super::Scheduler;
use crate::batch::{RowState, NO_ROW};
use crate::block_pool::BlockMath;
use crate::kv_cache_manager::Registration;
use crate::prefix_cache::ParentLink;

/// Whether a row's planned tokens fill a block (the last token of a block is among them).
#[inline]
pub(super) fn completes_block(bm: BlockMath, h: &RowState) -> bool {
    let after = h.computed as usize;
    h.new_tokens > 0 && !h.is_dead && bm.block(after) != bm.block(after - h.new_tokens as usize)
}

impl Scheduler {
    /// Registers the blocks that the planned rows `rows` complete, in two passes. The first
    /// brings the sequences' tokens up to date with their rows (a decode's input token may be
    /// staged) and records their registration progress for `cancel_step`, pipelined so that
    /// the misses of the chain request -> sequence -> lists overlap (`prefetch_ahead`). The
    /// second hashes row i while row i-2 is inserted (its index slot, record and token slot
    /// fetched meanwhile): hashing a block right after appending its tokens stalls on them.
    pub(super) fn register_planned(&mut self, rows: &[u32]) {
        if !self.kv.prefix_caching() || rows.is_empty() {
            return;
        }
        let n = rows.len();
        for i in 0..n {
            self.prefetch_ahead(rows, i);
            let r = rows[i] as usize;
            let s = Self::seq_of(&mut self.requests, self.batch.owner[r]);
            Self::flush_row(&mut self.batch, s);
            self.undo.marks.push((s.seq_id, s.kv.registration()));
        }
        for i in 0..n + 2 {
            for (j, prepare) in [(i, true), (i.wrapping_sub(2), false)] {
                if j >= n {
                    continue;
                }
                let r = rows[j] as usize;
                let (req, pos) = Self::row_req(&mut self.requests, self.batch.owner[r]);
                let s = &mut req.seqs[pos];
                let computed = self.batch.rows[r].computed as usize;
                let salt = req.cache_salt.as_deref();
                let ids = self.batch.ids(r);
                if prepare {
                    self.kv.prepare_register(&mut s.kv, &ids, &s.tokens, computed, salt);
                } else {
                    self.kv.register_computed(&mut s.kv, &ids, &s.tokens, computed, salt, &mut self.undo.registered);
                }
            }
        }
    }

    /// Registers what the decode row pass planned (its rows that complete a block, listed in
    /// `completing`), before the ordered walk and the admissions plan anything.
    pub(super) fn register_decoded_rows(&mut self) {
        let rows = std::mem::take(&mut self.completing);
        self.register_planned(&rows);
        self.completing = rows;
    }

    /// Registers what request `slot`'s plan (just recorded) completes, before the next
    /// request's prefix lookup.
    pub(super) fn register_request(&mut self, slot: u32) {
        if !self.kv.prefix_caching() {
            return;
        }
        let mut rows = std::mem::take(&mut self.completing);
        rows.clear();
        for s in &self.req(slot).seqs {
            if s.row != NO_ROW && completes_block(self.bm, &self.batch.rows[s.row as usize]) {
                rows.push(s.row);
            }
        }
        self.register_planned(&rows);
        self.completing = rows;
    }

    /// `cancel_step`: puts back the registration progress of the step's sequences that are
    /// still running (latest mark first, so each ends at its oldest) and forgets the blocks the
    /// step cached. Run before the rows' counts are rolled back.
    pub(super) fn undo_registrations(&mut self, marks: &[(u64, Registration)], registered: &[ParentLink]) {
        for &(seq_id, mark) in marks.iter().rev() {
            let Ok((slot, pos)) = self.locate_seq(seq_id) else { continue };
            let s = &mut self.requests[slot as usize].as_mut().expect("live slot").seqs[pos];
            if s.row != NO_ROW {
                s.kv.restore_registration(mark);
            }
        }
        self.kv.unregister(registered);
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_util::*;
    use super::super::*;
    use crate::request::FinishReason;

    /// Two prompts of 10 tokens sharing their first 8 (two blocks of 4).
    fn sharing(c: SchedulerConfig) -> Scheduler {
        let prompt = |tail: u32| -> Vec<u32> { (0..8).chain([tail, tail + 1]).collect() };
        with_requests(c, [NewRequest::new(1, prompt(50), 4), NewRequest::new(2, prompt(60), 4)])
    }

    #[test]
    fn a_request_admitted_later_in_the_same_step_hits_the_blocks_an_earlier_one_computes() {
        let mut s = sharing(cfg(32, 4, 64));
        let o = s.schedule().unwrap();
        s.check_invariants().unwrap();
        assert_eq!(s.num_cached_tokens(2).unwrap(), 8, "both shared blocks hit in the step that computes them");
        assert_eq!(o.num_tokens(), 10 + 2);
        let (a, b) = (s.seq_block_table(only_seq(&s, 1)).unwrap(), s.seq_block_table(only_seq(&s, 2)).unwrap());
        assert_eq!((a.len(), b.len()), (3, 3));
        assert_eq!(b[..2], a[..2], "request 2's table points at request 1's blocks");
        assert_ne!(b[2], a[2]);
        assert_eq!(s.stats().cached_prompt_tokens, 8);
        s.update(o.step_id, &[1, 1]).unwrap();
        s.check_invariants().unwrap();
        drain(&mut s, 1);
        assert_eq!(s.num_free_blocks(), 31);
    }

    #[test]
    fn cancelling_the_step_unregisters_its_blocks_and_recomputes_the_request_that_hit_them() {
        let mut s = sharing(cfg(32, 4, 64));
        let o = s.schedule().unwrap();
        assert_eq!((s.num_cached_tokens(2).unwrap(), s.kv.num_cached_blocks()), (8, 2));
        s.cancel_step(o.step_id).unwrap();
        s.check_invariants().unwrap();
        assert_eq!(s.kv.num_cached_blocks(), 0, "nothing the cancelled step computed stays registered");
        let (a, b) = (only_seq(&s, 1), only_seq(&s, 2));
        assert!(s.seq_block_table(a).unwrap().is_empty(), "request 1's counts went back to 0");
        assert_eq!((s.num_running(), s.num_waiting()), (1, 1), "request 2 read the step's blocks: it waits to be recomputed");
        assert!(s.seq_block_table(b).unwrap().is_empty());
        assert_eq!(s.num_free_blocks(), 31);
        // The next step plans the same as the cancelled one did.
        let again = s.schedule().unwrap();
        assert_eq!((again.req_ids.clone(), again.num_tokens(), s.kv.num_cached_blocks()), (vec![1, 2], 12, 2));
        s.update(again.step_id, &[1, 1]).unwrap();
        drain(&mut s, 1);
        assert_eq!(s.num_free_blocks(), 31);
    }

    #[test]
    fn a_decode_that_fills_a_block_registers_it_for_an_admission_in_the_same_step() {
        let mut s = with_requests(cfg(32, 4, 64), [req(1, 3, 8)]);
        step(&mut s, 7); // prefill of 3: block 1 holds 3 tokens; the sampled 7 is staged in the row
        let mut prompt = s.seq_tokens(only_seq(&s, 1)).unwrap();
        prompt.push(9);
        s.add_request(NewRequest::new(2, prompt, 2)).unwrap();
        let o = s.schedule().unwrap(); // request 1 decodes position 3, the last of block 1
        s.check_invariants().unwrap();
        assert_eq!(s.num_cached_tokens(2).unwrap(), 4, "the decode's input token was flushed and its block registered first");
        assert_eq!(o.positions, vec![3, 4]);
        s.cancel_step(o.step_id).unwrap();
        s.check_invariants().unwrap();
        assert_eq!((s.kv.num_cached_blocks(), s.num_waiting()), (0, 1));
    }

    #[test]
    fn an_abort_mid_step_keeps_the_registration_and_a_cancel_after_it_undoes_it() {
        // Aborted mid-step, the request's rows stay in the step's arrays: the runner writes its
        // K/V, so what it registered stays cached after `update`.
        let mut s = sharing(cfg(32, 4, 64));
        let o = s.schedule().unwrap();
        s.abort(1).unwrap();
        s.check_invariants().unwrap();
        s.update(o.step_id, &[1, 1]).unwrap();
        assert_eq!(s.kv.num_cached_blocks(), 2);
        // The same with a cancel after the abort: nothing of the step stays cached.
        let mut s = sharing(cfg(32, 4, 64));
        let o = s.schedule().unwrap();
        s.abort(1).unwrap();
        s.cancel_step(o.step_id).unwrap();
        s.check_invariants().unwrap();
        assert_eq!(s.kv.num_cached_blocks(), 0);
        assert_eq!((s.num_running(), s.num_waiting(), s.num_free_blocks()), (0, 1, 31));
        let (_, done) = step(&mut s, 1);
        assert!(done.is_empty() && s.stats().cached_prompt_tokens == 0, "request 2 hits nothing now");
    }

    #[test]
    fn a_request_that_forked_mid_step_after_registering_is_aborted_by_cancel_and_its_blocks_unregistered() {
        let mut s = sharing(cfg(32, 4, 64));
        let o = s.schedule().unwrap();
        s.fork_sequence(only_seq(&s, 1), Some(3)).unwrap();
        s.cancel_step(o.step_id).unwrap();
        s.check_invariants().unwrap();
        assert_eq!(s.kv.num_cached_blocks(), 0);
        let (_, done) = step(&mut s, 1);
        assert_eq!(done.iter().filter(|d| d.reason == FinishReason::Abort).count(), 2);
    }
}
