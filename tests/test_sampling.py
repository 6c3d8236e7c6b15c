"""The sampling rules: what the sampler draws (temperature, top-k then top-p, against references;
ever colder sampling ends in greedy decoding, never in a NaN), and bad sampling settings refused
before any work, by `lmforge train` and `lmforge sample`."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from lmforge.data_prep.tokenizer import encode_prompt, load_tokenizer_dir
from lmforge.launch.cli import main as lmforge
from lmforge.model import SamplingParams
from lmforge.model.generate import MIN_TEMPERATURE, sample
from lmforge.pipeline.config import ConfigError, load_config
from lmforge.pipeline.parallel.distributed import DistInfo
from lmforge.pipeline.train import Trainer
from tests.harness import TINY_ARGS, metrics, run, run_config
from tests.test_eval_sample_export import make_checkpoint

CPU = DistInfo(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))

# --------------------------------------------------------------------------------------------
# What the sampler draws

DRAWS = 20_000
# Frequencies of 20k draws are within 0.0036 (one sd at p = 0.5) of the probabilities; 0.015 is
# over 4 sd, and the seeds are fixed, so these tests do not flake. The bugs they exist for (a
# temperature that multiplies, top-p before top-k) move some probability by more than 0.2.
FREQ_TOL = 0.015


def frequencies(logits_V: torch.Tensor, sampling: SamplingParams, seed: int = 0) -> torch.Tensor:
    """How often each token is drawn by the real sampler, one row per draw."""
    g = torch.Generator().manual_seed(seed)
    draws = sample(logits_V.repeat(DRAWS, 1), sampling, g)
    return torch.bincount(draws, minlength=logits_V.numel()).double() / DRAWS


def reference_probs(logits_V: torch.Tensor, temperature: float, top_k: int, top_p: float,
                    top_p_first: bool = False) -> torch.Tensor:
    """The transformers order, written out on sorted Python floats: logits / temperature, keep
    the top_k, renormalise, keep the fewest tokens whose mass reaches top_p, renormalise.
    top_p_first=True is the wrong order, to show these logits can tell the two apart."""
    probs = (logits_V.double() / temperature).softmax(-1).tolist()
    ranked = sorted(range(len(probs)), key=lambda i: -probs[i])

    def top_k_of(ids):
        return ids[:top_k]

    def nucleus_of(ids):
        total = sum(probs[i] for i in ids)
        kept, mass = [], 0.0
        for i in ids:
            if mass >= top_p:
                break
            kept.append(i)
            mass += probs[i] / total
        return kept

    kept = top_k_of(nucleus_of(ranked)) if top_p_first else nucleus_of(top_k_of(ranked))
    out = torch.zeros(len(probs), dtype=torch.float64)
    out[kept] = torch.tensor([probs[i] for i in kept], dtype=torch.float64)
    return out / out.sum()


LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
# p = [.3, .25, .2, .15, .1]. Top-3 renormalised is [.4, .33, .27]: top_p = .7 keeps two tokens.
# Top-p first on the full distribution keeps three (.3 + .25 < .7), which top-3 then keeps too.
NUCLEUS_LOGITS = torch.tensor([0.3, 0.25, 0.2, 0.15, 0.1]).log()


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_temperature_divides_the_logits(temperature):
    sampling = SamplingParams(max_new_tokens=1, temperature=temperature, top_k=0)
    freq = frequencies(LOGITS, sampling)
    expected = (LOGITS.double() / temperature).softmax(-1)
    assert (freq - expected).abs().max() < FREQ_TOL, (freq, expected)
    multiplied = (LOGITS.double() * temperature).softmax(-1)
    assert (expected - multiplied).abs().max() > 10 * FREQ_TOL  # the test can see that bug


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_top_k_then_top_p_in_transformers_order(temperature):
    sampling = SamplingParams(max_new_tokens=1, temperature=temperature, top_k=3, top_p=0.7)
    expected = reference_probs(NUCLEUS_LOGITS, temperature, 3, 0.7)
    wrong = reference_probs(NUCLEUS_LOGITS, temperature, 3, 0.7, top_p_first=True)
    assert (expected > 0).sum() == 2 and (wrong > 0).sum() == 3  # the order matters here
    freq = frequencies(NUCLEUS_LOGITS, sampling, seed=1)
    assert torch.equal(freq > 0, expected > 0), (freq, expected)
    assert (freq - expected).abs().max() < FREQ_TOL, (freq, expected)


def test_reference_matches_transformers_warpers():
    """The reference above against transformers' own warpers, applied in generate()'s order."""
    gen = pytest.importorskip("transformers.generation.logits_process")
    torch.manual_seed(0)
    cases = [(NUCLEUS_LOGITS, 1.0, 3, 0.7), (NUCLEUS_LOGITS, 0.7, 3, 0.7), (LOGITS, 2.0, 4, 0.9)]
    cases += [(torch.randn(50) * 2, t, k, p) for t, k, p in [(0.8, 20, 0.6), (1.3, 40, 0.95)]]
    for logits, temperature, top_k, top_p in cases:
        scores = logits[None].double()
        for warper in (gen.TemperatureLogitsWarper(temperature), gen.TopKLogitsWarper(top_k),
                       gen.TopPLogitsWarper(top_p)):
            scores = warper(None, scores)
        theirs = scores.softmax(-1)[0]
        ours = reference_probs(logits, temperature, top_k, top_p)
        assert torch.allclose(ours, theirs, atol=1e-9), (logits, temperature, top_k, top_p)


# --------------------------------------------------------------------------------------------
# lmforge train: bad sample settings stop the run before step 1


def cfg_for(data, out, *extra):
    return run_config(data, out, *extra)


def prompt_of(data, n_tokens: int) -> str:
    """Text that encodes to exactly n_tokens, the leading end-of-text token included."""
    text = "\x00" * (n_tokens - 1)  # a byte the BPE never merged: one token each
    assert len(encode_prompt(load_tokenizer_dir(data / "tokenizer"), text)) == n_tokens
    return text


def test_prompt_too_long_for_the_model_fails_before_step_1(tiny_data, tmp_path):
    """A prompt of max_seq_len tokens leaves no room to generate. It used to crash the last step
    (before the final checkpoint); now `lmforge train` refuses it up front in one line."""
    run_dir = tmp_path / "r"
    prompts = json.dumps(["def ", prompt_of(tiny_data, 128)])  # TINY_ARGS: max_seq_len 128
    res = run([sys.executable, "-m", "lmforge.launch.cli", "train", "--data.path", str(tiny_data),
               "--log.out_dir", str(run_dir), *TINY_ARGS, "--train.max_steps", "3",
               "--sample.prompts", prompts], timeout=180)
    assert res.returncode == 2, res.stdout[-3000:]
    errors = [ln for ln in res.stdout.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in res.stdout, res.stdout[-3000:]
    assert "sample.prompts[1]" in errors[0] and "model.max_seq_len" in errors[0]
    assert not (run_dir / "metrics.jsonl").exists() and not (run_dir / "checkpoints").exists()

    def trainer_with_prompt_of(n_tokens: int) -> Trainer:
        prompts = json.dumps([prompt_of(tiny_data, n_tokens)])
        return Trainer(cfg_for(tiny_data, tmp_path / str(n_tokens), "--sample.prompts", prompts), CPU)

    trainer_with_prompt_of(127)  # room for one new token: accepted
    with pytest.raises(ConfigError, match=r"sample\.prompts\[0\] .* no room"):
        trainer_with_prompt_of(128)


def test_empty_prompt_list_means_no_samples(tiny_data, tmp_path):
    """`sample.prompts = []` used to crash the last step (max() of nothing) before the final
    checkpoint. It now means what a user writing it expects: no samples; the run completes."""
    run_dir = tmp_path / "r"
    Trainer(cfg_for(tiny_data, run_dir, "--train.max_steps", "3", "--sample.every", "2",
                    "--sample.prompts", "[]"), CPU).fit()
    recs = metrics(run_dir)
    assert [r["step"] for r in recs] == [1, 2, 3]
    assert not any(r.get("samples") for r in recs)
    assert (run_dir / "final").is_dir()


@pytest.mark.parametrize("key, value", [
    ("temperature", "nan"), ("temperature", "-1"), ("temperature", "inf"),
    ("top_k", "-1"), ("top_p", "0"), ("top_p", "1.5"), ("top_p", "nan"),
    ("max_new_tokens", "0"), ("max_new_tokens", "-5"),
])
def test_config_sampling_numbers_checked(key, value):
    with pytest.raises(ConfigError, match=rf"^bad value for 'sample\.{key}': .*\(expected "):
        load_config(None, [f"--sample.{key}", value])


# --------------------------------------------------------------------------------------------
# lmforge sample: every numeric option checked before any work


@pytest.mark.parametrize("option, value", [
    ("--temperature", "nan"), ("--temperature", "-1"), ("--temperature", "inf"),
    ("--top-k", "-1"),
    ("--top-p", "0"), ("--top-p", "1.5"), ("--top-p", "nan"),
    ("--max-new-tokens", "0"), ("--max-new-tokens", "-5"),
    ("--num-samples", "0"),
    ("--seed", "-1"), ("--seed", str(2**64)),
])
def test_sample_options_refused_before_any_work(option, value, tmp_path, capsys):
    # The checkpoint does not exist: an error about it would mean the option was checked late.
    rc = lmforge(["sample", "--ckpt", str(tmp_path / "nope"), "--prompt", "x", option, value])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert err[0].startswith("error: ") and option in err[0], err


# ---- ever colder sampling: greedy below fp32's smallest normal, never NaN -------------------------


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
