//! Counters and read-only queries: what the scheduler did (`SchedulerStats`), what the KV
//! memory holds (`KvUsage`), and a live request's or sequence's state.
//!
//! Invariants: queries never change state, and see a running sequence as it is (its row's
//! staged tokens and blocks included). Costs: counters are O(1); `kv_usage` is O(blocks held).

use super::Scheduler;
use crate::block_pool::BlockId;
use crate::batch::NO_ROW;
use crate::error::{CoreError, CoreResult};
use crate::kv_cache_manager::BlockIds;
use crate::request::Sequence;

#[derive(Debug, Default, Clone, Copy)]
pub struct SchedulerStats {
    pub steps: u64,
    pub requests_added: u64,
    pub requests_finished: u64,
    pub requests_aborted: u64,
    /// Requests ended because they could not fit even alone (only beam forks can cause it).
    pub capacity_aborts: u64,
    pub preemptions: u64,
    pub swap_preemptions: u64,
    pub recompute_preemptions: u64,
    /// Sum of prompt lengths of the requests admitted, counted at their first admission (a
    /// request aborted while it waited counts none, as in vLLM's prompt-token counter).
    pub prompt_tokens: u64,
    /// Prompt positions computed, recomputation included.
    pub prompt_tokens_computed: u64,
    /// Output positions computed again after a recompute preemption.
    pub output_tokens_recomputed: u64,
    /// Prompt positions served from the prefix cache, over all admissions.
    pub cached_prompt_tokens: u64,
    /// Prompt positions served from the prefix cache at each request's first admission.
    pub first_admission_cached_tokens: u64,
    /// Prompt positions looked up in the prefix cache at each request's first admission: those
    /// of `prompt_tokens` with caching on, the requests that skip cache hits aside (vLLM's
    /// prefix-cache queries, the base of `first_admission_cached_tokens`).
    pub prefix_cache_queried_tokens: u64,
    pub decode_tokens: u64,
    pub generated_tokens: u64,
    pub max_running_seqs: u64,
    pub max_step_tokens: u64,
    /// Steps undone by `cancel_step` (their computed work is not counted above).
    pub cancelled_steps: u64,
    /// Steps that scheduled work, by the tokens they scheduled: `step_tokens_hist[i]` counts
    /// those with at most `STEP_TOKEN_BOUNDS[i]` (and more than the bound before); the last
    /// entry counts the rest (vLLM's `iteration_tokens_total` histogram).
    pub step_tokens_hist: [u64; STEP_TOKEN_BOUNDS.len() + 1],
    /// Tokens scheduled over those steps (the histogram's sum).
    pub step_tokens_sum: u64,
}

/// vLLM's `iteration_tokens_total` bucket bounds.
pub const STEP_TOKEN_BOUNDS: [u64; 13] = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384];

impl SchedulerStats {
    /// Counts a step that scheduled `tokens` (> 0) tokens.
    pub(super) fn observe_step_tokens(&mut self, tokens: u64) {
        let bucket = STEP_TOKEN_BOUNDS.partition_point(|&b| b < tokens);
        self.step_tokens_hist[bucket] += 1;
        self.step_tokens_sum += tokens;
    }
}

/// The KV cache's block counts that cost O(1) (`KvUsage` adds those that cost O(blocks)).
#[derive(Debug, Clone, Copy)]
pub struct KvCounts {
    pub num_blocks: usize,
    pub num_free_blocks: usize,
    pub num_used_blocks: usize,
    pub num_cached_blocks: usize,
    pub block_size: usize,
}

/// The KV cache's usage: its O(1) block counts and the counts that cost O(blocks).
#[derive(Debug, Clone, Copy)]
pub struct KvUsage {
    pub counts: KvCounts,
    /// Blocks referenced by more than one block table.
    pub num_shared_blocks: usize,
    /// Sum over block tables of their lengths (what the blocks would be without sharing).
    pub num_block_refs: usize,
    /// Token slots holding computed KV in used blocks (shared blocks counted once).
    pub num_used_token_slots: usize,
}

impl Scheduler {
    pub fn request_seq_ids(&self, request_id: u64) -> CoreResult<Vec<u64>> {
        let slot = *self.by_id.get(&request_id).ok_or(CoreError::UnknownRequest { request_id })?;
        Ok(self.req(slot).seqs.iter().map(|s| s.seq_id).collect())
    }

    pub fn num_cached_tokens(&self, request_id: u64) -> CoreResult<usize> {
        let slot = *self.by_id.get(&request_id).ok_or(CoreError::UnknownRequest { request_id })?;
        Ok(self.req(slot).num_cached_tokens.unwrap_or(0))
    }

    pub fn seq_block_table(&self, seq_id: u64) -> CoreResult<Vec<u32>> {
        let (slot, pos) = self.locate_seq(seq_id)?;
        Ok(self.seq_blocks(&self.req(slot).seqs[pos]).into_iter().map(|b| b.0).collect())
    }

    /// A sequence's GPU blocks: its row's table while it runs, none otherwise.
    pub(super) fn seq_blocks(&self, s: &Sequence) -> Vec<BlockId> {
        if s.row == NO_ROW {
            Vec::new()
        } else {
            self.batch.ids(s.row as usize).to_vec()
        }
    }

    /// A live sequence's tokens (prompt and output so far).
    pub fn seq_tokens(&self, seq_id: u64) -> CoreResult<Vec<u32>> {
        let (slot, pos) = self.locate_seq(seq_id)?;
        let s = &self.req(slot).seqs[pos];
        let mut tokens = s.tokens.clone();
        if s.row != NO_ROW {
            tokens.extend_from_slice(self.batch.pending(s.row as usize));
        }
        Ok(tokens)
    }

    /// The clock reading of the last `schedule`, `update`, `cancel_step` or `abort` (after
    /// `update`: the time its tokens were appended).
    pub fn clock_ts(&self) -> f64 {
        self.ts
    }

    /// Whether `seq_id` is a live sequence (one hash probe: the text layer asks per row).
    pub fn is_live_seq(&self, seq_id: u64) -> bool {
        self.seq_owner.contains_key(&seq_id)
    }

    /// The request live sequence `seq_id` belongs to.
    pub fn seq_request_id(&self, seq_id: u64) -> Option<u64> {
        self.locate_seq(seq_id).ok().map(|(slot, _)| self.req(slot).request_id)
    }

    /// The tokens sequence `seq_id` has generated so far (its prompt left out): O(output).
    pub fn output_tokens(&self, seq_id: u64) -> CoreResult<Vec<u32>> {
        let (slot, _) = self.locate_seq(seq_id)?;
        let prompt_len = self.req(slot).prompt_len;
        let mut tokens = self.seq_tokens(seq_id)?;
        tokens.drain(..prompt_len.min(tokens.len()));
        Ok(tokens)
    }

    pub fn kv_counts(&self) -> KvCounts {
        let free = self.kv.num_free_blocks();
        KvCounts {
            num_blocks: self.cfg.num_blocks,
            num_free_blocks: free,
            num_used_blocks: self.kv.num_usable_blocks() - free,
            num_cached_blocks: self.kv.num_cached_blocks(),
            block_size: self.cfg.block_size,
        }
    }

    pub fn kv_usage(&self) -> KvUsage {
        let bs = self.cfg.block_size;
        let mut seen = vec![false; self.cfg.num_blocks];
        let (mut refs, mut slots) = (0, 0);
        for &slot in &self.running {
            for s in &self.req(slot).seqs {
                let computed = self.batch.rows[s.row as usize].computed as usize;
                for (i, b) in self.seq_blocks(s).into_iter().enumerate() {
                    refs += 1;
                    if !std::mem::replace(&mut seen[b.0 as usize], true) {
                        slots += computed.saturating_sub(i * bs).min(bs);
                    }
                }
            }
        }
        KvUsage {
            counts: self.kv_counts(),
            num_shared_blocks: (1..self.cfg.num_blocks).filter(|&b| self.kv.ref_count(BlockId(b as u32)) > 1).count(),
            num_block_refs: refs,
            num_used_token_slots: slots,
        }
    }

}

#[cfg(test)]
mod tests {
    use super::super::test_util::*;
    use crate::error::CoreError;

    #[test]
    fn steps_are_counted_by_the_tokens_they_schedule_and_a_cancelled_step_is_not() {
        let mut s = with_requests(cfg(16, 16, 64), [req(1, 6, 10), req(2, 9, 10)]);
        step(&mut s, 1); // the two prompts: 15 tokens, in the (8, 16] bucket
        step(&mut s, 1); // two decodes: (1, 8]
        let out = s.schedule().unwrap(); // two more, then cancelled
        s.cancel_step(out.step_id).unwrap();
        let st = s.stats();
        assert_eq!(st.step_tokens_hist[..4], [0, 1, 1, 0]);
        assert_eq!((st.step_tokens_hist.iter().sum::<u64>(), st.step_tokens_sum), (2, 17));
        let mut one = super::SchedulerStats::default();
        for tokens in [1, 2, 16384, 16385] {
            one.observe_step_tokens(tokens);
        }
        assert_eq!((one.step_tokens_hist[0], one.step_tokens_hist[1], one.step_tokens_hist[12], one.step_tokens_hist[13]), (1, 1, 1, 1));
    }

    #[test]
    fn kv_usage_counts_a_shared_block_once_and_used_slots_by_computed_tokens() {
        let mut s = with_requests(cfg(16, 4, 16), [req(1, 6, 10)]);
        step(&mut s, 1); // 6 computed tokens in blocks 1, 2
        // (used blocks, shared blocks, block refs, used token slots)
        let sharing =
            |u: super::KvUsage| (u.counts.num_used_blocks, u.num_shared_blocks, u.num_block_refs, u.num_used_token_slots);
        let u = s.kv_usage();
        assert_eq!((u.counts.num_blocks, u.counts.block_size, u.counts.num_free_blocks), (16, 4, 13));
        assert_eq!(sharing(u), (2, 0, 2, 6));
        assert_eq!(u.counts.num_cached_blocks, 1, "the full block is registered");
        s.fork_sequence(only_seq(&s, 1), None).unwrap();
        let u = s.kv_usage();
        assert_eq!(sharing(u), (2, 2, 4, 6));
        step(&mut s, 2); // both write position 6: one copies block 2 into block 3
        let u = s.kv_usage();
        assert_eq!(sharing(u), (3, 1, 4, 4 + 3 + 3));
        assert_eq!(u.counts.num_free_blocks, 12);
    }

    #[test]
    fn seq_tokens_include_the_tokens_staged_in_the_row() {
        let mut s = with_requests(cfg(16, 16, 32), [req(1, 3, 10)]);
        for t in 1..=3 {
            step(&mut s, t);
        }
        let seq = only_seq(&s, 1);
        assert_eq!(s.batch.pending(row_of(&s, seq)), [1, 2, 3]);
        assert_eq!(s.seq_tokens(seq).unwrap(), vec![1100, 1101, 1102, 1, 2, 3]);
        s.add_request(req(2, 2, 1)).unwrap();
        assert_eq!(s.seq_tokens(only_seq(&s, 2)).unwrap(), vec![2100, 2101], "a waiting sequence's own tokens");
        assert_eq!(s.seq_tokens(99), Err(CoreError::UnknownSequence { seq_id: 99 }));
    }

    #[test]
    fn seq_block_table_is_the_rows_table_while_running_and_empty_once_preempted() {
        // 6 usable blocks of 2 tokens: the fourth step preempts request 2 for recompute.
        let mut s = with_requests(cfg(7, 2, 16), [req(1, 4, 8), req(2, 4, 8)]);
        let (a, b) = (only_seq(&s, 1), only_seq(&s, 2));
        assert_eq!(s.seq_block_table(a).unwrap(), Vec::<u32>::new(), "waiting: no blocks yet");
        for _ in 0..3 {
            step(&mut s, 1);
        }
        assert_eq!((s.seq_block_table(a).unwrap(), s.seq_block_table(b).unwrap()), (vec![1, 2, 5], vec![3, 4, 6]));
        let (o, _) = step(&mut s, 1);
        assert_eq!(o.preempted_req_ids, vec![2]);
        assert_eq!((s.seq_block_table(a).unwrap(), s.seq_block_table(b).unwrap()), (vec![1, 2, 5, 6], vec![]), "its blocks freed tail first, 6 is reused first");
        assert_eq!(s.seq_block_table(99), Err(CoreError::UnknownSequence { seq_id: 99 }));
    }

    #[test]
    fn request_queries_answer_for_live_requests_only() {
        let mut s = with_requests(cfg(16, 4, 16), [req(1, 3, 1)]);
        assert_eq!(s.num_cached_tokens(1), Ok(0), "not admitted yet");
        assert_eq!(s.request_seq_ids(1).unwrap().len(), 1);
        step(&mut s, 1); // its one token: done
        assert_eq!(s.request_seq_ids(1), Err(CoreError::UnknownRequest { request_id: 1 }));
        assert_eq!(s.num_cached_tokens(1), Err(CoreError::UnknownRequest { request_id: 1 }));
    }
}
