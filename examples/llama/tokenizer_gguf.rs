//! The tokenizer stored in a GGUF file's metadata, rebuilt as a `tokenizers::Tokenizer` that
//! encodes like the Hugging Face `tokenizer.json` the file was converted from.
//!
//! llama.cpp's converter copies a byte-level BPE (`tokenizer.ggml.model` = "gpt2") as its
//! vocabulary (`tokens`), its merges (`merges`, "left right" strings), each token's type
//! (`token_type`: 1 normal, 3 control, 4 user-defined) and the BOS/EOS ids. What it does not
//! copy is the pre-tokenizer: it names it instead (`tokenizer.ggml.pre`), and llama.cpp keeps
//! the regular expressions of each name in its source. The names this module knows are those
//! whose Hugging Face pre-tokenizers it rebuilds exactly; any other is an error naming it.

use anyhow::{bail, Context, Result};
use candle::quantized::gguf_file::Value;
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::processors::template::TemplateProcessing;
use tokenizers::{AddedToken, PreTokenizerWrapper, SplitDelimiterBehavior, Tokenizer};

use super::gguf::{md_str, md_uint, Metadata};

/// LLaMA 3's split (its `tokenizer.json`: a `Split` of this pattern, then byte-level
/// mapping without the GPT-2 regex): letters, numbers in groups of up to three,
/// punctuation runs, newlines.
const LLAMA3_PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// The pre-tokenizer of a `tokenizer.ggml.pre` name, and whether the BPE skips merging
/// words that are whole tokens (`ignore_merges`, set by LLaMA 3's tokenizer).
fn pre_tokenizer(pre: &str) -> Result<(PreTokenizerWrapper, bool)> {
    Ok(match pre {
        // GPT-2's regex inside the byte-level step. (llama.cpp's "default" is another
        // expression list, written for files whose tokenizer its converter did not know.)
        "gpt-2" => (ByteLevel::new(false, true, true).into(), false),
        // The same after splitting off each digit (llama.cpp gives these names one
        // expression list: "\p{N}" then GPT-2's).
        "smollm" | "starcoder" | "refact" | "codeshell" | "exaone" | "minerva" => (
            Sequence::new(vec![
                Digits::new(true).into(),
                ByteLevel::new(false, true, true).into(),
            ])
            .into(),
            false,
        ),
        "llama3" | "llama-v3" | "llama-bpe" => {
            let split = Split::new(
                SplitPattern::Regex(LLAMA3_PATTERN.into()),
                SplitDelimiterBehavior::Isolated,
                false,
            )
            .map_err(|e| anyhow::anyhow!("the LLaMA 3 split pattern: {e}"))?;
            (
                Sequence::new(vec![
                    split.into(),
                    ByteLevel::new(false, true, false).into(),
                ])
                .into(),
                true,
            )
        }
        other => bail!(
            "tokenizer.ggml.pre {other:?} is not supported (gpt-2, smollm, starcoder, llama-bpe \
             and their kin)"
        ),
    })
}

fn strings<'a>(md: &'a Metadata, key: &str) -> Result<Option<Vec<&'a str>>> {
    match md.get(key) {
        None => Ok(None),
        Some(Value::Array(a)) => a
            .iter()
            .map(|v| match v {
                Value::String(s) => Ok(s.as_str()),
                other => bail!("GGUF metadata {key}: expected strings, found {other:?}"),
            })
            .collect::<Result<Vec<_>>>()
            .map(Some),
        Some(other) => bail!("GGUF metadata {key}: expected an array, found {other:?}"),
    }
}

fn ints(md: &Metadata, key: &str) -> Result<Option<Vec<i64>>> {
    match md.get(key) {
        None => Ok(None),
        Some(Value::Array(a)) => a
            .iter()
            .map(|v| match v {
                Value::I32(x) => Ok(*x as i64),
                Value::U32(x) => Ok(*x as i64),
                Value::I8(x) => Ok(*x as i64),
                Value::U8(x) => Ok(*x as i64),
                other => bail!("GGUF metadata {key}: expected integers, found {other:?}"),
            })
            .collect::<Result<Vec<_>>>()
            .map(Some),
        Some(other) => bail!("GGUF metadata {key}: expected an array, found {other:?}"),
    }
}

fn flag(md: &Metadata, key: &str) -> Option<bool> {
    match md.get(key) {
        Some(Value::Bool(b)) => Some(*b),
        _ => None,
    }
}

/// The tokenizer of a GGUF file's metadata.
pub fn from_metadata(md: &Metadata) -> Result<Tokenizer> {
    let model = md_str(md, "tokenizer.ggml.model")?.context("no tokenizer.ggml.model")?;
    if model != "gpt2" {
        bail!(
            "tokenizer.ggml.model {model:?} is not supported (gpt2, the byte-level BPE of \
             LLaMA 3, SmolLM, Qwen, ...)"
        )
    }
    let tokens = strings(md, "tokenizer.ggml.tokens")?.context("no tokenizer.ggml.tokens")?;
    let merges = strings(md, "tokenizer.ggml.merges")?.context("no tokenizer.ggml.merges")?;
    let types = ints(md, "tokenizer.ggml.token_type")?;
    if let Some(t) = &types {
        if t.len() != tokens.len() {
            bail!(
                "tokenizer.ggml.token_type: {} types for {} tokens",
                t.len(),
                tokens.len()
            )
        }
    }
    let pre = md_str(md, "tokenizer.ggml.pre")?.unwrap_or("(none)");
    let (pre_tok, ignore_merges) = pre_tokenizer(pre)?;

    let vocab: Vocab = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.to_string(), i as u32))
        .collect();
    let merges = merges
        .iter()
        .map(|m| {
            m.split_once(' ')
                .map(|(a, b)| (a.to_string(), b.to_string()))
                .with_context(|| format!("tokenizer.ggml.merges: {m:?} is not \"left right\""))
        })
        .collect::<Result<Vec<_>>>()?;
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .ignore_merges(ignore_merges)
        .build()
        .map_err(|e| anyhow::anyhow!("tokenizer.ggml: {e}"))?;
    let mut tok = Tokenizer::new(bpe);
    tok.with_pre_tokenizer(Some(pre_tok));
    tok.with_decoder(Some(ByteLevelDecoder::default()));

    // Control tokens are the special tokens of tokenizer.json (matched whole in the text,
    // skipped when decoding with skip_special_tokens); user-defined ones are its other added
    // tokens (matched whole, always decoded).
    if let Some(types) = &types {
        let (mut special, mut added) = (Vec::new(), Vec::new());
        for (t, &ty) in tokens.iter().zip(types) {
            match ty {
                3 => special.push(AddedToken::from(t.to_string(), true)),
                4 => added.push(AddedToken::from(t.to_string(), false)),
                _ => {}
            }
        }
        tok.add_special_tokens(special)
            .map_err(|e| anyhow::anyhow!("tokenizer.ggml: control tokens: {e}"))?;
        tok.add_tokens(added)
            .map_err(|e| anyhow::anyhow!("tokenizer.ggml: user-defined tokens: {e}"))?;
    }

    // llama.cpp adds BOS by default for LLaMA 3's tokenizer and not for the others; the
    // metadata says so explicitly when the converter knew.
    let add_bos = flag(md, "tokenizer.ggml.add_bos_token").unwrap_or(pre == "llama-bpe");
    let add_eos = flag(md, "tokenizer.ggml.add_eos_token").unwrap_or(false);
    let token_of = |key: &str| -> Result<Option<(String, u32)>> {
        Ok(match md_uint(md, key)? {
            Some(id) => {
                let t = tokens
                    .get(id as usize)
                    .with_context(|| format!("{key} {id}: past the vocabulary"))?;
                Some((t.to_string(), id as u32))
            }
            None => None,
        })
    };
    let mut template = Vec::new();
    let mut specials = Vec::new();
    if add_bos {
        let (t, id) = token_of("tokenizer.ggml.bos_token_id")?
            .context("tokenizer.ggml.add_bos_token without a bos_token_id")?;
        template.push(t.clone());
        specials.push((t, id));
    }
    template.push("$A".to_string());
    if add_eos {
        let (t, id) = token_of("tokenizer.ggml.eos_token_id")?
            .context("tokenizer.ggml.add_eos_token without an eos_token_id")?;
        template.push(t.clone());
        specials.push((t, id));
    }
    if !specials.is_empty() {
        let processor = TemplateProcessing::builder()
            .try_single(template.join(" "))
            .map_err(anyhow::Error::msg)?
            .special_tokens(specials)
            .build()?;
        tok.with_post_processor(Some(processor));
    }
    Ok(tok)
}
