"""Runs PyTorch's FlashAttention-2 (or cuDNN) backend forward and backward a few times on one
bench shape, for Nsight Compute to profile next to ours (scripts/profile/vs-fa2.sh).

Usage: python3 scripts/profile/fa2.py HD SEQLEN CAUSAL(n|c) [flash|cudnn]
  (batch x seqlen = 16k, hidden 2048; default backend flash)
"""
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

hd, seqlen, causal = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "c"
heads, batch = 2048 // hd, 16384 // seqlen
shape = (batch, heads, seqlen, hd)
q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)
           for _ in range(3))
do = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
backend = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[
    sys.argv[4] if len(sys.argv) > 4 else "flash"]
with sdpa_kernel(backend):
    for _ in range(4):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        out.backward(do)
torch.cuda.synchronize()
