"""model.logit_softcap through the pipeline: training with each train.loss (the chunked loss
eager, the full logits compiled), `lmforge eval` reproducing the val loss training logged, and
the chunked loss against the model's reference loss on the trained weights."""

from __future__ import annotations

import json

import pytest
import torch

from lmforge.launch.cli import main as lmforge
from lmforge.model.model import cross_entropy
from lmforge.pipeline.data.loader import TokenWindows
from lmforge.pipeline.evaluate import eval_batches
from lmforge.pipeline.inference import load_for_inference
from lmforge.pipeline.loss import ChunkedLoss
from tests.harness import metrics, run_args, train

CAP = 4.0
EVAL_TOKENS = 512  # tests.harness.TINY_ARGS' eval.tokens


@pytest.mark.parametrize("loss, compile", [("chunked", "off"), ("full", "on")])
def test_softcap_trains_and_evals_as_the_reference(tiny_data, tmp_path, loss, compile):
    out = tmp_path / "run"
    train(run_args(tiny_data, out, "--train.max_steps", "6", "--model.logit_softcap", str(CAP),
                   "--train.loss", loss, "--train.compile", compile, "--eval.every", "6"))
    records = metrics(out)
    assert records[-1]["step"] == 6 and records[-1]["loss"] < records[0]["loss"]
    logged = records[-1]["val_loss"]
    report = tmp_path / "eval.json"
    assert lmforge(["eval", "--ckpt", str(out), "--data", str(tiny_data),
                    "--max-tokens", str(EVAL_TOKENS), "--json", str(report)]) == 0
    assert json.loads(report.read_text())["loss"] == pytest.approx(logged, rel=1e-5)
    ckpt = load_for_inference(out)
    assert ckpt.config.logit_softcap == CAP
    x_BT, y_BT = eval_batches(TokenWindows(tiny_data, "val", 64, None), 4, 0, 1, 256)[0]
    with torch.no_grad():
        h_BTD = ckpt.model.hidden(x_BT)
        w_VD, V = ckpt.model.lm_head.weight, ckpt.config.vocab_size
        ref = cross_entropy(h_BTD, w_VD, y_BT, V, softcap=CAP)
        uncapped = cross_entropy(h_BTD, w_VD, y_BT, V)
        chunked = ChunkedLoss(chunk=64)(h_BTD, w_VD, y_BT, V, softcap=CAP)
    assert abs(chunked.item() - ref.item()) < 1e-5 and abs(ref.item() - uncapped.item()) > 1e-3
