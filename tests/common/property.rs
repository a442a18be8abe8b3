//! The property test's generator (issue 53), shared by the CPU test (tests/cpu_property.rs)
//! and the GPU suite's `property` section (tests/gpu/property.rs): random configurations over
//! the whole option space of `FlashAttn`, each drawn from one `u64` seed so that a failing
//! case is replayed from the seed alone (`CANDLE_FLASH_PROPTEST_REPLAY`). The inputs are drawn
//! from the same seed on the host, so a replay sees the same numbers on any device.
//!
//! The drawing is in `generate`, the evaluation (our op and the oracle: outputs, LSE and
//! gradients) in [`eval`]; the checks, whose rules differ between the CPU and the GPU suite,
//! are in the two test files.

use std::fmt;

use candle::{DType, Device, Result, Tensor};
use candle_flash::{BlockMask, FlashAttn, Padding, VarLen};

pub mod eval;
mod generate;
mod shrink;

#[allow(unused_imports)] // like tests/common/mod.rs: each test binary uses a different subset
pub use generate::{generate, normals};
#[allow(unused_imports)]
pub use shrink::{minimize, shrinks};

/// How many cases, from which seed; read from the environment.
#[derive(Clone, Copy, Debug)]
pub struct Settings {
    pub cases: usize,
    pub seed: u64,
    /// One case seed to run alone (a failure's replay line).
    pub replay: Option<u64>,
    /// With `replay`: minimize the case ([`minimize`]).
    pub shrink: bool,
}

impl Settings {
    /// `CANDLE_FLASH_PROPTEST_CASES` (default `default_cases`), `CANDLE_FLASH_PROPTEST_SEED`
    /// (default a fixed seed, so CI runs the same cases every time) and
    /// `CANDLE_FLASH_PROPTEST_REPLAY` (a case seed, decimal or 0x-hex), with
    /// `CANDLE_FLASH_PROPTEST_SHRINK=1` to minimize it if it fails.
    pub fn from_env(default_cases: usize) -> Self {
        let var = |name: &str| std::env::var(name).ok().and_then(|v| parse_u64(&v));
        Self {
            cases: var("CANDLE_FLASH_PROPTEST_CASES").map_or(default_cases, |n| n as usize),
            seed: var("CANDLE_FLASH_PROPTEST_SEED").unwrap_or(0x5EED_0053),
            replay: var("CANDLE_FLASH_PROPTEST_REPLAY"),
            shrink: var("CANDLE_FLASH_PROPTEST_SHRINK") == Some(1),
        }
    }

    /// The seed of every case: the replay seed alone, or `cases` seeds from `seed`.
    pub fn case_seeds(&self) -> Vec<u64> {
        match self.replay {
            Some(seed) => vec![seed],
            None => (0..self.cases as u64)
                .map(|i| splitmix(self.seed ^ splitmix(i)))
                .collect(),
        }
    }
}

fn parse_u64(s: &str) -> Option<u64> {
    let s = s.trim();
    match s.strip_prefix("0x") {
        Some(hex) => u64::from_str_radix(hex, 16).ok(),
        None => s.parse().ok(),
    }
}

/// SplitMix64's finaliser: neighbouring case indices get unrelated seeds.
fn splitmix(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Where the op runs, which decides the dtypes and head dims drawn (src/params.rs: f32 only
/// on the CPU, head_dim a multiple of 8 on CUDA) and the sizes (`long`: GPU-sized sequences).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Target {
    Cpu,
    Cuda { long: bool },
}

/// How the batch is laid out.
#[derive(Clone, Debug)]
pub enum Batch {
    /// `(b, sq, h, d)` and `(b, sk, hk, d)`.
    Fixed,
    /// Packed `(total, h, d)`, sequence lengths per side.
    Varlen {
        lens_q: Vec<usize>,
        lens_k: Vec<usize>,
    },
    /// `(b, sq, h, d)` with padding masks `(b, sq)` and `(b, sk)`, 1 = real token.
    Padded {
        pattern: &'static str,
        q_mask: Vec<u8>,
        kv_mask: Vec<u8>,
    },
}

/// One side of the window: `-1` (open) or a size, given through `window_size` (i64) or
/// `window` (`Option<usize>`, where `usize::MAX` becomes `i64::MAX`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Side {
    Open,
    Size(u64),
}

/// Which of the two window builders the case calls.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum WindowApi {
    WindowSize,
    Window,
}

/// A non-contiguous view of an input (only the last dimension contiguous): the test makes a
/// larger base tensor and takes this view of it, so gradients are those of the base.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum View {
    Contiguous,
    /// Stored rows-after-heads, transposed into place.
    HeadsMajor,
    /// `before` and `after` extra rows around the used ones (narrowed along the rows).
    Rows {
        before: usize,
        after: usize,
    },
    /// A row of `d + pad` elements of which `off..off + d` are used.
    Wide {
        pad: usize,
        off: usize,
    },
}

/// How the block mask is built; its states or element mask are drawn at generation, for the
/// call's (longest) lengths, and each sequence uses their top-left part.
#[derive(Clone, Debug)]
pub enum BlockKind {
    /// `BlockMask::new` with these states `(heads, rows, cols)`, nonzero = present.
    States(Vec<u8>),
    /// `BlockMask::from_dense` with this element mask `(heads, sq, sk)`.
    Dense(Vec<u8>),
    LocalGlobal {
        local: usize,
        global: usize,
    },
    Strided {
        stride: usize,
    },
    Butterfly,
}

#[derive(Clone, Debug)]
pub struct Blocks {
    pub kind: BlockKind,
    pub block_q: usize,
    pub block_k: usize,
    /// 1 (shared) or `h`.
    pub heads: usize,
    /// The lengths the states or the element mask cover.
    pub full: (usize, usize),
}

/// How the gradients are taken.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Grad {
    None,
    /// `backward()` through the op (Candle's autograd).
    Autograd,
    /// `forward_with_lse` then `FlashAttn::backward` (fixed-length batches only).
    Direct,
}

/// One case. For packed and padded batches `b` is the number of sequences and `sq`, `sk` the
/// rows of the tensors' row dimension (packed: totals; padded: the padded lengths).
#[derive(Clone, Debug)]
pub struct Config {
    pub seed: u64,
    pub dtype: DType,
    pub batch: Batch,
    pub b: usize,
    pub sq: usize,
    pub sk: usize,
    pub h: usize,
    pub hk: usize,
    pub d: usize,
    pub causal: bool,
    pub window: Option<(Side, Side, WindowApi)>,
    /// A negative side other than -1 (an invalid case), given through `window_size`.
    pub bad_window: Option<i64>,
    pub softcap: f32,
    pub scale: Option<f32>,
    /// ALiBi slopes, `(h)` or, with `per_batch`, `(b, h)`.
    pub alibi: Option<(bool, Vec<f32>)>,
    pub blocks: Option<Blocks>,
    /// `(p, seed, rng_offset)`.
    pub dropout: Option<(f32, u64, u64)>,
    pub views: [View; 3],
    pub grad: Grad,
    pub deterministic: bool,
    /// Standard deviation of q and k (large values make the softmax peaky).
    pub amplitude: f32,
}

impl Config {
    /// A plain fixed-length case (no option, contiguous inputs, autograd) of `(b, sq, sk, h,
    /// hk, d)`, for hand-made cases; its inputs come from seed 1.
    pub fn plain(
        dtype: DType,
        (b, sq, sk, h, hk, d): (usize, usize, usize, usize, usize, usize),
    ) -> Self {
        Self {
            seed: 1,
            dtype,
            batch: Batch::Fixed,
            b,
            sq,
            sk,
            h,
            hk,
            d,
            causal: false,
            window: None,
            bad_window: None,
            softcap: 0.0,
            scale: None,
            alibi: None,
            blocks: None,
            dropout: None,
            views: [View::Contiguous; 3],
            grad: Grad::Autograd,
            deterministic: false,
            amplitude: 1.0,
        }
    }

    /// Sequences as `(first q row, len_q, first k row, len_k)` in the rows of the packed (or
    /// fixed, flattened) layout; for padded batches the rows within the real tokens.
    pub fn seqs(&self) -> Vec<(usize, usize, usize, usize)> {
        let lens: Vec<(usize, usize)> = match &self.batch {
            Batch::Fixed => vec![(self.sq, self.sk); self.b],
            Batch::Varlen { lens_q, lens_k } => {
                lens_q.iter().copied().zip(lens_k.clone()).collect()
            }
            Batch::Padded {
                q_mask, kv_mask, ..
            } => (0..self.b)
                .map(|b| (real(q_mask, b, self.sq), real(kv_mask, b, self.sk)))
                .collect(),
        };
        let (mut q0, mut k0) = (0, 0);
        lens.into_iter()
            .map(|(lq, lk)| {
                let s = (q0, lq, k0, lk);
                (q0, k0) = (q0 + lq, k0 + lk);
                s
            })
            .collect()
    }

    /// The longest sequences: the lengths a block mask and a dropout mask cover.
    pub fn max_lens(&self) -> (usize, usize) {
        match self.batch {
            Batch::Fixed => (self.sq, self.sk),
            _ => self
                .seqs()
                .iter()
                .fold((0, 0), |(a, b), s| (a.max(s.1), b.max(s.3))),
        }
    }

    /// The options of the whole call, with slopes and block mask on `dev`.
    pub fn options(&self, dev: &Device) -> Result<FlashAttn> {
        let (mq, mk) = self.max_lens();
        self.options_with(dev, None, (mq, mk))
    }

    /// The options of sequence `b` alone, of lengths `lens` (its slopes' row, the top-left
    /// part of the block mask), for the per-sequence oracle.
    pub fn options_with(
        &self,
        dev: &Device,
        b: Option<usize>,
        lens: (usize, usize),
    ) -> Result<FlashAttn> {
        let mut o = FlashAttn::new()
            .causal(self.causal)
            .softcap(self.softcap)
            .deterministic(self.deterministic);
        if let Some(s) = self.scale {
            o = o.softmax_scale(s);
        }
        if let Some((left, right, api)) = self.window {
            o = match api {
                WindowApi::WindowSize => {
                    let side = |s| match s {
                        Side::Open => -1,
                        Side::Size(n) => n.min(i64::MAX as u64) as i64,
                    };
                    o.window_size(side(left), side(right))
                }
                WindowApi::Window => {
                    let side = |s| match s {
                        Side::Open => None,
                        Side::Size(n) => Some(usize::try_from(n).unwrap_or(usize::MAX)),
                    };
                    o.window(side(left), side(right))
                }
            };
        }
        if let Some(bad) = self.bad_window {
            o = o.window_size(bad, -1);
        }
        if let Some((per_batch, slopes)) = &self.alibi {
            let t = if *per_batch {
                let all = Tensor::from_vec(slopes.clone(), (self.b, self.h), dev)?;
                match b {
                    Some(b) => all.narrow(0, b, 1)?,
                    None => all,
                }
            } else {
                Tensor::from_vec(slopes.clone(), self.h, dev)?
            };
            o = o.alibi_slopes(&t);
        }
        if let Some(blocks) = &self.blocks {
            o = o.block_mask(&blocks.mask(lens, dev)?);
        }
        if let Some((p, seed, offset)) = self.dropout {
            o = o.dropout(p).seed(seed).rng_offset(offset);
        }
        Ok(o)
    }

    /// The padding masks of a padded batch.
    pub fn paddings(&self) -> Result<Option<(Padding, Padding)>> {
        let Batch::Padded {
            q_mask, kv_mask, ..
        } = &self.batch
        else {
            return Ok(None);
        };
        let mask = |m: &[u8], s: usize| Tensor::from_slice(m, (self.b, s), &Device::Cpu);
        Ok(Some((
            Padding::from_mask(&mask(q_mask, self.sq)?)?,
            Padding::from_mask(&mask(kv_mask, self.sk)?)?,
        )))
    }

    /// The offsets of a packed batch.
    pub fn varlen(&self) -> Result<Option<VarLen>> {
        match &self.batch {
            Batch::Varlen { lens_q, lens_k } => Ok(Some(VarLen::from_seqlens(lens_q, lens_k)?)),
            _ => Ok(None),
        }
    }

    /// What the op must reject, as a part of its error message, or `None` for a valid case.
    pub fn expected_error(&self, target: Target) -> Option<&'static str> {
        if self.hk == 0 {
            Some("num_heads_k")
        } else if self.d == 0 || self.d > candle_flash::MAX_HEAD_DIM {
            Some("head_dim")
        } else if target != Target::Cpu && !self.d.is_multiple_of(8) {
            Some("multiple of 8")
        } else if self.scale.is_some_and(|s| s <= 0.0) {
            Some("softmax_scale")
        } else if self.dropout.is_some_and(|(p, ..)| !(0.0..1.0).contains(&p)) {
            Some("dropout_p")
        } else if self.bad_window.is_some() {
            Some("window_size")
        } else if self.softcap < 0.0 {
            Some("softcap")
        } else {
            None
        }
    }
}

fn real(mask: &[u8], b: usize, s: usize) -> usize {
    mask[b * s..][..s].iter().filter(|&&m| m != 0).count()
}

impl Blocks {
    /// The mask for lengths `(sq, sk)`: the top-left part of the drawn one.
    pub fn mask(&self, (sq, sk): (usize, usize), dev: &Device) -> Result<BlockMask> {
        let (fq, fk) = self.full;
        let (bq, bk, heads) = (self.block_q, self.block_k, self.heads);
        match &self.kind {
            BlockKind::States(states) => {
                let (rows, cols) = (fq.div_ceil(bq), fk.div_ceil(bk));
                let t = Tensor::from_slice(states, (heads, rows, cols), dev)?
                    .narrow(1, 0, sq.div_ceil(bq))?
                    .narrow(2, 0, sk.div_ceil(bk))?;
                BlockMask::new(&t, bq, bk)
            }
            BlockKind::Dense(elements) => {
                let t = Tensor::from_slice(elements, (heads, fq, fk), dev)?
                    .narrow(1, 0, sq)?
                    .narrow(2, 0, sk)?;
                BlockMask::from_dense(&t, bq, bk)
            }
            BlockKind::LocalGlobal { local, global } => {
                BlockMask::local_global(sq, sk, bq, *local, *global, dev)
            }
            BlockKind::Strided { stride } => BlockMask::strided(sq, sk, bq, *stride, dev),
            BlockKind::Butterfly => BlockMask::butterfly(sq, sk, bq, dev),
        }
    }
}

impl fmt::Display for Side {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Side::Open => write!(f, "open"),
            Side::Size(n) if *n == u64::MAX => write!(f, "usize::MAX"),
            Side::Size(n) if *n == i64::MAX as u64 => write!(f, "i64::MAX"),
            Side::Size(n) => write!(f, "{n}"),
        }
    }
}

impl fmt::Display for Config {
    /// One line: everything but the drawn numbers, which the seed regenerates.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (b, sq, sk, h, hk, d) = (self.b, self.sq, self.sk, self.h, self.hk, self.d);
        write!(f, "seed=0x{:016x} {:?} ", self.seed, self.dtype)?;
        match &self.batch {
            Batch::Fixed => write!(f, "fixed b={b} sq={sq} sk={sk}")?,
            Batch::Varlen { lens_q, lens_k } => write!(f, "varlen q={lens_q:?} k={lens_k:?}")?,
            Batch::Padded { pattern, .. } => {
                let lens: Vec<_> = self.seqs().iter().map(|s| (s.1, s.3)).collect();
                write!(f, "padded({pattern}) b={b} sq={sq} sk={sk} real={lens:?}")?
            }
        }
        write!(f, " h={h}/{hk} d={d} causal={}", self.causal)?;
        if let Some((l, r, api)) = self.window {
            write!(f, " window=({l}, {r}) by {api:?}")?;
        }
        if let Some(bad) = self.bad_window {
            write!(f, " window_size=({bad}, -1)")?;
        }
        if self.softcap != 0.0 {
            write!(f, " softcap={}", self.softcap)?;
        }
        if let Some(s) = self.scale {
            write!(f, " scale={s}")?;
        }
        if let Some((per_batch, _)) = &self.alibi {
            write!(f, " alibi={}", if *per_batch { "(b, h)" } else { "(h)" })?;
        }
        if let Some(m) = &self.blocks {
            let kind = match &m.kind {
                BlockKind::States(_) => "states".to_string(),
                BlockKind::Dense(_) => "dense".to_string(),
                k => format!("{k:?}"),
            };
            let (bq, bk, heads) = (m.block_q, m.block_k, m.heads);
            write!(f, " blocks={kind} {bq}x{bk} heads={heads}")?;
        }
        if let Some((p, seed, offset)) = self.dropout {
            write!(f, " dropout=(p {p}, seed {seed:#x}, offset {offset:#x})")?;
        }
        if self.views != [View::Contiguous; 3] {
            write!(f, " views={:?}", self.views)?;
        }
        write!(f, " grad={:?}", self.grad)?;
        if self.deterministic {
            write!(f, " deterministic")?;
        }
        if self.amplitude != 1.0 {
            write!(f, " amplitude={}", self.amplitude)?;
        }
        Ok(())
    }
}
