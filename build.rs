//! With the `cuda` feature: compile every `cuda/*.cu` to PTX and embed it (see `src/ptx.rs`).
//! Without it: nothing to do, so the CPU build needs no CUDA toolkit.

fn main() -> anyhow::Result<()> {
    println!("cargo:rerun-if-changed=build.rs");
    #[cfg(feature = "cuda")]
    cuda::build()?;
    Ok(())
}

#[cfg(feature = "cuda")]
mod cuda {
    pub fn build() -> anyhow::Result<()> {
        println!("cargo:rerun-if-changed=cuda");
        for entry in std::fs::read_dir("cuda")? {
            println!("cargo:rerun-if-changed={}", entry?.path().display());
        }
        let out_dir = std::path::PathBuf::from(std::env::var("OUT_DIR")?);
        remove_stale_ptx(&out_dir)?;
        let builder = bindgen_cuda::Builder::default()
            .kernel_paths_glob("cuda/*.cu")
            .include_paths_glob("cuda/*.cuh")
            .arg("-std=c++17")
            .arg("-O3")
            .arg("--use_fast_math")
            // fwd_sm90.cu uses wgmma, which only the arch-specific target has; the other
            // kernels are unaffected (and Hopper is the only target this crate builds for).
            .arg("-arch=sm_90a")
            .arg("-lineinfo")
            .out_dir(out_dir.clone());
        let bindings = builder
            .build_ptx()
            .map_err(|e| anyhow::anyhow!("compiling cuda/*.cu to PTX: {e:?}"))?;
        bindings
            .write(out_dir.join("ptx.rs"))
            .map_err(|e| anyhow::anyhow!("writing ptx.rs: {e:?}"))?;
        Ok(())
    }

    /// bindgen_cuda recompiles a `.cu` only when the `.cu` itself is newer than its `.ptx`, so an
    /// edit to a header alone would leave stale PTX. Any file in cuda/ newer than a `.ptx`
    /// removes that `.ptx`, which makes bindgen_cuda compile it again.
    fn remove_stale_ptx(out_dir: &std::path::Path) -> anyhow::Result<()> {
        let mut newest_source = std::time::SystemTime::UNIX_EPOCH;
        for entry in std::fs::read_dir("cuda")? {
            newest_source = newest_source.max(entry?.metadata()?.modified()?);
        }
        for entry in std::fs::read_dir(out_dir)? {
            let path = entry?.path();
            if path.extension().is_some_and(|e| e == "ptx")
                && std::fs::metadata(&path)?.modified()? < newest_source
            {
                std::fs::remove_file(&path)?;
            }
        }
        Ok(())
    }
}
