//! Exceptions: one Python class per `CoreError` variant, under `FerrokvError`; bad input
//! also derives from `ValueError`. Each carries the field, value and reason it names.

use ferrokv_core::CoreError;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyTuple, PyType};

// ---------------------------------------------------------------------------------------------
// Exceptions: a hierarchy under FerrokvError; bad input also derives from ValueError.

pub(crate) struct Exceptions {
    pub(crate) base: Py<PyType>,
    pub(crate) invalid: Py<PyType>,
    pub(crate) duplicate: Py<PyType>,
    pub(crate) unknown_request: Py<PyType>,
    pub(crate) unknown_sequence: Py<PyType>,
    pub(crate) prompt_too_long: Py<PyType>,
    pub(crate) capacity: Py<PyType>,
    pub(crate) state: Py<PyType>,
}

pub(crate) static EXCEPTIONS: PyOnceLock<Exceptions> = PyOnceLock::new();

pub(crate) fn new_exception(py: Python<'_>, name: &str, bases: Vec<Bound<'_, PyAny>>, doc: &str) -> PyResult<Py<PyType>> {
    let ns = PyDict::new(py);
    ns.set_item("__module__", "ferrokv")?;
    ns.set_item("__doc__", doc)?;
    let cls = py
        .import("builtins")?
        .getattr("type")?
        .call1((name, PyTuple::new(py, bases)?, ns))?;
    Ok(cls.cast_into::<PyType>()?.unbind())
}

pub(crate) fn build_exceptions(py: Python<'_>) -> PyResult<Exceptions> {
    let exc = py.get_type::<pyo3::exceptions::PyException>().into_any();
    let value = py.get_type::<pyo3::exceptions::PyValueError>().into_any();
    let runtime = py.get_type::<pyo3::exceptions::PyRuntimeError>().into_any();
    let base = new_exception(py, "FerrokvError", vec![exc], "Base class of every ferrokv error.")?;
    let b = || base.bind(py).clone().into_any();
    let invalid = new_exception(
        py,
        "InvalidArgumentError",
        vec![b(), value],
        "A field has a bad value; the message names both.",
    )?;
    for attr in ["field", "value", "reason"] {
        invalid.bind(py).setattr(attr, py.None())?; // set on instances raised for a bad field value
    }
    let i = || invalid.bind(py).clone().into_any();
    Ok(Exceptions {
        duplicate: new_exception(
            py,
            "DuplicateRequestError",
            vec![i()],
            "A live request already uses this request_id.",
        )?,
        unknown_request: new_exception(py, "UnknownRequestError", vec![i()], "No live request has this request_id.")?,
        unknown_sequence: new_exception(py, "UnknownSequenceError", vec![i()], "No live sequence has this seq_id.")?,
        prompt_too_long: new_exception(py, "PromptTooLongError", vec![i()], "The prompt exceeds max_model_len.")?,
        capacity: new_exception(py, "CacheCapacityError", vec![i()], "The request could never fit in the KV cache.")?,
        state: new_exception(py, "SchedulerStateError", vec![b(), runtime], "Calls made out of order.")?,
        invalid,
        base,
    })
}

pub(crate) fn exceptions(py: Python<'_>) -> &'static Exceptions {
    EXCEPTIONS.get_or_init(py, || build_exceptions(py).expect("creating ferrokv exception classes"))
}

pub(crate) fn to_py_err(e: CoreError) -> PyErr {
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
        // The parts of the message as attributes, so a caller can name the field its own way.
        let v = err.value(py);
        let set = match &e {
            CoreError::InvalidArgument { field, value, reason } => v
                .setattr("field", *field)
                .and(v.setattr("value", value))
                .and(v.setattr("reason", reason)),
            other => other.field().map_or(Ok(()), |field| v.setattr("field", field)),
        };
        match set {
            Ok(()) => err,
            Err(e) => e,
        }
    })
}

pub(crate) fn invalid(field: &'static str, value: impl std::fmt::Display, reason: &str) -> PyErr {
    to_py_err(CoreError::invalid(field, value, reason))
}
