//! GGUF files in the LLaMA example, made offline from the built-in checkpoint the way
//! llama.cpp's converter writes them (q/k rows permuted, norms in f32, LLaMA 3 rope scaling
//! as `rope_freqs.weight`, the tokenizer as metadata): loading one gives back the checkpoint's
//! configuration, weights (exactly in f32, within each format's rounding otherwise) and
//! tokenizer; broken or unsupported files are errors that say what is wrong.
#![allow(dead_code)] // the example's modules are shared with other programs

#[path = "../examples/llama/builtin.rs"]
mod builtin;
#[path = "../examples/llama/checkpoint.rs"]
mod checkpoint;
#[path = "../examples/llama/generate.rs"]
mod generate;
#[path = "../examples/llama/gguf.rs"]
mod gguf;
#[path = "../examples/llama/model/mod.rs"]
mod model;
#[path = "../examples/llama/tokenizer_gguf.rs"]
mod tokenizer_gguf;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use candle::quantized::gguf_file::{self, Value};
use candle::quantized::{GgmlDType, QTensor};
use candle::{DType, Device, Tensor};
use candle_transformers::generation::Sampling;
use checkpoint::Checkpoint;
use model::{AttnImpl, CacheLayout};

fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("candle-flash-gguf-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// The built-in checkpoint in `dir`, and its weights.
fn builtin(name: &str) -> (PathBuf, HashMap<String, Tensor>) {
    let dir = scratch(name);
    builtin::write(&dir, 11).unwrap();
    let w = candle::safetensors::load(dir.join("model.safetensors"), &Device::Cpu).unwrap();
    (dir, w)
}

type Meta = Vec<(String, Value)>;
type Tensors = Vec<(String, Arc<QTensor>)>;

/// The GGUF name of a Hugging Face tensor name.
fn gguf_name(hf: &str) -> String {
    let fixed = [
        ("model.embed_tokens.weight", "token_embd.weight"),
        ("model.norm.weight", "output_norm.weight"),
        ("lm_head.weight", "output.weight"),
    ];
    if let Some((_, g)) = fixed.iter().find(|(h, _)| *h == hf) {
        return g.to_string();
    }
    let rest = hf.strip_prefix("model.layers.").unwrap();
    let (layer, rest) = rest.split_once('.').unwrap();
    let (part, kind) = rest.rsplit_once('.').unwrap();
    let g = match part {
        "input_layernorm" => "attn_norm",
        "post_attention_layernorm" => "ffn_norm",
        "self_attn.q_proj" => "attn_q",
        "self_attn.k_proj" => "attn_k",
        "self_attn.v_proj" => "attn_v",
        "self_attn.o_proj" => "attn_output",
        "mlp.gate_proj" => "ffn_gate",
        "mlp.up_proj" => "ffn_up",
        "mlp.down_proj" => "ffn_down",
        other => panic!("{other}"),
    };
    format!("blk.{layer}.{g}.{kind}")
}

/// Metadata and tensors of a checkpoint as llama.cpp's converter writes them, matrices in
/// `dtype`.
fn convert(dir: &Path, weights: &HashMap<String, Tensor>, dtype: GgmlDType) -> (Meta, Tensors) {
    let ckpt = Checkpoint::open(dir).unwrap();
    let c = &ckpt.config;
    let u32v = |v: usize| Value::U32(v as u32);
    let mut md: Meta = vec![
        ("general.architecture".into(), Value::String("llama".into())),
        ("llama.block_count".into(), u32v(c.num_hidden_layers)),
        (
            "llama.context_length".into(),
            u32v(c.max_position_embeddings),
        ),
        ("llama.embedding_length".into(), u32v(c.hidden_size)),
        (
            "llama.feed_forward_length".into(),
            u32v(c.intermediate_size),
        ),
        (
            "llama.attention.head_count".into(),
            u32v(c.num_attention_heads),
        ),
        (
            "llama.attention.head_count_kv".into(),
            u32v(c.num_kv_heads()),
        ),
        ("llama.rope.dimension_count".into(), u32v(c.head_dim())),
        (
            "llama.rope.freq_base".into(),
            Value::F32(c.rope_theta as f32),
        ),
        (
            "llama.attention.layer_norm_rms_epsilon".into(),
            Value::F32(c.rms_norm_eps as f32),
        ),
    ];
    // The tokenizer: vocabulary by id, merges as "left right", <s> and </s> as control.
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("tokenizer.json")).unwrap())
            .unwrap();
    let vocab = json["model"]["vocab"].as_object().unwrap();
    let mut tokens = vec![String::new(); vocab.len()];
    for (t, id) in vocab {
        tokens[id.as_u64().unwrap() as usize] = t.clone();
    }
    let merges: Vec<Value> = json["model"]["merges"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| match m {
            serde_json::Value::String(s) => Value::String(s.clone()),
            pair => Value::String(format!(
                "{} {}",
                pair[0].as_str().unwrap(),
                pair[1].as_str().unwrap()
            )),
        })
        .collect();
    let types: Vec<Value> = tokens
        .iter()
        .map(|t| {
            Value::I32(if t == builtin::BOS || t == builtin::EOS {
                3
            } else {
                1
            })
        })
        .collect();
    let tok_md = [
        ("model", Value::String("gpt2".into())),
        ("pre", Value::String("gpt-2".into())),
        (
            "tokens",
            Value::Array(tokens.into_iter().map(Value::String).collect()),
        ),
        ("merges", Value::Array(merges)),
        ("token_type", Value::Array(types)),
        ("bos_token_id", u32v(c.bos_token_id.unwrap() as usize)),
        ("eos_token_id", u32v(c.eos_ids()[0] as usize)),
        ("add_bos_token", Value::Bool(true)),
    ];
    for (k, v) in tok_md {
        md.push((format!("tokenizer.ggml.{k}"), v));
    }
    let mut names: Vec<&String> = weights.keys().collect();
    names.sort();
    let mut ts: Tensors = Vec::new();
    for name in names {
        let mut t = weights[name].clone();
        if name.ends_with("q_proj.weight") {
            t = gguf::permute(&t, c.num_attention_heads).unwrap();
        } else if name.ends_with("k_proj.weight") {
            t = gguf::permute(&t, c.num_kv_heads()).unwrap();
        }
        let ty = if t.rank() == 1 { GgmlDType::F32 } else { dtype };
        ts.push((
            gguf_name(name),
            Arc::new(QTensor::quantize(&t, ty).unwrap()),
        ));
    }
    // LLaMA 3.1 rope scaling as per-frequency factors, as the converter stores it.
    let mut plain = c.clone();
    plain.rope_scaling = None;
    let factors: Vec<f32> = plain
        .rope_inv_freq()
        .iter()
        .zip(c.rope_inv_freq())
        .map(|(b, s)| (b / s) as f32)
        .collect();
    let n = factors.len();
    let f = Tensor::from_vec(factors, n, &Device::Cpu).unwrap();
    ts.push((
        "rope_freqs.weight".into(),
        Arc::new(QTensor::quantize(&f, GgmlDType::F32).unwrap()),
    ));
    (md, ts)
}

fn write(path: &Path, md: &Meta, ts: &Tensors) {
    let md: Vec<(&str, &Value)> = md.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let ts: Vec<(&str, &QTensor)> = ts.iter().map(|(k, v)| (k.as_str(), &**v)).collect();
    let mut f = std::fs::File::create(path).unwrap();
    gguf_file::write(&mut f, &md, &ts).unwrap();
}

fn set(md: &mut Meta, key: &str, v: Value) {
    match md.iter_mut().find(|(k, _)| k == key) {
        Some(e) => e.1 = v,
        None => md.push((key.into(), v)),
    }
}

fn greedy_tokens(ckpt: &Checkpoint, prompt: &[u32]) -> (Vec<u32>, Tensor) {
    let model = ckpt
        .load(AttnImpl::Flash, DType::F32, &Device::Cpu, 64)
        .unwrap();
    let opts = generate::GenOpts {
        max_new_tokens: 12,
        sampling: Sampling::ArgMax,
        seed: 1,
        repeat_penalty: 1.0,
        repeat_last_n: 64,
        eos_ids: Vec::new(),
        ignore_eos: true,
        layout: CacheLayout::Contiguous,
        record_logits: true,
    };
    let g = generate::generate(&model, &[prompt.to_vec()], &opts, |_, _| {}).unwrap();
    (g.tokens[0].clone(), g.logits[0].clone())
}

#[test]
fn an_f32_gguf_loads_the_checkpoint_it_was_made_from() {
    let (dir, weights) = builtin("f32");
    let (md, ts) = convert(&dir, &weights, GgmlDType::F32);
    let path = dir.join("model.gguf");
    write(&path, &md, &ts);
    let from_gguf = gguf::open(&path, None).unwrap();
    let from_dir = Checkpoint::open(&dir).unwrap();

    // The configuration, LLaMA 3 rope scaling recovered from rope_freqs.weight included
    // (the file keeps epsilon in f32).
    let mut cfg = from_gguf.config.clone();
    assert!((cfg.rms_norm_eps - from_dir.config.rms_norm_eps).abs() < 1e-12);
    cfg.rms_norm_eps = from_dir.config.rms_norm_eps;
    assert_eq!(cfg, from_dir.config);
    assert_eq!(from_gguf.eos_ids, from_dir.eos_ids);

    // Every weight exactly, q/k rows back in Hugging Face order.
    let tensors = from_gguf.tensors.as_ref().unwrap();
    assert_eq!(tensors.len(), weights.len());
    for (name, w) in &weights {
        let g = &tensors[name];
        let same = (g - w).unwrap().abs().unwrap().flatten_all().unwrap();
        let diff = same.max(0).unwrap().to_scalar::<f32>().unwrap();
        assert_eq!(diff, 0.0, "{name}");
    }

    // The tokenizer from the metadata encodes (BOS included) and decodes like tokenizer.json.
    let (a, b) = (
        from_gguf.tokenizer().unwrap(),
        from_dir.tokenizer().unwrap(),
    );
    for text in [
        "FlashAttention computes exact attention",
        "  two spaces, digits 12345 and café 東京 🚀\n\tnext line",
        "</s> inside <s> text",
    ] {
        let (ea, eb) = (a.encode(text, true).unwrap(), b.encode(text, true).unwrap());
        assert_eq!(ea.get_ids(), eb.get_ids(), "{text:?}");
        assert_eq!(ea.get_ids()[0], from_dir.config.bos_token_id.unwrap());
        assert_eq!(
            a.decode(ea.get_ids(), true).unwrap(),
            b.decode(eb.get_ids(), true).unwrap()
        );
    }

    // And the model generates the same tokens.
    let prompt = b.encode("The KV cache", true).unwrap().get_ids().to_vec();
    let (t1, l1) = greedy_tokens(&from_gguf, &prompt);
    let (t2, l2) = greedy_tokens(&from_dir, &prompt);
    assert_eq!(t1, t2);
    let diff = (l1 - l2).unwrap().abs().unwrap().flatten_all().unwrap();
    assert!(diff.max(0).unwrap().to_scalar::<f32>().unwrap() < 1e-4);
}

#[test]
fn quantized_ggufs_dequantize_within_their_formats_rounding() {
    let (dir, weights) = builtin("quant");
    // Relative RMS error each format may add to normal weights; rows in the wrong order
    // would be off by about 1.4 (the norm of a difference of two independent rows).
    let formats = [
        (GgmlDType::F16, 1e-3),
        (GgmlDType::BF16, 5e-3),
        (GgmlDType::Q8_0, 1e-2),
        (GgmlDType::Q6K, 3e-2),
        (GgmlDType::Q5_0, 6e-2),
        (GgmlDType::Q5_1, 6e-2),
        (GgmlDType::Q5K, 6e-2),
        (GgmlDType::Q4_0, 0.12),
        (GgmlDType::Q4_1, 0.12),
        (GgmlDType::Q4K, 0.12),
    ];
    for (dtype, tol) in formats {
        let (md, ts) = convert(&dir, &weights, dtype);
        let path = dir.join(format!("model-{dtype:?}.gguf"));
        write(&path, &md, &ts);
        let ckpt = gguf::open(&path, None).unwrap_or_else(|e| panic!("{dtype:?}: {e:#}"));
        let tensors = ckpt.tensors.as_ref().unwrap();
        let mut worst = (0f64, String::new());
        for (name, w) in &weights {
            let g = &tensors[name];
            assert_eq!(g.dtype(), DType::F32);
            assert_eq!(g.dims(), w.dims(), "{name}");
            let err = (g - w).unwrap().sqr().unwrap().sum_all().unwrap();
            let norm = w.sqr().unwrap().sum_all().unwrap();
            let rel =
                (err.to_scalar::<f32>().unwrap() / norm.to_scalar::<f32>().unwrap()).sqrt() as f64;
            if rel > worst.0 {
                worst = (rel, name.clone());
            }
        }
        assert!(
            worst.0 < tol,
            "{dtype:?}: {} off by {:.3e} (relative RMS)",
            worst.1,
            worst.0
        );
        // It runs: finite logits.
        let tok = ckpt.tokenizer().unwrap();
        let prompt = tok.encode("attention", true).unwrap().get_ids().to_vec();
        let (_, logits) = greedy_tokens(&ckpt, &prompt);
        let logits = logits.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert!(logits.iter().all(|x| x.is_finite()), "{dtype:?}");
    }
}

fn open_err(path: &Path) -> String {
    match gguf::open(path, None) {
        Ok(_) => panic!("{} opened", path.display()),
        Err(e) => format!("{e:#}"),
    }
}

#[test]
fn broken_or_unsupported_ggufs_are_clear_errors() {
    let (dir, weights) = builtin("errors");
    let (md, ts) = convert(&dir, &weights, GgmlDType::Q8_0);
    let path = dir.join("bad.gguf");
    let variant = |edit: &dyn Fn(&mut Meta, &mut Tensors)| {
        let (mut m, mut t) = (md.clone(), ts.clone());
        edit(&mut m, &mut t);
        write(&path, &m, &t);
        open_err(&path)
    };
    let e = variant(&|m, _| set(m, "general.architecture", Value::String("gpt2".into())));
    assert!(e.contains("architecture \"gpt2\" is not supported"), "{e}");
    let e = variant(&|m, _| set(m, "tokenizer.ggml.pre", Value::String("tekken".into())));
    assert!(
        e.contains("\"tekken\" is not supported") && e.contains("--tokenizer"),
        "{e}"
    );
    let e = variant(&|m, _| set(m, "tokenizer.ggml.model", Value::String("llama".into())));
    assert!(e.contains("tokenizer.ggml.model \"llama\""), "{e}");
    let e = variant(&|m, _| m.retain(|(k, _)| k != "llama.embedding_length"));
    assert!(e.contains("no llama.embedding_length"), "{e}");
    let e = variant(&|_, t| {
        let extra = t[0].1.dequantize(&Device::Cpu).unwrap();
        let extra = QTensor::quantize(&extra, GgmlDType::F32).unwrap();
        t.push(("blk.0.ffn_gate_exps.weight".into(), Arc::new(extra)));
    });
    assert!(
        e.contains("blk.0.ffn_gate_exps.weight is not part of a LLaMA model"),
        "{e}"
    );

    // A file cut short, and one that is not GGUF at all.
    write(&path, &md, &ts);
    let bytes = std::fs::read(&path).unwrap();
    std::fs::write(&path, &bytes[..bytes.len() / 2]).unwrap();
    let e = open_err(&path);
    assert!(e.contains("bad.gguf") && e.contains("bytes"), "{e}");
    std::fs::write(&path, b"not a gguf file at all").unwrap();
    assert!(open_err(&path).contains("not a readable GGUF file"));
    let e = open_err(&dir.join("missing.gguf"));
    assert!(e.contains("opening") && e.contains("missing.gguf"), "{e}");
}

#[test]
fn the_byte_level_pre_tokenizers_round_trip_any_text() {
    // The pre-tokenizers of "smollm" (digits split) and "llama-bpe" (LLaMA 3's split):
    // whatever they cut, decoding gives the text back, and digits are grouped as each says.
    let (dir, weights) = builtin("pre");
    let (md, _) = convert(&dir, &weights, GgmlDType::F32);
    let md: HashMap<String, Value> = md.into_iter().collect();
    let texts = [
        "Numbers 1234567 and 3.14159, 'quotes' don't; CAPS\n\n  indented\ttab",
        "東京 café 🚀 naïve — “dashes”",
    ];
    for pre in ["smollm", "llama-bpe", "gpt-2"] {
        let mut m = md.clone();
        m.insert("tokenizer.ggml.pre".into(), Value::String(pre.into()));
        let tok = tokenizer_gguf::from_metadata(&m).unwrap();
        for text in texts {
            let ids = tok.encode(text, false).unwrap().get_ids().to_vec();
            assert_eq!(tok.decode(&ids, true).unwrap(), text, "{pre}");
        }
        let pieces: Vec<String> = tok
            .get_pre_tokenizer()
            .map(|p| {
                use tokenizers::{OffsetReferential, OffsetType, PreTokenizedString, PreTokenizer};
                let mut s = PreTokenizedString::from("1234567");
                p.pre_tokenize(&mut s).unwrap();
                s.get_splits(OffsetReferential::Original, OffsetType::Byte)
                    .into_iter()
                    .map(|(t, _, _)| t.to_string())
                    .collect()
            })
            .unwrap();
        let expected: &[&str] = match pre {
            "smollm" => &["1", "2", "3", "4", "5", "6", "7"],
            "llama-bpe" => &["123", "456", "7"],
            _ => &["1234567"],
        };
        assert_eq!(pieces, expected, "{pre}");
    }
}
