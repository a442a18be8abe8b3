//! Validation of the user's tensors, and the problem description shared by the CPU and CUDA
//! paths. Every error names the argument that failed and what was expected.

use candle::{bail, DType, Device, Result, Shape, Tensor};

/// Largest head dimension the kernels are instantiated for.
pub const MAX_HEAD_DIM: usize = 256;

pub(crate) use crate::shape::AttnShape;

/// Attention dropout: kept probabilities are scaled by `1 / (1 - p)`. Entry (query i, key j)
/// of sequence `b`, head `h` is kept iff [`crate::philox::RowKeep`] says so for the counter
/// `(seed, offset, b, h, i, j)`, on the CPU and on CUDA alike (src/philox.rs, cuda/common/philox.cuh).
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Dropout {
    pub p: f32,
    pub seed: u64,
    pub offset: u64,
}

/// Cumulative sequence offsets of a packed (variable-length) batch, on the host:
/// sequence `b` owns query rows `cu_q[b]..cu_q[b + 1]` and key rows `cu_k[b]..cu_k[b + 1]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct SeqOffsets {
    pub cu_q: Vec<u32>,
    pub cu_k: Vec<u32>,
}

/// `[0, l0, l0 + l1, ...]`, checked to fit u32.
pub(crate) fn cumulative(lengths: &[usize], name: &str) -> Result<Vec<u32>> {
    let mut cu = Vec::with_capacity(lengths.len() + 1);
    let mut total = 0u32;
    cu.push(total);
    for &len in lengths {
        total = match u32::try_from(len).ok().and_then(|l| total.checked_add(l)) {
            Some(t) => t,
            None => bail!("{name}: the total length exceeds u32::MAX"),
        };
        cu.push(total);
    }
    Ok(cu)
}

/// Everything the kernels need besides the data: sizes, scale, mask, dropout, packing.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Problem {
    pub shape: AttnShape,
    /// Multiplies q·k before the softmax.
    pub scale: f32,
    /// Bottom-right aligned causal mask: query i sees key j iff j <= i + sk - sq, with the
    /// lengths of i's own sequence.
    pub causal: bool,
    pub dropout: Option<Dropout>,
    /// Window (its right side includes `causal`), softcap and ALiBi.
    pub mods: crate::score_mod::ScoreMods,
    /// `Some` for packed variable-length batches.
    pub varlen: Option<std::sync::Arc<SeqOffsets>>,
}

impl Problem {
    /// First query row and length of sequence `b` (rows of the packed or flattened q).
    pub fn seq_q(&self, b: usize) -> (usize, usize) {
        match &self.varlen {
            Some(o) => (o.cu_q[b] as usize, (o.cu_q[b + 1] - o.cu_q[b]) as usize),
            None => (b * self.shape.sq, self.shape.sq),
        }
    }

    /// First key row and length of sequence `b`.
    pub fn seq_k(&self, b: usize) -> (usize, usize) {
        match &self.varlen {
            Some(o) => (o.cu_k[b] as usize, (o.cu_k[b + 1] - o.cu_k[b]) as usize),
            None => (b * self.shape.sk, self.shape.sk),
        }
    }

    /// Index into the LSE of row `i` of sequence `b`, head `h`. Fixed length: LSE is
    /// `(b, h, sq)`; packed: `(h, total_q)`.
    pub fn lse_index(&self, b: usize, h: usize, i: usize) -> usize {
        match &self.varlen {
            Some(o) => h * self.shape.total_q + o.cu_q[b] as usize + i,
            None => (b * self.shape.h + h) * self.shape.sq + i,
        }
    }

    /// Shape of q, the output and dq: `(b, sq, h, d)`, or `(total_q, h, d)` when packed.
    pub fn q_shape(&self) -> Shape {
        let s = self.shape;
        match self.varlen {
            Some(_) => Shape::from((s.total_q, s.h, s.d)),
            None => Shape::from((s.b, s.sq, s.h, s.d)),
        }
    }

    /// Shape of k, v, dk and dv: `(b, sk, hk, d)`, or `(total_k, hk, d)` when packed.
    pub fn kv_shape(&self) -> Shape {
        let s = self.shape;
        match self.varlen {
            Some(_) => Shape::from((s.total_k, s.hk, s.d)),
            None => Shape::from((s.b, s.sk, s.hk, s.d)),
        }
    }

    /// Shape of the f32 LSE (see [`Problem::lse_index`]): `(b, h, sq)`, or `(h, total_q)`
    /// when packed.
    pub fn lse_shape(&self) -> Shape {
        let s = self.shape;
        match self.varlen {
            Some(_) => Shape::from((s.h, s.total_q)),
            None => Shape::from((s.b, s.h, s.sq)),
        }
    }

    /// Keys `[lo, hi)` that query row `i` sees, for a sequence with `sq` queries and `sk` keys
    /// (bottom-right alignment of the causal mask and the window); `lo >= hi` when none.
    pub fn key_range(&self, i: usize, sq: usize, sk: usize) -> (usize, usize) {
        self.mods.key_range(i, sq, sk)
    }
}

/// Dimensions of one of q, k, v as `(batch, rows, heads, head_dim)`; packed tensors have a
/// batch of 1 and all their rows.
type Dims = (usize, usize, usize, usize);

pub(crate) fn dims4(t: &Tensor, name: &str, what: &str) -> Result<Dims> {
    match t.dims() {
        &[a, b, c, d] => Ok((a, b, c, d)),
        dims => bail!("{name}: expected rank 4 {what}, got shape {dims:?}"),
    }
}

fn dims3(t: &Tensor, name: &str, what: &str) -> Result<Dims> {
    match t.dims() {
        &[a, b, c] => Ok((1, a, b, c)),
        dims => {
            bail!("{name}: expected rank 3 {what} for a variable-length batch, got shape {dims:?}")
        }
    }
}

pub(crate) fn check_last_dim_contiguous(t: &Tensor, name: &str) -> Result<()> {
    let last = t.rank() - 1;
    if t.stride()[last] != 1 && t.dim(last)? > 1 {
        bail!(
            "{name}: the last dimension (head_dim) must be contiguous (stride 1), got strides {:?}",
            t.stride()
        )
    }
    Ok(())
}

/// Checks that `t` (named `name` in the message) has q's device and dtype.
pub(crate) fn check_like_q(q: &Tensor, t: &Tensor, name: &str) -> Result<()> {
    check_same_device(q, t, name)?;
    if t.dtype() != q.dtype() {
        bail!(
            "{name}: expected the same dtype as q ({:?}), got {:?}",
            q.dtype(),
            t.dtype()
        )
    }
    Ok(())
}

/// Checks that `t` (named `name` in the message) is on q's device.
fn check_same_device(q: &Tensor, t: &Tensor, name: &str) -> Result<()> {
    if !t.device().same_device(q.device()) {
        bail!(
            "{name}: expected the same device as q ({:?}), got {:?}",
            q.device().location(),
            t.device().location()
        )
    }
    Ok(())
}

/// Checks that the dimensions of q, k, v describe one attention problem: matching batch,
/// rows of k and v, num_heads_k and head_dim, `num_heads % num_heads_k == 0`, one dtype and
/// one device. `rows` names the row dimension in messages ("seqlen" or "total rows").
fn check_consistent(q: &Tensor, k: &Tensor, v: &Tensor, dims: [Dims; 3], rows: &str) -> Result<()> {
    let [(b, _, h, d), (bk, sk, hk, dk), (bv, skv, hkv, dv)] = dims;
    check_like_q(q, k, "k")?;
    check_like_q(q, v, "v")?;
    if bk != b {
        bail!("k: batch size {bk} differs from q's {b}")
    }
    if bv != b {
        bail!("v: batch size {bv} differs from q's {b}")
    }
    if skv != sk {
        bail!("v: {rows} {skv} differs from k's {rows} {sk}")
    }
    if hkv != hk {
        bail!("v: num_heads {hkv} differs from k's num_heads {hk}")
    }
    if dk != d {
        bail!("k: head_dim {dk} differs from q's head_dim {d}")
    }
    if dv != d {
        bail!("v: head_dim {dv} differs from q's head_dim {d}")
    }
    if hk == 0 || h % hk != 0 {
        bail!("k: num_heads_k {hk} must divide q's num_heads {h} (MQA/GQA)")
    }
    Ok(())
}

/// Checks that q, k, v describe one attention problem: rank 4, matching batch, seqlen_k,
/// num_heads_k and head_dim, `num_heads % num_heads_k == 0`, one dtype and one device.
/// Shared by the kernels ([`validate`]) and by the oracle [`crate::attention_slow`], which
/// accepts any dtype on any device.
pub(crate) fn validate_shapes(q: &Tensor, k: &Tensor, v: &Tensor) -> Result<AttnShape> {
    let dims = [
        dims4(q, "q", "(batch, seqlen_q, num_heads, head_dim)")?,
        dims4(k, "k", "(batch, seqlen_k, num_heads_k, head_dim)")?,
        dims4(v, "v", "(batch, seqlen_k, num_heads_k, head_dim)")?,
    ];
    check_consistent(q, k, v, dims, "seqlen")?;
    let [(b, sq, h, d), (_, sk, hk, _), _] = dims;
    Ok(AttnShape::fixed(b, sq, sk, h, hk, d))
}

/// Checks q, k, v against each other and against what the device's kernels support.
pub(crate) fn validate(q: &Tensor, k: &Tensor, v: &Tensor) -> Result<AttnShape> {
    let shape = validate_shapes(q, k, v)?;
    check_supported(q, k, v, &shape)?;
    Ok(shape)
}

/// Checks packed q `(total_q, h, d)`, k and v `(total_k, hk, d)` against each other, against
/// the offsets of `varlen` and against what the device's kernels support. The shape has
/// `b` = number of sequences and `sq`, `sk` = their maximum lengths.
pub(crate) fn validate_varlen(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    varlen: &crate::VarLen,
) -> Result<AttnShape> {
    let shape = validate_varlen_shapes(q, k, v, varlen)?;
    check_supported(q, k, v, &shape)?;
    Ok(shape)
}

/// [`validate_varlen`] without the device's dtype and head_dim checks: packed q, k, v against
/// each other and against the offsets of `varlen` (the FP8 forward checks the rest itself).
pub(crate) fn validate_varlen_shapes(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    varlen: &crate::VarLen,
) -> Result<AttnShape> {
    let dims = [
        dims3(q, "q", "(total_q, num_heads, head_dim)")?,
        dims3(k, "k", "(total_k, num_heads_k, head_dim)")?,
        dims3(v, "v", "(total_k, num_heads_k, head_dim)")?,
    ];
    check_consistent(q, k, v, dims, "total rows")?;
    let [(_, total_q, h, d), (_, total_k, hk, _), _] = dims;
    for (name, tensor, last, rows) in [
        ("cu_seqlens_q", "q", varlen.total_q(), total_q),
        ("cu_seqlens_k", "k", varlen.total_k(), total_k),
    ] {
        if last != rows {
            bail!("{name}: last offset {last} differs from {tensor}'s total rows {rows}")
        }
    }
    let shape = AttnShape {
        b: varlen.num_seqs(),
        sq: varlen.max_seqlen_q(),
        sk: varlen.max_seqlen_k(),
        h,
        hk,
        d,
        total_q,
        total_k,
    };
    Ok(shape)
}

/// The dtypes each device runs: f16/bf16 everywhere, f32 on the CPU. `what` names the
/// argument in the message ("q: dtype", "dtype:").
pub(crate) fn check_dtype(device: &Device, dtype: DType, what: &str) -> Result<()> {
    match (device, dtype) {
        (_, DType::F16 | DType::BF16) | (Device::Cpu, DType::F32) => Ok(()),
        (Device::Cpu, dt) => bail!("{what} {dt:?} is not supported, expected F32, F16 or BF16"),
        (_, dt) => bail!("{what} {dt:?} is not supported on this device, expected F16 or BF16"),
    }
}

/// The head dims the kernels run: `1..=MAX_HEAD_DIM`, a multiple of 8 on CUDA (16-byte loads).
/// `what` names the argument in the message ("q: head_dim", "head_dim:").
pub(crate) fn check_head_dim(device: &Device, d: usize, what: &str) -> Result<()> {
    if d == 0 || d > MAX_HEAD_DIM {
        bail!("{what} must be in 1..={MAX_HEAD_DIM}, got {d}")
    }
    if device.is_cuda() && !d.is_multiple_of(8) {
        bail!("{what} must be a multiple of 8 on CUDA, got {d}")
    }
    Ok(())
}

/// What the kernels support: dtype per device, head_dim, a contiguous last dimension.
pub(crate) fn check_supported(q: &Tensor, k: &Tensor, v: &Tensor, shape: &AttnShape) -> Result<()> {
    check_dtype(q.device(), q.dtype(), "q: dtype")?;
    check_head_dim(q.device(), shape.d, "q: head_dim")?;
    for (name, t) in [("q", q), ("k", k), ("v", v)] {
        check_last_dim_contiguous(t, name)?;
    }
    Ok(())
}

/// Checks what [`crate::FlashAttn::backward`] reads besides q, k, v against q and the
/// problem's sizes: `out` and `grad_out` with q's device, dtype and shape; `lse` f32
/// `(batch, num_heads, seqlen_q)` on q's device.
pub(crate) fn validate_bwd_inputs(
    q: &Tensor,
    out: &Tensor,
    lse: &Tensor,
    grad_out: &Tensor,
    shape: &AttnShape,
) -> Result<()> {
    for (name, t) in [("out", out), ("grad_out", grad_out)] {
        check_like_q(q, t, name)?;
        if t.dims() != q.dims() {
            bail!(
                "{name}: expected q's shape {:?} (batch, seqlen_q, num_heads, head_dim), got {:?}",
                q.dims(),
                t.dims()
            )
        }
    }
    check_same_device(q, lse, "lse")?;
    if lse.dtype() != DType::F32 {
        bail!(
            "lse: expected dtype F32 (as forward_with_lse returns it), got {:?}",
            lse.dtype()
        )
    }
    let expected = [shape.b, shape.h, shape.sq];
    if lse.dims() != expected {
        bail!(
            "lse: expected shape {expected:?} (batch, num_heads, seqlen_q), got {:?}",
            lse.dims()
        )
    }
    Ok(())
}

/// Checks the softmax scale the user gave.
pub(crate) fn check_scale(scale: f32) -> Result<()> {
    if !scale.is_finite() || scale <= 0.0 {
        bail!("softmax_scale: expected a finite positive number, got {scale}")
    }
    Ok(())
}

/// The element count of `dims`, checked to fit in host memory (`elem_bytes` each). Sizes taken
/// from user input are checked before anything is allocated for them: a product that wraps,
/// or an allocation this machine refuses, is an error naming `what` rather than a wrong size
/// or a process aborted by the allocator.
pub(crate) fn alloc_elems(dims: &[usize], elem_bytes: usize, what: &str) -> Result<usize> {
    alloc_elems_on(dims, elem_bytes, what, &Device::Cpu)
}

/// [`alloc_elems`] for memory on `device`: on the CPU the allocation is tried (reserved and
/// released untouched, so it costs no page); a device allocation reports its own failure.
pub(crate) fn alloc_elems_on(
    dims: &[usize],
    elem_bytes: usize,
    what: &str,
    device: &Device,
) -> Result<usize> {
    let elems = dims.iter().try_fold(1usize, |n, &d| n.checked_mul(d));
    let bytes = elems.and_then(|n| n.checked_mul(elem_bytes));
    let fits = match bytes {
        Some(b) if b <= isize::MAX as usize => {
            !device.is_cpu() || Vec::<u8>::new().try_reserve_exact(b).is_ok()
        }
        _ => false,
    };
    match elems {
        Some(n) if fits => Ok(n),
        _ => bail!("{what}: {dims:?} elements of {elem_bytes} bytes: does not fit in memory"),
    }
}

/// Sequences in one batch: the kernels index them in i32.
pub(crate) fn check_batch(batch: usize) -> Result<()> {
    if i32::try_from(batch).is_err() {
        bail!(
            "batch: {batch} sequences, more than the kernels' limit of {}",
            i32::MAX
        )
    }
    Ok(())
}

/// Checks the dropout probability the user gave.
pub(crate) fn check_dropout(p: f32) -> Result<()> {
    if !(0.0..1.0).contains(&p) {
        bail!("dropout_p: expected a value in [0, 1), got {p}")
    }
    Ok(())
}

/// Per-sequence numbers of a decoding call (cache lengths, a block table): on the host,
/// checked before anything is written, or in a U32 tensor on the CUDA device that only the
/// kernels read (no upload, no synchronisation: the call can be captured in a CUDA graph),
/// whose values the kernels clamp to the cache instead.
#[derive(Clone, Debug)]
pub(crate) enum Indices {
    Host(Vec<u32>),
    Device(Tensor),
}

impl PartialEq for Indices {
    fn eq(&self, other: &Self) -> bool {
        match (self, other) {
            (Indices::Host(a), Indices::Host(b)) => a == b,
            (Indices::Device(a), Indices::Device(b)) => a.id() == b.id(),
            _ => false,
        }
    }
}

impl Indices {
    /// The host values, or an error naming `what` for a device tensor (only the CUDA
    /// launchers read those).
    pub fn host(&self, what: &str) -> Result<&[u32]> {
        match self {
            Indices::Host(v) => Ok(v),
            Indices::Device(_) => bail!("{what}: a device tensor reached a host-only path"),
        }
    }
}

/// How a KV cache is laid out in memory.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Paging {
    /// `(b, capacity, hk, d)`: sequence `b` owns rows `0..capacity` of slice `b`.
    Contiguous { capacity: usize },
    /// `(num_pages, page_size, hk, d)` pages; token `j` of sequence `b` lives in page
    /// `block_table[b * max_pages + j / page_size]`, row `j % page_size`.
    Paged {
        page_size: usize,
        num_pages: usize,
        max_pages: usize,
        block_table: Indices,
    },
}

impl Paging {
    /// Tokens sequence `b` can hold.
    pub fn capacity(&self) -> usize {
        match self {
            Paging::Contiguous { capacity } => *capacity,
            Paging::Paged {
                page_size,
                max_pages,
                ..
            } => page_size.saturating_mul(*max_pages),
        }
    }
}

/// One KV-cache decoding call, after validation: `s_q` query tokens per sequence attend to
/// the first `seqlens[b]` cached tokens of their sequence (causal among the last `s_q` if
/// `causal`, bottom-right aligned). Appending new tokens is a separate in-place op that runs
/// first, or on CUDA part of the same launch (`append`); either way `seqlens` counts them.
#[derive(Clone, Debug)]
pub(crate) struct DecodeProblem {
    pub b: usize,
    pub s_q: usize,
    pub h: usize,
    pub hk: usize,
    pub d: usize,
    pub scale: f32,
    pub causal: bool,
    /// Window (right side includes `causal`), softcap and ALiBi slopes.
    pub mods: crate::score_mod::ScoreMods,
    /// Tokens to attend to per sequence: on the host (after the append, each
    /// <= `paging.capacity()`), or on the device as the lengths before the append, to which
    /// the kernels add `seqlens_add` (the appended count) and clamp to the capacity.
    pub seqlens: Indices,
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))] // the CPU converts device lengths
    pub seqlens_add: u32,
    /// Ragged queries: the real query rows per sequence (`<= s_q`; the rest of q is padding,
    /// whose output is 0 and LSE -inf); `None`: all `s_q`.
    pub q_lens: Option<Indices>,
    /// Device lengths grow by `q_lens[b]` (each sequence's new tokens), not `seqlens_add`.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub add_q_lens: bool,
    pub paging: Paging,
    /// Also return the row log-sum-exp `(b, h, s_q)` in f32.
    pub want_lse: bool,
    /// Attention sinks `(h)` in f32 ([`crate::sinks::values`]), applied to the output and
    /// LSE after the kernel.
    pub sinks: Option<Tensor>,
    /// An F8E4M3 cache's dequantization scales; `None` for a cache in q's dtype.
    pub kv_scales: Option<KvScales>,
    /// The new rows this launch appends itself before attending (CUDA only).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub append: Option<FusedAppend>,
}

/// The append a decode launch does itself: `k_new`, `v_new` `(b, s_new, hk, d)` written into
/// the caches at each sequence's end (its `q_lens[b]` first rows when ragged), K and q
/// rotated when `rotary` is set (its `q` unused: the launch rotates the q it attends with).
#[derive(Clone, Debug)]
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) struct FusedAppend {
    pub k_new: Tensor,
    pub v_new: Tensor,
    pub s_new: usize,
    pub rotary: Option<RotaryProblem>,
}

/// The per-head dequantization scales of an F8E4M3 KV cache: a cached value times its
/// head's scale is the real key or value. Each is `(num_heads_k,)` F32, contiguous, on the
/// cache's device (checked by the call).
#[derive(Clone, Debug)]
pub(crate) struct KvScales {
    pub k: Tensor,
    pub v: Tensor,
}

/// One in-place append: `new` (b, s_new, hk, d) is written to cache rows
/// `start[b]..start[b] + s_new` of sequence `b` (checked to fit by the caller).
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct AppendProblem {
    pub b: usize,
    pub s_new: usize,
    pub hk: usize,
    pub d: usize,
    /// Tokens already in the cache per sequence, before this append (on the device: rows
    /// past the capacity are dropped by the kernel).
    pub start: Indices,
    /// Ragged: the new rows per sequence (`<= s_new`; the rest of `new` is padding).
    pub new_lens: Option<Indices>,
    pub paging: Paging,
    /// Rotates the new rows, and the queries, at their positions (the K append only).
    pub rotary: Option<RotaryProblem>,
    /// An F8E4M3 cache: this cache's per-head scales `(hk,)` F32 (see [`KvScales`]); the new
    /// rows are divided by their head's scale and rounded to e4m3 (saturating at ±448).
    pub quant: Option<QuantScale>,
}

/// [`AppendProblem::quant`]: a scale tensor compared by identity.
#[derive(Clone, Debug)]
pub(crate) struct QuantScale(pub Tensor);

impl PartialEq for QuantScale {
    fn eq(&self, o: &Self) -> bool {
        self.0.id() == o.0.id()
    }
}

/// Rotary embedding fused into a KV-cache append: the new rows turn at positions
/// `start[b] + i`; the queries `q` `(b, s_q, h, d)` are rotated into a new tensor at
/// `start[b] + i` (`q_causal`) or `start[b]`.
#[derive(Clone, Debug)]
pub(crate) struct RotaryProblem {
    /// `(positions, rot_half)` f32, contiguous.
    pub cos: Tensor,
    pub sin: Tensor,
    pub rot_half: usize,
    pub interleaved: bool,
    pub q: Tensor,
    pub s_q: usize,
    pub h: usize,
    pub q_causal: bool,
}

impl PartialEq for RotaryProblem {
    fn eq(&self, o: &Self) -> bool {
        (self.cos.id(), self.sin.id(), self.q.id()) == (o.cos.id(), o.sin.id(), o.q.id())
            && (
                self.rot_half,
                self.interleaved,
                self.s_q,
                self.h,
                self.q_causal,
            ) == (o.rot_half, o.interleaved, o.s_q, o.h, o.q_causal)
    }
}
