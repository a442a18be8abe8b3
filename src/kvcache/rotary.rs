//! Rotary embedding inside the KV-cache calls ([`crate::FlashAttn::rotary`]): checked here;
//! on CUDA the append kernel rotates the new keys as it writes them and the queries into a
//! buffer of their own (one launch), on the CPU the same rotation runs as tensor ops before
//! the plain append.

use candle::{bail, DType, IndexOp, Result, Tensor};

use crate::options::Rotary;
use crate::params::{Indices, RotaryProblem};

/// The call's shape as far as rotary embedding needs it.
pub(super) struct RotaryCall<'a> {
    pub q: &'a Tensor,
    pub s_q: usize,
    pub h: usize,
    pub d: usize,
    pub s_new: usize,
    pub has_new_kv: bool,
    /// Queries at `start + i` (causal or windowed) or all at `start`.
    pub q_causal: bool,
    pub starts: &'a Indices,
}

/// Checks the tables against the call; returns them as the kernels read them (f32,
/// contiguous).
pub(super) fn check(r: &Rotary, c: &RotaryCall) -> Result<RotaryProblem> {
    if !c.has_new_kv {
        bail!(
            "rotary: rotary embedding is applied to the new keys and the queries, so the call \
             needs new keys and values (k_new, v_new)"
        )
    }
    let (rows, half) = match r.cos.dims() {
        &[rows, half] => (rows, half),
        dims => bail!("rotary: cos must be (positions, rotary_dim / 2), got shape {dims:?}"),
    };
    if r.sin.dims() != r.cos.dims() {
        bail!(
            "rotary: sin has shape {:?}, cos {:?}; expected the same",
            r.sin.dims(),
            r.cos.dims()
        )
    }
    if half == 0 || half % 8 != 0 || 2 * half > c.d {
        bail!(
            "rotary: rotary_dim = 2 * cos.dim(1) = {} must be a positive multiple of 16 and at \
             most head_dim {}",
            2 * half,
            c.d
        )
    }
    for (t, name) in [(&r.cos, "cos"), (&r.sin, "sin")] {
        if !t.dtype().is_float() {
            bail!(
                "rotary: {name} has dtype {:?}, expected a float dtype",
                t.dtype()
            )
        }
        if !t.device().same_device(c.q.device()) {
            bail!("rotary: {name} is on another device than q")
        }
    }
    if let Indices::Host(starts) = c.starts {
        let span = c.s_new.max(if c.q_causal { c.s_q } else { c.s_q.min(1) });
        for (b, &start) in starts.iter().enumerate() {
            let last = start as usize + span;
            if span > 0 && last > rows {
                bail!(
                    "rotary: sequence {b} needs positions up to {}, but cos and sin have {rows} rows",
                    last - 1
                )
            }
        }
    }
    let f32c = |t: &Tensor| t.detach().to_dtype(DType::F32)?.contiguous();
    Ok(RotaryProblem {
        cos: f32c(&r.cos)?,
        sin: f32c(&r.sin)?,
        rot_half: half,
        interleaved: r.interleaved,
        q: crate::layout::aligned(c.q)?,
        s_q: c.s_q,
        h: c.h,
        q_causal: c.q_causal,
    })
}

/// `x` `(b, s, heads, d)` rotated at position `start[b] + i` of row `i` (`per_row`) or
/// `start[b]`, in f32 with one rounding: the CPU's form of the kernel's rotation.
pub(super) fn rotate_cpu(
    x: &Tensor,
    r: &RotaryProblem,
    starts: &[u32],
    per_row: bool,
) -> Result<Tensor> {
    let (b, s, heads, d) = x.dims4()?;
    let half = r.rot_half;
    let pos: Vec<u32> = (0..b)
        .flat_map(|bi| (0..s).map(move |i| starts[bi] + if per_row { i as u32 } else { 0 }))
        .collect();
    let idx = Tensor::from_vec(pos, b * s, x.device())?;
    let table = |t: &Tensor| t.index_select(&idx, 0)?.reshape((b, s, 1, half));
    let (cos, sin) = (table(&r.cos)?, table(&r.sin)?);
    let xf = x.to_dtype(DType::F32)?;
    let xr = xf.narrow(3, 0, 2 * half)?;
    let (x1, x2) = if r.interleaved {
        let pairs = xr.reshape((b, s, heads, half, 2))?;
        (pairs.i((.., .., .., .., 0))?, pairs.i((.., .., .., .., 1))?)
    } else {
        (xr.narrow(3, 0, half)?, xr.narrow(3, half, half)?)
    };
    let o1 = (x1.broadcast_mul(&cos)? - x2.broadcast_mul(&sin)?)?;
    let o2 = (x2.broadcast_mul(&cos)? + x1.broadcast_mul(&sin)?)?;
    let rotated = if r.interleaved {
        Tensor::stack(&[o1, o2], 4)?.reshape((b, s, heads, 2 * half))?
    } else {
        Tensor::cat(&[o1, o2], 3)?
    };
    let out = if 2 * half < d {
        Tensor::cat(&[rotated, xf.narrow(3, 2 * half, d - 2 * half)?], 3)?
    } else {
        rotated
    };
    out.to_dtype(x.dtype())
}
