//! Launchers of the attention sinks' kernels (`cuda/train/sinks.cuh`) for `crate::sinks`,
//! which holds their contract: O `(outer, rows, heads, d)` in f16/bf16, its LSE
//! `(outer, heads, rows)` and the sinks `(heads)` in f32, all contiguous; `n = outer * rows`.

use candle::backend::BackendStorage;
use candle::{bail, CudaStorage, DType, Layout, Result};

use super::kernels::{Op, TrainKernel};
use super::launch::{self, Arg};

/// `n`, `rows`, `heads` and `d` as the kernels' integer arguments.
fn sizes([n, rows, heads, d]: [usize; 4]) -> Result<[Arg; 4]> {
    let int = |x: usize, what: &str| match i32::try_from(x) {
        Ok(x) => Ok(Arg::I32(x)),
        Err(_) => bail!("sinks: {what} {x} is past the kernels' 32-bit range"),
    };
    Ok([
        Arg::I64(n as i64),
        int(rows, "rows")?,
        int(heads, "num_heads")?,
        int(d, "head_dim")?,
    ])
}

/// Turns the forward's `out` and `lse` (fresh, contiguous from element 0) into the result with
/// the `sinks` in place.
pub(crate) fn fix_up(
    out: &mut CudaStorage,
    lse: &mut CudaStorage,
    sinks: (&CudaStorage, &Layout),
    dims: [usize; 4],
) -> Result<()> {
    let dev = out.device.clone();
    let name = TrainKernel::name(Op::SinksFwd, &[("sinks: out", out.dtype())])?;
    let [n, .., heads, _] = dims;
    let args = sizes(dims)?;
    let stream = dev.cuda_stream();
    let (s, _s) = launch::ptr(sinks.0, sinks.1, &stream)?;
    let (o, _o) = launch::ptr_mut(out, 0, &stream)?;
    let (l, _l) = launch::ptr_mut(lse, 0, &stream)?;
    let mut all = vec![Arg::Ptr(o), Arg::Ptr(l), Arg::Ptr(s)];
    all.extend(args);
    // A warp per (row, head), 8 per block.
    let blocks = launch::stride_blocks(&dev, n * heads, 8)?;
    launch::launch(&dev, name, blocks, 256, &all)
}

/// The sinks' gradient `(heads)` f32 from the output, its gradient (both `out`'s dtype), the
/// final LSE and the sinks: per-block partials summed in a fixed order (bitwise repeatable).
pub(crate) fn grad(
    out: (&CudaStorage, &Layout),
    grad_out: (&CudaStorage, &Layout),
    lse: (&CudaStorage, &Layout),
    sinks: (&CudaStorage, &Layout),
    dims: [usize; 4],
) -> Result<CudaStorage> {
    let dev = &out.0.device;
    let name = TrainKernel::name(Op::SinksGrad, &[("sinks: out", out.0.dtype())])?;
    let sum_name = TrainKernel::name(Op::RmsDw, &[])?;
    let [n, .., heads, _] = dims;
    // SINKS_GRAD_ROWS = 64 rows of one head per block (cuda/train/sinks.cuh).
    let chunks = n.div_ceil(64).max(1);
    let Ok(chunks_i32) = i32::try_from(chunks) else {
        bail!("sinks: {n} rows are past the kernels' 32-bit range of blocks")
    };
    let args = sizes(dims)?;
    let stream = dev.cuda_stream();
    let mut part = launch::alloc(dev, DType::F32, chunks * heads, false)?;
    let mut d_sinks = launch::alloc(dev, DType::F32, heads, false)?;
    {
        let (o, _o) = launch::ptr(out.0, out.1, &stream)?;
        let (g, _g) = launch::ptr(grad_out.0, grad_out.1, &stream)?;
        let (l, _l) = launch::ptr(lse.0, lse.1, &stream)?;
        let (s, _s) = launch::ptr(sinks.0, sinks.1, &stream)?;
        let (p, _p) = launch::ptr_mut(&mut part, 0, &stream)?;
        let mut all = vec![
            Arg::Ptr(o),
            Arg::Ptr(g),
            Arg::Ptr(l),
            Arg::Ptr(s),
            Arg::Ptr(p),
        ];
        all.extend(args);
        launch::launch(dev, name, chunks * heads, 256, &all)?;
        // train_rms_dw: the column sums of the (chunks, heads) partials in chunk order, 32
        // columns per block of 8 x 32 threads.
        let (dw, _dw) = launch::ptr_mut(&mut d_sinks, 0, &stream)?;
        let sum = [
            Arg::Ptr(p),
            Arg::Ptr(dw),
            Arg::I32(chunks_i32),
            Arg::I32(heads as i32),
        ];
        launch::launch(dev, sum_name, heads.div_ceil(32), 256, &sum)?;
    }
    Ok(d_sinks)
}
