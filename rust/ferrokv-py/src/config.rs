//! The core's configuration as Python sees it: its defaults (`SCHEDULER_DEFAULTS`) and its
//! checks (`validate_scheduler_config`), each defined once in the core.

use crate::*;
use ferrokv_core::{Named, Policy, PreemptionMode, SchedulerConfig};
use pyo3::prelude::*;
use pyo3::types::PyDict;

/// `SchedulerConfig::default()` as a dict: the one source of the engine's scheduling defaults
/// (`EngineArgs` and the CLI read it), under the constructor's keyword names.
pub(crate) fn scheduler_defaults(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
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
pub(crate) fn validate_scheduler_config(
    block_size: &Bound<'_, PyAny>,
    max_num_seqs: &Bound<'_, PyAny>,
    num_blocks: Option<&Bound<'_, PyAny>>,
    max_model_len: Option<&Bound<'_, PyAny>>,
    num_cpu_blocks: &Bound<'_, PyAny>,
    preemption_mode: &str,
    policy: &str,
) -> PyResult<()> {
    const SIZE: &str = "must be in [0, 2^63)";
    let max_num_seqs = int_arg("max_num_seqs", max_num_seqs, SIZE)?;
    let cfg = SchedulerConfig {
        num_blocks: opt_int_arg("num_blocks", num_blocks, SIZE)?.unwrap_or(2),
        block_size: int_arg("block_size", block_size, SIZE)?,
        max_num_seqs,
        max_num_batched_tokens: max_num_seqs,
        max_model_len: opt_int_arg("max_model_len", max_model_len, SIZE)?.unwrap_or(1),
        preemption_mode: PreemptionMode::parse(preemption_mode).map_err(to_py_err)?,
        num_cpu_blocks: int_arg("num_cpu_blocks", num_cpu_blocks, SIZE)?,
        policy: Policy::parse(policy).map_err(to_py_err)?,
        ..SchedulerConfig::default()
    };
    cfg.validate().map_err(to_py_err)
}
