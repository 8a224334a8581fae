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
                // Registered blocks are computed (by the step in flight at the latest): a
                // cancelled step's registrations were put back.
                if s.kv.num_registered() > computed / bs {
                    return Err(format!("seq {}: {} blocks registered, {computed} tokens computed", s.seq_id, s.kv.num_registered()));
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
        let live_seqs: usize = live().map(|r| r.seqs.len()).sum();
        if self.seq_owner.len() != live_seqs {
            return Err(format!("owner map holds {} sequences, {live_seqs} are live", self.seq_owner.len()));
        }
        self.kv.check(live().flat_map(|r| r.seqs.iter().map(|s| (&s.kv, self.seq_blocks(s)))))?;
        if running_seqs != self.num_running_seqs {
            return Err(format!("num_running_seqs={} but running requests hold {running_seqs}", self.num_running_seqs));
        }
        if self.waiting.len() + self.running.len() != self.by_id.len() {
            return Err("waiting + running != live requests".into());
        }
        let waiting_seqs: usize = self.waiting.iter().map(|&(_, _, slot)| self.req(slot).seq_slots()).sum();
        if waiting_seqs != self.num_waiting_seqs {
            return Err(format!("num_waiting_seqs={} but waiting requests hold {waiting_seqs}", self.num_waiting_seqs));
        }
        for w in self.running.windows(2) {
            if self.req(w[0]).order_key() > self.req(w[1]).order_key() {
                return Err("running list is not in (priority, arrival) order".into());
            }
        }
        // Rows that left while a step is in flight stay (dead) until it ends.
        let in_flight = self.in_flight.is_some();
        let orphan = (0..rows_seen.len()).find(|&i| !(rows_seen[i] || in_flight && self.batch.rows[i].is_dead));
        if let Some(i) = orphan {
            return Err(format!("batch row {i} belongs to no running sequence"));
        }
        if self.batch.has_dead() && !in_flight {
            return Err("dead batch rows outlived update()".into());
        }
        self.batch.check_padding()?;
        if let Some(f) = &self.in_flight {
            if !f.forked {
                self.check_writes()?;
            }
        }
        Ok(())
    }

    /// Every block the step in flight writes is held by its writer alone, except a block the
    /// write fills, which sequences that took it as a cache hit (registered when the step was
    /// planned) may hold too: they only read it, and nobody else writes it.
    fn check_writes(&self) -> Result<(), String> {
        let live = |r: &usize| self.batch.rows[*r].new_tokens > 0 && !self.batch.rows[*r].is_dead;
        let range = |r: usize| {
            let after = self.batch.rows[r].computed as usize;
            (after - self.batch.rows[r].new_tokens as usize, after)
        };
        let mut writers: std::collections::HashMap<u32, usize> = std::collections::HashMap::new();
        for r in (0..self.batch.len()).filter(live) {
            let (before, after) = range(r);
            let ids = self.batch.ids(r);
            for i in self.bm.block(before)..self.bm.blocks_for(after).min(ids.len()) {
                *writers.entry(ids.at(i).0).or_default() += 1;
            }
        }
        for r in (0..self.batch.len()).filter(live) {
            let SeqRef { slot, seq_id } = self.batch.owner[r];
            self.req(slot).seq_pos(seq_id).ok_or("a row's sequence is gone")?;
            let (before, after) = range(r);
            let ids = self.batch.ids(r);
            let read_only_hit = |(b, filled): (BlockId, bool)| filled && b.0 != 0 && writers.get(&b.0) == Some(&1);
            if !self.kv.shared_writes(&ids, before, after).all(read_only_hit) {
                let t = ids.to_vec();
                let refs: Vec<u32> = t.iter().map(|&b| self.kv.ref_count(b)).collect();
                return Err(format!("seq {seq_id} writes positions {before}..{after} into a shared block (table {t:?}, refs {refs:?})"));
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

#[cfg(test)]
mod tests {
    use super::super::test_util::*;
    use super::super::*;
    use crate::batch::SeqRef;
    use crate::kv_cache_manager::BlockIdsMut;

    /// Request 1 (prompt 6, forked: two sequences sharing blocks 1 and 2) and request 2 (prompt
    /// 5) running, 7 and 6 tokens computed (block size 4); request 3 waiting.
    fn busy() -> Scheduler {
        let mut c = cfg(32, 4, 16);
        c.max_num_seqs = 5;
        let mut s = with_requests(c, [req(1, 6, 20), req(2, 5, 20)]);
        step(&mut s, 1);
        step(&mut s, 2);
        s.fork_sequence(only_seq(&s, 1), None).unwrap();
        s.add_request(req(3, 4, 4)).unwrap();
        s.check_invariants().unwrap();
        s
    }

    /// `check_invariants` after `corrupt` changed `busy()`: the error it must report.
    fn error_after(corrupt: impl FnOnce(&mut Scheduler)) -> String {
        let mut s = busy();
        corrupt(&mut s);
        s.check_invariants().expect_err("the corruption went unnoticed")
    }

    fn parent_row(s: &Scheduler) -> usize {
        row_of(s, s.request_seq_ids(1).unwrap()[0])
    }

    #[test]
    fn a_wrong_tail_block_is_caught() {
        let e = error_after(|s| {
            let r = parent_row(s);
            s.batch.rows[r].tail_block = 7;
        });
        assert!(e.contains("tail block 7 != last of [1, 2]"), "{e}");
    }

    #[test]
    fn a_tail_marked_owned_while_shared_is_caught() {
        let e = error_after(|s| {
            let r = parent_row(s);
            s.batch.rows[r].tail_owned = true;
        });
        assert!(e.contains("tail block 2 marked owned but shared"), "{e}");
    }

    #[test]
    fn a_stale_num_running_seqs_is_caught() {
        let e = error_after(|s| s.num_running_seqs += 1);
        assert!(e.contains("num_running_seqs=4 but running requests hold 3"), "{e}");
        let e = error_after(|s| s.num_waiting_seqs += 2);
        assert!(e.contains("num_waiting_seqs=") && e.contains("but waiting requests hold"), "{e}");
    }

    #[test]
    fn a_row_owned_by_another_sequence_is_caught() {
        let e = error_after(|s| s.batch.owner.swap(0, 2));
        assert!(e.contains("row 0 of seq"), "{e}");
    }

    #[test]
    fn two_sequences_sharing_a_row_are_caught() {
        let e = error_after(|s| {
            let (slot, pos) = s.locate_seq(only_seq(s, 2)).unwrap();
            let r = parent_row(s) as u32;
            s.requests[slot as usize].as_mut().unwrap().seqs[pos].row = r;
        });
        assert!(e.contains("or shares it"), "{e}");
    }

    #[test]
    fn a_row_no_sequence_owns_is_caught() {
        let e = error_after(|s| {
            let (slot, pos) = s.locate_seq(only_seq(s, 3)).unwrap();
            let (q, seq) = (s.req(slot), &s.req(slot).seqs[pos]);
            let init = Scheduler::row_init(q, seq, 0, s.cfg.max_model_len);
            s.batch.push(SeqRef { slot, seq_id: seq.seq_id }, init, std::iter::empty());
        });
        assert!(e.contains("batch row 3 belongs to no running sequence"), "{e}");
    }

    #[test]
    fn a_ref_count_no_table_accounts_for_is_caught() {
        let e = error_after(|s| {
            // A fork whose child never gets a row: request 1's blocks gain a reference.
            let r = parent_row(s);
            let kv = &s.requests[s.by_id[&1] as usize].as_ref().unwrap().seqs[0].kv;
            let _leaked = s.kv.fork(kv, &s.batch.ids(r));
        });
        assert!(e.contains("block 1: ref count 3 but 2 tables hold it"), "{e}");
    }

    #[test]
    fn more_computed_tokens_than_tokens_are_caught() {
        let e = error_after(|s| {
            let r = row_of(s, only_seq(s, 2));
            s.batch.rows[r].computed = 8;
        });
        assert!(e.contains("computed 8 of 7 tokens"), "{e}");
    }

    #[test]
    fn a_table_that_does_not_cover_the_computed_tokens_is_caught() {
        let e = error_after(|s| {
            let r = row_of(s, only_seq(s, 2));
            s.batch.rows[r].computed = 4;
        });
        assert!(e.contains("2 gpu blocks for 4 computed tokens"), "{e}");
    }

    #[test]
    fn a_block_id_left_in_a_rows_padding_is_caught() {
        let e = error_after(|s| {
            let r = row_of(s, only_seq(s, 2));
            let tail = s.batch.rows[r].tail_block;
            s.batch.ids_mut(r).push(crate::block_pool::BlockId(9));
            (s.batch.rows[r].num_blocks, s.batch.rows[r].tail_block) = (2, tail);
        });
        assert!(e.contains("block 2 is 9 past its 2 blocks"), "{e}");
    }

    #[test]
    fn a_stale_owner_map_is_caught() {
        let e = error_after(|s| {
            let seq = only_seq(s, 2);
            s.seq_owner.remove(&seq);
        });
        assert!(e.contains("owner map is stale"), "{e}");
    }

    #[test]
    fn a_running_list_out_of_order_is_caught() {
        let e = error_after(|s| s.running.swap(0, 1));
        assert!(e.contains("not in (priority, arrival) order"), "{e}");
    }

    #[test]
    fn a_request_in_no_queue_is_caught() {
        let e = error_after(|s| s.waiting.clear());
        assert!(e.contains("waiting + running != live requests"), "{e}");
    }

    #[test]
    fn a_dead_row_left_after_update_is_caught() {
        let e = error_after(|s| s.batch.mark_dead(0));
        assert!(e.contains("dead batch rows outlived update()"), "{e}");
    }

    #[test]
    fn a_planned_write_into_a_shared_block_is_caught() {
        let mut s = busy();
        let o = s.schedule().unwrap();
        s.check_invariants().unwrap();
        // A fork in flight shares the block request 2 writes this step; the checker allows
        // it only because of the fork, so forget the fork.
        s.fork_sequence(only_seq(&s, 2), Some(5)).unwrap();
        s.check_invariants().unwrap();
        s.in_flight.as_mut().unwrap().forked = false;
        let e = s.check_invariants().unwrap_err();
        assert!(e.contains("writes positions 6..7 into a shared block"), "{e}");
        s.in_flight.as_mut().unwrap().forked = true;
        s.update(o.step_id, &vec![1; o.num_rows()]).unwrap();
        s.check_invariants().unwrap();
    }
}
