//! ferrokv-text against its oracles, on the checked-in fixtures (tests/fixtures/make_fixtures.py):
//! a byte-level BPE (decoder ByteLevel) and a SentencePiece-style BPE with byte fallback.
//!
//! * byte-level: text == decode(output, skip) on streams of encoded text with specials and
//!   unknown ids mixed in; the fast path == the general (decoder) path on arbitrary ids, stop
//!   strings and min_tokens included; a prompt cut inside a character pends its bytes, which the
//!   output completes.
//! * SentencePiece-style: text == decode(ctx + output) - decode(ctx) (ctx: the last 5 kept
//!   prompt ids).
//! * Stop strings: spanning tokens, cut before / after, reported by the completing append,
//!   earliest wins, min_tokens, nothing past a stop.

use std::str::FromStr;
use std::sync::Arc;

use ferrokv_text::{SeqText, StopStrings, TextError, TextModel, MAX_PENDING};
use tokenizers::Tokenizer;

const BYTE_LEVEL: &str = include_str!("fixtures/byte_level.json");
const SP: &str = include_str!("fixtures/sp.json");
const TEXTS: &[&str] = &[
    "Hello world, the cat runs today.",
    "crème brûlée and naïve café owners, señor über",
    "中文 text with 汉字 that were never in the corpus",
    "rockets 🚀🚀 and faces 😀 and 🦀 crabs",
    "mixed: é中😀a\u{a0}b\tc\n\nnew paragraph  two  spaces",
    "STOP here. The END? ¿Qué? ✓✓ done",
];
/// Ids past every vocab (padded embedding rows).
const UNKNOWN: u32 = 100_000;

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

fn encode(tok: &Tokenizer, text: &str) -> Vec<u32> {
    tok.encode(text, false).unwrap().get_ids().to_vec()
}

/// A stream of valid text's ids: a random slice of a text, encoded in 1-3 pieces cut at char
/// boundaries, with special (0..3) or unknown ids between pieces (mid-character they would make
/// the text invalid UTF-8, which the one-shot decode and the window treat differently).
fn text_stream(rng: &mut Rng, tok: &Tokenizer) -> Vec<u32> {
    let text = TEXTS[rng.below(TEXTS.len())];
    let chars: Vec<char> = text.chars().collect();
    let a = rng.below(chars.len());
    let b = a + 1 + rng.below(chars.len() - a);
    let mut cuts = vec![a, b];
    for _ in 0..rng.below(3) {
        cuts.push(a + rng.below(b - a));
    }
    cuts.sort();
    let mut ids = vec![];
    for w in cuts.windows(2).filter(|w| w[0] < w[1]) {
        if !ids.is_empty() || rng.below(4) == 0 {
            ids.push(if rng.below(2) == 0 { rng.below(3) as u32 } else { UNKNOWN });
        }
        ids.extend(encode(tok, &chars[w[0]..w[1]].iter().collect::<String>()));
    }
    ids
}

/// Runs a stream; returns (text, concatenated deltas, stop index, appended count).
fn run(model: &TextModel, params: &Arc<StopStrings>, prompt: &[u32], ids: &[u32]) -> (String, String, Option<u32>, usize) {
    let mut seq = SeqText::new(model, params.clone(), prompt);
    let mut deltas = String::new();
    let mut n = 0;
    for &t in ids {
        n += 1;
        let hit = seq.append(model, t);
        deltas.push_str(seq.take_delta());
        assert_eq!(hit, seq.stop_index());
        if hit.is_some() {
            break;
        }
    }
    if seq.stop_index().is_none() {
        seq.flush(model);
    }
    deltas.push_str(seq.take_delta());
    assert_eq!(seq.num_tokens() as usize, n);
    (seq.text().to_owned(), deltas, seq.stop_index(), n)
}

fn params(stop: &[&str], include: bool, min_tokens: u32, skip: bool) -> Arc<StopStrings> {
    Arc::new(StopStrings::new(
        stop.iter().map(|s| s.to_string()).collect(),
        include,
        min_tokens,
        skip,
    ))
}

fn models() -> (TextModel, TextModel, Tokenizer, Tokenizer) {
    let bl = TextModel::from_json(BYTE_LEVEL).unwrap();
    let sp = TextModel::from_json(SP).unwrap();
    (bl, sp, Tokenizer::from_str(BYTE_LEVEL).unwrap(), Tokenizer::from_str(SP).unwrap())
}

#[test]
fn fixtures_load() {
    let (bl, sp, _, _) = models();
    assert!(bl.is_byte_level() && !sp.is_byte_level());
    assert_eq!((bl.vocab_size(), sp.vocab_size()), (400, 526));
    assert!(bl.is_special(0) && !bl.is_special(3) && bl.token(UNKNOWN).is_none());
    assert_eq!(sp.token(3 + 0xE2), Some("<0xE2>"));
    assert_eq!(bl.decode(&[UNKNOWN], true), "");
}

#[test]
fn bad_json_is_a_typed_error() {
    let e = TextModel::from_json("{not json").unwrap_err();
    assert!(matches!(e, TextError::InvalidTokenizerJson(_)));
    assert!(e.to_string().starts_with("invalid tokenizer.json: "), "{e}");
    let e = TextModel::from_json(r#"{"model": {"type": "Nope"}}"#).unwrap_err();
    assert!(e.to_string().contains("invalid tokenizer.json"), "{e}");
}

#[test]
fn huge_ids_are_refused_and_types_are_thread_safe() {
    let mut v: serde_json::Value = serde_json::from_str(BYTE_LEVEL).unwrap();
    // (Added tokens get sequential ids on load whatever the file says; a model vocab keeps them.)
    v["model"]["vocab"]["<|huge|>"] = serde_json::json!(1u32 << 27);
    let e = TextModel::from_json(&v.to_string()).unwrap_err();
    assert!(matches!(e, TextError::IdTooLarge { id, .. } if id == 1 << 27), "{e}");
    assert!(e.to_string().contains("<|huge|>"), "{e}");
    fn check<T: Send + Sync>() {}
    check::<TextModel>();
    check::<SeqText>();
    check::<StopStrings>();
}

#[test]
fn byte_level_equals_one_shot_decode() {
    let (bl, _, tok, _) = models();
    let mut rng = Rng(1);
    for case in 0..400 {
        let ids = text_stream(&mut rng, &tok);
        let skip = case % 2 == 0;
        let prompt = encode(&tok, "Some prompt 中");
        let p = params(&[], false, 0, skip);
        let (text, deltas, _, _) = run(&bl, &p, &prompt, &ids);
        assert_eq!(text, tok.decode(&ids, skip).unwrap(), "{ids:?}");
        assert_eq!(deltas, text);
        assert!(!text.contains('\u{FFFD}'));
    }
}

#[test]
fn byte_level_fast_path_equals_decoder_path() {
    let (bl, _, _, _) = models();
    let general = TextModel::from_json(BYTE_LEVEL).unwrap().without_byte_level_fast_path();
    let mut rng = Rng(2);
    let stops: [&[&str]; 4] = [&[], &["e"], &["the", "\u{FFFD}", "ab"], &["🚀", "s t", "."]];
    for case in 0..600 {
        let len = 1 + rng.below(60);
        let ids: Vec<u32> = (0..len)
            .map(|_| if rng.below(40) == 0 { UNKNOWN } else { rng.below(400) as u32 })
            .collect();
        let prompt: Vec<u32> = (0..rng.below(8)).map(|_| rng.below(400) as u32).collect();
        let p = params(stops[case % 4], case % 3 == 0, rng.below(4) as u32, case % 5 != 0);
        let fast = run(&bl, &p, &prompt, &ids);
        let slow = run(&general, &p, &prompt, &ids);
        assert_eq!(fast, slow, "{ids:?} prompt {prompt:?}");
        assert_eq!(fast.0, fast.1);
        if stops[case % 4].is_empty() {
            // Arbitrary bytes: the one-shot decode (lossy UTF-8 resynchronizes), less what still
            // pends at the end.
            assert_final_text(&bl, &fast.0, &prompt, &ids, p.skip_special_tokens());
        }
    }
}

#[test]
fn sentencepiece_equals_context_difference() {
    let (_, sp, _, tok) = models();
    let mut rng = Rng(3);
    for case in 0..400 {
        let ids = text_stream(&mut rng, &tok);
        let skip = case % 2 == 0;
        let prompt = encode(&tok, TEXTS[case % TEXTS.len()]);
        let ctx: Vec<u32> = prompt
            .iter()
            .copied()
            .filter(|&i| sp.token(i).is_some() && !(skip && sp.is_special(i)))
            .collect();
        let ctx = if case % 7 == 0 {
            &[][..]
        } else {
            &ctx[ctx.len().saturating_sub(5)..]
        };
        let p = params(&[], false, 0, skip);
        let (text, deltas, _, _) = run(&sp, &p, if case % 7 == 0 { &[] } else { &prompt }, &ids);
        let whole = sp.decode(&[ctx, &ids[..]].concat(), skip);
        let head = sp.decode(ctx, skip);
        assert!(whole.starts_with(&head), "{whole:?} {head:?}");
        assert_eq!(text, whole[head.len()..], "ids {ids:?} ctx {ctx:?}");
        assert_eq!(deltas, text);
    }
}

#[test]
fn split_character_is_emitted_once_complete() {
    let (bl, sp, tbl, tsp) = models();
    for (model, tok) in [(&bl, &tbl), (&sp, &tsp)] {
        let ids = encode(tok, "a🦀");
        assert!(ids.len() >= 4, "{ids:?}");
        let mut seq = SeqText::new(model, params(&[], false, 0, true), &[]);
        let mut deltas = vec![];
        for &t in &ids {
            seq.append(model, t);
            deltas.push(seq.take_delta().to_owned());
        }
        assert!(deltas[1..ids.len() - 1].iter().all(String::is_empty), "{deltas:?}");
        assert!(deltas.last().unwrap().ends_with('🦀'));
        assert_eq!(seq.text(), "a🦀");
    }
}

#[test]
fn a_character_the_prompt_ends_in_is_completed_by_the_output() {
    // A prompt cut inside a character pends its bytes, so the output token that completes it emits
    // the whole character (vLLM's DecodeStream, primed with the prompt, does the same).
    let (bl, sp, tbl, tsp) = models();
    let bytes = byte_ids(&tbl);
    let emoji: Vec<u32> = "🦀".bytes().map(|b| bytes[usize::from(b)]).collect();
    let mut prompt = encode(&tbl, "say ");
    prompt.extend_from_slice(&emoji[..3]);
    let general_bl = TextModel::from_json(BYTE_LEVEL).unwrap().without_byte_level_fast_path();
    let stray: Vec<u32> = [bytes[0xFF]].iter().chain(&emoji[..3]).copied().collect();
    for model in [&bl, &general_bl] {
        // After clean context; with no context that decodes clean (the bytes alone); after a
        // stray byte, which is not output text.
        for prompt in [&prompt[..], &emoji[..3], &stray] {
            let out = [emoji[3], bytes[usize::from(b'!')]];
            let (text, deltas, _, _) = run(model, &params(&[], false, 0, true), prompt, &out);
            assert_eq!((text.as_str(), deltas.as_str()), ("🦀!", "🦀!"), "{prompt:?}");
        }
    }
    // SentencePiece byte fallback: the same.
    let ids = encode(&tsp, "a🦀b");
    let cut = (1..ids.len()).find(|&c| sp.decode(&ids[..c], true).ends_with('\u{FFFD}')).expect("a split character");
    let (text, _, _, _) = run(&sp, &params(&[], false, 0, true), &ids[..cut], &ids[cut..]);
    assert_eq!(sp.decode(&ids, true), format!("{}{text}", sp.decode(&ids[..cut], true).trim_end_matches('\u{FFFD}')));
}

#[test]
fn incomplete_tail_is_dropped_at_flush() {
    // vLLM's detokenizer drops what still pends when a sequence ends: a cut never ends in U+FFFD.
    let (bl, sp, tbl, tsp) = models();
    for (model, tok) in [(&bl, &tbl), (&sp, &tsp)] {
        let ids = encode(tok, "x🦀");
        let mut seq = SeqText::new(model, params(&[], false, 0, true), &[]);
        for &t in &ids[..ids.len() - 1] {
            seq.append(model, t);
        }
        assert_eq!(seq.text(), "x");
        seq.flush(model);
        assert_eq!(seq.text(), "x");
        assert_eq!(seq.take_delta(), "x");
        assert!(model.decode(&ids[..ids.len() - 1], true).starts_with("x\u{FFFD}"));
    }
}

/// The prompt ids a sequence starts with pending (`SeqText::new`'s rule): of the last 5 kept ids
/// among the last 7, those after the longest head that decodes clean (all when no head does).
fn pending_prompt_ids(model: &TextModel, prompt: &[u32], skip: bool) -> Vec<u32> {
    let tail = &prompt[prompt.len().saturating_sub(7)..];
    let kept: Vec<u32> =
        tail.iter().copied().filter(|&id| model.token(id).is_some() && !(skip && model.is_special(id))).collect();
    let ctx = &kept[kept.len().saturating_sub(5)..];
    let head = (1..=ctx.len()).rev().find(|&k| !model.decode(&ctx[..k], skip).ends_with('\u{FFFD}'));
    ctx[head.unwrap_or(0)..].to_vec()
}

/// `text` is the output's own final text, or, when the prompt ends inside a character that the
/// output completes (fewer U+FFFD together than apart), the final text of a tail of the prompt's
/// pending ids and the output.
fn assert_final_text(model: &TextModel, text: &str, prompt: &[u32], ids: &[u32], skip: bool) {
    let alone = final_text(model, ids, skip);
    if text != alone {
        let pending = pending_prompt_ids(model, prompt, skip);
        let fffd = |t: &str| t.matches('\u{FFFD}').count();
        let ok = (0..pending.len()).any(|j| {
            let together = final_text(model, &[&pending[j..], ids].concat(), skip);
            text == together && fffd(&together) < fffd(&alone) + fffd(&model.decode(&pending[j..], skip))
        });
        assert!(ok, "{text:?} vs alone {alone:?}: {ids:?} prompt {prompt:?}");
    }
}

/// The text vLLM's detokenizer ends with, by one-shot decodes (byte-level: the decode of a prefix
/// of the ids is a prefix of the decode): what pends is emitted once it adds a character and does
/// not end mid-character (or `MAX_PENDING` kept tokens pend); what pends at the end is dropped.
fn final_text(model: &TextModel, ids: &[u32], skip: bool) -> String {
    let kept: Vec<u32> = ids
        .iter()
        .copied()
        .filter(|&i| model.token(i).is_some() && !(skip && model.is_special(i)))
        .collect();
    let (mut emitted, mut text) = (0usize, String::new());
    for i in 1..=kept.len() {
        let t = model.decode(&kept[..i], skip);
        if t.chars().count() > text.chars().count() && (!t.ends_with('\u{FFFD}') || i - emitted >= MAX_PENDING) {
            (emitted, text) = (i, t);
        }
    }
    text
}

/// (text, stop index, tokens appended) of `text` encoded and streamed.
fn stream_text(model: &TextModel, tok: &Tokenizer, text: &str, p: &Arc<StopStrings>) -> (String, Option<u32>, usize) {
    let ids = encode(tok, text);
    let (t, d, stop, n) = run(model, p, &[], &ids);
    assert_eq!(t, d);
    (t, stop, n)
}

#[test]
fn stop_strings_cut_and_report() {
    let (bl, sp, tbl, tsp) = models();
    for (model, tok) in [(&bl, &tbl), (&sp, &tsp)] {
        let text = "Hello world, the cat runs today.";
        // Spanning several tokens, cut before.
        let (t, stop, n) = stream_text(model, tok, text, &params(&["nothing", "cat runs"], false, 0, true));
        assert_eq!((t.as_str(), stop), ("Hello world, the ", Some(1)));
        assert!(n < encode(tok, text).len());
        // Included.
        let (t, _, _) = stream_text(model, tok, text, &params(&["cat runs"], true, 0, true));
        assert_eq!(t, "Hello world, the cat runs");
        // Earliest wins, then shortest.
        let (t, stop, _) = stream_text(model, tok, text, &params(&["runs", "world", "wor"], false, 0, true));
        assert_eq!((t.as_str(), stop), ("Hello ", Some(2)));
        // Duplicates: the first one's index.
        let (_, stop, _) = stream_text(model, tok, text, &params(&["zebra", "cat", "cat"], false, 0, true));
        assert_eq!(stop, Some(1));
        // Not found: all text, after flush.
        let (t, stop, _) = stream_text(model, tok, text, &params(&["zebra"], false, 0, true));
        assert_eq!((t.as_str(), stop), (text, None));
        // Empty stop strings are ignored; indices stay the caller's.
        let (t, stop, _) = stream_text(model, tok, text, &params(&["", "today"], false, 0, true));
        assert_eq!((t.as_str(), stop), ("Hello world, the cat runs ", Some(1)));
        // A stop string with a split character.
        let (t, stop, _) = stream_text(model, tok, "go 🦀 now", &params(&["🦀"], false, 0, true));
        assert_eq!((t.as_str(), stop), ("go ", Some(0)));
    }
}

#[test]
fn stop_is_reported_by_the_completing_append_and_nothing_follows() {
    let (bl, _, tok, _) = models();
    let ids = encode(&tok, "the cat runs the cat");
    let p = params(&["cat"], false, 0, true);
    let mut seq = SeqText::new(&bl, p, &[]);
    let mut emitted = String::new();
    for (k, &t) in ids.iter().enumerate() {
        let hit = seq.append(&bl, t);
        emitted.push_str(seq.take_delta());
        let decoded = bl.decode(&ids[..=k], true);
        assert_eq!(hit.is_some(), decoded.contains("cat"), "token {k}: {decoded:?}");
        if hit.is_some() {
            break;
        }
    }
    assert_eq!((emitted.as_str(), seq.text()), ("the ", "the "));
    seq.flush(&bl);
    assert_eq!(seq.text(), "the ");
    assert_eq!(seq.take_delta(), "");
}

#[test]
fn min_tokens_delays_the_search() {
    let (bl, _, tok, _) = models();
    let text = "the cat runs the cat sleeps";
    let n_first = encode(&tok, "the cat").len() as u32;
    let (t, stop, _) = stream_text(&bl, &tok, text, &params(&["cat"], false, n_first, true));
    // The first "cat" completes at token n_first (not > min_tokens): only the second one stops.
    assert_eq!((t.as_str(), stop), ("the cat runs the ", Some(0)));
    let (t, _, _) = stream_text(&bl, &tok, text, &params(&["cat"], false, n_first - 1, true));
    assert_eq!(t, "the ");
}

#[test]
fn holdback_never_streams_a_partial_stop_string() {
    let (bl, _, tok, _) = models();
    let ids = encode(&tok, "the cat runs");
    let mut seq = SeqText::new(&bl, params(&["cat sleeps"], false, 0, true), &[]);
    for (k, &t) in ids.iter().enumerate() {
        seq.append(&bl, t);
        // The last 9 decoded chars could start "cat sleeps": never emitted.
        let decoded = bl.decode(&ids[..=k], true).chars().count();
        assert_eq!(seq.text().chars().count(), decoded.saturating_sub(9), "token {k}");
    }
    assert_eq!(seq.text(), "the");
    seq.flush(&bl);
    assert_eq!(seq.text(), "the cat runs");
}

/// Each append's delta, then the flushed rest (stream timing, not just the final text).
fn deltas_per_append(model: &TextModel, params: &Arc<StopStrings>, prompt: &[u32], ids: &[u32]) -> Vec<String> {
    let mut seq = SeqText::new(model, params.clone(), prompt);
    let mut out = Vec::new();
    for &t in ids {
        let hit = seq.append(model, t);
        out.push(seq.take_delta().to_owned());
        if hit.is_some() {
            return out;
        }
    }
    seq.flush(model);
    out.push(seq.take_delta().to_owned());
    out
}

/// The id of each single-byte token of the byte-level fixture (GPT-2's byte -> char map).
fn byte_ids(tok: &Tokenizer) -> Vec<u32> {
    let mut extra = 0u32;
    (0..=255u8)
        .map(|b| {
            let printable = matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
            let c = if printable {
                char::from(b)
            } else {
                extra += 1;
                char::from_u32(255 + extra).unwrap()
            };
            tok.token_to_id(&c.to_string()).unwrap_or_else(|| panic!("no byte token for {b:#x}"))
        })
        .collect()
}

#[test]
fn byte_level_fast_path_equals_decoder_path_on_split_and_invalid_bytes() {
    // Characters cut into single bytes, stray continuation and lead bytes, a literal U+FFFD:
    // the fast path's prefix goes valid -> invalid -> valid, and each append must emit what
    // the general path emits, when it emits it.
    let (bl, _, tok, _) = models();
    let general = TextModel::from_json(BYTE_LEVEL).unwrap().without_byte_level_fast_path();
    let bytes = byte_ids(&tok);
    let mut rng = Rng(7);
    let stops: [&[&str]; 3] = [&[], &["\u{FFFD}"], &["é", "🚀a"]];
    for case in 0..800 {
        let mut ids = Vec::new();
        for _ in 0..1 + rng.below(6) {
            let text = TEXTS[rng.below(TEXTS.len())];
            let chars: Vec<char> = text.chars().collect();
            let a = rng.below(chars.len());
            let piece: String = chars[a..(a + 1 + rng.below(6)).min(chars.len())].iter().collect();
            match rng.below(5) {
                0 => ids.extend(piece.bytes().map(|b| bytes[b as usize])),
                1 => ids.push(bytes[0x80 + rng.below(0x80)]),
                2 => ids.extend("\u{FFFD}".bytes().map(|b| bytes[b as usize])),
                3 => ids.extend(piece.bytes().take(1 + rng.below(3)).map(|b| bytes[b as usize])),
                _ => ids.extend(encode(&tok, &piece)),
            }
        }
        let prompt: Vec<u32> = (0..rng.below(8)).map(|_| bytes[rng.below(256)]).collect();
        let p = params(stops[case % 3], case % 4 == 0, 0, true);
        let fast = deltas_per_append(&bl, &p, &prompt, &ids);
        assert_eq!(fast, deltas_per_append(&general, &p, &prompt, &ids), "{ids:?} prompt {prompt:?}");
        if stops[case % 3].is_empty() {
            assert_final_text(&bl, &fast.concat(), &prompt, &ids, true);
        }
    }
}
