//! The running walk and what ends or suspends a request: preemption (swap or recompute),
//! aborts, dropped sequences.
//!
//! Invariants: the victim is always the back of the running list (lowest priority, latest
//! arrival); a request alone and still out of blocks is aborted, never spun on; every path
//! that ends a request frees all its blocks at once. Costs: O(running requests) per walk;
//! preemption and abort are O(the request's blocks).

use super::admit::Attempt;
use super::decode::DecodePlan;
use super::{PreemptionMode, Scheduler};
use crate::error::{CoreError, CoreResult};
use crate::kv_cache_manager::SeqKv;
use crate::output::{output_part, FinishedSeq};
use crate::request::{FinishReason, RequestState};

impl Scheduler {
    /// Serves the running requests in order within `budget`: decodes planned row by row
    /// (`plan_decode_rows`), the rest one request at a time. A request whose blocks cannot be
    /// found preempts the back of the running list (possibly itself). Returns the budget left
    /// and the preempted request ids.
    pub(super) fn schedule_running(&mut self, mut budget: usize) -> (usize, Vec<i64>) {
        let mut preempted: Vec<i64> = Vec::new();
        // The row pass leaves every row's plan written (its decodes) or cleared; the ordered
        // walk plans the requests it left.
        let plan = self.plan_decode_rows(budget);
        budget -= self.step.tokens;
        self.register_decoded_rows();
        let mut i = match plan {
            DecodePlan::All => return (budget, preempted),
            DecodePlan::Front { generic_from } => generic_from,
            DecodePlan::None => 0,
        };
        while i < self.running.len() {
            let slot = self.running[i];
            let attempt = match self.plan_decode_request(slot, budget) {
                Some(a) => a,
                None => self.try_schedule(slot, budget, 0),
            };
            match attempt {
                Attempt::Scheduled { tokens, full } => {
                    self.record(slot, full);
                    budget -= tokens;
                    i += 1;
                }
                Attempt::NoBudget => break,
                Attempt::NoSpace => {
                    if self.running.len() > i + 1 {
                        let victim = self.running.pop().expect("non-empty");
                        preempted.push(self.req(victim).request_id as i64);
                        self.preempt(victim);
                    } else if i == 0 {
                        // Alone and still out of blocks: it can never fit. End it rather than spin.
                        self.end_request_reported(slot, FinishReason::Abort);
                        self.stats.capacity_aborts += 1;
                    } else {
                        self.running.pop();
                        preempted.push(self.req(slot).request_id as i64);
                        self.preempt(slot);
                        break;
                    }
                }
            }
        }
        (budget, preempted)
    }

    /// Takes a running request's blocks away: to the CPU pool in swap mode (when it fits),
    /// else freed for recomputation. It goes back to the waiting queue at its original place.
    pub(super) fn preempt(&mut self, slot: u32) {
        self.preempt_as(slot, self.cfg.preemption_mode);
    }

    /// `preempt` in the given mode (swap falls back to recompute when the CPU pool is full).
    pub(super) fn preempt_as(&mut self, slot: u32, mode: PreemptionMode) {
        let req = self.requests[slot as usize].as_mut().expect("live slot");
        // What a request planned this step is registered already (its KV is the step's): it
        // must run. The walk preempts only requests it has not planned yet.
        debug_assert!(req.seqs.iter().all(|s| self.batch.rows[s.row as usize].new_tokens == 0), "a planned request is preempted");
        self.num_running_seqs -= req.seq_slots();
        let swapped = mode == PreemptionMode::Swap && {
            let ids: Vec<_> = req.seqs.iter().map(|s| self.batch.ids(s.row as usize)).collect();
            let mut tables: Vec<&mut SeqKv> = req.seqs.iter_mut().map(|s| &mut s.kv).collect();
            self.kv.swap_out(&mut tables, &ids)
        };
        if !swapped {
            for pos in 0..req.seqs.len() {
                self.free_seq_blocks(slot, pos);
            }
        }
        for pos in 0..self.req(slot).seqs.len() {
            self.take_row(slot, pos);
        }
        let req = self.requests[slot as usize].as_mut().expect("live slot");
        if swapped {
            req.state = RequestState::Swapped;
            self.stats.swap_preemptions += 1;
            self.undo.swapped_out.push(req.request_id);
        } else {
            req.seqs.iter_mut().for_each(|s| s.num_computed = 0);
            req.state = RequestState::Waiting;
            self.stats.recompute_preemptions += 1;
        }
        self.stats.preemptions += 1;
        let k = req.order_key();
        self.waiting.insert((k.0, k.1, slot));
        self.num_waiting_seqs += req.seq_slots();
    }

    /// Removes a request wherever it is, freeing all of its blocks; returns its sequences as
    /// finished, with their tokens (the callers report them or drop them).
    pub(super) fn end_request(&mut self, slot: u32, reason: FinishReason) -> Vec<FinishedSeq> {
        for pos in 0..self.req(slot).seqs.len() {
            self.free_seq_blocks(slot, pos);
            self.take_row(slot, pos);
        }
        let req = self.requests[slot as usize].as_mut().expect("live slot");
        match req.state {
            RequestState::Running => {
                self.num_running_seqs -= req.seq_slots();
                if let Some(i) = self.running.iter().position(|&s| s == slot) {
                    self.running.remove(i);
                }
            }
            RequestState::Waiting | RequestState::Swapped => {
                let k = req.order_key();
                self.waiting.remove(&(k.0, k.1, slot));
                self.num_waiting_seqs -= req.seq_slots();
            }
        }
        let n = req.seqs.len();
        let (request_id, prompt_len, cached) = (req.request_id, req.prompt_len, req.num_cached_tokens.unwrap_or(0));
        let times = req.times(self.last_token_ts[slot as usize], self.ts);
        let mut ended = Vec::with_capacity(n);
        for (i, s) in req.seqs.drain(..).enumerate() {
            self.seq_owner.remove(&s.seq_id);
            ended.push(FinishedSeq {
                request_id,
                seq_id: s.seq_id,
                sample_index: s.sample_index,
                reason,
                stop_token: None,
                stop_str: None,
                request_finished: i + 1 == n,
                output_tokens: output_part(s.tokens, prompt_len),
                num_cached_tokens: cached,
                times: (i + 1 == n).then_some(times),
            });
        }
        self.by_id.remove(&request_id);
        self.ended_ids.push(request_id as i64);
        self.release_slot(slot);
        ended
    }

    /// Like `end_request`, its sequences reported by the next `update` (the scheduler ended it:
    /// capacity, a cancelled step it cannot go on from).
    pub(super) fn end_request_reported(&mut self, slot: u32, reason: FinishReason) {
        let ended = self.end_request(slot, reason);
        self.pending_finished.extend(ended);
    }

    /// Ends a request at any time (waiting, running, swapped, or with a step in flight; the
    /// in-flight rows of an aborted request are ignored by `update`). Frees its blocks at once
    /// and returns its sequences as aborted, with the tokens each had generated.
    pub fn abort(&mut self, request_id: u64) -> CoreResult<Vec<FinishedSeq>> {
        self.end_by_caller(request_id, FinishReason::Abort)
    }

    /// Ends a request its caller found complete (a beam search that has its hypotheses), as
    /// `abort` does, but counted as finished; its sequences end with `Length`.
    pub fn finish_request(&mut self, request_id: u64) -> CoreResult<Vec<FinishedSeq>> {
        self.end_by_caller(request_id, FinishReason::Length)
    }

    fn end_by_caller(&mut self, request_id: u64, reason: FinishReason) -> CoreResult<Vec<FinishedSeq>> {
        let slot = *self.by_id.get(&request_id).ok_or(CoreError::UnknownRequest { request_id })?;
        self.ts = crate::clock::now(); // its finished time
        let ended = self.end_request(slot, reason);
        if reason == FinishReason::Abort {
            self.stats.requests_aborted += 1;
        } else {
            self.stats.requests_finished += 1;
        }
        Ok(ended)
    }

    /// Ends sequence `seq_id` with `FinishReason::Stop` because its caller's text layer found
    /// stop string `stop_str` in its text, and returns its record: the stop is decided without
    /// the model's runner. Legal at any time, as text may be a step behind (an overlapped
    /// engine detokenizes step N while step N + 1 runs): the sequence may have a step in
    /// flight (its row is then ignored by `update`, as an abort's), or have been preempted
    /// since. A request that loses one of several sequences mid-step cannot be put back by
    /// `cancel_step` and is aborted by it.
    pub fn stop_sequence(&mut self, seq_id: u64, stop_str: u32) -> CoreResult<FinishedSeq> {
        let (slot, pos) = self.locate_seq(seq_id)?;
        self.ts = crate::clock::now(); // its finished time
        let mut f = if self.req(slot).seqs.len() == 1 {
            let mut ended = self.end_request(slot, FinishReason::Stop);
            self.stats.requests_finished += 1;
            ended.pop().expect("end_request reports the sequence")
        } else {
            // Mid-step, its row dies: a cancelled step skips it, and the request goes on with
            // the others as if the stop had come before the step was planned.
            let mut out = Vec::with_capacity(1);
            let last = self.finish_seq(slot, pos, FinishReason::Stop, None, &mut out);
            debug_assert!(!last);
            out.pop().expect("finish_seq reports the sequence")
        };
        f.stop_str = Some(stop_str);
        Ok(f)
    }

    /// Ends one sequence and frees its blocks. Returns true if it was its request's last, in
    /// which case the request is gone too and counts as finished (its caller ended it: a stop
    /// string, a beam search that is done).
    pub fn drop_sequence(&mut self, seq_id: u64) -> CoreResult<bool> {
        let (slot, pos) = self.locate_seq(seq_id)?;
        if self.req(slot).seqs.len() == 1 {
            self.end_request(slot, FinishReason::Abort);
            self.stats.requests_finished += 1;
            return Ok(true);
        }
        if let Some(f) = self.in_flight.as_mut() {
            f.undo.reshaped.push(self.requests[slot as usize].as_ref().expect("live slot").request_id);
        }
        let mut sink = Vec::new();
        let last = self.finish_seq(slot, pos, FinishReason::Abort, None, &mut sink);
        debug_assert!(!last);
        Ok(false)
    }

    pub(super) fn release_slot(&mut self, slot: u32) {
        self.requests[slot as usize] = None;
        self.free_slots.push(slot);
    }

}

#[cfg(test)]
mod tests {
    use super::super::test_util::*;
    use super::super::*;
    use crate::error::CoreError;
    use crate::request::{FinishReason, RequestState};

    #[test]
    fn finished_and_aborted_sequences_carry_their_generated_tokens() {
        let mut s = with_requests(cfg(32, 4, 64), [req(1, 5, 3), req(2, 6, 50)]);
        let mut done = Vec::new();
        for t in 1..=3 {
            done.extend(step(&mut s, t).1);
        }
        assert_eq!(done.len(), 1);
        assert_eq!((done[0].request_id, done[0].reason, done[0].request_finished), (1, FinishReason::Length, true));
        assert_eq!(done[0].output_tokens, vec![1, 2, 3]);
        // Request 2 has generated 3 tokens (some still staged in its row): the abort reports them.
        let ended = s.abort(2).unwrap();
        assert_eq!(ended.len(), 1);
        assert_eq!((ended[0].reason, ended[0].request_finished), (FinishReason::Abort, true));
        assert_eq!(ended[0].output_tokens, vec![1, 2, 3]);
        assert!(!s.has_unfinished());
        assert_eq!(s.num_free_blocks(), 31);
    }

    #[test]
    fn stop_sequence_ends_a_sequence_between_steps() {
        let mut s = with_requests(cfg(32, 4, 64), [req(1, 5, 50), req(2, 5, 50)]);
        step(&mut s, 7);
        step(&mut s, 8);
        let seq = only_seq(&s, 1);
        step(&mut s, 9);
        let f = s.stop_sequence(seq, 2).unwrap();
        assert_eq!((f.reason, f.stop_str, f.stop_token, f.request_finished), (FinishReason::Stop, Some(2), None, true));
        assert_eq!(f.output_tokens, vec![7, 8, 9]);
        assert!(matches!(s.stop_sequence(seq, 0), Err(CoreError::UnknownSequence { .. })));
        s.check_invariants().unwrap();
        // The other request goes on alone; nothing leaks once it ends.
        let (o, _) = step(&mut s, 1);
        assert_eq!(o.req_ids, vec![2]);
        s.abort(2).unwrap();
        assert_eq!(s.num_free_blocks(), 31);
    }

    #[test]
    fn stop_sequence_with_a_step_in_flight_ignores_the_sequence_in_update() {
        // Text runs a step behind: the stop lands while the next step is in flight.
        let mut s = with_requests(cfg(32, 4, 64), [req(1, 5, 50), req(2, 5, 50)]);
        step(&mut s, 7);
        let seq = only_seq(&s, 1);
        let out = s.schedule().unwrap();
        let f = s.stop_sequence(seq, 0).unwrap();
        assert_eq!((f.reason, f.stop_str, f.request_finished, f.output_tokens.clone()), (FinishReason::Stop, Some(0), true, vec![7]));
        let done = s.update(out.step_id, &vec![8; out.num_rows()]).unwrap();
        assert!(done.is_empty(), "{done:?}");
        s.check_invariants().unwrap();
        assert_eq!(s.seq_tokens(only_seq(&s, 2)).unwrap().len(), 7, "the other row got its token");
        s.abort(2).unwrap();
        assert_eq!(s.num_free_blocks(), 31);
    }

    #[test]
    fn stop_sequence_of_one_of_several_samples_in_flight_then_a_cancelled_step_leaves_the_others_going() {
        let mut s = with_requests(cfg(64, 4, 64), [NewRequest { n: 2, ..req(1, 5, 50) }]);
        step(&mut s, 7);
        let seqs = s.request_seq_ids(1).unwrap();
        assert_eq!(seqs.len(), 2);
        let out = s.schedule().unwrap();
        let f = s.stop_sequence(seqs[0], 1).unwrap();
        assert!(!f.request_finished);
        s.cancel_step(out.step_id).unwrap();
        s.check_invariants().unwrap();
        // The other sample goes on from where it was: one row, its second token next.
        let (o, done) = step(&mut s, 1);
        assert!(done.is_empty() && o.row_seq_ids == vec![seqs[1] as i64], "{done:?}");
        assert_eq!(s.request_seq_ids(1).unwrap(), vec![seqs[1]]);
        assert_eq!(s.stats().requests_aborted, 0);
        s.abort(1).unwrap();
        assert_eq!(s.num_free_blocks(), 63);
    }

    #[test]
    fn stop_sequence_of_a_preempted_request_ends_it_from_the_waiting_queue() {
        let mut s = with_requests(cfg(32, 4, 64), [req(1, 5, 50)]);
        step(&mut s, 7);
        let seq = only_seq(&s, 1);
        preempt_between_steps(&mut s, 1);
        assert_eq!(s.num_waiting(), 1);
        let f = s.stop_sequence(seq, 0).unwrap();
        assert_eq!((f.reason, f.request_finished), (FinishReason::Stop, true));
        assert_eq!((s.num_waiting(), s.has_unfinished(), s.num_free_blocks()), (0, false, 31));
        s.check_invariants().unwrap();
    }

    #[test]
    fn a_prefill_at_the_back_that_runs_out_of_blocks_preempts_only_itself() {
        // 9 usable blocks of 4 tokens: two decoding requests hold 2 each, the long prompt's
        // second chunk cannot get its blocks.
        let mut c = cfg(10, 4, 16);
        c.max_num_seqs = 4;
        let mut s = Scheduler::new(c).unwrap();
        s.add_request(req(1, 7, 20)).unwrap();
        s.add_request(req(2, 7, 20)).unwrap();
        step(&mut s, 5);
        s.add_request(req(3, 30, 2)).unwrap();
        let (o, _) = step(&mut s, 5); // 2 decodes + 14 prompt tokens of request 3 (4 blocks)
        assert_eq!((o.num_decode_tokens, o.num_prefill_tokens), (2, 14));
        let (o, _) = step(&mut s, 5);
        // The decodes keep going; request 3 (the latest arrival, last in order) is preempted.
        assert_eq!(o.req_ids, vec![1, 2]);
        assert_eq!(o.preempted_req_ids, vec![3]);
        assert_eq!(s.stats().recompute_preemptions, 1);
        s.abort(3).unwrap();
        while s.has_unfinished() {
            step(&mut s, 5);
        }
        assert_eq!(s.num_free_blocks(), 9);
    }

    #[test]
    fn out_of_blocks_preempts_the_latest_arrival_for_recompute() {
        // 6 usable blocks of 2 tokens.
        let mut s = Scheduler::new(cfg(7, 2, 16)).unwrap();
        s.add_request(req(1, 4, 8)).unwrap();
        s.add_request(req(2, 4, 8)).unwrap();
        let (o, _) = step(&mut s, 1);
        assert_eq!(bt(&o), vec![1, 2, 3, 4]);
        step(&mut s, 1); // both at 5 tokens: blocks 5, 6
        assert_eq!(s.num_free_blocks(), 0);
        step(&mut s, 1); // positions 5 fit in the 3rd blocks
        let (o, _) = step(&mut s, 1); // request 1 needs a block: request 2 is preempted
        assert_eq!(o.preempted_req_ids, vec![2]);
        assert_eq!(o.req_ids, vec![1]);
        assert_eq!(s.num_waiting(), 1);
        assert_eq!(s.stats().recompute_preemptions, 1);
        // Request 2 comes back once request 1 is done and recomputes prompt + output.
        let mut seen_2 = false;
        for _ in 0..20 {
            let (o, _) = step(&mut s, 1);
            if o.req_ids.contains(&2) && !seen_2 {
                seen_2 = true;
                assert_eq!(o.positions.len(), 7); // 4 prompt + 3 generated tokens recomputed
            }
            if !s.has_unfinished() {
                break;
            }
        }
        assert!(seen_2 && !s.has_unfinished());
        assert_eq!(s.num_free_blocks(), 6);
        assert_eq!(s.stats().output_tokens_recomputed, 2);
    }

    /// 6 usable blocks of 2 tokens, swap mode: the fourth step swaps request 2 out.
    fn swapping() -> Scheduler {
        let c = SchedulerConfig { preemption_mode: PreemptionMode::Swap, num_cpu_blocks: 8, ..cfg(7, 2, 16) };
        with_requests(c, [req(1, 4, 8), req(2, 4, 8)])
    }

    #[test]
    fn swap_mode_emits_swap_pairs_and_resumes_without_recompute() {
        let mut s = swapping();
        for _ in 0..3 {
            step(&mut s, 1);
        }
        let (o, _) = step(&mut s, 1);
        assert_eq!(o.preempted_req_ids, vec![2]);
        assert_eq!(o.swap_out, vec![3, 0, 4, 1, 6, 2]); // request 2's blocks 3, 4, 6
        assert_eq!(s.stats().swap_preemptions, 1);
        let mut swapped_in = false;
        for _ in 0..20 {
            let (o, _) = step(&mut s, 1);
            if !o.swap_in.is_empty() {
                swapped_in = true;
                let cpu: Vec<i32> = o.swap_in.iter().step_by(2).copied().collect();
                assert_eq!(cpu, vec![0, 1, 2], "(cpu, gpu) pairs, in the order they went out");
                assert_eq!(o.positions.len(), 1, "a swapped request resumes with one decode token");
            }
            if !s.has_unfinished() {
                break;
            }
        }
        assert!(swapped_in);
        assert_eq!((s.kv_stats().blocks_swapped_out, s.kv_stats().blocks_swapped_in), (3, 3));
        assert_eq!(s.stats().output_tokens_recomputed, 0);
        assert_eq!(s.num_free_blocks(), 6);
    }

    #[test]
    fn priority_policy_orders_admission_and_picks_victims() {
        let mut c = cfg(7, 2, 16);
        c.policy = Policy::Priority;
        let mut s = Scheduler::new(c).unwrap();
        let mut low = req(1, 4, 8);
        low.priority = 5;
        let mut high = req(2, 4, 8);
        high.priority = -1;
        s.add_request(low).unwrap();
        s.add_request(high).unwrap();
        let (o, _) = step(&mut s, 1);
        assert_eq!(o.req_ids, vec![2, 1]);
        let mut preempted = vec![];
        for _ in 0..4 {
            let (o, _) = step(&mut s, 1);
            preempted.extend(o.preempted_req_ids);
        }
        assert_eq!(preempted, vec![1]);
    }

    #[test]
    fn the_victim_is_the_latest_arrival_of_three_or_more_running() {
        // 6 usable blocks of 2 tokens: three prompts of 4 fill them, then each decode needs a
        // block. Request 1 preempts the back of the running list: request 3, not request 2.
        let mut s = with_requests(cfg(7, 2, 16), [req(1, 4, 8), req(2, 4, 8), req(3, 4, 8)]);
        let (o, _) = step(&mut s, 1);
        assert_eq!((o.req_ids.clone(), s.num_free_blocks()), (vec![1, 2, 3], 0));
        let (o, _) = step(&mut s, 1);
        assert_eq!(o.preempted_req_ids, vec![3]);
        assert_eq!(o.req_ids, vec![1, 2], "the freed blocks serve both earlier arrivals");
        assert_eq!((s.num_running(), s.num_waiting()), (2, 1));
    }

    #[test]
    fn victims_go_by_lowest_priority_then_latest_arrival() {
        // Arrivals 1..4 with priorities 0, 5, 0, 5: the running order is 1, 3, 2, 4. Each
        // decode needs a block and none is free: request 1 preempts 4 (the lowest priority,
        // latest arrival); then request 2, at the back and out of blocks, preempts itself.
        let mut c = cfg(9, 2, 16);
        c.policy = Policy::Priority;
        let reqs = [(1, 0), (2, 5), (3, 0), (4, 5)].map(|(id, priority)| NewRequest { priority, ..req(id, 4, 8) });
        let mut s = with_requests(c, reqs);
        let (o, _) = step(&mut s, 1);
        assert_eq!((o.req_ids.clone(), s.num_free_blocks()), (vec![1, 3, 2, 4], 0));
        let (o, _) = step(&mut s, 1);
        assert_eq!(o.preempted_req_ids, vec![4, 2]);
        assert_eq!(o.req_ids, vec![1, 3]);
    }

    #[test]
    fn a_request_that_outgrows_the_cache_alone_is_aborted_not_spun_on() {
        let mut s = Scheduler::new(cfg(5, 2, 16)).unwrap(); // 4 usable blocks
        s.add_request(req(1, 3, 5)).unwrap(); // worst case 4 blocks: accepted
        let out = s.schedule().unwrap();
        let p = out.row_seq_ids[0] as u64;
        s.fork_sequence(p, Some(1)).unwrap(); // two beams of 8 tokens cannot fit in 4 blocks
        s.update(out.step_id, &[1]).unwrap();
        let mut aborted = false;
        for _ in 0..10 {
            let out = s.schedule().unwrap();
            let done = s.update(out.step_id, &vec![1; out.num_rows()]).unwrap();
            s.check_invariants().unwrap();
            if done.iter().any(|d| d.reason == FinishReason::Abort && d.request_finished) {
                aborted = true;
                break;
            }
        }
        assert!(aborted);
        assert_eq!(s.stats().capacity_aborts, 1);
        assert_eq!(s.num_free_blocks(), 4);
    }

    #[test]
    fn abort_between_schedule_and_update_is_safe() {
        let mut s = Scheduler::new(cfg(16, 4, 16)).unwrap();
        s.add_request(req(1, 5, 4)).unwrap();
        s.add_request(req(2, 5, 4)).unwrap();
        let out = s.schedule().unwrap();
        s.abort(1).unwrap();
        let done = s.update(out.step_id, &[3, 3]).unwrap();
        assert!(done.is_empty());
        assert_eq!(s.seq_tokens(s.request_seq_ids(2).unwrap()[0]).unwrap().len(), 6);
        s.check_invariants().unwrap();
    }

    #[test]
    fn abort_frees_blocks_wherever_the_request_is_and_reports_it_once_in_order() {
        let mut c = cfg(32, 4, 16);
        c.max_num_seqs = 2;
        let mut s = with_requests(c, [req(1, 6, 10), req(2, 6, 10), req(3, 6, 10)]);
        step(&mut s, 1);
        assert_eq!((s.num_running(), s.num_waiting()), (2, 1));
        s.abort(3).unwrap(); // waiting
        s.abort(1).unwrap(); // running
        assert_eq!(s.num_free_blocks(), 31 - 2);
        let out = s.schedule().unwrap();
        assert_eq!(out.finished_req_ids, vec![3, 1], "ended since the previous step, in order");
        assert_eq!(out.req_ids, vec![2]);
        s.abort(2).unwrap(); // with a step in flight: update ignores its row
        assert_eq!(s.num_free_blocks(), 31);
        assert!(s.update(out.step_id, &[1]).unwrap().is_empty());
        let (o, _) = step(&mut s, 1);
        assert_eq!((o.finished_req_ids.clone(), o.num_tokens()), (vec![2], 0));
        assert_eq!((s.stats().requests_aborted, s.stats().requests_finished), (3, 0));
        assert_eq!(s.abort(2), Err(CoreError::UnknownRequest { request_id: 2 }));
    }

    #[test]
    fn a_request_its_caller_finishes_frees_its_blocks_and_counts_as_finished() {
        let mut s = with_requests(cfg(32, 4, 16), [req(1, 6, 10), req(2, 6, 10)]);
        step(&mut s, 1);
        let ended = s.finish_request(1).unwrap();
        assert!(ended.iter().all(|f| f.reason == FinishReason::Length));
        s.abort(2).unwrap();
        assert_eq!((s.stats().requests_finished, s.stats().requests_aborted), (1, 1));
        assert_eq!(s.num_free_blocks(), 31);
        assert!(s.finish_request(1).is_err());
        s.check_invariants().unwrap();
    }

    #[test]
    fn aborting_a_swapped_request_releases_its_cpu_blocks() {
        let mut s = swapping();
        for _ in 0..4 {
            step(&mut s, 1);
        }
        let (slot, _) = s.locate_seq(only_seq(&s, 2)).unwrap();
        assert_eq!(s.req(slot).state, RequestState::Swapped);
        s.abort(2).unwrap();
        s.check_invariants().unwrap(); // the CPU pool's ref counts match the tables left
        drain(&mut s, 1);
        assert_eq!((s.num_free_blocks(), s.kv_stats().blocks_swapped_in), (6, 0));
    }
}
