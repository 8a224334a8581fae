//! Helpers shared by the scheduler's unit tests.

use super::{NewRequest, PreemptionMode, Scheduler, SchedulerConfig};
use crate::batch::NO_ROW;
use crate::output::{BlockTables, FinishedSeq, SchedulerOutput};

pub(super) fn cfg(num_blocks: usize, block_size: usize, budget: usize) -> SchedulerConfig {
    SchedulerConfig {
        num_blocks,
        block_size,
        max_num_seqs: budget.min(8),
        max_num_batched_tokens: budget,
        max_model_len: 1024,
        watermark: 0.0,
        admission_headroom: 0.0,
        ..Default::default()
    }
}

pub(super) fn bt(o: &SchedulerOutput) -> Vec<i32> {
    match &o.block_tables {
        BlockTables::Owned(v) => v.clone(),
        BlockTables::Batch => panic!("copy the block tables out before update"),
    }
}

pub(super) fn req(id: u64, prompt_len: usize, max_tokens: usize) -> NewRequest {
    NewRequest::new(id, (0..prompt_len as u32).map(|t| 100 + t + id as u32 * 1000).collect(), max_tokens)
}

/// A scheduler on `c` with `reqs` added (not yet scheduled).
pub(super) fn with_requests(c: SchedulerConfig, reqs: impl IntoIterator<Item = NewRequest>) -> Scheduler {
    let mut s = Scheduler::new(c).unwrap();
    for r in reqs {
        s.add_request(r).unwrap();
    }
    s
}

/// One step with every row sampling `tok`; returns the output (its block tables copied out
/// of the batch before `update`) and what finished.
pub(super) fn step(s: &mut Scheduler, tok: i64) -> (SchedulerOutput, Vec<FinishedSeq>) {
    let mut out = s.schedule().unwrap();
    s.check_invariants().unwrap();
    out.block_tables = BlockTables::Owned(s.block_tables(&out).unwrap());
    let done = s.update(out.step_id, &vec![tok; out.num_rows()]).unwrap();
    s.check_invariants().unwrap();
    (out, done)
}

/// Preempts request `id` between steps, as the next `schedule`'s walk would before planning
/// it: out of the running list, its rows unplanned.
pub(super) fn preempt_between_steps(s: &mut Scheduler, id: u64) {
    preempt_as_between_steps(s, id, s.cfg.preemption_mode);
}

/// `preempt_between_steps` in `mode` (swap falls back to recompute when the CPU pool is full).
pub(super) fn preempt_as_between_steps(s: &mut Scheduler, id: u64, mode: PreemptionMode) {
    let slot = s.by_id[&id];
    s.running.retain(|&r| r != slot);
    for q in &s.requests[slot as usize].as_ref().expect("live slot").seqs {
        s.batch.rows[q.row as usize].new_tokens = 0;
    }
    s.preempt_as(slot, mode);
}

/// Steps (every row sampling `tok`) until no request is left; returns what finished.
pub(super) fn drain(s: &mut Scheduler, tok: i64) -> Vec<FinishedSeq> {
    let mut done = Vec::new();
    for _ in 0..10_000 {
        if !s.has_unfinished() {
            return done;
        }
        done.extend(step(s, tok).1);
    }
    panic!("the scheduler did not drain");
}

/// The block tables of live request `request_id`'s sequences.
pub(super) fn block_tables_of(s: &Scheduler, request_id: u64) -> Vec<Vec<u32>> {
    s.request_seq_ids(request_id).unwrap().iter().map(|&q| s.seq_block_table(q).unwrap()).collect()
}

/// The only sequence of live request `request_id`.
pub(super) fn only_seq(s: &Scheduler, request_id: u64) -> u64 {
    let ids = s.request_seq_ids(request_id).unwrap();
    assert_eq!(ids.len(), 1, "request {request_id} has {} sequences", ids.len());
    ids[0]
}

/// The batch row of running sequence `seq_id`.
pub(super) fn row_of(s: &Scheduler, seq_id: u64) -> usize {
    let (slot, pos) = s.locate_seq(seq_id).unwrap();
    let row = s.req(slot).seqs[pos].row;
    assert_ne!(row, NO_ROW, "seq {seq_id} has no row");
    row as usize
}
