//! `IdMap`: a `HashMap` keyed by the engine's integer ids (requests, sequences), hashed with
//! splitmix64's finalizer instead of the default SipHash.
//!
//! Why: the text layer looks ids up several times per sampled row each step; SipHash's keyed
//! rounds cost more than the rest of such a lookup. The finalizer is a bijection that mixes every
//! input bit into every output bit, so sequential ids and ids differing only in high bits spread
//! over the buckets alike. Not keyed: the ids are assigned by the engine, not chosen by clients.
//! Costs: a few multiplications and shifts per hash.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

/// A `HashMap` from `u64` ids (see the module docs).
pub type IdMap<V> = HashMap<u64, V, BuildHasherDefault<IdHasher>>;

/// splitmix64's finalizer over the one `u64` written (other writes fold their bytes in first).
#[derive(Default, Clone, Copy, Debug)]
pub struct IdHasher(u64);

impl Hasher for IdHasher {
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(b);
        }
    }

    fn write_u64(&mut self, x: u64) {
        self.0 ^= x;
    }

    fn finish(&self) -> u64 {
        let mut z = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::hash::BuildHasher;

    #[test]
    fn ids_map_and_spread() {
        let mut m: IdMap<u32> = IdMap::default();
        for i in 0..10_000u64 {
            m.insert(i << 40, i as u32); // ids differing only in high bits
        }
        assert_eq!((0..10_000u64).filter(|&i| m[&(i << 40)] == i as u32).count(), 10_000);
        let h = BuildHasherDefault::<IdHasher>::default();
        let low: std::collections::HashSet<u64> = (0..4096u64).map(|i| h.hash_one(i << 40) & 4095).collect();
        assert!(low.len() > 2400, "high-bit ids fill the low bits: {}", low.len());
        let seq: std::collections::HashSet<u64> = (0..4096u64).map(|i| h.hash_one(i) >> 57).collect();
        assert_eq!(seq.len(), 128, "sequential ids cover every top-7-bit tag");
    }
}
