#!/usr/bin/env python3
"""What a softcap costs PyTorch's FlexAttention, on the shapes of the bench's mods section.

Issue 19 asks for a softcap within 10% of plain attention. SDPA has no softcap, so this times
FlexAttention (torch.compile'd, Triton) plain and with `score_mod = cap * tanh(score / cap)`,
each pair back to back on the same inputs, and cuDNN's SDPA for plain attention beside them.
The tanh is `tanh.approx.f32` (one MUFU operation, as in our kernels and in FlashAttention's)
through a custom op that Inductor inlines; torch.tanh lowers to libdevice's exact tanh, which
would charge flex for a slower tanh than ours. `--exact-tanh` times that form too.

Shapes: benches/attention.rs `mods_section`: (hd, seqlen, heads) = (128, 16k, 16),
(64, 4k, 32), (256, 4k, 8), batch 16k / seqlen, bf16, causal and not. Passes fwd and bwd
(backward alone on a kept graph), timed as scripts/torch_bench.py times (rotating input
sets, median of repeats). Before timing, each flex form's output for 64 query rows is checked
against float32 math.

Usage: python3 scripts/flex_softcap.py [--hds 64,128,256] [--cap 50] [--exact-tanh]
                                       [--json PATH]
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


def reference_rows(q, k, v, causal, cap):
    """float32 attention of batch 0, head 0, query rows [0, CHECK_ROWS) over all keys."""
    qf, kf, vf = (x[0, 0].float() for x in (q, k, v))
    s = qf[:CHECK_ROWS] @ kf.T / q.shape[-1] ** 0.5
    if cap is not None:
        s = cap * torch.tanh(s / cap)
    if causal:
        rows = torch.arange(CHECK_ROWS, device=s.device)[:, None]
        cols = torch.arange(kf.shape[0], device=s.device)[None, :]
        s = s.masked_fill(cols > rows, float("-inf"))
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
    ap.add_argument("--json")
    args = ap.parse_args()
    cap = args.cap
    dtype = torch.bfloat16
    torch.manual_seed(0)
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")

    tanh = approx_tanh()
    forms = {}
    if tanh is not None:
        forms["softcap (tanh.approx)"] = lambda s, b, h, qi, ki: cap * tanh(s / cap)
    if tanh is None or args.exact_tanh:
        forms["softcap (torch.tanh)"] = lambda s, b, h, qi, ki: cap * torch.tanh(s / cap)
    # One compiled graph per shape, mask, score_mod and grad mode: 24 here, past Dynamo's
    # default limit of 8, after which flex_attention silently runs unfused.
    torch._dynamo.config.recompile_limit = 64
    flex = torch.compile(flex_attention, dynamic=False)

    rows = []
    header = f"{'impl':<30} {'hd':>4} {'seqlen':>6} {'causal':>6} {'pass':<4} {'ms':>8} {'TFLOP/s':>8} {'vs plain':>8}"
    print(header)
    for hd in (int(x) for x in args.hds.split(",")):
        s, h = SHAPES[hd]
        b = TOKENS // s
        for causal in (False, True):
            sets = []
            for _ in range(N_SETS):
                q, k, v = (torch.randn(b, h, s, hd, device="cuda", dtype=dtype, requires_grad=True)
                           for _ in range(3))
                sets.append((q, k, v, torch.randn(b, h, s, hd, device="cuda", dtype=dtype)))
            mask = None
            if causal:
                mask = create_block_mask(lambda b_, h_, qi, ki: qi >= ki, None, None, s, s, device="cuda")
            flop = 4 * b * h * s * s * hd * (0.5 if causal else 1.0)

            def record(impl, times, plain=None):
                for p, ms in times.items():
                    ratio = f"{ms / plain[p]:.3f}" if plain else "-"
                    tf = flop * PASS_FLOP_FACTOR[p] / ms / 1e9
                    print(f"{impl:<30} {hd:>4} {s:>6} {str(causal):>6} {p:<4} {ms:>8.3f} {tf:>8.1f} {ratio:>8}",
                          flush=True)
                    rows.append({"impl": impl, "hd": hd, "seqlen": s, "causal": causal, "pass": p,
                                 "ms": ms, "tflops": tf, "vs_plain": ms / plain[p] if plain else None})

            q, k, v, _ = sets[0]
            for name, mod in [("flex plain", None)] + list(forms.items()):
                with torch.no_grad():
                    got = flex(q, k, v, score_mod=mod, block_mask=mask)[0, 0, :CHECK_ROWS].float()
                ref = reference_rows(q, k, v, causal, None if mod is None else cap)
                err = ((got - ref).abs().max() / ref.abs().max()).item()
                if not err <= CHECK_REL:
                    print(f"{name} hd {hd} causal {causal}: rel err {err:.2e} > {CHECK_REL}; not timed")
                    forms.pop(name, None)
            # Each capped form right after plain flex attention on the same inputs, so that
            # the pair sees the same clock (the card runs at its power limit under this load).
            for name, mod in forms.items():
                plain = time_flex(flex, sets, mask, None)
                record("flex plain", plain)
                record(f"flex {name}", time_flex(flex, sets, mask, mod), plain)
            del sets
            try:
                cudnn = dict(bench_config(hd, s, h, h, causal, dtype, SDPBackend.CUDNN_ATTENTION,
                                          passes=("fwd", "bwd")))
                record("torch-cudnn plain", cudnn)
            except Exception as e:  # noqa: BLE001 (a backend that cannot run a shape is skipped)
                print(f"torch-cudnn hd {hd} causal {causal}: skipped: {str(e).splitlines()[0]}")
            torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "cap": cap,
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
