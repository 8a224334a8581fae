//! Requests, their sequences, and the stop conditions decided in Rust.
//!
//! A request owns one sequence until its prompt is prefilled; with `n > 1` it then fans out
//! into `n` sequences that share the prompt's blocks, and beam search may fork and drop
//! sequences at will. Every sequence holds its full token list (prompt + output), so a
//! recomputed or forked sequence needs nothing else.
//!
//! Invariants: a running sequence's computed count, block table and newest sampled tokens live
//! in its batch row only (`batch.rs`); `num_computed` is its count while it has no row (0
//! unless swapped out). A sequence's table covers `ceil(computed / block_size)` blocks.

use crate::kv_cache_manager::SeqKv;
use crate::output::RequestTimes;
use crate::sampling::SamplingSpec;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// EOS or a stop token id.
    Stop,
    /// `max_tokens` or `max_model_len` reached.
    Length,
    /// Aborted, dropped, or impossible to schedule.
    Abort,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Abort => "abort",
        }
    }
}

#[derive(Debug, Clone, Default)]
pub struct StopParams {
    pub max_tokens: usize,
    pub min_tokens: usize,
    pub eos_token_id: Option<u32>,
    pub stop_token_ids: Vec<u32>,
    pub ignore_eos: bool,
    /// Banned under `min_tokens` besides EOS and the stop ids; they stop nothing (the model's
    /// other EOS ids under `ignore_eos`: vLLM bans all of them).
    pub min_tokens_bans: Vec<u32>,
}

/// `StopParams` flattened for a running sequence, in terms of its total length, so that a decode
/// step decides most stops without reading the request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RowStop {
    /// EOS and stop tokens count from this total length on (prompt + min_tokens).
    pub min_len: u32,
    /// Length stop at this total length: min(prompt + max_tokens, max_model_len).
    pub stop_len: u32,
    /// The EOS token unless ignored.
    pub eos: Option<u32>,
    pub has_stop_ids: bool,
}

impl RowStop {
    pub fn new(p: &StopParams, prompt_len: usize, max_model_len: usize) -> Self {
        let clamp = |v: usize| v.min(u32::MAX as usize) as u32;
        RowStop {
            min_len: clamp(prompt_len.saturating_add(p.min_tokens)),
            stop_len: clamp(prompt_len.saturating_add(p.max_tokens).min(max_model_len)),
            eos: if p.ignore_eos { None } else { p.eos_token_id },
            has_stop_ids: !p.stop_token_ids.is_empty(),
        }
    }

    /// A cheap filter for `check`: false means `check` is `None` (it never looks up stop ids).
    #[inline]
    pub fn may_stop(&self, token: u32, total_len: u32) -> bool {
        total_len >= self.stop_len || (total_len >= self.min_len && (self.eos == Some(token) || self.has_stop_ids))
    }

    /// Why a sequence stops after appending `token` (it now has `total_len` tokens), if it does:
    /// EOS and stop tokens once `min_tokens` are out (EOS first, as in vLLM), then length.
    /// `stop_ids` is only called when the request has stop token ids. The one stop decider.
    #[inline]
    pub fn check(&self, token: u32, total_len: u32, stop_ids: impl FnOnce() -> bool) -> Option<(FinishReason, Option<u32>)> {
        if total_len >= self.min_len {
            if self.eos == Some(token) {
                return Some((FinishReason::Stop, None));
            }
            if self.has_stop_ids && stop_ids() {
                return Some((FinishReason::Stop, Some(token)));
            }
        }
        (total_len >= self.stop_len).then_some((FinishReason::Length, None))
    }
}

#[derive(Debug, Clone)]
pub struct Sequence {
    pub seq_id: u64,
    /// 0..n for parallel samples; fork order for beam candidates.
    pub sample_index: u32,
    pub tokens: Vec<u32>,
    /// Tokens whose KV is computed, while the sequence has no row (a running sequence's count
    /// lives in its batch row only).
    pub num_computed: usize,
    /// Its KV bookkeeping (its GPU block ids live in its batch row while it runs).
    pub kv: SeqKv,
    /// Its row in the persistent batch while running, else `batch::NO_ROW`.
    pub row: u32,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RequestState {
    Waiting,
    Running,
    /// Preempted by swapping: its sequences' blocks live in the CPU pool.
    Swapped,
}

#[derive(Debug, Clone)]
pub struct Request {
    pub request_id: u64,
    pub arrival: u64,
    pub priority: i32,
    pub n: u32,
    pub prompt_len: usize,
    pub stop: StopParams,
    /// How its sequences sample (copied into their batch rows).
    pub sampling: SamplingSpec,
    pub cache_salt: Option<Box<str>>,
    /// Token sequences its samples must never generate (`sampling::bad_word_bans`).
    pub bad_words: Box<[Vec<u32>]>,
    /// Its prompt is never read from the prefix cache (`NewRequest::skip_cache_hits`).
    pub skip_cache_hits: bool,
    pub seqs: Vec<Sequence>,
    pub state: RequestState,
    /// Set once the `n` samples have been forked off the prefilled prompt.
    pub fanned_out: bool,
    /// Sequence slots held in the batch whatever the live count (beam search reserves its width).
    pub reserved_seqs: u32,
    pub next_sample_index: u32,
    /// Prompt tokens served from the prefix cache at first admission.
    pub num_cached_tokens: Option<usize>,
    /// When it was added, first scheduled and got its first output token (`clock` seconds,
    /// 0.0 = not yet); its last token's time is the scheduler's (per slot, written by the row
    /// pass of `update`).
    pub queued_ts: f64,
    pub scheduled_ts: f64,
    pub first_token_ts: f64,
}

impl Request {
    /// Its timestamps, given the ones the scheduler keeps for it.
    pub fn times(&self, last_token_ts: f64, finished_ts: f64) -> RequestTimes {
        let (queued_ts, scheduled_ts, first_token_ts) = (self.queued_ts, self.scheduled_ts, self.first_token_ts);
        RequestTimes { queued_ts, scheduled_ts, first_token_ts, last_token_ts, finished_ts }
    }

    /// Sequence slots the request occupies once running (its `n` samples count before they exist).
    pub fn seq_slots(&self) -> usize {
        let held = if self.fanned_out { self.seqs.len() } else { self.seqs.len().max(self.n as usize) };
        held.max(self.reserved_seqs as usize)
    }

    /// Scheduling order: lower priority value first, then earlier arrival.
    pub fn order_key(&self) -> (i64, u64) {
        (self.priority as i64, self.arrival)
    }

    pub fn seq_pos(&self, seq_id: u64) -> Option<usize> {
        self.seqs.iter().position(|s| s.seq_id == seq_id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An independent statement of vLLM's stop rules in terms of the output length: EOS, then
    /// stop token ids, once `min_tokens` are out; then `max_tokens` or `max_model_len`.
    fn reference(p: &StopParams, token: u32, output_len: usize, total_len: usize, max_model_len: usize) -> Option<(FinishReason, Option<u32>)> {
        if output_len >= p.min_tokens {
            if !p.ignore_eos && p.eos_token_id == Some(token) {
                return Some((FinishReason::Stop, None));
            }
            if p.stop_token_ids.contains(&token) {
                return Some((FinishReason::Stop, Some(token)));
            }
        }
        (output_len >= p.max_tokens || total_len >= max_model_len).then_some((FinishReason::Length, None))
    }

    #[test]
    fn stop_conditions_follow_vllm_order_and_min_tokens() {
        let p = StopParams { max_tokens: 5, min_tokens: 2, eos_token_id: Some(0), stop_token_ids: vec![7], ignore_eos: false, ..Default::default() };
        // Prompt of 8 tokens, max_model_len 100; total = 8 + output length.
        let row = RowStop::new(&p, 8, 100);
        let check = |tok: u32, out: u32| row.check(tok, 8 + out, || p.stop_token_ids.contains(&tok));
        assert_eq!(check(0, 1), None); // EOS before min_tokens is ignored
        assert_eq!(check(0, 2), Some((FinishReason::Stop, None)));
        assert_eq!(check(7, 3), Some((FinishReason::Stop, Some(7))));
        assert_eq!(check(3, 5), Some((FinishReason::Length, None)));
        assert_eq!(check(3, 3), None);
        assert_eq!(RowStop::new(&p, 97, 100).check(3, 100, || false), Some((FinishReason::Length, None)));
        let q = StopParams { ignore_eos: true, ..p };
        assert_eq!(RowStop::new(&q, 8, 100).check(0, 11, || false), None);
    }

    #[test]
    fn row_stop_decides_exactly_like_stop_params() {
        let max_model_len = 40;
        for prompt_len in [1usize, 5, 39] {
            for (max_tokens, min_tokens) in [(1, 0), (3, 2), (7, 7), (100, 0)] {
                for (eos, ignore_eos) in [(None, false), (Some(0), false), (Some(0), true), (Some(u32::MAX), false)] {
                    for stops in [vec![], vec![2, 7]] {
                        let p = StopParams { max_tokens, min_tokens, eos_token_id: eos, stop_token_ids: stops, ignore_eos, ..Default::default() };
                        let row = RowStop::new(&p, prompt_len, max_model_len);
                        for out_len in 1..=max_tokens.min(50) {
                            let total = prompt_len + out_len;
                            for tok in [0u32, 1, 2, 7, u32::MAX] {
                                let want = reference(&p, tok, out_len, total, max_model_len);
                                let have = row.check(tok, total as u32, || p.stop_token_ids.contains(&tok));
                                assert_eq!(have, want, "{p:?} prompt {prompt_len} out {out_len} tok {tok}");
                                if want.is_some() {
                                    assert!(row.may_stop(tok, total as u32), "the filter hides a stop: {p:?} out {out_len} tok {tok}");
                                }
                            }
                        }
                    }
                }
            }
        }
    }
}
