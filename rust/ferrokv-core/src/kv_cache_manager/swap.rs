//! Swapping: a preempted request's sequences move their GPU blocks to the CPU pool, and back
//! into fresh GPU blocks when the request resumes.
//!
//! Invariants: a swap is all or nothing (capacity is checked for the whole request before any
//! block moves); a block shared between the request's sequences moves once and stays shared;
//! a swapped-out sequence holds CPU blocks only and has no registration progress (its GPU
//! blocks were released; its chain hashes stay valid). Costs: O(blocks) per swap plus a hash
//! map over the request's distinct blocks, and one queued swap op per distinct block.

use super::{BlockIds, KvCacheManager, SeqKv};
use crate::block_pool::BlockId;
use std::collections::HashMap;

impl KvCacheManager {
    /// Moves all GPU blocks of one request's running sequences (`tables[i]` with block ids
    /// `ids[i]`, which the caller then drops with their rows) to the CPU pool. Blocks shared
    /// between them move once. Returns false, changing nothing, if the CPU pool is too small.
    pub fn swap_out<I: BlockIds>(&mut self, tables: &mut [&mut SeqKv], ids: &[I]) -> bool {
        debug_assert_eq!(tables.len(), ids.len());
        let mut map: HashMap<u32, BlockId> = HashMap::new();
        let unique = {
            let mut seen = std::collections::HashSet::new();
            ids.iter().flat_map(|t| (0..t.len()).map(|i| t.at(i))).filter(|b| seen.insert(b.0)).count()
        };
        if self.cpu.num_free() < unique {
            return false;
        }
        for (t, gpu) in tables.iter_mut().zip(ids) {
            debug_assert!(!t.is_swapped());
            for i in 0..gpu.len() {
                let g = gpu.at(i);
                let c = match map.get(&g.0) {
                    Some(&c) => {
                        self.cpu.incref(c);
                        c
                    }
                    None => {
                        let c = self.cpu.allocate().expect("capacity was checked");
                        map.insert(g.0, c);
                        self.ops.swap_out.push((g.0, c.0));
                        self.stats.blocks_swapped_out += 1;
                        c
                    }
                };
                t.cpu_blocks.push(c);
            }
            self.release_gpu(gpu);
            t.num_registered = 0;
            t.last_link = None;
        }
        true
    }

    /// Brings swapped sequences back into fresh GPU blocks, keeping `watermark` blocks free:
    /// the block ids of each, for the rows they are about to get. `None`, changing nothing, if
    /// they do not fit.
    pub fn swap_in(&mut self, tables: &mut [&mut SeqKv], watermark: usize) -> Option<Vec<Vec<BlockId>>> {
        let mut map: HashMap<u32, BlockId> = HashMap::new();
        let unique = {
            let mut seen = std::collections::HashSet::new();
            tables.iter().flat_map(|t| t.cpu_blocks.iter()).filter(|b| seen.insert(b.0)).count()
        };
        if self.gpu.num_free() < unique + watermark {
            return None;
        }
        let mut out = Vec::with_capacity(tables.len());
        for t in tables.iter_mut() {
            let mut blocks = Vec::with_capacity(t.cpu_blocks.len());
            for &c in &t.cpu_blocks {
                let g = match map.get(&c.0) {
                    Some(&g) => {
                        self.gpu.incref(g);
                        g
                    }
                    None => {
                        let g = self.pop_block().expect("capacity was checked");
                        map.insert(c.0, g);
                        self.ops.swap_in.push((c.0, g.0));
                        self.stats.blocks_swapped_in += 1;
                        g
                    }
                };
                blocks.push(g);
            }
            for &c in t.cpu_blocks.iter().rev() {
                self.cpu.decref(c, false);
            }
            t.cpu_blocks.clear();
            out.push(blocks);
        }
        Some(out)
    }
}
