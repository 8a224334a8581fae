//! `SchedulerText`: the text layer of a `ferrokv_core::Scheduler`. It keeps each text request's
//! parameters and prompt tail and each live sequence's `SeqText`; run after `Scheduler::update`
//! (at once, or deferred while the next step runs) with the step's sampled tokens, it
//! detokenizes them, ends the sequences whose text reached a stop string (`Scheduler::stop_sequence`, no round trip through the
//! caller) and gives the text of every sequence that ended.
//!
//! Invariants: the tokens are the ones the core appended (the step's sampled ids of its logits
//! rows), so a sequence's tokens have one home, the core; this layer keeps no token list, only
//! each sequence's small decoding window and its emitted text. A request registered here keeps
//! its state until the record that ends it (`request_finished`) passes through `end`; a sequence
//! has a `SeqText` from its first token until its record passes. The token that ended a sequence
//! by EOS or a stop token id is not decoded (vLLM keeps it out of the text); a sequence that
//! reached its length on the token that completed a stop string ends on the string ("stop").
//! Costs per step: per sampling row a liveness probe of the core, one lookup of the sequence's
//! entry (its request's too at its first token) and one `SeqText::append`; per ended
//! sequence its text is moved out once. Nothing grows with the output length but the text.

use std::sync::Arc;

use ferrokv_core::{FinishReason, FinishedSeq, IdMap, Scheduler};

use crate::{SeqText, StopStrings, TextModel};

/// Prompt ids kept per request as decoding context for its sequences' first tokens.
const PROMPT_TAIL: usize = 7;

struct RequestText {
    params: Arc<StopStrings>,
    prompt_tail: Vec<u32>,
    /// It wants text deltas every step (CUMULATIVE / DELTA outputs).
    stream: bool,
    /// False: its tokens are never decoded (`detokenize=False`): its text stays empty and its
    /// streaming rows get empty deltas.
    detokenize: bool,
}

/// The text of one sequence that ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EndedText {
    pub text: String,
    /// What `take_delta` had not handed out yet.
    pub delta: String,
    pub stop_string: Option<String>,
}

/// One step's streaming rows (of requests that stream, whose sequence got a token and goes on)
/// and their text deltas.
#[derive(Debug, Default)]
pub struct StepDeltas {
    pub rows: Vec<i64>,
    pub deltas: Vec<String>,
}

/// The text layer of one scheduler (see the module header).
pub struct SchedulerText {
    model: Arc<TextModel>,
    requests: IdMap<RequestText>,
    seqs: IdMap<SeqState>,
}

/// A live sequence's text state, with what a step needs of its request (so that a row touches
/// only this entry).
struct SeqState {
    text: SeqText,
    /// Its request wants text deltas every step.
    stream: bool,
}

impl SchedulerText {
    pub fn new(model: Arc<TextModel>) -> Self {
        SchedulerText { model, requests: IdMap::default(), seqs: IdMap::default() }
    }

    pub fn model(&self) -> &Arc<TextModel> {
        &self.model
    }

    /// Registers a request the scheduler has just taken.
    pub fn add_request(&mut self, request_id: u64, params: StopStrings, prompt: &[u32], stream: bool, detokenize: bool) {
        debug_assert!(detokenize || params.stop().is_empty(), "stop strings need text");
        let tail = if detokenize { prompt[prompt.len().saturating_sub(PROMPT_TAIL)..].to_vec() } else { Vec::new() };
        self.requests.insert(request_id, RequestText { params: Arc::new(params), prompt_tail: tail, stream, detokenize });
    }

    /// Whether request `rid`'s text takes the EOS or stop token id that ended a sequence
    /// (`include_stop_str_in_output`, as vLLM's detokenizer; a special token still obeys
    /// `skip_special_tokens`). Looked up only on a sequence's last token.
    fn keeps_stop_token(&self, rid: u64) -> bool {
        self.requests.get(&rid).is_some_and(|q| q.params.include_stop_str_in_output())
    }

    /// Requests and sequences with text state (for leak checks).
    pub fn len(&self) -> (usize, usize) {
        (self.requests.len(), self.seqs.len())
    }

    /// Detokenizes the tokens `update` appended (`sampled[r]` for the sequence `row_seqs[r]` of
    /// request `row_reqs[r]`), ends sequences on stop strings (their records join `finished`;
    /// a length stop on the same token becomes the string's stop) and returns the streaming
    /// rows' deltas and, per record of `finished`, its text.
    pub fn after_update(
        &mut self,
        sched: &mut Scheduler,
        row_reqs: &[i64],
        row_seqs: &[i64],
        sampled: &[i64],
        finished: &mut Vec<FinishedSeq>,
    ) -> (StepDeltas, Vec<Option<EndedText>>) {
        let mut step = StepDeltas::default();
        let mut ended: IdMap<usize> = finished.iter().enumerate().map(|(i, f)| (f.seq_id, i)).collect();
        for r in 0..row_seqs.len().min(row_reqs.len()).min(sampled.len()) {
            let (rid, sid) = (row_reqs[r] as u64, row_seqs[r] as u64);
            let f = if ended.is_empty() { None } else { ended.get(&sid).copied() };
            if f.is_some_and(|i| finished[i].reason == FinishReason::Stop && finished[i].stop_str.is_none())
                && !self.keeps_stop_token(rid)
            {
                continue; // EOS or a stop token id: kept out of the text, unless include_stop_str_in_output (vLLM)
            }
            if f.is_none() && !sched.is_live_seq(sid) {
                continue; // ended mid-step (a stop string found a step late): `update` ignored its row
            }
            // A sequence's first token (or one of a request without text state) looks its
            // request up; every later one touches only the sequence's own entry.
            if !self.seqs.contains_key(&sid) && !self.start_seq(rid, sid, f.is_none(), r, &mut step) {
                continue;
            }
            let Some(seq) = self.seqs.get_mut(&sid) else { continue };
            if seq.text.stop_index().is_some() {
                continue;
            }
            if let Some(k) = seq.text.append(&self.model, sampled[r] as u32) {
                match f {
                    Some(i) => {
                        let rec = &mut finished[i];
                        (rec.reason, rec.stop_str, rec.stop_token) = (FinishReason::Stop, Some(k), None);
                    }
                    // Run deferred, the sequence may have ended since (a capacity abort by the
                    // next schedule): an Err is ignored, as its record, reported later, ends its text.
                    None => {
                        if let Ok(rec) = sched.stop_sequence(sid, k) {
                            ended.insert(sid, finished.len());
                            finished.push(rec);
                        }
                    }
                }
            } else if f.is_none() && seq.stream {
                step.rows.push(r as i64);
                step.deltas.push(seq.text.take_delta().to_owned());
            }
        }
        let texts = self.end(finished);
        (step, texts)
    }

    /// Gives sequence `sid` of request `rid` its text state at its first token; false when it
    /// gets none: its request has no text state (beam search, or ended), or does not detokenize
    /// (a streaming row, `goes_on`, then gets an empty delta at row `r`).
    fn start_seq(&mut self, rid: u64, sid: u64, goes_on: bool, r: usize, step: &mut StepDeltas) -> bool {
        let Some(req) = self.requests.get(&rid) else {
            return false;
        };
        if !req.detokenize {
            if goes_on && req.stream {
                step.rows.push(r as i64);
                step.deltas.push(String::new());
            }
            return false;
        }
        let text = SeqText::new(&self.model, req.params.clone(), &req.prompt_tail);
        self.seqs.insert(sid, SeqState { text, stream: req.stream });
        true
    }

    /// The text of each ended sequence of `finished` (None for a request without text), its
    /// state dropped; a sequence that did not stop on a string is flushed first.
    pub fn end(&mut self, finished: &[FinishedSeq]) -> Vec<Option<EndedText>> {
        finished.iter().map(|f| self.end_one(f)).collect()
    }

    fn end_one(&mut self, f: &FinishedSeq) -> Option<EndedText> {
        let seq = self.seqs.remove(&f.seq_id).map(|s| s.text);
        let req = if f.request_finished { self.requests.remove(&f.request_id) } else { None };
        let params = match (&seq, &req) {
            (Some(s), _) => s.params().clone(),
            (None, Some(r)) => r.params.clone(),
            (None, None) => self.requests.get(&f.request_id)?.params.clone(),
        };
        let Some(mut seq) = seq else {
            // It ended before its first token (an abort, a capacity abort).
            return Some(EndedText { text: String::new(), delta: String::new(), stop_string: None });
        };
        if seq.stop_index().is_none() {
            seq.flush(&self.model);
        }
        let delta = seq.take_delta().to_owned();
        let stop_string = seq.stop_index().map(|k| params.stop()[k as usize].clone());
        Some(EndedText { text: seq.text().to_owned(), delta, stop_string })
    }

    /// Forgets a sequence ended without a record (`Scheduler::drop_sequence`); and its request
    /// when it was the last.
    pub fn forget(&mut self, request_id: u64, seq_id: u64, request_ended: bool) {
        self.seqs.remove(&seq_id);
        if request_ended {
            self.requests.remove(&request_id);
        }
    }
}
