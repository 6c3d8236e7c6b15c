"""`--dry-run` planning (pipeline/parallel/plan.py) checked against real runs on CPU.

Parameter, gradient and AdamW bytes must equal the tensors of a real run exactly, one process and
FSDP2 on 2 gloo ranks (this file, run under torchrun, is the probe). Activations are compared with
the bytes autograd saves for backward (a saved-tensors hook, storages counted once), as the
difference between micro-batches of 4 and 2 sequences so that per-weight tensors (bf16 weight
casts, RoPE tables) cancel out.
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace

import pytest
import torch

from lmforge.model import GPT, ModelConfig
from lmforge.pipeline.loss import CHUNK_ELEMS, ChunkedLoss
from lmforge.pipeline.parallel.materialize import meta_gpt
from lmforge.pipeline.parallel.plan import (
    activation_bytes,
    head_loss_bytes,
    planned_loss,
    state_bytes,
)
from tests.harness import ROOT, run

SMALL = ModelConfig(vocab_size=1000, n_layer=3, n_head=4, n_kv_head=2, d_model=128, max_seq_len=64)


def real_state_bytes(model: torch.nn.Module) -> dict[str, int]:
    """One AdamW step on a real model; bytes of this rank's params, grads, optimizer state."""
    def local(t):
        return t.to_local() if hasattr(t, "to_local") else t

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, SMALL.vocab_size, (2, 32))
    model(x, x).backward()
    grads = sum(local(p.grad).nbytes for p in model.parameters())
    opt.step()
    params = sum(local(p).nbytes for p in model.parameters())
    state = sum(local(v).nbytes for s in opt.state.values() for v in s.values())
    return {"params": params, "grads": grads, "optimizer": state}


def planned(world: int, sharded: bool, rank: int) -> dict[str, int]:
    shapes = [tuple(p.shape) for p in meta_gpt(SMALL).parameters()]
    s = state_bytes(shapes, world, sharded, rank)
    return {"params": s.params, "grads": s.grads, "optimizer": s.optimizer}


def test_state_bytes_equal_a_real_single_process_run():
    torch.manual_seed(0)
    assert real_state_bytes(GPT(SMALL)) == planned(1, False, 0)


def test_muon_state_bytes_equal_a_real_run():
    """optim.name = "muon": one momentum per block matrix, AdamW's two moments + step elsewhere."""
    from lmforge.pipeline.config import OptimConfig
    from lmforge.pipeline.optim.optimizers import build_optimizer, is_muon_matrix

    torch.manual_seed(0)
    model = GPT(SMALL)
    opt = build_optimizer(model, OptimConfig(name="muon"), torch.device("cpu"))
    x = torch.randint(0, SMALL.vocab_size, (2, 32))
    model(x, x).backward()
    opt.step()
    real = sum(v.nbytes for o in opt.optimizers for s in o.state.values() for v in s.values())
    muon = [is_muon_matrix(n, p) for n, p in model.named_parameters()]
    shapes = [tuple(p.shape) for p in model.parameters()]
    assert any(muon) and not all(muon)
    assert state_bytes(shapes, 1, False, muon=muon).optimizer == real
    assert real < planned(1, False, 0)["optimizer"]  # fewer bytes than AdamW's: a real difference


def test_state_bytes_equal_real_fsdp_shards_on_2_ranks():
    res = run([sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc_per_node=2", str(ROOT / "tests" / "test_plan.py")], timeout=240)
    assert res.returncode == 0, res.stdout[-3000:]
    found = [json.loads(ln[len("PLAN "):]) for ln in res.stdout.splitlines() if ln.startswith("PLAN ")]
    assert sorted(r["rank"] for r in found) == [0, 1]
    for r in found:
        assert r["real"] == planned(2, True, r["rank"]), r
    # Sharding really halves the state (the check is not comparing a run with itself).
    assert planned(2, True, 0)["params"] < 0.6 * planned(1, False, 0)["params"]


def saved_for_backward(model: GPT, batch: int, bf16: bool) -> int:
    storages: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        storages[s.data_ptr()] = s.nbytes()
        return t

    x = torch.randint(0, SMALL.vocab_size, (batch, SMALL.max_seq_len))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast("cpu", torch.bfloat16, enabled=bf16):
            model(x, x, reduction="sum", loss_fn=ChunkedLoss())  # the CPU run's loss: no logits kept
    return sum(storages.values())


# The recipe's options (model/model.py) bar logit_softcap, which the loss applies (no activation).
RECIPE = {"mlp": "relu2", "qk_norm": True, "value_embeds": True, "zero_init": True}


@pytest.mark.parametrize("options", [{"mlp": "swiglu"}, {"mlp": "gelu"}, RECIPE],
                         ids=["swiglu", "gelu", "recipe"])
@pytest.mark.parametrize("bf16", [False, True])
def test_activation_estimate_within_25_percent(options, bf16):
    cfg = ModelConfig(**{**SMALL.to_dict(), **options})
    model = GPT(cfg)
    measured = saved_for_backward(model, 4, bf16) - saved_for_backward(model, 2, bf16)
    estimate = activation_bytes(cfg, 2, cfg.max_seq_len, bf16, checkpointing=False)
    assert abs(estimate / measured - 1) < 0.25, (estimate, measured)


def test_head_loss_bytes_follow_the_loss_a_gpu_run_resolves():
    """full: the logits in the compute dtype, their fp32 copy and log-probabilities; chunked: two
    fp32 chunk x V buffers (chunks within CUDA's CHUNK_ELEMS) and the head's fp32 gradient."""
    from lmforge.pipeline.config import DataConfig, JobConfig, TrainConfig

    model = meta_gpt(SMALL)
    V, D = SMALL.padded_vocab_size, SMALL.d_model
    assert head_loss_bytes(model, 512, "full", bf16=True) == 512 * V * (2 + 8)
    assert head_loss_bytes(model, 512, "full", bf16=False) == 512 * V * (4 + 8)
    assert head_loss_bytes(model, 512, "chunked", bf16=True) == 8 * 512 * V + 4 * V * D
    many = 4 * CHUNK_ELEMS["cuda"] // V  # four chunks' worth: only one chunk is held
    assert head_loss_bytes(model, many, "chunked", bf16=True) == 8 * (many // 4) * V + 4 * V * D
    cfg = JobConfig(data=DataConfig(seq_len=64), train=TrainConfig(micro_batch_size=8))
    assert planned_loss(cfg, SMALL) == "full"  # auto, as on a GPU
    assert planned_loss(replace(cfg, train=replace(cfg.train, loss="chunked")), SMALL) == "chunked"
    # 2^15 x 64 tokens x 1,024 columns: 2^31 logits, past what auto keeps whole on a GPU.
    huge_batch = replace(cfg, train=replace(cfg.train, micro_batch_size=2**15))
    assert planned_loss(huge_batch, SMALL) == "chunked"


def test_dry_run_plans_without_starting_anything():
    res = run([sys.executable, "-m", "lmforge.launch.cli", "train", "--nproc", "8", "--nnodes", "4",
               "--config", "configs/llama_350m.toml", "--dry-run", "--gpu", "H100",
               "--train.micro_batch_size", "8"], timeout=120)
    assert res.returncode == 0, res.stdout[-3000:]
    assert "4 node(s) x 8 H100 SXM = 32 GPUs" in res.stdout
    assert "FSDP2" in res.stdout and "s/step" in res.stdout
    assert "LM-head loss (full)" in res.stdout  # train.loss = auto, resolved for the GPUs
    bad = run([sys.executable, "-m", "lmforge.launch.cli", "train", "--config", "configs/tiny.toml",
               "--dry-run", "--gpu", "Z80"], timeout=120)
    assert bad.returncode == 2 and "error: --gpu: unknown GPU 'Z80'" in bad.stdout


def test_fsdp_muon_traffic_is_every_muon_matrix_there_and_back():
    """FSDP2 + Muon: each matrix Muon owns is gathered whole (fp32) and scattered back per step;
    nothing extra for AdamW, DDP (every rank has whole matrices) or one process."""
    from lmforge.pipeline.config import JobConfig, OptimConfig
    from lmforge.pipeline.optim.optimizers import build_optimizer
    from lmforge.pipeline.parallel.plan import strategies

    cfg = JobConfig(optim=OptimConfig(name="muon"))
    model = meta_gpt(SMALL)
    _, muon = build_optimizer(model, cfg.optim, torch.device("cpu"))
    matrices = sum(p.numel() for g in muon.param_groups for p in g["params"])
    ddp, fsdp = strategies(cfg, model, 2, bf16=False)
    assert fsdp.muon == 2 * 4 * matrices and ddp.muon == 0
    assert strategies(cfg, model, 1, bf16=False)[1].muon == 0
    adamw = JobConfig(optim=OptimConfig(name="adamw"))
    assert strategies(adamw, model, 2, bf16=False)[1].muon == 0


def _fsdp_probe() -> None:
    """Under torchrun: shard SMALL with FSDP2 on gloo, one AdamW step, print this rank's bytes
    (inside the pipeline's process-group lifetime, which frees the model before the group)."""
    from lmforge.pipeline.parallel.distributed import distributed

    with distributed("cpu") as info:
        _print_rank_bytes(info.rank)


def _print_rank_bytes(rank: int) -> None:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = GPT(SMALL)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    # One write per line: print writes the text and its newline apart (unbuffered, as under
    # PYTHONUNBUFFERED), so the two ranks' lines could interleave.
    sys.stdout.write("PLAN " + json.dumps({"rank": rank, "real": real_state_bytes(model)}) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    _fsdp_probe()
