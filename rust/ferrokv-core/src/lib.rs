//! ferrokv-core: the paged KV-cache allocator, copy-on-write prefix sharing and the
//! iteration-level scheduler of ferrokv, in pure Rust (no Python types).
//!
//! Layers, each only calling the one below: `scheduler` → (`kv_cache_manager` →
//! (`block_pool`, `prefix_cache`), `batch`).

pub mod batch;
pub mod block_pool;
pub mod clock;
pub mod error;
pub mod hash_index;
pub mod id_map;
pub mod kv_cache_manager;
pub mod output;
pub mod prefetch;
pub mod prefix_cache;
pub mod request;
pub mod sampling;
pub mod scheduler;

pub use block_pool::{BlockId, NULL_BLOCK};
pub use error::{CoreError, CoreResult};
pub use id_map::IdMap;
pub use output::{BlockTables, FinishedSeq, RequestTimes, SchedulerOutput};
pub use request::FinishReason;
pub use sampling::{SamplingColumns, SamplingSpec};
pub use scheduler::{
    KvCounts, KvUsage, Named, NewRequest, Policy, PreemptionMode, Scheduler, SchedulerConfig, SchedulerStats,
    STEP_TOKEN_BOUNDS,
};
