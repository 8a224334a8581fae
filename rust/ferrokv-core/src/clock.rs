//! The core's clock: monotonic seconds (f64) on the scale of Python's `time.monotonic()`, so
//! that the per-request timestamps the scheduler records compare with the engine's own.
//!
//! `now()` is an anchor plus the `Instant` time elapsed since a process-wide epoch (taken on
//! first use). The bindings call `anchor` once at module init with `time.monotonic()`; without
//! it the scale starts at 0.0 at the epoch. Invariants: `now()` never goes backwards between
//! anchors. Costs: one `Instant::now()` per call; the scheduler reads it once per `schedule()`,
//! `update()` or other entry point, never per row.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::OnceLock;
use std::time::Instant;

static EPOCH: OnceLock<Instant> = OnceLock::new();
/// f64 bits of the clock's value at the epoch.
static ANCHOR: AtomicU64 = AtomicU64::new(0);

fn since_epoch() -> f64 {
    EPOCH.get_or_init(Instant::now).elapsed().as_secs_f64()
}

/// Seconds on the anchored monotonic scale.
pub fn now() -> f64 {
    f64::from_bits(ANCHOR.load(Relaxed)) + since_epoch()
}

/// Puts the clock on another monotonic scale: `now()` reads `python_monotonic_now` at this
/// instant (the bindings pass Python's `time.monotonic()`).
pub fn anchor(python_monotonic_now: f64) {
    ANCHOR.store((python_monotonic_now - since_epoch()).to_bits(), Relaxed);
}

#[cfg(test)]
mod tests {
    #[test]
    fn now_is_monotonic_and_follows_the_anchor() {
        let a = super::now();
        let b = super::now();
        assert!(b >= a);
        super::anchor(1000.0);
        let c = super::now();
        assert!((1000.0..1001.0).contains(&c), "{c}");
        assert!(super::now() >= c);
    }
}
