//! Decode planning over the batch rows: the common step, where running sequences each decode
//! one token, planned row by row without reaching a request or a sequence.
//!
//! Invariants: a row is advanced only if its write lands in a block it owns (decided in one
//! place, `owned_write_block`) or in a fresh block handed to the row; a plan that does not
//! qualify changes nothing. Costs: one pass over the rows (a few loads and stores each), plus
//! one block allocation per row entering a new block.

use super::{Scheduler, StepCounts};
use crate::batch::{RowState, TableRef};
use crate::block_pool::{BlockId, BlockMath};
use crate::kv_cache_manager::KvCacheManager;

/// How `plan_decode_rows` planned the step's decodes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum DecodePlan {
    /// Every running sequence, and the step's arrays emitted.
    All,
    /// Every all-decode request; the per-request walk continues at `running[generic_from..]`.
    Front { generic_from: usize },
    /// Nothing: the per-request walk plans the whole step.
    None,
}

/// The block a decode row writes its next token into, when that token does not start a new
/// block; `None` when another table shares the block (copy it first). Usually it is the row's
/// last block, known unshared, and neither the matrix nor the block pool is read; otherwise
/// the pool answers, and a last block found unshared is recorded as such (`tail_owned`, a
/// fact whether or not the step goes ahead).
pub(super) fn owned_write_block(h: &mut RowState, table: &TableRef<'_>, r: usize, kv: &KvCacheManager, bm: BlockMath) -> Option<i32> {
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

impl Scheduler {
    /// The common steps, planned row by row over the batch without looking at a request:
    ///
    /// - `All`: every running sequence decodes one token and all of them fit (budget, free
    ///   blocks, no shared block written). The running requests' order cannot matter then, and
    ///   the step's arrays are emitted in the same pass.
    /// - `Front`: the same for every request whose rows are all single-token decodes, when the
    ///   other running requests (prefill chunks, usually just admitted) are all at the back of
    ///   the running order. The per-request walk would have served the decodes first anyway, so
    ///   it only runs over those requests; any preemption victim is one of them.
    ///
    /// Neither reaches a sequence: a decode entering a new block gets it in its row
    /// (`append_new_blocks`). `None` changes nothing: the per-request walk plans the whole step.
    pub(super) fn plan_decode_rows(&mut self, budget: usize) -> DecodePlan {
        if self.batch.is_empty() {
            return DecodePlan::None;
        }
        if self.plan_all(budget) {
            return DecodePlan::All;
        }
        let bm = self.bm;
        let mut new_block_rows = std::mem::take(&mut self.scratch_rows);
        new_block_rows.clear();
        let mut others = std::mem::take(&mut self.scratch_slots);
        others.clear();
        let mut cow = false;
        {
            let (kv, mark) = (&self.kv, &mut self.mark);
            let (rows, table, owner) = self.batch.rows_and_table();
            for (r, h) in rows.iter_mut().enumerate() {
                if !h.is_decode() {
                    // A prefill chunk, or the prompt's last token: its request goes the long way.
                    let slot = owner[r].slot as usize;
                    if !std::mem::replace(&mut mark[slot], true) {
                        others.push(slot as u32);
                    }
                    continue;
                }
                if bm.offset(h.computed as usize) == 0 {
                    new_block_rows.push(r as u32);
                } else if owned_write_block(h, &table, r, kv, bm).is_none() {
                    cow = true; // copy-on-write: left to the per-request walk
                    break;
                }
            }
        }
        // Every row a decode (`plan_all` declined for budget, blocks or copy-on-write): the
        // per-request walk decides.
        let plan = if cow || others.is_empty() { DecodePlan::None } else { self.front_plan(&others, &mut new_block_rows, budget) };
        for &slot in &others {
            self.mark[slot as usize] = false;
        }
        self.scratch_slots = others;
        self.scratch_rows = new_block_rows;
        plan
    }

    /// The `All` plan in one pass over the rows: each row is checked, advanced and emitted
    /// together (the common step pays for one walk, not a check walk and a plan walk). If a
    /// row turns out not to qualify, the rows already advanced are restored and it returns
    /// false, changing nothing.
    pub(super) fn plan_all(&mut self, budget: usize) -> bool {
        let n = self.batch.len();
        if n > budget {
            return false;
        }
        let bm = self.bm;
        let mut new_block_rows = std::mem::take(&mut self.scratch_rows);
        new_block_rows.clear();
        // Row r is sequence, token and logits row r. Admissions of this step append after
        // these rows (`build_output` continues from here).
        let mut o = Self::empty_output(n + 16, n + 16, n + 16);
        // Sized first, then written through zipped iterators: no per-element capacity check.
        o.seq_lens.resize(n, 0);
        o.positions.resize(n, 0);
        o.slot_mapping.resize(n, 0);
        let mut max_blocks = 0;
        let mut declined_at = None;
        {
            let kv = &self.kv;
            let (rows, table, _) = self.batch.rows_and_table();
            let outs = o.seq_lens.iter_mut().zip(o.positions.iter_mut()).zip(o.slot_mapping.iter_mut());
            for (r, (h, ((len, pos), slot))) in rows.iter_mut().zip(outs).enumerate() {
                if !h.is_decode() {
                    declined_at = Some(r); // a prefill chunk, or the prompt's last token
                    break;
                }
                let c = h.computed as usize;
                let starts_block = bm.offset(c) == 0;
                if starts_block {
                    // Its slot is known once the block is allocated below.
                    new_block_rows.push(r as u32);
                    *slot = -1;
                } else {
                    let Some(blk) = owned_write_block(h, &table, r, kv, bm) else {
                        declined_at = Some(r); // copy-on-write
                        break;
                    };
                    *slot = bm.slot(blk, c);
                }
                debug_assert_eq!(h.fan_out, 0, "fan-outs happen at update");
                h.computed += 1;
                h.new_tokens = 1;
                h.samples = true;
                h.logits_row = r as u32;
                *len = c as i32 + 1;
                *pos = c as i64;
                max_blocks = max_blocks.max(h.num_blocks + u32::from(starts_block));
            }
        }
        if declined_at.is_none() && self.kv.num_free_blocks() < new_block_rows.len() {
            declined_at = Some(n);
        }
        if let Some(k) = declined_at {
            for h in &mut self.batch.rows[..k] {
                h.computed -= 1;
                h.new_tokens = 0;
                h.samples = false;
            }
            self.scratch_rows = new_block_rows;
            return false;
        }
        let b = &self.batch;
        o.req_ids.extend_from_slice(&b.req_id);
        o.seq_ids.extend_from_slice(&b.seq_id);
        o.input_ids.extend_from_slice(&b.last_token);
        o.row_req_ids.extend_from_slice(&b.req_id);
        o.row_seq_ids.extend_from_slice(&b.seq_id);
        o.row_sample_index.extend_from_slice(&b.sample_index);
        o.query_start_loc.extend(1..=n as i32);
        o.logits_indices.extend(0..n as i64);
        self.append_new_blocks(&new_block_rows);
        for &r in &new_block_rows {
            let h = &self.batch.rows[r as usize];
            o.slot_mapping[r as usize] = bm.slot(h.tail_block as i32, h.computed as usize - 1);
        }
        self.scratch_rows = new_block_rows;
        self.emitted = Some((o, n, max_blocks as usize));
        self.step = StepCounts { seqs: n, tokens: n, logits_rows: n, decode_tokens: n };
        self.stats.decode_tokens += n as u64;
        true
    }

    /// Gives each of `rows` (just advanced by one decode token that starts a new block) a fresh
    /// block, in the row only: the sequence's table adopts it at the next `flush_row` (the
    /// step that completes the block flushes the row to register it), so planning a decode
    /// step never reaches the sequences.
    pub(super) fn append_new_blocks(&mut self, rows: &[u32]) {
        for &r in rows {
            let r = r as usize;
            debug_assert_eq!(
                self.batch.rows[r].num_blocks as usize,
                self.bm.block(self.batch.rows[r].computed as usize - 1),
                "the write starts a new block"
            );
            let b = self.kv.allocate_block();
            self.batch.push_block(r, b.0);
        }
    }

    /// `Front` planning (see `plan_decode_rows`): `others` are the marked requests that are not
    /// all-decode; `new_block_rows` the decode rows entering a new block (some of them may be
    /// rows of marked requests).
    pub(super) fn front_plan(&mut self, others: &[u32], new_block_rows: &mut Vec<u32>, budget: usize) -> DecodePlan {
        let len = self.running.len();
        let k = others.len();
        for &slot in others {
            if self.running_index(slot) < len - k {
                return DecodePlan::None; // one of them would be served before some decodes
            }
        }
        let b = &self.batch;
        let mark = &self.mark;
        new_block_rows.retain(|&r| !mark[b.owner[r as usize].slot as usize]);
        let decodes = b.rows.iter().zip(&b.owner).filter(|(h, o)| h.is_decode() && !mark[o.slot as usize]).count();
        if decodes > budget || self.kv.num_free_blocks() < new_block_rows.len() {
            return DecodePlan::None;
        }
        self.batch.clear_plan();
        let b = &mut self.batch;
        for (h, o) in b.rows.iter_mut().zip(&b.owner) {
            if h.is_decode() && !mark[o.slot as usize] {
                debug_assert_eq!(h.fan_out, 0, "fan-outs happen at update");
                h.computed += 1;
                h.new_tokens = 1;
                h.samples = true;
            }
        }
        self.append_new_blocks(new_block_rows);
        self.step = StepCounts { seqs: decodes, tokens: decodes, logits_rows: decodes, decode_tokens: decodes };
        self.stats.decode_tokens += decodes as u64;
        DecodePlan::Front { generic_from: len - k }
    }

}

#[cfg(test)]
mod tests {
    use super::super::test_util::*;
    use super::super::*;

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
    fn a_decode_block_lives_in_the_row_until_the_sequence_is_read() {
        let mut s = Scheduler::new(cfg(16, 4, 16)).unwrap();
        s.add_request(req(1, 4, 12)).unwrap();
        step(&mut s, 1); // prefill: block 1 full
        let seq = s.request_seq_ids(1).unwrap()[0];
        let table_len = |s: &Scheduler| s.req(s.seq_owner[&seq]).seqs[0].table.len();
        step(&mut s, 2); // position 4 starts block 2, given to the row only
        assert_eq!((table_len(&s), s.seq_block_table(seq).unwrap()), (1, vec![1, 2]));
        assert_eq!(s.kv_usage().num_block_refs, 2);
        step(&mut s, 3);
        step(&mut s, 4);
        step(&mut s, 5); // position 7 completes block 2: registering it brings the table up to date
        assert_eq!(table_len(&s), 2);
        step(&mut s, 6); // block 3, in the row only again; a fork reads the table
        assert_eq!(table_len(&s), 2);
        let child = s.fork_sequence(seq, None).unwrap();
        assert_eq!(s.seq_block_table(child).unwrap(), vec![1, 2, 3]);
        assert_eq!(table_len(&s), 3);
        s.check_invariants().unwrap();
        s.abort(1).unwrap();
        assert_eq!(s.num_free_blocks(), 15);
    }
}
