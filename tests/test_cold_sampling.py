"""Ever colder sampling ends in greedy decoding, never in a NaN: a temperature below fp32's
smallest normal number is greedy (said on stderr), and a small one above it divides logits that
were first shifted to a maximum of 0. `lmforge sample` also says which dtype it computed in."""

from __future__ import annotations

import pytest
import torch

from launch.cli import main as lmforge
from model import SamplingParams
from model.generate import MIN_TEMPERATURE, sample
from tests.test_eval_sample_export import make_checkpoint


@pytest.mark.parametrize("temperature", [1e-45, 1e-37, 1e-6])
def test_cold_sampling_draws_the_most_likely_token(temperature):
    # A gap of 1e4 / 1e-37 overflowed fp32: softmax(inf, ...) is NaN and multinomial refused it.
    logits_BV = torch.tensor([[0.0, 1e4, -3e4, 5.0], [2.0, -1.0, 0.5, 1.5]])
    sampling = SamplingParams(max_new_tokens=1, temperature=temperature, top_k=0)
    for seed in range(5):
        draws = sample(logits_BV, sampling, torch.Generator().manual_seed(seed))
        assert draws.tolist() == [1, 0]
    assert sampling.greedy == (temperature < MIN_TEMPERATURE)


def test_sample_at_a_temperature_below_the_floor_is_greedy_and_says_so(tiny_data, tmp_path,
                                                                       capsys):
    ckpt = str(make_checkpoint(tmp_path / "final", tiny_data))
    outs = []
    for temperature in ("0", "1e-45"):
        rc = lmforge(["sample", "--ckpt", ckpt, "--prompt", "def ", "--max-new-tokens", "12",
                      "--temperature", temperature, "--seed", "3", "--dtype", "fp32"])
        captured = capsys.readouterr()
        assert rc == 0, captured.err
        outs.append(captured.out)
        assert "note: computing in fp32 on cpu (--dtype fp32)" in captured.err
    assert outs[0] == outs[1]
    assert "note: --temperature 1e-45 is below 1.18e-38: sampling greedily" in captured.err
