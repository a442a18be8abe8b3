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

mod batch;
mod fixed;
mod op;
mod paged;
mod scores;
mod segments;
mod seqlens;
mod window;

use candle::{Result, Tensor};

use batch::Batch;
use fixed::fixed;
use paged::prefix_ranges;
use scores::Scores;
use window::Window;

pub use op::FlashAttn;

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
