//! `ferrokv._core`: thin PyO3 bindings over `ferrokv-core` (and `ferrokv-text`: `TextModel`,
//! `SeqText`).
//!
//! Only conversions live here: arguments become owned Rust values, the work runs with the GIL
//! released (`py.detach`), each `CoreError` variant maps to one Python exception class, and
//! the step's buffers move into numpy arrays without copying (lazily, on first access, so an
//! array the runner never reads costs nothing). The block tables of a step that holds every
//! running sequence are a read-only view of the scheduler's persistent batch matrix, which
//! keeps the `Scheduler` object alive.

mod config;
mod convert;
mod errors;
mod output;
mod scheduler;
mod step_results;
mod text;

pub(crate) use config::*;
pub(crate) use convert::*;
pub(crate) use errors::*;
pub(crate) use output::*;
pub(crate) use scheduler::*;
pub(crate) use step_results::*;
pub(crate) use text::*;

use ferrokv_core::{Named, Policy, PreemptionMode};
use pyo3::prelude::*;
use pyo3::types::PyDict;

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    // The core's timestamps are on time.monotonic()'s scale, so the engine can compare them.
    let monotonic: f64 = py.import("time")?.getattr("monotonic")?.call0()?.extract()?;
    ferrokv_core::clock::anchor(monotonic);
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
    m.add_class::<PyTextModel>()?;
    m.add_class::<PySeqText>()?;
    m.add_function(wrap_pyfunction!(validate_scheduler_config, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add("SCHEDULER_DEFAULTS", scheduler_defaults(py)?)?;
    let choices = PyDict::new(py);
    choices.set_item("preemption_mode", PreemptionMode::ALL.iter().map(|(_, n)| *n).collect::<Vec<_>>())?;
    choices.set_item("policy", Policy::ALL.iter().map(|(_, n)| *n).collect::<Vec<_>>())?;
    m.add("SCHEDULER_CHOICES", choices)?;
    Ok(())
}
