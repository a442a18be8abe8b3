//! From the kernel catalogue (`cuda/catalogue.rs`, the table of every compiled attention
//! kernel) the build generates:
//! - `OUT_DIR/instances/<file>.inc`: each kernel's entry point (name, launch bounds, template
//!   arguments), included at the end of its `.cu` file;
//! - `OUT_DIR/catalogue.rs`: the `Kernel` enum (one variant per row, in table order), the
//!   kernels' names per dtype and their geometry, which `src/cuda/catalogue.rs` includes.
//!
//! The geometry (threads, shared memory, tile rows and keys, ring slots) is the device code's
//! own: a probe per file includes the file without its kernels
//! (`CANDLE_FLASH_GEOMETRY_PROBE`), fills a device array with each row's traits constants and
//! is compiled to PTX, where the numbers are read back. Nothing restates them on the host.

use anyhow::{bail, Context};
use std::collections::BTreeSet;
use std::fmt::Write as _;
use std::path::Path;

use crate::table::{Bounds, Family, File, Mods, Tile, Variant, CATALOGUE};

/// The probe's device array, read back from its PTX.
const ARRAY: &str = "candle_flash_geometry";
/// Numbers per row in the probe: threads, shared memory, bm, bn, stages, q_stages, o_staged,
/// splits, min_blocks, vt_panel_keys.
const FIELDS: usize = 10;

const DTYPES: [(&str, &str, &str); 2] = [
    ("f16", "__half", "CANDLE_FLASH_ONLY_BF16"),
    ("bf16", "__nv_bfloat16", "CANDLE_FLASH_ONLY_F16"),
];

/// The stem build.rs names a file's images by (`sm90/fwd_ws.cu` -> `sm90_fwd_ws`).
pub fn stem(file: File) -> String {
    let mut parts: Vec<&str> = file.path().trim_end_matches(".cu").split('/').collect();
    parts.dedup();
    parts.join("_")
}

fn mods_c(mods: Mods) -> &'static str {
    match mods {
        Mods::None => "MODS_NONE",
        Mods::Cap => "MODS_CAP",
        Mods::Scores => "MODS_SCORES",
        Mods::Sparse => "MODS_SPARSE",
        Mods::Any => "MODS_ANY",
    }
}

fn mods_suffix(mods: Mods) -> &'static str {
    match mods {
        Mods::None => "",
        Mods::Cap => "_cap",
        Mods::Scores => "_mods",
        Mods::Sparse | Mods::Any => "_sparse",
    }
}

/// The traits' `DA` argument where the products cover fewer columns than the tiles (d 96 on
/// d 128's warp-specialized tiles), else nothing (its default, the tiles' head dim).
fn da(v: &Variant) -> String {
    if v.vt {
        // DA, then VT_GLOBAL.
        format!(", {}, true", v.d)
    } else if v.tiles_d() != v.d {
        format!(", {}", v.d)
    } else {
        String::new()
    }
}

fn flag(b: bool) -> &'static str {
    if b {
        "true"
    } else {
        "false"
    }
}

/// The entry point's name for dtype `dt`.
fn name(v: &Variant, dt: &str) -> String {
    let d = v.d;
    let opt = |b: bool, s: &'static str| if b { s } else { "" };
    match v.family {
        Family::Fwd => {
            let shape = match v.tile {
                Tile::Small => "_s64",
                Tile::Wide => "_wide",
                _ => "",
            };
            format!(
                "flash_fwd_{dt}_d{d}{shape}{}{}",
                mods_suffix(v.mods),
                opt(v.dropout, "_dropout")
            )
        }
        Family::FwdSm90 => {
            let shape = match v.groups {
                1 => format!("_g1_n{}", v.bn),
                2 => String::new(),
                g => format!("_g{g}"),
            };
            format!("flash_fwd_sm90_{dt}_d{d}{shape}{}", mods_suffix(v.mods))
        }
        Family::FwdWs => {
            // The head dim's base shape (no suffix): two warpgroups, its fewest keys per tile.
            let base_bn = CATALOGUE
                .iter()
                .filter(|w| w.family == Family::FwdWs && w.d == d && w.groups == 2 && !w.fp8)
                .map(|w| w.bn)
                .min()
                .unwrap_or(v.bn);
            let shape = if v.groups != 2 {
                format!("_g{}", v.groups)
            } else if v.bn != base_bn {
                format!("_n{}", v.bn)
            } else {
                String::new()
            };
            format!(
                "flash_fwd_ws_{dt}_d{d}{shape}{}{}{}{}{}",
                mods_suffix(v.mods),
                opt(v.packed, "_packed"),
                opt(v.dropout, "_dropout"),
                opt(v.fp8, "_fp8"),
                opt(v.vt, "_vt")
            )
        }
        Family::BwdDsum => format!("flash_bwd_dsum_{dt}"),
        Family::BwdSm90Convert => format!("flash_bwd_dq_convert_{dt}"),
        Family::BwdDkdv => format!(
            "flash_bwd_dkdv_{dt}_d{d}{}{}",
            opt(v.tile == Tile::Small, "_s16"),
            opt(v.mods == Mods::Sparse, "_sparse")
        ),
        Family::BwdDq => format!("flash_bwd_dq_{dt}_d{d}"),
        Family::BwdFused | Family::BwdFusedConvert => {
            let shape = match v.tile {
                Tile::Wide => "_bn128",
                Tile::Tall => "_bn128t",
                Tile::Grid => "_grid",
                Tile::GridQ1 => "_grid_q1",
                _ => "",
            };
            if v.family == Family::BwdFused {
                format!(
                    "flash_bwd_dkdvq_{dt}_d{d}{shape}{}{}",
                    mods_suffix(v.mods),
                    opt(v.dropout, "_dropout")
                )
            } else {
                format!("flash_bwd_dq_convert_{dt}_d{d}{shape}")
            }
        }
        Family::BwdSm90 => format!("flash_bwd_sm90_{dt}_d{d}{}", mods_suffix(v.mods)),
        Family::BwdWs => format!(
            "flash_bwd_ws_{dt}_d{d}{}{}{}{}",
            mods_suffix(v.mods),
            opt(v.deterministic, "_det"),
            opt(v.packed, "_packed"),
            opt(v.dropout, "_dropout")
        ),
        Family::BwdWsPrep => format!("flash_bwd_ws_prep_{dt}_d{d}"),
        Family::BwdWsConvert => format!("flash_bwd_ws_convert_{dt}_d{d}"),
        Family::Append => format!("flash_append_{dt}{}", opt(v.fp8, "_fp8")),
        Family::Decode => {
            let warps = match v.groups {
                4 => String::new(),
                w => format!("_w{w}"),
            };
            format!("flash_decode_{dt}_d{d}{warps}{}", opt(v.fp8, "_fp8"))
        }
    }
}

/// The Rust variant name: the entry point's without `flash_` and the dtype, in CamelCase
/// (`flash_fwd_ws_bf16_d64_g3_mods` -> `FwdWsD64G3Mods`).
fn rust_name(v: &Variant) -> String {
    name(v, "DTYPE")
        .trim_start_matches("flash_")
        .split('_')
        .filter(|p| *p != "DTYPE")
        .map(|p| {
            let mut c = p.chars();
            c.next()
                .map(|f| f.to_ascii_uppercase().to_string() + c.as_str())
                .unwrap_or_default()
        })
        .collect()
}

/// The C++ parameter block type.
fn params(family: Family) -> &'static str {
    match family {
        Family::Fwd | Family::FwdSm90 => "AttnParams",
        Family::FwdWs => "FwdTmaParams",
        Family::BwdWs | Family::BwdWsPrep | Family::BwdWsConvert => "BwdTmaParams",
        Family::Append => "AppendParams",
        Family::Decode => "DecodeParams",
        _ => "BwdParams",
    }
}

/// The traits type (None: the kernel is templated on the element type alone).
fn traits(v: &Variant, t: &str) -> Option<String> {
    let d = v.d;
    let (wide, tall) = (
        matches!(v.tile, Tile::Wide | Tile::Tall),
        v.tile == Tile::Tall,
    );
    Some(match v.family {
        Family::Fwd if v.tile == Tile::Small => format!("FwdSmallConfig<{t}, {d}>::Traits"),
        Family::Fwd if v.tile == Tile::Wide => format!("FwdWideConfig<{t}, {d}>::Traits"),
        Family::Fwd => format!("FwdConfig<{t}, {d}>::Traits"),
        Family::FwdSm90 => format!(
            "Sm90Traits<{t}, {d}, {}, {}, {}>",
            v.groups,
            v.bn,
            mods_c(v.mods)
        ),
        // CANDLE_FLASH_WS_PINGPONG: sm90/fwd_ws.cu's A/B switch (true unless defined). d 96
        // runs on d 128's tiles with the products cut to 96 columns (WsTraits::DA).
        Family::FwdWs => format!(
            "WsTraits<{t}, {}, {}, {}, {}, CANDLE_FLASH_WS_PINGPONG, {}, {}, {}, {}{}>",
            v.tiles_d(),
            v.bn,
            v.stages,
            v.groups,
            mods_c(v.mods),
            flag(v.packed),
            flag(v.dropout),
            flag(v.fp8),
            da(v)
        ),
        Family::BwdDkdv if v.tile == Tile::Small => format!("BwdKvSmall256<{t}>::Kv"),
        Family::BwdDkdv => format!("BwdConfig<{t}, {d}>::Kv"),
        Family::BwdDq => format!("BwdConfig<{t}, {d}>::Q"),
        Family::BwdFused | Family::BwdFusedConvert if v.tile == Tile::Grid => {
            format!("BwdGridConfig<{t}, {d}, 2>::Kv")
        }
        Family::BwdFused | Family::BwdFusedConvert if v.tile == Tile::GridQ1 => {
            format!("BwdGridConfig<{t}, {d}, 1>::Kv")
        }
        Family::BwdFused | Family::BwdFusedConvert => format!(
            "BwdFusedConfig<{t}, {d}, {}, {}>::Kv",
            flag(wide),
            flag(tall)
        ),
        Family::BwdSm90 => format!("BwdSm90Traits<{t}, {d}, {}>", mods_c(v.mods)),
        Family::BwdWs | Family::BwdWsPrep | Family::BwdWsConvert => format!(
            "BwdWsTraits<{t}, {}, {}, {}, {}, {}, {}{}>",
            v.tiles_d(),
            v.stages,
            mods_c(v.mods),
            flag(v.packed),
            flag(v.dropout),
            flag(v.deterministic),
            da(v)
        ),
        Family::Decode => format!("DecodeTraits<{t}, {d}, {}, {}>", v.groups, flag(v.fp8)),
        Family::BwdDsum | Family::BwdSm90Convert | Family::Append => return None,
    })
}

/// The kernel's body: its entry template called on the parameter block `p`.
fn body(v: &Variant, t: &str) -> String {
    let k = traits(v, t).unwrap_or_default();
    match v.family {
        Family::Fwd => format!("flash_fwd<{k}, {}, {}>(p)", flag(v.dropout), mods_c(v.mods)),
        Family::FwdSm90 => format!("flash_fwd_sm90<{k}>(p)"),
        Family::FwdWs => format!("flash_fwd_ws<{k}>(p)"),
        Family::BwdDsum => format!("flash_bwd_dsum<{t}>(p)"),
        Family::BwdSm90Convert => format!("flash_bwd_dq_convert<{t}>(p)"),
        Family::BwdFused if matches!(v.tile, Tile::Grid | Tile::GridQ1) => {
            format!("flash_bwd_grid<{k}, {}>(p)", mods_c(v.mods))
        }
        Family::BwdDkdv | Family::BwdFused => format!(
            "flash_bwd_dkdv<{k}, {}, {}>(p)",
            // The dK/dV kernels keep the dropout path (the fused one compiles it out without).
            flag(v.family == Family::BwdDkdv || v.dropout),
            mods_c(v.mods)
        ),
        Family::BwdDq => format!("flash_bwd_dq<{k}>(p)"),
        Family::BwdFusedConvert => format!("flash_bwd_dq_convert_tiled<{k}>(p)"),
        Family::BwdSm90 => format!("flash_bwd_sm90<{k}>(p)"),
        Family::BwdWs => format!("flash_bwd_ws<{k}>(p)"),
        Family::BwdWsPrep => format!("flash_bwd_ws_prep<{k}>(p)"),
        Family::BwdWsConvert => format!("flash_bwd_ws_convert<{k}>(p)"),
        Family::Append => {
            let cache = if v.fp8 { "uint8_t" } else { t };
            format!("flash_append<{t}, {cache}>(p)")
        }
        Family::Decode => format!("flash_decode<{k}>(p)"),
    }
}

fn bounds(v: &Variant, t: &str) -> String {
    let k = traits(v, t).unwrap_or_default();
    match v.bounds {
        Bounds::Traits(0) => format!(" __launch_bounds__({k}::THREADS)"),
        Bounds::Traits(min) => format!(" __launch_bounds__({k}::THREADS, {min})"),
        Bounds::TraitsMin => format!(" __launch_bounds__({k}::THREADS, {k}::MIN_BLOCKS)"),
        Bounds::Threads(n) => format!(" __launch_bounds__({n})"),
        Bounds::Free => String::new(),
    }
}

/// The probe's numbers for one row (C++ expressions), in `FIELDS` order.
fn geometry_exprs(v: &Variant) -> [String; FIELDS] {
    let k = traits(v, "__half").unwrap_or_default();
    let c = |s: &str| format!("{k}::{s}");
    let zero = || "0".to_string();
    let threads = match v.bounds {
        Bounds::Threads(n) => n.to_string(),
        Bounds::Free => zero(),
        _ => c("THREADS"),
    };
    let min_blocks = match v.bounds {
        Bounds::Traits(min) => min.to_string(),
        Bounds::TraitsMin => c("MIN_BLOCKS"),
        _ => zero(),
    };
    let (smem, bm, bn, stages, q_stages, o_staged, splits) = match v.family {
        Family::BwdDsum | Family::BwdSm90Convert | Family::Append => {
            (zero(), zero(), zero(), zero(), zero(), zero(), zero())
        }
        Family::FwdWs => (
            c("SMEM_BYTES"),
            c("BM"),
            c("BN"),
            c("STAGES"),
            c("Q_STAGES"),
            c("O_STAGED"),
            "1".into(),
        ),
        Family::BwdDkdv => (
            c("SMEM_BYTES"),
            c("BM"),
            c("BN"),
            zero(),
            zero(),
            zero(),
            c("SPLITS"),
        ),
        Family::BwdFused => (
            c("SMEM_BYTES"),
            c("BM"),
            c("BN"),
            c("STAGES"),
            zero(),
            zero(),
            "1".into(),
        ),
        // Converts use no dynamic shared memory; their tile is the fused kernel's.
        Family::BwdFusedConvert => (zero(), c("BM"), c("BN"), zero(), zero(), zero(), "1".into()),
        Family::BwdWs => (
            c("SMEM_BYTES"),
            c("BM"),
            c("BN"),
            c("STAGES"),
            zero(),
            zero(),
            "1".into(),
        ),
        Family::BwdWsPrep | Family::BwdWsConvert => (
            zero(),
            c("BM"),
            c("BN"),
            c("STAGES"),
            zero(),
            zero(),
            "1".into(),
        ),
        Family::Decode => (
            c("SMEM_BYTES"),
            c("ROWS"),
            c("BN"),
            zero(),
            zero(),
            zero(),
            "1".into(),
        ),
        Family::Fwd | Family::FwdSm90 | Family::BwdDq | Family::BwdSm90 => (
            c("SMEM_BYTES"),
            c("BM"),
            c("BN"),
            zero(),
            zero(),
            zero(),
            "1".into(),
        ),
    };
    let vt_panel_keys = if v.vt { c("VT_PANEL_KEYS") } else { zero() };
    [
        threads,
        smem,
        bm,
        bn,
        stages,
        q_stages,
        o_staged,
        splits,
        min_blocks,
        vt_panel_keys,
    ]
}

/// What the table must hold for the generator to be right: unique names, the fields each
/// family's template takes.
fn check(rows: &[Variant]) -> anyhow::Result<()> {
    let mut names = BTreeSet::new();
    for v in rows {
        let n = name(v, "bf16");
        if !names.insert(n.clone()) {
            bail!("cuda/catalogue.rs: {n} is listed twice");
        }
        let needs = |ok: bool, what: &str| -> anyhow::Result<()> {
            if ok {
                Ok(())
            } else {
                bail!("cuda/catalogue.rs: {n} ({:?}) needs {what}", v.family)
            }
        };
        match v.family {
            Family::FwdSm90 => needs(v.groups > 0 && v.bn > 0, "groups and bn")?,
            Family::FwdWs => needs(
                v.groups > 0 && v.bn > 0 && v.stages > 0,
                "bn, stages, groups",
            )?,
            Family::BwdWs | Family::BwdWsPrep | Family::BwdWsConvert => {
                needs(v.stages > 0, "stages")?
            }
            Family::Decode => needs(v.groups > 0, "warps (groups)")?,
            _ => {}
        }
        needs(
            !v.fp8
                || matches!(v.family, Family::Append | Family::Decode)
                || (v.family == Family::FwdWs && v.mods == Mods::None && !v.dropout),
            "a KV-cache family or the plain warp-specialized forward for e4m3 operands",
        )?;
        needs(
            !v.vt || (v.family == Family::FwdWs && v.fp8 && !v.packed && v.bn % 32 == 0),
            "the FP8 warp-specialized forward (fixed-length batches, whole k32 steps) for \
             key-major V",
        )?;
        let free = matches!(
            v.family,
            Family::BwdDsum | Family::BwdSm90Convert | Family::Append
        );
        needs(
            free == (v.bounds == Bounds::Free),
            "launch bounds from its traits",
        )?;
        needs(free == (v.d == 0), "a head dim (0 only for any-d kernels)")?;
    }
    Ok(())
}

/// Writes the instantiation files and `catalogue.rs` into `out_dir`; `nvcc_args` compile the
/// geometry probes.
pub fn generate(nvcc_args: &[String], out_dir: &Path) -> anyhow::Result<()> {
    check(CATALOGUE)?;
    let inst_dir = out_dir.join("instances");
    std::fs::create_dir_all(&inst_dir)?;
    let mut geometry = vec![[0u64; FIELDS]; CATALOGUE.len()];
    for file in File::ALL {
        let rows: Vec<(usize, &Variant)> = CATALOGUE
            .iter()
            .enumerate()
            .filter(|(_, v)| v.family.file() == file)
            .collect();
        // Instantiations, a dtype at a time (build.rs may compile the file per dtype).
        let mut inc = String::from(
            "// Generated by build.rs from cuda/catalogue.rs: the kernels of this file.\n\
             #ifndef CANDLE_FLASH_GEOMETRY_PROBE\n",
        );
        for (dt, t, skip) in DTYPES {
            writeln!(inc, "#ifndef {skip}")?;
            for (_, v) in &rows {
                writeln!(
                    inc,
                    "extern \"C\" __global__ void{} {}(const __grid_constant__ {} p) {{ {}; }}",
                    bounds(v, t),
                    name(v, dt),
                    params(v.family),
                    body(v, t)
                )?;
            }
            writeln!(inc, "#endif")?;
        }
        inc.push_str("#endif\n");
        write_if_changed(&inst_dir.join(format!("{}.inc", stem(file))), &inc)?;

        // The probe: the file's traits, no kernels.
        let mut probe = format!(
            "#define CANDLE_FLASH_GEOMETRY_PROBE\n#include \"{}\"\n\
             extern \"C\" __device__ unsigned long long {ARRAY}[] = {{\n",
            file.path()
        );
        for (_, v) in &rows {
            let exprs = geometry_exprs(v);
            let items: Vec<String> = exprs
                .iter()
                .map(|e| format!("(unsigned long long)({e})"))
                .collect();
            writeln!(probe, "    {},", items.join(", "))?;
        }
        probe.push_str("};\n");
        let src = out_dir.join(format!("geometry_{}.cu", stem(file)));
        let ptx = src.with_extension("ptx");
        std::fs::write(&src, probe)?;
        let arch = if file.path().starts_with("sm90/") {
            "-arch=compute_90a"
        } else {
            "-arch=compute_80"
        };
        let out = std::process::Command::new("nvcc")
            .args(nvcc_args)
            .args([arch, "-ptx"])
            .arg(&src)
            .arg("-o")
            .arg(&ptx)
            .output()
            .context("running nvcc for the geometry probe")?;
        if !out.status.success() {
            bail!(
                "the geometry probe of cuda/{} failed to compile:\n{}{}",
                file.path(),
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        let text = std::fs::read_to_string(&ptx)?;
        let values = crate::abi_layout::read_array(&text, ARRAY)
            .with_context(|| format!("reading `{ARRAY}` from {}", ptx.display()))?;
        if values.len() != rows.len() * FIELDS {
            bail!(
                "geometry probe of cuda/{}: {} values for {} kernels",
                file.path(),
                values.len(),
                rows.len()
            );
        }
        for ((i, _), chunk) in rows.iter().zip(values.chunks_exact(FIELDS)) {
            geometry[*i].copy_from_slice(chunk);
        }
    }
    write_if_changed(&out_dir.join("catalogue.rs"), &rust_table(&geometry)?)?;
    Ok(())
}

/// The generated Rust: `Kernel`, `NAMES`, `GEOMETRY`.
fn rust_table(geometry: &[[u64; FIELDS]]) -> anyhow::Result<String> {
    let n = CATALOGUE.len();
    let mut s = String::from(
        "// Generated by build.rs from cuda/catalogue.rs.\n\n\
         /// Every compiled attention kernel, in the catalogue's order (`CATALOGUE[k as usize]`\n\
         /// is its row).\n\
         #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]\n\
         #[allow(dead_code)] // the planners name some; the rest are found by their fields\n\
         pub enum Kernel {\n",
    );
    for v in CATALOGUE {
        writeln!(s, "    {},", rust_name(v))?;
    }
    s.push_str("}\n\n");
    writeln!(s, "impl Kernel {{\n    pub const ALL: [Kernel; {n}] = [")?;
    for v in CATALOGUE {
        writeln!(s, "        Kernel::{},", rust_name(v))?;
    }
    s.push_str("    ];\n}\n\n");
    writeln!(
        s,
        "/// Entry point names, `[f16, bf16]`.\nstatic NAMES: [[&str; 2]; {n}] = ["
    )?;
    for v in CATALOGUE {
        writeln!(s, "    [\"{}\", \"{}\"],", name(v, "f16"), name(v, "bf16"))?;
    }
    s.push_str("];\n\n");
    writeln!(
        s,
        "/// The device code's geometry of each kernel.\nstatic GEOMETRY: [Geometry; {n}] = ["
    )?;
    for g in geometry {
        writeln!(
            s,
            "    Geometry {{ threads: {}, smem: {}, bm: {}, bn: {}, stages: {}, q_stages: {}, \
             o_staged: {}, splits: {}, min_blocks: {}, vt_panel_keys: {} }},",
            g[0],
            g[1],
            g[2],
            g[3],
            g[4],
            g[5],
            g[6] != 0,
            g[7],
            g[8],
            g[9]
        )?;
    }
    s.push_str("];\n");
    Ok(s)
}

/// Writes `text` unless the file already holds it, so that an unchanged table does not
/// rebuild what includes it.
fn write_if_changed(path: &Path, text: &str) -> anyhow::Result<()> {
    if std::fs::read_to_string(path).is_ok_and(|old| old == text) {
        return Ok(());
    }
    std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))
}
