//! Local (sliding-window) attention, softcapping and ALiBi: FlashAttention 2's `window_size`,
//! `softcap` and `alibi_slopes`, with its semantics, for every path (CPU, CUDA forward,
//! backward and decode).
//!
//! For query row `i` and key `j` of a sequence with `sq` queries and `sk` keys, with
//! `off = sk - sq` (bottom-right alignment, like the causal mask):
//! - window `(left, right)`: `j` is visible iff `i + off - left <= j <= i + off + right`
//!   (`None` = unbounded on that side; causal is right = 0). A side `>= sk` is unbounded
//!   too, FlashAttention 2's rule (`window_size_left >= seqlen_k` becomes -1), applied per
//!   sequence: it is what keeps the sums below in range for sides up to `i64::MAX`;
//! - the score is `s = scale · q·k`, then `s = c · tanh(s / c)` with a softcap `c`, then
//!   `s - slope · |i + off - j|` with ALiBi slopes; the softmax follows.

use candle::{bail, DType, Result, Tensor};

use crate::shape::AttnShape;

/// The score modifications of one call, validated. `right` already includes the causal mask.
#[derive(Clone, Debug, Default, PartialEq)]
pub(crate) struct ScoreMods {
    pub left: Option<usize>,
    pub right: Option<usize>,
    pub softcap: Option<f32>,
    pub alibi: Option<Alibi>,
    /// Block-sparse attention: only the blocks the mask keeps are visible (checked against
    /// the call's shape).
    pub sparse: Option<crate::BlockMask>,
}

/// ALiBi slopes: f32, contiguous, on the inputs' device, `(num_heads)` (`per_batch` false) or
/// `(batch, num_heads)`.
#[derive(Clone, Debug)]
pub(crate) struct Alibi {
    pub slopes: Tensor,
    pub per_batch: bool,
}

impl PartialEq for Alibi {
    fn eq(&self, other: &Self) -> bool {
        self.slopes.id() == other.slopes.id() && self.per_batch == other.per_batch
    }
}

impl Alibi {
    /// The slopes as host values, `(b or 1) * h` of them (the CPU path reads them).
    pub fn host(&self) -> Result<Vec<f32>> {
        self.slopes.flatten_all()?.to_vec1::<f32>()
    }

    /// Index of sequence `b`, head `h`'s slope in [`Alibi::host`].
    pub fn index(&self, b: usize, h: usize, num_heads: usize) -> usize {
        if self.per_batch {
            b * num_heads + h
        } else {
            h
        }
    }
}

impl ScoreMods {
    /// Checks the user's options against the problem: a window `(left, right)` in FA2's
    /// convention (-1 = unbounded, other negatives are errors), a softcap that is finite and
    /// > 0 (0 = off, as in FA2), slopes of shape `(h)` or `(b, h)`, f32, on `device`.
    pub fn new(
        causal: bool,
        window: (i64, i64),
        softcap: f32,
        alibi: Option<&Tensor>,
        shape: &AttnShape,
        device: &candle::Device,
    ) -> Result<Self> {
        let side = |v: i64, name: &str| -> Result<Option<usize>> {
            match v {
                -1 => Ok(None),
                v if v >= 0 => Ok(Some(v as usize)),
                v => bail!("window_size: {name} must be >= 0, or -1 for unbounded, got {v}"),
            }
        };
        let left = side(window.0, "left")?;
        let mut right = side(window.1, "right")?;
        if causal {
            right = Some(0);
        }
        let softcap = if softcap == 0.0 {
            None
        } else if softcap.is_finite() && softcap > 0.0 {
            Some(softcap)
        } else {
            bail!("softcap: expected a finite value > 0 (or 0 for none), got {softcap}")
        };
        let alibi = match alibi {
            None => None,
            Some(t) => Some(Alibi::new(t, shape, device)?),
        };
        Ok(Self {
            left,
            right,
            softcap,
            alibi,
            sparse: None,
        })
    }

    /// The window's sides in a sequence of `sk` keys: a side `>= sk` is unbounded (`None`).
    pub fn sides(&self, sk: usize) -> (Option<usize>, Option<usize>) {
        let within = |w: Option<usize>| w.filter(|&w| w < sk);
        (within(self.left), within(self.right))
    }

    /// Keys `[lo, hi)` that query row `i` sees in a sequence of `sq` queries and `sk` keys;
    /// `lo >= hi` when none.
    pub fn key_range(&self, i: usize, sq: usize, sk: usize) -> (usize, usize) {
        // Sizes of tensors in memory and sides below `sk`: every sum fits an i64.
        let (left, right) = self.sides(sk);
        let diag = i as i64 + sk as i64 - sq as i64;
        let lo = left.map_or(0, |l| (diag - l as i64).max(0));
        let hi = right.map_or(sk as i64, |r| (diag + r as i64 + 1).clamp(0, sk as i64));
        (lo.min(sk as i64) as usize, hi as usize)
    }

    /// The score of `(i, j)` after the cap and the bias, from the scaled dot product `s`, and
    /// its derivative with respect to `s` (`1 - tanh²` under a cap, else 1). `slope` is the
    /// row's ALiBi slope (0 without ALiBi).
    pub fn score(
        &self,
        s: f32,
        i: usize,
        j: usize,
        sq: usize,
        sk: usize,
        slope: f32,
    ) -> (f32, f32) {
        let (s, grad) = match self.softcap {
            Some(c) => {
                let t = (s / c).tanh();
                (c * t, 1.0 - t * t)
            }
            None => (s, 1.0),
        };
        if slope == 0.0 {
            return (s, grad);
        }
        let dist = (i as i64 + sk as i64 - sq as i64 - j as i64).unsigned_abs() as f32;
        (s - slope * dist, grad)
    }
}

impl Alibi {
    fn new(t: &Tensor, shape: &AttnShape, device: &candle::Device) -> Result<Self> {
        if !t.device().same_device(device) {
            bail!(
                "alibi_slopes: expected the same device as q ({:?}), got {:?}",
                device.location(),
                t.device().location()
            )
        }
        if t.dtype() != DType::F32 {
            bail!("alibi_slopes: expected dtype F32, got {:?}", t.dtype())
        }
        let per_batch = match t.dims() {
            &[h] if h == shape.h => false,
            &[b, h] if b == shape.b && h == shape.h => true,
            dims => bail!(
                "alibi_slopes: expected shape (num_heads) = ({}) or (batch, num_heads) = ({}, {}), \
                 got {dims:?}",
                shape.h,
                shape.b,
                shape.h
            ),
        };
        Ok(Self {
            slopes: t.contiguous()?,
            per_batch,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle::Device;

    fn mods(left: Option<usize>, right: Option<usize>) -> ScoreMods {
        ScoreMods {
            left,
            right,
            ..ScoreMods::default()
        }
    }

    /// `key_range` against the definition, key by key: `j` visible iff
    /// `i + sk - sq - left <= j <= i + sk - sq + right`, a side `>= sk` unbounded; the visible
    /// keys are one run.
    #[test]
    fn key_range_is_the_definition() {
        let huge = Some(i64::MAX as usize);
        let sides = [None, Some(0), Some(1), Some(3), Some(4), Some(10), huge];
        for (sq, sk) in [(1, 1), (5, 5), (3, 9), (9, 3), (0, 4), (4, 0)] {
            for left in sides {
                for right in sides {
                    let m = mods(left, right);
                    for i in 0..sq {
                        let diag = i as i128 + sk as i128 - sq as i128;
                        let bounded = |w: Option<usize>| w.filter(|&w| w < sk);
                        let visible: Vec<usize> = (0..sk)
                            .filter(|&j| {
                                let j = j as i128;
                                bounded(left).is_none_or(|l| j >= diag - l as i128)
                                    && bounded(right).is_none_or(|r| j <= diag + r as i128)
                            })
                            .collect();
                        let (lo, hi) = m.key_range(i, sq, sk);
                        let got: Vec<usize> = (lo..hi).collect();
                        assert_eq!(
                            got, visible,
                            "({left:?}, {right:?}) sq {sq} sk {sk} row {i}"
                        );
                        assert!(lo <= sk && hi <= sk);
                    }
                }
            }
        }
    }

    /// Both ends grow with the row: the CPU bounds a tile's keys by its first and last rows.
    #[test]
    fn key_range_is_monotone() {
        for m in [
            mods(Some(2), Some(0)),
            mods(Some(0), None),
            mods(None, Some(3)),
            mods(Some(usize::MAX), Some(usize::MAX)),
        ] {
            for (sq, sk) in [(7, 20), (20, 7), (10, 10)] {
                let ranges: Vec<_> = (0..sq).map(|i| m.key_range(i, sq, sk)).collect();
                for w in ranges.windows(2) {
                    assert!(w[0].0 <= w[1].0 && w[0].1 <= w[1].1, "{m:?} {ranges:?}");
                }
            }
        }
    }

    #[test]
    fn score_caps_then_biases() {
        let plain = ScoreMods::default();
        assert_eq!(plain.score(3.5, 2, 7, 4, 9, 0.0), (3.5, 1.0));
        let capped = ScoreMods {
            softcap: Some(2.0),
            ..ScoreMods::default()
        };
        let (s, grad) = capped.score(3.0, 0, 0, 1, 1, 0.0);
        assert!((s - 2.0 * (1.5f32).tanh()).abs() < 1e-6);
        // The derivative against a central difference.
        let h = 1e-2;
        let numeric = (capped.score(3.0 + h, 0, 0, 1, 1, 0.0).0
            - capped.score(3.0 - h, 0, 0, 1, 1, 0.0).0)
            / (2.0 * h);
        assert!((grad - numeric).abs() < 1e-3, "{grad} vs {numeric}");
        // ALiBi after the cap: row 1 of 4, keys 9: diagonal 6, key 2 is 4 away.
        let (s, grad) = capped.score(3.0, 1, 2, 4, 9, 0.25);
        assert!((s - (2.0 * (1.5f32).tanh() - 1.0)).abs() < 1e-6);
        assert!((grad - numeric).abs() < 1e-3);
        // Past the diagonal the distance is |i + off - j| too.
        assert_eq!(plain.score(0.0, 1, 9, 4, 9, 0.5).0, -1.5);
    }

    #[test]
    fn new_validates_and_applies_causal() -> Result<()> {
        let dev = Device::Cpu;
        let shape = AttnShape::fixed(2, 4, 4, 3, 1, 8);
        let m = ScoreMods::new(true, (5, -1), 0.0, None, &shape, &dev)?;
        assert_eq!((m.left, m.right, m.softcap), (Some(5), Some(0), None));
        let m = ScoreMods::new(false, (-1, 2), 30.0, None, &shape, &dev)?;
        assert_eq!((m.left, m.right, m.softcap), (None, Some(2), Some(30.0)));
        for bad in [(-2, 0), (0, -3)] {
            let e = ScoreMods::new(false, bad, 0.0, None, &shape, &dev).unwrap_err();
            assert!(e.to_string().starts_with("window_size:"), "{e}");
        }
        for bad in [-1.0, f32::NAN, f32::INFINITY] {
            let e = ScoreMods::new(false, (-1, -1), bad, None, &shape, &dev).unwrap_err();
            assert!(e.to_string().starts_with("softcap:"), "{e}");
        }
        let per_head = Tensor::ones(3, DType::F32, &dev)?;
        let per_seq = Tensor::ones((2, 3), DType::F32, &dev)?;
        let m = ScoreMods::new(false, (-1, -1), 0.0, Some(&per_seq), &shape, &dev)?;
        let a = m.alibi.expect("alibi");
        assert!(a.per_batch);
        assert_eq!((a.index(1, 2, 3), a.host()?.len()), (5, 6));
        let m = ScoreMods::new(false, (-1, -1), 0.0, Some(&per_head), &shape, &dev)?;
        assert_eq!(m.alibi.expect("alibi").index(1, 2, 3), 2);
        for bad in [
            Tensor::ones(2, DType::F32, &dev)?,
            Tensor::ones((3, 3), DType::F32, &dev)?,
            Tensor::ones(3, DType::F16, &dev)?,
        ] {
            let e = ScoreMods::new(false, (-1, -1), 0.0, Some(&bad), &shape, &dev).unwrap_err();
            assert!(e.to_string().starts_with("alibi_slopes:"), "{e}");
        }
        Ok(())
    }
}
