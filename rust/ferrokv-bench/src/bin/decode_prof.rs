//! Profiling aid: steady decode steps at a fixed batch (schedule and update timed apart).
//!
//! ```text
//! cargo run --release -p ferrokv-bench --bin decode_prof -- [SEQS=1024] [STEPS=600]
//! ```
//!
//! `NO_CACHE=1` turns prefix caching off; `SLOWEST=1` also prints the 12 slowest steps.
use ferrokv_core::*;
use std::time::Instant;
fn main() {
    let size: usize = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(1024);
    let mut s = Scheduler::new(SchedulerConfig {
        num_blocks: 1 + size * 300,
        block_size: 16,
        max_num_seqs: size,
        max_num_batched_tokens: 8192,
        max_model_len: 4096,
        enable_prefix_caching: std::env::var_os("NO_CACHE").is_none(),
        ..Default::default()
    })
    .unwrap();
    for r in 0..size {
        let base = (r * 4096) as u32;
        let mut q = NewRequest::new(r as u64, (base..base + 160).collect(), 4000);
        q.ignore_eos = true;
        s.add_request(q).unwrap();
    }
    loop {
        let out = s.schedule().unwrap();
        s.update(out.step_id, &vec![7; out.num_rows()]).unwrap();
        if out.num_prefill_tokens == 0 && s.num_waiting() == 0 {
            break;
        }
    }
    let steps: usize = std::env::args().nth(2).and_then(|a| a.parse().ok()).unwrap_or(600);
    let sampled = vec![7i64; size];
    let (mut a, mut b) = (vec![], vec![]);
    for _ in 0..steps {
        let t = Instant::now();
        let out = s.schedule().unwrap();
        std::hint::black_box(&out);
        let t2 = Instant::now();
        s.update(out.step_id, &sampled).unwrap();
        let t3 = Instant::now();
        drop(out);
        a.push((t2 - t).as_secs_f64() * 1e6);
        b.push((t3 - t2).as_secs_f64() * 1e6);
    }
    let total: Vec<f64> = a.iter().zip(&b).map(|(x, y)| x + y).collect();
    let mut sorted = total.clone();
    sorted.sort_by(|x, y| x.partial_cmp(y).unwrap());
    a.sort_by(|x, y| x.partial_cmp(y).unwrap());
    b.sort_by(|x, y| x.partial_cmp(y).unwrap());
    let q = |v: &[f64], p: f64| v[((v.len() - 1) as f64 * p) as usize];
    println!(
        "S={size}: schedule p50 {:.1} us, update p50 {:.1} us; step mean {:.1} p50 {:.1} p90 {:.1} p99 {:.1} max {:.1} us",
        q(&a, 0.5),
        q(&b, 0.5),
        total.iter().sum::<f64>() / total.len() as f64,
        q(&sorted, 0.5),
        q(&sorted, 0.9),
        q(&sorted, 0.99),
        q(&sorted, 1.0)
    );
    if std::env::var_os("SLOWEST").is_some() {
        let mut idx: Vec<usize> = (0..total.len()).collect();
        idx.sort_by(|&i, &j| total[j].partial_cmp(&total[i]).unwrap());
        eprintln!("slowest steps (index: us): {:?}", idx.iter().take(12).map(|&i| (i, total[i] as u32)).collect::<Vec<_>>());
    }
}
