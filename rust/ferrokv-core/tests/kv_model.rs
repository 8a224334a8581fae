//! The KV memory model: random operations against the scheduler, with every step run on a
//! simulated KV memory and every read of it checked against an independent model.
//!
//! The model knows nothing of blocks, hashing or scheduling. It keeps each live sequence's
//! tokens (from `add_request`, the sampled tokens it passes to `update`, forks) and one value
//! per GPU and CPU token slot: which prefix (cache salt and tokens up to and including a
//! position) the KV in that slot was computed for. Prefixes are interned in a trie, so two
//! slots hold the same KV exactly when they hold the same node. For each step it does what a
//! runner does: swap-outs, swap-ins and copy-on-write copies block by block, then one write per
//! token into `slot_mapping[t]`, then it reads every context position of every scheduled
//! sequence through the step's block tables and checks that the slot holds that sequence's
//! prefix at that position. A wrong block, a missing copy, a prefix-cache hit across salts or
//! on other tokens, a lost swap, two sequences writing one slot: each reads the wrong prefix.
//!
//! A cancelled step runs only part of its block ops and writes (some skipped, some leaving
//! garbage behind, as an interrupted runner may), and `cancel_step` must make sure that nothing
//! read later depends on them. Step misuse (`schedule` twice, `update` with another step's id,
//! the wrong number of tokens or a bad token, `update` or `cancel_step` of a step that is over,
//! a fork with the wrong `next_token`) must be an error that changes nothing. Every sequence
//! that `update` reports ended ends as the model's own statement of the stop rules says (EOS,
//! stop token ids, `min_tokens`, `ignore_eos`, `max_tokens`, `max_model_len`), or is an abort;
//! every output reports each request that ended since the last output that was not cancelled,
//! once (`finished_req_ids`); after every `update` the live requests, sequences and tokens and
//! the request counters agree with the model; once everything has ended, every block is free.
//!
//! Operations: add (prompts that share prefixes, three salts, n > 1, beam reservations,
//! priorities), schedule and update or cancel, fork, drop, abort and `reset_prefix_cache`
//! between steps and mid-step. Configurations: block sizes 1 to 16, tight and roomy GPU and CPU
//! pools, both preemption modes and policies, prefix caching on and off, watermarks, several
//! `max_model_len`.
//!
//! The run counts the successes of every kind of operation (fork, drop and abort, between
//! steps and mid-step; cancel; rejected misuse) and of what makes the model worth running
//! (swap-ins, copies, prefix hits, preemptions of both kinds) and fails if one never happens.
//! `PROPTEST_CASES=20000` (with `--release`) for a long run.

use ferrokv_core::{CoreError, FinishReason, FinishedSeq, NewRequest, Policy, PreemptionMode, Scheduler, SchedulerConfig, SchedulerOutput};
use proptest::prelude::*;
use proptest::test_runner::{Config, FileFailurePersistence, TestCaseError, TestRunner};
use std::cell::RefCell;
use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};

/// Cases CI runs (a few seconds in a debug build).
const DEFAULT_CASES: u32 = 256;
/// Below this many cases the run is too short to require every kind of operation to succeed.
const MIN_CASES_FOR_COVERAGE: u32 = 64;

/// A slot nothing was ever written to, and one an interrupted runner left half written.
const EMPTY: u32 = u32::MAX;
const GARBAGE: u32 = u32::MAX - 1;

/// Interned prefixes: a node per (salt, tokens) prefix.
#[derive(Default)]
struct Prefixes {
    roots: HashMap<Option<String>, u32>,
    children: HashMap<(u32, u32), u32>,
}

impl Prefixes {
    fn fresh(&self) -> u32 {
        (self.roots.len() + self.children.len()) as u32
    }
    fn root(&mut self, salt: &Option<String>) -> u32 {
        if let Some(&n) = self.roots.get(salt) {
            return n;
        }
        let n = self.fresh();
        self.roots.insert(salt.clone(), n);
        n
    }
    fn child(&mut self, parent: u32, token: u32) -> u32 {
        if let Some(&n) = self.children.get(&(parent, token)) {
            return n;
        }
        let n = self.fresh();
        self.children.insert((parent, token), n);
        n
    }
}

#[derive(Debug, Clone)]
struct MSeq {
    req: u64,
    tokens: Vec<u32>,
    /// `nodes[p]`: the prefix of tokens `0..=p` (with the request's salt).
    nodes: Vec<u32>,
}

#[derive(Debug, Clone)]
struct MReq {
    salt: Option<String>,
    root: u32,
    /// Its stop rules: from `min_len` tokens on, EOS (unless ignored) then the stop token ids;
    /// then the length `min(prompt + max_tokens, max_model_len)`.
    min_len: usize,
    eos: Option<u32>,
    stop_ids: Vec<u32>,
    stop_len: usize,
}

/// Why a sequence ended, and the stop token id that ended it.
type Stop = (FinishReason, Option<u32>);

/// Successes over the run.
#[derive(Debug, Default, Clone)]
struct Counts {
    steps_checked: u64,
    positions_read: u64,
    fork_idle: u64,
    fork_mid_step: u64,
    drop_idle: u64,
    drop_mid_step: u64,
    abort_idle: u64,
    abort_mid_step: u64,
    cancel: u64,
    misuse_rejected: u64,
    fan_outs: u64,
    copy_ops: u64,
    swap_outs: u64,
    swap_ins: u64,
    prefix_hit_tokens: u64,
    salted_prefix_hit_tokens: u64,
    recompute_preemptions: u64,
    swap_preemptions: u64,
}

impl Counts {
    fn add(&mut self, o: &Counts) {
        for (a, b) in self.fields_mut().into_iter().zip(o.fields()) {
            *a.1 += b.1;
        }
    }
    fn fields(&self) -> Vec<(&'static str, u64)> {
        let mut c = self.clone();
        c.fields_mut().into_iter().map(|(n, v)| (n, *v)).collect()
    }
    fn fields_mut(&mut self) -> Vec<(&'static str, &mut u64)> {
        vec![
            ("steps_checked", &mut self.steps_checked),
            ("positions_read", &mut self.positions_read),
            ("fork_idle", &mut self.fork_idle),
            ("fork_mid_step", &mut self.fork_mid_step),
            ("drop_idle", &mut self.drop_idle),
            ("drop_mid_step", &mut self.drop_mid_step),
            ("abort_idle", &mut self.abort_idle),
            ("abort_mid_step", &mut self.abort_mid_step),
            ("cancel", &mut self.cancel),
            ("misuse_rejected", &mut self.misuse_rejected),
            ("fan_outs", &mut self.fan_outs),
            ("copy_ops", &mut self.copy_ops),
            ("swap_outs", &mut self.swap_outs),
            ("swap_ins", &mut self.swap_ins),
            ("prefix_hit_tokens", &mut self.prefix_hit_tokens),
            ("salted_prefix_hit_tokens", &mut self.salted_prefix_hit_tokens),
            ("recompute_preemptions", &mut self.recompute_preemptions),
            ("swap_preemptions", &mut self.swap_preemptions),
        ]
    }
}

#[derive(Debug, Clone)]
enum Mid {
    /// Fork the k-th scheduled sequence (its child's token if it samples this step).
    Fork(u8, u8),
    Drop(u8),
    Abort(u8),
    ResetPrefixCache,
}

#[derive(Debug, Clone, Copy)]
enum Misuse {
    ScheduleAgain,
    WrongStepId,
    WrongTokenCount,
    BadToken,
    CancelWrongStepId,
    ForkWrongNextToken,
    /// After the update: `update` and `cancel_step` of the step that is over.
    AfterTheStep,
}

#[derive(Debug, Clone)]
enum End {
    Update,
    /// The runner was interrupted: `pattern` says, op by op and write by write, whether it ran
    /// (1), did not (0) or left garbage behind (2).
    Cancel { pattern: Vec<u8> },
}

/// A request: its prompt is `len` tokens, the first `shared` of them common to its `family`.
#[derive(Debug, Clone)]
struct Add {
    family: u8,
    shared: usize,
    len: usize,
    max_tokens: usize,
    min_tokens: usize,
    n: u32,
    /// Hold a beam width of n + 1 sequence slots.
    reserve: bool,
    priority: i32,
    eos: bool,
    ignore_eos: bool,
    stop_id: bool,
    salt: u8,
}

#[derive(Debug, Clone)]
enum Op {
    Add(Add),
    Step { tokens: Vec<u8>, mid: Vec<Mid>, misuse: Vec<Misuse>, end: End },
    Abort(u8),
    ForkIdle(u8),
    Drop(u8),
    ResetPrefixCache,
}

fn misuse() -> impl Strategy<Value = Misuse> {
    prop::sample::select(vec![
        Misuse::ScheduleAgain,
        Misuse::WrongStepId,
        Misuse::WrongTokenCount,
        Misuse::BadToken,
        Misuse::CancelWrongStepId,
        Misuse::ForkWrongNextToken,
        Misuse::AfterTheStep,
    ])
}

fn mid() -> impl Strategy<Value = Mid> {
    prop_oneof![
        (any::<u8>(), any::<u8>()).prop_map(|(k, t)| Mid::Fork(k, t)),
        any::<u8>().prop_map(Mid::Drop),
        any::<u8>().prop_map(Mid::Abort),
        Just(Mid::ResetPrefixCache),
    ]
}

fn op() -> impl Strategy<Value = Op> {
    let add = (
        (0u8..2, 0usize..24, 1usize..24, 1usize..32, 0usize..3),
        (prop::sample::select(vec![1u32, 1, 1, 2, 3]), prop::bool::weighted(0.1), -2i32..3),
        (any::<bool>(), prop::bool::weighted(0.1), prop::bool::weighted(0.2), 0u8..4),
    )
        .prop_map(|((family, shared, len, max_tokens, min_tokens), (n, reserve, priority), (eos, ignore_eos, stop_id, salt))| {
            Op::Add(Add { family, shared, len, max_tokens, min_tokens, n, reserve, priority, eos, ignore_eos, stop_id, salt })
        });
    let end = prop_oneof![7 => Just(End::Update), 1 => prop::collection::vec(0u8..3, 0..12).prop_map(|pattern| End::Cancel { pattern })];
    let step = (
        prop::collection::vec(any::<u8>(), 0..8),
        prop_oneof![3 => Just(Vec::new()), 1 => prop::collection::vec(mid(), 1..3)],
        prop::collection::vec(misuse(), 0..2),
        end,
    )
        .prop_map(|(tokens, mid, misuse, end)| Op::Step { tokens, mid, misuse, end });
    prop_oneof![
        4 => add,
        7 => step,
        1 => any::<u8>().prop_map(Op::Abort),
        1 => any::<u8>().prop_map(Op::ForkIdle),
        1 => any::<u8>().prop_map(Op::Drop),
        1 => Just(Op::ResetPrefixCache),
    ]
}

fn config() -> impl Strategy<Value = SchedulerConfig> {
    (
        prop::sample::select(vec![1usize, 2, 4, 8, 16]),
        16usize..96,
        4usize..48,
        any::<bool>(),
        any::<bool>(),
        any::<bool>(),
        0usize..160,
        prop::sample::select(vec![0usize, 0, 1, 2]),
        prop::sample::select(vec![24usize, 64, 96, 96]),
    )
        .prop_map(|(block_size, gpu_tokens, budget, caching, swap, priority, cpu_tokens, slack, max_model_len)| SchedulerConfig {
            num_blocks: 2 + gpu_tokens / block_size,
            block_size,
            max_num_seqs: budget.min(6),
            max_num_batched_tokens: budget,
            max_model_len,
            enable_prefix_caching: caching,
            preemption_mode: if swap { PreemptionMode::Swap } else { PreemptionMode::Recompute },
            num_cpu_blocks: cpu_tokens / block_size,
            policy: if priority { Policy::Priority } else { Policy::Fcfs },
            watermark: [0.0, 0.05, 0.1][slack],
            admission_headroom: [0.0, 0.5, 1.0][slack],
            sampling_seed: 0,
        })
}

fn fail(e: impl std::fmt::Display) -> TestCaseError {
    TestCaseError::fail(e.to_string())
}

/// A sample fanned out at `update`: its request and prompt.
type NewSample = (u64, Vec<u32>);

struct Model {
    bs: usize,
    max_model_len: usize,
    num_blocks: usize,
    gpu: Vec<u32>,
    cpu: Vec<u32>,
    prefixes: Prefixes,
    reqs: BTreeMap<u64, MReq>,
    seqs: BTreeMap<u64, MSeq>,
    /// Every request id ever accepted, and the sequence ids that ended.
    added: Vec<u64>,
    gone_seqs: HashSet<u64>,
    /// Sequences that ended in the scheduler (a fork that stopped at once) and that the next
    /// `update` reports, with why.
    unreported: HashMap<u64, Stop>,
    /// Requests that ended since the last output that was not cancelled, and requests an
    /// output reported ended before the model learnt why (from the next `update`).
    to_report: BTreeSet<u64>,
    reported_early: BTreeSet<u64>,
    /// Salted requests whose first admission's prefix hits were counted.
    salted_hits_seen: HashSet<u64>,
    next_id: u64,
    counts: Counts,
}

impl Model {
    fn new(cfg: &SchedulerConfig) -> Self {
        Model {
            bs: cfg.block_size,
            max_model_len: cfg.max_model_len,
            num_blocks: cfg.num_blocks,
            gpu: vec![EMPTY; cfg.num_blocks * cfg.block_size],
            cpu: vec![EMPTY; cfg.num_cpu_blocks * cfg.block_size],
            prefixes: Prefixes::default(),
            reqs: BTreeMap::new(),
            seqs: BTreeMap::new(),
            added: Vec::new(),
            gone_seqs: HashSet::new(),
            unreported: HashMap::new(),
            to_report: BTreeSet::new(),
            reported_early: BTreeSet::new(),
            salted_hits_seen: HashSet::new(),
            next_id: 0,
            counts: Counts::default(),
        }
    }

    fn new_seq(&mut self, req: u64, tokens: Vec<u32>) -> MSeq {
        let mut s = MSeq { req, tokens: Vec::new(), nodes: Vec::new() };
        for t in tokens {
            self.push_token(&mut s, t);
        }
        s
    }

    fn push_token(&mut self, s: &mut MSeq, t: u32) {
        let parent = s.nodes.last().copied().unwrap_or(self.reqs[&s.req].root);
        s.nodes.push(self.prefixes.child(parent, t));
        s.tokens.push(t);
    }

    /// Why a sequence stops after its last token, if it does.
    fn stop(&self, s: &MSeq) -> Option<Stop> {
        let r = &self.reqs[&s.req];
        let (len, last) = (s.tokens.len(), *s.tokens.last().expect("a sequence has tokens"));
        if len >= r.min_len && r.eos == Some(last) {
            Some((FinishReason::Stop, None))
        } else if len >= r.min_len && r.stop_ids.contains(&last) {
            Some((FinishReason::Stop, Some(last)))
        } else {
            (len >= r.stop_len).then_some((FinishReason::Length, None))
        }
    }

    fn seqs_of(&self, req: u64) -> Vec<u64> {
        self.seqs.iter().filter(|(_, s)| s.req == req).map(|(&id, _)| id).collect()
    }

    fn end_seq(&mut self, seq: u64) {
        self.seqs.remove(&seq);
        self.gone_seqs.insert(seq);
    }

    fn end_request(&mut self, req: u64) {
        for q in self.seqs_of(req) {
            self.end_seq(q);
        }
        self.request_ended(req);
    }

    /// A request is gone: the next output reports it, unless one reported it already.
    fn request_ended(&mut self, req: u64) {
        self.reqs.remove(&req);
        if !self.reported_early.remove(&req) {
            self.to_report.insert(req);
        }
    }

    fn add(&mut self, s: &mut Scheduler, a: &Add) {
        let &Add { family, shared, len, max_tokens, min_tokens, n, reserve, priority, eos, ignore_eos, stop_id, salt } = a;
        let id = self.next_id;
        self.next_id += 1;
        let prompt: Vec<u32> = (0..len as u32)
            .map(|t| if (t as usize) < shared { family as u32 * 10 + t % 4 } else { 100 + (id as u32 * 31 + t * 7) % 1000 })
            .collect();
        let salt = match salt {
            1 | 2 => Some("a".to_string()),
            3 => Some("b".to_string()),
            _ => None,
        };
        let mut r = NewRequest::new(id, prompt.clone(), max_tokens);
        (r.n, r.priority, r.eos_token_id, r.cache_salt) = (n, priority, eos.then_some(3), salt.clone());
        (r.min_tokens, r.ignore_eos, r.stop_token_ids) = (min_tokens.min(max_tokens), ignore_eos, if stop_id { vec![5] } else { vec![] });
        r.reserve_seqs = if reserve { n + 1 } else { 0 };
        let stop_ids = r.stop_token_ids.clone();
        if s.add_request(r).is_err() {
            return;
        }
        let root = self.prefixes.root(&salt);
        let (min_len, stop_len) = (len + min_tokens.min(max_tokens), (len + max_tokens).min(self.max_model_len));
        let eos = if eos && !ignore_eos { Some(3) } else { None };
        self.reqs.insert(id, MReq { salt, root, min_len, eos, stop_ids, stop_len });
        self.added.push(id);
        let seq_id = s.request_seq_ids(id).expect("just added")[0];
        let seq = self.new_seq(id, prompt);
        self.seqs.insert(seq_id, seq);
    }

    /// What the scheduler shows of the state a misuse must not change.
    fn snapshot(&self, s: &Scheduler) -> String {
        let mut out = format!(
            "{:?} {:?} free={} waiting={} running={} seqs={}",
            s.stats(),
            s.kv_stats(),
            s.num_free_blocks(),
            s.num_waiting(),
            s.num_running(),
            s.num_running_seqs()
        );
        for &q in self.seqs.keys() {
            out += &format!(" {q}:{:?}{:?}", s.seq_tokens(q), s.seq_block_table(q));
        }
        out
    }

    fn copy_block(from: &[u32], fb: usize, to: &mut [u32], tb: usize, bs: usize) {
        to[tb * bs..(tb + 1) * bs].copy_from_slice(&from[fb * bs..(fb + 1) * bs]);
    }

    /// Runs the step's block ops, in the runner's order (swap-out, swap-in, copy), then its
    /// writes. `pattern` (an interrupted runner) skips some and leaves garbage for others.
    fn run_step(&mut self, out: &SchedulerOutput, pattern: Option<&[u8]>) -> Result<(), TestCaseError> {
        let bs = self.bs;
        let mut k = 0usize;
        let mut next = || {
            let v = match pattern {
                Some(p) if !p.is_empty() => p[k % p.len()],
                _ => 1,
            };
            k += 1;
            v
        };
        let gpu_blocks = self.num_blocks;
        let cpu_blocks = self.cpu.len() / bs.max(1);
        let pairs = |v: &[i32]| -> Vec<(usize, usize)> { v.chunks(2).map(|p| (p[0] as usize, p[1] as usize)).collect() };
        let (swap_out, swap_in, copies) = (pairs(&out.swap_out), pairs(&out.swap_in), pairs(&out.copy_ops));
        prop_assert!(out.swap_out.len() % 2 == 0 && out.swap_in.len() % 2 == 0 && out.copy_ops.len() % 2 == 0);
        // A runner runs each kind of op as one batch: destinations are distinct, never the null
        // block, and no copy reads a block another copy of the step writes.
        for (name, ops, src_max, dst_max) in
            [("swap_out", &swap_out, gpu_blocks, cpu_blocks), ("swap_in", &swap_in, cpu_blocks, gpu_blocks), ("copy", &copies, gpu_blocks, gpu_blocks)]
        {
            let dsts: BTreeSet<usize> = ops.iter().map(|p| p.1).collect();
            prop_assert_eq!(dsts.len(), ops.len(), "{} destinations repeat: {:?}", name, ops);
            for &(a, b) in ops.iter() {
                prop_assert!(a < src_max && b < dst_max, "{} op {:?} out of range", name, (a, b));
            }
        }
        prop_assert!(copies.iter().all(|&(a, b)| a != 0 && b != 0 && !copies.iter().any(|c| c.1 == a)), "copy ops {:?}", copies);
        prop_assert!(swap_in.iter().all(|&(_, g)| g != 0) && swap_out.iter().all(|&(g, _)| g != 0));
        for &(g, c) in &swap_out {
            match next() {
                0 => {}
                1 => Self::copy_block(&self.gpu, g, &mut self.cpu, c, bs),
                _ => self.cpu[c * bs..(c + 1) * bs].fill(GARBAGE),
            }
        }
        for &(c, g) in &swap_in {
            match next() {
                0 => {}
                1 => Self::copy_block(&self.cpu, c, &mut self.gpu, g, bs),
                _ => self.gpu[g * bs..(g + 1) * bs].fill(GARBAGE),
            }
        }
        for &(a, b) in &copies {
            match next() {
                0 => {}
                1 => {
                    let src = self.gpu.clone();
                    Self::copy_block(&src, a, &mut self.gpu, b, bs);
                }
                _ => self.gpu[b * bs..(b + 1) * bs].fill(GARBAGE),
            }
        }
        self.counts.copy_ops += copies.len() as u64;
        self.counts.swap_outs += swap_out.len() as u64;
        self.counts.swap_ins += swap_in.len() as u64;
        let mut written = HashSet::new();
        for i in 0..out.num_seqs() {
            let seq = &self.seqs[&(out.seq_ids[i] as u64)];
            for t in out.query_start_loc[i] as usize..out.query_start_loc[i + 1] as usize {
                let (p, slot) = (out.positions[t] as usize, out.slot_mapping[t]);
                prop_assert!(slot >= bs as i64 && (slot as usize) < self.gpu.len(), "token {} writes slot {}", t, slot);
                prop_assert!(written.insert(slot), "two tokens of the step write slot {}", slot);
                match next() {
                    0 => {}
                    1 => self.gpu[slot as usize] = seq.nodes[p],
                    _ => self.gpu[slot as usize] = GARBAGE,
                }
            }
        }
        Ok(())
    }

    /// Every context position of every scheduled sequence, read through the step's block
    /// tables, holds that sequence's prefix.
    fn check_reads(&mut self, out: &SchedulerOutput, tables: &[i32]) -> Result<(), TestCaseError> {
        let (bs, m) = (self.bs, out.max_blocks);
        for i in 0..out.num_seqs() {
            let id = out.seq_ids[i] as u64;
            let seq = &self.seqs[&id];
            let row = &tables[i * m..(i + 1) * m];
            let len = out.seq_lens[i] as usize;
            for p in 0..len {
                let b = row[p / bs];
                prop_assert!(b > 0 && (b as usize) < self.num_blocks, "seq {} position {} in block {}", id, p, b);
                let have = self.gpu[b as usize * bs + p % bs];
                prop_assert!(
                    have == seq.nodes[p],
                    "step {}: seq {} (request {}, salt {:?}) reads position {} in block {}: holds {}, expected #{}",
                    out.step_id,
                    id,
                    seq.req,
                    self.reqs.get(&seq.req).map(|r| r.salt.clone()),
                    p,
                    b,
                    match have {
                        EMPTY => "nothing".to_string(),
                        GARBAGE => "garbage".to_string(),
                        n => format!("prefix #{n}"),
                    },
                    seq.nodes[p]
                );
            }
            self.counts.positions_read += len as u64;
        }
        Ok(())
    }

    /// The step's arrays agree with the model's sequences: ids, positions, input ids, slots
    /// (through the block tables) and logits rows.
    fn check_step(&self, out: &SchedulerOutput, tables: &[i32]) -> Result<(), TestCaseError> {
        let (bs, m, s_count) = (self.bs, out.max_blocks, out.num_seqs());
        prop_assert_eq!(out.block_size, bs);
        prop_assert_eq!(tables.len(), s_count * m);
        prop_assert_eq!(out.query_start_loc.len(), s_count + 1);
        prop_assert_eq!((out.req_ids.len(), out.seq_lens.len()), (s_count, s_count));
        prop_assert_eq!(out.query_start_loc[s_count] as usize, out.num_tokens());
        prop_assert_eq!((out.positions.len(), out.slot_mapping.len()), (out.num_tokens(), out.num_tokens()));
        let mut samples = BTreeSet::new();
        let mut seen = HashSet::new();
        for i in 0..s_count {
            let id = out.seq_ids[i] as u64;
            prop_assert!(seen.insert(id), "seq {} scheduled twice", id);
            let Some(seq) = self.seqs.get(&id) else {
                return Err(fail(format!("step {} schedules seq {id}, which the model does not know (ended: {})", out.step_id, self.gone_seqs.contains(&id))));
            };
            prop_assert_eq!(out.req_ids[i] as u64, seq.req);
            let (lo, hi, len) = (out.query_start_loc[i] as usize, out.query_start_loc[i + 1] as usize, out.seq_lens[i] as usize);
            prop_assert!(lo < hi && hi - lo <= len && len <= seq.tokens.len(), "seq {} computes {}..{} of {}", id, len.saturating_sub(hi - lo), len, seq.tokens.len());
            prop_assert!(len.div_ceil(bs) <= m, "seq {} needs {} blocks, the tables have {}", id, len.div_ceil(bs), m);
            let row = &tables[i * m..(i + 1) * m];
            for t in lo..hi {
                let p = out.positions[t] as usize;
                prop_assert_eq!(p, len - (hi - t));
                prop_assert_eq!(out.input_ids[t], seq.tokens[p] as i64, "seq {} position {}", id, p);
                prop_assert_eq!(out.slot_mapping[t], row[p / bs] as i64 * bs as i64 + (p % bs) as i64, "seq {} position {}", id, p);
            }
            if len == seq.tokens.len() {
                samples.insert(hi - 1);
            }
        }
        // Logits rows: the last token of each sequence that computed its last token (and its
        // fanned-out samples), nothing else.
        prop_assert_eq!((out.row_req_ids.len(), out.row_seq_ids.len(), out.row_sample_index.len()), (out.num_rows(), out.num_rows(), out.num_rows()));
        let rows: BTreeSet<usize> = out.logits_indices.iter().map(|&t| t as usize).collect();
        prop_assert_eq!(&rows, &samples, "logits rows");
        for j in 0..out.num_rows() {
            let t = out.logits_indices[j] as usize;
            let i = out.query_start_loc.partition_point(|&q| q as usize <= t) - 1;
            prop_assert_eq!(out.row_req_ids[j], out.req_ids[i]);
            let q = out.row_seq_ids[j] as u64;
            if q != out.seq_ids[i] as u64 {
                prop_assert!(out.row_sample_index[j] > 0 && !self.seqs.contains_key(&q) && !self.gone_seqs.contains(&q), "row {} names seq {}", j, q);
            }
        }
        Ok(())
    }

    /// Applies `update`'s effects to the model: sampled tokens, fanned-out samples, and what
    /// it reports as finished.
    fn apply_update(&mut self, out: &SchedulerOutput, sampled: &[i64], done: &[FinishedSeq]) -> Result<(), TestCaseError> {
        // (seq, its token, the new sample's request and prompt); read before anything changes.
        let mut appended: Vec<(u64, u32, Option<NewSample>)> = Vec::new();
        for (j, &tok) in sampled.iter().enumerate() {
            let (q, tok) = (out.row_seq_ids[j] as u64, tok as u32);
            if self.seqs.contains_key(&q) {
                appended.push((q, tok, None));
            } else if !self.gone_seqs.contains(&q) {
                // A fanned-out sample: the prompt of the sequence the row samples, then its token.
                let t = out.logits_indices[j] as usize;
                let i = out.query_start_loc.partition_point(|&x| x as usize <= t) - 1;
                if let Some(parent) = self.seqs.get(&(out.seq_ids[i] as u64)) {
                    appended.push((q, tok, Some((parent.req, parent.tokens.clone()))));
                }
            }
        }
        let mut stops: HashMap<u64, Stop> = HashMap::new();
        for (q, tok, new) in appended {
            let mut s = match new {
                None => self.seqs.remove(&q).expect("listed above"),
                Some((req, prompt)) => {
                    self.counts.fan_outs += 1;
                    self.new_seq(req, prompt)
                }
            };
            self.push_token(&mut s, tok);
            if let Some(why) = self.stop(&s) {
                stops.insert(q, why);
            }
            self.seqs.insert(q, s);
        }
        // What ends: the stops above, forks that stopped at once, and aborts the model cannot
        // foresee (a request that outgrew the cache alone, one a cancel could not put back).
        for f in done {
            if let Some(why) = self.unreported.remove(&f.seq_id) {
                prop_assert_eq!((f.reason, f.stop_token, f.request_finished), (why.0, why.1, false), "{:?}", f);
                self.gone_seqs.insert(f.seq_id);
                continue;
            }
            let Some(s) = self.seqs.get(&f.seq_id) else {
                return Err(fail(format!("update reports seq {} finished, which the model does not know: {f:?}", f.seq_id)));
            };
            prop_assert_eq!(s.req, f.request_id);
            let want = stops.remove(&f.seq_id).unwrap_or((FinishReason::Abort, None));
            prop_assert_eq!((f.reason, f.stop_token), want, "{:?}", f);
            self.end_seq(f.seq_id);
            let left = self.seqs_of(f.request_id);
            prop_assert_eq!(f.request_finished, left.is_empty(), "{:?}: sequences left {:?}", f, left);
            if f.request_finished {
                self.request_ended(f.request_id);
            }
        }
        prop_assert!(stops.is_empty(), "sequences that should have stopped: {:?}", stops);
        Ok(())
    }

    /// After an update: the scheduler's live requests, sequences and tokens are the model's,
    /// and every request that ended is counted once.
    fn check_sync(&self, s: &Scheduler) -> Result<(), TestCaseError> {
        for &r in &self.added {
            match (self.reqs.contains_key(&r), s.request_seq_ids(r)) {
                (true, Ok(mut ids)) => {
                    ids.sort_unstable();
                    prop_assert_eq!(ids, self.seqs_of(r), "request {}'s sequences", r);
                }
                (false, Err(CoreError::UnknownRequest { .. })) => {}
                (live, other) => return Err(fail(format!("request {r}: model live={live}, scheduler says {other:?}"))),
            }
        }
        for (&q, seq) in &self.seqs {
            prop_assert_eq!(s.seq_tokens(q).map_err(fail)?, seq.tokens.clone(), "seq {} tokens", q);
        }
        let st = s.stats();
        let ended = (self.added.len() - self.reqs.len()) as u64;
        prop_assert_eq!(st.requests_added, self.added.len() as u64);
        prop_assert_eq!(st.requests_finished + st.requests_aborted + st.capacity_aborts, ended, "ended requests: {:?}", st);
        prop_assert_eq!(s.num_unfinished(), self.reqs.len());
        Ok(())
    }

    /// Prefix hits of salted requests (hits that the model proves came from the same salt).
    fn count_salted_hits(&mut self, s: &Scheduler) {
        for (&r, q) in &self.reqs {
            if q.salt.is_some() && !self.salted_hits_seen.contains(&r) {
                if let Ok(n @ 1..) = s.num_cached_tokens(r) {
                    self.counts.salted_prefix_hit_tokens += n as u64;
                    self.salted_hits_seen.insert(r);
                }
            }
        }
    }

    /// A misuse is an error and changes nothing.
    fn rejected<T: std::fmt::Debug>(&mut self, s: &Scheduler, before: &str, what: &str, r: Result<T, CoreError>) -> Result<(), TestCaseError> {
        prop_assert!(r.is_err(), "{} succeeded: {:?}", what, r);
        prop_assert_eq!(&self.snapshot(s), before, "{} changed the state", what);
        self.counts.misuse_rejected += 1;
        Ok(())
    }

    fn misuse_in_flight(&mut self, s: &mut Scheduler, out: &SchedulerOutput, m: Misuse) -> Result<(), TestCaseError> {
        let before = self.snapshot(s);
        let rows = out.num_rows();
        match m {
            Misuse::ScheduleAgain => {
                let r = s.schedule();
                self.rejected(s, &before, "schedule() in flight", r)
            }
            Misuse::WrongStepId => {
                let r = s.update(out.step_id + 1, &vec![1; rows]);
                self.rejected(s, &before, "update(wrong step id)", r)
            }
            Misuse::WrongTokenCount => {
                let r = s.update(out.step_id, &vec![1; rows + 1]);
                self.rejected(s, &before, "update(one token too many)", r)
            }
            Misuse::BadToken if rows > 0 => {
                let mut bad = vec![1; rows];
                bad[rows - 1] = if out.step_id % 2 == 0 { -1 } else { 1i64 << 32 };
                let r = s.update(out.step_id, &bad);
                self.rejected(s, &before, "update(bad token)", r)
            }
            Misuse::CancelWrongStepId => {
                let r = s.cancel_step(out.step_id.wrapping_sub(1));
                self.rejected(s, &before, "cancel_step(wrong step id)", r)
            }
            Misuse::ForkWrongNextToken if out.num_seqs() > 0 => {
                // The first scheduled sequence, with a token exactly when it does not sample.
                let q = out.seq_ids[0] as u64;
                if !self.seqs.contains_key(&q) {
                    return Ok(());
                }
                let samples = out.row_seq_ids.contains(&(q as i64));
                let r = s.fork_sequence(q, if samples { None } else { Some(1) });
                self.rejected(s, &before, "fork_sequence(wrong next_token)", r)
            }
            _ => Ok(()),
        }
    }

    /// Fork, drop, abort or reset the prefix cache while the step is in flight (as another
    /// thread may).
    fn mid_step(&mut self, s: &mut Scheduler, out: &SchedulerOutput, m: &Mid) -> Result<(), TestCaseError> {
        if out.num_seqs() == 0 {
            return Ok(());
        }
        let pick = |k: u8| out.seq_ids[k as usize % out.num_seqs()] as u64;
        match *m {
            Mid::Fork(k, tok) => {
                let q = pick(k);
                let Some(parent) = self.seqs.get(&q).cloned() else { return Ok(()) };
                let samples = out.row_seq_ids.contains(&(q as i64));
                let next = samples.then_some(tok as u32 % 6);
                match s.fork_sequence(q, next) {
                    Ok(child) => {
                        let mut tokens = parent.tokens.clone();
                        tokens.extend(next);
                        let c = self.new_seq(parent.req, tokens);
                        let live = s.request_seq_ids(parent.req).map_err(fail)?.contains(&child);
                        match self.stop(&c).filter(|_| next.is_some()) {
                            Some(why) => {
                                prop_assert!(!live, "fork {} should have stopped at once ({:?})", child, why);
                                self.unreported.insert(child, why);
                            }
                            None => {
                                prop_assert!(live, "fork {} ended at once", child);
                                self.seqs.insert(child, c);
                            }
                        }
                        self.counts.fork_mid_step += 1;
                    }
                    Err(CoreError::InvalidArgument { field: "next_token", reason, .. }) => {
                        return Err(fail(format!("fork of seq {q} (samples: {samples}) refused its next_token: {reason}")))
                    }
                    Err(_) => {}
                }
            }
            Mid::Drop(k) => {
                let q = pick(k);
                if let Ok(last) = s.drop_sequence(q) {
                    let req = self.seqs.get(&q).map(|x| x.req);
                    let Some(req) = req else { return Err(fail(format!("dropped seq {q}, which the model does not know"))) };
                    self.end_seq(q);
                    prop_assert_eq!(last, self.seqs_of(req).is_empty());
                    if last {
                        self.request_ended(req);
                    }
                    self.counts.drop_mid_step += 1;
                }
            }
            Mid::Abort(k) => {
                let r = out.req_ids[k as usize % out.num_seqs()] as u64;
                if s.abort(r).is_ok() {
                    prop_assert!(self.reqs.contains_key(&r), "aborted request {}, which the model does not know", r);
                    self.end_request(r);
                    self.counts.abort_mid_step += 1;
                }
            }
            Mid::ResetPrefixCache => s.reset_prefix_cache(),
        }
        Ok(())
    }

    /// An output reports every request that ended since the last output that was not
    /// cancelled, once. The others it reports ended in this `schedule` or in a `cancel_step`
    /// (they outgrew the cache alone, or could not be put back): the model learns why from the
    /// next `update`. Returns what it reports.
    fn check_reported(&mut self, out: &SchedulerOutput) -> Result<BTreeSet<u64>, TestCaseError> {
        let got: BTreeSet<u64> = out.finished_req_ids.iter().map(|&r| r as u64).collect();
        prop_assert_eq!(got.len(), out.finished_req_ids.len(), "reported twice: {:?}", out.finished_req_ids);
        let missing: Vec<_> = self.to_report.difference(&got).collect();
        prop_assert!(missing.is_empty(), "requests that ended but are not reported: {:?}", missing);
        for r in got.difference(&self.to_report) {
            prop_assert!(self.reqs.contains_key(r), "request {} reported ended again", r);
        }
        self.reported_early.extend(got.iter().filter(|r| self.reqs.contains_key(r)));
        Ok(got)
    }

    fn step(&mut self, s: &mut Scheduler, tokens: &[u8], mids: &[Mid], misuse: &[Misuse], end: &End) -> Result<(), TestCaseError> {
        let out = s.schedule().map_err(fail)?;
        s.check_invariants().map_err(fail)?;
        let reported = self.check_reported(&out)?;
        // A cancelled step's output is reported again by the next one.
        self.to_report = if matches!(end, End::Cancel { .. }) { reported } else { BTreeSet::new() };
        let tables = s.block_tables(&out).map_err(fail)?;
        self.check_step(&out, &tables)?;
        match end {
            End::Update => {
                self.run_step(&out, None)?;
                self.check_reads(&out, &tables)?;
                self.counts.steps_checked += 1;
            }
            End::Cancel { pattern } => self.run_step(&out, Some(pattern))?,
        }
        for &m in misuse {
            self.misuse_in_flight(s, &out, m)?;
        }
        for m in mids {
            self.mid_step(s, &out, m)?;
        }
        s.check_invariants().map_err(fail)?;
        prop_assert_eq!(s.block_tables(&out).map_err(fail)?, tables, "the step's block tables changed while it was in flight");
        match end {
            End::Cancel { .. } => {
                s.cancel_step(out.step_id).map_err(fail)?;
                s.check_invariants().map_err(fail)?;
                self.counts.cancel += 1;
                let before = self.snapshot(s);
                let r = s.update(out.step_id, &vec![1; out.num_rows()]);
                self.rejected(s, &before, "update of a cancelled step", r)?;
            }
            End::Update => {
                let sampled: Vec<i64> = (0..out.num_rows()).map(|i| *tokens.get(i).unwrap_or(&(i as u8 + 4)) as i64 % 6).collect();
                let done = s.update(out.step_id, &sampled).map_err(fail)?;
                s.check_invariants().map_err(fail)?;
                self.apply_update(&out, &sampled, &done)?;
                self.check_sync(s)?;
                self.count_salted_hits(s);
                if misuse.iter().any(|m| matches!(m, Misuse::AfterTheStep)) {
                    let before = self.snapshot(s);
                    let r = s.update(out.step_id, &sampled);
                    self.rejected(s, &before, "a second update", r)?;
                    let r = s.cancel_step(out.step_id);
                    self.rejected(s, &before, "cancel_step after update", r)?;
                }
            }
        }
        Ok(())
    }

    fn apply(&mut self, s: &mut Scheduler, op: &Op) -> Result<(), TestCaseError> {
        match op {
            Op::Add(a) => self.add(s, a),
            Op::ResetPrefixCache => s.reset_prefix_cache(),
            Op::Step { tokens, mid, misuse, end } => self.step(s, tokens, mid, misuse, end)?,
            Op::Abort(k) => {
                if !self.added.is_empty() {
                    let r = self.added[*k as usize % self.added.len()];
                    if s.abort(r).is_ok() {
                        prop_assert!(self.reqs.contains_key(&r), "aborted request {}, which ended", r);
                        self.end_request(r);
                        self.counts.abort_idle += 1;
                    }
                }
            }
            Op::ForkIdle(k) => {
                let live: Vec<u64> = self.seqs.keys().copied().collect();
                if !live.is_empty() {
                    let q = live[*k as usize % live.len()];
                    if let Ok(child) = s.fork_sequence(q, None) {
                        let parent = self.seqs[&q].clone();
                        let c = self.new_seq(parent.req, parent.tokens);
                        self.seqs.insert(child, c);
                        self.counts.fork_idle += 1;
                    }
                }
            }
            Op::Drop(k) => {
                let live: Vec<u64> = self.seqs.keys().copied().collect();
                if !live.is_empty() {
                    let q = live[*k as usize % live.len()];
                    if let Ok(last) = s.drop_sequence(q) {
                        let req = self.seqs[&q].req;
                        self.end_seq(q);
                        prop_assert_eq!(last, self.seqs_of(req).is_empty());
                        if last {
                            self.request_ended(req);
                        }
                        self.counts.drop_idle += 1;
                    }
                }
            }
        }
        s.check_invariants().map_err(fail)
    }
}

/// One case: the operations, then `drain` plain steps (`None`: to completion), then every
/// request left is aborted (with a step in flight if `abort_in_flight`): every block is free.
fn run_case(cfg: SchedulerConfig, ops: &[Op], drain: Option<usize>, abort_in_flight: bool) -> Result<Counts, TestCaseError> {
    let usable = cfg.num_blocks - 1;
    let mut m = Model::new(&cfg);
    let mut s = Scheduler::new(cfg).map_err(fail)?;
    for op in ops {
        m.apply(&mut s, op)?;
    }
    for _ in 0..drain.unwrap_or(2000) {
        if !s.has_unfinished() {
            break;
        }
        m.step(&mut s, &[], &[], &[], &End::Update)?;
    }
    if drain.is_none() {
        prop_assert!(!s.has_unfinished(), "requests left: {}", s.num_unfinished());
    }
    let in_flight = if abort_in_flight {
        let out = s.schedule().map_err(fail)?;
        m.check_reported(&out)?;
        m.to_report.clear();
        let tables = s.block_tables(&out).map_err(fail)?;
        m.check_step(&out, &tables)?;
        m.run_step(&out, None)?;
        m.check_reads(&out, &tables)?;
        Some(out)
    } else {
        None
    };
    for r in m.added.clone() {
        if s.abort(r).is_ok() {
            m.end_request(r);
        }
    }
    s.check_invariants().map_err(fail)?;
    prop_assert!(!s.has_unfinished());
    prop_assert_eq!(s.num_free_blocks(), usable);
    if let Some(out) = in_flight {
        let done = s.update(out.step_id, &vec![1; out.num_rows()]).map_err(fail)?;
        m.apply_update(&out, &vec![1; out.num_rows()], &done)?;
        m.check_sync(&s)?;
        prop_assert_eq!(s.num_free_blocks(), usable);
    }
    let st = s.stats();
    m.counts.recompute_preemptions += st.recompute_preemptions;
    m.counts.swap_preemptions += st.swap_preemptions;
    m.counts.prefix_hit_tokens += st.cached_prompt_tokens;
    Ok(m.counts)
}

fn cases() -> u32 {
    std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(DEFAULT_CASES)
}

#[test]
fn every_kv_read_sees_the_prefix_the_model_expects_and_every_operation_succeeds_somewhere() {
    let cases = cases();
    let rc = Config {
        cases,
        source_file: Some(file!()),
        failure_persistence: Some(Box::new(FileFailurePersistence::WithSource("proptest-regressions"))),
        ..Config::default()
    };
    let mut runner = TestRunner::new(rc);
    let total = RefCell::new(Counts::default());
    let strategy = (config(), prop::collection::vec(op(), 1..60), prop::option::of(0usize..8), any::<bool>());
    let result = runner.run(&strategy, |(cfg, ops, drain, abort_in_flight)| {
        let c = run_case(cfg, &ops, drain, abort_in_flight)?;
        total.borrow_mut().add(&c);
        Ok(())
    });
    if let Err(e) = result {
        panic!("{e}");
    }
    let total = total.into_inner();
    eprintln!("{cases} cases: {total:?}");
    if cases >= MIN_CASES_FOR_COVERAGE {
        for (name, n) in total.fields() {
            assert!(n > 0, "{name} never happened in {cases} cases: {total:?}");
        }
    }
}
