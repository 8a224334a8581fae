//! Sampling parameters kept in the core: each request's `SamplingSpec`, copied into its
//! sequences' batch rows, and the per-logits-row columns a step hands the sampler
//! (`SamplingColumns`), so that building a step's sampling metadata reads arrays, not requests.
//!
//! Invariants: a row's spec is its request's (copied when the row is given, moved with the row);
//! a row's uniform draw depends only on its request's key, its sample index and the position of
//! the token it samples, so a seeded request samples the same tokens alone or in any batch, and
//! again after a preemption. The `min_tokens` bans are the tokens `RowStop` would stop on, for
//! rows that have generated fewer than `min_tokens` tokens (vLLM's rule).
//! Costs: O(1) per logits row, plus the banned tokens of rows still under `min_tokens`.

use crate::error::{CoreError, CoreResult};
use xxhash_rust::xxh3::xxh3_64_with_seed;

/// How a request samples (the sampler's knobs; stop rules live in `StopParams`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SamplingSpec {
    /// 0 = greedy.
    pub temperature: f32,
    /// <= 0 = off.
    pub top_k: i32,
    pub top_p: f32,
    pub min_p: f32,
    pub presence_penalty: f32,
    pub frequency_penalty: f32,
    pub repetition_penalty: f32,
    /// Logprobs wanted per sampled token; -1 = none.
    pub num_logprobs: i32,
    /// The key of the request's random draws (`rng_key`): its seed itself when `seeded`.
    pub rng_key: u64,
    /// The request gave a seed: sample `i` draws as the request with seed + i and one sample
    /// would (vLLM's child seeds, so splitting an n>1 request into seeded n=1 ones is the same).
    pub seeded: bool,
    /// The request has `bad_words` (banned per step from its output's tail).
    pub has_bad_words: bool,
    /// The request has a static per-token bias that the engine keeps per batch row
    /// (`logit_bias`, `allowed_token_ids`): its logits rows are listed in `bias_rows`.
    pub has_logit_bias: bool,
}

impl Default for SamplingSpec {
    fn default() -> Self {
        SamplingSpec {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            repetition_penalty: 1.0,
            num_logprobs: -1,
            rng_key: 0,
            seeded: false,
            has_bad_words: false,
            has_logit_bias: false,
        }
    }
}

impl SamplingSpec {
    /// Rejects values the sampler cannot use, naming the field.
    pub fn validate(&self) -> CoreResult<()> {
        let finite = |field: &'static str, v: f32| {
            if v.is_finite() {
                Ok(())
            } else {
                Err(CoreError::invalid(field, v, "must be finite"))
            }
        };
        finite("temperature", self.temperature)?;
        if self.temperature < 0.0 {
            return Err(CoreError::invalid("temperature", self.temperature, "must be >= 0"));
        }
        finite("top_p", self.top_p)?;
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(CoreError::invalid("top_p", self.top_p, "must be in (0, 1]"));
        }
        finite("min_p", self.min_p)?;
        if !(0.0..=1.0).contains(&self.min_p) {
            return Err(CoreError::invalid("min_p", self.min_p, "must be in [0, 1]"));
        }
        finite("presence_penalty", self.presence_penalty)?;
        finite("frequency_penalty", self.frequency_penalty)?;
        finite("repetition_penalty", self.repetition_penalty)?;
        if self.repetition_penalty <= 0.0 {
            return Err(CoreError::invalid("repetition_penalty", self.repetition_penalty, "must be > 0"));
        }
        if self.num_logprobs < -1 {
            return Err(CoreError::invalid("logprobs", self.num_logprobs, "must be >= 0 (or None)"));
        }
        Ok(())
    }

    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0
    }

    pub fn has_penalties(&self) -> bool {
        self.presence_penalty != 0.0 || self.frequency_penalty != 0.0 || self.repetition_penalty != 1.0
    }
}

/// The key of a request's draws: its seed when it has one (reproducible whatever else runs),
/// else a hash of its id and the scheduler's sampling seed.
pub fn rng_key(seed: Option<u64>, request_id: u64, sampling_seed: u64) -> u64 {
    match seed {
        Some(s) => s,
        None => xxh3_64_with_seed(&request_id.to_le_bytes(), sampling_seed),
    }
}

/// The uniform draw in [0, 1) of sample `sample_index` of a request sampling with `spec`, at
/// token position `position`. A seeded sample draws from its own seed, the request's plus its
/// index (two's complement: a seed of -1 and index 1 give seed 0).
#[inline]
pub fn sample_uniform(spec: &SamplingSpec, sample_index: u32, position: u32) -> f64 {
    if spec.seeded {
        let seed = spec.rng_key.wrapping_add(u64::from(sample_index));
        uniform(xxh3_64_with_seed(b"ferrokv-seeded", seed), 0, position)
    } else {
        uniform(spec.rng_key, sample_index, position)
    }
}

/// The uniform draw in [0, 1) keyed by `rng_key`, `sample_index` and `position`.
#[inline]
fn uniform(rng_key: u64, sample_index: u32, position: u32) -> f64 {
    let mut bytes = [0u8; 8];
    bytes[..4].copy_from_slice(&sample_index.to_le_bytes());
    bytes[4..].copy_from_slice(&position.to_le_bytes());
    (xxh3_64_with_seed(&bytes, rng_key) >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
}

/// The last token of each of `bad_words` whose other tokens end the output `tokens[prompt_len..]`
/// followed by `pending` (vLLM's rule: a one-token word is always banned; a longer one only once
/// the output ends with its prefix, which never reaches back into the prompt).
pub fn bad_word_bans<'a>(bad_words: &'a [Vec<u32>], tokens: &'a [u32], pending: &'a [u32], prompt_len: usize) -> impl Iterator<Item = u32> + 'a {
    let out_len = (tokens.len() + pending.len()).saturating_sub(prompt_len);
    // The i-th token from the end of tokens ++ pending.
    let from_end = move |i: usize| if i < pending.len() { pending[pending.len() - 1 - i] } else { tokens[tokens.len() - 1 - (i - pending.len())] };
    bad_words.iter().filter_map(move |w| {
        let (&last, prefix) = w.split_last()?;
        (prefix.len() <= out_len && prefix.iter().rev().enumerate().all(|(i, &t)| from_end(i) == t)).then_some(last)
    })
}

/// A step's sampling parameters per logits row, and flags saying which sampler stages any row
/// needs (a batch that is all greedy needs none).
#[derive(Debug, Default, Clone)]
pub struct SamplingColumns {
    pub temperature: Vec<f32>,
    pub top_k: Vec<i32>,
    pub top_p: Vec<f32>,
    pub min_p: Vec<f32>,
    pub presence: Vec<f32>,
    pub frequency: Vec<f32>,
    pub repetition: Vec<f32>,
    pub num_logprobs: Vec<i32>,
    pub uniform: Vec<f64>,
    /// The row's batch row (where penalty statistics can be kept across steps); -1 for the
    /// samples an `n > 1` request forks off its prompt at this step.
    pub batch_rows: Vec<i32>,
    /// Tokens the row's sequence had generated before this step.
    pub num_output: Vec<i32>,
    /// Bans as (logits row, token) pairs: what would stop a row under `min_tokens`, and the
    /// `bad_words` whose other tokens end the row's output.
    pub banned_rows: Vec<i64>,
    pub banned_tokens: Vec<i64>,
    /// Logits rows whose request has a static bias (`SamplingSpec::has_logit_bias`).
    pub bias_rows: Vec<i64>,
    pub num_greedy_rows: usize,
    pub max_top_k: i32,
    pub any_top_p: bool,
    pub any_min_p: bool,
    pub any_penalties: bool,
    pub any_logprobs: bool,
}

impl SamplingColumns {
    pub fn with_capacity(rows: usize) -> Self {
        SamplingColumns {
            temperature: Vec::with_capacity(rows),
            top_k: Vec::with_capacity(rows),
            top_p: Vec::with_capacity(rows),
            min_p: Vec::with_capacity(rows),
            presence: Vec::with_capacity(rows),
            frequency: Vec::with_capacity(rows),
            repetition: Vec::with_capacity(rows),
            num_logprobs: Vec::with_capacity(rows),
            uniform: Vec::with_capacity(rows),
            batch_rows: Vec::with_capacity(rows),
            num_output: Vec::with_capacity(rows),
            ..Default::default()
        }
    }

    pub fn len(&self) -> usize {
        self.temperature.len()
    }

    pub fn is_empty(&self) -> bool {
        self.temperature.is_empty()
    }

    /// Appends one logits row: sample `sample_index` of a sequence in batch row `batch_row`
    /// (-1: none yet) with `num_output` tokens generated, sampling the token at `position`.
    #[inline]
    pub fn push(&mut self, spec: &SamplingSpec, sample_index: u32, position: u32, batch_row: i32, num_output: u32) {
        self.extend(std::slice::from_ref(spec), [(sample_index, position, batch_row, num_output)]);
    }

    /// Appends one logits row per spec, in bulk: `rows` gives each its sample index, position,
    /// batch row and output count (as `push`), in the same order.
    #[inline]
    pub fn extend<I>(&mut self, specs: &[SamplingSpec], rows: I)
    where
        I: IntoIterator<Item = (u32, u32, i32, u32)>,
        I::IntoIter: Clone,
    {
        let rows = rows.into_iter();
        let first = self.temperature.len();
        self.temperature.extend(specs.iter().map(|s| s.temperature));
        self.top_k.extend(specs.iter().map(|s| s.top_k));
        self.top_p.extend(specs.iter().map(|s| s.top_p));
        self.min_p.extend(specs.iter().map(|s| s.min_p));
        self.presence.extend(specs.iter().map(|s| s.presence_penalty));
        self.frequency.extend(specs.iter().map(|s| s.frequency_penalty));
        self.repetition.extend(specs.iter().map(|s| s.repetition_penalty));
        self.num_logprobs.extend(specs.iter().map(|s| s.num_logprobs));
        // One exact-size pass per column (no per-row capacity checks).
        let draw = |(spec, (sample_index, position, _, _)): (&SamplingSpec, (u32, u32, i32, u32))| {
            if spec.is_greedy() { 0.0 } else { sample_uniform(spec, sample_index, position) }
        };
        self.uniform.extend(specs.iter().zip(rows.clone()).map(draw));
        self.batch_rows.extend(rows.clone().map(|(_, _, batch_row, _)| batch_row));
        self.num_output.extend(rows.map(|(_, _, _, num_output)| num_output.min(i32::MAX as u32) as i32));
        debug_assert_eq!(self.uniform.len(), self.temperature.len(), "one row per spec");
        for (i, spec) in specs.iter().enumerate() {
            if spec.has_logit_bias {
                self.bias_rows.push((first + i) as i64);
            }
        }
    }

    /// Bans `tokens` for logits row `row`.
    pub fn ban(&mut self, row: usize, tokens: impl IntoIterator<Item = u32>) {
        debug_assert!(row < self.len());
        for t in tokens {
            self.banned_rows.push(row as i64);
            self.banned_tokens.push(t as i64);
        }
    }

    /// Sets the flags from the columns (once per step).
    pub fn finish(&mut self) {
        // Branch-free folds (they vectorize): the common step has none of these set.
        self.num_greedy_rows = self.temperature.iter().map(|&t| usize::from(t == 0.0)).sum();
        self.max_top_k = self.top_k.iter().fold(0, |m, &k| m.max(k));
        self.any_top_p = self.top_p.iter().fold(false, |a, &p| a | (p < 1.0));
        self.any_min_p = self.min_p.iter().fold(false, |a, &p| a | (p > 0.0));
        let penalties = self.presence.iter().zip(&self.frequency).zip(&self.repetition);
        self.any_penalties = penalties.fold(false, |a, ((&p, &f), &r)| a | (p != 0.0) | (f != 0.0) | (r != 1.0));
        self.any_logprobs = self.num_logprobs.iter().fold(false, |a, &n| a | (n >= 0));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uniforms_are_in_range_and_depend_only_on_key_sample_and_position() {
        let k = rng_key(Some(7), 1, 99);
        assert_eq!(k, rng_key(Some(7), 2, 5), "a seeded key ignores the request id and the engine seed");
        assert_ne!(rng_key(None, 1, 99), rng_key(None, 2, 99));
        assert_ne!(rng_key(None, 1, 99), rng_key(None, 1, 98));
        let mut seen = std::collections::HashSet::new();
        for s in 0..4 {
            for p in 0..256 {
                let u = uniform(k, s, p);
                assert!((0.0..1.0).contains(&u));
                assert_eq!(u, uniform(k, s, p));
                seen.insert(u.to_bits());
            }
        }
        assert_eq!(seen.len(), 1024, "distinct draws per (sample, position)");
        let mean: f64 = (0..10_000).map(|p| uniform(k, 0, p)).sum::<f64>() / 10_000.0;
        assert!((mean - 0.5).abs() < 0.02, "{mean}");
    }

    #[test]
    fn a_seeded_sample_draws_as_one_sample_with_the_seed_plus_its_index() {
        let seeded = |seed: i64| SamplingSpec { rng_key: rng_key(Some(seed as u64), 1, 2), seeded: true, ..Default::default() };
        for p in 0..64 {
            for i in 0..4u32 {
                assert_eq!(sample_uniform(&seeded(7), i, p), sample_uniform(&seeded(7 + i as i64), 0, p));
            }
            assert_eq!(sample_uniform(&seeded(-1), 1, p), sample_uniform(&seeded(0), 0, p), "two's complement");
            assert_ne!(sample_uniform(&seeded(7), 0, p), sample_uniform(&seeded(7), 1, p));
        }
        let unseeded = SamplingSpec { rng_key: rng_key(None, 1, 2), ..Default::default() };
        assert_ne!(sample_uniform(&unseeded, 0, 5), sample_uniform(&unseeded, 1, 5), "unseeded samples differ too");
    }

    #[test]
    fn validate_names_the_bad_field() {
        let bad = |f: fn(&mut SamplingSpec)| {
            let mut s = SamplingSpec::default();
            f(&mut s);
            match s.validate() {
                Err(CoreError::InvalidArgument { field, .. }) => field,
                other => panic!("{s:?}: {other:?}"),
            }
        };
        assert!(SamplingSpec::default().validate().is_ok());
        assert_eq!(bad(|s| s.temperature = -1.0), "temperature");
        assert_eq!(bad(|s| s.temperature = f32::NAN), "temperature");
        assert_eq!(bad(|s| s.top_p = 0.0), "top_p");
        assert_eq!(bad(|s| s.top_p = 1.5), "top_p");
        assert_eq!(bad(|s| s.min_p = -0.1), "min_p");
        assert_eq!(bad(|s| s.presence_penalty = f32::INFINITY), "presence_penalty");
        assert_eq!(bad(|s| s.repetition_penalty = 0.0), "repetition_penalty");
        assert_eq!(bad(|s| s.num_logprobs = -2), "logprobs");
    }

    #[test]
    fn bad_words_ban_their_last_token_once_the_output_ends_with_the_rest() {
        let words = vec![vec![7], vec![1, 2, 3], vec![2, 9], vec![5, 6]];
        let bans = |tokens: &[u32], pending: &[u32], prompt_len| bad_word_bans(&words, tokens, pending, prompt_len).collect::<Vec<_>>();
        // Prompt [5], no output: only the one-token word (the prefix never reaches the prompt).
        assert_eq!(bans(&[5], &[], 1), vec![7]);
        assert_eq!(bans(&[5, 1, 2], &[], 1), vec![7, 3, 9]);
        // The same output split between the sequence and its staged tokens.
        assert_eq!(bans(&[5, 1], &[2], 1), vec![7, 3, 9]);
        assert_eq!(bans(&[5], &[1, 2], 1), vec![7, 3, 9]);
        assert_eq!(bans(&[5, 1, 2, 5], &[], 1), vec![7, 6]);
        // [5, 6]'s prefix 5 is the prompt's last token, not output: not banned.
        assert_eq!(bans(&[9, 5], &[], 2), vec![7]);
        assert_eq!(bans(&[1, 2], &[], 1), vec![7, 9], "[1, 2, 3] needs 1 in the output");
    }

    #[test]
    fn rows_appended_in_bulk_equal_a_row_by_row_reference() {
        use proptest::prelude::*;
        let knobs = (0u8..4, 0i32..4, 0u8..3, any::<bool>(), any::<bool>(), any::<bool>(), -1i32..3, any::<u64>());
        let spec = knobs.prop_map(
            |(t, top_k, p, pen, seeded, bias, lp, key)| SamplingSpec {
                temperature: [0.0, 0.5, 1.0, 1.7][t as usize],
                top_k,
                top_p: [1.0, 0.9, 0.3][p as usize],
                min_p: if pen { 0.1 } else { 0.0 },
                presence_penalty: if pen { 0.5 } else { 0.0 },
                repetition_penalty: if seeded { 1.2 } else { 1.0 },
                num_logprobs: lp,
                rng_key: key,
                seeded,
                has_logit_bias: bias,
                ..Default::default()
            },
        );
        let row = (0u32..4, 0u32..5000, -1i32..64, 0u32..3000);
        let case = (proptest::collection::vec((spec, row), 0..40), 0usize..3);
        proptest::test_runner::TestRunner::default()
            .run(&case, |(rows, before)| {
                let specs: Vec<SamplingSpec> = rows.iter().map(|(s, _)| *s).collect();
                let (mut bulk, mut one) = (SamplingColumns::with_capacity(0), SamplingColumns::with_capacity(0));
                for c in [&mut bulk, &mut one] {
                    for i in 0..before {
                        c.push(&SamplingSpec { has_logit_bias: i == 1, ..Default::default() }, 0, i as u32, 0, 0);
                    }
                }
                bulk.extend(&specs, rows.iter().map(|(_, r)| *r));
                for &(ref s, (si, pos, br, no)) in &rows {
                    // The reference: one row at a time, each column written from its definition.
                    if s.has_logit_bias {
                        one.bias_rows.push(one.temperature.len() as i64);
                    }
                    one.temperature.push(s.temperature);
                    one.top_k.push(s.top_k);
                    one.top_p.push(s.top_p);
                    one.min_p.push(s.min_p);
                    one.presence.push(s.presence_penalty);
                    one.frequency.push(s.frequency_penalty);
                    one.repetition.push(s.repetition_penalty);
                    one.num_logprobs.push(s.num_logprobs);
                    one.uniform.push(if s.temperature == 0.0 { 0.0 } else { sample_uniform(s, si, pos) });
                    one.batch_rows.push(br);
                    one.num_output.push(no as i32);
                }
                bulk.finish();
                one.finish();
                prop_assert_eq!(format!("{bulk:?}"), format!("{one:?}"));
                Ok(())
            })
            .unwrap();
    }

    #[test]
    fn columns_flags_follow_the_rows() {
        let mut c = SamplingColumns::with_capacity(2);
        c.push(&SamplingSpec::default(), 0, 5, 0, 1);
        c.finish();
        assert_eq!((c.num_greedy_rows, c.max_top_k, c.any_top_p, c.any_penalties, c.any_logprobs), (1, 0, false, false, false));
        assert_eq!(c.uniform, vec![0.0], "a greedy row draws nothing");
        let hot = SamplingSpec { temperature: 0.8, top_k: 5, top_p: 0.9, repetition_penalty: 1.2, num_logprobs: 0, rng_key: 3, ..Default::default() };
        c.push(&hot, 1, 5, -1, 0);
        c.ban(1, [2, 9]);
        c.finish();
        assert_eq!((c.num_greedy_rows, c.max_top_k, c.any_top_p, c.any_penalties, c.any_logprobs), (1, 5, true, true, true));
        assert_eq!((c.banned_rows.clone(), c.banned_tokens.clone()), (vec![1, 1], vec![2, 9]));
        assert_eq!(c.uniform[1], uniform(3, 1, 5));
        assert!(c.bias_rows.is_empty());
        c.push(&SamplingSpec { has_logit_bias: true, ..Default::default() }, 0, 5, 2, 0);
        assert_eq!(c.bias_rows, vec![2], "a biased row lists its logits row");
    }
}
