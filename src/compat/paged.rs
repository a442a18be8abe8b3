//! A paged call's inputs: k and v in cache blocks addressed through the block table, and the
//! `mm_prefix_ranges` of each sequence, read to the host and checked.

use candle::{bail, DType, Device, Result, Tensor};

use super::batch::{Batch, KeyRows};
use super::seqlens::{check_packed, offsets};

impl Batch {
    /// Packed q, paged k and v, their offsets and block table.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn paged(
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        seqlens_q: &Tensor,
        seqlens_k: &Tensor,
        block_table: &Tensor,
        max_seqlen_q: usize,
        page: usize,
    ) -> Result<Self> {
        let what = "(num_blocks, page_block_size, num_heads_k, head_dim)";
        let (total_q, num_blocks) = check_packed(q, k, v, 4, what)?;
        if page == 0 || k.dim(1)? != page {
            bail!(
                "page_block_size: expected k's dimension 1 (>= 1), {}, got {page}",
                k.dim(1)?
            )
        }
        // Key rows are addressed with u32 indices, like the packed offsets.
        if num_blocks.saturating_mul(page) > u32::MAX as usize {
            bail!("k: {num_blocks} blocks of {page} rows exceed u32::MAX rows")
        }
        let (cu_q, cu_k) = offsets(seqlens_q, seqlens_k, total_q, max_seqlen_q)?;
        let batch = cu_q.len() - 1;
        let (entries, width) = host_table(block_table, batch)?;
        for b in 0..batch {
            let len_k = (cu_k[b + 1] - cu_k[b]) as usize;
            let pages = len_k.div_ceil(page);
            if pages > width {
                bail!(
                    "block_table: sequence {b} has {len_k} keys, {pages} blocks of \
                     {page}, but the table has {width} columns"
                )
            }
            for (p, &block) in entries[b * width..][..pages].iter().enumerate() {
                if !(0..num_blocks as i64).contains(&block) {
                    bail!(
                        "block_table: entry [{b}, {p}] is {block}, not a block of the \
                         cache's {num_blocks}"
                    )
                }
            }
        }
        // Entries no sequence reads may hold anything (upstream never reads them either).
        let table = entries
            .into_iter()
            .map(|e| u32::try_from(e).unwrap_or(0))
            .collect();
        Ok(Self {
            cu_q,
            cu_k,
            keys: KeyRows::Paged { table, width, page },
        })
    }
}

/// The block table, U32 or I32 `(batch or more, width)`: the entries of its first `batch`
/// rows (row-major) and its width.
fn host_table(t: &Tensor, batch: usize) -> Result<(Vec<i64>, usize)> {
    let (rows, width) = match t.dims() {
        &[rows, width] => (rows, width),
        dims => bail!("block_table: expected rank 2 (batch, max_blocks), got shape {dims:?}"),
    };
    if rows < batch {
        bail!("block_table: expected at least {batch} rows (one per sequence), got {rows}")
    }
    let t = t
        .narrow(0, 0, batch)?
        .to_device(&Device::Cpu)?
        .flatten_all()?;
    let entries = match t.dtype() {
        DType::U32 => t.to_vec1::<u32>()?.into_iter().map(i64::from).collect(),
        DType::I32 => t.to_vec1::<i32>()?.into_iter().map(i64::from).collect(),
        dt => bail!("block_table: expected dtype U32 or I32, got {dt:?}"),
    };
    Ok((entries, width))
}

/// The prefix ranges, I32 `(batch, max_ranges, 2)`, as each sequence's valid (`start < end`)
/// `[start, end)` pairs.
pub(super) fn prefix_ranges(t: &Tensor, batch: usize) -> Result<Vec<Vec<(i64, i64)>>> {
    match t.dims() {
        &[b, _, 2] if b == batch => {}
        dims => bail!(
            "mm_prefix_ranges: expected shape (batch, max_ranges, 2) with batch {batch}, got \
             {dims:?}"
        ),
    }
    if t.dtype() != DType::I32 {
        bail!("mm_prefix_ranges: expected dtype I32, got {:?}", t.dtype())
    }
    let ranges = t.to_device(&Device::Cpu)?.to_vec3::<i32>()?;
    Ok(ranges
        .into_iter()
        .map(|seq| {
            seq.into_iter()
                .map(|pair| (pair[0] as i64, pair[1] as i64))
                .filter(|(s, e)| s < e)
                .collect()
        })
        .collect())
}
