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
    /// Sum of prompt lengths of added requests.
    pub prompt_tokens: u64,
    /// Prompt positions computed, recomputation included.
    pub prompt_tokens_computed: u64,
    /// Output positions computed again after a recompute preemption.
    pub output_tokens_recomputed: u64,
    /// Prompt positions served from the prefix cache, over all admissions.
    pub cached_prompt_tokens: u64,
    /// Prompt positions served from the prefix cache at each request's first admission.
    pub first_admission_cached_tokens: u64,
    pub decode_tokens: u64,
    pub generated_tokens: u64,
    pub max_running_seqs: u64,
    pub max_step_tokens: u64,
}

#[derive(Debug, Clone, Copy)]
pub struct KvUsage {
    pub num_blocks: usize,
    pub num_free_blocks: usize,
    pub num_used_blocks: usize,
    pub num_cached_blocks: usize,
    /// Blocks referenced by more than one block table.
    pub num_shared_blocks: usize,
    /// Sum over block tables of their lengths (what the blocks would be without sharing).
    pub num_block_refs: usize,
    /// Token slots holding computed KV in used blocks (shared blocks counted once).
    pub num_used_token_slots: usize,
    pub block_size: usize,
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
        let free = self.kv.num_free_blocks();
        let used = self.kv.num_usable_blocks() - free;
        KvUsage {
            num_blocks: self.cfg.num_blocks,
            num_free_blocks: free,
            num_used_blocks: used,
            num_cached_blocks: self.kv.num_cached_blocks(),
            num_shared_blocks: (1..self.cfg.num_blocks).filter(|&b| self.kv.ref_count(BlockId(b as u32)) > 1).count(),
            num_block_refs: refs,
            num_used_token_slots: slots,
            block_size: bs,
        }
    }

}
