//! Deferred step results: `update(..., defer_text=True)` appends a step's tokens and keeps what
//! its text layer needs (the rows' ids, the sampled ids, the ended sequences' records); the
//! text work runs later, in `take_step_results`, which an overlapped engine calls while the
//! next step's forward pass runs.
//!
//! Invariants: at most one step is deferred and at most one processed result waits to be
//! taken; any call that changes the scheduler's sequences (update, cancel_step, abort,
//! stop_sequence, fork, drop) first processes the deferred step (`flush`), so its text sees the
//! sequences as `update` left them, or later (a stop string may then end a sequence the next
//! step planned: `Scheduler::stop_sequence` allows it). `schedule` does not flush: that is the
//! point of deferring. Costs: the step's text work, once, with the GIL released.

use ferrokv_core::{FinishedSeq, Scheduler};
use ferrokv_text::{EndedText, SchedulerText, StepDeltas};

/// A step whose tokens were appended and whose text work waits.
pub(crate) struct DeferredStep {
    pub(crate) row_reqs: Vec<i64>,
    pub(crate) row_seqs: Vec<i64>,
    pub(crate) sampled: Vec<i64>,
    pub(crate) done: Vec<FinishedSeq>,
}

/// A processed step, waiting to be taken: its records (with their texts when the text layer
/// gave some), its streaming rows and their deltas.
#[derive(Default)]
pub(crate) struct StepResults {
    pub(crate) records: Vec<FinishedSeq>,
    pub(crate) texts: Option<Vec<Option<EndedText>>>,
    pub(crate) deltas: StepDeltas,
}

#[derive(Default)]
pub(crate) struct Deferred {
    step: Option<DeferredStep>,
    ready: Option<StepResults>,
}

impl Deferred {
    /// A step's results are deferred or processed and not taken yet.
    pub(crate) fn is_untaken(&self) -> bool {
        self.step.is_some() || self.ready.is_some()
    }

    pub(crate) fn defer(&mut self, step: DeferredStep) {
        debug_assert!(!self.is_untaken());
        self.step = Some(step);
    }

    /// Runs the deferred step's text work, if any (call without the GIL).
    pub(crate) fn flush(&mut self, sched: &mut Scheduler, text: &mut Option<SchedulerText>) {
        let Some(mut s) = self.step.take() else {
            return;
        };
        let results = match text.as_mut() {
            Some(t) => {
                let (deltas, texts) = t.after_update(sched, &s.row_reqs, &s.row_seqs, &s.sampled, &mut s.done);
                StepResults { records: s.done, texts: Some(texts), deltas }
            }
            None => StepResults { records: s.done, texts: None, deltas: StepDeltas::default() },
        };
        debug_assert!(self.ready.is_none());
        self.ready = Some(results);
    }

    /// The processed results (flush first); empty when no step was deferred.
    pub(crate) fn take(&mut self) -> StepResults {
        self.ready.take().unwrap_or_default()
    }
}
