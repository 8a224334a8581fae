//! `SchedulerOutput` and `FinishedSequence`: a step's buffers moved into numpy arrays without
//! copying, lazily on first access; the block tables of a step that holds every running
//! sequence are a read-only view of the scheduler's batch matrix, which keeps it alive.

use crate::*;
use ferrokv_core::{BlockTables, CoreError, FinishedSeq, SamplingColumns, SchedulerOutput};
use numpy::ndarray::{Array2, ArrayView2, ShapeBuilder};
use numpy::{Element, IntoPyArray, PyArray1, PyArray2, PyArrayMethods, PyUntypedArrayMethods};
use pyo3::prelude::*;

// ---------------------------------------------------------------------------------------------
// Lazily converted numpy buffers.

pub(crate) struct Lazy1<T: Element> {
    vec: Option<Vec<T>>,
    arr: Option<Py<PyArray1<T>>>,
}

impl<T: Element + Copy> Lazy1<T> {
    fn new(v: Vec<T>) -> Self {
        Lazy1 { vec: Some(v), arr: None }
    }
    /// Its elements, wherever they are now (the Vec, or the numpy array it became).
    pub(crate) fn copy_into(&self, py: Python<'_>, out: &mut Vec<T>) {
        out.clear();
        match (&self.vec, &self.arr) {
            (Some(v), _) => out.extend_from_slice(v),
            (None, Some(a)) => out.extend(a.bind(py).readonly().as_array().iter().copied()),
            (None, None) => {}
        }
    }
    fn get(&mut self, py: Python<'_>) -> Py<PyArray1<T>> {
        if self.arr.is_none() {
            let v = self.vec.take().unwrap_or_default();
            self.arr = Some(v.into_pyarray(py).unbind());
        }
        self.arr.as_ref().expect("just set").clone_ref(py)
    }
}

pub(crate) struct Lazy2<T: Element> {
    vec: Option<(Vec<T>, usize, usize)>,
    arr: Option<Py<PyArray2<T>>>,
}

impl<T: Element> Lazy2<T> {
    fn new(v: Vec<T>, rows: usize, cols: usize) -> Self {
        Lazy2 {
            vec: Some((v, rows, cols)),
            arr: None,
        }
    }
    fn get(&mut self, py: Python<'_>) -> Py<PyArray2<T>> {
        if self.arr.is_none() {
            let (v, r, c) = self.vec.take().expect("set once");
            let a = Array2::from_shape_vec((r, c), v).expect("rows * cols elements");
            self.arr = Some(a.into_pyarray(py).unbind());
        }
        self.arr.as_ref().expect("just set").clone_ref(py)
    }
}

/// A step's block tables: a copy, or rows `0..rows` of the batch matrix of `owner`.
pub(crate) enum LazyTables {
    Owned(Lazy2<i32>),
    Batch {
        owner: Py<PyScheduler>,
        rows: usize,
        cols: usize,
        arr: Option<Py<PyArray2<i32>>>,
    },
}

impl LazyTables {
    fn get(&mut self, py: Python<'_>, step_id: u64) -> PyResult<Py<PyArray2<i32>>> {
        match self {
            LazyTables::Owned(l) => Ok(l.get(py)),
            LazyTables::Batch { arr: Some(a), .. } => Ok(a.clone_ref(py)),
            LazyTables::Batch { owner, rows, cols, arr } => {
                let sched = owner.bind(py).try_borrow().map_err(|_| {
                    to_py_err(CoreError::InvalidState {
                        message: "block_tables read while the scheduler is busy".into(),
                    })
                })?;
                sched.inner.check_batch_view(step_id).map_err(to_py_err)?;
                let (ptr, capacity, stride) = sched.inner.batch_table();
                assert!(*rows <= capacity && *cols <= stride, "a step's view lies inside the batch matrix");
                // SAFETY: the matrix is allocated once per scheduler and never moves; the array
                // holds a reference to the scheduler, so the memory outlives the view. It is
                // read-only: only the scheduler writes it (between steps).
                let a = unsafe {
                    let view = ArrayView2::from_shape_ptr((*rows, *cols).strides((stride, 1)), ptr);
                    let a = PyArray2::borrow_from_array(&view, owner.clone_ref(py).into_bound(py).into_any());
                    (*a.as_array_ptr()).fields.flags &= !numpy::npyffi::flags::NPY_ARRAY_WRITEABLE;
                    a
                };
                let a = a.unbind();
                *arr = Some(a.clone_ref(py));
                Ok(a)
            }
        }
    }
}

/// One scheduling step: see `python/ferrokv/_core.pyi` for the layout of each array.
#[pyclass(module = "ferrokv._core", name = "SchedulerOutput")]
pub(crate) struct PySchedulerOutput {
    #[pyo3(get)]
    pub(crate) step_id: u64,
    #[pyo3(get)]
    num_seqs: usize,
    #[pyo3(get)]
    num_tokens: usize,
    #[pyo3(get)]
    num_rows: usize,
    #[pyo3(get)]
    num_prefill_tokens: usize,
    #[pyo3(get)]
    num_decode_tokens: usize,
    /// The longest query (tokens computed for one sequence) and the longest sequence of the
    /// step: host ints for the attention metadata, with no pass over the arrays in Python.
    #[pyo3(get)]
    max_query_len: usize,
    #[pyo3(get)]
    max_seq_len: usize,
    #[pyo3(get)]
    block_size: usize,
    req_ids: Lazy1<i64>,
    seq_ids: Lazy1<i64>,
    query_start_loc: Lazy1<i32>,
    seq_lens: Lazy1<i32>,
    prompt_lens: Lazy1<i32>,
    block_tables: LazyTables,
    input_ids: Lazy1<i64>,
    positions: Lazy1<i64>,
    slot_mapping: Lazy1<i64>,
    logits_indices: Lazy1<i64>,
    pub(crate) row_req_ids: Lazy1<i64>,
    pub(crate) row_seq_ids: Lazy1<i64>,
    row_sample_index: Lazy1<i32>,
    copy_ops: Lazy2<i32>,
    swap_out: Lazy2<i32>,
    swap_in: Lazy2<i32>,
    finished_req_ids: Lazy1<i64>,
    preempted_req_ids: Lazy1<i64>,
    sampling: LazySampling,
    #[pyo3(get)]
    num_greedy_rows: usize,
    #[pyo3(get)]
    max_top_k: i32,
    #[pyo3(get)]
    any_top_p: bool,
    #[pyo3(get)]
    any_min_p: bool,
    #[pyo3(get)]
    any_penalties: bool,
    #[pyo3(get)]
    any_logprobs: bool,
    /// Some row has a static bias (`bias_rows` is not empty).
    #[pyo3(get)]
    any_logit_bias: bool,
}

/// The per-row sampling columns (`ferrokv_core::SamplingColumns`) as lazy numpy arrays.
struct LazySampling {
    temperature: Lazy1<f32>,
    top_k: Lazy1<i32>,
    top_p: Lazy1<f32>,
    min_p: Lazy1<f32>,
    presence: Lazy1<f32>,
    frequency: Lazy1<f32>,
    repetition: Lazy1<f32>,
    num_logprobs: Lazy1<i32>,
    uniform: Lazy1<f64>,
    batch_rows: Lazy1<i32>,
    num_output: Lazy1<i32>,
    banned_rows: Lazy1<i64>,
    banned_tokens: Lazy1<i64>,
    bias_rows: Lazy1<i64>,
}

impl LazySampling {
    fn new(c: SamplingColumns) -> Self {
        LazySampling {
            temperature: Lazy1::new(c.temperature),
            top_k: Lazy1::new(c.top_k),
            top_p: Lazy1::new(c.top_p),
            min_p: Lazy1::new(c.min_p),
            presence: Lazy1::new(c.presence),
            frequency: Lazy1::new(c.frequency),
            repetition: Lazy1::new(c.repetition),
            num_logprobs: Lazy1::new(c.num_logprobs),
            uniform: Lazy1::new(c.uniform),
            batch_rows: Lazy1::new(c.batch_rows),
            num_output: Lazy1::new(c.num_output),
            banned_rows: Lazy1::new(c.banned_rows),
            banned_tokens: Lazy1::new(c.banned_tokens),
            bias_rows: Lazy1::new(c.bias_rows),
        }
    }
}

impl PySchedulerOutput {
    pub(crate) fn from_core(o: SchedulerOutput, owner: Py<PyScheduler>) -> Self {
        let (s, t, r) = (o.num_seqs(), o.num_tokens(), o.num_rows());
        let pairs = |v: Vec<i32>| {
            let n = v.len() / 2;
            Lazy2::new(v, n, 2)
        };
        PySchedulerOutput {
            step_id: o.step_id,
            num_seqs: s,
            num_tokens: t,
            num_rows: r,
            num_prefill_tokens: o.num_prefill_tokens,
            num_decode_tokens: o.num_decode_tokens,
            max_query_len: o.query_start_loc.windows(2).map(|w| (w[1] - w[0]) as usize).max().unwrap_or(0),
            max_seq_len: o.seq_lens.iter().copied().max().unwrap_or(0).max(0) as usize,
            block_size: o.block_size,
            req_ids: Lazy1::new(o.req_ids),
            seq_ids: Lazy1::new(o.seq_ids),
            query_start_loc: Lazy1::new(o.query_start_loc),
            seq_lens: Lazy1::new(o.seq_lens),
            prompt_lens: Lazy1::new(o.prompt_lens),
            block_tables: match o.block_tables {
                BlockTables::Owned(v) => LazyTables::Owned(Lazy2::new(v, s, o.max_blocks)),
                BlockTables::Batch => LazyTables::Batch {
                    owner,
                    rows: s,
                    cols: o.max_blocks,
                    arr: None,
                },
            },
            input_ids: Lazy1::new(o.input_ids),
            positions: Lazy1::new(o.positions),
            slot_mapping: Lazy1::new(o.slot_mapping),
            logits_indices: Lazy1::new(o.logits_indices),
            row_req_ids: Lazy1::new(o.row_req_ids),
            row_seq_ids: Lazy1::new(o.row_seq_ids),
            row_sample_index: Lazy1::new(o.row_sample_index),
            copy_ops: pairs(o.copy_ops),
            swap_out: pairs(o.swap_out),
            swap_in: pairs(o.swap_in),
            finished_req_ids: Lazy1::new(o.finished_req_ids),
            preempted_req_ids: Lazy1::new(o.preempted_req_ids),
            num_greedy_rows: o.sampling.num_greedy_rows,
            max_top_k: o.sampling.max_top_k,
            any_top_p: o.sampling.any_top_p,
            any_min_p: o.sampling.any_min_p,
            any_penalties: o.sampling.any_penalties,
            any_logprobs: o.sampling.any_logprobs,
            any_logit_bias: !o.sampling.bias_rows.is_empty(),
            sampling: LazySampling::new(o.sampling),
        }
    }
}

#[pymethods]
impl PySchedulerOutput {
    #[getter]
    fn req_ids(&mut self, py: Python<'_>) -> Py<PyArray1<i64>> {
        self.req_ids.get(py)
    }
    #[getter]
    fn seq_ids(&mut self, py: Python<'_>) -> Py<PyArray1<i64>> {
        self.seq_ids.get(py)
    }
    #[getter]
    fn query_start_loc(&mut self, py: Python<'_>) -> Py<PyArray1<i32>> {
        self.query_start_loc.get(py)
    }
    #[getter]
    fn seq_lens(&mut self, py: Python<'_>) -> Py<PyArray1<i32>> {
        self.seq_lens.get(py)
    }
    #[getter]
    fn prompt_lens(&mut self, py: Python<'_>) -> Py<PyArray1<i32>> {
        self.prompt_lens.get(py)
    }
    /// Valid between `schedule()` and `update()`: a read-only view of the scheduler's batch
    /// matrix when every running sequence is in the step (read it before `update`).
    #[getter]
    fn block_tables(&mut self, py: Python<'_>) -> PyResult<Py<PyArray2<i32>>> {
        self.block_tables.get(py, self.step_id)
    }
    /// True when `block_tables` views the batch matrix (strided rows, changes with later steps):
    /// a caller that keeps the table must copy it.
    #[getter]
    fn block_tables_is_view(&self) -> bool {
        matches!(self.block_tables, LazyTables::Batch { .. })
    }
    #[getter]
    fn input_ids(&mut self, py: Python<'_>) -> Py<PyArray1<i64>> {
        self.input_ids.get(py)
    }
    #[getter]
    fn positions(&mut self, py: Python<'_>) -> Py<PyArray1<i64>> {
        self.positions.get(py)
    }
    #[getter]
    fn slot_mapping(&mut self, py: Python<'_>) -> Py<PyArray1<i64>> {
        self.slot_mapping.get(py)
    }
    #[getter]
    fn logits_indices(&mut self, py: Python<'_>) -> Py<PyArray1<i64>> {
        self.logits_indices.get(py)
    }
    #[getter]
    fn row_req_ids(&mut self, py: Python<'_>) -> Py<PyArray1<i64>> {
        self.row_req_ids.get(py)
    }
    #[getter]
    fn row_seq_ids(&mut self, py: Python<'_>) -> Py<PyArray1<i64>> {
        self.row_seq_ids.get(py)
    }
    #[getter]
    fn row_sample_index(&mut self, py: Python<'_>) -> Py<PyArray1<i32>> {
        self.row_sample_index.get(py)
    }
    #[getter]
    fn row_temperature(&mut self, py: Python<'_>) -> Py<PyArray1<f32>> {
        self.sampling.temperature.get(py)
    }
    #[getter]
    fn row_top_k(&mut self, py: Python<'_>) -> Py<PyArray1<i32>> {
        self.sampling.top_k.get(py)
    }
    #[getter]
    fn row_top_p(&mut self, py: Python<'_>) -> Py<PyArray1<f32>> {
        self.sampling.top_p.get(py)
    }
    #[getter]
    fn row_min_p(&mut self, py: Python<'_>) -> Py<PyArray1<f32>> {
        self.sampling.min_p.get(py)
    }
    #[getter]
    fn row_presence(&mut self, py: Python<'_>) -> Py<PyArray1<f32>> {
        self.sampling.presence.get(py)
    }
    #[getter]
    fn row_frequency(&mut self, py: Python<'_>) -> Py<PyArray1<f32>> {
        self.sampling.frequency.get(py)
    }
    #[getter]
    fn row_repetition(&mut self, py: Python<'_>) -> Py<PyArray1<f32>> {
        self.sampling.repetition.get(py)
    }
    #[getter]
    fn row_num_logprobs(&mut self, py: Python<'_>) -> Py<PyArray1<i32>> {
        self.sampling.num_logprobs.get(py)
    }
    #[getter]
    fn row_uniform(&mut self, py: Python<'_>) -> Py<PyArray1<f64>> {
        self.sampling.uniform.get(py)
    }
    #[getter]
    fn row_batch_rows(&mut self, py: Python<'_>) -> Py<PyArray1<i32>> {
        self.sampling.batch_rows.get(py)
    }
    #[getter]
    fn row_num_output(&mut self, py: Python<'_>) -> Py<PyArray1<i32>> {
        self.sampling.num_output.get(py)
    }
    #[getter]
    fn banned_rows(&mut self, py: Python<'_>) -> Py<PyArray1<i64>> {
        self.sampling.banned_rows.get(py)
    }
    #[getter]
    fn banned_tokens(&mut self, py: Python<'_>) -> Py<PyArray1<i64>> {
        self.sampling.banned_tokens.get(py)
    }
    #[getter]
    fn bias_rows(&mut self, py: Python<'_>) -> Py<PyArray1<i64>> {
        self.sampling.bias_rows.get(py)
    }
    #[getter]
    fn copy_ops(&mut self, py: Python<'_>) -> Py<PyArray2<i32>> {
        self.copy_ops.get(py)
    }
    #[getter]
    fn swap_out(&mut self, py: Python<'_>) -> Py<PyArray2<i32>> {
        self.swap_out.get(py)
    }
    #[getter]
    fn swap_in(&mut self, py: Python<'_>) -> Py<PyArray2<i32>> {
        self.swap_in.get(py)
    }
    #[getter]
    fn finished_req_ids(&mut self, py: Python<'_>) -> Py<PyArray1<i64>> {
        self.finished_req_ids.get(py)
    }
    #[getter]
    fn preempted_req_ids(&mut self, py: Python<'_>) -> Py<PyArray1<i64>> {
        self.preempted_req_ids.get(py)
    }
    fn __repr__(&self) -> String {
        format!(
            "SchedulerOutput(step_id={}, num_seqs={}, num_tokens={}, num_rows={}, prefill={}, decode={})",
            self.step_id, self.num_seqs, self.num_tokens, self.num_rows, self.num_prefill_tokens, self.num_decode_tokens
        )
    }
}

/// A sequence that ended, as reported by `Scheduler.update`.
#[pyclass(module = "ferrokv._core", name = "FinishedSequence", frozen)]
pub(crate) struct PyFinishedSequence {
    #[pyo3(get)]
    request_id: u64,
    #[pyo3(get)]
    seq_id: u64,
    #[pyo3(get)]
    sample_index: u32,
    #[pyo3(get)]
    reason: &'static str,
    #[pyo3(get)]
    stop_token_id: Option<u32>,
    /// Index of the request's stop string that ended it.
    #[pyo3(get)]
    stop_str_index: Option<u32>,
    #[pyo3(get)]
    request_finished: bool,
    #[pyo3(get)]
    num_cached_tokens: usize,
    output_tokens: Vec<u32>,
    /// Set by the text layer: the stop string itself, the final text, and the text not yet
    /// taken as a delta.
    pub(crate) stop_string: Option<String>,
    #[pyo3(get)]
    pub(crate) text: Option<String>,
    #[pyo3(get)]
    pub(crate) text_delta: Option<String>,
    /// (queued, scheduled, first token, last token, finished) on `time.monotonic()`'s scale,
    /// on the record that ends the request.
    #[pyo3(get)]
    times: Option<TimesTuple>,
}

/// `RequestTimes` as Python sees it: a 5-tuple of floats (0.0 = not yet).
pub(crate) type TimesTuple = (f64, f64, f64, f64, f64);

pub(crate) fn times_tuple(t: ferrokv_core::RequestTimes) -> TimesTuple {
    (t.queued_ts, t.scheduled_ts, t.first_token_ts, t.last_token_ts, t.finished_ts)
}

#[pymethods]
impl PyFinishedSequence {
    /// The generated token ids (a new list per access).
    #[getter]
    fn output_token_ids(&self) -> Vec<u32> {
        self.output_tokens.clone()
    }

    /// vLLM's ``stop_reason``: the stop string, else the stop token id, else None.
    #[getter]
    fn stop_reason(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        Ok(match (&self.stop_string, self.stop_token_id) {
            (Some(s), _) => s.into_pyobject(py)?.into_any().unbind(),
            (None, Some(t)) => t.into_pyobject(py)?.into_any().unbind(),
            (None, None) => py.None(),
        })
    }

    /// A copy with its text set (a text layer written in Python fills these in); with a stop
    /// string, it ended on that string (index `stop_str_index` of its request's).
    #[pyo3(signature = (text, text_delta, stop_str_index=None, stop_string=None))]
    fn with_text(&self, text: String, text_delta: String, stop_str_index: Option<u32>, stop_string: Option<String>) -> Self {
        let stopped = stop_string.is_some();
        PyFinishedSequence {
            output_tokens: self.output_tokens.clone(),
            text: Some(text),
            text_delta: Some(text_delta),
            reason: if stopped { "stop" } else { self.reason },
            stop_str_index: if stopped { stop_str_index } else { self.stop_str_index },
            stop_string: if stopped { stop_string } else { self.stop_string.clone() },
            ..*self
        }
    }

    fn __repr__(&self) -> String {
        format!(
            "FinishedSequence(request_id={}, seq_id={}, sample_index={}, reason={:?}, stop_token_id={:?}, stop_string={:?}, request_finished={}, <{} tokens>)",
            self.request_id,
            self.seq_id,
            self.sample_index,
            self.reason,
            self.stop_token_id,
            self.stop_string,
            if self.request_finished { "True" } else { "False" },
            self.output_tokens.len(),
        )
    }
}

impl PyFinishedSequence {
    /// The record with its text (from the scheduler's text layer), if it has one.
    pub(crate) fn with_ended_text(f: FinishedSeq, text: Option<ferrokv_text::EndedText>) -> Self {
        let mut me = PyFinishedSequence::from(f);
        if let Some(t) = text {
            me.text = Some(t.text);
            me.text_delta = Some(t.delta);
            me.stop_string = t.stop_string;
        }
        me
    }
}

impl From<FinishedSeq> for PyFinishedSequence {
    fn from(f: FinishedSeq) -> Self {
        PyFinishedSequence {
            request_id: f.request_id,
            seq_id: f.seq_id,
            sample_index: f.sample_index,
            reason: f.reason.as_str(),
            stop_token_id: f.stop_token,
            stop_str_index: f.stop_str,
            request_finished: f.request_finished,
            num_cached_tokens: f.num_cached_tokens,
            output_tokens: f.output_tokens,
            stop_string: None,
            text: None,
            text_delta: None,
            times: f.times.map(times_tuple),
        }
    }
}
