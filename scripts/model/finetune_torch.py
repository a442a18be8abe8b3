#!/usr/bin/env python3
"""Training speed of the fine-tuning example's model in PyTorch, on the lent GPU machine: the
same LLaMA shapes (examples/finetune --config 150m|1b) as transformers' LlamaForCausalLM with
random initialisation, f32 master weights under bf16 autocast (as the example's mixed
precision), sdpa attention, torch.optim.AdamW, random tokens with the loss on every next token
(the example's --task random). Prints one JSON line per configuration:
tokens/s over the timed steps (after 2 warm-up steps) and torch.cuda.max_memory_allocated.

  python3 scripts/model/finetune_torch.py --config 150m --seq-len 2048 --batch 8 --steps 12
"""
import argparse
import json
import time

import torch


def config(name):
    import transformers

    shape = {
        "150m": dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                     num_attention_heads=12, num_key_value_heads=4, vocab_size=2048,
                     tie_word_embeddings=False),
        "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                   num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                   tie_word_embeddings=True),
    }[name]
    return transformers.LlamaConfig(head_dim=64, max_position_embeddings=8192,
                                    rms_norm_eps=1e-5, **shape)


def run(args, seq_len):
    import transformers

    torch.manual_seed(0)
    cfg = config(args.config)
    try:
        model = transformers.LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa")
    except TypeError:
        model = transformers.LlamaForCausalLM(cfg)
    model = model.cuda().train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
    g = torch.Generator().manual_seed(0)
    torch.cuda.reset_peak_memory_stats()
    timed, tokens = 0.0, 0
    prof = None
    for step in range(args.steps):
        if args.profile and step == args.steps - 2:
            prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
            prof.__enter__()
        ids = torch.randint(0, cfg.vocab_size, (args.batch, seq_len), generator=g).cuda()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        if step >= 2:
            timed += time.perf_counter() - t0
            tokens += args.batch * seq_len
    if prof is not None:
        prof.__exit__(None, None, None)
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=60)
        with open(args.profile, "w") as f:
            f.write(f"# torch.profiler, last 2 steps, {args.config} seq {seq_len} batch {args.batch}\n")
            f.write(table)
    return {
        "impl": "pytorch", "config": args.config, "context": seq_len, "batch": args.batch,
        "tokens_per_s": tokens / timed,
        "peak_mem_mib": torch.cuda.max_memory_allocated() / 2**20,
        "loss": float(loss),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", choices=["150m", "1b"], default="150m")
    ap.add_argument("--seq-len", default="512,2048,8192")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--profile", help="write a torch.profiler table of the last two steps here")
    args = ap.parse_args()
    for s in args.seq_len.split(","):
        try:
            r = run(args, int(s))
        except torch.cuda.OutOfMemoryError:
            r = {"impl": "pytorch", "config": args.config, "context": int(s), "error": "OOM"}
        torch.cuda.empty_cache()
        print(json.dumps(r), flush=True)


if __name__ == "__main__":
    main()
