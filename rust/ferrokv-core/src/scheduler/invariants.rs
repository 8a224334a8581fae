//! `check_invariants`: every structural invariant of the scheduler, its rows and its block
//! tables, checked from scratch (for tests and debugging).
//!
//! Costs: O(everything); never called on the hot path.

use super::Scheduler;
use crate::batch::{SeqRef, NO_ROW};
use crate::block_pool::BlockId;
use crate::kv_cache_manager::BlockIds;
use crate::request::{Request, RequestState, RowStop, Sequence};

impl Scheduler {
    /// Checks every structural invariant; for tests and debugging (O(everything)).
    pub fn check_invariants(&self) -> Result<(), String> {
        let bs = self.cfg.block_size;
        let live = || self.requests.iter().flatten();
        let mut running_seqs = 0;
        let mut rows_seen = vec![false; self.batch.len()];
        for r in live() {
            for s in &r.seqs {
                self.check_row(r, s, &mut rows_seen)?;
                // The row is the only home of a running sequence's count and staged tokens.
                let (computed, staged) = match r.state {
                    RequestState::Running => (self.batch.rows[s.row as usize].computed as usize, self.batch.pending(s.row as usize).len()),
                    _ => (s.num_computed, 0),
                };
                let num_tokens = s.tokens.len() + staged;
                if computed > num_tokens {
                    return Err(format!("seq {} computed {computed} of {num_tokens} tokens", s.seq_id));
                }
                let want = computed.div_ceil(bs);
                let (have, what) = match r.state {
                    RequestState::Swapped => (s.kv.cpu_blocks().len(), "cpu"),
                    _ => (self.seq_blocks(s).len(), "gpu"),
                };
                if have != want {
                    return Err(format!("seq {}: {have} {what} blocks for {} computed tokens", s.seq_id, computed));
                }
                if self.seq_owner.get(&s.seq_id) != self.by_id.get(&r.request_id) {
                    return Err(format!("seq {} owner map is stale", s.seq_id));
                }
            }
            match r.state {
                RequestState::Running => running_seqs += r.seq_slots(),
                RequestState::Waiting if r.seqs.iter().any(|s| s.num_computed != 0) => {
                    return Err(format!("waiting request {} holds computed tokens", r.request_id));
                }
                _ => {}
            }
        }
        self.kv.check(live().flat_map(|r| r.seqs.iter().map(|s| (&s.kv, self.seq_blocks(s)))))?;
        if running_seqs != self.num_running_seqs {
            return Err(format!("num_running_seqs={} but running requests hold {running_seqs}", self.num_running_seqs));
        }
        if self.waiting.len() + self.running.len() != self.by_id.len() {
            return Err("waiting + running != live requests".into());
        }
        for w in self.running.windows(2) {
            if self.req(w[0]).order_key() > self.req(w[1]).order_key() {
                return Err("running list is not in (priority, arrival) order".into());
            }
        }
        if let Some(i) = rows_seen.iter().position(|&seen| !seen) {
            return Err(format!("batch row {i} belongs to no running sequence"));
        }
        if self.batch.has_dead() {
            return Err("dead batch rows outlived update()".into());
        }
        self.batch.check_padding()?;
        if let Some(f) = &self.in_flight {
            if !f.forked {
                for r in (0..self.batch.len()).filter(|&r| self.batch.rows[r].new_tokens > 0) {
                    let SeqRef { slot, seq_id } = self.batch.owner[r];
                    let req = self.req(slot);
                    req.seq_pos(seq_id).ok_or("a row's sequence is gone")?;
                    let after = self.batch.rows[r].computed as usize;
                    let before = after - self.batch.rows[r].new_tokens as usize;
                    let ids = self.batch.ids(r);
                    if !self.kv.writes_are_exclusive(&ids, before, after) {
                        let t = ids.to_vec();
                        let refs: Vec<u32> = t.iter().map(|&b| self.kv.ref_count(b)).collect();
                        return Err(format!(
                            "seq {seq_id} writes positions {before}..{after} into a shared block (table {t:?}, refs {refs:?})"
                        ));
                    }
                }
            }
        }
        Ok(())
    }

    /// A running sequence owns exactly one batch row, whose ids and stop thresholds match it
    /// and whose tail fields describe its table; any other sequence has none.
    pub(super) fn check_row(&self, r: &Request, s: &Sequence, rows_seen: &mut [bool]) -> Result<(), String> {
        let b = &self.batch;
        if r.state != RequestState::Running {
            return if s.row == NO_ROW { Ok(()) } else { Err(format!("seq {} is not running but holds row {}", s.seq_id, s.row)) };
        }
        let row = s.row as usize;
        if row >= b.len() || std::mem::replace(&mut rows_seen[row], true) {
            return Err(format!("running seq {} has row {} (of {}), or shares it", s.seq_id, s.row, b.len()));
        }
        let slot = *self.by_id.get(&r.request_id).ok_or("running request not in by_id")?;
        let pending = b.pending(row);
        let last = pending.last().or(s.tokens.last()).copied().unwrap_or(0);
        let want = (
            SeqRef { slot, seq_id: s.seq_id },
            r.request_id as i64,
            s.seq_id as i64,
            s.sample_index as i32,
            (s.tokens.len() + pending.len()) as u32,
            last as i64,
            r.prompt_len as u32,
            RowStop::new(&r.stop, r.prompt_len, self.cfg.max_model_len),
        );
        let have = (
            b.owner[row],
            b.req_id[row],
            b.seq_id[row],
            b.sample_index[row],
            b.rows[row].num_tokens,
            b.last_token[row],
            b.rows[row].prompt_len,
            b.rows[row].stop,
        );
        if want != have {
            return Err(format!("row {row} of seq {}: {have:?} != {want:?}", s.seq_id));
        }
        let blocks: Vec<i32> = b.row_blocks(row).collect();
        let h = &b.rows[row];
        if h.tail_block as i32 != blocks.last().copied().unwrap_or(0) {
            return Err(format!("row {row} of seq {}: tail block {} != last of {blocks:?}", s.seq_id, h.tail_block));
        }
        // An owned tail may be shared only once full (a cache hit); then no write touches it.
        let tail_full = h.num_blocks as usize * self.cfg.block_size <= h.computed as usize;
        if h.tail_owned && !tail_full && self.kv.ref_count(BlockId(h.tail_block)) != 1 {
            return Err(format!("row {row} of seq {}: tail block {} marked owned but shared", s.seq_id, h.tail_block));
        }
        Ok(())
    }

}
