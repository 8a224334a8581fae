//! Criterion benches of the core operations, in pure Rust (criterion is an opt-in feature of
//! this crate, so that `cargo test --workspace` does not compile it).
//!
//! ```text
//! cargo bench -p ferrokv-bench --features criterion --bench core -- --warm-up-time 1 --measurement-time 2
//! ```
//!
//! - `kv/allocate_free_block`: `allocate_slots` of one token into an empty table, then `free`
//!   (with and without prefix caching: with it, a popped block is also checked for eviction).
//! - `kv/fork_cow`: fork a 20-token table (one full + one partial block of 16), write the next
//!   token into the child (copy-on-write of the shared last block), free the child, take the
//!   queued copy op.
//! - `prefix_lookup/find_cached_prefix/{1,8,64}`: lookup of a prompt whose first 1/8/64 blocks
//!   are cached (one hash and one map probe per block; throughput in blocks).
//! - `scheduler/decode_step/{64,256,1024,4096}`: one `schedule()` + `update()` with that many
//!   running decode sequences (160-token prompts prefilled untimed; the batch is rebuilt,
//!   untimed, every 512 steps, so contexts stay under ~850 tokens). Throughput in
//!   sequence-steps. The same loop through Python is `benches/scheduler_bench.py` (its
//!   "fixed decode batch" table) and, for the full workload, `src/bin/sched_loop.rs`.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use ferrokv_core::kv_cache_manager::{KvCacheManager, SeqKv};
use ferrokv_core::BlockId;
use ferrokv_core::{NewRequest, Scheduler, SchedulerConfig};
use std::hint::black_box;
use std::time::{Duration, Instant};

const BS: usize = 16;

fn kv_ops(c: &mut Criterion) {
    let mut g = c.benchmark_group("kv");
    for caching in [false, true] {
        let name = if caching { "allocate_free_block/prefix_caching" } else { "allocate_free_block" };
        g.bench_function(name, |b| {
            let mut m = KvCacheManager::new(1024, BS, 0, caching);
            // A sequence's block ids live in its batch row; a Vec stands in for it here.
            let (mut t, mut ids) = (SeqKv::default(), Vec::<BlockId>::new());
            b.iter(|| {
                let ok = m.allocate_slots(&mut t, &mut ids, 0, black_box(1), &[], 0);
                black_box(ok);
                m.free(&mut t, &ids);
                ids.clear();
            });
            assert!(ids.is_empty() && m.num_free_blocks() == 1023);
        });
    }
    g.bench_function("fork_cow", |b| {
        let mut m = KvCacheManager::new(1024, BS, 0, false);
        let (mut parent, mut parent_ids) = (SeqKv::default(), Vec::<BlockId>::new());
        assert!(m.allocate_slots(&mut parent, &mut parent_ids, 0, 20, &[], 0));
        b.iter(|| {
            let (mut child, mut child_ids) = m.fork(&parent, &parent_ids);
            let ok = m.allocate_slots(&mut child, &mut child_ids, 20, 1, &[], 0);
            black_box(ok);
            m.free(&mut child, &child_ids);
            black_box(m.take_ops())
        });
        let (mut child, mut child_ids) = m.fork(&parent, &parent_ids);
        assert!(m.allocate_slots(&mut child, &mut child_ids, 20, 1, &[], 0));
        assert_eq!(m.take_ops().copy, vec![(parent_ids[1].0, child_ids[1].0)]);
    });
    g.finish();
}

fn prefix_lookup(c: &mut Criterion) {
    let mut g = c.benchmark_group("prefix_lookup");
    for nb in [1usize, 8, 64] {
        let mut m = KvCacheManager::new(nb + 16, BS, 0, true);
        // nb full blocks + 1 token: all nb blocks can hit (the last token is always computed).
        let tokens: Vec<u32> = (1000..1000 + (nb * BS + 1) as u32).collect();
        let (mut t, mut ids) = (SeqKv::default(), Vec::<BlockId>::new());
        assert!(m.allocate_slots(&mut t, &mut ids, 0, tokens.len(), &[], 0));
        m.register_computed(&mut t, &ids, &tokens, tokens.len(), None, &mut Vec::new());
        m.free(&mut t, &ids); // cached, unreferenced: what a later identical prompt finds
        assert_eq!(m.num_cached_blocks(), nb);
        g.throughput(Throughput::Elements(nb as u64));
        g.bench_with_input(BenchmarkId::new("find_cached_prefix", nb), &nb, |b, &nb| {
            b.iter(|| {
                let mut fresh = SeqKv::default();
                let hits = m.find_cached_prefix(&mut fresh, black_box(&tokens), None);
                debug_assert_eq!(hits.len(), nb);
                black_box((hits, fresh))
            });
            let mut fresh = SeqKv::default();
            assert_eq!(m.find_cached_prefix(&mut fresh, &tokens, None).len(), nb);
        });
    }
    g.finish();
}

const PROMPT_LEN: usize = 160;
const REBUILD_EVERY: usize = 512;

/// `size` requests with 160-token prompts, prefilled: every following step is pure decode of
/// `size` sequences for at least `REBUILD_EVERY` steps.
fn decode_batch(size: usize) -> Scheduler {
    let budget = 8192usize.max(2 * size);
    // Steps until the last prompt is prefilled (running sequences' decode tokens share the
    // budget): the first admitted decode that much longer than the last.
    let ramp = (size * PROMPT_LEN).div_ceil(budget - size) + 2;
    let max_tokens = REBUILD_EVERY + ramp + 2;
    let mut s = Scheduler::new(SchedulerConfig {
        num_blocks: 1 + size * (PROMPT_LEN + max_tokens).div_ceil(BS),
        block_size: BS,
        max_num_seqs: size,
        max_num_batched_tokens: budget,
        max_model_len: 4096,
        ..Default::default()
    })
    .expect("valid config");
    for r in 0..size {
        let base = (r * 4096) as u32;
        let mut q = NewRequest::new(r as u64, (base..base + PROMPT_LEN as u32).collect(), max_tokens);
        q.ignore_eos = true;
        s.add_request(q).expect("add_request");
    }
    loop {
        let out = s.schedule().expect("schedule");
        s.update(out.step_id, &vec![7; out.num_rows()]).expect("update");
        if out.num_prefill_tokens == 0 && s.num_waiting() == 0 {
            return s;
        }
    }
}

fn scheduler_step(c: &mut Criterion) {
    let mut g = c.benchmark_group("scheduler");
    for size in [64usize, 256, 1024, 4096] {
        g.throughput(Throughput::Elements(size as u64));
        g.bench_with_input(BenchmarkId::new("decode_step", size), &size, |b, &size| {
            let mut s = decode_batch(size);
            let mut done = 0;
            let sampled = vec![7i64; size];
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    if done == REBUILD_EVERY {
                        s = decode_batch(size);
                        done = 0;
                    }
                    let t = Instant::now();
                    let out = s.schedule().expect("schedule");
                    black_box(&out);
                    s.update(out.step_id, &sampled).expect("update");
                    drop(out);
                    total += t.elapsed();
                    done += 1;
                }
                total
            });
            assert_eq!(s.num_running_seqs(), size);
        });
    }
    g.finish();
}

criterion_group!(benches, kv_ops, prefix_lookup, scheduler_step);
criterion_main!(benches);
