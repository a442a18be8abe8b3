//! The fine-tuning example's pieces on the CPU with a tiny model: the schedule and clipping,
//! flash and naive attention giving the same gradients, LoRA training only its adapters,
//! save + resume continuing exactly, and the loss falling on the built-in task; then the
//! example's binary itself: what it prints when stderr is not a terminal, and what it writes.
#![allow(dead_code)] // the example's modules are shared with other programs

#[path = "../examples/llama/builtin.rs"]
mod builtin;
#[path = "../examples/finetune/data.rs"]
mod data;
#[path = "../examples/finetune/lora.rs"]
mod lora;
#[path = "../examples/llama/model/mod.rs"]
mod model;
#[path = "../examples/finetune/optim.rs"]
mod optim;
#[path = "../examples/finetune/task.rs"]
mod task;
#[path = "../examples/finetune/train.rs"]
mod train;

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::OnceLock;

use candle::{DType, Device, Tensor, Var};
use model::{AttnImpl, Config};
use task::Recall;
use train::Trainer;

/// A tiny GQA model over the built-in tokenizer's vocabulary.
fn tiny() -> Config {
    let mut c = builtin::config(512, 1, 2);
    (c.hidden_size, c.intermediate_size, c.num_hidden_layers) = (64, 128, 2);
    (c.num_attention_heads, c.num_key_value_heads, c.head_dim) = (4, Some(2), Some(16));
    c
}

fn trainer(attn: AttnImpl, lora: Option<lora::LoraOpts>) -> Trainer {
    let cfg = tiny();
    let w = builtin::weights(&cfg, 3).unwrap();
    Trainer::new(&cfg, &w, attn, DType::F32, &Device::Cpu, 64, lora, 0.01, 5).unwrap()
}

fn task() -> Recall {
    Recall::new(48, 4, 4, 512, 1).unwrap()
}

#[test]
fn schedule_warms_up_then_decays_to_the_floor() {
    let lr = |s| optim::learning_rate(s, 10, 110, 1e-3, 1e-4);
    assert!((lr(0) - 1e-4).abs() < 1e-12 && (lr(9) - 1e-3).abs() < 1e-12);
    assert!((lr(10) - 1e-3).abs() < 1e-12, "peak right after warm-up");
    assert!((lr(60) - 5.5e-4).abs() < 1e-9, "half-way down the cosine");
    assert!((lr(110) - 1e-4).abs() < 1e-12 && (lr(500) - 1e-4).abs() < 1e-12);
    let mut prev = f64::INFINITY;
    for s in 10..=110 {
        assert!(lr(s) <= prev + 1e-15);
        prev = lr(s);
    }
}

#[test]
fn clipping_scales_to_the_global_norm() -> candle::Result<()> {
    let a = Var::new(&[0f32, 0.0], &Device::Cpu)?;
    let b = Var::new(&[0f32], &Device::Cpu)?;
    let loss = ((a.as_tensor() * &Tensor::new(&[3f32, 0.0], &Device::Cpu)?)?.sum_all()?
        + (b.as_tensor() * 4.0)?.sum_all()?)?;
    let grads = loss.backward()?;
    let vars = vec![("a".to_string(), a.clone()), ("b".to_string(), b.clone())];
    let (norm, scale) = optim::clip_scale(&grads, &vars, 1.0)?;
    assert!(
        (norm - 5.0).abs() < 1e-6 && (scale - 0.2).abs() < 1e-6,
        "{norm} {scale}"
    );
    // Under the bound, or with no bound, nothing is scaled.
    assert_eq!(optim::clip_scale(&grads, &vars, 10.0)?.1, 1.0);
    assert_eq!(optim::clip_scale(&grads, &vars, 0.0)?.1, 1.0);
    // The clipped update equals the update from clipped gradients: AdamW's first step moves
    // each weight by lr * g / |g| whatever the scale, so compare the moments instead.
    let mut opt = candle_flash::train::AdamW::new(vars.clone(), 0.1, 0.0)?;
    opt.update(&grads, scale)?;
    let m = opt.state()?["m.a"].to_vec1::<f32>()?;
    assert!(
        (m[0] - 0.1 * 0.6).abs() < 1e-6,
        "first moment {m:?} of the clipped gradient"
    );
    Ok(())
}

#[test]
fn flash_and_naive_attention_give_the_same_gradients() -> candle::Result<()> {
    let batch = task().batch(3, 11);
    let mut grads = vec![];
    for attn in [AttnImpl::Flash, AttnImpl::Naive] {
        let t = trainer(attn, None);
        let (loss, _, _) = t
            .loss(&batch, Some(model::TrainOpts::default()), false)
            .unwrap();
        let g = loss.backward()?;
        let per_var: Vec<(String, Vec<f32>)> = t
            .trainable
            .iter()
            .map(|(n, v)| {
                (
                    n.clone(),
                    g.get(v.as_tensor())
                        .unwrap()
                        .flatten_all()
                        .unwrap()
                        .to_vec1()
                        .unwrap(),
                )
            })
            .collect();
        grads.push((loss.to_scalar::<f32>()?, per_var));
    }
    let (flash, naive) = (&grads[0], &grads[1]);
    assert!(
        (flash.0 - naive.0).abs() < 1e-5,
        "loss {} vs {}",
        flash.0,
        naive.0
    );
    for ((name, a), (_, b)) in flash.1.iter().zip(&naive.1) {
        let scale = b.iter().fold(1e-6f32, |m, x| m.max(x.abs()));
        let err = a.iter().zip(b).fold(0f32, |m, (x, y)| {
            if (x - y).is_nan() {
                f32::NAN
            } else {
                m.max((x - y).abs())
            }
        });
        assert!(
            err <= 1e-3 * scale,
            "{name}: gradients differ by {err} (scale {scale})"
        );
    }
    Ok(())
}

#[test]
fn lora_trains_only_its_adapters() -> candle::Result<()> {
    let opts = lora::LoraOpts {
        rank: 4,
        alpha: 8.0,
        mlp: true,
    };
    let mut t = trainer(AttnImpl::Flash, Some(opts));
    assert!(t
        .trainable
        .iter()
        .all(|(n, _)| n.ends_with(".lora_a") || n.ends_with(".lora_b")));
    assert_eq!(
        t.trainable.len(),
        2 * 2 * 7,
        "q/k/v/o and gate/up/down of 2 layers, A and B"
    );
    let before = t.weights();
    let out0 = t.model.named_weights(true).unwrap();
    let batch = task().batch(4, 1);
    for _ in 0..3 {
        t.step(std::slice::from_ref(&batch), 1e-2, 1.0).unwrap();
    }
    for (name, w) in t.weights() {
        let same = (w - &before[&name])?.abs()?.max_all()?.to_scalar::<f32>()?;
        assert_eq!(same, 0.0, "base weight {name} changed");
    }
    // The merged weights moved where adapters sit (B left zero), and nowhere else.
    let merged = t.model.named_weights(true).unwrap();
    let moved = |n: &str| -> f32 {
        (&merged[n] - &out0[n])
            .unwrap()
            .abs()
            .unwrap()
            .max_all()
            .unwrap()
            .to_scalar()
            .unwrap()
    };
    assert!(moved("model.layers.0.self_attn.q_proj.weight") > 0.0);
    assert_eq!(moved("model.embed_tokens.weight"), 0.0);
    Ok(())
}

#[test]
fn save_and_resume_continue_exactly() -> candle::Result<()> {
    let dir = std::env::temp_dir().join(format!("candle-flash-ft-resume-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let batches: Vec<_> = (0..5).map(|i| task().batch(2, 100 + i)).collect();
    let mut a = trainer(AttnImpl::Flash, None);
    for b in &batches[..3] {
        a.step(std::slice::from_ref(b), 5e-3, 1.0).unwrap();
    }
    a.save(&dir, None).unwrap();
    let next_a: Vec<f64> = batches[3..]
        .iter()
        .map(|b| a.step(std::slice::from_ref(b), 5e-3, 1.0).unwrap().loss)
        .collect();
    let mut b = trainer(AttnImpl::Flash, None);
    b.resume(&dir).unwrap();
    assert_eq!(b.opt.step, 3);
    let next_b: Vec<f64> = batches[3..]
        .iter()
        .map(|x| b.step(std::slice::from_ref(x), 5e-3, 1.0).unwrap().loss)
        .collect();
    assert_eq!(
        next_a, next_b,
        "the optimiser state must come back too, not only the weights"
    );
    // The inference example loads the checkpoint (its config.json and weights).
    let cfg =
        Config::from_json(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    assert_eq!(cfg, tiny());
    let w = candle::safetensors::load(dir.join("model.safetensors"), &Device::Cpu)?;
    assert_eq!(w.len(), a.weights().len());
    Ok(())
}

#[test]
fn accumulating_micro_batches_equals_one_batch() -> candle::Result<()> {
    use rand::SeedableRng;
    let mut rng = rand::rngs::StdRng::seed_from_u64(4);
    // Micro-batches of unequal target counts (2 and 4 sequences), weighted by targets.
    let examples: Vec<_> = (0..6).map(|_| task().example(&mut rng)).collect();
    let first = data::Batch::pack(examples[..2].to_vec());
    let second = data::Batch::pack(examples[2..].to_vec());
    let all = data::Batch::pack(examples);
    let mut a = trainer(AttnImpl::Flash, None);
    let mut b = trainer(AttnImpl::Flash, None);
    let sa = a.step(&[first, second], 5e-3, 0.5).unwrap();
    let sb = b.step(&[all], 5e-3, 0.5).unwrap();
    assert!((sa.loss - sb.loss).abs() < 1e-5, "{} {}", sa.loss, sb.loss);
    assert!((sa.grad_norm - sb.grad_norm).abs() < 1e-4 * sb.grad_norm);
    let (wa, wb) = (a.weights(), b.weights());
    for (name, t) in &wa {
        let diff = (t - &wb[name])?
            .abs()?
            .flatten_all()?
            .max(0)?
            .to_scalar::<f32>()?;
        assert!(diff < 1e-5, "{name}: {diff}");
    }
    Ok(())
}

#[test]
fn a_short_run_lowers_the_loss_clearly() {
    let mut t = trainer(AttnImpl::Flash, None);
    let recall = task();
    let eval: Vec<_> = (0..2).map(|i| recall.batch(8, 9000 + i)).collect();
    let (before, _) = t.evaluate(&eval).unwrap();
    for s in 0..40 {
        let b = recall.batch(8, s);
        let lr = optim::learning_rate(s as usize, 5, 40, 1e-2, 1e-3);
        t.step(std::slice::from_ref(&b), lr, 1.0).unwrap();
    }
    let (after, _) = t.evaluate(&eval).unwrap();
    // From ~ln(512) (uniform) to below ln(128) + margin: the answers are values.
    assert!(
        before > 6.0 && after < before - 1.0,
        "eval loss {before} -> {after}"
    );
}

#[test]
fn recall_sequences_have_the_shape_asked_for() {
    let r = Recall::new(64, 5, 3, 512, 1).unwrap();
    let b = r.batch(4, 7);
    assert_eq!(b.seqlens, vec![64; 4]);
    assert_eq!(b.targets.len(), 12);
    for (&row, &t) in b.rows.iter().zip(&b.targets) {
        assert_eq!(
            b.ids[row as usize + 1],
            t,
            "the target is the token after the query key"
        );
    }
    assert!(Recall::new(10, 5, 3, 512, 1).is_err());
    assert!(Recall::new(64, 5, 3, 100, 1).is_err());
}

#[test]
fn jsonl_prompt_completion_puts_the_loss_on_the_completion() {
    let tok = builtin::train_tokenizer(512).unwrap();
    let dir = std::env::temp_dir().join(format!("candle-flash-ft-data-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let f = dir.join("d.jsonl");
    std::fs::write(&f, "{\"prompt\": \"The KV cache\", \"completion\": \" holds keys\"}\n{\"text\": \"attention\"}\n").unwrap();
    let docs = data::load(&f, &tok, Some(2), 64).unwrap();
    assert_eq!(docs.len(), 2);
    let prompt = tok.encode("The KV cache", true).unwrap().get_ids().len();
    let first = docs[0].targets[0].0;
    assert_eq!(
        first,
        prompt - 1,
        "the first target is the first completion token"
    );
    assert_eq!(
        docs[1].targets.len(),
        docs[1].tokens.len() - 1,
        "text: every next token"
    );
    std::fs::write(&f, "{\"question\": 1}\n").unwrap();
    let e = data::load(&f, &tok, None, 64).unwrap_err().to_string();
    assert!(e.contains("expected {\"text\""), "{e}");
}

#[test]
fn the_training_forward_equals_the_inference_forward() -> candle::Result<()> {
    // Training swaps Candle's fused RMSNorm and rotary kernels (no backward) for op-by-op
    // forms; both must compute the same function.
    let t = trainer(AttnImpl::Flash, None);
    let b = task().batch(2, 3);
    let (ids, _, _) = b.tensors(&Device::Cpu)?;
    let infer = t.model.forward_packed(&ids, &b.seqlens, None, None)?;
    let train =
        t.model
            .forward_packed(&ids, &b.seqlens, None, Some(model::TrainOpts::default()))?;
    let err = (infer - train)?.abs()?.max_all()?.to_scalar::<f32>()?;
    assert!(
        err < 1e-4,
        "training and inference forwards differ by {err}"
    );
    Ok(())
}

/// The built-in copy task is learned, not only its token distribution: a tiny model on the
/// CPU leaves the plateau at ~100 steps and copies exactly by ~200 (deterministic seeds).
#[test]
fn a_short_run_learns_the_copy_task() {
    let mut t = trainer(AttnImpl::Flash, None);
    let copy = task::CopyTask::new(64, 512, 1).unwrap();
    let eval = vec![copy.batch(16, 424242)];
    let (loss0, acc0) = t.evaluate(&eval).unwrap();
    for s in 0..200u64 {
        let b = copy.batch(16, s);
        t.step(std::slice::from_ref(&b), 3e-3, 1.0).unwrap();
    }
    let (loss, acc) = t.evaluate(&eval).unwrap();
    assert!(
        acc0 < 0.01 && acc > 0.9 && loss < loss0 - 4.0,
        "eval loss {loss0} -> {loss}, accuracy {acc0} -> {acc}"
    );
}

/// The example's binary, built (once per test run) by the cargo that runs these tests, with
/// their profile and features, so it is never a stale one.
fn example_binary() -> &'static Path {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| {
        let mut cargo = Command::new(env!("CARGO"));
        // Without the variables cargo set for this test (CARGO_PKG_NAME, OUT_DIR, ...): build
        // scripts that read them (ring's) would rerun here, then again in the next plain build.
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
        cargo.args(["build", "--example", "finetune", "--message-format=json"]);
        cargo.args([
            "--manifest-path",
            concat!(env!("CARGO_MANIFEST_DIR"), "/Cargo.toml"),
        ]);
        // This test's profile: the name of the directory above its `deps/` (`debug` is `dev`).
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
        assert!(
            out.status.success(),
            "cargo build --example finetune failed"
        );
        String::from_utf8(out.stdout)
            .unwrap()
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .filter(|m| m["reason"] == "compiler-artifact" && m["target"]["name"] == "finetune")
            .find_map(|m| m["executable"].as_str().map(PathBuf::from))
            .expect("cargo reported no finetune executable")
    })
}

/// Runs the example with its progress bar on and stderr a pipe (not a terminal: indicatif
/// hides the bar there), on a tiny model for a few steps; `(stderr, success)`.
fn run_example(out_dir: &Path, extra: &[&str]) -> (String, bool) {
    let _ = std::fs::remove_dir_all(out_dir);
    let Output { status, stderr, .. } = Command::new(example_binary())
        .args("--device cpu --config tiny --context 32 --batch 4 --steps 6".split(' '))
        .args("--eval-every 3 --eval-batches 1 --out".split(' '))
        .arg(out_dir)
        .args(extra)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    (String::from_utf8(stderr).unwrap(), status.success())
}

#[test]
fn the_example_prints_its_evaluations_to_a_non_terminal_stderr() {
    let dir = std::env::temp_dir().join(format!("candle-flash-ft-pipe-{}", std::process::id()));
    let (err, ok) = run_example(&dir, &[]);
    assert!(ok, "{err}");
    for step in [
        "step 0/6: eval loss",
        "step 3/6: eval loss",
        "step 6/6: eval loss",
    ] {
        assert!(
            err.lines().any(|l| l.starts_with(step)),
            "no {step:?} line in:\n{err}"
        );
    }
    let summary = err.lines().last().unwrap_or_default();
    assert!(
        summary.starts_with("done: 6 steps in ")
            && summary.contains("tokens/s")
            && summary.ends_with(&format!("checkpoint and loss.svg in {}", dir.display())),
        "the last line is the summary:\n{err}"
    );
    // What the summary claims was written, was.
    for f in [
        "model.safetensors",
        "config.json",
        "tokenizer.json",
        "optimizer.safetensors",
        "loss.svg",
    ] {
        assert!(dir.join(f).is_file(), "{f} missing from {}", dir.display());
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn the_example_with_no_save_writes_nothing_and_claims_nothing() {
    let dir = std::env::temp_dir().join(format!("candle-flash-ft-nosave-{}", std::process::id()));
    let (err, ok) = run_example(&dir, &["--no-save"]);
    assert!(ok, "{err}");
    assert!(!dir.exists(), "--no-save created {}", dir.display());
    assert!(
        err.lines()
            .last()
            .unwrap_or_default()
            .ends_with("nothing written (--no-save)"),
        "{err}"
    );
    assert!(
        !err.contains("checkpoint") && !err.contains("loss.svg"),
        "--no-save output mentions a file:\n{err}"
    );
    let (err, ok) = run_example(&dir, &["--no-save", "--save-every", "2"]);
    assert!(
        !ok && err.contains("--no-save") && err.contains("--save-every 2"),
        "{err}"
    );
    assert!(!dir.exists());
}
