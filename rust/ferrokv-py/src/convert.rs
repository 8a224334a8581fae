//! Argument conversion: Python values to owned Rust values, with typed errors naming the
//! field (negative sizes, token ids outside u32, arrays of the wrong dtype).

use crate::*;
use numpy::{Element, PyArray1, PyArrayMethods};
use pyo3::prelude::*;

// ---------------------------------------------------------------------------------------------
// Argument conversion.

pub(crate) fn non_negative(field: &'static str, v: i64) -> PyResult<u64> {
    u64::try_from(v).map_err(|_| invalid(field, v, "must be >= 0"))
}

pub(crate) fn count(field: &'static str, v: i64) -> PyResult<usize> {
    non_negative(field, v).map(|v| v as usize)
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
