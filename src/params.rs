//! Validation of the user's tensors, and the problem description shared by the CPU and CUDA
//! paths. Every error names the argument that failed and what was expected.

use candle::{bail, DType, Device, Result, Tensor};

/// Largest head dimension the kernels are instantiated for.
pub const MAX_HEAD_DIM: usize = 256;

/// Sizes of one attention call. q is `(b, sq, h, d)`, k and v are `(b, sk, hk, d)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct AttnShape {
    pub b: usize,
    pub sq: usize,
    pub sk: usize,
    pub h: usize,
    pub hk: usize,
    pub d: usize,
}

impl AttnShape {
    pub fn q_elems(&self) -> usize {
        self.b * self.sq * self.h * self.d
    }
    pub fn kv_elems(&self) -> usize {
        self.b * self.sk * self.hk * self.d
    }
    /// Query heads that share one K/V head.
    pub fn group(&self) -> usize {
        self.h / self.hk
    }
}

/// Everything the kernels need besides the data: sizes, scale and mask.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Problem {
    pub shape: AttnShape,
    /// Multiplies q·k before the softmax.
    pub scale: f32,
    /// Bottom-right aligned causal mask: query i sees key j iff j <= i + sk - sq.
    pub causal: bool,
}

impl Problem {
    /// Last key index query row `i` may see, plus one (bottom-right alignment), clamped to
    /// `[0, sk]`. A result of 0 means the row sees no key.
    pub fn key_end(&self, i: usize) -> usize {
        let sk = self.shape.sk;
        if !self.causal {
            return sk;
        }
        let end = i as i64 + 1 + sk as i64 - self.shape.sq as i64;
        end.clamp(0, sk as i64) as usize
    }
}

fn dims4(t: &Tensor, name: &str, what: &str) -> Result<(usize, usize, usize, usize)> {
    match t.dims() {
        &[a, b, c, d] => Ok((a, b, c, d)),
        dims => bail!("{name}: expected rank 4 {what}, got shape {dims:?}"),
    }
}

fn check_last_dim_contiguous(t: &Tensor, name: &str) -> Result<()> {
    let stride = t.stride()[3];
    if stride != 1 && t.dim(3)? > 1 {
        bail!(
            "{name}: the last dimension (head_dim) must be contiguous (stride 1), got strides {:?}",
            t.stride()
        )
    }
    Ok(())
}

/// Checks that q, k, v describe one attention problem: rank 4, matching batch, seqlen_k,
/// num_heads_k and head_dim, `num_heads % num_heads_k == 0`, one dtype and one device.
/// Shared by the kernels ([`validate`]) and by the oracle [`crate::attention_slow`], which
/// accepts any dtype on any device.
pub(crate) fn validate_shapes(q: &Tensor, k: &Tensor, v: &Tensor) -> Result<AttnShape> {
    let (b, sq, h, d) = dims4(q, "q", "(batch, seqlen_q, num_heads, head_dim)")?;
    let (bk, sk, hk, dk) = dims4(k, "k", "(batch, seqlen_k, num_heads_k, head_dim)")?;
    let (bv, skv, hkv, dv) = dims4(v, "v", "(batch, seqlen_k, num_heads_k, head_dim)")?;
    for (name, t) in [("k", k), ("v", v)] {
        if !t.device().same_device(q.device()) {
            bail!(
                "{name}: expected the same device as q ({:?}), got {:?}",
                q.device().location(),
                t.device().location()
            )
        }
        if t.dtype() != q.dtype() {
            bail!(
                "{name}: expected the same dtype as q ({:?}), got {:?}",
                q.dtype(),
                t.dtype()
            )
        }
    }
    if bk != b {
        bail!("k: batch size {bk} differs from q's {b}")
    }
    if bv != b {
        bail!("v: batch size {bv} differs from q's {b}")
    }
    if skv != sk {
        bail!("v: seqlen {skv} differs from k's seqlen {sk}")
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
    Ok(AttnShape {
        b,
        sq,
        sk,
        h,
        hk,
        d,
    })
}

/// Checks q, k, v against each other and against what the device's kernels support.
pub(crate) fn validate(q: &Tensor, k: &Tensor, v: &Tensor) -> Result<AttnShape> {
    let shape = validate_shapes(q, k, v)?;
    match (q.device(), q.dtype()) {
        (_, DType::F16 | DType::BF16) => {}
        (Device::Cpu, DType::F32) => {}
        (Device::Cpu, dt) => bail!("q: dtype {dt:?} is not supported, expected F32, F16 or BF16"),
        (_, dt) => bail!("q: dtype {dt:?} is not supported on this device, expected F16 or BF16"),
    }
    let d = shape.d;
    if d == 0 || d > MAX_HEAD_DIM {
        bail!("q: head_dim must be in 1..={MAX_HEAD_DIM}, got {d}")
    }
    if q.device().is_cuda() && d % 8 != 0 {
        bail!("q: head_dim must be a multiple of 8 on CUDA, got {d}")
    }
    for (name, t) in [("q", q), ("k", k), ("v", v)] {
        check_last_dim_contiguous(t, name)?;
    }
    Ok(shape)
}

/// Checks the softmax scale the user gave.
pub(crate) fn check_scale(scale: f32) -> Result<()> {
    if !scale.is_finite() || scale <= 0.0 {
        bail!("softmax_scale: expected a finite positive number, got {scale}")
    }
    Ok(())
}
