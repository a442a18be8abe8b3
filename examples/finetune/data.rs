//! Training data: documents tokenised with the model's tokenizer, cut to `--seq-len`, packed
//! into micro-batches of whole documents (a varlen batch: no padding, and no token attends
//! across a document boundary).
//!
//! Inputs: plain text files (one document each), or JSONL with `{"text": ...}` (loss on every
//! next token) or `{"prompt": ..., "completion": ...}` (loss on the completion only).

use std::path::Path;

use anyhow::{bail, Context, Result};
use candle::{Device, Tensor};
use tokenizers::Tokenizer;

/// One training sequence and where its loss applies: `(position, next token)`.
#[derive(Clone, Debug, PartialEq)]
pub struct Example {
    pub tokens: Vec<u32>,
    pub targets: Vec<(usize, u32)>,
}

/// Sequences packed one after another, as `Llama::forward_packed` takes them.
#[derive(Clone, Debug)]
pub struct Batch {
    pub ids: Vec<u32>,
    pub seqlens: Vec<usize>,
    /// Rows of the packed hidden states that predict a target.
    pub rows: Vec<u32>,
    pub targets: Vec<u32>,
}

impl Batch {
    pub fn pack(examples: Vec<Example>) -> Self {
        let mut b = Batch {
            ids: vec![],
            seqlens: vec![],
            rows: vec![],
            targets: vec![],
        };
        for e in examples {
            let start = b.ids.len() as u32;
            for &(pos, target) in &e.targets {
                b.rows.push(start + pos as u32);
                b.targets.push(target);
            }
            b.seqlens.push(e.tokens.len());
            b.ids.extend(e.tokens);
        }
        b
    }

    pub fn tokens(&self) -> usize {
        self.ids.len()
    }

    /// `(ids, rows, targets)` on `dev`.
    pub fn tensors(&self, dev: &Device) -> candle::Result<(Tensor, Tensor, Tensor)> {
        Ok((
            Tensor::new(self.ids.as_slice(), dev)?,
            Tensor::new(self.rows.as_slice(), dev)?,
            Tensor::new(self.targets.as_slice(), dev)?,
        ))
    }
}

/// Every next token of `tokens` from `first` on is a target.
fn next_tokens(tokens: &[u32], first: usize) -> Vec<(usize, u32)> {
    (first..tokens.len().saturating_sub(1))
        .map(|i| (i, tokens[i + 1]))
        .collect()
}

/// Cuts an example into pieces of at most `seq_len` tokens (targets that cross a cut are lost).
fn cut(e: Example, seq_len: usize) -> Vec<Example> {
    if e.tokens.len() <= seq_len {
        return vec![e];
    }
    e.tokens
        .chunks(seq_len)
        .enumerate()
        .map(|(c, chunk)| {
            let (lo, hi) = (c * seq_len, c * seq_len + chunk.len());
            let targets = e
                .targets
                .iter()
                .filter(|&&(p, _)| p >= lo && p + 1 < hi)
                .map(|&(p, t)| (p - lo, t))
                .collect();
            Example {
                tokens: chunk.to_vec(),
                targets,
            }
        })
        .filter(|e: &Example| !e.targets.is_empty())
        .collect()
}

fn encode(tok: &Tokenizer, text: &str, special: bool) -> Result<Vec<u32>> {
    Ok(tok
        .encode(text, special)
        .map_err(anyhow::Error::msg)?
        .get_ids()
        .to_vec())
}

/// The documents of `path` (text or `.jsonl`), cut to `seq_len`.
pub fn load(
    path: &Path,
    tok: &Tokenizer,
    eos: Option<u32>,
    seq_len: usize,
) -> Result<Vec<Example>> {
    let body =
        std::fs::read_to_string(path).with_context(|| format!("--data {}", path.display()))?;
    let mut docs = vec![];
    let jsonl = path.extension().is_some_and(|e| e == "jsonl");
    let lines: Box<dyn Iterator<Item = &str>> = if jsonl {
        Box::new(body.lines().filter(|l| !l.trim().is_empty()))
    } else {
        Box::new(std::iter::once(body.as_str()))
    };
    for (n, line) in lines.enumerate() {
        let (mut tokens, first) = if jsonl {
            let v: serde_json::Value = serde_json::from_str(line)
                .with_context(|| format!("{} line {}: not JSON", path.display(), n + 1))?;
            match (v["text"].as_str(), v["prompt"].as_str(), v["completion"].as_str()) {
                (Some(text), _, _) => (encode(tok, text, true)?, 0),
                (None, Some(p), Some(c)) => {
                    let prompt = encode(tok, p, true)?;
                    let first = prompt.len().saturating_sub(1);
                    let mut all = prompt;
                    all.extend(encode(tok, c, false)?);
                    (all, first)
                }
                _ => bail!(
                    "{} line {}: expected {{\"text\": ...}} or {{\"prompt\": ..., \"completion\": ...}}",
                    path.display(),
                    n + 1
                ),
            }
        } else {
            (encode(tok, line, true)?, 0)
        };
        tokens.extend(eos);
        let targets = next_tokens(&tokens, first);
        docs.extend(cut(Example { tokens, targets }, seq_len));
    }
    if docs.is_empty() {
        bail!("--data {}: no document with a target", path.display())
    }
    Ok(docs)
}

/// Groups documents into micro-batches of at most `max_tokens` tokens, in order.
pub fn batches(docs: &[Example], max_tokens: usize) -> Vec<Batch> {
    let mut out = vec![];
    let mut cur: Vec<Example> = vec![];
    let mut n = 0;
    for d in docs {
        if n + d.tokens.len() > max_tokens && !cur.is_empty() {
            out.push(Batch::pack(std::mem::take(&mut cur)));
            n = 0;
        }
        n += d.tokens.len();
        cur.push(d.clone());
    }
    if !cur.is_empty() {
        out.push(Batch::pack(cur));
    }
    out
}
