//! What one scheduling step hands the model runner, and what `update` reports back.
//!
//! Layout (S scheduled sequences, T tokens, R sampling rows, M = max blocks in the batch):
//! - per sequence: `req_ids[S]`, `seq_ids[S]`, `query_start_loc[S+1]`, `seq_lens[S]` (context
//!   length after this step), `prompt_lens[S]` (its prompt's length), block tables `[S, M]` padded with the null block 0: when every
//!   running sequence is in the step (the usual case) they are rows `0..S` of the scheduler's
//!   persistent batch matrix, read in place (`Scheduler::batch_table`) until `update`;
//!   otherwise a compact row-major copy;
//! - per token: `input_ids[T]`, `positions[T]`, `slot_mapping[T]` (block * block_size + offset;
//!   the core never pads, -1 is reserved for padding a runner adds);
//! - per sampling row: `logits_indices[R]` (a token index; one row may be sampled several
//!   times, once per sample of an `n > 1` request), `row_req_ids[R]`, `row_seq_ids[R]`,
//!   `row_sample_index[R]`;
//! - block ops to run before the forward pass, in order swap-out, swap-in, copy, as flat pairs.
//!
//! Every other buffer is a plain `Vec` so the bindings can hand it to numpy without copying.

use crate::request::FinishReason;
use crate::sampling::SamplingColumns;

#[derive(Debug, Default, Clone)]
pub struct SchedulerOutput {
    pub step_id: u64,
    pub block_size: usize,
    pub req_ids: Vec<i64>,
    pub seq_ids: Vec<i64>,
    pub query_start_loc: Vec<i32>,
    pub seq_lens: Vec<i32>,
    pub prompt_lens: Vec<i32>,
    pub block_tables: BlockTables,
    /// M, the widest block table in the step.
    pub max_blocks: usize,
    pub input_ids: Vec<i64>,
    pub positions: Vec<i64>,
    pub slot_mapping: Vec<i64>,
    pub logits_indices: Vec<i64>,
    pub row_req_ids: Vec<i64>,
    pub row_seq_ids: Vec<i64>,
    pub row_sample_index: Vec<i32>,
    /// Per sampling row: its sampling parameters, uniform draw and `min_tokens` bans.
    pub sampling: SamplingColumns,
    /// Flattened (src, dst) pairs.
    pub copy_ops: Vec<i32>,
    /// Flattened (gpu_block, cpu_block) pairs.
    pub swap_out: Vec<i32>,
    /// Flattened (cpu_block, gpu_block) pairs.
    pub swap_in: Vec<i32>,
    /// Requests that ended (finished, aborted) since the previous step.
    pub finished_req_ids: Vec<i64>,
    /// Requests preempted in this step.
    pub preempted_req_ids: Vec<i64>,
    pub num_prefill_tokens: usize,
    pub num_decode_tokens: usize,
}

/// Where a step's `[S, M]` block tables are.
#[derive(Debug, Clone)]
pub enum BlockTables {
    /// Rows `0..S`, columns `0..M` of the batch matrix (`Scheduler::batch_table`).
    Batch,
    /// A row-major `S * M` copy.
    Owned(Vec<i32>),
}

impl Default for BlockTables {
    fn default() -> Self {
        BlockTables::Owned(Vec::new())
    }
}

impl SchedulerOutput {
    pub fn num_seqs(&self) -> usize {
        self.seq_ids.len()
    }
    pub fn num_tokens(&self) -> usize {
        self.input_ids.len()
    }
    pub fn num_rows(&self) -> usize {
        self.logits_indices.len()
    }
    pub fn is_empty(&self) -> bool {
        self.input_ids.is_empty()
    }
}

/// A sequence that ended, as reported by `update` (and by forks that ended at once).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FinishedSeq {
    pub request_id: u64,
    pub seq_id: u64,
    pub sample_index: u32,
    pub reason: FinishReason,
    /// The stop token id when a `stop_token_ids` entry ended the sequence.
    pub stop_token: Option<u32>,
    /// Which of the request's stop strings ended it (`Scheduler::stop_sequence`): the core
    /// never sees text, its caller's text layer decides these.
    pub stop_str: Option<u32>,
    /// True for the last sequence of its request: the request is gone from the scheduler.
    pub request_finished: bool,
    /// Its generated tokens, moved out of the sequence as it ends (their only home until then).
    pub output_tokens: Vec<u32>,
    /// Its request's prompt tokens served from the prefix cache at first admission (0 if never
    /// admitted).
    pub num_cached_tokens: usize,
    /// The request's timestamps, on the record with `request_finished` (it is gone after it).
    pub times: Option<RequestTimes>,
}

/// The generated part of a sequence's token list: its prompt dropped, in place.
pub(crate) fn output_part(mut tokens: Vec<u32>, prompt_len: usize) -> Vec<u32> {
    tokens.drain(..prompt_len.min(tokens.len()));
    tokens
}

/// When a request reached each stage, in seconds on `clock::now()`'s scale (Python's
/// `time.monotonic()`); 0.0 = not yet.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct RequestTimes {
    /// `add_request`.
    pub queued_ts: f64,
    /// The first step that scheduled any of its tokens (a readmission keeps it).
    pub scheduled_ts: f64,
    /// The `update` that appended its first output token.
    pub first_token_ts: f64,
    /// The latest `update` that appended a token to it.
    pub last_token_ts: f64,
    /// When it ended (stop, length, abort).
    pub finished_ts: f64,
}

/// Timestamps are finite (never NaN), so equality is an equivalence (`FinishedSeq` is `Eq`).
impl Eq for RequestTimes {}
