#!/usr/bin/env python3
"""The LLaMA example against Hugging Face transformers, on the lent GPU machine (torch,
transformers and tokenizers are installed there; nothing is downloaded).

  python3 scripts/model/llama_hf.py parity BIN [--out DIR]
      Makes small random checkpoints (LlamaForCausalLM with GQA and LLaMA 3 rope scaling;
      Qwen2ForCausalLM with q/k/v biases and tied embeddings) and a BPE tokenizer trained on
      this repository's README, runs transformers' greedy generate and the example binary BIN
      on the same directories, and checks: greedy tokens equal for 32 new tokens in f32 (CPU:
      flash and paged flash; GPU: f32 needs --attention naive, our CUDA kernels are f16/bf16),
      and the first step's logits in bf16/f16 within 2x the error of transformers' own bf16/f16
      against its f32 (the FlashAttention rule). Prints PASS/FAIL lines; exit 1 on a FAIL.

  python3 scripts/model/llama_hf.py bench BIN [--out DIR] [--shapes 512x1,512x16,4096x1,4096x16]
      Makes a LLaMA-3.2-1B-shaped checkpoint with random bf16 weights (hidden 2048, 16 layers,
      32/8 heads, head_dim 64, vocab 128256, tied, sharded safetensors) and measures prefill
      and decode tokens/s, time to first token and peak memory for: the example with flash
      attention, with --attention naive, candle-transformers' llama (--impl
      candle-transformers), and transformers' generate (sdpa), each in its own process, 256
      new tokens. Prints a markdown table (and writes it to DIR/llama-bench.md).

  python3 scripts/model/llama_hf.py graphs BIN [--out DIR] [--graph-shapes 512x1,512x16]
      On the same 1B-shaped checkpoint: the decoding step as a CUDA graph (the default), the
      same step uncaptured (--no-cuda-graph; its tokens must be identical) and the host-length
      eager step of before (--host-step), each shape in its own processes (--warmup, median of --repeat
      runs, 256 new tokens, greedy): ms per step, tokens/s and the % of the weight-read
      roofline (the weights' bytes at the copy bandwidth measured in the same run, --roofline),
      and whether the greedy tokens of the two are identical. Prints a markdown table
      (DIR/llama-graphs.md, .json); exit 1 if a run fails or the tokens differ.
"""
import argparse
import json
import os
import subprocess
import sys
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROMPTS = [
    "FlashAttention computes exact attention",
    "The KV cache",
    "Decoding reads K and V at the copy bandwidth of the device, so a long prompt costs",
]


def train_tokenizer(path, vocab_size=1024):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    lines = open(os.path.join(REPO, "README.md"), encoding="utf-8").read().splitlines()
    tok.train_from_iterator(lines, trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
    tok.save(path)
    return tok


def make_tiny(out, kind):
    """A small random checkpoint in out/, f32 weights."""
    import transformers

    os.makedirs(out, exist_ok=True)
    tok = train_tokenizer(os.path.join(out, "tokenizer.json"))
    vocab = (tok.get_vocab_size() + 63) // 64 * 64
    bos, eos = tok.token_to_id("<s>"), tok.token_to_id("</s>")
    common = dict(
        vocab_size=vocab, hidden_size=128, intermediate_size=352, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        rms_norm_eps=1e-5, bos_token_id=bos, eos_token_id=eos, initializer_range=0.05,
    )
    torch.manual_seed(0)
    if kind == "llama":
        cfg = transformers.LlamaConfig(
            **common, head_dim=32, tie_word_embeddings=False,
            **rope_kwargs(500000.0, {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
                                     "high_freq_factor": 4.0,
                                     "original_max_position_embeddings": 128}),
        )
        model = transformers.LlamaForCausalLM(cfg)
    else:
        cfg = transformers.Qwen2Config(**common, tie_word_embeddings=True, use_sliding_window=False,
                                       **rope_kwargs(10000.0, None))
        model = transformers.Qwen2ForCausalLM(cfg)
        # Random init leaves biases at zero; make them matter.
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("bias"):
                    p.normal_(0.0, 0.5)
    model.save_pretrained(out, safe_serialization=True)
    print(f"{out}/config.json: " + open(os.path.join(out, "config.json")).read().replace("\n", " "))
    return out


def make_1b(out):
    done = os.path.join(out, ".complete")
    if os.path.exists(done):  # the weights are seeded: the same checkpoint every time
        return out
    import transformers

    os.makedirs(out, exist_ok=True)
    train_tokenizer(os.path.join(out, "tokenizer.json"))
    cfg = transformers.LlamaConfig(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, head_dim=64,
        max_position_embeddings=131072, rms_norm_eps=1e-5,
        tie_word_embeddings=True, bos_token_id=128000, eos_token_id=128001,
        **rope_kwargs(500000.0, {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0,
                                 "original_max_position_embeddings": 8192}),
    )
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True, max_shard_size="1GB")
    del model
    torch.cuda.empty_cache()
    open(done, "w").close()
    return out


def rope_kwargs(theta, scaling):
    """rope_theta and scaling for LlamaConfig/Qwen2Config: transformers 5 takes them as
    rope_parameters, 4.x as rope_theta + rope_scaling."""
    import transformers

    if int(transformers.__version__.split(".")[0]) >= 5:
        params = dict(scaling or {"rope_type": "default"})
        params["rope_theta"] = theta
        return {"rope_parameters": params}
    return {"rope_theta": theta, "rope_scaling": scaling}


DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}


def load_hf(d, dtype, device):
    import transformers

    try:
        m = transformers.AutoModelForCausalLM.from_pretrained(d, attn_implementation="sdpa")
    except TypeError:
        m = transformers.AutoModelForCausalLM.from_pretrained(d)
    return m.to(device=device, dtype=DTYPES[dtype]).eval()


def encode(d, text):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(os.path.join(d, "tokenizer.json")).encode(text).ids


@torch.no_grad()
def hf_greedy(model, ids, new):
    x = torch.tensor([ids], device=model.device)
    out = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                         max_new_tokens=new, min_new_tokens=new,
                         pad_token_id=model.config.eos_token_id)
    return out[0, len(ids):].tolist()


@torch.no_grad()
def hf_first_logits(model, ids):
    x = torch.tensor([ids], device=model.device)
    return model(x).logits[0, -1].float().cpu()


def ours(binary, d, *extra, timeout=600):
    """Runs the example; returns (returncode, stdout, stderr)."""
    cmd = [binary, "--model", d, *extra]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    return p.returncode, p.stdout, p.stderr


def ours_greedy(binary, d, new, *extra):
    args = []
    for t in PROMPTS:
        args += ["--prompt", t]
    rc, out, err = ours(binary, d, *args, "--max-new-tokens", str(new), "--ignore-eos",
                        "--quiet", "--print-ids", *extra)
    if rc != 0:
        raise RuntimeError(f"example failed ({' '.join(extra)}):\n{err[-3000:]}")
    seqs = {}
    for line in out.splitlines():
        if line.startswith("ids["):
            b = int(line[4:line.index("]")])
            prompt = json.loads(line[line.index("prompt=") + 7:line.index(" new=")])
            new_ids = json.loads(line[line.index("new=") + 4:])
            seqs[b] = (prompt, new_ids)
    return [seqs[b] for b in range(len(PROMPTS))]


def ours_logits(binary, d, path, *extra):
    from safetensors.torch import load_file

    rc, out, err = ours(binary, d, "--max-new-tokens", "1", "--quiet", "--logits-out", path, *extra)
    if rc != 0:
        raise RuntimeError(f"example failed ({' '.join(extra)}):\n{err[-3000:]}")
    return load_file(path)["logits"]


def parity(args):
    results = []

    def check(name, ok, detail):
        results.append(ok)
        print(f"{'PASS' if ok else 'FAIL'} {name}: {detail}", flush=True)

    for kind in ["llama", "qwen2"]:
        d = make_tiny(os.path.join(args.out, f"tiny-{kind}"), kind)
        new = 32
        ids = [encode(d, t) for t in PROMPTS]
        ref = {}
        for dev in ["cpu", "cuda"]:
            m = load_hf(d, "f32", dev)
            ref[dev] = [hf_greedy(m, p, new) for p in ids]
            del m
        for dev, extra in [
            ("cpu", ["--device", "cpu", "--dtype", "f32"]),
            ("cpu", ["--device", "cpu", "--dtype", "f32", "--paged", "--page-size", "8"]),
            ("cpu", ["--device", "cpu", "--dtype", "f32", "--attention", "naive"]),
            ("cuda", ["--device", "cuda", "--dtype", "f32", "--attention", "naive"]),
        ]:
            got = ours_greedy(args.bin, d, new, *extra)
            prompts_ok = all(g[0] == p for g, p in zip(got, ids))
            same = [g[1] == r for g, r in zip(got, ref[dev])]
            check(f"{kind} greedy f32 {' '.join(extra)}", prompts_ok and all(same),
                  f"{sum(same)}/{len(same)} prompts give transformers' {new} tokens "
                  f"(prompt ids equal: {prompts_ok})")
        # First-step logits, the FlashAttention rule: our low-precision error against
        # transformers' f32 within 2x transformers' own low-precision error (+ a small term).
        m32 = load_hf(d, "f32", "cuda")
        reference = [hf_first_logits(m32, p) for p in ids]
        del m32
        for dt in ["bf16", "f16"]:
            mlow = load_hf(d, dt, "cuda")
            low = [hf_first_logits(mlow, p) for p in ids]
            del mlow
            for extra in [[], ["--paged", "--page-size", "16"]]:
                args_p = []
                for t in PROMPTS:
                    args_p += ["--prompt", t]
                path = os.path.join(args.out, f"logits-{kind}-{dt}.safetensors")
                got = ours_logits(args.bin, d, path, "--device", "cuda", "--dtype", dt, *args_p, *extra)
                errs = []
                for b in range(len(PROMPTS)):
                    ours_err = (got[b] - reference[b]).abs().max().item()
                    hf_err = (low[b] - reference[b]).abs().max().item()
                    scale = reference[b].abs().max().item()
                    errs.append((ours_err, hf_err, ours_err <= 2 * hf_err + 1e-3 * scale))
                check(f"{kind} first-step logits {dt} flash {' '.join(extra)}",
                      all(e[2] for e in errs),
                      "max |ours - hf f32| / max |hf " + dt + " - hf f32| per prompt: " +
                      ", ".join(f"{o:.4f}/{h:.4f}" for o, h, _ in errs))
    print(f"parity: {sum(results)} passed, {len(results) - sum(results)} failed")
    return 0 if all(results) else 1


@torch.no_grad()
def hf_bench(d, L, B, new):
    m = load_hf(d, "bf16", "cuda")
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, m.config.vocab_size, (B, L), generator=g).cuda()
    kw = dict(do_sample=False, pad_token_id=m.config.eos_token_id)
    m.generate(ids[:, :32], attention_mask=torch.ones_like(ids[:, :32]), max_new_tokens=3,
               min_new_tokens=3, **kw)
    mask = torch.ones_like(ids)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    m.generate(ids, attention_mask=mask, max_new_tokens=1, min_new_tokens=1, **kw)
    torch.cuda.synchronize()
    ttft = time.perf_counter() - t0
    t0 = time.perf_counter()
    m.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, **kw)
    torch.cuda.synchronize()
    total = time.perf_counter() - t0
    return {
        "impl": "transformers (sdpa)", "batch": B, "prompt_tokens": B * L,
        "ttft_ms": ttft * 1e3, "prefill_tok_s": B * L / ttft,
        "decode_tok_s": B * (new - 1) / max(total - ttft, 1e-9),
        "decode_ms_per_step": (total - ttft) * 1e3 / (new - 1),
        "peak_mem_mib": torch.cuda.max_memory_allocated() / 2**20,
    }


def bench(args):
    d = os.path.join(args.out, "llama-3.2-1b-random")
    t0 = time.time()
    make_1b(d)
    print(f"made {d} in {time.time() - t0:.0f} s", flush=True)
    new = args.new_tokens
    rows = []
    for shape in args.shapes.split(","):
        L, B = (int(x) for x in shape.split("x"))
        runs = [
            ("flash", ["--attention", "flash"]),
            ("flash paged", ["--attention", "flash", "--paged", "--page-size", "64"]),
            ("naive", ["--attention", "naive"]),
            ("candle-transformers", ["--impl", "candle-transformers"]),
        ]
        for name, extra in runs:
            try:
                rc, out, err = ours(args.bin, d, "--device", "cuda", "--dtype", "bf16",
                                    "--random-prompt", str(L), "--batch", str(B),
                                    "--max-new-tokens", str(new), "--ignore-eos", "--quiet",
                                    "--stats-json", "--warmup", "--repeat", str(args.repeat), *extra,
                                    timeout=args.timeout)
            except subprocess.TimeoutExpired:
                rc, out, err = -1, "", "timeout"
            if rc == 0:
                r = json.loads(out.strip().splitlines()[-1])
                r["impl"] = name
            else:
                lines = [l for l in err.splitlines() if l.startswith("Error")] or err.strip().splitlines()[-1:]
                msg = lines[0] if lines else f"exit {rc}"
                oom = "out of memory" in err.lower() or "OUT_OF_MEMORY" in err
                # Scores of (batch, heads, seqlen, seqlen) past 2^31 elements make Candle's
                # element-wise launches invalid.
                big = B * 32 * L * L >= 2**31
                why = (f"OOM ({msg[:120]})" if oom else
                       f"fails: scores of {B}x32x{L}x{L} exceed 2^31 elements ({msg[7:80]})" if big
                       else f"failed: {msg[:160]}")
                r = {"impl": name, "error": why}
            r.update(prompt_len=L, batch=B)
            rows.append(r)
            print(json.dumps(r), flush=True)
        try:
            r = hf_bench(d, L, B, new)
        except torch.cuda.OutOfMemoryError:
            r = {"impl": "transformers (sdpa)", "error": "OOM"}
        torch.cuda.empty_cache()
        r.update(prompt_len=L, batch=B)
        rows.append(r)
        print(json.dumps(r), flush=True)
    table = ["| prompt | batch | implementation | prefill tok/s | TTFT ms | decode tok/s | ms/step | peak MiB | decode vs candle-transformers | decode vs transformers |",
             "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        same = [x for x in rows if x["prompt_len"] == r["prompt_len"] and x["batch"] == r["batch"]]
        def ratio(name):
            o = next((x for x in same if x["impl"].startswith(name) and "decode_tok_s" in x), None)
            return f"{r['decode_tok_s'] / o['decode_tok_s']:.2f}" if o and "decode_tok_s" in r else "–"
        if "error" in r:
            table.append(f"| {r['prompt_len']} | {r['batch']} | {r['impl']} | {r['error']} | – | – | – | – | – | – |")
        else:
            table.append(
                f"| {r['prompt_len']} | {r['batch']} | {r['impl']} | {r['prefill_tok_s']:.0f} | "
                f"{r['ttft_ms']:.1f} | {r['decode_tok_s']:.1f} | {r['decode_ms_per_step']:.2f} | "
                f"{r['peak_mem_mib']:.0f} | {ratio('candle-transformers')} | {ratio('transformers')} |")
    text = "\n".join(table)
    print(text)
    with open(os.path.join(args.out, "llama-bench.md"), "w") as f:
        f.write(text + "\n")
    with open(os.path.join(args.out, "llama-bench.json"), "w") as f:
        json.dump(rows, f, indent=1)
    return 0


def new_ids(out):
    """{sequence: new token ids} from the example's --print-ids lines."""
    seqs = {}
    for line in out.splitlines():
        if line.startswith("ids["):
            b = int(line[4:line.index("]")])
            seqs[b] = json.loads(line[line.index("new=") + 4:])
    return seqs


def first_difference(a, b):
    """(sequence, token index) of the first difference of two {sequence: ids}."""
    for s in sorted(set(a) | set(b)):
        x, y = a.get(s, []), b.get(s, [])
        if x != y:
            return s, next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
    return None


def graphs(args):
    d = os.path.join(args.out, "llama-3.2-1b-random")
    t0 = time.time()
    make_1b(d)
    print(f"checkpoint {d} ready in {time.time() - t0:.0f} s", flush=True)
    new = args.new_tokens
    rows, failures = [], []
    for shape in args.graph_shapes.split(","):
        L, B = (int(x) for x in shape.split("x"))
        ids = {}

        def run(*extra):
            try:
                return ours(args.bin, d, "--device", "cuda", "--dtype", "bf16",
                            "--random-prompt", str(L), "--batch", str(B),
                            "--max-new-tokens", str(new), "--ignore-eos", "--quiet",
                            "--print-ids", "--stats-json", "--warmup", "--roofline",
                            "--repeat", str(args.repeat), *extra, timeout=args.timeout)
            except subprocess.TimeoutExpired:
                return -1, "", "timeout"

        # "eager": the host-length step (the path before graphs); "device step": the graph's
        # step run uncaptured (--no-cuda-graph), which must give the graph's tokens exactly.
        modes = [("eager", ["--host-step"]), ("device step", ["--no-cuda-graph"]), ("CUDA graph", [])]
        for mode, extra in modes:
            rc, out, err = run(*extra)
            if rc != 0:
                tail = err.strip().splitlines()[-3:]
                failures.append(f"{L}x{B} {mode}: exit {rc}: {' / '.join(tail)}")
                rows.append({"prompt_len": L, "batch": B, "decode": mode, "error": f"exit {rc}"})
                print(json.dumps(rows[-1]), flush=True)
                continue
            r = json.loads(out.strip().splitlines()[-1])
            r.update(prompt_len=L, batch=B)
            if r.get("decode") != mode:
                failures.append(f"{L}x{B}: asked for {mode}, the example decoded {r.get('decode')!r}")
            ids[mode] = new_ids(out)
            rows.append(r)
            print(json.dumps({k: v for k, v in r.items() if k != "model"}), flush=True)
        if "device step" in ids and "CUDA graph" in ids:
            a, b = ids["device step"], ids["CUDA graph"]
            same = a == b and len(a) == B and all(len(v) == new for v in a.values())
            if "eager" in ids:
                # Informational: the host step plans and rotates differently (near-ties may part).
                for r in rows[-3:]:
                    if r.get("decode") == "eager":
                        r["tokens_identical"] = ids["eager"] == b
            if not same:
                failures.append(f"{L}x{B}: greedy tokens of the CUDA graph differ from the same "
                                f"step run uncaptured (first at (sequence, token) "
                                f"{first_difference(a, b)})")
            for r in rows[-2:]:
                r["tokens_identical"] = same
    table = ["| prompt | batch | decode | ms/step | decode tok/s | weights GB | copy GB/s | "
             "weights at copy bw, ms | % of roofline | speed-up over eager | greedy tokens identical |",
             "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|:---:|"]
    for r in rows:
        if "error" in r:
            table.append(f"| {r['prompt_len']} | {r['batch']} | {r['decode']} | {r['error']} |"
                         " – | – | – | – | – | – | – |")
            continue
        eager = next((x for x in rows if x["prompt_len"] == r["prompt_len"] and x["batch"] == r["batch"]
                      and x.get("decode") == "eager" and "error" not in x), None)
        speedup = (f"{eager['decode_ms_per_step'] / r['decode_ms_per_step']:.2f}x"
                   if eager and r["decode"] != "eager" else "–")
        def fmt(key, spec, scale=1.0):
            v = r.get(key)
            return "–" if v is None else format(v * scale, spec)
        identical = {True: "yes", False: "NO"}.get(r.get("tokens_identical"), "–")
        table.append(
            f"| {r['prompt_len']} | {r['batch']} | {r['decode']} | {r['decode_ms_per_step']:.3f} | "
            f"{r['decode_tok_s']:.1f} | {fmt('weight_bytes', '.3f', 1e-9)} | "
            f"{fmt('copy_gbps', '.0f')} | {fmt('roofline_ms', '.3f')} | "
            f"{fmt('roofline_pct', '.0f')}% | {speedup} | {identical} |")
    text = "\n".join(table)
    print(text)
    with open(os.path.join(args.out, "llama-graphs.md"), "w") as f:
        f.write(text + "\n")
    with open(os.path.join(args.out, "llama-graphs.json"), "w") as f:
        json.dump(rows, f, indent=1)
    for msg in failures:
        print(f"FAIL {msg}")
    print("PASS: greedy tokens identical with and without CUDA graphs" if not failures else
          f"{len(failures)} failure(s)")
    return 1 if failures else 0


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["parity", "bench", "graphs"])
    ap.add_argument("bin", help="the llama example binary")
    ap.add_argument("--out", default="/tmp/llama-hf")
    ap.add_argument("--shapes", default="512x1,512x16,4096x1,4096x16")
    ap.add_argument("--graph-shapes", default="512x1,512x16",
                    help="graphs: PROMPTxBATCH shapes, each run with and without CUDA graphs")
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--timeout", type=int, default=300)
    ap.add_argument("--repeat", type=int, default=3, help="timed runs per candle configuration (median)")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    import transformers

    print(f"torch {torch.__version__}, transformers {transformers.__version__}, "
          f"{torch.cuda.get_device_name(0)}", flush=True)
    sys.exit({"parity": parity, "bench": bench, "graphs": graphs}[args.what](args))


if __name__ == "__main__":
    main()
