"""The attention kernel a run computes with (`train.attention = auto | sdpa | eager`), handed to
every forward (`GPT.forward(..., attend=...)`), never set on the model: sdpa is
F.scaled_dot_product_attention (flash kernels on CUDA and CPU), eager pipeline.cpu.attention.

auto is sdpa, except on a CPU in bf16 at sequences up to EAGER_MAX_T, where the CPU flash kernel
measured 1.3-2.1x slower than eager (Zen 4, one layer forward + backward: 2.12x at T 256, 1.28x
at 512, 0.69x at 1,024; in fp32 sdpa won at every length; bench/results/README.md).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

Attend = Callable[..., torch.Tensor]  # F.scaled_dot_product_attention's signature
EAGER_MAX_T = 512


def resolve(requested: str, device: torch.device, dtype: torch.dtype, seq_len: int) -> str:
    """train.attention auto|sdpa|eager -> sdpa|eager on `device` in `dtype` at `seq_len`."""
    if requested != "auto":
        return requested
    cpu_bf16 = torch.device(device).type == "cpu" and dtype == torch.bfloat16
    return "eager" if cpu_bf16 and seq_len <= EAGER_MAX_T else "sdpa"


def kernel(name: str) -> Attend:
    if name == "eager":
        from lmforge.pipeline.cpu.attention import eager_attention  # the CPU room: only when chosen

        return eager_attention
    return F.scaled_dot_product_attention
