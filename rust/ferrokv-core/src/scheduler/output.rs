//! The step output: flattens the planned rows, in row order, into the arrays the runner reads
//! (ids, positions, slot mappings, block tables, sampling rows, block ops).
//!
//! Invariants: sequence i of the output is the i-th planned row; when every row is planned the
//! block tables are the batch matrix itself, valid until `update` (`check_batch_view`).
//! Costs: O(tokens + sampling rows) per step; O(S * M) only when block tables are gathered.

use super::{Scheduler, StepCounts};
use crate::block_pool::BlockMath;
use crate::error::{CoreError, CoreResult};
use crate::output::{BlockTables, SchedulerOutput};

impl Scheduler {
    /// Output buffers with room for a step, `query_start_loc` started.
    pub(super) fn empty_output(seqs: usize, tokens: usize, rows: usize) -> SchedulerOutput {
        let mut o = SchedulerOutput {
            req_ids: Vec::with_capacity(seqs),
            seq_ids: Vec::with_capacity(seqs),
            query_start_loc: Vec::with_capacity(seqs + 1),
            seq_lens: Vec::with_capacity(seqs),
            input_ids: Vec::with_capacity(tokens),
            positions: Vec::with_capacity(tokens),
            slot_mapping: Vec::with_capacity(tokens),
            logits_indices: Vec::with_capacity(rows),
            row_req_ids: Vec::with_capacity(rows),
            row_seq_ids: Vec::with_capacity(rows),
            row_sample_index: Vec::with_capacity(rows),
            ..Default::default()
        };
        o.query_start_loc.push(0);
        o
    }

    /// Buffers for a step whose first rows are emitted by the decode row pass: per-row columns
    /// sized for all `n` rows (the pass writes row r at index r), room for admissions after.
    pub(super) fn decode_output(n: usize) -> SchedulerOutput {
        let mut o = Self::empty_output(n + 16, n + 16, n + 16);
        o.seq_lens.resize(n, 0);
        o.positions.resize(n, 0);
        o.slot_mapping.resize(n, 0);
        o
    }

    /// A decode row's columns of the step output: context length, position and the KV slot of
    /// its token at position `c` in block `blk`. A negative `blk` is a block not allocated yet:
    /// its slot is a placeholder that `new_block_slots` overwrites once it is.
    #[inline]
    pub(super) fn decode_columns(bm: BlockMath, c: usize, blk: i32) -> (i32, i64, i64) {
        (c as i32 + 1, c as i64, bm.slot(blk.max(0), c))
    }

    /// The slots of the emitted decode rows (`< emitted`) whose token started a new block, now
    /// that the block is the row's last.
    pub(super) fn new_block_slots(&self, o: &mut SchedulerOutput, rows: &[u32], emitted: usize) {
        for &r in rows.iter().filter(|&&r| (r as usize) < emitted) {
            let h = &self.batch.rows[r as usize];
            o.slot_mapping[r as usize] = self.bm.slot(h.tail_block as i32, h.computed as usize - 1);
        }
    }

    /// Completes the decode rows `0..k` the row pass wrote (one token and one logits row each,
    /// sequence i = row i = token i): the columns copied in bulk from the batch.
    pub(super) fn finish_decode_output(&self, o: &mut SchedulerOutput, k: usize) {
        let b = &self.batch;
        o.seq_lens.truncate(k);
        o.positions.truncate(k);
        o.slot_mapping.truncate(k);
        o.req_ids.extend_from_slice(&b.req_id[..k]);
        o.seq_ids.extend_from_slice(&b.seq_id[..k]);
        o.input_ids.extend_from_slice(&b.last_token[..k]);
        o.row_req_ids.extend_from_slice(&b.req_id[..k]);
        o.row_seq_ids.extend_from_slice(&b.seq_id[..k]);
        o.row_sample_index.extend_from_slice(&b.sample_index[..k]);
        o.query_start_loc.extend(1..=k as i32);
        o.logits_indices.extend(0..k as i64);
    }

    /// Flattens the planned rows, in row order, into the step's arrays. When every row is in
    /// the step, the block tables are the batch matrix itself (no copy); otherwise the planned
    /// rows are gathered.
    pub(super) fn build_output(&mut self, preempted: Vec<i64>) -> SchedulerOutput {
        let bs = self.cfg.block_size;
        let StepCounts { seqs: s_count, tokens: t_count, logits_rows: r_count, decode_tokens } = self.step;
        let n = self.batch.len();
        // The decode row pass emitted the leading rows; the others follow in row order.
        let (mut o, start, mut max_blocks) = match self.emitted.take() {
            Some(e) => e,
            None => (Self::empty_output(s_count, t_count, r_count), 0, 0),
        };
        o.step_id = self.step_id;
        o.block_size = bs;
        o.finished_req_ids = std::mem::take(&mut self.ended_ids);
        o.preempted_req_ids = std::mem::take(&mut self.pending_preempted);
        o.preempted_req_ids.extend(preempted);
        o.num_decode_tokens = decode_tokens;
        o.num_prefill_tokens = t_count - decode_tokens;
        // A decode prefix was sized for its rows: room for the rest of the step, once.
        let (seqs, tokens, rows) = (o.seq_ids.len(), o.input_ids.len(), o.logits_indices.len());
        if s_count > seqs {
            for v in [&mut o.req_ids, &mut o.seq_ids] {
                v.reserve(s_count - seqs);
            }
            o.seq_lens.reserve(s_count - seqs);
            o.query_start_loc.reserve(s_count - seqs);
            for v in [&mut o.input_ids, &mut o.positions, &mut o.slot_mapping] {
                v.reserve(t_count - tokens);
            }
            for v in [&mut o.logits_indices, &mut o.row_req_ids, &mut o.row_seq_ids] {
                v.reserve(r_count - rows);
            }
            o.row_sample_index.reserve(r_count - rows);
        }
        let b = &mut self.batch;
        let bm = self.bm;
        let mut num_tokens = o.input_ids.len();
        for r in start..n {
            let k = b.rows[r].new_tokens as usize;
            if k == 0 {
                continue;
            }
            let after = b.rows[r].computed as usize;
            let before = after - k;
            o.req_ids.push(b.req_id[r]);
            o.seq_ids.push(b.seq_id[r]);
            o.seq_lens.push(after as i32);
            if before + 1 == b.rows[r].num_tokens as usize {
                o.input_ids.push(b.last_token[r]);
            } else {
                let s = Self::seq_of(&mut self.requests, b.owner[r]);
                o.input_ids.extend(s.tokens[before..after].iter().map(|&t| t as i64));
            }
            for p in before..after {
                o.positions.push(p as i64);
                o.slot_mapping.push(bm.slot(b.block(r, bm.block(p)), p));
            }
            num_tokens += k;
            o.query_start_loc.push(num_tokens as i32);
            max_blocks = max_blocks.max(b.rows[r].num_blocks as usize);
            if b.rows[r].samples {
                b.rows[r].logits_row = o.logits_indices.len() as u32;
                o.logits_indices.push(num_tokens as i64 - 1);
                o.row_req_ids.push(b.req_id[r]);
                o.row_seq_ids.push(b.seq_id[r]);
                o.row_sample_index.push(b.sample_index[r]);
                let f = b.rows[r].fan_out;
                if f > 0 {
                    // The samples of an n > 1 request: children 1..n, forked at update.
                    let first = self.next_seq_id;
                    self.next_seq_id += f as u64;
                    b.fan_out_first[r] = first;
                    for j in 0..f {
                        o.logits_indices.push(num_tokens as i64 - 1);
                        o.row_req_ids.push(b.req_id[r]);
                        o.row_seq_ids.push((first + j as u64) as i64);
                        o.row_sample_index.push(j as i32 + 1);
                    }
                }
            }
        }
        debug_assert_eq!((o.seq_ids.len(), num_tokens, o.logits_indices.len()), (s_count, t_count, r_count));
        o.max_blocks = max_blocks;
        o.block_tables = if s_count == n {
            BlockTables::Batch
        } else {
            let mut bt = Vec::with_capacity(s_count * max_blocks);
            for r in (0..n).filter(|&r| b.rows[r].new_tokens > 0) {
                // Entries past a row's blocks are the null block already.
                bt.extend((0..max_blocks).map(|i| b.block(r, i)));
            }
            BlockTables::Owned(bt)
        };
        self.finish_output(o)
    }

    /// Block ops queued by the step go last.
    pub(super) fn finish_output(&mut self, mut o: SchedulerOutput) -> SchedulerOutput {
        let ops = self.kv.take_ops();
        o.copy_ops = ops.copy.iter().flat_map(|&(a, b)| [a as i32, b as i32]).collect();
        o.swap_out = ops.swap_out.iter().flat_map(|&(a, b)| [a as i32, b as i32]).collect();
        o.swap_in = ops.swap_in.iter().flat_map(|&(a, b)| [a as i32, b as i32]).collect();
        o
    }

    /// The block tables of the step in flight as one `[num_seqs * max_blocks]` copy (for tests
    /// and tools; the runner reads the batch matrix through `batch_table`).
    pub fn block_tables(&self, out: &SchedulerOutput) -> CoreResult<Vec<i32>> {
        match &out.block_tables {
            BlockTables::Owned(v) => Ok(v.clone()),
            BlockTables::Batch => {
                self.check_batch_view(out.step_id)?;
                let m = out.max_blocks;
                Ok((0..out.num_seqs()).flat_map(|r| (0..m).map(move |i| self.batch.block(r, i))).collect())
            }
        }
    }

    /// The batch matrix (`max_num_seqs` rows of `row_stride` block ids) that outputs with
    /// `BlockTables::Batch` view, valid for the scheduler's lifetime.
    pub fn batch_table(&self) -> (*const i32, usize, usize) {
        (self.batch.table_ptr(), self.batch.capacity(), self.batch.width())
    }

    /// A `BlockTables::Batch` view is only meaningful while its step is in flight.
    pub fn check_batch_view(&self, step_id: u64) -> CoreResult<()> {
        match &self.in_flight {
            Some(f) if f.step_id == step_id => Ok(()),
            _ => Err(CoreError::InvalidState {
                message: format!(
                    "the block tables of step {step_id} are no longer valid: read them between schedule() and update()"
                ),
            }),
        }
    }

}

#[cfg(test)]
mod tests {
    use super::super::test_util::*;
    use super::super::*;
    use crate::output::BlockTables;
    use crate::request::FinishReason;

    #[test]
    fn chunked_prefill_then_decode_with_exact_slots_and_tables() {
        let mut s = Scheduler::new(cfg(16, 4, 8)).unwrap();
        s.add_request(req(1, 10, 3)).unwrap();
        let (o, _) = step(&mut s, 7);
        assert_eq!(o.num_tokens(), 8);
        assert_eq!(o.num_rows(), 0); // partial prefill: no logits
        assert_eq!(bt(&o), vec![1, 2]);
        assert_eq!(o.slot_mapping, (4..12).collect::<Vec<i64>>());
        assert_eq!(o.positions, (0..8).collect::<Vec<i64>>());
        let (o, _) = step(&mut s, 7);
        assert_eq!((o.num_tokens(), o.num_rows()), (2, 1));
        assert_eq!(o.positions, vec![8, 9]);
        assert_eq!(o.seq_lens, vec![10]);
        assert_eq!(bt(&o), vec![1, 2, 3]);
        assert_eq!(o.slot_mapping, vec![12, 13]);
        assert_eq!(o.logits_indices, vec![1]);
        let (o, _) = step(&mut s, 7);
        assert_eq!(o.input_ids, vec![7]);
        assert_eq!(o.positions, vec![10]);
        assert_eq!(o.num_decode_tokens, 1);
        let (_, done) = step(&mut s, 7);
        assert_eq!(done.len(), 1);
        assert_eq!(done[0].reason, FinishReason::Length);
        assert!(done[0].request_finished);
        assert_eq!(s.num_free_blocks(), 15);
        let st = s.stats();
        assert_eq!((st.prompt_tokens_computed, st.decode_tokens, st.generated_tokens), (10, 2, 3));
        let (o, _) = step(&mut s, 7);
        assert_eq!(o.finished_req_ids, vec![1]);
        assert!(o.is_empty());
    }

    #[test]
    fn a_mixed_step_flattens_the_decode_row_then_the_prefill_chunk() {
        let mut s = with_requests(cfg(32, 4, 6), [req(1, 3, 10)]);
        let (first, _) = step(&mut s, 5);
        s.add_request(req(2, 9, 10)).unwrap();
        let (o, _) = step(&mut s, 5);
        assert_eq!(o.step_id, first.step_id + 1);
        assert_eq!((o.req_ids.clone(), o.query_start_loc.clone(), o.seq_lens.clone()), (vec![1, 2], vec![0, 1, 6], vec![4, 5]));
        assert_eq!(o.input_ids, vec![5, 2100, 2101, 2102, 2103, 2104]);
        assert_eq!(o.positions, vec![3, 0, 1, 2, 3, 4]);
        assert_eq!((bt(&o), o.max_blocks), (vec![1, 0, 2, 3], 2), "tables padded with the null block");
        assert_eq!(o.slot_mapping, vec![7, 8, 9, 10, 11, 12]);
        assert_eq!((o.logits_indices.clone(), o.row_req_ids.clone(), o.row_sample_index.clone()), (vec![0], vec![1], vec![0]));
        assert_eq!(o.row_seq_ids, vec![o.seq_ids[0]], "request 2's chunk is partial: no row");
        assert_eq!((o.num_decode_tokens, o.num_prefill_tokens, o.block_size), (1, 5, 4));
        let (o, _) = step(&mut s, 5); // the budget finishes the prompt: both sample
        assert_eq!((o.query_start_loc.clone(), o.logits_indices), (vec![0, 1, 5], vec![0, 4]));
    }

    #[test]
    fn a_step_that_leaves_a_running_sequence_out_gathers_a_compact_copy_of_the_tables() {
        // A higher-priority prompt admitted behind a decode takes the next step's whole budget:
        // the decode after it in the running order is left out.
        let mut c = cfg(64, 4, 8);
        c.policy = Policy::Priority;
        let mut s = with_requests(c, [req(2, 3, 10)]);
        step(&mut s, 1);
        s.add_request(NewRequest { priority: -1, ..req(3, 20, 4) }).unwrap();
        step(&mut s, 1); // request 2's decode + 7 prompt tokens of request 3
        let o = s.schedule().unwrap();
        assert_eq!((o.req_ids.clone(), o.num_tokens(), s.num_running_seqs()), (vec![3], 8, 2));
        let table: Vec<i32> = s.seq_block_table(only_seq(&s, 3)).unwrap().iter().map(|&b| b as i32).collect();
        assert!(matches!(&o.block_tables, BlockTables::Owned(t) if *t == table), "{:?} vs {table:?}", o.block_tables);
        assert_eq!(o.max_blocks, table.len());
        s.update(o.step_id, &[]).unwrap();
        assert_eq!(s.block_tables(&o).unwrap(), table, "a copy stays readable after update");
    }
}
