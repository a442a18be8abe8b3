#!/usr/bin/env python3
"""The decode call of scripts/bench/torch_bench.py, alone, for Nsight Compute: GQA 32/8 heads, hd 128,
bf16, one query token over a (b, 8, L, 128) cache, through one SDPA backend, CALLS times.
Meant to run under `ncu --launch-skip` so that the profiled launch is past the warm-up, to set
PyTorch's fastest decode kernel (cuDNN) side by side with ours (scripts/profile/decode.sh).

Usage: python3 scripts/profile/torch-decode.py B L [cudnn|flash] [gqa|packed] [bhsd|bshd]
(bshd: the cache memory in candle-flash's (b, L, h_k, d) order, passed as a transposed view)
"""
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

H, HK, HD, CALLS = 32, 8, 128, 40


def main():
    b, L = int(sys.argv[1]), int(sys.argv[2])
    backend = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}[
        sys.argv[3] if len(sys.argv) > 3 else "cudnn"]
    form = sys.argv[4] if len(sys.argv) > 4 else "gqa"
    if len(sys.argv) > 5 and sys.argv[5] == "bshd":
        k = torch.randn(b, L, HK, HD, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
        v = torch.randn(b, L, HK, HD, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    else:
        k = torch.randn(b, HK, L, HD, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
    if form == "gqa":
        q = torch.randn(b, H, 1, HD, device="cuda", dtype=torch.bfloat16)
        call = lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)  # noqa: E731
    else:
        q = torch.randn(b, HK, H // HK, HD, device="cuda", dtype=torch.bfloat16)
        call = lambda: F.scaled_dot_product_attention(q, k, v)  # noqa: E731
    with sdpa_kernel([backend]):
        for _ in range(CALLS):
            call()
    torch.cuda.synchronize()
    print(f"{CALLS} calls of {sys.argv[3:] or ['cudnn']} at b={b} L={L} done")


if __name__ == "__main__":
    main()
