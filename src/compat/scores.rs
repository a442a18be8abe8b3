//! The score modifiers of a call (scale, softcap, ALiBi) as upstream takes them, checked, and
//! turned into our op's options.

use candle::{bail, DType, Result, Tensor};

use super::window::Mask;
use crate::options::FlashAttn as Options;

/// The score modifiers of a call as upstream takes them.
pub(super) struct Scores<'a> {
    scale: f32,
    softcap: Option<f32>,
    pub(super) alibi: Option<&'a Tensor>,
}

impl<'a> Scores<'a> {
    pub(super) fn plain(scale: f32) -> Result<Self> {
        Self::new(scale, None, None)
    }

    /// Checks the scale (finite) and keeps a softcap only when `> 0` (upstream's rule).
    pub(super) fn new(scale: f32, softcap: Option<f32>, alibi: Option<&'a Tensor>) -> Result<Self> {
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
    pub(super) fn check_slopes(&self, num_heads: usize) -> Result<()> {
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
    pub(super) fn query(&self, q: &Tensor) -> Result<(Tensor, f32)> {
        if self.scale > 0.0 {
            Ok((q.clone(), self.scale))
        } else if self.scale < 0.0 {
            Ok((q.neg()?, -self.scale))
        } else {
            Ok(((q * 0.0)?, 1.0))
        }
    }

    /// Our options for one mask at scale `scale`. `flip_alibi` negates the slopes: see
    /// [`Window::clipped_rows`](super::window::Window::clipped_rows) for the rows that need it.
    pub(super) fn options(&self, scale: f32, mask: Mask, flip_alibi: bool) -> Result<Options> {
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
