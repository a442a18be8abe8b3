//! Block-sparse attention (FlashAttention, Dao et al. 2022, Algorithm 5): a mask over blocks of
//! the attention matrix says which blocks exist; the others count as scores of `-inf` and are
//! never read or computed, so the cost falls with the fraction of blocks present.
//!
//! A [`BlockMask`] keeps one state per block: 0 (absent), 1 (every entry visible) or 2 (some:
//! the element mask of [`BlockMask::from_dense`] says which). The kernels skip absent blocks,
//! run present ones like unmasked attention and apply the element mask only in blocks of state
//! 2, or where one of their tiles straddles blocks of different states.

use candle::{bail, DType, Device, Result, Tensor};

use crate::params::AttnShape;

/// Which blocks of the `(seqlen_q, seqlen_k)` attention matrix exist, for
/// [`FlashAttn::block_mask`](crate::FlashAttn::block_mask).
///
/// Block `(r, c)` covers queries `r · block_q .. (r + 1) · block_q` and keys
/// `c · block_k .. (c + 1) · block_k` (row and column indices from the top-left corner of each
/// sequence; the last blocks may be cut short by the lengths). Its mask is
/// `(num_row_blocks, num_col_blocks)`, one for every head, or `(num_heads, rows, cols)`, one
/// per query head, with `num_row_blocks = ceil(seqlen_q / block_q)` and
/// `num_col_blocks = ceil(seqlen_k / block_k)`.
///
/// Block sizes are positive multiples of [`BlockMask::GRANULE`] (64), chosen freely otherwise:
/// the kernels' own tiles (64 to 128 rows, 64 to 128 keys under a block mask) are independent
/// of them. A tile that lies in absent blocks only is skipped; one that straddles blocks of
/// different states is masked entry by entry. Multiples of 128 line up with the tiles of the
/// fastest kernels (Hopper: 128 x 128 at head_dim 64 and 128, 128 x 64 at 256), which then
/// skip exactly the absent blocks.
///
/// Making a mask on a CUDA device also builds the tables with which the kernels jump from one
/// kept block to the next: 8 bytes per block, in a few tensor ops on that device.
///
/// The mask combines with the causal mask, a window, GQA, variable-length batches (each
/// sequence uses the top-left part of the mask that its lengths cover) and dropout. A query
/// that sees no key outputs zeros with LSE `-inf`, and gets zero gradients.
///
/// ```
/// # fn main() -> candle::Result<()> {
/// use candle::{Device, Tensor};
/// use candle_flash::{attention_slow_with, BlockMask, FlashAttn};
/// let dev = Device::Cpu;
/// let q = Tensor::randn(0f32, 1.0, (1, 256, 2, 32), &dev)?;
/// let k = Tensor::randn(0f32, 1.0, (1, 256, 2, 32), &dev)?;
/// let v = Tensor::randn(0f32, 1.0, (1, 256, 2, 32), &dev)?;
/// // 64 x 64 blocks: a band of one block each side of the diagonal, plus the first block
/// // row and column (global tokens).
/// let mask = BlockMask::local_global(256, 256, 64, 1, 1, &dev)?;
/// let attn = FlashAttn::new().block_mask(&mask);
/// let ours = attn.forward(&q, &k, &v)?;
/// let expected = attention_slow_with(&q, &k, &v, &attn)?;
/// let err = (ours - expected)?.abs()?.max_all()?.to_scalar::<f32>()?;
/// assert!(err < 1e-5);
/// # Ok(()) }
/// ```
#[derive(Clone, Debug)]
pub struct BlockMask {
    /// u8 `(heads, rows, cols)`, contiguous: 0 absent, 1 all visible, 2 see `dense`.
    states: Tensor,
    /// u8 `(heads, seqlen_q, seqlen_k)`, contiguous, nonzero = visible: the element mask of
    /// [`BlockMask::from_dense`].
    dense: Option<Tensor>,
    /// Where the CUDA kernels' loops jump past absent blocks (see [`Skips`]); none for masks
    /// on other devices, whose path reads the states on the host.
    skips: Option<Skips>,
    block_q: usize,
    block_k: usize,
}

/// The present blocks nearest to each block, so that a kernel steps from one present block to
/// the next with one read instead of testing every block between them (at 10% density, a
/// scan of 16k keys in blocks of 128 read 115 absent states per query tile, one after
/// another, and took longer than the attention itself).
#[derive(Clone, Debug)]
struct Skips {
    /// u32 `(heads, rows, cols)`: 1 + the last column at or before `c` present in row `r`
    /// (0: none), for the forward and dQ loops, which walk keys from the last.
    prev_col: Tensor,
    /// u32 `(heads, cols, rows)`: the first row at or after `r` present in column `c`
    /// (`rows`: none), for the dK/dV loops, which walk the queries of a key block.
    next_row: Tensor,
    /// u32 `(heads, rows, cols)`: the first column at or after `c` present in row `r`
    /// (`cols`: none), for the deterministic backward: the next key block to add into a
    /// query tile's dQ before this one.
    next_col: Tensor,
}

impl Skips {
    fn new(states: &Tensor) -> Result<Self> {
        let (heads, rows, cols) = states.dims3()?;
        let dev = states.device();
        let present = states.ne(0u8)?;
        let at = Tensor::arange(1u32, cols as u32 + 1, dev)?.broadcast_as((heads, rows, cols))?;
        let prev_col = present.where_cond(&at, &at.zeros_like()?)?;
        let prev_col = scan(&prev_col, 0, true)?;
        let col = Tensor::arange(0u32, cols as u32, dev)?.broadcast_as((heads, rows, cols))?;
        let no_col = Tensor::full(cols as u32, (heads, rows, cols), dev)?;
        let next_col = scan(&present.where_cond(&col, &no_col)?, cols as u32, false)?;
        let present = present.transpose(1, 2)?.contiguous()?;
        let at = Tensor::arange(0u32, rows as u32, dev)?.broadcast_as((heads, cols, rows))?;
        let none = Tensor::full(rows as u32, (heads, cols, rows), dev)?;
        let next_row = scan(&present.where_cond(&at, &none)?, rows as u32, false)?;
        Ok(Self {
            prev_col,
            next_row,
            next_col,
        })
    }
}

/// Running maximum of `x` along its last dimension from the front (`forward`), or running
/// minimum from the back, by doubling: log2(n) steps of whole-tensor ops, on any device.
/// `fill` is the identity (0 for the maximum, at least every value for the minimum).
fn scan(x: &Tensor, fill: u32, forward: bool) -> Result<Tensor> {
    let n = x.dim(2)?;
    let mut x = x.contiguous()?;
    let mut s = 1;
    while s < n {
        let (a, b) = x.dims3().map(|(a, b, _)| (a, b))?;
        let pad = Tensor::full(fill, (a, b, s), x.device())?;
        x = if forward {
            let shifted = Tensor::cat(&[&pad, &x.narrow(2, 0, n - s)?], 2)?;
            x.maximum(&shifted)?
        } else {
            let shifted = Tensor::cat(&[&x.narrow(2, s, n - s)?, &pad], 2)?;
            x.minimum(&shifted)?
        };
        s *= 2;
    }
    Ok(x)
}

impl PartialEq for BlockMask {
    /// The same tensors (by identity) and block sizes.
    fn eq(&self, other: &Self) -> bool {
        self.states.id() == other.states.id()
            && self.dense.as_ref().map(Tensor::id) == other.dense.as_ref().map(Tensor::id)
            && (self.block_q, self.block_k) == (other.block_q, other.block_k)
    }
}

/// The state of a block whose entries are all visible.
pub(crate) const ALL: u8 = 1;
/// The state of a block with some visible entries: the element mask decides.
pub(crate) const SOME: u8 = 2;

impl BlockMask {
    /// Block sizes are positive multiples of this.
    pub const GRANULE: usize = 64;

    /// A mask from a u8 tensor `(rows, cols)` or `(num_heads, rows, cols)`: nonzero keeps a
    /// block. `block_q`, `block_k`: rows and keys per block, positive multiples of
    /// [`BlockMask::GRANULE`]. The tensor may be on any device; the call's q must be on the
    /// same one.
    pub fn new(mask: &Tensor, block_q: usize, block_k: usize) -> Result<Self> {
        check_block_sizes(block_q, block_k)?;
        let mask = rank3(mask, "mask", "(num_row_blocks, num_col_blocks)")?;
        Self::with_states(mask.ne(0u8)?.contiguous()?, None, block_q, block_k)
    }

    /// The blocks of a dense boolean mask: a u8 tensor `(seqlen_q, seqlen_k)` or
    /// `(num_heads, seqlen_q, seqlen_k)`, nonzero = visible. Blocks without a visible entry
    /// are absent; inside the others the mask is applied entry by entry (and skipped where a
    /// block is entirely visible), so the result is attention under exactly this mask.
    pub fn from_dense(mask: &Tensor, block_q: usize, block_k: usize) -> Result<Self> {
        check_block_sizes(block_q, block_k)?;
        let dense = rank3(mask, "mask", "(seqlen_q, seqlen_k)")?
            .ne(0u8)?
            .contiguous()?;
        let (heads, sq, sk) = dense.dims3()?;
        let (rows, cols) = (sq.div_ceil(block_q), sk.div_ceil(block_k));
        // Visible entries per block: entries past the lengths count as neither visible
        // (`seen`, padded with 0) nor hidden (`full` pads with 1), so a cut-short block whose
        // real entries are all visible is ALL.
        let per_block = |x: &Tensor| -> Result<Tensor> {
            x.pad_with_zeros(1, 0, rows * block_q - sq)?
                .pad_with_zeros(2, 0, cols * block_k - sk)?
                .to_dtype(DType::F32)?
                .reshape((heads, rows, block_q, cols, block_k))?
                .sum(4)?
                .sum(2)
        };
        let ones = dense.ones_like()?;
        let seen = per_block(&dense)?;
        let hidden = per_block(&ones.sub(&dense)?)?;
        let any = seen.gt(0f64)?;
        let none_hidden = hidden.eq(0f64)?;
        // 0 where nothing is visible, 1 where nothing is hidden, 2 otherwise.
        let states = (any.to_dtype(DType::U8)? * 2.0)?
            .sub(&(any.mul(&none_hidden)?.to_dtype(DType::U8)?))?;
        Self::with_states(states.contiguous()?, Some(dense), block_q, block_k)
    }

    /// Local + global blocks (Longformer, BigBird): square blocks of `block` rows and keys;
    /// block `(r, c)` exists iff `|r - c| <= local`, or `r < global` or `c < global` (the
    /// first `global` blocks of tokens see everything and are seen by everything).
    pub fn local_global(
        seqlen_q: usize,
        seqlen_k: usize,
        block: usize,
        local: usize,
        global: usize,
        device: &Device,
    ) -> Result<Self> {
        Self::pattern(seqlen_q, seqlen_k, block, device, |r, c| {
            r.abs_diff(c) <= local || r < global || c < global
        })
    }

    /// The strided pattern of the Sparse Transformer (Child et al. 2019) on square blocks of
    /// `block`: block `(r, c)` exists iff `|r - c| < stride` (the local band) or `|r - c|` is a
    /// multiple of `stride` (every `stride`-th block back and forth). With a causal mask this
    /// is the paper's pattern. `stride` >= 1.
    pub fn strided(
        seqlen_q: usize,
        seqlen_k: usize,
        block: usize,
        stride: usize,
        device: &Device,
    ) -> Result<Self> {
        if stride == 0 {
            bail!("stride: expected >= 1, got 0")
        }
        Self::pattern(seqlen_q, seqlen_k, block, device, |r, c| {
            r.abs_diff(c) < stride || r.abs_diff(c) % stride == 0
        })
    }

    /// The flat butterfly pattern (Pixelated Butterfly, Dao et al. 2021; the block-sparse
    /// experiments of the FlashAttention paper) on square blocks of `block`: block `(r, c)`
    /// exists iff `r` and `c` differ in at most one bit, so each block row has
    /// `1 + log2(num_blocks)` blocks.
    pub fn butterfly(
        seqlen_q: usize,
        seqlen_k: usize,
        block: usize,
        device: &Device,
    ) -> Result<Self> {
        Self::pattern(seqlen_q, seqlen_k, block, device, |r, c| {
            (r ^ c).count_ones() <= 1
        })
    }

    fn pattern(
        seqlen_q: usize,
        seqlen_k: usize,
        block: usize,
        device: &Device,
        keep: impl Fn(usize, usize) -> bool,
    ) -> Result<Self> {
        check_block_sizes(block, block)?;
        let (rows, cols) = (seqlen_q.div_ceil(block), seqlen_k.div_ceil(block));
        crate::params::alloc_elems(&[rows, cols], 1, "block mask")?;
        let states: Vec<u8> = (0..rows)
            .flat_map(|r| (0..cols).map(move |c| (r, c)))
            .map(|(r, c)| u8::from(keep(r, c)))
            .collect();
        let states = Tensor::from_vec(states, (1, rows, cols), device)?;
        Self::with_states(states, None, block, block)
    }

    fn with_states(
        states: Tensor,
        dense: Option<Tensor>,
        block_q: usize,
        block_k: usize,
    ) -> Result<Self> {
        Ok(Self {
            skips: states
                .device()
                .is_cuda()
                .then(|| Skips::new(&states))
                .transpose()?,
            states,
            dense,
            block_q,
            block_k,
        })
    }

    /// Rows (queries) and keys per block.
    pub fn block_size(&self) -> (usize, usize) {
        (self.block_q, self.block_k)
    }

    /// The block mask, u8 `(heads, rows, cols)` with `heads` 1 (every head) or `num_heads`:
    /// 0 absent, 1 present, 2 present with the element mask applied inside.
    pub fn blocks(&self) -> &Tensor {
        &self.states
    }

    /// The element mask of [`BlockMask::from_dense`], u8 `(heads, seqlen_q, seqlen_k)`.
    pub fn element_mask(&self) -> Option<&Tensor> {
        self.dense.as_ref()
    }

    /// The fraction of blocks present (over every head).
    pub fn density(&self) -> Result<f64> {
        let n = self.states.elem_count();
        if n == 0 {
            return Ok(0.0);
        }
        let present = self
            .states
            .ne(0u8)?
            .to_dtype(DType::F32)?
            .sum_all()?
            .to_scalar::<f32>()?;
        Ok(present as f64 / n as f64)
    }

    /// The visibility this mask gives a `(seqlen_q, seqlen_k)` attention matrix, u8
    /// `(heads, seqlen_q, seqlen_k)`, 1 = visible: what the op applies, as a dense mask.
    pub fn to_dense(&self, seqlen_q: usize, seqlen_k: usize) -> Result<Tensor> {
        let (heads, rows, cols) = self.states.dims3()?;
        if rows.saturating_mul(self.block_q) < seqlen_q
            || cols.saturating_mul(self.block_k) < seqlen_k
        {
            bail!(
                "block_mask: {rows} x {cols} blocks of {} x {} do not cover {seqlen_q} x {seqlen_k}",
                self.block_q,
                self.block_k
            )
        }
        let device = self.states.device();
        crate::params::alloc_elems_on(&[heads, seqlen_q, seqlen_k], 1, "to_dense", device)?;
        // Each entry takes its block's state: gathered by index, so that only the
        // (seqlen_q, seqlen_k) entries asked for are made, whatever the block sizes.
        let block_of = |n: usize, size: usize| -> Result<Tensor> {
            let idx: Vec<i64> = (0..n).map(|i| (i / size) as i64).collect();
            Tensor::from_vec(idx, n, self.states.device())
        };
        let expanded = self
            .states
            .index_select(&block_of(seqlen_q, self.block_q)?, 1)?
            .index_select(&block_of(seqlen_k, self.block_k)?, 2)?;
        let all = expanded.eq(ALL)?;
        match &self.dense {
            None => expanded.ne(0u8),
            Some(dense) => {
                let some = expanded.eq(SOME)?;
                let dense = dense.narrow(1, 0, seqlen_q)?.narrow(2, 0, seqlen_k)?;
                all.maximum(&some.mul(&dense)?)
            }
        }
    }

    /// Checks the mask against a call: q's device, 1 or `num_heads` heads, the blocks that
    /// cover `(seqlen_q, seqlen_k)` (the longest sequences of a packed batch).
    pub(crate) fn check(&self, shape: &AttnShape, device: &Device) -> Result<()> {
        if !self.states.device().same_device(device) {
            bail!(
                "block_mask: expected the same device as q ({:?}), got {:?}",
                device.location(),
                self.states.device().location()
            )
        }
        let (heads, rows, cols) = self.states.dims3()?;
        let (want_rows, want_cols) = (
            shape.sq.div_ceil(self.block_q),
            shape.sk.div_ceil(self.block_k),
        );
        if (heads != 1 && heads != shape.h) || rows != want_rows || cols != want_cols {
            bail!(
                "block_mask: expected (num_row_blocks, num_col_blocks) = ({want_rows}, {want_cols}) \
                 or (num_heads, ..) = ({}, {want_rows}, {want_cols}) for seqlen_q {}, seqlen_k {} \
                 in blocks of {} x {}, got ({heads}, {rows}, {cols})",
                shape.h,
                shape.sq,
                shape.sk,
                self.block_q,
                self.block_k
            )
        }
        if let Some(dense) = &self.dense {
            let (_, sq, sk) = dense.dims3()?;
            if (sq, sk) != (shape.sq, shape.sk) {
                bail!(
                    "block_mask: its element mask is {sq} x {sk}, the call's seqlen_q x seqlen_k \
                     is {} x {}",
                    shape.sq,
                    shape.sk
                )
            }
        }
        Ok(())
    }

    /// The states and element mask on the host, for the CPU path.
    pub(crate) fn host(&self) -> Result<HostBlockMask> {
        let (heads, rows, cols) = self.states.dims3()?;
        let dense = match &self.dense {
            Some(d) => {
                let (_, sq, sk) = d.dims3()?;
                Some((d.flatten_all()?.to_vec1::<u8>()?, sq, sk))
            }
            None => None,
        };
        Ok(HostBlockMask {
            states: self.states.flatten_all()?.to_vec1::<u8>()?,
            dense,
            heads,
            rows,
            cols,
            block_q: self.block_q,
            block_k: self.block_k,
        })
    }

    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn states(&self) -> &Tensor {
        &self.states
    }

    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn dense(&self) -> Option<&Tensor> {
        self.dense.as_ref()
    }

    /// [`Skips`]: `(prev_col, next_row, next_col)`, for masks on a CUDA device.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn skips(&self) -> Option<(&Tensor, &Tensor, &Tensor)> {
        self.skips
            .as_ref()
            .map(|s| (&s.prev_col, &s.next_row, &s.next_col))
    }
}

/// A [`BlockMask`] on the host: the CPU path's view.
#[derive(Clone, Debug)]
pub(crate) struct HostBlockMask {
    states: Vec<u8>,
    /// Element mask, its `seqlen_q` and `seqlen_k`.
    dense: Option<(Vec<u8>, usize, usize)>,
    heads: usize,
    rows: usize,
    cols: usize,
    pub block_q: usize,
    pub block_k: usize,
}

impl HostBlockMask {
    fn head(&self, head: usize) -> usize {
        if self.heads == 1 {
            0
        } else {
            head
        }
    }

    /// The state of block `(r, c)` of query head `head`.
    pub fn state(&self, head: usize, r: usize, c: usize) -> u8 {
        self.states[(self.head(head) * self.rows + r) * self.cols + c]
    }

    /// Whether query `i` sees key `j` under query head `head`'s mask.
    pub fn visible(&self, head: usize, i: usize, j: usize) -> bool {
        match self.state(head, i / self.block_q, j / self.block_k) {
            0 => false,
            ALL => true,
            _ => self
                .dense
                .as_ref()
                .is_some_and(|(d, sq, sk)| d[(self.head(head) * sq + i) * sk + j] != 0),
        }
    }
}

/// The multiplier and shift of division by `d` (>= 1) as the kernels do it (`FastDiv` in
/// cuda/common/params.cuh): `n / d == (umulhi(n, mul) + n) >> shift` for `0 <= n < 2^31`.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) fn fast_div(d: u32) -> (u32, i32) {
    let shift = d.next_power_of_two().trailing_zeros();
    let mul = ((1u64 << 32) * ((1u64 << shift) - d as u64) / d as u64 + 1) as u32;
    (mul, shift as i32)
}

fn check_block_sizes(block_q: usize, block_k: usize) -> Result<()> {
    for (name, b) in [("block_q", block_q), ("block_k", block_k)] {
        // The kernels compute block offsets in i32: 2^30 keeps every product of a block index
        // and a size in range.
        if b == 0 || b % BlockMask::GRANULE != 0 || b > 1 << 30 {
            bail!(
                "{name}: expected a positive multiple of {} (BlockMask::GRANULE) up to 2^30, \
                 got {b}",
                BlockMask::GRANULE
            )
        }
    }
    Ok(())
}

/// `t` as u8 `(heads, rows, cols)`: rank 2 gains a heads dimension of 1.
fn rank3(t: &Tensor, name: &str, what: &str) -> Result<Tensor> {
    if t.dtype() != DType::U8 {
        bail!("{name}: expected dtype U8, got {:?}", t.dtype())
    }
    match t.rank() {
        2 => t.unsqueeze(0),
        3 => Ok(t.clone()),
        _ => bail!(
            "{name}: expected rank 2 {what} or rank 3 (num_heads, ..), got shape {:?}",
            t.dims()
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn from_dense_states() -> Result<()> {
        let dev = Device::Cpu;
        // 130 x 70 in 64 x 64 blocks: 3 x 2 blocks, the last ones cut short.
        let (sq, sk) = (130, 70);
        let mut m = vec![0u8; sq * sk];
        // Block (0, 0): all visible. Block (1, 0): one entry. Block (2, 1): its 2 x 6 real
        // entries all visible (ALL though cut short).
        for i in 0..64 {
            for j in 0..64 {
                m[i * sk + j] = 1;
            }
        }
        m[100 * sk + 3] = 1;
        for i in 128..130 {
            for j in 64..70 {
                m[i * sk + j] = 1;
            }
        }
        let dense = Tensor::from_vec(m.clone(), (sq, sk), &dev)?;
        let bm = BlockMask::from_dense(&dense, 64, 64)?;
        let states = bm.blocks().flatten_all()?.to_vec1::<u8>()?;
        assert_eq!(states, vec![1, 0, 2, 0, 0, 1]);
        let back = bm.to_dense(sq, sk)?.flatten_all()?.to_vec1::<u8>()?;
        assert_eq!(back, m);
        let host = bm.host()?;
        for i in 0..sq {
            for j in 0..sk {
                assert_eq!(host.visible(0, i, j), m[i * sk + j] != 0, "({i}, {j})");
            }
        }
        Ok(())
    }

    #[test]
    fn patterns() -> Result<()> {
        let dev = Device::Cpu;
        let lg = BlockMask::local_global(256, 256, 64, 0, 1, &dev)?;
        let s = lg.blocks().flatten_all()?.to_vec1::<u8>()?;
        #[rustfmt::skip]
        assert_eq!(s, vec![1, 1, 1, 1,
                           1, 1, 0, 0,
                           1, 0, 1, 0,
                           1, 0, 0, 1]);
        let bf = BlockMask::butterfly(512, 512, 64, &dev)?;
        let rows = bf.blocks().sum(2)?.flatten_all()?.to_vec1::<u8>()?;
        assert_eq!(rows, vec![4; 8]); // 1 + log2(8)
        let st = BlockMask::strided(256, 256, 64, 2, &dev)?;
        let s = st.blocks().flatten_all()?.to_vec1::<u8>()?;
        #[rustfmt::skip]
        assert_eq!(s, vec![1, 1, 1, 0,
                           1, 1, 1, 1,
                           1, 1, 1, 1,
                           0, 1, 1, 1]);
        assert!((st.density()? - 14.0 / 16.0).abs() < 1e-9);
        Ok(())
    }

    /// The skip tables against a direct search, on a random mask with empty rows and columns.
    #[test]
    fn skips() -> Result<()> {
        let dev = Device::Cpu;
        let (heads, rows, cols) = (2, 13, 37);
        let mut seed = 7u32;
        let states: Vec<u8> = (0..heads * rows * cols)
            .map(|i| {
                seed = seed.wrapping_mul(1664525).wrapping_add(1013904223);
                let (r, c) = (i / cols % rows, i % cols);
                u8::from(r != 4 && c != 9 && seed >> 28 < 3) * (1 + (seed >> 20 & 1) as u8)
            })
            .collect();
        let bm = BlockMask::new(
            &Tensor::from_vec(states.clone(), (heads, rows, cols), &dev)?,
            64,
            64,
        )?;
        let skips = Skips::new(bm.blocks())?;
        let (prev, next) = (&skips.prev_col, &skips.next_row);
        let prev = prev.flatten_all()?.to_vec1::<u32>()?;
        let next = next.flatten_all()?.to_vec1::<u32>()?;
        let next_col = skips.next_col.flatten_all()?.to_vec1::<u32>()?;
        let on = |h: usize, r: usize, c: usize| states[(h * rows + r) * cols + c] != 0;
        for h in 0..heads {
            for r in 0..rows {
                for c in 0..cols {
                    let want = (0..=c).rev().find(|&c| on(h, r, c)).map_or(0, |c| c + 1);
                    assert_eq!(
                        prev[(h * rows + r) * cols + c] as usize,
                        want,
                        "prev {h} {r} {c}"
                    );
                    let want = (r..rows).find(|&r| on(h, r, c)).unwrap_or(rows);
                    assert_eq!(
                        next[(h * cols + c) * rows + r] as usize,
                        want,
                        "next {h} {r} {c}"
                    );
                    let want = (c..cols).find(|&c| on(h, r, c)).unwrap_or(cols);
                    assert_eq!(
                        next_col[(h * rows + r) * cols + c] as usize,
                        want,
                        "next_col {h} {r} {c}"
                    );
                }
            }
        }
        Ok(())
    }

    /// The kernels' division of block indices, against `/`: every n below 2^22 (16k blocks
    /// of 256), then a sweep up to 2^31, for block sizes from 1 to 4096.
    #[test]
    fn fast_div_divides() {
        let div = |n: u32, (mul, shift): (u32, i32)| {
            let hi = ((n as u64 * mul as u64) >> 32) as u32;
            (hi + n) >> shift
        };
        for d in (1..=4096u32).filter(|d| d % 64 == 0 || *d < 200) {
            let m = fast_div(d);
            for n in (0..1 << 22).chain((1u32 << 22..1 << 31).step_by(997_001)) {
                assert_eq!(div(n, m), n / d, "{n} / {d}");
            }
            assert_eq!(div(i32::MAX as u32, m), i32::MAX as u32 / d, "max / {d}");
        }
    }

    #[test]
    fn bad_input() -> Result<()> {
        let dev = Device::Cpu;
        let m = Tensor::ones((2, 2), DType::U8, &dev)?;
        for (bq, bk) in [(0, 64), (64, 100), (32, 64)] {
            let e = BlockMask::new(&m, bq, bk).unwrap_err().to_string();
            assert!(e.starts_with("block_"), "{e}");
        }
        let e = BlockMask::new(&m.to_dtype(DType::F32)?, 64, 64)
            .unwrap_err()
            .to_string();
        assert!(e.starts_with("mask: expected dtype U8"), "{e}");
        let e = BlockMask::new(&Tensor::ones(4, DType::U8, &dev)?, 64, 64)
            .unwrap_err()
            .to_string();
        assert!(e.starts_with("mask: expected rank 2"), "{e}");
        let bm = BlockMask::new(&m, 64, 64)?;
        let shape = AttnShape::fixed(1, 128, 200, 4, 2, 32);
        let e = bm.check(&shape, &dev).unwrap_err().to_string();
        assert!(e.starts_with("block_mask: expected"), "{e}");
        let shape = AttnShape::fixed(1, 128, 128, 4, 2, 32);
        bm.check(&shape, &dev)?;
        Ok(())
    }
}
