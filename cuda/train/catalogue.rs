//! The training kernels' catalogue: every kernel of `cuda/train/train.cu`, as the op it
//! computes and the element types it is instantiated for. It is the single source of truth
//! for what exists. From it build.rs (`build/train_catalogue.rs`) generates
//! - the instantiations (`OUT_DIR/instances/train.inc`, included at the end of `train.cu`):
//!   one line per kernel invoking the op's macro with the kernel's name and types;
//! - the host's table (`OUT_DIR/train_catalogue.rs`, included by `src/train/kernels.rs`):
//!   each kernel's op, dtypes and entry point name, which the launchers look up.
//!
//! Adding a kernel is one row here (a new op: plus its macro in `train.cu` and its name in
//! the generator).
//!
//! This file is plain data included by build.rs and by the crate: no dependencies.

/// What a kernel computes (its macro in `train.cu`, its header under `cuda/train/`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Op {
    /// RMSNorm forward, `(x, weight)` (`norm.cuh`).
    RmsFwd,
    /// Residual add then RMSNorm, both results, `(x, weight)` (`norm.cuh`).
    AddRmsFwd,
    /// RMSNorm backward: dx and per-block partial dweight, `(x, weight)`.
    RmsBwd,
    /// RMSNorm backward: the partial dweights summed in block order (f32, no dtype).
    RmsDw,
    /// Rotary embedding, either direction, `(x)` (`rotary.cuh`).
    Rotary,
    /// `silu(gate) * up`, `(x)` (`swiglu.cuh`).
    SwigluFwd,
    /// Its gradients for gate and up, `(x)`.
    SwigluBwd,
    /// Embedding rows gathered into another dtype, `(table, out)` (`embed.cuh`).
    EmbedFwd,
    /// The embedding's gradient, atomic scatter-add into f32, `(dy)`.
    EmbedBwd,
    /// The same summed per id in row order (deterministic), `(dy)`.
    EmbedBwdSorted,
    /// Cross-entropy loss and log-sum-exp per row, `(logits)` (`xent.cuh`).
    XentFwd,
    /// Its gradient for the logits, `(logits)`.
    XentBwd,
    /// AdamW's moments from a gradient, `(gradient)` (`adamw.cuh`).
    AdamwMoments,
    /// AdamW's update of the f32 weight from the moments (no dtype).
    AdamwApply,
    /// Partial sums of squares for the gradient norm, `(x)`.
    SumSquares,
    /// The merge of attentions over disjoint key sets from their (out, lse), `(parts, out)`
    /// (`combine.cuh`, src/combine.rs).
    Combine,
    /// A decoding step's few rows times a weight, `+ add` optional, `(x)` (`gemv.cuh`,
    /// src/infer/linear.rs).
    Gemv,
    /// The same with the SwiGLU of a stacked gate-and-up weight's two halves, `(x)`.
    GemvSwiglu,
    /// Five to sixteen rows on tensor cores, `(x)` (`gemv_mma.cuh`; its own kernel so that
    /// its registers do not lower the one-to-four-row kernel's occupancy).
    GemvMma,
    /// The same with the SwiGLU, `(x)`.
    GemvMmaSwiglu,
    /// Each row's index of its largest element, `(x)` (`argmax.cuh`, src/infer/argmax.rs).
    Argmax,
    /// The attention sinks' fix-up of the forward's (O, lse), in place, `(out)` (`sinks.cuh`,
    /// src/sinks.rs).
    SinksFwd,
    /// The sinks' gradient: per-block partials, summed by `RmsDw`, `(out)`.
    SinksGrad,
    /// A tensor to e4m3 bytes divided by its group's scale, `(x)` (`quant.cuh`, src/quant/).
    Fp8Quantize,
    /// e4m3 bytes times their scale, `(y)`.
    Fp8Dequantize,
    /// A strided tensor of e4m3 bytes copied into a contiguous one (`quant.cuh`,
    /// src/layout.rs).
    Fp8Copy,
}

/// An element type a kernel is instantiated for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Elem {
    F32,
    F16,
    BF16,
}

/// The element types of one kernel, in the order of its name and its macro's arguments.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Dtypes {
    /// Not templated: f32 throughout.
    Untyped,
    One(Elem),
    Two(Elem, Elem),
}

use Dtypes::{One, Two};
use Elem::{BF16, F16, F32};

/// RMSNorm `(x, weight)`: the weight in f32 or x's dtype.
const NORM: &[Dtypes] = &[
    Two(BF16, F32),
    Two(F16, F32),
    Two(F32, F32),
    Two(BF16, BF16),
    Two(F16, F16),
];
/// Element-wise ops: every float dtype.
const EACH: &[Dtypes] = &[One(BF16), One(F16), One(F32)];
/// Embedding `(table, out)`: an f32 table gives rows in any dtype, another its own.
const EMBED: &[Dtypes] = &[
    Two(F32, BF16),
    Two(F32, F16),
    Two(F32, F32),
    Two(BF16, BF16),
    Two(F16, F16),
];
const UNTYPED: &[Dtypes] = &[Dtypes::Untyped];
/// The attention's outputs on CUDA, and the decoding step's weights: f16 and bf16.
const HALVES: &[Dtypes] = &[One(BF16), One(F16)];
/// Combine `(parts, out)`: each dtype to itself, and to or from f32 for the f32 partial
/// results of more parts than one launch takes.
const COMBINE: &[Dtypes] = &[
    Two(BF16, BF16),
    Two(F16, F16),
    Two(F32, F32),
    Two(BF16, F32),
    Two(F16, F32),
    Two(F32, BF16),
    Two(F32, F16),
];

/// Every training kernel: an op and the dtypes it is compiled for, one kernel per entry.
pub const TRAIN_CATALOGUE: &[(Op, &[Dtypes])] = &[
    (Op::RmsFwd, NORM),
    (Op::AddRmsFwd, NORM),
    (Op::RmsBwd, NORM),
    (Op::RmsDw, UNTYPED),
    (Op::Rotary, EACH),
    (Op::SwigluFwd, EACH),
    (Op::SwigluBwd, EACH),
    (Op::EmbedFwd, EMBED),
    (Op::EmbedBwd, EACH),
    (Op::EmbedBwdSorted, EACH),
    (Op::XentFwd, EACH),
    (Op::XentBwd, EACH),
    (Op::AdamwMoments, EACH),
    (Op::AdamwApply, UNTYPED),
    (Op::SumSquares, EACH),
    (Op::Combine, COMBINE),
    (Op::Gemv, HALVES),
    (Op::GemvSwiglu, HALVES),
    (Op::GemvMma, HALVES),
    (Op::GemvMmaSwiglu, HALVES),
    (Op::Argmax, EACH),
    (Op::SinksFwd, HALVES),
    (Op::SinksGrad, HALVES),
    (Op::Fp8Quantize, EACH),
    (Op::Fp8Dequantize, EACH),
    (Op::Fp8Copy, UNTYPED),
];

impl Dtypes {
    /// The element types, in order.
    pub fn elems(self) -> Vec<Elem> {
        match self {
            Dtypes::Untyped => vec![],
            One(a) => vec![a],
            Two(a, b) => vec![a, b],
        }
    }
}
