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
        let builder = bindgen_cuda::Builder::default()
            .kernel_paths_glob("cuda/*.cu")
            .include_paths_glob("cuda/*.cuh")
            .arg("-std=c++17")
            .arg("-O3")
            .arg("--use_fast_math")
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
}
