//! Decode planning: one rule for a row's decode token (`decode_block`), applied by the row
//! pass over the batch (the common step, without reaching a request or a sequence) and by the
//! ordered walk (`plan_decode_request`) when the running order matters.
//!
//! Invariants: a row is advanced only if its write lands in a block it owns (decided in one
//! place, `owned_write_block`) or in a fresh block given to the row; a request is planned
//! whole or not at all (its samples step in lockstep); a plan that does not qualify changes
//! nothing but what the rows learned about their tail block. Costs: one pass over the rows (a
//! few loads and stores each, the step's arrays written in the same pass), one block
//! allocation per row entering a new block, and a second pass only in a step that also plans
//! prefill chunks.

use super::admit::Attempt;
use super::{Scheduler, StepCounts};
use crate::batch::{RowState, TableRef};
use crate::block_pool::{BlockId, BlockMath};
use crate::kv_cache_manager::KvCacheManager;
use crate::output::SchedulerOutput;

/// How the row pass planned the step's decodes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum DecodePlan {
    /// Every running sequence (only admission is left).
    All,
    /// Every request whose rows all decode on their own; the ordered walk continues with the
    /// rest, `running[generic_from..]`.
    Front { generic_from: usize },
    /// Nothing: the ordered walk plans the whole step.
    None,
}

/// Plans row `r`'s decode token (its sampled token is logits row `r` unless the output builder
/// numbers it later).
#[inline]
fn advance(h: &mut RowState, r: usize) {
    debug_assert_eq!(h.fan_out, 0, "fan-outs happen at update");
    (h.computed, h.new_tokens, h.samples, h.logits_row) = (h.computed + 1, 1, true, r as u32);
}

/// `decode_block` of a token that starts a new block: it is known once allocated.
const NEW_BLOCK: i32 = -1;

/// The block a decode row writes its next token into, when that token does not start a new
/// block; `None` when another table shares the block (copy it first). Usually it is the row's
/// last block, known unshared, and neither the matrix nor the block pool is read; otherwise
/// the pool answers, and a last block found unshared is recorded as such (`tail_owned`, a
/// fact whether or not the step goes ahead).
fn owned_write_block(h: &mut RowState, table: &TableRef<'_>, r: usize, kv: &KvCacheManager, bm: BlockMath) -> Option<i32> {
    let c = h.computed as usize;
    debug_assert_ne!(bm.offset(c), 0, "a write that starts a block gets a fresh one");
    let in_tail = bm.block(c) + 1 == h.num_blocks as usize;
    if in_tail && h.tail_owned {
        return Some(h.tail_block as i32);
    }
    let blk = if in_tail { h.tail_block as i32 } else { table.block(r, bm.block(c)) };
    if kv.ref_count(BlockId(blk as u32)) != 1 {
        return None;
    }
    h.tail_owned |= in_tail;
    Some(blk)
}

/// The one decode rule: the block row `r`'s next decode token writes (`NEW_BLOCK` when it
/// starts a block, which the caller allocates), or `None` when the row cannot decode on its
/// own (a prefill chunk, the prompt's last token, or a write into a shared block).
#[inline]
fn decode_block(h: &mut RowState, table: &TableRef<'_>, r: usize, kv: &KvCacheManager, bm: BlockMath) -> Option<i32> {
    if !h.is_decode() {
        return None;
    }
    if bm.offset(h.computed as usize) == 0 {
        return Some(NEW_BLOCK);
    }
    owned_write_block(h, table, r, kv, bm)
}

/// The row pass's lists, kept in the scheduler's scratch buffers between steps (no allocation
/// per step once they have grown).
struct RowPass {
    /// Rows whose token starts a new block (to allocate once the plan stands).
    new_block: Vec<u32>,
    /// Rows whose token completes a block (to register).
    completing: Vec<u32>,
    /// Requests left to the ordered walk, each once (marked in `Scheduler::mark` meanwhile).
    others: Vec<u32>,
}

impl RowPass {
    /// Plans row `r`'s decode token into block `blk`, listing the row when that token starts
    /// or completes a block. Returns the token's position.
    #[inline]
    fn plan(&mut self, h: &mut RowState, r: usize, blk: i32, bm: BlockMath) -> usize {
        let c = h.computed as usize;
        if blk == NEW_BLOCK {
            self.new_block.push(r as u32);
        }
        if bm.offset(c + 1) == 0 {
            self.completing.push(r as u32);
        }
        advance(h, r);
        c
    }
}

impl Scheduler {
    /// The row pass: plans one decode token for every row that decodes on its own, and writes
    /// the step's arrays for the leading rows in the same pass (while every row so far is in
    /// the step, sequence i is row i). It stands only where the running order cannot change
    /// the outcome: every such decode fits (budget, free blocks) and the requests it leaves to
    /// the ordered walk are at the back of the running order, where that walk would have left
    /// them anyway. Otherwise it changes nothing and returns `None`. The planned rows whose
    /// token completes a block are left in `completing`, for registration.
    pub(super) fn plan_decode_rows(&mut self, budget: usize) -> DecodePlan {
        self.completing.clear();
        let n = self.batch.len();
        if n == 0 {
            return DecodePlan::None;
        }
        let mut pass = self.take_row_pass();
        let mut o = Self::decode_output(n);
        let (mut emitted, mut max_blocks) = self.emit_leading_decodes(&mut o, &mut pass);
        self.plan_other_decodes(emitted, &mut pass);
        let mut decodes = emitted + self.batch.rows[emitted..].iter().filter(|h| h.new_tokens > 0).count();
        if !pass.others.is_empty() {
            (decodes, emitted) = self.unplan_partial_requests(&mut pass.new_block, decodes, emitted);
            pass.completing.retain(|&r| self.batch.rows[r as usize].new_tokens > 0);
        }
        let k = pass.others.len();
        let len = self.running.len();
        let stands = decodes <= budget
            && self.kv.num_free_blocks() >= pass.new_block.len()
            && pass.others.iter().all(|&slot| self.running_index(slot) >= len - k);
        for &slot in &pass.others {
            self.mark[slot as usize] = false;
        }
        if !stands {
            self.unplan_all_decodes();
            pass.completing.clear();
            self.put_back_row_pass(pass);
            return DecodePlan::None;
        }
        self.append_new_blocks(&pass.new_block);
        self.new_block_slots(&mut o, &pass.new_block, emitted);
        self.put_back_row_pass(pass);
        if emitted > 0 {
            if emitted < n {
                // The pass's maximum may count rows put back since; the tables have their new blocks.
                max_blocks = self.batch.rows[..emitted].iter().map(|h| h.num_blocks).max().unwrap_or(0);
            }
            self.finish_decode_output(&mut o, emitted);
            self.emitted = Some((o, emitted, max_blocks as usize));
        }
        self.step = StepCounts { seqs: decodes, tokens: decodes, logits_rows: decodes, decode_tokens: decodes };
        self.stats.decode_tokens += decodes as u64;
        if k == 0 { DecodePlan::All } else { DecodePlan::Front { generic_from: len - k } }
    }

    /// The row pass's lists, emptied, out of their scratch buffers.
    fn take_row_pass(&mut self) -> RowPass {
        let mut pass = RowPass {
            new_block: std::mem::take(&mut self.scratch_rows),
            completing: std::mem::take(&mut self.completing),
            others: std::mem::take(&mut self.scratch_slots),
        };
        pass.new_block.clear();
        pass.others.clear();
        pass
    }

    /// Returns the row pass's lists to their scratch buffers (`completing` for registration).
    fn put_back_row_pass(&mut self, pass: RowPass) {
        (self.scratch_rows, self.completing, self.scratch_slots) = (pass.new_block, pass.completing, pass.others);
    }

    /// The leading rows while each decodes on its own: planned and written in one pass
    /// (sequence i = row i), through zipped iterators over presized columns. Returns the rows
    /// emitted and the widest of their tables (a block to allocate counted).
    fn emit_leading_decodes(&mut self, o: &mut SchedulerOutput, pass: &mut RowPass) -> (usize, u32) {
        let (kv, bm) = (&self.kv, self.bm);
        let (rows, table, _) = self.batch.rows_and_table();
        let mut max_blocks = 0u32;
        let mut emitted = 0usize;
        let outs = o.seq_lens.iter_mut().zip(o.positions.iter_mut()).zip(o.slot_mapping.iter_mut());
        for (r, (h, ((len, pos), slot))) in rows.iter_mut().zip(outs).enumerate() {
            let Some(blk) = decode_block(h, &table, r, kv, bm) else { break };
            let c = pass.plan(h, r, blk, bm);
            (*len, *pos, *slot) = Self::decode_columns(bm, c, blk); // a new block's slot follows
            max_blocks = max_blocks.max(h.num_blocks + u32::from(blk == NEW_BLOCK));
            emitted = r + 1;
        }
        (emitted, max_blocks)
    }

    /// The rows from `emitted` on (a step that also plans prefill chunks): the same rule, their
    /// columns written later. A row that cannot decode on its own is left to the ordered walk,
    /// and its request is marked and listed in `pass.others`.
    fn plan_other_decodes(&mut self, emitted: usize, pass: &mut RowPass) {
        let (kv, mark, bm) = (&self.kv, &mut self.mark, self.bm);
        let (rows, table, owner) = self.batch.rows_and_table();
        for r in emitted..rows.len() {
            let h = &mut rows[r];
            match decode_block(h, &table, r, kv, bm) {
                Some(blk) => {
                    pass.plan(h, r, blk, bm);
                }
                None => {
                    (h.new_tokens, h.samples, h.fan_out) = (0, false, 0); // left to the ordered walk
                    let req = owner[r].slot as usize;
                    if !std::mem::replace(&mut mark[req], true) {
                        pass.others.push(req as u32);
                    }
                }
            }
        }
    }

    /// A row pass that does not stand: every decode it planned is put back.
    fn unplan_all_decodes(&mut self) {
        for h in self.batch.rows.iter_mut().filter(|h| h.new_tokens > 0) {
            (h.computed, h.new_tokens, h.samples) = (h.computed - 1, 0, false);
        }
    }

    /// After the row pass: a request the pass left to the ordered walk (marked) is planned
    /// there whole, so its rows the pass advanced are put back. Returns the decodes and the
    /// emitted rows left.
    fn unplan_partial_requests(&mut self, new_block_rows: &mut Vec<u32>, mut decodes: usize, mut emitted: usize) -> (usize, usize) {
        let (rows, owner, mark) = (&mut self.batch.rows, &self.batch.owner, &self.mark);
        for (r, h) in rows.iter_mut().enumerate() {
            if h.new_tokens > 0 && mark[owner[r].slot as usize] {
                (h.computed, h.new_tokens, h.samples) = (h.computed - 1, 0, false);
                decodes -= 1;
                emitted = emitted.min(r);
            }
        }
        new_block_rows.retain(|&r| rows[r as usize].new_tokens > 0);
        (decodes, emitted)
    }

    /// Gives each of `rows` (just advanced by one decode token that starts a new block) a
    /// fresh block, through the KV-cache manager (the only writer of block tables).
    fn append_new_blocks(&mut self, rows: &[u32]) {
        for &r in rows {
            let r = r as usize;
            debug_assert_eq!(
                self.batch.rows[r].num_blocks as usize,
                self.bm.block(self.batch.rows[r].computed as usize - 1),
                "the write starts a new block"
            );
            self.kv.append_block(&mut self.batch.ids_mut(r));
        }
    }

    /// The ordered walk's decode: one token for every sequence of request `slot` when all its
    /// rows decode on their own (`decode_block`, the row pass's rule), with the same answers as
    /// the chunk planner (`try_schedule`) would give; `None` when one of them needs that planner.
    pub(super) fn plan_decode_request(&mut self, slot: u32, budget: usize) -> Option<Attempt> {
        let bm = self.bm;
        let req = self.requests[slot as usize].as_ref().expect("live slot");
        let mut new_blocks = 0;
        {
            let (rows, table, _) = self.batch.rows_and_table();
            for s in &req.seqs {
                let r = s.row as usize;
                new_blocks += usize::from(decode_block(&mut rows[r], &table, r, &self.kv, bm)? == NEW_BLOCK);
            }
        }
        if budget < req.seqs.len() {
            return Some(Attempt::NoBudget);
        }
        if self.kv.num_free_blocks() < new_blocks {
            return Some(Attempt::NoSpace);
        }
        self.plan.clear();
        for s in &req.seqs {
            let r = s.row as usize;
            let c = self.batch.rows[r].computed as usize;
            self.plan.push((c, 1));
            self.batch.rows[r].computed += 1;
            if bm.offset(c) == 0 {
                self.kv.append_block(&mut self.batch.ids_mut(r));
            }
        }
        Some(Attempt::Scheduled { tokens: req.seqs.len(), full: true })
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_util::*;
    use super::super::*;
    use crate::output::BlockTables;

    #[test]
    fn decode_goes_first_and_prefill_fills_the_rest_of_the_budget() {
        let mut s = Scheduler::new(cfg(32, 4, 6)).unwrap();
        s.add_request(req(1, 3, 10)).unwrap();
        step(&mut s, 5);
        s.add_request(req(2, 9, 10)).unwrap();
        let (o, _) = step(&mut s, 5);
        assert_eq!(o.req_ids, vec![1, 2]);
        assert_eq!(o.query_start_loc, vec![0, 1, 6]); // 1 decode + 5 prefill tokens
        assert_eq!(o.num_prefill_tokens, 5);
        assert_eq!(o.logits_indices, vec![0]);
    }

    #[test]
    fn decodes_are_planned_row_wise_and_the_prefill_at_the_back_continues() {
        let mut s = Scheduler::new(cfg(64, 4, 8)).unwrap();
        s.add_request(req(1, 3, 10)).unwrap();
        s.add_request(req(2, 3, 10)).unwrap();
        step(&mut s, 5);
        s.add_request(req(3, 20, 4)).unwrap();
        let (o, _) = step(&mut s, 5); // 2 decodes + the first 6 tokens of request 3
        assert_eq!((o.num_decode_tokens, o.num_prefill_tokens), (2, 6));
        // Request 3 is running mid-prefill, at the back of the running order: the two decodes
        // are planned over the rows, request 3 gets the rest of the budget.
        let (o, _) = step(&mut s, 5);
        assert_eq!(o.req_ids, vec![1, 2, 3]);
        assert_eq!(o.query_start_loc, vec![0, 1, 2, 8]);
        assert_eq!(o.positions[2..], (6..12).collect::<Vec<i64>>()[..]);
        assert_eq!(o.logits_indices, vec![0, 1]); // request 3 is not done: no row
        assert_eq!((o.num_decode_tokens, o.num_prefill_tokens), (2, 6));
        let (o, _) = step(&mut s, 5);
        assert_eq!(o.query_start_loc, vec![0, 1, 2, 8]);
        let (o, _) = step(&mut s, 5); // the last 2 prompt tokens, then request 3 samples
        assert_eq!(o.query_start_loc, vec![0, 1, 2, 4]);
        assert_eq!(o.logits_indices, vec![0, 1, 3]);
        assert_eq!(s.stats().prompt_tokens_computed, 26);
    }

    #[test]
    fn a_decode_block_is_written_into_the_row_that_the_runner_reads() {
        let mut s = Scheduler::new(cfg(16, 4, 16)).unwrap();
        s.add_request(req(1, 4, 12)).unwrap();
        step(&mut s, 1); // prefill: block 1 full
        let seq = s.request_seq_ids(1).unwrap()[0];
        // Position 4 starts block 2: the step's own view of the batch matrix has it already.
        let o = s.schedule().unwrap();
        assert!(matches!(o.block_tables, BlockTables::Batch));
        assert_eq!((s.block_tables(&o).unwrap(), o.slot_mapping.clone()), (vec![1, 2], vec![8]));
        s.update(o.step_id, &[2]).unwrap();
        assert_eq!(s.seq_block_table(seq).unwrap(), vec![1, 2]);
        assert_eq!(s.kv_usage().num_block_refs, 2);
        for t in 3..=6 {
            step(&mut s, t); // position 8 (the last step) starts block 3
        }
        let child = s.fork_sequence(seq, None).unwrap();
        assert_eq!(s.seq_block_table(child).unwrap(), vec![1, 2, 3]);
        s.check_invariants().unwrap();
        s.abort(1).unwrap();
        assert_eq!(s.num_free_blocks(), 15);
    }
}
