//! Merging partial attentions: attention over a key set split into disjoint parts (split-KV,
//! cascade attention over a prompt shared by many sequences, ring attention) is recovered
//! exactly from each part's output and row log-sum-exp, the same merge the split-KV decode
//! kernels do on chip.

use candle::{bail, DType, Result, Tensor, D};

/// Merges attention results over disjoint key sets into the result over their union.
///
/// Each part is `(o_i, lse_i)` as [`crate::FlashAttn::forward_with_lse`] returns them: `o_i`
/// `(batch, seqlen_q, num_heads, head_dim)` (every part the same shape, dtype and device),
/// `lse_i` f32 `(batch, num_heads, seqlen_q)`, each of any strides. Returns `(o, lse)`
/// contiguous in the same layouts, with `lse = log sum_i exp(lse_i)` and
/// `o = sum_i exp(lse_i - lse) o_i`, computed in f32 and cast to the parts' dtype. Rows that no
/// part's keys reach (every `lse_i` is `-inf`) come out zero with `lse = -inf`, as a forward
/// over no keys does; a NaN `lse_i` makes its row NaN, and a NaN in an `o_i` reaches `o`.
/// One part is returned as it is.
///
/// On CUDA, parts in bf16, f16 or f32 that carry no gradient (inference: decoding, cascade
/// attention) are merged by one kernel launch for up to 16 parts; more parts are merged in
/// groups of at most 16 into f32 partial results, then those (a launch per group and one at
/// the end). Elsewhere (the CPU, f64, or parts in a training graph: any that tracks a
/// gradient) Candle's ops do it, which carry gradients like any other op.
pub fn combine(parts: &[(Tensor, Tensor)]) -> Result<(Tensor, Tensor)> {
    let Some((o0, _)) = parts.first() else {
        bail!("combine: parts is empty, expected at least one (out, lse) pair")
    };
    let (b, s, h, _) = o0.dims4().map_err(|_| {
        candle::Error::Msg(format!(
            "combine: parts[0].0 has shape {:?}, expected (batch, seqlen_q, num_heads, head_dim)",
            o0.dims()
        ))
    })?;
    for (i, (o, lse)) in parts.iter().enumerate() {
        if o.dims() != o0.dims() || o.dtype() != o0.dtype() || !o.device().same_device(o0.device())
        {
            bail!(
                "combine: parts[{i}].0 is {:?} {:?}, expected parts[0].0's shape {:?} and dtype \
                 {:?} on its device",
                o.dims(),
                o.dtype(),
                o0.dims(),
                o0.dtype()
            )
        }
        if lse.dims() != [b, h, s]
            || lse.dtype() != DType::F32
            || !lse.device().same_device(o0.device())
        {
            bail!(
                "combine: parts[{i}].1 (lse) is {:?} {:?}, expected f32 (batch, num_heads, \
                 seqlen_q) = {:?} on the outputs' device",
                lse.dims(),
                lse.dtype(),
                [b, h, s]
            )
        }
    }
    if parts.len() == 1 {
        return Ok((o0.clone(), parts[0].1.clone()));
    }
    #[cfg(feature = "cuda")]
    if o0.device().is_cuda()
        && matches!(o0.dtype(), DType::BF16 | DType::F16 | DType::F32)
        && !parts.iter().any(|(o, l)| o.track_op() || l.track_op())
    {
        return cuda::combine(parts);
    }
    by_ops(parts)
}

/// [`combine`] in Candle's ops, for parts already checked.
fn by_ops(parts: &[(Tensor, Tensor)]) -> Result<(Tensor, Tensor)> {
    let o0 = &parts[0].0;
    let lses = Tensor::stack(&parts.iter().map(|(_, l)| l.clone()).collect::<Vec<_>>(), 0)?;
    // The largest part's LSE as the exponent's origin; 0 where every part is -inf, so that no
    // -inf - -inf appears (their weights are then exp(-inf) = 0).
    let max = lses.max(0)?;
    let finite = max.ne(f64::NEG_INFINITY)?;
    let origin = finite.where_cond(&max, &max.zeros_like()?)?;
    let weights = lses.broadcast_sub(&origin.unsqueeze(0)?)?.exp()?;
    let total = weights.sum(0)?;
    let lse = (origin + total.log()?)?;
    // 1 / total where some part has keys, else 0 (the row's output is zero).
    let any = total.gt(0f64)?;
    let inv = any.where_cond(&total.recip()?, &total.zeros_like()?)?;
    let mut out: Option<Tensor> = None;
    for (i, (o, _)) in parts.iter().enumerate() {
        // (batch, heads, seqlen_q) -> (batch, seqlen_q, heads, 1), beside o's layout.
        let w = (weights.get(i)? * &inv)?
            .transpose(1, 2)?
            .unsqueeze(D::Minus1)?;
        let term = o.to_dtype(DType::F32)?.broadcast_mul(&w)?;
        out = Some(match out {
            Some(acc) => (acc + term)?,
            None => term,
        });
    }
    let out = out.expect("at least two parts").to_dtype(o0.dtype())?;
    Ok((out, lse))
}

/// The kernel of `cuda/train/combine.cuh` (an op of the training kernels' catalogue).
#[cfg(feature = "cuda")]
mod cuda {
    use candle::cuda_backend::cudarc::driver::DeviceRepr;
    use candle::op::BackpropOp;
    use candle::{bail, DType, Result, Storage, Tensor};

    use crate::train::kernels::{Op, TrainKernel};
    use crate::train::launch;

    /// `COMBINE_MAX_PARTS`: the parts one launch's parameter block holds.
    const MAX_PARTS: usize = 16;

    /// `CombinePart` of combine.cuh: addresses with the layouts' start offsets applied,
    /// strides in elements.
    #[repr(C)]
    #[derive(Clone, Copy, Default)]
    struct Part {
        o: u64,
        lse: u64,
        /// batch, seqlen_q, head (head_dim's is 1).
        o_stride: [i64; 3],
        /// batch, head, seqlen_q.
        lse_stride: [i64; 3],
    }

    /// `CombineParams` of combine.cuh, the kernel's only argument.
    #[repr(C)]
    #[derive(Clone, Copy)]
    struct Params {
        part: [Part; MAX_PARTS],
        out: u64,
        out_lse: u64,
        rows: i64,
        seqlen_q: i32,
        heads: i32,
        head_dim: i32,
        parts: i32,
        vec: i32,
        pad: i32,
    }

    // The C side asserts the same sizes (combine.cuh).
    const _: () = assert!(std::mem::size_of::<Part>() == 64);
    const _: () = assert!(std::mem::size_of::<Params>() == 64 * MAX_PARTS + 48);

    // SAFETY: plain integers, laid out as the kernel's C struct (sizes asserted on both sides).
    unsafe impl DeviceRepr for Params {}

    /// Parts checked by `super::combine` (two or more, same shape, dtype and CUDA device, no
    /// gradient): groups of at most [`MAX_PARTS`] into f32 partial results until one launch
    /// takes the rest.
    pub(super) fn combine(parts: &[(Tensor, Tensor)]) -> Result<(Tensor, Tensor)> {
        let dtype = parts[0].0.dtype();
        let mut level = parts.to_vec();
        while level.len() > MAX_PARTS {
            // As even as the groups can be, so that none is a lone part (which would stay in
            // the parts' dtype beside f32 partial results).
            let groups = level.len().div_ceil(MAX_PARTS);
            let (base, extra) = (level.len() / groups, level.len() % groups);
            let mut next = Vec::with_capacity(groups);
            let mut at = 0;
            for g in 0..groups {
                let n = base + usize::from(g < extra);
                next.push(launch_group(&level[at..at + n], DType::F32)?);
                at += n;
            }
            level = next;
        }
        launch_group(&level, dtype)
    }

    /// One launch over `group` (at most [`MAX_PARTS`] parts of one dtype) into `out_dtype`.
    fn launch_group(group: &[(Tensor, Tensor)], out_dtype: DType) -> Result<(Tensor, Tensor)> {
        let o0 = &group[0].0;
        let (b, s, h, d) = o0.dims4()?;
        let name = TrainKernel::name(
            Op::Combine,
            &[
                ("combine: parts[0].0", o0.dtype()),
                ("combine: output", out_dtype),
            ],
        )?;
        let (seqlen_q, heads, head_dim) =
            match (i32::try_from(s), i32::try_from(h), i32::try_from(d)) {
                (Ok(s), Ok(h), Ok(d)) => (s, h, d),
                _ => bail!(
                    "combine: parts[0].0 has shape {:?}, past the kernel's 32-bit seqlen_q, \
                 num_heads and head_dim",
                    o0.dims()
                ),
            };
        // The kernel reads a row's head_dim elements in vectors: a part whose head_dim is
        // strided is copied first.
        let group = group
            .iter()
            .map(|(o, l)| {
                let o = if d > 1 && o.stride()[3] != 1 {
                    o.contiguous()?
                } else {
                    o.clone()
                };
                Ok((o, l.clone()))
            })
            .collect::<Result<Vec<_>>>()?;
        let dev = o0.device().as_cuda_device()?.clone();
        let stream = dev.cuda_stream();
        let rows = b * s * h;
        let mut out = launch::alloc(&dev, out_dtype, rows * d, false)?;
        let mut out_lse = launch::alloc(&dev, DType::F32, rows, false)?;
        {
            let guards: Vec<_> = group
                .iter()
                .map(|(o, l)| (o.storage_and_layout(), l.storage_and_layout()))
                .collect();
            let mut syncs = Vec::with_capacity(2 * group.len() + 2);
            let mut params = Params {
                part: [Part::default(); MAX_PARTS],
                out: 0,
                out_lse: 0,
                rows: rows as i64,
                seqlen_q,
                heads,
                head_dim,
                parts: group.len() as i32,
                vec: 1,
                pad: 0,
            };
            let elem = o0.dtype().size_in_bytes();
            // The widest load of at most 16 bytes that every part's rows allow.
            let mut vec = (16 / elem).max(1);
            for (i, ((os, ol), (ls, ll))) in guards.iter().enumerate() {
                let (Storage::Cuda(os), Storage::Cuda(ls)) = (&**os, &**ls) else {
                    bail!("combine: parts[{i}] is not on the CUDA device of parts[0]")
                };
                let (o, so) = launch::ptr(os, ol, &stream)?;
                let (lse, sl) = launch::ptr(ls, ll, &stream)?;
                syncs.push(so);
                syncs.push(sl);
                // A dimension of size 1 is never stepped over: its stride is left out, so
                // that it cannot narrow the loads.
                let strides = |l: &candle::Layout, dims: [usize; 3]| -> [i64; 3] {
                    std::array::from_fn(|k| match l.dims()[dims[k]] {
                        1 => 0,
                        _ => l.stride()[dims[k]] as i64,
                    })
                };
                let part = Part {
                    o,
                    lse,
                    o_stride: strides(ol, [0, 1, 2]),
                    lse_stride: strides(ll, [0, 1, 2]),
                };
                while vec > 1
                    && (d % vec != 0
                        || o % (vec * elem) as u64 != 0
                        || part.o_stride.iter().any(|&st| st % vec as i64 != 0))
                {
                    vec /= 2;
                }
                params.part[i] = part;
            }
            params.vec = vec as i32;
            let (po, s1) = launch::ptr_mut(&mut out, 0, &stream)?;
            let (pl, s2) = launch::ptr_mut(&mut out_lse, 0, &stream)?;
            params.out = po;
            params.out_lse = pl;
            let threads = rows * (d / vec).max(1);
            let blocks = launch::stride_blocks(&dev, threads, 256)?;
            launch::launch_params(&dev, name, blocks, 256, &params)?;
            // The guards order the stream's later uses of these buffers after the launch.
            drop((s1, s2, syncs));
        }
        let out = Tensor::from_storage(Storage::Cuda(out), (b, s, h, d), BackpropOp::none(), false);
        let lse =
            Tensor::from_storage(Storage::Cuda(out_lse), (b, h, s), BackpropOp::none(), false);
        Ok((out, lse))
    }
}
