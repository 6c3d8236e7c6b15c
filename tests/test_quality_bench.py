"""bench/quality.py's pieces that decide its figures: which text is the judging corpus, and that its
one scorer gives the model's own loss over the same val windows."""

from __future__ import annotations

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


@pytest.mark.parametrize("args, words", [
    (["--fortunes", "{tmp}/none"], "apt-get install -y fortunes"),
    (["--recipes", "tiny", "wd=configs/tiny"], "NAME=CONFIG.toml"),
    (["--recipes", "modern"], "--baseline tiny is not among --recipes"),
])
def test_bad_input_is_one_error_line_before_any_work(tmp_path, capsys, args, words):
    with pytest.raises(SystemExit) as exit_:
        quality.main([a.format(tmp=tmp_path) for a in args] + ["--work", str(tmp_path / "w")])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.startswith("error: ") and words in err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "w").exists()
