//! `update`: sampled tokens in, stops decided, finished sequences freed; forks (n > 1 fan-out
//! and beam-style `fork_sequence`). The step's blocks were registered in the prefix cache when
//! it was planned (`register.rs`).
//!
//! Invariants: one token per logits row of the step in flight, or a typed error and nothing
//! changed; rows leaving during `update` are compacted at its end, so row numbers hold through
//! it. Costs: one pass over the rows; only rows that stop, fill their stage or fan out reach
//! their sequence.

use super::Scheduler;
use crate::batch::{SeqRef, NO_ROW, PENDING_TOKENS};
use crate::error::{CoreError, CoreResult};
use crate::output::{output_part, FinishedSeq};
use crate::request::{FinishReason, RequestState, Sequence};

/// What the row pass of `update` leaves for the passes that need a sequence.
struct Staged {
    /// Rows whose token is their sequence's first output token.
    first_tokens: Vec<u32>,
    /// Rows of n > 1 prompts whose samples fork off now.
    forks: Vec<u32>,
    /// Rows whose stage was full: their token is staged after the stage is flushed.
    full_stage: Vec<u32>,
    /// Rows the cheap stop filter could not rule out.
    maybe_stops: Vec<u32>,
    generated: u64,
}

/// A sequence that stops at this update: its row, why, and the stop token id if one ended it.
type Stop = (u32, FinishReason, Option<u32>);

impl Scheduler {
    /// Appends one sampled token per logits row of step `step_id`, decides stops and frees what
    /// finished.
    pub fn update(&mut self, step_id: u64, sampled: &[i64]) -> CoreResult<Vec<FinishedSeq>> {
        self.check_update(step_id, sampled)?;
        self.in_flight = None;
        self.ts = crate::clock::now();
        // Rows that leave are compacted at the end, so row numbers hold through every pass.
        self.defer_row_removal = true;
        let mut st = self.stage_sampled(sampled);
        self.mark_first_tokens(&st.first_tokens);
        let mut stops = self.decide_stops(&st.maybe_stops);
        self.flush_full_stages(&st.full_stage);
        st.generated += self.fan_out_rows(&st.forks, sampled, &mut stops);
        self.stats.generated_tokens += st.generated;
        let mut finished = std::mem::take(&mut self.pending_finished);
        let mut ended_slots: Vec<u32> = Vec::new();
        for (r, reason, stop_token) in stops {
            let SeqRef { slot, seq_id } = self.batch.owner[r as usize];
            let pos = self.req(slot).seq_pos(seq_id).expect("a live row's sequence is live");
            if self.finish_seq(slot, pos, reason, stop_token, &mut finished) {
                ended_slots.push(slot);
            }
        }
        self.remove_ended(&ended_slots);
        self.compact_dead_rows();
        Ok(finished)
    }

    /// `update`'s arguments belong to the step in flight, one valid token per logits row; a
    /// typed error changes nothing.
    fn check_update(&self, step_id: u64, sampled: &[i64]) -> CoreResult<()> {
        let fl = self.step_in_flight("update", step_id)?;
        if sampled.len() != fl.num_logits_rows {
            return Err(CoreError::invalid(
                "sampled_token_ids",
                format!("<{} tokens>", sampled.len()),
                format!("expected one token per logits row ({})", fl.num_logits_rows),
            ));
        }
        // One vectorizable pass; the offending value is looked up only on error.
        if sampled.iter().fold(0u64, |acc, &t| acc | (t as u64 >> 32)) != 0 {
            let bad = sampled.iter().find(|&&t| !(0..=u32::MAX as i64).contains(&t)).copied().unwrap_or(-1);
            return Err(CoreError::invalid("sampled_token_ids", bad, "token ids must be in [0, 2^32)"));
        }
        Ok(())
    }

    /// One tight pass over the rows stages each sampled token and filters stops from the row
    /// alone. Rows that need their sequence are listed for the passes after it: n > 1 prompts
    /// whose samples fork off now (their own token is appended after the fork), and full stages.
    fn stage_sampled(&mut self, sampled: &[i64]) -> Staged {
        let mut st = Staged { first_tokens: Vec::new(), forks: Vec::new(), full_stage: Vec::new(), maybe_stops: Vec::new(), generated: 0 };
        let (now, last_ts) = (self.ts, &mut self.last_token_ts);
        let b = &mut self.batch;
        let n = b.rows.len();
        let rows = &mut b.rows[..n];
        let last = &mut b.last_token[..n];
        let pending = &mut b.pending[..n * PENDING_TOKENS];
        let owner = &b.owner[..n];
        for r in 0..n {
            let h = &mut rows[r];
            if h.new_tokens == 0 || h.is_dead {
                continue; // not in the step, forked after it was scheduled, or ended mid-step
            }
            if !h.samples || h.fan_out > 0 {
                if h.fan_out > 0 {
                    st.forks.push(r as u32);
                }
                continue;
            }
            st.generated += 1;
            let tok = sampled[h.logits_row as usize] as u32;
            h.num_tokens += 1;
            last[r] = tok as i64;
            last_ts[owner[r].slot as usize] = now;
            if h.num_tokens == h.prompt_len + 1 {
                st.first_tokens.push(r as u32);
            }
            let k = h.num_pending as usize;
            if k < PENDING_TOKENS {
                pending[r * PENDING_TOKENS + k] = tok;
                h.num_pending += 1;
            } else {
                st.full_stage.push(r as u32); // staged once its stage is flushed
            }
            if h.stop.may_stop(tok, h.num_tokens) {
                st.maybe_stops.push(r as u32);
            }
        }
        st
    }

    /// Requests that got their first output token (rows from the row pass): its time.
    fn mark_first_tokens(&mut self, rows: &[u32]) {
        for &r in rows {
            let req = self.requests[self.batch.owner[r as usize].slot as usize].as_mut().expect("a live row's request is live");
            if req.first_token_ts == 0.0 {
                req.first_token_ts = self.ts;
            }
        }
    }

    /// The stops among the rows the filter let through (`RowStop::check`, the one decider).
    fn decide_stops(&self, maybe_stops: &[u32]) -> Vec<Stop> {
        let mut stops = Vec::new();
        for &r in maybe_stops {
            let r = r as usize;
            let tok = self.batch.last_token[r] as u32;
            let h = &self.batch.rows[r];
            let slot = self.batch.owner[r].slot;
            let requests = &self.requests;
            let stop_ids = || requests[slot as usize].as_ref().is_some_and(|q| q.stop.stop_token_ids.contains(&tok));
            if let Some((reason, stop_token)) = h.stop.check(tok, h.num_tokens, stop_ids) {
                stops.push((r as u32, reason, stop_token));
            }
        }
        stops
    }

    /// Rows whose stage was full: flushed into their sequences, then their token staged.
    fn flush_full_stages(&mut self, full_stage: &[u32]) {
        for (i, &r) in full_stage.iter().enumerate() {
            self.prefetch_ahead(full_stage, i);
            let r = r as usize;
            let s = Self::seq_of(&mut self.requests, self.batch.owner[r]);
            Self::flush_row(&mut self.batch, s);
            let staged = self.batch.stage_token(r, self.batch.last_token[r] as u32);
            debug_assert!(staged);
        }
    }

    /// Forks the samples of the n > 1 prompts in `forks` and appends every sample's token
    /// (the children's rows come after the rows staged above); their stops join `stops`.
    /// Returns the tokens appended.
    fn fan_out_rows(&mut self, forks: &[u32], sampled: &[i64], stops: &mut Vec<Stop>) -> u64 {
        let mut generated = 0;
        for &r in forks {
            let first_child = self.batch.len();
            self.fan_out(r as usize);
            for row in std::iter::once(r as usize).chain(first_child..self.batch.len()) {
                generated += 1;
                let tok = sampled[self.batch.rows[row].logits_row as usize] as u32;
                let (req, pos) = Self::row_req(&mut self.requests, self.batch.owner[row]);
                let s = &mut req.seqs[pos];
                Self::flush_row(&mut self.batch, s);
                s.tokens.push(tok);
                let h = &mut self.batch.rows[row];
                h.num_tokens += 1;
                self.last_token_ts[self.batch.owner[row].slot as usize] = self.ts;
                if req.first_token_ts == 0.0 {
                    req.first_token_ts = self.ts;
                }
                self.batch.last_token[row] = tok as i64;
                let stop_ids = || req.stop.stop_token_ids.contains(&tok);
                if let Some((reason, stop_token)) = h.stop.check(tok, h.num_tokens, stop_ids) {
                    stops.push((row as u32, reason, stop_token));
                }
            }
        }
        generated
    }

    /// Takes the requests that ended out of the running list and frees their slots.
    pub(super) fn remove_ended(&mut self, ended_slots: &[u32]) {
        if ended_slots.len() <= 8 {
            // The usual handful: found by binary search in the ordered running list.
            for &slot in ended_slots {
                let pos = self.running_index(slot);
                debug_assert_eq!(self.running.get(pos), Some(&slot));
                self.running.remove(pos);
            }
        } else {
            for &s in ended_slots {
                self.ending[s as usize] = true;
            }
            let ending = &self.ending;
            self.running.retain(|&s| !ending[s as usize]);
            for &s in ended_slots {
                self.ending[s as usize] = false;
            }
        }
        for &s in ended_slots {
            self.release_slot(s);
        }
    }

    /// Forks the `n - 1` extra samples off the prefilled prompt in row `r`; each gets a row
    /// that samples its own token of this step.
    pub(super) fn fan_out(&mut self, r: usize) {
        let SeqRef { slot, seq_id } = self.batch.owner[r];
        let (count, first, logits_row) = (self.batch.rows[r].fan_out, self.batch.fan_out_first[r], self.batch.rows[r].logits_row);
        // Done once: the plan of a row the next step does not plan keeps no stale fan-out.
        self.batch.rows[r].fan_out = 0;
        let before = self.req(slot).seq_slots();
        let ppos = self.req(slot).seq_pos(seq_id).expect("a live row's sequence is live");
        for j in 0..count {
            // Children are pushed after the parent: its position holds.
            let row = self.add_child(slot, ppos, first + j as u64, None) as usize;
            self.batch.rows[row].samples = true;
            self.batch.rows[row].logits_row = logits_row + 1 + j;
        }
        let req = self.requests[slot as usize].as_mut().expect("live slot");
        req.fanned_out = true;
        // Usually no change: the n slots were counted at admission.
        self.num_running_seqs = self.num_running_seqs + req.seq_slots() - before;
    }

    /// Forks sequence `ppos` of running request `slot` into a new sequence `child_id` that
    /// shares all its blocks (copy-on-write) and gets a batch row; `next_token`, if any, is
    /// appended to the child's tokens. The caller accounts for the request's sequence slots.
    pub(super) fn add_child(&mut self, slot: u32, ppos: usize, child_id: u64, next_token: Option<u32>) -> u32 {
        self.flush_seq(slot, ppos);
        let req = self.requests[slot as usize].as_mut().expect("live slot");
        let parent = &req.seqs[ppos];
        let prow = parent.row as usize;
        debug_assert_ne!(parent.row, NO_ROW, "only a running sequence forks");
        let computed = self.batch.rows[prow].computed as usize;
        let (kv, blocks) = self.kv.fork(&parent.kv, &self.batch.ids(prow));
        self.batch.rows[prow].tail_owned = false; // now shared
        let mut tokens = parent.tokens.clone();
        tokens.extend(next_token);
        let child = Sequence { seq_id: child_id, sample_index: req.next_sample_index, tokens, num_computed: computed, kv, row: NO_ROW };
        req.next_sample_index += 1;
        req.seqs.push(child);
        self.seq_owner.insert(child_id, slot);
        let pos = self.req(slot).seqs.len() - 1;
        self.give_row(slot, pos, &blocks);
        self.req(slot).seqs[pos].row
    }

    /// Ends one sequence; returns true when it was its request's last (the caller then takes
    /// the request out of `running` and releases the slot).
    pub(super) fn finish_seq(&mut self, slot: u32, pos: usize, reason: FinishReason, stop_token: Option<u32>, out: &mut Vec<FinishedSeq>) -> bool {
        self.free_seq_blocks(slot, pos);
        self.take_row(slot, pos);
        let req = self.requests[slot as usize].as_mut().expect("live slot");
        let before = req.seq_slots();
        let s = req.seqs.remove(pos);
        self.seq_owner.remove(&s.seq_id);
        let last = req.seqs.is_empty();
        let freed = before - if last { 0 } else { req.seq_slots() };
        if req.state == RequestState::Running {
            self.num_running_seqs -= freed;
        } else {
            self.num_waiting_seqs -= freed;
        }
        out.push(FinishedSeq {
            request_id: req.request_id,
            seq_id: s.seq_id,
            sample_index: s.sample_index,
            reason,
            stop_token,
            stop_str: None,
            request_finished: last,
            output_tokens: output_part(s.tokens, req.prompt_len),
            num_cached_tokens: req.num_cached_tokens.unwrap_or(0),
            times: last.then(|| req.times(self.last_token_ts[slot as usize], self.ts)),
        });
        if last {
            self.by_id.remove(&req.request_id);
            self.ended_ids.push(req.request_id as i64);
            self.stats.requests_finished += 1;
        }
        last
    }

    /// Forks a running sequence whose prompt is computed into a new one of the same request that
    /// shares all its blocks (copy-on-write). If the sequence has a step in flight,
    /// `next_token` is the child's sampled token for that step (the parent gets its own through
    /// `update`); otherwise it must be `None`. A child that stops at once is reported by the
    /// next `update`.
    pub fn fork_sequence(&mut self, seq_id: u64, next_token: Option<u32>) -> CoreResult<u64> {
        let (slot, pos) = self.locate_seq(seq_id)?;
        if self.req(slot).state != RequestState::Running {
            return Err(CoreError::InvalidState {
                message: format!("fork_sequence(seq_id={seq_id}): its request is not running (waiting or swapped out)"),
            });
        }
        let req = self.req(slot);
        if req.n > 1 && !req.fanned_out {
            return Err(CoreError::InvalidState {
                message: format!("fork_sequence(seq_id={seq_id}): the request's n={} samples do not exist yet", req.n),
            });
        }
        let grow = (req.seqs.len() + 1).max(req.reserved_seqs as usize).saturating_sub(req.seq_slots());
        if self.num_running_seqs + grow > self.cfg.max_num_seqs {
            // A batch never holds more than max_num_seqs sequences (runners size buffers by it).
            return Err(CoreError::invalid(
                "seq_id",
                seq_id,
                format!("forking it would exceed max_num_seqs={} running sequences", self.cfg.max_num_seqs),
            ));
        }
        if self.in_flight.is_some() {
            // Rows of sequences that ended mid-step stay in place (dead) until `update`, and the
            // step's n > 1 prompts fan out into new rows at `update`: a fork must leave room.
            let fanning: usize = self.batch.rows.iter().filter(|h| !h.is_dead).map(|h| h.fan_out as usize).sum();
            if self.batch.len() + fanning >= self.batch.capacity() {
                return Err(CoreError::InvalidState {
                    message: format!("fork_sequence(seq_id={seq_id}): the batch has no free row until update() (sequences that ended mid-step keep theirs while the step is in flight)"),
                });
            }
        }
        let parent_row = req.seqs[pos].row as usize;
        let computed = self.batch.rows[parent_row].computed as usize;
        if computed < req.prompt_len {
            // Samples share their prompt's full blocks, and recomputed ones wait for the first
            // sample's (`plan_start`): a fork mid-prefill would give each its own.
            return Err(CoreError::InvalidState {
                message: format!(
                    "fork_sequence(seq_id={seq_id}): its prompt is not computed yet ({computed} of {} tokens)",
                    req.prompt_len
                ),
            });
        }
        let in_flight = self.in_flight.is_some() && self.batch.rows[parent_row].samples;
        match (in_flight, next_token) {
            (true, None) => {
                return Err(CoreError::invalid("next_token", "None", format!("seq_id={seq_id} has a step in flight: pass the child's sampled token")))
            }
            (false, Some(t)) => {
                return Err(CoreError::invalid("next_token", t, format!("seq_id={seq_id} has no step in flight")))
            }
            _ => {}
        }
        let child_id = self.new_seq_id();
        let before = self.req(slot).seq_slots();
        let row = self.add_child(slot, pos, child_id, next_token) as usize;
        self.num_running_seqs += self.req(slot).seq_slots() - before;
        let request_id = self.req(slot).request_id;
        if let Some(f) = self.in_flight.as_mut() {
            f.forked = true;
            f.undo.reshaped.push(request_id);
        }
        if let Some(t) = next_token {
            let h = &self.batch.rows[row];
            let stop_ids = || self.req(slot).stop.stop_token_ids.contains(&t);
            if let Some((reason, st)) = h.stop.check(t, h.num_tokens, stop_ids) {
                let mut out = std::mem::take(&mut self.pending_finished);
                let pos = self.req(slot).seqs.len() - 1;
                if self.finish_seq(slot, pos, reason, st, &mut out) {
                    unreachable!("the parent is still live");
                }
                self.pending_finished = out;
            }
        }
        Ok(child_id)
    }

}

#[cfg(test)]
mod tests {
    use super::super::test_util::*;
    use super::super::*;
    use crate::request::FinishReason;

    #[test]
    fn parallel_samples_share_the_prompt_and_copy_on_write() {
        let mut s = Scheduler::new(cfg(16, 4, 16)).unwrap();
        let mut r = req(1, 6, 3);
        r.n = 3;
        s.add_request(r).unwrap();
        let (o, _) = step(&mut s, 9);
        assert_eq!(o.logits_indices, vec![5, 5, 5]); // the last prompt row, sampled 3 times
        assert_eq!(o.row_sample_index, vec![0, 1, 2]);
        assert_eq!(o.row_req_ids, vec![1, 1, 1]);
        assert_eq!(bt(&o), vec![1, 2]);
        let ids = s.request_seq_ids(1).unwrap();
        assert_eq!(o.row_seq_ids, ids.iter().map(|&i| i as i64).collect::<Vec<_>>(), "the samples' ids are known at schedule");
        let u = s.kv_usage();
        assert_eq!((u.counts.num_used_blocks, u.num_shared_blocks, u.num_block_refs), (2, 2, 6));
        let out = s.schedule().unwrap();
        s.check_invariants().unwrap();
        // Each sample writes position 6 in shared block 2: the first two copy, the last owns it.
        assert_eq!(out.copy_ops, vec![2, 3, 2, 4]);
        assert_eq!(s.block_tables(&out).unwrap(), vec![1, 3, 1, 4, 1, 2]);
        assert_eq!(out.slot_mapping, vec![3 * 4 + 2, 4 * 4 + 2, 2 * 4 + 2]);
        assert_eq!(out.num_rows(), 3);
        s.update(out.step_id, &[1, 2, 3]).unwrap();
        assert_eq!(s.kv_stats().cow_copies, 2);
        let toks: Vec<_> = ids.iter().map(|&i| s.seq_tokens(i).unwrap()[6..].to_vec()).collect();
        assert_eq!(toks, vec![vec![9, 1], vec![9, 2], vec![9, 3]]);
        let (_, done) = step(&mut s, 0);
        assert_eq!(done.len(), 3);
        assert_eq!(done.iter().filter(|d| d.request_finished).count(), 1);
        assert_eq!(s.num_free_blocks(), 15);
    }

    #[test]
    fn beam_style_fork_and_drop() {
        let mut s = Scheduler::new(cfg(16, 4, 16)).unwrap();
        s.add_request(req(1, 5, 10)).unwrap();
        let out = s.schedule().unwrap();
        let parent = out.row_seq_ids[0] as u64;
        assert!(s.fork_sequence(parent, None).is_err()); // in flight: a token is required
        let child = s.fork_sequence(parent, Some(42)).unwrap();
        assert_eq!((s.request_seq_ids(1).unwrap(), s.num_running_seqs()), (vec![parent, child], 2));
        s.update(out.step_id, &[41]).unwrap();
        assert_eq!(s.seq_tokens(parent).unwrap()[5..], [41]);
        assert_eq!(s.seq_tokens(child).unwrap()[5..], [42]);
        assert_eq!(s.seq_block_table(child).unwrap(), s.seq_block_table(parent).unwrap());
        let (o, _) = step(&mut s, 1);
        assert_eq!(o.copy_ops, vec![2, 3]);
        assert_eq!(o.num_rows(), 2);
        assert!(!s.drop_sequence(parent).unwrap());
        assert_eq!(s.seq_tokens(parent), Err(CoreError::UnknownSequence { seq_id: parent }));
        assert_eq!((s.seq_block_table(child).unwrap(), s.num_running_seqs()), (vec![1, 2], 1));
        assert!(s.drop_sequence(child).unwrap());
        assert!(!s.has_unfinished());
        assert_eq!(s.num_free_blocks(), 15);
        s.check_invariants().unwrap();
    }

    #[test]
    fn a_fork_makes_the_shared_tail_copy_on_write_and_the_rows_learn_it_is_theirs_again() {
        let mut s = Scheduler::new(cfg(16, 4, 16)).unwrap();
        s.add_request(req(1, 6, 20)).unwrap();
        step(&mut s, 1); // prefill: blocks 1, 2 (tokens 0..4, 4..6)
        let row = |s: &Scheduler, seq: u64| s.batch.rows[row_of(s, seq)];
        let parent = s.request_seq_ids(1).unwrap()[0];
        step(&mut s, 2); // decode at position 6, inside block 2: its ref count seen at 1
        assert_eq!((row(&s, parent).tail_block, row(&s, parent).tail_owned), (2, true));
        let child = s.fork_sequence(parent, None).unwrap();
        assert!(!row(&s, parent).tail_owned && !row(&s, child).tail_owned);
        // Both write position 7 of the shared block 2: one copies it first.
        let (o, _) = step(&mut s, 3);
        assert_eq!(o.copy_ops, vec![2, 3]);
        assert_eq!(o.slot_mapping, vec![3 * 4 + 3, 2 * 4 + 3]);
        assert_eq!((row(&s, parent).tail_block, row(&s, child).tail_block), (3, 2));
        // Position 8 starts fresh blocks; position 9 is written where each row owns its tail.
        let (o, _) = step(&mut s, 4);
        assert!(o.copy_ops.is_empty());
        assert!(row(&s, parent).tail_owned && row(&s, child).tail_owned);
        s.drop_sequence(child).unwrap();
        let (o, _) = step(&mut s, 5);
        assert_eq!((o.positions.clone(), o.copy_ops.len()), (vec![9], 0));
        assert_eq!(s.seq_tokens(parent).unwrap()[6..], [1, 2, 3, 4, 5]);
        s.check_invariants().unwrap();
    }

    #[test]
    fn stop_tokens_eos_and_abort_free_blocks_at_once() {
        let mut s = Scheduler::new(cfg(16, 4, 16)).unwrap();
        let mut a = req(1, 3, 10);
        a.eos_token_id = Some(2);
        let mut b = req(2, 3, 10);
        b.stop_token_ids = vec![5];
        s.add_request(a).unwrap();
        s.add_request(b).unwrap();
        s.add_request(req(3, 3, 10)).unwrap();
        let out = s.schedule().unwrap();
        let done = s.update(out.step_id, &[2, 5, 2]).unwrap();
        assert_eq!(done.len(), 2);
        assert_eq!((done[0].request_id, done[0].reason, done[0].stop_token), (1, FinishReason::Stop, None));
        assert_eq!((done[1].request_id, done[1].stop_token), (2, Some(5)));
        assert_eq!(s.num_free_blocks(), 14);
        s.abort(3).unwrap();
        assert_eq!(s.num_free_blocks(), 15);
        assert_eq!(s.abort(3), Err(CoreError::UnknownRequest { request_id: 3 }));
        let o = s.schedule().unwrap();
        assert_eq!(o.finished_req_ids, vec![1, 2, 3]);
    }

    #[test]
    fn a_wrong_token_count_or_an_out_of_range_token_is_an_error_and_changes_nothing() {
        let mut s = with_requests(cfg(8, 4, 16), [req(1, 3, 2)]);
        let o = s.schedule().unwrap();
        let field = |r: CoreResult<Vec<FinishedSeq>>| match r {
            Err(CoreError::InvalidArgument { field, value, .. }) => format!("{field}={value}"),
            other => panic!("{other:?}"),
        };
        assert_eq!(field(s.update(o.step_id, &[1, 2])), "sampled_token_ids=<2 tokens>");
        assert_eq!(field(s.update(o.step_id, &[])), "sampled_token_ids=<0 tokens>");
        assert_eq!(field(s.update(o.step_id, &[-1])), "sampled_token_ids=-1");
        assert_eq!(field(s.update(o.step_id, &[1 << 32])), "sampled_token_ids=4294967296");
        s.check_invariants().unwrap();
        assert_eq!(s.seq_tokens(only_seq(&s, 1)).unwrap().len(), 3);
        s.update(o.step_id, &[u32::MAX as i64]).unwrap();
        assert_eq!(s.seq_tokens(only_seq(&s, 1)).unwrap()[3], u32::MAX);
    }

    #[test]
    fn update_stops_on_eos_and_stop_ids_after_min_tokens_unless_eos_is_ignored() {
        let stop = |eos: Option<u32>, ids: &[u32], min_tokens: usize, ignore_eos: bool| NewRequest {
            eos_token_id: eos,
            stop_token_ids: ids.to_vec(),
            min_tokens,
            ignore_eos,
            ..req(1, 3, 4)
        };
        // (request, tokens sampled, tokens until it ends, reason, stop token)
        let cases = [
            (stop(Some(2), &[], 0, false), vec![1, 1, 2, 1], 3, FinishReason::Stop, None),
            (stop(None, &[5, 6], 0, false), vec![1, 6, 1], 2, FinishReason::Stop, Some(6)),
            (stop(None, &[], 0, false), vec![1; 10], 4, FinishReason::Length, None),
            (stop(Some(2), &[], 3, false), vec![2, 2, 2, 1], 3, FinishReason::Stop, None),
            (stop(None, &[5], 2, false), vec![5, 5], 2, FinishReason::Stop, Some(5)),
            (stop(Some(2), &[], 0, true), vec![2, 2, 2, 2], 4, FinishReason::Length, None),
            (stop(Some(2), &[2], 0, true), vec![2], 1, FinishReason::Stop, Some(2)),
        ];
        for (r, tokens, n, reason, stop_token) in cases {
            let what = format!("{r:?}");
            let mut s = with_requests(cfg(32, 4, 16), [r]);
            let (mut steps, mut done) = (0, Vec::new());
            for &t in &tokens {
                steps += 1;
                done = step(&mut s, t).1;
                if !done.is_empty() {
                    break;
                }
            }
            assert_eq!((steps, done.len()), (n, 1), "{what}");
            assert_eq!((done[0].reason, done[0].stop_token, done[0].request_finished), (reason, stop_token, true), "{what}");
            assert_eq!((s.stats().generated_tokens, s.num_free_blocks()), (n as u64, 31), "{what}");
        }
    }

    #[test]
    fn a_sequence_reaching_max_model_len_finishes_with_length() {
        let c = SchedulerConfig { max_model_len: 8, ..cfg(32, 4, 16) };
        let mut s = with_requests(c, [req(1, 6, 100)]);
        assert!(step(&mut s, 1).1.is_empty());
        let (_, done) = step(&mut s, 1);
        assert_eq!((done.len(), done[0].reason), (1, FinishReason::Length));
        assert_eq!(s.stats().generated_tokens, 2);
    }

    #[test]
    fn a_fork_that_stops_at_once_is_reported_by_the_next_update() {
        let mut s = with_requests(cfg(16, 4, 16), [NewRequest { eos_token_id: Some(0), ..req(1, 5, 10) }]);
        let out = s.schedule().unwrap();
        let parent = only_seq(&s, 1);
        let child = s.fork_sequence(parent, Some(0)).unwrap(); // EOS: it ends at once
        assert_eq!(s.request_seq_ids(1).unwrap(), vec![parent]);
        s.check_invariants().unwrap();
        let done = s.update(out.step_id, &[3]).unwrap();
        let d = &done[..];
        assert_eq!(d.len(), 1);
        assert_eq!((d[0].seq_id, d[0].reason, d[0].request_finished), (child, FinishReason::Stop, false));
        assert_eq!(s.num_free_blocks(), 13);
        s.check_invariants().unwrap();
    }

    #[test]
    fn a_fork_is_refused_while_waiting_before_the_samples_exist_and_past_max_num_seqs() {
        let mut c = cfg(32, 4, 16);
        c.max_num_seqs = 3;
        let mut s = with_requests(c, [NewRequest { n: 2, ..req(1, 4, 5) }, req(2, 4, 5), req(3, 4, 5)]);
        let o = s.schedule().unwrap(); // requests 1 (two samples) and 2 fill the batch
        let not_running = s.fork_sequence(only_seq(&s, 3), None);
        assert!(matches!(not_running, Err(CoreError::InvalidState { message }) if message.contains("not running")));
        let unborn = s.fork_sequence(only_seq(&s, 1), Some(1));
        assert!(matches!(unborn, Err(CoreError::InvalidState { message }) if message.contains("samples do not exist yet")));
        s.update(o.step_id, &[1, 1, 1]).unwrap();
        let full = s.fork_sequence(only_seq(&s, 2), None);
        assert!(matches!(full, Err(CoreError::InvalidArgument { field: "seq_id", reason, .. }) if reason.contains("max_num_seqs=3")));
        assert_eq!((s.num_running_seqs(), s.request_seq_ids(2).unwrap().len()), (3, 1));
        s.check_invariants().unwrap();
    }

    #[test]
    fn reserved_sequence_slots_let_beams_fork_in_a_full_batch() {
        let mut c = cfg(64, 4, 16);
        c.max_num_seqs = 4;
        let mut s = with_requests(c, [NewRequest { reserve_seqs: 3, ..req(1, 3, 10) }, req(2, 3, 10)]);
        let out = s.schedule().unwrap();
        assert_eq!(s.num_running_seqs(), 4, "a beam of width 3 and one more");
        let parent = only_seq(&s, 1);
        s.fork_sequence(parent, Some(5)).unwrap();
        s.fork_sequence(parent, Some(6)).unwrap(); // within the reservation
        let over = s.fork_sequence(parent, Some(7));
        assert!(matches!(over, Err(CoreError::InvalidArgument { reason, .. }) if reason.contains("max_num_seqs")));
        s.update(out.step_id, &vec![1; out.num_rows()]).unwrap();
        assert_eq!((s.num_running_seqs(), s.request_seq_ids(1).unwrap().len()), (4, 3));
        s.check_invariants().unwrap();
    }

    /// A request that ends mid-step keeps its row (dead) until `update`, so that the step's
    /// arrays stay valid: a fork after it must not need a row past `max_num_seqs`. Found by
    /// the KV model test (it panicked in `Batch::push`).
    #[test]
    fn a_fork_mid_step_after_an_abort_mid_step_never_needs_a_row_past_max_num_seqs() {
        let c = SchedulerConfig { max_num_seqs: 2, ..cfg(32, 4, 16) };
        let mut s = with_requests(c, [req(1, 3, 8), req(2, 3, 8)]);
        step(&mut s, 5);
        let seq = only_seq(&s, 2);
        let o = s.schedule().unwrap();
        s.abort(1).unwrap(); // its row stays in place, dead, while the step is in flight
        match s.fork_sequence(seq, Some(9)) {
            Ok(_) | Err(CoreError::InvalidState { .. }) => {}
            Err(e) => panic!("{e}"),
        }
        s.check_invariants().unwrap();
        s.update(o.step_id, &[5, 5]).unwrap();
        s.check_invariants().unwrap();
        drain(&mut s, 5);
        assert_eq!(s.num_free_blocks(), 31);
    }

    /// The same with the rows an `n > 1` prompt fans out at `update`: they were counted at
    /// admission, and a fork into the slot an abort freed mid-step must leave room for them.
    #[test]
    fn a_fork_mid_step_after_an_abort_leaves_rows_for_the_samples_that_fan_out_at_update() {
        let c = SchedulerConfig { max_num_seqs: 4, ..cfg(32, 4, 16) };
        let mut s = with_requests(c, [req(2, 3, 8), req(3, 3, 8)]);
        step(&mut s, 5);
        s.add_request(NewRequest { n: 2, ..req(1, 3, 8) }).unwrap();
        let o = s.schedule().unwrap(); // two decodes and request 1's prompt: 3 rows, 4 slots
        assert_eq!((o.num_rows(), s.num_running_seqs()), (4, 4));
        s.abort(2).unwrap();
        match s.fork_sequence(only_seq(&s, 3), Some(9)) {
            Ok(_) | Err(CoreError::InvalidState { .. }) => {}
            Err(e) => panic!("{e}"),
        }
        s.check_invariants().unwrap();
        s.update(o.step_id, &[5, 5, 5, 5]).unwrap(); // request 1's second sample forks now
        s.check_invariants().unwrap();
        assert_eq!(s.request_seq_ids(1).unwrap().len(), 2);
        drain(&mut s, 5);
        assert_eq!(s.num_free_blocks(), 31);
    }

    #[test]
    fn a_sequence_forks_only_once_its_prompt_is_computed() {
        // A prompt of 8 in chunks of 2 (budget 2): mid-prefill, a fork would give the two their
        // own prompt blocks (nshare8). Once the last prompt token is in flight, it forks.
        let c = SchedulerConfig { enable_prefix_caching: false, max_num_seqs: 2, ..cfg(16, 4, 2) };
        let mut s = with_requests(c, [NewRequest { reserve_seqs: 2, ..req(1, 8, 4) }]);
        step(&mut s, 5);
        let e = s.fork_sequence(only_seq(&s, 1), None).unwrap_err();
        let said = matches!(&e, CoreError::InvalidState { message } if message.contains("not computed yet (2 of 8 tokens)"));
        assert!(said, "{e}");
        for _ in 0..2 {
            step(&mut s, 5);
        }
        let o = s.schedule().unwrap(); // the last chunk samples
        let child = s.fork_sequence(only_seq(&s, 1), Some(9)).unwrap();
        s.update(o.step_id, &vec![5; o.num_rows()]).unwrap();
        s.check_invariants().unwrap();
        assert_eq!(s.seq_tokens(child).unwrap().last(), Some(&9));
        let done = drain(&mut s, 5);
        assert!(done.len() == 2 && done.iter().all(|d| d.reason == FinishReason::Length));
        assert_eq!(s.num_free_blocks(), 15);
    }
}
