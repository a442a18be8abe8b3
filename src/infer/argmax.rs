//! [`argmax`]: greedy decoding's choice over a vocabulary in one launch.

use candle::{bail, CpuStorage, CustomOp1, DType, Layout, Result, Shape, Tensor};

/// The index of the largest element of each row of `x` `(..., n)`, as U32 `(...)`: the first
/// of equal values, and a NaN above every number (as `torch.argmax`). BF16, F16 or F32, on
/// the CPU or CUDA. On CUDA one launch: each row cut into slices of 8192 elements, a block
/// each (16-byte loads where aligned), merged by the row's last slice to finish. Candle's
/// argmax gives a row one block: over LLaMA 3's 128k logits it takes longer than the LM
/// head's product, and its ties and NaNs follow the reduction order.
pub fn argmax(x: &Tensor) -> Result<Tensor> {
    let Some((&n, outer)) = x.dims().split_last() else {
        bail!("argmax: x is a scalar, expected (..., n)")
    };
    if n == 0 {
        bail!(
            "argmax: x has shape {:?}, expected a last dim of at least 1",
            x.dims()
        )
    }
    if u32::try_from(n).is_err() {
        bail!("argmax: x's last dim {n} does not fit the U32 indices")
    }
    if !matches!(x.dtype(), DType::BF16 | DType::F16 | DType::F32) {
        bail!("argmax: x is {:?}, expected BF16, F16 or F32", x.dtype())
    }
    let rows = outer.iter().product::<usize>();
    x.contiguous()?
        .reshape((rows, n))?
        .apply_op1_no_bwd(&Argmax)?
        .reshape(outer)
}

struct Argmax;

/// Whether `a` ranks above `b` (NaN above every number; the caller keeps the first of ties).
fn above(a: f32, b: f32) -> bool {
    (a.is_nan() && !b.is_nan()) || a > b
}

impl CustomOp1 for Argmax {
    fn name(&self) -> &'static str {
        "argmax-rows"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let (rows, n) = (l.dims()[0], l.dims()[1]);
        let x = crate::cpu::gather_f32(s, l)?;
        let out: Vec<u32> = x
            .chunks(n)
            .map(|row| {
                let mut at = 0;
                for (i, &v) in row.iter().enumerate() {
                    if above(v, row[at]) {
                        at = i;
                    }
                }
                at as u32
            })
            .collect();
        Ok((CpuStorage::U32(out), Shape::from(rows)))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle::CudaStorage,
        l: &Layout,
    ) -> Result<(candle::CudaStorage, Shape)> {
        use crate::train::kernels::{Op, TrainKernel};
        use crate::train::launch::{self, Arg};
        use candle::backend::BackendStorage;
        use candle::cuda_backend::cudarc::driver::DevicePtrMut;
        let dev = &s.device;
        let (rows, n) = (l.dims()[0], l.dims()[1]);
        let name = TrainKernel::name(Op::Argmax, &[("argmax: x", s.dtype())])?;
        let elem = s.dtype().size_in_bytes();
        // Whole 16-byte vectors a row, from a 16-byte-aligned start (allocations are).
        let vec = (n * elem).is_multiple_of(16) && (l.start_offset() * elem).is_multiple_of(16);
        let slices = n.div_ceil(SLICE).min(MAX_SLICES);
        // A multiple of 8 elements, so that every slice starts on a vector.
        let chunk = n.div_ceil(slices).next_multiple_of(8);
        let slices = n.div_ceil(chunk);
        let stream = dev.cuda_stream();
        let mut out = launch::alloc(dev, DType::U32, rows, false)?;
        if rows == 0 {
            return Ok((out, Shape::from(rows)));
        }
        // SAFETY: every slice's block writes its key before it counts itself in; the last
        // reads them.
        let mut part = crate::graph::unchained(&stream, || unsafe {
            dev.alloc::<u64>(if slices > 1 { rows * slices } else { 1 })
        })?;
        // Held until the launch is queued (see `stream_counters`).
        let mut cache = COUNTERS
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let counters = crate::cuda::stream_counters(&mut cache, dev, rows)?;
        let (x, _a) = launch::ptr(s, l, &stream)?;
        let (o, _b) = launch::ptr_mut(&mut out, 0, &stream)?;
        let (p, _c) = part.device_ptr_mut(&stream);
        let (c, _d) = counters.device_ptr_mut(&stream);
        let args = [
            Arg::Ptr(x),
            Arg::Ptr(p),
            Arg::Ptr(c),
            Arg::Ptr(o),
            Arg::I64(rows as i64),
            Arg::I64(n as i64),
            Arg::I64(n as i64),
            Arg::I64(chunk as i64),
            Arg::I32(i32::from(vec)),
        ];
        launch::launch_grid(dev, name, (slices, rows.min(65535), 1), 256, &args)?;
        drop((_a, _b, _c, _d));
        drop(cache);
        Ok((out, Shape::from(rows)))
    }
}

/// Elements a block of the CUDA kernel reads: 32 per lane, four 16-byte vectors of bf16, so
/// that a 128k vocabulary is 16 blocks each waiting on one round of loads.
#[cfg(feature = "cuda")]
const SLICE: usize = 8192;
/// The most slices of a row.
#[cfg(feature = "cuda")]
const MAX_SLICES: usize = 1024;

/// The arrival counters of the rows' last slices, per stream (`crate::cuda::stream_counters`).
#[cfg(feature = "cuda")]
static COUNTERS: std::sync::Mutex<crate::cuda::StreamCounters> = std::sync::Mutex::new(Vec::new());
