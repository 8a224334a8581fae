//! Per-sequence block tables over the physical pools: allocation, copy-on-write, prefix
//! caching, swapping to the CPU pool (`swap`).
//!
//! A sequence's KV state has two parts. Its GPU block ids exist only while it runs, and live
//! in one place: its row of the batch matrix that the runner reads (any `BlockIdsMut`; tests
//! use a `Vec`). Everything else (chain hashes, registration progress, CPU blocks while
//! swapped out) is a `SeqKv`, opaque outside this module. A waiting sequence holds no GPU
//! block (preemption frees or swaps them out); `fork` and `swap_in` hand back the ids of a
//! sequence that is about to get its row.
//!
//! Invariants (checked by `check`):
//! - Every reference count equals the number of block tables that hold the block. Only this
//!   module changes reference counts or writes block ids into a table; the scheduler only
//!   reads tables and moves a table's ids with its row.
//! - A block about to be written (positions `num_computed..num_computed+num_new`) has exactly
//!   one reference: a shared block is copied first and a `(src, dst)` copy op is queued.
//! - Only full blocks whose KV is computed are registered in the prefix cache: by an earlier
//!   step, or by the step being planned, whose forward pass writes every K/V of the step
//!   before any attention reads it (the scheduler registers at planning time and undoes the
//!   registrations of a step that is cancelled, `Registration` and `unregister`). A cached
//!   block that is reused for other tokens is evicted from the cache first.
//! - A block being written is held by its writer alone, except a full block the writer
//!   registered this step: sequences that took it as a cache hit only read it.
//! - Capacity checks (`blocks_needed`) never under-count, so an allocation that passed its
//!   check cannot fail halfway.
//!
//! Costs: allocation is O(new blocks); a decode step that stays inside its last block costs
//! at most one ref-count read. Prefix lookups cost one hash per full block of the prompt.

use crate::block_pool::{BlockId, BlockMath, BlockPool};
use crate::error::{CoreError, CoreResult};
use crate::prefix_cache::{hash_block, BlockHash, ParentLink, PrefixCache};

mod swap;

/// Where a sequence's GPU block ids live (its batch row, or a `Vec`): read access.
pub trait BlockIds {
    fn len(&self) -> usize;
    fn at(&self, i: usize) -> BlockId;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    fn to_vec(&self) -> Vec<BlockId> {
        (0..self.len()).map(|i| self.at(i)).collect()
    }
}

/// Write access to a sequence's block ids; only this module writes through it.
pub trait BlockIdsMut: BlockIds {
    fn set(&mut self, i: usize, b: BlockId);
    fn push(&mut self, b: BlockId);
    /// Appends a block just taken from the free list (ref count 1, nobody else holds it).
    fn push_fresh(&mut self, b: BlockId) {
        self.push(b)
    }
    /// Removes the last block id.
    fn pop(&mut self) -> Option<BlockId>;
}

impl BlockIds for Vec<BlockId> {
    fn len(&self) -> usize {
        self.as_slice().len()
    }
    fn at(&self, i: usize) -> BlockId {
        self[i]
    }
}

impl BlockIdsMut for Vec<BlockId> {
    fn set(&mut self, i: usize, b: BlockId) {
        self[i] = b;
    }
    fn push(&mut self, b: BlockId) {
        Vec::push(self, b);
    }
    fn pop(&mut self) -> Option<BlockId> {
        Vec::pop(self)
    }
}

/// A sequence's KV bookkeeping besides its GPU block ids. Fields are private to this module.
#[derive(Debug, Clone, Default)]
pub struct SeqKv {
    /// Chain hashes of the sequence's leading full blocks known so far (valid while the
    /// tokens only grow, so they survive preemption).
    hashes: Vec<BlockHash>,
    /// Leading blocks already registered in (or found in) the prefix cache.
    num_registered: usize,
    /// Cache link of the last registered block: the parent of the next one.
    last_link: Option<ParentLink>,
    /// Blocks in the CPU pool while the sequence is swapped out.
    cpu_blocks: Vec<BlockId>,
}

impl SeqKv {
    /// Room for the hashes of `blocks` blocks without reallocating.
    pub fn reserve(&mut self, blocks: usize) {
        self.hashes.reserve_exact(blocks.saturating_sub(self.hashes.len()));
    }

    /// Starts fetching the end of the hash list (what registering a block touches).
    #[inline]
    pub fn prefetch_tail(&self) {
        crate::prefetch::read(self.hashes.as_ptr().wrapping_add(self.hashes.len()) as *const u8);
    }

    pub fn is_swapped(&self) -> bool {
        !self.cpu_blocks.is_empty()
    }
    pub fn cpu_blocks(&self) -> &[BlockId] {
        &self.cpu_blocks
    }

    /// Its registration progress, to put back with `restore_registration` if the step that
    /// registers further is cancelled.
    pub fn registration(&self) -> Registration {
        Registration { num_registered: self.num_registered, last_link: self.last_link }
    }

    pub fn restore_registration(&mut self, r: Registration) {
        (self.num_registered, self.last_link) = (r.num_registered, r.last_link);
    }

    /// Leading blocks registered in (or found in) the prefix cache.
    pub fn num_registered(&self) -> usize {
        self.num_registered
    }
}

/// A sequence's registration progress at one point (opaque outside this module).
#[derive(Debug, Clone, Copy)]
pub struct Registration {
    num_registered: usize,
    last_link: Option<ParentLink>,
}

/// Block-copy operations the model runner must perform before this step's forward pass,
/// in this order: swap out, swap in, copy.
#[derive(Debug, Default, Clone)]
pub struct BlockOps {
    /// (gpu_block, cpu_block)
    pub swap_out: Vec<(u32, u32)>,
    /// (cpu_block, gpu_block)
    pub swap_in: Vec<(u32, u32)>,
    /// (src_gpu_block, dst_gpu_block), copy-on-write.
    pub copy: Vec<(u32, u32)>,
}

#[derive(Debug, Default, Clone, Copy)]
pub struct KvStats {
    pub cow_copies: u64,
    pub blocks_swapped_out: u64,
    pub blocks_swapped_in: u64,
    pub prefix_evictions: u64,
}

pub struct KvCacheManager {
    bm: BlockMath,
    gpu: BlockPool,
    cpu: BlockPool,
    cache: Option<PrefixCache>,
    ops: BlockOps,
    stats: KvStats,
}

impl KvCacheManager {
    pub fn new(num_blocks: usize, block_size: usize, num_cpu_blocks: usize, enable_prefix_caching: bool) -> Self {
        Self::try_new(num_blocks, block_size, num_cpu_blocks, enable_prefix_caching).expect("KV-cache bookkeeping allocation")
    }

    /// `new`, or a typed error naming the field whose size cannot be allocated (never an
    /// abort: the pools and the prefix cache are allocated fallibly).
    pub fn try_new(num_blocks: usize, block_size: usize, num_cpu_blocks: usize, enable_prefix_caching: bool) -> CoreResult<Self> {
        let too_big = |field: &'static str, value: usize| {
            CoreError::invalid(field, value, "the KV-cache bookkeeping for this many blocks cannot be allocated")
        };
        let cache = match enable_prefix_caching {
            true => Some(PrefixCache::try_new(num_blocks, block_size).ok_or_else(|| too_big("num_blocks", num_blocks))?),
            false => None,
        };
        Ok(KvCacheManager {
            bm: BlockMath::new(block_size),
            gpu: BlockPool::try_new(num_blocks, true).ok_or_else(|| too_big("num_blocks", num_blocks))?,
            cpu: BlockPool::try_new(num_cpu_blocks, false).ok_or_else(|| too_big("num_cpu_blocks", num_cpu_blocks))?,
            cache,
            ops: BlockOps::default(),
            stats: KvStats::default(),
        })
    }

    pub fn num_free_blocks(&self) -> usize {
        self.gpu.num_free()
    }
    pub fn num_usable_blocks(&self) -> usize {
        self.gpu.num_usable()
    }
    pub fn num_cached_blocks(&self) -> usize {
        self.cache.as_ref().map_or(0, |c| c.len())
    }
    pub fn prefix_caching(&self) -> bool {
        self.cache.is_some()
    }
    /// Whether `b` holds a prefix the cache can serve.
    pub fn is_cached(&self, b: BlockId) -> bool {
        self.cache.as_ref().is_some_and(|c| c.is_cached(b))
    }

    pub fn ref_count(&self, b: BlockId) -> u32 {
        self.gpu.ref_count(b)
    }
    pub fn stats(&self) -> KvStats {
        self.stats
    }
    pub fn free_list(&self) -> Vec<BlockId> {
        self.gpu.free_list()
    }

    /// Moves out the block ops queued since the last call.
    pub fn take_ops(&mut self) -> BlockOps {
        std::mem::take(&mut self.ops)
    }

    pub fn blocks_for(&self, num_tokens: usize) -> usize {
        self.bm.blocks_for(num_tokens)
    }

    /// Cached prefix of `tokens` for a sequence that holds no block yet, capped so that at
    /// least the last token is recomputed (its logits are needed). The chain hashes are
    /// remembered in `t`.
    pub fn find_cached_prefix(&self, t: &mut SeqKv, tokens: &[u32], salt: Option<&str>) -> Vec<BlockId> {
        debug_assert_eq!(t.num_registered, 0);
        match &self.cache {
            Some(cache) if !tokens.is_empty() => {
                let max_blocks = self.bm.block(tokens.len() - 1);
                cache.lookup(tokens, salt, max_blocks, &mut t.hashes)
            }
            _ => Vec::new(),
        }
    }

    /// Free blocks that `allocate_slots` with the same arguments would consume. Shared blocks
    /// in the written range count as one copy each, which may over-count by one when siblings
    /// that share a block both write this step; it never under-counts.
    pub fn blocks_needed(&self, ids: &impl BlockIds, num_computed: usize, num_new: usize, hits: &[BlockId]) -> usize {
        let revived = hits.iter().filter(|&&b| self.gpu.ref_count(b) == 0).count();
        if num_new == 0 {
            return revived;
        }
        let have = ids.len() + hits.len();
        let fresh = self.blocks_for(num_computed + num_new).saturating_sub(have);
        let cow = (self.bm.block(num_computed)..ids.len()).filter(|&i| self.gpu.ref_count(ids.at(i)) > 1).count();
        fresh + cow + revived
    }

    /// `blocks_needed` for several sequences of one request that are allocated together: cache
    /// hits they share are revived once, and a shared block written by all of its holders is
    /// copied by all but the last writer, which then owns it.
    pub fn blocks_needed_together<I: BlockIds>(&self, items: &[(I, usize, usize, &[BlockId])]) -> usize {
        let mut fresh = 0;
        let mut revived: Vec<u32> = Vec::new();
        let mut written_shared: Vec<u32> = Vec::new();
        for (ids, num_computed, num_new, hits) in items {
            revived.extend(hits.iter().filter(|b| self.gpu.ref_count(**b) == 0).map(|b| b.0));
            if *num_new == 0 {
                continue;
            }
            let have = ids.len() + hits.len();
            fresh += self.blocks_for(num_computed + num_new).saturating_sub(have);
            let written = (self.bm.block(*num_computed)..ids.len()).map(|i| ids.at(i));
            written_shared.extend(written.filter(|b| self.gpu.ref_count(*b) > 1).map(|b| b.0));
        }
        revived.sort_unstable();
        revived.dedup();
        written_shared.sort_unstable();
        let mut cow = 0;
        for run in written_shared.chunk_by(|a, b| a == b) {
            let writers = run.len();
            let refs = self.gpu.ref_count(BlockId(run[0])) as usize;
            cow += if refs > writers { writers } else { writers - 1 };
        }
        fresh + revived.len() + cow
    }

    /// Makes room for `num_new` tokens after `num_computed`, taking the cache `hits` first (only
    /// for a sequence with no block), copying shared blocks that will be written and appending
    /// fresh ones. Returns false, changing nothing, when fewer than `needed + watermark` blocks
    /// are free.
    pub fn allocate_slots(
        &mut self,
        t: &mut SeqKv,
        ids: &mut impl BlockIdsMut,
        num_computed: usize,
        num_new: usize,
        hits: &[BlockId],
        watermark: usize,
    ) -> bool {
        let needed = self.blocks_needed(ids, num_computed, num_new, hits);
        if self.gpu.num_free() < needed + watermark {
            return false;
        }
        if !hits.is_empty() {
            debug_assert!(ids.is_empty() && num_computed == hits.len() * self.bm.size());
            for &b in hits {
                self.gpu.incref(b);
                ids.push(b);
            }
            t.num_registered = hits.len();
            t.last_link = self.cache.as_ref().map(|c| c.link_to(*hits.last().unwrap()));
        }
        if num_new == 0 {
            return true;
        }
        for i in self.bm.block(num_computed)..ids.len() {
            let src = ids.at(i);
            if self.gpu.ref_count(src) > 1 {
                let dst = self.pop_block().expect("capacity was checked");
                self.gpu.decref(src, false); // still referenced by a sibling: never freed here
                self.ops.copy.push((src.0, dst.0));
                self.stats.cow_copies += 1;
                ids.set(i, dst);
            }
        }
        let target = self.blocks_for(num_computed + num_new);
        while ids.len() < target {
            let b = self.pop_block().expect("capacity was checked");
            ids.push_fresh(b);
        }
        true
    }

    /// The first half of `register_computed`, run over many sequences before any of them
    /// registers: hashes the blocks it will register (the hashes stay in `t`) and starts
    /// fetching what inserting them touches, so that the cache misses of a step's
    /// registrations overlap.
    pub fn prepare_register(&self, t: &mut SeqKv, ids: &impl BlockIds, tokens: &[u32], num_computed: usize, salt: Option<&str>) {
        let Some(cache) = &self.cache else { return };
        for i in t.num_registered..self.registrable(ids, tokens, num_computed) {
            self.hash_of(t, tokens, i, salt);
            cache.prefetch_insert(ids.at(i), t.hashes[i]);
        }
    }

    /// Leading blocks that are full and computed (the first `num_computed` tokens).
    fn registrable(&self, ids: &impl BlockIds, tokens: &[u32], num_computed: usize) -> usize {
        self.bm.block(num_computed).min(ids.len()).min(self.bm.block(tokens.len()))
    }

    /// Block `i`'s chain hash, computed once and kept in `t` (hashes `0..i` are known).
    fn hash_of(&self, t: &mut SeqKv, tokens: &[u32], i: usize, salt: Option<&str>) -> BlockHash {
        if t.hashes.len() == i {
            let bs = self.bm.size();
            let prev = if i == 0 { None } else { Some(t.hashes[i - 1]) };
            t.hashes.push(hash_block(prev, &tokens[i * bs..(i + 1) * bs], salt));
        }
        t.hashes[i]
    }

    /// Gives a sequence with no block a sibling's leading `blocks`, whose KV that sibling has
    /// computed (its samples' shared prompt): they are shared, not copied. Its registration
    /// progress stays at 0, so registering it walks them again and chains on from the cache's
    /// copy (`register_computed`; nothing happens without a cache). The caller has checked
    /// that none is free (`blocks_needed` counts them as held).
    pub fn share_blocks(&mut self, t: &SeqKv, ids: &mut impl BlockIdsMut, blocks: &[BlockId]) {
        debug_assert!(ids.is_empty() && t.num_registered == 0 && t.cpu_blocks.is_empty());
        for &b in blocks {
            debug_assert!(self.gpu.ref_count(b) > 0, "a sibling holds it");
            self.gpu.incref(b);
            ids.push(b);
        }
    }

    /// Appends one fresh block (ref count 1) for a sequence whose next token starts a new
    /// block (the decode step's allocation). The caller has counted a free block for it.
    pub fn append_block(&mut self, ids: &mut impl BlockIdsMut) {
        let b = self.pop_block().expect("a free block was counted");
        ids.push_fresh(b);
    }

    fn pop_block(&mut self) -> Option<BlockId> {
        let b = self.gpu.allocate()?;
        if let Some(cache) = &mut self.cache {
            // Allocations come in bursts and each one evicts the cached prefix its block held:
            // fetch ahead along the free list (the next block's index slot, the one after's
            // record).
            if let Some(next) = self.gpu.peek_free() {
                cache.prefetch_evict(next);
            }
            if let Some(after) = self.gpu.peek_second_free() {
                cache.prefetch_record(after);
            }
            if cache.evict(b) {
                self.stats.prefix_evictions += 1;
            }
        }
        Some(b)
    }

    /// Registers the full blocks whose KV is computed (the first `num_computed` tokens, this
    /// step's included) in the prefix cache. `tokens` are the sequence's tokens; `salt` only
    /// affects block 0. Each block it caches is appended to `inserted` (with its incarnation),
    /// for `unregister`.
    pub fn register_computed(
        &mut self,
        t: &mut SeqKv,
        ids: &impl BlockIds,
        tokens: &[u32],
        num_computed: usize,
        salt: Option<&str>,
        inserted: &mut Vec<ParentLink>,
    ) {
        if self.cache.is_none() {
            return;
        }
        let bs = self.bm.size();
        let full = self.registrable(ids, tokens, num_computed);
        while t.num_registered < full {
            let i = t.num_registered;
            let chunk = &tokens[i * bs..(i + 1) * bs];
            self.hash_of(t, tokens, i, salt);
            let cache = self.cache.as_mut().expect("checked above");
            let parent = if i == 0 { None } else { t.last_link };
            if i > 0 && parent.is_none() {
                break; // the chain is broken (a collision upstream): stop registering
            }
            let b = ids.at(i);
            let canonical = if cache.insert(b, t.hashes[i], parent, chunk, salt) {
                inserted.push(cache.link_to(b));
                Some(b)
            } else {
                // Already cached: as this very block (a sibling registered it), or as an
                // identical block another request computed. Chain on from the cached copy.
                let mut probe = t.hashes[..=i].to_vec();
                cache.lookup(&tokens[..(i + 1) * bs], salt, i + 1, &mut probe).get(i).copied()
            };
            match canonical {
                Some(c) => {
                    t.last_link = Some(cache.link_to(c));
                    t.num_registered += 1;
                }
                None => break,
            }
        }
    }

    /// Forgets the blocks `register_computed` cached (`inserted`) whose KV will never be
    /// written (a cancelled step), unless they were evicted and re-cached since.
    pub fn unregister(&mut self, inserted: &[ParentLink]) {
        if let Some(cache) = &mut self.cache {
            for &link in inserted {
                cache.unregister(link);
            }
        }
    }

    /// Shares every block of a running sequence with a new one (copy-on-write on the next
    /// write): the child's bookkeeping and block ids, for the row it is about to get.
    pub fn fork(&mut self, t: &SeqKv, ids: &impl BlockIds) -> (SeqKv, Vec<BlockId>) {
        debug_assert!(!t.is_swapped());
        let blocks = ids.to_vec();
        for &b in &blocks {
            self.gpu.incref(b);
        }
        let child = SeqKv { hashes: t.hashes.clone(), num_registered: t.num_registered, last_link: t.last_link, cpu_blocks: Vec::new() };
        (child, blocks)
    }

    /// Releases every block of a sequence: `ids` (its GPU blocks, which the caller then drops
    /// with its row) and its CPU blocks. Tail blocks are released first, so among cached blocks
    /// a sequence's tail is evicted before its (more shareable) head.
    pub fn free(&mut self, t: &mut SeqKv, ids: &impl BlockIds) {
        // Each block's entry and cache record is a likely miss: start them all first.
        for i in 0..ids.len() {
            self.gpu.prefetch(ids.at(i));
            if let Some(c) = &self.cache {
                c.prefetch_record(ids.at(i));
            }
        }
        self.release_gpu(ids);
        for &b in t.cpu_blocks.iter().rev() {
            self.cpu.decref(b, false);
        }
        t.cpu_blocks.clear();
        t.num_registered = 0;
        t.last_link = None;
    }

    /// Releases the blocks of a running sequence past its first `keep` (a cancelled step's
    /// allocations; they are never cached).
    pub fn truncate(&mut self, ids: &mut impl BlockIdsMut, keep: usize) {
        while ids.len() > keep {
            let b = ids.pop().expect("longer than keep");
            let cached = self.cache.as_ref().is_some_and(|c| c.is_cached(b));
            self.gpu.decref(b, cached);
        }
    }

    /// Drops one reference to each block of `ids`, tail first (cached blocks stay cached).
    fn release_gpu(&mut self, ids: &impl BlockIds) {
        for i in (0..ids.len()).rev() {
            let b = ids.at(i);
            let keep = self.cache.as_ref().is_some_and(|c| c.is_cached(b));
            self.gpu.decref(b, keep);
        }
    }

    /// True when every block covering token positions `from..to` has exactly one reference.
    pub fn writes_are_exclusive(&self, ids: &impl BlockIds, from: usize, to: usize) -> bool {
        self.shared_writes(ids, from, to).next().is_none()
    }

    /// The blocks covering positions `from..to` that another table holds too (all of them
    /// when the range runs past the table), with whether the write fills them.
    pub fn shared_writes<'a>(&'a self, ids: &'a impl BlockIds, from: usize, to: usize) -> impl Iterator<Item = (BlockId, bool)> + 'a {
        let (a, b) = if from >= to { (1, 0) } else { (self.bm.block(from), self.bm.block(to - 1)) };
        let past = b >= ids.len() && a <= b;
        (a..=b).filter_map(move |i| {
            let blk = if i < ids.len() { ids.at(i) } else { BlockId(0) };
            let shared = past || self.gpu.ref_count(blk) != 1;
            shared.then_some((blk, (i + 1) * self.bm.size() <= to))
        })
    }

    /// Drops every cached prefix that no sequence uses (e.g. after the runner failed a step).
    pub fn reset_prefix_cache(&mut self) {
        if let Some(c) = &mut self.cache {
            c.clear();
        }
    }

    /// Checks ref counts against every live sequence (its bookkeeping and GPU block ids), the
    /// free lists and the cache.
    pub fn check<'a>(&self, tables: impl Iterator<Item = (&'a SeqKv, Vec<BlockId>)>) -> Result<(), String> {
        let mut gpu_refs = vec![0u32; self.gpu.num_blocks()];
        let mut cpu_refs = vec![0u32; self.cpu.num_blocks()];
        for (t, blocks) in tables {
            for b in &blocks {
                gpu_refs[b.0 as usize] += 1;
            }
            for b in &t.cpu_blocks {
                cpu_refs[b.0 as usize] += 1;
            }
            if !blocks.is_empty() && !t.cpu_blocks.is_empty() {
                return Err("a table holds GPU and CPU blocks at once".into());
            }
        }
        self.gpu.check(&gpu_refs).map_err(|e| format!("gpu pool: {e}"))?;
        self.cpu.check(&cpu_refs).map_err(|e| format!("cpu pool: {e}"))?;
        if let Some(c) = &self.cache {
            c.check()?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A sequence as the tests hold it: its bookkeeping and its block ids (the scheduler keeps
    /// the ids in a batch row).
    #[derive(Default)]
    struct Table {
        kv: SeqKv,
        ids: Vec<BlockId>,
    }

    fn ids(t: &Table) -> Vec<u32> {
        t.ids.iter().map(|b| b.0).collect()
    }

    fn free(m: &mut KvCacheManager, t: &mut Table) {
        m.free(&mut t.kv, &t.ids);
        t.ids.clear();
    }

    fn fork(m: &mut KvCacheManager, t: &Table) -> Table {
        let (kv, ids) = m.fork(&t.kv, &t.ids);
        Table { kv, ids }
    }

    fn check(m: &KvCacheManager, tables: &[&Table]) -> Result<(), String> {
        m.check(tables.iter().map(|t| (&t.kv, t.ids.clone())))
    }

    fn swap_out(m: &mut KvCacheManager, tables: &mut [&mut Table]) -> bool {
        let ids: Vec<Vec<BlockId>> = tables.iter().map(|t| t.ids.clone()).collect();
        let mut kvs: Vec<&mut SeqKv> = tables.iter_mut().map(|t| &mut t.kv).collect();
        let ok = m.swap_out(&mut kvs, &ids);
        if ok {
            tables.iter_mut().for_each(|t| t.ids.clear());
        }
        ok
    }

    fn swap_in(m: &mut KvCacheManager, tables: &mut [&mut Table], watermark: usize) -> bool {
        let mut kvs: Vec<&mut SeqKv> = tables.iter_mut().map(|t| &mut t.kv).collect();
        let Some(ids) = m.swap_in(&mut kvs, watermark) else { return false };
        for (t, i) in tables.iter_mut().zip(ids) {
            t.ids = i;
        }
        true
    }

    #[test]
    fn allocation_grows_by_whole_blocks_with_exact_ids() {
        let mut m = KvCacheManager::new(8, 4, 0, false);
        assert!(!m.prefix_caching());
        let mut t = Table::default();
        assert!(m.allocate_slots(&mut t.kv, &mut t.ids, 0, 5, &[], 0));
        assert_eq!(ids(&t), vec![1, 2]);
        assert!(m.allocate_slots(&mut t.kv, &mut t.ids, 5, 3, &[], 0)); // fills block 2 exactly
        assert_eq!(ids(&t), vec![1, 2]);
        assert!(m.allocate_slots(&mut t.kv, &mut t.ids, 8, 1, &[], 0));
        assert_eq!(ids(&t), vec![1, 2, 3]);
        assert_eq!(m.num_free_blocks(), 4);
        // The watermark keeps blocks back.
        let mut u = Table::default();
        assert!(!m.allocate_slots(&mut u.kv, &mut u.ids, 0, 16, &[], 1));
        assert!(u.ids.is_empty());
        assert!(m.allocate_slots(&mut u.kv, &mut u.ids, 0, 16, &[], 0));
        assert_eq!(ids(&u), vec![4, 5, 6, 7]);
        check(&m, &[&t, &u]).unwrap();
        free(&mut m, &mut t);
        free(&mut m, &mut u);
        assert_eq!(m.num_free_blocks(), 7);
        m.check(std::iter::empty()).unwrap();
    }

    #[test]
    fn fork_shares_and_the_first_write_copies_on_write() {
        let mut m = KvCacheManager::new(8, 4, 0, false);
        let mut a = Table::default();
        assert!(m.allocate_slots(&mut a.kv, &mut a.ids, 0, 6, &[], 0)); // blocks 1 (full), 2 (2 of 4)
        let mut b = fork(&mut m, &a);
        assert_eq!(m.ref_count(BlockId(1)), 2);
        assert_eq!(m.ref_count(BlockId(2)), 2);
        // b writes position 6, inside shared block 2: it gets a private copy (block 3).
        assert_eq!(m.blocks_needed(&b.ids, 6, 1, &[]), 1);
        assert!(m.allocate_slots(&mut b.kv, &mut b.ids, 6, 1, &[], 0));
        assert_eq!(ids(&b), vec![1, 3]);
        assert_eq!(m.take_ops().copy, vec![(2, 3)]);
        assert_eq!(m.ref_count(BlockId(2)), 1);
        // a now owns block 2 alone and writes in place.
        assert!(m.allocate_slots(&mut a.kv, &mut a.ids, 6, 1, &[], 0));
        assert_eq!(ids(&a), vec![1, 2]);
        assert!(m.take_ops().copy.is_empty());
        assert!(m.writes_are_exclusive(&a.ids, 6, 7) && m.writes_are_exclusive(&b.ids, 6, 7));
        assert!(!m.writes_are_exclusive(&a.ids, 0, 4));
        assert!(!m.writes_are_exclusive(&a.ids, 6, 9), "position 8 is past the table");
        check(&m, &[&a, &b]).unwrap();
        free(&mut m, &mut b);
        assert_eq!(m.ref_count(BlockId(1)), 1);
        free(&mut m, &mut a);
        m.check(std::iter::empty()).unwrap();
    }

    #[test]
    fn prefix_hits_reuse_cached_blocks_and_leave_the_last_token_to_compute() {
        let mut m = KvCacheManager::new(8, 2, 0, true);
        let toks: Vec<u32> = vec![10, 11, 12, 13, 14];
        let mut a = Table::default();
        assert!(m.allocate_slots(&mut a.kv, &mut a.ids, 0, 5, &[], 0));
        assert_eq!(ids(&a), vec![1, 2, 3]);
        m.register_computed(&mut a.kv, &a.ids, &toks, 5, None, &mut Vec::new());
        assert_eq!(m.num_cached_blocks(), 2);
        assert!(m.prefix_caching() && m.is_cached(BlockId(1)) && m.is_cached(BlockId(2)) && !m.is_cached(BlockId(3)));
        assert!(m.find_cached_prefix(&mut Table::default().kv, &[], None).is_empty(), "an empty prompt hits nothing");
        // Same prompt: blocks 1 and 2 hit; the fifth token is computed.
        let mut b = Table::default();
        let hits = m.find_cached_prefix(&mut b.kv, &toks, None);
        assert_eq!(hits, vec![BlockId(1), BlockId(2)]);
        assert!(m.allocate_slots(&mut b.kv, &mut b.ids, 4, 1, &hits, 0));
        assert_eq!(ids(&b), vec![1, 2, 4]);
        // A prompt that is exactly the two cached blocks hits only one: the last token must
        // be recomputed to produce logits.
        let mut c = Table::default();
        assert_eq!(m.find_cached_prefix(&mut c.kv, &toks[..4], None), vec![BlockId(1)]);
        // A salted request shares nothing.
        let mut d = Table::default();
        assert!(m.find_cached_prefix(&mut d.kv, &toks, Some("x")).is_empty());
        free(&mut m, &mut a);
        free(&mut m, &mut b);
        // Freed in reverse: uncached tails at the head (b freed last, so 4 first), cached
        // blocks at the tail with the sequence's tail block (2) before its head block (1).
        assert_eq!(m.free_list().iter().map(|b| b.0).collect::<Vec<_>>(), vec![4, 3, 5, 6, 7, 2, 1]);
        m.check(std::iter::empty()).unwrap();
    }

    #[test]
    fn reusing_a_cached_block_evicts_it() {
        let mut m = KvCacheManager::new(3, 2, 0, true); // usable blocks: 1, 2
        let toks = vec![1, 2, 3, 4];
        let mut a = Table::default();
        assert!(m.allocate_slots(&mut a.kv, &mut a.ids, 0, 4, &[], 0));
        m.register_computed(&mut a.kv, &a.ids, &toks, 4, None, &mut Vec::new());
        free(&mut m, &mut a);
        assert_eq!(m.num_cached_blocks(), 2);
        let mut b = Table::default();
        assert!(m.allocate_slots(&mut b.kv, &mut b.ids, 0, 1, &[], 0));
        assert_eq!(ids(&b), vec![2]); // the tail block is evicted first
        assert_eq!(m.num_cached_blocks(), 1);
        let mut c = Table::default();
        assert_eq!(m.find_cached_prefix(&mut c.kv, &[1, 2, 3, 4, 5], None), vec![BlockId(1)]);
        assert_eq!(m.stats().prefix_evictions, 1);
    }

    #[test]
    fn concurrent_duplicates_chain_through_the_canonical_block() {
        let mut m = KvCacheManager::new(10, 2, 0, true);
        let a_toks = vec![1, 2, 3, 4];
        let b_toks = vec![1, 2, 3, 4, 7, 8, 9];
        let (mut a, mut b) = (Table::default(), Table::default());
        assert!(m.allocate_slots(&mut a.kv, &mut a.ids, 0, 4, &[], 0));
        assert!(m.allocate_slots(&mut b.kv, &mut b.ids, 0, 7, &[], 0));
        m.register_computed(&mut a.kv, &a.ids, &a_toks, 4, None, &mut Vec::new());
        m.register_computed(&mut b.kv, &b.ids, &b_toks, 7, None, &mut Vec::new());
        // b's third block chains from a's copy of the shared prefix.
        let mut c = Table::default();
        let hits = m.find_cached_prefix(&mut c.kv, &[1, 2, 3, 4, 7, 8, 0], None);
        assert_eq!(hits, vec![BlockId(1), BlockId(2), BlockId(5)]);
    }

    #[test]
    fn swap_out_and_in_move_shared_blocks_once() {
        let mut m = KvCacheManager::new(8, 2, 4, false);
        let mut a = Table::default();
        assert!(m.allocate_slots(&mut a.kv, &mut a.ids, 0, 3, &[], 0)); // 1, 2
        let mut b = fork(&mut m, &a);
        assert!(m.allocate_slots(&mut b.kv, &mut b.ids, 3, 1, &[], 0)); // COW 2 -> 3
        m.take_ops();
        assert!(swap_out(&mut m, &mut [&mut a, &mut b]));
        assert!(a.kv.is_swapped() && b.kv.is_swapped());
        let ops = m.take_ops();
        assert_eq!(ops.swap_out, vec![(1, 0), (2, 1), (3, 2)]);
        assert_eq!(m.num_free_blocks(), 7);
        assert_eq!(a.kv.cpu_blocks().iter().map(|b| b.0).collect::<Vec<_>>(), vec![0, 1]);
        check(&m, &[&a, &b]).unwrap();
        assert!(!swap_in(&mut m, &mut [&mut a, &mut b], 5));
        assert!(swap_in(&mut m, &mut [&mut a, &mut b], 0));
        let ops = m.take_ops();
        // Freed uncached blocks went to the head of the free list, so they come back first.
        assert_eq!(ops.swap_in, vec![(0, 1), (1, 3), (2, 2)]);
        assert_eq!(ids(&a), vec![1, 3]);
        assert_eq!(ids(&b), vec![1, 2]);
        assert_eq!(m.ref_count(BlockId(1)), 2);
        check(&m, &[&a, &b]).unwrap();
        let mut c = Table::default();
        assert!(m.allocate_slots(&mut c.kv, &mut c.ids, 0, 4, &[], 0));
        assert!(swap_out(&mut m, &mut [&mut c]));
        assert!(!swap_out(&mut m, &mut [&mut a, &mut b])); // needs 3 CPU blocks, 2 are left
        assert!(!a.kv.is_swapped());
    }

    #[test]
    fn samples_writing_the_block_they_share_need_one_copy_fewer_than_writers() {
        let mut m = KvCacheManager::new(16, 4, 0, false);
        let mut a = Table::default();
        assert!(m.allocate_slots(&mut a.kv, &mut a.ids, 0, 6, &[], 0)); // blocks 1 (full), 2 (2 of 4)
        let mut b = fork(&mut m, &a);
        let mut c = fork(&mut m, &a);
        let write_7th = |t: &Table| (t.ids.clone(), 6usize, 1usize, &[][..]);
        // Block 2 has three holders. All three write position 6: two copy, the last keeps it.
        assert_eq!(m.blocks_needed_together(&[write_7th(&a), write_7th(&b), write_7th(&c)]), 2);
        // Two of the three write: both copy (the third still holds the block).
        assert_eq!(m.blocks_needed_together(&[write_7th(&a), write_7th(&b)]), 2);
        free(&mut m, &mut c);
        // Two holders, both writing: exactly one copy, which is what allocating them takes.
        assert_eq!(m.blocks_needed_together(&[write_7th(&a), write_7th(&b)]), 1);
        let before = m.num_free_blocks();
        assert!(m.allocate_slots(&mut a.kv, &mut a.ids, 6, 1, &[], 0));
        assert!(m.allocate_slots(&mut b.kv, &mut b.ids, 6, 1, &[], 0));
        assert_eq!(before - m.num_free_blocks(), 1);
        assert_eq!((ids(&a), ids(&b), m.take_ops().copy), (vec![1, 3], vec![1, 2], vec![(2, 3)]));
        check(&m, &[&a, &b]).unwrap();
    }

    #[test]
    fn truncate_releases_the_blocks_past_keep_tail_first() {
        let mut m = KvCacheManager::new(8, 4, 0, false);
        let mut t = Table::default();
        assert!(m.allocate_slots(&mut t.kv, &mut t.ids, 0, 10, &[], 0)); // blocks 1, 2, 3
        m.truncate(&mut t.ids, 1);
        assert_eq!((ids(&t), m.num_free_blocks()), (vec![1], 6));
        assert_eq!(m.free_list()[..3], [BlockId(2), BlockId(3), BlockId(4)], "uncached: reused first, in table order");
        check(&m, &[&t]).unwrap();
    }

    #[test]
    fn swaps_that_fit_exactly_go_ahead_and_the_watermark_counts() {
        let mut m = KvCacheManager::new(5, 2, 2, false); // 4 usable GPU blocks, 2 CPU blocks
        let mut a = Table::default();
        assert!(m.allocate_slots(&mut a.kv, &mut a.ids, 0, 4, &[], 0)); // blocks 1, 2
        assert!(swap_out(&mut m, &mut [&mut a]), "2 blocks fit 2 free CPU blocks");
        let mut b = Table::default();
        assert!(m.allocate_slots(&mut b.kv, &mut b.ids, 0, 4, &[], 0));
        assert_eq!(m.num_free_blocks(), 2);
        assert!(!swap_in(&mut m, &mut [&mut a], 1), "2 blocks and a watermark of 1 do not fit 2 free");
        assert!(swap_in(&mut m, &mut [&mut a], 0), "2 blocks fit 2 free");
        check(&m, &[&a, &b]).unwrap();
    }
}
