//! GPU tests for `deterministic(true)` backwards. On Hopper without a block mask they run the
//! warp-specialized kernel's deterministic mode (`_mods` under a softcap or ALiBi), where the
//! key blocks that see a query tile add their dQ into it one at a time, from the last
//! (cuda/sm90/dq_tile_state.cuh; at head dims 193-256 the consumers add from registers, in turns
//! taken by a warp of their own); elsewhere the separate dK/dV and dQ kernels. The shapes make
//! tiles whose sets of key blocks differ: causal with seqlen_q above and below seqlen_k (the
//! first query tiles see no key at all), windows (the first block of a tile is not block 0),
//! GQA (a block adds into every head of its group), packed batches, dropout, softcap and
//! ALiBi, and more key blocks than the GPU has SMs (blocks wait for blocks that started in an
//! earlier wave).

use candle::{DType, Device, Result, Tensor};
use candle_flash::{attention_slow_with, FlashAttn};

use crate::cuda_suite::{
    check_against_slow, check_varlen_against_slow, grads_of, randn, reference_device, tensors_bits,
    Suite,
};

/// One fixed-length problem: (batch, seqlen_q, seqlen_k, heads, KV heads, head dim).
#[derive(Clone, Copy, Debug)]
struct Shape {
    dtype: DType,
    dims: (usize, usize, usize, usize, usize, usize),
    causal: bool,
    /// FlashAttention 2's `window_size`.
    window: (i64, i64),
    dropout: f32,
    /// 0: none.
    softcap: f32,
    /// ALiBi slopes, one per head.
    alibi: bool,
}

impl std::fmt::Display for Shape {
    fn fmt(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        let (b, sq, sk, h, hk, d) = self.dims;
        write!(
            f,
            "{:?} b={b} sq={sq} sk={sk} h={h}/{hk} d={d} causal={} window={:?} dropout={} \
             softcap={} alibi={}",
            self.dtype, self.causal, self.window, self.dropout, self.softcap, self.alibi
        )
    }
}

impl Shape {
    fn opts(&self, dev: &Device) -> Result<FlashAttn> {
        let mut attn = FlashAttn::new()
            .causal(self.causal)
            .window_size(self.window.0, self.window.1)
            .deterministic(true);
        if self.dropout > 0.0 {
            attn = attn.dropout(self.dropout).seed(5).rng_offset(3);
        }
        if self.softcap > 0.0 {
            attn = attn.softcap(self.softcap);
        }
        if self.alibi {
            let h = self.dims.3;
            let slopes: Vec<f32> = (1..=h)
                .map(|i| 2f32.powf(-8.0 * i as f32 / h as f32))
                .collect();
            attn = attn.alibi_slopes(&Tensor::from_vec(slopes, h, dev)?);
        }
        Ok(attn)
    }
}

/// The bits of the output and the three gradients, in one vector.
fn bits(out: &Tensor, grads: &[Tensor; 3]) -> Result<Vec<u32>> {
    tensors_bits(std::iter::once(out).chain(grads))
}

/// `runs` forward+backward calls give the same bits; without dropout the gradients also pass
/// the 3x rule against the oracle.
fn repeatable(dev: &Device, s: Shape, runs: usize) -> Result<()> {
    let (b, sq, sk, h, hk, d) = s.dims;
    let q = randn((b, sq, h, d), s.dtype, dev)?;
    let k = randn((b, sk, hk, d), s.dtype, dev)?;
    let v = randn((b, sk, hk, d), s.dtype, dev)?;
    let w = randn((b, sq, h, d), s.dtype, dev)?;
    let attn = s.opts(dev)?;
    let call = || -> Result<(Tensor, [Tensor; 3])> {
        let out = attn.forward(&q, &k, &v)?;
        Ok((
            out,
            grads_of(&q, &k, &v, &w, |q, k, v| attn.forward(q, k, v))?,
        ))
    };
    let (out, grads) = call()?;
    let first = bits(&out, &grads)?;
    for run in 1..runs {
        let (o, g) = call()?;
        if bits(&o, &g)? != first {
            candle::bail!("run {run} differs from run 0");
        }
    }
    if s.dropout > 0.0 {
        return Ok(());
    }
    // The oracle's options on its device (the CPU under --sanitize): the ALiBi slopes.
    let oracle = s.opts(&reference_device(dev))?;
    check_against_slow(&out, &grads, [&q, &k, &v, &w], |q, k, v| {
        attention_slow_with(q, k, v, &oracle)
    })
}

/// A packed batch (sequences of several key blocks, one shorter than a tile): repeatable, and
/// right against the per-sequence oracle.
fn repeatable_varlen(dev: &Device, d: usize, causal: bool, runs: usize) -> Result<()> {
    let (lens_q, lens_k) = ([700usize, 37, 1300], [900usize, 200, 1300]);
    let (h, hk) = (4, 2);
    let attn = FlashAttn::new().causal(causal).deterministic(true);
    let varlen = candle_flash::VarLen::from_seqlens(&lens_q, &lens_k)?;
    let (tq, tk): (usize, usize) = (lens_q.iter().sum(), lens_k.iter().sum());
    let q = randn((1, tq, h, d), DType::BF16, dev)?;
    let k = randn((1, tk, hk, d), DType::BF16, dev)?;
    let v = randn((1, tk, hk, d), DType::BF16, dev)?;
    let w = randn((1, tq, h, d), DType::BF16, dev)?;
    let call = || -> Result<Vec<u32>> {
        let grads = grads_of(&q, &k, &v, &w, |q, k, v| {
            attn.forward_varlen(&q.squeeze(0)?, &k.squeeze(0)?, &v.squeeze(0)?, &varlen)?
                .unsqueeze(0)
        })?;
        let out = attn.forward_varlen(&q.squeeze(0)?, &k.squeeze(0)?, &v.squeeze(0)?, &varlen)?;
        bits(&out, &grads)
    };
    let first = call()?;
    for run in 1..runs {
        if call()? != first {
            candle::bail!("run {run} differs from run 0");
        }
    }
    check_varlen_against_slow(dev, d, (h, hk), (&lens_q, &lens_k), &attn, |_, _, _| {
        Ok(FlashAttn::new().causal(causal))
    })
}

pub fn run(dev: &Device, quick: bool, suite: &mut Suite) {
    let runs = if quick { 2 } else { 4 };
    let plain = |dtype, dims, causal| Shape {
        dtype,
        dims,
        causal,
        window: (-1, -1),
        dropout: 0.0,
        softcap: 0.0,
        alibi: false,
    };
    let mut shapes = vec![
        plain(DType::BF16, (2, 1024, 1024, 4, 4, 64), true),
        plain(DType::F16, (2, 777, 901, 8, 2, 128), true),
        // The first 700 query rows see no key (bottom-right causal).
        plain(DType::BF16, (1, 1000, 300, 4, 1, 128), true),
        plain(DType::BF16, (2, 300, 1000, 4, 2, 64), false),
        // Head dims 40 and 96 on the d 64 and 128 kernels.
        plain(DType::F16, (1, 513, 515, 2, 2, 40), true),
        plain(DType::BF16, (1, 513, 515, 2, 1, 96), false),
        Shape {
            window: (200, 0),
            ..plain(DType::BF16, (2, 1100, 1100, 4, 2, 128), false)
        },
        Shape {
            window: (100, 300),
            ..plain(DType::F16, (1, 900, 1200, 2, 2, 64), false)
        },
        Shape {
            dropout: 0.15,
            ..plain(DType::BF16, (2, 600, 700, 4, 2, 64), true)
        },
        Shape {
            dropout: 0.1,
            ..plain(DType::BF16, (1, 500, 500, 4, 4, 128), false)
        },
        // The d 256 kernel (64 keys per block, dQ added from the consumers' registers).
        plain(DType::BF16, (2, 777, 901, 8, 2, 256), true),
        plain(DType::F16, (1, 1000, 300, 4, 1, 256), true),
        plain(DType::BF16, (1, 513, 515, 4, 2, 200), false),
        Shape {
            window: (150, 40),
            ..plain(DType::F16, (1, 900, 700, 2, 2, 256), false)
        },
        Shape {
            dropout: 0.1,
            ..plain(DType::BF16, (2, 600, 700, 4, 2, 256), true)
        },
        // The `_mods` kernels: softcap, ALiBi, both with a window.
        Shape {
            softcap: 30.0,
            ..plain(DType::BF16, (2, 600, 700, 8, 2, 128), true)
        },
        Shape {
            alibi: true,
            ..plain(DType::F16, (1, 500, 800, 4, 2, 64), false)
        },
        Shape {
            softcap: 20.0,
            alibi: true,
            window: (150, 0),
            ..plain(DType::BF16, (1, 500, 500, 4, 4, 256), false)
        },
    ];
    if !quick {
        // 4 x 2 KV heads x 64 key blocks (d 64, 128 keys each): 512 blocks, about four waves
        // on 132 SMs, pairs interleaved two at a time.
        shapes.push(plain(DType::BF16, (4, 2048, 8192, 8, 2, 64), true));
        // 157 key blocks in one pair: its chains span two waves.
        shapes.push(plain(DType::BF16, (1, 1024, 20000, 2, 1, 64), true));
        shapes.push(plain(DType::BF16, (2, 4096, 4096, 8, 4, 128), false));
        // 2 x 4 KV heads x 64 key blocks of 64 keys: 512 blocks at d 256.
        shapes.push(plain(DType::BF16, (2, 4096, 4096, 8, 4, 256), true));
    }
    for s in shapes {
        suite.record(&format!("deterministic bwd {s}"), repeatable(dev, s, runs));
    }
    for (d, causal) in [(64, true), (128, false), (256, true)] {
        suite.record(
            &format!("deterministic bwd packed d={d} causal={causal}"),
            repeatable_varlen(dev, d, causal, runs),
        );
    }
}
