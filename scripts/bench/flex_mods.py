#!/usr/bin/env python3
"""What a softcap and a sliding window cost PyTorch's FlexAttention, on the mods section's shapes.

Issue 19 asks for a softcap within 10% of plain attention and windowed passes close to the
window's share of full attention. SDPA has neither, so this times FlexAttention
(torch.compile'd, Triton): plain, with `score_mod = cap * tanh(score / cap)`, and (--windows)
with a sliding-window block mask, each variant right after flex's plain attention on the same
inputs, and cuDNN's SDPA for plain attention beside them. The tanh is `tanh.approx.f32` (one
MUFU operation, as in our kernels and in FlashAttention's) through a custom op that Inductor
inlines; torch.tanh lowers to libdevice's exact tanh, which would charge flex for a slower
tanh than ours. `--exact-tanh` times that form too.

Shapes: benches/attention/options.rs `mods_section`: (hd, seqlen, heads) = (128, 16k, 16),
(64, 4k, 32), (256, 4k, 8), batch 16k / seqlen, bf16. Softcap: causal and not, against plain
attention with the same mask. Windows (the bench's): (seqlen / 4, 0) causal and
(seqlen / 8, seqlen / 8), against plain non-causal attention, `ideal` being the share of
visible (query, key) pairs. Passes fwd and bwd (backward alone on a kept graph), timed as
scripts/bench/torch_bench.py times (rotating input sets, median of repeats); TFLOP/s counts the
visible pairs. Before timing, each flex variant's output for 64 query rows from the middle of
the sequence is checked against float32 math.

Usage: python3 scripts/bench/flex_mods.py [--hds 64,128,256] [--cap 50] [--exact-tanh]
                                    [--no-softcap] [--windows] [--json PATH]
"""
import argparse
import functools
import json
import os
import sys

import torch
from torch.nn.attention import SDPBackend
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_bench import N_SETS, PASS_FLOP_FACTOR, bench_config, time_ms  # noqa: E402

TOKENS = 16 * 1024
SHAPES = {128: (16384, 16), 64: (4096, 32), 256: (4096, 8)}  # hd -> (seqlen, heads)
CHECK_ROWS = 64
CHECK_REL = 0.03  # max |out - f32| / max |f32| over the checked rows; bf16 rounding ~0.4%


def approx_tanh():
    """tanh(x) as `tanh.approx.f32`, inlined by Inductor into the flex kernels, with the
    derivative 1 - tanh^2 for the backward. Returns None where this torch lacks the hooks."""
    try:
        from torch._inductor.lowering import make_pointwise, register_lowering
        from torch._inductor.virtualized import ops
    except ImportError as e:
        print(f"tanh.approx unavailable ({e}); flex softcap uses torch.tanh")
        return None

    @torch.library.custom_op("candle_flash_bench::tanh_approx", mutates_args=())
    def tanh_op(x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x)

    @tanh_op.register_fake
    def _(x):
        return torch.empty_like(x)

    asm = functools.partial(ops.inline_asm_elementwise, asm="tanh.approx.f32 $0, $1;")
    register_lowering(torch.ops.candle_flash_bench.tanh_approx)(make_pointwise(asm))

    class Tanh(torch.autograd.Function):
        @staticmethod
        def forward(x):
            return torch.ops.candle_flash_bench.tanh_approx(x)

        @staticmethod
        def setup_context(ctx, inputs, output):
            ctx.save_for_backward(output)

        @staticmethod
        def backward(ctx, grad):
            (t,) = ctx.saved_tensors
            return grad * (1 - t * t)

    return Tanh.apply


def window_visible(left, right):
    """Mask function (query index, key index) -> visible, for a window (left, right) on
    seqlen_q = seqlen_k (-1 = unbounded side); works on ints and on tensors."""
    def visible(qi, ki):
        ok = (ki - qi <= right) if right >= 0 else (ki >= 0)
        if left >= 0:
            ok = ok & (qi - ki <= left)
        return ok
    return visible


def visible_share(s, left, right):
    """Share of the s x s (query, key) pairs a window (left, right) keeps."""
    pairs = 0
    for qi in range(s):
        lo = 0 if left < 0 else max(0, qi - left)
        hi = s - 1 if right < 0 else min(s - 1, qi + right)
        pairs += hi - lo + 1
    return pairs / (s * s)


def reference_rows(q, k, v, row0, visible=None, cap=None):
    """float32 attention of batch 0, head 0, query rows [row0, row0 + CHECK_ROWS) over all keys."""
    qf, kf, vf = (x[0, 0].float() for x in (q, k, v))
    s = qf[row0:row0 + CHECK_ROWS] @ kf.T / q.shape[-1] ** 0.5
    if cap is not None:
        s = cap * torch.tanh(s / cap)
    if visible is not None:
        rows = torch.arange(row0, row0 + CHECK_ROWS, device=s.device)[:, None]
        cols = torch.arange(kf.shape[0], device=s.device)[None, :]
        s = s.masked_fill(~visible(rows, cols), float("-inf"))
    return torch.softmax(s, dim=-1) @ vf


def time_flex(flex, sets, block_mask, score_mod):
    """{pass: ms} of flex attention over the input sets: fwd, and bwd on kept graphs."""

    def attn(q, k, v):
        return flex(q, k, v, score_mod=score_mod, block_mask=block_mask)

    out = {}
    with torch.no_grad():
        out["fwd"] = time_ms(lambda i: attn(*sets[i][:3]), N_SETS)
    graphs = [attn(q, k, v) for q, k, v, _ in sets]
    out["bwd"] = time_ms(
        lambda i: torch.autograd.grad(graphs[i], sets[i][:3], sets[i][3], retain_graph=True), N_SETS)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hds", default="64,128,256")
    ap.add_argument("--cap", type=float, default=50.0)
    ap.add_argument("--exact-tanh", action="store_true")
    ap.add_argument("--no-softcap", action="store_true")
    ap.add_argument("--windows", action="store_true")
    ap.add_argument("--json")
    args = ap.parse_args()
    cap = args.cap
    dtype = torch.bfloat16
    torch.manual_seed(0)
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")

    caps = {}
    if not args.no_softcap:
        tanh = approx_tanh()
        if tanh is not None:
            caps["softcap (tanh.approx)"] = lambda s, b, h, qi, ki: cap * tanh(s / cap)
        if tanh is None or args.exact_tanh:
            caps["softcap (torch.tanh)"] = lambda s, b, h, qi, ki: cap * torch.tanh(s / cap)
    # One compiled graph per shape, mask, score_mod and grad mode (24 for the softcap rows),
    # past Dynamo's default limit of 8, after which flex_attention silently runs unfused.
    torch._dynamo.config.recompile_limit = 64
    flex = torch.compile(flex_attention, dynamic=False)

    rows = []
    print(f"{'impl':<34} {'hd':>4} {'seqlen':>6} {'causal':>6} {'pass':<4} {'ms':>8} {'TFLOP/s':>8} "
          f"{'vs plain':>8} {'ideal':>6}")

    def record(impl, hd, s, b, h, causal, share, times, plain=None, ideal=None):
        flop = 4 * b * h * s * s * hd * share
        for p, ms in times.items():
            ratio = f"{ms / plain[p]:.3f}" if plain else "-"
            tf = flop * PASS_FLOP_FACTOR[p] / ms / 1e9
            ideal_s = f"{ideal:.3f}" if ideal is not None else "-"
            print(f"{impl:<34} {hd:>4} {s:>6} {str(causal):>6} {p:<4} {ms:>8.3f} {tf:>8.1f} {ratio:>8} {ideal_s:>6}",
                  flush=True)
            rows.append({"impl": impl, "hd": hd, "seqlen": s, "causal": causal, "pass": p, "ms": ms,
                         "tflops": tf, "vs_plain": ms / plain[p] if plain else None, "ideal": ideal})

    def checked(name, q, k, v, s, mask, visible, mod):
        row0 = s // 2
        with torch.no_grad():
            got = flex(q, k, v, score_mod=mod, block_mask=mask)[0, 0, row0:row0 + CHECK_ROWS].float()
        ref = reference_rows(q, k, v, row0, visible, None if mod is None else cap)
        err = ((got - ref).abs().max() / ref.abs().max()).item()
        if not err <= CHECK_REL:
            print(f"{name}, hd {q.shape[-1]}: rel err {err:.2e} > {CHECK_REL}; not timed")
        return err <= CHECK_REL

    def block_mask(visible, s):
        return create_block_mask(lambda b_, h_, qi, ki: visible(qi, ki), None, None, s, s, device="cuda")

    for hd in (int(x) for x in args.hds.split(",")):
        s, h = SHAPES[hd]
        b = TOKENS // s
        sets = []
        for _ in range(N_SETS):
            q, k, v = (torch.randn(b, h, s, hd, device="cuda", dtype=dtype, requires_grad=True)
                       for _ in range(3))
            sets.append((q, k, v, torch.randn(b, h, s, hd, device="cuda", dtype=dtype)))
        q, k, v, _ = sets[0]
        causal_vis = window_visible(-1, 0)
        for causal in (False, True) if caps else ():
            vis = causal_vis if causal else None
            mask = block_mask(vis, s) if causal else None
            share = 0.5 if causal else 1.0
            if not checked("flex plain", q, k, v, s, mask, vis, None):
                continue
            # Each capped form right after plain flex attention on the same inputs, so that
            # the pair sees the same clock (the card runs at its power limit under this load).
            for name, mod in caps.items():
                if not checked(name, q, k, v, s, mask, vis, mod):
                    continue
                plain = time_flex(flex, sets, mask, None)
                record("flex plain", hd, s, b, h, causal, share, plain)
                record(f"flex {name}", hd, s, b, h, causal, share, time_flex(flex, sets, mask, mod), plain)
            try:
                cudnn = dict(bench_config(hd, s, h, h, causal, dtype, SDPBackend.CUDNN_ATTENTION,
                                          passes=("fwd", "bwd")))
                record("torch-cudnn plain", hd, s, b, h, causal, share, cudnn)
            except Exception as e:  # noqa: BLE001 (a backend that cannot run a shape is skipped)
                print(f"torch-cudnn hd {hd} causal {causal}: skipped: {str(e).splitlines()[0]}")
        if args.windows and checked("flex plain", q, k, v, s, None, None, None):
            quarter = s // 4
            for left, right, causal in ((quarter, 0, True), (quarter // 2, quarter // 2, False)):
                vis = window_visible(left, right)
                mask = block_mask(vis, s)
                name = f"window ({left}, {right}){' causal' if causal else ''}"
                if not checked(f"flex {name}", q, k, v, s, mask, vis, None):
                    continue
                share = visible_share(s, left, right)
                plain = time_flex(flex, sets, None, None)
                record("flex plain", hd, s, b, h, False, 1.0, plain)
                record(f"flex {name}", hd, s, b, h, causal, share, time_flex(flex, sets, mask, None),
                       plain, share)
        del sets, q, k, v
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "cap": cap,
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
