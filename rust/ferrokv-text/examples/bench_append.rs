//! Micro-measurement of `SeqText::append` (ns per appended token), not a timed assertion:
//! `cargo run --release -p ferrokv-text --example bench_append`.
//!
//! Streams ~100k tokens of mixed text (ASCII, accents, CJK, emoji) through the byte-level
//! fixture on the fast path and on the general (decoder) path, and through the
//! SentencePiece-style fixture, without and with stop strings that never match.

use std::hint::black_box;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Instant;

use ferrokv_text::{SeqText, StopStrings, TextModel};
use tokenizers::Tokenizer;

const BYTE_LEVEL: &str = include_str!("../tests/fixtures/byte_level.json");
const SP: &str = include_str!("../tests/fixtures/sp.json");
const TEXT: &str = "Hello world, the cat runs today. crème brûlée and naïve café owners. 中文 text with 汉字. \
                    rockets 🚀🚀 and faces 😀 and 🦀 crabs.\n";

fn bench(name: &str, model: &TextModel, ids: &[u32], stop: &[&str]) {
    let params = Arc::new(StopStrings::new(stop.iter().map(|s| s.to_string()).collect(), false, 0, true));
    let mut best = f64::MAX;
    let mut chars = 0;
    for _ in 0..5 {
        let t0 = Instant::now();
        // Sequences of 1000 tokens, like real generations (text grows, windows slide).
        for chunk in ids.chunks(1000) {
            let mut seq = SeqText::new(model, params.clone(), &[]);
            for &t in chunk {
                black_box(seq.append(model, t));
                black_box(seq.take_delta());
            }
            seq.flush(model);
            chars += seq.text().len();
        }
        best = best.min(t0.elapsed().as_nanos() as f64 / ids.len() as f64);
    }
    black_box(chars);
    println!("{name:<44} {best:8.1} ns/token  ({} tokens)", ids.len());
}

fn main() {
    let text = TEXT.repeat(1200);
    let bl = TextModel::from_json(BYTE_LEVEL).unwrap();
    let bl_general = TextModel::from_json(BYTE_LEVEL).unwrap().without_byte_level_fast_path();
    let sp = TextModel::from_json(SP).unwrap();
    let bl_ids = Tokenizer::from_str(BYTE_LEVEL)
        .unwrap()
        .encode(text.as_str(), false)
        .unwrap()
        .get_ids()
        .to_vec();
    let sp_ids = Tokenizer::from_str(SP)
        .unwrap()
        .encode(text.as_str(), false)
        .unwrap()
        .get_ids()
        .to_vec();
    let stops: &[&str] = &["<|never|>", "STOP HERE", "zebra"];
    bench("byte-level, fast path", &bl, &bl_ids, &[]);
    bench("byte-level, fast path, 3 stop strings", &bl, &bl_ids, stops);
    bench("byte-level, general decoder path", &bl_general, &bl_ids, &[]);
    bench("byte-level, general path, 3 stop strings", &bl_general, &bl_ids, stops);
    bench("sentencepiece-style (general path)", &sp, &sp_ids, &[]);
    bench("sentencepiece-style, 3 stop strings", &sp, &sp_ids, stops);
}
