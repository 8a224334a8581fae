//! Iteration-level scheduler with a token budget (vLLM V1 style).
//!
//! Each `schedule()`:
//! 1. gives every running sequence what it still needs (one decode token, or the next prefill
//!    chunk), within `max_num_batched_tokens`. The common step, where every running sequence
//!    decodes one token and all fit, is planned row by row over the persistent batch
//!    (`batch.rs`) without looking at a request; otherwise requests are walked in order
//!    (priority, then arrival), and one whose blocks cannot be found preempts the
//!    lowest-priority, latest-arrived running request (the back of the list), possibly itself.
//! 2. if nothing was preempted, admits waiting requests in order while their next chunk fits
//!    in the budget, in `max_num_seqs`, and in the free blocks minus a small watermark kept for
//!    running sequences to grow. The head of the queue blocks the rest (no starvation).
//! 3. flattens the planned rows, in row order, into the arrays of `SchedulerOutput`; when every
//!    running sequence is in the step the block tables are the batch matrix itself.
//!
//! `update()` then appends one sampled token per logits row (staged in the rows), decides stop
//! conditions from per-row thresholds, frees finished sequences at once and registers newly
//! computed full blocks in the prefix cache. Only rows that need their sequence (a completed
//! block, a stop, a full stage, a fan-out) reach it.
//!
//! Invariants: the scheduler never touches reference counts (the KV-cache manager does); a
//! request that could never fit is rejected when added, so no step spins on it; every running
//! sequence owns one batch row that holds its computed count, its block table and, after it,
//! the fresh blocks decode steps gave the row (the table adopts them when the row is flushed);
//! `check_invariants` verifies all of it.
//!
//! Costs: a step is O(running sequences) plus O(tokens and blocks that change): a decode row
//! costs a few loads and stores; block tables are never rebuilt. The number of waiting or
//! finished requests never enters it. Preemption scans nothing: the victim is the back of the
//! sorted running list.

use crate::batch::{Batch, Moved, RowInit, RowState, SeqRef, TableRef, NO_ROW, PENDING_TOKENS};
use crate::block_pool::{BlockId, BlockMath};
use crate::error::{CoreError, CoreResult};
use crate::kv_cache_manager::{BlockTable, KvCacheManager, KvStats};
use crate::output::{BlockTables, FinishedSeq, SchedulerOutput};
use crate::request::{FinishReason, Request, RequestState, RowStop, Sequence, StopParams};
use std::collections::{BTreeSet, HashMap};

/// How much of a new running sequence's token list is mapped at admission (16,384 tokens): all
/// of a typical reservation, and a bounded cost when `max_tokens` is huge.
const PREFAULT_TOKEN_BYTES: usize = 64 << 10;

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
        }
    }
}

impl SchedulerConfig {
    pub fn validate(&self) -> CoreResult<()> {
        if self.num_blocks < 2 {
            return Err(CoreError::invalid("num_blocks", self.num_blocks, "must be >= 2 (block 0 is the null block)"));
        }
        if self.num_blocks >= u32::MAX as usize || self.num_cpu_blocks >= u32::MAX as usize {
            return Err(CoreError::invalid("num_blocks", self.num_blocks, "must fit in 32 bits"));
        }
        if !self.block_size.is_power_of_two() {
            // The paged-attention kernels tile a block by it, and the core's block math shifts.
            return Err(CoreError::invalid("block_size", self.block_size, "must be a power of two (1, 2, 4, ..., 16, 32, ...)"));
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
        let entries = self.max_num_seqs as u128 * self.max_model_len.div_ceil(self.block_size) as u128;
        if entries > 1 << 28 {
            return Err(CoreError::invalid(
                "max_model_len",
                self.max_model_len,
                format!("max_num_seqs ({}) * max_model_len / block_size must be <= 2^28 block-table entries", self.max_num_seqs),
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
    pub cache_salt: Option<String>,
    /// Sequence slots to hold for the request's whole life (e.g. a beam width), 0 = `n`.
    pub reserve_seqs: u32,
}

impl NewRequest {
    pub fn new(request_id: u64, prompt_token_ids: Vec<u32>, max_tokens: usize) -> Self {
        NewRequest { request_id, prompt_token_ids, max_tokens, n: 1, ..Default::default() }
    }
}

#[derive(Debug, Default, Clone, Copy)]
pub struct SchedulerStats {
    pub steps: u64,
    pub requests_added: u64,
    pub requests_finished: u64,
    pub requests_aborted: u64,
    /// Requests ended because they could not fit even alone (only beam forks can cause it).
    pub capacity_aborts: u64,
    pub preemptions: u64,
    pub swap_preemptions: u64,
    pub recompute_preemptions: u64,
    /// Sum of prompt lengths of added requests.
    pub prompt_tokens: u64,
    /// Prompt positions computed, recomputation included.
    pub prompt_tokens_computed: u64,
    /// Output positions computed again after a recompute preemption.
    pub output_tokens_recomputed: u64,
    /// Prompt positions served from the prefix cache, over all admissions.
    pub cached_prompt_tokens: u64,
    /// Prompt positions served from the prefix cache at each request's first admission.
    pub first_admission_cached_tokens: u64,
    pub decode_tokens: u64,
    pub generated_tokens: u64,
    pub max_running_seqs: u64,
    pub max_step_tokens: u64,
}

#[derive(Debug, Clone, Copy)]
pub struct KvUsage {
    pub num_blocks: usize,
    pub num_free_blocks: usize,
    pub num_used_blocks: usize,
    pub num_cached_blocks: usize,
    /// Blocks referenced by more than one block table.
    pub num_shared_blocks: usize,
    /// Sum over block tables of their lengths (what the blocks would be without sharing).
    pub num_block_refs: usize,
    /// Token slots holding computed KV in used blocks (shared blocks counted once).
    pub num_used_token_slots: usize,
    pub block_size: usize,
}

enum Attempt {
    Scheduled { tokens: usize, full: bool },
    NoBudget,
    NoSpace,
}

/// A step between `schedule` and `update`. Its plan (tokens, sampling rows, fan-outs) lives in
/// the batch rows and moves with them.
struct InFlight {
    step_id: u64,
    num_logits_rows: usize,
    /// A fork since `schedule` legitimately shares blocks this step wrote.
    forked: bool,
}

/// How `plan_decode_rows` planned the step's decodes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum DecodePlan {
    /// Every running sequence, and the step's arrays emitted.
    All,
    /// Every all-decode request; the per-request walk continues at `running[generic_from..]`.
    Front { generic_from: usize },
    /// Nothing: the per-request walk plans the whole step.
    None,
}

/// What the step being built holds so far.
#[derive(Debug, Default, Clone, Copy)]
struct StepCounts {
    seqs: usize,
    tokens: usize,
    logits_rows: usize,
    /// Single-token decodes (not a recompute chunk ending at the last token).
    decode_tokens: usize,
}

pub struct Scheduler {
    cfg: SchedulerConfig,
    kv: KvCacheManager,
    requests: Vec<Option<Request>>,
    free_slots: Vec<u32>,
    by_id: HashMap<u64, u32>,
    seq_owner: HashMap<u64, u32>,
    waiting: BTreeSet<(i64, u64, u32)>,
    running: Vec<u32>,
    num_running_seqs: usize,
    watermark_blocks: usize,
    next_arrival: u64,
    next_seq_id: u64,
    step_id: u64,
    in_flight: Option<InFlight>,
    /// Set while `update` runs: leaving rows are marked dead and compacted at its end.
    defer_row_removal: bool,
    batch: Batch,
    pending_finished: Vec<FinishedSeq>,
    ended_ids: Vec<i64>,
    ending: Vec<bool>,
    plan: Vec<(usize, usize)>,
    step: StepCounts,
    /// The output the all-decode path emitted: (buffers, rows emitted, widest table).
    emitted: Option<(SchedulerOutput, usize, usize)>,
    /// Reused list of rows that need per-sequence work in `update`.
    scratch_rows: Vec<u32>,
    /// Reused list of request slots, and a mark per slot (both empty between uses).
    scratch_slots: Vec<u32>,
    mark: Vec<bool>,
    bm: BlockMath,
    hits: Vec<Vec<BlockId>>,
    stats: SchedulerStats,
}

/// The block a decode row writes its next token into, when that token does not start a new
/// block; `None` when another table shares the block (copy it first). Usually it is the row's
/// last block, known unshared, and neither the matrix nor the block pool is read; otherwise
/// the pool answers, and a last block found unshared is recorded as such (`tail_owned`, a
/// fact whether or not the step goes ahead).
fn owned_write_block(h: &mut RowState, table: &TableRef<'_>, r: usize, kv: &KvCacheManager, bm: BlockMath) -> Option<i32> {
    let c = h.computed as usize;
    debug_assert_ne!(bm.offset(c), 0, "a write that starts a block gets a fresh one");
    let in_tail = bm.block(c) + 1 == h.num_blocks as usize;
    if in_tail && h.tail_owned {
        return Some(h.tail_block as i32);
    }
    let blk = if in_tail { h.tail_block as i32 } else { table.block(r, bm.block(c)) };
    if kv.ref_count(BlockId(blk as u32)) != 1 {
        return None;
    }
    h.tail_owned |= in_tail;
    Some(blk)
}

impl Scheduler {
    pub fn new(cfg: SchedulerConfig) -> CoreResult<Self> {
        cfg.validate()?;
        let kv = KvCacheManager::new(cfg.num_blocks, cfg.block_size, cfg.num_cpu_blocks, cfg.enable_prefix_caching);
        let watermark_blocks = ((cfg.num_blocks - 1) as f64 * cfg.watermark) as usize;
        // Step ids are unique across scheduler instances, so update() can reject another
        // scheduler's output.
        static INSTANCES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
        let instance = INSTANCES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let batch = Batch::new(cfg.max_num_seqs, cfg.max_model_len.div_ceil(cfg.block_size)).ok_or_else(|| {
            CoreError::invalid("max_num_seqs", cfg.max_num_seqs, "the batch's block-table matrix cannot be allocated (lower it or max_model_len)")
        })?;
        Ok(Scheduler {
            bm: BlockMath::new(cfg.block_size),
            batch,
            cfg,
            kv,
            requests: Vec::new(),
            free_slots: Vec::new(),
            by_id: HashMap::new(),
            seq_owner: HashMap::new(),
            waiting: BTreeSet::new(),
            running: Vec::new(),
            num_running_seqs: 0,
            watermark_blocks,
            next_arrival: 0,
            next_seq_id: 0,
            step_id: instance << 32,
            in_flight: None,
            defer_row_removal: false,
            pending_finished: Vec::new(),
            ended_ids: Vec::new(),
            ending: Vec::new(),
            plan: Vec::new(),
            step: StepCounts::default(),
            emitted: None,
            scratch_rows: Vec::new(),
            scratch_slots: Vec::new(),
            mark: Vec::new(),
            hits: Vec::new(),
            stats: SchedulerStats::default(),
        })
    }

    pub fn config(&self) -> &SchedulerConfig {
        &self.cfg
    }
    pub fn num_free_blocks(&self) -> usize {
        self.kv.num_free_blocks()
    }
    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }
    pub fn num_running(&self) -> usize {
        self.running.len()
    }
    pub fn num_running_seqs(&self) -> usize {
        self.num_running_seqs
    }
    pub fn num_unfinished(&self) -> usize {
        self.by_id.len()
    }
    pub fn has_unfinished(&self) -> bool {
        !self.by_id.is_empty()
    }
    pub fn stats(&self) -> SchedulerStats {
        self.stats
    }
    pub fn kv_stats(&self) -> KvStats {
        self.kv.stats()
    }
    pub fn watermark_blocks(&self) -> usize {
        self.watermark_blocks
    }

    /// Blocks a request may need in the worst case: the prompt's full blocks are shared by
    /// its samples, everything after them is private to each sample. After a recompute
    /// preemption every sample is recomputed on its own and sharing is not guaranteed (it
    /// comes back only through prefix-cache hits), so in recompute mode nothing is shared.
    fn worst_case_blocks(&self, prompt_len: usize, max_tokens: usize, n: usize) -> usize {
        let bs = self.cfg.block_size;
        let total = (prompt_len + max_tokens).min(self.cfg.max_model_len).max(prompt_len);
        let shares = n > 1 && self.cfg.preemption_mode == PreemptionMode::Swap;
        let shared = if shares { prompt_len / bs } else { 0 };
        shared + n * (total.div_ceil(bs) - shared)
    }

    pub fn add_request(&mut self, r: NewRequest) -> CoreResult<()> {
        if self.by_id.contains_key(&r.request_id) {
            return Err(CoreError::DuplicateRequest { request_id: r.request_id });
        }
        let p = r.prompt_token_ids.len();
        if p == 0 {
            return Err(CoreError::invalid("prompt_token_ids", "[]", "must contain at least one token"));
        }
        if p > self.cfg.max_model_len {
            return Err(CoreError::PromptTooLong { len: p, max_model_len: self.cfg.max_model_len });
        }
        if r.max_tokens == 0 {
            return Err(CoreError::invalid("max_tokens", r.max_tokens, "must be >= 1"));
        }
        if r.n == 0 {
            return Err(CoreError::invalid("n", r.n, "must be >= 1"));
        }
        if r.n as usize > self.cfg.max_num_seqs {
            return Err(CoreError::invalid("n", r.n, format!("must be <= max_num_seqs ({})", self.cfg.max_num_seqs)));
        }
        if r.reserve_seqs as usize > self.cfg.max_num_seqs {
            return Err(CoreError::invalid(
                "reserve_seqs",
                r.reserve_seqs,
                format!("must be <= max_num_seqs ({})", self.cfg.max_num_seqs),
            ));
        }
        if r.min_tokens > r.max_tokens {
            return Err(CoreError::invalid("min_tokens", r.min_tokens, format!("must be <= max_tokens ({})", r.max_tokens)));
        }
        let usable = self.kv.num_usable_blocks();
        let needed = self.worst_case_blocks(p, r.max_tokens, r.n.max(r.reserve_seqs) as usize);
        if needed > usable {
            return Err(CoreError::ExceedsCacheCapacity { request_id: r.request_id, blocks_needed: needed, blocks_available: usable });
        }
        let seq_id = self.new_seq_id();
        let arrival = self.next_arrival;
        self.next_arrival += 1;
        let priority = if self.cfg.policy == Policy::Priority { r.priority } else { 0 };
        let req = Request {
            request_id: r.request_id,
            arrival,
            priority,
            n: r.n,
            prompt_len: p,
            stop: StopParams {
                max_tokens: r.max_tokens,
                min_tokens: r.min_tokens,
                eos_token_id: r.eos_token_id,
                stop_token_ids: r.stop_token_ids,
                ignore_eos: r.ignore_eos,
            },
            cache_salt: r.cache_salt.map(String::into_boxed_str),
            seqs: vec![Sequence {
                seq_id,
                sample_index: 0,
                tokens: r.prompt_token_ids,
                num_computed: 0,
                table: BlockTable::default(),
                row: NO_ROW,
            }],
            state: RequestState::Waiting,
            fanned_out: false,
            reserved_seqs: r.reserve_seqs,
            next_sample_index: 1,
            num_cached_tokens: None,
        };
        let key = req.order_key();
        let slot = match self.free_slots.pop() {
            Some(s) => {
                self.requests[s as usize] = Some(req);
                s
            }
            None => {
                self.requests.push(Some(req));
                self.ending.push(false);
                self.mark.push(false);
                (self.requests.len() - 1) as u32
            }
        };
        self.by_id.insert(r.request_id, slot);
        self.seq_owner.insert(seq_id, slot);
        self.waiting.insert((key.0, key.1, slot));
        self.stats.requests_added += 1;
        self.stats.prompt_tokens += p as u64;
        Ok(())
    }

    fn new_seq_id(&mut self) -> u64 {
        let id = self.next_seq_id;
        self.next_seq_id += 1;
        id
    }

    fn req(&self, slot: u32) -> &Request {
        self.requests[slot as usize].as_ref().expect("live slot")
    }

    /// Tokens of `s` whose KV is computed: its batch row holds the count while it runs.
    fn computed_of(batch: &Batch, s: &Sequence) -> usize {
        if s.row == NO_ROW {
            s.num_computed
        } else {
            batch.rows[s.row as usize].computed as usize
        }
    }

    fn set_computed(batch: &mut Batch, s: &mut Sequence, v: usize) {
        if s.row == NO_ROW {
            s.num_computed = v;
        } else {
            batch.rows[s.row as usize].computed = v as u32;
        }
    }

    /// The row of a sequence whose tokens are all in `s.tokens` (nothing staged).
    fn row_init(req: &Request, s: &Sequence, computed: usize, max_model_len: usize) -> RowInit {
        RowInit {
            req_id: req.request_id,
            sample_index: s.sample_index,
            prompt_len: req.prompt_len,
            computed,
            num_tokens: s.tokens.len(),
            last_token: *s.tokens.last().expect("a sequence has at least one token"),
            stop: RowStop::new(&req.stop, req.prompt_len, max_model_len),
        }
    }

    /// Brings a running sequence up to date with its row (before anything reads its tokens or
    /// its block table): appends the tokens staged in the row, and the blocks decode steps
    /// appended to the row only (fresh blocks that no other table holds yet).
    fn flush_row(batch: &mut Batch, s: &mut Sequence) {
        if s.row != NO_ROW {
            let row = s.row as usize;
            batch.flush_tokens(row, &mut s.tokens);
            let (known, h) = (s.table.len(), &batch.rows[row]);
            match (h.num_blocks as usize).saturating_sub(known) {
                0 => {}
                1 => s.table.adopt(std::iter::once(BlockId(h.tail_block))), // the usual one, without the matrix
                _ => s.table.adopt(batch.row_blocks(row).skip(known).map(|b| BlockId(b as u32))),
            }
        }
    }

    /// Gives every sequence of a request that starts running a batch row, and reserves its
    /// token, block and hash lists for its longest possible length (prompt + max_tokens, at
    /// most max_model_len), as other engines' input batches hold max_model_len tokens per row.
    /// Grown by doubling instead, the lists of a batch that started together reallocate in the
    /// same few steps, and those steps take several times the median. The token list's first
    /// `PREFAULT_TOKEN_BYTES` are mapped now (one write per 4 KiB): left to the decode steps,
    /// fresh memory cost about one page fault per step at 1,024 sequences, ~15 % of the step.
    fn give_rows(&mut self, slot: u32) {
        let req = self.requests[slot as usize].as_mut().expect("live slot");
        let longest = (req.prompt_len + req.stop.max_tokens).min(self.cfg.max_model_len);
        for i in 0..req.seqs.len() {
            let s = &mut req.seqs[i];
            s.tokens.reserve_exact(longest.saturating_sub(s.tokens.len()));
            crate::prefetch::prefault_spare(&mut s.tokens, PREFAULT_TOKEN_BYTES);
            s.table.reserve(longest.div_ceil(self.cfg.block_size));
            let s = &req.seqs[i];
            debug_assert_eq!(s.row, NO_ROW);
            let init = Self::row_init(req, s, s.num_computed, self.cfg.max_model_len);
            let row = self.batch.push(SeqRef { slot, seq_id: s.seq_id }, init, s.table.blocks().iter().map(|b| b.0));
            req.seqs[i].row = row;
        }
    }

    /// Takes a sequence's row away; its computed count goes back into the sequence.
    fn take_row(&mut self, slot: u32, pos: usize) {
        self.flush_seq(slot, pos);
        let s = &mut self.requests[slot as usize].as_mut().expect("live slot").seqs[pos];
        let row = std::mem::replace(&mut s.row, NO_ROW);
        if row == NO_ROW {
            return;
        }
        s.num_computed = self.batch.rows[row as usize].computed as usize;
        if self.defer_row_removal {
            self.batch.mark_dead(row);
        } else if let Some(m) = self.batch.swap_remove(row) {
            self.fix_moved(m);
        }
    }

    /// A live row's request and the position of its sequence in it.
    fn row_req(requests: &mut [Option<Request>], seq: SeqRef) -> (&mut Request, usize) {
        let req = requests[seq.slot as usize].as_mut().expect("a live row's request is live");
        let pos = req.seq_pos(seq.seq_id).expect("a live row's sequence is live");
        (req, pos)
    }

    /// A live row's sequence.
    fn seq_of(requests: &mut [Option<Request>], seq: SeqRef) -> &mut Sequence {
        let (req, pos) = Self::row_req(requests, seq);
        &mut req.seqs[pos]
    }

    /// While row `rows[i]` is being worked on, starts fetching what the work on the rows after
    /// it will touch, level by level: the request 8 rows ahead, the sequence 4 ahead (its
    /// request fetched by then), the ends of its token, block and hash lists 3 ahead. Rows that
    /// cross a block boundary in one step each need that chain; pipelined, the misses overlap
    /// instead of queueing one chain after another.
    #[inline]
    fn prefetch_ahead(&self, rows: &[u32], i: usize) {
        const DISTANCE: [usize; 3] = [8, 4, 3]; // per level
        for (level, d) in DISTANCE.into_iter().enumerate() {
            // The first row primes the pipeline with the rows before that distance too.
            let from = if i == 0 { 0 } else { d };
            for &r in rows.iter().skip(i + from).take(d + 1 - from) {
                self.prefetch_row_level(r, level as u8);
            }
        }
    }

    /// One level of `prefetch_ahead` for one row: 0 the request, 1 the sequence, 2 the ends
    /// of its token, block and hash lists (each level reads what the one before fetched).
    #[inline]
    fn prefetch_row_level(&self, r: u32, level: u8) {
        use crate::prefetch::{read, read_range, read_value};
        let SeqRef { slot, seq_id } = self.batch.owner[r as usize];
        let entry = &self.requests[slot as usize];
        match (level, entry) {
            (0, _) => read_value(entry),
            // The first sequence, without reading it (usually the only one).
            (1, Some(req)) => read_range(req.seqs.as_ptr() as *const u8, std::mem::size_of::<Sequence>()),
            (_, Some(req)) => {
                if let Some(s) = req.seqs.iter().find(|s| s.seq_id == seq_id) {
                    read(s.tokens.as_ptr().wrapping_add(s.tokens.len()) as *const u8);
                    s.table.prefetch_tail();
                }
            }
            _ => {}
        }
    }

    fn fix_moved(&mut self, m: Moved) {
        Self::seq_of(&mut self.requests, m.seq).row = m.to;
    }

    /// Mirrors a sequence's block table into its row from block `from` on.
    fn sync_row(batch: &mut Batch, s: &Sequence, from: usize) {
        if s.row != NO_ROW {
            let from = from.min(batch.rows[s.row as usize].num_blocks as usize).min(s.table.len());
            batch.sync_blocks(s.row as usize, from, s.table.blocks()[from..].iter().map(|b| b.0));
        }
    }

    /// Plans and allocates the next chunk of every sequence of one request. All sequences
    /// finish this step together (they then get logits rows) or each stops one token short,
    /// so the samples of a request always step in lockstep.
    fn try_schedule(&mut self, slot: u32, budget: usize, watermark: usize) -> Attempt {
        let bs = self.cfg.block_size;
        let bm = self.bm;
        let req = self.requests[slot as usize].as_mut().expect("live slot");
        let kv = &mut self.kv;
        let batch = &mut self.batch;
        let n = req.seqs.len();
        for s in req.seqs.iter_mut() {
            Self::flush_row(batch, s);
        }
        // Fast path, the common decode step: one sequence writing one token inside its own
        // last block needs no block accounting at all.
        if n == 1 && budget > 0 {
            let s = &mut req.seqs[0];
            let c = Self::computed_of(batch, s);
            if c + 1 == s.tokens.len() && bm.offset(c) != 0 && kv.ref_count(s.table.blocks()[bm.block(c)]) == 1 {
                self.plan.clear();
                self.plan.push((c, 1));
                Self::set_computed(batch, s, c + 1);
                return Attempt::Scheduled { tokens: 1, full: true };
            }
        }
        if self.hits.len() < n {
            self.hits.resize_with(n, Vec::new);
        }
        self.plan.clear();
        let mut total = 0;
        for (i, s) in req.seqs.iter_mut().enumerate() {
            self.hits[i].clear();
            let c = Self::computed_of(batch, s);
            if c == 0 && s.table.is_empty() && !s.table.is_swapped() {
                self.hits[i] = kv.find_cached_prefix(&mut s.table, &s.tokens, req.cache_salt.as_deref());
            }
            let start = c.max(self.hits[i].len() * bs);
            total += s.tokens.len() - start;
            self.plan.push((start, 0));
        }
        let full = total <= budget;
        let mut left = budget;
        let mut sum = 0;
        for (i, s) in req.seqs.iter().enumerate() {
            let start = self.plan[i].0;
            let remaining = s.tokens.len() - start;
            let chunk = if full { remaining } else { remaining.saturating_sub(1).min(left) };
            left -= chunk;
            sum += chunk;
            self.plan[i].1 = chunk;
        }
        if sum == 0 {
            return Attempt::NoBudget;
        }
        let needed = if n == 1 {
            kv.blocks_needed(&req.seqs[0].table, self.plan[0].0, self.plan[0].1, &self.hits[0])
        } else {
            let items: Vec<_> = req.seqs.iter().enumerate()
                .map(|(i, s)| (&s.table, self.plan[i].0, self.plan[i].1, &self.hits[i][..]))
                .collect();
            kv.blocks_needed_together(&items)
        };
        if kv.num_free_blocks() < needed + watermark {
            return Attempt::NoSpace;
        }
        // Take every sibling's cache hits before any fresh block is popped: a hit may sit in
        // the free list, and popping it for a sibling would evict it.
        for (i, s) in req.seqs.iter_mut().enumerate() {
            if !self.hits[i].is_empty() {
                let ok = kv.allocate_slots(&mut s.table, self.plan[i].0, 0, &self.hits[i], 0);
                debug_assert!(ok, "capacity was checked for the whole request");
            }
        }
        for (i, s) in req.seqs.iter_mut().enumerate() {
            let (start, chunk) = self.plan[i];
            let ok = kv.allocate_slots(&mut s.table, start, chunk, &[], 0);
            debug_assert!(ok, "capacity was checked for the whole request");
            if !self.hits[i].is_empty() {
                let cached = (self.hits[i].len() * bs).min(req.prompt_len) as u64;
                self.stats.cached_prompt_tokens += cached;
                if i == 0 && req.num_cached_tokens.is_none() {
                    self.stats.first_admission_cached_tokens += cached;
                }
            }
            if i == 0 && req.num_cached_tokens.is_none() {
                req.num_cached_tokens = Some(self.hits[0].len() * bs);
            }
            Self::set_computed(batch, s, start + chunk);
            // Blocks change from the first one written (copy-on-write) or appended on.
            Self::sync_row(batch, s, bm.block(start));
        }
        Attempt::Scheduled { tokens: sum, full }
    }

    /// Writes the plan just allocated for `slot` into its sequences' rows.
    fn record(&mut self, slot: u32, full: bool) {
        let req = self.requests[slot as usize].as_ref().expect("live slot");
        let p = req.prompt_len;
        let fans_out = full && req.n > 1 && !req.fanned_out && req.seqs.len() == 1;
        for (pos, s) in req.seqs.iter().enumerate() {
            let (before, chunk) = self.plan[pos];
            let after = before + chunk;
            let row = s.row as usize;
            debug_assert!(s.row != NO_ROW, "a scheduled sequence has a row");
            debug_assert!(chunk > 0 || !full, "a sampling row computes its last token");
            if chunk > 0 {
                self.batch.rows[row].new_tokens = chunk as u32;
                self.step.seqs += 1;
                self.step.tokens += chunk;
                let len = s.tokens.len();
                self.stats.prompt_tokens_computed += (after.min(p).saturating_sub(before.min(p))) as u64;
                self.stats.output_tokens_recomputed += (after.min(len - 1).saturating_sub(before.max(p))) as u64;
                if after == len && len > p {
                    self.stats.decode_tokens += 1;
                    // The output counts single-token decodes (not a recompute ending at len).
                    self.step.decode_tokens += usize::from(chunk == 1);
                }
            }
            if full {
                self.batch.rows[row].samples = true;
                self.step.logits_rows += 1;
                if fans_out {
                    self.batch.rows[row].fan_out = req.n - 1;
                    self.step.logits_rows += req.n as usize - 1;
                }
            }
        }
    }

    /// The common steps, planned row by row over the batch without looking at a request:
    ///
    /// - `All`: every running sequence decodes one token and all of them fit (budget, free
    ///   blocks, no shared block written). The running requests' order cannot matter then, and
    ///   the step's arrays are emitted in the same pass.
    /// - `Front`: the same for every request whose rows are all single-token decodes, when the
    ///   other running requests (prefill chunks, usually just admitted) are all at the back of
    ///   the running order. The per-request walk would have served the decodes first anyway, so
    ///   it only runs over those requests; any preemption victim is one of them.
    ///
    /// Neither reaches a sequence: a decode entering a new block gets it in its row
    /// (`append_new_blocks`). `None` changes nothing: the per-request walk plans the whole step.
    fn plan_decode_rows(&mut self, budget: usize) -> DecodePlan {
        if self.batch.is_empty() {
            return DecodePlan::None;
        }
        if self.plan_all(budget) {
            return DecodePlan::All;
        }
        let bm = self.bm;
        let mut new_block_rows = std::mem::take(&mut self.scratch_rows);
        new_block_rows.clear();
        let mut others = std::mem::take(&mut self.scratch_slots);
        others.clear();
        let mut cow = false;
        {
            let (kv, mark) = (&self.kv, &mut self.mark);
            let (rows, table, owner) = self.batch.rows_and_table();
            for (r, h) in rows.iter_mut().enumerate() {
                if !h.is_decode() {
                    // A prefill chunk, or the prompt's last token: its request goes the long way.
                    let slot = owner[r].slot as usize;
                    if !std::mem::replace(&mut mark[slot], true) {
                        others.push(slot as u32);
                    }
                    continue;
                }
                if bm.offset(h.computed as usize) == 0 {
                    new_block_rows.push(r as u32);
                } else if owned_write_block(h, &table, r, kv, bm).is_none() {
                    cow = true; // copy-on-write: left to the per-request walk
                    break;
                }
            }
        }
        // Every row a decode (`plan_all` declined for budget, blocks or copy-on-write): the
        // per-request walk decides.
        let plan = if cow || others.is_empty() { DecodePlan::None } else { self.front_plan(&others, &mut new_block_rows, budget) };
        for &slot in &others {
            self.mark[slot as usize] = false;
        }
        self.scratch_slots = others;
        self.scratch_rows = new_block_rows;
        plan
    }

    /// The `All` plan in one pass over the rows: each row is checked, advanced and emitted
    /// together (the common step pays for one walk, not a check walk and a plan walk). If a
    /// row turns out not to qualify, the rows already advanced are restored and it returns
    /// false, changing nothing.
    fn plan_all(&mut self, budget: usize) -> bool {
        let n = self.batch.len();
        if n > budget {
            return false;
        }
        let bm = self.bm;
        let mut new_block_rows = std::mem::take(&mut self.scratch_rows);
        new_block_rows.clear();
        // Row r is sequence, token and logits row r. Admissions of this step append after
        // these rows (`build_output` continues from here).
        let mut o = Self::empty_output(n + 16, n + 16, n + 16);
        // Sized first, then written through zipped iterators: no per-element capacity check.
        o.seq_lens.resize(n, 0);
        o.positions.resize(n, 0);
        o.slot_mapping.resize(n, 0);
        let mut max_blocks = 0;
        let mut declined_at = None;
        {
            let kv = &self.kv;
            let (rows, table, _) = self.batch.rows_and_table();
            let outs = o.seq_lens.iter_mut().zip(o.positions.iter_mut()).zip(o.slot_mapping.iter_mut());
            for (r, (h, ((len, pos), slot))) in rows.iter_mut().zip(outs).enumerate() {
                if !h.is_decode() {
                    declined_at = Some(r); // a prefill chunk, or the prompt's last token
                    break;
                }
                let c = h.computed as usize;
                let starts_block = bm.offset(c) == 0;
                if starts_block {
                    // Its slot is known once the block is allocated below.
                    new_block_rows.push(r as u32);
                    *slot = -1;
                } else {
                    let Some(blk) = owned_write_block(h, &table, r, kv, bm) else {
                        declined_at = Some(r); // copy-on-write
                        break;
                    };
                    *slot = bm.slot(blk, c);
                }
                debug_assert_eq!(h.fan_out, 0, "fan-outs happen at update");
                h.computed += 1;
                h.new_tokens = 1;
                h.samples = true;
                h.logits_row = r as u32;
                *len = c as i32 + 1;
                *pos = c as i64;
                max_blocks = max_blocks.max(h.num_blocks + u32::from(starts_block));
            }
        }
        if declined_at.is_none() && self.kv.num_free_blocks() < new_block_rows.len() {
            declined_at = Some(n);
        }
        if let Some(k) = declined_at {
            for h in &mut self.batch.rows[..k] {
                h.computed -= 1;
                h.new_tokens = 0;
                h.samples = false;
            }
            self.scratch_rows = new_block_rows;
            return false;
        }
        let b = &self.batch;
        o.req_ids.extend_from_slice(&b.req_id);
        o.seq_ids.extend_from_slice(&b.seq_id);
        o.input_ids.extend_from_slice(&b.last_token);
        o.row_req_ids.extend_from_slice(&b.req_id);
        o.row_seq_ids.extend_from_slice(&b.seq_id);
        o.row_sample_index.extend_from_slice(&b.sample_index);
        o.query_start_loc.extend(1..=n as i32);
        o.logits_indices.extend(0..n as i64);
        self.append_new_blocks(&new_block_rows);
        for &r in &new_block_rows {
            let h = &self.batch.rows[r as usize];
            o.slot_mapping[r as usize] = bm.slot(h.tail_block as i32, h.computed as usize - 1);
        }
        self.scratch_rows = new_block_rows;
        self.emitted = Some((o, n, max_blocks as usize));
        self.step = StepCounts { seqs: n, tokens: n, logits_rows: n, decode_tokens: n };
        self.stats.decode_tokens += n as u64;
        true
    }

    /// Gives each of `rows` (just advanced by one decode token that starts a new block) a fresh
    /// block, in the row only: the sequence's table adopts it at the next `flush_row` (the
    /// step that completes the block flushes the row to register it), so planning a decode
    /// step never reaches the sequences.
    fn append_new_blocks(&mut self, rows: &[u32]) {
        for &r in rows {
            let r = r as usize;
            debug_assert_eq!(
                self.batch.rows[r].num_blocks as usize,
                self.bm.block(self.batch.rows[r].computed as usize - 1),
                "the write starts a new block"
            );
            let b = self.kv.allocate_block();
            self.batch.push_block(r, b.0);
        }
    }

    /// `Front` planning (see `plan_decode_rows`): `others` are the marked requests that are not
    /// all-decode; `new_block_rows` the decode rows entering a new block (some of them may be
    /// rows of marked requests).
    fn front_plan(&mut self, others: &[u32], new_block_rows: &mut Vec<u32>, budget: usize) -> DecodePlan {
        let len = self.running.len();
        let k = others.len();
        for &slot in others {
            if self.running_index(slot) < len - k {
                return DecodePlan::None; // one of them would be served before some decodes
            }
        }
        let b = &self.batch;
        let mark = &self.mark;
        new_block_rows.retain(|&r| !mark[b.owner[r as usize].slot as usize]);
        let decodes = b.rows.iter().zip(&b.owner).filter(|(h, o)| h.is_decode() && !mark[o.slot as usize]).count();
        if decodes > budget || self.kv.num_free_blocks() < new_block_rows.len() {
            return DecodePlan::None;
        }
        self.batch.clear_plan();
        let b = &mut self.batch;
        for (h, o) in b.rows.iter_mut().zip(&b.owner) {
            if h.is_decode() && !mark[o.slot as usize] {
                debug_assert_eq!(h.fan_out, 0, "fan-outs happen at update");
                h.computed += 1;
                h.new_tokens = 1;
                h.samples = true;
            }
        }
        self.append_new_blocks(new_block_rows);
        self.step = StepCounts { seqs: decodes, tokens: decodes, logits_rows: decodes, decode_tokens: decodes };
        self.stats.decode_tokens += decodes as u64;
        DecodePlan::Front { generic_from: len - k }
    }

    pub fn schedule(&mut self) -> CoreResult<SchedulerOutput> {
        if self.in_flight.is_some() {
            return Err(CoreError::InvalidState {
                message: "schedule() called while a step is in flight: call update(output, sampled_token_ids) first".into(),
            });
        }
        debug_assert!(!self.batch.has_dead());
        self.step_id += 1;
        self.stats.steps += 1;
        self.step = StepCounts::default();
        let mut budget = self.cfg.max_num_batched_tokens;
        let mut preempted: Vec<i64> = Vec::new();

        // The decode paths write the plan of the rows they take; the per-request walk starts
        // from none, or after the decodes planned row by row.
        let plan = self.plan_decode_rows(budget);
        budget -= self.step.tokens;
        if !matches!(plan, DecodePlan::All) {
            let mut i = match plan {
                DecodePlan::Front { generic_from } => generic_from,
                _ => {
                    self.batch.clear_plan();
                    0
                }
            };
            while i < self.running.len() {
                let slot = self.running[i];
                match self.try_schedule(slot, budget, 0) {
                    Attempt::Scheduled { tokens, full } => {
                        self.record(slot, full);
                        budget -= tokens;
                        i += 1;
                    }
                    Attempt::NoBudget => break,
                    Attempt::NoSpace => {
                        if self.running.len() > i + 1 {
                            let victim = self.running.pop().expect("non-empty");
                            preempted.push(self.req(victim).request_id as i64);
                            self.preempt(victim);
                        } else if i == 0 {
                            // Alone and still out of blocks: it can never fit. End it rather than spin.
                            self.end_request(slot, FinishReason::Abort, true);
                            self.stats.capacity_aborts += 1;
                        } else {
                            self.running.pop();
                            preempted.push(self.req(slot).request_id as i64);
                            self.preempt(slot);
                            break;
                        }
                    }
                }
            }
        }

        if preempted.is_empty() {
            while let Some(&(p, a, slot)) = self.waiting.first() {
                if budget == 0 || self.num_running_seqs + self.req(slot).seq_slots() > self.cfg.max_num_seqs {
                    break;
                }
                let watermark = if self.running.is_empty() {
                    0
                } else {
                    self.watermark_blocks + (self.num_running_seqs as f64 * self.cfg.admission_headroom).ceil() as usize
                };
                if self.req(slot).state == RequestState::Swapped {
                    let alone = self.running.is_empty();
                    let req = self.requests[slot as usize].as_mut().expect("live slot");
                    // Room to grow by a block per sequence, unless nothing else could use it.
                    let extra = if alone { 0 } else { watermark + req.seqs.len() };
                    let mut tables: Vec<&mut BlockTable> = req.seqs.iter_mut().map(|s| &mut s.table).collect();
                    if !self.kv.swap_in(&mut tables, extra) {
                        if alone {
                            self.end_request(slot, FinishReason::Abort, true);
                            self.stats.capacity_aborts += 1;
                            continue;
                        }
                        break;
                    }
                    self.admit(slot, (p, a, slot));
                    if let Attempt::Scheduled { tokens, full } = self.try_schedule(slot, budget, 0) {
                        self.record(slot, full);
                        budget -= tokens;
                    }
                    continue;
                }
                match self.try_schedule(slot, budget, watermark) {
                    Attempt::Scheduled { tokens, full } => {
                        self.admit(slot, (p, a, slot));
                        self.record(slot, full);
                        budget -= tokens;
                    }
                    Attempt::NoSpace if self.running.is_empty() => {
                        // Nothing else holds a block, yet its next chunk does not fit: it never
                        // will (beam forks grew it past the cache). End it rather than spin.
                        self.end_request(slot, FinishReason::Abort, true);
                        self.stats.capacity_aborts += 1;
                    }
                    Attempt::NoBudget | Attempt::NoSpace => break,
                }
            }
        }

        self.stats.max_running_seqs = self.stats.max_running_seqs.max(self.num_running_seqs as u64);
        self.stats.max_step_tokens = self.stats.max_step_tokens.max(self.step.tokens as u64);
        let out = self.build_output(preempted);
        self.in_flight = Some(InFlight { step_id: self.step_id, num_logits_rows: out.num_rows(), forked: false });
        Ok(out)
    }

    /// Where request `slot` is (or belongs) in the running list, which is sorted by order key
    /// (keys are unique: arrivals are).
    fn running_index(&self, slot: u32) -> usize {
        let key = self.req(slot).order_key();
        self.running.partition_point(|&s| self.req(s).order_key() < key)
    }

    /// A request starts running: it joins the running list in order and its sequences get rows.
    fn admit(&mut self, slot: u32, key: (i64, u64, u32)) {
        self.waiting.remove(&key);
        let req = self.requests[slot as usize].as_mut().expect("live slot");
        req.state = RequestState::Running;
        self.num_running_seqs += req.seq_slots();
        let pos = self.running_index(slot);
        self.running.insert(pos, slot);
        self.give_rows(slot);
    }

    /// Takes a running request's blocks away: to the CPU pool in swap mode (when it fits),
    /// else freed for recomputation. It goes back to the waiting queue at its original place.
    fn preempt(&mut self, slot: u32) {
        for pos in 0..self.req(slot).seqs.len() {
            self.take_row(slot, pos);
        }
        let req = self.requests[slot as usize].as_mut().expect("live slot");
        self.num_running_seqs -= req.seq_slots();
        let swapped = self.cfg.preemption_mode == PreemptionMode::Swap && {
            let mut tables: Vec<&mut BlockTable> = req.seqs.iter_mut().map(|s| &mut s.table).collect();
            self.kv.swap_out(&mut tables)
        };
        if swapped {
            req.state = RequestState::Swapped;
            self.stats.swap_preemptions += 1;
        } else {
            for s in req.seqs.iter_mut() {
                self.kv.free(&mut s.table);
                s.num_computed = 0;
            }
            req.state = RequestState::Waiting;
            self.stats.recompute_preemptions += 1;
        }
        self.stats.preemptions += 1;
        let k = req.order_key();
        self.waiting.insert((k.0, k.1, slot));
    }

    /// Output buffers with room for a step, `query_start_loc` started.
    fn empty_output(seqs: usize, tokens: usize, rows: usize) -> SchedulerOutput {
        let mut o = SchedulerOutput {
            req_ids: Vec::with_capacity(seqs),
            seq_ids: Vec::with_capacity(seqs),
            query_start_loc: Vec::with_capacity(seqs + 1),
            seq_lens: Vec::with_capacity(seqs),
            input_ids: Vec::with_capacity(tokens),
            positions: Vec::with_capacity(tokens),
            slot_mapping: Vec::with_capacity(tokens),
            logits_indices: Vec::with_capacity(rows),
            row_req_ids: Vec::with_capacity(rows),
            row_seq_ids: Vec::with_capacity(rows),
            row_sample_index: Vec::with_capacity(rows),
            ..Default::default()
        };
        o.query_start_loc.push(0);
        o
    }

    /// Flattens the planned rows, in row order, into the step's arrays. When every row is in
    /// the step, the block tables are the batch matrix itself (no copy); otherwise the planned
    /// rows are gathered.
    fn build_output(&mut self, preempted: Vec<i64>) -> SchedulerOutput {
        let bs = self.cfg.block_size;
        let StepCounts { seqs: s_count, tokens: t_count, logits_rows: r_count, decode_tokens } = self.step;
        let n = self.batch.len();
        // The all-decode path already emitted its rows; rows admitted after them follow.
        let (mut o, start, mut max_blocks) = match self.emitted.take() {
            Some(e) => e,
            None => (Self::empty_output(s_count, t_count, r_count), 0, 0),
        };
        o.step_id = self.step_id;
        o.block_size = bs;
        o.finished_req_ids = std::mem::take(&mut self.ended_ids);
        o.preempted_req_ids = preempted;
        o.num_decode_tokens = decode_tokens;
        o.num_prefill_tokens = t_count - decode_tokens;
        let b = &mut self.batch;
        let bm = self.bm;
        let mut num_tokens = o.input_ids.len();
        for r in start..n {
            let k = b.rows[r].new_tokens as usize;
            if k == 0 {
                continue;
            }
            let after = b.rows[r].computed as usize;
            let before = after - k;
            o.req_ids.push(b.req_id[r]);
            o.seq_ids.push(b.seq_id[r]);
            o.seq_lens.push(after as i32);
            if before + 1 == b.rows[r].num_tokens as usize {
                o.input_ids.push(b.last_token[r]);
            } else {
                let s = Self::seq_of(&mut self.requests, b.owner[r]);
                o.input_ids.extend(s.tokens[before..after].iter().map(|&t| t as i64));
            }
            for p in before..after {
                o.positions.push(p as i64);
                o.slot_mapping.push(bm.slot(b.block(r, bm.block(p)), p));
            }
            num_tokens += k;
            o.query_start_loc.push(num_tokens as i32);
            max_blocks = max_blocks.max(b.rows[r].num_blocks as usize);
            if b.rows[r].samples {
                b.rows[r].logits_row = o.logits_indices.len() as u32;
                o.logits_indices.push(num_tokens as i64 - 1);
                o.row_req_ids.push(b.req_id[r]);
                o.row_seq_ids.push(b.seq_id[r]);
                o.row_sample_index.push(b.sample_index[r]);
                let f = b.rows[r].fan_out;
                if f > 0 {
                    // The samples of an n > 1 request: children 1..n, forked at update.
                    let first = self.next_seq_id;
                    self.next_seq_id += f as u64;
                    b.fan_out_first[r] = first;
                    for j in 0..f {
                        o.logits_indices.push(num_tokens as i64 - 1);
                        o.row_req_ids.push(b.req_id[r]);
                        o.row_seq_ids.push((first + j as u64) as i64);
                        o.row_sample_index.push(j as i32 + 1);
                    }
                }
            }
        }
        debug_assert_eq!((o.seq_ids.len(), num_tokens, o.logits_indices.len()), (s_count, t_count, r_count));
        o.max_blocks = max_blocks;
        o.block_tables = if s_count == n {
            BlockTables::Batch { row_stride: b.width() }
        } else {
            let mut bt = Vec::with_capacity(s_count * max_blocks);
            for r in (0..n).filter(|&r| b.rows[r].new_tokens > 0) {
                // Entries past a row's blocks are the null block already.
                bt.extend((0..max_blocks).map(|i| b.block(r, i)));
            }
            BlockTables::Owned(bt)
        };
        self.finish_output(o)
    }

    /// Block ops queued by the step go last.
    fn finish_output(&mut self, mut o: SchedulerOutput) -> SchedulerOutput {
        let ops = self.kv.take_ops();
        o.copy_ops = ops.copy.iter().flat_map(|&(a, b)| [a as i32, b as i32]).collect();
        o.swap_out = ops.swap_out.iter().flat_map(|&(a, b)| [a as i32, b as i32]).collect();
        o.swap_in = ops.swap_in.iter().flat_map(|&(a, b)| [a as i32, b as i32]).collect();
        o
    }

    /// The block tables of the step in flight as one `[num_seqs * max_blocks]` copy (for tests
    /// and tools; the runner reads the batch matrix through `batch_table`).
    pub fn block_tables(&self, out: &SchedulerOutput) -> CoreResult<Vec<i32>> {
        match &out.block_tables {
            BlockTables::Owned(v) => Ok(v.clone()),
            BlockTables::Batch { .. } => {
                self.check_batch_view(out.step_id)?;
                let m = out.max_blocks;
                Ok((0..out.num_seqs()).flat_map(|r| (0..m).map(move |i| self.batch.block(r, i))).collect())
            }
        }
    }

    /// The batch matrix (`max_num_seqs` rows of `row_stride` block ids) that outputs with
    /// `BlockTables::Batch` view, valid for the scheduler's lifetime.
    pub fn batch_table(&self) -> (*const i32, usize, usize) {
        (self.batch.table_ptr(), self.batch.capacity(), self.batch.width())
    }

    /// A `BlockTables::Batch` view is only meaningful while its step is in flight.
    pub fn check_batch_view(&self, step_id: u64) -> CoreResult<()> {
        match &self.in_flight {
            Some(f) if f.step_id == step_id => Ok(()),
            _ => Err(CoreError::InvalidState {
                message: format!(
                    "the block tables of step {step_id} are no longer valid: read them between schedule() and update()"
                ),
            }),
        }
    }

    /// Appends one sampled token per logits row of step `step_id`, decides stops, frees what
    /// finished and registers computed blocks in the prefix cache.
    pub fn update(&mut self, step_id: u64, sampled: &[i64]) -> CoreResult<Vec<FinishedSeq>> {
        let fl = match self.in_flight.as_ref() {
            None => {
                return Err(CoreError::InvalidState { message: "update() called with no step in flight: call schedule() first".into() })
            }
            Some(fl) => fl,
        };
        if fl.step_id != step_id {
            let msg = format!("update() got the output of step {step_id}, but step {} is in flight", fl.step_id);
            return Err(CoreError::InvalidState { message: msg });
        }
        if sampled.len() != fl.num_logits_rows {
            return Err(CoreError::invalid(
                "sampled_token_ids",
                format!("<{} tokens>", sampled.len()),
                format!("expected one token per logits row ({})", fl.num_logits_rows),
            ));
        }
        // One vectorizable pass; the offending value is looked up only on error.
        if sampled.iter().fold(0u64, |acc, &t| acc | (t as u64 >> 32)) != 0 {
            let bad = sampled.iter().find(|&&t| !(0..=u32::MAX as i64).contains(&t)).copied().unwrap_or(-1);
            return Err(CoreError::invalid("sampled_token_ids", bad, "token ids must be in [0, 2^32)"));
        }
        self.in_flight = None;
        // Rows that leave are compacted at the end, so row numbers hold through both passes.
        self.defer_row_removal = true;
        let bm = self.bm;
        let caching = self.kv.prefix_caching();
        // One tight pass over the rows stages each sampled token and decides stops from the
        // row alone. Rows that need their sequence are listed and handled after it: those that
        // completed a block (registered in the prefix cache now that their KV is computed,
        // about one row in block_size per step), n > 1 prompts whose samples fork off now (their
        // own token is appended after the fork), and full stages.
        let mut blocks_done = std::mem::take(&mut self.scratch_rows);
        let mut forks: Vec<u32> = Vec::new();
        let mut full_stage: Vec<u32> = Vec::new();
        let mut maybe_stops: Vec<u32> = Vec::new();
        let mut generated = 0u64;
        blocks_done.clear();
        {
            let b = &mut self.batch;
            let n = b.rows.len();
            let rows = &mut b.rows[..n];
            let last = &mut b.last_token[..n];
            let pending = &mut b.pending[..n * PENDING_TOKENS];
            for r in 0..n {
                let h = &mut rows[r];
                if h.new_tokens == 0 {
                    continue; // not in the step, or forked after it was scheduled
                }
                let after = h.computed as usize;
                let before = after - h.new_tokens as usize;
                if bm.block(after) != bm.block(before) || before == 0 {
                    blocks_done.push(r as u32);
                }
                if !h.samples || h.is_dead || h.fan_out > 0 {
                    if h.fan_out > 0 {
                        forks.push(r as u32);
                    }
                    continue;
                }
                generated += 1;
                let tok = sampled[h.logits_row as usize] as u32;
                h.num_tokens += 1;
                last[r] = tok as i64;
                let k = h.num_pending as usize;
                if k < PENDING_TOKENS {
                    pending[r * PENDING_TOKENS + k] = tok;
                    h.num_pending += 1;
                } else {
                    full_stage.push(r as u32); // staged once its stage is flushed
                }
                if h.stop.may_stop(tok, h.num_tokens) {
                    maybe_stops.push(r as u32);
                }
            }
        }
        if !caching {
            blocks_done.clear();
        }
        let mut stops: Vec<(u32, FinishReason, Option<u32>)> = Vec::new();
        for &r in &maybe_stops {
            let r = r as usize;
            let tok = self.batch.last_token[r] as u32;
            let h = &self.batch.rows[r];
            let slot = self.batch.owner[r].slot;
            let requests = &self.requests;
            let stop_ids = || requests[slot as usize].as_ref().is_some_and(|q| q.stop.stop_token_ids.contains(&tok));
            if let Some((reason, stop_token)) = h.stop.check(tok, h.num_tokens, stop_ids) {
                stops.push((r as u32, reason, stop_token));
            }
        }
        for (i, &r) in full_stage.iter().enumerate() {
            self.prefetch_ahead(&full_stage, i);
            let r = r as usize;
            let s = Self::seq_of(&mut self.requests, self.batch.owner[r]);
            Self::flush_row(&mut self.batch, s);
            let staged = self.batch.stage_token(r, self.batch.last_token[r] as u32);
            debug_assert!(staged);
        }
        // Registration in two passes. The first brings the sequences up to date with their rows
        // (staged tokens, blocks only the row held), pipelined so that the misses of the chain
        // request -> sequence -> lists overlap (see `prefetch_ahead`). The second hashes row i
        // while row i-2 is inserted (its index slot, record and token slot fetched meanwhile).
        // Hashing a block right after appending its tokens stalled on those stores.
        let n = blocks_done.len();
        for i in 0..n {
            self.prefetch_ahead(&blocks_done, i);
            let r = blocks_done[i] as usize;
            let s = Self::seq_of(&mut self.requests, self.batch.owner[r]);
            Self::flush_row(&mut self.batch, s);
        }
        for i in 0..n + 2 {
            for (j, prepare) in [(i, true), (i.wrapping_sub(2), false)] {
                if j >= n {
                    continue;
                }
                let r = blocks_done[j] as usize;
                let (req, pos) = Self::row_req(&mut self.requests, self.batch.owner[r]);
                let s = &mut req.seqs[pos];
                let computed = self.batch.rows[r].computed as usize;
                let salt = req.cache_salt.as_deref();
                if prepare {
                    self.kv.prepare_register(&mut s.table, &s.tokens, computed, salt);
                } else {
                    self.kv.register_computed(&mut s.table, &s.tokens, computed, salt);
                }
            }
        }
        self.scratch_rows = blocks_done;
        let mut finished = std::mem::take(&mut self.pending_finished);
        let mut ended_slots: Vec<u32> = Vec::new();
        for r in forks {
            // The children get rows (past the loop above) that sample their own tokens.
            let first_child = self.batch.len();
            self.fan_out(r as usize);
            for row in std::iter::once(r as usize).chain(first_child..self.batch.len()) {
                generated += 1;
                let tok = sampled[self.batch.rows[row].logits_row as usize] as u32;
                let (req, pos) = Self::row_req(&mut self.requests, self.batch.owner[row]);
                let s = &mut req.seqs[pos];
                Self::flush_row(&mut self.batch, s);
                s.tokens.push(tok);
                let h = &mut self.batch.rows[row];
                h.num_tokens += 1;
                self.batch.last_token[row] = tok as i64;
                let stop_ids = || req.stop.stop_token_ids.contains(&tok);
                if let Some((reason, stop_token)) = h.stop.check(tok, h.num_tokens, stop_ids) {
                    stops.push((row as u32, reason, stop_token));
                }
            }
        }
        for (r, reason, stop_token) in stops {
            let SeqRef { slot, seq_id } = self.batch.owner[r as usize];
            let pos = self.req(slot).seq_pos(seq_id).expect("a live row's sequence is live");
            if self.finish_seq(slot, pos, reason, stop_token, &mut finished) {
                ended_slots.push(slot);
            }
        }
        self.stats.generated_tokens += generated;
        if ended_slots.len() <= 8 {
            // The usual handful: found by binary search in the ordered running list.
            for &slot in &ended_slots {
                let pos = self.running_index(slot);
                debug_assert_eq!(self.running.get(pos), Some(&slot));
                self.running.remove(pos);
            }
        } else {
            for &s in &ended_slots {
                self.ending[s as usize] = true;
            }
            let ending = &self.ending;
            self.running.retain(|&s| !ending[s as usize]);
            for &s in &ended_slots {
                self.ending[s as usize] = false;
            }
        }
        for &s in &ended_slots {
            self.release_slot(s);
        }
        self.defer_row_removal = false;
        if self.batch.has_dead() {
            let mut moves = Vec::new();
            self.batch.compact(|m| moves.push(m));
            for m in moves {
                self.fix_moved(m);
            }
        }
        Ok(finished)
    }

    /// Forks the `n - 1` extra samples off the prefilled prompt in row `r`; each gets a row
    /// that samples its own token of this step.
    fn fan_out(&mut self, r: usize) {
        let SeqRef { slot, seq_id } = self.batch.owner[r];
        let (count, first, logits_row) = (self.batch.rows[r].fan_out, self.batch.fan_out_first[r], self.batch.rows[r].logits_row);
        // Done once: a step that skips `clear_plan` must not fork again.
        self.batch.rows[r].fan_out = 0;
        let before = self.req(slot).seq_slots();
        let ppos = self.req(slot).seq_pos(seq_id).expect("a live row's sequence is live");
        for j in 0..count {
            // Children are pushed after the parent: its position holds.
            let row = self.add_child(slot, ppos, first + j as u64, None) as usize;
            self.batch.rows[row].samples = true;
            self.batch.rows[row].logits_row = logits_row + 1 + j;
        }
        let req = self.requests[slot as usize].as_mut().expect("live slot");
        req.fanned_out = true;
        // Usually no change: the n slots were counted at admission.
        self.num_running_seqs = self.num_running_seqs + req.seq_slots() - before;
    }

    /// Forks sequence `ppos` of running request `slot` into a new sequence `child_id` that
    /// shares all its blocks (copy-on-write) and gets a batch row; `next_token`, if any, is
    /// appended to the child's tokens. The caller accounts for the request's sequence slots.
    fn add_child(&mut self, slot: u32, ppos: usize, child_id: u64, next_token: Option<u32>) -> u32 {
        self.flush_seq(slot, ppos);
        let req = self.requests[slot as usize].as_mut().expect("live slot");
        let parent = &req.seqs[ppos];
        let computed = Self::computed_of(&self.batch, parent);
        let table = self.kv.fork(&parent.table);
        if parent.row != NO_ROW {
            self.batch.rows[parent.row as usize].tail_owned = false; // now shared
        }
        let mut tokens = parent.tokens.clone();
        tokens.extend(next_token);
        let child = Sequence { seq_id: child_id, sample_index: req.next_sample_index, tokens, num_computed: computed, table, row: NO_ROW };
        req.next_sample_index += 1;
        let init = Self::row_init(req, &child, computed, self.cfg.max_model_len);
        let row = self.batch.push(SeqRef { slot, seq_id: child_id }, init, child.table.blocks().iter().map(|b| b.0));
        req.seqs.push(Sequence { row, ..child });
        self.seq_owner.insert(child_id, slot);
        row
    }

    /// Brings a running sequence up to date with its row (`flush_row`).
    fn flush_seq(&mut self, slot: u32, pos: usize) {
        let s = &mut self.requests[slot as usize].as_mut().expect("live slot").seqs[pos];
        Self::flush_row(&mut self.batch, s);
    }

    /// Ends one sequence; returns true when it was its request's last (the caller then takes
    /// the request out of `running` and releases the slot).
    fn finish_seq(&mut self, slot: u32, pos: usize, reason: FinishReason, stop_token: Option<u32>, out: &mut Vec<FinishedSeq>) -> bool {
        self.take_row(slot, pos);
        let req = self.requests[slot as usize].as_mut().expect("live slot");
        let before = req.seq_slots();
        let mut s = req.seqs.remove(pos);
        self.kv.free(&mut s.table);
        self.seq_owner.remove(&s.seq_id);
        let last = req.seqs.is_empty();
        if req.state == RequestState::Running {
            self.num_running_seqs -= before - if last { 0 } else { req.seq_slots() };
        }
        out.push(FinishedSeq {
            request_id: req.request_id,
            seq_id: s.seq_id,
            sample_index: s.sample_index,
            reason,
            stop_token,
            request_finished: last,
        });
        if last {
            self.by_id.remove(&req.request_id);
            self.ended_ids.push(req.request_id as i64);
            self.stats.requests_finished += 1;
        }
        last
    }

    fn release_slot(&mut self, slot: u32) {
        self.requests[slot as usize] = None;
        self.free_slots.push(slot);
    }

    /// Removes a request wherever it is, freeing all of its blocks. With `report`, its
    /// sequences are reported as finished by the next `update`.
    fn end_request(&mut self, slot: u32, reason: FinishReason, report: bool) {
        for pos in 0..self.req(slot).seqs.len() {
            self.take_row(slot, pos);
        }
        let req = self.requests[slot as usize].as_mut().expect("live slot");
        match req.state {
            RequestState::Running => {
                self.num_running_seqs -= req.seq_slots();
                if let Some(i) = self.running.iter().position(|&s| s == slot) {
                    self.running.remove(i);
                }
            }
            RequestState::Waiting | RequestState::Swapped => {
                let k = req.order_key();
                self.waiting.remove(&(k.0, k.1, slot));
            }
        }
        let n = req.seqs.len();
        for (i, s) in req.seqs.iter_mut().enumerate() {
            self.kv.free(&mut s.table);
            self.seq_owner.remove(&s.seq_id);
            if report {
                self.pending_finished.push(FinishedSeq {
                    request_id: req.request_id,
                    seq_id: s.seq_id,
                    sample_index: s.sample_index,
                    reason,
                    stop_token: None,
                    request_finished: i + 1 == n,
                });
            }
        }
        self.by_id.remove(&req.request_id);
        self.ended_ids.push(req.request_id as i64);
        self.release_slot(slot);
    }

    /// Ends a request at any time (waiting, running, swapped, or with a step in flight; the
    /// in-flight rows of an aborted request are ignored by `update`). Frees its blocks at once.
    pub fn abort(&mut self, request_id: u64) -> CoreResult<()> {
        let slot = *self.by_id.get(&request_id).ok_or(CoreError::UnknownRequest { request_id })?;
        self.end_request(slot, FinishReason::Abort, false);
        self.stats.requests_aborted += 1;
        Ok(())
    }

    fn locate_seq(&self, seq_id: u64) -> CoreResult<(u32, usize)> {
        let slot = *self.seq_owner.get(&seq_id).ok_or(CoreError::UnknownSequence { seq_id })?;
        let pos = self.req(slot).seq_pos(seq_id).ok_or(CoreError::UnknownSequence { seq_id })?;
        Ok((slot, pos))
    }

    /// Forks a running sequence into a new one of the same request that shares all its blocks
    /// (copy-on-write). If the sequence has a step in flight, `next_token` is the child's
    /// sampled token for that step (the parent gets its own through `update`); otherwise it
    /// must be `None`. A child that stops at once is reported by the next `update`.
    pub fn fork_sequence(&mut self, seq_id: u64, next_token: Option<u32>) -> CoreResult<u64> {
        let (slot, pos) = self.locate_seq(seq_id)?;
        if self.req(slot).state != RequestState::Running {
            return Err(CoreError::InvalidState {
                message: format!("fork_sequence(seq_id={seq_id}): its request is not running (waiting or swapped out)"),
            });
        }
        let req = self.req(slot);
        if req.n > 1 && !req.fanned_out {
            return Err(CoreError::InvalidState {
                message: format!("fork_sequence(seq_id={seq_id}): the request's n={} samples do not exist yet", req.n),
            });
        }
        let grow = (req.seqs.len() + 1).max(req.reserved_seqs as usize).saturating_sub(req.seq_slots());
        if self.num_running_seqs + grow > self.cfg.max_num_seqs {
            // A batch never holds more than max_num_seqs sequences (runners size buffers by it).
            return Err(CoreError::invalid(
                "seq_id",
                seq_id,
                format!("forking it would exceed max_num_seqs={} running sequences", self.cfg.max_num_seqs),
            ));
        }
        let parent_row = req.seqs[pos].row as usize;
        let in_flight = self.in_flight.is_some() && self.batch.rows[parent_row].samples;
        match (in_flight, next_token) {
            (true, None) => {
                return Err(CoreError::invalid("next_token", "None", format!("seq_id={seq_id} has a step in flight: pass the child's sampled token")))
            }
            (false, Some(t)) => {
                return Err(CoreError::invalid("next_token", t, format!("seq_id={seq_id} has no step in flight")))
            }
            _ => {}
        }
        let child_id = self.new_seq_id();
        let before = self.req(slot).seq_slots();
        self.add_child(slot, pos, child_id, next_token);
        self.num_running_seqs += self.req(slot).seq_slots() - before;
        if let Some(f) = self.in_flight.as_mut() {
            f.forked = true;
        }
        if let Some(t) = next_token {
            let req = self.req(slot);
            let s = req.seqs.last().expect("just pushed");
            if let Some((reason, st)) = req.stop.check(t, s.tokens.len() - req.prompt_len, s.tokens.len(), self.cfg.max_model_len) {
                let mut out = std::mem::take(&mut self.pending_finished);
                let pos = self.req(slot).seqs.len() - 1;
                if self.finish_seq(slot, pos, reason, st, &mut out) {
                    unreachable!("the parent is still live");
                }
                self.pending_finished = out;
            }
        }
        Ok(child_id)
    }

    /// Ends one sequence and frees its blocks. Returns true if it was its request's last, in
    /// which case the request is gone too.
    pub fn drop_sequence(&mut self, seq_id: u64) -> CoreResult<bool> {
        let (slot, pos) = self.locate_seq(seq_id)?;
        if self.req(slot).seqs.len() == 1 {
            self.end_request(slot, FinishReason::Abort, false);
            return Ok(true);
        }
        let mut sink = Vec::new();
        let last = self.finish_seq(slot, pos, FinishReason::Abort, None, &mut sink);
        debug_assert!(!last);
        Ok(false)
    }

    /// Forgets all cached prefixes not in use (e.g. after a failed model step whose KV is
    /// suspect). In-use blocks keep serving their own sequences.
    pub fn reset_prefix_cache(&mut self) {
        self.kv.reset_prefix_cache();
    }

    pub fn request_seq_ids(&self, request_id: u64) -> CoreResult<Vec<u64>> {
        let slot = *self.by_id.get(&request_id).ok_or(CoreError::UnknownRequest { request_id })?;
        Ok(self.req(slot).seqs.iter().map(|s| s.seq_id).collect())
    }

    pub fn num_cached_tokens(&self, request_id: u64) -> CoreResult<usize> {
        let slot = *self.by_id.get(&request_id).ok_or(CoreError::UnknownRequest { request_id })?;
        Ok(self.req(slot).num_cached_tokens.unwrap_or(0))
    }

    pub fn seq_block_table(&self, seq_id: u64) -> CoreResult<Vec<u32>> {
        let (slot, pos) = self.locate_seq(seq_id)?;
        Ok(self.seq_blocks(&self.req(slot).seqs[pos]).map(|b| b.0).collect())
    }

    /// A sequence's blocks: its table's, then those its row holds beyond them (see `flush_row`).
    fn seq_blocks<'a>(&'a self, s: &'a Sequence) -> impl Iterator<Item = BlockId> + 'a {
        let known = s.table.len();
        let extra = (s.row != NO_ROW).then(|| self.batch.row_blocks(s.row as usize).skip(known)).into_iter().flatten();
        s.table.blocks().iter().copied().chain(extra.map(|b| BlockId(b as u32)))
    }

    /// A sequence's table as `flush_row` would leave it (for the `&self` checks).
    fn flushed_table(&self, s: &Sequence) -> BlockTable {
        let mut t = s.table.clone();
        t.adopt(self.seq_blocks(s).skip(s.table.len()));
        t
    }

    /// A live sequence's tokens (prompt and output so far).
    pub fn seq_tokens(&self, seq_id: u64) -> CoreResult<Vec<u32>> {
        let (slot, pos) = self.locate_seq(seq_id)?;
        let s = &self.req(slot).seqs[pos];
        let mut tokens = s.tokens.clone();
        if s.row != NO_ROW {
            tokens.extend_from_slice(self.batch.pending(s.row as usize));
        }
        Ok(tokens)
    }

    pub fn kv_usage(&self) -> KvUsage {
        let bs = self.cfg.block_size;
        let mut seen = vec![false; self.cfg.num_blocks];
        let (mut refs, mut slots) = (0, 0);
        for &slot in &self.running {
            for s in &self.req(slot).seqs {
                for (i, b) in self.seq_blocks(s).enumerate() {
                    refs += 1;
                    if !std::mem::replace(&mut seen[b.0 as usize], true) {
                        slots += Self::computed_of(&self.batch, s).saturating_sub(i * bs).min(bs);
                    }
                }
            }
        }
        let free = self.kv.num_free_blocks();
        let used = self.kv.num_usable_blocks() - free;
        KvUsage {
            num_blocks: self.cfg.num_blocks,
            num_free_blocks: free,
            num_used_blocks: used,
            num_cached_blocks: self.kv.num_cached_blocks(),
            num_shared_blocks: (1..self.cfg.num_blocks).filter(|&b| self.kv.ref_count(BlockId(b as u32)) > 1).count(),
            num_block_refs: refs,
            num_used_token_slots: slots,
            block_size: bs,
        }
    }

    /// Checks every structural invariant; for tests and debugging (O(everything)).
    pub fn check_invariants(&self) -> Result<(), String> {
        let bs = self.cfg.block_size;
        let live = || self.requests.iter().flatten();
        let tables: Vec<BlockTable> = live().flat_map(|r| r.seqs.iter().map(|s| self.flushed_table(s))).collect();
        self.kv.check(tables.iter())?;
        let mut running_seqs = 0;
        let mut rows_seen = vec![false; self.batch.len()];
        for r in live() {
            for s in &r.seqs {
                let computed = Self::computed_of(&self.batch, s);
                let staged = if (s.row as usize) < self.batch.len() { self.batch.pending(s.row as usize).len() } else { 0 };
                let num_tokens = s.tokens.len() + staged;
                if computed > num_tokens {
                    return Err(format!("seq {} computed {computed} of {num_tokens} tokens", s.seq_id));
                }
                let want = computed.div_ceil(bs);
                let (have, what) = match r.state {
                    RequestState::Swapped => (s.table.cpu_blocks().len(), "cpu"),
                    _ => (self.seq_blocks(s).count(), "gpu"),
                };
                if have != want {
                    return Err(format!("seq {}: {have} {what} blocks for {} computed tokens", s.seq_id, computed));
                }
                if self.seq_owner.get(&s.seq_id) != self.by_id.get(&r.request_id) {
                    return Err(format!("seq {} owner map is stale", s.seq_id));
                }
                self.check_row(r, s, &mut rows_seen)?;
            }
            match r.state {
                RequestState::Running => running_seqs += r.seq_slots(),
                RequestState::Waiting if r.seqs.iter().any(|s| s.num_computed != 0) => {
                    return Err(format!("waiting request {} holds computed tokens", r.request_id));
                }
                _ => {}
            }
        }
        if running_seqs != self.num_running_seqs {
            return Err(format!("num_running_seqs={} but running requests hold {running_seqs}", self.num_running_seqs));
        }
        if self.waiting.len() + self.running.len() != self.by_id.len() {
            return Err("waiting + running != live requests".into());
        }
        for w in self.running.windows(2) {
            if self.req(w[0]).order_key() > self.req(w[1]).order_key() {
                return Err("running list is not in (priority, arrival) order".into());
            }
        }
        if let Some(i) = rows_seen.iter().position(|&seen| !seen) {
            return Err(format!("batch row {i} belongs to no running sequence"));
        }
        if self.batch.has_dead() {
            return Err("dead batch rows outlived update()".into());
        }
        self.batch.check_padding()?;
        if let Some(f) = &self.in_flight {
            if !f.forked {
                for r in (0..self.batch.len()).filter(|&r| self.batch.rows[r].new_tokens > 0) {
                    let SeqRef { slot, seq_id } = self.batch.owner[r];
                    let req = self.req(slot);
                    let s = &req.seqs[req.seq_pos(seq_id).ok_or("a row's sequence is gone")?];
                    let after = self.batch.rows[r].computed as usize;
                    let before = after - self.batch.rows[r].new_tokens as usize;
                    let table = self.flushed_table(s);
                    if !self.kv.writes_are_exclusive(&table, before, after) {
                        let t = table.blocks();
                        let refs: Vec<u32> = t.iter().map(|&b| self.kv.ref_count(b)).collect();
                        return Err(format!(
                            "seq {seq_id} writes positions {before}..{after} into a shared block (table {t:?}, refs {refs:?})"
                        ));
                    }
                }
            }
        }
        Ok(())
    }

    /// A running sequence owns exactly one batch row that mirrors it (its table, then blocks
    /// only the row holds yet); any other has none.
    fn check_row(&self, r: &Request, s: &Sequence, rows_seen: &mut [bool]) -> Result<(), String> {
        let b = &self.batch;
        if r.state != RequestState::Running {
            return if s.row == NO_ROW { Ok(()) } else { Err(format!("seq {} is not running but holds row {}", s.seq_id, s.row)) };
        }
        let row = s.row as usize;
        if row >= b.len() || std::mem::replace(&mut rows_seen[row], true) {
            return Err(format!("running seq {} has row {} (of {}), or shares it", s.seq_id, s.row, b.len()));
        }
        let slot = *self.by_id.get(&r.request_id).ok_or("running request not in by_id")?;
        let pending = b.pending(row);
        let last = pending.last().or(s.tokens.last()).copied().unwrap_or(0);
        let want = (
            SeqRef { slot, seq_id: s.seq_id },
            r.request_id as i64,
            s.seq_id as i64,
            s.sample_index as i32,
            (s.tokens.len() + pending.len()) as u32,
            last as i64,
            r.prompt_len as u32,
            RowStop::new(&r.stop, r.prompt_len, self.cfg.max_model_len),
        );
        let have = (
            b.owner[row],
            b.req_id[row],
            b.seq_id[row],
            b.sample_index[row],
            b.rows[row].num_tokens,
            b.last_token[row],
            b.rows[row].prompt_len,
            b.rows[row].stop,
        );
        if want != have {
            return Err(format!("row {row} of seq {}: {have:?} != {want:?}", s.seq_id));
        }
        let blocks: Vec<i32> = b.row_blocks(row).collect();
        let table: Vec<i32> = s.table.blocks().iter().map(|x| x.0 as i32).collect();
        if !blocks.starts_with(&table) {
            return Err(format!("row {row} of seq {}: blocks {blocks:?} do not extend table {table:?}", s.seq_id));
        }
        // Blocks only the row holds are fresh decode blocks: unshared, not cached yet.
        for &x in &blocks[table.len()..] {
            let x = BlockId(x as u32);
            if self.kv.ref_count(x) != 1 || self.kv.is_cached(x) {
                return Err(format!("row {row} of seq {}: block {} beyond its table is shared or cached", s.seq_id, x.0));
            }
        }
        let h = &b.rows[row];
        if h.tail_block as i32 != blocks.last().copied().unwrap_or(0) {
            return Err(format!("row {row} of seq {}: tail block {} != last of {blocks:?}", s.seq_id, h.tail_block));
        }
        // An owned tail may be shared only once full (a cache hit); then no write touches it.
        let tail_full = h.num_blocks as usize * self.cfg.block_size <= h.computed as usize;
        if h.tail_owned && !tail_full && self.kv.ref_count(BlockId(h.tail_block)) != 1 {
            return Err(format!("row {row} of seq {}: tail block {} marked owned but shared", s.seq_id, h.tail_block));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(num_blocks: usize, block_size: usize, budget: usize) -> SchedulerConfig {
        SchedulerConfig {
            num_blocks,
            block_size,
            max_num_seqs: budget.min(8),
            max_num_batched_tokens: budget,
            max_model_len: 1024,
            watermark: 0.0,
            admission_headroom: 0.0,
            ..Default::default()
        }
    }

    fn bt(o: &SchedulerOutput) -> Vec<i32> {
        match &o.block_tables {
            BlockTables::Owned(v) => v.clone(),
            BlockTables::Batch { .. } => panic!("copy the block tables out before update"),
        }
    }

    fn req(id: u64, prompt_len: usize, max_tokens: usize) -> NewRequest {
        NewRequest::new(id, (0..prompt_len as u32).map(|t| 100 + t + id as u32 * 1000).collect(), max_tokens)
    }

    /// One step with every row sampling `tok`; returns the output (its block tables copied out
    /// of the batch before `update`) and what finished.
    fn step(s: &mut Scheduler, tok: i64) -> (SchedulerOutput, Vec<FinishedSeq>) {
        let mut out = s.schedule().unwrap();
        s.check_invariants().unwrap();
        out.block_tables = BlockTables::Owned(s.block_tables(&out).unwrap());
        let done = s.update(out.step_id, &vec![tok; out.num_rows()]).unwrap();
        s.check_invariants().unwrap();
        (out, done)
    }

    #[test]
    fn chunked_prefill_then_decode_with_exact_slots_and_tables() {
        let mut s = Scheduler::new(cfg(16, 4, 8)).unwrap();
        s.add_request(req(1, 10, 3)).unwrap();
        let (o, _) = step(&mut s, 7);
        assert_eq!(o.num_tokens(), 8);
        assert_eq!(o.num_rows(), 0); // partial prefill: no logits
        assert_eq!(bt(&o), vec![1, 2]);
        assert_eq!(o.slot_mapping, (4..12).collect::<Vec<i64>>());
        assert_eq!(o.positions, (0..8).collect::<Vec<i64>>());
        let (o, _) = step(&mut s, 7);
        assert_eq!((o.num_tokens(), o.num_rows()), (2, 1));
        assert_eq!(o.positions, vec![8, 9]);
        assert_eq!(o.seq_lens, vec![10]);
        assert_eq!(bt(&o), vec![1, 2, 3]);
        assert_eq!(o.slot_mapping, vec![12, 13]);
        assert_eq!(o.logits_indices, vec![1]);
        let (o, _) = step(&mut s, 7);
        assert_eq!(o.input_ids, vec![7]);
        assert_eq!(o.positions, vec![10]);
        assert_eq!(o.num_decode_tokens, 1);
        let (_, done) = step(&mut s, 7);
        assert_eq!(done.len(), 1);
        assert_eq!(done[0].reason, FinishReason::Length);
        assert!(done[0].request_finished);
        assert_eq!(s.num_free_blocks(), 15);
        let st = s.stats();
        assert_eq!((st.prompt_tokens_computed, st.decode_tokens, st.generated_tokens), (10, 2, 3));
        let (o, _) = step(&mut s, 7);
        assert_eq!(o.finished_req_ids, vec![1]);
        assert!(o.is_empty());
    }

    #[test]
    fn decode_goes_first_and_prefill_fills_the_rest_of_the_budget() {
        let mut s = Scheduler::new(cfg(32, 4, 6)).unwrap();
        s.add_request(req(1, 3, 10)).unwrap();
        step(&mut s, 5);
        s.add_request(req(2, 9, 10)).unwrap();
        let (o, _) = step(&mut s, 5);
        assert_eq!(o.req_ids, vec![1, 2]);
        assert_eq!(o.query_start_loc, vec![0, 1, 6]); // 1 decode + 5 prefill tokens
        assert_eq!(o.num_prefill_tokens, 5);
        assert_eq!(o.logits_indices, vec![0]);
    }

    #[test]
    fn decodes_are_planned_row_wise_and_the_prefill_at_the_back_continues() {
        let mut s = Scheduler::new(cfg(64, 4, 8)).unwrap();
        s.add_request(req(1, 3, 10)).unwrap();
        s.add_request(req(2, 3, 10)).unwrap();
        step(&mut s, 5);
        s.add_request(req(3, 20, 4)).unwrap();
        let (o, _) = step(&mut s, 5); // 2 decodes + the first 6 tokens of request 3
        assert_eq!((o.num_decode_tokens, o.num_prefill_tokens), (2, 6));
        // Request 3 is running mid-prefill, at the back of the running order: the two decodes
        // are planned over the rows, request 3 gets the rest of the budget.
        let (o, _) = step(&mut s, 5);
        assert_eq!(o.req_ids, vec![1, 2, 3]);
        assert_eq!(o.query_start_loc, vec![0, 1, 2, 8]);
        assert_eq!(o.positions[2..], (6..12).collect::<Vec<i64>>()[..]);
        assert_eq!(o.logits_indices, vec![0, 1]); // request 3 is not done: no row
        assert_eq!((o.num_decode_tokens, o.num_prefill_tokens), (2, 6));
        let (o, _) = step(&mut s, 5);
        assert_eq!(o.query_start_loc, vec![0, 1, 2, 8]);
        let (o, _) = step(&mut s, 5); // the last 2 prompt tokens, then request 3 samples
        assert_eq!(o.query_start_loc, vec![0, 1, 2, 4]);
        assert_eq!(o.logits_indices, vec![0, 1, 3]);
        assert_eq!(s.stats().prompt_tokens_computed, 26);
    }

    #[test]
    fn a_prefill_at_the_back_that_runs_out_of_blocks_preempts_only_itself() {
        // 9 usable blocks of 4 tokens: two decoding requests hold 2 each, the long prompt's
        // second chunk cannot get its blocks.
        let mut c = cfg(10, 4, 16);
        c.max_num_seqs = 4;
        let mut s = Scheduler::new(c).unwrap();
        s.add_request(req(1, 7, 20)).unwrap();
        s.add_request(req(2, 7, 20)).unwrap();
        step(&mut s, 5);
        s.add_request(req(3, 30, 2)).unwrap();
        let (o, _) = step(&mut s, 5); // 2 decodes + 14 prompt tokens of request 3 (4 blocks)
        assert_eq!((o.num_decode_tokens, o.num_prefill_tokens), (2, 14));
        let (o, _) = step(&mut s, 5);
        // The decodes keep going; request 3 (the latest arrival, last in order) is preempted.
        assert_eq!(o.req_ids, vec![1, 2]);
        assert_eq!(o.preempted_req_ids, vec![3]);
        assert_eq!(s.stats().recompute_preemptions, 1);
        s.abort(3).unwrap();
        while s.has_unfinished() {
            step(&mut s, 5);
        }
        assert_eq!(s.num_free_blocks(), 9);
    }

    #[test]
    fn out_of_blocks_preempts_the_latest_arrival_for_recompute() {
        // 6 usable blocks of 2 tokens.
        let mut s = Scheduler::new(cfg(7, 2, 16)).unwrap();
        s.add_request(req(1, 4, 8)).unwrap();
        s.add_request(req(2, 4, 8)).unwrap();
        let (o, _) = step(&mut s, 1);
        assert_eq!(bt(&o), vec![1, 2, 3, 4]);
        step(&mut s, 1); // both at 5 tokens: blocks 5, 6
        assert_eq!(s.num_free_blocks(), 0);
        step(&mut s, 1); // positions 5 fit in the 3rd blocks
        let (o, _) = step(&mut s, 1); // request 1 needs a block: request 2 is preempted
        assert_eq!(o.preempted_req_ids, vec![2]);
        assert_eq!(o.req_ids, vec![1]);
        assert_eq!(s.num_waiting(), 1);
        assert_eq!(s.stats().recompute_preemptions, 1);
        // Request 2 comes back once request 1 is done and recomputes prompt + output.
        let mut seen_2 = false;
        for _ in 0..20 {
            let (o, _) = step(&mut s, 1);
            if o.req_ids.contains(&2) && !seen_2 {
                seen_2 = true;
                assert_eq!(o.positions.len(), 7); // 4 prompt + 3 generated tokens recomputed
            }
            if !s.has_unfinished() {
                break;
            }
        }
        assert!(seen_2 && !s.has_unfinished());
        assert_eq!(s.num_free_blocks(), 6);
        assert_eq!(s.stats().output_tokens_recomputed, 2);
    }

    #[test]
    fn swap_mode_emits_swap_pairs_and_resumes_without_recompute() {
        let mut c = cfg(7, 2, 16);
        c.preemption_mode = PreemptionMode::Swap;
        c.num_cpu_blocks = 8;
        let mut s = Scheduler::new(c).unwrap();
        s.add_request(req(1, 4, 8)).unwrap();
        s.add_request(req(2, 4, 8)).unwrap();
        for _ in 0..3 {
            step(&mut s, 1);
        }
        let (o, _) = step(&mut s, 1);
        assert_eq!(o.preempted_req_ids, vec![2]);
        assert_eq!(o.swap_out, vec![3, 0, 4, 1, 6, 2]); // request 2's blocks 3, 4, 6
        assert_eq!(s.stats().swap_preemptions, 1);
        let mut swapped_in = false;
        for _ in 0..20 {
            let (o, _) = step(&mut s, 1);
            if !o.swap_in.is_empty() {
                swapped_in = true;
                assert_eq!(o.swap_in.len(), 6);
                assert_eq!(o.positions.len(), 1, "a swapped request resumes with one decode token");
            }
            if !s.has_unfinished() {
                break;
            }
        }
        assert!(swapped_in);
        assert_eq!(s.stats().output_tokens_recomputed, 0);
        assert_eq!(s.num_free_blocks(), 6);
    }

    #[test]
    fn parallel_samples_share_the_prompt_and_copy_on_write() {
        let mut s = Scheduler::new(cfg(16, 4, 16)).unwrap();
        let mut r = req(1, 6, 3);
        r.n = 3;
        s.add_request(r).unwrap();
        let (o, _) = step(&mut s, 9);
        assert_eq!(o.logits_indices, vec![5, 5, 5]); // the last prompt row, sampled 3 times
        assert_eq!(o.row_sample_index, vec![0, 1, 2]);
        assert_eq!(bt(&o), vec![1, 2]);
        let ids = s.request_seq_ids(1).unwrap();
        assert_eq!(ids.len(), 3);
        let u = s.kv_usage();
        assert_eq!((u.num_used_blocks, u.num_shared_blocks, u.num_block_refs), (2, 2, 6));
        let out = s.schedule().unwrap();
        s.check_invariants().unwrap();
        // Each sample writes position 6 in shared block 2: the first two copy, the last owns it.
        assert_eq!(out.copy_ops, vec![2, 3, 2, 4]);
        assert_eq!(s.block_tables(&out).unwrap(), vec![1, 3, 1, 4, 1, 2]);
        assert_eq!(out.num_rows(), 3);
        s.update(out.step_id, &[1, 2, 3]).unwrap();
        let toks: Vec<_> = ids.iter().map(|&i| s.seq_tokens(i).unwrap()[6..].to_vec()).collect();
        assert_eq!(toks, vec![vec![9, 1], vec![9, 2], vec![9, 3]]);
        let (_, done) = step(&mut s, 0);
        assert_eq!(done.len(), 3);
        assert_eq!(done.iter().filter(|d| d.request_finished).count(), 1);
        assert_eq!(s.num_free_blocks(), 15);
    }

    #[test]
    fn beam_style_fork_and_drop() {
        let mut s = Scheduler::new(cfg(16, 4, 16)).unwrap();
        s.add_request(req(1, 5, 10)).unwrap();
        let out = s.schedule().unwrap();
        let parent = out.row_seq_ids[0] as u64;
        assert!(s.fork_sequence(parent, None).is_err()); // in flight: a token is required
        let child = s.fork_sequence(parent, Some(42)).unwrap();
        s.update(out.step_id, &[41]).unwrap();
        assert_eq!(s.seq_tokens(parent).unwrap()[5..], [41]);
        assert_eq!(s.seq_tokens(child).unwrap()[5..], [42]);
        assert_eq!(s.seq_block_table(child).unwrap(), s.seq_block_table(parent).unwrap());
        let (o, _) = step(&mut s, 1);
        assert_eq!(o.copy_ops, vec![2, 3]);
        assert_eq!(o.num_rows(), 2);
        assert!(!s.drop_sequence(parent).unwrap());
        assert_eq!(s.seq_block_table(child).unwrap(), vec![1, 2]);
        assert!(s.drop_sequence(child).unwrap());
        assert!(!s.has_unfinished());
        assert_eq!(s.num_free_blocks(), 15);
        s.check_invariants().unwrap();
    }

    #[test]
    fn a_fork_makes_the_shared_tail_copy_on_write_and_the_rows_learn_it_is_theirs_again() {
        let mut s = Scheduler::new(cfg(16, 4, 16)).unwrap();
        s.add_request(req(1, 6, 20)).unwrap();
        step(&mut s, 1); // prefill: blocks 1, 2 (tokens 0..4, 4..6)
        let row_of = |s: &Scheduler, seq: u64| s.batch.rows[s.req(s.seq_owner[&seq]).seqs.iter().find(|q| q.seq_id == seq).unwrap().row as usize];
        let parent = s.request_seq_ids(1).unwrap()[0];
        step(&mut s, 2); // decode at position 6, inside block 2: its ref count seen at 1
        assert_eq!((row_of(&s, parent).tail_block, row_of(&s, parent).tail_owned), (2, true));
        let child = s.fork_sequence(parent, None).unwrap();
        assert!(!row_of(&s, parent).tail_owned && !row_of(&s, child).tail_owned);
        // Both write position 7 of the shared block 2: one copies it first.
        let (o, _) = step(&mut s, 3);
        assert_eq!(o.copy_ops, vec![2, 3]);
        assert_eq!(o.slot_mapping, vec![3 * 4 + 3, 2 * 4 + 3]);
        assert_eq!((row_of(&s, parent).tail_block, row_of(&s, child).tail_block), (3, 2));
        // Position 8 starts fresh blocks; position 9 is written where each row owns its tail.
        let (o, _) = step(&mut s, 4);
        assert!(o.copy_ops.is_empty());
        assert!(row_of(&s, parent).tail_owned && row_of(&s, child).tail_owned);
        s.drop_sequence(child).unwrap();
        let (o, _) = step(&mut s, 5);
        assert_eq!((o.positions.clone(), o.copy_ops.len()), (vec![9], 0));
        assert_eq!(s.seq_tokens(parent).unwrap()[6..], [1, 2, 3, 4, 5]);
        s.check_invariants().unwrap();
    }

    #[test]
    fn a_decode_block_lives_in_the_row_until_the_sequence_is_read() {
        let mut s = Scheduler::new(cfg(16, 4, 16)).unwrap();
        s.add_request(req(1, 4, 12)).unwrap();
        step(&mut s, 1); // prefill: block 1 full
        let seq = s.request_seq_ids(1).unwrap()[0];
        let table_len = |s: &Scheduler| s.req(s.seq_owner[&seq]).seqs[0].table.len();
        step(&mut s, 2); // position 4 starts block 2, given to the row only
        assert_eq!((table_len(&s), s.seq_block_table(seq).unwrap()), (1, vec![1, 2]));
        assert_eq!(s.kv_usage().num_block_refs, 2);
        step(&mut s, 3);
        step(&mut s, 4);
        step(&mut s, 5); // position 7 completes block 2: registering it brings the table up to date
        assert_eq!(table_len(&s), 2);
        step(&mut s, 6); // block 3, in the row only again; a fork reads the table
        assert_eq!(table_len(&s), 2);
        let child = s.fork_sequence(seq, None).unwrap();
        assert_eq!(s.seq_block_table(child).unwrap(), vec![1, 2, 3]);
        assert_eq!(table_len(&s), 3);
        s.check_invariants().unwrap();
        s.abort(1).unwrap();
        assert_eq!(s.num_free_blocks(), 15);
    }

    #[test]
    fn stop_tokens_eos_and_abort_free_blocks_at_once() {
        let mut s = Scheduler::new(cfg(16, 4, 16)).unwrap();
        let mut a = req(1, 3, 10);
        a.eos_token_id = Some(2);
        let mut b = req(2, 3, 10);
        b.stop_token_ids = vec![5];
        s.add_request(a).unwrap();
        s.add_request(b).unwrap();
        s.add_request(req(3, 3, 10)).unwrap();
        let out = s.schedule().unwrap();
        let done = s.update(out.step_id, &[2, 5, 2]).unwrap();
        assert_eq!(done.len(), 2);
        assert_eq!((done[0].request_id, done[0].reason, done[0].stop_token), (1, FinishReason::Stop, None));
        assert_eq!((done[1].request_id, done[1].stop_token), (2, Some(5)));
        assert_eq!(s.num_free_blocks(), 14);
        s.abort(3).unwrap();
        assert_eq!(s.num_free_blocks(), 15);
        assert_eq!(s.abort(3), Err(CoreError::UnknownRequest { request_id: 3 }));
        let o = s.schedule().unwrap();
        assert_eq!(o.finished_req_ids, vec![1, 2, 3]);
    }

    #[test]
    fn abort_between_schedule_and_update_is_safe() {
        let mut s = Scheduler::new(cfg(16, 4, 16)).unwrap();
        s.add_request(req(1, 5, 4)).unwrap();
        s.add_request(req(2, 5, 4)).unwrap();
        let out = s.schedule().unwrap();
        s.abort(1).unwrap();
        let done = s.update(out.step_id, &[3, 3]).unwrap();
        assert!(done.is_empty());
        assert_eq!(s.seq_tokens(s.request_seq_ids(2).unwrap()[0]).unwrap().len(), 6);
        s.check_invariants().unwrap();
    }

    #[test]
    fn prefix_cache_hits_across_requests_and_after_preemption() {
        let mut s = Scheduler::new(cfg(32, 4, 64)).unwrap();
        let prompt: Vec<u32> = (0..13).collect();
        s.add_request(NewRequest::new(1, prompt.clone(), 2)).unwrap();
        step(&mut s, 1);
        step(&mut s, 1);
        assert!(!s.has_unfinished());
        s.add_request(NewRequest::new(2, prompt.clone(), 2)).unwrap();
        let (o, _) = step(&mut s, 1);
        assert_eq!(o.positions, vec![12]); // 3 blocks hit, the last token is recomputed
        assert_eq!(bt(&o), vec![1, 2, 3, 4]); // block 4 was partial, uncached: reused first
        assert_eq!(s.num_cached_tokens(2).unwrap(), 12);
        assert_eq!(s.stats().first_admission_cached_tokens, 12);
        // A different salt shares nothing.
        let mut r = NewRequest::new(3, prompt.clone(), 2);
        r.cache_salt = Some("tenant".into());
        s.add_request(r).unwrap();
        let (o, _) = step(&mut s, 1);
        assert_eq!(o.req_ids, vec![2, 3]);
        assert_eq!(o.num_tokens(), 1 + 13);
    }

    #[test]
    fn priority_policy_orders_admission_and_picks_victims() {
        let mut c = cfg(7, 2, 16);
        c.policy = Policy::Priority;
        let mut s = Scheduler::new(c).unwrap();
        let mut low = req(1, 4, 8);
        low.priority = 5;
        let mut high = req(2, 4, 8);
        high.priority = -1;
        s.add_request(low).unwrap();
        s.add_request(high).unwrap();
        let (o, _) = step(&mut s, 1);
        assert_eq!(o.req_ids, vec![2, 1]);
        let mut preempted = vec![];
        for _ in 0..4 {
            let (o, _) = step(&mut s, 1);
            preempted.extend(o.preempted_req_ids);
        }
        assert_eq!(preempted, vec![1]);
    }

    #[test]
    fn bad_input_is_a_typed_error_naming_the_field() {
        let mut s = Scheduler::new(cfg(8, 4, 16)).unwrap();
        s.add_request(req(1, 3, 2)).unwrap();
        assert_eq!(s.add_request(req(1, 3, 2)), Err(CoreError::DuplicateRequest { request_id: 1 }));
        let e = s.add_request(NewRequest::new(2, vec![], 2)).unwrap_err();
        assert!(e.to_string().contains("prompt_token_ids"), "{e}");
        let e = s.add_request(req(3, 3, 0)).unwrap_err();
        assert!(e.to_string().contains("max_tokens=0"), "{e}");
        let e = s.add_request(req(4, 2000, 2)).unwrap_err();
        assert_eq!(e, CoreError::PromptTooLong { len: 2000, max_model_len: 1024 });
        let e = s.add_request(req(5, 20, 20)).unwrap_err();
        assert!(matches!(e, CoreError::ExceedsCacheCapacity { blocks_needed: 10, blocks_available: 7, .. }), "{e}");
        assert!(s.update(1, &[]).is_err());
        let o = s.schedule().unwrap();
        assert!(matches!(s.schedule(), Err(CoreError::InvalidState { .. })));
        assert!(s.update(o.step_id, &[1, 2]).is_err());
        assert!(s.update(o.step_id, &[-1]).is_err());
        s.update(o.step_id, &[1]).unwrap();
        assert!(Scheduler::new(SchedulerConfig { max_num_batched_tokens: 4, max_num_seqs: 8, ..cfg(8, 4, 16) }).is_err());
        s.check_invariants().unwrap();
    }

    #[test]
    fn a_request_that_outgrows_the_cache_alone_is_aborted_not_spun_on() {
        let mut s = Scheduler::new(cfg(5, 2, 16)).unwrap(); // 4 usable blocks
        s.add_request(req(1, 3, 5)).unwrap(); // worst case 4 blocks: accepted
        let out = s.schedule().unwrap();
        let p = out.row_seq_ids[0] as u64;
        s.fork_sequence(p, Some(1)).unwrap(); // two beams of 8 tokens cannot fit in 4 blocks
        s.update(out.step_id, &[1]).unwrap();
        let mut aborted = false;
        for _ in 0..10 {
            let out = s.schedule().unwrap();
            let done = s.update(out.step_id, &vec![1; out.num_rows()]).unwrap();
            s.check_invariants().unwrap();
            if done.iter().any(|d| d.reason == FinishReason::Abort && d.request_finished) {
                aborted = true;
                break;
            }
        }
        assert!(aborted);
        assert_eq!(s.stats().capacity_aborts, 1);
        assert_eq!(s.num_free_blocks(), 4);
    }
}
