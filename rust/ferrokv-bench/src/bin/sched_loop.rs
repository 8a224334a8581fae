//! The scheduler loop of `benches/scheduler_bench.py`, in pure Rust: same workload (same
//! generator, so the same requests for a seed: compare the checksums), same configurations,
//! same timing (schedule + reading the runner's arrays + update; the stand-in model that
//! returns token 7 per logits row is not timed) and the same tables. The difference between
//! the two programs' numbers is the cost of the Python boundary.
//!
//! ```text
//! cargo run --release -p ferrokv-bench --bin sched_loop -- [--sizes 64,256,1024,4096]
//!     [--requests N] [--seed S] [--fixed-steps N] [--quick] [--json]
//! ```
//!
//! 1. Workload: prompt/output lengths lognormal with means 160 / 340 (sigma 1.0, before
//!    clipping), clipped to [4, 2048]; request `r` has prompt tokens `r * 4096 + [0, len)`,
//!    `ignore_eos`, `max_tokens` = its output length; all queued at the start. Sizes S with
//!    max_num_seqs = S and 64 KV blocks of 16 tokens per sequence, S=1024 with 4x the
//!    requests, S=256 with 16 blocks per sequence (preemption).
//! 2. Fixed decode batch: S requests with 160-token prompts prefilled (untimed), then timed
//!    pure decode steps at exactly S running; S=1024 also with requests queued behind it
//!    (4,000 and 16,000 in total). The cache holds every sequence's prompt + all timed steps.
//!    The batches advance round-robin, 25 steps at a time (load from other processes on a
//!    shared machine hits all of them alike).

use ferrokv_core::{NewRequest, Scheduler, SchedulerConfig, SchedulerOutput};
use std::hint::black_box;
use std::time::Instant;

const BLOCK_SIZE: usize = 16;
const MAX_MODEL_LEN: usize = 4096;
const MAX_NUM_BATCHED_TOKENS: usize = 8192;
const MIN_LEN: f64 = 4.0;
const MAX_LEN: f64 = 2048.0;
const PROMPT_MEAN: f64 = 160.0;
const PROMPT_SIGMA: f64 = 1.0;
const OUTPUT_MEAN: f64 = 340.0;
const OUTPUT_SIGMA: f64 = 1.0;
const ROOMY_BLOCKS_PER_SEQ: usize = 64;
const TIGHT_BLOCKS_PER_SEQ: usize = 16;
const SAMPLED_TOKEN: i64 = 7;
const FIXED_PROMPT_LEN: usize = 160;
const FIXED_QUEUE_TOTALS: [usize; 2] = [4000, 16000];

fn default_requests(size: usize) -> usize {
    match size {
        64 => 1000,
        256 => 2000,
        1024 => 4000,
        4096 => 16000,
        s => (4 * s).clamp(1000, 16000),
    }
}

/// splitmix64 (Steele, Lea, Flood); the same generator as in scheduler_bench.py.
struct SplitMix64(u64);

impl SplitMix64 {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in (0, 1].
    fn uniform(&mut self) -> f64 {
        ((self.next_u64() >> 11) + 1) as f64 * (1.0 / (1u64 << 53) as f64)
    }
    fn normal(&mut self) -> f64 {
        let u1 = self.uniform();
        let u2 = self.uniform();
        (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
    }
    fn lognormal_len(&mut self, mean: f64, sigma: f64) -> usize {
        let mu = mean.ln() - sigma * sigma / 2.0;
        let x = (mu + sigma * self.normal()).exp();
        (x + 0.5).floor().clamp(MIN_LEN, MAX_LEN) as usize
    }
}

fn workload(num_requests: usize, seed: u64) -> (Vec<usize>, Vec<usize>) {
    let mut rng = SplitMix64(seed);
    let mut prompts = Vec::with_capacity(num_requests);
    let mut outputs = Vec::with_capacity(num_requests);
    for _ in 0..num_requests {
        prompts.push(rng.lognormal_len(PROMPT_MEAN, PROMPT_SIGMA));
        outputs.push(rng.lognormal_len(OUTPUT_MEAN, OUTPUT_SIGMA));
    }
    (prompts, outputs)
}

fn request(r: usize, prompt_len: usize, max_tokens: usize) -> NewRequest {
    let base = (r * 4096) as u32;
    let mut q = NewRequest::new(r as u64, (base..base + prompt_len as u32).collect(), max_tokens);
    q.ignore_eos = true;
    q
}

fn new_scheduler(size: usize, num_blocks: usize) -> Scheduler {
    Scheduler::new(SchedulerConfig {
        num_blocks,
        block_size: BLOCK_SIZE,
        max_num_seqs: size,
        max_num_batched_tokens: MAX_NUM_BATCHED_TOKENS.max(size),
        max_model_len: MAX_MODEL_LEN,
        enable_prefix_caching: true,
        ..Default::default()
    })
    .expect("valid config")
}

/// Reads what a runner copies to the device every step.
fn touch(out: &SchedulerOutput) -> usize {
    black_box(&out.input_ids);
    black_box(&out.positions);
    black_box(&out.slot_mapping);
    black_box(&out.query_start_loc);
    black_box(&out.seq_lens);
    black_box(&out.block_tables);
    black_box(&out.logits_indices);
    out.input_ids.len()
        + out.positions.len()
        + out.slot_mapping.len()
        + out.query_start_loc.len()
        + out.seq_lens.len()
        + out.max_blocks
        + out.logits_indices.len()
}

struct StepTimer {
    times_ns: Vec<f64>,
    seqs: Vec<f64>,
    widths: Vec<f64>,
    sampled: Vec<i64>,
    touched: usize,
}

struct StepInfo {
    num_seqs: usize,
    num_prefill_tokens: usize,
}

impl StepTimer {
    fn new() -> Self {
        StepTimer { times_ns: Vec::new(), seqs: Vec::new(), widths: Vec::new(), sampled: Vec::new(), touched: 0 }
    }
    fn step(&mut self, s: &mut Scheduler) -> StepInfo {
        let t0 = Instant::now();
        let out = s.schedule().expect("schedule");
        self.touched += touch(&out);
        let t1 = Instant::now();
        self.sampled.clear();
        self.sampled.resize(out.num_rows(), SAMPLED_TOKEN); // the stand-in model
        let info = StepInfo { num_seqs: out.num_seqs(), num_prefill_tokens: out.num_prefill_tokens };
        let width = out.max_blocks;
        let t2 = Instant::now();
        s.update(out.step_id, &self.sampled).expect("update");
        drop(out);
        let t3 = Instant::now();
        self.times_ns.push(((t1 - t0) + (t3 - t2)).as_nanos() as f64);
        self.seqs.push(info.num_seqs as f64);
        self.widths.push(width as f64);
        info
    }
}

#[derive(Default, Clone)]
struct Summary {
    steps: usize,
    mean_us: Option<f64>,
    p50_us: Option<f64>,
    p99_us: Option<f64>,
    us_per_seq_step: Option<f64>,
    mean_seqs: Option<f64>,
    mean_width: Option<f64>,
}

/// numpy's default (linear) percentile.
fn percentile(sorted: &[f64], q: f64) -> f64 {
    let pos = q / 100.0 * (sorted.len() - 1) as f64;
    let (lo, hi) = (pos.floor() as usize, pos.ceil() as usize);
    sorted[lo] + (sorted[hi] - sorted[lo]) * (pos - lo as f64)
}

fn summarize(times_ns: &[f64], seqs: &[f64], widths: &[f64]) -> Summary {
    if times_ns.is_empty() {
        return Summary::default();
    }
    let n = times_ns.len() as f64;
    let us: Vec<f64> = times_ns.iter().map(|t| t / 1e3).collect();
    let mut sorted = us.clone();
    sorted.sort_by(f64::total_cmp);
    let total: f64 = us.iter().sum();
    let seq_total: f64 = seqs.iter().sum();
    Summary {
        steps: us.len(),
        mean_us: Some(total / n),
        p50_us: Some(percentile(&sorted, 50.0)),
        p99_us: Some(percentile(&sorted, 99.0)),
        us_per_seq_step: Some(total / seq_total.max(1.0)),
        mean_seqs: Some(seq_total / n),
        mean_width: Some(widths.iter().sum::<f64>() / n),
    }
}

struct Config {
    label: String,
    size: usize,
    requests: usize,
    blocks_per_seq: usize,
}

impl Config {
    fn num_blocks(&self) -> usize {
        1 + self.size * self.blocks_per_seq
    }
}

struct WorkloadResult {
    label: String,
    size: usize,
    requests: usize,
    num_blocks: usize,
    checksum: (usize, usize),
    all: Summary,
    steady: Summary,
    steps: u64,
    preemptions: u64,
    max_running_seqs: u64,
    prefill_computed: u64,
    prefill_min: u64,
    output_tokens_recomputed: u64,
    cached_prompt_tokens: u64,
    first_admission_cached_tokens: u64,
    wall_s: f64,
}

fn run_workload(cfg: &Config, seed: u64) -> WorkloadResult {
    let (prompts, outputs) = workload(cfg.requests, seed);
    let mut s = new_scheduler(cfg.size, cfg.num_blocks());
    for (r, (&p, &o)) in prompts.iter().zip(&outputs).enumerate() {
        s.add_request(request(r, p, o)).expect("add_request");
    }
    let mut timer = StepTimer::new();
    let mut steady = Vec::new();
    let wall0 = Instant::now();
    while s.has_unfinished() {
        let waiting = s.num_waiting() > 0; // before schedule(): what it had to choose from
        let info = timer.step(&mut s);
        steady.push(waiting && info.num_prefill_tokens == 0 && info.num_seqs > 0);
    }
    let wall_s = wall0.elapsed().as_secs_f64();
    let st = s.stats();
    assert_eq!(st.requests_finished as usize, cfg.requests);
    assert_eq!(s.num_free_blocks(), cfg.num_blocks() - 1);
    assert_eq!(st.generated_tokens as usize, outputs.iter().sum::<usize>());
    s.check_invariants().expect("invariants");
    black_box(timer.touched);
    let pick = |v: &[f64]| -> Vec<f64> { v.iter().zip(&steady).filter(|(_, &m)| m).map(|(&x, _)| x).collect() };
    WorkloadResult {
        label: cfg.label.clone(),
        size: cfg.size,
        requests: cfg.requests,
        num_blocks: cfg.num_blocks(),
        checksum: (prompts.iter().sum(), outputs.iter().sum()),
        all: summarize(&timer.times_ns, &timer.seqs, &timer.widths),
        steady: summarize(&pick(&timer.times_ns), &pick(&timer.seqs), &pick(&timer.widths)),
        steps: st.steps,
        preemptions: st.preemptions,
        max_running_seqs: st.max_running_seqs,
        prefill_computed: st.prompt_tokens_computed + st.output_tokens_recomputed,
        prefill_min: st.prompt_tokens - st.first_admission_cached_tokens,
        output_tokens_recomputed: st.output_tokens_recomputed,
        cached_prompt_tokens: st.cached_prompt_tokens,
        first_admission_cached_tokens: st.first_admission_cached_tokens,
        wall_s,
    }
}

struct FixedResult {
    label: String,
    size: usize,
    requests: usize,
    decode: Summary,
}

/// `size` decode sequences running, `total_requests - size` queued behind them.
fn setup_fixed(size: usize, total_requests: usize, steps: usize) -> Scheduler {
    // Room for every sequence to decode all timed steps: no preemption, nobody finishes (the
    // first admitted start decoding while the last are still prefilling: at most `ramp` steps,
    // as the running sequences' decode tokens share the budget).
    let budget = MAX_NUM_BATCHED_TOKENS.max(size);
    assert!(budget > size, "the fixed batch needs max_num_batched_tokens > size");
    let ramp = (size * FIXED_PROMPT_LEN).div_ceil(budget - size) + 2;
    let max_tokens = steps + ramp + 2;
    let blocks_per_seq = (FIXED_PROMPT_LEN + max_tokens).div_ceil(BLOCK_SIZE);
    let mut s = new_scheduler(size, 1 + size * blocks_per_seq);
    for r in 0..size {
        s.add_request(request(r, FIXED_PROMPT_LEN, max_tokens)).expect("add_request");
    }
    loop {
        let out = s.schedule().expect("schedule");
        s.update(out.step_id, &vec![SAMPLED_TOKEN; out.num_rows()]).expect("update");
        if out.num_prefill_tokens == 0 && s.num_waiting() == 0 {
            break;
        }
    }
    for r in size..total_requests {
        s.add_request(request(r, FIXED_PROMPT_LEN, max_tokens)).expect("add_request");
    }
    s
}

/// Times `steps` decode steps of each (size, total_requests) batch. The batches advance
/// round-robin, `CHUNK` steps at a time, so that load from other processes hits them alike.
fn run_fixed(configs: &[(usize, usize)], steps: usize) -> Vec<FixedResult> {
    const CHUNK: usize = 25;
    let mut runs: Vec<(Scheduler, StepTimer)> =
        configs.iter().map(|&(size, total)| (setup_fixed(size, total, steps), StepTimer::new())).collect();
    for lo in (0..steps).step_by(CHUNK) {
        for (&(size, _), (s, timer)) in configs.iter().zip(runs.iter_mut()) {
            for _ in lo..(lo + CHUNK).min(steps) {
                let info = timer.step(s);
                assert!(
                    info.num_seqs == size && info.num_prefill_tokens == 0,
                    "step {} of {steps}: {} seqs, {} prefill tokens",
                    timer.times_ns.len(),
                    info.num_seqs,
                    info.num_prefill_tokens
                );
            }
        }
    }
    configs
        .iter()
        .zip(runs)
        .map(|(&(size, total), (s, timer))| {
            assert_eq!(s.num_waiting(), total - size);
            black_box(timer.touched);
            FixedResult {
                label: format!("S={size} q={}", total - size),
                size,
                requests: total,
                decode: summarize(&timer.times_ns, &timer.seqs, &timer.widths),
            }
        })
        .collect()
}

fn f(x: Option<f64>, width: usize, prec: usize) -> String {
    match x {
        Some(v) => format!("{v:>width$.prec$}"),
        None => format!("{:>width$}", "-"),
    }
}

fn json_num(x: Option<f64>) -> String {
    x.map_or("null".into(), |v| format!("{v}"))
}

fn json_summary(s: &Summary) -> String {
    format!(
        "{{\"steps\": {}, \"mean_us\": {}, \"p50_us\": {}, \"p99_us\": {}, \"us_per_seq_step\": {}, \"mean_seqs\": {}, \"mean_width\": {}}}",
        s.steps,
        json_num(s.mean_us),
        json_num(s.p50_us),
        json_num(s.p99_us),
        json_num(s.us_per_seq_step),
        json_num(s.mean_seqs),
        json_num(s.mean_width)
    )
}

fn workload_json(r: &WorkloadResult) -> String {
    let waste = (r.prefill_min > 0).then(|| r.prefill_computed as f64 / r.prefill_min as f64);
    format!(
        "{{\"kind\": \"workload\", \"impl\": \"rust\", \"label\": \"{}\", \"size\": {}, \"requests\": {}, \"num_blocks\": {}, \
         \"checksum\": [{}, {}], \"all\": {}, \"decode_steady\": {}, \"steps\": {}, \"preemptions\": {}, \
         \"max_running_seqs\": {}, \"prefill_computed\": {}, \"prefill_min\": {}, \"output_tokens_recomputed\": {}, \"cached_prompt_tokens\": {}, \
         \"first_admission_cached_tokens\": {}, \"waste_ratio\": {}, \"wall_s\": {}}}",
        r.label,
        r.size,
        r.requests,
        r.num_blocks,
        r.checksum.0,
        r.checksum.1,
        json_summary(&r.all),
        json_summary(&r.steady),
        r.steps,
        r.preemptions,
        r.max_running_seqs,
        r.prefill_computed,
        r.prefill_min,
        r.output_tokens_recomputed,
        r.cached_prompt_tokens,
        r.first_admission_cached_tokens,
        json_num(waste),
        r.wall_s
    )
}

fn fixed_json(r: &FixedResult) -> String {
    format!(
        "{{\"kind\": \"fixed_decode\", \"impl\": \"rust\", \"label\": \"{}\", \"size\": {}, \"requests\": {}, \"queued\": {}, \"decode\": {}}}",
        r.label,
        r.size,
        r.requests,
        r.requests - r.size,
        json_summary(&r.decode)
    )
}

fn print_tables(work: &[WorkloadResult], fixed: &[FixedResult]) {
    if !work.is_empty() {
        let hdr = format!(
            "{:<16} {:>6} {:>5} | {:>9} {:>6} {:>7} {:>6} {:>5} {:>4} | {:>16} {:>6} {:>6} {:>7} {:>6} {:>5} {:>4} | {:>7} {:>6} {:>20} {:>5}",
            "workload (rust)", "reqs", "steps", "all: mean", "p50", "p99", "us/seq", "seqs", "M",
            "decode steady: n", "mean", "p50", "p99", "us/seq", "seqs", "M", "preempt", "maxrun", "prefill computed/min", "waste"
        );
        println!("{hdr}");
        println!("{}", "-".repeat(hdr.chars().count()));
        for r in work {
            let (a, d) = (&r.all, &r.steady);
            let waste = (r.prefill_min > 0).then(|| r.prefill_computed as f64 / r.prefill_min as f64);
            println!(
                "{:<16} {:>6} {:>5} | {} {} {} {} {} {} | {:>16} {} {} {} {} {} {} | {:>7} {:>6} {:>20} {}",
                r.label,
                r.requests,
                r.steps,
                f(a.mean_us, 9, 1),
                f(a.p50_us, 6, 1),
                f(a.p99_us, 7, 1),
                f(a.us_per_seq_step, 6, 3),
                f(a.mean_seqs, 5, 0),
                f(a.mean_width, 4, 0),
                d.steps,
                f(d.mean_us, 6, 1),
                f(d.p50_us, 6, 1),
                f(d.p99_us, 7, 1),
                f(d.us_per_seq_step, 6, 3),
                f(d.mean_seqs, 5, 0),
                f(d.mean_width, 4, 0),
                r.preemptions,
                r.max_running_seqs,
                format!("{}/{}", r.prefill_computed, r.prefill_min),
                f(waste, 5, 3),
            );
        }
        let sums: Vec<String> =
            work.iter().map(|r| format!("{}=[{}, {}]", r.label, r.checksum.0, r.checksum.1)).collect();
        println!("checksums (sum prompt, sum output): {}", sums.join(", "));
    }
    if !fixed.is_empty() {
        println!();
        let hdr = format!(
            "{:<18} {:>6} {:>5} | {:>7} {:>7} {:>7} {:>6} {:>4}",
            "fixed decode (rust)", "reqs", "steps", "mean", "p50", "p99", "us/seq", "M"
        );
        println!("{hdr}");
        println!("{}", "-".repeat(hdr.chars().count()));
        for r in fixed {
            let d = &r.decode;
            println!(
                "{:<18} {:>6} {:>5} | {} {} {} {} {}",
                r.label,
                r.requests,
                d.steps,
                f(d.mean_us, 7, 1),
                f(d.p50_us, 7, 1),
                f(d.p99_us, 7, 1),
                f(d.us_per_seq_step, 6, 3),
                f(d.mean_width, 4, 0)
            );
        }
    }
    println!(
        "µs per step of schedule() + reading the arrays + update() (pure Rust, no Python); us/seq: µs per \
         sequence-step; seqs: mean sequences per step; M: mean block-table width"
    );
}

struct Args {
    sizes: Vec<usize>,
    requests: Option<usize>,
    seed: u64,
    fixed_steps: Option<usize>,
    quick: bool,
    json: bool,
}

fn parse_args() -> Args {
    let mut a = Args {
        sizes: vec![64, 256, 1024, 4096],
        requests: None,
        seed: 0,
        fixed_steps: None,
        quick: false,
        json: false,
    };
    let mut it = std::env::args().skip(1);
    let usage =
        "usage: sched_loop [--sizes 64,256,1024,4096] [--requests N] [--seed S] [--fixed-steps N] [--quick] [--json]";
    while let Some(arg) = it.next() {
        let (key, inline) = match arg.split_once('=') {
            Some((k, v)) => (k.to_string(), Some(v.to_string())),
            None => (arg.clone(), None),
        };
        let mut value = |name: &str| {
            inline.clone().or_else(|| it.next()).unwrap_or_else(|| panic!("{name} needs a value\n{usage}"))
        };
        match key.as_str() {
            "--sizes" => {
                a.sizes =
                    value("--sizes").split(',').filter(|x| !x.is_empty()).map(|x| x.parse().expect(usage)).collect()
            }
            "--requests" => a.requests = Some(value("--requests").parse().expect(usage)),
            "--seed" => a.seed = value("--seed").parse().expect(usage),
            "--fixed-steps" => a.fixed_steps = Some(value("--fixed-steps").parse().expect(usage)),
            "--quick" => a.quick = true,
            "--json" => a.json = true,
            // `cargo bench`/`cargo test` may pass harness flags; ignore them.
            "--bench" | "--nocapture" => {}
            "-h" | "--help" => {
                println!("{usage}");
                std::process::exit(0);
            }
            other => panic!("unknown argument {other}\n{usage}"),
        }
    }
    a
}

fn workload_configs(a: &Args) -> Vec<Config> {
    let count = |size: usize| {
        let n = a.requests.unwrap_or_else(|| default_requests(size));
        if a.quick {
            (size + size / 2).max(n / 8)
        } else {
            n
        }
    };
    let mut out: Vec<Config> = a
        .sizes
        .iter()
        .map(|&size| Config {
            label: format!("S={size}"),
            size,
            requests: count(size),
            blocks_per_seq: ROOMY_BLOCKS_PER_SEQ,
        })
        .collect();
    if a.sizes.contains(&1024) {
        out.push(Config {
            label: "S=1024 x4 reqs".into(),
            size: 1024,
            requests: count(1024) * 4,
            blocks_per_seq: ROOMY_BLOCKS_PER_SEQ,
        });
    }
    let tight = if a.sizes.contains(&256) { 256 } else { *a.sizes.iter().min().expect("at least one size") };
    out.push(Config {
        label: format!("S={tight} tight KV"),
        size: tight,
        requests: count(tight),
        blocks_per_seq: TIGHT_BLOCKS_PER_SEQ,
    });
    out
}

fn fixed_configs(a: &Args) -> Vec<(usize, usize)> {
    let mut out: Vec<(usize, usize)> = a.sizes.iter().map(|&s| (s, s)).collect();
    if a.sizes.contains(&1024) {
        out.extend(FIXED_QUEUE_TOTALS.iter().map(|&t| (1024, t)));
    }
    out
}

fn main() {
    let a = parse_args();
    let fixed_steps = a.fixed_steps.unwrap_or(if a.quick { 100 } else { 500 });
    let mut work = Vec::new();
    for cfg in workload_configs(&a) {
        let r = run_workload(&cfg, a.seed);
        if a.json {
            println!("{}", workload_json(&r));
        } else {
            eprintln!("  {}: {} steps in {:.1} s", r.label, r.steps, r.wall_s);
        }
        work.push(r);
    }
    let fixed = run_fixed(&fixed_configs(&a), fixed_steps);
    if a.json {
        for r in &fixed {
            println!("{}", fixed_json(r));
        }
    }
    if !a.json {
        print_tables(&work, &fixed);
    }
}
