//! Helpers shared by the scheduler's unit tests.

use super::{NewRequest, Scheduler, SchedulerConfig};
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
        BlockTables::Batch { .. } => panic!("copy the block tables out before update"),
    }
}

pub(super) fn req(id: u64, prompt_len: usize, max_tokens: usize) -> NewRequest {
    NewRequest::new(id, (0..prompt_len as u32).map(|t| 100 + t + id as u32 * 1000).collect(), max_tokens)
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
