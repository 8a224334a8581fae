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
use crate::batch::{Batch, RowState};
use crate::request::Request;
use crate::sampling::{bad_word_bans, SamplingColumns};

impl Scheduler {
    /// Output buffers with room for a step, `query_start_loc` started.
    pub(super) fn empty_output(seqs: usize, tokens: usize, rows: usize) -> SchedulerOutput {
        let mut o = SchedulerOutput {
            req_ids: Vec::with_capacity(seqs),
            seq_ids: Vec::with_capacity(seqs),
            query_start_loc: Vec::with_capacity(seqs + 1),
            seq_lens: Vec::with_capacity(seqs),
            prompt_lens: Vec::with_capacity(seqs),
            input_ids: Vec::with_capacity(tokens),
            positions: Vec::with_capacity(tokens),
            slot_mapping: Vec::with_capacity(tokens),
            logits_indices: Vec::with_capacity(rows),
            row_req_ids: Vec::with_capacity(rows),
            row_seq_ids: Vec::with_capacity(rows),
            row_sample_index: Vec::with_capacity(rows),
            sampling: SamplingColumns::with_capacity(rows),
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
        o.prompt_lens.extend(b.rows[..k].iter().map(|h| h.prompt_len as i32));
        o.input_ids.extend_from_slice(&b.last_token[..k]);
        o.row_req_ids.extend_from_slice(&b.req_id[..k]);
        o.row_seq_ids.extend_from_slice(&b.seq_id[..k]);
        o.row_sample_index.extend_from_slice(&b.sample_index[..k]);
        o.query_start_loc.extend(1..=k as i32);
        o.logits_indices.extend(0..k as i64);
        debug_assert!(o.sampling.is_empty(), "logits row r is batch row r: the step's first rows");
        let rows = b.rows[..k].iter().zip(&b.sample_index[..k]).enumerate();
        o.sampling.extend(&b.sampling[..k], rows.map(|(r, (h, &si))| (si as u32, h.num_tokens, r as i32, Self::num_output(h))));
        for r in 0..k {
            if Self::has_bans(b, r) {
                Self::push_bans(b, &self.requests, &mut o.sampling, r, r);
            }
        }
    }

    /// Appends the sampling columns of a logits row of batch row `r`: sample `sample_index` of
    /// it (a fork-to-be when `batch_row` is -1), sampling the token after all of its tokens.
    #[inline]
    pub(super) fn push_sampling_row(b: &Batch, requests: &[Option<Request>], c: &mut SamplingColumns, r: usize, sample_index: u32, batch_row: i32) {
        let h = &b.rows[r];
        c.push(&b.sampling[r], sample_index, h.num_tokens, batch_row, Self::num_output(h));
        if Self::has_bans(b, r) {
            Self::push_bans(b, requests, c, c.len() - 1, r);
        }
    }

    /// Whether batch row `r`'s logits row has bans (`push_bans`): rare, so checked inline.
    #[inline(always)]
    fn has_bans(b: &Batch, r: usize) -> bool {
        let h = &b.rows[r];
        h.num_tokens < h.stop.min_len || b.sampling[r].has_bad_words
    }

    #[inline]
    fn num_output(h: &RowState) -> u32 {
        h.num_tokens.saturating_sub(h.prompt_len)
    }

    /// The bans of logits row `row`, of batch row `r`: under `min_tokens`, EOS and the stop
    /// tokens (vLLM's MinTokens bans every EOS id even under ignore_eos) and the request's other
    /// bans; and the `bad_words` whose other tokens end its output.
    #[cold]
    fn push_bans(b: &Batch, requests: &[Option<Request>], c: &mut SamplingColumns, row: usize, r: usize) {
        let h = &b.rows[r];
        if h.num_tokens < h.stop.min_len {
            let req = requests[b.owner[r].slot as usize].as_ref().expect("a live row's request is live");
            let eos = req.stop.eos_token_id;
            c.ban(row, eos);
            if h.stop.has_stop_ids {
                c.ban(row, req.stop.stop_token_ids.iter().copied().filter(|&t| Some(t) != eos));
            }
            c.ban(row, req.stop.min_tokens_bans.iter().copied());
        }
        if b.sampling[r].has_bad_words {
            let owner = b.owner[r];
            let req = requests[owner.slot as usize].as_ref().expect("a live row's request is live");
            let seq = &req.seqs[req.seq_pos(owner.seq_id).expect("a live row's sequence is live")];
            c.ban(row, bad_word_bans(&req.bad_words, &seq.tokens, b.pending(r), req.prompt_len));
        }
    }

    /// Flattens the planned rows, in row order, into the step's arrays. When every row is in
    /// the step, the block tables are the batch matrix itself (no copy); otherwise the planned
    /// rows are gathered.
    pub(super) fn build_output(&mut self, preempted: Vec<i64>) -> SchedulerOutput {
        let StepCounts { seqs: s_count, tokens: t_count, logits_rows: r_count, .. } = self.step;
        let n = self.batch.len();
        // The decode row pass emitted the leading rows; the others follow in row order.
        let (mut o, start, mut max_blocks) = match self.emitted.take() {
            Some(e) => e,
            None => (Self::empty_output(s_count, t_count, r_count), 0, 0),
        };
        self.fill_step_fields(&mut o, preempted);
        Self::reserve_rest(&mut o, self.step);
        let mut num_tokens = o.input_ids.len();
        for r in start..n {
            let k = self.batch.rows[r].new_tokens as usize;
            if k == 0 {
                continue;
            }
            self.push_row_tokens(&mut o, r, k);
            num_tokens += k;
            o.query_start_loc.push(num_tokens as i32);
            max_blocks = max_blocks.max(self.batch.rows[r].num_blocks as usize);
            if self.batch.rows[r].samples {
                self.push_logits_rows(&mut o, r, num_tokens as i64 - 1);
            }
        }
        debug_assert_eq!((o.seq_ids.len(), num_tokens, o.logits_indices.len()), (s_count, t_count, r_count));
        debug_assert_eq!(o.sampling.len(), r_count);
        o.sampling.finish();
        o.max_blocks = max_blocks;
        o.block_tables = if s_count == n {
            BlockTables::Batch
        } else {
            Self::gather_block_tables(&self.batch, s_count, max_blocks)
        };
        self.finish_output(o)
    }

    /// The step's scalars, and the requests that ended or were preempted since the last output.
    fn fill_step_fields(&mut self, o: &mut SchedulerOutput, preempted: Vec<i64>) {
        let StepCounts { tokens, decode_tokens, .. } = self.step;
        o.step_id = self.step_id;
        o.block_size = self.cfg.block_size;
        o.finished_req_ids = std::mem::take(&mut self.ended_ids);
        o.preempted_req_ids = std::mem::take(&mut self.pending_preempted);
        o.preempted_req_ids.extend(preempted);
        o.num_decode_tokens = decode_tokens;
        o.num_prefill_tokens = tokens - decode_tokens;
    }

    /// A decode prefix was sized for its rows: room for the rest of the step, once.
    fn reserve_rest(o: &mut SchedulerOutput, step: StepCounts) {
        let StepCounts { seqs: s_count, tokens: t_count, logits_rows: r_count, .. } = step;
        let (seqs, tokens, rows) = (o.seq_ids.len(), o.input_ids.len(), o.logits_indices.len());
        if s_count > seqs {
            for v in [&mut o.req_ids, &mut o.seq_ids] {
                v.reserve(s_count - seqs);
            }
            o.seq_lens.reserve(s_count - seqs);
            o.prompt_lens.reserve(s_count - seqs);
            o.query_start_loc.reserve(s_count - seqs);
            for v in [&mut o.input_ids, &mut o.positions, &mut o.slot_mapping] {
                v.reserve(t_count - tokens);
            }
            for v in [&mut o.logits_indices, &mut o.row_req_ids, &mut o.row_seq_ids] {
                v.reserve(r_count - rows);
            }
            o.row_sample_index.reserve(r_count - rows);
        }
    }

    /// Appends planned row `r`'s sequence columns and its `k` new tokens (ids, positions, KV
    /// slots). A chunk that starts at the row's last token (a decode) finds it in the batch;
    /// any other reads its sequence's tokens.
    #[inline]
    fn push_row_tokens(&mut self, o: &mut SchedulerOutput, r: usize, k: usize) {
        let (b, bm) = (&self.batch, self.bm);
        let after = b.rows[r].computed as usize;
        let before = after - k;
        o.req_ids.push(b.req_id[r]);
        o.seq_ids.push(b.seq_id[r]);
        o.seq_lens.push(after as i32);
        o.prompt_lens.push(b.rows[r].prompt_len as i32);
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
    }

    /// Appends the logits rows of sampling row `r`, whose last token is token `last` of the
    /// step: its own, then one per child of a fan-out (seq ids taken now, forked at update).
    #[inline]
    fn push_logits_rows(&mut self, o: &mut SchedulerOutput, r: usize, last: i64) {
        let b = &mut self.batch;
        b.rows[r].logits_row = o.logits_indices.len() as u32;
        o.logits_indices.push(last);
        o.row_req_ids.push(b.req_id[r]);
        o.row_seq_ids.push(b.seq_id[r]);
        o.row_sample_index.push(b.sample_index[r]);
        let f = b.rows[r].fan_out;
        let sample_index = b.sample_index[r] as u32;
        if f > 0 {
            // The samples of an n > 1 request: children 1..n, forked at update.
            let first = self.next_seq_id;
            self.next_seq_id += f as u64;
            b.fan_out_first[r] = first;
            for j in 0..f {
                o.logits_indices.push(last);
                o.row_req_ids.push(b.req_id[r]);
                o.row_seq_ids.push((first + j as u64) as i64);
                o.row_sample_index.push(j as i32 + 1);
            }
        }
        Self::push_sampling_row(b, &self.requests, &mut o.sampling, r, sample_index, r as i32);
        for j in 0..f {
            Self::push_sampling_row(b, &self.requests, &mut o.sampling, r, j + 1, -1);
        }
    }

    /// The planned rows' block tables, `max_blocks` wide, copied out of the batch matrix (a
    /// step that leaves rows out, so the matrix itself is not the step's tables).
    fn gather_block_tables(b: &Batch, seqs: usize, max_blocks: usize) -> BlockTables {
        let mut bt = Vec::with_capacity(seqs * max_blocks);
        for r in (0..b.len()).filter(|&r| b.rows[r].new_tokens > 0) {
            // Entries past a row's blocks are the null block already.
            bt.extend((0..max_blocks).map(|i| b.block(r, i)));
        }
        BlockTables::Owned(bt)
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
    use crate::output::{BlockTables, FinishedSeq, SchedulerOutput};
    use crate::request::FinishReason;
    use crate::sampling::{rng_key, sample_uniform, SamplingSpec};

    /// The draw of sample `si` at `pos` of request `id` (with `seed`) under `sampling_seed`.
    fn draw(seed: Option<u64>, id: u64, sampling_seed: u64, si: u32, pos: u32) -> f64 {
        let spec = SamplingSpec { rng_key: rng_key(seed, id, sampling_seed), seeded: seed.is_some(), ..Default::default() };
        sample_uniform(&spec, si, pos)
    }

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
        assert_eq!(o.prompt_lens, vec![3, 9], "a decode row's and a partial chunk's prompt lengths");
        assert_eq!(o.input_ids, vec![5, 2100, 2101, 2102, 2103, 2104]);
        assert_eq!(o.positions, vec![3, 0, 1, 2, 3, 4]);
        assert_eq!((bt(&o), o.max_blocks), (vec![1, 0, 2, 3], 2), "tables padded with the null block");
        assert_eq!(o.slot_mapping, vec![7, 8, 9, 10, 11, 12]);
        assert_eq!((o.logits_indices.clone(), o.row_req_ids.clone(), o.row_sample_index.clone()), (vec![0], vec![1], vec![0]));
        assert_eq!(o.row_seq_ids, vec![o.seq_ids[0]], "request 2's chunk is partial: no row");
        assert_eq!((o.num_decode_tokens, o.num_prefill_tokens, o.block_size), (1, 5, 4));
        let (o, _) = step(&mut s, 5); // the budget finishes the prompt: both sample
        assert_eq!((o.query_start_loc.clone(), o.logits_indices), (vec![0, 1, 5], vec![0, 4]));
        assert_eq!(o.prompt_lens, vec![3, 9]);
        let (o, _) = step(&mut s, 5); // all decode: the bulk path
        assert_eq!((o.num_decode_tokens, o.prompt_lens), (2, vec![3, 9]));
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
    // ---- Sampling columns ----------------------------------------------------------------

    /// A distinct, valid spec per `i` (hot when `temperature > 0`).
    fn spec(i: i32, temperature: f32) -> SamplingSpec {
        let f = i as f32;
        SamplingSpec {
            temperature,
            top_k: i,
            top_p: 1.0 - 0.05 * f,
            min_p: 0.01 * f,
            presence_penalty: 0.1 * f,
            frequency_penalty: -0.2 * f,
            repetition_penalty: 1.0 + 0.1 * f,
            num_logprobs: i - 1,
            ..Default::default()
        }
    }

    /// Checks the sampling columns of `o` (just scheduled, not updated) row by row against the
    /// requests as they were added: the spec, the draw (from the seed, else the id and the
    /// scheduler's `sampling_seed`, at the sampled token's position), batch row, tokens out,
    /// `min_tokens` bans and the flags.
    fn check_sampling(s: &Scheduler, o: &SchedulerOutput, reqs: &[NewRequest]) {
        let (c, n) = (&o.sampling, o.num_rows());
        let lens = [c.temperature.len(), c.top_k.len(), c.top_p.len(), c.min_p.len(), c.presence.len(), c.frequency.len()];
        assert_eq!(lens, [n; 6]);
        let lens = [c.repetition.len(), c.num_logprobs.len(), c.uniform.len(), c.batch_rows.len(), c.num_output.len()];
        assert_eq!(lens, [n; 5]);
        assert_eq!(c.banned_rows.len(), c.banned_tokens.len());
        let mut bans = vec![Vec::new(); n];
        for (&r, &t) in c.banned_rows.iter().zip(&c.banned_tokens) {
            bans[r as usize].push(t);
        }
        let mut specs = Vec::new();
        for (i, row_bans) in bans.iter_mut().enumerate() {
            let rid = o.row_req_ids[i] as u64;
            let r = reqs.iter().find(|r| r.request_id == rid).expect("a known request");
            let sp = r.sampling;
            let got = SamplingSpec {
                temperature: c.temperature[i],
                top_k: c.top_k[i],
                top_p: c.top_p[i],
                min_p: c.min_p[i],
                presence_penalty: c.presence[i],
                frequency_penalty: c.frequency[i],
                repetition_penalty: c.repetition[i],
                num_logprobs: c.num_logprobs[i],
                ..sp
            };
            assert_eq!(got, sp, "row {i} (request {rid})");
            specs.push(sp);
            let pos = o.positions[o.logits_indices[i] as usize] as u32 + 1; // of the sampled token
            let si = o.row_sample_index[i] as u32;
            let u = if sp.temperature == 0.0 { 0.0 } else { draw(r.seed, rid, s.cfg.sampling_seed, si, pos) };
            assert_eq!(c.uniform[i], u, "row {i} (request {rid}, sample {si}, position {pos})");
            let out = pos as usize - r.prompt_token_ids.len();
            assert_eq!(c.num_output[i], out as i32, "row {i}");
            let seq = o.row_seq_ids[i] as u64;
            if c.batch_rows[i] >= 0 {
                assert_eq!(row_of(s, seq), c.batch_rows[i] as usize, "row {i}: seq {seq}");
            } else {
                assert!(si > 0 && s.locate_seq(seq).is_err(), "row {i}: only a sample forked at update has no row");
            }
            let mut want: Vec<i64> = Vec::new();
            if out < r.min_tokens {
                want.extend(r.eos_token_id.map(i64::from));
                for &t in r.stop_token_ids.iter().chain(&r.min_tokens_bans) {
                    if !want.contains(&(t as i64)) {
                        want.push(t as i64);
                    }
                }
            }
            row_bans.sort();
            want.sort();
            assert_eq!(*row_bans, want, "row {i} (request {rid}, {out} out): min_tokens bans");
        }
        let flags = (c.num_greedy_rows, c.max_top_k, c.any_top_p, c.any_min_p, c.any_penalties, c.any_logprobs);
        let want = (
            specs.iter().filter(|p| p.temperature == 0.0).count(),
            specs.iter().map(|p| p.top_k).max().unwrap_or(0).max(0),
            specs.iter().any(|p| p.top_p < 1.0),
            specs.iter().any(|p| p.min_p > 0.0),
            specs.iter().any(|p| p.has_penalties()),
            specs.iter().any(|p| p.num_logprobs >= 0),
        );
        assert_eq!(flags, want);
    }

    /// `step` with `check_sampling` between `schedule` and `update`.
    fn checked_step(s: &mut Scheduler, tok: i64, reqs: &[NewRequest]) -> (SchedulerOutput, Vec<FinishedSeq>) {
        let o = s.schedule().unwrap();
        s.check_invariants().unwrap();
        check_sampling(s, &o, reqs);
        let done = s.update(o.step_id, &vec![tok; o.num_rows()]).unwrap();
        s.check_invariants().unwrap();
        (o, done)
    }

    fn seeded(mut c: crate::scheduler::SchedulerConfig, seed: u64) -> crate::scheduler::SchedulerConfig {
        c.sampling_seed = seed;
        c
    }

    #[test]
    fn sampling_columns_follow_each_rows_request_on_the_decode_fast_path_and_after_a_row_moves() {
        let reqs = [
            NewRequest { sampling: spec(3, 0.7), ..req(1, 3, 2) }, // finishes first: row 0 is freed
            NewRequest { sampling: spec(2, 0.0), ..req(2, 5, 10) }, // greedy, with penalties and logprobs
            NewRequest { sampling: spec(5, 1.3), seed: Some(99), ..req(3, 6, 10) },
        ];
        let mut s = with_requests(seeded(cfg(64, 4, 32), 7), reqs.clone());
        let (o, _) = checked_step(&mut s, 9, &reqs); // three prompts, the general path
        assert_eq!((o.sampling.batch_rows.clone(), o.sampling.num_output.clone()), (vec![0, 1, 2], vec![0, 0, 0]));
        let (o, done) = checked_step(&mut s, 9, &reqs); // every row decodes: the row pass
        assert_eq!(o.num_decode_tokens, 3);
        let c = &o.sampling;
        assert_eq!((c.batch_rows.clone(), c.num_output.clone()), (vec![0, 1, 2], vec![1, 1, 1]));
        assert_eq!(c.temperature, vec![0.7, 0.0, 1.3]);
        assert_eq!((c.top_k.clone(), c.num_logprobs.clone()), (vec![3, 2, 5], vec![2, 1, 4]));
        assert_eq!(c.uniform[1], 0.0, "a greedy row draws nothing");
        assert!(c.uniform[0] != c.uniform[2] && c.uniform[0] > 0.0 && c.uniform[2] > 0.0);
        assert_eq!((c.num_greedy_rows, c.max_top_k, c.any_top_p, c.any_min_p, c.any_penalties, c.any_logprobs), (1, 5, true, true, true, true));
        assert!(c.banned_rows.is_empty());
        assert_eq!(done.iter().map(|d| d.request_id).collect::<Vec<_>>(), vec![1]);
        // Request 1's row 0 went to the last row (request 3's): its columns moved with it.
        let (o, _) = checked_step(&mut s, 9, &reqs);
        let c = &o.sampling;
        assert_eq!((o.row_req_ids.clone(), c.batch_rows.clone(), c.num_output.clone()), (vec![3, 2], vec![0, 1], vec![2, 2]));
        assert_eq!((c.temperature.clone(), c.top_k.clone(), c.repetition.clone()), (vec![1.3, 0.0], vec![5, 2], vec![1.5, 1.2]));
        assert_eq!(c.uniform[0], draw(Some(99), 0, 0, 0, 8));
        assert_eq!((c.num_greedy_rows, c.max_top_k), (1, 5));
        drain(&mut s, 9);
        assert_eq!(s.num_free_blocks(), 63);
    }

    #[test]
    fn sampling_columns_of_rows_written_by_the_general_path_behind_a_prefill_chunk() {
        let reqs = [
            NewRequest { sampling: spec(1, 0.5), ..req(1, 2, 2) },
            NewRequest { sampling: spec(2, 0.9), min_tokens: 5, eos_token_id: Some(3), ..req(2, 2, 20) },
            NewRequest { sampling: spec(4, 0.0), ..req(3, 40, 2) },
        ];
        let mut s = with_requests(cfg(64, 4, 8), reqs.clone());
        let (o, _) = checked_step(&mut s, 9, &reqs);
        assert_eq!((o.req_ids.clone(), o.row_req_ids.clone()), (vec![1, 2, 3], vec![1, 2]));
        let (_, done) = checked_step(&mut s, 9, &reqs);
        assert_eq!(done.iter().map(|d| d.request_id).collect::<Vec<_>>(), vec![1]);
        // Row 0 is now request 3's prefill chunk: request 2's decode in row 1 is written by
        // the general path.
        let (o, _) = checked_step(&mut s, 9, &reqs);
        assert_eq!((o.req_ids.clone(), o.row_req_ids.clone()), (vec![3, 2], vec![2]));
        let c = &o.sampling;
        assert_eq!((c.batch_rows.clone(), c.num_output.clone(), c.temperature.clone()), (vec![1], vec![2], vec![0.9]));
        assert_eq!((c.banned_rows.clone(), c.banned_tokens.clone()), (vec![0], vec![3]), "under min_tokens: EOS is banned");
        let mut sampled_3 = false;
        while s.has_unfinished() {
            let (o, _) = checked_step(&mut s, 9, &reqs);
            if let Some(i) = o.row_req_ids.iter().position(|&r| r == 3) {
                sampled_3 |= o.sampling.num_output[i] == 0 && o.sampling.batch_rows[i] == 0;
            }
        }
        assert!(sampled_3, "request 3's prompt sampled from row 0");
        assert_eq!(s.num_free_blocks(), 63);
    }

    #[test]
    fn the_samples_of_an_n_request_fan_out_with_their_own_sample_index_and_draw() {
        let reqs = [
            NewRequest { n: 3, sampling: spec(2, 0.8), seed: Some(5), ..req(1, 5, 3) },
            NewRequest { n: 2, sampling: spec(1, 0.0), ..req(2, 3, 3) },
        ];
        let mut s = with_requests(cfg(64, 4, 16), reqs.clone());
        let (o, _) = checked_step(&mut s, 9, &reqs);
        let c = &o.sampling;
        assert_eq!(o.row_sample_index, vec![0, 1, 2, 0, 1]);
        assert_eq!((c.batch_rows.clone(), c.num_output.clone()), (vec![0, -1, -1, 1, -1], vec![0; 5]));
        assert_eq!(c.temperature, vec![0.8, 0.8, 0.8, 0.0, 0.0]);
        assert_eq!(c.top_p, vec![0.9, 0.9, 0.9, 0.95, 0.95]);
        // vLLM's child seeds: sample i draws as a one-sample request with seed 5 + i.
        assert_eq!(c.uniform, vec![draw(Some(5), 0, 0, 0, 5), draw(Some(6), 0, 0, 0, 5), draw(Some(7), 0, 0, 0, 5), 0.0, 0.0]);
        assert!(c.uniform[0] != c.uniform[1] && c.uniform[1] != c.uniform[2] && c.uniform[0] != c.uniform[2]);
        // Forked at update: each sample has its own row now and keeps its sample index.
        let (o, _) = checked_step(&mut s, 9, &reqs);
        let c = &o.sampling;
        assert_eq!(o.num_rows(), 5);
        assert!(c.batch_rows.iter().all(|&r| r >= 0) && c.num_output == vec![1; 5]);
        let mut si: Vec<(i64, i32)> = o.row_req_ids.iter().copied().zip(o.row_sample_index.iter().copied()).collect();
        si.sort();
        assert_eq!(si, vec![(1, 0), (1, 1), (1, 2), (2, 0), (2, 1)]);
        // The forks' first writes copied their shared blocks: the row pass plans this one
        // (each row's draw, at its own sample index, is checked by `check_sampling`).
        let (o, _) = checked_step(&mut s, 9, &reqs);
        assert_eq!((o.num_rows(), o.num_decode_tokens), (5, 5));
        assert!(!s.has_unfinished());
        assert_eq!(s.num_free_blocks(), 63);
    }

    #[test]
    fn a_seeded_requests_draws_depend_on_nothing_else_and_unseeded_ones_on_the_sampling_seed() {
        let hot = SamplingSpec { temperature: 1.0, ..Default::default() };
        // The draws of request `id` (prompt 5, 4 tokens) over its life, among `others`;
        // preempted (recompute) after two tokens with `preempt`.
        let draws = |sampling_seed: u64, others: Vec<NewRequest>, id: u64, seed: Option<u64>, preempt: bool| {
            let mine = NewRequest { sampling: hot, seed, ..req(id, 5, 4) };
            let mut s = with_requests(seeded(cfg(64, 4, 64), sampling_seed), others.into_iter().chain([mine]));
            let mut u = Vec::new();
            for k in 0.. {
                if !s.has_unfinished() {
                    break;
                }
                if preempt && k == 2 {
                    preempt_between_steps(&mut s, id);
                }
                let (o, _) = step(&mut s, 9);
                u.extend((0..o.num_rows()).filter(|&i| o.row_req_ids[i] == id as i64).map(|i| o.sampling.uniform[i]));
            }
            assert_eq!(s.num_free_blocks(), 63);
            u
        };
        let others = || vec![NewRequest { sampling: hot, ..req(1, 7, 6) }, req(2, 3, 6), NewRequest { sampling: hot, seed: Some(3), ..req(3, 4, 2) }];
        let alone = draws(0, vec![], 1, Some(42), false);
        assert_eq!(alone, (5..9).map(|p| draw(Some(42), 0, 0, 0, p)).collect::<Vec<_>>());
        assert_eq!(draws(123, others(), 9, Some(42), false), alone, "another batch, id and sampling seed");
        assert_eq!(draws(0, vec![], 1, Some(42), true), alone, "the same draws again after a preemption");
        assert_ne!(draws(0, vec![], 1, Some(43), false), alone);
        let unseeded = draws(0, others(), 7, None, false);
        assert_eq!(unseeded, (5..9).map(|p| draw(None, 7, 0, 0, p)).collect::<Vec<_>>());
        assert_eq!(draws(0, vec![], 7, None, false), unseeded, "keyed by id and sampling seed only");
        assert_ne!(draws(1, others(), 7, None, false), unseeded, "another sampling seed");
        assert_ne!(draws(0, others(), 8, None, false), unseeded, "another id");
        assert_eq!(draws(0, vec![], 7, Some(0), false).len(), 4);
        let greedy = NewRequest { seed: Some(42), ..req(4, 5, 3) };
        let mut s = with_requests(cfg(64, 4, 64), [greedy]);
        let (o, _) = step(&mut s, 9);
        assert_eq!(o.sampling.uniform, vec![0.0], "a greedy row draws nothing, seeded or not");
    }

    #[test]
    fn bad_words_are_banned_once_the_output_ends_with_their_prefix() {
        // The prompt ends with 5: [5, 7]'s prefix must come from the output, not the prompt.
        let words = vec![vec![9], vec![4, 5, 6], vec![5, 7]];
        let hot = SamplingSpec { temperature: 1.0, ..Default::default() };
        let r1 = NewRequest { bad_words: words, sampling: hot, ..NewRequest::new(1, vec![1, 2, 5], 20) };
        let mut s = with_requests(cfg(64, 4, 64), [r1, req(2, 3, 20)]);
        let bans = |o: &SchedulerOutput, rid: i64| {
            let row = o.row_req_ids.iter().position(|&r| r == rid).unwrap() as i64;
            let mut b: Vec<i64> = o.sampling.banned_rows.iter().zip(&o.sampling.banned_tokens).filter(|(&r, _)| r == row).map(|(_, &t)| t).collect();
            b.sort();
            b
        };
        // Request 1's token per step, and its bans at the step that samples it.
        let plan = [(4, vec![9]), (5, vec![9]), (6, vec![6, 7, 9]), (5, vec![9]), (7, vec![7, 9]), (4, vec![9]), (5, vec![9]), (1, vec![6, 7, 9])];
        for (tok, want) in plan {
            let o = s.schedule().unwrap();
            assert_eq!(bans(&o, 1), want, "before sampling {tok}");
            assert_eq!(bans(&o, 2), Vec::<i64>::new(), "a request without bad words bans nothing");
            let sampled: Vec<i64> = o.row_req_ids.iter().map(|&r| if r == 1 { tok } else { 3 }).collect();
            s.update(o.step_id, &sampled).unwrap();
            s.check_invariants().unwrap();
        }
    }

    #[test]
    fn rows_under_min_tokens_ban_what_would_stop_them() {
        let hot = SamplingSpec { temperature: 1.0, ..Default::default() };
        let reqs = [
            // EOS also a stop id: banned once.
            NewRequest { min_tokens: 3, eos_token_id: Some(2), stop_token_ids: vec![5, 2, 7], ..req(1, 3, 6) },
            // ignore_eos: EOS is banned all the same (vLLM), and the stop ids.
            NewRequest { min_tokens: 2, eos_token_id: Some(2), ignore_eos: true, stop_token_ids: vec![2, 5], sampling: hot, ..req(2, 4, 6) },
            NewRequest { min_tokens: 2, eos_token_id: Some(2), ..req(3, 5, 6) },
            NewRequest { eos_token_id: Some(2), stop_token_ids: vec![5], ..req(4, 2, 6) }, // no min_tokens
            // EOS only; and the model's other EOS id (9), which stops nothing.
            NewRequest { min_tokens: 3, eos_token_id: Some(3), ignore_eos: true, min_tokens_bans: vec![9], ..req(5, 2, 6) },
        ];
        let mut s = with_requests(cfg(64, 4, 64), reqs.clone());
        let pairs = |o: &SchedulerOutput| {
            let mut p: Vec<(i64, i64)> = o.sampling.banned_rows.iter().copied().zip(o.sampling.banned_tokens.iter().copied()).collect();
            p.sort();
            p
        };
        let (o, _) = checked_step(&mut s, 9, &reqs); // prompts: 0 out
        assert_eq!(pairs(&o), vec![(0, 2), (0, 5), (0, 7), (1, 2), (1, 5), (2, 2), (4, 3), (4, 9)]);
        let (o, _) = checked_step(&mut s, 9, &reqs); // decodes: 1 out
        assert_eq!(pairs(&o), vec![(0, 2), (0, 5), (0, 7), (1, 2), (1, 5), (2, 2), (4, 3), (4, 9)]);
        let (o, _) = checked_step(&mut s, 9, &reqs); // 2 out
        assert_eq!(pairs(&o), vec![(0, 2), (0, 5), (0, 7), (4, 3), (4, 9)]);
        let (o, _) = checked_step(&mut s, 9, &reqs); // 3 out: min_tokens are out everywhere
        assert_eq!(pairs(&o), vec![]);
        while s.has_unfinished() {
            checked_step(&mut s, 9, &reqs);
        }
        assert_eq!(s.num_free_blocks(), 63);
    }
}
