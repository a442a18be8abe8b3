//! The host-device contract, checked at build time: every `#[repr(C)]` struct under
//! `src/cuda` is the twin of the C struct of the same name under `cuda/`, and the crate does
//! not compile where the two differ (what the generated file asserts: `src/cuda/mod.rs`,
//! module `abi_layout`).
//! - Rust side: the twins are the `#[repr(C)]` structs found in `src/cuda/**/*.rs`.
//! - C side, the source of truth: each struct's fields are parsed from its definition
//!   (`type a, *b, c[N];` declarations; member functions and static members skipped, anything
//!   else an error, never skipped), so the field list is never a hand-written mirror. Their
//!   layout comes from the compiler: a probe (`OUT_DIR/abi_probe.cu`) includes the headers
//!   (for a struct defined in a `.cu` file: that file's includes and the struct's own text),
//!   fills a device array with `sizeof`/`alignof`/`offsetof` of every struct and field and is
//!   compiled to PTX, where the numbers are read back. Device compilation only: nothing is
//!   linked or run, so a GPU-less build machine checks it like any other, in about a second.

use anyhow::{bail, Context};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

/// Where the Rust twins live.
const RUST_DIR: &str = "src/cuda";
/// Where the C structs live (the root of the kernels' include path).
const C_DIR: &str = "cuda";
/// The probe's device array, read back from its PTX.
const ARRAY: &str = "candle_flash_abi_layout";

/// A C struct with a Rust twin.
struct Twin {
    name: String,
    /// The Rust struct's path, e.g. `crate::cuda::decode::DecodeParams`.
    rust: String,
    /// The C file that defines it, relative to `cuda/`.
    file: String,
    /// Its definition (`struct ... };`), comments removed: pasted into the probe when the
    /// file is a `.cu` (which the probe cannot include: it would compile its kernels).
    definition: String,
    fields: Vec<Field>,
}

/// One member of a C struct.
struct Field {
    name: String,
    /// The type without qualifiers and stars (`unsigned int`, `AttnParams`).
    base: String,
    pointer: bool,
    /// The bound of a one-dimensional array, as written (`DECODE_INLINE_SEQLENS`).
    array: Option<String>,
    /// The declaration without qualifiers, for messages (`void* q`).
    decl: String,
}

/// Writes `OUT_DIR/abi_layout.rs`, the compile-time checks of every twin, from the C
/// layout the device compiler (`nvcc` with `nvcc_args`) gives each struct.
pub fn generate(nvcc_args: &[String], out_dir: &Path) -> anyhow::Result<()> {
    println!("cargo:rerun-if-changed={RUST_DIR}");
    let mut c_files = vec![];
    for path in files(Path::new(C_DIR), &["cu", "cuh"])? {
        let text = std::fs::read_to_string(&path)
            .with_context(|| format!("reading {}", path.display()))?;
        let rel = path
            .strip_prefix(C_DIR)?
            .to_string_lossy()
            .replace('\\', "/");
        c_files.push((rel, strip_comments(&text)));
    }
    let mut twins = vec![];
    for (name, rust) in rust_twins()? {
        let mut found = vec![];
        for (file, text) in &c_files {
            for (start, body, end) in definitions(text, &name)? {
                found.push((file, &text[start..end], &text[body]));
            }
        }
        let (file, definition, body) = match found.as_slice() {
            [one] => *one,
            [] => bail!(
                "ABI: `{rust}` is #[repr(C)] but no `struct {name}` is defined under \
                 {C_DIR}/: every #[repr(C)] struct of {RUST_DIR} mirrors a C struct of the \
                 same name (the build checks their layouts against each other)"
            ),
            more => bail!(
                "ABI: `struct {name}` (twin of `{rust}`) is defined more than once: in {}",
                more.iter()
                    .map(|(f, ..)| format!("{C_DIR}/{f}"))
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        };
        let fields = parse_fields(body).with_context(|| {
            format!("ABI: reading the fields of `struct {name}` in {C_DIR}/{file}")
        })?;
        twins.push(Twin {
            name,
            rust,
            file: file.clone(),
            definition: definition.to_string(),
            fields,
        });
    }

    let probe = out_dir.join("abi_probe.cu");
    let ptx = out_dir.join("abi_probe.ptx");
    std::fs::write(&probe, probe_source(&twins, &c_files))?;
    let out = std::process::Command::new("nvcc")
        .args(nvcc_args)
        .args(["-arch=compute_90a", "-ptx"])
        .arg(&probe)
        .arg("-o")
        .arg(&ptx)
        .output()
        .context("running nvcc on the layout probe (is the CUDA toolkit's bin on PATH?)")?;
    if !out.status.success() {
        bail!(
            "ABI: the layout probe {} (the C twins of {RUST_DIR}'s #[repr(C)] structs) did \
             not compile; a struct defined in a .cu file may use only what that file \
             includes:\n{}{}",
            probe.display(),
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let values = read_array(&std::fs::read_to_string(&ptx)?, ARRAY)
        .with_context(|| format!("ABI: reading `{ARRAY}` from {}", ptx.display()))?;
    std::fs::write(out_dir.join("abi_layout.rs"), checks(&twins, &values)?)?;
    Ok(())
}

/// The files under `dir` (recursively) with one of `exts`, sorted.
pub fn files(dir: &Path, exts: &[&str]) -> anyhow::Result<Vec<PathBuf>> {
    let mut out = vec![];
    for entry in std::fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))? {
        let path = entry?.path();
        if path.is_dir() {
            out.extend(files(&path, exts)?);
        } else if path
            .extension()
            .is_some_and(|e| exts.iter().any(|x| e == *x))
        {
            out.push(path);
        }
    }
    out.sort();
    Ok(out)
}

/// (name, path) of every `#[repr(C)]` struct under `src/cuda`.
fn rust_twins() -> anyhow::Result<Vec<(String, String)>> {
    let mut twins = vec![];
    for path in files(Path::new(RUST_DIR), &["rs"])? {
        // src/cuda/decode.rs -> crate::cuda::decode; src/cuda/mod.rs -> crate::cuda
        let rel = path.strip_prefix("src")?.with_extension("");
        let mut module: Vec<String> = rel
            .components()
            .map(|c| c.as_os_str().to_string_lossy().into_owned())
            .collect();
        if module.last().is_some_and(|m| m == "mod") {
            module.pop();
        }
        let module = module.join("::");
        let text = std::fs::read_to_string(&path)?;
        let lines: Vec<&str> = text.lines().map(str::trim).collect();
        for (i, line) in lines.iter().enumerate() {
            if !(line.starts_with("#[repr(C)") || line.starts_with("#[repr(C,")) {
                continue;
            }
            let item = lines[i + 1..]
                .iter()
                .find(|l| !(l.starts_with("#[") || l.starts_with("//")));
            let name = item.and_then(|item| {
                let mut words = item.split_whitespace();
                words.find(|w| *w == "struct")?;
                let word = words.next()?;
                let end = word
                    .find(|c: char| !(c.is_alphanumeric() || c == '_'))
                    .unwrap_or(word.len());
                Some(word[..end].to_string()).filter(|n| !n.is_empty())
            });
            let Some(name) = name else {
                bail!(
                    "ABI: {}:{}: #[repr(C)] on something other than a struct, which the \
                     layout check does not understand",
                    path.display(),
                    i + 1
                );
            };
            twins.push((name.clone(), format!("crate::{module}::{name}")));
        }
    }
    Ok(twins)
}

/// `text` without its comments (string and character literals kept as they are).
fn strip_comments(text: &str) -> String {
    let b = text.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        match (b[i], b.get(i + 1)) {
            (b'/', Some(b'/')) => {
                while i < b.len() && b[i] != b'\n' {
                    i += 1;
                }
            }
            (b'/', Some(b'*')) => {
                let end = text[i + 2..].find("*/").map_or(b.len(), |e| i + 2 + e + 2);
                // Keep the line breaks, so that line-based reading still works.
                out.push(b' ');
                out.extend(b[i..end].iter().filter(|&&c| c == b'\n'));
                i = end;
            }
            (b'"' | b'\'', _) => {
                let end = skip_literal(b, i);
                out.extend_from_slice(&b[i..end]);
                i = end;
            }
            (c, _) => {
                out.push(c);
                i += 1;
            }
        }
    }
    // Only whole ASCII runs were removed: still UTF-8.
    String::from_utf8(out).expect("comments end on ASCII")
}

/// The index past the string or character literal starting at `b[i]`.
fn skip_literal(b: &[u8], i: usize) -> usize {
    let quote = b[i];
    let mut j = i + 1;
    while j < b.len() && b[j] != quote {
        j += if b[j] == b'\\' { 2 } else { 1 };
    }
    (j + 1).min(b.len())
}

/// The index of the bracket closing the one at `b[open]`, literals skipped.
fn closing(b: &[u8], open: usize) -> anyhow::Result<usize> {
    let (up, down) = (b[open], if b[open] == b'{' { b'}' } else { b')' });
    let (mut depth, mut i) = (0, open);
    while i < b.len() {
        match b[i] {
            b'"' | b'\'' => {
                i = skip_literal(b, i);
                continue;
            }
            c if c == up => depth += 1,
            c if c == down => {
                depth -= 1;
                if depth == 0 {
                    return Ok(i);
                }
            }
            _ => {}
        }
        i += 1;
    }
    bail!("unbalanced `{}`", up as char)
}

fn is_ident(c: u8) -> bool {
    c.is_ascii_alphanumeric() || c == b'_'
}

fn skip_ws(b: &[u8], mut i: usize) -> usize {
    while i < b.len() && b[i].is_ascii_whitespace() {
        i += 1;
    }
    i
}

/// Each definition `struct [alignas(..)] name { body };` in `text` (comments removed):
/// (start, the body's range, the end past the `;`).
fn definitions(
    text: &str,
    name: &str,
) -> anyhow::Result<Vec<(usize, std::ops::Range<usize>, usize)>> {
    let b = text.as_bytes();
    let mut found = vec![];
    let mut from = 0;
    while let Some(at) = text[from..].find("struct") {
        let start = from + at;
        from = start + "struct".len();
        if (start > 0 && is_ident(b[start - 1])) || b.get(from).is_some_and(|&c| is_ident(c)) {
            continue;
        }
        let mut i = skip_ws(b, from);
        if text[i..].starts_with("alignas") {
            i = skip_ws(b, i + "alignas".len());
            if b.get(i) != Some(&b'(') {
                continue;
            }
            i = skip_ws(b, closing(b, i)? + 1);
        }
        let word_end = (i..b.len()).find(|&j| !is_ident(b[j])).unwrap_or(b.len());
        if &text[i..word_end] != name {
            continue;
        }
        let open = skip_ws(b, word_end);
        if b.get(open) != Some(&b'{') {
            continue; // a declaration or a use, not the definition
        }
        let close = closing(b, open)?;
        let semi = skip_ws(b, close + 1);
        if b.get(semi) != Some(&b';') {
            bail!("`struct {name} {{ .. }}` is not followed by `;`");
        }
        found.push((start, open + 1..close, semi + 1));
    }
    Ok(found)
}

/// The data members of a struct body (comments removed), in order.
fn parse_fields(body: &str) -> anyhow::Result<Vec<Field>> {
    if let Some(line) = body.lines().find(|l| l.trim_start().starts_with('#')) {
        bail!(
            "a preprocessor line inside the struct (`{}`): not understood",
            line.trim()
        );
    }
    let b = body.as_bytes();
    let mut fields = vec![];
    let (mut i, mut start) = (0, 0);
    while i < b.len() {
        match b[i] {
            b'"' | b'\'' => {
                i = skip_literal(b, i);
                continue;
            }
            // A member function's body (what precedes it has its parameter list).
            b'{' if body[start..i].contains('(') => {
                i = skip_ws(b, closing(b, i)? + 1);
                if b.get(i) == Some(&b';') {
                    i += 1;
                }
                start = i;
                continue;
            }
            b'{' => bail!(
                "`{} {{`: a nested struct, union or brace initializer is not understood",
                body[start..i].trim()
            ),
            b';' => {
                fields.extend(declaration(&body[start..i])?);
                start = i + 1;
            }
            _ => {}
        }
        i += 1;
    }
    if !body[start..].trim().is_empty() {
        bail!("`{}` is not a complete declaration", body[start..].trim());
    }
    if fields.is_empty() {
        bail!("no data members found");
    }
    Ok(fields)
}

/// The fields of one member declaration `[alignas(n)] type a, *b, c[N]` (no storage:
/// none).
fn declaration(stmt: &str) -> anyhow::Result<Vec<Field>> {
    let mut s = stmt.split_whitespace().collect::<Vec<_>>().join(" ");
    for label in ["public:", "private:", "protected:"] {
        if let Some(rest) = s.strip_prefix(label) {
            s = rest.trim().to_string();
        }
    }
    let first = s.split([' ', '(', '<']).next().unwrap_or_default();
    if s.is_empty()
        || [
            "static",
            "static_assert",
            "using",
            "typedef",
            "friend",
            "template",
        ]
        .contains(&first)
    {
        return Ok(vec![]);
    }
    if s.starts_with("alignas") {
        let b = s.as_bytes();
        let open = s.find('(').context("`alignas` without `(`")?;
        s = s[closing(b, open)? + 1..].trim().to_string();
    }
    let s = s.replace("std::", "");
    if s.contains(['(', ')', '&', ':']) {
        bail!(
            "`{stmt}`: not understood as a data member (member function declaration, \
             function pointer, reference or bit-field?)",
            stmt = stmt.trim()
        );
    }
    let mut parts = s.split(',');
    let first = parts.next().unwrap_or_default();
    let (base_text, first) =
        split_base(first).with_context(|| format!("`{}`: no type and name", stmt.trim()))?;
    let base = base_text
        .split_whitespace()
        .filter(|w| !["const", "volatile", "__restrict__", "struct"].contains(w))
        .collect::<Vec<_>>()
        .join(" ");
    if base.is_empty() {
        bail!("`{}`: no type", stmt.trim());
    }
    let mut fields = vec![];
    for declarator in std::iter::once(first).chain(parts.map(str::to_string)) {
        // A default member initializer does not change the layout.
        let declarator = declarator.split('=').next().unwrap_or_default().trim();
        let (head, dims) = declarator.split_at(declarator.find('[').unwrap_or(declarator.len()));
        let stars = head.matches('*').count();
        let name = head.replace('*', "").trim().to_string();
        if name.is_empty() || !name.bytes().all(is_ident) || name.as_bytes()[0].is_ascii_digit() {
            bail!(
                "`{}`: declarator `{declarator}` not understood",
                stmt.trim()
            );
        }
        let array = match dims.matches('[').count() {
            0 => None,
            1 if dims.ends_with(']') => Some(dims[1..dims.len() - 1].trim().to_string()),
            _ => bail!(
                "`{}`: only one-dimensional arrays are understood",
                stmt.trim()
            ),
        };
        fields.push(Field {
            decl: format!("{base}{} {name}{dims}", "*".repeat(stars)),
            name,
            base: base.clone(),
            pointer: stars > 0,
            array,
        });
    }
    Ok(fields)
}

/// `const void* q` -> (`const void`, `* q`): the type, and the first declarator with the
/// stars that belong to it.
fn split_base(first: &str) -> Option<(String, String)> {
    let head_end = first.find(['[', '=']).unwrap_or(first.len());
    let head = first[..head_end].trim_end();
    let name_start = head
        .rfind(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .map_or(0, |p| p + 1);
    let prefix = &head[..name_start];
    let base = prefix.trim_end().trim_end_matches(['*', ' ']);
    if base.is_empty() {
        return None;
    }
    Some((
        base.to_string(),
        format!("{}{}", &prefix[base.len()..], &first[name_start..]),
    ))
}

/// The probe: every twin's size and alignment, then each field's offset and size (and an
/// array's length), in that order, into one device array.
fn probe_source(twins: &[Twin], c_files: &[(String, String)]) -> String {
    let mut src = String::from(
        "// Generated by build.rs (abi_layout): the layout of the C twins of the Rust\n\
         // #[repr(C)] structs, as the device compiler lays them out.\n#include <cstddef>\n",
    );
    let mut seen = vec![];
    for twin in twins.iter().filter(|t| !t.file.ends_with(".cu")) {
        if !seen.contains(&&twin.file) {
            seen.push(&twin.file);
            let _ = writeln!(src, "#include \"{}\"", twin.file);
        }
    }
    for (file, text) in c_files.iter().filter(|(f, _)| f.ends_with(".cu")) {
        let defined: Vec<&Twin> = twins.iter().filter(|t| &t.file == file).collect();
        if defined.is_empty() {
            continue;
        }
        let _ = writeln!(src, "// from {C_DIR}/{file}");
        // Not the kernels' instantiations (build/catalogue.rs): the structs come before them.
        for line in text.lines().filter(|l| {
            let l = l.trim_start();
            l.starts_with("#include") && !l.contains("\"instances/")
        }) {
            let _ = writeln!(src, "{}", line.trim());
        }
        for twin in defined {
            // Without the blank lines its comments left.
            for line in twin.definition.lines().filter(|l| !l.trim().is_empty()) {
                let _ = writeln!(src, "{line}");
            }
        }
    }
    let _ = writeln!(
        src,
        "extern \"C\" __device__ unsigned long long {ARRAY}[] = {{"
    );
    for twin in twins {
        let s = &twin.name;
        let _ = writeln!(src, "    sizeof({s}), alignof({s}),");
        for f in &twin.fields {
            let n = &f.name;
            let _ = write!(src, "    offsetof({s}, {n}), sizeof({s}::{n}),");
            if f.array.is_some() {
                let _ = write!(src, " sizeof({s}::{n}) / sizeof({s}::{n}[0]),");
            }
            src.push('\n');
        }
    }
    src.push_str("};\n");
    src
}

/// The values of the probe's array in its PTX: `.b8 name[N] = {bytes}` (trailing zeros
/// left out) or `.u64 name[N] = {values}`.
pub fn read_array(ptx: &str, array: &str) -> anyhow::Result<Vec<u64>> {
    let at = ptx
        .find(&format!("{array}["))
        .context("the array is not in the PTX")?;
    let decl_start = ptx[..at].rfind('\n').map_or(0, |p| p + 1);
    let decl = &ptx[decl_start..at];
    let width = if decl.contains(".b8") || decl.contains(".u8") {
        1
    } else if decl.contains(".b64") || decl.contains(".u64") || decl.contains(".s64") {
        8
    } else {
        bail!("unexpected declaration `{decl}`");
    };
    let rest = &ptx[at..];
    let len: usize = rest[array.len() + 1..rest.find(']').context("no `]`")?].parse()?;
    let open = rest.find('{').context("no initializer")?;
    let close = rest.find('}').context("no `}`")?;
    let mut items = rest[open + 1..close]
        .split(',')
        .map(|v| v.trim().parse::<u64>())
        .collect::<Result<Vec<_>, _>>()?;
    items.resize(len, 0);
    if width == 8 {
        return Ok(items);
    }
    let bytes = items
        .iter()
        .map(|&v| u8::try_from(v))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(bytes
        .chunks_exact(8)
        .map(|c| u64::from_le_bytes(c.try_into().unwrap()))
        .collect())
}

/// The Rust type of a C field: cudarc's `CUdeviceptr` (u64) for any pointer.
fn rust_type(f: &Field, len: Option<u64>, twins: &[Twin]) -> anyhow::Result<String> {
    let scalar = if f.pointer {
        "u64".to_string()
    } else {
        let known = match f.base.as_str() {
            "int" | "signed" | "signed int" | "int32_t" => "i32",
            "unsigned" | "unsigned int" | "uint32_t" => "u32",
            "long long" | "long long int" | "int64_t" => "i64",
            "unsigned long long" | "unsigned long long int" | "uint64_t" => "u64",
            "short" | "int16_t" => "i16",
            "unsigned short" | "uint16_t" => "u16",
            "signed char" | "int8_t" => "i8",
            "unsigned char" | "uint8_t" => "u8",
            "float" => "f32",
            "double" => "f64",
            "bool" => "bool",
            _ => "",
        };
        match twins.iter().find(|t| t.name == f.base) {
            _ if !known.is_empty() => known.to_string(),
            Some(twin) => twin.rust.clone(),
            None => bail!(
                "ABI: field `{}` has C type `{}`, which has no Rust twin: add its mapping to \
                 build.rs (abi_layout::rust_type) or a #[repr(C)] twin under {RUST_DIR}",
                f.name,
                f.base
            ),
        }
    };
    Ok(match len {
        Some(n) => format!("[{scalar}; {n}]"),
        None => scalar,
    })
}

/// The Rust checks of every twin against the probe's `values`.
fn checks(twins: &[Twin], values: &[u64]) -> anyhow::Result<String> {
    let mut out = String::from(
        "// Generated by build.rs (abi_layout) from the C structs under cuda/ and their \
         layout as nvcc\n// gives it; see the `abi_layout` module of src/cuda/mod.rs.\n\n\
         /// The size of the field `get` returns; its type is `F`.\n\
         const fn field_size<S, F>(_get: fn(&S) -> &F) -> usize {\n    \
         ::core::mem::size_of::<F>()\n}\n",
    );
    let mut next = values.iter().copied();
    let mut take = || next.next().context("the probe's array is too short");
    for t in twins {
        let (name, rust, file) = (&t.name, &t.rust, format!("{C_DIR}/{}", t.file));
        let (size, align) = (take()?, take()?);
        writeln!(
            out,
            "\n// struct {name} ({file}): {size} bytes, aligned to {align}."
        )?;
        writeln!(
            out,
            "const _: () = assert!(::core::mem::size_of::<{rust}>() == {size}, \
             \"ABI: size_of::<{name}>() in Rust differs from sizeof({name}) = {size} in {file}\");"
        )?;
        writeln!(
            out,
            "const _: () = assert!(::core::mem::align_of::<{rust}>() == {align}, \
             \"ABI: align_of::<{name}>() in Rust differs from alignof({name}) = {align} in {file}\");"
        )?;
        for f in &t.fields {
            let (field, decl) = (&f.name, &f.decl);
            let (offset, bytes) = (take()?, take()?);
            let len = f.array.as_ref().map(|_| take()).transpose()?;
            let ty = rust_type(f, len, twins).with_context(|| format!("in struct {name}"))?;
            writeln!(
                out,
                "const _: () = assert!(::core::mem::offset_of!({rust}, {field}) == {offset}, \
                 \"ABI: offset_of!({name}, {field}) in Rust differs from offsetof({name}, {field}) = {offset} in {file}\");"
            )?;
            writeln!(
                out,
                "const _: () = assert!(field_size::<{rust}, {ty}>(|s| &s.{field}) == {bytes}, \
                 \"ABI: {name}.{field} in Rust is not {ty} of {bytes} bytes, as `{decl}` in {file}\");"
            )?;
        }
        // Exactly C's fields, no `..`: a field that one side has and the other lacks (even
        // one in tail padding, which no size shows) does not compile.
        writeln!(
            out,
            "#[allow(dead_code, non_snake_case)]\nfn the_fields_of_{name}_in_C(s: &{rust}) {{\n    let {rust} {{"
        )?;
        for f in &t.fields {
            writeln!(out, "        {}: _,", f.name)?;
        }
        writeln!(out, "    }} = s;\n}}")?;
    }
    if next.next().is_some() {
        bail!("ABI: the probe's array is longer than its fields");
    }
    Ok(out)
}
