//! # candle-flash
//!
//! FlashAttention-2 for [Candle](https://github.com/huggingface/candle): exact attention that
//! never materialises the `seqlen_q × seqlen_k` score matrix, with a forward **and** backward
//! pass, so Candle models can serve and train with it.
//!
//! - [`flash_attn`] / [`FlashAttn::forward`]: `(batch, seqlen, num_heads, head_dim)` tensors,
//!   causal masks aligned bottom-right, MQA/GQA by head indexing, differentiable.
//! - CUDA (feature `cuda`): hand-written tensor-core kernels for f16/bf16.
//! - CPU: the same op in f32 math (tiled online softmax), for f32/f16/bf16 inputs.
//! - [`attention_slow`]: the same function in plain Candle ops, the test oracle.
//!
//! ```
//! # fn main() -> candle::Result<()> {
//! use candle::{Device, Tensor, Var};
//! let dev = Device::Cpu;
//! let q = Var::randn(0f32, 1.0, (1, 128, 4, 64), &dev)?;
//! let k = Var::randn(0f32, 1.0, (1, 128, 4, 64), &dev)?;
//! let v = Var::randn(0f32, 1.0, (1, 128, 4, 64), &dev)?;
//! let out = candle_flash::flash_attn(&q, &k, &v, true)?;
//! let grads = out.sqr()?.sum_all()?.backward()?;
//! assert!(grads.get(&q).is_some());
//! # Ok(()) }
//! ```

mod bwd;
mod cpu;
#[cfg(feature = "cuda")]
mod cuda;
mod fwd;
mod options;
mod params;
#[cfg(feature = "cuda")]
mod ptx;
mod reference;

pub use options::{flash_attn, FlashAttn};
pub use params::MAX_HEAD_DIM;
pub use reference::attention_slow;
