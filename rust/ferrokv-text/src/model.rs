//! `TextModel`: a tokenizer.json loaded once and turned into per-id tables for decoding.
//!
//! Invariants:
//! * Immutable after [`TextModel::from_json`] and `Send + Sync`: one model is shared by every
//!   sequence of every request.
//! * An id's token string is what `tokenizers`' `decode` uses: the added vocabulary's content,
//!   else the model's `id_to_token`. Ids with neither (padded embedding rows) are *unknown* and
//!   decode to nothing. An id is *special* when its token string is in the added vocabulary's
//!   special set (the `special` flag in tokenizer.json) -- exactly what `decode` skips with
//!   `skip_special_tokens`. (The Python path skips the same set: transformers' `all_special_ids`
//!   plus the added tokens flagged special, see `special_token_ids` in detokenizer.py.)
//! * Byte-level fast path: when the decoder is exactly `ByteLevel` (GPT-2, SmolLM2, Qwen, Llama 3),
//!   every id's bytes are precomputed at load with the GPT-2 byte<->unicode table; a token with a
//!   char outside the table keeps its UTF-8 bytes (as the `ByteLevel` decoder does). Decoding a
//!   window is then a byte concatenation plus `String::from_utf8_lossy`, which is exactly what the
//!   `ByteLevel` decoder returns. Every other decoder is called through `tokenizers` itself.
//!   The ids whose bytes are valid UTF-8 on their own also keep them as text (`utf8_token`), so
//!   the common token (one complete piece after complete text) decodes with no copy at all.
//!
//! Costs: load is O(vocab) (one `id_to_token` per id, a few bytes per id kept); a window decode
//! is O(window bytes) on the fast path (no allocation unless the bytes are invalid UTF-8), and one
//! `Decoder::decode` over freshly allocated token strings otherwise.

use std::borrow::Cow;
use std::fmt;
use std::str::FromStr;

use tokenizers::{Decoder, DecoderWrapper, Tokenizer};

/// Ids above this are refused at load (a table entry per id is kept).
const MAX_ID: u32 = 1 << 26;
const FLAG_KNOWN: u8 = 1;
const FLAG_SPECIAL: u8 = 2;

/// Why a tokenizer.json could not be loaded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TextError {
    /// Not JSON, or not a tokenizer `tokenizers` 0.22 can deserialize (unknown model, decoder,
    /// regex it cannot compile, ...). Carries `tokenizers`' message.
    InvalidTokenizerJson(String),
    /// A token id too large for the per-id tables.
    IdTooLarge { token: String, id: u32 },
}

impl fmt::Display for TextError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TextError::InvalidTokenizerJson(why) => write!(f, "invalid tokenizer.json: {why}"),
            TextError::IdTooLarge { token, id } => {
                write!(
                    f,
                    "invalid tokenizer.json: token {token:?} has id {id}, above the supported maximum {MAX_ID}"
                )
            }
        }
    }
}

impl std::error::Error for TextError {}

/// Precomputed bytes of every id, for a tokenizer whose decoder is exactly `ByteLevel`.
struct ByteTable {
    bytes: Vec<u8>,
    /// `ends[i]..ends[i + 1]` are id i's bytes (`ends.len() == num ids + 1`).
    ends: Vec<u32>,
    /// The ids whose bytes are valid UTF-8 on their own, back to back: `text_ends[i]..
    /// text_ends[i + 1]` is id i's text (empty for the others; `utf8` says which).
    text: String,
    text_ends: Vec<u32>,
    utf8: Vec<bool>,
}

/// A tokenizer loaded for decoding (see the module header).
pub struct TextModel {
    tokenizer: Tokenizer,
    /// All token strings back to back; `ends[i]..ends[i + 1]` is id i's.
    strings: String,
    ends: Vec<u32>,
    flags: Vec<u8>,
    byte_level: Option<ByteTable>,
    vocab_size: usize,
}

impl fmt::Debug for TextModel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TextModel")
            .field("vocab_size", &self.vocab_size)
            .field("byte_level", &self.byte_level.is_some())
            .finish()
    }
}

impl TextModel {
    /// Loads a tokenizer.json (its text). Errors name what failed.
    pub fn from_json(json: &str) -> Result<TextModel, TextError> {
        let tokenizer = Tokenizer::from_str(json).map_err(|e| TextError::InvalidTokenizerJson(e.to_string()))?;
        let vocab = tokenizer.get_vocab(true);
        let vocab_size = tokenizer.get_vocab_size(true);
        if let Some((token, &id)) = vocab.iter().max_by_key(|(_, &id)| id).filter(|(_, &id)| id >= MAX_ID) {
            return Err(TextError::IdTooLarge { token: token.clone(), id });
        }
        let num_ids = vocab.values().max().map_or(0, |&m| m as usize + 1);
        let added = tokenizer.get_added_vocabulary();
        let mut strings = String::new();
        let mut ends = Vec::with_capacity(num_ids + 1);
        let mut flags = Vec::with_capacity(num_ids);
        ends.push(0u32);
        for id in 0..num_ids as u32 {
            let mut f = 0;
            if let Some(tok) = tokenizer.id_to_token(id) {
                f = FLAG_KNOWN | if added.is_special_token(&tok) { FLAG_SPECIAL } else { 0 };
                strings.push_str(&tok);
            }
            flags.push(f);
            ends.push(u32::try_from(strings.len()).expect("token strings exceed 4 GiB"));
        }
        let mut model = TextModel {
            tokenizer,
            strings,
            ends,
            flags,
            byte_level: None,
            vocab_size,
        };
        if matches!(model.tokenizer.get_decoder(), Some(DecoderWrapper::ByteLevel(_))) {
            model.byte_level = Some(model.build_byte_table());
        }
        Ok(model)
    }

    fn build_byte_table(&self) -> ByteTable {
        let table = char_to_byte_table();
        let mut bytes = Vec::with_capacity(self.strings.len());
        let mut ends = Vec::with_capacity(self.ends.len());
        ends.push(0u32);
        for id in 0..self.flags.len() as u32 {
            let tok = self.token(id).unwrap_or("");
            let start = bytes.len();
            for c in tok.chars() {
                match table.get(c as usize).copied().flatten() {
                    Some(b) => bytes.push(b),
                    None => {
                        // Like the ByteLevel decoder: one char outside the table keeps the
                        // whole token's UTF-8 bytes.
                        bytes.truncate(start);
                        bytes.extend_from_slice(tok.as_bytes());
                        break;
                    }
                }
            }
            ends.push(bytes.len() as u32);
        }
        let mut text = String::new();
        let mut text_ends = Vec::with_capacity(ends.len());
        let mut utf8 = Vec::with_capacity(ends.len() - 1);
        text_ends.push(0u32);
        for w in ends.windows(2) {
            let s = std::str::from_utf8(&bytes[w[0] as usize..w[1] as usize]).ok();
            utf8.push(s.is_some());
            text.push_str(s.unwrap_or(""));
            text_ends.push(text.len() as u32);
        }
        ByteTable { bytes, ends, text, text_ends, utf8 }
    }

    /// Test / bench hook: the same model decoding every window through the `tokenizers`
    /// decoder, even when the byte-level fast path applies.
    #[doc(hidden)]
    pub fn without_byte_level_fast_path(mut self) -> Self {
        self.byte_level = None;
        self
    }

    /// Whether windows are decoded by the byte-level fast path.
    pub fn is_byte_level(&self) -> bool {
        self.byte_level.is_some()
    }

    /// One-shot decode of `ids`: exactly `tokenizers`' `decode` ("" if the decoder fails).
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> String {
        self.tokenizer.decode(ids, skip_special_tokens).unwrap_or_default()
    }

    /// Number of distinct tokens, added tokens included (Python's `len(tokenizer)`).
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// The token string of `id` (None for an unknown id).
    pub fn token(&self, id: u32) -> Option<&str> {
        let i = id as usize;
        if self.flags.get(i).is_some_and(|f| f & FLAG_KNOWN != 0) {
            Some(&self.strings[self.ends[i] as usize..self.ends[i + 1] as usize])
        } else {
            None
        }
    }

    /// Whether `id` is a special (added) token.
    pub fn is_special(&self, id: u32) -> bool {
        self.flags.get(id as usize).is_some_and(|f| f & FLAG_SPECIAL != 0)
    }

    /// Whether `id` takes part in decoding: known, and not a skipped special token.
    #[inline]
    pub(crate) fn keeps(&self, id: u32, skip_special_tokens: bool) -> bool {
        match self.flags.get(id as usize) {
            Some(&f) => f & FLAG_KNOWN != 0 && !(skip_special_tokens && f & FLAG_SPECIAL != 0),
            None => false,
        }
    }

    /// On the byte-level fast path, `id`'s bytes as text when they are valid UTF-8 on their own
    /// (None otherwise, and for every id of another decoder).
    #[inline]
    pub(crate) fn utf8_token(&self, id: u32) -> Option<&str> {
        let t = self.byte_level.as_ref()?;
        let i = id as usize;
        if *t.utf8.get(i)? {
            Some(&t.text[t.text_ends[i] as usize..t.text_ends[i + 1] as usize])
        } else {
            None
        }
    }

    /// Decodes a window of kept ids the way `convert_tokens_to_string` does (the decoder over
    /// the token strings). `scratch` is reused for the fast path's bytes.
    pub(crate) fn decode_window<'a>(&self, ids: &[u32], scratch: &'a mut Vec<u8>) -> Cow<'a, str> {
        if let Some(t) = &self.byte_level {
            scratch.clear();
            for &id in ids {
                let i = id as usize;
                scratch.extend_from_slice(&t.bytes[t.ends[i] as usize..t.ends[i + 1] as usize]);
            }
            return String::from_utf8_lossy(scratch);
        }
        let tokens: Vec<String> = ids.iter().filter_map(|&id| self.token(id)).map(str::to_owned).collect();
        Cow::Owned(match self.tokenizer.get_decoder() {
            Some(d) => d.decode(tokens).unwrap_or_default(),
            None => tokens.join(" "),
        })
    }
}

/// GPT-2's unicode char -> byte table (the inverse of `bytes_to_unicode`), indexed by char code.
fn char_to_byte_table() -> Vec<Option<u8>> {
    let mut table = vec![None; 256 + 68];
    let mut n = 0usize;
    for b in 0..=255u8 {
        let printable = matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
        if printable {
            table[b as usize] = Some(b);
        } else {
            table[256 + n] = Some(b);
            n += 1;
        }
    }
    table
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_table_is_a_bijection() {
        let t = char_to_byte_table();
        let mut seen = [false; 256];
        for b in t.iter().flatten() {
            assert!(!seen[*b as usize]);
            seen[*b as usize] = true;
        }
        assert!(seen.iter().all(|&s| s));
        assert_eq!(t['Ġ' as usize], Some(b' '));
        assert_eq!(t['Ċ' as usize], Some(b'\n'));
    }

    #[test]
    fn model_is_send_sync() {
        fn check<T: Send + Sync>() {}
        check::<TextModel>();
    }
}
