//! CPU KV-cache decoding against `attention_slow` on each sequence's prefix: contiguous and
//! paged caches, with and without new keys and values (whose rows in the cache are checked
//! too), GQA, causal or not; then `KvCache` and `PagedKvCache` over generation loops.

mod common;

use candle::{DType, Device, IndexOp, Result, Tensor, Var};
use candle_flash::{
    attention_slow, flash_attn_with_kvcache, flash_attn_with_paged_kvcache, FlashAttn, KvCache,
    PagedKvCache,
};
use common::{assert_close, assert_within_budget, randn};
use rand::{rngs::StdRng, seq::SliceRandom, Rng, SeedableRng};

/// f32 inputs: both sides do f32 math in a different order.
const F32_TOL: f32 = 1e-5;
/// Sequence lengths of the grid (after the append): 1, a short one, one past a 256 block, one
/// long-ish (1000 keeps the CPU time low).
const LENGTHS: [usize; 4] = [1, 7, 255, 1000];

/// Contiguous `(b, capacity, hk, d)` or paged with this page size.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Layout {
    Contiguous,
    Paged(usize),
}

/// One decoding call: `s_q` queries per sequence over caches holding `lens[b]` tokens before
/// `s_new` new ones are appended.
#[derive(Clone, Debug)]
struct DecodeCase {
    lens: Vec<usize>,
    s_q: usize,
    s_new: usize,
    h: usize,
    hk: usize,
    d: usize,
    causal: bool,
    layout: Layout,
}

/// The inputs of one call and the cache contents the call must leave behind.
struct Inputs {
    q: Tensor,
    /// `(b, capacity, hk, d)`: the caches before the call (rows past each length are noise
    /// that must not be read).
    k0: Tensor,
    v0: Tensor,
    new: Option<(Tensor, Tensor)>,
    /// `k0`, `v0` with the new rows written at `lens[b]..`.
    k1: Tensor,
    v1: Tensor,
}

impl DecodeCase {
    fn b(&self) -> usize {
        self.lens.len()
    }

    fn final_lens(&self) -> Vec<usize> {
        self.lens.iter().map(|l| l + self.s_new).collect()
    }

    /// Room for the longest sequence plus a few spare rows; whole pages when paged.
    fn capacity(&self) -> usize {
        let needed = self.final_lens().into_iter().max().unwrap_or(0) + 3;
        match self.layout {
            Layout::Contiguous => needed,
            Layout::Paged(ps) => needed.next_multiple_of(ps),
        }
    }

    fn cache_seqlens(&self) -> Vec<u32> {
        self.lens.iter().map(|&l| l as u32).collect()
    }

    fn opts(&self) -> FlashAttn {
        FlashAttn::new().causal(self.causal)
    }

    fn inputs(&self, dtype: DType) -> Result<Inputs> {
        let (b, cap, hk, d) = (self.b(), self.capacity(), self.hk, self.d);
        let q = randn((b, self.s_q, self.h, d), dtype)?;
        let k0 = randn((b, cap, hk, d), dtype)?;
        let v0 = randn((b, cap, hk, d), dtype)?;
        if self.s_new == 0 {
            let (k1, v1) = (k0.clone(), v0.clone());
            return Ok(Inputs {
                q,
                k0,
                v0,
                new: None,
                k1,
                v1,
            });
        }
        let k_new = randn((b, self.s_new, hk, d), dtype)?;
        let v_new = randn((b, self.s_new, hk, d), dtype)?;
        let k1 = write_rows(&k0, &k_new, &self.lens)?;
        let v1 = write_rows(&v0, &v_new, &self.lens)?;
        Ok(Inputs {
            q,
            k0,
            v0,
            new: Some((k_new, v_new)),
            k1,
            v1,
        })
    }

    /// The oracle: `attention_slow` of each sequence's queries over its first
    /// `lens[b] + s_new` cached tokens.
    fn reference(&self, x: &Inputs) -> Result<Tensor> {
        let scale = 1.0 / (self.d as f32).sqrt();
        let outs = self
            .final_lens()
            .iter()
            .enumerate()
            .map(|(b, &len)| {
                let prefix = |c: &Tensor| c.narrow(0, b, 1)?.narrow(1, 0, len);
                let q = x.q.narrow(0, b, 1)?;
                attention_slow(&q, &prefix(&x.k1)?, &prefix(&x.v1)?, scale, self.causal)
            })
            .collect::<Result<Vec<_>>>()?;
        Tensor::cat(&outs, 0)
    }

    /// Runs the op on fresh copies of the caches: returns the output and the caches after
    /// the call, as contiguous `(b, capacity, hk, d)` tensors (paged ones read back through
    /// the block table, after checking that the pages no sequence owns are untouched).
    fn run(&self, x: &Inputs, rng: &mut StdRng) -> Result<(Tensor, Tensor, Tensor)> {
        let new_kv = x.new.as_ref().map(|(k, v)| (k, v));
        let lens = self.cache_seqlens();
        match self.layout {
            Layout::Contiguous => {
                let (k, v) = (x.k0.copy()?, x.v0.copy()?);
                let out = flash_attn_with_kvcache(&x.q, &k, &v, new_kv, &lens, &self.opts())?;
                Ok((out, k, v))
            }
            Layout::Paged(ps) => {
                let paged = Paged::new(self.b(), self.capacity() / ps, ps, 5, rng);
                let (k, v) = (paged.scatter(&x.k0)?, paged.scatter(&x.v0)?);
                let (k_spare, v_spare) = (paged.spare(&k)?, paged.spare(&v)?);
                let out = flash_attn_with_paged_kvcache(
                    &x.q,
                    &k,
                    &v,
                    new_kv,
                    &lens,
                    &paged.block_table,
                    paged.max_pages,
                    &self.opts(),
                )?;
                assert_eq!(
                    to_vec(&paged.spare(&k)?)?,
                    to_vec(&k_spare)?,
                    "spare k pages"
                );
                assert_eq!(
                    to_vec(&paged.spare(&v)?)?,
                    to_vec(&v_spare)?,
                    "spare v pages"
                );
                Ok((out, paged.gather(&k)?, paged.gather(&v)?))
            }
        }
    }
}

/// `cache` with `new[b]` written at rows `lens[b]..lens[b] + s_new` of sequence `b`.
fn write_rows(cache: &Tensor, new: &Tensor, lens: &[usize]) -> Result<Tensor> {
    let (_, cap, _, _) = cache.dims4()?;
    let s_new = new.dim(1)?;
    let rows = lens
        .iter()
        .enumerate()
        .map(|(b, &len)| {
            let c = cache.narrow(0, b, 1)?;
            let mut parts = vec![c.narrow(1, 0, len)?, new.narrow(0, b, 1)?];
            if len + s_new < cap {
                parts.push(c.narrow(1, len + s_new, cap - len - s_new)?);
            }
            Tensor::cat(&parts, 1)
        })
        .collect::<Result<Vec<_>>>()?;
    Tensor::cat(&rows, 0)
}

fn to_vec(t: &Tensor) -> Result<Vec<f32>> {
    t.to_dtype(DType::F32)?.flatten_all()?.to_vec1()
}

/// A block table over a shuffled pool: every sequence gets `max_pages` pages scattered over
/// `batch * max_pages + spare` pages, so neither page order nor adjacency can be assumed.
struct Paged {
    page_size: usize,
    max_pages: usize,
    num_pages: usize,
    block_table: Vec<u32>,
}

impl Paged {
    fn new(
        batch: usize,
        max_pages: usize,
        page_size: usize,
        spare: usize,
        rng: &mut StdRng,
    ) -> Self {
        let num_pages = batch * max_pages + spare;
        let mut pages: Vec<u32> = (0..num_pages as u32).collect();
        pages.shuffle(rng);
        pages.truncate(batch * max_pages);
        Self {
            page_size,
            max_pages,
            num_pages,
            block_table: pages,
        }
    }

    /// Pages `(num_pages, page_size, hk, d)` holding a contiguous `(b, capacity, hk, d)`
    /// cache; the spare pages hold noise.
    fn scatter(&self, cache: &Tensor) -> Result<Tensor> {
        let (_, _, hk, d) = cache.dims4()?;
        let mut pages: Vec<Option<Tensor>> = vec![None; self.num_pages];
        for (slot, &page) in self.block_table.iter().enumerate() {
            let (b, p) = (slot / self.max_pages, slot % self.max_pages);
            pages[page as usize] =
                Some(cache.i(b)?.narrow(0, p * self.page_size, self.page_size)?);
        }
        let pages = pages
            .into_iter()
            .map(|p| match p {
                Some(p) => Ok(p),
                None => randn((self.page_size, hk, d), cache.dtype()),
            })
            .collect::<Result<Vec<_>>>()?;
        Tensor::stack(&pages, 0)
    }

    /// The inverse of [`Paged::scatter`]: `(b, capacity, hk, d)`.
    fn gather(&self, pages: &Tensor) -> Result<Tensor> {
        let rows = self
            .block_table
            .chunks(self.max_pages)
            .map(|row| {
                let seq = row
                    .iter()
                    .map(|&page| pages.i(page as usize))
                    .collect::<Result<Vec<_>>>()?;
                Tensor::cat(&seq, 0)
            })
            .collect::<Result<Vec<_>>>()?;
        Tensor::stack(&rows, 0)
    }

    /// The pages no sequence owns, concatenated.
    fn spare(&self, pages: &Tensor) -> Result<Tensor> {
        let spare = (0..self.num_pages as u32)
            .filter(|p| !self.block_table.contains(p))
            .map(|p| pages.i(p as usize))
            .collect::<Result<Vec<_>>>()?;
        Tensor::cat(&spare, 0)
    }
}

/// Runs one case in f32: output against the oracle, cache contents exactly.
fn check_case(case: &DecodeCase, rng: &mut StdRng) -> Result<()> {
    let x = case.inputs(DType::F32)?;
    let (out, k, v) = case.run(&x, rng)?;
    assert_close(&format!("{case:?}"), &out, &case.reference(&x)?, F32_TOL)?;
    assert_eq!(to_vec(&k)?, to_vec(&x.k1)?, "k cache after {case:?}");
    assert_eq!(to_vec(&v)?, to_vec(&x.v1)?, "v cache after {case:?}");
    Ok(())
}

/// The grid: s_q {1, 4, 16} x GQA ratio {1, 4, 8} x causal x {contiguous, pages of 16, pages
/// of 256} x {no new tokens, s_q new tokens}, lengths 1, 7, 255, 1000 in a random order.
#[test]
fn grid_against_attention_slow() -> Result<()> {
    let mut rng = StdRng::seed_from_u64(7);
    let mut cases = 0;
    for s_q in [1, 4, 16] {
        for ratio in [1, 4, 8] {
            for causal in [false, true] {
                for layout in [Layout::Contiguous, Layout::Paged(16), Layout::Paged(256)] {
                    for with_new in [false, true] {
                        let s_new = if with_new { s_q } else { 0 };
                        let mut lens = LENGTHS.to_vec();
                        lens.shuffle(&mut rng);
                        // The lengths above are those after the append.
                        let lens = lens.iter().map(|l| l.saturating_sub(s_new)).collect();
                        let case = DecodeCase {
                            lens,
                            s_q,
                            s_new,
                            h: 2 * ratio,
                            hk: 2,
                            d: 32,
                            causal,
                            layout,
                        };
                        check_case(&case, &mut rng)?;
                        cases += 1;
                    }
                }
            }
        }
    }
    assert_eq!(cases, 108);
    Ok(())
}

/// Random lengths, a different number of new tokens than queries (both ways), empty
/// sequences, MQA, head_dims that are not multiples of 8 and up to 256.
#[test]
fn awkward_shapes() -> Result<()> {
    let mut rng = StdRng::seed_from_u64(11);
    let random: Vec<usize> = (0..5).map(|_| rng.random_range(0..600)).collect();
    let base = DecodeCase {
        lens: random,
        s_q: 3,
        s_new: 5,
        h: 4,
        hk: 1,
        d: 40,
        causal: true,
        layout: Layout::Contiguous,
    };
    let cases = [
        base.clone(),
        DecodeCase {
            s_q: 9,
            s_new: 2,
            layout: Layout::Paged(16),
            ..base.clone()
        },
        DecodeCase {
            lens: vec![0, 0, 3],
            s_q: 4,
            s_new: 0,
            ..base.clone()
        },
        DecodeCase {
            lens: vec![0, 20],
            s_q: 6,
            s_new: 2,
            layout: Layout::Paged(16),
            ..base.clone()
        },
        DecodeCase {
            lens: vec![33, 1],
            s_q: 2,
            s_new: 1,
            h: 2,
            hk: 2,
            d: 8,
            ..base.clone()
        },
        DecodeCase {
            lens: vec![300, 17],
            s_q: 4,
            s_new: 4,
            h: 8,
            hk: 2,
            d: 256,
            layout: Layout::Paged(256),
            ..base.clone()
        },
        DecodeCase {
            lens: vec![5, 3],
            s_q: 1,
            s_new: 1,
            h: 6,
            hk: 3,
            d: 3,
            causal: false,
            ..base.clone()
        },
    ];
    for case in &cases {
        check_case(case, &mut rng)?;
    }
    Ok(())
}

/// f16 and bf16: within 2x the error of the same math done in the low precision; the new rows
/// are stored bit for bit.
#[test]
fn half_precision_within_budget() -> Result<()> {
    let mut rng = StdRng::seed_from_u64(3);
    for dtype in [DType::F16, DType::BF16] {
        for layout in [Layout::Contiguous, Layout::Paged(16)] {
            let case = DecodeCase {
                lens: vec![1, 77, 300],
                s_q: 4,
                s_new: 4,
                h: 8,
                hk: 2,
                d: 64,
                causal: true,
                layout,
            };
            let x = case.inputs(dtype)?;
            let (out, k, v) = case.run(&x, &mut rng)?;
            let baseline = case.reference(&x)?;
            let up = |t: &Tensor| t.to_dtype(DType::F32);
            let exact = case.reference(&Inputs {
                q: up(&x.q)?,
                k0: up(&x.k0)?,
                v0: up(&x.v0)?,
                new: None,
                k1: up(&x.k1)?,
                v1: up(&x.v1)?,
            })?;
            let what = format!("{dtype:?} {layout:?}");
            assert_within_budget(&what, &out, &baseline, &exact, 2.0)?;
            assert_eq!(out.dtype(), dtype);
            assert_eq!(to_vec(&k)?, to_vec(&x.k1)?, "{what}: k cache");
            assert_eq!(to_vec(&v)?, to_vec(&x.v1)?, "{what}: v cache");
        }
    }
    Ok(())
}

/// Strided q and new rows (only the last dimension contiguous) and caches that start at an
/// offset inside a larger allocation: the same result, and only the new rows change.
#[test]
fn strided_inputs_and_offset_caches() -> Result<()> {
    let (b, s_q, h, hk, d, cap) = (3, 4, 8, 2, 16, 40);
    let lens = [3u32, 0, 30];
    // q and the new rows as transposed views of (b, heads, s, d) tensors.
    let q = randn((b, h, s_q, d), DType::F32)?.transpose(1, 2)?;
    let k_new = randn((b, hk, s_q, d), DType::F32)?.transpose(1, 2)?;
    let v_new = randn((b, hk, s_q, d), DType::F32)?.transpose(1, 2)?;
    assert!(!q.is_contiguous() && !k_new.is_contiguous());
    // One allocation holding [k_cache | v_cache] as in vLLM's (2, ...) layout.
    let both = randn((2, b, cap, hk, d), DType::F32)?;
    let before = to_vec(&both)?;
    let (k_cache, v_cache) = (both.i(0)?, both.i(1)?);
    let opts = FlashAttn::new().causal(true);
    let new_kv = Some((&k_new, &v_new));
    let out = flash_attn_with_kvcache(&q, &k_cache, &v_cache, new_kv, &lens, &opts)?;

    let (k_fresh, v_fresh) = (both.i(0)?.copy()?, both.i(1)?.copy()?);
    let k0 = Tensor::from_vec(
        before[..b * cap * hk * d].to_vec(),
        (b, cap, hk, d),
        &Device::Cpu,
    )?;
    let v0 = Tensor::from_vec(
        before[b * cap * hk * d..].to_vec(),
        (b, cap, hk, d),
        &Device::Cpu,
    )?;
    let lens_usize: Vec<usize> = lens.iter().map(|&l| l as usize).collect();
    assert_eq!(
        to_vec(&k_fresh)?,
        to_vec(&write_rows(&k0, &k_new, &lens_usize)?)?
    );
    assert_eq!(
        to_vec(&v_fresh)?,
        to_vec(&write_rows(&v0, &v_new, &lens_usize)?)?
    );

    // The same call on contiguous copies of everything.
    let (k_c, v_c) = (k0.copy()?, v0.copy()?);
    let (q_c, kn_c, vn_c) = (q.contiguous()?, k_new.contiguous()?, v_new.contiguous()?);
    let expected = flash_attn_with_kvcache(&q_c, &k_c, &v_c, Some((&kn_c, &vn_c)), &lens, &opts)?;
    assert_eq!(to_vec(&out)?, to_vec(&expected)?);
    Ok(())
}

/// Decoding is inference only: a backward pass through it is an error, not a silent zero.
#[test]
fn backward_is_an_error() -> Result<()> {
    let q = Var::from_tensor(&randn((1, 1, 2, 8), DType::F32)?)?;
    let cache = randn((1, 4, 2, 8), DType::F32)?;
    let out = flash_attn_with_kvcache(&q, &cache, &cache.copy()?, None, &[3], &FlashAttn::new())?;
    let err = out
        .sum_all()?
        .backward()
        .expect_err("backward through decoding");
    assert!(err.to_string().contains("flash-attn-kvcache"), "{err}");
    Ok(())
}

/// One step of a generation loop: random q, k_new, v_new for `s` tokens.
fn step(b: usize, s: usize, h: usize, hk: usize, d: usize) -> Result<[Tensor; 3]> {
    Ok([
        randn((b, s, h, d), DType::F32)?,
        randn((b, s, hk, d), DType::F32)?,
        randn((b, s, hk, d), DType::F32)?,
    ])
}

/// Each sequence's keys and values so far, `(1, len, hk, d)`, and the oracle over them.
struct History {
    k: Vec<Option<Tensor>>,
    v: Vec<Option<Tensor>>,
}

impl History {
    fn new(b: usize) -> Self {
        Self {
            k: vec![None; b],
            v: vec![None; b],
        }
    }

    fn push(&mut self, k_new: &Tensor, v_new: &Tensor) -> Result<()> {
        for (hist, new) in [(&mut self.k, k_new), (&mut self.v, v_new)] {
            for (b, seq) in hist.iter_mut().enumerate() {
                let row = new.narrow(0, b, 1)?;
                *seq = Some(match seq.take() {
                    Some(old) => Tensor::cat(&[old, row], 1)?,
                    None => row,
                });
            }
        }
        Ok(())
    }

    fn reset(&mut self, b: usize) {
        self.k[b] = None;
        self.v[b] = None;
    }

    /// Full causal attention of the latest queries over each sequence's whole history.
    fn attend(&self, q: &Tensor) -> Result<Tensor> {
        let d = q.dim(3)?;
        let outs = (0..self.k.len())
            .map(|b| {
                let (k, v) = (self.k[b].as_ref().unwrap(), self.v[b].as_ref().unwrap());
                attention_slow(&q.narrow(0, b, 1)?, k, v, 1.0 / (d as f32).sqrt(), true)
            })
            .collect::<Result<Vec<_>>>()?;
        Tensor::cat(&outs, 0)
    }
}

/// Prefill, then token-by-token decoding (and a 3-token speculative step), with a sequence
/// restarted halfway: every step equals full causal attention over the accumulated sequence,
/// and the cache holds exactly the appended rows.
#[test]
fn kv_cache_generation_loop() -> Result<()> {
    let (b, h, hk, d) = (3, 8, 2, 32);
    let mut cache = KvCache::new(b, 64, hk, d, DType::F32, &Device::Cpu)?;
    assert_eq!((cache.capacity(), cache.lengths()), (64, &[0u32; 3][..]));
    let mut history = History::new(b);
    let opts = FlashAttn::new().causal(true);
    for (t, s) in [7, 1, 1, 3, 1, 1, 1, 2, 1].into_iter().enumerate() {
        if t == 5 {
            cache.reset_sequence(1)?;
            history.reset(1);
        }
        let [q, k, v] = step(b, s, h, hk, d)?;
        let out = cache.append_and_attend(&q, &k, &v, &opts)?;
        history.push(&k, &v)?;
        assert_close(&format!("step {t}"), &out, &history.attend(&q)?, F32_TOL)?;
    }
    assert_eq!(cache.lengths(), &[18, 5, 18]);
    for (seq, &len) in cache.lengths().iter().enumerate() {
        let k = cache.k().i(seq)?.narrow(0, 0, len as usize)?;
        let v = cache.v().i(seq)?.narrow(0, 0, len as usize)?;
        assert_eq!(to_vec(&k)?, to_vec(history.k[seq].as_ref().unwrap())?);
        assert_eq!(to_vec(&v)?, to_vec(history.v[seq].as_ref().unwrap())?);
    }
    Ok(())
}

/// A sequence that would exceed the capacity is an error naming it, before anything is
/// written; `reset` makes room again and behaves like a fresh cache.
#[test]
fn kv_cache_overflow_and_reset() -> Result<()> {
    let (b, h, hk, d) = (2, 4, 2, 16);
    let mut cache = KvCache::new(b, 8, hk, d, DType::F32, &Device::Cpu)?;
    let opts = FlashAttn::new().causal(true);
    let [q, k, v] = step(b, 5, h, hk, d)?;
    cache.append_and_attend(&q, &k, &v, &opts)?;
    let (k_before, v_before) = (to_vec(cache.k())?, to_vec(cache.v())?);
    let [q, k, v] = step(b, 4, h, hk, d)?;
    let err = cache
        .append_and_attend(&q, &k, &v, &opts)
        .expect_err("9 tokens in a cache of 8");
    let message = err.to_string();
    for part in ["cache_seqlens", "sequence 0", "5 + 4 = 9", "capacity of 8"] {
        assert!(message.contains(part), "{message:?} lacks {part:?}");
    }
    assert_eq!(cache.lengths(), &[5, 5]);
    assert_eq!(to_vec(cache.k())?, k_before, "k written despite the error");
    assert_eq!(to_vec(cache.v())?, v_before, "v written despite the error");
    // Exactly full is fine.
    let [q3, k3, v3] = step(b, 3, h, hk, d)?;
    cache.append_and_attend(&q3, &k3, &v3, &opts)?;
    assert_eq!(cache.lengths(), &[8, 8]);

    cache.reset();
    assert_eq!(cache.lengths(), &[0, 0]);
    let mut fresh = KvCache::new(b, 8, hk, d, DType::F32, &Device::Cpu)?;
    let ours = cache.append_and_attend(&q, &k, &v, &opts)?;
    let theirs = fresh.append_and_attend(&q, &k, &v, &opts)?;
    assert_eq!(to_vec(&ours)?, to_vec(&theirs)?);
    assert_eq!(cache.lengths(), &[4, 4]);
    assert!(cache.reset_sequence(2).is_err());
    Ok(())
}

/// `PagedKvCache` gives exactly `KvCache`'s outputs on the same data, through prefill,
/// decoding steps, page boundaries and a restarted sequence, and returns pages to the pool.
#[test]
fn paged_kv_cache_equals_kv_cache() -> Result<()> {
    let (b, h, hk, d) = (3, 8, 2, 32);
    for page_size in [4, 16] {
        let max_pages = 64usize.div_ceil(page_size);
        let num_pages = b * max_pages;
        let dev = &Device::Cpu;
        let mut flat = KvCache::new(b, 64, hk, d, DType::F32, dev)?;
        let mut paged =
            PagedKvCache::new(b, num_pages, page_size, max_pages, hk, d, DType::F32, dev)?;
        assert_eq!(paged.capacity(), flat.capacity());
        let opts = FlashAttn::new().causal(true);
        for (t, s) in [9, 1, 1, 5, 1, 1, 2, 1].into_iter().enumerate() {
            if t == 4 {
                let held = paged.lengths()[0].div_ceil(page_size as u32) as usize;
                let free = paged.free_pages();
                flat.reset_sequence(0)?;
                paged.reset_sequence(0)?;
                assert_eq!(paged.free_pages(), free + held, "pages returned");
            }
            let [q, k, v] = step(b, s, h, hk, d)?;
            let ours = paged.append_and_attend(&q, &k, &v, &opts)?;
            let theirs = flat.append_and_attend(&q, &k, &v, &opts)?;
            assert_eq!(
                to_vec(&ours)?,
                to_vec(&theirs)?,
                "page_size {page_size}, step {t}"
            );
            assert_eq!(paged.lengths(), flat.lengths());
            let held: usize = paged
                .lengths()
                .iter()
                .map(|&l| (l as usize).div_ceil(page_size))
                .sum();
            assert_eq!(paged.free_pages(), num_pages - held);
        }
        paged.reset();
        assert_eq!(paged.free_pages(), num_pages);
        assert_eq!(paged.lengths(), &[0, 0, 0]);
    }
    Ok(())
}

/// A pool with too few free pages is an error naming the sequence, before anything is
/// written or any page taken; so is a sequence past `max_pages_per_seq * page_size`.
#[test]
fn paged_kv_cache_out_of_pages() -> Result<()> {
    let (b, h, hk, d) = (2, 4, 1, 8);
    let dev = &Device::Cpu;
    let mut cache = PagedKvCache::new(b, 3, 4, 4, hk, d, DType::F32, dev)?;
    let opts = FlashAttn::new();
    let [q, k, v] = step(b, 5, h, hk, d)?; // 2 pages each: 4 > 3
    let err = cache
        .append_and_attend(&q, &k, &v, &opts)
        .expect_err("3 pages for 4");
    let message = err.to_string();
    for part in ["out of pages", "sequence 1", "0 + 5 tokens", "3 of 3 pages"] {
        assert!(message.contains(part), "{message:?} lacks {part:?}");
    }
    assert_eq!((cache.lengths(), cache.free_pages()), (&[0u32, 0][..], 3));

    let [q, k, v] = step(b, 4, h, hk, d)?; // 1 page each
    cache.append_and_attend(&q, &k, &v, &opts)?;
    assert_eq!((cache.lengths(), cache.free_pages()), (&[4u32, 4][..], 1));
    cache.reset_sequence(0)?;
    assert_eq!((cache.lengths(), cache.free_pages()), (&[0u32, 4][..], 2));

    let mut small = PagedKvCache::new(b, 16, 4, 2, hk, d, DType::F32, dev)?;
    let [q, k, v] = step(b, 9, h, hk, d)?;
    let err = small
        .append_and_attend(&q, &k, &v, &opts)
        .expect_err("9 tokens in 2 pages of 4");
    let message = err.to_string();
    for part in [
        "cache_seqlens",
        "sequence 0",
        "0 + 9 = 9",
        "capacity of 8",
        "max_pages 2",
    ] {
        assert!(message.contains(part), "{message:?} lacks {part:?}");
    }
    assert_eq!(small.free_pages(), 16);
    Ok(())
}

/// A cache of either layout behind one interface, for the ragged-append tests.
enum AnyCache {
    Flat(KvCache),
    Paged(PagedKvCache),
}

impl AnyCache {
    fn new(layout: Layout, b: usize, capacity: usize, hk: usize, d: usize) -> Result<Self> {
        Ok(match layout {
            Layout::Contiguous => {
                AnyCache::Flat(KvCache::new(b, capacity, hk, d, DType::F32, &Device::Cpu)?)
            }
            Layout::Paged(ps) => {
                let per_seq = capacity.div_ceil(ps);
                AnyCache::Paged(PagedKvCache::new(
                    b,
                    b * per_seq,
                    ps,
                    per_seq,
                    hk,
                    d,
                    DType::F32,
                    &Device::Cpu,
                )?)
            }
        })
    }
    fn append_varlen(&mut self, k: &Tensor, v: &Tensor, lens: &[usize]) -> Result<()> {
        match self {
            AnyCache::Flat(c) => c.append_varlen(k, v, lens),
            AnyCache::Paged(c) => c.append_varlen(k, v, lens),
        }
    }
    fn step(&mut self, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Tensor> {
        let opts = FlashAttn::new().causal(true);
        match self {
            AnyCache::Flat(c) => c.append_and_attend(q, k, v, &opts),
            AnyCache::Paged(c) => c.append_and_attend(q, k, v, &opts),
        }
    }
    fn lengths(&self) -> Vec<u32> {
        match self {
            AnyCache::Flat(c) => c.lengths().to_vec(),
            AnyCache::Paged(c) => c.lengths().to_vec(),
        }
    }
    fn free_pages(&self) -> Option<usize> {
        match self {
            AnyCache::Flat(_) => None,
            AnyCache::Paged(c) => Some(c.free_pages()),
        }
    }
}

#[test]
fn ragged_append_then_decode() -> Result<()> {
    let (h, hk, d) = (4, 2, 16);
    // An empty sequence, one that ends exactly on a page, one that spans pages.
    let lens = [5usize, 0, 16, 33];
    let total: usize = lens.iter().sum();
    for layout in [Layout::Contiguous, Layout::Paged(16), Layout::Paged(3)] {
        let k_new = randn((total, hk, d), DType::F32)?;
        let v_new = randn((total, hk, d), DType::F32)?;
        let mut cache = AnyCache::new(layout, lens.len(), 40, hk, d)?;
        cache.append_varlen(&k_new, &v_new, &lens)?;
        assert_eq!(cache.lengths(), vec![5, 0, 16, 33]);
        // A second ragged append continues each sequence where it stopped.
        let more = [1usize, 2, 0, 3];
        let (k_more, v_more) = (
            randn((6, hk, d), DType::F32)?,
            randn((6, hk, d), DType::F32)?,
        );
        cache.append_varlen(&k_more, &v_more, &more)?;
        let q = randn((lens.len(), 1, h, d), DType::F32)?;
        let k_step = randn((lens.len(), 1, hk, d), DType::F32)?;
        let v_step = randn((lens.len(), 1, hk, d), DType::F32)?;
        let out = cache.step(&q, &k_step, &v_step)?;
        let (mut start, mut start_more) = (0, 0);
        for s in 0..lens.len() {
            let keys = |a: &Tensor, b: &Tensor, step: &Tensor| -> Result<Tensor> {
                Tensor::cat(
                    &[
                        &a.narrow(0, start, lens[s])?.unsqueeze(0)?,
                        &b.narrow(0, start_more, more[s])?.unsqueeze(0)?,
                        &step.i(s..s + 1)?,
                    ],
                    1,
                )
            };
            let k = keys(&k_new, &k_more, &k_step)?;
            let v = keys(&v_new, &v_more, &v_step)?;
            let expect = attention_slow(&q.i(s..s + 1)?, &k, &v, 1.0 / (d as f32).sqrt(), true)?;
            assert_close(
                &format!("{layout:?} seq {s}"),
                &out.i(s..s + 1)?,
                &expect,
                F32_TOL,
            )?;
            start += lens[s];
            start_more += more[s];
        }
        assert_eq!(cache.lengths(), vec![7, 3, 17, 37]);
    }
    Ok(())
}

#[test]
fn ragged_append_errors_write_nothing() -> Result<()> {
    let (hk, d) = (2, 8);
    for layout in [Layout::Contiguous, Layout::Paged(4)] {
        let mut cache = AnyCache::new(layout, 2, 8, hk, d)?;
        let k = randn((6, hk, d), DType::F32)?;
        let cases: Vec<(Tensor, Vec<usize>, &str)> = vec![
            (
                k.clone(),
                vec![6],
                "seqlens_new: 1 entries for a cache of 2 sequences",
            ),
            (k.clone(), vec![2, 3], "k_new: expected (total=5"),
            (k.clone(), vec![0, 9], "k_new: expected (total=9"),
            (
                randn((9, hk, d), DType::F32)?,
                vec![0, 9],
                "more than the cache capacity of 8",
            ),
            (randn((6, hk, 4), DType::F32)?, vec![3, 3], "head_dim=8"),
            (k.to_dtype(DType::F16)?, vec![3, 3], "dtype F16 differs"),
        ];
        for (kn, lens, needle) in cases {
            let err = cache
                .append_varlen(&kn, &kn, &lens)
                .expect_err(needle)
                .to_string();
            assert!(err.contains(needle), "{layout:?}: {err:?} lacks {needle:?}");
            assert_eq!(
                cache.lengths(),
                vec![0, 0],
                "{layout:?}: lengths changed on error"
            );
        }
        cache.append_varlen(&k, &k, &[6, 0])?;
        assert_eq!(cache.lengths(), vec![6, 0]);
    }
    // Out of pages: 2 sequences share a pool of 3 pages of 4 tokens.
    let mut paged = PagedKvCache::new(2, 3, 4, 3, hk, d, DType::F32, &Device::Cpu)?;
    let k = randn((14, hk, d), DType::F32)?;
    let err = paged
        .append_varlen(&k, &k, &[9, 5])
        .expect_err("out of pages")
        .to_string();
    assert!(err.contains("out of pages"), "{err}");
    assert_eq!((paged.lengths(), paged.free_pages()), (&[0u32, 0][..], 3));
    Ok(())
}

#[test]
fn ragged_append_into_a_fragmented_pool() -> Result<()> {
    // After both sequences are reset the free list hands out pages 3, 4, 5, 0, 1, ...: a
    // 20-token append then spans adjacent pages (copied as one run) and a jump back.
    let (h, hk, d, ps) = (2, 1, 8, 4);
    let mut cache = PagedKvCache::new(2, 8, ps, 6, hk, d, DType::F32, &Device::Cpu)?;
    let k = randn((20, hk, d), DType::F32)?;
    cache.append_varlen(&k, &k, &[10, 10])?;
    cache.reset_sequence(0)?;
    cache.reset_sequence(1)?;
    let (k_new, v_new) = (
        randn((20, hk, d), DType::F32)?,
        randn((20, hk, d), DType::F32)?,
    );
    cache.append_varlen(&k_new, &v_new, &[20, 0])?;
    assert_eq!(&cache.block_table()[..5], &[3, 4, 5, 0, 1]);
    let q = randn((2, 1, h, d), DType::F32)?;
    let (k1, v1) = (
        randn((2, 1, hk, d), DType::F32)?,
        randn((2, 1, hk, d), DType::F32)?,
    );
    let out = cache.append_and_attend(&q, &k1, &v1, &FlashAttn::new().causal(true))?;
    let keys = |a: &Tensor, step: &Tensor| Tensor::cat(&[&a.unsqueeze(0)?, &step.i(0..1)?], 1);
    let expect = attention_slow(
        &q.i(0..1)?,
        &keys(&k_new, &k1)?,
        &keys(&v_new, &v1)?,
        1.0 / (d as f32).sqrt(),
        true,
    )?;
    assert_close("fragmented pool", &out.i(0..1)?, &expect, F32_TOL)
}

/// One appending call over pages `(num_pages, 4, 1, 8)` with `table` (2 rows of `max_pages`):
/// the error message, or None when it ran. The pool is checked unchanged on error.
fn append_with_table(table: &[u32], max_pages: usize, lens: &[u32]) -> Result<Option<String>> {
    let (ps, hk, d) = (4, 1, 8);
    let pages = randn((4, ps, hk, d), DType::F32)?;
    let before = pages.flatten_all()?.to_vec1::<f32>()?;
    let (v_pages, q) = (pages.copy()?, randn((2, 1, 2, d), DType::F32)?);
    let new = randn((2, 1, hk, d), DType::F32)?;
    let opts = FlashAttn::new().causal(true);
    let r = flash_attn_with_paged_kvcache(
        &q,
        &pages,
        &v_pages,
        Some((&new, &new)),
        lens,
        table,
        max_pages,
        &opts,
    );
    match r {
        Ok(_) => Ok(None),
        Err(e) => {
            assert_eq!(
                pages.flatten_all()?.to_vec1::<f32>()?,
                before,
                "written on error"
            );
            Ok(Some(e.to_string()))
        }
    }
}

#[test]
fn appends_never_write_a_shared_page() -> Result<()> {
    let shared = "appended pages must not be shared";
    // Two sequences given the same page.
    let e = append_with_table(&[2, 0, 2, 0], 2, &[0, 0])?.expect("same page accepted");
    assert!(e.contains(shared) && e.contains("page 2"), "{e}");
    // A shared prefix page, partly filled, that both sequences append to.
    let e = append_with_table(&[1, 0, 1, 0], 2, &[2, 2])?.expect("shared partial page accepted");
    assert!(e.contains(shared), "{e}");
    // The unallocated zero entries of PagedKvCache::block_table(): sequence 1 holds nothing,
    // so its row is zeros, and its append would land in sequence 0's page 0.
    let mut cache = PagedKvCache::new(2, 4, 4, 2, 1, 8, DType::F32, &Device::Cpu)?;
    let k = randn((3, 1, 8), DType::F32)?;
    cache.append_varlen(&k, &k, &[3, 0])?;
    assert_eq!(cache.block_table(), &[0, 0, 0, 0]);
    let table = cache.block_table().to_vec();
    let e = append_with_table(&table, 2, &[3, 0])?.expect("zero entries accepted");
    assert!(e.contains("entry [1, 0]") || e.contains("[1, 0]"), "{e}");
    // A full prefix page read by both, each appending to its own page: allowed.
    assert_eq!(append_with_table(&[0, 1, 0, 2], 2, &[4, 4])?, None);
    // PagedKvCache's own calls keep working (its tables never alias).
    let q = randn((2, 1, 2, 8), DType::F32)?;
    let kn = randn((2, 1, 1, 8), DType::F32)?;
    cache.append_and_attend(&q, &kn, &kn, &FlashAttn::new().causal(true))?;
    assert_eq!(cache.lengths(), &[4, 1]);
    Ok(())
}

#[test]
fn constructors_reject_what_the_first_call_would() {
    let cpu = &Device::Cpu;
    let kv = |hk, d, dt| {
        KvCache::new(2, 16, hk, d, dt, cpu)
            .map(|_| ())
            .map_err(|e| e.to_string())
    };
    let paged = |ps, mp, hk, d, dt| {
        PagedKvCache::new(2, 8, ps, mp, hk, d, dt, cpu)
            .map(|_| ())
            .map_err(|e| e.to_string())
    };
    for (r, needle) in [
        (kv(0, 64, DType::F32), "num_heads_k: must be > 0"),
        (kv(2, 0, DType::F32), "head_dim: must be in 1..=256, got 0"),
        (
            kv(2, 264, DType::F32),
            "head_dim: must be in 1..=256, got 264",
        ),
        (kv(2, 64, DType::F64), "dtype: F64 is not supported"),
        (kv(2, 64, DType::U32), "dtype: U32 is not supported"),
        (paged(4, 2, 0, 64, DType::F32), "num_heads_k: must be > 0"),
        (
            paged(4, 2, 2, 300, DType::BF16),
            "head_dim: must be in 1..=256",
        ),
        (paged(4, 2, 2, 64, DType::F64), "dtype: F64"),
        (paged(1 << 40, 1 << 40, 2, 64, DType::F32), "overflows"),
    ] {
        let e = r.expect_err(needle);
        assert!(e.contains(needle), "{e:?} lacks {needle:?}");
    }
    // Sizes whose product does not fit in memory are an error, not an aborted allocation.
    let e = KvCache::new(1 << 20, u32::MAX as usize, 1 << 10, 256, DType::F32, cpu)
        .expect_err("absurd size")
        .to_string();
    assert!(e.contains("does not fit in memory"), "{e}");
}

/// "On error nothing is written": a failure injected where an out-of-memory or a failed
/// launch could strike (between the K and V appends, at the attention, inside a ragged
/// append) leaves the lengths and the free pages as they were, and a retry gives exactly what
/// one successful call gives on a twin cache (no token appended twice), now and at the next
/// step.
#[test]
fn injected_failures_write_nothing() -> Result<()> {
    let (h, hk, d) = (4, 2, 16);
    let lens = [5usize, 0, 16, 33];
    let total: usize = lens.iter().sum();
    let bits =
        |t: &Tensor| -> Result<Vec<u32>> { Ok(to_vec(t)?.into_iter().map(f32::to_bits).collect()) };
    for layout in [Layout::Contiguous, Layout::Paged(16), Layout::Paged(3)] {
        let prefill = [
            randn((total, hk, d), DType::F32)?,
            randn((total, hk, d), DType::F32)?,
        ];
        let [q, k, v] = step(lens.len(), 2, h, hk, d)?;
        let [q2, k2, v2] = step(lens.len(), 1, h, hk, d)?;
        for point in [
            "kvcache: between the K and V appends",
            "kvcache: attention",
            "append_varlen: between K and V",
        ] {
            let tag = format!("{layout:?}, failure at {point:?}");
            let mut failing = AnyCache::new(layout, lens.len(), 48, hk, d)?;
            let mut twin = AnyCache::new(layout, lens.len(), 48, hk, d)?;
            let ragged = point.starts_with("append_varlen");
            if !ragged {
                failing.append_varlen(&prefill[0], &prefill[1], &lens)?;
                twin.append_varlen(&prefill[0], &prefill[1], &lens)?;
            }
            let (lengths, free) = (failing.lengths(), failing.free_pages());
            candle_flash::inject_failure(Some(point));
            let result = if ragged {
                failing.append_varlen(&prefill[0], &prefill[1], &lens)
            } else {
                failing.step(&q, &k, &v).map(|_| ())
            };
            candle_flash::inject_failure(None);
            match result {
                Err(e) if e.to_string().contains("injected failure") => {}
                other => panic!("{tag}: expected the injected error, got {other:?}"),
            }
            assert_eq!(failing.lengths(), lengths, "{tag}: lengths changed");
            assert_eq!(failing.free_pages(), free, "{tag}: pages taken");
            if ragged {
                failing.append_varlen(&prefill[0], &prefill[1], &lens)?;
                twin.append_varlen(&prefill[0], &prefill[1], &lens)?;
            } else {
                let retried = failing.step(&q, &k, &v)?;
                let once = twin.step(&q, &k, &v)?;
                assert_eq!(bits(&retried)?, bits(&once)?, "{tag}: the retry differs");
            }
            assert_eq!(
                failing.lengths(),
                twin.lengths(),
                "{tag}: lengths after the retry"
            );
            let next = failing.step(&q2, &k2, &v2)?;
            let next_twin = twin.step(&q2, &k2, &v2)?;
            assert_eq!(
                bits(&next)?,
                bits(&next_twin)?,
                "{tag}: the next step differs"
            );
        }
    }
    Ok(())
}

/// New keys or values that are views of a cache (each of the four pairings, contiguous and
/// paged, and the ragged append) are refused before anything is written, with an error naming
/// both: the caches stay bitwise as they were. Candle's own refusal came after the first
/// cache was already written, and named no argument.
#[test]
fn new_kv_viewing_a_cache_is_refused_before_any_write() -> Result<()> {
    let (b, cap, hk, d) = (2, 8, 1, 8);
    let q = randn((b, 1, 2, d), DType::F32)?;
    let lens = [3u32, 3];
    let bits =
        |t: &Tensor| -> Result<Vec<u32>> { Ok(to_vec(t)?.into_iter().map(f32::to_bits).collect()) };
    for paged in [false, true] {
        let (kn, vn) = if paged {
            ("k_pages", "v_pages")
        } else {
            ("k_cache", "v_cache")
        };
        for (which_new, which_cache) in [(0, 0), (0, 1), (1, 0), (1, 1)] {
            let caches = [
                randn((b, cap, hk, d), DType::F32)?,
                randn((b, cap, hk, d), DType::F32)?,
            ];
            let before = [bits(&caches[0])?, bits(&caches[1])?];
            let view = caches[which_cache].narrow(1, 6, 1)?;
            let fresh = randn((b, 1, hk, d), DType::F32)?;
            let new = if which_new == 0 {
                [view, fresh]
            } else {
                [fresh, view]
            };
            let opts = FlashAttn::new();
            let result = if paged {
                // Pages 0..cap/4 of 4 rows: the caches double as page pools of 2 * 2 pages.
                let pages = |c: &Tensor| c.reshape((b * 2, cap / 2, hk, d));
                let table = [0u32, 1, 2, 3];
                flash_attn_with_paged_kvcache(
                    &q,
                    &pages(&caches[0])?,
                    &pages(&caches[1])?,
                    Some((&new[0], &new[1])),
                    &lens,
                    &table,
                    2,
                    &opts,
                )
            } else {
                flash_attn_with_kvcache(
                    &q,
                    &caches[0],
                    &caches[1],
                    Some((&new[0], &new[1])),
                    &lens,
                    &opts,
                )
            };
            let new_name = ["k_new", "v_new"][which_new];
            let cache_name = [kn, vn][which_cache];
            let tag = format!("paged={paged}: {new_name} a view of {cache_name}");
            let e = result.expect_err(&tag).to_string();
            assert!(
                e.starts_with(new_name) && e.contains(cache_name),
                "{tag}: {e}"
            );
            assert_eq!(bits(&caches[0])?, before[0], "{tag}: {kn} written");
            assert_eq!(bits(&caches[1])?, before[1], "{tag}: {vn} written");
        }
    }
    for layout in [Layout::Contiguous, Layout::Paged(4)] {
        let mut cache = AnyCache::new(layout, b, cap, hk, d)?;
        let (k, v) = (
            randn((5, hk, d), DType::F32)?,
            randn((5, hk, d), DType::F32)?,
        );
        cache.append_varlen(&k, &v, &[3, 2])?;
        let (ck, cv) = match &cache {
            AnyCache::Flat(c) => (c.k().clone(), c.v().clone()),
            AnyCache::Paged(c) => (c.k().clone(), c.v().clone()),
        };
        let before = (bits(&ck)?, bits(&cv)?, cache.lengths());
        let view = cv.flatten_to(1)?.narrow(0, 0, 2)?;
        let fresh = randn((2, hk, d), DType::F32)?;
        let e = cache
            .append_varlen(&fresh, &view, &[1, 1])
            .expect_err("a view of the values")
            .to_string();
        assert!(
            e.starts_with("v_new") && e.contains("values"),
            "{layout:?}: {e}"
        );
        let after = (bits(&ck)?, bits(&cv)?, cache.lengths());
        assert!(after == before, "{layout:?}: the cache changed");
    }
    Ok(())
}

/// A `max_pages` so large that `batch * max_pages` wraps around to the table's length is an
/// error naming the block table, not an out-of-bounds index.
#[test]
fn absurd_max_pages_is_an_error() -> Result<()> {
    let (b, hk, d) = (2, 1, 8);
    let q = randn((b, 1, 2, d), DType::F32)?;
    let pages = randn((4, 4, hk, d), DType::F32)?;
    for (table, max_pages) in [(vec![], 1usize << 63), (vec![0u32, 1], (1usize << 63) + 1)] {
        let e = flash_attn_with_paged_kvcache(
            &q,
            &pages,
            &pages.copy()?,
            None,
            &[1, 1],
            &table,
            max_pages,
            &FlashAttn::new(),
        )
        .expect_err("absurd max_pages")
        .to_string();
        assert!(e.starts_with("block_table:"), "{e}");
    }
    Ok(())
}
