//! Building blocks of a decoding step beside the attention: at a few tokens a step is a read
//! of the model's weights, and what costs is how well each matrix product streams them
//! and how many launches there are between them.
//!
//! - [`linear`]: `x @ weight^T`, optionally `+ add` (the residual stream), for the few rows
//!   of a decoding step: every warp streams whole weight rows (bf16/f16 on CUDA; one to four
//!   rows on the CUDA cores, five to sixteen on tensor cores with the weight as the 16-row
//!   operand), where a GEMM tiles the rows in and leaves much of a small matrix's bandwidth
//!   unused. Other shapes, and anything that tracks gradients, go to Candle's matmul, so it
//!   is a drop-in for a linear layer's forward.
//! - [`linear_swiglu`]: `silu(x @ gate^T) * (x @ up^T)` from one stacked `[gate; up]` weight
//!   in the same pass.
//! - [`rms_norm_linear`], [`rms_norm_linear_swiglu`]: the same after an RMSNorm of x, which
//!   at up to sixteen rows each block computes itself (one launch where there were two).
//! - [`argmax`]: each row's first largest element (greedy decoding over a vocabulary in one
//!   launch).
//!
//! The fused residual add and norm around them is [`crate::train::add_rms_norm`].
//!
//! ```
//! # fn main() -> candle::Result<()> {
//! use candle::{DType, Device, Tensor};
//! let dev = Device::Cpu;
//! let x = Tensor::randn(0f32, 1.0, (1, 64), &dev)?;
//! let w = Tensor::randn(0f32, 1.0, (32, 64), &dev)?;
//! let h = Tensor::zeros((1, 32), DType::F32, &dev)?;
//! let y = candle_flash::infer::linear(&x, &w, Some(&h))?;
//! let gu = Tensor::randn(0f32, 1.0, (2 * 16, 64), &dev)?;
//! let act = candle_flash::infer::linear_swiglu(&x, &gu)?;
//! assert_eq!((y.dims(), act.dims()), ([1, 32].as_slice(), [1, 16].as_slice()));
//! let next = candle_flash::infer::argmax(&y)?;
//! assert_eq!(next.dims(), [1].as_slice());
//! # Ok(()) }
//! ```

mod argmax;
mod linear;

pub use argmax::argmax;
pub use linear::{
    fused_max_rows, linear, linear_swiglu, rms_norm_linear, rms_norm_linear_swiglu, GEMV_MAX_ROWS,
    LINEAR_MAX_ROWS,
};
