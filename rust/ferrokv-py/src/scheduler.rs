//! `Scheduler`: the core scheduler behind the GIL-free calls (`schedule`, `update`,
//! `cancel_step` run with the GIL released), with its text layer once one is attached
//! (`attach_text`): `update` then detokenizes the step and ends sequences on stop strings, and
//! every ended sequence's record carries its text.

use ferrokv_core::{CoreError, FinishedSeq, Named, NewRequest, Policy, PreemptionMode, SamplingSpec, Scheduler, SchedulerConfig,
                   STEP_TOKEN_BOUNDS};
use ferrokv_text::{EndedText, SchedulerText, StopStrings};

use crate::*;

/// What a size argument accepts (the core then checks its own bounds).
const SIZE_RANGE: &str = "must be in [0, 2^63)";
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyString};

/// The iteration-level scheduler over a paged KV cache. See `_core.pyi`.
#[pyclass(module = "ferrokv._core", name = "Scheduler")]
pub(crate) struct PyScheduler {
    pub(crate) inner: Scheduler,
    /// The text layer (`attach_text`).
    text: Option<SchedulerText>,
    /// A step whose text work `update` deferred, or its untaken results (and the row buffers
    /// reused from step to step).
    deferred: Deferred,
}

/// `take_step_results()`: (records, streaming rows, their text deltas).
type StepResultsTuple<'py> = (Vec<PyFinishedSequence>, Bound<'py, numpy::PyArray1<i64>>, Vec<String>);

impl PyScheduler {
    /// Appends the step's tokens now (GIL released) and defers its text work, in the buffers
    /// the previous step gave back.
    fn update_deferred(
        &mut self,
        py: Python<'_>,
        output: PyRef<'_, PySchedulerOutput>,
        sampled_token_ids: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let step_id = output.step_id;
        let mut step = self.deferred.spare_step();
        if self.text.is_some() {
            output.row_req_ids.copy_into(py, &mut step.row_reqs);
            output.row_seq_ids.copy_into(py, &mut step.row_seqs);
        }
        drop(output);
        let taken = token_ids_into("sampled_token_ids", sampled_token_ids, &mut step.sampled);
        let inner = &mut self.inner;
        let done = taken.and_then(|()| py.detach(|| inner.update(step_id, &step.sampled)).map_err(to_py_err));
        match done {
            Ok(done) => {
                step.done = done;
                self.deferred.defer(step);
                Ok(())
            }
            Err(e) => {
                self.deferred.give_back(step);
                Err(e)
            }
        }
    }

    /// Records as Python objects, with their text when the text layer gave some.
    fn with_text(done: Vec<FinishedSeq>, texts: Option<Vec<Option<EndedText>>>) -> Vec<PyFinishedSequence> {
        match texts {
            None => done.into_iter().map(Into::into).collect(),
            Some(texts) => done.into_iter().zip(texts).map(|(f, t)| PyFinishedSequence::with_ended_text(f, t)).collect(),
        }
    }

    /// `abort` (`finished`: `finish_request`): ends a request, with the text its sequences had.
    fn end_by_caller(&mut self, py: Python<'_>, request_id: i64, finished: bool) -> PyResult<Vec<PyFinishedSequence>> {
        let id = non_negative("request_id", request_id)?;
        self.flush_deferred(py);
        let ended = if finished { self.inner.finish_request(id) } else { self.inner.abort(id) }.map_err(to_py_err)?;
        let texts = self.text.as_mut().map(|t| t.end(&ended));
        Ok(Self::with_text(ended, texts))
    }

    /// Runs a deferred step's text work (GIL released) before a call that changes sequences.
    fn flush_deferred(&mut self, py: Python<'_>) {
        let (deferred, inner, text) = (&mut self.deferred, &mut self.inner, &mut self.text);
        py.detach(|| deferred.flush(inner, text));
    }
}

#[pymethods]
impl PyScheduler {
    /// Keywords left out take `SchedulerConfig::default()` (also `_core.SCHEDULER_DEFAULTS`).
    #[new]
    #[pyo3(signature = (num_blocks, block_size=None, max_num_seqs=None, max_num_batched_tokens=None,
                        max_model_len=None, enable_prefix_caching=None, preemption_mode=None,
                        num_cpu_blocks=None, policy=None, watermark=None, admission_headroom=None,
                        sampling_seed=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        num_blocks: &Bound<'_, PyAny>,
        block_size: Option<&Bound<'_, PyAny>>,
        max_num_seqs: Option<&Bound<'_, PyAny>>,
        max_num_batched_tokens: Option<&Bound<'_, PyAny>>,
        max_model_len: Option<&Bound<'_, PyAny>>,
        enable_prefix_caching: Option<bool>,
        preemption_mode: Option<&str>,
        num_cpu_blocks: Option<&Bound<'_, PyAny>>,
        policy: Option<&str>,
        watermark: Option<f64>,
        admission_headroom: Option<f64>,
        sampling_seed: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let d = SchedulerConfig::default();
        let size = |field: &'static str, v: Option<&Bound<'_, PyAny>>, default: usize| {
            opt_int_arg(field, v, SIZE_RANGE).map(|v| v.unwrap_or(default))
        };
        let cfg = SchedulerConfig {
            num_blocks: int_arg("num_blocks", num_blocks, SIZE_RANGE)?,
            block_size: size("block_size", block_size, d.block_size)?,
            max_num_seqs: size("max_num_seqs", max_num_seqs, d.max_num_seqs)?,
            max_num_batched_tokens: size("max_num_batched_tokens", max_num_batched_tokens, d.max_num_batched_tokens)?,
            max_model_len: size("max_model_len", max_model_len, d.max_model_len)?,
            enable_prefix_caching: enable_prefix_caching.unwrap_or(d.enable_prefix_caching),
            preemption_mode: preemption_mode
                .map_or(Ok(d.preemption_mode), PreemptionMode::parse)
                .map_err(to_py_err)?,
            num_cpu_blocks: size("num_cpu_blocks", num_cpu_blocks, d.num_cpu_blocks)?,
            policy: policy.map_or(Ok(d.policy), Policy::parse).map_err(to_py_err)?,
            watermark: watermark.unwrap_or(d.watermark),
            admission_headroom: admission_headroom.unwrap_or(d.admission_headroom),
            sampling_seed: sampling_seed.filter(|s| !s.is_none()).map(|s| any_int_as_u64("sampling_seed", s)).transpose()?.unwrap_or(d.sampling_seed),
        };
        Ok(PyScheduler {
            inner: Scheduler::new(cfg).map_err(to_py_err)?,
            text: None,
            deferred: Deferred::default(),
        })
    }

    #[pyo3(signature = (request_id, prompt_token_ids, max_tokens, *, n=1, priority=0, eos_token_id=None,
                        stop_token_ids=None, min_tokens=0, ignore_eos=false, min_tokens_bans=None, cache_salt=None, reserve_seqs=0,
                        stop=None, include_stop_str_in_output=false, skip_special_tokens=true, stream_text=false,
                        temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, presence_penalty=0.0,
                        frequency_penalty=0.0, repetition_penalty=1.0, seed=None, logprobs=None, bad_words=None,
                        has_logit_bias=false, skip_cache_hits=false, detokenize=true))]
    #[allow(clippy::too_many_arguments)]
    fn add_request(
        &mut self,
        py: Python<'_>,
        request_id: &Bound<'_, PyAny>,
        prompt_token_ids: &Bound<'_, PyAny>,
        max_tokens: &Bound<'_, PyAny>,
        n: i64,
        priority: i64,
        eos_token_id: Option<&Bound<'_, PyAny>>,
        stop_token_ids: Option<&Bound<'_, PyAny>>,
        min_tokens: i64,
        ignore_eos: bool,
        min_tokens_bans: Option<&Bound<'_, PyAny>>,
        cache_salt: Option<&Bound<'_, PyAny>>,
        reserve_seqs: i64,
        stop: Option<&Bound<'_, PyAny>>,
        include_stop_str_in_output: bool,
        skip_special_tokens: bool,
        stream_text: bool,
        temperature: f64,
        top_k: i64,
        top_p: f64,
        min_p: f64,
        presence_penalty: f64,
        frequency_penalty: f64,
        repetition_penalty: f64,
        seed: Option<&Bound<'_, PyAny>>,
        logprobs: Option<i64>,
        bad_words: Option<&Bound<'_, PyAny>>,
        has_logit_bias: bool,
        skip_cache_hits: bool,
        detokenize: bool,
    ) -> PyResult<()> {
        let stop = stop_strings(stop, self.text.is_some())?;
        let request_id: u64 = int_arg("request_id", request_id, "must be in [0, 2^63)")?;
        let max_tokens: i64 = int_arg("max_tokens", max_tokens, "must be >= 1")?;
        let priority = i32::try_from(priority).map_err(|_| invalid("priority", priority, "must be in [-2^31, 2^31)"))?;
        let eos_token_id: Option<i64> = opt_int_arg("eos_token_id", eos_token_id, "token ids must be in [0, 2^32)")?;
        let cache_salt = cache_salt.filter(|c| !c.is_none()).map(|c| str_arg("cache_salt", c)).transpose()?;
        let prompt = token_ids("prompt_token_ids", prompt_token_ids)?
            .into_iter()
            .map(|t| token_id("prompt_token_ids", t))
            .collect::<PyResult<Vec<u32>>>()?;
        let id_list = |name: &'static str, ids: Option<&Bound<'_, PyAny>>| match ids {
            Some(s) => token_ids(name, s)?.into_iter().map(|t| token_id(name, t)).collect::<PyResult<Vec<u32>>>(),
            None => Ok(Vec::new()),
        };
        let stops = id_list("stop_token_ids", stop_token_ids)?;
        let min_tokens_bans = id_list("min_tokens_bans", min_tokens_bans)?;
        if max_tokens < 1 {
            return Err(invalid("max_tokens", max_tokens, "must be >= 1"));
        }
        let knobs = [temperature, top_p, min_p, presence_penalty, frequency_penalty, repetition_penalty];
        let sampling = SamplingSpec { has_logit_bias, ..sampling_spec(knobs, top_k, logprobs)? };
        let bad_words = bad_words.filter(|b| !b.is_none()).map(|b| token_id_lists("bad_words", b)).transpose()?.unwrap_or_default();
        let seed = seed.filter(|s| !s.is_none()).map(|s| any_int_as_u64("seed", s)).transpose()?;
        if n < 1 || n > u32::MAX as i64 {
            return Err(invalid("n", n, "must be >= 1"));
        }
        let req = NewRequest {
            request_id,
            prompt_token_ids: prompt,
            max_tokens: max_tokens as usize,
            n: n as u32,
            priority,
            eos_token_id: eos_token_id.map(|t| token_id("eos_token_id", t)).transpose()?,
            stop_token_ids: stops,
            min_tokens: non_negative("min_tokens", min_tokens)? as usize,
            ignore_eos,
            min_tokens_bans,
            cache_salt,
            reserve_seqs: u32::try_from(reserve_seqs).map_err(|_| invalid("reserve_seqs", reserve_seqs, "must be >= 0"))?,
            sampling,
            seed,
            bad_words,
            skip_cache_hits,
        };
        let prompt = self.text.as_ref().map(|_| req.prompt_token_ids.clone());
        let min_tokens = req.min_tokens;
        let inner = &mut self.inner;
        py.detach(|| inner.add_request(req)).map_err(to_py_err)?;
        if let (Some(text), Some(prompt)) = (self.text.as_mut(), prompt) {
            let min_tokens = u32::try_from(min_tokens).unwrap_or(u32::MAX);
            let params = StopStrings::new(stop, include_stop_str_in_output, min_tokens, skip_special_tokens);
            text.add_request(request_id, params, &prompt, stream_text, detokenize);
        }
        Ok(())
    }

    /// Attaches a text layer over `model` (requests added from now on get text).
    fn attach_text(&mut self, model: PyRef<'_, PyTextModel>) {
        self.text = Some(SchedulerText::new(model.inner.clone()));
    }

    /// The core's clock at its last `schedule`/`update`/`cancel_step`/`abort`.
    #[getter]
    fn clock_ts(&self) -> f64 {
        self.inner.clock_ts()
    }

    /// (requests, sequences) holding text state: both 0 once every request has ended.
    fn text_state(&self) -> (usize, usize) {
        self.text.as_ref().map_or((0, 0), |t| t.len())
    }

    /// Decides the next batch (GIL released) and returns it as zero-copy numpy arrays.
    fn schedule(slf: &Bound<'_, Self>) -> PyResult<PySchedulerOutput> {
        let py = slf.py();
        let out = {
            let mut me = slf.borrow_mut();
            let inner = &mut me.inner;
            py.detach(|| inner.schedule()).map_err(to_py_err)?
        };
        Ok(PySchedulerOutput::from_core(out, slf.clone().unbind()))
    }

    /// Appends one sampled token per logits row of `output` (GIL released); the step's text
    /// work (the text layer's) is deferred: to `take_step_results` with `defer_text`, else done
    /// here, its records returned. One path either way.
    #[pyo3(signature = (output, sampled_token_ids, *, defer_text=false))]
    fn update(
        &mut self,
        py: Python<'_>,
        output: PyRef<'_, PySchedulerOutput>,
        sampled_token_ids: &Bound<'_, PyAny>,
        defer_text: bool,
    ) -> PyResult<Vec<PyFinishedSequence>> {
        if self.deferred.is_untaken() {
            return Err(to_py_err(CoreError::InvalidState {
                message: "update before the previous step's take_step_results() (it used defer_text=True)".into(),
            }));
        }
        self.update_deferred(py, output, sampled_token_ids)?;
        if defer_text {
            return Ok(Vec::new());
        }
        self.flush_deferred(py);
        let r = self.deferred.take();
        Ok(Self::with_text(r.records, r.texts))
    }

    /// The deferred step's records (with their texts), its streaming rows (indices into its
    /// logits rows) and their text deltas, once; its text work runs now if no call ran it.
    fn take_step_results<'py>(&mut self, py: Python<'py>) -> StepResultsTuple<'py> {
        self.flush_deferred(py);
        let r = self.deferred.take();
        (Self::with_text(r.records, r.texts), numpy::IntoPyArray::into_pyarray(r.deltas.rows, py), r.deltas.deltas)
    }

    /// Undoes the step of `output` instead of `update` (its forward pass failed or was
    /// interrupted): no token is appended and no computed count advances (GIL released).
    fn cancel_step(&mut self, py: Python<'_>, output: PyRef<'_, PySchedulerOutput>) -> PyResult<()> {
        let step_id = output.step_id;
        drop(output);
        self.flush_deferred(py);
        let inner = &mut self.inner;
        py.detach(|| inner.cancel_step(step_id)).map_err(to_py_err)
    }

    /// Cancels the step in flight, whichever it is (`cancel_step` without its output: for a
    /// caller interrupted between `schedule` returning and holding the output); False if none.
    fn cancel_step_in_flight(&mut self, py: Python<'_>) -> PyResult<bool> {
        let Some(step_id) = self.inner.step_in_flight_id() else {
            return Ok(false);
        };
        self.flush_deferred(py);
        let inner = &mut self.inner;
        py.detach(|| inner.cancel_step(step_id)).map_err(to_py_err)?;
        Ok(true)
    }

    /// Ends a request anywhere; returns its sequences as aborted, with what they generated.
    fn abort(&mut self, py: Python<'_>, request_id: i64) -> PyResult<Vec<PyFinishedSequence>> {
        self.end_by_caller(py, request_id, false)
    }

    /// Ends a request its caller found complete (a beam search), counted as finished.
    fn finish_request(&mut self, py: Python<'_>, request_id: i64) -> PyResult<Vec<PyFinishedSequence>> {
        self.end_by_caller(py, request_id, true)
    }

    /// Ends a sequence on stop string `stop_str_index` (also with a step in flight).
    fn stop_sequence(&mut self, py: Python<'_>, seq_id: i64, stop_str_index: i64) -> PyResult<PyFinishedSequence> {
        let seq_id = non_negative("seq_id", seq_id)?;
        let index = u32::try_from(stop_str_index).map_err(|_| invalid("stop_str_index", stop_str_index, "must be in [0, 2^32)"))?;
        self.flush_deferred(py);
        self.inner.stop_sequence(seq_id, index).map(Into::into).map_err(to_py_err)
    }

    /// The tokens a sequence has generated so far (its prompt left out).
    fn output_tokens(&self, seq_id: i64) -> PyResult<Vec<u32>> {
        self.inner.output_tokens(non_negative("seq_id", seq_id)?).map_err(to_py_err)
    }

    #[pyo3(signature = (seq_id, next_token=None))]
    fn fork_sequence(&mut self, py: Python<'_>, seq_id: i64, next_token: Option<i64>) -> PyResult<u64> {
        let seq_id = non_negative("seq_id", seq_id)?;
        let tok = next_token.map(|t| token_id("next_token", t)).transpose()?;
        self.flush_deferred(py);
        self.inner.fork_sequence(seq_id, tok).map_err(to_py_err)
    }

    fn drop_sequence(&mut self, py: Python<'_>, seq_id: i64) -> PyResult<bool> {
        let seq_id = non_negative("seq_id", seq_id)?;
        self.flush_deferred(py);
        let request_id = self.inner.seq_request_id(seq_id);
        let last = self.inner.drop_sequence(seq_id).map_err(to_py_err)?;
        if let (Some(t), Some(rid)) = (self.text.as_mut(), request_id) {
            t.forget(rid, seq_id, last);
        }
        Ok(last)
    }

    fn reset_prefix_cache(&mut self) {
        self.inner.reset_prefix_cache();
    }

    fn request_seq_ids(&self, request_id: i64) -> PyResult<Vec<u64>> {
        self.inner
            .request_seq_ids(non_negative("request_id", request_id)?)
            .map_err(to_py_err)
    }

    fn num_cached_tokens(&self, request_id: i64) -> PyResult<usize> {
        self.inner
            .num_cached_tokens(non_negative("request_id", request_id)?)
            .map_err(to_py_err)
    }

    /// (queued, scheduled, first token, last token, finished) of a live request, seconds on
    /// `time.monotonic()`'s scale, 0.0 = not yet.
    fn request_times(&self, request_id: i64) -> PyResult<TimesTuple> {
        let t = self.inner.request_times(non_negative("request_id", request_id)?).map_err(to_py_err)?;
        Ok(times_tuple(t))
    }

    fn seq_block_table(&self, seq_id: i64) -> PyResult<Vec<u32>> {
        self.inner.seq_block_table(non_negative("seq_id", seq_id)?).map_err(to_py_err)
    }

    fn seq_tokens(&self, seq_id: i64) -> PyResult<Vec<u32>> {
        self.inner.seq_tokens(non_negative("seq_id", seq_id)?).map_err(to_py_err)
    }

    fn has_unfinished(&self) -> bool {
        self.inner.has_unfinished()
    }

    /// Raises SchedulerStateError if an internal invariant is broken (O(everything)).
    fn check_invariants(&self) -> PyResult<()> {
        self.inner
            .check_invariants()
            .map_err(|m| to_py_err(CoreError::InvalidState { message: m }))
    }

    #[getter]
    fn num_free_blocks(&self) -> usize {
        self.inner.num_free_blocks()
    }
    /// The most new tokens `n` samples of a `prompt_len`-token prompt can ask for and be
    /// admitted (0: not even one).
    fn max_fitting_tokens(&self, prompt_len: usize, n: usize) -> usize {
        self.inner.max_fitting_tokens(prompt_len, n)
    }
    #[getter]
    fn num_waiting(&self) -> usize {
        self.inner.num_waiting()
    }
    #[getter]
    fn num_running(&self) -> usize {
        self.inner.num_running()
    }
    #[getter]
    fn num_running_seqs(&self) -> usize {
        self.inner.num_running_seqs()
    }
    #[getter]
    fn num_unfinished(&self) -> usize {
        self.inner.num_unfinished()
    }
    #[getter]
    fn num_blocks(&self) -> usize {
        self.inner.config().num_blocks
    }
    #[getter]
    fn block_size(&self) -> usize {
        self.inner.config().block_size
    }
    #[getter]
    fn max_model_len(&self) -> usize {
        self.inner.config().max_model_len
    }
    #[getter]
    fn max_num_seqs(&self) -> usize {
        self.inner.config().max_num_seqs
    }

    /// Counters and the current KV usage as a dict of ints. `full=False` leaves out the usage
    /// counts that cost O(blocks): `num_shared_blocks`, `num_block_refs`, `num_used_token_slots`.
    #[pyo3(signature = (full=true))]
    fn stats<'py>(&self, py: Python<'py>, full: bool) -> PyResult<Bound<'py, PyDict>> {
        let s = self.inner.stats();
        let k = self.inner.kv_stats();
        let c = self.inner.kv_counts();
        let d = PyDict::new(py);
        // Interned keys: the engine refreshes its snapshot from this after every step.
        macro_rules! set {
            ($($key:literal => $value:expr,)*) => { $(d.set_item(pyo3::intern!(py, $key), $value as u64)?;)* };
        }
        set! {
            "steps" => s.steps,
            "requests_added" => s.requests_added,
            "requests_finished" => s.requests_finished,
            "requests_aborted" => s.requests_aborted,
            "capacity_aborts" => s.capacity_aborts,
            "preemptions" => s.preemptions,
            "swap_preemptions" => s.swap_preemptions,
            "recompute_preemptions" => s.recompute_preemptions,
            "prompt_tokens" => s.prompt_tokens,
            "prompt_tokens_computed" => s.prompt_tokens_computed,
            "output_tokens_recomputed" => s.output_tokens_recomputed,
            "cached_prompt_tokens" => s.cached_prompt_tokens,
            "first_admission_cached_tokens" => s.first_admission_cached_tokens,
            "prefix_cache_queried_tokens" => s.prefix_cache_queried_tokens,
            "decode_tokens" => s.decode_tokens,
            "generated_tokens" => s.generated_tokens,
            "max_running_seqs" => s.max_running_seqs,
            "max_step_tokens" => s.max_step_tokens,
            "cancelled_steps" => s.cancelled_steps,
            "cow_copies" => k.cow_copies,
            "blocks_swapped_out" => k.blocks_swapped_out,
            "blocks_swapped_in" => k.blocks_swapped_in,
            "prefix_evictions" => k.prefix_evictions,
            "num_blocks" => c.num_blocks,
            "num_free_blocks" => c.num_free_blocks,
            "num_used_blocks" => c.num_used_blocks,
            "num_cached_blocks" => c.num_cached_blocks,
            "block_size" => c.block_size,
            "num_waiting" => self.inner.num_waiting(),
            "num_running" => self.inner.num_running(),
            "num_running_seqs" => self.inner.num_running_seqs(),
            "num_waiting_seqs" => self.inner.num_waiting_seqs(),
        }
        // The steps' token histogram, one key per bucket of STEP_TOKEN_BOUNDS (not cumulative).
        for (key, count) in step_token_keys(py).iter().zip(s.step_tokens_hist) {
            d.set_item(key.bind(py), count)?;
        }
        set! { "step_tokens_sum" => s.step_tokens_sum, }
        if full {
            let u = self.inner.kv_usage();
            set! {
                "num_shared_blocks" => u.num_shared_blocks,
                "num_block_refs" => u.num_block_refs,
                "num_used_token_slots" => u.num_used_token_slots,
            }
        }
        Ok(d)
    }

    fn __repr__(&self) -> String {
        let c = self.inner.config();
        format!(
            "Scheduler(num_blocks={}, block_size={}, running={}, waiting={}, free_blocks={})",
            c.num_blocks,
            c.block_size,
            self.inner.num_running(),
            self.inner.num_waiting(),
            self.inner.num_free_blocks()
        )
    }
}


/// The stats keys of the steps' token histogram, `step_tokens_le_{bound}` for each of
/// `STEP_TOKEN_BOUNDS` then `step_tokens_le_inf`, made once (interned).
fn step_token_keys(py: Python<'_>) -> &Vec<Py<PyString>> {
    static KEYS: PyOnceLock<Vec<Py<PyString>>> = PyOnceLock::new();
    KEYS.get_or_init(py, || {
        let names = STEP_TOKEN_BOUNDS.iter().map(|b| b.to_string()).chain(std::iter::once("inf".to_string()));
        names.map(|name| PyString::intern(py, &format!("step_tokens_le_{name}")).unbind()).collect()
    })
}
