//! The kernel catalogue on the host: the table of `cuda/catalogue.rs` (every compiled
//! attention kernel, one row each) with what build.rs generated from it: the [`Kernel`] enum,
//! each kernel's entry point names and its [`Geometry`], read from the device code's traits.
//! The planners find kernels here by their fields; nothing outside this module names one.

use candle::{bail, DType, Result};

#[allow(dead_code)] // the table's builders and doc-only items
#[path = "../../cuda/catalogue.rs"]
mod table;
pub(crate) use table::{Family, File, Mods, Tile, Variant, CATALOGUE};

/// A kernel's launch geometry, as its traits define it (0 where the kernel has none: the
/// launcher's choice, or no dynamic shared memory).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Geometry {
    /// Threads per block.
    pub threads: u32,
    /// Dynamic shared memory per block, in bytes.
    pub smem: u32,
    /// Query rows per block or tile (decode: packed (token, head) rows).
    pub bm: u32,
    /// Keys per tile.
    pub bn: u32,
    /// Ring slots (K/V for the warp-specialized forward, Q/dO for the backwards).
    pub stages: u32,
    /// The warp-specialized forward's Q slots.
    pub q_stages: u32,
    /// The warp-specialized forward stages O in shared memory for a TMA store.
    pub o_staged: bool,
    /// Column splits of dK/dV (the dK/dV kernel above d = 128).
    pub splits: u32,
    /// Blocks per SM its launch bounds ask ptxas for (0: none).
    pub min_blocks: u32,
    /// Keys per swizzled panel of a V given transposed (the FP8 `_vt` kernels; 0: V is not).
    pub vt_panel_keys: u32,
}

include!(concat!(env!("OUT_DIR"), "/catalogue.rs"));

impl Kernel {
    /// The kernel's row of the catalogue.
    pub fn variant(self) -> &'static Variant {
        &CATALOGUE[self as usize]
    }

    pub fn geometry(self) -> &'static Geometry {
        &GEOMETRY[self as usize]
    }

    pub fn file(self) -> File {
        self.variant().family.file()
    }

    /// The entry point for `dtype`.
    pub fn name(self, dtype: DType) -> Result<&'static str> {
        let [f16, bf16] = NAMES[self as usize];
        match dtype {
            DType::F16 => Ok(f16),
            DType::BF16 => Ok(bf16),
            dt => bail!("{f16}: dtype {dt:?} is not supported on CUDA, expected F16 or BF16"),
        }
    }

    /// The first kernel whose row satisfies `pred` (`None`: not compiled).
    pub fn find(pred: impl Fn(&Variant) -> bool) -> Option<Kernel> {
        Kernel::ALL.into_iter().find(|k| pred(k.variant()))
    }

    /// The kernel of `family` for head dim `d` with the row's other fields as `pred` asks.
    pub fn of(family: Family, d: usize, pred: impl Fn(&Variant) -> bool) -> Option<Kernel> {
        Kernel::find(|v| v.family == family && usize::from(v.d) == d && pred(v))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_row_is_a_kernel_with_its_geometry() {
        assert_eq!(Kernel::ALL.len(), CATALOGUE.len());
        for (i, k) in Kernel::ALL.into_iter().enumerate() {
            assert_eq!(k as usize, i);
            let g = k.geometry();
            let v = k.variant();
            if v.d != 0 {
                assert!(g.threads > 0 && g.bm > 0 && g.bn > 0, "{k:?}: {g:?}");
            }
            assert!(k.name(DType::BF16).unwrap().contains("_bf16"));
            assert!(k.name(DType::F32).is_err());
        }
    }

    /// Every kernel of the set the device runs loads, and its launch bounds are the
    /// geometry's block size: the catalogue, the generated instantiations and the probe agree
    /// with the compiled code. Prints each kernel's registers (the register report of the
    /// build the device runs).
    #[test]
    #[ignore = "needs a CUDA device: scripts/gpu/suite.sh runs it"]
    fn every_kernel_loads_with_its_geometry() -> Result<()> {
        use super::super::runtime::{device_facts, load_func, Source};
        use candle::backend::BackendDevice;
        use candle::cuda_backend::cudarc::driver::sys::CUfunction_attribute as Attr;
        use candle::cuda_backend::WrapErr;
        let dev = candle::CudaDevice::new(0)?;
        let facts = device_facts(&dev)?;
        let mut checked = 0;
        for k in Kernel::ALL {
            let sm90 = matches!(
                k.file(),
                File::Sm90Fwd | File::Sm90Bwd | File::Sm90FwdWs | File::Sm90BwdWs
            );
            if sm90 && !facts.hopper() {
                continue;
            }
            let g = k.geometry();
            for dtype in [DType::F16, DType::BF16] {
                let name = k.name(dtype)?;
                let func = load_func(&dev, name, Source::Attention(k.file()))?;
                let max_threads = func
                    .get_attribute(Attr::CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK)
                    .w()?;
                let regs = func.num_regs().w()?;
                let local = func
                    .get_attribute(Attr::CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES)
                    .w()?;
                println!(
                    "{name}\tregs {regs}\tlocal {local}\tthreads {}\tsmem {}",
                    g.threads, g.smem
                );
                if k.variant().bounds != table::Bounds::Free {
                    assert_eq!(
                        max_threads as u32, g.threads,
                        "{name}: launch bounds vs geometry"
                    );
                }
                checked += 1;
            }
        }
        println!("catalogue: {checked} kernels loaded, launch bounds = geometry");
        Ok(())
    }
}
