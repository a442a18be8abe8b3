//! Fused training layers with their backward passes: what a LLaMA-style model needs around
//! the attention so that a Candle training step is not dominated by element-wise work.
//!
//! In a Candle training graph every op costs its own kernel and, in the backward, a zeroed
//! gradient buffer plus an addition per input. Written op by op, RMSNorm, rotary embeddings,
//! SwiGLU, the embedding lookup (whose `index_select` backward is a slow `index_add`) and
//! the cross-entropy make up most of a step's time (docs/archive/PERF.md has the profile). Each
//! function here is one op with a hand-written backward, on CUDA (kernels in `cuda/train/train.cu`)
//! and on the CPU (f32 arithmetic), and computes in f32 whatever the storage dtype:
//!
//! - [`rms_norm`]: `x * rsqrt(mean(x^2) + eps) * weight`, gradients for both (the weight's
//!   summed over rows in a fixed order); [`add_rms_norm`]: the residual add before it, fused
//!   (both results from one kernel).
//! - [`rotary`]: rotary position embedding of `(tokens, heads, head_dim)` (LLaMA's halves).
//! - [`swiglu`]: `silu(gate) * up`, the halves of a fused gate-and-up projection read in place.
//! - [`embedding`]: rows of a table gathered in another dtype, a scatter-add backward;
//!   [`embedding_deterministic`] sums each id's rows in row order (bitwise repeatable).
//! - [`cross_entropy`] / [`cross_entropy_rows`]: from logits in any float dtype, no softmax
//!   stored; targets equal to [`IGNORE`] are left out.
//! - [`AdamW`]: the optimiser in two fused passes per variable, state readable for
//!   checkpoints (a copy; a failed update or restore changes nothing), gradient clipping
//!   folded into the update ([`sum_squares`] for the norm, summed in a fixed order).
//! - [`retain_freed_device_memory`]: CUDA's memory pool keeps what a step frees for the next
//!   one, as PyTorch's caching allocator does (10-20 ms per step of a 150M model, H100).
//!
//! ```
//! # fn main() -> candle::Result<()> {
//! use candle::{Device, Tensor, Var, D};
//! let dev = Device::Cpu;
//! let x = Var::randn(0f32, 1.0, (6, 16), &dev)?;
//! let w = Var::ones(16, candle::DType::F32, &dev)?;
//! let y = candle_flash::train::rms_norm(&x, &w, 1e-5)?;
//! let grads = y.sqr()?.sum_all()?.backward()?;
//! assert!(grads.get(&x).is_some() && grads.get(&w).is_some());
//! # Ok(()) }
//! ```

mod adamw;
mod adamw_ops;
mod adamw_state;
mod add_rms_norm;
mod cross_entropy;
mod embedding;
mod host;
// Also the launch path of `crate::combine`'s kernel, which lives in their catalogue.
#[cfg(feature = "cuda")]
pub(crate) mod kernels;
#[cfg(feature = "cuda")]
pub(crate) mod launch;
mod pool;
pub(crate) mod rms_norm;
mod rotary;
// The attention sinks' kernels live in the training module and its catalogue.
#[cfg(feature = "cuda")]
pub(crate) mod sinks;
mod swiglu;

pub use adamw::{sum_squares, AdamW};
pub use add_rms_norm::add_rms_norm;
pub use cross_entropy::{cross_entropy, cross_entropy_rows, IGNORE};
pub use embedding::{embedding, embedding_deterministic};
pub use pool::retain_freed_device_memory;
pub use rms_norm::rms_norm;
pub use rotary::rotary;
pub use swiglu::swiglu;
