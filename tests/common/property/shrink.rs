//! Minimizing a failure: one-step simplifications of a case (each drops one option or shrinks
//! one size), taken greedily while the case still fails. With `CANDLE_FLASH_PROPTEST_SHRINK=1`
//! next to `CANDLE_FLASH_PROPTEST_REPLAY`, the test files print each step and the minimal
//! case (deterministic: the same two variables replay it).

use candle::DType;

use super::{Batch, BlockKind, Config, Grad, Target, View};

/// An option to drop: its name, whether the case has it, how to drop it.
type Removal = (&'static str, bool, fn(&mut Config));

/// The variants of `cfg`, each named by what it changes.
pub fn shrinks(cfg: &Config, target: Target) -> Vec<(String, Config)> {
    let mut out = vec![];
    let mut push = |name: String, c: Config| out.push((name, c));
    let base = || cfg.clone();
    if cfg.views != [View::Contiguous; 3] {
        push(
            "contiguous views".into(),
            Config {
                views: [View::Contiguous; 3],
                ..base()
            },
        );
    }
    let drops: [Removal; 10] = [
        ("no alibi", cfg.alibi.is_some(), |c| c.alibi = None),
        ("no softcap", cfg.softcap != 0.0, |c| c.softcap = 0.0),
        ("no window", cfg.window.is_some(), |c| c.window = None),
        ("not causal", cfg.causal, |c| c.causal = false),
        ("no block mask", cfg.blocks.is_some(), |c| c.blocks = None),
        ("no dropout", cfg.dropout.is_some(), |c| c.dropout = None),
        ("default scale", cfg.scale.is_some(), |c| c.scale = None),
        ("amplitude 1", cfg.amplitude != 1.0, |c| c.amplitude = 1.0),
        ("not deterministic", cfg.deterministic, |c| {
            c.deterministic = false
        }),
        ("autograd", cfg.grad != Grad::Autograd, |c| {
            c.grad = Grad::Autograd
        }),
    ];
    for (name, applies, change) in drops {
        if applies {
            let mut c = base();
            change(&mut c);
            push(name.into(), c);
        }
    }
    let dtypes: &[DType] = match target {
        Target::Cpu => &[DType::F32, DType::F16, DType::BF16],
        _ => &[DType::F16, DType::BF16],
    };
    for &dtype in dtypes.iter().filter(|&&d| d != cfg.dtype) {
        push(format!("{dtype:?}"), Config { dtype, ..base() });
    }
    if cfg.h > cfg.hk {
        push("h = hk".into(), with_heads(cfg, 1, cfg.hk));
    }
    if cfg.hk > 1 {
        push("hk = 1".into(), with_heads(cfg, cfg.h / cfg.hk, 1));
    }
    let step = if target == Target::Cpu { 1 } else { 8 };
    if cfg.d > step {
        push(
            "half head_dim".into(),
            Config {
                d: (cfg.d / 2).div_ceil(step) * step,
                ..base()
            },
        );
    }
    let seqs = cfg.seqs();
    if let Batch::Padded { .. } = cfg.batch {
        push(
            "packed".into(),
            with_seqs(cfg, &(0..cfg.b).collect::<Vec<_>>(), false),
        );
    }
    for (b, &(_, lq, _, lk)) in seqs.iter().enumerate() {
        if cfg.b > 1 && lq > 0 && lk > 0 {
            push(format!("sequence {b} alone"), with_seqs(cfg, &[b], false));
        }
    }
    if cfg.b == 1 && !matches!(cfg.batch, Batch::Fixed) && seqs[0].1 * seqs[0].3 > 0 {
        push("fixed length".into(), with_seqs(cfg, &[0], true));
    }
    if let Batch::Fixed = cfg.batch {
        if cfg.sq > 1 {
            push(
                "half seqlen_q".into(),
                Config {
                    sq: cfg.sq / 2,
                    ..base()
                },
            );
        }
        if cfg.sk > 1 {
            push(
                "half seqlen_k".into(),
                Config {
                    sk: cfg.sk / 2,
                    ..base()
                },
            );
        }
    }
    out
}

/// Greedy minimization: takes the first variant of [`shrinks`] that still `fails`, again and
/// again, and returns the last failing case (`cfg` itself if no variant fails). `fails` says
/// whether a case fails (and may print why).
pub fn minimize(
    cfg: &Config,
    target: Target,
    mut fails: impl FnMut(&str, &Config) -> bool,
) -> Config {
    let mut current = cfg.clone();
    // Cases already tried (the dtype variants lead back and forth).
    let mut seen = std::collections::HashSet::from([cfg.to_string()]);
    'outer: loop {
        for (name, variant) in shrinks(&current, target) {
            if seen.insert(variant.to_string()) && fails(&name, &variant) {
                current = variant;
                continue 'outer;
            }
        }
        return current;
    }
}

/// `cfg` with `group · hk` query heads over `hk` K/V heads: the first heads' slopes and block
/// masks.
fn with_heads(cfg: &Config, group: usize, hk: usize) -> Config {
    let h = group * hk;
    let mut c = Config {
        h,
        hk,
        ..cfg.clone()
    };
    if let Some((per_batch, slopes)) = &mut c.alibi {
        let rows = if *per_batch { cfg.b } else { 1 };
        *slopes = (0..rows)
            .flat_map(|r| slopes[r * cfg.h..][..h].to_vec())
            .collect();
    }
    if let Some(blocks) = &mut c.blocks {
        if blocks.heads > 1 {
            let per_head = match &blocks.kind {
                BlockKind::States(s) | BlockKind::Dense(s) => s.len() / blocks.heads,
                _ => 0,
            };
            if let BlockKind::States(s) | BlockKind::Dense(s) = &mut blocks.kind {
                s.truncate(h * per_head);
            }
            blocks.heads = h;
        }
    }
    c
}

/// `cfg` with the sequences `keep` only (their slopes' rows), as a packed batch (a padded one
/// gives its real tokens), or `fixed` a fixed-length batch of the one sequence.
fn with_seqs(cfg: &Config, keep: &[usize], fixed: bool) -> Config {
    let seqs = cfg.seqs();
    let (lens_q, lens_k): (Vec<usize>, Vec<usize>) =
        keep.iter().map(|&b| (seqs[b].1, seqs[b].3)).unzip();
    let mut c = Config {
        b: keep.len(),
        ..cfg.clone()
    };
    if let Some((true, slopes)) = &mut c.alibi {
        *slopes = keep
            .iter()
            .flat_map(|&b| slopes[b * cfg.h..][..cfg.h].to_vec())
            .collect();
    }
    if fixed || matches!(cfg.batch, Batch::Fixed) {
        (c.batch, c.sq, c.sk) = (Batch::Fixed, lens_q[0], lens_k[0]);
    } else {
        (c.sq, c.sk) = (lens_q.iter().sum(), lens_k.iter().sum());
        c.batch = Batch::Varlen { lens_q, lens_k };
        if c.grad == Grad::Direct {
            c.grad = Grad::Autograd; // the direct backward is for fixed-length batches
        }
    }
    c
}
