//! Argument conversion: Python values to owned Rust values, with typed errors naming the
//! field (negative sizes, token ids outside u32, arrays of the wrong dtype).

use crate::*;
use numpy::{Element, PyArray1, PyArrayMethods};
use pyo3::prelude::*;

// ---------------------------------------------------------------------------------------------
// Argument conversion.

/// An int argument as `T`: an int outside `T`'s range is an `InvalidArgumentError` naming the
/// field and the value (never a bare `OverflowError`); a non-int stays a `TypeError`.
pub(crate) fn int_arg<T: TryFrom<i128>>(field: &'static str, obj: &Bound<'_, PyAny>, range: &str) -> PyResult<T> {
    let too_big = |obj: &Bound<'_, PyAny>| invalid(field, obj.str().map(|s| s.to_string()).unwrap_or_default(), range);
    match obj.extract::<i64>() {
        Ok(v) => T::try_from(v as i128).map_err(|_| too_big(obj)),
        Err(e) if e.is_instance_of::<pyo3::exceptions::PyOverflowError>(obj.py()) => Err(too_big(obj)),
        Err(e) => Err(e),
    }
}

/// `int_arg` for an optional argument.
pub(crate) fn opt_int_arg<T: TryFrom<i128>>(field: &'static str, obj: Option<&Bound<'_, PyAny>>, range: &str) -> PyResult<Option<T>> {
    obj.filter(|o| !o.is_none()).map(|o| int_arg(field, o, range)).transpose()
}

/// A str argument: a non-str or a string with a lone surrogate is an `InvalidArgumentError`
/// naming the field.
pub(crate) fn str_arg(field: &'static str, obj: &Bound<'_, PyAny>) -> PyResult<String> {
    let s = obj.cast::<pyo3::types::PyString>().map_err(|_| invalid(field, obj.get_type().name().map(|n| n.to_string()).unwrap_or_default(), "must be a str"))?;
    s.to_str().map(str::to_owned).map_err(|_| invalid(field, "<a lone surrogate>", "must be valid Unicode"))
}

/// Any Python int as a u64, modulo 2^64 (a seed: every int is a valid one); a non-int is an
/// `InvalidArgumentError` naming the field.
pub(crate) fn any_int_as_u64(field: &'static str, obj: &Bound<'_, PyAny>) -> PyResult<u64> {
    if !obj.is_instance_of::<pyo3::types::PyInt>() {
        let ty = obj.get_type().name().map(|n| n.to_string()).unwrap_or_default();
        return Err(invalid(field, ty, "must be an int"));
    }
    obj.call_method1("__and__", (u64::MAX,))?.extract::<u64>()
}

pub(crate) fn non_negative(field: &'static str, v: i64) -> PyResult<u64> {
    u64::try_from(v).map_err(|_| invalid(field, v, "must be >= 0"))
}


pub(crate) fn token_id(field: &'static str, v: i64) -> PyResult<u32> {
    u32::try_from(v).map_err(|_| invalid(field, v, "token ids must be in [0, 2^32)"))
}

/// Token ids from a numpy integer array or any sequence of ints.
pub(crate) fn token_ids(field: &'static str, obj: &Bound<'_, PyAny>) -> PyResult<Vec<i64>> {
    let mut out = Vec::new();
    token_ids_into(field, obj, &mut out)?;
    Ok(out)
}

/// `token_ids`, appended to `out`. The dtype is checked by a cast, not by a failing extract
/// (which would build a Python exception on every call).
pub(crate) fn token_ids_into(field: &'static str, obj: &Bound<'_, PyAny>, out: &mut Vec<i64>) -> PyResult<()> {
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
    let v = obj.extract::<Vec<i64>>().map_err(|_| {
        invalid(
            field,
            obj.get_type().name().map(|n| format!("<{n}>")).unwrap_or_default(),
            "must be a sequence of ints",
        )
    })?;
    out.extend_from_slice(&v);
    Ok(())
}

/// A list of token-id lists (`bad_words`), each non-empty.
pub(crate) fn token_id_lists(field: &'static str, obj: &Bound<'_, PyAny>) -> PyResult<Vec<Vec<u32>>> {
    let mut out = Vec::new();
    for item in obj.try_iter()? {
        let ids = token_ids(field, &item?)?.into_iter().map(|t| token_id(field, t)).collect::<PyResult<Vec<u32>>>()?;
        if ids.is_empty() {
            return Err(invalid(field, "[]", "must not contain an empty token list"));
        }
        out.push(ids);
    }
    Ok(out)
}

/// A request's `SamplingSpec` from its keywords; `knobs` are temperature, top_p, min_p and the
/// presence, frequency and repetition penalties (the core validates them at admission).
pub(crate) fn sampling_spec(knobs: [f64; 6], top_k: i64, logprobs: Option<i64>) -> PyResult<ferrokv_core::SamplingSpec> {
    const NAMES: [&str; 6] =
        ["temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"];
    for (name, v) in NAMES.into_iter().zip(knobs) {
        // A finite f64 beyond f32 would reach the core's check as inf, misreporting the value.
        if v.is_finite() && !(v as f32).is_finite() {
            return Err(invalid(name, format!("{v:e}"), "is out of float32 range"));
        }
    }
    let [temperature, top_p, min_p, presence_penalty, frequency_penalty, repetition_penalty] = knobs.map(|v| v as f32);
    Ok(ferrokv_core::SamplingSpec {
        temperature,
        top_k: top_k.clamp(-1, i32::MAX as i64) as i32,
        top_p,
        min_p,
        presence_penalty,
        frequency_penalty,
        repetition_penalty,
        num_logprobs: match logprobs {
            None => -1,
            Some(k) => i32::try_from(k).ok().filter(|&k| k >= 0).ok_or_else(|| invalid("logprobs", k, "must be >= 0 (or None)"))?,
        },
        ..Default::default()
    })
}
