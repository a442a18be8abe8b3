//! KV-cache decoding against the device's copy bandwidth.

#[allow(unused_imports)]
use super::*;

/// KV-cache decoding ([`flash_attn_with_kvcache`]) and the copy bandwidth it is measured
/// against.
impl Bench {
    /// The copy bandwidth once, then every decode shape; the JSON is rewritten after each.
    pub(crate) fn decode_section(&mut self, json: Option<&PathBuf>) {
        println!(
            "# decode: GQA {DECODE_HEADS}/{DECODE_HEADS_K} heads, hd {DECODE_HD}, {:?}, one query \
             token attending to all L cached tokens (no append); GB/s of K+V read",
            self.dtype
        );
        let copy_gbps = self.copy_bandwidth();
        if let Some(path) = json {
            self.write_json(path);
        }
        println!(
            "{:<12} {:<8} {:>4} {:>6} {:>5} {:>6} {:>6} {:>9} {:>8} {:>6} {:>9}  check",
            "impl", "pass", "hd", "L", "batch", "heads", "caches", "ms", "GB/s", "%copy", "host ms"
        );
        for (batch, seqlen) in decode_shapes() {
            for fp8 in [false, true] {
                self.decode(&DecodeCase { batch, seqlen, fp8 }, copy_gbps);
                if let Some(path) = json {
                    self.write_json(path);
                }
            }
        }
        println!(
            "# %copy: GB/s of K+V read / the copy bandwidth above. dec-fp8 / grph-fp8: the same \
             calls over an F8E4M3 cache (one byte an element; its own GB/s). host ms: time to \
             queue a call; close to ms means the host, not the GPU, sets the pace. check: max \
             |ours - f32 reference| as a % of max |reference| (MISMATCH above {:.0}%)",
            100.0 * DECODE_CHECK_REL
        );
    }

    /// Device-to-device copy bandwidth in GB/s: bytes read + written by `cuMemcpyDtoDAsync`
    /// of a 2 GiB buffer into another (no allocation in the loop; like torch's
    /// `dst.copy_(src)`). Candle's `slice_set` is not used: it measured 1.1 TB/s on the H200,
    /// a quarter of the memcpy. Recorded as impl "copy", pass "copy".
    pub(crate) fn copy_bandwidth(&mut self) -> Option<f64> {
        let dev = self.dev.clone();
        let size = COPY_ELEMS * 2;
        let bytes = 2 * size;
        let timed = try_run(|| memcpy_timing(&dev));
        match timed {
            Ok(t) if t.ms.is_finite() && t.ms > 0.0 => {
                let gbps = bytes as f64 / (t.ms * 1e-3) / 1e9;
                println!(
                    "copy: {} MiB bf16 device-to-device, {} MiB read + written: {:.3} ms, \
                     {gbps:.0} GB/s",
                    size >> 20,
                    bytes >> 20,
                    t.ms
                );
                self.records.push(format!(
                    "  {{\"impl\": \"copy\", \"pass\": \"copy\", \"bytes\": {bytes}, \
                     \"ms\": {:.6}, \"gbps\": {gbps:.1}}}",
                    t.ms
                ));
                Some(gbps)
            }
            Ok(t) => {
                println!("copy: n/a  bad timing {}", t.ms);
                None
            }
            Err(e) => {
                println!("copy: n/a  {e}");
                None
            }
        }
    }

    /// One decode shape: [`flash_attn_with_kvcache`] over `case.caches()` separate filled
    /// caches in turn, checked once against Candle's attention in f32, then timed.
    pub(crate) fn decode(&mut self, case: &DecodeCase, copy_gbps: Option<f64>) {
        let n = case.caches(self.dtype);
        let sets = (0..n).map(|_| DecodeInputs::new(case, self.dtype, &self.dev));
        let sets = match sets.collect::<Result<Vec<_>>>() {
            Ok(sets) => sets,
            Err(e) => {
                println!(
                    "{FLASH:<12} skipped decode {case}: inputs: {}",
                    first_line(&e)
                );
                return;
            }
        };
        let lens = vec![case.seqlen as u32; case.batch];
        let opts = match &sets[0].scales {
            Some((ks, vs)) => FlashAttn::new().kv_cache_scales(ks, vs),
            None => FlashAttn::new(),
        };
        let (pass_eager, pass_graph) = match case.fp8 {
            false => ("decode", "graph"),
            true => ("dec-fp8", "grph-fp8"),
        };
        let attend =
            |s: &DecodeInputs| flash_attn_with_kvcache(&s.q, &s.k, &s.v, None, &lens, &opts);
        let check = match try_run(|| decode_check(&sets[0], &attend(&sets[0])?)) {
            Ok(rel) if rel <= DECODE_CHECK_REL => (format!("ok ({:.2}%)", 100.0 * rel), Some(rel)),
            Ok(rel) => (format!("MISMATCH ({:.2}%)", 100.0 * rel), Some(rel)),
            Err(e) => (format!("n/a ({e})"), None),
        };
        let dev = self.dev.clone();
        let timed =
            try_run(|| time_ms_with(&dev, DECODE_TIMING, |i| attend(&sets[i % n]).map(drop)));
        let row = case.row(pass_eager, n);
        let t = match timed {
            Ok(t) if t.ms.is_finite() && t.ms > 0.0 => t,
            Ok(t) => return println!("{row} n/a  bad timing {}  check {}", t.ms, check.0),
            Err(e) => return println!("{row} n/a  {e}  check {}", check.0),
        };
        let (cells, mut fields) = case.record("decode", t.ms, self.dtype, copy_gbps);
        println!("{row} {cells} {:>9.4}  {}", t.host_ms, check.0);
        fields.push(format!("\"host_ms\": {:.6}", t.host_ms));
        fields.push(format!("\"caches\": {n}"));
        if let Some(rel) = check.1 {
            let ok = rel <= DECODE_CHECK_REL;
            fields.push(format!(
                "\"check\": \"{}\"",
                if ok { "ok" } else { "mismatch" }
            ));
            if rel.is_finite() {
                fields.push(format!("\"max_rel_err\": {rel:.3e}"));
            }
        }
        self.records.push(format!("  {{{}}}", fields.join(", ")));

        // The same calls captured in a CUDA graph (lengths in a device tensor, one call per
        // cache set in turn) and replayed: the kernels back to back without launch gaps, as a
        // captured decoding step runs them.
        let lens_dev = match Tensor::new(lens.as_slice(), &dev) {
            Ok(t) => t,
            Err(e) => return println!("{FLASH:<12} skipped decode-graph: {}", first_line(&e)),
        };
        let attend_dev =
            |s: &DecodeInputs| flash_attn_with_kvcache(&s.q, &s.k, &s.v, None, &lens_dev, &opts);
        // The library's capture (memory nodes out of the kernels' chain, programmatic edges
        // kept: candle_flash::graph) and the graph as a plain stream capture records it.
        let pass_cap = if case.fp8 { "gr-c-fp8" } else { "graph-c" };
        for (as_captured, pass, json_pass) in [
            (false, pass_graph, "decode-graph"),
            (true, pass_cap, "decode-graph-captured"),
        ] {
            let timed =
                try_run(|| graph_timing(&dev, n, as_captured, |i| attend_dev(&sets[i]).map(drop)));
            let row = case.row(pass, n);
            let (t, stats) = match timed {
                Ok((t, stats)) if t.ms.is_finite() && t.ms > 0.0 => (t, stats),
                Ok((t, _)) => {
                    println!("{row} n/a  bad timing {}", t.ms);
                    continue;
                }
                Err(e) => {
                    println!("{row} n/a  {}", first_line(&e));
                    continue;
                }
            };
            let (cells, fields) = case.record(json_pass, t.ms, self.dtype, copy_gbps);
            println!("{row} {cells} {:>9.4}  in a CUDA graph: {stats}", t.host_ms);
            self.records.push(format!("  {{{}}}", fields.join(", ")));
        }
    }
}

/// Per-call time of `calls` calls (`step(0..calls)`) captured once in a CUDA graph and
/// replayed, with what the graph holds; each call is run eagerly first (kernel modules, the
/// decode's counters). `as_captured`: the graph as a plain stream capture records it,
/// otherwise as `candle_flash::graph` shapes it.
#[cfg(feature = "cuda")]
pub(crate) fn graph_timing(
    dev: &Device,
    calls: usize,
    as_captured: bool,
    step: impl Fn(usize) -> Result<()>,
) -> Result<(Timed, String)> {
    use candle_flash::graph::{CapturedGraph, Wiring};
    for i in 0..calls {
        step(i)?;
    }
    dev.synchronize()?;
    let wiring = match as_captured {
        true => Wiring::AsCaptured,
        false => Wiring::Programmatic,
    };
    let (graph, ()) = CapturedGraph::capture_with(dev, wiring, || (0..calls).try_for_each(&step))?;
    let t = time_ms_with(dev, DECODE_TIMING, |_| graph.launch())?;
    let stats = graph.stats().to_string();
    Ok((
        Timed {
            ms: t.ms / calls as f64,
            host_ms: t.host_ms / calls as f64,
        },
        stats,
    ))
}

#[cfg(not(feature = "cuda"))]
pub(crate) fn graph_timing(
    _dev: &Device,
    _calls: usize,
    _as_captured: bool,
    _step: impl Fn(usize) -> Result<()>,
) -> Result<(Timed, String)> {
    candle::bail!("CUDA graphs need the cuda feature")
}

/// [`DECODE_SHAPES`], or the `BxL` shapes listed in `CANDLE_FLASH_BENCH_DECODE` (e.g.
/// `8x8192,1x65536`: one shape under a profiler). Unparsable entries are reported and skipped.
pub(crate) fn decode_shapes() -> Vec<(usize, usize)> {
    let Ok(list) = std::env::var("CANDLE_FLASH_BENCH_DECODE") else {
        return DECODE_SHAPES.to_vec();
    };
    list.split(',')
        .filter_map(|entry| {
            let parsed = entry
                .split_once('x')
                .and_then(|(b, l)| Some((b.trim().parse().ok()?, l.trim().parse().ok()?)));
            if parsed.is_none() {
                println!("CANDLE_FLASH_BENCH_DECODE: skipping {entry:?}, expected BxL");
            }
            parsed
        })
        .collect()
}

/// One decode shape: `batch` sequences of `seqlen` cached tokens (all attended), GQA
/// DECODE_HEADS/DECODE_HEADS_K heads at DECODE_HD, one query token per sequence.
#[derive(Clone, Copy)]
pub(crate) struct DecodeCase {
    pub(crate) batch: usize,
    pub(crate) seqlen: usize,
    /// The cache is F8E4M3 (one byte an element, per-head scales).
    pub(crate) fp8: bool,
}

impl DecodeCase {
    /// A table row's leading cells: implementation, `pass`, shape, `caches` cache sets.
    pub(crate) fn row(&self, pass: &str, caches: usize) -> String {
        format!(
            "{FLASH:<12} {:<8} {DECODE_HD:>4} {:>6} {:>5} {:>6} {caches:>6}",
            pass,
            self.seqlen,
            self.batch,
            format!("{DECODE_HEADS}/{DECODE_HEADS_K}"),
        )
    }

    /// A call of `ms` milliseconds: the row's ms, GB/s and % of copy cells, and the JSON
    /// fields every decode record shares (pass `json_pass`, `-fp8` appended for an e4m3
    /// cache).
    pub(crate) fn record(
        &self,
        json_pass: &str,
        ms: f64,
        dtype: DType,
        copy_gbps: Option<f64>,
    ) -> (String, Vec<String>) {
        let gbps = self.kv_bytes(dtype) as f64 / (ms * 1e-3) / 1e9;
        let pct = copy_gbps.map(|c| 100.0 * gbps / c);
        let pct_cell = pct.map_or("n/a".to_string(), |p| format!("{p:.1}"));
        let suffix = if self.fp8 { "-fp8" } else { "" };
        let mut fields = vec![
            format!("\"impl\": \"{FLASH}\""),
            format!("\"pass\": \"{json_pass}{suffix}\""),
            format!("\"hd\": {DECODE_HD}"),
            format!("\"seqlen\": {}", self.seqlen),
            format!("\"batch\": {}", self.batch),
            format!("\"heads\": {DECODE_HEADS}"),
            format!("\"heads_k\": {DECODE_HEADS_K}"),
            "\"causal\": false".into(),
            format!("\"ms\": {ms:.6}"),
            format!("\"gbps\": {gbps:.1}"),
        ];
        if let Some(p) = pct {
            fields.push(format!("\"pct_copy\": {p:.2}"));
        }
        (format!("{ms:>9.4} {gbps:>8.0} {pct_cell:>6}"), fields)
    }

    /// Bytes of K and V one call reads: 2·b·L·hk·d elements.
    pub(crate) fn kv_bytes(&self, dtype: DType) -> usize {
        let elem = if self.fp8 { 1 } else { dtype.size_in_bytes() };
        2 * self.batch * self.seqlen * DECODE_HEADS_K * DECODE_HD * elem
    }

    /// Caches to rotate over: at least DECODE_MIN_CACHES and DECODE_ROTATE_BYTES in all, at
    /// most DECODE_MAX_BYTES.
    pub(crate) fn caches(&self, dtype: DType) -> usize {
        let one = self.kv_bytes(dtype).max(1);
        let wanted = DECODE_ROTATE_BYTES.div_ceil(one).max(DECODE_MIN_CACHES);
        wanted.min(DECODE_MAX_BYTES / one).max(1)
    }
}

impl fmt::Display for DecodeCase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "batch={} L={} heads={DECODE_HEADS}/{DECODE_HEADS_K} hd={DECODE_HD}{}",
            self.batch,
            self.seqlen,
            if self.fp8 { " fp8 cache" } else { "" }
        )
    }
}

/// One decode input: q `(b, 1, h, d)` and a full cache `(b, L, hk, d)` of random values; an
/// F8E4M3 cache holds N(0, 1) values quantized with a scale of 4 per head.
pub(crate) struct DecodeInputs {
    pub(crate) q: Tensor,
    pub(crate) k: Tensor,
    pub(crate) v: Tensor,
    pub(crate) scales: Option<(Tensor, Tensor)>,
}

impl DecodeInputs {
    pub(crate) fn new(case: &DecodeCase, dtype: DType, dev: &Device) -> Result<Self> {
        let randn = |rows: usize, heads: usize| {
            Tensor::randn(0f32, 1.0, (case.batch, rows, heads, DECODE_HD), dev)?.to_dtype(dtype)
        };
        if !case.fp8 {
            return Ok(Self {
                q: randn(1, DECODE_HEADS)?,
                k: randn(case.seqlen, DECODE_HEADS_K)?,
                v: randn(case.seqlen, DECODE_HEADS_K)?,
                scales: None,
            });
        }
        let scale = Tensor::full(4f32, DECODE_HEADS_K, dev)?;
        let fp8 = |rows: usize| {
            let x = Tensor::randn(
                0f32,
                1.0,
                (case.batch, rows, DECODE_HEADS_K, DECODE_HD),
                dev,
            )?;
            quant::quantize_fp8(&x, &scale, quant::Fp8Scaling::PerHead)
        };
        Ok(Self {
            q: randn(1, DECODE_HEADS)?,
            k: fp8(case.seqlen)?,
            v: fp8(case.seqlen)?,
            scales: Some((scale.clone(), scale)),
        })
    }
}

/// max |out - reference| / max |reference|, the reference being Candle's attention in f32 on
/// the same inputs (an F8E4M3 cache dequantized; a guard against a fast but wrong kernel; NaN
/// or inf anywhere gives inf).
pub(crate) fn decode_check(s: &DecodeInputs, out: &Tensor) -> Result<f64> {
    let f32 = |t: &Tensor| t.to_dtype(DType::F32);
    let (k, v) = match &s.scales {
        None => (f32(&s.k)?, f32(&s.v)?),
        Some((ks, vs)) => {
            let real = |x: &Tensor, scale: &Tensor| {
                quant::dequantize_fp8(x, scale, quant::Fp8Scaling::PerHead, DType::F32)
            };
            (real(&s.k, ks)?, real(&s.v, vs)?)
        }
    };
    let reference = naive_attention(&f32(&s.q)?, &k, &v, None, false)?;
    let out = f32(out)?;
    // NaN compares false with everything: count the elements of finite magnitude.
    let finite = out.abs()?.le(f32::MAX as f64)?.to_dtype(DType::F32)?;
    if (finite.sum_all()?.to_scalar::<f32>()? as usize) < out.elem_count() {
        return Ok(f64::INFINITY);
    }
    let max_abs = |t: &Tensor| -> Result<f64> {
        Ok(t.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()? as f64)
    };
    Ok(max_abs(&(&out - &reference)?)? / max_abs(&reference)?.max(1e-30))
}
