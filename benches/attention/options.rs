//! The sections of score modifiers, FP8, packed batches and block masks (`--mods-only`,
//! `--fp8-only`, `--varlen-only`, `--sparse-only`).

#[allow(unused_imports)]
use super::*;

impl Bench {
    /// `--mods-only`: sliding windows, softcapping and ALiBi against plain attention of the
    /// same shape, in the same run (torch's SDPA has neither a window nor a cap to compare
    /// with). `ideal` is the window's share of the plain (non-causal) score matrix: the
    /// time a windowed pass would take if its cost followed the visible pairs exactly.
    /// `vs plain` divides by plain attention timed again right before the variant
    /// (`baseline_passes`), `vs first` by the section's first plain lines (the d 128 causal
    /// softcap read 1.16-1.26x against those, 1.06-1.09x beside plain attention; H100,
    /// docs/archive/PERF.md, "The bench's "vs plain" and the card's power limit").
    pub(crate) fn mods_section(&mut self) {
        println!(
            "{:<34} {:>4} {:>6} {:>5} {:<4} {:>9} {:>8} {:>9} {:>9} {:>6}",
            "variant",
            "hd",
            "seqlen",
            "batch",
            "pass",
            "ms",
            "TFLOP/s",
            "vs plain",
            "vs first",
            "ideal"
        );
        let dev = self.dev.clone();
        let deterministic = self.deterministic;
        let plain = |causal| FlashAttn::new().causal(causal).deterministic(deterministic);
        // `CANDLE_FLASH_BENCH_MODS=128/softcap 50 causal,64/plain` (profiling): only those
        // head dims and variants, so that a profiler's launch count finds one variant's kernel.
        let only: Option<Vec<(usize, String)>> = std::env::var("CANDLE_FLASH_BENCH_MODS")
            .ok()
            .map(|v| mods_filter(&v));
        let keep = |hd: usize, name: &str| {
            only.as_ref()
                .is_none_or(|list| list.iter().any(|(h, n)| *h == hd && n == name))
        };
        for (hd, seqlen, heads) in [(128, 16384, 16), (64, 4096, 32), (256, 4096, 8)] {
            if only
                .as_ref()
                .is_some_and(|l| l.iter().all(|(h, _)| *h != hd))
            {
                continue;
            }
            let case = Case {
                hd,
                seqlen,
                heads,
                heads_k: heads,
                causal: false,
            };
            let Some(sets) = self.option_inputs(&case) else {
                continue;
            };
            let slopes: Vec<f32> = (0..heads)
                .map(|i| 2f32.powf(-8.0 * (i + 1) as f32 / heads as f32))
                .collect();
            let slopes = match Tensor::new(slopes.as_slice(), &dev) {
                Ok(s) => s,
                Err(e) => {
                    println!("skipped: slopes: {}", first_line(&e));
                    continue;
                }
            };
            let quarter = seqlen as i64 / 4;
            let variants: Vec<(String, FlashAttn, bool)> = vec![
                ("plain".into(), plain(false), false),
                ("plain causal".into(), plain(true), true),
                (
                    format!("window ({quarter}, 0) causal"),
                    plain(true).window_size(quarter, 0),
                    true,
                ),
                (
                    format!("window ({}, {})", quarter / 2, quarter / 2),
                    plain(false).window_size(quarter / 2, quarter / 2),
                    false,
                ),
                ("softcap 50".into(), plain(false).softcap(50.0), false),
                ("softcap 50 causal".into(), plain(true).softcap(50.0), true),
                (
                    "alibi causal".into(),
                    plain(true).alibi_slopes(&slopes),
                    true,
                ),
            ];
            let mut base = [[None; 2]; 2]; // [causal][pass]
            for (name, opts, causal) in &variants {
                if !keep(hd, name) {
                    continue;
                }
                let (left, right) = opts.window_size;
                let visible = visible_share(seqlen, *causal, left, right);
                // Windows against plain non-causal attention (their ideal share), the rest
                // against plain attention with their own mask.
                let windowed = left >= 0 || (right >= 0 && !*causal);
                let against_causal = *causal && !windowed;
                let adjacent = if name.starts_with("plain") {
                    Vec::new()
                } else {
                    baseline_passes(&dev, &sets, &plain(against_causal), self.fwd_only)
                };
                let passes = time_option_passes(&dev, &sets, opts, self.fwd_only);
                for (p, (pass, ms)) in passes.into_iter().enumerate() {
                    let ms = match ms {
                        Ok(ms) => ms,
                        Err(e) => {
                            println!("{name:<34} {hd:>4} {seqlen:>6} {pass}: failed: {e}");
                            continue;
                        }
                    };
                    let flops = 4.0
                        * (case.batch() * heads * hd) as f64
                        * (seqlen * seqlen) as f64
                        * visible
                        * flop_factor(pass);
                    if name.starts_with("plain") {
                        base[usize::from(*causal)][p] = Some(ms);
                    }
                    let first = base[usize::from(against_causal)][p];
                    let against = adjacent.get(p).copied().flatten().or(first);
                    let ratio = against.map_or("-".into(), |b| format!("{:.3}", ms / b));
                    let vs_first = first.map_or("-".into(), |b| format!("{:.3}", ms / b));
                    let ideal = if windowed {
                        format!("{visible:.3}")
                    } else {
                        "-".into()
                    };
                    println!(
                        "{name:<34} {hd:>4} {seqlen:>6} {:>5} {pass:<4} {ms:>9.3} {:>8.1} {ratio:>9} {vs_first:>9} {ideal:>6}",
                        case.batch(),
                        flops / ms / 1e9,
                    );
                }
            }
        }
    }

    /// `--sparse-only`: block-sparse attention (128 x 128 blocks) against dense attention of
    /// the same shape timed right before each mask (`baseline_passes`); `ideal` is the share of
    /// blocks kept, the time a block-sparse pass would take if its cost followed the blocks
    /// exactly.
    /// Packed (variable-length) batches against fixed-length ones of the same tokens: 16k
    /// tokens in sequences of random lengths (a fixed LCG, uniform in [mean / 2, 3 mean / 2),
    /// the last one cut to fill 16k), seqlen_q = seqlen_k. `fwd` is the forward alone, `bwd`
    /// `loss.backward()` on a kept graph (so Candle's per-gradient bookkeeping too, the same
    /// bytes for both layouts). TFLOP/s counts each sequence's 4·h·s²·d (halved for causal,
    /// x2.5 for bwd), as the grid does; "vs fixed" is the ratio of TFLOP/s to the fixed-length
    /// batch's. `CANDLE_FLASH_WS_PACKED=0` in a second run times the kernels packed batches
    /// had before the warp-specialized ones.
    /// The FP8 (e4m3) forward against our bf16 forward on the same shapes (16k tokens per
    /// batch, hidden 2048): ms, TFLOP/s and the ratio. Inputs quantized per tensor (or per
    /// block: `CANDLE_FLASH_BENCH_FP8_BLOCKS=1`).
    pub(crate) fn fp8_section(&mut self) {
        println!(
            "{:<10} {:>4} {:>6} {:>5} {:>6} {:>6} {:>9} {:>9} {:>9} {:>9} {:>7} {:>9} {:>9}",
            "pass",
            "hd",
            "seqlen",
            "batch",
            "heads",
            "causal",
            "bf16 ms",
            "bf16 TF",
            "fp8 ms",
            "fp8 TF",
            "fp8/bf16",
            "fp8 vt ms",
            "fp8 vt TF"
        );
        use candle_flash::quant::{
            fp8_scales, fp8_v_transposed, quantize_fp8, Fp8Scaling, FP8_BLOCK_ROWS,
        };
        let dev = self.dev.clone();
        let scaling = if std::env::var("CANDLE_FLASH_BENCH_FP8_BLOCKS").is_ok_and(|v| v == "1") {
            println!("FP8 descales per block of {FP8_BLOCK_ROWS} rows");
            Fp8Scaling::PerBlock {
                rows: FP8_BLOCK_ROWS,
            }
        } else {
            Fp8Scaling::PerTensor
        };
        let fp8_hds: Vec<usize> = std::env::var("CANDLE_FLASH_BENCH_HDS")
            .ok()
            .map(|v| v.split(',').filter_map(|x| x.trim().parse().ok()).collect())
            .unwrap_or_else(|| vec![128, 256]);
        for &hd in &fp8_hds {
            for seqlen in [512usize, 1024, 2048, 4096, 8192, 16384] {
                for causal in [false, true] {
                    if !grid::case_selected(hd, seqlen, causal) {
                        continue;
                    }
                    let heads = HIDDEN / hd;
                    let batch = TOKENS / seqlen;
                    let run = || -> Result<(f64, f64, f64)> {
                        let x = || Tensor::randn(0f32, 1.0, (batch, seqlen, heads, hd), &dev);
                        let (q, k, v) = (x()?, x()?, x()?);
                        let quant = |t: &Tensor| -> Result<(Tensor, Tensor)> {
                            let s = fp8_scales(t, scaling)?;
                            Ok((quantize_fp8(t, &s, scaling)?, s))
                        };
                        let ((q8, qs), (k8, ks), (v8, vs)) = (quant(&q)?, quant(&k)?, quant(&v)?);
                        let bf = |t: &Tensor| t.to_dtype(DType::BF16);
                        let (qb, kb, vb) = (bf(&q)?, bf(&k)?, bf(&v)?);
                        let opts = FlashAttn::new().causal(causal);
                        let bf16_ms = time_ms(&dev, |_| opts.forward(&qb, &kb, &vb).map(|_| ()))?;
                        let fp8 = opts.clone().fp8_descales(&qs, &ks, &vs);
                        let fp8_ms = time_ms(&dev, |_| fp8.forward(&q8, &k8, &v8).map(|_| ()))?;
                        // V transposed ahead: the kernels that copy V^T without transposing.
                        let v8t = fp8_v_transposed(&v8)?;
                        let fp8t = fp8.clone().fp8_v_transposed();
                        let vt_ms = time_ms(&dev, |_| fp8t.forward(&q8, &k8, &v8t).map(|_| ()))?;
                        Ok((bf16_ms, fp8_ms, vt_ms))
                    };
                    let flop = 4.0
                        * (batch * heads * hd) as f64
                        * (seqlen * seqlen) as f64
                        * visible_share(seqlen, causal, -1, -1);
                    match run() {
                        Ok((b_ms, f_ms, t_ms)) => {
                            let tf = |ms: f64| flop / (ms * 1e-3) / 1e12;
                            println!(
                                "{:<10} {:>4} {:>6} {:>5} {:>6} {:>6} {:>9.4} {:>9.1} {:>9.4} {:>9.1} {:>6.2}x {:>9.4} {:>9.1}",
                                "fwd-fp8", hd, seqlen, batch, heads, causal, b_ms, tf(b_ms), f_ms,
                                tf(f_ms), b_ms / f_ms, t_ms, tf(t_ms)
                            );
                        }
                        Err(e) => println!(
                            "{:<10} {:>4} {:>6} {:>5} {:>6} {:>6} error: {}",
                            "fwd-fp8",
                            hd,
                            seqlen,
                            batch,
                            heads,
                            causal,
                            first_line(&e)
                        ),
                    }
                }
            }
        }
    }

    pub(crate) fn varlen_section(&mut self) {
        /// (layout, pass, causal, ms, TFLOP)
        type VarlenRow = (&'static str, &'static str, bool, f64, f64);
        println!(
            "{:<8} {:<4} {:>4} {:>6} {:>5} {:>6} {:>6} {:>9} {:>8} {:>9}",
            "layout", "pass", "hd", "mean", "seqs", "heads", "causal", "ms", "TFLOP/s", "vs fixed"
        );
        let dev = self.dev.clone();
        let dtype = self.dtype;
        for (hd, heads) in [(64, 32), (128, 16), (256, 8)] {
            for mean in [512usize, 2048] {
                let mut x = 0x2545_F491_4F6C_DD1Du64 ^ (hd * mean) as u64;
                let mut lens = vec![];
                let mut left = TOKENS;
                while left > 0 {
                    x = x
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    let len = (mean / 2 + (x >> 33) as usize % mean).min(left);
                    lens.push(len);
                    left -= len;
                }
                let fixed_lens = vec![mean; TOKENS / mean];
                let run = || -> Result<Vec<VarlenRow>> {
                    let varlen = candle_flash::VarLen::from_seqlens(&lens, &lens)?;
                    let qkv = || -> Result<Var> {
                        Var::from_tensor(
                            &Tensor::randn(0f32, 1.0, (TOKENS, heads, hd), &dev)?
                                .to_dtype(dtype)?,
                        )
                    };
                    let (q, k, v) = (qkv()?, qkv()?, qkv()?);
                    let dout =
                        Tensor::randn(0f32, 1.0, (TOKENS, heads, hd), &dev)?.to_dtype(dtype)?;
                    // The fixed batch's inputs are variables of their own shape, so that its
                    // graph holds no reshape (whose gradients Candle would also accumulate).
                    let fixed = |t: &Tensor| -> Result<Var> {
                        Var::from_tensor(&t.reshape((TOKENS / mean, mean, heads, hd))?)
                    };
                    let (qf, kf, vf) = (fixed(&q)?, fixed(&k)?, fixed(&v)?);
                    let dout_f = dout.reshape((TOKENS / mean, mean, heads, hd))?;
                    let mut rows = vec![];
                    for causal in [false, true] {
                        let attn = FlashAttn::new().causal(causal);
                        let half = if causal { 0.5 } else { 1.0 };
                        for (layout, lens) in [("packed", &lens), ("fixed", &fixed_lens)] {
                            let packed = layout == "packed";
                            let (q, k, v, dout) = if packed {
                                (&q, &k, &v, &dout)
                            } else {
                                (&qf, &kf, &vf, &dout_f)
                            };
                            let fwd = |q: &Tensor, k: &Tensor, v: &Tensor| {
                                if packed {
                                    attn.forward_varlen(q, k, v, &varlen)
                                } else {
                                    attn.forward(q, k, v)
                                }
                            };
                            let tflop = lens
                                .iter()
                                .map(|&l| 4.0 * (heads * hd) as f64 * (l * l) as f64 * half)
                                .sum::<f64>()
                                / 1e12;
                            let (qd, kd, vd) = (
                                q.as_detached_tensor(),
                                k.as_detached_tensor(),
                                v.as_detached_tensor(),
                            );
                            let ms = time_ms(&dev, |_| fwd(&qd, &kd, &vd).map(drop))?;
                            rows.push((layout, "fwd", causal, ms, tflop));
                            let loss = grad_loss(&fwd(q, k, v)?, dout)?;
                            let ms = time_ms(&dev, |_| loss.backward().map(drop))?;
                            rows.push((layout, "bwd", causal, ms, 2.5 * tflop));
                        }
                    }
                    Ok(rows)
                };
                match run() {
                    Ok(rows) => {
                        for (layout, pass, causal, ms, tflop) in &rows {
                            let tflops = tflop / ms * 1e3;
                            let (_, _, _, fixed_ms, fixed_tflop) = rows
                                .iter()
                                .find(|r| r.0 == "fixed" && r.1 == *pass && r.2 == *causal)
                                .expect("a fixed row per pass and mask");
                            let seqs = if *layout == "packed" {
                                lens.len()
                            } else {
                                fixed_lens.len()
                            };
                            println!(
                                "{layout:<8} {pass:<4} {hd:>4} {mean:>6} {seqs:>5} {heads:>6} {causal:>6} {ms:>9.3} {tflops:>8.1} {:>9.3}",
                                tflops / (fixed_tflop / fixed_ms * 1e3),
                            );
                        }
                    }
                    Err(e) => println!("varlen hd {hd} mean {mean}: failed: {}", first_line(&e)),
                }
            }
        }
    }

    pub(crate) fn sparse_section(&mut self) {
        println!(
            "{:<24} {:>4} {:>6} {:>5} {:<4} {:>9} {:>8} {:>9} {:>6}",
            "mask", "hd", "seqlen", "batch", "pass", "ms", "TFLOP/s", "vs dense", "ideal"
        );
        let dev = self.dev.clone();
        // `CANDLE_FLASH_BENCH_SPARSE=HD/DENSITY` (profiling): that head dim and one random mask.
        let only: Option<(usize, f64)> =
            std::env::var("CANDLE_FLASH_BENCH_SPARSE")
                .ok()
                .and_then(|v| {
                    let (hd, density) = v.split_once('/')?;
                    Some((hd.parse().ok()?, density.parse().ok()?))
                });
        for (hd, seqlen, heads) in [(128, 16384, 16), (64, 16384, 32), (256, 16384, 8)] {
            if only.is_some_and(|(h, _)| h != hd) {
                continue;
            }
            let case = Case {
                hd,
                seqlen,
                heads,
                heads_k: heads,
                causal: false,
            };
            let Some(sets) = self.option_inputs(&case) else {
                continue;
            };
            let blocks = seqlen / 128;
            // Random blocks per head, from a fixed LCG: the same mask every run.
            let random = |density: f64| -> Result<BlockMask> {
                let mut x = 0x9E37_79B9_7F4A_7C15u64;
                let v: Vec<u8> = (0..heads * blocks * blocks)
                    .map(|_| {
                        x = x
                            .wrapping_mul(6364136223846793005)
                            .wrapping_add(1442695040888963407);
                        u8::from(((x >> 11) as f64 / (1u64 << 53) as f64) < density)
                    })
                    .collect();
                BlockMask::new(
                    &Tensor::from_vec(v, (heads, blocks, blocks), &dev)?,
                    128,
                    128,
                )
            };
            let masks: Vec<(String, Result<BlockMask>)> = if let Some((_, density)) = only {
                vec![(format!("random {:.0}%", density * 100.0), random(density))]
            } else {
                vec![
                    ("random 10%".into(), random(0.1)),
                    ("random 50%".into(), random(0.5)),
                    ("random 100%".into(), random(1.0)),
                    (
                        "butterfly".into(),
                        BlockMask::butterfly(seqlen, seqlen, 128, &dev),
                    ),
                    (
                        "local 3 + global 1".into(),
                        BlockMask::local_global(seqlen, seqlen, 128, 3, 1, &dev),
                    ),
                ]
            };
            let det = FlashAttn::new().deterministic(self.deterministic);
            let mut variants = vec![("dense".to_string(), det.clone(), 1.0)];
            for (name, mask) in masks {
                match mask.and_then(|m| Ok((m.density()?, m))) {
                    Ok((density, m)) => variants.push((name, det.clone().block_mask(&m), density)),
                    Err(e) => println!("skipped {name}: {}", first_line(&e)),
                }
            }
            let mut base = [None; 2];
            for (name, opts, density) in &variants {
                let adjacent = if name == "dense" {
                    Vec::new()
                } else {
                    baseline_passes(&dev, &sets, &det, self.fwd_only)
                };
                let passes = time_option_passes(&dev, &sets, opts, self.fwd_only);
                for (p, (pass, ms)) in passes.into_iter().enumerate() {
                    let ms = match ms {
                        Ok(ms) => ms,
                        Err(e) => {
                            println!("{name:<24} {hd:>4} {seqlen:>6} {pass}: failed: {e}");
                            continue;
                        }
                    };
                    let flops = 4.0
                        * (case.batch() * heads * hd) as f64
                        * (seqlen * seqlen) as f64
                        * density
                        * flop_factor(pass);
                    if name == "dense" {
                        base[p] = Some(ms);
                    }
                    let against = adjacent.get(p).copied().flatten().or(base[p]);
                    let ratio = against.map_or("-".into(), |b| format!("{:.3}", ms / b));
                    println!(
                        "{name:<24} {hd:>4} {seqlen:>6} {:>5} {pass:<4} {ms:>9.3} {:>8.1} {ratio:>9} {density:>6.3}",
                        case.batch(),
                        flops / ms / 1e9,
                    );
                }
            }
        }
    }
}
