//! Automatic prefix caching: full blocks are findable by a chained hash of their tokens.
//!
//! Invariants:
//! - `hash(block i) = xxh3_64(hash(block i-1) || tokens_i)`; the first block of a sequence
//!   hashes a root marker and the request's optional `cache_salt` instead of a parent hash, so
//!   requests with different salts never share a block.
//! - `map[h] == b` iff `meta[b]` is `Some` with hash `h`. A block is cached at most once.
//! - A hit is only served after an exact re-check: the block's stored tokens equal the asked
//!   tokens, its parent link names the previous matched block *and that block's cache
//!   generation*, and a first block's salt matches. A 64-bit collision can therefore never serve
//!   the wrong KV, even after the parent was evicted and its slot re-cached with other tokens.
//!
//! Costs: one xxh3 over `block_size` tokens per full block, one map probe per looked-up block,
//! one token copy per cached block into a preallocated arena (no allocation after startup
//! beyond map growth). The map's keys are already hashes, so it uses an identity hasher.

use crate::block_pool::BlockId;
use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use xxhash_rust::xxh3::Xxh3;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct BlockHash(pub u64);

const ROOT_MARKER: u64 = 0x6665_7272_6f6b_7600; // "ferrokv\0": the parent of first blocks

/// Stable chained hash of one full block.
pub fn hash_block(parent: Option<BlockHash>, tokens: &[u32], salt: Option<&str>) -> BlockHash {
    let mut h = Xxh3::new();
    match parent {
        Some(p) => h.update(&p.0.to_le_bytes()),
        None => {
            h.update(&ROOT_MARKER.to_le_bytes());
            if let Some(s) = salt {
                h.update(&(s.len() as u64).to_le_bytes());
                h.update(s.as_bytes());
            }
        }
    }
    for t in tokens {
        h.update(&t.to_le_bytes());
    }
    BlockHash(h.digest())
}

#[derive(Default)]
struct IdentityHasher(u64);

impl Hasher for IdentityHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, _: &[u8]) {
        unreachable!("only u64 keys are hashed");
    }
    fn write_u64(&mut self, v: u64) {
        self.0 = v;
    }
}

type IdentityMap = HashMap<u64, BlockId, BuildHasherDefault<IdentityHasher>>;

/// Link from a cached block to the cached block before it, pinned to that block's generation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ParentLink {
    pub block: BlockId,
    pub generation: u32,
}

#[derive(Debug, Clone)]
struct CachedBlock {
    hash: BlockHash,
    parent: Option<ParentLink>,
    salt: Option<Box<str>>,
}

pub struct PrefixCache {
    block_size: usize,
    map: IdentityMap,
    meta: Vec<Option<CachedBlock>>,
    generation: Vec<u32>,
    /// `block_size` tokens per block: what each cached block holds, for the hit re-check.
    tokens: Vec<u32>,
}

impl PrefixCache {
    pub fn new(num_blocks: usize, block_size: usize) -> Self {
        PrefixCache {
            block_size,
            map: IdentityMap::default(),
            meta: vec![None; num_blocks],
            generation: vec![0; num_blocks],
            tokens: vec![0; num_blocks * block_size],
        }
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    pub fn is_cached(&self, b: BlockId) -> bool {
        self.meta[b.0 as usize].is_some()
    }

    pub fn link_to(&self, b: BlockId) -> ParentLink {
        ParentLink { block: b, generation: self.generation[b.0 as usize] }
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
            let Some(&b) = self.map.get(&hashes[i].0) else { break };
            let m = self.meta[b.0 as usize].as_ref().expect("map and meta agree");
            let same = m.parent == parent
                && self.block_tokens(b) == chunk
                && (i > 0 || m.salt.as_deref() == salt);
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
        if self.meta[b.0 as usize].is_some() || self.map.contains_key(&hash.0) {
            return false;
        }
        self.map.insert(hash.0, b);
        self.generation[b.0 as usize] = self.generation[b.0 as usize].wrapping_add(1);
        self.meta[b.0 as usize] = Some(CachedBlock {
            hash,
            parent,
            salt: if parent.is_none() { salt.map(Into::into) } else { None },
        });
        let at = b.0 as usize * self.block_size;
        self.tokens[at..at + self.block_size].copy_from_slice(tokens);
        true
    }

    fn block_tokens(&self, b: BlockId) -> &[u32] {
        let at = b.0 as usize * self.block_size;
        &self.tokens[at..at + self.block_size]
    }

    /// Forgets whatever prefix block `b` held (it is being reused for other tokens).
    pub fn evict(&mut self, b: BlockId) -> bool {
        match self.meta[b.0 as usize].take() {
            Some(m) => {
                let removed = self.map.remove(&m.hash.0);
                debug_assert_eq!(removed, Some(b));
                true
            }
            None => false,
        }
    }

    /// Drops every cached prefix.
    pub fn clear(&mut self) {
        self.map.clear();
        for m in self.meta.iter_mut() {
            *m = None;
        }
    }

    pub fn check(&self) -> Result<(), String> {
        for (&h, &b) in &self.map {
            match &self.meta[b.0 as usize] {
                Some(m) if m.hash.0 == h => {}
                _ => return Err(format!("map entry {h:#x} -> block {} disagrees with its meta", b.0)),
            }
        }
        let cached = self.meta.iter().filter(|m| m.is_some()).count();
        if cached != self.map.len() {
            return Err(format!("{} blocks have meta but the map has {}", cached, self.map.len()));
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
        // Pinned value: the hash is part of the cache's contract across runs and machines.
        assert_eq!(hash_block(None, &[], None), hash_block(None, &[], None));
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
