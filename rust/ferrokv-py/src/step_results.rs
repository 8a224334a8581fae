//! Deferred step results: `update` appends a step's tokens and keeps what its text layer needs
//! (the rows' ids, the sampled ids, the ended sequences' records); the text work runs later: in
//! `take_step_results` (`defer_text=True`: an overlapped engine calls it while the next step's
//! forward pass runs), or before `update` returns. One path either way.
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
    /// The last processed step's row buffers, reused by the next (no allocation per step).
    spare: Option<DeferredStep>,
}

impl Deferred {
    /// A step's results are deferred or processed and not taken yet.
    pub(crate) fn is_untaken(&self) -> bool {
        self.step.is_some() || self.ready.is_some()
    }

    /// An empty step in reused buffers, to fill and `defer` (or `give_back`).
    pub(crate) fn spare_step(&mut self) -> DeferredStep {
        let mut s = self.spare.take().unwrap_or(DeferredStep {
            row_reqs: Vec::new(),
            row_seqs: Vec::new(),
            sampled: Vec::new(),
            done: Vec::new(),
        });
        s.row_reqs.clear();
        s.row_seqs.clear();
        s.sampled.clear();
        s.done.clear();
        s
    }

    /// Keeps an unused step's buffers for the next one.
    pub(crate) fn give_back(&mut self, step: DeferredStep) {
        self.spare = Some(step);
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
        let (deltas, texts) = match text.as_mut() {
            Some(t) => {
                let (deltas, texts) = t.after_update(sched, &s.row_reqs, &s.row_seqs, &s.sampled, &mut s.done);
                (deltas, Some(texts))
            }
            None => (StepDeltas::default(), None),
        };
        let records = std::mem::take(&mut s.done);
        debug_assert!(self.ready.is_none());
        self.ready = Some(StepResults { records, texts, deltas });
        self.spare = Some(s);
    }

    /// The processed results (flush first); empty when no step was deferred.
    pub(crate) fn take(&mut self) -> StepResults {
        self.ready.take().unwrap_or_default()
    }
}
