"""A dataset is input, not lmforge's own: every file `prepare --verify`, `inspect`, the trainer's
loader, `eval` and `sample` open in a dataset or its tokenizer directory goes through
data_prep/safe_files.py (tests/test_safe_files.py holds the rule itself), and every figure read
from one is held against its neighbours (manifest <-> tokenizer <-> shards) before it sizes
anything. Each case runs `lmforge` on real files, as a subprocess under a timeout where a FIFO or
/dev/zero could hang it; each refusal is one `error:` line, exit 2, with nothing outside the
dataset read or written."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from lmforge.data_prep import shards as S
from tests.errors import last_error, one_error_line, proc_error
from tests.file_kinds import files_under, plant
from tests.harness import ROOT, TINY_ARGS, env
from tests.test_eval_sample_export import make_checkpoint
from tests.test_prepare_bad_input import byte_vocab

TIMEOUT = 60  # a FIFO read blocks forever, /dev/zero never ends: each command is cut off here


def lmforge(*args: str, timeout: float = TIMEOUT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lmforge.launch.cli", *args], cwd=ROOT, env=env(),
                          capture_output=True, text=True, timeout=timeout)


def texts(n: int) -> list[str]:
    return [f"document {i}: " + "the quick brown fox jumps over the lazy dog " * (1 + i % 3)
            for i in range(n)]


def prepare_dir(root: Path, vocab: Path, docs: list[str], *args: str) -> Path:
    (root / "src").mkdir(parents=True)
    for i, text in enumerate(docs):
        (root / "src" / f"d{i:03d}.txt").write_text(text)
    proc = lmforge("prepare", "--source", str(root / "src"), "--tokenizer", str(vocab), "--out",
                   str(root / "data"), "--quiet", *args)
    assert proc.returncode == 0, proc.stderr
    return root / "data"


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    """One train shard and its index, val shards, manifest.json and tokenizer/ (a byte vocab)."""
    root = tmp_path_factory.mktemp("dataset")
    return prepare_dir(root, byte_vocab(root / "bytes.tiktoken"), texts(40), "--val-fraction", "0.2")


def holed_vocab(path: Path) -> Path:
    """The 256 bytes at ranks 0-255, ten merges at ranks 300-309 (ids 256-299 belong to no token,
    as cl100k leaves ids unused), <|endoftext|> = 310 (inferred): 311 ids, 267 of them tokens."""
    merges = [b"th", b"he", b"e ", b" t", b"qu", b"ck", b"ow", b"ox", b"og", b"um"]
    return byte_vocab(path, {m: 300 + i for i, m in enumerate(merges)})


@pytest.fixture(scope="module")
def holed(tmp_path_factory) -> tuple[Path, Path]:
    """(dataset, checkpoint of a random model for it) with the holed vocabulary."""
    root = tmp_path_factory.mktemp("holed")
    data = prepare_dir(root, holed_vocab(root / "holed.tiktoken"), texts(40), "--val-fraction",
                       "0.3")
    return data, make_checkpoint(root / "final", data)


def copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, symlinks=True)
    return dst


# --------------------------------------------------------------------------------------------
# every file kind, for every file of a dataset

FILES = ["train_000000.bin", "train_000000.idx", "manifest.json", "tokenizer/vocab.tiktoken",
         "tokenizer/tokenizer.json"]
KINDS = ["link_to_file", "link_to_dir", "fifo", "dir", "link_to_dev_zero"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", FILES)
def test_every_file_kind_in_a_dataset_is_refused_in_one_line(dataset, tmp_path, name, kind):
    data, outside = copy(dataset, tmp_path / "data"), tmp_path / "outside"
    plant(data / name, kind, outside)
    before = files_under(outside)
    # prepare --verify reads the manifest, every shard and index; inspect the tokenizer too.
    command = ["inspect", str(data)] if name.startswith("tokenizer/") else ["prepare", "--verify",
                                                                           str(data)]
    line = proc_error(lmforge(*command))
    assert Path(name).name in line and "Traceback" not in line
    assert files_under(outside) == before


@pytest.mark.parametrize("kind", ["fifo", "link_to_dev_zero", "dir"])
def test_the_trainers_loader_refuses_a_special_document_index(dataset, tmp_path, kind):
    """Through the loader's own path (inspect --rows is the trainer's loader)."""
    data, outside = copy(dataset, tmp_path / "data"), tmp_path / "outside"
    plant(data / "train_000000.idx", kind, outside)
    proc_error(lmforge("inspect", str(data), "--rows", "2", "--seq-len", "8", "--align", "doc"),
               "train_000000.idx", "is a")


@pytest.mark.parametrize("kind", ["hard link", "symbolic link"])
def test_a_link_at_an_output_temp_name_is_never_written_through(dataset, tmp_path, kind):
    """A prepare resumed after its kill writes manifest.json via .manifest.json.tmp: a link
    planted there must not carry the write to the file it names."""
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    root = tmp_path / "p"
    argv = ["--tokenizer", str(byte_vocab(tmp_path / "b.tiktoken")), "--val-fraction", "0"]
    data = prepare_dir(root, tmp_path / "b.tiktoken", texts(5), *argv[2:])
    (data / S.MANIFEST_NAME).unlink()  # as if killed before its last write
    tmp = data / f".{S.MANIFEST_NAME}.tmp"
    os.link(victim, tmp) if kind == "hard link" else tmp.symlink_to(victim)
    proc = lmforge("prepare", "--source", str(root / "src"), "--out", str(data), "--quiet", *argv)
    proc_error(proc, ".manifest.json.tmp")
    assert victim.read_text() == "precious"


# --------------------------------------------------------------------------------------------
# the tokenizer held against the manifest, ids without tokens, a pattern that panics tiktoken


def craft_rank(data: Path, n_vocab: int | None) -> None:
    """One more token at rank 2**32 - 3 in vocab.tiktoken, tokenizer.json's and the manifest's
    sha256 made to match (and its n_vocab set to `n_vocab` where given): a 5 KB file declaring
    4 billion ids, beside a manifest and shards of 257."""
    tok_dir = data / "tokenizer"
    vocab = tok_dir / "vocab.tiktoken"
    vocab.write_bytes(vocab.read_bytes() + base64.b64encode(b"zz") + b" 4294967293\n")
    meta = json.loads((tok_dir / "tokenizer.json").read_text())
    meta["sha256"] = hashlib.sha256(vocab.read_bytes()).hexdigest()
    if n_vocab is not None:
        meta["n_vocab"] = meta["vocab_size"] = n_vocab
    (tok_dir / "tokenizer.json").write_text(json.dumps(meta))
    edit_manifest(data, lambda d: d["tokenizer"].update(sha256=meta["sha256"]))


@pytest.mark.parametrize("n_vocab", [None, 2**32 - 2])
def test_a_tokenizer_rank_beyond_the_manifest_is_refused_before_any_allocation(dataset, tmp_path,
                                                                              n_vocab):
    data = copy(dataset, tmp_path / "data")
    craft_rank(data, n_vocab)
    proc_error(lmforge("inspect", str(data)), "tokenizer")


def test_train_refuses_a_tokenizer_rank_beyond_the_manifest(dataset, tmp_path):
    data = copy(dataset, tmp_path / "data")
    craft_rank(data, 2**32 - 2)
    proc = subprocess.run([sys.executable, "-m", "lmforge.launch.cli", "train", "--data.path", str(data),
                           "--log.out_dir", str(tmp_path / "run"), *TINY_ARGS,
                           "--data.seq_len", "8", "--train.max_steps", "1"],
                          cwd=ROOT, env=env(), capture_output=True, text=True, timeout=120)
    last_error(proc, "tokenizer", "4294967294")


def test_prepare_refuses_a_tiktoken_file_with_a_rank_beyond_its_tokens(tmp_path):
    vocab = byte_vocab(tmp_path / "v.tiktoken", {b"zz": 2**32 - 3})
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.txt").write_text("some text")
    proc_error(lmforge("prepare", "--source", str(tmp_path / "src"), "--tokenizer", str(vocab),
                       "--out", str(tmp_path / "out"), "--quiet"), "only 258 tokens")
    assert not (tmp_path / "out").exists()


def test_sample_decodes_ids_without_bytes_as_replacement_characters(holed, capsys):
    """A random model draws unused ids (44 of 311) often; each prints as U+FFFD."""
    from lmforge.launch.cli import main

    _, ckpt = holed
    rc = main(["sample", "--ckpt", str(ckpt), "--prompt", "the ", "--max-new-tokens", "40",
               "--temperature", "1", "--top-k", "0", "--seed", "0", "--num-samples", "2"])
    out = capsys.readouterr().out
    assert rc == 0 and "\ufffd" in out and out.startswith("--- sample 1/2 ---\nthe ")


@pytest.mark.parametrize("pattern", ["", "(?=a)|\\s", "(?:a|a)*(?!x)b|\\S|\\s"])
def test_a_tokenizer_pattern_that_panics_tiktoken_is_one_line(holed, tmp_path, pattern):
    """A pattern matching the empty string or backtracking without bound panics tiktoken's
    Rust core on encoding (a BaseException, and a Rust backtrace on stderr)."""
    ckpt = copy(holed[1], tmp_path / "final")
    meta = json.loads((ckpt / "tokenizer/tokenizer.json").read_text())
    (ckpt / "tokenizer/tokenizer.json").write_text(json.dumps(meta | {"pattern": pattern}))
    proc = lmforge("sample", "--ckpt", str(ckpt), "--prompt", "aaaaaaaaaaaaaaaaaaaaaaaaaaaa c",
                   "--max-new-tokens", "4", "--seed", "0")
    proc_error(proc, "pattern")


def test_prepare_refuses_a_sidecar_pattern_that_panics_tiktoken(tmp_path):
    vocab = byte_vocab(tmp_path / "v.tiktoken")
    (tmp_path / "v.tiktoken.json").write_text(json.dumps({"pattern": "(?=a)|\\s"}))
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.txt").write_text("a banana")
    proc_error(lmforge("prepare", "--source", str(tmp_path / "src"), "--tokenizer", str(vocab),
                       "--out", str(tmp_path / "out"), "--quiet"), "pattern")
    assert not (tmp_path / "out").exists()


# --------------------------------------------------------------------------------------------
# the manifest validated on read


def edit_manifest(data: Path, edit) -> None:
    d = json.loads((data / S.MANIFEST_NAME).read_text())
    edit(d)
    (data / S.MANIFEST_NAME).write_text(json.dumps(d))


@pytest.mark.parametrize("stats", [{"replaced_chars": "many"}, {"val_floor": "x"},
                                   {"documents": -1}, {"typo": 3}])
def test_a_manifest_stat_of_the_wrong_type_is_one_line(dataset, tmp_path, stats):
    data = copy(dataset, tmp_path / "data")
    edit_manifest(data, lambda d: d["stats"].update(stats))
    proc_error(lmforge("inspect", str(data)), "stats", next(iter(stats)))


def test_eval_takes_data_whose_manifest_predates_the_tokenizer_sha256(holed, tmp_path, capsys):
    """Older data without the tokenizer's sha256 in its manifest is read, as training reads it:
    its tokenizer/ directory is then the one compared with the checkpoint's."""
    from lmforge.launch.cli import main

    data, ckpt = holed
    data = copy(data, tmp_path / "data")
    edit_manifest(data, lambda d: d["tokenizer"].pop("sha256"))
    assert main(["eval", "--ckpt", str(ckpt), "--data", str(data)]) == 0
    assert "perplexity" in capsys.readouterr().out
    other = byte_vocab(tmp_path / "b.tiktoken")  # another vocabulary in its tokenizer/ is refused
    shutil.rmtree(data / "tokenizer")
    from lmforge.data_prep.tokenizer import load_tokenizer, save_tokenizer_dir
    save_tokenizer_dir(load_tokenizer(str(other)), data / "tokenizer", "file", "b")
    rc = main(["eval", "--ckpt", str(ckpt), "--data", str(data)])
    one_error_line(rc, capsys.readouterr().err, "tokenizer")


# --------------------------------------------------------------------------------------------
# --out inside --source


@pytest.mark.parametrize("source", ["dir", "glob"])
def test_prepare_out_inside_source_never_reads_its_own_files(tmp_path, source):
    src = tmp_path / "corpus"
    src.mkdir()
    for i, text in enumerate(texts(6)):
        (src / f"d{i}.txt").write_text(text)
    spec = str(src) if source == "dir" else f"{src}/**/*.*"
    argv = ["prepare", "--source", spec, "--tokenizer", str(byte_vocab(tmp_path / "b.tiktoken")),
            "--out", str(src / "data"), "--quiet", "--val-fraction", "0"]
    first = lmforge(*argv)
    assert first.returncode == 0, first.stderr
    assert S.load_manifest(src / "data").num_documents("train") == 6
    again = lmforge(*argv)
    assert again.returncode == 0 and "nothing to do" in again.stderr, again.stderr


@pytest.mark.parametrize("kind", ["hard link", "symbolic link"])
def test_eval_json_replaces_a_link_instead_of_writing_through_it(holed, tmp_path, kind, capsys):
    from lmforge.launch.cli import main

    data, ckpt = holed
    victim, out = tmp_path / "victim.json", tmp_path / "e.json"
    victim.write_text("precious")
    os.link(victim, out) if kind == "hard link" else out.symlink_to(victim)
    assert main(["eval", "--ckpt", str(ckpt), "--data", str(data), "--json", str(out)]) == 0
    assert victim.read_text() == "precious" and not out.is_symlink()
    assert json.loads(out.read_text())["tokens"] > 0


def test_prepare_names_a_special_tokenizer_file_and_a_source_inside_out(tmp_path, capsys):
    from tests.errors import cli_error

    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.txt").write_text("text")
    os.mkfifo(tmp_path / "fifo.tiktoken")
    cli_error(capsys, ["prepare", "--source", str(tmp_path / "src"), "--tokenizer",
                       str(tmp_path / "fifo.tiktoken"), "--out", str(tmp_path / "o"), "--quiet"],
              "fifo.tiktoken is a FIFO")
    cli_error(capsys, ["prepare", "--source", str(tmp_path / "src"), "--tokenizer",
                       str(byte_vocab(tmp_path / "b.tiktoken")), "--out", str(tmp_path), "--quiet"],
              "lies inside --out")
