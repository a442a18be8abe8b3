//! The kernels' nvcc jobs: which images each `.cu` file gets, their commands, and a pool
//! that runs the stale ones.

use anyhow::{bail, Context};
use std::collections::BTreeSet;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::SystemTime;

/// One nvcc run: `src` of `set` into `out` (a `.fatbin`).
struct Job {
    set: &'static str,
    src: PathBuf,
    out: PathBuf,
    args: Vec<String>,
    /// Rough cost for the queue's order (longest first): source bytes x images.
    cost: usize,
    /// The newest modification time among the files it reads (stale if its output is older).
    newest: SystemTime,
}

pub fn build() -> anyhow::Result<()> {
    for var in [
        "CUDA_COMPUTE_CAP",
        "CANDLE_FLASH_SASS",
        "CANDLE_FLASH_NVCC_JOBS",
        "CANDLE_FLASH_LINEINFO",
        "CANDLE_FLASH_SKIP_KERNELS",
        "CANDLE_FLASH_NVCC_FLAGS",
        "NVCC_CCBIN",
    ] {
        println!("cargo:rerun-if-env-changed={var}");
    }
    println!("cargo:rerun-if-changed=cuda");
    let mut sources = vec![];
    for path in crate::abi_layout::files(Path::new("cuda"), &["cu", "cuh", "rs"])? {
        println!("cargo:rerun-if-changed={}", path.display());
        if path.extension().is_some_and(|e| e == "cu") {
            sources.push(path);
        }
    }
    // A job is stale when build.rs or a file its source includes (transitively) is newer
    // than its image: a change to one kernel's file rebuilds that kernel alone.
    let build_rs = std::fs::metadata("build.rs")?.modified()?;
    let targets = targets()?;
    let out_dir = PathBuf::from(std::env::var("OUT_DIR")?);
    let mut common: Vec<String> = ["-std=c++17", "-O3", "--use_fast_math", "-Icuda"]
        .map(String::from)
        .to_vec();
    if std::env::var("CANDLE_FLASH_LINEINFO").is_ok_and(|v| v == "1") {
        common.push("-lineinfo".into());
    }
    // Extra nvcc flags (whitespace-separated), for A/B builds of kernel variants.
    if let Ok(flags) = std::env::var("CANDLE_FLASH_NVCC_FLAGS") {
        common.extend(flags.split_whitespace().map(String::from));
    }
    if let Ok(ccbin) = std::env::var("NVCC_CCBIN") {
        common.extend(["-ccbin".into(), ccbin]);
    }
    // Before the kernels: a layout mismatch fails in a second, not after the nvcc jobs.
    // The catalogue's instantiations: `#include "instances/<file>.inc"` at the end of each
    // `.cu` file.
    common.push(format!("-I{}", out_dir.display()));
    crate::abi_layout::generate(&common, &out_dir)?;
    // Before the kernels too: the instantiations they include, and the host's table with
    // the kernels' geometry.
    crate::catalogue::generate(&common, &out_dir)?;
    crate::train_catalogue::generate(&out_dir)?;
    // What each source needs is read once, for both sets.
    let sources = sources
        .iter()
        .map(|path| Source::read(path))
        .collect::<anyhow::Result<Vec<_>>>()?;

    // `CANDLE_FLASH_SKIP_KERNELS=1`: no images (every launch then errors), for `cargo check`
    // and clippy of the host code without the kernels' minutes of nvcc.
    let skip = std::env::var("CANDLE_FLASH_SKIP_KERNELS").is_ok_and(|v| v == "1");
    let mut jobs = vec![];
    let mut consts = String::new();
    for set in ["sm90a", "sm80"] {
        writeln!(consts, "/// Images of the `{set}` set (None: not built).")?;
        writeln!(
            consts,
            "pub mod {set} {{\n    #[allow(unused_imports)] // no images: CANDLE_FLASH_SKIP_KERNELS\n    use super::{{Image, Parts}};"
        )?;
        for src in &sources {
            let value = match codes(set, src, &targets).filter(|_| !skip) {
                None => "Parts::One(None)".to_string(),
                Some(codes) => {
                    let dir = out_dir.join(set);
                    std::fs::create_dir_all(&dir)?;
                    // Files that opt in are compiled once per dtype: two jobs of half
                    // the size.
                    let parts: &[(&str, &str)] = if src.by_dtype {
                        &[
                            ("f16", "-DCANDLE_FLASH_ONLY_F16"),
                            ("bf16", "-DCANDLE_FLASH_ONLY_BF16"),
                        ]
                    } else {
                        &[("all", "")]
                    };
                    let mut images = vec![];
                    let newest = src.newest(&out_dir)?.max(build_rs);
                    for &(part, define) in parts {
                        let cost = src.bytes * (codes.len() + 1) / parts.len();
                        let (mut job, image) =
                            job(set, src, &dir, part, define, &codes, &common, cost);
                        job.newest = newest;
                        jobs.push(job);
                        images.push(image);
                    }
                    if src.by_dtype {
                        format!("Parts::ByDtype({}, {})", images[0], images[1])
                    } else {
                        format!("Parts::One({})", images[0])
                    }
                }
            };
            writeln!(
                consts,
                "    pub const {}: Parts = {value};",
                src.stem.to_uppercase()
            )?;
        }
        writeln!(consts, "}}")?;
    }
    run_jobs(jobs)?;
    std::fs::write(out_dir.join("ptx.rs"), consts)?;
    Ok(())
}

/// The nvcc job that compiles `src` (with `define`, if any) for `codes` into
/// `dir/STEM.PART.fatbin`, and the Rust expression of its embedded image.
///
/// A PTX-only build (`codes` one virtual arch) is a fatbin too, not PTX text: fatbinary
/// compresses PTX (8-9x on these kernels), and with every test binary, bench and example
/// embedding the images, raw PTX made each 170 MB.
#[allow(clippy::too_many_arguments)]
fn job(
    set: &'static str,
    src: &Source,
    dir: &Path,
    part: &str,
    define: &str,
    codes: &[String],
    common: &[String],
    cost: usize,
) -> (Job, String) {
    let out = dir.join(format!("{}.{part}.fatbin", src.stem));
    let virt = if set == "sm80" {
        "compute_80"
    } else {
        "compute_90a"
    };
    let mut args = common.to_vec();
    if !define.is_empty() {
        args.push(define.to_string());
    }
    args.push("-fatbin".into());
    for code in codes {
        args.push(format!("-gencode=arch={virt},code={code}"));
    }
    args.extend([
        src.path.display().to_string(),
        "-o".into(),
        out.display().to_string(),
    ]);
    let path = format!("{:?}", out.display().to_string());
    let image = format!("Some(Image(include_bytes!({path})))");
    let job = Job {
        set,
        src: src.path.clone(),
        out,
        args,
        cost,
        newest: SystemTime::UNIX_EPOCH,
    };
    (job, image)
}

/// The compute capabilities to build machine code for (empty: PTX only).
fn targets() -> anyhow::Result<BTreeSet<u32>> {
    let parse = |list: &str| -> anyhow::Result<BTreeSet<u32>> {
        let mut caps = BTreeSet::new();
        for item in list.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            let digits = item.trim_end_matches(['a', 'f']).replace('.', "");
            let cap: u32 = digits
                .parse()
                .with_context(|| format!("compute capability {item:?}: expected e.g. 86"))?;
            if cap < 80 {
                println!(
                    "cargo:warning=candle-flash: compute capability {cap} is below 8.0, \
                     which the kernels need (mma.sync, cp.async); not built for it"
                );
            } else {
                caps.insert(cap);
            }
        }
        Ok(caps)
    };
    if let Ok(list) = std::env::var("CANDLE_FLASH_SASS") {
        return if list.trim() == "none" {
            Ok(BTreeSet::new())
        } else {
            parse(&list).context("CANDLE_FLASH_SASS")
        };
    }
    if let Ok(cap) = std::env::var("CUDA_COMPUTE_CAP") {
        return parse(&cap).context("CUDA_COMPUTE_CAP");
    }
    // Like candle's own kernel build: the GPUs of this machine, if it has any.
    let smi = std::process::Command::new("nvidia-smi")
        .args(["--query-gpu=compute_cap", "--format=csv,noheader"])
        .output();
    match smi {
        Ok(out) if out.status.success() => {
            let text = String::from_utf8_lossy(&out.stdout).replace('\n', ",");
            parse(&text).context("nvidia-smi --query-gpu=compute_cap")
        }
        _ => Ok(BTreeSet::new()),
    }
}

/// The `code=` values of `src` in `set` (None: not built).
fn codes(set: &str, src: &Source, targets: &BTreeSet<u32>) -> Option<Vec<String>> {
    let hopper_code = src.wgmma || src.arch_tests;
    if set == "sm90a" {
        return if !hopper_code {
            None
        } else if targets.is_empty() {
            Some(vec!["compute_90a".into()])
        } else if targets.iter().any(|c| c / 10 == 9) {
            Some(vec!["sm_90a".into()])
        } else {
            None
        };
    }
    if src.wgmma {
        return None;
    }
    // sm80: its PTX always (for GPUs newer than every target), machine code for each
    // target that loads the file from this set.
    let sass: Vec<String> = targets
        .iter()
        .filter(|&&c| c / 10 != 9 || !hopper_code)
        .map(|c| format!("sm_{c}"))
        .collect();
    if !targets.is_empty() && sass.is_empty() {
        return None; // only Hopper targeted, and it takes this file from sm90a
    }
    Some(sass.into_iter().chain(["compute_80".to_string()]).collect())
}

/// One `.cu` file and what the build needs to know of it.
struct Source {
    path: PathBuf,
    stem: String,
    /// A wgmma file (under `cuda/sm90/`): sm_90a only.
    wgmma: bool,
    /// It or a header it includes (transitively) tests `__CUDA_ARCH__`: Hopper loads it
    /// from the sm90a set.
    arch_tests: bool,
    /// It can be compiled one dtype at a time (`CANDLE_FLASH_ONLY_F16` / `_BF16`).
    by_dtype: bool,
    /// Bytes of it and its headers: the job-order estimate before any build was timed.
    bytes: usize,
    /// It and the headers it includes, transitively.
    files: Vec<PathBuf>,
    /// The generated files it includes (`instances/...`, under OUT_DIR), rewritten by the
    /// build script only when their text changes.
    generated: Vec<String>,
}

impl Source {
    fn read(path: &Path) -> anyhow::Result<Self> {
        // `sm90/fwd_ws.cu` -> `sm90_fwd_ws`, `decode/decode.cu` -> `decode`: unique
        // across the folders.
        let mut parts: Vec<String> = path
            .strip_prefix("cuda")?
            .with_extension("")
            .iter()
            .map(|p| p.to_string_lossy().into_owned())
            .collect();
        parts.dedup();
        let stem = parts.join("_");
        let by_dtype = std::fs::read_to_string(path)?.contains("CANDLE_FLASH_ONLY_BF16");
        let (mut bytes, mut arch_tests) = (0, false);
        let mut seen = BTreeSet::new();
        let mut generated = vec![];
        let mut stack = vec![path.to_path_buf()];
        while let Some(file) = stack.pop() {
            if !seen.insert(file.clone()) {
                continue;
            }
            let text = std::fs::read_to_string(&file)
                .with_context(|| format!("reading {}", file.display()))?;
            bytes += text.len();
            arch_tests |= text.contains("__CUDA_ARCH__");
            for line in text.lines() {
                if let Some(name) = line
                    .trim()
                    .strip_prefix("#include \"")
                    .and_then(|rest| rest.strip_suffix('"'))
                {
                    // The catalogue's instantiations (OUT_DIR) test no architecture.
                    if name.starts_with("instances/") {
                        generated.push(name.to_string());
                    } else {
                        stack.push(Path::new("cuda").join(name));
                    }
                }
            }
        }
        Ok(Self {
            path: path.to_path_buf(),
            stem: stem.to_string(),
            wgmma: path.starts_with("cuda/sm90"),
            arch_tests,
            by_dtype,
            bytes,
            files: seen.into_iter().collect(),
            generated,
        })
    }

    /// The newest modification time of its files and of the generated ones under `out_dir`.
    fn newest(&self, out_dir: &Path) -> anyhow::Result<SystemTime> {
        let mut newest = SystemTime::UNIX_EPOCH;
        let generated = self.generated.iter().map(|name| out_dir.join(name));
        for file in self.files.iter().cloned().chain(generated) {
            let modified = std::fs::metadata(&file)
                .and_then(|m| m.modified())
                .with_context(|| format!("reading the time of {}", file.display()))?;
            newest = newest.max(modified);
        }
        Ok(newest)
    }
}

/// Runs the jobs whose output is missing, older than their inputs or built by another command,
/// on a pool of threads.
fn run_jobs(jobs: Vec<Job>) -> anyhow::Result<()> {
    let mut stale: Vec<Job> = jobs
        .into_iter()
        .filter(|job| {
            let stamp = job.out.with_extension("cmd");
            let fresh = std::fs::metadata(&job.out)
                .and_then(|m| m.modified())
                .is_ok_and(|t| t >= job.newest)
                && std::fs::read_to_string(&stamp).is_ok_and(|s| s == job.args.join(" "));
            !fresh
        })
        .collect();
    // Longest first (popped from the end): by the job's last measured time when there is
    // one (fwd.cu, a small file, is the longest job), else by its size.
    let last_ms = |job: &Job| -> Option<u64> {
        std::fs::read_to_string(job.out.with_extension("ms"))
            .ok()?
            .trim()
            .parse()
            .ok()
    };
    stale.sort_by_key(|job| (last_ms(job).unwrap_or(0), job.cost));
    let threads = std::env::var("CANDLE_FLASH_NVCC_JOBS")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(2, |n| n.get()))
        .max(1);
    let (start, count) = (std::time::Instant::now(), stale.len());
    let queue = Mutex::new(stale);
    let errors = Mutex::new(vec![]);
    std::thread::scope(|scope| {
        for _ in 0..threads {
            scope.spawn(|| loop {
                let Some(job) = queue.lock().unwrap().pop() else {
                    return;
                };
                if let Err(e) = run(&job) {
                    errors.lock().unwrap().push(format!("{e:#}"));
                }
            });
        }
    });
    println!(
        "nvcc: {count} jobs on {threads} threads in {:.1} s",
        start.elapsed().as_secs_f64()
    );
    let errors = errors.into_inner().unwrap();
    if !errors.is_empty() {
        bail!("{}", errors.join("\n\n"));
    }
    Ok(())
}

fn run(job: &Job) -> anyhow::Result<()> {
    let start = std::time::Instant::now();
    let out = std::process::Command::new("nvcc")
        .args(&job.args)
        .output()
        .context("running nvcc (is the CUDA toolkit's bin directory on PATH?)")?;
    if !out.status.success() {
        bail!(
            "nvcc failed on {} ({} set):\n{}{}",
            job.src.display(),
            job.set,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    std::fs::write(job.out.with_extension("cmd"), job.args.join(" "))?;
    std::fs::write(
        job.out.with_extension("ms"),
        start.elapsed().as_millis().to_string(),
    )?;
    // Visible with `cargo build -vv`: where the build's time goes.
    println!(
        "{} ({}): {:.1} s",
        job.out.display(),
        job.set,
        start.elapsed().as_secs_f64()
    );
    Ok(())
}
