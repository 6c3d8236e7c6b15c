"""Meta-device build + FSDP2 sharding + materialize: the initial weights are those of one process,
bit for bit, on 2 gloo ranks (this file, run under torchrun, is the probe), while each rank holds
only its shards; the tie of embedding and LM head survives."""

from __future__ import annotations

import sys

import torch

from lmforge.model import ModelConfig
from lmforge.pipeline.parallel.distributed import DistInfo, distributed
from lmforge.pipeline.parallel.materialize import meta_gpt
from lmforge.pipeline.parallel.parallelize import Precision, parallelize
from tests.harness import ROOT, run

CFG = ModelConfig(vocab_size=1000, n_layer=3, n_head=4, n_kv_head=2, d_model=96, max_seq_len=64)
SEED = 1234


def build(parallel: str, info: DistInfo):
    precision = Precision(torch.float32, info.device)
    return parallelize(meta_gpt(CFG), info, parallel=parallel, precision=precision,
                       compile_model=False, activation_checkpointing=False, init_seed=SEED).module


def test_fsdp_two_ranks_start_from_one_process_weights(tmp_path):
    out = tmp_path / "fsdp_state.pt"
    res = run([sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc_per_node=2", str(ROOT / "tests" / "test_materialize.py"), str(out)],
              timeout=180)
    assert res.returncode == 0, res.stdout[-3000:]
    one = build("none", DistInfo(0, 0, 1, torch.device("cpu")))
    assert one.lm_head.weight is one.tok_emb.weight
    sharded = torch.load(out, weights_only=True)
    assert sharded.pop("local_numel") < 0.6 * one.num_params()  # each rank: about half
    whole = one.state_dict()
    assert sorted(sharded) == sorted(whole)
    differ = [k for k, v in whole.items() if not torch.equal(sharded[k], v)]
    assert not differ, differ


def _write_shards(info: DistInfo, out: str) -> None:
    from lmforge.pipeline.checkpoint.format import full_model_state

    model = build("fsdp", info)
    assert model.lm_head.weight is model.tok_emb.weight
    local_numel = sum(p.to_local().numel() for p in model.parameters())
    state = full_model_state(model)
    if info.rank == 0:
        torch.save({**state, "local_numel": local_numel}, out)


def _probe(out: str) -> None:
    # The pipeline's own process-group lifetime: every rank waits for the others and the model
    # is freed (it lives in _write_shards) before the group is destroyed. A rank tearing gloo
    # down while rank 0 still wrote the file was seen to abort ("terminate called without an
    # active exception").
    with distributed("cpu") as info:
        _write_shards(info, out)


if __name__ == "__main__":
    _probe(sys.argv[1])
