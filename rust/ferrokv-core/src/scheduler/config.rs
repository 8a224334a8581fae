//! The scheduler's configuration and the request a caller submits.
//!
//! Invariants: `SchedulerConfig::default()` is the one source of every default (the bindings'
//! keyword defaults and the Python `EngineArgs` read it); `validate` is the one check of a
//! configuration (the Python side calls it before loading a model). Sizes are checked with
//! wide arithmetic, so no user-given size can overflow an allocation.
//! Costs: O(1).

use crate::error::{CoreError, CoreResult};
use crate::sampling::SamplingSpec;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PreemptionMode {
    Recompute,
    Swap,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Policy {
    Fcfs,
    Priority,
}

/// A setting chosen by name: its names, and parsing with a typed error naming the field.
pub trait Named: Copy + 'static {
    const FIELD: &'static str;
    const ALL: &'static [(Self, &'static str)];

    fn as_str(self) -> &'static str
    where
        Self: PartialEq,
    {
        Self::ALL.iter().find(|(v, _)| *v == self).map(|(_, n)| *n).expect("every value is named")
    }

    fn parse(name: &str) -> CoreResult<Self> {
        Self::ALL.iter().find(|(_, n)| *n == name).map(|(v, _)| *v).ok_or_else(|| {
            let names: Vec<String> = Self::ALL.iter().map(|(_, n)| format!("{n:?}")).collect();
            CoreError::invalid(Self::FIELD, format!("{name:?}"), format!("must be one of {}", names.join(", ")))
        })
    }
}

impl Named for PreemptionMode {
    const FIELD: &'static str = "preemption_mode";
    const ALL: &'static [(Self, &'static str)] = &[(PreemptionMode::Recompute, "recompute"), (PreemptionMode::Swap, "swap")];
}

impl Named for Policy {
    const FIELD: &'static str = "policy";
    const ALL: &'static [(Self, &'static str)] = &[(Policy::Fcfs, "fcfs"), (Policy::Priority, "priority")];
}

/// The most blocks in either pool: 2^28 (over 4 billion tokens at 16 tokens a block). Every
/// size the core allocates up front is checked against these bounds before it is allocated.
pub const MAX_BLOCKS: usize = 1 << 28;
pub const MAX_BLOCK_SIZE: usize = 1 << 16;
const MAX_TOKEN_SLOTS: u128 = 1 << 40;

#[derive(Debug, Clone)]
pub struct SchedulerConfig {
    pub num_blocks: usize,
    pub block_size: usize,
    pub max_num_seqs: usize,
    pub max_num_batched_tokens: usize,
    pub max_model_len: usize,
    pub enable_prefix_caching: bool,
    pub preemption_mode: PreemptionMode,
    pub num_cpu_blocks: usize,
    pub policy: Policy,
    /// Fraction of blocks admission keeps free for running sequences to grow into.
    pub watermark: f64,
    /// Extra free blocks admission keeps back per running sequence, so that the batch can grow
    /// for a while before anyone must be preempted (the cure for admit-then-preempt thrash).
    pub admission_headroom: f64,
    /// The key of unseeded requests' random draws (with their ids): an engine seed replays them.
    pub sampling_seed: u64,
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        SchedulerConfig {
            num_blocks: 1024,
            block_size: 16,
            max_num_seqs: 256,
            max_num_batched_tokens: 8192,
            max_model_len: 8192,
            enable_prefix_caching: true,
            preemption_mode: PreemptionMode::Recompute,
            num_cpu_blocks: 0,
            policy: Policy::Fcfs,
            watermark: 0.01,
            admission_headroom: 1.0,
            sampling_seed: 0,
        }
    }
}

impl SchedulerConfig {
    pub fn validate(&self) -> CoreResult<()> {
        if self.num_blocks < 2 {
            return Err(CoreError::invalid("num_blocks", self.num_blocks, "must be >= 2 (block 0 is the null block)"));
        }
        if self.num_blocks > MAX_BLOCKS {
            return Err(CoreError::invalid("num_blocks", self.num_blocks, format!("must be <= {MAX_BLOCKS} (2^28)")));
        }
        if self.num_cpu_blocks > MAX_BLOCKS {
            return Err(CoreError::invalid("num_cpu_blocks", self.num_cpu_blocks, format!("must be <= {MAX_BLOCKS} (2^28)")));
        }
        if !self.block_size.is_power_of_two() {
            // The paged-attention kernels tile a block by it, and the core's block math shifts.
            return Err(CoreError::invalid("block_size", self.block_size, "must be a power of two (1, 2, 4, ..., 16, 32, ...)"));
        }
        if self.block_size > MAX_BLOCK_SIZE {
            return Err(CoreError::invalid("block_size", self.block_size, format!("must be <= {MAX_BLOCK_SIZE}")));
        }
        // Token slots (block * block_size + offset) are i64 in the step's arrays and index the
        // prefix cache's token arena: the product stays far from any overflow.
        if (self.num_blocks as u128) * (self.block_size as u128) > MAX_TOKEN_SLOTS {
            return Err(CoreError::invalid(
                "num_blocks",
                self.num_blocks,
                format!("num_blocks * block_size ({}) must be <= 2^40 token slots", self.block_size),
            ));
        }
        if self.max_num_seqs == 0 {
            return Err(CoreError::invalid("max_num_seqs", self.max_num_seqs, "must be >= 1"));
        }
        if self.max_num_batched_tokens < self.max_num_seqs {
            return Err(CoreError::invalid(
                "max_num_batched_tokens",
                self.max_num_batched_tokens,
                format!("must be >= max_num_seqs ({}) so every running sequence can decode", self.max_num_seqs),
            ));
        }
        if self.max_model_len == 0 {
            return Err(CoreError::invalid("max_model_len", self.max_model_len, "must be >= 1"));
        }
        // The batch matrix holds max_num_seqs rows of ceil(max_model_len / block_size) blocks
        // (committed lazily by the OS, but its address space is reserved up front): at most 1 GiB.
        if self.max_num_seqs > 1 << 28 {
            // Too many rows whatever the length (the one to blame when max_model_len is not known yet).
            return Err(CoreError::invalid("max_num_seqs", self.max_num_seqs, "must be <= 2^28 (block-table rows)"));
        }
        let entries = self.max_num_seqs as u128 * self.max_model_len.div_ceil(self.block_size) as u128;
        if entries > 1 << 28 {
            return Err(CoreError::invalid(
                "max_model_len",
                self.max_model_len,
                format!(
                    "max_num_seqs ({}) * max_model_len / block_size must be <= 2^28 block-table entries \
                     (lower max_num_seqs or max_model_len)",
                    self.max_num_seqs
                ),
            ));
        }
        if !(0.0..1.0).contains(&self.watermark) {
            return Err(CoreError::invalid("watermark", self.watermark, "must be in [0, 1)"));
        }
        if !(0.0..=16.0).contains(&self.admission_headroom) {
            return Err(CoreError::invalid("admission_headroom", self.admission_headroom, "must be in [0, 16]"));
        }
        Ok(())
    }
}

/// A request as the caller submits it.
#[derive(Debug, Clone, Default)]
pub struct NewRequest {
    pub request_id: u64,
    pub prompt_token_ids: Vec<u32>,
    pub max_tokens: usize,
    pub n: u32,
    pub priority: i32,
    pub eos_token_id: Option<u32>,
    pub stop_token_ids: Vec<u32>,
    pub min_tokens: usize,
    pub ignore_eos: bool,
    /// Banned under `min_tokens` besides EOS and the stop ids (`StopParams::min_tokens_bans`).
    pub min_tokens_bans: Vec<u32>,
    pub cache_salt: Option<String>,
    /// Sequence slots to hold for the request's whole life (e.g. a beam width), 0 = `n`.
    pub reserve_seqs: u32,
    /// How it samples; `rng_key` is set by `add_request` (from `seed`, else the request id).
    pub sampling: SamplingSpec,
    /// Its own sampling seed: its draws then depend on nothing else.
    pub seed: Option<u64>,
    /// Token sequences it must never generate (`sampling.has_bad_words` is set from it).
    pub bad_words: Vec<Vec<u32>>,
    /// Its prompt is computed in full, never read from the prefix cache (prompt logprobs need
    /// every position's logits); its blocks are still registered for others.
    pub skip_cache_hits: bool,
}

impl NewRequest {
    pub fn new(request_id: u64, prompt_token_ids: Vec<u32>, max_tokens: usize) -> Self {
        NewRequest { request_id, prompt_token_ids, max_tokens, n: 1, ..Default::default() }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn field_of(cfg: SchedulerConfig) -> &'static str {
        match cfg.validate() {
            Err(CoreError::InvalidArgument { field, .. }) => field,
            other => panic!("{cfg:?} validated as {other:?}"),
        }
    }

    #[test]
    fn the_default_configuration_is_valid() {
        SchedulerConfig::default().validate().unwrap();
    }

    #[test]
    fn every_bad_size_is_an_error_naming_its_field() {
        let d = SchedulerConfig::default;
        assert_eq!(field_of(SchedulerConfig { num_blocks: 1, ..d() }), "num_blocks");
        assert_eq!(field_of(SchedulerConfig { num_blocks: u32::MAX as usize, ..d() }), "num_blocks");
        assert_eq!(field_of(SchedulerConfig { block_size: 12, ..d() }), "block_size");
        assert_eq!(field_of(SchedulerConfig { block_size: 0, ..d() }), "block_size");
        assert_eq!(field_of(SchedulerConfig { max_num_seqs: 0, ..d() }), "max_num_seqs");
        assert_eq!(field_of(SchedulerConfig { max_num_batched_tokens: 8, max_num_seqs: 16, ..d() }), "max_num_batched_tokens");
        assert_eq!(field_of(SchedulerConfig { max_model_len: 0, ..d() }), "max_model_len");
        // max_num_seqs * max_model_len / block_size block-table entries: at most 2^28.
        assert_eq!(field_of(SchedulerConfig { max_num_seqs: 1 << 12, max_model_len: 1 << 21, ..d() }), "max_model_len");
        let rows = (1 << 28) + 1;
        let too_many = SchedulerConfig { max_num_seqs: rows, max_num_batched_tokens: rows, max_model_len: 1, ..d() };
        assert_eq!(field_of(too_many), "max_num_seqs");
        assert_eq!(field_of(SchedulerConfig { watermark: 1.0, ..d() }), "watermark");
        assert_eq!(field_of(SchedulerConfig { watermark: f64::NAN, ..d() }), "watermark");
        assert_eq!(field_of(SchedulerConfig { admission_headroom: -1.0, ..d() }), "admission_headroom");
    }

    #[test]
    fn sizes_that_would_overflow_or_exhaust_memory_are_errors_not_aborts() {
        let d = SchedulerConfig::default;
        assert_eq!(field_of(SchedulerConfig { num_blocks: 32, block_size: 1 << 40, ..d() }), "block_size");
        assert_eq!(field_of(SchedulerConfig { num_blocks: 4, block_size: 1 << 62, ..d() }), "block_size");
        assert_eq!(field_of(SchedulerConfig { num_blocks: 1 << 31, ..d() }), "num_blocks");
        assert_eq!(field_of(SchedulerConfig { num_blocks: 8, num_cpu_blocks: (1 << 32) - 2, ..d() }), "num_cpu_blocks");
        assert_eq!(field_of(SchedulerConfig { num_blocks: MAX_BLOCKS, block_size: MAX_BLOCK_SIZE, ..d() }), "num_blocks");
        // At the bounds, the configuration is valid (allocation is then fallible, see kv tests).
        let edge = SchedulerConfig { num_blocks: MAX_BLOCKS, num_cpu_blocks: MAX_BLOCKS, block_size: 4096, ..d() };
        edge.validate().unwrap();
    }

    #[test]
    fn modes_and_policies_parse_their_own_names_only() {
        for m in [PreemptionMode::Recompute, PreemptionMode::Swap] {
            assert_eq!(PreemptionMode::parse(m.as_str()), Ok(m));
        }
        for p in [Policy::Fcfs, Policy::Priority] {
            assert_eq!(Policy::parse(p.as_str()), Ok(p));
        }
        assert!(matches!(PreemptionMode::parse("Swap"), Err(CoreError::InvalidArgument { field: "preemption_mode", .. })));
        assert!(matches!(Policy::parse(""), Err(CoreError::InvalidArgument { field: "policy", .. })));
    }
}
