"""Muon (torch.optim.Muon's update, Newton–Schulz in a chosen dtype), on whole or FSDP2-sharded
matrices.

Newton–Schulz needs the whole matrix: under FSDP2, matrix i's owner (rank i % world) gathers the
dim-0 shards of its momentum update, orthogonalises it and scatters it back. The momentum buffer
stays a shard like the parameter's, so DCP reshards it as it does AdamW's moments. Gather/scatter
rather than torchtitan's all-to-all: the same bytes, the owner holds only its own matrices whole,
the uneven FSDP shards need only padding, on gloo and nccl alike; the gathers are all issued at
once and each owner orthogonalises as its matrices arrive.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard


def orthogonalize(g_MN: torch.Tensor, coefficients, steps: int, eps: float) -> torch.Tensor:
    """Quintic Newton–Schulz towards U V^T of g = U S V^T (torch.optim.Muon's iteration)."""
    a, b, c = coefficients
    tall = g_MN.size(0) > g_MN.size(1)
    x = g_MN.T if tall else g_MN  # iterate on the wide side: the Gram matrix is the smaller one
    x = x / x.norm().clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


class Muon(torch.optim.Muon):
    """torch.optim.Muon (its own step for bf16 on whole matrices), else the same update here with
    Newton–Schulz in `ns_dtype`: on CPUs without bf16 matmuls fp32 is several times faster, and it
    keeps fp32 runs reproducible across world sizes to fp32 rounding."""

    def __init__(self, params, *, ns_dtype: torch.dtype, **kwargs):
        super().__init__(params, **kwargs)
        self.ns_dtype = ns_dtype

    @torch.no_grad()
    def step(self, closure=None):
        sharded = any(isinstance(p, DTensor) for g in self.param_groups for p in g["params"])
        if self.ns_dtype == torch.bfloat16 and not sharded:
            return super().step(closure)
        for group in self.param_groups:
            with_grad = [p for p in group["params"] if p.grad is not None]
            updates = [self._momentum_update(p, group) for p in with_grad]

            def ortho(u_MN, group=group):
                return orthogonalize(u_MN.to(self.ns_dtype), group["ns_coefficients"],
                                     group["ns_steps"], group["eps"])

            orthos = (orthogonalize_sharded(updates, ortho) if sharded
                      else [ortho(u) for u in updates])
            lr, wd = group["lr"], group["weight_decay"]
            for p, ortho_local in zip(with_grad, orthos, strict=True):
                local = p.to_local() if isinstance(p, DTensor) else p
                local.mul_(1 - lr * wd)
                scale = math.sqrt(max(1.0, p.shape[0] / p.shape[1]))  # torch's default
                local.add_(ortho_local.to(local.dtype), alpha=-lr * scale)
        return None

    def _momentum_update(self, p: torch.Tensor, group: dict) -> torch.Tensor:
        """Updates the momentum buffer (a shard under FSDP2); returns what to orthogonalise."""
        buf = self.state[p].setdefault("momentum_buffer", torch.zeros_like(p.grad))
        momentum = group["momentum"]
        buf.lerp_(p.grad, 1 - momentum)
        return p.grad.lerp(buf, momentum) if group["nesterov"] else buf


def orthogonalize_sharded(updates: list[DTensor], ortho) -> list[torch.Tensor]:
    """FSDP2's dim-0-sharded matrices (the same order on every rank) -> this rank's rows of
    ortho(whole matrix), computed on rank i % world; shards padded to torch.chunk's size."""
    gathers = []
    for i, u in enumerate(updates):
        if tuple(u.placements) != (Shard(0),):
            raise ValueError(f"Muon under FSDP2 expects dim-0 shards, got {u.placements}")
        group = u.device_mesh.get_group()
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        local = u.to_local()
        padded = local.new_zeros((-(-u.shape[0] // world), *u.shape[1:]))
        padded[: len(local)] = local
        owner = i % world
        pieces = [torch.empty_like(padded) for _ in range(world)] if rank == owner else None
        work = dist.gather(padded, pieces, group_dst=owner, group=group, async_op=True)
        gathers.append((work, pieces, padded, len(local), group, owner))
    scatters = []
    for u, (work, pieces, padded, rows, group, owner) in zip(updates, gathers, strict=True):
        work.wait()
        if pieces is not None:  # the owner: orthogonalise the whole matrix, send each its rows
            stacked = torch.cat(pieces)
            out = torch.zeros_like(stacked)
            out[: u.shape[0]] = ortho(stacked[: u.shape[0]])
            pieces = list(out.split(len(padded)))
        mine = torch.empty_like(padded)
        work = dist.scatter(mine, pieces, group_src=owner, group=group, async_op=True)
        scatters.append((work, mine, rows))
    result = []
    for work, mine, rows in scatters:
        work.wait()
        result.append(mine[:rows])
    return result
