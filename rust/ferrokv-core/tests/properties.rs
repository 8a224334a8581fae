//! The property test of the scheduler's invariants: random interleavings of add, schedule,
//! update, fork, drop and abort (also while a step is in flight) keep every invariant
//! (`check_invariants`), every step's arrays agree with the sequences they describe, and once
//! every request has ended (run to completion or aborted) every block is free. The run counts
//! how often fork, drop, abort and cancel succeed, and fails if one of them never does.

use ferrokv_core::{NewRequest, Policy, PreemptionMode, Scheduler, SchedulerConfig, SchedulerOutput};
use proptest::prelude::*;
use proptest::test_runner::{Config, FileFailurePersistence, TestCaseError, TestRunner};
use std::cell::RefCell;

/// Successes over the run, by kind (mid-step ones included).
#[derive(Debug, Default, Clone, Copy)]
struct Successes {
    fork: u64,
    drop: u64,
    abort: u64,
    cancel: u64,
}

#[derive(Debug, Clone)]
enum Op {
    Add { prompt_len: usize, shared_prefix: bool, max_tokens: usize, n: u32, priority: i32, eos: bool },
    /// `cancel`: the forward pass fails and the step is cancelled instead of updated.
    Step { tokens: Vec<u8>, fork_rows: Vec<u8>, drop_rows: Vec<u8>, abort_rows: Vec<u8>, cancel: bool },
    Abort(u8),
    ForkIdle(u8),
    Drop(u8),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (1usize..40, any::<bool>(), 1usize..24, 1u32..4, -2i32..3, any::<bool>()).prop_map(
            |(prompt_len, shared_prefix, max_tokens, n, priority, eos)| Op::Add { prompt_len, shared_prefix, max_tokens, n, priority, eos }
        ),
        6 => (
            prop::collection::vec(any::<u8>(), 0..8),
            prop::collection::vec(any::<u8>(), 0..2),
            prop::collection::vec(any::<u8>(), 0..2),
            prop::collection::vec(any::<u8>(), 0..2),
            0u8..8, // one step in 8 is cancelled
        )
            .prop_map(|(tokens, fork_rows, drop_rows, abort_rows, cancel)| Op::Step { tokens, fork_rows, drop_rows, abort_rows, cancel: cancel == 0 }),
        1 => any::<u8>().prop_map(Op::Abort),
        1 => any::<u8>().prop_map(Op::ForkIdle),
        1 => any::<u8>().prop_map(Op::Drop),
    ]
}

fn config() -> impl Strategy<Value = SchedulerConfig> {
    (6usize..40, prop::sample::select(vec![1usize, 2, 4, 8]), 4usize..48, any::<bool>(), any::<bool>(), any::<bool>(), 0usize..12)
        .prop_map(|(num_blocks, block_size, budget, caching, swap, priority, cpu)| SchedulerConfig {
            num_blocks,
            block_size,
            max_num_seqs: budget.min(6),
            max_num_batched_tokens: budget,
            max_model_len: 96,
            enable_prefix_caching: caching,
            preemption_mode: if swap { PreemptionMode::Swap } else { PreemptionMode::Recompute },
            num_cpu_blocks: cpu,
            policy: if priority { Policy::Priority } else { Policy::Fcfs },
            watermark: 0.05,
            admission_headroom: 0.5,
            sampling_seed: 0,
        })
}

/// Every scheduled sequence's slots, input ids and block-table row agree with its state.
fn check_output(s: &Scheduler, out: &SchedulerOutput) -> Result<(), TestCaseError> {
    let bs = out.block_size;
    let tables = s.block_tables(out).map_err(|e| TestCaseError::fail(e.to_string()))?;
    let m = out.max_blocks;
    prop_assert_eq!(tables.len(), out.num_seqs() * m);
    for i in 0..out.num_seqs() {
        let seq = out.seq_ids[i] as u64;
        let table: Vec<i32> = s.seq_block_table(seq).unwrap().iter().map(|&b| b as i32).collect();
        let row = &tables[i * m..(i + 1) * m];
        prop_assert_eq!(&row[..table.len()], &table[..], "seq {} table", seq);
        prop_assert!(row[table.len()..].iter().all(|&b| b == 0), "seq {} padding {:?}", seq, row);
        let (lo, hi) = (out.query_start_loc[i] as usize, out.query_start_loc[i + 1] as usize);
        let len = out.seq_lens[i] as usize;
        prop_assert_eq!(table.len(), len.div_ceil(bs));
        let tokens = s.seq_tokens(seq).unwrap();
        for t in lo..hi {
            let p = out.positions[t] as usize;
            prop_assert_eq!(p, len - (hi - t));
            prop_assert_eq!(out.input_ids[t], tokens[p] as i64);
            prop_assert_eq!(out.slot_mapping[t], (table[p / bs] as usize * bs + p % bs) as i64);
        }
    }
    Ok(())
}

fn live_seqs(s: &Scheduler, ids: &[u64]) -> Vec<u64> {
    ids.iter().filter_map(|&r| s.request_seq_ids(r).ok()).flatten().collect()
}

fn invariants(s: &Scheduler) -> Result<(), TestCaseError> {
    s.check_invariants().map_err(TestCaseError::fail)
}

/// Applies one random operation; `ids` lists the requests added so far.
fn apply(s: &mut Scheduler, op: Op, ids: &mut Vec<u64>, next_id: &mut u64, n: &mut Successes) -> Result<(), TestCaseError> {
    match op {
        Op::Add { prompt_len, shared_prefix, max_tokens, n, priority, eos } => {
            let base = if shared_prefix { 0 } else { 1000 * (*next_id as u32 + 1) };
            let mut r = NewRequest::new(*next_id, (0..prompt_len as u32).map(|t| base + t % 7).collect(), max_tokens);
            r.n = n;
            r.priority = priority;
            r.eos_token_id = eos.then_some(3);
            if s.add_request(r).is_ok() {
                ids.push(*next_id);
            }
            *next_id += 1;
        }
        Op::Step { tokens, fork_rows, drop_rows, abort_rows, cancel } => {
            let out = s.schedule().unwrap();
            invariants(s)?;
            check_output(s, &out)?;
            let rows = out.num_rows();
            if rows > 0 {
                for f in fork_rows {
                    let seq = out.row_seq_ids[f as usize % rows] as u64;
                    // Rows of n > 1 samples forked at update do not exist yet.
                    n.fork += u64::from(s.fork_sequence(seq, Some(f as u32 % 5)).is_ok());
                }
                for d in drop_rows {
                    n.drop += u64::from(s.drop_sequence(out.row_seq_ids[d as usize % rows] as u64).is_ok());
                }
                for a in abort_rows {
                    n.abort += u64::from(s.abort(out.row_req_ids[a as usize % rows] as u64).is_ok());
                }
            }
            invariants(s)?;
            if cancel {
                let free = s.num_free_blocks();
                s.cancel_step(out.step_id).unwrap();
                n.cancel += 1;
                prop_assert!(s.num_free_blocks() >= free, "a cancel releases, never takes");
                return invariants(s);
            }
            let sampled: Vec<i64> = (0..rows).map(|i| *tokens.get(i).unwrap_or(&9) as i64 % 6).collect();
            s.update(out.step_id, &sampled).unwrap();
        }
        Op::Abort(k) => {
            if !ids.is_empty() {
                n.abort += u64::from(s.abort(ids[k as usize % ids.len()]).is_ok());
            }
        }
        Op::ForkIdle(k) => {
            let live = live_seqs(s, ids);
            if !live.is_empty() {
                n.fork += u64::from(s.fork_sequence(live[k as usize % live.len()], None).is_ok());
            }
        }
        Op::Drop(k) => {
            let live = live_seqs(s, ids);
            if !live.is_empty() {
                s.drop_sequence(live[k as usize % live.len()]).unwrap();
                n.drop += 1;
            }
        }
    }
    invariants(s)
}

/// Random operations keep every invariant and every step's arrays right; then everything ends
/// and every block is free again. `drain` steps run first (`None`: to completion, which must
/// come, since forks can only shrink from here), then every request left is aborted, with a
/// step in flight if `abort_in_flight`.
fn run_case(cfg: SchedulerConfig, ops: Vec<Op>, drain: Option<usize>, abort_in_flight: bool, n: &mut Successes) -> Result<(), TestCaseError> {
    let usable = cfg.num_blocks - 1;
    let mut s = Scheduler::new(cfg).unwrap();
    let (mut ids, mut next_id) = (Vec::new(), 0u64);
    for op in ops {
        apply(&mut s, op, &mut ids, &mut next_id, n)?;
    }
    for _ in 0..drain.unwrap_or(2000) {
        if !s.has_unfinished() {
            break;
        }
        let plain = Op::Step { tokens: vec![4; 8], fork_rows: vec![], drop_rows: vec![], abort_rows: vec![], cancel: false };
        apply(&mut s, plain, &mut ids, &mut next_id, n)?;
    }
    if drain.is_none() {
        prop_assert!(!s.has_unfinished(), "requests left: {}", s.num_unfinished());
    }
    let in_flight = if abort_in_flight {
        let out = s.schedule().unwrap();
        invariants(&s)?;
        check_output(&s, &out)?;
        Some(out)
    } else {
        None
    };
    for &id in &ids {
        let _ = s.abort(id);
    }
    invariants(&s)?;
    prop_assert!(!s.has_unfinished());
    prop_assert_eq!(s.num_free_blocks(), usable);
    if let Some(out) = in_flight {
        s.update(out.step_id, &vec![1; out.num_rows()]).unwrap();
        invariants(&s)?;
        prop_assert_eq!(s.num_free_blocks(), usable);
    }
    Ok(())
}

/// PROPTEST_CASES=20000 for a stress run; CI runs 400.
#[test]
fn any_interleaving_keeps_every_invariant_and_ending_everything_frees_every_block() {
    let cases = std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(400);
    let rc = Config {
        cases,
        source_file: Some(file!()),
        failure_persistence: Some(Box::new(FileFailurePersistence::WithSource("proptest-regressions"))),
        ..Config::default()
    };
    let total = RefCell::new(Successes::default());
    let strategy = (config(), prop::collection::vec(op(), 1..60), prop::option::of(0usize..8), any::<bool>());
    let result = TestRunner::new(rc).run(&strategy, |(cfg, ops, drain, abort_in_flight)| {
        let mut n = Successes::default();
        run_case(cfg, ops, drain, abort_in_flight, &mut n)?;
        let mut t = total.borrow_mut();
        (t.fork, t.drop, t.abort, t.cancel) = (t.fork + n.fork, t.drop + n.drop, t.abort + n.abort, t.cancel + n.cancel);
        Ok(())
    });
    if let Err(e) = result {
        panic!("{e}");
    }
    let t = total.into_inner();
    eprintln!("{cases} cases, successes: {t:?}");
    // A run of 64 cases or more has each of them hundreds of times.
    if cases >= 64 {
        assert!(t.fork > 0 && t.drop > 0 && t.abort > 0 && t.cancel > 0, "an operation never succeeded in {cases} cases: {t:?}");
    }
}
