//! `TextModel` / `SeqText`: thin bindings over `ferrokv-text` (incremental detokenization and
//! stop strings), so Python can drive and test the Rust detokenizer.
//!
//! Invariants: a `SeqText` keeps its `TextModel` alive (it holds the model's `Arc`); bad input
//! (tokenizer.json that does not load, a token id outside u32, a negative `min_tokens`) raises
//! `InvalidArgumentError` (a `ValueError`) naming the field and value. Costs: loading runs with
//! the GIL released; `append` is sub-microsecond work, so it keeps the GIL (releasing it would
//! cost more than the call).

use std::sync::Arc;

use ferrokv_text::{SeqText, StopStrings, TextModel};
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;

use crate::*;

const TOKEN_RANGE: &str = "token ids must be in [0, 2^32)";

/// A tokenizer.json loaded for decoding. See `_core.pyi`.
#[pyclass(module = "ferrokv._core", name = "TextModel", frozen)]
pub(crate) struct PyTextModel {
    pub(crate) inner: Arc<TextModel>,
}

/// The first characters of a (long) argument, for an error message.
fn excerpt(s: &str) -> String {
    let head: String = s.chars().take(40).collect();
    if head.len() < s.len() {
        format!("{head:?}... ({} chars)", s.chars().count())
    } else {
        format!("{head:?}")
    }
}

fn ids_arg(field: &'static str, obj: &Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
    token_ids(field, obj)?.into_iter().map(|t| token_id(field, t)).collect()
}

#[pymethods]
impl PyTextModel {
    #[new]
    fn new(py: Python<'_>, tokenizer_json: &Bound<'_, PyAny>) -> PyResult<Self> {
        let json = str_arg("tokenizer_json", tokenizer_json)?;
        let model = py.detach(|| TextModel::from_json(&json));
        let model = model.map_err(|e| invalid("tokenizer_json", excerpt(&json), &e.to_string()))?;
        Ok(PyTextModel { inner: Arc::new(model) })
    }

    #[pyo3(signature = (ids, skip_special_tokens=true))]
    fn decode(&self, py: Python<'_>, ids: &Bound<'_, PyAny>, skip_special_tokens: bool) -> PyResult<String> {
        let ids = ids_arg("ids", ids)?;
        Ok(py.detach(|| self.inner.decode(&ids, skip_special_tokens)))
    }

    #[getter]
    fn vocab_size(&self) -> usize {
        self.inner.vocab_size()
    }
}

/// One sequence's incremental detokenizer. See `_core.pyi`.
#[pyclass(module = "ferrokv._core", name = "SeqText")]
pub(crate) struct PySeqText {
    model: Arc<TextModel>,
    inner: SeqText,
}

#[pymethods]
impl PySeqText {
    #[new]
    #[pyo3(signature = (model, prompt_tail, stop=Vec::new(), include_stop_str_in_output=false, min_tokens=0,
                        skip_special_tokens=true))]
    fn new(
        model: PyRef<'_, PyTextModel>,
        prompt_tail: &Bound<'_, PyAny>,
        stop: Vec<String>,
        include_stop_str_in_output: bool,
        min_tokens: i64,
        skip_special_tokens: bool,
    ) -> PyResult<Self> {
        let prompt_tail = ids_arg("prompt_tail", prompt_tail)?;
        let min_tokens = u32::try_from(min_tokens).map_err(|_| invalid("min_tokens", min_tokens, "must be in [0, 2^32)"))?;
        let params = Arc::new(StopStrings::new(stop, include_stop_str_in_output, min_tokens, skip_special_tokens));
        let model = model.inner.clone();
        let inner = SeqText::new(&model, params, &prompt_tail);
        Ok(PySeqText { model, inner })
    }

    /// Appends one token; returns the index of the stop string it completed, if any.
    fn append(&mut self, token: &Bound<'_, PyAny>) -> PyResult<Option<u32>> {
        let token: u32 = int_arg("token", token, TOKEN_RANGE)?;
        if let Some(i) = self.inner.stop_index() {
            return Err(PyRuntimeError::new_err(format!("sequence already stopped on stop string {i}")));
        }
        Ok(self.inner.append(&self.model, token))
    }

    fn flush(&mut self) {
        self.inner.flush(&self.model);
    }

    fn take_delta(&mut self) -> String {
        self.inner.take_delta().to_owned()
    }

    #[getter]
    fn text(&self) -> &str {
        self.inner.text()
    }

    #[getter]
    fn num_tokens(&self) -> u32 {
        self.inner.num_tokens()
    }

    #[getter]
    fn stop_index(&self) -> Option<u32> {
        self.inner.stop_index()
    }
}

/// A request's stop strings (`stop`: None, or a list of non-empty str); they need a text layer.
pub(crate) fn stop_strings(stop: Option<&Bound<'_, PyAny>>, has_text: bool) -> PyResult<Vec<String>> {
    let Some(stop) = stop.filter(|s| !s.is_none()) else {
        return Ok(Vec::new());
    };
    let list: Vec<String> = stop.extract().map_err(|_| invalid("stop", stop.repr().map_or_else(|_| "?".into(), |r| r.to_string()), "must be a list of str"))?;
    if let Some(s) = list.iter().find(|s| s.is_empty()) {
        return Err(invalid("stop", format!("{s:?}"), "stop strings must not be empty"));
    }
    if !list.is_empty() && !has_text {
        return Err(invalid("stop", format!("{list:?}"), "stop strings need a text layer (Scheduler.attach_text)"));
    }
    Ok(list)
}
