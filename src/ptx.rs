//! PTX of `cuda/*.cu`, compiled by build.rs and embedded as string constants: one set for
//! Hopper (`sm90a`, the wgmma kernels included) and one for Ampere/Ada (`sm80`); a constant
//! is `None` where its set (or, for `sm80`, its Hopper-only file) was not built.
include!(concat!(env!("OUT_DIR"), "/ptx.rs"));
