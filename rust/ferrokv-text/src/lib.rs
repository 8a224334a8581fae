//! ferrokv-text: vLLM-semantics incremental detokenization and stop-string detection over a
//! model's tokenizer.json, and the text layer that runs it on a scheduler's steps
//! (ferrokv-core does not depend on it: the core never sees text).
//!
//! * [`TextModel`]: the tokenizer, loaded once, shared by all sequences (`Send + Sync`).
//! * [`StopStrings`]: one request's text parameters (stop strings, include_stop_str_in_output,
//!   min_tokens, skip_special_tokens), built once and shared by its sequences through an `Arc`.
//! * [`SeqText`]: one sequence's incremental state; `append` per generated token, `flush` when
//!   the sequence ends for any reason other than a stop string, `take_delta` for streaming.
//! * [`SchedulerText`]: a scheduler's text layer, run right after `Scheduler::update`: it feeds
//!   the step's tokens to their sequences' `SeqText`s and ends sequences on stop strings.
//!
//! The semantics are those of `IncrementalDetokenizer` in python/ferrokv/detokenizer.py: for a
//! byte-level BPE tokenizer the text equals `decode(output_ids, skip_special_tokens)`; for a
//! SentencePiece-style one it equals `decode(context + output) - decode(context)` where the
//! context is the last 5 kept prompt ids; in both, less the tokens still pending when the
//! sequence ends (vLLM's). A character split across tokens is never emitted half-formed (held
//! until complete, or emitted as U+FFFD once more than `MAX_PENDING` tokens pend), and one still
//! incomplete at the end is dropped. Costs per token are independent of the output length (see each module's header).

mod model;
mod scheduler_text;
mod seq;
mod stop;

pub use model::{TextError, TextModel};
pub use scheduler_text::{EndedText, SchedulerText, StepDeltas};
pub use seq::{SeqText, MAX_PENDING, PROMPT_CONTEXT};
pub use stop::StopStrings;
