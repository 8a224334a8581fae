//! `SeqText`: one sequence's incremental detokenizer, a line-for-line port of
//! `IncrementalDetokenizer` (python/ferrokv/detokenizer.py, the spec).
//!
//! Invariants:
//! * `window` holds kept ids only (known, and not a skipped special); `window[..read]` is context
//!   already emitted (at first: up to 5 prompt ids), `window[read..]` is pending (at first: the
//!   prompt ids of a character the prompt ends in, which the output completes). A new token
//!   decodes `window[..read]` (cached as its character count) and `window`; the new text is the
//!   characters past the prefix's count. It is held back while the decode ends in U+FFFD (an
//!   incomplete character) and fewer than `MAX_PENDING` tokens pend, or while it adds no
//!   character; otherwise it is emitted and the window slides to the just-emitted ids.
//! * Byte-level fast path (the same text, fewer decodes): while the prefix's bytes end clean
//!   (`prefix_clean`: their last UTF-8 chunk has no invalid tail, so a lossy decode of more bytes
//!   never reaches back into them), decode(window) is decode(prefix) followed by
//!   decode(window[read..]): only the pending tokens are decoded, and a lone pending token whose
//!   bytes are valid UTF-8 is its own new text (no decode at all).
//! * The text is final once emitted (see stop.rs for held-back stop-string prefixes); the
//!   concatenation of all `take_delta` results is `text()`.
//! * After a stop string no token is accepted (`append` is a no-op, a debug assertion).
//! * Like the Python path (and vLLM), the caller does not append the EOS / `stop_token_ids`
//!   token that ended a sequence (it is not part of the text and is not counted here), and calls
//!   `flush` when a sequence ends for any reason other than a stop string: pending tokens are then
//!   dropped (vLLM's), so a cut in the middle of a character leaves no U+FFFD.
//!
//! Costs per appended token: on the byte-level fast path a table lookup, or a decode of the
//! pending tokens after an incomplete character; otherwise two window decodes over at most
//! ~`MAX_PENDING + 5` tokens; plus the stop search of stop.rs. Memory: the window, a few small
//! buffers and the emitted text.

use std::borrow::Cow;
use std::sync::Arc;

use crate::model::TextModel;
use crate::stop::{StopScan, StopStrings};

/// Prompt ids used as decoding context (vLLM uses 5).
pub const PROMPT_CONTEXT: usize = 5;
/// Extra prompt ids looked at in case some are skipped specials (Python takes the last 7).
const PROMPT_LOOKBACK: usize = PROMPT_CONTEXT + 2;
/// Pending tokens after which an undecodable tail is emitted as U+FFFD. vLLM has no cap; this
/// one bounds the window, and only a long run of garbage bytes reaches it (a character needs at
/// most 4 byte tokens, but garbage may precede a valid one, which must pend with it).
pub const MAX_PENDING: usize = 64;
const REPLACEMENT: char = '\u{FFFD}';

/// One sequence's incremental text state (see the module header).
#[derive(Debug)]
pub struct SeqText {
    params: Arc<StopStrings>,
    /// `params`' two flags read for every token, kept here (one cache line less per token).
    skip_special_tokens: bool,
    has_stop: bool,
    window: Vec<u32>,
    read: usize,
    /// Prompt ids at `window[read..]` (a character the prompt ends in) until the first text.
    prompt_pending: usize,
    /// Character count of decode(window[..read]); None until needed after a slide.
    prefix_chars: Option<usize>,
    /// Byte-level models only: the prefix's bytes end clean, so the next text is the pending
    /// tokens' bytes decoded alone (module header).
    prefix_clean: bool,
    scratch: Vec<u8>,
    scan: StopScan,
    text: String,
    /// `text[..taken]` was returned by take_delta already.
    taken: usize,
    num_tokens: u32,
    stop_index: Option<u32>,
}

/// Whether `new_text`, the text `pending` tokens add to a prefix, is emitted now: it adds a
/// character and does not end mid-character (unless `MAX_PENDING` tokens pend).
fn completes(new_text: &str, pending: usize) -> bool {
    !(new_text.is_empty() || new_text.ends_with(REPLACEMENT) && pending < MAX_PENDING)
}

/// Whether the bytes a byte-level decode (lossy UTF-8) returned `text` for end clean: their last
/// chunk has no invalid tail. Conservative: valid text, or text not ending in U+FFFD (an invalid
/// tail always decodes to a final U+FFFD; a literal one ends valid bytes).
#[allow(clippy::ptr_arg)] // the Cow itself is the signal: borrowed means the bytes were valid UTF-8
fn ends_clean(text: &Cow<'_, str>) -> bool {
    matches!(text, Cow::Borrowed(_)) || !text.ends_with(REPLACEMENT)
}

/// Where the prompt context `ctx` starts and how much of it is emitted context: the first start
/// from which some head decodes clean at both ends (no U+FFFD first or last: the last 5 ids may
/// begin inside a character, and a byte-fallback decoder turns a whole invalid byte run into
/// U+FFFDs, which would leave no clean head and drop the context, and with it the first output
/// token's leading space), its longest such head, and that head's character count. The ids after
/// the head (a prompt ending mid-character) pend, so the output token that completes the
/// character emits it whole, as vLLM's DecodeStream primed with the prompt does
/// (`settle_prompt_tail`). No start decodes clean at both ends: start 0 and its longest head that
/// does not end in U+FFFD ((0, 0, 0) when none).
fn clean_context(model: &TextModel, ctx: &[u32], scratch: &mut Vec<u8>) -> (usize, usize, usize) {
    for start in 0..ctx.len() {
        for end in (start + 1..=ctx.len()).rev() {
            let text = model.decode_window(&ctx[start..end], scratch);
            if !text.is_empty() && !text.starts_with(REPLACEMENT) && !text.ends_with(REPLACEMENT) {
                return (start, end - start, text.chars().count());
            }
        }
    }
    (1..=ctx.len())
        .rev()
        .find_map(|read| {
            let text = model.decode_window(&ctx[..read], scratch);
            (!text.ends_with(REPLACEMENT)).then(|| (0, read, text.chars().count()))
        })
        .unwrap_or((0, 0, 0))
}

impl SeqText {
    /// A sequence whose prompt ends with `prompt_tail` (pass the last few ids, up to 7 are used:
    /// the last 5 kept ones are decoding context; those of a character they end in pend).
    pub fn new(model: &TextModel, params: Arc<StopStrings>, prompt_tail: &[u32]) -> SeqText {
        let mut seq = SeqText {
            skip_special_tokens: params.skip_special_tokens(),
            has_stop: params.has_stop(),
            params,
            window: Vec::with_capacity(PROMPT_CONTEXT + 4),
            read: 0,
            prompt_pending: 0,
            prefix_chars: Some(0),
            // Empty, or context whose decode does not end in U+FFFD: clean either way.
            prefix_clean: model.is_byte_level(),
            scratch: Vec::new(),
            scan: StopScan::default(),
            text: String::new(),
            taken: 0,
            num_tokens: 0,
            stop_index: None,
        };
        let skip = seq.skip_special_tokens;
        let from = prompt_tail.len().saturating_sub(PROMPT_LOOKBACK);
        let mut ctx: Vec<u32> = prompt_tail[from..].iter().copied().filter(|&id| model.keeps(id, skip)).collect();
        ctx.drain(..ctx.len().saturating_sub(PROMPT_CONTEXT));
        let (start, read, chars) = clean_context(model, &ctx, &mut seq.scratch);
        ctx.drain(..start);
        seq.prefix_chars = Some(chars);
        seq.read = read;
        seq.prompt_pending = ctx.len() - read;
        seq.window = ctx;
        seq
    }

    /// Appends one generated token. Returns `Some(i)` when stop string `i` (an index into the
    /// params' `stop`) completed with this token: the text is cut and the sequence is finished.
    pub fn append(&mut self, model: &TextModel, token: u32) -> Option<u32> {
        if self.stop_index.is_some() {
            debug_assert!(false, "SeqText::append after stop string {:?}", self.stop_index);
            return None;
        }
        self.num_tokens = self.num_tokens.saturating_add(1);
        if !model.keeps(token, self.skip_special_tokens) {
            return None;
        }
        self.window.push(token);
        if self.prompt_pending > 0 && !self.settle_prompt_tail(model) {
            return None;
        }
        if model.is_byte_level() && !self.prefix_clean {
            self.prefix_chars(model); // finds out whether the prefix ends clean after all
        }
        let hit = if !self.prefix_clean {
            self.decode_window_step(model)
        } else if let Some(piece) = model.utf8_token(token).filter(|_| self.window.len() - self.read == 1) {
            // The common token: complete text after complete text, emitted as it is.
            if !completes(piece, 1) {
                return None;
            }
            self.slide(true);
            if !self.has_stop {
                self.text.push_str(piece);
                return None;
            }
            self.scan.emit(&self.params, self.num_tokens, piece, &mut self.text)
        } else {
            self.decode_pending_step(model)
        };
        if hit.is_some() {
            self.stop_index = hit;
            self.window.clear();
            self.read = 0;
        }
        hit
    }

    /// While prompt ids pend: the shortest tail of them that the output completes a character
    /// with (their decode together completes text, with fewer U+FFFD than apart) stays, and the
    /// ids before it are dropped; none does: all of them are dropped once the output completes
    /// text alone (it broke the character), so the prompt's stray bytes are not output text (vLLM
    /// would show them); else false (wait for more tokens). The normal step then decodes.
    fn settle_prompt_tail(&mut self, model: &TextModel) -> bool {
        let (read, end) = (self.read, self.read + self.prompt_pending);
        let mut decoded = |ids: &[u32]| {
            let text = model.decode_window(ids, &mut self.scratch);
            (completes(&text, ids.len()), text.matches(REPLACEMENT).count())
        };
        let (output_done, output_fffd) = decoded(&self.window[end..]);
        let tail = (read..end).rev().find(|&j| {
            let (done, together) = decoded(&self.window[j..]);
            done && together < decoded(&self.window[j..end]).1 + output_fffd
        });
        let keep = match tail {
            Some(j) => j,
            None if output_done => end,
            None => return false,
        };
        self.window.drain(read..keep);
        self.prompt_pending = 0;
        true
    }

    /// The pending tokens were emitted: they become the prefix (`clean`: their bytes end clean).
    fn slide(&mut self, clean: bool) {
        self.window.drain(..self.read);
        self.read = self.window.len();
        self.prefix_chars = None;
        self.prefix_clean = clean;
    }

    /// The prefix ends clean, so decode(prefix + pending) is decode(prefix) followed by
    /// decode(pending): only the pending tokens are decoded.
    fn decode_pending_step(&mut self, model: &TextModel) -> Option<u32> {
        let new_text = model.decode_window(&self.window[self.read..], &mut self.scratch);
        if !completes(&new_text, self.window.len() - self.read) {
            return None;
        }
        let clean = ends_clean(&new_text);
        let hit = self.scan.emit(&self.params, self.num_tokens, &new_text, &mut self.text);
        self.slide(clean);
        hit
    }

    /// The general step (spec): decodes the window and its prefix; the new text is the
    /// characters past the prefix's.
    fn decode_window_step(&mut self, model: &TextModel) -> Option<u32> {
        let prefix_chars = self.prefix_chars(model);
        let new_text = model.decode_window(&self.window, &mut self.scratch);
        let pending = self.window.len() - self.read;
        let incomplete = new_text.ends_with(REPLACEMENT) && pending < MAX_PENDING;
        // Python: len(new_text) <= len(prefix_text); only count as far as needed.
        let start = match new_text.char_indices().nth(prefix_chars) {
            Some((i, _)) if !incomplete => i,
            _ => return None,
        };
        let hit = self.scan.emit(&self.params, self.num_tokens, &new_text[start..], &mut self.text);
        self.slide(false); // whether the new prefix ends clean is found out when it is decoded
        hit
    }

    /// Character count of decode(prefix), decoded once per slide (which also finds out whether
    /// the prefix ends clean).
    fn prefix_chars(&mut self, model: &TextModel) -> usize {
        match self.prefix_chars {
            Some(n) => n,
            None => {
                let text = model.decode_window(&self.window[..self.read], &mut self.scratch);
                let n = text.chars().count();
                self.prefix_clean = model.is_byte_level() && ends_clean(&text);
                self.prefix_chars = Some(n);
                n
            }
        }
    }

    /// End of the sequence for any reason but a stop string: releases the text held back for
    /// stop strings. Pending tokens (a character still incomplete, or tokens that added no
    /// character yet) are dropped, as vLLM's detokenizer drops them: a cut never ends in U+FFFD.
    pub fn flush(&mut self, _model: &TextModel) {
        self.scan.flush(&mut self.text);
        self.window.truncate(self.read);
    }

    /// All text emitted so far (after `flush`: the complete output text).
    pub fn text(&self) -> &str {
        &self.text
    }

    /// Text emitted since the previous call (an offset into `text`, no copy).
    pub fn take_delta(&mut self) -> &str {
        let from = self.taken;
        self.taken = self.text.len();
        &self.text[from..]
    }

    /// Tokens appended (skipped and unknown ids included).
    pub fn num_tokens(&self) -> u32 {
        self.num_tokens
    }

    /// Index of the stop string that ended the sequence, if any.
    pub fn stop_index(&self) -> Option<u32> {
        self.stop_index
    }

    /// The shared text parameters.
    pub fn params(&self) -> &Arc<StopStrings> {
        &self.params
    }
}
