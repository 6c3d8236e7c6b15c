"""bench/quality.py's pieces that decide its figures: which text is the judging corpus, and that its
one scorer gives the model's own loss over the same val windows."""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from bench import quality
from lmforge.data_prep.shards import load_manifest
from lmforge.model import GPT, ModelConfig
from lmforge.model.model import IGNORE_INDEX
from lmforge.pipeline.data.windows import TokenWindows
from lmforge.pipeline.evaluate import eval_batches


def test_each_fortune_of_the_text_files_is_a_document(tmp_path):
    (tmp_path / "art").write_text("%\nOne.\n%\nTwo,\n  two lines.\n%\n")
    (tmp_path / "tao").write_text("Three.\r\n%\r\nFour.")
    (tmp_path / "art.dat").write_bytes(b"\x00\x00\x00\x02binary index")
    (tmp_path / "art.u8").symlink_to("art")
    (tmp_path / "latin1").write_bytes("Caf\xe9.\n%\n".encode("latin-1"))  # not UTF-8: not text
    (tmp_path / "off").mkdir()
    (tmp_path / "off" / "rude").write_text("Offensive.\n%\n")
    assert quality.fortunes_docs(tmp_path) == ["One.", "Two,\n  two lines.", "Three.", "Four."]


def test_each_text_file_of_the_kernel_docs_is_a_document(tmp_path):
    (tmp_path / "mm").mkdir()
    (tmp_path / "mm" / "concepts.rst.gz").write_bytes(gzip.compress(b"Concepts\r\n========\r\n"))
    (tmp_path / "README.txt").write_text("Plain.\n")
    (tmp_path / "index.rst").write_text("  \n")  # blank: no document
    for skipped in ("translations/it_IT/index.rst", "devicetree/bindings/clk.txt", "sphinx/x.py.gz",
                    "svg/logo.svg.gz"):
        (tmp_path / skipped).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / skipped).write_bytes(gzip.compress(b"not prose"))
    assert quality.kerneldoc_docs(tmp_path) == ["Plain.\n", "Concepts\n========\n"]


def test_the_scorer_gives_the_models_own_loss_on_eval_windows(tiny_data):
    torch.manual_seed(0)
    vocab = load_manifest(tiny_data).vocab_size
    model = GPT(ModelConfig(vocab_size=vocab, n_layer=1, n_head=2, n_kv_head=2, d_model=64,
                            max_seq_len=quality.SEQ)).eval()
    tokens = 700  # not a multiple of 256: the last window is padded, its padding not scored
    with torch.no_grad():
        batches = eval_batches(TokenWindows(tiny_data, "val", quality.SEQ, None), 8, 0, 1, tokens)
        own = sum(model(x, y, reduction="sum").item() for x, y in batches)
        assert sum(int((y != IGNORE_INDEX).sum()) for _, y in batches) == tokens
    assert abs(quality.score(model, tiny_data, tokens) - own / tokens) < 1e-5


def test_report_tables_the_ledger_and_trains_nothing(tmp_path):
    ledger, out = tmp_path / "runs.jsonl", tmp_path / "table.txt"
    wd = "wd=configs/tiny.toml:--optim.weight_decay 0.1"  # a recipe's key is its whole spec
    runs = [("tiny", "fortunes", 1, 4.5), ("tiny", "fortunes", 2, 4.7), (wd, "fortunes", 1, 4.4),
            ("nanochat", "pystdlib", 1, 3.9), ("tiny", "pystdlib", 1, 4.0)]
    ledger.write_text("".join(json.dumps({"spec": s, "corpus": c, "steps": 200, "seed": n,
                                          "tokens": 65536, "loss": x}) + "\n" for s, c, n, x in runs))
    quality.main(["--report", "--ledger", str(ledger), "--out", str(out), "--work",
                  str(tmp_path / "w"), "--fortunes", str(tmp_path / "none"), "--recipes", "tiny",
                  wd, "nanochat"])
    rows = {line.split()[0]: line.split() for line in out.read_text().splitlines()[3:]}
    assert rows["tiny"][1:9] == ["4.0000", "+-", "0.0000", "(1)", "+0.0000",
                                 "4.6000", "+-", "0.1414"]
    assert rows["wd"][1:7] == ["-", "-", "4.4000", "+-", "0.0000", "(1)"]
    assert rows["wd"][7] == "-0.2000" and rows["nanochat"][5] == "-0.1000"
    quality.main(["--report", "--ledger", str(ledger), "--out", str(out), "--work",
                  str(tmp_path / "w"), "--corpora", "fortunes", "--recipes", "tiny"])
    head, tiny = out.read_text().splitlines()[2:4]  # --corpora picks the columns
    assert head.split()[1] == "fortunes" and "pystdlib" not in head
    assert tiny.split()[1:6] == ["4.6000", "+-", "0.1414", "(2)", "+0.0000"]
    assert not (tmp_path / "w").exists()


@pytest.mark.parametrize("args, words", [
    (["--fortunes", "{tmp}/none"], "apt-get install -y fortunes"),
    (["--corpora", "kerneldoc", "--kerneldoc", "{tmp}/none"], "apt-get install -y linux-doc-6.1"),
    (["--recipes", "tiny", "wd=configs/tiny"], "NAME=CONFIG.toml"),
    (["--recipes", "modern"], "--baseline tiny is not among --recipes"),
])
def test_bad_input_is_one_error_line_before_any_work(tmp_path, capsys, args, words):
    with pytest.raises(SystemExit) as exit_:
        quality.main([a.format(tmp=tmp_path) for a in args] + ["--work", str(tmp_path / "w")])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.startswith("error: ") and words in err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "w").exists()


def test_a_killed_bench_takes_its_training_run_with_it(tmp_path):
    """`kill` of a bench left its training child running (two orphans shared the cores with the
    next runs): the child is killed with it."""
    pid_file = tmp_path / "pid"
    run = (f"import os, pathlib, time; pathlib.Path({str(pid_file)!r}).write_text(str(os.getpid()));"
           " time.sleep(120)")
    bench = subprocess.Popen([sys.executable, "-c", "import sys; from bench import quality; "
                              "quality.exit_on_sigterm(); "
                              "quality.child([sys.executable, '-c', sys.argv[1]], 120, 'run')", run],
                             cwd=quality.ROOT)
    deadline = time.time() + 60
    while not (pid_file.exists() and pid_file.read_text()) and time.time() < deadline:
        time.sleep(0.1)
    pid = int(pid_file.read_text())
    try:
        bench.send_signal(signal.SIGTERM)
        assert bench.wait(timeout=30) == 128 + signal.SIGTERM
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
