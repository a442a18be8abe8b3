//! [`linear`] and [`linear_swiglu`]: the few-row kernel (`cuda/train/gemv.cuh`) where it
//! applies, Candle's matmul everywhere else.

use candle::backend::BackendStorage;
use candle::{bail, CpuStorage, CustomOp2, CustomOp3, DType, Layout, Result, Shape, Tensor, D};

/// The most rows (tokens, after flattening x's leading dims) that [`linear`] and its fused
/// forms take in one launch streaming the weight: one to [`GEMV_MAX_ROWS`] on the CUDA cores
/// (`cuda/train/gemv.cuh`), up to sixteen on tensor cores with the weight as the mma's
/// 16-row operand (`cuda/train/gemv_mma.cuh`). More rows go to Candle's GEMM.
/// [`fused_max_rows`] is the count in force (`CANDLE_FLASH_GEMV_MMA=0` keeps the tensor-core
/// kernel out, for comparisons).
pub const LINEAR_MAX_ROWS: usize = 16;

/// The most rows of the CUDA-core kernel (`GEMV_MAX_M` in `cuda/train/gemv.cuh`).
pub const GEMV_MAX_ROWS: usize = 4;

/// The most output columns the tensor-core kernel takes: past them a GEMM's own tiles fill
/// every multiprocessor in even waves while ours ends on a partial one (an LM head's 128k
/// columns: cuBLAS 128 µs, ours 138, H200), where the 1B model's 16k gate-and-up columns
/// are ours.
const MMA_MAX_COLS: usize = 32768;

/// The rows [`linear`], [`linear_swiglu`] and the norm-fused forms take in one launch in this
/// process: [`LINEAR_MAX_ROWS`], or [`GEMV_MAX_ROWS`] under `CANDLE_FLASH_GEMV_MMA=0`. A model
/// whose step has at most this many tokens can leave each norm to the projection after it
/// and each residual add to the one before it.
pub fn fused_max_rows() -> usize {
    #[cfg(feature = "cuda")]
    if crate::cuda::overrides().gemv_mma_off {
        return GEMV_MAX_ROWS;
    }
    LINEAR_MAX_ROWS
}

/// `x @ weight^T (+ add)`: `x` `(..., k)`, `weight` `(n, k)` as a linear layer stores it,
/// `add` `(..., n)` (a residual stream, added after the product is rounded, as a separate
/// add would be). One launch that streams the weight when x has at most
/// [`fused_max_rows`] rows, bf16/f16 on CUDA, `k` a multiple of 8, dense 16-byte-aligned
/// operands and nothing tracking gradients (and, past [`GEMV_MAX_ROWS`] rows, at most 32768
/// output columns); Candle's matmul (and add) otherwise, so every input that a linear layer
/// takes works, with gradients.
pub fn linear(x: &Tensor, weight: &Tensor, add: Option<&Tensor>) -> Result<Tensor> {
    let shape = check(x, weight, "linear")?;
    let mut out_dims = x.dims().to_vec();
    *out_dims.last_mut().expect("checked: x has a last dim") = shape.n;
    if let Some(a) = add {
        if !a.device().same_device(x.device()) {
            bail!(
                "linear: add is on {:?}, expected x's device",
                a.device().location()
            )
        }
        if a.dims() != out_dims.as_slice() || a.dtype() != x.dtype() {
            bail!(
                "linear: add is {:?} {:?}, expected {out_dims:?} {:?} (x's rows by weight's rows)",
                a.dims(),
                a.dtype(),
                x.dtype()
            )
        }
    }
    if few_rows(x, weight, add, &shape) {
        let x2 = x.reshape((shape.rows, shape.k))?;
        let y = match add {
            Some(a) => x2.apply_op3_no_bwd(
                weight,
                &a.reshape((shape.rows, shape.n))?,
                &Gemv {
                    swiglu: false,
                    norm: None,
                },
            )?,
            None => x2.apply_op2_no_bwd(
                weight,
                &Gemv {
                    swiglu: false,
                    norm: None,
                },
            )?,
        };
        return y.reshape(out_dims);
    }
    let y = x
        .reshape((shape.rows, shape.k))?
        .matmul(&weight.t()?)?
        .reshape(out_dims)?;
    match add {
        Some(a) => y + a,
        None => Ok(y),
    }
}

/// `silu(x @ gate^T) * (x @ up^T)` for `weight` `(2 i, k)` holding gate's rows then up's
/// (one stacked projection): `(..., i)`. The few-row kernel computes both halves in one pass
/// where [`linear`]'s would apply; otherwise Candle's matmul and [`crate::train::swiglu`]
/// over the two halves in place.
pub fn linear_swiglu(x: &Tensor, weight: &Tensor) -> Result<Tensor> {
    let shape = check(x, weight, "linear_swiglu")?;
    if !shape.n.is_multiple_of(2) {
        bail!(
            "linear_swiglu: weight has {} rows, expected an even count (gate's rows, then up's)",
            shape.n
        )
    }
    let i = shape.n / 2;
    let mut out_dims = x.dims().to_vec();
    *out_dims.last_mut().expect("checked: x has a last dim") = i;
    if few_rows(x, weight, None, &shape) {
        let x2 = x.reshape((shape.rows, shape.k))?;
        return x2
            .apply_op2_no_bwd(
                weight,
                &Gemv {
                    swiglu: true,
                    norm: None,
                },
            )?
            .reshape(out_dims);
    }
    let y = x.reshape((shape.rows, shape.k))?.matmul(&weight.t()?)?;
    crate::train::swiglu(&y.narrow(D::Minus1, 0, i)?, &y.narrow(D::Minus1, i, i)?)?
        .reshape(out_dims)
}

/// `linear(rms_norm(x, norm_weight, eps), weight, None)`: a transformer block's input norm
/// and the projection after it. Where [`linear`] takes one launch (with the norm weight in
/// x's dtype, and the rows' normalised copy within 96 KB of shared memory) one launch, each
/// block normalising the few rows itself, rounded as the separate norm rounds them;
/// otherwise [`crate::train::rms_norm`] then [`linear`].
pub fn rms_norm_linear(
    x: &Tensor,
    norm_weight: &Tensor,
    eps: f32,
    weight: &Tensor,
) -> Result<Tensor> {
    normed(x, norm_weight, eps, weight, false)
}

/// `linear_swiglu(rms_norm(x, norm_weight, eps), weight)`, in one launch where
/// [`rms_norm_linear`]'s would be.
pub fn rms_norm_linear_swiglu(
    x: &Tensor,
    norm_weight: &Tensor,
    eps: f32,
    weight: &Tensor,
) -> Result<Tensor> {
    normed(x, norm_weight, eps, weight, true)
}

/// Bytes of normalised rows one block of the fused kernel keeps in shared memory.
const NORM_SMEM: usize = 96 * 1024;

fn normed(x: &Tensor, g: &Tensor, eps: f32, weight: &Tensor, swiglu: bool) -> Result<Tensor> {
    let op = if swiglu {
        "rms_norm_linear_swiglu"
    } else {
        "rms_norm_linear"
    };
    crate::train::rms_norm::check(x, g, eps, op)?;
    let shape = check(x, weight, op)?;
    if swiglu && !shape.n.is_multiple_of(2) {
        bail!(
            "{op}: weight has {} rows, expected an even count (gate's rows, then up's)",
            shape.n
        )
    }
    let fused = few_rows(x, weight, None, &shape)
        && norm_smem(shape.rows, shape.k, x.dtype()) <= NORM_SMEM
        && g.dtype() == x.dtype()
        && !g.track_op()
        && g.is_contiguous()
        && g.layout().start_offset().is_multiple_of(8);
    if !fused {
        let h = crate::train::rms_norm(x, g, eps)?;
        return match swiglu {
            true => linear_swiglu(&h, weight),
            false => linear(&h, weight, None),
        };
    }
    let mut out_dims = x.dims().to_vec();
    *out_dims.last_mut().expect("checked: x has a last dim") =
        if swiglu { shape.n / 2 } else { shape.n };
    x.reshape((shape.rows, shape.k))?
        .apply_op3_no_bwd(
            weight,
            g,
            &Gemv {
                swiglu,
                norm: Some(eps),
            },
        )?
        .reshape(out_dims)
}

/// Bytes of the fused norm's rows in shared memory: the tensor-core kernel pads each row by 16
/// bytes (`gemv_mma_norm_ld`), so that its fragments' loads of neighbouring rows fall in
/// different banks.
fn norm_smem(rows: usize, k: usize, dtype: DType) -> usize {
    let ld = if rows <= GEMV_MAX_ROWS { k } else { k + 8 };
    rows * ld * dtype.size_in_bytes()
}

struct Dims {
    rows: usize,
    k: usize,
    n: usize,
}

fn check(x: &Tensor, weight: &Tensor, op: &str) -> Result<Dims> {
    if !x.device().same_device(weight.device()) {
        bail!(
            "{op}: weight is on {:?}, expected x's device ({:?})",
            weight.device().location(),
            x.device().location()
        )
    }
    let Some(&k) = x.dims().last() else {
        bail!("{op}: x is a scalar, expected (..., k)")
    };
    let &[n, wk] = weight.dims() else {
        bail!(
            "{op}: weight has shape {:?}, expected (n, {k})",
            weight.dims()
        )
    };
    if wk != k {
        bail!(
            "{op}: weight has shape {:?}, expected (n, {k}) for x of shape {:?}",
            weight.dims(),
            x.dims()
        )
    }
    if weight.dtype() != x.dtype() {
        bail!(
            "{op}: weight dtype {:?}, expected x's {:?}",
            weight.dtype(),
            x.dtype()
        )
    }
    Ok(Dims {
        rows: x.elem_count() / k.max(1),
        k,
        n,
    })
}

/// Whether the few-row kernels take this call (see [`linear`]).
fn few_rows(x: &Tensor, weight: &Tensor, add: Option<&Tensor>, d: &Dims) -> bool {
    let dense_aligned =
        |t: &Tensor| t.is_contiguous() && t.layout().start_offset().is_multiple_of(8);
    x.device().is_cuda()
        && matches!(x.dtype(), DType::BF16 | DType::F16)
        && (1..=fused_max_rows()).contains(&d.rows)
        && d.k.is_multiple_of(8)
        && d.k > 0
        && d.n > 0
        && i32::try_from(d.n).is_ok()
        && i32::try_from(d.k).is_ok()
        && !x.track_op()
        && !weight.track_op()
        && add.is_none_or(|a| !a.track_op() && a.is_contiguous())
        && dense_aligned(x)
        && dense_aligned(weight)
        && (d.rows <= GEMV_MAX_ROWS || d.n <= MMA_MAX_COLS)
}

/// The kernel as an op over `(x (rows, k), weight (n, k)[, add (rows, n)])`, or with `norm`
/// (its eps) over `(x, weight, norm weight (k,))`.
struct Gemv {
    swiglu: bool,
    norm: Option<f32>,
}

/// `(rows, n)`, or `(rows, n / 2)` for the SwiGLU of the two halves.
fn out_shape(swiglu: bool, x: &Layout, w: &Layout) -> Shape {
    let n = w.dims()[0];
    Shape::from((x.dims()[0], if swiglu { n / 2 } else { n }))
}

impl Gemv {
    #[cfg(feature = "cuda")]
    fn cuda(
        &self,
        (xs, xl): (&candle::CudaStorage, &Layout),
        (ws, wl): (&candle::CudaStorage, &Layout),
        third: Option<(&candle::CudaStorage, &Layout)>,
    ) -> Result<(candle::CudaStorage, Shape)> {
        use crate::train::kernels::{Op, TrainKernel};
        use crate::train::launch::{self, Arg};
        let dev = &xs.device;
        let (rows, k) = (xl.dims()[0], xl.dims()[1]);
        let n = wl.dims()[0];
        let op = match (self.swiglu, rows <= GEMV_MAX_ROWS) {
            (false, true) => Op::Gemv,
            (true, true) => Op::GemvSwiglu,
            (false, false) => Op::GemvMma,
            (true, false) => Op::GemvMmaSwiglu,
        };
        let name = TrainKernel::name(op, &[("linear: x", xs.dtype())])?;
        let shape = out_shape(self.swiglu, xl, wl);
        let outs = shape.dims()[1];
        let sms = crate::cuda::device_facts(dev)?.sms;
        let split = split(rows, k, outs, sms);
        let stream = dev.cuda_stream();
        let mut y = launch::alloc(dev, xs.dtype(), rows * outs, false)?;
        {
            let (x, _a) = launch::ptr(xs, xl, &stream)?;
            let (w, _b) = launch::ptr(ws, wl, &stream)?;
            let (t, _c) = match third {
                Some((s, l)) => {
                    let (p, g) = launch::ptr(s, l, &stream)?;
                    (p, Some(g))
                }
                None => (0, None),
            };
            // The third operand is the norm's weight with `norm`, the added rows otherwise.
            let (a, g) = match self.norm {
                Some(_) => (0, t),
                None => (t, 0),
            };
            let (yp, _d) = launch::ptr_mut(&mut y, 0, &stream)?;
            let args = [
                Arg::Ptr(x),
                Arg::Ptr(w),
                Arg::Ptr(a),
                Arg::Ptr(yp),
                Arg::I32(rows as i32),
                Arg::I32(n as i32),
                Arg::I32(k as i32),
                Arg::I32(split as i32),
                Arg::Ptr(g),
                Arg::F32(self.norm.unwrap_or(0.0)),
            ];
            let units = if rows <= GEMV_MAX_ROWS {
                outs
            } else {
                outs.div_ceil(16)
            };
            // Eight warps a block, sixteen where sixteen share a tile.
            let warps = split.max(8);
            let mut blocks = (units * split).div_ceil(warps).min(launch::stride_cap(sms));
            // The fused norm's rows in dynamic shared memory.
            let smem = match self.norm {
                Some(_) => norm_smem(rows, k, xs.dtype()),
                None => 0,
            };
            // The one-to-four-row kernel runs one wave of resident blocks looping over
            // column groups: with the norm fused, x is normalised once per block rather than
            // once per group (the 1B model's gate-and-up at batch 1: 264 blocks instead of
            // 1024); and with every block resident from the start, the kernel can let the
            // next one's blocks in as it starts (gemv.cuh), where a grid of several waves
            // would hand them the slots its own later blocks need (docs/PERFORMANCE.md).
            if rows <= GEMV_MAX_ROWS {
                use crate::cuda::{resident_blocks, Source};
                let threads = 32 * warps as u32;
                let resident = resident_blocks(dev, Source::Train, name, threads, smem as u32)?;
                blocks = blocks.min(resident.max(1) * sms);
            }
            // Programmatic on Hopper: the kernel's blocks are dispatched (and ask L2 for
            // their first weight slices) while the kernel ahead finishes; they wait in
            // `pdl_wait` before reading x or writing y.
            launch::launch_programmatic(dev, name, blocks, 32 * warps as u32, smem as u32, &args)?;
        }
        Ok((y, shape))
    }
}

/// Warps per output column (one to four rows) or per 16-column tile (more, up to 16:
/// `CANDLE_FLASH_GEMV_SPLIT` chooses), each summing a slice of k.
#[cfg(feature = "cuda")]
fn split(rows: usize, k: usize, outs: usize, sms: usize) -> usize {
    if rows <= GEMV_MAX_ROWS {
        // A long row cut into slices of at least 2048 elements, so that a block holds as
        // many loads in flight over a 8192-long row as over a 2048-long one (the 1B model's
        // down projection: 2048 columns alone would fill under two blocks a multiprocessor).
        return match k / 8 {
            c if c >= 2048 => 8,
            c if c >= 1024 => 4,
            c if c >= 512 => 2,
            _ => 1,
        };
    }
    if let Some(n) = crate::cuda::overrides().gemv_split {
        return n;
    }
    // A tile's warp reads 2 KB of weight per 64-element chunk: split until the launch has
    // about sixteen warps a multiprocessor (the 1B model's down projection, 128 tiles of 8192
    // elements: sixteen warps a tile), keeping at least four chunks a warp (its o projection,
    // 2048 long, stays at eight); a power of two, so that a block's warps divide into whole
    // tiles.
    let tiles = outs.div_ceil(16);
    let chunks = k.div_ceil(64);
    let s = (2 * 8 * sms / tiles.max(1))
        .clamp(1, 16)
        .min((chunks / 4).max(1));
    1 << s.ilog2()
}

/// The CPU never takes the kernel's path ([`few_rows`] asks for CUDA); the same product in
/// f32, rounded as the kernel rounds, keeps the op whole.
fn cpu(
    op: &Gemv,
    (xs, xl): (&CpuStorage, &Layout),
    (ws, wl): (&CpuStorage, &Layout),
    third: Option<(&CpuStorage, &Layout)>,
) -> Result<(CpuStorage, Shape)> {
    let swiglu = op.swiglu;
    let dtype = xs.dtype();
    let round = |v: f32| crate::cpu::round_to(v, dtype);
    let (mut x, w) = (
        crate::cpu::gather_f32(xs, xl)?,
        crate::cpu::gather_f32(ws, wl)?,
    );
    let t = third
        .map(|(s, l)| crate::cpu::gather_f32(s, l))
        .transpose()?;
    let (rows, k) = (xl.dims()[0], xl.dims()[1]);
    let a = match (op.norm, t) {
        (Some(eps), Some(g)) => {
            for row in x.chunks_mut(k.max(1)) {
                let rstd = crate::train::rms_norm::rstd(row, eps);
                for (v, gw) in row.iter_mut().zip(&g) {
                    *v = round(*v * rstd * gw);
                }
            }
            None
        }
        (_, t) => t,
    };
    let n = wl.dims()[0];
    let outs = if swiglu { n / 2 } else { n };
    let dot = |r: usize, j: usize| -> f32 {
        let xr = &x[r * k..(r + 1) * k];
        round(
            w[j * k..(j + 1) * k]
                .iter()
                .zip(xr)
                .map(|(a, b)| a * b)
                .sum(),
        )
    };
    let mut y = Vec::with_capacity(rows * outs);
    for r in 0..rows {
        for j in 0..outs {
            y.push(match (swiglu, &a) {
                (true, _) => {
                    let (g, u) = (dot(r, j), dot(r, j + outs));
                    g / (1.0 + (-g).exp()) * u
                }
                (false, Some(a)) => dot(r, j) + a[r * n + j],
                (false, None) => dot(r, j),
            });
        }
    }
    Ok((crate::cpu::to_storage(y, dtype)?, out_shape(swiglu, xl, wl)))
}

impl CustomOp2 for Gemv {
    fn name(&self) -> &'static str {
        "linear-few-rows"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        cpu(self, (s1, l1), (s2, l2), None)
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle::CudaStorage,
        l1: &Layout,
        s2: &candle::CudaStorage,
        l2: &Layout,
    ) -> Result<(candle::CudaStorage, Shape)> {
        self.cuda((s1, l1), (s2, l2), None)
    }
}

impl CustomOp3 for Gemv {
    fn name(&self) -> &'static str {
        "linear-few-rows-add"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        cpu(self, (s1, l1), (s2, l2), Some((s3, l3)))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle::CudaStorage,
        l1: &Layout,
        s2: &candle::CudaStorage,
        l2: &Layout,
        s3: &candle::CudaStorage,
        l3: &Layout,
    ) -> Result<(candle::CudaStorage, Shape)> {
        self.cuda((s1, l1), (s2, l2), Some((s3, l3)))
    }
}
