//! Automatic prefix caching: full blocks are findable by a chained hash of their tokens.
//!
//! Invariants:
//! - `hash(block i) = xxh3_64(hash(block i-1) || tokens_i)`; the first block of a sequence
//!   hashes a root marker and the request's optional `cache_salt` instead of a parent hash, so
//!   requests with different salts never share a block.
//! - `map[h] == b` iff `records[b]` is cached with hash `h`. A block is cached at most once.
//! - A hit is only served after an exact re-check: the block's stored tokens equal the asked
//!   tokens, its parent link names the previous matched block *and that block's cache
//!   generation*, and a first block's salt matches. A 64-bit collision can therefore never serve
//!   the wrong KV, even after the parent was evicted and its slot re-cached with other tokens.
//!
//! Costs: one xxh3 over `block_size` tokens per full block, one index probe per looked-up
//! block (`hash_index`: usually one cache line), one 24-byte record and one token copy per
//! cached block into preallocated arrays (no allocation after startup, salts aside; the token
//! arena's pages are mapped at startup, not by the first steps that cache into them).

use crate::block_pool::BlockId;
use crate::hash_index::HashIndex;
use std::collections::HashMap;
use xxhash_rust::xxh3::{xxh3_64, Xxh3};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct BlockHash(pub u64);

/// `hash_block`'s bytes streamed piece by piece (`head` is the parent hash or the root marker;
/// `salt` only for first blocks): the definition the one-shot path must match.
fn hash_streamed(head: u64, tokens: &[u32], salt: Option<&str>) -> BlockHash {
    let mut h = Xxh3::new();
    h.update(&head.to_le_bytes());
    if let Some(s) = salt {
        h.update(&(s.len() as u64).to_le_bytes());
        h.update(s.as_bytes());
    }
    for t in tokens {
        h.update(&t.to_le_bytes());
    }
    BlockHash(h.digest())
}

const ROOT_MARKER: u64 = 0x6665_7272_6f6b_7600; // "ferrokv\0": the parent of first blocks

/// Stable chained hash of one full block: xxh3-64 of the parent hash (or the root marker, the
/// salt's length and the salt), then the tokens, all little-endian.
pub fn hash_block(parent: Option<BlockHash>, tokens: &[u32], salt: Option<&str>) -> BlockHash {
    let head = match parent {
        Some(p) => p.0,
        None => ROOT_MARKER,
    };
    let salt = if parent.is_none() { salt } else { None };
    match (salt, tokens.len()) {
        // The usual block sizes, with copy lengths the compiler knows (no memcpy calls).
        (None, 16) => hash_one_shot::<16>(head, None, tokens),
        (None, 32) => hash_one_shot::<32>(head, None, tokens),
        (None, 8) => hash_one_shot::<8>(head, None, tokens),
        (_, n) if 8 + salt.map_or(0, |s| 8 + s.len()) + 4 * n > ONE_SHOT_BYTES => hash_streamed(head, tokens, salt),
        _ => hash_one_shot::<0>(head, salt, tokens),
    }
}

/// What `hash_one_shot` hashes in one go: the head and up to 64 tokens (or a salt and fewer).
const ONE_SHOT_BYTES: usize = 8 + 4 * 64;

/// `hash_streamed`'s bytes laid out in a stack buffer and hashed at once (~4x faster; the same
/// hash). `N > 0` fixes the token count at compile time; `N = 0` takes `tokens.len()`. The
/// caller checks that everything fits in `ONE_SHOT_BYTES`.
#[inline]
fn hash_one_shot<const N: usize>(head: u64, salt: Option<&str>, tokens: &[u32]) -> BlockHash {
    let count = if N > 0 { N } else { tokens.len() };
    let mut buf = [0u8; ONE_SHOT_BYTES];
    buf[..8].copy_from_slice(&head.to_le_bytes());
    let mut n = 8;
    if let Some(s) = salt {
        buf[n..n + 8].copy_from_slice(&(s.len() as u64).to_le_bytes());
        buf[n + 8..n + 8 + s.len()].copy_from_slice(s.as_bytes());
        n += 8 + s.len();
    }
    // Exact chunks: no per-token bounds check, so this compiles to a plain copy on LE targets.
    let end = n + 4 * count;
    for (dst, t) in buf[n..end].chunks_exact_mut(4).zip(&tokens[..count]) {
        dst.copy_from_slice(&t.to_le_bytes());
    }
    BlockHash(xxh3_64(&buf[..end]))
}

/// Link from a cached block to the cached block before it, pinned to that block's generation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ParentLink {
    pub block: BlockId,
    pub generation: u32,
}

/// What the cache knows of one block: 24 bytes, so that an insert or an eviction touches one
/// record (plus the map and the token arena).
#[derive(Debug, Clone, Copy, Default)]
struct Record {
    hash: u64,
    parent_block: u32,
    parent_generation: u32,
    /// Bumped on every insert: links to an older incarnation of the block are stale.
    generation: u32,
    flags: u8,
}

const CACHED: u8 = 1;
const HAS_PARENT: u8 = 2;
const SALTED: u8 = 4;

impl Record {
    fn cached(&self) -> bool {
        self.flags & CACHED != 0
    }
    fn parent(&self) -> Option<ParentLink> {
        (self.flags & HAS_PARENT != 0).then_some(ParentLink { block: BlockId(self.parent_block), generation: self.parent_generation })
    }
}

pub struct PrefixCache {
    block_size: usize,
    map: HashIndex,
    records: Vec<Record>,
    /// Salts of cached first blocks that have one (rare: kept out of the records).
    salts: HashMap<u32, Box<str>>,
    /// `block_size` tokens per block: what each cached block holds, for the hit re-check.
    tokens: Vec<u32>,
}

impl PrefixCache {
    pub fn new(num_blocks: usize, block_size: usize) -> Self {
        Self::try_new(num_blocks, block_size).expect("prefix cache allocation")
    }

    /// `new`, or `None` when its arena, records or index cannot be allocated. The arena's
    /// first `PREFAULT_ARENA_BYTES` are mapped now (registration would fault them in during
    /// steps); the rest of a huge one maps in as blocks are registered.
    pub fn try_new(num_blocks: usize, block_size: usize) -> Option<Self> {
        const PREFAULT_ARENA_BYTES: usize = 256 << 20;
        let mut tokens = crate::block_pool::try_zeroed(num_blocks.checked_mul(block_size)?)?;
        let head = tokens.len().min(PREFAULT_ARENA_BYTES / std::mem::size_of::<u32>());
        crate::prefetch::prefault_zeroed(&mut tokens[..head]);
        Some(PrefixCache {
            block_size,
            map: HashIndex::try_new(num_blocks)?,
            records: crate::block_pool::try_filled(num_blocks, Record::default())?,
            salts: HashMap::new(),
            tokens,
        })
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    pub fn is_cached(&self, b: BlockId) -> bool {
        self.records[b.0 as usize].cached()
    }

    pub fn link_to(&self, b: BlockId) -> ParentLink {
        ParentLink { block: b, generation: self.records[b.0 as usize].generation }
    }

    fn salt_of(&self, b: BlockId) -> Option<&str> {
        if self.records[b.0 as usize].flags & SALTED == 0 {
            return None;
        }
        self.salts.get(&b.0).map(|s| &**s)
    }

    /// Longest cached prefix of `tokens`, at most `max_blocks` blocks. `hashes` holds the chain
    /// hashes already known for the leading blocks and is extended as blocks are hashed.
    pub fn lookup(
        &self,
        tokens: &[u32],
        salt: Option<&str>,
        max_blocks: usize,
        hashes: &mut Vec<BlockHash>,
    ) -> Vec<BlockId> {
        let bs = self.block_size;
        let mut hits = Vec::new();
        let mut parent: Option<ParentLink> = None;
        for i in 0..max_blocks.min(tokens.len() / bs) {
            let chunk = &tokens[i * bs..(i + 1) * bs];
            if hashes.len() == i {
                let prev = if i == 0 { None } else { Some(hashes[i - 1]) };
                hashes.push(hash_block(prev, chunk, salt));
            }
            let Some(b) = self.map.get(hashes[i].0) else { break };
            let m = &self.records[b.0 as usize];
            debug_assert!(m.cached(), "map and records agree");
            let same = m.parent() == parent
                && self.block_tokens(b) == chunk
                && (i > 0 || self.salt_of(b) == salt);
            if !same {
                break; // a hash collision: never serve it
            }
            hits.push(b);
            parent = Some(self.link_to(b));
        }
        hits
    }

    /// Caches block `b` under `hash`. Returns false (and caches nothing) when an identical
    /// block is already cached, e.g. when two requests computed the same prefix concurrently.
    pub fn insert(
        &mut self,
        b: BlockId,
        hash: BlockHash,
        parent: Option<ParentLink>,
        tokens: &[u32],
        salt: Option<&str>,
    ) -> bool {
        debug_assert_eq!(tokens.len(), self.block_size);
        if self.records[b.0 as usize].cached() {
            return false;
        }
        if !self.map.insert(hash.0, b) {
            return false;
        }
        let salt = if parent.is_none() { salt } else { None };
        let r = &mut self.records[b.0 as usize];
        r.hash = hash.0;
        r.generation = r.generation.wrapping_add(1);
        let p = parent.unwrap_or(ParentLink { block: BlockId(0), generation: 0 });
        (r.parent_block, r.parent_generation) = (p.block.0, p.generation);
        r.flags = CACHED | if parent.is_some() { HAS_PARENT } else { 0 } | if salt.is_some() { SALTED } else { 0 };
        if let Some(s) = salt {
            self.salts.insert(b.0, s.into());
        }
        let at = self.arena_at(b);
        let dst = &mut self.tokens[at..at + self.block_size];
        // Usual sizes with a known length: a few vector moves, not a memcpy call.
        match tokens.len() {
            16 => dst[..16].copy_from_slice(&tokens[..16]),
            32 => dst[..32].copy_from_slice(&tokens[..32]),
            _ => dst.copy_from_slice(tokens),
        }
        true
    }

    /// Hints the CPU to fetch what `insert(b, hash, ..)` will touch (the index slot, the
    /// block's record and token slot), so that the misses of many inserts overlap instead of
    /// queueing one after the other.
    #[inline]
    pub fn prefetch_insert(&self, b: BlockId, hash: BlockHash) {
        self.map.prefetch(hash.0);
        self.prefetch_record(b);
        if let Some(t) = self.tokens.get(self.arena_at(b)) {
            crate::prefetch::read(t as *const u32 as *const u8);
        }
    }

    /// Starts fetching the index slot `evict(b)` will touch, if `b`'s record (fetched earlier
    /// by `prefetch_record`) says it is cached.
    #[inline]
    pub fn prefetch_evict(&self, b: BlockId) {
        if let Some(r) = self.records.get(b.0 as usize) {
            if r.cached() {
                self.map.prefetch(r.hash);
            }
        }
    }

    /// Starts fetching block `b`'s record (what `evict(b)` reads).
    #[inline]
    pub fn prefetch_record(&self, b: BlockId) {
        if let Some(r) = self.records.get(b.0 as usize) {
            crate::prefetch::read(r as *const Record as *const u8);
        }
    }

    /// Where block `b`'s tokens start in the arena.
    #[inline]
    fn arena_at(&self, b: BlockId) -> usize {
        b.0 as usize * self.block_size
    }

    fn block_tokens(&self, b: BlockId) -> &[u32] {
        let at = self.arena_at(b);
        &self.tokens[at..at + self.block_size]
    }

    /// Forgets whatever prefix block `b` held (it is being reused for other tokens).
    pub fn evict(&mut self, b: BlockId) -> bool {
        let r = &mut self.records[b.0 as usize];
        if !r.cached() {
            return false;
        }
        if r.flags & SALTED != 0 {
            self.salts.remove(&b.0);
        }
        r.flags = 0;
        let removed = self.map.remove(r.hash);
        debug_assert_eq!(removed, Some(b));
        true
    }

    /// Forgets block `b = link.block` if it is still cached as the incarnation `link` names (a
    /// registration being undone); false when it was evicted or re-cached since.
    pub fn unregister(&mut self, link: ParentLink) -> bool {
        let r = &self.records[link.block.0 as usize];
        r.cached() && r.generation == link.generation && self.evict(link.block)
    }

    /// Drops every cached prefix.
    pub fn clear(&mut self) {
        self.map.clear();
        self.salts.clear();
        for r in self.records.iter_mut() {
            r.flags = 0;
        }
    }

    pub fn check(&self) -> Result<(), String> {
        self.map.check()?;
        for (h, b) in self.map.iter() {
            let r = &self.records[b.0 as usize];
            if !r.cached() || r.hash != h {
                return Err(format!("map entry {h:#x} -> block {} disagrees with its record", b.0));
            }
        }
        let cached = self.records.iter().filter(|r| r.cached()).count();
        if cached != self.map.len() {
            return Err(format!("{} blocks are cached but the map has {}", cached, self.map.len()));
        }
        let salted = self.records.iter().filter(|r| r.cached() && r.flags & SALTED != 0).count();
        if salted != self.salts.len() {
            return Err(format!("{} cached blocks are salted but {} salts are kept", salted, self.salts.len()));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hashes_are_chained_salted_and_stable() {
        let a = hash_block(None, &[1, 2], None);
        assert_eq!(a, hash_block(None, &[1, 2], None));
        assert_ne!(a, hash_block(None, &[1, 2], Some("tenant-a")));
        assert_ne!(hash_block(None, &[1, 2], Some("a")), hash_block(None, &[1, 2], Some("b")));
        let b1 = hash_block(Some(a), &[3, 4], None);
        let other_root = hash_block(None, &[9, 9], None);
        assert_ne!(b1, hash_block(Some(other_root), &[3, 4], None));
    }

    /// The hash is part of the cache's contract across runs and machines: pinned values for
    /// the root, tokens, a salt, a parent, the 16-token fast path and the streamed path.
    #[test]
    fn hashes_are_pinned() {
        let pinned = |h: BlockHash| format!("{:#018x}", h.0);
        assert_eq!(pinned(hash_block(None, &[], None)), "0x1cdf7e3a3ae6102f");
        let b = hash_block(None, &[1, 2], None);
        assert_eq!(pinned(b), "0xf764434cfcb2a8a1");
        assert_eq!(pinned(hash_block(None, &[1, 2], Some("tenant-a"))), "0x83b93a1cdc9dcdf9");
        assert_eq!(pinned(hash_block(Some(b), &[3, 4], None)), "0x842ec4981e08e7f8");
        let t16: Vec<u32> = (0..16).collect();
        let e = hash_block(None, &t16, None);
        assert_eq!(pinned(e), "0x8f90d73bc666b3ec");
        assert_eq!(pinned(hash_block(Some(e), &t16, None)), "0xc0d86a169f895426");
        let t100: Vec<u32> = (0..100).collect();
        assert_eq!(pinned(hash_block(None, &t100, Some("s"))), "0x4858bf072a690847");
    }

    /// The streamed definition, with a first block's root marker and salt.
    fn streamed(parent: Option<BlockHash>, tokens: &[u32], salt: Option<&str>) -> BlockHash {
        match parent {
            Some(p) => hash_streamed(p.0, tokens, None),
            None => hash_streamed(ROOT_MARKER, tokens, salt),
        }
    }

    #[test]
    fn one_shot_and_streamed_hashes_agree_for_every_length() {
        let long_salt = "s".repeat(300);
        for n in 0..80u32 {
            let tokens: Vec<u32> = (0..n).map(|t| t.wrapping_mul(2_654_435_761)).collect();
            // A salt of one byte puts the one-shot limit at 62 tokens.
            for salt in [None, Some("s"), Some("tenant"), Some(long_salt.as_str())] {
                assert_eq!(hash_block(None, &tokens, salt), streamed(None, &tokens, salt), "{n} tokens, salt {salt:?}");
                let p = Some(BlockHash(n as u64 * 7 + 1));
                assert_eq!(hash_block(p, &tokens, salt), streamed(p, &tokens, None), "{n} tokens after a parent");
            }
        }
    }

    #[test]
    fn lookup_follows_the_chain_and_stops_at_the_first_miss() {
        let mut c = PrefixCache::new(8, 2);
        let toks = [1, 2, 3, 4, 5, 6];
        let h0 = hash_block(None, &toks[0..2], None);
        let h1 = hash_block(Some(h0), &toks[2..4], None);
        assert!(c.insert(BlockId(5), h0, None, &toks[0..2], None));
        assert!(c.insert(BlockId(3), h1, Some(c.link_to(BlockId(5))), &toks[2..4], None));
        let mut hashes = Vec::new();
        assert_eq!(c.lookup(&toks, None, 10, &mut hashes), vec![BlockId(5), BlockId(3)]);
        assert_eq!(hashes.len(), 3);
        let mut hashes = Vec::new();
        assert_eq!(c.lookup(&toks, None, 1, &mut hashes), vec![BlockId(5)]);
        // Another salt sees nothing.
        let mut hashes = Vec::new();
        assert!(c.lookup(&toks, Some("s"), 10, &mut hashes).is_empty());
    }

    #[test]
    fn a_forged_collision_is_rejected_by_the_token_recheck() {
        let mut c = PrefixCache::new(4, 2);
        // Register block 1 under the hash that [7, 8] would have, but holding other tokens.
        let h = hash_block(None, &[7, 8], None);
        assert!(c.insert(BlockId(1), h, None, &[1, 1], None));
        let mut hashes = Vec::new();
        assert!(c.lookup(&[7, 8, 9], None, 4, &mut hashes).is_empty());
    }

    #[test]
    fn a_forged_collision_across_salts_is_rejected_by_the_salt_recheck() {
        let mut c = PrefixCache::new(4, 2);
        // Block 1 holds tenant a's [7, 8], registered under the hash tenant b's [7, 8] has.
        let h = hash_block(None, &[7, 8], Some("b"));
        assert!(c.insert(BlockId(1), h, None, &[7, 8], Some("a")));
        assert!(!c.is_empty());
        assert!(c.lookup(&[7, 8, 9], Some("b"), 4, &mut Vec::new()).is_empty());
    }

    #[test]
    fn check_finds_a_map_entry_its_record_disagrees_with() {
        let mut c = PrefixCache::new(4, 2);
        assert!(c.insert(BlockId(1), hash_block(None, &[1, 2], None), None, &[1, 2], None));
        c.check().unwrap();
        c.records[1].hash ^= 1;
        assert!(c.check().unwrap_err().contains("disagrees"));
        c.records[1].hash ^= 1;
        c.records[1].flags = 0;
        assert!(c.check().unwrap_err().contains("disagrees"));
    }

    #[test]
    fn a_stale_parent_generation_is_a_miss() {
        let mut c = PrefixCache::new(4, 2);
        let h0 = hash_block(None, &[1, 2], None);
        let h1 = hash_block(Some(h0), &[3, 4], None);
        c.insert(BlockId(1), h0, None, &[1, 2], None);
        c.insert(BlockId(2), h1, Some(c.link_to(BlockId(1))), &[3, 4], None);
        // Block 1 is evicted and re-cached with the same tokens: block 2's KV was computed
        // against the old incarnation, so it must no longer chain.
        assert!(c.evict(BlockId(1)));
        c.insert(BlockId(1), h0, None, &[1, 2], None);
        let mut hashes = Vec::new();
        assert_eq!(c.lookup(&[1, 2, 3, 4], None, 4, &mut hashes), vec![BlockId(1)]);
        c.check().unwrap();
    }

    #[test]
    fn salts_live_and_die_with_their_first_block() {
        let mut c = PrefixCache::new(4, 2);
        let h = hash_block(None, &[1, 2], Some("tenant"));
        assert!(c.insert(BlockId(1), h, None, &[1, 2], Some("tenant")));
        // A salt on a block with a parent is not part of it (only first blocks are salted).
        let h2 = hash_block(Some(h), &[3, 4], None);
        assert!(c.insert(BlockId(2), h2, Some(c.link_to(BlockId(1))), &[3, 4], Some("tenant")));
        let mut hashes = Vec::new();
        assert_eq!(c.lookup(&[1, 2, 3, 4, 5], Some("tenant"), 4, &mut hashes), vec![BlockId(1), BlockId(2)]);
        assert!(c.lookup(&[1, 2, 3, 4, 5], Some("other"), 4, &mut Vec::new()).is_empty());
        c.check().unwrap();
        assert!(c.evict(BlockId(1)));
        c.check().unwrap();
        assert!(c.insert(BlockId(1), h, None, &[1, 2], Some("tenant")));
        c.clear();
        c.check().unwrap();
        assert!(c.is_empty() && !c.is_cached(BlockId(1)));
    }

    #[test]
    fn unregister_forgets_only_the_incarnation_it_names() {
        let mut c = PrefixCache::new(4, 2);
        let h = hash_block(None, &[1, 2], None);
        assert!(c.insert(BlockId(1), h, None, &[1, 2], None));
        let old = c.link_to(BlockId(1));
        assert!(c.unregister(old) && !c.is_cached(BlockId(1)) && c.is_empty());
        assert!(!c.unregister(old), "already gone");
        assert!(c.insert(BlockId(1), h, None, &[1, 2], None));
        assert!(!c.unregister(old), "re-cached since: a newer incarnation");
        assert!(c.is_cached(BlockId(1)));
        c.check().unwrap();
    }

    #[test]
    fn duplicate_content_is_cached_once() {
        let mut c = PrefixCache::new(4, 2);
        let h = hash_block(None, &[1, 2], None);
        assert!(c.insert(BlockId(1), h, None, &[1, 2], None));
        assert!(!c.insert(BlockId(2), h, None, &[1, 2], None));
        assert!(!c.is_cached(BlockId(2)));
        assert_eq!(c.len(), 1);
        assert!(c.evict(BlockId(1)));
        assert!(!c.evict(BlockId(1)));
        assert!(c.is_empty());
    }
}
