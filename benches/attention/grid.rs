//! The prefill grid's shapes, their FLOP counts and the JSON records.

#[allow(unused_imports)]
use super::*;

/// One attention shape of the grid.
#[derive(Clone, Copy)]
pub(crate) struct Case {
    pub(crate) hd: usize,
    pub(crate) seqlen: usize,
    pub(crate) heads: usize,
    pub(crate) heads_k: usize,
    pub(crate) causal: bool,
}

impl Case {
    pub(crate) fn batch(&self) -> usize {
        TOKENS / self.seqlen
    }

    /// 4·b·h·s·s·d (two matmuls of 2 FLOPs per multiply-add), halved for causal: the useful
    /// work, also for Candle's attention, which computes the masked half anyway.
    pub(crate) fn fwd_flops(&self) -> f64 {
        let full =
            4.0 * (self.batch() * self.heads * self.hd) as f64 * (self.seqlen as f64).powi(2);
        if self.causal {
            full / 2.0
        } else {
            full
        }
    }

    /// Bytes of one (b, h, s, s) score tensor in `dtype`.
    pub(crate) fn score_bytes(&self, dtype: DType) -> f64 {
        (self.batch() * self.heads * dtype.size_in_bytes()) as f64 * (self.seqlen as f64).powi(2)
    }
}

impl fmt::Display for Case {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "hd={} seqlen={} heads={}/{} causal={}",
            self.hd, self.seqlen, self.heads, self.heads_k, self.causal
        )
    }
}

/// The shapes, in the order scripts/bench/torch_bench.py measures them (its `--quick` grid too).
pub(crate) fn grid(quick: bool) -> Vec<Case> {
    let (hds, seqlens, gqa_seqlens): (&[usize], &[usize], &[usize]) = if quick {
        (&[64, 128], &[1024, 4096], &[2048])
    } else {
        (
            &[64, 128, 256],
            &[512, 1024, 2048, 4096, 8192, 16384],
            &[2048, 8192],
        )
    };
    // `CANDLE_FLASH_BENCH_HDS=96,224` replaces the head dims (hidden 2048 / hd heads, rounded
    // down): the head-dim classes between the grid's.
    let hds_env: Option<Vec<usize>> = std::env::var("CANDLE_FLASH_BENCH_HDS")
        .ok()
        .map(|v| v.split(',').filter_map(|x| x.trim().parse().ok()).collect());
    let hds = hds_env.as_deref().unwrap_or(hds);
    // `CANDLE_FLASH_BENCH_HEADS=33` replaces the MHA cases' head count (the hidden size then
    // differs from 2048): the work tiles' count against the SMs' (wave quantization).
    let heads_env: Option<usize> = std::env::var("CANDLE_FLASH_BENCH_HEADS")
        .ok()
        .and_then(|v| v.trim().parse().ok());
    let mut cases = Vec::new();
    for &hd in hds {
        for &seqlen in seqlens {
            for causal in [false, true] {
                let heads = heads_env.unwrap_or(HIDDEN / hd);
                cases.push(Case {
                    hd,
                    seqlen,
                    heads,
                    heads_k: heads,
                    causal,
                });
            }
        }
    }
    for &seqlen in gqa_seqlens {
        for causal in [false, true] {
            cases.push(Case {
                hd: 128,
                seqlen,
                heads: 32,
                heads_k: 8,
                causal,
            });
        }
    }
    if std::env::var("CANDLE_FLASH_BENCH_CASES").is_ok() {
        cases.retain(|c| c.heads == c.heads_k && case_selected(c.hd, c.seqlen, c.causal));
    }
    cases
}

/// `CANDLE_FLASH_BENCH_CASES=128/8192/n,64/2048/c` keeps only those (hd/seqlen/causal, MHA
/// shapes, the grid's and the FP8 section's): one case under a profiler. Without it, all.
pub(crate) fn case_selected(hd: usize, seqlen: usize, causal: bool) -> bool {
    let Ok(list) = std::env::var("CANDLE_FLASH_BENCH_CASES") else {
        return true;
    };
    let key = format!("{hd}/{seqlen}/{}", if causal { "c" } else { "n" });
    list.split(',').map(str::trim).any(|k| k == key)
}

/// `CANDLE_FLASH_BENCH_MODS`'s items, `HD/NAME` separated by commas. A window's name holds a
/// comma of its own (`128/window (4096, 0) causal`), so a piece that does not start with a
/// head dim and a slash continues the item before it.
pub(crate) fn mods_filter(list: &str) -> Vec<(usize, String)> {
    let mut items: Vec<(usize, String)> = Vec::new();
    for piece in list.split(',') {
        let item = piece
            .split_once('/')
            .and_then(|(hd, name)| Some((hd.trim().parse().ok()?, name.trim().to_string())));
        match (item, items.last_mut()) {
            (Some(item), _) => items.push(item),
            (None, Some((_, name))) => {
                name.push(',');
                name.push_str(piece.trim_end());
            }
            (None, None) => {}
        }
    }
    items
}

/// The share of a `seqlen` x `seqlen` score matrix that a (causal, window) mask leaves
/// visible (FA2's window: -1 unbounded; causal sets right = 0).
pub(crate) fn visible_share(seqlen: usize, causal: bool, left: i64, right: i64) -> f64 {
    let n = seqlen as i64;
    let right = if causal { 0 } else { right };
    let visible: i64 = (0..n)
        .map(|i| {
            let lo = if left >= 0 { (i - left).max(0) } else { 0 };
            let hi = if right >= 0 {
                (i + right).min(n - 1)
            } else {
                n - 1
            };
            (hi - lo + 1).max(0)
        })
        .sum();
    visible as f64 / (n * n) as f64
}

pub(crate) fn flop_factor(pass: &str) -> f64 {
    match pass {
        "bwd" | "bwd-autograd" => 2.5,
        "fwd+bwd" => 3.5,
        _ => 1.0,
    }
}

/// One JSON record, the schema scripts/bench/compare.py reads.
pub(crate) struct Record {
    pub(crate) imp: &'static str,
    pub(crate) pass: &'static str,
    pub(crate) case: Case,
    pub(crate) ms: f64,
    pub(crate) tflops: f64,
    /// `--dropout P`, recorded where nonzero (the records of a dropout run say so).
    pub(crate) dropout: f32,
    /// `--deterministic`, recorded where set.
    pub(crate) deterministic: bool,
}

impl Record {
    pub(crate) fn json(&self) -> String {
        let c = &self.case;
        format!(
            "  {{\"impl\": \"{}\", \"pass\": \"{}\", \"hd\": {}, \"seqlen\": {}, \"batch\": {}, \
             \"heads\": {}, \"heads_k\": {}, \"causal\": {}, \"ms\": {:.6}, \"tflops\": {:.3}{}{}}}",
            self.imp,
            self.pass,
            c.hd,
            c.seqlen,
            c.batch(),
            c.heads,
            c.heads_k,
            c.causal,
            self.ms,
            self.tflops,
            if self.dropout > 0.0 {
                format!(", \"dropout\": {}", self.dropout)
            } else {
                String::new()
            },
            if self.deterministic {
                ", \"deterministic\": true"
            } else {
                ""
            }
        )
    }
}
