//! With the `cuda` feature: compile `cuda/*.cu` and embed the results (see `src/ptx.rs`), in
//! two sets chosen at run time by the device's compute capability:
//! - `sm80` (virtual arch compute_80): every file but the wgmma ones. Ampere and Ada run it,
//!   newer GPUs too (their driver compiles its PTX), and Hopper takes from it the files whose
//!   code does not change for sm_90 (the mma.sync forward, the training ops).
//! - `sm90a` (Hopper): the wgmma files (`cuda/sm90/`) and the files with sm_90-only code paths
//!   (`__CUDA_ARCH__` tests in their headers: vector dQ atomics, programmatic launch).
//!
//! What goes into each file's image depends on the GPUs the build targets:
//! - a list of compute capabilities (`CANDLE_FLASH_SASS=80,90`; else `CUDA_COMPUTE_CAP`, as
//!   candle reads it; else what `nvidia-smi` reports): machine code (cubin) for each, inside a
//!   fatbin, so no GPU waits for a JIT at first use. The sm80 set also carries its PTX, which
//!   newer GPUs compile. A target narrows the build to what its GPU loads: 8.x builds only the
//!   sm80 set, 9.0 the sm90a set plus the sm80 files Hopper takes.
//! - no target (`CANDLE_FLASH_SASS=none`, or nothing known: a GPU-less build machine): PTX of
//!   both sets, the portable default, in fatbins too (which store it compressed). Every GPU
//!   from sm_80 runs it after a one-time JIT by the driver (cached in ~/.nv/ComputeCache).
//!
//! Jobs run in parallel (`CANDLE_FLASH_NVCC_JOBS`, default: the available cores). Each output
//! is rebuilt when a file of cuda/ or build.rs is newer, or its nvcc command changed.
//! `CANDLE_FLASH_LINEINFO=1` adds line tables for profilers (4x larger images).
//! Before the kernels, the host-device contract: the `#[repr(C)]` structs of src/cuda are
//! checked against their C twins (module `abi_layout` below).
//! Without the `cuda` feature there is nothing to do: the CPU build needs no CUDA toolkit.

fn main() -> anyhow::Result<()> {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=build");
    #[cfg(feature = "cuda")]
    nvcc::build()?;
    Ok(())
}

#[cfg(feature = "cuda")]
#[path = "build/nvcc.rs"]
mod nvcc;

#[cfg(feature = "cuda")]
#[path = "build/abi_layout.rs"]
mod abi_layout;

#[cfg(feature = "cuda")]
#[path = "build/catalogue.rs"]
mod catalogue;

#[cfg(feature = "cuda")]
#[path = "build/train_catalogue.rs"]
mod train_catalogue;

/// The kernel catalogue's table (plain data, shared with the crate).
#[cfg(feature = "cuda")]
#[allow(dead_code)]
#[path = "cuda/catalogue.rs"]
mod table;

/// The training kernels' catalogue (plain data, shared with the crate).
#[cfg(feature = "cuda")]
#[allow(dead_code)]
#[path = "cuda/train/catalogue.rs"]
mod train_table;
