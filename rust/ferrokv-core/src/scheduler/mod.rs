//! Iteration-level scheduler with a token budget (vLLM V1 style). It decides *what* runs;
//! the KV-cache manager decides which blocks hold it, and the step-output module turns the
//! plan into the runner's arrays.
//!
//! Each `schedule()`:
//! 1. gives every running sequence what it still needs (one decode token, or the next prefill
//!    chunk), within `max_num_batched_tokens` (`preempt.rs`, the running walk). Decodes are
//!    planned by one rule (`decode.rs`): over the batch rows, without reaching a request, where
//!    the running order cannot change the outcome (the common step); otherwise requests are
//!    walked in order (priority, then arrival), and one whose blocks cannot be found preempts
//!    the lowest-priority, latest-arrived running request (the back of the list), possibly
//!    itself. Prefill chunks and copy-on-write writes go through the chunk planner (`admit.rs`).
//! 2. if nothing was preempted, admits waiting requests in order while their next chunk fits
//!    in the budget, in `max_num_seqs`, and in the free blocks minus a small watermark kept for
//!    running sequences to grow (`admit.rs`). The head of the queue blocks the rest.
//! 3. flattens the planned rows, in row order, into the arrays of `SchedulerOutput`
//!    (`output.rs`); when every running sequence is in the step the block tables are the batch
//!    matrix itself.
//!
//! Full blocks are registered in the prefix cache as soon as the step that computes them is
//! planned, in plan order, so that a request admitted later in the same step hits them
//! (`register.rs`; `cancel_step` undoes it).
//!
//! `update()` (`update.rs`) then appends one sampled token per logits row (staged in the rows),
//! decides stop conditions from per-row thresholds and frees finished sequences at once. Only
//! rows that need their sequence (a stop, a full stage, a fan-out) reach it.
//!
//! Invariants: the scheduler never touches reference counts or writes a block table (the
//! KV-cache manager does); a request that could never fit is rejected when added, so no step
//! spins on it; every running sequence owns one batch row, the only home of its computed
//! count, block table, tail block and staged tokens (`rows.rs` moves them in and out);
//! `check_invariants` (`invariants.rs`) verifies all of it.
//!
//! Costs: a step is O(running sequences) plus O(tokens and blocks that change): a decode row
//! costs a few loads and stores; block tables are never rebuilt. The number of waiting or
//! finished requests never enters it. Preemption scans nothing: the victim is the back of the
//! sorted running list.

mod admit;
mod cancel;
mod config;
mod decode;
mod invariants;
mod output;
mod preempt;
mod register;
mod rows;
mod stats;
mod update;
#[cfg(test)]
mod test_util;

pub use config::{Named, NewRequest, Policy, PreemptionMode, SchedulerConfig};
pub use stats::{KvCounts, KvUsage, SchedulerStats, STEP_TOKEN_BOUNDS};

use crate::batch::Batch;
use crate::block_pool::{BlockId, BlockMath};
use crate::error::{CoreError, CoreResult};
use crate::kv_cache_manager::{KvCacheManager, KvStats, Registration};
use crate::output::{FinishedSeq, RequestTimes, SchedulerOutput};
use crate::prefix_cache::ParentLink;
use crate::request::Request;
use crate::IdMap;
use std::collections::BTreeSet;

/// A step between `schedule` and `update` (or `cancel_step`). Its plan (tokens, sampling rows,
/// fan-outs) lives in the batch rows and moves with them.
struct InFlight {
    step_id: u64,
    num_logits_rows: usize,
    /// A fork since `schedule` legitimately shares blocks this step wrote.
    forked: bool,
    undo: StepUndo,
}

/// What `cancel_step` needs besides the rows' plans to undo a step whose forward pass (and
/// maybe its block ops) never completed. Requests are named by id: a slot may be reused.
#[derive(Debug, Default)]
struct StepUndo {
    /// GPU blocks the step's copy and swap-in ops were to fill.
    filled: Vec<u32>,
    /// Requests the step swapped out (their CPU copy may never have been made).
    swapped_out: Vec<u64>,
    /// Requests that forked or dropped a sequence while the step was in flight.
    reshaped: Vec<u64>,
    /// What the step's output reported, to report again after a cancel.
    finished_ids: Vec<i64>,
    preempted_ids: Vec<i64>,
    /// Sequences that registered blocks in the prefix cache, with their progress before.
    marks: Vec<(u64, Registration)>,
    /// Blocks the step registered (with their cache incarnation): their KV is the step's.
    registered: Vec<ParentLink>,
    /// Counters of computed work before the step.
    stats: SchedulerStats,
}


/// What the step being built holds so far.
#[derive(Debug, Default, Clone, Copy)]
struct StepCounts {
    seqs: usize,
    tokens: usize,
    logits_rows: usize,
    /// Single-token decodes (not a recompute chunk ending at the last token).
    decode_tokens: usize,
}

pub struct Scheduler {
    cfg: SchedulerConfig,
    kv: KvCacheManager,
    requests: Vec<Option<Request>>,
    free_slots: Vec<u32>,
    by_id: IdMap<u32>,
    seq_owner: IdMap<u32>,
    waiting: BTreeSet<(i64, u64, u32)>,
    running: Vec<u32>,
    num_running_seqs: usize,
    /// Sequence slots of the waiting (and swapped-out) requests: each of n samples counts, as
    /// vLLM's child requests do.
    num_waiting_seqs: usize,
    watermark_blocks: usize,
    next_arrival: u64,
    next_seq_id: u64,
    step_id: u64,
    in_flight: Option<InFlight>,
    /// Set while `update` or `cancel_step` runs: leaving rows are marked dead and compacted at
    /// its end (also while a step is in flight, so that its arrays stay valid).
    defer_row_removal: bool,
    /// The undo record of the step being planned.
    undo: StepUndo,
    /// Preemptions a cancelled step's output reported, for the next output.
    pending_preempted: Vec<i64>,
    batch: Batch,
    pending_finished: Vec<FinishedSeq>,
    ended_ids: Vec<i64>,
    ending: Vec<bool>,
    plan: Vec<(usize, usize)>,
    step: StepCounts,
    /// The output the all-decode path emitted: (buffers, rows emitted, widest table).
    emitted: Option<(SchedulerOutput, usize, usize)>,
    /// Reused list of rows the decode row pass gives a fresh block.
    scratch_rows: Vec<u32>,
    /// Reused list of planned rows that complete a block (registered in plan order).
    completing: Vec<u32>,
    /// Reused list of request slots, and a mark per slot (both empty between uses).
    scratch_slots: Vec<u32>,
    mark: Vec<bool>,
    bm: BlockMath,
    hits: Vec<Vec<BlockId>>,
    /// Per sequence of the request being planned: `hits` holds its first sample's blocks, to
    /// share (or it waits for them), not cache hits.
    shares: Vec<bool>,
    stats: SchedulerStats,
    /// The clock, read once at the start of `schedule`, `update` and `cancel_step`.
    ts: f64,
    /// Per request slot: when `update` last appended a token to it (its only home; the row
    /// pass writes it without reaching the request).
    last_token_ts: Vec<f64>,
}

impl Scheduler {
    pub fn new(cfg: SchedulerConfig) -> CoreResult<Self> {
        cfg.validate()?;
        let kv = KvCacheManager::try_new(cfg.num_blocks, cfg.block_size, cfg.num_cpu_blocks, cfg.enable_prefix_caching)?;
        let watermark_blocks = ((cfg.num_blocks - 1) as f64 * cfg.watermark) as usize;
        // Step ids are unique across scheduler instances, so update() can reject another
        // scheduler's output.
        static INSTANCES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
        let instance = INSTANCES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let batch = Batch::new(cfg.max_num_seqs, cfg.max_model_len.div_ceil(cfg.block_size)).ok_or_else(|| {
            CoreError::invalid("max_num_seqs", cfg.max_num_seqs, "the batch's block-table matrix cannot be allocated (lower it or max_model_len)")
        })?;
        Ok(Scheduler {
            bm: BlockMath::new(cfg.block_size),
            batch,
            cfg,
            kv,
            requests: Vec::new(),
            free_slots: Vec::new(),
            by_id: IdMap::default(),
            seq_owner: IdMap::default(),
            waiting: BTreeSet::new(),
            running: Vec::new(),
            num_running_seqs: 0,
            num_waiting_seqs: 0,
            watermark_blocks,
            next_arrival: 0,
            next_seq_id: 0,
            step_id: instance << 32,
            in_flight: None,
            defer_row_removal: false,
            undo: StepUndo::default(),
            pending_preempted: Vec::new(),
            pending_finished: Vec::new(),
            ended_ids: Vec::new(),
            ending: Vec::new(),
            plan: Vec::new(),
            step: StepCounts::default(),
            emitted: None,
            scratch_rows: Vec::new(),
            completing: Vec::new(),
            scratch_slots: Vec::new(),
            mark: Vec::new(),
            hits: Vec::new(),
            shares: Vec::new(),
            stats: SchedulerStats::default(),
            ts: 0.0,
            last_token_ts: Vec::new(),
        })
    }

    pub fn config(&self) -> &SchedulerConfig {
        &self.cfg
    }
    pub fn num_free_blocks(&self) -> usize {
        self.kv.num_free_blocks()
    }
    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }
    pub fn num_running(&self) -> usize {
        self.running.len()
    }
    pub fn num_running_seqs(&self) -> usize {
        self.num_running_seqs
    }

    /// Sequence slots of the waiting requests (a request's n samples count n).
    pub fn num_waiting_seqs(&self) -> usize {
        self.num_waiting_seqs
    }
    pub fn num_unfinished(&self) -> usize {
        self.by_id.len()
    }
    pub fn has_unfinished(&self) -> bool {
        !self.by_id.is_empty()
    }
    pub fn stats(&self) -> SchedulerStats {
        self.stats
    }
    pub fn kv_stats(&self) -> KvStats {
        self.kv.stats()
    }

    fn new_seq_id(&mut self) -> u64 {
        let id = self.next_seq_id;
        self.next_seq_id += 1;
        id
    }

    fn req(&self, slot: u32) -> &Request {
        self.requests[slot as usize].as_ref().expect("live slot")
    }

    pub fn schedule(&mut self) -> CoreResult<SchedulerOutput> {
        if self.in_flight.is_some() {
            return Err(CoreError::InvalidState {
                message: "schedule() called while a step is in flight: call update(output, sampled_token_ids) first".into(),
            });
        }
        debug_assert!(!self.batch.has_dead());
        self.ts = crate::clock::now();
        self.step_id += 1;
        self.stats.steps += 1;
        self.step = StepCounts::default();
        self.undo = StepUndo { stats: self.stats, ..StepUndo::default() };
        let budget = self.cfg.max_num_batched_tokens;
        let (budget, preempted) = self.schedule_running(budget);
        if preempted.is_empty() {
            self.admit_waiting(budget);
        }
        self.stats.max_running_seqs = self.stats.max_running_seqs.max(self.num_running_seqs as u64);
        self.stats.max_step_tokens = self.stats.max_step_tokens.max(self.step.tokens as u64);
        if self.step.tokens > 0 {
            self.stats.observe_step_tokens(self.step.tokens as u64);
        }
        let out = self.build_output(preempted);
        let mut undo = std::mem::take(&mut self.undo);
        if !out.copy_ops.is_empty() || !out.swap_in.is_empty() {
            undo.filled.extend(out.copy_ops.iter().skip(1).step_by(2).chain(out.swap_in.iter().skip(1).step_by(2)).map(|&b| b as u32));
        }
        (undo.finished_ids, undo.preempted_ids) = (out.finished_req_ids.clone(), out.preempted_req_ids.clone());
        self.in_flight = Some(InFlight { step_id: self.step_id, num_logits_rows: out.num_rows(), forked: false, undo });
        Ok(out)
    }

    /// Where request `slot` is (or belongs) in the running list, which is sorted by order key
    /// (keys are unique: arrivals are).
    fn running_index(&self, slot: u32) -> usize {
        let key = self.req(slot).order_key();
        self.running.partition_point(|&s| self.req(s).order_key() < key)
    }

    /// The id of the step between `schedule` and `update` (or `cancel_step`), if any: a caller
    /// interrupted before it held the step's output still finds the step to cancel.
    pub fn step_in_flight_id(&self) -> Option<u64> {
        self.in_flight.as_ref().map(|fl| fl.step_id)
    }

    /// The step in flight, if `step_id` names it (for `update` and `cancel_step`).
    fn step_in_flight(&self, call: &str, step_id: u64) -> CoreResult<&InFlight> {
        let Some(fl) = self.in_flight.as_ref() else {
            return Err(CoreError::InvalidState { message: format!("{call}() called with no step in flight: call schedule() first") });
        };
        if fl.step_id != step_id {
            let msg = format!("{call}() got the output of step {step_id}, but step {} is in flight", fl.step_id);
            return Err(CoreError::InvalidState { message: msg });
        }
        Ok(fl)
    }

    /// A live request's timestamps (`finished_ts` is 0.0: an ended request is gone; its
    /// times travel with its last `FinishedSeq`).
    pub fn request_times(&self, request_id: u64) -> CoreResult<RequestTimes> {
        let slot = *self.by_id.get(&request_id).ok_or(CoreError::UnknownRequest { request_id })?;
        Ok(self.req(slot).times(self.last_token_ts[slot as usize], 0.0))
    }

    fn locate_seq(&self, seq_id: u64) -> CoreResult<(u32, usize)> {
        let slot = *self.seq_owner.get(&seq_id).ok_or(CoreError::UnknownSequence { seq_id })?;
        let pos = self.req(slot).seq_pos(seq_id).ok_or(CoreError::UnknownSequence { seq_id })?;
        Ok((slot, pos))
    }



    /// Forgets all cached prefixes not in use (e.g. after a failed model step whose KV is
    /// suspect). In-use blocks keep serving their own sequences.
    pub fn reset_prefix_cache(&mut self) {
        self.kv.reset_prefix_cache();
    }
}

#[cfg(test)]
mod tests {
    use super::test_util::*;
    use super::*;

    fn is_state_error<T: std::fmt::Debug>(r: CoreResult<T>, fragment: &str) -> bool {
        matches!(&r, Err(CoreError::InvalidState { message }) if message.contains(fragment))
    }

    #[test]
    fn new_rejects_an_invalid_configuration() {
        let c = SchedulerConfig { max_num_batched_tokens: 4, max_num_seqs: 8, ..cfg(8, 4, 16) };
        assert!(matches!(Scheduler::new(c), Err(CoreError::InvalidArgument { field: "max_num_batched_tokens", .. })));
    }

    #[test]
    fn schedule_twice_without_update_is_a_state_error_and_keeps_the_first_step() {
        let mut s = with_requests(cfg(8, 4, 16), [req(1, 3, 2)]);
        let o = s.schedule().unwrap();
        assert!(is_state_error(s.schedule(), "in flight"));
        assert_eq!(s.stats().steps, 1);
        s.update(o.step_id, &[1]).unwrap();
        assert_eq!(s.seq_tokens(only_seq(&s, 1)).unwrap().len(), 4);
        s.check_invariants().unwrap();
    }

    #[test]
    fn update_with_no_step_in_flight_is_a_state_error() {
        let mut s = with_requests(cfg(8, 4, 16), [req(1, 3, 2)]);
        assert!(is_state_error(s.update(1, &[]), "no step in flight"));
        let o = s.schedule().unwrap();
        s.update(o.step_id, &[1]).unwrap();
        assert!(is_state_error(s.update(o.step_id, &[1]), "no step in flight"));
        assert_eq!(s.seq_tokens(only_seq(&s, 1)).unwrap().len(), 4, "the second update appended nothing");
    }

    #[test]
    fn update_with_another_steps_id_is_a_state_error_and_the_step_stays_in_flight() {
        let mut s = with_requests(cfg(8, 4, 16), [req(1, 3, 2)]);
        let mut other = with_requests(cfg(8, 4, 16), [req(1, 3, 2)]);
        let o = s.schedule().unwrap();
        let theirs = other.schedule().unwrap();
        assert_ne!(theirs.step_id, o.step_id, "step ids are unique across schedulers");
        let msg = format!("step {} is in flight", o.step_id);
        assert!(is_state_error(s.update(o.step_id + 1, &[1]), &msg));
        assert!(is_state_error(s.update(theirs.step_id, &[1]), &msg));
        s.check_invariants().unwrap();
        s.update(o.step_id, &[1]).unwrap();
        assert_eq!(s.seq_tokens(only_seq(&s, 1)).unwrap().len(), 4);
    }

    #[test]
    fn step_ids_are_consecutive_within_a_scheduler() {
        let mut s = with_requests(cfg(8, 4, 16), [req(1, 3, 4)]);
        let (a, _) = step(&mut s, 1);
        let (b, _) = step(&mut s, 1);
        let (c, _) = step(&mut s, 1);
        assert_eq!((b.step_id, c.step_id), (a.step_id + 1, a.step_id + 2));
    }

    #[test]
    fn the_step_in_flight_is_known_without_its_output_and_cancels_by_its_id() {
        let mut s = with_requests(cfg(8, 4, 16), [req(1, 3, 4)]);
        assert_eq!(s.step_in_flight_id(), None);
        let o = s.schedule().unwrap();
        assert_eq!(s.step_in_flight_id(), Some(o.step_id));
        s.cancel_step(s.step_in_flight_id().unwrap()).unwrap();
        assert_eq!((s.step_in_flight_id(), s.stats().cancelled_steps), (None, 1));
        let (again, _) = step(&mut s, 1);
        assert_eq!(again.step_id, o.step_id + 1);
        assert_eq!(s.step_in_flight_id(), None);
    }

    #[test]
    fn an_empty_step_plans_nothing_and_still_reports_what_ended() {
        let mut s = Scheduler::new(cfg(8, 4, 16)).unwrap();
        let (o, done) = step(&mut s, 1);
        assert!(o.is_empty() && done.is_empty());
        assert_eq!((o.num_seqs(), o.num_rows(), o.max_blocks), (0, 0, 0));
        assert_eq!((o.query_start_loc.clone(), bt(&o)), (vec![0], vec![]));
        assert_eq!(s.stats().steps, 1);
        s.add_request(req(4, 3, 1)).unwrap();
        let (_, done) = step(&mut s, 1); // prefill and its one token: done
        assert_eq!(done.len(), 1);
        let (o, _) = step(&mut s, 1);
        assert!(o.is_empty());
        assert_eq!(o.finished_req_ids, vec![4]);
        let (o, _) = step(&mut s, 1);
        assert!(o.finished_req_ids.is_empty(), "an ended request is reported once");
    }

    #[test]
    fn reset_prefix_cache_forgets_the_unused_cached_blocks() {
        let prompt: Vec<u32> = (0..13).collect();
        let mut s = with_requests(cfg(32, 4, 64), [NewRequest::new(1, prompt.clone(), 2)]);
        drain(&mut s, 1);
        assert_eq!(s.kv_counts().num_cached_blocks, 3);
        s.reset_prefix_cache();
        assert_eq!(s.kv_counts().num_cached_blocks, 0);
        s.add_request(NewRequest::new(2, prompt, 2)).unwrap();
        let (o, _) = step(&mut s, 1);
        assert_eq!(o.num_tokens(), 13, "nothing is served from the cache");
        assert_eq!(s.num_cached_tokens(2).unwrap(), 0);
    }

    fn ordered(t: &RequestTimes) -> bool {
        0.0 < t.queued_ts && t.queued_ts <= t.scheduled_ts && t.scheduled_ts <= t.first_token_ts && t.first_token_ts <= t.last_token_ts && t.last_token_ts <= t.finished_ts
    }

    #[test]
    fn request_times_are_recorded_in_order_and_travel_with_the_last_finished_record() {
        let mut s = with_requests(cfg(16, 4, 16), [NewRequest { n: 2, ..req(1, 3, 3) }, req(2, 5, 2)]);
        let t = s.request_times(1).unwrap();
        assert!(t.queued_ts > 0.0 && (t.scheduled_ts, t.first_token_ts, t.last_token_ts, t.finished_ts) == (0.0, 0.0, 0.0, 0.0));
        step(&mut s, 1); // both prefill and sample (request 1 fans out at update)
        let (t1, t2) = (s.request_times(1).unwrap(), s.request_times(2).unwrap());
        assert!(t1.first_token_ts > 0.0 && t1.first_token_ts == t1.last_token_ts && t1.first_token_ts == t2.first_token_ts);
        let (_, done) = step(&mut s, 1);
        let last = done.iter().find(|d| d.request_id == 2).unwrap();
        let t = last.times.expect("the request's last record carries its times");
        assert!(ordered(&t) && t.first_token_ts < t.last_token_ts && t.last_token_ts == t.finished_ts, "{t:?}");
        assert_eq!(t.queued_ts, t2.queued_ts);
        assert!(s.request_times(2).is_err(), "gone");
        let done = drain(&mut s, 1);
        assert_eq!(done.iter().map(|d| d.times.is_some()).collect::<Vec<_>>(), vec![false, true], "only on the record that ends the request");
        assert!(ordered(&done[1].times.unwrap()));
    }

    #[test]
    fn a_preempted_and_readmitted_request_keeps_its_first_scheduled_ts() {
        let mut s = with_requests(cfg(7, 2, 16), [req(1, 4, 8), req(2, 4, 8)]);
        step(&mut s, 1);
        let first = s.request_times(2).unwrap();
        assert!(first.scheduled_ts > 0.0);
        let mut readmitted = false;
        for _ in 0..20 {
            let (o, _) = step(&mut s, 1);
            if !o.preempted_req_ids.is_empty() {
                assert_eq!(s.request_times(2).unwrap().scheduled_ts, first.scheduled_ts);
            }
            if s.stats().recompute_preemptions > 0 && o.req_ids.contains(&2) {
                readmitted = true;
                let t = s.request_times(2).unwrap();
                assert_eq!((t.scheduled_ts, t.first_token_ts), (first.scheduled_ts, first.first_token_ts));
                assert!(t.last_token_ts >= first.last_token_ts);
                break;
            }
        }
        assert!(readmitted);
    }

    #[test]
    fn an_abort_sets_finished_ts() {
        // A request that forked mid-step is aborted by a cancel of the step, and reported.
        let mut s = with_requests(cfg(32, 4, 16), [req(1, 3, 8)]);
        step(&mut s, 5);
        let o = s.schedule().unwrap();
        s.fork_sequence(only_seq(&s, 1), Some(9)).unwrap();
        s.cancel_step(o.step_id).unwrap();
        let (_, done) = step(&mut s, 1);
        let t = done.iter().find(|d| d.request_finished).and_then(|d| d.times).unwrap();
        assert_eq!(done[1].reason, crate::request::FinishReason::Abort);
        assert!(ordered(&t), "{t:?}");
        // An abort before anything was scheduled: only queued and finished are set.
        let c = SchedulerConfig { enable_prefix_caching: false, ..cfg(5, 2, 16) };
        let mut s = with_requests(c, [req(1, 3, 5)]);
        for _ in 0..3 {
            step(&mut s, 1);
        }
        s.fork_sequence(only_seq(&s, 1), None).unwrap();
        let o = s.schedule().unwrap();
        s.cancel_step(o.step_id).unwrap(); // it waits to recompute two sequences that never fit
        let done = drain(&mut s, 1);
        let t = done.last().and_then(|d| d.times).unwrap();
        assert!(ordered(&t) && t.finished_ts > t.last_token_ts, "a capacity abort: {t:?}");
    }
}
