//! The LLaMA example's model on the CPU: the built-in checkpoint generated offline, flash and
//! naive attention agreeing token for token and logit for logit, contiguous and paged
//! caches, a batch of prompts of different lengths equal to each prompt alone, sharded
//! checkpoints, and the errors a user meets first; the decoding step of CUDA graph mode run
//! eagerly on the CPU (its inputs in tensors, the lengths advanced by the step itself) against
//! the eager step; then what surrounds the model: streamed text on whole UTF-8 characters,
//! chat templates, where `--model` finds a model, and the command line.
#![allow(dead_code)] // the example's modules are shared with other programs

#[path = "../examples/llama/builtin.rs"]
mod builtin;
#[path = "../examples/llama/chat.rs"]
mod chat;
#[path = "../examples/llama/checkpoint.rs"]
mod checkpoint;
#[path = "../examples/llama/generate.rs"]
mod generate;
#[path = "../examples/llama/graph.rs"]
mod graph;
#[path = "../examples/llama/model/mod.rs"]
mod model;
#[path = "../examples/llama/source.rs"]
mod source;
#[path = "../examples/llama/stream.rs"]
mod stream;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;

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

#[test]
fn the_graph_step_decodes_like_the_eager_one() {
    // Graph mode's step without the capture: tokens and lengths in tensors, the next tokens
    // (greedy) chosen and the lengths advanced by the step itself, one cache per batch size
    // kept across generations, a paged cache's pages given up front.
    let dir = builtin_dir("graph-step");
    let p = prompts(&dir);
    let model = Checkpoint::open(&dir)
        .unwrap()
        .load(AttnImpl::Flash, DType::F32, &Device::Cpu, 512)
        .unwrap();
    let mut graphs = graph::Graphs::new(false, 64);
    for layout in [
        CacheLayout::Contiguous,
        CacheLayout::Paged { page_size: 4 },
        CacheLayout::Paged { page_size: 16 },
    ] {
        let opts = greedy(20, layout);
        let eager = generate::generate(&model, &p, &opts, |_, _| {}).unwrap();
        // Twice: the second generation reuses the first one's cache and static tensors.
        for again in [false, true] {
            let g = generate::generate_with(&model, &p, &opts, &mut graphs, |_, _| {}).unwrap();
            assert_eq!(g.tokens, eager.tokens, "{layout:?}, again {again}");
            let diff = max_diff(&g.logits, &eager.logits);
            assert!(diff < 1e-5, "{layout:?}: logits differ by {diff}");
            assert_eq!(g.stats.decode, "device step");
        }
        // Another batch size gets its own slot; the greedy choice without recorded logits.
        let one = GenOpts {
            record_logits: false,
            ..greedy(9, layout)
        };
        let alone = generate::generate(&model, &p[1..2], &one, |_, _| {}).unwrap();
        let g = generate::generate_with(&model, &p[1..2], &one, &mut graphs, |_, _| {}).unwrap();
        assert_eq!(g.tokens, alone.tokens, "{layout:?}, batch 1");
    }
    // Sampling on the host: the logits come out of the step, the tokens go back in.
    let sampled = GenOpts {
        sampling: Sampling::All { temperature: 0.9 },
        record_logits: false,
        ..greedy(16, CacheLayout::Contiguous)
    };
    let eager = generate::generate(&model, &p, &sampled, |_, _| {}).unwrap();
    let g = generate::generate_with(&model, &p, &sampled, &mut graphs, |_, _| {}).unwrap();
    assert_eq!(g.tokens, eager.tokens);
}

#[test]
fn an_fp8_cache_decodes_close_to_the_f32_one_eager_and_on_the_device() {
    // `--kv-cache-dtype fp8`: the prefill attends to its own keys (identical first logits),
    // then every step reads e4m3 keys and values (per-head scales from the prompt) and stays
    // close to the f32 cache; the device step agrees with the eager one.
    let dir = builtin_dir("fp8-cache");
    let p = prompts(&dir);
    let load = || {
        Checkpoint::open(&dir)
            .unwrap()
            .load(AttnImpl::Flash, DType::F32, &Device::Cpu, 512)
            .unwrap()
    };
    let full = load();
    let mut fp8 = load();
    fp8.set_kv_cache_dtype(DType::F8E4M3).unwrap();
    assert_eq!(fp8.kv_bytes_per_token() * 4, full.kv_bytes_per_token());
    let mut graphs = graph::Graphs::new(false, 64);
    for layout in [
        CacheLayout::Contiguous,
        CacheLayout::Paged { page_size: 16 },
    ] {
        let opts = greedy(12, layout);
        let want = generate::generate(&full, &p, &opts, |_, _| {}).unwrap();
        let got = generate::generate(&fp8, &p, &opts, |_, _| {}).unwrap();
        assert_eq!(
            max_diff(&got.logits[..1], &want.logits[..1]),
            0.0,
            "{layout:?}"
        );
        // Step i's logits follow the tokens before it: compared while both runs chose the
        // same tokens (random weights leave near ties that quantization may tip).
        let same = common_steps(&got.tokens, &want.tokens);
        assert!(same >= 4, "{layout:?}: tokens part after {same} steps");
        let scale = max_abs(&want.logits);
        let diff = max_diff(&got.logits[..=same.min(11)], &want.logits[..=same.min(11)]);
        assert!(
            diff < 0.05 * scale,
            "{layout:?}: logits differ by {diff} (max |logit| {scale})"
        );
        let g = generate::generate_with(&fp8, &p, &opts, &mut graphs, |_, _| {}).unwrap();
        assert_eq!(g.stats.decode, "device step");
        let same = common_steps(&g.tokens, &got.tokens);
        assert!(
            same >= 4,
            "{layout:?}: the device step's tokens part after {same} steps"
        );
        let diff = max_diff(&g.logits[..=same.min(11)], &got.logits[..=same.min(11)]);
        assert!(
            diff < 0.02 * scale,
            "{layout:?}: device step differs by {diff}"
        );
    }
    // The naive attention has no FP8 cache.
    let mut naive = Checkpoint::open(&dir)
        .unwrap()
        .load(AttnImpl::Naive, DType::F32, &Device::Cpu, 512)
        .unwrap();
    let err = naive.set_kv_cache_dtype(DType::F8E4M3).unwrap_err();
    assert!(err.to_string().contains("--attention flash"), "{err}");
}

/// Steps (from the first) at which every sequence chose the same token in both runs.
fn common_steps(a: &[Vec<u32>], b: &[Vec<u32>]) -> usize {
    let steps = a.iter().map(Vec::len).min().unwrap_or(0);
    (0..steps)
        .take_while(|&i| a.iter().zip(b).all(|(x, y)| x[i] == y[i]))
        .count()
}

fn max_abs(xs: &[Tensor]) -> f32 {
    xs.iter()
        .map(|t| {
            t.abs()
                .unwrap()
                .flatten_all()
                .unwrap()
                .max(0)
                .unwrap()
                .to_scalar::<f32>()
                .unwrap()
        })
        .fold(0.0, f32::max)
}

#[test]
fn a_cache_stepped_on_the_device_refuses_eager_steps_until_reset() {
    let dir = builtin_dir("graph-mix");
    let model = Checkpoint::open(&dir)
        .unwrap()
        .load(AttnImpl::Flash, DType::F32, &Device::Cpu, 64)
        .unwrap();
    let cfg = model.config().clone();
    let dev = Device::Cpu;
    let mut cache = model::Cache::new(
        &cfg,
        AttnImpl::Flash,
        CacheLayout::Contiguous,
        2,
        16,
        DType::F32,
        &dev,
    )
    .unwrap();
    let ids = Tensor::new(&[1u32, 2], &dev).unwrap();
    model
        .forward_packed(
            &Tensor::new(&[1u32, 2, 3], &dev).unwrap(),
            &[2, 1],
            Some(&mut cache),
            None,
        )
        .unwrap();
    let step = model::DeviceStep {
        lengths: Tensor::new(&[2u32, 1], &dev).unwrap(),
        table: None,
    };
    model.forward_step_device(&ids, &step, &mut cache).unwrap();
    cache.advance();
    assert_eq!(cache.lengths(), &[3, 2]);
    let err = model.forward_step(&ids, &mut cache).unwrap_err();
    assert!(format!("{err}").contains("on the device"), "{err}");
    cache.reset();
    assert_eq!(cache.lengths(), &[0, 0]);
    model
        .forward_packed(
            &Tensor::new(&[1u32, 2, 3], &dev).unwrap(),
            &[2, 1],
            Some(&mut cache),
            None,
        )
        .unwrap();
    model.forward_step(&ids, &mut cache).unwrap();
    // Naive attention has no device step.
    let naive = Checkpoint::open(&dir)
        .unwrap()
        .load(AttnImpl::Naive, DType::F32, &Device::Cpu, 64)
        .unwrap();
    let err = naive
        .forward_step_device(&ids, &step, &mut cache)
        .unwrap_err();
    assert!(format!("{err}").contains("flash attention"), "{err}");
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

const REPLACEMENT: char = '\u{FFFD}';

/// The chunks a stream hands out for `ids`, one push at a time.
fn stream_chunks(tok: &tokenizers::Tokenizer, context: &[u32], ids: &[u32]) -> Vec<String> {
    let mut s = stream::TextStream::new(tok, context).unwrap();
    ids.iter().map(|&i| s.push(i).unwrap()).collect()
}

#[test]
fn streamed_text_holds_back_characters_split_over_tokens() {
    let dir = builtin_dir("utf8");
    let ckpt = Checkpoint::open(&dir).unwrap();
    let tok = ckpt.tokenizer().unwrap();
    // Characters the corpus does not have, so their bytes are separate tokens.
    let text = " prix: 5 € — ß, ğ, 🎉 and ✓ done, long enough to slide the window past them all";
    let ids = tok.encode(text, false).unwrap().get_ids().to_vec();
    let split = ids
        .iter()
        .filter(|&&i| tok.decode(&[i], true).unwrap().contains(REPLACEMENT))
        .count();
    assert!(
        split >= 4,
        "the text must have tokens holding part of a character"
    );
    let prompt = tok.encode("The", true).unwrap().get_ids().to_vec();
    let chunks = stream_chunks(tok, &prompt, &ids);
    for c in &chunks {
        assert!(
            !c.contains(REPLACEMENT),
            "a broken character was handed out: {c:?}"
        );
    }
    assert!(chunks.iter().any(String::is_empty), "nothing was held back");
    assert_eq!(chunks.concat(), text);
}

#[test]
fn streamed_text_drops_bytes_that_form_no_character() {
    let dir = builtin_dir("utf8-bad");
    let ckpt = Checkpoint::open(&dir).unwrap();
    let tok = ckpt.tokenizer().unwrap();
    // "€" is E2 82 AC, one byte token each: E2 alone is the lead of a character that never
    // comes.
    let euro = tok.encode("€", false).unwrap().get_ids().to_vec();
    assert_eq!(
        euro.len(),
        3,
        "€ is three byte tokens in the built-in tokenizer"
    );
    let a = tok.encode("a", false).unwrap().get_ids().to_vec();
    let b = tok.encode("b", false).unwrap().get_ids().to_vec();
    // A lead byte then ASCII: the byte is left out, the letters are not held back.
    let ids = [euro[0], a[0], b[0]];
    let chunks = stream_chunks(tok, &[], &ids);
    assert_eq!(chunks, ["", "a", "b"]);
    // A character cut short by the end of generation is never printed.
    let mut out = Vec::new();
    let mut p = stream::Printer::new(tok, &[vec![]], &["x".into()], &mut out).unwrap();
    for &i in &[a[0], euro[0], euro[1]] {
        p.push(0, i).unwrap();
    }
    p.finish().unwrap();
    assert_eq!(String::from_utf8(out).unwrap(), "xa\n");
}

#[test]
fn several_sequences_print_as_whole_tagged_lines() {
    let dir = builtin_dir("lines");
    let ckpt = Checkpoint::open(&dir).unwrap();
    let tok = ckpt.tokenizer().unwrap();
    let texts = [" café 🎉\nsecond line ✓", " 東京\n"];
    let ids: Vec<Vec<u32>> = texts
        .iter()
        .map(|t| tok.encode(*t, false).unwrap().get_ids().to_vec())
        .collect();
    let prompts = vec![vec![], vec![]];
    let mut out = Vec::new();
    let heads = ["[a]".to_string(), "[b]".to_string()];
    let mut p = stream::Printer::new(tok, &prompts, &heads, &mut out).unwrap();
    // Interleaved as a batch produces them: one token of each sequence per step.
    for step in 0..ids.iter().map(Vec::len).max().unwrap() {
        for (b, seq) in ids.iter().enumerate() {
            if let Some(&t) = seq.get(step) {
                p.push(b, t).unwrap();
            }
        }
    }
    p.finish().unwrap();
    let out = String::from_utf8(out).unwrap();
    assert!(!out.contains(REPLACEMENT), "{out}");
    let mut lines: Vec<&str> = out.lines().collect();
    lines.sort();
    assert_eq!(
        lines,
        ["[0] [a] café 🎉", "[0] second line ✓", "[1] [b] 東京"],
        "{out}"
    );
}

/// SmolLM2-Instruct's chat template (from its tokenizer_config.json).
const CHATML: &str = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

#[test]
fn chat_templates_render_like_transformers() {
    use chat::{ChatTemplate, Message};
    let t = ChatTemplate::new(CHATML, "<|im_start|>", "<|im_end|>").unwrap();
    let text = t.render(&[Message::new("user", "Hi")]).unwrap();
    assert_eq!(
        text,
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging \
         Face<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    );
    let text = t
        .render(&[
            Message::new("system", "Be brief."),
            Message::new("user", "Hi"),
        ])
        .unwrap();
    assert!(
        text.starts_with("<|im_start|>system\nBe brief.<|im_end|>\n"),
        "{text}"
    );

    // LLaMA-style: bos_token, trimmed blocks, Python string methods, raise_exception.
    let llama = "{{ bos_token }}{% for m in messages %}\n{% if m['role'] == 'tool' %}\
                 {{ raise_exception('no tools here') }}{% endif %}\
                 [{{ m['role'].upper() }}] {{ m['content'].strip() }}{{ eos_token }}\n{% endfor %}";
    let t = ChatTemplate::new(llama, "<s>", "</s>").unwrap();
    let text = t.render(&[Message::new("user", "  Hi  ")]).unwrap();
    assert_eq!(text, "<s>[USER] Hi</s>\n");
    let err = t.render(&[Message::new("tool", "x")]).unwrap_err();
    assert!(format!("{err:#}").contains("no tools here"), "{err:#}");
    assert!(ChatTemplate::new("{% for %}", "", "").is_err());

    // A model without a template says so.
    let dir = builtin_dir("no-template");
    let ckpt = Checkpoint::open(&dir).unwrap();
    assert!(ckpt.chat_template.is_none());
    let tok = ckpt.tokenizer().unwrap();
    let err = ChatTemplate::for_model(None, tok, None, &[]).err().unwrap();
    assert!(format!("{err:#}").contains("no chat template"), "{err:#}");
    // tokenizer_config.json's template is the checkpoint's.
    std::fs::write(
        dir.join("tokenizer_config.json"),
        serde_json::json!({ "chat_template": CHATML }).to_string(),
    )
    .unwrap();
    let ckpt = Checkpoint::open(&dir).unwrap();
    assert_eq!(ckpt.chat_template.as_deref(), Some(CHATML));
}

/// A hub that cannot be reached: a closed port on this machine.
fn unreachable_hub(cache: PathBuf) -> source::Hub {
    source::Hub {
        endpoint: "http://127.0.0.1:9".into(),
        cache,
        offline: false,
    }
}

#[test]
fn model_arguments_resolve_to_directories_files_or_hub_snapshots() {
    use source::{resolve, Source};
    let dir = builtin_dir("resolve");
    let hub = unreachable_hub(scratch("resolve-hub"));
    let arg = dir.to_str().unwrap();
    assert_eq!(resolve(arg, &hub).unwrap(), Source::Dir(dir.clone()));
    let gguf = dir.join("m.gguf");
    std::fs::write(&gguf, b"").unwrap();
    assert_eq!(
        resolve(gguf.to_str().unwrap(), &hub).unwrap(),
        Source::Gguf(gguf.clone())
    );
    let e = resolve(dir.join("config.json").to_str().unwrap(), &hub).unwrap_err();
    assert!(format!("{e:#}").contains("expected a checkpoint directory or a .gguf file"));
    let e = resolve("/no/such/place", &hub).unwrap_err();
    assert!(
        format!("{e:#}").contains("no such directory or file"),
        "{e:#}"
    );

    // A snapshot in the Hugging Face cache is used as it is, with no network.
    let snap = hub
        .cache
        .join("models--someone--tiny-llama/snapshots/0123abcd");
    std::fs::create_dir_all(&snap).unwrap();
    for f in ["config.json", "model.safetensors", "tokenizer.json"] {
        std::fs::copy(dir.join(f), snap.join(f)).unwrap();
    }
    let refs = hub.cache.join("models--someone--tiny-llama/refs");
    std::fs::create_dir_all(&refs).unwrap();
    std::fs::write(refs.join("main"), "0123abcd").unwrap();
    assert_eq!(
        resolve("someone/tiny-llama", &hub).unwrap(),
        Source::Dir(snap.clone())
    );
    Checkpoint::open(&snap).unwrap();
}

#[test]
fn a_hub_id_offline_fails_at_once_with_what_to_do() {
    let hub = unreachable_hub(scratch("offline-hub"));
    let start = std::time::Instant::now();
    let e = source::resolve("HuggingFaceTB/SmolLM2-135M-Instruct", &hub).unwrap_err();
    let e = format!("{e:#}");
    assert!(start.elapsed().as_secs() < 3, "took {:?}", start.elapsed());
    assert!(
        e.contains("cannot be reached") && e.contains("fetch-model.sh"),
        "{e}"
    );
    let offline = source::Hub {
        offline: true,
        ..hub
    };
    let e = source::resolve("someone/model:file.gguf", &offline).unwrap_err();
    assert!(format!("{e:#}").contains("HF_HUB_OFFLINE"), "{e:#}");
}

#[test]
fn without_model_the_default_is_smollm2_from_the_cache_else_the_builtin_one() {
    use source::{default_model_in, Source, DEFAULT_GGUF};
    let cache = scratch("default-cache");
    let hub = unreachable_hub(scratch("default-hub"));
    assert_eq!(default_model_in(Some(&cache), &hub), Source::Builtin);
    assert_eq!(default_model_in(None, &hub), Source::Builtin);
    std::fs::write(cache.join(DEFAULT_GGUF), b"").unwrap();
    assert_eq!(
        default_model_in(Some(&cache), &hub),
        Source::Gguf(cache.join(DEFAULT_GGUF))
    );
}

/// The example's binary, built (once per test run) by the cargo that runs these tests, with
/// their profile and features (as tests/finetune_example.rs does).
fn example_binary() -> &'static Path {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| {
        let mut cargo = Command::new(env!("CARGO"));
        // Without the variables cargo set for this test: build scripts that read them would
        // rerun here, then again in the next plain build.
        for (name, _) in std::env::vars_os() {
            let name = name.to_string_lossy();
            let per_crate = [
                "CARGO_PKG_",
                "CARGO_MANIFEST_",
                "CARGO_CRATE_",
                "CARGO_BIN_",
            ];
            if per_crate.iter().any(|p| name.starts_with(p))
                || name == "CARGO_PRIMARY_PACKAGE"
                || name == "CARGO_TARGET_TMPDIR"
                || name == "OUT_DIR"
            {
                cargo.env_remove(&*name);
            }
        }
        cargo.args(["build", "--example", "llama", "--message-format=json"]);
        cargo.args([
            "--manifest-path",
            concat!(env!("CARGO_MANIFEST_DIR"), "/Cargo.toml"),
        ]);
        let exe = std::env::current_exe().unwrap();
        let profile = exe
            .parent()
            .and_then(Path::parent)
            .and_then(Path::file_name);
        match profile.and_then(|p| p.to_str()).unwrap() {
            "debug" => {}
            name => {
                cargo.args(["--profile", name]);
            }
        }
        if cfg!(feature = "cuda") {
            cargo.args(["--features", "cuda"]);
        }
        let out = cargo.stderr(Stdio::inherit()).output().unwrap();
        assert!(out.status.success(), "cargo build --example llama failed");
        String::from_utf8(out.stdout)
            .unwrap()
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .filter(|m| m["reason"] == "compiler-artifact" && m["target"]["name"] == "llama")
            .find_map(|m| m["executable"].as_str().map(PathBuf::from))
            .expect("cargo reported no llama executable")
    })
}

#[test]
fn the_cuda_graph_flags_are_accepted_on_the_cpu() {
    // --no-cuda-graph and --roofline are CUDA matters: on the CPU the run is the same eager
    // one, and the roofline says why it is not printed.
    let dir = builtin_dir("flags");
    let run = |extra: &[&str]| {
        let out = Command::new(example_binary())
            .args(["--device", "cpu", "--model"])
            .arg(&dir)
            .args([
                "--prompt",
                "The KV cache",
                "--max-new-tokens",
                "5",
                "--ignore-eos",
            ])
            .args(["--quiet", "--print-ids", "--stats-json"])
            .args(extra)
            .stdin(Stdio::null())
            .output()
            .unwrap();
        let stdout = String::from_utf8(out.stdout).unwrap();
        let stderr = String::from_utf8(out.stderr).unwrap();
        assert!(out.status.success(), "{extra:?}: {stderr}");
        let ids: Vec<String> = stdout
            .lines()
            .filter(|l| l.starts_with("ids["))
            .map(String::from)
            .collect();
        let json: serde_json::Value = serde_json::from_str(stdout.lines().last().unwrap()).unwrap();
        (ids, json, stderr)
    };
    let (ids, json, _) = run(&[]);
    let (ids_off, json_off, err_off) = run(&["--no-cuda-graph", "--roofline"]);
    assert_eq!(ids.len(), 1);
    assert_eq!(ids, ids_off);
    for j in [&json, &json_off] {
        assert_eq!(j["decode"], "eager", "{j}");
        assert_eq!(j["cuda_graph"], false, "{j}");
    }
    assert!(err_off.contains("ms/step, eager)"), "{err_off}");
    assert!(err_off.contains("roofline: needs CUDA"), "{err_off}");
}
