//! The options type: one configuration for every attention entry point.

use candle::{Result, Tensor};

use crate::fwd::FlashAttnOp;
use crate::params::{self, Problem};

/// FlashAttention options. Build with [`FlashAttn::new`] and the builder methods, then call
/// [`FlashAttn::forward`].
///
/// ```
/// # fn main() -> candle::Result<()> {
/// use candle::{Device, Tensor};
/// let dev = Device::Cpu;
/// let q = Tensor::randn(0f32, 1.0, (2, 16, 8, 64), &dev)?; // (batch, seqlen_q, heads, head_dim)
/// let k = Tensor::randn(0f32, 1.0, (2, 32, 2, 64), &dev)?; // (batch, seqlen_k, heads_k, head_dim)
/// let v = Tensor::randn(0f32, 1.0, (2, 32, 2, 64), &dev)?;
/// let out = candle_flash::FlashAttn::new().causal(true).forward(&q, &k, &v)?;
/// assert_eq!(out.dims(), &[2, 16, 8, 64]);
/// # Ok(()) }
/// ```
#[derive(Clone, Debug, Default, PartialEq)]
#[non_exhaustive]
pub struct FlashAttn {
    /// Multiplies q·kᵀ before the softmax; `None` means `1 / sqrt(head_dim)`. Must be > 0.
    pub softmax_scale: Option<f32>,
    /// Causal mask aligned to the bottom-right corner: query `i` sees key `j` iff
    /// `j <= i + seqlen_k - seqlen_q`. Query rows that see no key output zeros.
    pub causal: bool,
    /// Makes the CUDA backward pass bitwise reproducible (no floating-point atomics), at some
    /// cost in speed. The forward pass and the CPU backward are always deterministic.
    pub deterministic: bool,
}

impl FlashAttn {
    /// Default options: scale `1 / sqrt(head_dim)`, no mask, non-deterministic backward.
    pub fn new() -> Self {
        Self::default()
    }

    /// Sets the causal (bottom-right aligned) mask.
    pub fn causal(mut self, causal: bool) -> Self {
        self.causal = causal;
        self
    }

    /// Sets the softmax scale (must be finite and > 0).
    pub fn softmax_scale(mut self, scale: f32) -> Self {
        self.softmax_scale = Some(scale);
        self
    }

    /// Asks for a bitwise reproducible backward pass.
    pub fn deterministic(mut self, deterministic: bool) -> Self {
        self.deterministic = deterministic;
        self
    }

    /// Exact attention `softmax(scale · q kᵀ + mask) v`.
    ///
    /// - `q`: `(batch, seqlen_q, num_heads, head_dim)`
    /// - `k`, `v`: `(batch, seqlen_k, num_heads_k, head_dim)`, `num_heads % num_heads_k == 0`
    ///   (MQA/GQA: query head `h` reads K/V head `h / (num_heads / num_heads_k)`).
    /// - dtypes: f16 or bf16 on CUDA; f32, f16 or bf16 on CPU (computed in f32). All three
    ///   tensors share dtype and device. Only the last dimension must be contiguous.
    /// - `head_dim` in `1..=256`; on CUDA a multiple of 8.
    ///
    /// Returns `(batch, seqlen_q, num_heads, head_dim)` in the input dtype. Differentiable:
    /// `backward()` through the result gives gradients for q, k and v. A seqlen of 0 gives an
    /// empty result; `seqlen_k == 0` gives zeros.
    ///
    /// Errors name the argument and the expected value (rank, shapes, dtypes, devices,
    /// head_dim, contiguity, scale).
    pub fn forward(&self, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Tensor> {
        Ok(self.forward_with_lse(q, k, v)?.0)
    }

    /// Like [`FlashAttn::forward`], also returning the row log-sum-exp of the scaled scores,
    /// `(batch, num_heads, seqlen_q)` in f32 (`-inf` for rows that see no key). The LSE is
    /// what merging partial attentions (split-KV, ring attention) needs. It carries no
    /// gradient.
    pub fn forward_with_lse(&self, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<(Tensor, Tensor)> {
        let shape = params::validate(q, k, v)?;
        let scale = self.softmax_scale.unwrap_or(1.0 / (shape.d as f32).sqrt());
        params::check_scale(scale)?;
        let problem = Problem {
            shape,
            scale,
            causal: self.causal,
        };
        FlashAttnOp::new(problem, self.deterministic).run(q, k, v)
    }
}

/// Exact attention with default options: `softmax(q kᵀ / sqrt(head_dim) + mask) v`.
///
/// Shapes `(batch, seqlen, num_heads, head_dim)`; see [`FlashAttn::forward`] for the
/// contract and errors. Works in training graphs (gradients for q, k and v).
pub fn flash_attn(q: &Tensor, k: &Tensor, v: &Tensor, causal: bool) -> Result<Tensor> {
    FlashAttn::new().causal(causal).forward(q, k, v)
}
