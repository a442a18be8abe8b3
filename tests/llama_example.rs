//! The LLaMA example's model on the CPU: the built-in checkpoint generated offline, flash and
//! naive attention agreeing token for token and logit for logit, contiguous and paged
//! caches, a batch of prompts of different lengths equal to each prompt alone, sharded
//! checkpoints, and the errors a user meets first.
#![allow(dead_code)] // the example's modules are shared with other programs

#[path = "../examples/llama/builtin.rs"]
mod builtin;
#[path = "../examples/llama/checkpoint.rs"]
mod checkpoint;
#[path = "../examples/llama/generate.rs"]
mod generate;
#[path = "../examples/llama/model.rs"]
mod model;

use std::path::{Path, PathBuf};

use candle::{DType, Device, Tensor};
use candle_transformers::generation::Sampling;
use checkpoint::Checkpoint;
use generate::{GenOpts, Generation};
use model::{AttnImpl, CacheLayout};

/// A fresh directory under the system's temporary one.
fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("candle-flash-test-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn builtin_dir(name: &str) -> PathBuf {
    let d = scratch(name);
    builtin::write(&d, 7).unwrap();
    d
}

fn greedy(max_new: usize, layout: CacheLayout) -> GenOpts {
    GenOpts {
        max_new_tokens: max_new,
        sampling: Sampling::ArgMax,
        seed: 1,
        repeat_penalty: 1.0,
        repeat_last_n: 64,
        eos_ids: Vec::new(),
        ignore_eos: true,
        layout,
        record_logits: true,
    }
}

fn run(dir: &Path, attn: AttnImpl, prompts: &[Vec<u32>], opts: &GenOpts) -> Generation {
    let ckpt = Checkpoint::open(dir).unwrap();
    let model = ckpt.load(attn, DType::F32, &Device::Cpu, 512).unwrap();
    generate::generate(&model, prompts, opts, |_, _| {}).unwrap()
}

fn prompts(dir: &Path) -> Vec<Vec<u32>> {
    let ckpt = Checkpoint::open(dir).unwrap();
    let tok = ckpt.tokenizer().unwrap();
    [
        "FlashAttention computes exact attention",
        "The KV cache",
        "Decoding reads K and V at the copy bandwidth of the device, so a long prompt costs",
    ]
    .iter()
    .map(|t| tok.encode(*t, true).unwrap().get_ids().to_vec())
    .collect()
}

/// Largest |a - b| over two logit sets, failing on any non-finite value.
fn max_diff(a: &[Tensor], b: &[Tensor]) -> f32 {
    assert_eq!(a.len(), b.len());
    let mut worst = 0f32;
    for (x, y) in a.iter().zip(b) {
        let x = x.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let y = y.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert_eq!(x.len(), y.len());
        for (p, q) in x.iter().zip(&y) {
            assert!(p.is_finite() && q.is_finite(), "non-finite logit {p} / {q}");
            worst = worst.max((p - q).abs());
        }
    }
    worst
}

#[test]
fn builtin_checkpoint_has_the_hugging_face_layout() {
    let dir = builtin_dir("layout");
    for f in [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "generation_config.json",
    ] {
        assert!(dir.join(f).exists(), "{f} missing");
    }
    let ckpt = Checkpoint::open(&dir).unwrap();
    let cfg = &ckpt.config;
    assert_eq!(
        (cfg.num_attention_heads, cfg.num_kv_heads(), cfg.head_dim()),
        (4, 2, 64)
    );
    let tok = ckpt.tokenizer().unwrap();
    let bos = tok.token_to_id(builtin::BOS).unwrap();
    let ids = tok.encode("attention", true).unwrap().get_ids().to_vec();
    assert_eq!(ids[0], bos, "the tokenizer adds <s>");
    assert_eq!(ckpt.eos_ids, vec![tok.token_to_id(builtin::EOS).unwrap()]);
    assert!(tok.get_vocab_size(true) > 500, "the BPE learned merges");
    assert_eq!(tok.decode(&ids, true).unwrap(), "attention");
    // Same seed, same weights.
    let again = builtin_dir("layout-again");
    let w1 = std::fs::read(dir.join("model.safetensors")).unwrap();
    let w2 = std::fs::read(again.join("model.safetensors")).unwrap();
    assert!(w1 == w2, "the built-in weights are not reproducible");
}

#[test]
fn flash_and_naive_generate_the_same_tokens_for_a_ragged_batch() {
    let dir = builtin_dir("parity");
    let p = prompts(&dir);
    assert!(p[0].len() != p[1].len() && p[1].len() != p[2].len());
    let naive = run(
        &dir,
        AttnImpl::Naive,
        &p,
        &greedy(24, CacheLayout::Contiguous),
    );
    for layout in [
        CacheLayout::Contiguous,
        CacheLayout::Paged { page_size: 4 },
        CacheLayout::Paged { page_size: 16 },
    ] {
        let flash = run(&dir, AttnImpl::Flash, &p, &greedy(24, layout));
        assert_eq!(flash.tokens, naive.tokens, "{layout:?}");
        let diff = max_diff(&flash.logits, &naive.logits);
        assert!(diff < 1e-3, "{layout:?}: logits differ by {diff}");
        assert_eq!(flash.logits.len(), 24);
    }
}

#[test]
fn a_ragged_batch_equals_each_prompt_alone() {
    let dir = builtin_dir("alone");
    let p = prompts(&dir);
    let opts = greedy(12, CacheLayout::Paged { page_size: 8 });
    let batch = run(&dir, AttnImpl::Flash, &p, &opts);
    for (b, prompt) in p.iter().enumerate() {
        let alone = run(&dir, AttnImpl::Flash, std::slice::from_ref(prompt), &opts);
        assert_eq!(alone.tokens[0], batch.tokens[b], "sequence {b}");
        let rows: Vec<Tensor> = batch
            .logits
            .iter()
            .map(|l| l.narrow(0, b, 1).unwrap())
            .collect();
        let diff = max_diff(&rows, &alone.logits);
        assert!(
            diff < 1e-4,
            "sequence {b}: logits differ by {diff} from its run alone"
        );
    }
}

#[test]
fn planted_bug_a_cache_that_drops_a_token_is_caught() {
    // The parity test's tolerance sees a wrong cache: generating from a prompt with one
    // token missing (as if the cache had lost it) changes the logits far beyond 1e-3.
    let dir = builtin_dir("planted");
    let p = prompts(&dir);
    let mut short = p[2].clone();
    short.remove(3);
    let opts = greedy(4, CacheLayout::Contiguous);
    let a = run(&dir, AttnImpl::Flash, &p[2..3], &opts);
    let b = run(&dir, AttnImpl::Flash, &[short], &opts);
    assert!(max_diff(&a.logits[..1], &b.logits[..1]) > 1e-2);
}

#[test]
fn sharded_checkpoints_load_like_one_file() {
    let dir = builtin_dir("shards");
    let weights = candle::safetensors::load(dir.join("model.safetensors"), &Device::Cpu).unwrap();
    let sharded = scratch("shards-out");
    for f in ["config.json", "tokenizer.json", "generation_config.json"] {
        std::fs::copy(dir.join(f), sharded.join(f)).unwrap();
    }
    let mut names: Vec<&String> = weights.keys().collect();
    names.sort();
    let (first, second) = names.split_at(names.len() / 2);
    let mut map = serde_json::Map::new();
    for (i, part) in [first, second].iter().enumerate() {
        let file = format!("model-0000{}-of-00002.safetensors", i + 1);
        let tensors: std::collections::HashMap<String, Tensor> = part
            .iter()
            .map(|n| ((*n).clone(), weights[*n].clone()))
            .collect();
        candle::safetensors::save(&tensors, sharded.join(&file)).unwrap();
        for n in part.iter() {
            map.insert((*n).clone(), serde_json::Value::String(file.clone()));
        }
    }
    let index = serde_json::json!({ "metadata": {}, "weight_map": map });
    std::fs::write(
        sharded.join("model.safetensors.index.json"),
        index.to_string(),
    )
    .unwrap();
    let p = prompts(&dir);
    let opts = greedy(3, CacheLayout::Contiguous);
    let one = run(&dir, AttnImpl::Flash, &p, &opts);
    let two = run(&sharded, AttnImpl::Flash, &p, &opts);
    assert_eq!(one.tokens, two.tokens);
    assert_eq!(max_diff(&one.logits, &two.logits), 0.0);
}

fn open_err(dir: &Path) -> String {
    match Checkpoint::open(dir) {
        Ok(_) => panic!("{} opened", dir.display()),
        Err(e) => format!("{e:#}"),
    }
}

#[test]
fn bad_checkpoints_are_clear_errors() {
    let missing = scratch("missing").join("nothing-here");
    assert!(open_err(&missing).contains("not a directory"));

    let dir = builtin_dir("errors");
    let cfg = std::fs::read_to_string(dir.join("config.json")).unwrap();
    let edit = |from: &str, to: &str| {
        assert!(cfg.contains(from), "{from}");
        std::fs::write(dir.join("config.json"), cfg.replace(from, to)).unwrap();
        open_err(&dir)
    };
    let e = edit("\"model_type\": \"llama\"", "\"model_type\": \"gpt2\"");
    assert!(e.contains("model_type \"gpt2\" is not supported"), "{e}");
    let e = edit("\"hidden_act\": \"silu\"", "\"hidden_act\": \"gelu\"");
    assert!(e.contains("hidden_act"), "{e}");
    let e = edit("\"rope_type\": \"llama3\"", "\"rope_type\": \"yarn\"");
    assert!(e.contains("rope_scaling type \"yarn\""), "{e}");
    let e = edit("\"num_key_value_heads\": 2", "\"num_key_value_heads\": 3");
    assert!(e.contains("num_key_value_heads 3 must divide"), "{e}");
    std::fs::write(dir.join("config.json"), "{ not json").unwrap();
    assert!(open_err(&dir).contains("config.json"));
    std::fs::write(dir.join("config.json"), &cfg).unwrap();
    std::fs::remove_file(dir.join("model.safetensors")).unwrap();
    let e = open_err(&dir);
    assert!(e.contains("no model.safetensors"), "{e}");
}

#[test]
fn a_prompt_past_the_model_positions_is_an_error() {
    let dir = builtin_dir("too-long");
    let ckpt = Checkpoint::open(&dir).unwrap();
    let model = ckpt
        .load(AttnImpl::Flash, DType::F32, &Device::Cpu, 64)
        .unwrap();
    // Past the rotary tables the model was loaded for.
    let prompt = vec![vec![1u32; 100]];
    let err = generate::generate(
        &model,
        &prompt,
        &greedy(4, CacheLayout::Contiguous),
        |_, _| {},
    )
    .err()
    .expect("a 100-token prompt past 64 positions must fail");
    assert!(format!("{err:#}").contains("positions"), "{err:#}");
    // Past max_position_embeddings (8192).
    let model = ckpt
        .load(AttnImpl::Flash, DType::F32, &Device::Cpu, 16)
        .unwrap();
    let prompt = vec![vec![1u32; 8190]];
    let err = generate::generate(
        &model,
        &prompt,
        &greedy(4, CacheLayout::Contiguous),
        |_, _| {},
    )
    .err()
    .expect("8190 + 4 tokens past max_position_embeddings must fail");
    assert!(
        format!("{err:#}").contains("max_position_embeddings of 8192"),
        "{err:#}"
    );
}

#[test]
fn transformers_5_rope_parameters_read_like_rope_theta_and_rope_scaling() {
    let v4 = r#"{"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
        "vocab_size": 100, "rope_theta": 500000.0,
        "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}"#;
    let v5 = r#"{"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
        "vocab_size": 100,
        "rope_parameters": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
                            "rope_theta": 500000.0}}"#;
    let (a, b) = (
        model::Config::from_json(v4).unwrap(),
        model::Config::from_json(v5).unwrap(),
    );
    assert_eq!(a, b);
    assert_eq!(b.rope_theta, 500000.0);
    assert_eq!(
        model::normalized_json(v5).unwrap()["rope_scaling"]["factor"],
        32.0
    );
    let plain = v5.replace("\"llama3\"", "\"default\"");
    let c = model::Config::from_json(&plain).unwrap();
    assert!(c.rope_scaling.is_none() && c.rope_theta == 500000.0);
    // LLaMA 3 scaling divides the low frequencies by the factor and keeps the high ones.
    let (scaled, base) = (a.rope_inv_freq(), c.rope_inv_freq());
    assert_eq!(scaled[0], base[0]);
    assert!((scaled[7] - base[7] / 32.0).abs() < 1e-12);
}
