//! `cancel_step`: undoes a step in flight whose forward pass did not complete (an exception or
//! an interrupt between `schedule` and `update`), so that the scheduler goes on as if the step
//! had never been planned.
//!
//! Invariants: after it, no sampled token was appended and no computed count advanced; every
//! block the step allocated for its tokens is released; no block the step registered in the
//! prefix cache stays registered, and every sequence's registration progress is what it was; a
//! request whose KV the step was to make valid (a copy-on-write copy, a swap-in, a swap-out, a
//! block it took as a cache hit that the step itself computes) is recomputed from scratch,
//! since those ops and writes may not have run; a request that forked or dropped a sequence mid-step
//! (a beam search) cannot be put back and is aborted (reported by the next `update`); one whose
//! sample a stop string ended mid-step goes on with its other samples. What the cancelled output
//! reported (ended and preempted requests) is reported again by the next output.
//! Costs: O(rows) plus O(blocks) of the requests it resets; never on the normal path.

use super::{PreemptionMode, Scheduler};
use crate::batch::NO_ROW;
use crate::block_pool::BlockId;
use crate::error::CoreResult;
use crate::kv_cache_manager::BlockIds;
use crate::prefix_cache::ParentLink;
use crate::request::{FinishReason, RequestState};

impl Scheduler {
    /// Undoes the step `step_id` in flight (see the module docs). Any call between `schedule`
    /// and `update` may be followed by it instead of `update`.
    pub fn cancel_step(&mut self, step_id: u64) -> CoreResult<()> {
        self.step_in_flight("cancel_step", step_id)?;
        let undo = self.in_flight.take().expect("checked").undo;
        self.ts = crate::clock::now();
        self.defer_row_removal = true;
        for id in undo.reshaped {
            if let Some(&slot) = self.by_id.get(&id) {
                self.end_request_reported(slot, FinishReason::Abort);
                self.stats.requests_aborted += 1;
            }
        }
        self.undo_registrations(&undo.marks, &undo.registered);
        self.roll_back_rows();
        self.recompute_untrusted(&undo.filled, &undo.registered);
        for id in undo.swapped_out {
            self.forget_swap(id);
        }
        self.compact_dead_rows();
        let ended = std::mem::replace(&mut self.ended_ids, undo.finished_ids);
        self.ended_ids.extend(ended);
        self.pending_preempted = undo.preempted_ids;
        let s = &mut self.stats;
        (s.prompt_tokens_computed, s.output_tokens_recomputed) = (undo.stats.prompt_tokens_computed, undo.stats.output_tokens_recomputed);
        (s.decode_tokens, s.cached_prompt_tokens) = (undo.stats.decode_tokens, undo.stats.cached_prompt_tokens);
        (s.step_tokens_hist, s.step_tokens_sum) = (undo.stats.step_tokens_hist, undo.stats.step_tokens_sum);
        s.cancelled_steps += 1;
        Ok(())
    }

    /// Every planned row's count goes back, and the blocks allocated past it are released.
    fn roll_back_rows(&mut self) {
        for r in 0..self.batch.len() {
            let h = &mut self.batch.rows[r];
            let planned = h.new_tokens;
            (h.new_tokens, h.samples, h.fan_out) = (0, false, 0);
            if planned == 0 || h.is_dead {
                continue;
            }
            h.computed -= planned;
            let keep = self.bm.blocks_for(h.computed as usize);
            self.kv.truncate(&mut self.batch.ids_mut(r), keep);
        }
    }

    /// Requests whose rows hold a block the step's copy or swap-in ops were to fill, or count
    /// as computed a block the step registered (a cache hit taken in the step; its writer's
    /// count is rolled back below it already): their KV cannot be trusted, so they are
    /// recomputed.
    fn recompute_untrusted(&mut self, filled: &[u32], registered: &[ParentLink]) {
        if filled.is_empty() && registered.is_empty() {
            return;
        }
        let mut fresh: Vec<u32> = registered.iter().map(|l| l.block.0).collect();
        fresh.sort_unstable();
        let bs = self.cfg.block_size;
        let mut slots: Vec<u32> = Vec::new();
        for r in (0..self.batch.len()).filter(|&r| !self.batch.rows[r].is_dead) {
            let ids = self.batch.ids(r);
            let computed = self.batch.rows[r].computed as usize;
            let untrusted = |i: usize| {
                let b = ids.at(i).0;
                filled.contains(&b) || ((i + 1) * bs <= computed && fresh.binary_search(&b).is_ok())
            };
            if (0..ids.len()).any(untrusted) {
                slots.push(self.batch.owner[r].slot);
            }
        }
        slots.sort_unstable();
        slots.dedup();
        for slot in slots {
            let pos = self.running_index(slot);
            debug_assert_eq!(self.running.get(pos), Some(&slot));
            self.running.remove(pos);
            self.preempt_as(slot, PreemptionMode::Recompute);
        }
    }

    /// A request the step swapped out: its CPU copy may never have been made, so it waits to
    /// be recomputed instead.
    fn forget_swap(&mut self, request_id: u64) {
        let Some(&slot) = self.by_id.get(&request_id) else { return };
        let req = self.requests[slot as usize].as_mut().expect("live slot");
        if req.state != RequestState::Swapped {
            return;
        }
        for s in req.seqs.iter_mut() {
            debug_assert_eq!(s.row, NO_ROW);
            self.kv.free(&mut s.kv, &Vec::<BlockId>::new());
            s.num_computed = 0;
        }
        req.state = RequestState::Waiting;
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_util::*;
    use super::super::*;
    use crate::output::{BlockTables, FinishedSeq, SchedulerOutput};
    use crate::request::FinishReason;

    /// What a step plans, without block ids (a cancelled step's blocks may come back in
    /// another order).
    fn plan_of(o: &SchedulerOutput) -> (Vec<i64>, Vec<i64>, Vec<i64>, Vec<i32>, Vec<i32>, Vec<i64>) {
        (o.req_ids.clone(), o.input_ids.clone(), o.positions.clone(), o.seq_lens.clone(), o.query_start_loc.clone(), o.logits_indices.clone())
    }

    /// Tokens sampled as a function of the step and the row, so both runs sample alike.
    fn tokens_for(o: &SchedulerOutput, k: i64) -> Vec<i64> {
        (0..o.num_rows() as i64).map(|r| (k * 7 + r) % 50 + 1).collect()
    }

    fn run(s: &mut Scheduler, cancel_at: &[usize]) -> (Vec<(Vec<i64>, Vec<i64>, Vec<i64>, Vec<i32>, Vec<i32>, Vec<i64>)>, Vec<FinishedSeq>) {
        let (mut plans, mut done) = (Vec::new(), Vec::new());
        for k in 0..200 {
            if !s.has_unfinished() {
                break;
            }
            if cancel_at.contains(&k) {
                let o = s.schedule().unwrap();
                s.cancel_step(o.step_id).unwrap();
                s.check_invariants().unwrap();
                assert!(s.update(o.step_id, &tokens_for(&o, k as i64)).is_err(), "a cancelled step is over");
            }
            let o = s.schedule().unwrap();
            s.check_invariants().unwrap();
            plans.push(plan_of(&o));
            // Timestamps differ between the runs; everything else must not.
            done.extend(s.update(o.step_id, &tokens_for(&o, k as i64)).unwrap().into_iter().map(|d| FinishedSeq { times: None, ..d }));
            s.check_invariants().unwrap();
        }
        (plans, done)
    }

    fn workload(c: SchedulerConfig) -> Scheduler {
        let mut s = Scheduler::new(c).unwrap();
        for id in 0..5u64 {
            let mut r = req(id, 3 + 5 * id as usize, 6 + id as usize);
            r.eos_token_id = Some(13);
            s.add_request(r).unwrap();
        }
        s
    }

    #[test]
    fn a_cancelled_step_leaves_every_later_step_as_if_it_never_was() {
        for caching in [true, false] {
            let c = SchedulerConfig { enable_prefix_caching: caching, ..cfg(64, 4, 12) };
            let (plans, done) = run(&mut workload(c.clone()), &[]);
            let mut s = workload(c);
            let free = s.num_free_blocks();
            let (cancelled_plans, cancelled_done) = run(&mut s, &[0, 1, 3, 4, 9, 10]);
            assert_eq!(cancelled_plans, plans);
            assert_eq!(cancelled_done, done);
            assert_eq!(s.stats().cancelled_steps, 6);
            assert_eq!(s.num_free_blocks(), free);
        }
    }

    #[test]
    fn cancel_rolls_back_counts_releases_the_steps_blocks_and_reports_what_ended_again() {
        let mut s = with_requests(cfg(32, 4, 16), [req(1, 4, 8), req(2, 4, 8)]);
        step(&mut s, 5); // prefill: one full block each
        s.abort(2).unwrap();
        let seq = only_seq(&s, 1);
        let free = s.num_free_blocks();
        let o = s.schedule().unwrap(); // position 4 starts a new block
        assert_eq!(o.finished_req_ids, vec![2]);
        assert_eq!(s.num_free_blocks(), free - 1);
        s.cancel_step(o.step_id).unwrap();
        assert_eq!((s.num_free_blocks(), s.seq_block_table(seq).unwrap().len()), (free, 1));
        assert_eq!(s.seq_tokens(seq).unwrap().len(), 5, "no token appended");
        assert!(s.cancel_step(o.step_id).is_err(), "nothing in flight");
        let again = s.schedule().unwrap();
        assert_eq!((again.finished_req_ids.clone(), again.positions.clone()), (vec![2], vec![4]));
    }

    #[test]
    fn a_copy_on_write_step_cancelled_recomputes_the_request() {
        let mut s = Scheduler::new(cfg(32, 4, 16)).unwrap();
        let mut r = req(1, 6, 8);
        r.n = 2;
        s.add_request(r).unwrap();
        step(&mut s, 5); // prefill, then the two samples fork and share the partial block
        let o = s.schedule().unwrap();
        assert!(!o.copy_ops.is_empty(), "a sample writes into the shared block: copy-on-write");
        s.cancel_step(o.step_id).unwrap();
        s.check_invariants().unwrap();
        // The copy may never have run: both samples are recomputed from scratch.
        assert_eq!((s.num_running(), s.num_waiting(), s.num_free_blocks()), (0, 1, 31));
        let done = drain(&mut s, 5);
        assert_eq!(done.len(), 2);
        assert_eq!(s.num_free_blocks(), 31);
    }

    #[test]
    fn a_swap_out_cancelled_is_recomputed_not_swapped_back_in() {
        let c = SchedulerConfig { preemption_mode: PreemptionMode::Swap, num_cpu_blocks: 16, ..cfg(6, 2, 16) };
        let mut s = with_requests(c, [req(1, 3, 6), req(2, 3, 6)]);
        step(&mut s, 5);
        let mut swapped = None;
        for _ in 0..6 {
            let o = s.schedule().unwrap();
            if !o.swap_out.is_empty() {
                swapped = Some(o);
                break;
            }
            s.update(o.step_id, &vec![5; o.num_rows()]).unwrap();
        }
        let o = swapped.expect("a tight cache swaps one out");
        let victim = o.preempted_req_ids[0] as u64;
        s.cancel_step(o.step_id).unwrap();
        s.check_invariants().unwrap();
        let r = s.req(s.by_id[&victim]);
        assert_eq!(r.state, crate::request::RequestState::Waiting);
        assert!(r.seqs.iter().all(|q| q.kv.cpu_blocks().is_empty() && q.num_computed == 0));
        let again = s.schedule().unwrap();
        assert_eq!(again.preempted_req_ids, vec![victim as i64], "the preemption is reported again");
        assert!(again.swap_in.is_empty());
        s.update(again.step_id, &vec![5; again.num_rows()]).unwrap();
        drain(&mut s, 5);
        assert_eq!(s.stats().swap_preemptions, s.stats().preemptions - s.stats().recompute_preemptions);
        assert_eq!(s.num_free_blocks(), 5);
    }

    #[test]
    fn a_request_that_forked_mid_step_is_aborted_by_cancel() {
        let mut s = with_requests(cfg(32, 4, 16), [req(1, 3, 8)]);
        step(&mut s, 5);
        let seq = only_seq(&s, 1);
        let o = s.schedule().unwrap();
        s.fork_sequence(seq, Some(9)).unwrap();
        s.cancel_step(o.step_id).unwrap();
        assert!(!s.has_unfinished());
        let o = s.schedule().unwrap();
        let done = s.update(o.step_id, &[]).unwrap();
        assert_eq!(done.len(), 2, "both sequences reported aborted");
        assert!(done.iter().all(|d| d.reason == FinishReason::Abort));
        assert_eq!(s.num_free_blocks(), 31);
    }

    #[test]
    fn an_abort_mid_step_keeps_the_steps_block_tables_in_place() {
        let mut s = with_requests(cfg(32, 4, 16), [req(1, 3, 8), req(2, 5, 8), req(3, 7, 8)]);
        step(&mut s, 5);
        let o = s.schedule().unwrap();
        assert!(matches!(o.block_tables, BlockTables::Batch));
        let before = s.block_tables(&o).unwrap();
        s.abort(1).unwrap(); // row 0: the last row must not move into it while the step runs
        assert_eq!(s.block_tables(&o).unwrap(), before);
        s.check_invariants().unwrap();
        s.update(o.step_id, &vec![5; o.num_rows()]).unwrap();
        s.check_invariants().unwrap();
        assert_eq!(s.num_running(), 2);
    }
}
