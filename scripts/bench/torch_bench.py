#!/usr/bin/env python3
"""PyTorch SDPA speed anchor on the FlashAttention-2 paper grid, run on the lent GPU.

Grid: batch * seqlen = 16k tokens, hidden 2048 (hd 64 -> 32 heads, 128 -> 16, 256 -> 8),
seqlen 512..16k, causal and not; plus GQA 32/8 heads, hd 128, seqlen 2k and 8k.
Passes fwd, bwd and fwd+bwd, backends FlashAttention-2 and cuDNN (skipped where they fail).
Tensors are in SDPA's native (b, h, s, d) layout; our crate's is (b, s, h, d).

TFLOP/s: fwd = 4*b*h*sq*sk*d (halved for causal), bwd = 2.5x fwd, fwd+bwd = 3.5x fwd.
Timing: CUDA events around a loop that rotates over input sets (each set alone is larger
than the 50 MB L2), median of several repeats after a warm-up.

Decode (always run after the grid; --decode-only runs only it), the shapes of the decode
section of benches/attention/: GQA 32/8 heads, hd 128, one query token per sequence over all
L cached tokens, (batch, L) in (1, 8k), (8, 8k), (1, 64k), (32, 4k). q (b, 32, 1, 128),
k/v (b, 8, L, 128), rotating over >= 3 caches of >= 256 MiB in all. GB/s = K+V bytes read
(2*b*L*8*128*2) / time. Each backend (flash, cuDNN, efficient) is timed in two forms:
  - impl "torch-<backend>": enable_gqa=True, the plain call;
  - impl "torch-<backend>-packed": the 4 query heads sharing a K/V head passed as 4 query rows
    of that head, q (b, 8, 4, 128) against k/v (b, 8, L, 128): the same result (non-causal,
    one token) and the layout FlashAttention's own decode uses; it also runs on backends
    without GQA support.
and each of those again replayed from a CUDA graph ("...+graph"): the kernels without
Python's per-call overhead, as a serving stack that captures its decode step would run them.
A form whose output differs from a float32 reference by more than 3% of its largest value is
reported and not recorded. The device copy bandwidth (bytes read + written by a 2 GiB bf16
copy_) is recorded as impl "torch-copy", pass "copy".

--dropout P times the grid with dropout_p = P (benches/attention/ takes the same flag).

Usage: python3 scripts/bench/torch_bench.py [--quick] [--decode-only | --no-decode] [--no-graph]
                                      [--passes fwd,bwd,fwd+bwd] [--dropout P] [--dtype bf16|fp16]
                                      [--json PATH]
"""
import argparse
import json
import os
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

DECODE_SHAPES = ((1, 8192), (8, 8192), (1, 65536), (32, 4096))  # (batch, cache length L)
DECODE_H, DECODE_HK, DECODE_HD = 32, 8, 128
DECODE_BACKENDS = {"torch-flash": SDPBackend.FLASH_ATTENTION, "torch-cudnn": SDPBackend.CUDNN_ATTENTION,
                   "torch-efficient": SDPBackend.EFFICIENT_ATTENTION}
DECODE_MIN_CACHES = 3
DECODE_ROTATE_BYTES = 256 << 20  # K+V of all caches together: 4-5x the 50-60 MB L2
DECODE_MAX_BYTES = 8 << 30
DECODE_CALIB_CALLS = 20  # one call is ~10-100 us: estimate its time over this many
DECODE_MAX_ITERS = 50_000
DECODE_REPEATS = 9
DECODE_CHECK_REL = 0.03  # max |out - float32 reference| / max |reference|; bf16 rounding gives ~0.4%
COPY_ELEMS = 1 << 30  # 2 GiB of bf16


def grid(quick):
    """(hd, seqlen, heads, heads_k, causal) in the order they are measured."""
    hds, seqlens = ((64, 128), (1024, 4096)) if quick else ((64, 128, 256), (512, 1024, 2048, 4096, 8192, 16384))
    # CANDLE_FLASH_BENCH_HDS=160,192 replaces the head dims, as in benches/attention/.
    env_hds = os.environ.get("CANDLE_FLASH_BENCH_HDS")
    if env_hds:
        hds = tuple(int(x) for x in env_hds.split(",") if x.strip())
    for hd in hds:
        for s in seqlens:
            for causal in (False, True):
                yield hd, s, HIDDEN // hd, HIDDEN // hd, causal
    for s in (2048,) if quick else (2048, 8192):
        for causal in (False, True):
            yield 128, s, 32, 8, causal


def cases(quick):
    """grid(quick), or only its MHA shapes named in CANDLE_FLASH_BENCH_CASES (as the Rust bench:
    `128/8192/n,256/4096/c`, hd/seqlen/causal), taken from the full grid."""
    keys = os.environ.get("CANDLE_FLASH_BENCH_CASES")
    if not keys:
        yield from grid(quick)
        return
    keys = {k.strip() for k in keys.split(",")}
    for hd, s, h, hk, causal in grid(False):
        if h == hk and f"{hd}/{s}/{'c' if causal else 'n'}" in keys:
            yield hd, s, h, hk, causal


def time_ms(fn, n_sets, calib=1, max_iters=100, repeats=REPEATS, warmup=None):
    """Median milliseconds per call of fn(i), i rotating over the input sets. The defaults are
    the training grid's; decode calls are short and calibrate over many calls, allow many more
    per repeat and repeat more often."""
    for i in range(2 * n_sets if warmup is None else warmup):  # kernel selection, allocator, lazy init
        fn(i % n_sets)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(calib):
        fn(i % n_sets)
    torch.cuda.synchronize()
    est_ms = max((time.perf_counter() - t0) * 1e3 / calib, 1e-3)
    iters = int(min(max_iters, max(3, TARGET_MS_PER_REPEAT / est_ms)))
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(repeats):
        start.record()
        for i in range(iters):
            fn(i % n_sets)
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / iters)
    return statistics.median(samples)


def bench_config(hd, s, h, hk, causal, dtype, backend, passes=tuple(PASS_FLOP_FACTOR), dropout=0.0):
    """Yields (pass, ms) for one shape and backend, for the passes named; raises if the backend
    cannot run it."""
    b = TOKENS // s
    gqa = h != hk

    def make():
        q = torch.randn(b, h, s, hd, device="cuda", dtype=dtype, requires_grad=True)
        k = torch.randn(b, hk, s, hd, device="cuda", dtype=dtype, requires_grad=True)
        v = torch.randn(b, hk, s, hd, device="cuda", dtype=dtype, requires_grad=True)
        return q, k, v, torch.randn(b, h, s, hd, device="cuda", dtype=dtype)

    def attn(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa, dropout_p=dropout)

    with sdpa_kernel(backend):
        sets = [make() for _ in range(N_SETS)]
        if "fwd" in passes:
            with torch.no_grad():
                yield "fwd", time_ms(lambda i: attn(*sets[i][:3]), N_SETS)
        if "bwd" in passes:
            # bwd alone: keep one graph per set and re-run only its backward.
            outs = [attn(q, k, v) for q, k, v, _ in sets]
            yield "bwd", time_ms(
                lambda i: torch.autograd.grad(outs[i], sets[i][:3], sets[i][3], retain_graph=True), N_SETS)
            del outs
        if "fwd+bwd" in passes:
            yield "fwd+bwd", time_ms(
                lambda i: torch.autograd.grad(attn(*sets[i][:3]), sets[i][:3], sets[i][3]), N_SETS)


def decode_caches(b, L, elem_bytes):
    """Caches to rotate over: >= DECODE_MIN_CACHES and DECODE_ROTATE_BYTES of K+V in all,
    at most DECODE_MAX_BYTES."""
    one = 2 * b * L * DECODE_HK * DECODE_HD * elem_bytes
    wanted = max(DECODE_MIN_CACHES, -(-DECODE_ROTATE_BYTES // one))
    return max(1, min(wanted, DECODE_MAX_BYTES // one))


def decode_forms(b):
    """{form: (impl suffix, fn(q, k, v) -> (b, 32, 1, 128))} for q (b, 32, 1, 128), k/v (b, 8, L, 128)."""
    group = DECODE_H // DECODE_HK

    def gqa(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    def packed(q, k, v):
        # Query head h reads K/V head h // group (enable_gqa's rule): rows of one K/V head.
        out = F.scaled_dot_product_attention(q.view(b, DECODE_HK, group, DECODE_HD), k, v)
        return out.view(b, DECODE_H, 1, DECODE_HD)

    return {"gqa": ("", gqa), "packed": ("-packed", packed)}


def decode_reference(q, k, v):
    """float32 attention of q (b, 32, 1, d) over k/v (b, 8, L, d), (b, 32, 1, d)."""
    b = q.shape[0]
    group = DECODE_H // DECODE_HK
    qg = q.float().view(b, DECODE_HK, group, DECODE_HD)
    p = torch.softmax(qg @ k.float().transpose(-1, -2) / DECODE_HD ** 0.5, dim=-1)
    return (p @ v.float()).view(b, DECODE_H, 1, DECODE_HD)


def rel_err(out, ref):
    out = out.float()
    if not torch.isfinite(out).all():
        return float("inf")
    return ((out - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def time_graph_ms(fn, sets):
    """Per-call milliseconds of fn over the sets, replayed from one CUDA graph of >= 64 calls."""
    n = len(sets)
    rounds = max(1, -(-64 // n))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the default stream, as torch.cuda.graph asks
        for _ in range(2):
            for s in sets:
                fn(*s)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [fn(*s) for _ in range(rounds) for s in sets]
    del outs
    ms = time_ms(lambda i: graph.replay(), 1, calib=5, max_iters=DECODE_MAX_ITERS,
                 repeats=DECODE_REPEATS, warmup=3)
    return ms / (rounds * n)


def copy_bandwidth():
    """Device copy bandwidth in GB/s (bytes read + written by dst.copy_(src), 2 GiB bf16); the record."""
    src = torch.randn(COPY_ELEMS, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    ms = time_ms(lambda i: dst.copy_(src), 1)
    nbytes = 2 * src.numel() * src.element_size()
    src = dst = None  # free the 4 GiB before the decode caches
    torch.cuda.empty_cache()
    gbps = nbytes / (ms * 1e-3) / 1e9
    print(f"torch-copy: {nbytes >> 21} MiB bf16 device-to-device, {nbytes >> 20} MiB read + written: "
          f"{ms:.3f} ms, {gbps:.0f} GB/s")
    return gbps, {"impl": "torch-copy", "pass": "copy", "bytes": nbytes, "ms": ms, "gbps": gbps}


def bench_decode(b, L, dtype, graphs, copy_gbps):
    """Yields the records of one decode shape; prints a row (or why not) per impl."""
    n = decode_caches(b, L, torch.finfo(dtype).bits // 8)
    kv_bytes = 2 * b * L * DECODE_HK * DECODE_HD * (torch.finfo(dtype).bits // 8)
    sets = [(torch.randn(b, DECODE_H, 1, DECODE_HD, device="cuda", dtype=dtype),
             torch.randn(b, DECODE_HK, L, DECODE_HD, device="cuda", dtype=dtype),
             torch.randn(b, DECODE_HK, L, DECODE_HD, device="cuda", dtype=dtype)) for _ in range(n)]
    ref = decode_reference(*sets[0])
    lead = f"{'decode':<8} {DECODE_HD:>4} {L:>6} {b:>5} {f'{DECODE_H}/{DECODE_HK}':>6} {n:>6}"

    def row(name, ms, err):
        gbps = kv_bytes / (ms * 1e-3) / 1e9
        pct = f"{100 * gbps / copy_gbps:.1f}" if copy_gbps else "n/a"
        print(f"{name:<26} {lead} {ms:>9.4f} {gbps:>8.0f} {pct:>6}  ok ({100 * err:.2f}%)")
        return {"impl": name, "pass": "decode", "hd": DECODE_HD, "seqlen": L, "batch": b, "heads": DECODE_H,
                "heads_k": DECODE_HK, "causal": False, "ms": ms, "gbps": gbps, "caches": n, "max_rel_err": err}

    def skip(name, why):
        print(f"{name:<26} {lead} skipped: {why}")

    for backend_name, backend in DECODE_BACKENDS.items():
        for suffix, fn in decode_forms(b).values():
            name = backend_name + suffix
            try:
                with sdpa_kernel(backend), torch.no_grad():
                    err = rel_err(fn(*sets[0]), ref)
                    if err > DECODE_CHECK_REL:
                        skip(name, f"MISMATCH: max error {100 * err:.2f}% of max |reference|")
                        continue
                    ms = time_ms(lambda i: fn(*sets[i]), n, calib=DECODE_CALIB_CALLS, max_iters=DECODE_MAX_ITERS,
                                 repeats=DECODE_REPEATS, warmup=2 * DECODE_CALIB_CALLS)
                    yield row(name, ms, err)
                    if graphs:
                        try:
                            yield row(name + "+graph", time_graph_ms(fn, sets), err)
                        except Exception as e:  # capture unsupported: the eager record stands
                            skip(name + "+graph", first_line(e))
            except Exception as e:  # a backend that does not support the shape or form
                skip(name, first_line(e))
            torch.cuda.synchronize()
    sets = ref = None  # free the caches before the next shape
    torch.cuda.empty_cache()


def first_line(e):
    msg = str(e).strip()
    return (msg.splitlines()[0] if msg else type(e).__name__)[:160]


def run_decode(dtype, graphs, records, json_path):
    print(f"# decode: GQA {DECODE_H}/{DECODE_HK} heads, hd {DECODE_HD}, {dtype}, one query token over all L "
          f"cached tokens; GB/s of K+V read; {'eager and CUDA graph' if graphs else 'eager'}")
    copy_gbps = None
    try:
        copy_gbps, rec = copy_bandwidth()
        records.append(rec)
    except Exception as e:
        print(f"torch-copy: skipped: {first_line(e)}")
    print(f"{'impl':<26} {'pass':<8} {'hd':>4} {'L':>6} {'batch':>5} {'heads':>6} {'caches':>6} "
          f"{'ms':>9} {'GB/s':>8} {'%copy':>6}  check")
    for b, L in DECODE_SHAPES:
        try:
            records.extend(bench_decode(b, L, dtype, graphs, copy_gbps))
        except Exception as e:  # inputs or reference (out of memory?)
            print(f"decode batch={b} L={L}: skipped: {first_line(e)}")
            torch.cuda.empty_cache()
        if json_path:
            with open(json_path, "w") as f:
                json.dump(records, f, indent=1)
    print("# %copy: GB/s of K+V read / torch-copy's bandwidth. check: max |out - float32 reference| "
          f"as a % of max |reference| (not recorded above {100 * DECODE_CHECK_REL:.0f}%)")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="reduced grid")
    ap.add_argument("--decode-only", action="store_true", help="only the decode shapes")
    ap.add_argument("--no-decode", action="store_true", help="only the grid, no decode shapes")
    ap.add_argument("--passes", default="fwd,bwd,fwd+bwd",
                    help="comma-separated grid passes to time (default: all three)")
    ap.add_argument("--no-graph", action="store_true", help="decode: skip the CUDA-graph timings")
    ap.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    ap.add_argument("--dropout", type=float, default=0.0, help="the grid with this dropout_p")
    ap.add_argument("--json", metavar="PATH", help="write the records as a JSON list")
    args = ap.parse_args()
    args.passes = tuple(p for p in args.passes.split(",") if p)
    if bad := [p for p in args.passes if p not in PASS_FLOP_FACTOR]:
        ap.error(f"--passes: unknown {bad}, expected some of {list(PASS_FLOP_FACTOR)}")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    if not torch.cuda.is_available():
        sys.exit("torch_bench: no CUDA device")
    print(f"# {torch.cuda.get_device_name()}  torch {torch.__version__}  "
          f"cuDNN {torch.backends.cudnn.version()}  {args.dtype}"
          + (f"  dropout_p {args.dropout}" if args.dropout else ""))
    records, t_start = [], time.time()
    if not args.decode_only:
        run_grid(args, dtype, records)
    if not args.no_decode:
        run_decode(dtype, not args.no_graph, records, args.json)
    print(f"# {len(records)} records in {time.time() - t_start:.0f} s")


def run_grid(args, dtype, records):
    print(f"{'impl':<12} {'pass':<8} {'hd':>4} {'seqlen':>6} {'batch':>5} {'heads':>6} "
          f"{'causal':>6} {'ms':>9} {'TFLOP/s':>8}")
    for hd, s, h, hk, causal in cases(args.quick):
        b = TOKENS // s
        fwd_flop = 4 * b * h * s * s * hd / (2 if causal else 1)
        for name, backend in BACKENDS.items():
            try:
                for pas, ms in bench_config(hd, s, h, hk, causal, dtype, backend, args.passes, args.dropout):
                    tflops = PASS_FLOP_FACTOR[pas] * fwd_flop / (ms * 1e-3) / 1e12
                    records.append({"impl": name, "pass": pas, "hd": hd, "seqlen": s, "batch": b, "heads": h,
                                    "heads_k": hk, "causal": causal, "ms": ms, "tflops": tflops,
                                    **({"dropout": args.dropout} if args.dropout else {})})
                    print(f"{name:<12} {pas:<8} {hd:>4} {s:>6} {b:>5} {f'{h}/{hk}':>6} "
                          f"{str(causal):>6} {ms:>9.3f} {tflops:>8.1f}")
            except Exception as e:  # a backend that does not support a shape: skip it
                msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                print(f"{name:<12} skipped hd={hd} seqlen={s} heads={h}/{hk} causal={causal}: {msg[:120]}")
            torch.cuda.empty_cache()
        if args.json:  # rewrite after each shape so a timed-out run still leaves results
            with open(args.json, "w") as f:
                json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
