"""The sharded path's memory promise, at the CLI: each FSDP2 rank of a 2-rank run peaks below one
process training the same model by at least one fp32 copy of the model (both once
peaked at the same RSS). A ratio within one test, not a figure: bench/fsdp_memory.py has those."""

from __future__ import annotations

import re

from tests.harness import run_args, train

# d_model 768, 4 layers: ~25M parameters, 16 bytes each in training (fp32 weights, gradients,
# AdamW's two moments); sharded over 2 ranks, each holds half of that.
SHAPE = ["--model.d_model", "768", "--model.n_layer", "4", "--model.n_head", "12",
         "--model.n_kv_head", "4", "--model.max_seq_len", "64", "--data.seq_len", "64",
         "--train.dtype", "fp32", "--train.global_batch_tokens", "512",
         "--train.micro_batch_size", "4", "--train.max_steps", "2", "--eval.every", "0",
         "--checkpoint.every", "0", "--eval.tasks", '["nextline"]', "--eval.tasks_max_examples", "8"]


def peaks(res) -> list[float]:
    return [float(mb) for mb in re.findall(r"^peak_rss_mb \d+ (\d+)$", res.stdout, re.M)]


def test_each_fsdp_rank_peaks_a_model_copy_below_one_process(tiny_data, tmp_path):
    one = train(run_args(tiny_data, tmp_path / "one", *SHAPE), module="tests.peak_rss_train",
                timeout=1800)
    two = train(run_args(tiny_data, tmp_path / "two", *SHAPE, "--train.parallel", "fsdp"), nproc=2,
                module="tests.peak_rss_train", timeout=1800)
    n_params = float(re.search(r"GPT ([\d.]+)M params", one.stdout)[1]) * 1e6
    (single,), ranks = peaks(one), peaks(two)
    assert len(ranks) == 2, two.stdout[-3000:]
    model_mb = 4 * n_params / 2**20
    assert max(ranks) <= single - model_mb, (single, ranks, model_mb)
