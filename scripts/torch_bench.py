#!/usr/bin/env python3
"""PyTorch SDPA speed anchor on the FlashAttention-2 paper grid, run on the lent GPU.

Grid: batch * seqlen = 16k tokens, hidden 2048 (hd 64 -> 32 heads, 128 -> 16, 256 -> 8),
seqlen 512..16k, causal and not; plus GQA 32/8 heads, hd 128, seqlen 2k and 8k.
Passes fwd, bwd and fwd+bwd, backends FlashAttention-2 and cuDNN (skipped where they fail).
Tensors are in SDPA's native (b, h, s, d) layout; our crate's is (b, s, h, d).

TFLOP/s: fwd = 4*b*h*sq*sk*d (halved for causal), bwd = 2.5x fwd, fwd+bwd = 3.5x fwd.
Timing: CUDA events around a loop that rotates over input sets (each set alone is larger
than the 50 MB L2), median of several repeats after a warm-up.

Usage: python3 scripts/torch_bench.py [--quick] [--dtype bf16|fp16] [--json PATH]
"""
import argparse
import json
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

TOKENS = 16 * 1024
HIDDEN = 2048
BACKENDS = {"torch-flash": SDPBackend.FLASH_ATTENTION, "torch-cudnn": SDPBackend.CUDNN_ATTENTION}
PASS_FLOP_FACTOR = {"fwd": 1.0, "bwd": 2.5, "fwd+bwd": 3.5}
N_SETS = 3  # input sets to rotate over; one set is already >= 64 MB
REPEATS = 7
TARGET_MS_PER_REPEAT = 25.0


def grid(quick):
    """(hd, seqlen, heads, heads_k, causal) in the order they are measured."""
    hds, seqlens = ((64, 128), (1024, 4096)) if quick else ((64, 128, 256), (512, 1024, 2048, 4096, 8192, 16384))
    for hd in hds:
        for s in seqlens:
            for causal in (False, True):
                yield hd, s, HIDDEN // hd, HIDDEN // hd, causal
    for s in (2048,) if quick else (2048, 8192):
        for causal in (False, True):
            yield 128, s, 32, 8, causal


def time_ms(fn, n_sets):
    """Median milliseconds per call of fn(i), i rotating over the input sets."""
    for i in range(2 * n_sets):  # warm-up: kernel selection, allocator, lazy init
        fn(i % n_sets)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn(0)
    torch.cuda.synchronize()
    est_ms = max((time.perf_counter() - t0) * 1e3, 1e-3)
    iters = int(min(100, max(3, TARGET_MS_PER_REPEAT / est_ms)))
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(REPEATS):
        start.record()
        for i in range(iters):
            fn(i % n_sets)
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / iters)
    return statistics.median(samples)


def bench_config(hd, s, h, hk, causal, dtype, backend):
    """Yields (pass, ms) for one shape and backend; raises if the backend cannot run it."""
    b = TOKENS // s
    gqa = h != hk

    def make():
        q = torch.randn(b, h, s, hd, device="cuda", dtype=dtype, requires_grad=True)
        k = torch.randn(b, hk, s, hd, device="cuda", dtype=dtype, requires_grad=True)
        v = torch.randn(b, hk, s, hd, device="cuda", dtype=dtype, requires_grad=True)
        return q, k, v, torch.randn(b, h, s, hd, device="cuda", dtype=dtype)

    def attn(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)

    with sdpa_kernel(backend):
        sets = [make() for _ in range(N_SETS)]
        with torch.no_grad():
            yield "fwd", time_ms(lambda i: attn(*sets[i][:3]), N_SETS)
        # bwd alone: keep one graph per set and re-run only its backward.
        outs = [attn(q, k, v) for q, k, v, _ in sets]
        yield "bwd", time_ms(
            lambda i: torch.autograd.grad(outs[i], sets[i][:3], sets[i][3], retain_graph=True), N_SETS)
        del outs
        yield "fwd+bwd", time_ms(
            lambda i: torch.autograd.grad(attn(*sets[i][:3]), sets[i][:3], sets[i][3]), N_SETS)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="reduced grid")
    ap.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    ap.add_argument("--json", metavar="PATH", help="write the records as a JSON list")
    args = ap.parse_args()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    if not torch.cuda.is_available():
        sys.exit("torch_bench: no CUDA device")
    print(f"# {torch.cuda.get_device_name()}  torch {torch.__version__}  "
          f"cuDNN {torch.backends.cudnn.version()}  {args.dtype}")
    print(f"{'impl':<12} {'pass':<8} {'hd':>4} {'seqlen':>6} {'batch':>5} {'heads':>6} "
          f"{'causal':>6} {'ms':>9} {'TFLOP/s':>8}")
    records, t_start = [], time.time()
    for hd, s, h, hk, causal in grid(args.quick):
        b = TOKENS // s
        fwd_flop = 4 * b * h * s * s * hd / (2 if causal else 1)
        for name, backend in BACKENDS.items():
            try:
                for pas, ms in bench_config(hd, s, h, hk, causal, dtype, backend):
                    tflops = PASS_FLOP_FACTOR[pas] * fwd_flop / (ms * 1e-3) / 1e12
                    records.append({"impl": name, "pass": pas, "hd": hd, "seqlen": s, "batch": b, "heads": h,
                                    "heads_k": hk, "causal": causal, "ms": ms, "tflops": tflops})
                    print(f"{name:<12} {pas:<8} {hd:>4} {s:>6} {b:>5} {f'{h}/{hk}':>6} "
                          f"{str(causal):>6} {ms:>9.3f} {tflops:>8.1f}")
            except Exception as e:  # a backend that does not support a shape: skip it
                msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                print(f"{name:<12} skipped hd={hd} seqlen={s} heads={h}/{hk} causal={causal}: {msg[:120]}")
            torch.cuda.empty_cache()
        if args.json:  # rewrite after each shape so a timed-out run still leaves results
            with open(args.json, "w") as f:
                json.dump(records, f, indent=1)
    print(f"# {len(records)} records in {time.time() - t_start:.0f} s")


if __name__ == "__main__":
    main()
