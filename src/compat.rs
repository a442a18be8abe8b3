//! candle-flash-attn 0.11's public API on this crate's op: the same function names, argument
//! lists and results, so that
//!
//! ```
//! use candle_flash::compat as candle_flash_attn;
//! ```
//!
//! is the whole switch for code written against candle-flash-attn (candle-transformers' models
//! call `candle_flash_attn::flash_attn(&q, &k, &v, softmax_scale, causal)`).
//!
//! What changes for the caller:
//! - it runs on the CPU too (f32, f16 or bf16, computed in f32); on CUDA it takes f16/bf16
//!   like candle-flash-attn, through this crate's kernels;
//! - it is differentiable: `backward()` through any of these results gives gradients for q,
//!   k and v (candle-flash-attn's ops have no backward pass);
//! - head_dim goes up to [`crate::MAX_HEAD_DIM`] (candle-flash-attn: 512), any value on the
//!   CPU and a multiple of 8 on CUDA;
//! - arguments that candle-flash-attn would read out of bounds or leave parts of the output
//!   unwritten for are errors naming the argument (a `max_seqlen_q` below the longest query
//!   sequence, `seqlens_q` that do not span q, block-table entries past the cache, ...);
//! - `softmax_scale` may be any finite number (zero and negative included, as upstream);
//!   NaN or an infinite scale is an error;
//! - a `softcap` of `+inf` is an error; `<= 0` (or NaN) turns the cap off, as upstream.
//!
//! # Windows
//!
//! Query `i` of a sequence with `seqlen_q` queries and `seqlen_k` keys sits at key position
//! `p = i + seqlen_k - seqlen_q` (masks are aligned bottom-right), and a window
//! `(window_size_left, window_size_right)` lets it see key `j` iff
//! `p - left <= j <= p + right`. The `Option<usize>` sides follow candle-flash-attn's
//! conventions exactly, including where they differ from [`crate::FlashAttn::window`]:
//! - a side larger than `seqlen_k` counts as `None` (varlen: larger than `max_seqlen_k`);
//! - `(None, None)` is no mask and `(None, Some(0))` is the causal mask;
//! - with one side `None` and the other bounded, the `None` side becomes `seqlen_k`
//!   (varlen: `max_seqlen_k`);
//! - every side left is a bound, even one at or past a sequence's key count, which
//!   [`crate::FlashAttn::window`] treats as unbounded. On the left that changes nothing; on
//!   the right it masks the first rows of a sequence with more than `right + 1` queries:
//!   they see only the keys `j <= p + right` (none when `p + right < 0`: zeros). compat
//!   computes those rows separately so that the result is upstream's;
//! - varlen: the sides are compared with the `max_seqlen_k` argument, not with each
//!   sequence's length; the mask itself uses each sequence's own lengths.
//!
//! Rows that see no key output zeros (as upstream). ALiBi adds `-slope[h] · |p - j|` to the
//! scaled (and capped) score of head `h`.
//!
//! # Variable-length batches
//!
//! `seqlens_q` / `seqlens_k` are rank-1 U32 tensors of `batch + 1` cumulative offsets: sequence
//! `b` owns query rows `seqlens_q[b]..seqlens_q[b + 1]` and key rows
//! `seqlens_k[b]..seqlens_k[b + 1]`. They are read to the host on every call (a device
//! synchronisation on CUDA; [`crate::VarLen`] with [`crate::FlashAttn::forward_varlen`] keeps
//! them on the host). `seqlens_q` must start at 0 and end at q's rows; `seqlens_k` may start
//! past 0 and end before k's last row (those key rows are ignored, as upstream).
//! `max_seqlen_q` must be at least the longest query sequence; `max_seqlen_k` only enters the
//! window conventions above.

use std::ops::Range;

use candle::backend::{BackendDevice, BackendStorage};
use candle::op::BackpropOp;
use candle::{bail, CpuStorage, DType, Device, Layout, Result, Shape, Storage, Tensor, Var};

use crate::options::FlashAttn as Options;
use crate::VarLen;

/// candle-flash-attn's op, as a [`candle::CustomOp3`] over `(q, k, v)`: what its
/// [`flash_attn_alibi_windowed_softcap`] runs, for code that builds the struct and calls
/// `q.apply_op3(&k, &v, op)` itself. Shapes, dtypes and window conventions as in
/// [`flash_attn_windowed`]; `alibi_slopes` f32 `(num_heads)`; `softcap` `Some(c)` with
/// `c > 0` caps the scores.
///
/// Differentiable too, but its backward pass recomputes the forward first (the struct's
/// fields are fixed by candle-flash-attn, so it has nowhere to keep the forward's row
/// statistics); the functions of this module do not pay that, and neither does
/// [`crate::FlashAttn`]. Under `apply_op3` the inputs and the output are also copied once.
///
/// ```
/// # fn main() -> candle::Result<()> {
/// use candle::{Device, Tensor};
/// let dev = Device::Cpu;
/// let q = Tensor::randn(0f32, 1.0, (1, 8, 2, 16), &dev)?;
/// let k = Tensor::randn(0f32, 1.0, (1, 8, 2, 16), &dev)?;
/// let v = Tensor::randn(0f32, 1.0, (1, 8, 2, 16), &dev)?;
/// let op = candle_flash::compat::FlashAttn {
///     softmax_scale: 0.25,
///     alibi_slopes: None,
///     window_size_left: Some(3),
///     window_size_right: Some(0),
///     softcap: None,
/// };
/// let out = q.apply_op3(&k, &v, op)?;
/// let same = candle_flash::compat::flash_attn_windowed(&q, &k, &v, 0.25, Some(3), Some(0))?;
/// assert_eq!((out - same)?.abs()?.max_all()?.to_scalar::<f32>()?, 0.0);
/// # Ok(()) }
/// ```
pub struct FlashAttn {
    /// Multiplies `q·k` before the softmax.
    pub softmax_scale: f32,
    /// ALiBi slopes, f32 `(num_heads)` on q's device.
    pub alibi_slopes: Option<Tensor>,
    /// Keys left of the query's diagonal position that it sees; see the module docs.
    pub window_size_left: Option<usize>,
    /// Keys right of the query's diagonal position that it sees; `Some(0)` with a `None`
    /// left side is the causal mask.
    pub window_size_right: Option<usize>,
    /// Gemma-style cap of the scaled scores, `c · tanh(s / c)`, when `Some(c)` with `c > 0`.
    pub softcap: Option<f32>,
}

impl FlashAttn {
    fn forward(&self, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Tensor> {
        let scores = Scores::new(self.softmax_scale, self.softcap, self.alibi_slopes.as_ref())?;
        fixed(
            q,
            k,
            v,
            &scores,
            self.window_size_left,
            self.window_size_right,
        )
    }
}

impl candle::CustomOp3 for FlashAttn {
    fn name(&self) -> &'static str {
        "flash-attn"
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
        let (q, k, v) = (
            detached(s1, l1, Storage::Cpu)?,
            detached(s2, l2, Storage::Cpu)?,
            detached(s3, l3, Storage::Cpu)?,
        );
        let out = self.forward(&q, &k, &v)?;
        let (storage, layout) = out.storage_and_layout();
        match &*storage {
            Storage::Cpu(s) => Ok((copied(s, layout)?, layout.shape().clone())),
            _ => bail!("flash-attn: the CPU forward produced a result on another device"),
        }
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
        let (q, k, v) = (
            detached(s1, l1, Storage::Cuda)?,
            detached(s2, l2, Storage::Cuda)?,
            detached(s3, l3, Storage::Cuda)?,
        );
        let out = self.forward(&q, &k, &v)?;
        let (storage, layout) = out.storage_and_layout();
        match &*storage {
            Storage::Cuda(s) => Ok((copied(s, layout)?, layout.shape().clone())),
            _ => bail!("flash-attn: the CUDA forward produced a result on another device"),
        }
    }

    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        _out: &Tensor,
        grad_out: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        // The forward again, in a graph of its own, and its gradients by autograd.
        let (qv, kv, vv) = (
            Var::from_tensor(&q.detach())?,
            Var::from_tensor(&k.detach())?,
            Var::from_tensor(&v.detach())?,
        );
        let out = self.forward(qv.as_tensor(), kv.as_tensor(), vv.as_tensor())?;
        let grads = (out * grad_out.detach())?.sum_all()?.backward()?;
        let grad = |var: &Var| match grads.get(var) {
            Some(g) => Ok(g.clone()),
            None => var.zeros_like(),
        };
        Ok((Some(grad(&qv)?), Some(grad(&kv)?), Some(grad(&vv)?)))
    }
}

/// A tensor outside any graph holding a contiguous copy of the view `(storage, layout)`.
fn detached<S: BackendStorage<Device = D>, D: BackendDevice<Storage = S>>(
    storage: &S,
    layout: &Layout,
    wrap: fn(S) -> Storage,
) -> Result<Tensor> {
    let copy = copied(storage, layout)?;
    Ok(Tensor::from_storage(
        wrap(copy),
        layout.shape().clone(),
        BackpropOp::none(),
        false,
    ))
}

/// A contiguous copy of the view `(storage, layout)`.
fn copied<S: BackendStorage<Device = D>, D: BackendDevice<Storage = S>>(
    storage: &S,
    layout: &Layout,
) -> Result<S> {
    let mut dst = storage
        .device()
        .zeros_impl(layout.shape(), storage.dtype())?;
    storage.copy_strided_src(&mut dst, 0, layout)?;
    Ok(dst)
}

/// Attention `softmax(softmax_scale · q kᵀ + mask) v`, candle-flash-attn's `flash_attn`.
///
/// - `q`: `(batch, seqlen_q, num_heads, head_dim)`;
/// - `k`, `v`: `(batch, seqlen_k, num_heads_k, head_dim)` with `num_heads % num_heads_k == 0`
///   (MQA/GQA: query head `h` reads K/V head `h / (num_heads / num_heads_k)`);
/// - `causal`: query `i` sees key `j` iff `j <= i + seqlen_k - seqlen_q` (bottom-right).
///
/// Returns `(batch, seqlen_q, num_heads, head_dim)` in q's dtype. Dtypes: f16/bf16 on CUDA;
/// f32, f16 or bf16 on the CPU. Differentiable. Only the last dimension must be contiguous.
///
/// Errors name the argument: ranks, shapes, dtypes and devices that differ, a head_dim the
/// device does not run, a scale that is NaN or infinite.
pub fn flash_attn(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    softmax_scale: f32,
    causal: bool,
) -> Result<Tensor> {
    let scores = Scores::plain(softmax_scale)?;
    fixed(q, k, v, &scores, None, causal.then_some(0))
}

/// [`flash_attn`] with a local window: query `i` sees key `j` iff
/// `p - window_size_left <= j <= p + window_size_right`, `p = i + seqlen_k - seqlen_q`, with
/// candle-flash-attn's conventions for `None` and for sides past `seqlen_k` (module docs,
/// "Windows"). `(None, Some(0))` is the causal mask, `(None, None)` no mask.
pub fn flash_attn_windowed(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    softmax_scale: f32,
    window_size_left: Option<usize>,
    window_size_right: Option<usize>,
) -> Result<Tensor> {
    let scores = Scores::plain(softmax_scale)?;
    fixed(q, k, v, &scores, window_size_left, window_size_right)
}

/// [`flash_attn`] with ALiBi: head `h`'s score of query `i`, key `j` gets
/// `-alibi_slopes[h] · |i + seqlen_k - seqlen_q - j|`.
///
/// `alibi_slopes`: f32 `(num_heads)` on q's device (an error otherwise).
pub fn flash_attn_alibi(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    alibi_slopes: &Tensor,
    softmax_scale: f32,
    causal: bool,
) -> Result<Tensor> {
    let scores = Scores::new(softmax_scale, None, Some(alibi_slopes))?;
    fixed(q, k, v, &scores, None, causal.then_some(0))
}

/// [`flash_attn_windowed`] with ALiBi slopes as in [`flash_attn_alibi`].
pub fn flash_attn_alibi_windowed(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    alibi_slopes: &Tensor,
    softmax_scale: f32,
    window_size_left: Option<usize>,
    window_size_right: Option<usize>,
) -> Result<Tensor> {
    let scores = Scores::new(softmax_scale, None, Some(alibi_slopes))?;
    fixed(q, k, v, &scores, window_size_left, window_size_right)
}

/// [`flash_attn_windowed`] with optional ALiBi slopes (as in [`flash_attn_alibi`]) and a
/// softcap: the scaled score `s` becomes `softcap · tanh(s / softcap)` before the bias and the
/// softmax. A `softcap <= 0` (or NaN) means no cap, as upstream; `+inf` is an error.
#[allow(clippy::too_many_arguments)]
pub fn flash_attn_alibi_windowed_softcap(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    alibi_slopes: Option<&Tensor>,
    softmax_scale: f32,
    window_size_left: Option<usize>,
    window_size_right: Option<usize>,
    softcap: f32,
) -> Result<Tensor> {
    let scores = Scores::new(softmax_scale, Some(softcap), alibi_slopes)?;
    fixed(q, k, v, &scores, window_size_left, window_size_right)
}

/// Attention over a packed batch of variable-length sequences, candle-flash-attn's
/// `flash_attn_varlen`: each sequence attends only to its own keys, as a batch of one would.
///
/// - `q`: `(total_q, num_heads, head_dim)`; `k`, `v`: `(total_k, num_heads_k, head_dim)`;
/// - `seqlens_q`, `seqlens_k`: U32 `(batch + 1)` cumulative offsets (module docs,
///   "Variable-length batches"), on any device; read to the host;
/// - `max_seqlen_q`: at least the longest query sequence; `max_seqlen_k`: the longest key
///   sequence (it only matters for windows);
/// - `causal`: bottom-right aligned per sequence.
///
/// Returns `(total_q, num_heads, head_dim)`; differentiable. Dtypes and head_dim as in
/// [`flash_attn`].
///
/// Errors: those of [`flash_attn`] (with rank 3), seqlens that are not rank-1 U32 with at
/// least 2 and equally many entries, that decrease, that do not start at 0 and end at q's rows
/// (`seqlens_q`) or end past k's rows (`seqlens_k`), a `max_seqlen_q` below a sequence's length.
#[allow(clippy::too_many_arguments)]
pub fn flash_attn_varlen(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    seqlens_q: &Tensor,
    seqlens_k: &Tensor,
    max_seqlen_q: usize,
    max_seqlen_k: usize,
    softmax_scale: f32,
    causal: bool,
) -> Result<Tensor> {
    let scores = Scores::plain(softmax_scale)?;
    let batch = Batch::packed(q, k, v, seqlens_q, seqlens_k, max_seqlen_q)?;
    let window = Window::new(None, causal.then_some(0), max_seqlen_k, false);
    batch.attend(q, k, v, &scores, window, None)
}

/// [`flash_attn_varlen`] with a local window per sequence, with candle-flash-attn's
/// conventions (module docs, "Windows"): sides are compared with `max_seqlen_k`, and a `None`
/// side facing a bounded one becomes `max_seqlen_k`.
#[allow(clippy::too_many_arguments)]
pub fn flash_attn_varlen_windowed(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    seqlens_q: &Tensor,
    seqlens_k: &Tensor,
    max_seqlen_q: usize,
    max_seqlen_k: usize,
    softmax_scale: f32,
    window_size_left: Option<usize>,
    window_size_right: Option<usize>,
) -> Result<Tensor> {
    let scores = Scores::plain(softmax_scale)?;
    let batch = Batch::packed(q, k, v, seqlens_q, seqlens_k, max_seqlen_q)?;
    let window = Window::new(window_size_left, window_size_right, max_seqlen_k, false);
    batch.attend(q, k, v, &scores, window, None)
}

/// [`flash_attn_varlen_windowed`] with keys and values in a paged cache (vLLM's layout).
///
/// - `k`, `v`: `(num_blocks, page_block_size, num_heads_k, head_dim)`: key `j` of sequence
///   `b` is row `j % page_block_size` of block `block_table[b, j / page_block_size]`;
/// - `seqlens_k`: cumulative offsets as in [`flash_attn_varlen`], here only giving each
///   sequence's key count `seqlens_k[b + 1] - seqlens_k[b]`;
/// - `block_table`: U32 or I32 `(batch or more, max_blocks)`; its first `ceil(len_k /
///   page_block_size)` entries of row `b` must name blocks of the cache (blocks may be shared);
/// - `mm_prefix_ranges`: optional I32 `(batch, max_ranges, 2)` of `[start, end)` key ranges
///   (ranges with `start >= end` are ignored). Under a causal or local mask, a query whose
///   position `p = i + len_k - len_q` lies in a range of its sequence also sees every key of
///   that range (bidirectional attention inside, for example, an image's tokens); with a
///   causal mask the window's left side becomes `max_seqlen_k`, as upstream;
/// - `page_block_size`: k's dimension 1 (any size >= 1; upstream needs a multiple of 32);
/// - `softcap`: `Some(c)` with `c > 0` caps the scores as in
///   [`flash_attn_alibi_windowed_softcap`].
///
/// Returns `(total_q, num_heads, head_dim)`. Differentiable: gradients reach the cache blocks
/// the call read (summed where blocks are shared). The pages a call reads are first gathered
/// into a packed copy, so each call moves its keys and values through memory once more.
///
/// Errors: those of [`flash_attn_varlen`], k and v of other shapes, a `page_block_size` that is
/// not k's dimension 1, a block table that is not rank-2 U32/I32 with at least `batch` rows,
/// too few columns for a sequence, or entries outside `0..num_blocks`, and ranges that are not
/// I32 `(batch, max_ranges, 2)`.
#[allow(clippy::too_many_arguments)]
pub fn flash_attn_varlen_paged_windowed(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    seqlens_q: &Tensor,
    seqlens_k: &Tensor,
    block_table: &Tensor,
    mm_prefix_ranges: Option<&Tensor>,
    max_seqlen_q: usize,
    max_seqlen_k: usize,
    softmax_scale: f32,
    window_size_left: Option<usize>,
    window_size_right: Option<usize>,
    page_block_size: usize,
    softcap: Option<f32>,
) -> Result<Tensor> {
    let scores = Scores::new(softmax_scale, softcap, None)?;
    let batch = Batch::paged(
        q,
        k,
        v,
        seqlens_q,
        seqlens_k,
        block_table,
        max_seqlen_q,
        page_block_size,
    )?;
    let ranges = match mm_prefix_ranges {
        Some(r) => Some(prefix_ranges(r, batch.num_seqs())?),
        None => None,
    };
    let window = Window::new(
        window_size_left,
        window_size_right,
        max_seqlen_k,
        ranges.is_some(),
    );
    let (k, v) = (k.flatten(0, 1)?, v.flatten(0, 1)?);
    batch.attend(q, &k, &v, &scores, window, ranges.as_deref())
}

/// [`flash_attn_varlen`] with ALiBi slopes, f32 `(num_heads)`: the score of query `i`, key
/// `j` of head `h` in a sequence gets `-alibi_slopes[h] · |i + len_k - len_q - j|`.
#[allow(clippy::too_many_arguments)]
pub fn flash_attn_varlen_alibi(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    alibi_slopes: &Tensor,
    seqlens_q: &Tensor,
    seqlens_k: &Tensor,
    max_seqlen_q: usize,
    max_seqlen_k: usize,
    softmax_scale: f32,
    causal: bool,
) -> Result<Tensor> {
    let scores = Scores::new(softmax_scale, None, Some(alibi_slopes))?;
    let batch = Batch::packed(q, k, v, seqlens_q, seqlens_k, max_seqlen_q)?;
    let window = Window::new(None, causal.then_some(0), max_seqlen_k, false);
    batch.attend(q, k, v, &scores, window, None)
}

/// [`flash_attn_varlen_windowed`] with ALiBi slopes as in [`flash_attn_varlen_alibi`].
#[allow(clippy::too_many_arguments)]
pub fn flash_attn_varlen_alibi_windowed(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    alibi_slopes: &Tensor,
    seqlens_q: &Tensor,
    seqlens_k: &Tensor,
    max_seqlen_q: usize,
    max_seqlen_k: usize,
    softmax_scale: f32,
    window_size_left: Option<usize>,
    window_size_right: Option<usize>,
) -> Result<Tensor> {
    let scores = Scores::new(softmax_scale, None, Some(alibi_slopes))?;
    let batch = Batch::packed(q, k, v, seqlens_q, seqlens_k, max_seqlen_q)?;
    let window = Window::new(window_size_left, window_size_right, max_seqlen_k, false);
    batch.attend(q, k, v, &scores, window, None)
}

/// [`flash_attn_varlen_windowed`] with optional ALiBi slopes (as in
/// [`flash_attn_varlen_alibi`]) and a softcap (as in [`flash_attn_alibi_windowed_softcap`]).
#[allow(clippy::too_many_arguments)]
pub fn flash_attn_varlen_alibi_windowed_softcap(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    alibi_slopes: Option<&Tensor>,
    seqlens_q: &Tensor,
    seqlens_k: &Tensor,
    max_seqlen_q: usize,
    max_seqlen_k: usize,
    softmax_scale: f32,
    window_size_left: Option<usize>,
    window_size_right: Option<usize>,
    softcap: f32,
) -> Result<Tensor> {
    let scores = Scores::new(softmax_scale, Some(softcap), alibi_slopes)?;
    let batch = Batch::packed(q, k, v, seqlens_q, seqlens_k, max_seqlen_q)?;
    let window = Window::new(window_size_left, window_size_right, max_seqlen_k, false);
    batch.attend(q, k, v, &scores, window, None)
}

/// The score modifiers of a call as upstream takes them.
struct Scores<'a> {
    scale: f32,
    softcap: Option<f32>,
    alibi: Option<&'a Tensor>,
}

impl<'a> Scores<'a> {
    fn plain(scale: f32) -> Result<Self> {
        Self::new(scale, None, None)
    }

    /// Checks the scale (finite) and keeps a softcap only when `> 0` (upstream's rule).
    fn new(scale: f32, softcap: Option<f32>, alibi: Option<&'a Tensor>) -> Result<Self> {
        if !scale.is_finite() {
            bail!("softmax_scale: expected a finite number, got {scale}")
        }
        Ok(Self {
            scale,
            softcap: softcap.filter(|&c| c > 0.0),
            alibi,
        })
    }

    /// Checks the slopes against q's `num_heads`: f32 `(num_heads)`, upstream's only layout.
    fn check_slopes(&self, num_heads: usize) -> Result<()> {
        if let Some(slopes) = self.alibi {
            if slopes.dtype() != DType::F32 {
                bail!("alibi_slopes: expected dtype F32, got {:?}", slopes.dtype())
            }
            if slopes.dims() != [num_heads] {
                bail!(
                    "alibi_slopes: expected shape (num_heads) = ({num_heads}), got {:?}",
                    slopes.dims()
                )
            }
        }
        Ok(())
    }

    /// q and the scale our op runs with: it takes a positive scale, so the sign of a negative
    /// one moves into q, and a zero scale zeroes q (keeping NaN and infinity as upstream would).
    fn query(&self, q: &Tensor) -> Result<(Tensor, f32)> {
        if self.scale > 0.0 {
            Ok((q.clone(), self.scale))
        } else if self.scale < 0.0 {
            Ok((q.neg()?, -self.scale))
        } else {
            Ok(((q * 0.0)?, 1.0))
        }
    }

    /// Our options for one mask at scale `scale`. `flip_alibi` negates the slopes: see
    /// [`Window::clipped_rows`] for the rows that need it.
    fn options(&self, scale: f32, mask: Mask, flip_alibi: bool) -> Result<Options> {
        let mut opts = Options::new()
            .softmax_scale(scale)
            .causal(mask.causal)
            .window(mask.left, mask.right);
        if let Some(c) = self.softcap {
            opts = opts.softcap(c);
        }
        if let Some(slopes) = self.alibi {
            opts = match flip_alibi {
                true => opts.alibi_slopes(&slopes.neg()?),
                false => opts.alibi_slopes(slopes),
            };
        }
        Ok(opts)
    }
}

/// A mask of our op: causal and [`Options::window`] sides (a side at or past a sequence's key
/// count is unbounded there).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Mask {
    causal: bool,
    left: Option<usize>,
    right: Option<usize>,
}

const CAUSAL: Mask = Mask {
    causal: true,
    left: None,
    right: None,
};

/// The mask upstream's kernels apply, after its conversions of the `Option<usize>` sides
/// (module docs, "Windows"), with `limit` = seqlen_k (fixed length) or max_seqlen_k (varlen).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Window {
    Full,
    Causal,
    /// Query at position `p` sees keys `p - left ..= p + right`, both sides finite.
    Local {
        left: usize,
        right: usize,
    },
}

impl Window {
    fn new(left: Option<usize>, right: Option<usize>, limit: usize, prefix_ranges: bool) -> Self {
        let within = |w: Option<usize>| w.filter(|&w| w <= limit);
        let (mut left, right) = (within(left), within(right));
        // Upstream turns causal into a local window when prefix ranges are given, so that
        // its kernels mask every key block (the ranges reach right of the diagonal).
        if prefix_ranges && left.is_none() && right == Some(0) {
            left = Some(limit);
        }
        match (left, right) {
            (None, None) => Self::Full,
            (None, Some(0)) => Self::Causal,
            (None, Some(right)) => Self::Local { left: limit, right },
            (Some(left), None) => Self::Local { left, right: limit },
            (Some(left), Some(right)) => Self::Local { left, right },
        }
    }

    /// Our op's mask for this window: exact for every row but [`Window::clipped_rows`].
    fn mask(self) -> Mask {
        match self {
            Self::Full => Mask::default(),
            Self::Causal => CAUSAL,
            Self::Local { left, right } => Mask {
                causal: false,
                left: Some(left),
                right: Some(right),
            },
        }
    }

    /// The first rows of a sequence of `sq` queries and `sk` keys on which our op's window
    /// differs from upstream's: with a right side `r >= sk` our op leaves that side unbounded,
    /// upstream does not, which matters for rows `i < sq - 1 - r` (position `p < sk - 1 - r`,
    /// hence `p < 0`).
    ///
    /// Those rows see keys `0 ..= p + r` (their left side lies before key 0), all below
    /// `sk - 1`: a causal call of these rows over keys `0..sk - 1` has its diagonal exactly at
    /// `p + r`. Its ALiBi distances `p + r - j` are upstream's `j - p` reflected around a
    /// per-row constant, so negated slopes give the same scores up to a per-row constant,
    /// which the softmax cancels.
    fn clipped_rows(self, sq: usize, sk: usize) -> usize {
        match self {
            Self::Local { right, .. } if sk > 0 && right >= sk && sq > 0 && right < sq - 1 => {
                sq - 1 - right
            }
            _ => 0,
        }
    }
}

/// Fixed-length attention with upstream's window conventions, `seqlen_k` the limit.
fn fixed(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    scores: &Scores,
    left: Option<usize>,
    right: Option<usize>,
) -> Result<Tensor> {
    let shape = crate::params::validate_shapes(q, k, v)?;
    scores.check_slopes(shape.h)?;
    let (sq, sk) = (shape.sq, shape.sk);
    let window = Window::new(left, right, sk, false);
    let (q, scale) = scores.query(q)?;
    let rest = scores.options(scale, window.mask(), false)?;
    let top = window.clipped_rows(sq, sk);
    if top == 0 {
        return rest.forward(&q, k, v);
    }
    let head = scores.options(scale, CAUSAL, true)?.forward(
        &q.narrow(1, 0, top)?,
        &k.narrow(1, 0, sk - 1)?,
        &v.narrow(1, 0, sk - 1)?,
    )?;
    let tail = rest.forward(&q.narrow(1, top, sq - top)?, k, v)?;
    Tensor::cat(&[head, tail], 1)
}

/// Where key `j` of sequence `b` lives in the (flattened) key tensor of a varlen call.
enum KeyRows {
    /// Packed `(total_k, ..)`: row `cu_k[b] + j`.
    Packed,
    /// Paged, flattened to `(num_blocks · page, ..)`: row `table[b][j / page] · page + j % page`
    /// with `width` entries per table row.
    Paged {
        table: Vec<u32>,
        width: usize,
        page: usize,
    },
}

/// The layout of a varlen call, checked, on the host.
struct Batch {
    cu_q: Vec<u32>,
    /// Cumulative key offsets as given (upstream does not need them to start at 0).
    cu_k: Vec<u32>,
    keys: KeyRows,
}

impl Batch {
    /// Packed q, k, v and their offsets.
    fn packed(
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        seqlens_q: &Tensor,
        seqlens_k: &Tensor,
        max_seqlen_q: usize,
    ) -> Result<Self> {
        let (total_q, total_k) = check_packed(q, k, v, 3, "(total_k, num_heads_k, head_dim)")?;
        let (cu_q, cu_k) = offsets(seqlens_q, seqlens_k, total_q, max_seqlen_q)?;
        let last = cu_k[cu_k.len() - 1] as usize;
        if last > total_k {
            bail!("seqlens_k: last offset {last} exceeds k's total rows {total_k}")
        }
        Ok(Self {
            cu_q,
            cu_k,
            keys: KeyRows::Packed,
        })
    }

    /// Packed q, paged k and v, their offsets and block table.
    #[allow(clippy::too_many_arguments)]
    fn paged(
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

    fn num_seqs(&self) -> usize {
        self.cu_q.len() - 1
    }

    fn len_q(&self, b: usize) -> usize {
        (self.cu_q[b + 1] - self.cu_q[b]) as usize
    }

    fn len_k(&self, b: usize) -> usize {
        (self.cu_k[b + 1] - self.cu_k[b]) as usize
    }

    /// The row of key `j` of sequence `b` in the (flattened) key tensor.
    fn key_row(&self, b: usize, j: usize) -> u32 {
        match &self.keys {
            KeyRows::Packed => self.cu_k[b] + j as u32,
            KeyRows::Paged { table, width, page } => {
                table[b * width + j / page] * *page as u32 + (j % page) as u32
            }
        }
    }

    /// Runs the call: `k`, `v` are `(rows, num_heads_k, head_dim)` (paged ones flattened),
    /// `ranges` the valid prefix ranges of each sequence (paged calls, no ALiBi).
    ///
    /// Every sequence is cut into row segments that one call of our op computes exactly
    /// (usually one per sequence: the whole of it under upstream's mask); segments with the
    /// same mask run as one packed call, and the rows are put back in order.
    fn attend(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        scores: &Scores,
        window: Window,
        ranges: Option<&[Vec<(i64, i64)>]>,
    ) -> Result<Tensor> {
        scores.check_slopes(q.dim(1)?)?;
        if ranges.is_some() && scores.alibi.is_some() {
            bail!("alibi_slopes: not supported together with mm_prefix_ranges")
        }
        let (q, scale) = scores.query(q)?;
        let mut groups: Vec<Group> = Vec::new();
        for b in 0..self.num_seqs() {
            let (sq, sk) = (self.len_q(b), self.len_k(b));
            let segments = match (window, ranges.map(|r| r[b].as_slice())) {
                (Window::Local { left, right }, Some(r)) if !r.is_empty() => {
                    prefix_segments(sq, sk, left, right, r)?
                }
                _ => window_segments(window, sq, sk),
            };
            for seg in segments {
                let key = (seg.mask, seg.flip_alibi);
                let at = match groups.iter().position(|g| g.key == key) {
                    Some(at) => at,
                    None => {
                        groups.push(Group::new(key));
                        groups.len() - 1
                    }
                };
                groups[at].add(self, b, &seg);
            }
        }
        let mut outs = Vec::with_capacity(groups.len());
        let mut order: Vec<u32> = Vec::with_capacity(q.dim(0)?);
        for g in &groups {
            let varlen = VarLen::from_seqlens(&g.lens_q, &g.lens_k)?;
            let opts = scores.options(scale, g.key.0, g.key.1)?;
            let (qg, kg, vg) = (
                rows(&q, &g.q_rows)?,
                rows(k, &g.k_rows)?,
                rows(v, &g.k_rows)?,
            );
            outs.push(opts.forward_varlen(&qg, &kg, &vg, &varlen)?);
            order.extend_from_slice(&g.q_rows);
        }
        if outs.len() == 1 {
            // One group holds every row in order.
            return Ok(outs.remove(0));
        }
        let out = Tensor::cat(&outs, 0)?;
        let mut inverse = vec![0u32; order.len()];
        for (at, &row) in order.iter().enumerate() {
            inverse[row as usize] = at as u32;
        }
        let len = inverse.len();
        out.index_select(&Tensor::from_vec(inverse, len, q.device())?, 0)
    }
}

/// Rows `rows` of `t` along dimension 0: a view when they are consecutive (the usual case: a
/// single segment per sequence over packed keys), a gathered copy otherwise.
fn rows(t: &Tensor, rows: &[u32]) -> Result<Tensor> {
    let first = rows.first().copied().unwrap_or(0);
    if rows.iter().enumerate().all(|(i, &r)| r == first + i as u32) {
        return t.narrow(0, first as usize, rows.len());
    }
    t.index_select(&Tensor::from_vec(rows.to_vec(), rows.len(), t.device())?, 0)
}

/// The segments of one mask, gathered into one packed call.
struct Group {
    key: (Mask, bool),
    q_rows: Vec<u32>,
    k_rows: Vec<u32>,
    lens_q: Vec<usize>,
    lens_k: Vec<usize>,
}

impl Group {
    fn new(key: (Mask, bool)) -> Self {
        Self {
            key,
            q_rows: Vec::new(),
            k_rows: Vec::new(),
            lens_q: Vec::new(),
            lens_k: Vec::new(),
        }
    }

    fn add(&mut self, batch: &Batch, b: usize, seg: &Segment) {
        let start = batch.cu_q[b];
        self.q_rows
            .extend(seg.rows.clone().map(|i| start + i as u32));
        self.k_rows
            .extend(seg.keys.clone().map(|j| batch.key_row(b, j)));
        self.lens_q.push(seg.rows.len());
        self.lens_k.push(seg.keys.len());
    }
}

/// Query rows of one sequence that one call of our op computes exactly: over keys `keys` of
/// the sequence, with `mask` (aligned bottom-right within the segment) and the ALiBi slopes
/// negated if `flip_alibi`.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Segment {
    rows: Range<usize>,
    keys: Range<usize>,
    mask: Mask,
    flip_alibi: bool,
}

/// A sequence under `window` alone: our op's mask for the whole sequence, but for the
/// [`Window::clipped_rows`].
fn window_segments(window: Window, sq: usize, sk: usize) -> Vec<Segment> {
    let top = window.clipped_rows(sq, sk);
    let mut segments = Vec::with_capacity(2);
    if top > 0 {
        segments.push(Segment {
            rows: 0..top,
            keys: 0..sk - 1,
            mask: CAUSAL,
            flip_alibi: true,
        });
    }
    segments.push(Segment {
        rows: top..sq,
        keys: 0..sk,
        mask: window.mask(),
        flip_alibi: false,
    });
    segments
}

/// One end of the keys a row sees: a fixed key index, or the row's position `p` plus an
/// offset.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Edge {
    At(i64),
    Diag(i64),
}

/// A sequence of `sq` queries and `sk` keys under a local window `(left, right)` joined with
/// prefix ranges (half-open, `start < end`): upstream's query at position `p` sees the keys
/// of the window, and those of each range that contains `p`, within `0..sk`. Each row's keys
/// form one interval (all the pieces contain `p`) whose ends are fixed or follow `p`; rows
/// whose ends have the same form make one segment.
///
/// A segment's call aligns its diagonal with the upper end: a fixed end `e` is the end of its
/// key slice (no right side), an end `p + c` makes it causal over keys up to the last row's
/// `p + c`; a lower end `p + c` is its left side, measured from that diagonal. The diagonal
/// moves by a per-segment amount, which would shift ALiBi distances: these calls take none.
fn prefix_segments(
    sq: usize,
    sk: usize,
    left: usize,
    right: usize,
    ranges: &[(i64, i64)],
) -> Result<Vec<Segment>> {
    let (sq_i, sk_i) = (sq as i64, sk as i64);
    // Sides past sq + sk act like sq + sk for every row; the arithmetic then stays in i64.
    let reach = sq_i + sk_i;
    let side = |w: usize| i64::try_from(w).unwrap_or(i64::MAX).min(reach);
    let (l, r) = (side(left), side(right));
    let edges = |i: usize| -> Option<(Edge, Edge)> {
        let p = i as i64 + sk_i - sq_i;
        let covering = ranges.iter().filter(|&&(s, e)| s <= p && p < e);
        let start = covering.clone().map(|&(s, _)| s).min().unwrap_or(i64::MAX);
        let end = covering.map(|&(_, e)| e).max().unwrap_or(i64::MIN);
        let (lo, lo_edge) = match start < p - l {
            true => (start, Edge::At(start)),
            false => (p - l, Edge::Diag(-l)),
        };
        let (lo, lo_edge) = if lo <= 0 {
            (0, Edge::At(0))
        } else {
            (lo, lo_edge)
        };
        let (hi, hi_edge) = match end > p + r + 1 {
            true => (end, Edge::At(end)),
            false => (p + r + 1, Edge::Diag(r + 1)),
        };
        let (hi, hi_edge) = if hi >= sk_i {
            (sk_i, Edge::At(sk_i))
        } else {
            (hi, hi_edge)
        };
        (lo < hi).then_some((lo_edge, hi_edge))
    };
    let mut segments = Vec::new();
    let mut i0 = 0;
    while i0 < sq {
        let form = edges(i0);
        let mut i1 = i0 + 1;
        while i1 < sq && edges(i1) == form {
            i1 += 1;
        }
        segments.push(match form {
            // Rows that see no key: a call over no key outputs zeros.
            None => Segment {
                rows: i0..i1,
                keys: 0..0,
                mask: Mask::default(),
                flip_alibi: false,
            },
            Some((lo, hi)) => edge_segment(i0..i1, sq_i, sk_i, lo, hi)?,
        });
        i0 = i1;
    }
    Ok(segments)
}

/// The call for rows `rows` whose visible keys run from `lo` to `hi` (see [`prefix_segments`]).
fn edge_segment(rows: Range<usize>, sq: i64, sk: i64, lo: Edge, hi: Edge) -> Result<Segment> {
    let (p0, p1) = (rows.start as i64 + sk - sq, rows.end as i64 + sk - sq);
    // The segment's diagonal is `p + shift` for the row at position `p`.
    let (end, causal, shift) = match hi {
        Edge::At(e) => (e, false, e - p1),
        Edge::Diag(c) => (p1 - 1 + c, true, c - 1),
    };
    let (start, left) = match lo {
        Edge::At(s) => (s, None),
        Edge::Diag(c) => (p0 + c, Some(shift - c)),
    };
    let index = |x: i64| usize::try_from(x).ok();
    match (index(start), index(end), left.map(index)) {
        (Some(start), Some(end), None) if start <= end => Ok(Segment {
            rows,
            keys: start..end,
            mask: Mask {
                causal,
                left: None,
                right: None,
            },
            flip_alibi: false,
        }),
        (Some(start), Some(end), Some(Some(left))) if start <= end => Ok(Segment {
            rows,
            keys: start..end,
            mask: Mask {
                causal,
                left: Some(left),
                right: None,
            },
            flip_alibi: false,
        }),
        _ => bail!(
            "mm_prefix_ranges: internal error, rows {rows:?} got keys {start}..{end}, \
             left side {left:?}"
        ),
    }
}

/// Checks the ranks, dtypes and devices of a varlen call's q `(total_q, h, d)`, k and v
/// (rank `k_rank`, `k_what`; v shaped like k). Returns q's and k's first dimensions.
fn check_packed(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    k_rank: usize,
    k_what: &str,
) -> Result<(usize, usize)> {
    if q.rank() != 3 {
        bail!(
            "q: expected rank 3 (total_q, num_heads, head_dim), got shape {:?}",
            q.dims()
        )
    }
    if k.rank() != k_rank {
        bail!(
            "k: expected rank {k_rank} {k_what}, got shape {:?}",
            k.dims()
        )
    }
    crate::params::check_like_q(q, k, "k")?;
    crate::params::check_like_q(q, v, "v")?;
    if v.dims() != k.dims() {
        bail!("v: expected k's shape {:?}, got {:?}", k.dims(), v.dims())
    }
    Ok((q.dim(0)?, k.dim(0)?))
}

/// The offsets of `seqlens_q` and `seqlens_k`, checked against q's rows and `max_seqlen_q`.
fn offsets(
    seqlens_q: &Tensor,
    seqlens_k: &Tensor,
    total_q: usize,
    max_seqlen_q: usize,
) -> Result<(Vec<u32>, Vec<u32>)> {
    let cu_q = host_offsets(seqlens_q, "seqlens_q")?;
    let cu_k = host_offsets(seqlens_k, "seqlens_k")?;
    if cu_k.len() != cu_q.len() {
        bail!(
            "seqlens_k: expected {} entries like seqlens_q (batch + 1), got {}",
            cu_q.len(),
            cu_k.len()
        )
    }
    if cu_q[0] != 0 {
        bail!(
            "seqlens_q: expected the first offset to be 0, got {}",
            cu_q[0]
        )
    }
    let last = cu_q[cu_q.len() - 1] as usize;
    if last != total_q {
        bail!("seqlens_q: last offset {last} differs from q's total rows {total_q}")
    }
    let longest = cu_q.windows(2).map(|w| w[1] - w[0]).max().unwrap_or(0) as usize;
    if max_seqlen_q < longest {
        bail!(
            "max_seqlen_q: expected at least the longest query sequence, {longest}, got \
             {max_seqlen_q}"
        )
    }
    Ok((cu_q, cu_k))
}

/// A rank-1 U32 tensor of at least 2 non-decreasing offsets, read to the host.
fn host_offsets(t: &Tensor, name: &str) -> Result<Vec<u32>> {
    if t.rank() != 1 || t.dtype() != DType::U32 {
        bail!(
            "{name}: expected a rank-1 U32 tensor, got {:?} of shape {:?}",
            t.dtype(),
            t.dims()
        )
    }
    let cu = t.to_device(&Device::Cpu)?.to_vec1::<u32>()?;
    if cu.len() < 2 {
        bail!(
            "{name}: expected at least 2 entries (batch + 1 cumulative offsets), got {}",
            cu.len()
        )
    }
    if let Some(b) = cu.windows(2).position(|w| w[1] < w[0]) {
        bail!(
            "{name}: offsets must be non-decreasing, got {} at index {} after {}",
            cu[b + 1],
            b + 1,
            cu[b]
        )
    }
    Ok(cu)
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
fn prefix_ranges(t: &Tensor, batch: usize) -> Result<Vec<Vec<(i64, i64)>>> {
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
