//! The decoding step as a CUDA graph (issue 56): captured once per batch size, then replayed.
//!
//! An eager step at the LLaMA-3.2-1B shape costs more host time than device time: a dozen
//! launches per layer, uploads of the positions and cache lengths, allocations. A graph
//! replays the whole step in one launch. What that takes:
//!
//! - every input in a static device tensor, refilled in place before a replay: the tokens
//!   `(b,)` u32 and the cache lengths `(b,)` u32, which are also the positions (the rotary
//!   tables are gathered by them) and which the attention reads on the device
//!   ([`candle_flash::CacheSeqlens`]); for a paged cache, a block table that gives each
//!   sequence its whole capacity up front, so that it never changes while decoding;
//! - every output written into a static tensor inside the graph: the argmax of the logits
//!   into the tokens tensor (greedy), or the logits into a static `(b, vocab)` f32 tensor (the
//!   host samples); and the lengths advanced in the graph. A greedy replay needs no host
//!   input at all; the host reads the new tokens (one small copy, which also tells it when to
//!   stop) and advances its mirror of the lengths ([`Cache::advance`]);
//! - nothing in the step uploads, reads back or synchronises; its temporaries are allocated
//!   and freed inside the capture (graph memory nodes), which `candle_flash::graph` keeps out
//!   of the way of the kernels' programmatic launches;
//! - one eager step of the same batch size first: kernel modules load, cuBLAS initialises,
//!   the crate's decode counters are allocated, and Candle caches the small layout uploads of
//!   its strided ops (`enable_cuda_graph_htod_cache`), which the capture then copies on the
//!   device.
//!
//! A graph holds the addresses of the tensors it was captured with, so [`Graphs`] keeps one
//! cache per batch size from one generation to the next (emptied, not reallocated).
//!
//! `--no-cuda-graph` runs this same device step without capturing it (the same kernels, and
//! the attention's split planned from the cache capacity either way), so greedy tokens with
//! and without graphs are identical (scripts/model/llama-gpu.sh checks). The host-length step
//! ([`super::generate::Eager`], the CPU's) plans the split from the longest sequence and
//! rotates with Candle's kernel instead of inside the cache append: it may part from the
//! device step after a near-tie.

use std::collections::HashMap;

use anyhow::{Context, Result};
use candle::{DType, Device, Tensor};

use super::generate::{StepOut, Stepper, Want};
use super::model::{Cache, CacheLayout, DeviceStep, Llama};

/// One batch size's decoding step over one cache, with static inputs and outputs: run
/// eagerly first, then captured and replayed (or, without capture, run eagerly every time:
/// the CPU, and the `--no-capture` diagnosis).
pub struct StepGraph {
    /// `(b,)` u32: the tokens the step embeds; a greedy step writes the next ones here.
    ids: Tensor,
    /// The lengths `(b,)` (advanced by the step) and a paged cache's block table.
    inputs: DeviceStep,
    /// `(b, vocab)` f32: the step's logits, when the host wants them.
    logits: Option<Tensor>,
    /// Whether the step writes the argmax of its logits into `ids`.
    greedy: bool,
    /// Whether `ids` holds the tokens of the next step (written by the last greedy one).
    ids_current: bool,
    capture: bool,
    state: State,
}

enum State {
    /// The next step runs eagerly, as the warm-up of a capture.
    Cold,
    /// Warmed up: the next step is captured (and then launched).
    Warm,
    #[cfg(feature = "cuda")]
    Captured(candle_flash::graph::CapturedGraph),
}

impl StepGraph {
    /// Static tensors for the steps over `cache`, filled from it ([`StepGraph::start`]).
    /// `want`: greedy writes the argmax into the tokens tensor, logits into a static output.
    pub fn new(model: &Llama, cache: &Cache, want: Want, capture: bool) -> Result<Self> {
        let dev = model.device();
        let b = cache.lengths().len();
        let table = match cache.full_block_table()? {
            Some((_, pages)) => Some(Tensor::zeros((b, pages), DType::U32, dev)?),
            None => None,
        };
        let vocab = model.config().vocab_size;
        let mut graph = Self {
            ids: Tensor::zeros(b, DType::U32, dev)?,
            inputs: DeviceStep {
                lengths: Tensor::zeros(b, DType::U32, dev)?,
                table,
            },
            logits: match want.logits || !want.greedy {
                true => Some(Tensor::zeros((b, vocab), DType::F32, dev)?),
                false => None,
            },
            greedy: want.greedy,
            ids_current: false,
            capture: capture && dev.is_cuda(),
            state: State::Cold,
        };
        graph.start(cache)?;
        Ok(graph)
    }

    /// Whether this graph gives back what `want` asks for.
    pub fn serves(&self, want: Want) -> bool {
        self.greedy == want.greedy && (self.logits.is_some() || !want.logits)
    }

    /// The lengths (and the paged block table) of `cache`, for the next generation's steps;
    /// the tokens are given to the first step.
    pub fn start(&mut self, cache: &Cache) -> Result<()> {
        let dev = self.ids.device().clone();
        let lengths: Vec<u32> = cache.lengths().iter().map(|&l| l as u32).collect();
        self.inputs
            .lengths
            .slice_set(&Tensor::new(lengths, &dev)?, 0, 0)?;
        if let (Some(table), Some((host, pages))) = (&self.inputs.table, cache.full_block_table()?)
        {
            let b = cache.lengths().len();
            table.slice_set(&Tensor::from_vec(host, (b, pages), &dev)?, 0, 0)?;
        }
        self.ids_current = false;
        Ok(())
    }

    /// The step itself, every output written into the static tensors: what is captured.
    fn body(&self, model: &Llama, cache: &mut Cache) -> candle::Result<()> {
        let hidden = model.forward_step_device(&self.ids, &self.inputs, cache)?;
        // The greedy choice from the logits as the LM head gives them (no f32 copy).
        let logits = model.logits_raw(&hidden)?;
        if self.greedy {
            self.ids
                .slice_set(&candle_flash::infer::argmax(&logits)?, 0, 0)?;
        }
        if let Some(out) = &self.logits {
            out.slice_set(&logits.to_dtype(DType::F32)?, 0, 0)?;
        }
        let lengths = &self.inputs.lengths;
        lengths.slice_set(&(lengths + 1.0)?, 0, 0)
    }

    /// One decoding step of the tokens `ids` (uploaded unless the last greedy step wrote
    /// them): the first eagerly, the second captured and launched, the next replayed.
    /// Advances the cache's host lengths.
    pub fn step(&mut self, model: &Llama, cache: &mut Cache, ids: &[u32]) -> Result<()> {
        model.check_step(&self.ids, cache)?;
        if !(self.greedy && self.ids_current) {
            self.ids
                .slice_set(&Tensor::new(ids, self.ids.device())?, 0, 0)?;
        }
        match std::mem::replace(&mut self.state, State::Cold) {
            State::Cold => {
                with_upload_cache(model.device(), || self.body(model, cache))?;
                if self.capture {
                    self.state = State::Warm;
                }
            }
            #[cfg(feature = "cuda")]
            State::Warm => {
                let graph = self.capture(model, cache)?;
                graph
                    .launch()
                    .context("launching the decoding step's graph")?;
                self.state = State::Captured(graph);
            }
            #[cfg(not(feature = "cuda"))]
            State::Warm => unreachable!("capture needs the cuda feature"),
            #[cfg(feature = "cuda")]
            State::Captured(graph) => {
                graph.launch().context("replaying the decoding step")?;
                self.state = State::Captured(graph);
            }
        }
        cache.advance();
        self.ids_current = self.greedy;
        Ok(())
    }

    /// Records [`StepGraph::body`] into a graph, in the stream Candle launches on (the
    /// per-thread default stream, which may be captured). Nothing runs: launch it. The
    /// crate's capture keeps the kernels' programmatic launches, which the step's memory
    /// nodes would otherwise break (`candle_flash::graph`).
    #[cfg(feature = "cuda")]
    fn capture(
        &self,
        model: &Llama,
        cache: &mut Cache,
    ) -> Result<candle_flash::graph::CapturedGraph> {
        let cuda = model.device().as_cuda_device()?;
        let _uploads = cuda.enable_cuda_graph_htod_cache();
        let hint = "capturing the decoding step in a CUDA graph (--no-cuda-graph decodes eagerly)";
        // The body's temporaries are freed when it returns: inside the capture.
        let (graph, ()) =
            candle_flash::graph::CapturedGraph::capture(model.device(), || self.body(model, cache))
                .context(hint)?;
        Ok(graph)
    }

    /// The tokens the last (greedy) step chose: one small copy to the host.
    pub fn ids(&self) -> Result<Vec<u32>> {
        Ok(self.ids.to_vec1::<u32>()?)
    }

    /// The last step's logits `(b, vocab)` f32, copied (the static tensor is rewritten by the
    /// next step).
    pub fn logits(&self) -> Result<Option<Tensor>> {
        Ok(self.logits.as_ref().map(Tensor::copy).transpose()?)
    }
}

/// Runs `f` with Candle's cache of small host-to-device copies on (the dims and strides of
/// strided ops), as the warm-up step must, so that the captured step finds them on the device.
fn with_upload_cache<R>(dev: &Device, f: impl FnOnce() -> R) -> R {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(d) = dev {
        let _uploads = d.enable_cuda_graph_htod_cache();
        return f();
    }
    let _ = dev;
    f()
}

/// The [`Stepper`] of graph mode: one cache and one [`StepGraph`] per batch size, kept from
/// one generation to the next (a graph holds its cache's addresses).
pub struct Graphs {
    capture: bool,
    /// Each cache holds at least this many tokens per sequence, so that generations of other
    /// lengths (a warm-up, then the timed run) share one capture.
    min_capacity: usize,
    slots: HashMap<usize, Slot>,
    /// The batch size of the current generation.
    batch: usize,
}

struct Slot {
    cache: Cache,
    layout: CacheLayout,
    graph: Option<StepGraph>,
    /// Whether the current generation made its first step.
    started: bool,
}

impl Graphs {
    /// Graphs captured on CUDA (`capture`); the same steps run eagerly otherwise (the CPU,
    /// or to tell a capture problem from the device step's own behaviour).
    pub fn new(capture: bool, min_capacity: usize) -> Self {
        Self {
            capture,
            min_capacity,
            slots: HashMap::new(),
            batch: 0,
        }
    }
}

impl Stepper for Graphs {
    fn name(&self) -> &'static str {
        match self.capture {
            true => "CUDA graph",
            false => "device step",
        }
    }

    fn cache(
        &mut self,
        model: &Llama,
        batch: usize,
        capacity: usize,
        layout: CacheLayout,
    ) -> Result<&mut Cache> {
        let capacity = capacity.max(self.min_capacity);
        self.batch = batch;
        let reuse = self
            .slots
            .get(&batch)
            .is_some_and(|s| s.layout == layout && s.cache.capacity() >= capacity);
        if !reuse {
            self.slots.remove(&batch); // its graph and cache go before the new ones come
            let cache = Cache::new(
                model.config(),
                model.attn_impl(),
                layout,
                batch,
                capacity,
                model.kv_cache_dtype(),
                model.device(),
            )?;
            let slot = Slot {
                cache,
                layout,
                graph: None,
                started: false,
            };
            self.slots.insert(batch, slot);
        }
        let slot = self.slots.get_mut(&batch).context("no slot")?;
        slot.cache.reset();
        slot.started = false;
        Ok(&mut slot.cache)
    }

    fn step(&mut self, model: &Llama, ids: &[u32], want: Want) -> Result<StepOut> {
        let capture = self.capture;
        let slot = self
            .slots
            .get_mut(&self.batch)
            .context("a step before the cache was made")?;
        let graph = match &mut slot.graph {
            Some(g) if g.serves(want) => {
                if !slot.started {
                    g.start(&slot.cache)?;
                }
                g
            }
            other => other.insert(StepGraph::new(model, &slot.cache, want, capture)?),
        };
        slot.started = true;
        graph.step(model, &mut slot.cache, ids)?;
        Ok(StepOut {
            logits: graph.logits()?,
            ids: match want.greedy {
                true => Some(graph.ids()?),
                false => None,
            },
        })
    }
}

/// The device's copy bandwidth in GB/s: bytes read + written by device-to-device copies of a
/// 2 GiB buffer (the benches' measure, benches/attention/), the median of 5 timings of 4
/// copies. `None` on the CPU.
pub fn copy_bandwidth(dev: &Device) -> Result<Option<f64>> {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(d) = dev {
        const ELEMS: usize = 1 << 30; // u16: 2 GiB
        let stream = d.cuda_stream();
        let src = stream.alloc_zeros::<u16>(ELEMS)?;
        let mut dst = stream.alloc_zeros::<u16>(ELEMS)?;
        stream.memcpy_dtod(&src, &mut dst)?;
        stream.synchronize()?;
        let mut ms = Vec::new();
        for _ in 0..5 {
            let t = std::time::Instant::now();
            for _ in 0..4 {
                stream.memcpy_dtod(&src, &mut dst)?;
            }
            stream.synchronize()?;
            ms.push(t.elapsed().as_secs_f64() * 1e3 / 4.0);
        }
        ms.sort_by(f64::total_cmp);
        let bytes = 2.0 * (ELEMS * 2) as f64;
        return Ok(Some(bytes / (ms[2] * 1e-3) / 1e9));
    }
    let _ = dev;
    Ok(None)
}
