//! Admission: validating a new request, planning one request's next chunk (prefix-cache hits,
//! copy-on-write and fresh blocks, all or nothing), and admitting waiting requests in order.
//!
//! Invariants: a request that could never fit is rejected when added; the samples of a
//! request step in lockstep (all get their logits rows this step, or none) and never hold a
//! full prompt block of their own (recomputed after a preemption, the later ones wait for the
//! first's); capacity is checked for the whole request before any block moves. Costs:
//! O(prompt blocks) for a prefix lookup, O(new blocks) per allocation; the waiting queue is
//! only read at its head.

use super::{NewRequest, Policy, Scheduler};
use crate::batch::{Batch, NO_ROW};
use crate::block_pool::BlockId;
use crate::error::{CoreError, CoreResult};
use crate::kv_cache_manager::{BlockIds, KvCacheManager, SeqKv};
use crate::request::{FinishReason, Request, RequestState, Sequence, StopParams};
use crate::sampling::{rng_key, SamplingSpec};

/// How much of a new running sequence's token list is mapped at admission (16,384 tokens): all
/// of a typical reservation, and a bounded cost when `max_tokens` is huge.
const PREFAULT_TOKEN_BYTES: usize = 64 << 10;

pub(super) enum Attempt {
    Scheduled { tokens: usize, full: bool },
    NoBudget,
    NoSpace,
}

impl Scheduler {
    /// Admits waiting requests in order while their next chunk fits in `budget`, in
    /// `max_num_seqs` and in the free blocks minus the watermark and headroom kept for the
    /// running ones to grow. The head of the queue blocks the rest (no starvation). A request
    /// gets its rows before its chunk is planned (the planner works on rows only), and gives
    /// them back if it is not admitted.
    pub(super) fn admit_waiting(&mut self, mut budget: usize) {
        while let Some(&(p, a, slot)) = self.waiting.first() {
            if budget == 0 || self.num_running_seqs + self.req(slot).seq_slots() > self.cfg.max_num_seqs {
                break;
            }
            let alone = self.running.is_empty();
            let watermark = if alone {
                0
            } else {
                self.watermark_blocks + (self.num_running_seqs as f64 * self.cfg.admission_headroom).ceil() as usize
            };
            if self.req(slot).state == RequestState::Swapped {
                let req = self.requests[slot as usize].as_mut().expect("live slot");
                // Room to grow by a block per sequence, unless nothing else could use it.
                let extra = if alone { 0 } else { watermark + req.seqs.len() };
                let mut tables: Vec<&mut SeqKv> = req.seqs.iter_mut().map(|s| &mut s.kv).collect();
                let Some(ids) = self.kv.swap_in(&mut tables, extra) else {
                    if alone {
                        self.end_request_reported(slot, FinishReason::Abort);
                        self.stats.capacity_aborts += 1;
                        continue;
                    }
                    break;
                };
                for (pos, blocks) in ids.iter().enumerate() {
                    self.give_row(slot, pos, blocks);
                }
                self.admit(slot, (p, a, slot));
                if let Attempt::Scheduled { tokens, full } = self.try_schedule(slot, budget, 0) {
                    self.record(slot, full);
                    budget -= tokens;
                }
                continue;
            }
            for pos in 0..self.req(slot).seqs.len() {
                self.give_row(slot, pos, &[]);
            }
            match self.try_schedule(slot, budget, watermark) {
                Attempt::Scheduled { tokens, full } => {
                    self.admit(slot, (p, a, slot));
                    self.record(slot, full);
                    budget -= tokens;
                }
                Attempt::NoSpace if alone => {
                    // Nothing else holds a block, yet its next chunk does not fit: it never
                    // will (beam forks grew it past the cache). End it rather than spin.
                    self.end_request_reported(slot, FinishReason::Abort);
                    self.stats.capacity_aborts += 1;
                }
                Attempt::NoBudget | Attempt::NoSpace => {
                    // Nothing was allocated: its rows (the last ones) go, and it waits.
                    for pos in (0..self.req(slot).seqs.len()).rev() {
                        self.take_row(slot, pos);
                    }
                    break;
                }
            }
        }
    }

    /// Blocks a request may need in the worst case: its prompt's full blocks once, which its
    /// samples share (after the prefill's fan-out, in a swap, and after a recompute, where the
    /// other samples wait for the first one's: `plan_start`), and for each sample the rest of
    /// its context but its last token, whose KV is never computed (no forward pass takes it in).
    pub(super) fn worst_case_blocks(&self, prompt_len: usize, max_tokens: usize, n: usize) -> usize {
        let context = prompt_len.saturating_add(max_tokens).min(self.cfg.max_model_len);
        let per_seq = context.saturating_sub(1).max(prompt_len).div_ceil(self.cfg.block_size);
        let shared = prompt_len / self.cfg.block_size;
        shared + n * (per_seq - shared)
    }

    /// The most new tokens `seqs` samples of a `prompt_len`-token prompt can ask for and pass
    /// the worst-case check (at most up to `max_model_len`); 0 when not even one fits. What a
    /// request that names no limit gets (vLLM's samples each only need to fit alone).
    pub fn max_fitting_tokens(&self, prompt_len: usize, seqs: usize) -> usize {
        let (usable, shared) = (self.kv.num_usable_blocks(), prompt_len / self.cfg.block_size);
        let blocks_per_seq = if usable < shared { 0 } else { shared + (usable - shared) / seqs.max(1) };
        let slots = blocks_per_seq.saturating_mul(self.cfg.block_size);
        // A prompt that fits gets one token more than its slots hold: the last is never cached.
        let context = if slots < prompt_len { 0 } else { slots.saturating_add(1).min(self.cfg.max_model_len) };
        context.saturating_sub(prompt_len)
    }

    /// Every check `add_request` makes before it changes anything.
    fn check_new_request(&self, r: &NewRequest) -> CoreResult<()> {
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
        r.sampling.validate()?;
        let usable = self.kv.num_usable_blocks();
        let seqs = r.n.max(r.reserve_seqs) as usize;
        let needed = self.worst_case_blocks(p, r.max_tokens, seqs);
        if needed > usable {
            return Err(CoreError::ExceedsCacheCapacity {
                request_id: r.request_id,
                blocks_needed: needed,
                blocks_available: usable,
                prompt_len: p,
                max_tokens: r.max_tokens,
                seqs,
                block_size: self.cfg.block_size,
                beam: r.reserve_seqs > r.n,
            });
        }
        Ok(())
    }

    /// Queues a request, or rejects it with a typed error naming the field (nothing changes).
    pub fn add_request(&mut self, r: NewRequest) -> CoreResult<()> {
        self.check_new_request(&r)?;
        let p = r.prompt_token_ids.len();
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
                min_tokens_bans: r.min_tokens_bans,
            },
            sampling: SamplingSpec {
                rng_key: rng_key(r.seed, r.request_id, self.cfg.sampling_seed),
                seeded: r.seed.is_some(),
                has_bad_words: !r.bad_words.is_empty(),
                ..r.sampling
            },
            cache_salt: r.cache_salt.map(String::into_boxed_str),
            bad_words: r.bad_words.into_boxed_slice(),
            skip_cache_hits: r.skip_cache_hits,
            seqs: vec![Sequence {
                seq_id,
                sample_index: 0,
                tokens: r.prompt_token_ids,
                num_computed: 0,
                kv: SeqKv::default(),
                row: NO_ROW,
            }],
            state: RequestState::Waiting,
            fanned_out: false,
            reserved_seqs: r.reserve_seqs,
            next_sample_index: 1,
            num_cached_tokens: None,
            queued_ts: crate::clock::now(),
            scheduled_ts: 0.0,
            first_token_ts: 0.0,
        };
        let key = req.order_key();
        let slot = match self.free_slots.pop() {
            Some(s) => {
                self.requests[s as usize] = Some(req);
                self.last_token_ts[s as usize] = 0.0;
                s
            }
            None => {
                self.requests.push(Some(req));
                self.ending.push(false);
                self.mark.push(false);
                self.last_token_ts.push(0.0);
                (self.requests.len() - 1) as u32
            }
        };
        self.by_id.insert(r.request_id, slot);
        self.seq_owner.insert(seq_id, slot);
        self.waiting.insert((key.0, key.1, slot));
        self.num_waiting_seqs += self.req(slot).seq_slots();
        self.stats.requests_added += 1;
        Ok(())
    }

    /// Plans and allocates the next chunk of every sequence of one request. All sequences
    /// finish this step together (they then get logits rows) or each stops one token short,
    /// so the samples of a request always step in lockstep. Samples recomputed after a
    /// preemption share their prompt's full blocks again (`plan_start`).
    pub(super) fn try_schedule(&mut self, slot: u32, budget: usize, watermark: usize) -> Attempt {
        let n = self.req(slot).seqs.len();
        if self.hits.len() < n {
            self.hits.resize_with(n, Vec::new);
            self.shares.resize(n, false);
        }
        self.plan.clear();
        let (mut total, mut waits) = (0, false);
        for i in 0..n {
            let (start, remaining) = self.plan_start(slot, i);
            waits |= remaining == 0 && self.shares[i];
            total += remaining;
            self.plan.push((start, remaining));
        }
        let full = total <= budget && !waits;
        let sum = Self::split_budget(&mut self.plan, full, budget);
        if sum == 0 {
            return Attempt::NoBudget;
        }
        let req = self.requests[slot as usize].as_mut().expect("live slot");
        let (kv, batch) = (&mut self.kv, &mut self.batch);
        let needed = Self::plan_blocks_needed(kv, batch, &req.seqs, &self.plan, &self.hits);
        if kv.num_free_blocks() < needed + watermark {
            return Attempt::NoSpace;
        }
        // Take every sibling's cache hits (and shared blocks) before any fresh block is popped:
        // a hit may sit in the free list, and popping it for a sibling would evict it.
        for (i, s) in req.seqs.iter_mut().enumerate() {
            if self.shares[i] {
                kv.share_blocks(&s.kv, &mut batch.ids_mut(s.row as usize), &self.hits[i]);
            } else if !self.hits[i].is_empty() {
                let ok = kv.allocate_slots(&mut s.kv, &mut batch.ids_mut(s.row as usize), self.plan[i].0, 0, &self.hits[i], 0);
                debug_assert!(ok, "capacity was checked for the whole request");
            }
        }
        let bs = self.cfg.block_size;
        for (i, s) in req.seqs.iter_mut().enumerate() {
            let (start, chunk) = self.plan[i];
            let row = s.row as usize;
            let ok = kv.allocate_slots(&mut s.kv, &mut batch.ids_mut(row), start, chunk, &[], 0);
            debug_assert!(ok, "capacity was checked for the whole request");
            if !self.hits[i].is_empty() && !self.shares[i] {
                let cached = (self.hits[i].len() * bs).min(req.prompt_len) as u64;
                self.stats.cached_prompt_tokens += cached;
                if i == 0 && req.num_cached_tokens.is_none() {
                    self.stats.first_admission_cached_tokens += cached;
                }
            }
            if i == 0 && req.num_cached_tokens.is_none() {
                req.num_cached_tokens = Some(self.hits[0].len() * bs);
                self.stats.prompt_tokens += req.prompt_len as u64;
                if kv.prefix_caching() && !req.skip_cache_hits {
                    self.stats.prefix_cache_queried_tokens += req.prompt_len as u64;
                }
            }
            batch.rows[row].computed = (start + chunk) as u32;
        }
        Attempt::Scheduled { tokens: sum, full }
    }

    /// Where sequence `i` of request `slot` starts this step, and the tokens it has left from
    /// there; fills `hits[i]` and `shares[i]`. A sequence with no block looks its tokens up in
    /// the prefix cache. A later sample (`i > 0`, after a recompute or with a swapped-in first
    /// sample) never holds a full prompt block of its own, so the request never needs more than
    /// its worst case (`worst_case_blocks`): it takes cache hits only when they are the first
    /// sample's prompt blocks (the first sample took the same hits in this pass, or holds them);
    /// else it shares the first sample's blocks once that one has computed them (`shares[i]`),
    /// and waits until then (0 tokens left, `shares[i]` set).
    fn plan_start(&mut self, slot: u32, i: usize) -> (usize, usize) {
        let bs = self.cfg.block_size;
        let req = self.requests[slot as usize].as_mut().expect("live slot");
        let prompt_blocks = req.prompt_len / bs;
        Self::flush_row(&mut self.batch, &mut req.seqs[i]);
        let (hits, s) = (&mut self.hits[i], &mut req.seqs[i]);
        hits.clear();
        self.shares[i] = false;
        let row = s.row as usize;
        let c = self.batch.rows[row].computed as usize;
        if c == 0 && self.batch.rows[row].num_blocks == 0 {
            *hits = self.kv.find_cached_prefix(&mut s.kv, &s.tokens, req.cache_salt.as_deref());
            if req.skip_cache_hits {
                hits.clear(); // looked up only for its block hashes
            }
            if i > 0 && prompt_blocks > 0 {
                let first = req.seqs[0].row as usize;
                let (lead, ids) = (&self.batch.rows[first], self.batch.ids(first));
                let fresh_lead = lead.computed == 0 && lead.num_blocks == 0; // it took the same hits
                let leads_hits = hits.len() >= prompt_blocks
                    && (fresh_lead || (0..prompt_blocks).all(|b| ids.len() > b && hits[b] == ids.at(b)));
                if !leads_hits {
                    hits.clear();
                    self.shares[i] = true;
                    if (lead.computed as usize) < prompt_blocks * bs {
                        return (0, 0);
                    }
                    hits.extend((0..prompt_blocks).map(|b| ids.at(b)));
                }
            }
        }
        let start = c.max(hits.len() * bs);
        (start, req.seqs[i].tokens.len() - start)
    }

    /// Each sequence's chunk out of `budget`, from what it has left (`plan[i].1`, replaced by
    /// its chunk; it starts at `plan[i].0`): all of it when the whole request fits (`full`),
    /// else each stops one token short (no sample gets its logits row before its siblings).
    /// Returns the tokens planned.
    fn split_budget(plan: &mut [(usize, usize)], full: bool, budget: usize) -> usize {
        let mut left = budget;
        let mut sum = 0;
        for p in plan.iter_mut() {
            let remaining = p.1;
            let chunk = if full { remaining } else { remaining.saturating_sub(1).min(left) };
            left -= chunk;
            sum += chunk;
            p.1 = chunk;
        }
        sum
    }

    /// Free blocks that allocating the plan of one request's `seqs` (chunks in `plan`, cache
    /// hits in `hits`) consumes; siblings are counted together, as they share blocks.
    fn plan_blocks_needed(
        kv: &KvCacheManager,
        batch: &Batch,
        seqs: &[Sequence],
        plan: &[(usize, usize)],
        hits: &[Vec<BlockId>],
    ) -> usize {
        if seqs.len() == 1 {
            kv.blocks_needed(&batch.ids(seqs[0].row as usize), plan[0].0, plan[0].1, &hits[0])
        } else {
            let items: Vec<_> = seqs.iter().enumerate()
                .map(|(i, s)| (batch.ids(s.row as usize), plan[i].0, plan[i].1, &hits[i][..]))
                .collect();
            kv.blocks_needed_together(&items)
        }
    }

    /// Writes the plan just allocated for `slot` into its sequences' rows, and registers the
    /// blocks it completes (before anything else is planned: the next admission may hit them).
    pub(super) fn record(&mut self, slot: u32, full: bool) {
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
        self.register_request(slot);
    }

    /// A request whose sequences have rows starts running: it joins the running list in order.
    /// Its token and hash lists are reserved for their longest possible length (prompt +
    /// max_tokens, at most max_model_len), as other engines' input batches hold max_model_len
    /// tokens per row. Grown by doubling instead, the lists of a batch that started together
    /// reallocate in the same few steps, and those steps take several times the median. The
    /// token list's first `PREFAULT_TOKEN_BYTES` are mapped now (one write per 4 KiB): left to
    /// the decode steps, fresh memory cost about one page fault per step at 1,024 sequences.
    pub(super) fn admit(&mut self, slot: u32, key: (i64, u64, u32)) {
        self.waiting.remove(&key);
        let req = self.requests[slot as usize].as_mut().expect("live slot");
        self.num_waiting_seqs -= req.seq_slots();
        req.state = RequestState::Running;
        if req.scheduled_ts == 0.0 {
            req.scheduled_ts = self.ts;
        }
        self.num_running_seqs += req.seq_slots();
        let longest = (req.prompt_len + req.stop.max_tokens).min(self.cfg.max_model_len);
        for s in req.seqs.iter_mut() {
            debug_assert_ne!(s.row, NO_ROW, "a request gets its rows before it is admitted");
            s.tokens.reserve_exact(longest.saturating_sub(s.tokens.len()));
            crate::prefetch::prefault_spare(&mut s.tokens, PREFAULT_TOKEN_BYTES);
            s.kv.reserve(longest.div_ceil(self.cfg.block_size));
        }
        let pos = self.running_index(slot);
        self.running.insert(pos, slot);
    }

}

#[cfg(test)]
mod tests {
    use super::super::test_util::*;
    use super::super::*;
    use crate::request::FinishReason;

    #[test]
    fn prefix_cache_hits_across_requests_and_only_within_a_salt() {
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
        s.add_request(r.clone()).unwrap();
        let (o, _) = step(&mut s, 1);
        assert_eq!(o.req_ids, vec![2, 3]);
        assert_eq!(o.num_tokens(), 1 + 13);
        assert_eq!(s.num_cached_tokens(3).unwrap(), 0);
        drain(&mut s, 1);
        // The same salt does share.
        r.request_id = 4;
        s.add_request(r).unwrap();
        step(&mut s, 1);
        assert_eq!(s.num_cached_tokens(4).unwrap(), 12);
        let st = s.stats();
        assert_eq!((st.cached_prompt_tokens, st.first_admission_cached_tokens), (24, 24));
        assert_eq!(st.prompt_tokens_computed, 13 + 1 + 13 + 1);
    }

    #[test]
    fn a_request_that_skips_cache_hits_computes_its_whole_prompt_and_still_registers_it() {
        let mut s = Scheduler::new(cfg(32, 4, 64)).unwrap();
        let prompt: Vec<u32> = (0..13).collect();
        s.add_request(NewRequest::new(1, prompt.clone(), 2)).unwrap();
        drain(&mut s, 1);
        s.add_request(NewRequest { skip_cache_hits: true, ..NewRequest::new(2, prompt.clone(), 2) }).unwrap();
        let (o, _) = step(&mut s, 1);
        assert_eq!(o.positions, (0..13).collect::<Vec<i64>>(), "every prompt position is computed");
        assert_eq!(s.num_cached_tokens(2).unwrap(), 0);
        drain(&mut s, 1);
        s.add_request(NewRequest::new(3, prompt, 2)).unwrap();
        step(&mut s, 1);
        assert_eq!(s.num_cached_tokens(3).unwrap(), 12, "the others still hit");
    }

    #[test]
    fn prefix_caching_disabled_shares_nothing() {
        let c = SchedulerConfig { enable_prefix_caching: false, ..cfg(32, 4, 64) };
        let mut s = with_requests(c, [NewRequest::new(1, (0..13).collect(), 2)]);
        drain(&mut s, 1);
        s.add_request(NewRequest::new(2, (0..13).collect(), 2)).unwrap();
        let (o, _) = step(&mut s, 1);
        assert_eq!(o.num_tokens(), 13);
        assert_eq!((s.stats().cached_prompt_tokens, s.num_cached_tokens(2).unwrap()), (0, 0));
    }

    #[test]
    fn bad_input_is_a_typed_error_naming_the_field() {
        let mut s = Scheduler::new(cfg(8, 4, 16)).unwrap();
        s.add_request(req(1, 3, 2)).unwrap();
        assert_eq!(s.add_request(req(1, 3, 2)), Err(CoreError::DuplicateRequest { request_id: 1 }));
        let field = |r: CoreResult<()>| match r {
            Err(CoreError::InvalidArgument { field, .. }) => field,
            other => panic!("{other:?}"),
        };
        assert_eq!(field(s.add_request(NewRequest::new(2, vec![], 2))), "prompt_token_ids");
        assert_eq!(field(s.add_request(req(3, 3, 0))), "max_tokens");
        assert_eq!(field(s.add_request(NewRequest { n: 0, ..req(3, 3, 2) })), "n");
        assert_eq!(field(s.add_request(NewRequest { n: 9, ..req(3, 3, 2) })), "n");
        assert_eq!(field(s.add_request(NewRequest { reserve_seqs: 9, ..req(3, 3, 2) })), "reserve_seqs");
        assert_eq!(field(s.add_request(NewRequest { min_tokens: 3, ..req(3, 3, 2) })), "min_tokens");
        let e = s.add_request(req(4, 2000, 2)).unwrap_err();
        assert_eq!(e, CoreError::PromptTooLong { len: 2000, max_model_len: 1024 });
        let e = s.add_request(req(5, 20, 20)).unwrap_err();
        assert!(matches!(e, CoreError::ExceedsCacheCapacity { blocks_needed: 10, blocks_available: 7, .. }), "{e}");
        // The message says what overflows, with the values: prompt + max_tokens times the
        // sequences, or the prompt alone.
        assert_eq!(e.field(), Some("max_tokens"));
        let msg = e.to_string();
        let want = "needs up to 10 KV blocks of 4 tokens (1 sequence(s) of its 20-token prompt + max_tokens=20)";
        assert!(msg.contains(want), "{msg}");
        let e = s.add_request(NewRequest { n: 3, ..req(5, 8, 8) }).unwrap_err().to_string();
        assert!(e.contains("8 KV blocks of 4 tokens (3 sequence(s) of its 8-token prompt + max_tokens=8)"), "{e}");
        let e = s.add_request(req(5, 40, 1)).unwrap_err();
        assert_eq!(e.field(), Some("prompt_token_ids"), "the prompt alone overflows");
        let e = e.to_string();
        let want = "its prompt of 40 tokens alone needs 10 KV blocks of 4 tokens, but the cache holds 7";
        assert!(e.contains(want), "{e}");
        assert_eq!((s.num_unfinished(), s.stats().requests_added), (1, 1), "a rejected request leaves no trace");
        s.check_invariants().unwrap();
    }

    #[test]
    fn samples_sharing_a_partial_block_fit_a_cache_with_just_the_one_copy_they_need() {
        // 4 usable blocks of 4 (the worst case: 2 samples of 2 blocks): a prompt of 6 (2
        // blocks) with two samples, which share it. Both samples write position 6 in the shared
        // block: one copy, the last writer keeps it, so one of the two free blocks is used and
        // nobody is preempted or aborted.
        let c = SchedulerConfig { preemption_mode: PreemptionMode::Swap, ..cfg(5, 4, 16) };
        let mut s = with_requests(c, [NewRequest { n: 2, ..req(1, 6, 2) }]);
        step(&mut s, 5);
        assert_eq!((s.request_seq_ids(1).unwrap().len(), s.num_free_blocks()), (2, 2));
        let (o, done) = step(&mut s, 5);
        assert_eq!((o.num_tokens(), o.copy_ops.len() / 2, o.preempted_req_ids.len()), (2, 1, 0));
        assert_eq!(done.iter().map(|d| d.reason).collect::<Vec<_>>(), vec![FinishReason::Length; 2]);
        assert_eq!((s.stats().preemptions, s.stats().capacity_aborts, s.num_free_blocks()), (0, 0, 4));
    }

    #[test]
    fn each_admission_is_charged_to_the_step_budget_before_the_next() {
        // Budget 10: request 1's prompt of 6 is admitted whole; request 2 gets the 4 left.
        let mut s = with_requests(cfg(32, 4, 10), [req(1, 6, 4), req(2, 6, 4)]);
        let (o, _) = step(&mut s, 5);
        assert_eq!((o.req_ids.clone(), o.query_start_loc.clone()), (vec![1, 2], vec![0, 6, 10]));
        assert_eq!(o.logits_indices, vec![5], "request 2's chunk is partial: no logits row");
    }

    #[test]
    fn a_swapped_request_resumed_is_charged_to_the_step_budget() {
        // Budget 4, 6 usable blocks of 2: request 2 is swapped out at the fourth step and comes
        // back when request 1 ends, with one decode token; request 3's prompt, admitted behind
        // it in the same step, gets the 3 tokens left.
        let c = SchedulerConfig { preemption_mode: PreemptionMode::Swap, num_cpu_blocks: 8, ..cfg(7, 2, 4) };
        let mut s = with_requests(c, [req(1, 4, 8), req(2, 4, 8)]);
        for _ in 0..3 {
            step(&mut s, 1);
        }
        s.add_request(req(3, 9, 2)).unwrap();
        let resumed = (0..20).map(|_| step(&mut s, 1).0).find(|o| !o.swap_in.is_empty()).expect("request 2 comes back");
        assert_eq!((resumed.req_ids, resumed.query_start_loc), (vec![2, 3], vec![0, 1, 4]));
    }

    #[test]
    fn admission_keeps_the_watermark_and_the_headroom_of_running_sequences_free() {
        // 10 usable blocks of 4, a watermark of 10 % (1 block) and 1 block of headroom per
        // running sequence: with request 1 running (2 blocks, its next token inside block 2),
        // a prompt is admitted only if 1 + 1 of the 8 free blocks stay free.
        let c = SchedulerConfig { watermark: 0.1, admission_headroom: 1.0, ..cfg(11, 4, 64) };
        for (prompt, admitted) in [(24, true), (25, false)] {
            let mut s = with_requests(c.clone(), [req(1, 7, 8)]);
            step(&mut s, 5); // alone: no watermark
            s.add_request(req(2, prompt, 1)).unwrap();
            let (o, _) = step(&mut s, 5);
            assert_eq!(o.req_ids.contains(&2), admitted, "a prompt of {prompt} tokens");
        }
    }

    #[test]
    fn a_swapped_request_comes_back_only_with_a_block_to_grow_per_sequence() {
        // 3 usable blocks of 4: request 2 is swapped out (1 block) when both decodes need a new
        // block. The next step leaves 1 block free, which request 2's swap-in would take and
        // leave it none to grow into: it stays out until request 1 ends.
        let c = SchedulerConfig { preemption_mode: PreemptionMode::Swap, num_cpu_blocks: 4, ..cfg(4, 4, 16) };
        let mut s = with_requests(c, [req(1, 4, 8), req(2, 4, 8)]);
        step(&mut s, 5);
        let (o, _) = step(&mut s, 5);
        assert_eq!((o.preempted_req_ids.clone(), s.num_free_blocks()), (vec![2], 1));
        let (o, _) = step(&mut s, 5);
        assert_eq!((o.req_ids, o.swap_in), (vec![1], vec![]));
        drain(&mut s, 5);
        assert_eq!((s.kv_stats().blocks_swapped_in, s.num_free_blocks()), (1, 3));
    }

    #[test]
    fn every_limit_of_a_new_request_is_inclusive() {
        // 7 usable blocks of 4, max_num_seqs 4, max_model_len 16.
        let c = SchedulerConfig { max_num_seqs: 4, max_model_len: 16, ..cfg(8, 4, 16) };
        let mut s = Scheduler::new(c).unwrap();
        s.add_request(req(1, 16, 1)).unwrap(); // a prompt of max_model_len
        s.add_request(NewRequest { n: 4, ..req(2, 2, 2) }).unwrap(); // n = max_num_seqs: 4 blocks
        s.add_request(NewRequest { reserve_seqs: 4, ..req(3, 2, 1) }).unwrap();
        s.add_request(NewRequest { min_tokens: 3, ..req(4, 2, 3) }).unwrap();
        s.add_request(req(5, 12, 8)).unwrap(); // 12 + 8 > max_model_len: 4 blocks
        // Prompt tokens count at each request's first admission.
        assert_eq!((s.stats().requests_added, s.stats().prompt_tokens), (5, 0));
        drain(&mut s, 5);
        assert_eq!(s.stats().prompt_tokens, 16 + 2 + 2 + 2 + 12);
        // A worst case of exactly the 7 usable blocks: 29 tokens, the last never cached.
        let mut s = Scheduler::new(cfg(8, 4, 16)).unwrap();
        s.add_request(req(1, 20, 9)).unwrap();
        s.add_request(req(2, 28, 1)).unwrap(); // a prompt that fills the cache, and one token
        assert!(matches!(s.add_request(req(3, 20, 10)), Err(CoreError::ExceedsCacheCapacity { blocks_needed: 8, .. })));
        assert_eq!((s.max_fitting_tokens(28, 1), s.max_fitting_tokens(29, 1), s.max_fitting_tokens(20, 1)), (1, 0, 9));
        let done = drain(&mut s, 5); // they run, one at a time, to their ends: no capacity abort
        assert!(done.len() == 2 && done.iter().all(|f| f.reason != crate::request::FinishReason::Abort));
    }

    #[test]
    fn the_worst_case_counts_the_prompts_full_blocks_once() {
        // Blocks of 4, a prompt of 10 (2 full blocks, shared), 6 new tokens: 15 tokens cached,
        // 4 blocks per sequence, 2 of them its own.
        let s = Scheduler::new(cfg(64, 4, 16)).unwrap();
        assert_eq!((s.worst_case_blocks(10, 6, 1), s.worst_case_blocks(10, 6, 3)), (4, 2 + 3 * 2));
        assert_eq!(s.worst_case_blocks(12, 1, 3), 3, "a full prompt and its one token: all shared");
        assert_eq!(s.worst_case_blocks(10, 2000, 1), 1024 / 4, "capped at max_model_len");
    }

    #[test]
    fn max_fitting_tokens_is_the_largest_limit_the_worst_case_check_passes() {
        for (blocks, bs) in [(8, 4), (64, 4), (23, 16), (1024, 16), (5, 2)] {
            let s = Scheduler::new(cfg(blocks, bs, 16)).unwrap();
            let usable = blocks - 1;
            for n in 1..=5 {
                for p in [1, 3, 10, 17, 40] {
                    let m = s.max_fitting_tokens(p, n);
                    if m == 0 {
                        assert!(s.worst_case_blocks(p, 1, n) > usable || p >= s.cfg.max_model_len, "{blocks} {bs} {n} {p}");
                        continue;
                    }
                    assert!(s.worst_case_blocks(p, m, n) <= usable, "{blocks} {bs} {n} {p} {m}");
                    if p + m < s.cfg.max_model_len {
                        assert!(s.worst_case_blocks(p, m + 1, n) > usable, "{blocks} {bs} {n} {p} {m}: not the largest");
                    } else {
                        assert_eq!(p + m, s.cfg.max_model_len);
                    }
                }
            }
        }
    }

    #[test]
    fn a_waiting_request_whose_sequences_no_longer_fit_alone_is_aborted_not_spun_on() {
        // 4 usable blocks of 2, no prefix cache. The request grows to 6 tokens (3 blocks),
        // forks, and the step whose copy-on-write copy would give the two their own last block
        // is cancelled: it waits to recompute two sequences of 6 tokens. The first recomputes
        // its 3 blocks alone; the second, sharing the prompt's full block, needs 2 more, which
        // never fit, even alone.
        let c = SchedulerConfig { enable_prefix_caching: false, ..cfg(5, 2, 16) };
        let mut s = with_requests(c, [req(1, 3, 5)]);
        for _ in 0..3 {
            step(&mut s, 1);
        }
        s.fork_sequence(only_seq(&s, 1), None).unwrap();
        let o = s.schedule().unwrap();
        assert_eq!(o.copy_ops.len(), 2);
        s.cancel_step(o.step_id).unwrap();
        assert_eq!((s.num_running(), s.num_waiting()), (0, 1));
        let (o, done) = step(&mut s, 1);
        assert_eq!((o.num_tokens(), done.len(), s.num_free_blocks()), (5, 0, 1), "the first sample alone");
        let (_, done) = step(&mut s, 1);
        assert_eq!(done.iter().map(|d| (d.reason, d.request_finished)).collect::<Vec<_>>(), vec![(FinishReason::Abort, false), (FinishReason::Abort, true)]);
        assert_eq!((s.stats().capacity_aborts, s.has_unfinished(), s.num_free_blocks()), (1, false, 4));
    }

    #[test]
    fn decode_tokens_count_single_token_decodes_planned_as_chunks_and_not_recomputes() {
        // Two samples writing the block they share are planned by the chunk planner: 2 decodes.
        let mut s = with_requests(cfg(16, 4, 16), [NewRequest { n: 2, ..req(1, 6, 3) }]);
        let (o, _) = step(&mut s, 9);
        assert_eq!((o.num_prefill_tokens, o.num_decode_tokens, s.stats().decode_tokens), (6, 0, 0));
        let (o, _) = step(&mut s, 9);
        assert_eq!(o.copy_ops.len(), 2, "planned by the chunk planner (copy-on-write)");
        assert_eq!((o.num_prefill_tokens, o.num_decode_tokens, s.stats().decode_tokens), (0, 2, 2));
        // A recompute that ends at the last token computes the next token, but is no decode row.
        let mut s = with_requests(cfg(7, 2, 16), [req(1, 4, 8), req(2, 4, 8)]);
        let back = (0..20).map(|_| step(&mut s, 1).0).find(|o| o.req_ids == [2] && o.num_tokens() > 1).expect("request 2 recomputes");
        assert_eq!((back.num_prefill_tokens, back.num_decode_tokens, back.num_tokens()), (7, 0, 7));
    }

    #[test]
    fn first_admission_counters_ignore_the_cache_hits_of_a_recompute() {
        // A prompt of 13 with two samples, no hit at first. The step where the samples copy
        // their shared last block is cancelled, so both recompute, each hitting the 3 blocks
        // the prompt registered.
        let mut s = with_requests(cfg(32, 4, 64), [NewRequest { n: 2, ..req(1, 13, 4) }]);
        step(&mut s, 5);
        let o = s.schedule().unwrap();
        assert_eq!(o.copy_ops.len(), 2);
        s.cancel_step(o.step_id).unwrap();
        let (o, _) = step(&mut s, 5);
        assert_eq!(o.num_tokens(), 2 * 2, "each sample recomputes 2 of its 14 tokens");
        let st = s.stats();
        assert_eq!((st.cached_prompt_tokens, st.first_admission_cached_tokens, s.num_cached_tokens(1).unwrap()), (24, 0, 0));
    }

    #[test]
    fn samples_recomputed_after_a_preemption_share_their_prompts_full_blocks_again() {
        // Blocks of 4, no prefix cache: a prompt of 8 (2 full blocks) with 3 samples of 2
        // tokens each, preempted for recompute. The first sample recomputes alone; then the
        // others take its 2 prompt blocks and compute only their own tokens.
        let c = SchedulerConfig { enable_prefix_caching: false, ..cfg(32, 4, 64) };
        let mut s = with_requests(c, [NewRequest { n: 3, ..req(1, 8, 4) }]);
        step(&mut s, 5);
        step(&mut s, 6);
        preempt_between_steps(&mut s, 1);
        assert_eq!(s.num_free_blocks(), 31);
        let (o, _) = step(&mut s, 7);
        assert_eq!((o.num_tokens(), o.num_rows(), s.num_free_blocks()), (9, 0, 28), "the first sample alone, 1 short");
        let (o, _) = step(&mut s, 7);
        assert_eq!((o.num_tokens(), o.num_rows(), s.num_free_blocks()), (1 + 2 + 2, 3, 26));
        let tables = block_tables_of(&s, 1);
        assert!(tables.iter().all(|t| t.len() == 3 && t[..2] == tables[0][..2]), "{tables:?}");
        let done = drain(&mut s, 7);
        assert!(done.len() == 3 && done.iter().all(|d| d.reason == FinishReason::Length));
        assert_eq!((s.stats().cached_prompt_tokens, s.num_free_blocks()), (0, 31), "sharing is no cache hit");
    }

    #[test]
    fn a_request_that_fills_the_cache_with_shared_prompt_blocks_finishes_after_preemptions() {
        // The cache holds exactly the request's prompt full blocks once and the rest of each
        // sample's context. A request that arrived first grows to take the whole cache, so ours
        // is preempted (recompute, or swap falling back to it with one CPU block) and comes
        // back alone: its samples must never hold a prompt block of their own.
        let (mut recomputed, mut runs) = (0, 0);
        for caching in [false, true] {
            for mode in [PreemptionMode::Recompute, PreemptionMode::Swap] {
                for bs in [1usize, 2, 4] {
                    for (n, p, m) in [(2u32, 3usize, 5usize), (3, 4, 5), (3, 9, 6), (2, 8, 1), (4, 12, 9)] {
                        let shared = p / bs;
                        let usable = shared + n as usize * ((p + m - 1).div_ceil(bs) - shared);
                        let c = SchedulerConfig {
                            enable_prefix_caching: caching,
                            preemption_mode: mode,
                            num_cpu_blocks: usize::from(mode == PreemptionMode::Swap),
                            ..cfg(usable + 1, bs, 64)
                        };
                        let mut s = with_requests(c, [req(1, 1, usable * bs), NewRequest { n, ..req(2, p, m) }]);
                        let done = drain(&mut s, 5);
                        let what = format!("caching={caching} {mode:?} bs={bs} n={n} p={p} m={m}");
                        assert_eq!(done.len(), 1 + n as usize, "{what}");
                        assert!(done.iter().all(|d| d.reason == FinishReason::Length), "{what}: {done:?}");
                        assert_eq!((s.stats().capacity_aborts, s.num_free_blocks()), (0, usable), "{what}");
                        recomputed += s.stats().recompute_preemptions;
                        runs += 1;
                    }
                }
            }
        }
        assert!(recomputed >= runs / 2, "{recomputed} recomputes in {runs} runs");
    }

    #[test]
    fn a_waiting_sample_shares_the_swapped_in_first_samples_blocks_not_their_old_cached_copies() {
        // Blocks of 1, a prompt of 5 with 2 samples of 5 tokens: worst case 5 + 2 * 4 = 13 of 15
        // usable. After a recompute (the cache emptied meanwhile), sample 0 recomputes while
        // sample 1 waits; then a swap-out frees sample 0's blocks into the cache, and the swap-in
        // gives it fresh ones: sample 1 must share those, not revive the old copies (review25).
        let c = SchedulerConfig { preemption_mode: PreemptionMode::Swap, num_cpu_blocks: 16, ..cfg(16, 1, 64) };
        let mut s = with_requests(c, [NewRequest { n: 2, ..req(1, 5, 5) }]);
        assert_eq!(s.worst_case_blocks(5, 5, 2), 13);
        step(&mut s, 5);
        step(&mut s, 6);
        preempt_as_between_steps(&mut s, 1, PreemptionMode::Recompute);
        s.kv.reset_prefix_cache();
        let (o, _) = step(&mut s, 7);
        assert_eq!(o.num_rows(), 0, "sample 1 waits");
        preempt_as_between_steps(&mut s, 1, PreemptionMode::Swap);
        let (o, _) = step(&mut s, 7);
        assert_eq!(o.num_rows(), 2);
        let tables = block_tables_of(&s, 1);
        assert_eq!(tables[0][..5], tables[1][..5], "{tables:?}");
        let done = drain(&mut s, 7);
        assert!(done.len() == 2 && done.iter().all(|d| d.reason == FinishReason::Length), "{done:?}");
        assert_eq!((s.stats().capacity_aborts, s.num_free_blocks()), (0, 15));
    }
}
