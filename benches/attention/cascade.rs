//! Cascade attention: a shared prompt attended once, against the unshared decode step.

#[allow(unused_imports)]
use super::*;

/// Cascade attention: a decode step over a prompt shared by every sequence, unshared and as
/// a cascade.
impl Bench {
    /// The unshared step, the cascade and its parts timed on the same inputs, and the
    /// cascade checked against the unshared step; the JSON rewritten at the end.
    pub(crate) fn cascade_section(&mut self, json: Option<&PathBuf>) {
        let lens = cascade_suffix_lens();
        let (lo, hi) = (
            lens.iter().min().unwrap_or(&0),
            lens.iter().max().unwrap_or(&0),
        );
        let sets = cascade_sets(self.dtype);
        println!(
            "# cascade: {CASCADE_BATCH} sequences share a {CASCADE_PREFIX}-token prefix, each \
             with its own suffix of {lo}..{hi} tokens (all different), GQA \
             {DECODE_HEADS}/{DECODE_HEADS_K} heads, hd {DECODE_HD}, {:?}, one query token each; \
             {sets} input sets",
            self.dtype
        );
        let sets = (0..sets).map(|_| CascadeInputs::new(self.dtype, &self.dev));
        let sets = match sets.collect::<Result<Vec<_>>>() {
            Ok(sets) => sets,
            Err(e) => return println!("{FLASH:<12} skipped cascade: inputs: {}", first_line(&e)),
        };
        let full_lens: Vec<u32> = lens.iter().map(|&l| l + CASCADE_PREFIX as u32).collect();
        let opts = FlashAttn::new();
        let unshared = |s: &CascadeInputs| {
            flash_attn_with_kvcache(&s.q, &s.full_k, &s.full_v, None, &full_lens, &opts)
        };
        let suffix = |s: &CascadeInputs| {
            flash_attn_with_kvcache_lse(&s.q, &s.suffix_k, &s.suffix_v, None, &lens, &opts)
        };
        let cascade = |s: &CascadeInputs, split: bool| -> Result<Tensor> {
            let mut parts = if split {
                s.prefix_split(&opts)?
            } else {
                vec![s.prefix(&opts)?]
            };
            parts.push(suffix(s)?);
            Ok(combine(&parts)?.0)
        };
        // The parts of each set for timing the merge alone.
        let parts = sets
            .iter()
            .map(|s| Ok([s.prefix(&opts)?, suffix(s)?]))
            .collect::<Result<Vec<_>>>();
        let n = sets.len();
        let dev = self.dev.clone();
        let time = |f: &dyn Fn(usize) -> Result<()>| {
            try_run(|| time_ms_with(&dev, DECODE_TIMING, f)).and_then(|t| {
                if t.ms.is_finite() && t.ms > 0.0 {
                    Ok(t)
                } else {
                    Err(format!("bad timing {}", t.ms))
                }
            })
        };
        let rows: Vec<(&'static str, std::result::Result<Timed, String>)> = vec![
            ("unshared", time(&|i| unshared(&sets[i % n]).map(drop))),
            ("cascade", time(&|i| cascade(&sets[i % n], false).map(drop))),
            ("prefix", time(&|i| sets[i % n].prefix(&opts).map(drop))),
            ("suffix", time(&|i| suffix(&sets[i % n]).map(drop))),
            (
                "combine",
                match &parts {
                    Ok(parts) => time(&|i| combine(&parts[i % n]).map(drop)),
                    Err(e) => Err(first_line(e)),
                },
            ),
            (
                "cascade-split",
                time(&|i| cascade(&sets[i % n], true).map(drop)),
            ),
            (
                "prefix-split",
                time(&|i| sets[i % n].prefix_split(&opts).map(drop)),
            ),
        ];
        let base = rows[0].1.as_ref().ok().map(|t| t.ms);
        let dtype = self.dtype;
        let kv = |tokens: usize| {
            (2 * tokens * DECODE_HEADS_K * DECODE_HD * dtype.size_in_bytes()) as f64
        };
        let suffix_tokens: usize = lens.iter().map(|&l| l as usize).sum();
        let prefix_bytes = kv(CASCADE_PREFIX);
        let suffix_bytes = kv(suffix_tokens);
        let bytes = |pass: &str| match pass {
            "unshared" => kv(CASCADE_BATCH * CASCADE_PREFIX + suffix_tokens),
            "cascade" | "cascade-split" => prefix_bytes + suffix_bytes,
            "prefix" | "prefix-split" => prefix_bytes,
            "suffix" => suffix_bytes,
            _ => 0.0,
        };
        println!(
            "{:<12} {:<15} {:>9} {:>8} {:>9} {:>9}",
            "impl", "pass", "ms", "speedup", "K+V MB", "host ms"
        );
        for (pass, timed) in &rows {
            // The parts indented under their cascade.
            let label = match *pass {
                "prefix" | "suffix" | "combine" | "prefix-split" => format!("  {pass}"),
                _ => pass.to_string(),
            };
            let t = match timed {
                Ok(t) => t,
                Err(e) => {
                    println!("{FLASH:<12} {label:<15} n/a  {e}");
                    continue;
                }
            };
            let speedup = match (*pass, base) {
                ("unshared" | "cascade" | "cascade-split", Some(b)) => {
                    format!("{:.2}x", b / t.ms)
                }
                _ => String::new(),
            };
            let mb = bytes(pass) / 1e6;
            println!(
                "{FLASH:<12} {label:<15} {:>9.4} {speedup:>8} {mb:>9.1} {:>9.4}",
                t.ms, t.host_ms
            );
            // JSON passes: "cascade-unshared", "cascade", "cascade-prefix", ...
            let record_pass = match pass.starts_with("cascade") {
                true => pass.to_string(),
                false => format!("cascade-{pass}"),
            };
            self.records.push(format!(
                "  {{\"impl\": \"{FLASH}\", \"pass\": \"{record_pass}\", \"hd\": {DECODE_HD}, \
                 \"batch\": {CASCADE_BATCH}, \"prefix\": {CASCADE_PREFIX}, \"suffix_min\": {lo}, \
                 \"suffix_max\": {hi}, \"heads\": {DECODE_HEADS}, \"heads_k\": {DECODE_HEADS_K}, \
                 \"ms\": {:.6}, \"host_ms\": {:.6}, \"kv_bytes\": {:.0}}}",
                t.ms,
                t.host_ms,
                bytes(pass)
            ));
        }
        for packed in [false, true] {
            let name = if packed { "cascade-split" } else { "cascade" };
            let check =
                try_run(|| cascade_check(&cascade(&sets[0], packed)?, &unshared(&sets[0])?));
            match check {
                Ok((diff, max)) => {
                    let ulp = dtype_ulp(self.dtype, max);
                    let ulps = diff / ulp;
                    let verdict = if ulps <= CASCADE_CHECK_ULPS {
                        "ok"
                    } else {
                        "MISMATCH"
                    };
                    println!(
                        "check {name}: max |{name} - unshared| {diff:.3e} = {ulps:.2} {:?} ulp \
                         at max |unshared| {max:.3e} (bound {CASCADE_CHECK_ULPS}): {verdict}",
                        self.dtype
                    );
                    self.records.push(format!(
                        "  {{\"impl\": \"{FLASH}\", \"pass\": \"cascade-check\", \"variant\": \
                         \"{name}\", \"max_abs_diff\": {diff:.3e}, \"ulps\": {ulps:.3}, \
                         \"check\": \"{}\"}}",
                        verdict.to_lowercase()
                    ));
                }
                Err(e) => println!("check {name}: n/a ({e})"),
            }
        }
        println!(
            "# speedup: unshared ms / ms. K+V MB: the keys and values each pass reads (the \
             prefix once for all sequences in the cascade). host ms: time to queue a call."
        );
        if let Some(path) = json {
            self.write_json(path);
        }
    }
}

/// Sequence `i`'s suffix: `CASCADE_SUFFIX_MIN + (i · 97 mod CASCADE_SUFFIX_SPAN)` tokens,
/// different for every sequence and spread over 64..256.
pub(crate) fn cascade_suffix_lens() -> Vec<u32> {
    (0..CASCADE_BATCH)
        .map(|i| (CASCADE_SUFFIX_MIN + (i * 97) % CASCADE_SUFFIX_SPAN) as u32)
        .collect()
}

/// Input sets to rotate over: as for decode, at least DECODE_MIN_CACHES and enough that the
/// cascade's reads total DECODE_ROTATE_BYTES (its prompt, 32 MiB in bf16, would otherwise
/// stay in L2), while the unshared caches stay within DECODE_MAX_BYTES.
pub(crate) fn cascade_sets(dtype: DType) -> usize {
    let row = DECODE_HEADS_K * DECODE_HD * dtype.size_in_bytes() * 2;
    let suffix_cap = CASCADE_SUFFIX_MIN + CASCADE_SUFFIX_SPAN - 1;
    let cascade = row * (CASCADE_PREFIX + CASCADE_BATCH * suffix_cap);
    let full = row * CASCADE_BATCH * (CASCADE_PREFIX + suffix_cap);
    let wanted = DECODE_ROTATE_BYTES.div_ceil(cascade).max(DECODE_MIN_CACHES);
    wanted.min(DECODE_MAX_BYTES / full).max(1)
}

/// One cascade input set: q `(b, 1, h, d)`; the prompt's K and V `(1, prefix, hk, d)`; each
/// sequence's own tokens `(b, suffix_max, hk, d)`; and the unshared caches `(b, prefix +
/// suffix_max, hk, d)`, the prompt copied in front of each sequence's own tokens.
pub(crate) struct CascadeInputs {
    pub(crate) q: Tensor,
    pub(crate) prefix_k: Tensor,
    pub(crate) prefix_v: Tensor,
    pub(crate) suffix_k: Tensor,
    pub(crate) suffix_v: Tensor,
    pub(crate) full_k: Tensor,
    pub(crate) full_v: Tensor,
}

impl CascadeInputs {
    pub(crate) fn new(dtype: DType, dev: &Device) -> Result<Self> {
        let randn = |b: usize, rows: usize, heads: usize| {
            Tensor::randn(0f32, 1.0, (b, rows, heads, DECODE_HD), dev)?.to_dtype(dtype)
        };
        let (b, hk) = (CASCADE_BATCH, DECODE_HEADS_K);
        let suffix_cap = CASCADE_SUFFIX_MIN + CASCADE_SUFFIX_SPAN - 1;
        let prefix_k = randn(1, CASCADE_PREFIX, hk)?;
        let prefix_v = randn(1, CASCADE_PREFIX, hk)?;
        let suffix_k = randn(b, suffix_cap, hk)?;
        let suffix_v = randn(b, suffix_cap, hk)?;
        let full = |p: &Tensor, s: &Tensor| -> Result<Tensor> {
            Tensor::cat(
                &[&p.broadcast_as((b, CASCADE_PREFIX, hk, DECODE_HD))?, s],
                1,
            )
        };
        Ok(Self {
            q: randn(b, 1, DECODE_HEADS)?,
            full_k: full(&prefix_k, &suffix_k)?,
            full_v: full(&prefix_v, &suffix_v)?,
            prefix_k,
            prefix_v,
            suffix_k,
            suffix_v,
        })
    }

    /// The prompt attended once: the sequences' query tokens as the rows of one batch,
    /// `(out (b, 1, h, d), lse (b, h, 1))` (the lse a transposed view, which `combine` reads
    /// as it is).
    pub(crate) fn prefix(&self, opts: &FlashAttn) -> Result<(Tensor, Tensor)> {
        let (b, h, d) = (CASCADE_BATCH, DECODE_HEADS, DECODE_HD);
        let rows = self.q.reshape((1, b, h, d))?;
        let (out, lse) = opts.forward_with_lse(&rows, &self.prefix_k, &self.prefix_v)?;
        Ok((out.reshape((b, 1, h, d))?, lse.transpose(0, 2)?))
    }

    /// [`Self::prefix`] with the prompt's keys split into [`CASCADE_SPLIT`] chunks, attended
    /// in one launch as a batch of chunks (the prompt reshaped, a view; q copied per chunk),
    /// so that the launch has `CASCADE_SPLIT` times the blocks of 64 query rows per head; the
    /// chunks' `(out, lse)` go to `combine` with the suffix.
    pub(crate) fn prefix_split(&self, opts: &FlashAttn) -> Result<Vec<(Tensor, Tensor)>> {
        let (b, h, hk, d) = (CASCADE_BATCH, DECODE_HEADS, DECODE_HEADS_K, DECODE_HD);
        let parts = CASCADE_SPLIT;
        let chunk = CASCADE_PREFIX / parts;
        let k = self.prefix_k.reshape((parts, chunk, hk, d))?;
        let v = self.prefix_v.reshape((parts, chunk, hk, d))?;
        let rows = self
            .q
            .reshape((1, b, h, d))?
            .broadcast_as((parts, b, h, d))?
            .contiguous()?;
        let (out, lse) = opts.forward_with_lse(&rows, &k, &v)?;
        (0..parts)
            .map(|p| {
                Ok((
                    out.get(p)?.reshape((b, 1, h, d))?,
                    lse.get(p)?.transpose(0, 1)?.unsqueeze(2)?,
                ))
            })
            .collect()
    }
}

/// `(max |cascade - unshared|, max |unshared|)` in f32; infinite where either has a NaN or
/// an infinity.
pub(crate) fn cascade_check(cascade: &Tensor, unshared: &Tensor) -> Result<(f64, f64)> {
    let f32 = |t: &Tensor| -> Result<Vec<f32>> {
        t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()
    };
    let (a, b) = (f32(cascade)?, f32(unshared)?);
    if a.len() != b.len() {
        bail!(
            "cascade {:?} vs unshared {:?}",
            cascade.dims(),
            unshared.dims()
        )
    }
    let (mut diff, mut max) = (0f64, 0f64);
    for (&x, &y) in a.iter().zip(&b) {
        if !(x.is_finite() && y.is_finite()) {
            return Ok((f64::INFINITY, f64::INFINITY));
        }
        diff = diff.max((x - y).abs() as f64);
        max = max.max(y.abs() as f64);
    }
    Ok((diff, max))
}

/// One unit in the last place of `dtype` at `x`.
pub(crate) fn dtype_ulp(dtype: DType, x: f64) -> f64 {
    let mantissa = match dtype {
        DType::BF16 => 7,
        DType::F16 => 10,
        _ => 23,
    };
    x.max(f64::MIN_POSITIVE).log2().floor().exp2() / f64::from(1u32 << mantissa)
}
