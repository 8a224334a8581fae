//! Every common tokenizer.json shape loads with the chosen features (fancy-regex, no onig):
//! WordLevel, WordPiece (BERT), Unigram (Metaspace), and byte-level BPE with the Qwen2 / Llama 3
//! `Split` regexes (lookahead, `(?i:...)`, `\p{..}` classes, counted repetition). Streaming the
//! encoding of a text through `SeqText` gives the one-shot decode.

use std::str::FromStr;
use std::sync::Arc;

use ferrokv_text::{SeqText, StopStrings, TextModel};
use serde_json::{json, Value};
use tokenizers::Tokenizer;

const BYTE_LEVEL: &str = include_str!("fixtures/byte_level.json");
const QWEN2: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const LLAMA3: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

fn tokenizer(model: Value, normalizer: Value, pre_tokenizer: Value, decoder: Value) -> String {
    json!({"version": "1.0", "truncation": null, "padding": null, "added_tokens": [], "normalizer": normalizer,
           "pre_tokenizer": pre_tokenizer, "post_processor": null, "decoder": decoder, "model": model})
    .to_string()
}

/// Loads `json`, encodes `text`, streams the ids; checks text == decode and returns it.
fn stream(json: &str, text: &str) -> String {
    let model = TextModel::from_json(json).unwrap_or_else(|e| panic!("{e}"));
    let ids = Tokenizer::from_str(json).unwrap().encode(text, false).unwrap().get_ids().to_vec();
    assert!(!ids.is_empty());
    let mut seq = SeqText::new(&model, Arc::new(StopStrings::new(vec![], false, 0, true)), &[]);
    for &t in &ids {
        assert_eq!(seq.append(&model, t), None);
    }
    seq.flush(&model);
    assert_eq!(seq.text(), model.decode(&ids, true), "{ids:?}");
    seq.text().to_owned()
}

#[test]
fn word_level_with_whitespace_regex() {
    let vocab = json!({"[UNK]": 0, "hello": 1, "world": 2, "!": 3});
    let json = tokenizer(
        json!({"type": "WordLevel", "vocab": vocab, "unk_token": "[UNK]"}),
        Value::Null,
        json!({"type": "Whitespace"}),
        Value::Null,
    );
    assert_eq!(stream(&json, "hello world !"), "hello world !");
}

#[test]
fn word_piece_bert() {
    let vocab = json!({"[UNK]": 0, "hello": 1, "world": 2, "##s": 3, "!": 4, "play": 5, "##ing": 6});
    let json = tokenizer(
        json!({"type": "WordPiece", "unk_token": "[UNK]", "continuing_subword_prefix": "##",
               "max_input_chars_per_word": 100, "vocab": vocab}),
        json!({"type": "BertNormalizer", "clean_text": true, "handle_chinese_chars": true,
               "strip_accents": null, "lowercase": true}),
        json!({"type": "BertPreTokenizer"}),
        json!({"type": "WordPiece", "prefix": "##", "cleanup": true}),
    );
    assert_eq!(stream(&json, "Hello worlds playing!"), "hello worlds playing!");
}

#[test]
fn unigram_metaspace() {
    let vocab = json!([
        ["<unk>", 0.0],
        ["▁hello", -1.0],
        ["▁world", -1.5],
        ["▁", -2.0],
        ["h", -3.0],
        ["e", -3.0],
        ["l", -3.0],
        ["o", -3.0],
        ["w", -3.0],
        ["r", -3.0],
        ["d", -3.0]
    ]);
    let json = tokenizer(
        json!({"type": "Unigram", "unk_id": 0, "vocab": vocab, "byte_fallback": false}),
        json!({"type": "NFKC"}),
        json!({"type": "Metaspace", "replacement": "▁", "prepend_scheme": "always", "split": true}),
        json!({"type": "Metaspace", "replacement": "▁", "prepend_scheme": "always", "split": true}),
    );
    assert_eq!(stream(&json, "hello world hold"), "hello world hold");
}

#[test]
fn byte_level_bpe_with_qwen2_and_llama3_split_regexes() {
    for pattern in [QWEN2, LLAMA3] {
        let mut v: Value = serde_json::from_str(BYTE_LEVEL).unwrap();
        v["normalizer"] = json!({"type": "NFC"});
        v["pre_tokenizer"] = json!({"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": false},
            {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false}]});
        let json = v.to_string();
        assert!(TextModel::from_json(&json).unwrap().is_byte_level());
        let text = "I'll say 12345 things, 中文 and 🦀!\n\n  done";
        assert_eq!(stream(&json, text), text);
    }
}
