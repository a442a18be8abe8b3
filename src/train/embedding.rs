//! Embedding lookup with a scatter-add backward. `index_select`'s backward in Candle is an
//! `index_add` whose CUDA kernel walks all ids per column: 8 ms for 16k ids on an H100.
//! [`embedding_deterministic`] sums each id's rows in row order instead of by atomics.

use candle::{bail, CpuStorage, CustomOp2, DType, Layout, Result, Shape, Storage, Tensor};

use super::host;

/// Rows `ids` of `table` `(vocab, hidden)`, as `(ids.len(), hidden)` in `dtype` (the
/// mixed-precision cast folded in). `table` BF16, F16 or F32 (F32 for any `dtype`, otherwise
/// `dtype` itself); `ids` `(n,)` U32. Differentiable in `table` (gradient in its dtype, summed
/// in f32). An id past the table gives a row of NaN rather than an out-of-bounds read; ids
/// are not copied to the host to be checked. On CUDA the rows of a repeated id add into its
/// gradient in no fixed order; [`embedding_deterministic`] is bitwise repeatable.
pub fn embedding(table: &Tensor, ids: &Tensor, dtype: DType) -> Result<Tensor> {
    embedding_impl(table, ids, dtype, false)
}

/// [`embedding`] whose backward on CUDA sums each id's rows in row order, so that the
/// table's gradient is bitwise repeatable. It copies the ids to the host (one
/// synchronisation per backward) to sort them.
pub fn embedding_deterministic(table: &Tensor, ids: &Tensor, dtype: DType) -> Result<Tensor> {
    embedding_impl(table, ids, dtype, true)
}

fn embedding_impl(
    table: &Tensor,
    ids: &Tensor,
    dtype: DType,
    deterministic: bool,
) -> Result<Tensor> {
    host::check_float(table, "embedding: table")?;
    host::check_same_device(table, ids, "embedding: ids")?;
    let (_vocab, hidden) = match table.dims() {
        [v, h] => (*v, *h),
        s => bail!("embedding: table has shape {s:?}, expected (vocab, hidden)"),
    };
    if ids.rank() != 1 || ids.dtype() != DType::U32 {
        bail!(
            "embedding: ids are {:?} {:?}, expected (n,) U32",
            ids.dims(),
            ids.dtype()
        )
    }
    if table.dtype() != DType::F32 && table.dtype() != dtype {
        bail!(
            "embedding: a {:?} table gives {:?} rows only, not {dtype:?}",
            table.dtype(),
            table.dtype()
        )
    }
    if i32::try_from(hidden).is_err() {
        bail!("embedding: hidden size {hidden} is past the kernels' 32-bit range")
    }
    if !matches!(dtype, DType::BF16 | DType::F16 | DType::F32) {
        bail!("embedding: dtype {dtype:?} is not supported, expected BF16, F16 or F32")
    }
    table.contiguous()?.apply_op2(
        &ids.contiguous()?,
        Embedding {
            dtype,
            deterministic,
        },
    )
}

struct Embedding {
    dtype: DType,
    /// Read by the CUDA backward only: the CPU's sums run in row order anyway.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    deterministic: bool,
}

/// The rows whose id is in the table, by id and then row, and where each id's rows start
/// (plus the end), for `train_embed_bwd_sorted`; `None` if no id is in the table.
#[cfg(feature = "cuda")]
fn rows_by_id(ids: &[u32], vocab: usize) -> Result<Option<(Vec<u32>, Vec<u32>)>> {
    if u32::try_from(ids.len()).is_err() {
        bail!(
            "embedding backward: {} ids are past the sorted kernel's 32-bit range",
            ids.len()
        )
    }
    let mut order: Vec<u32> = (0..ids.len() as u32)
        .filter(|&r| (ids[r as usize] as usize) < vocab)
        .collect();
    if order.is_empty() {
        return Ok(None);
    }
    // Stable: each id's rows stay in row order.
    order.sort_by_key(|&r| ids[r as usize]);
    let mut seg: Vec<u32> = vec![];
    for (k, &r) in order.iter().enumerate() {
        if k == 0 || ids[r as usize] != ids[order[k - 1] as usize] {
            seg.push(k as u32);
        }
    }
    seg.push(order.len() as u32);
    Ok(Some((order, seg)))
}

/// The `EmbedFwd` / `EmbedBwd` kernels: three pointers (rows in, ids, rows out), then
/// `n` ids of a `vocab`-row table with `hidden` columns, a grid-stride loop over the elements.
#[cfg(feature = "cuda")]
fn launch_rows(
    dev: &candle::CudaDevice,
    name: &str,
    [a, ids, out]: [u64; 3],
    n: usize,
    vocab: usize,
    hidden: usize,
) -> Result<()> {
    use super::launch::{self, Arg};
    let args = [
        Arg::Ptr(a),
        Arg::Ptr(ids),
        Arg::Ptr(out),
        Arg::I64(n as i64),
        Arg::I64(vocab as i64),
        Arg::I32(hidden as i32),
    ];
    let blocks = launch::stride_blocks(dev, n * hidden, 256)?;
    launch::launch(dev, name, blocks, 256, &args)
}

impl CustomOp2 for Embedding {
    fn name(&self) -> &'static str {
        "embedding"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let table = crate::cpu::gather_f32(s1, l1)?;
        let ids = host::u32s(s2, l2, "embedding: ids")?;
        let (vocab, hidden) = (l1.dims()[0], l1.dims()[1]);
        let mut y = Vec::with_capacity(ids.len() * hidden);
        for &id in ids {
            match (id as usize) < vocab {
                true => y.extend_from_slice(&table[id as usize * hidden..][..hidden]),
                false => y.extend(std::iter::repeat_n(f32::NAN, hidden)),
            }
        }
        Ok((
            crate::cpu::to_storage(y, self.dtype)?,
            Shape::from((ids.len(), hidden)),
        ))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle::CudaStorage,
        l1: &Layout,
        s2: &candle::CudaStorage,
        l2: &Layout,
    ) -> Result<(candle::CudaStorage, Shape)> {
        use super::kernels::{Op, TrainKernel};
        use super::launch;
        use candle::backend::BackendStorage;
        let dev = &s1.device;
        let (vocab, hidden) = (l1.dims()[0], l1.dims()[1]);
        let n = l2.shape().elem_count();
        let name = TrainKernel::name(
            Op::EmbedFwd,
            &[
                ("embedding: table", s1.dtype()),
                ("embedding: dtype", self.dtype),
            ],
        )?;
        let stream = dev.cuda_stream();
        let mut y = launch::alloc(dev, self.dtype, n * hidden, false)?;
        {
            let (t, _a) = launch::ptr(s1, l1, &stream)?;
            let (i, _b) = launch::ptr(s2, l2, &stream)?;
            let (yp, _c) = launch::ptr_mut(&mut y, 0, &stream)?;
            launch_rows(dev, name, [t, i, yp], n, vocab, hidden)?;
        }
        Ok((y, Shape::from((n, hidden))))
    }

    fn bwd(
        &self,
        table: &Tensor,
        ids: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let dy = grad.contiguous()?;
        let (vocab, hidden) = table.dims2()?;
        let dtable = {
            let (is, il) = ids.storage_and_layout();
            let (ds, dl) = dy.storage_and_layout();
            match (&*is, &*ds) {
                (Storage::Cpu(is), Storage::Cpu(ds)) => {
                    let ids = host::u32s(is, il, "embedding: ids")?;
                    let d = crate::cpu::gather_f32(ds, dl)?;
                    let mut dt = vec![0f32; vocab * hidden];
                    for (r, &id) in ids.iter().enumerate() {
                        if (id as usize) < vocab {
                            let row = &mut dt[id as usize * hidden..][..hidden];
                            for (a, b) in row.iter_mut().zip(&d[r * hidden..][..hidden]) {
                                *a += b;
                            }
                        }
                    }
                    Storage::Cpu(crate::cpu::to_storage(dt, DType::F32)?)
                }
                #[cfg(feature = "cuda")]
                (Storage::Cuda(is), Storage::Cuda(ds)) => {
                    use super::kernels::{Op, TrainKernel};
                    use super::launch::{self, Arg};
                    use candle::backend::BackendStorage;
                    let dev = &ds.device;
                    let n = il.shape().elem_count();
                    let op = match self.deterministic {
                        true => Op::EmbedBwdSorted,
                        false => Op::EmbedBwd,
                    };
                    let name = TrainKernel::name(op, &[("embedding", ds.dtype())])?;
                    let stream = dev.cuda_stream();
                    // Deterministic: the ids on the host, sorted, and back as two slices.
                    let sorted = match self.deterministic {
                        true => {
                            let host_ids = is.to_cpu_storage()?;
                            let host_ids = host::u32s(&host_ids, il, "embedding: ids")?;
                            match rows_by_id(host_ids, vocab)? {
                                Some((order, seg)) => {
                                    Some((dev.clone_htod(&order)?, dev.clone_htod(&seg)?))
                                }
                                None => None,
                            }
                        }
                        false => None,
                    };
                    let mut dt = launch::alloc(dev, DType::F32, vocab * hidden, true)?;
                    {
                        let (d, _a) = launch::ptr(ds, dl, &stream)?;
                        let (i, _b) = launch::ptr(is, il, &stream)?;
                        let (dtp, _c) = launch::ptr_mut(&mut dt, 0, &stream)?;
                        if let Some((order, seg)) = &sorted {
                            let (o, _d) = launch::slice_ptr(order, &stream);
                            let (s, _e) = launch::slice_ptr(seg, &stream);
                            let args = [
                                Arg::Ptr(d),
                                Arg::Ptr(i),
                                Arg::Ptr(o),
                                Arg::Ptr(s),
                                Arg::Ptr(dtp),
                                Arg::I32(hidden as i32),
                            ];
                            // One block per (id, 256 columns).
                            let ids_in_table = seg.len() - 1;
                            launch::launch(
                                dev,
                                name,
                                ids_in_table * hidden.div_ceil(256),
                                256,
                                &args,
                            )?;
                        } else if !self.deterministic {
                            // (Deterministic with no id in the table: dtable stays zero.)
                            launch_rows(dev, name, [d, i, dtp], n, vocab, hidden)?;
                        }
                    }
                    Storage::Cuda(dt)
                }
                _ => bail!("embedding backward: ids and the gradient must share a device"),
            }
        };
        let dtable = host::tensor(dtable, (vocab, hidden));
        let dtable = match table.dtype() {
            DType::F32 => dtable,
            dt => dtable.to_dtype(dt)?,
        };
        Ok((Some(dtable), None))
    }
}
