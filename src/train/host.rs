//! What the training ops share on the host: argument checks with errors naming the argument,
//! ids read from a CPU storage, and tensors built from computed storages (CPU storages as f32
//! and back: `crate::cpu::gather_f32` / `to_storage`, as the attention uses them).

use candle::op::BackpropOp;
use candle::{bail, CpuStorage, DType, Layout, Result, Shape, Storage, Tensor};

/// Errors unless `t` has a float dtype the ops support (BF16, F16, F32).
pub(super) fn check_float(t: &Tensor, what: &str) -> Result<()> {
    match t.dtype() {
        DType::BF16 | DType::F16 | DType::F32 => Ok(()),
        dt => bail!("{what}: dtype {dt:?} is not supported, expected BF16, F16 or F32"),
    }
}

/// Errors unless `a` and `b` are on the same device.
pub(super) fn check_same_device(a: &Tensor, b: &Tensor, what: &str) -> Result<()> {
    if !a.device().same_device(b.device()) {
        bail!(
            "{what}: on {:?}, expected the device of the other inputs ({:?})",
            b.device().location(),
            a.device().location()
        )
    }
    Ok(())
}

/// A CPU storage's contiguous u32 elements.
pub(super) fn u32s<'a>(s: &'a CpuStorage, l: &Layout, what: &str) -> Result<&'a [u32]> {
    match (s, l.contiguous_offsets()) {
        (CpuStorage::U32(v), Some((a, b))) => Ok(&v[a..b]),
        _ => bail!("{what}: expected a contiguous U32 tensor"),
    }
}

/// A tensor (outside any graph) over a storage computed by a backward pass.
pub(super) fn tensor(s: Storage, shape: impl Into<Shape>) -> Tensor {
    Tensor::from_storage(s, shape, BackpropOp::none(), false)
}
