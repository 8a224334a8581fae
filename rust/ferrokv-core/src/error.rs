//! Typed errors for bad user input and API misuse.
//!
//! Invariants: every variant that a user can trigger names the offending field and value in its
//! message. Broken internal invariants are never reported here (they are `debug_assert!`s), and
//! "out of blocks" is never an error (it is an `Option`/`bool` handled by the scheduler).

use std::fmt;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CoreError {
    /// A field has a value outside its domain.
    InvalidArgument { field: &'static str, value: String, reason: String },
    /// `add_request` with an id that is still live.
    DuplicateRequest { request_id: u64 },
    /// An id that names no live request.
    UnknownRequest { request_id: u64 },
    /// An id that names no live sequence.
    UnknownSequence { seq_id: u64 },
    /// The prompt does not fit in `max_model_len`.
    PromptTooLong { len: usize, max_model_len: usize },
    /// The request could never fit in the KV cache, even alone.
    /// `seqs`: the sequences it may run at once (n, or a beam search's slots: `beam`).
    ExceedsCacheCapacity {
        request_id: u64,
        blocks_needed: usize,
        blocks_available: usize,
        prompt_len: usize,
        max_tokens: usize,
        seqs: usize,
        block_size: usize,
        beam: bool,
    },
    /// Calls made out of order (e.g. `schedule()` twice without `update()`).
    InvalidState { message: String },
}

impl CoreError {
    /// The request field the error blames, if any: an `ExceedsCacheCapacity` blames the prompt
    /// when it overflows the cache alone, else `max_tokens`.
    pub fn field(&self) -> Option<&'static str> {
        match self {
            CoreError::InvalidArgument { field, .. } => Some(field),
            CoreError::PromptTooLong { .. } => Some("prompt_token_ids"),
            CoreError::ExceedsCacheCapacity { blocks_available, prompt_len, block_size, .. } => {
                Some(if prompt_len.div_ceil((*block_size).max(1)) > *blocks_available {
                    "prompt_token_ids"
                } else {
                    "max_tokens"
                })
            }
            _ => None,
        }
    }

    pub fn invalid(field: &'static str, value: impl fmt::Display, reason: impl Into<String>) -> Self {
        CoreError::InvalidArgument { field, value: value.to_string(), reason: reason.into() }
    }
}

impl fmt::Display for CoreError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CoreError::InvalidArgument { field, value, reason } => {
                write!(f, "invalid {field}={value}: {reason}")
            }
            CoreError::DuplicateRequest { request_id } => {
                write!(f, "duplicate request_id={request_id}: a live request already uses this id")
            }
            CoreError::UnknownRequest { request_id } => {
                write!(f, "unknown request_id={request_id}: no live request has this id")
            }
            CoreError::UnknownSequence { seq_id } => {
                write!(f, "unknown seq_id={seq_id}: no live sequence has this id")
            }
            CoreError::PromptTooLong { len, max_model_len } => write!(
                f,
                "prompt_token_ids has length {len}, which exceeds max_model_len={max_model_len}"
            ),
            CoreError::ExceedsCacheCapacity {
                request_id,
                blocks_needed,
                blocks_available,
                prompt_len,
                max_tokens,
                seqs,
                block_size,
                beam,
            } => {
                if self.field() == Some("prompt_token_ids") {
                    let prompt_blocks = prompt_len.div_ceil((*block_size).max(1));
                    return write!(
                        f,
                        "request_id={request_id}: its prompt of {prompt_len} tokens alone needs {prompt_blocks} KV \
                         blocks of {block_size} tokens, but the cache holds {blocks_available}; shorten the prompt \
                         or enlarge the KV cache"
                    );
                }
                let (what, knob) =
                    if *beam { ("beam search sequences (2 * beam_width - 1)", "beam_width") } else { ("sequence(s)", "n") };
                write!(
                    f,
                    "request_id={request_id} needs up to {blocks_needed} KV blocks of {block_size} tokens \
                     ({seqs} {what} of its {prompt_len}-token prompt + max_tokens={max_tokens}) but the cache \
                     can only ever give it {blocks_available}; lower max_tokens or {knob}, or enlarge the KV cache"
                )
            }
            CoreError::InvalidState { message } => write!(f, "{message}"),
        }
    }
}

impl std::error::Error for CoreError {}

pub type CoreResult<T> = Result<T, CoreError>;
