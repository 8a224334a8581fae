//! `ferrokv._core`: thin PyO3 bindings over `ferrokv-core`.
//!
//! Only conversions live here: arguments become owned Rust values, the work runs with the GIL
//! released (`py.detach`), each `CoreError` variant maps to one Python exception class, and
//! the step's buffers move into numpy arrays without copying (lazily, on first access, so an
//! array the runner never reads costs nothing). The block tables of a step that holds every
//! running sequence are a read-only view of the scheduler's persistent batch matrix, which
//! keeps the `Scheduler` object alive.

use ferrokv_core::{
    BlockTables, CoreError, FinishedSeq, Named, NewRequest, Policy, PreemptionMode, Scheduler, SchedulerConfig, SchedulerOutput,
};
use numpy::ndarray::{Array2, ArrayView2, ShapeBuilder};
use numpy::{Element, IntoPyArray, PyArray1, PyArray2, PyArrayMethods, PyUntypedArrayMethods};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyTuple, PyType};

// ---------------------------------------------------------------------------------------------
// Exceptions: a hierarchy under FerrokvError; bad input also derives from ValueError.

struct Exceptions {
    base: Py<PyType>,
    invalid: Py<PyType>,
    duplicate: Py<PyType>,
    unknown_request: Py<PyType>,
    unknown_sequence: Py<PyType>,
    prompt_too_long: Py<PyType>,
    capacity: Py<PyType>,
    state: Py<PyType>,
}

static EXCEPTIONS: PyOnceLock<Exceptions> = PyOnceLock::new();

fn new_exception(py: Python<'_>, name: &str, bases: Vec<Bound<'_, PyAny>>, doc: &str) -> PyResult<Py<PyType>> {
    let ns = PyDict::new(py);
    ns.set_item("__module__", "ferrokv")?;
    ns.set_item("__doc__", doc)?;
    let cls = py.import("builtins")?.getattr("type")?.call1((name, PyTuple::new(py, bases)?, ns))?;
    Ok(cls.cast_into::<PyType>()?.unbind())
}

fn build_exceptions(py: Python<'_>) -> PyResult<Exceptions> {
    let exc = py.get_type::<pyo3::exceptions::PyException>().into_any();
    let value = py.get_type::<pyo3::exceptions::PyValueError>().into_any();
    let runtime = py.get_type::<pyo3::exceptions::PyRuntimeError>().into_any();
    let base = new_exception(py, "FerrokvError", vec![exc], "Base class of every ferrokv error.")?;
    let b = || base.bind(py).clone().into_any();
    let invalid = new_exception(py, "InvalidArgumentError", vec![b(), value], "A field has a bad value; the message names both.")?;
    for attr in ["field", "value", "reason"] {
        invalid.bind(py).setattr(attr, py.None())?; // set on instances raised for a bad field value
    }
    let i = || invalid.bind(py).clone().into_any();
    Ok(Exceptions {
        duplicate: new_exception(py, "DuplicateRequestError", vec![i()], "A live request already uses this request_id.")?,
        unknown_request: new_exception(py, "UnknownRequestError", vec![i()], "No live request has this request_id.")?,
        unknown_sequence: new_exception(py, "UnknownSequenceError", vec![i()], "No live sequence has this seq_id.")?,
        prompt_too_long: new_exception(py, "PromptTooLongError", vec![i()], "The prompt exceeds max_model_len.")?,
        capacity: new_exception(py, "CacheCapacityError", vec![i()], "The request could never fit in the KV cache.")?,
        state: new_exception(py, "SchedulerStateError", vec![b(), runtime], "Calls made out of order.")?,
        invalid,
        base,
    })
}

fn exceptions(py: Python<'_>) -> &'static Exceptions {
    EXCEPTIONS.get_or_init(py, || build_exceptions(py).expect("creating ferrokv exception classes"))
}

fn to_py_err(e: CoreError) -> PyErr {
    Python::attach(|py| {
        let x = exceptions(py);
        let cls = match &e {
            CoreError::InvalidArgument { .. } => &x.invalid,
            CoreError::DuplicateRequest { .. } => &x.duplicate,
            CoreError::UnknownRequest { .. } => &x.unknown_request,
            CoreError::UnknownSequence { .. } => &x.unknown_sequence,
            CoreError::PromptTooLong { .. } => &x.prompt_too_long,
            CoreError::ExceedsCacheCapacity { .. } => &x.capacity,
            CoreError::InvalidState { .. } => &x.state,
        };
        let err = PyErr::from_type(cls.bind(py).clone(), e.to_string());
        if let CoreError::InvalidArgument { field, value, reason } = &e {
            // The parts of the message as attributes, so a caller can name the field its own way.
            let v = err.value(py);
            let set = v.setattr("field", *field).and(v.setattr("value", value)).and(v.setattr("reason", reason));
            if let Err(e) = set {
                return e;
            }
        }
        err
    })
}

fn invalid(field: &'static str, value: impl std::fmt::Display, reason: &str) -> PyErr {
    to_py_err(CoreError::invalid(field, value, reason))
}

// ---------------------------------------------------------------------------------------------
// Argument conversion.

fn non_negative(field: &'static str, v: i64) -> PyResult<u64> {
    u64::try_from(v).map_err(|_| invalid(field, v, "must be >= 0"))
}

fn count(field: &'static str, v: i64) -> PyResult<usize> {
    non_negative(field, v).map(|v| v as usize)
}

fn token_id(field: &'static str, v: i64) -> PyResult<u32> {
    u32::try_from(v).map_err(|_| invalid(field, v, "token ids must be in [0, 2^32)"))
}

/// Token ids from a numpy integer array or any sequence of ints.
fn token_ids(field: &'static str, obj: &Bound<'_, PyAny>) -> PyResult<Vec<i64>> {
    let mut out = Vec::new();
    token_ids_into(field, obj, &mut out)?;
    Ok(out)
}

/// `token_ids`, appended to `out`. The dtype is checked by a cast, not by a failing extract
/// (which would build a Python exception on every call).
fn token_ids_into(field: &'static str, obj: &Bound<'_, PyAny>, out: &mut Vec<i64>) -> PyResult<()> {
    /// A 1-D integer array's values, contiguous or strided.
    fn extend<T: Element + Copy + Into<i64>>(a: &Bound<'_, PyArray1<T>>, out: &mut Vec<i64>) {
        let a = a.readonly();
        match a.as_slice() {
            Ok(s) => out.extend(s.iter().map(|&t| t.into())),
            Err(_) => out.extend(a.as_array().iter().map(|&t| t.into())),
        }
    }
    if let Ok(a) = obj.cast::<PyArray1<i64>>() {
        extend(a, out);
        return Ok(());
    }
    if let Ok(a) = obj.cast::<PyArray1<i32>>() {
        extend(a, out);
        return Ok(());
    }
    if obj.is_instance_of::<pyo3::types::PyString>() {
        return Err(invalid(field, "<str>", "must be a sequence of token ids, not a string"));
    }
    let v = obj
        .extract::<Vec<i64>>()
        .map_err(|_| invalid(field, obj.get_type().name().map(|n| format!("<{n}>")).unwrap_or_default(), "must be a sequence of ints"))?;
    out.extend_from_slice(&v);
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Lazily converted numpy buffers.

struct Lazy1<T: Element> {
    vec: Option<Vec<T>>,
    arr: Option<Py<PyArray1<T>>>,
}

impl<T: Element> Lazy1<T> {
    fn new(v: Vec<T>) -> Self {
        Lazy1 { vec: Some(v), arr: None }
    }
    fn get(&mut self, py: Python<'_>) -> Py<PyArray1<T>> {
        if self.arr.is_none() {
            let v = self.vec.take().unwrap_or_default();
            self.arr = Some(v.into_pyarray(py).unbind());
        }
        self.arr.as_ref().expect("just set").clone_ref(py)
    }
}

struct Lazy2<T: Element> {
    vec: Option<(Vec<T>, usize, usize)>,
    arr: Option<Py<PyArray2<T>>>,
}

impl<T: Element> Lazy2<T> {
    fn new(v: Vec<T>, rows: usize, cols: usize) -> Self {
        Lazy2 { vec: Some((v, rows, cols)), arr: None }
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
enum LazyTables {
    Owned(Lazy2<i32>),
    Batch { owner: Py<PyScheduler>, rows: usize, cols: usize, arr: Option<Py<PyArray2<i32>>> },
}

impl LazyTables {
    fn get(&mut self, py: Python<'_>, step_id: u64) -> PyResult<Py<PyArray2<i32>>> {
        match self {
            LazyTables::Owned(l) => Ok(l.get(py)),
            LazyTables::Batch { arr: Some(a), .. } => Ok(a.clone_ref(py)),
            LazyTables::Batch { owner, rows, cols, arr } => {
                let sched = owner.bind(py).try_borrow().map_err(|_| {
                    to_py_err(CoreError::InvalidState { message: "block_tables read while the scheduler is busy".into() })
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
struct PySchedulerOutput {
    #[pyo3(get)]
    step_id: u64,
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
    #[pyo3(get)]
    block_size: usize,
    req_ids: Lazy1<i64>,
    seq_ids: Lazy1<i64>,
    query_start_loc: Lazy1<i32>,
    seq_lens: Lazy1<i32>,
    block_tables: LazyTables,
    input_ids: Lazy1<i64>,
    positions: Lazy1<i64>,
    slot_mapping: Lazy1<i64>,
    logits_indices: Lazy1<i64>,
    row_req_ids: Lazy1<i64>,
    row_seq_ids: Lazy1<i64>,
    row_sample_index: Lazy1<i32>,
    copy_ops: Lazy2<i32>,
    swap_out: Lazy2<i32>,
    swap_in: Lazy2<i32>,
    finished_req_ids: Lazy1<i64>,
    preempted_req_ids: Lazy1<i64>,
}

impl PySchedulerOutput {
    fn from_core(o: SchedulerOutput, owner: Py<PyScheduler>) -> Self {
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
            block_size: o.block_size,
            req_ids: Lazy1::new(o.req_ids),
            seq_ids: Lazy1::new(o.seq_ids),
            query_start_loc: Lazy1::new(o.query_start_loc),
            seq_lens: Lazy1::new(o.seq_lens),
            block_tables: match o.block_tables {
                BlockTables::Owned(v) => LazyTables::Owned(Lazy2::new(v, s, o.max_blocks)),
                BlockTables::Batch { .. } => LazyTables::Batch { owner, rows: s, cols: o.max_blocks, arr: None },
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
#[pyclass(module = "ferrokv._core", name = "FinishedSequence", frozen, get_all)]
struct PyFinishedSequence {
    request_id: u64,
    seq_id: u64,
    sample_index: u32,
    reason: &'static str,
    stop_token_id: Option<u32>,
    request_finished: bool,
}

#[pymethods]
impl PyFinishedSequence {
    fn __repr__(&self) -> String {
        format!(
            "FinishedSequence(request_id={}, seq_id={}, sample_index={}, reason={:?}, stop_token_id={:?}, request_finished={})",
            self.request_id,
            self.seq_id,
            self.sample_index,
            self.reason,
            self.stop_token_id,
            if self.request_finished { "True" } else { "False" }
        )
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
            request_finished: f.request_finished,
        }
    }
}

/// The iteration-level scheduler over a paged KV cache. See `_core.pyi`.
#[pyclass(module = "ferrokv._core", name = "Scheduler")]
struct PyScheduler {
    inner: Scheduler,
    /// Reused buffer for `update`'s sampled ids (no allocation per step).
    sampled: Vec<i64>,
}

#[pymethods]
impl PyScheduler {
    /// Keywords left out take `SchedulerConfig::default()` (also `_core.SCHEDULER_DEFAULTS`).
    #[new]
    #[pyo3(signature = (num_blocks, block_size=None, max_num_seqs=None, max_num_batched_tokens=None,
                        max_model_len=None, enable_prefix_caching=None, preemption_mode=None,
                        num_cpu_blocks=None, policy=None, watermark=None, admission_headroom=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        num_blocks: i64,
        block_size: Option<i64>,
        max_num_seqs: Option<i64>,
        max_num_batched_tokens: Option<i64>,
        max_model_len: Option<i64>,
        enable_prefix_caching: Option<bool>,
        preemption_mode: Option<&str>,
        num_cpu_blocks: Option<i64>,
        policy: Option<&str>,
        watermark: Option<f64>,
        admission_headroom: Option<f64>,
    ) -> PyResult<Self> {
        let d = SchedulerConfig::default();
        let size = |field: &'static str, v: Option<i64>, default: usize| v.map_or(Ok(default), |v| count(field, v));
        let cfg = SchedulerConfig {
            num_blocks: count("num_blocks", num_blocks)?,
            block_size: size("block_size", block_size, d.block_size)?,
            max_num_seqs: size("max_num_seqs", max_num_seqs, d.max_num_seqs)?,
            max_num_batched_tokens: size("max_num_batched_tokens", max_num_batched_tokens, d.max_num_batched_tokens)?,
            max_model_len: size("max_model_len", max_model_len, d.max_model_len)?,
            enable_prefix_caching: enable_prefix_caching.unwrap_or(d.enable_prefix_caching),
            preemption_mode: preemption_mode.map_or(Ok(d.preemption_mode), PreemptionMode::parse).map_err(to_py_err)?,
            num_cpu_blocks: size("num_cpu_blocks", num_cpu_blocks, d.num_cpu_blocks)?,
            policy: policy.map_or(Ok(d.policy), Policy::parse).map_err(to_py_err)?,
            watermark: watermark.unwrap_or(d.watermark),
            admission_headroom: admission_headroom.unwrap_or(d.admission_headroom),
        };
        Ok(PyScheduler { inner: Scheduler::new(cfg).map_err(to_py_err)?, sampled: Vec::new() })
    }

    #[pyo3(signature = (request_id, prompt_token_ids, max_tokens, *, n=1, priority=0, eos_token_id=None,
                        stop_token_ids=None, min_tokens=0, ignore_eos=false, cache_salt=None, reserve_seqs=0))]
    #[allow(clippy::too_many_arguments)]
    fn add_request(
        &mut self,
        py: Python<'_>,
        request_id: i64,
        prompt_token_ids: &Bound<'_, PyAny>,
        max_tokens: i64,
        n: i64,
        priority: i32,
        eos_token_id: Option<i64>,
        stop_token_ids: Option<&Bound<'_, PyAny>>,
        min_tokens: i64,
        ignore_eos: bool,
        cache_salt: Option<String>,
        reserve_seqs: i64,
    ) -> PyResult<()> {
        let request_id = non_negative("request_id", request_id)?;
        let prompt = token_ids("prompt_token_ids", prompt_token_ids)?
            .into_iter()
            .map(|t| token_id("prompt_token_ids", t))
            .collect::<PyResult<Vec<u32>>>()?;
        let stops = match stop_token_ids {
            Some(s) => token_ids("stop_token_ids", s)?
                .into_iter()
                .map(|t| token_id("stop_token_ids", t))
                .collect::<PyResult<Vec<u32>>>()?,
            None => Vec::new(),
        };
        if max_tokens < 1 {
            return Err(invalid("max_tokens", max_tokens, "must be >= 1"));
        }
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
            cache_salt,
            reserve_seqs: u32::try_from(reserve_seqs).map_err(|_| invalid("reserve_seqs", reserve_seqs, "must be >= 0"))?,
        };
        let inner = &mut self.inner;
        py.detach(|| inner.add_request(req)).map_err(to_py_err)
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

    /// Appends one sampled token per logits row of `output` (GIL released).
    fn update(&mut self, py: Python<'_>, output: PyRef<'_, PySchedulerOutput>, sampled_token_ids: &Bound<'_, PyAny>) -> PyResult<Vec<PyFinishedSequence>> {
        let step_id = output.step_id;
        drop(output);
        let mut sampled = std::mem::take(&mut self.sampled);
        sampled.clear();
        token_ids_into("sampled_token_ids", sampled_token_ids, &mut sampled)?;
        let inner = &mut self.inner;
        let done = py.detach(|| inner.update(step_id, &sampled));
        self.sampled = sampled;
        let done = done.map_err(to_py_err)?;
        Ok(done.into_iter().map(Into::into).collect())
    }

    /// Undoes the step of `output` instead of `update` (its forward pass failed or was
    /// interrupted): no token is appended and no computed count advances (GIL released).
    fn cancel_step(&mut self, py: Python<'_>, output: PyRef<'_, PySchedulerOutput>) -> PyResult<()> {
        let step_id = output.step_id;
        drop(output);
        let inner = &mut self.inner;
        py.detach(|| inner.cancel_step(step_id)).map_err(to_py_err)
    }

    fn abort(&mut self, request_id: i64) -> PyResult<()> {
        let id = non_negative("request_id", request_id)?;
        self.inner.abort(id).map_err(to_py_err)
    }

    #[pyo3(signature = (seq_id, next_token=None))]
    fn fork_sequence(&mut self, seq_id: i64, next_token: Option<i64>) -> PyResult<u64> {
        let seq_id = non_negative("seq_id", seq_id)?;
        let tok = next_token.map(|t| token_id("next_token", t)).transpose()?;
        self.inner.fork_sequence(seq_id, tok).map_err(to_py_err)
    }

    fn drop_sequence(&mut self, seq_id: i64) -> PyResult<bool> {
        let seq_id = non_negative("seq_id", seq_id)?;
        self.inner.drop_sequence(seq_id).map_err(to_py_err)
    }

    fn reset_prefix_cache(&mut self) {
        self.inner.reset_prefix_cache();
    }

    fn request_seq_ids(&self, request_id: i64) -> PyResult<Vec<u64>> {
        self.inner.request_seq_ids(non_negative("request_id", request_id)?).map_err(to_py_err)
    }

    fn num_cached_tokens(&self, request_id: i64) -> PyResult<usize> {
        self.inner.num_cached_tokens(non_negative("request_id", request_id)?).map_err(to_py_err)
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
        self.inner.check_invariants().map_err(|m| to_py_err(CoreError::InvalidState { message: m }))
    }

    #[getter]
    fn num_free_blocks(&self) -> usize {
        self.inner.num_free_blocks()
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

    /// Counters and the current KV usage as a dict of ints.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.inner.stats();
        let k = self.inner.kv_stats();
        let u = self.inner.kv_usage();
        let d = PyDict::new(py);
        let items: [(&str, u64); 33] = [
            ("steps", s.steps),
            ("requests_added", s.requests_added),
            ("requests_finished", s.requests_finished),
            ("requests_aborted", s.requests_aborted),
            ("capacity_aborts", s.capacity_aborts),
            ("preemptions", s.preemptions),
            ("swap_preemptions", s.swap_preemptions),
            ("recompute_preemptions", s.recompute_preemptions),
            ("prompt_tokens", s.prompt_tokens),
            ("prompt_tokens_computed", s.prompt_tokens_computed),
            ("output_tokens_recomputed", s.output_tokens_recomputed),
            ("cached_prompt_tokens", s.cached_prompt_tokens),
            ("first_admission_cached_tokens", s.first_admission_cached_tokens),
            ("decode_tokens", s.decode_tokens),
            ("generated_tokens", s.generated_tokens),
            ("max_running_seqs", s.max_running_seqs),
            ("max_step_tokens", s.max_step_tokens),
            ("cancelled_steps", s.cancelled_steps),
            ("cow_copies", k.cow_copies),
            ("blocks_swapped_out", k.blocks_swapped_out),
            ("blocks_swapped_in", k.blocks_swapped_in),
            ("prefix_evictions", k.prefix_evictions),
            ("num_blocks", u.num_blocks as u64),
            ("num_free_blocks", u.num_free_blocks as u64),
            ("num_used_blocks", u.num_used_blocks as u64),
            ("num_cached_blocks", u.num_cached_blocks as u64),
            ("num_shared_blocks", u.num_shared_blocks as u64),
            ("num_block_refs", u.num_block_refs as u64),
            ("num_used_token_slots", u.num_used_token_slots as u64),
            ("block_size", u.block_size as u64),
            ("num_waiting", self.inner.num_waiting() as u64),
            ("num_running", self.inner.num_running() as u64),
            ("num_running_seqs", self.inner.num_running_seqs() as u64),
        ];
        for (key, v) in items {
            d.set_item(key, v)?;
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

/// `SchedulerConfig::default()` as a dict: the one source of the engine's scheduling defaults
/// (`EngineArgs` and the CLI read it), under the constructor's keyword names.
fn scheduler_defaults(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    let d = SchedulerConfig::default();
    let out = PyDict::new(py);
    out.set_item("block_size", d.block_size)?;
    out.set_item("max_num_seqs", d.max_num_seqs)?;
    out.set_item("max_num_batched_tokens", d.max_num_batched_tokens)?;
    out.set_item("max_model_len", d.max_model_len)?;
    out.set_item("enable_prefix_caching", d.enable_prefix_caching)?;
    out.set_item("preemption_mode", d.preemption_mode.as_str())?;
    out.set_item("num_cpu_blocks", d.num_cpu_blocks)?;
    out.set_item("policy", d.policy.as_str())?;
    out.set_item("watermark", d.watermark)?;
    out.set_item("admission_headroom", d.admission_headroom)?;
    Ok(out)
}

/// Checks the scheduler settings an engine knows before it loads a model, with the core's own
/// rules (`SchedulerConfig::validate`), so each rule lives once. The settings learnt later take
/// the smallest valid value while unknown (None): `num_blocks` (sized from memory) and
/// `max_model_len` (from the model); the token budget takes `max_num_seqs` (an engine raises a
/// smaller one to it); the rest take the core's defaults. Every argument is required (no second
/// copy of the defaults).
#[pyfunction]
#[pyo3(signature = (*, block_size, max_num_seqs, num_blocks, max_model_len, num_cpu_blocks, preemption_mode, policy))]
fn validate_scheduler_config(
    block_size: i64,
    max_num_seqs: i64,
    num_blocks: Option<i64>,
    max_model_len: Option<i64>,
    num_cpu_blocks: i64,
    preemption_mode: &str,
    policy: &str,
) -> PyResult<()> {
    let max_num_seqs = count("max_num_seqs", max_num_seqs)?;
    let cfg = SchedulerConfig {
        num_blocks: num_blocks.map_or(Ok(2), |v| count("num_blocks", v))?,
        block_size: count("block_size", block_size)?,
        max_num_seqs,
        max_num_batched_tokens: max_num_seqs,
        max_model_len: max_model_len.map_or(Ok(1), |v| count("max_model_len", v))?,
        preemption_mode: PreemptionMode::parse(preemption_mode).map_err(to_py_err)?,
        num_cpu_blocks: count("num_cpu_blocks", num_cpu_blocks)?,
        policy: Policy::parse(policy).map_err(to_py_err)?,
        ..SchedulerConfig::default()
    };
    cfg.validate().map_err(to_py_err)
}

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    let x = exceptions(py);
    for (name, cls) in [
        ("FerrokvError", &x.base),
        ("InvalidArgumentError", &x.invalid),
        ("DuplicateRequestError", &x.duplicate),
        ("UnknownRequestError", &x.unknown_request),
        ("UnknownSequenceError", &x.unknown_sequence),
        ("PromptTooLongError", &x.prompt_too_long),
        ("CacheCapacityError", &x.capacity),
        ("SchedulerStateError", &x.state),
    ] {
        m.add(name, cls.bind(py))?;
    }
    m.add_class::<PyScheduler>()?;
    m.add_class::<PySchedulerOutput>()?;
    m.add_class::<PyFinishedSequence>()?;
    m.add_function(wrap_pyfunction!(validate_scheduler_config, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add("SCHEDULER_DEFAULTS", scheduler_defaults(py)?)?;
    let choices = PyDict::new(py);
    choices.set_item("preemption_mode", PreemptionMode::ALL.iter().map(|(_, n)| *n).collect::<Vec<_>>())?;
    choices.set_item("policy", Policy::ALL.iter().map(|(_, n)| *n).collect::<Vec<_>>())?;
    m.add("SCHEDULER_CHOICES", choices)?;
    Ok(())
}
