//! With the `cuda` feature: compile `cuda/*.cu` to PTX twice and embed both sets (see
//! `src/ptx.rs`), chosen at run time by the device's compute capability:
//! - `sm_90a` (Hopper): every file, the wgmma kernels (`*_sm90.cu`) included;
//! - `sm_80` (Ampere and Ada, sm_80/86/89; newer GPUs can load it too): every file but the
//!   wgmma ones, whose instructions only sm_90a has.
//!
//! `CUDA_COMPUTE_CAP` (as candle reads it) below 90 builds the sm_80 set only, for a faster
//! build on an Ampere/Ada machine; 90 and above (or unset) build both, so that a Hopper build
//! also runs the sm_80 kernels when asked (`CANDLE_FLASH_ARCH=sm80`, for testing them there).
//! Without the `cuda` feature there is nothing to do: the CPU build needs no CUDA toolkit.

fn main() -> anyhow::Result<()> {
    println!("cargo:rerun-if-changed=build.rs");
    #[cfg(feature = "cuda")]
    cuda::build()?;
    Ok(())
}

#[cfg(feature = "cuda")]
mod cuda {
    use std::fmt::Write as _;
    use std::path::{Path, PathBuf};

    /// One PTX set: its directory under OUT_DIR, nvcc's `-arch`, which sources it takes.
    struct Set {
        dir: &'static str,
        arch: &'static str,
        hopper_only_files: bool,
    }

    const SETS: [Set; 2] = [
        Set {
            dir: "sm90a",
            arch: "-arch=sm_90a",
            hopper_only_files: true,
        },
        Set {
            dir: "sm80",
            arch: "-arch=sm_80",
            hopper_only_files: false,
        },
    ];

    pub fn build() -> anyhow::Result<()> {
        println!("cargo:rerun-if-changed=cuda");
        println!("cargo:rerun-if-env-changed=CUDA_COMPUTE_CAP");
        let mut sources = vec![];
        for entry in std::fs::read_dir("cuda")? {
            let path = entry?.path();
            println!("cargo:rerun-if-changed={}", path.display());
            if path.extension().is_some_and(|e| e == "cu") {
                sources.push(path);
            }
        }
        sources.sort();
        let out_dir = PathBuf::from(std::env::var("OUT_DIR")?);
        let cap: Option<u32> = std::env::var("CUDA_COMPUTE_CAP")
            .ok()
            .and_then(|c| c.trim_end_matches(['a', 'f']).parse().ok());
        let mut consts = String::new();
        for set in &SETS {
            let built = set.dir == "sm80" || cap.is_none_or(|c| c >= 90);
            let files: Vec<&PathBuf> = sources
                .iter()
                .filter(|p| set.hopper_only_files || !is_hopper_only(p))
                .collect();
            let dir = out_dir.join(set.dir);
            if built {
                std::fs::create_dir_all(&dir)?;
                remove_stale_ptx(&dir)?;
                let builder = bindgen_cuda::Builder::default()
                    .kernel_paths(files.clone())
                    .include_paths_glob("cuda/*.cuh")
                    .arg("-std=c++17")
                    .arg("-O3")
                    .arg("--use_fast_math")
                    // After bindgen_cuda's own --gpu-architecture (from CUDA_COMPUTE_CAP):
                    // nvcc warns and the last value wins.
                    .arg(set.arch)
                    .arg("-lineinfo")
                    .out_dir(dir.clone());
                builder
                    .build_ptx()
                    .map_err(|e| anyhow::anyhow!("compiling cuda/*.cu for {}: {e:?}", set.arch))?;
            }
            writeln!(
                consts,
                "/// PTX of the `{}` set (None: not built).",
                set.dir
            )?;
            writeln!(consts, "pub mod {} {{", set.dir)?;
            for src in &sources {
                let stem = src.file_stem().and_then(|s| s.to_str()).unwrap_or_default();
                let ptx = dir.join(format!("{stem}.ptx"));
                let value = if built && files.contains(&src) {
                    format!("Some(include_str!({:?}))", ptx.display().to_string())
                } else {
                    "None".to_string()
                };
                writeln!(
                    consts,
                    "    pub const {}: Option<&str> = {value};",
                    stem.to_uppercase()
                )?;
            }
            writeln!(consts, "}}")?;
        }
        std::fs::write(out_dir.join("ptx.rs"), consts)?;
        Ok(())
    }

    /// The wgmma kernels, which only sm_90a has instructions for.
    fn is_hopper_only(path: &Path) -> bool {
        path.file_stem()
            .and_then(|s| s.to_str())
            .is_some_and(|s| s.ends_with("_sm90"))
    }

    /// bindgen_cuda recompiles a `.cu` only when the `.cu` itself is newer than its `.ptx`, so an
    /// edit to a header alone would leave stale PTX. Any file in cuda/ newer than a `.ptx`
    /// removes that `.ptx`, which makes bindgen_cuda compile it again.
    fn remove_stale_ptx(dir: &Path) -> anyhow::Result<()> {
        let mut newest_source = std::time::SystemTime::UNIX_EPOCH;
        for entry in std::fs::read_dir("cuda")? {
            newest_source = newest_source.max(entry?.metadata()?.modified()?);
        }
        newest_source = newest_source.max(std::fs::metadata("build.rs")?.modified()?);
        for entry in std::fs::read_dir(dir)? {
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
