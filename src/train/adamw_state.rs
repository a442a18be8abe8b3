//! Reading a saved [`super::AdamW`] state: every entry checked before any is used, so that a
//! malformed checkpoint is an error naming the entry, never a panic or a half-loaded state.

use std::collections::{HashMap, HashSet};

use candle::{bail, DType, Device, Result, Tensor, Var};

/// The `(2, numel)` moments of each of `vars` (fresh copies, on the variable's device) and
/// the step count held by `state`.
pub(super) fn parse(
    vars: &[(String, Var)],
    state: &HashMap<String, Tensor>,
) -> Result<(Vec<Tensor>, usize)> {
    check_keys(vars, state)?;
    let step_dev = vars.first().map(|(_, v)| v.device().clone());
    let step = step(state.get("step"), step_dev.as_ref().unwrap_or(&Device::Cpu))?;
    let moments = vars
        .iter()
        .map(|(name, var)| {
            let parts = [
                moment(state, "m", name, var)?,
                moment(state, "v", name, var)?,
            ];
            // `stack` writes a new buffer: the update must not write into `state`'s tensors.
            Tensor::stack(&parts, 0)
        })
        .collect::<Result<Vec<_>>>()?;
    Ok((moments, step))
}

/// Errors on an entry that is neither `step` nor a moment of one of `vars`.
fn check_keys(vars: &[(String, Var)], state: &HashMap<String, Tensor>) -> Result<()> {
    let names: HashSet<&str> = vars.iter().map(|(n, _)| n.as_str()).collect();
    let known = |key: &str| {
        key == "step"
            || ["m.", "v."]
                .iter()
                .any(|p| key.strip_prefix(p).is_some_and(|n| names.contains(n)))
    };
    let mut unknown: Vec<&str> = state
        .keys()
        .map(String::as_str)
        .filter(|k| !known(k))
        .collect();
    if !unknown.is_empty() {
        unknown.sort_unstable();
        bail!(
            "optimizer state: unexpected entries {unknown:?}, expected only step and m.NAME / \
             v.NAME for the optimiser's variables"
        )
    }
    Ok(())
}

/// `state[PREFIX.NAME]` as a flat F32 tensor on `var`'s device.
fn moment(state: &HashMap<String, Tensor>, prefix: &str, name: &str, var: &Var) -> Result<Tensor> {
    let key = format!("{prefix}.{name}");
    let Some(t) = state.get(&key) else {
        bail!("optimizer state: {key} is missing")
    };
    if t.dims() != var.dims() || t.dtype() != DType::F32 {
        bail!(
            "optimizer state: {key} is {:?} {:?}, expected {:?} F32 (its variable's shape)",
            t.dims(),
            t.dtype(),
            var.dims()
        )
    }
    check_device(&key, t, var.device())?;
    t.to_device(var.device())?.flatten_all()
}

/// Errors unless `t` is on `dev` or on the CPU (a checkpoint read from a file).
fn check_device(key: &str, t: &Tensor, dev: &Device) -> Result<()> {
    if !t.device().is_cpu() && !t.device().same_device(dev) {
        bail!(
            "optimizer state: {key} is on {:?}, expected {:?} or the CPU",
            t.device().location(),
            dev.location()
        )
    }
    Ok(())
}

/// The step count: one element of an integer dtype, or of F32/F64 holding a whole number
/// (the types checkpoints use), in `0..=i32::MAX` (the bias corrections' `powi`).
fn step(t: Option<&Tensor>, dev: &Device) -> Result<usize> {
    let Some(t) = t else {
        bail!("optimizer state: step is missing")
    };
    if t.rank() > 1 || t.elem_count() != 1 {
        bail!(
            "optimizer state: step has shape {:?}, expected (1,) (or a scalar)",
            t.dims()
        )
    }
    if !matches!(
        t.dtype(),
        DType::U8 | DType::U32 | DType::I16 | DType::I32 | DType::I64 | DType::F32 | DType::F64
    ) {
        bail!(
            "optimizer state: step is {:?}, expected U32 (or another integer dtype, F32 or F64)",
            t.dtype()
        )
    }
    check_device("step", t, dev)?;
    // Converted on the CPU: not every integer cast has a CUDA kernel.
    let value = t
        .to_device(&Device::Cpu)?
        .flatten_all()?
        .to_dtype(DType::F64)?
        .get(0)?
        .to_scalar::<f64>()?;
    if !(value.is_finite() && value >= 0.0 && value.fract() == 0.0 && value <= i32::MAX as f64) {
        bail!(
            "optimizer state: step is {value}, expected a whole number in 0..={}",
            i32::MAX
        )
    }
    Ok(value as usize)
}
