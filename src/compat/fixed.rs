//! Fixed-length calls: upstream's window on `(batch, seqlen, heads, head_dim)` tensors, run as
//! one call of our op, or two when the first rows need their own mask.

use candle::{Result, Tensor};

use super::scores::Scores;
use super::window::{Window, CAUSAL};

/// Fixed-length attention with upstream's window conventions, `seqlen_k` the limit.
pub(super) fn fixed(
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
