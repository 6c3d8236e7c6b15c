"""The training loader's order: exactly-once per epoch, world-size independence, exact resume.

The test stream is token t = its position in the split, so a window names itself: x[0] // seq_len.
"""

from collections import Counter

import numpy as np
import pytest
import torch

from lmforge.data_prep.errors import DataError
from lmforge.data_prep.shards import FORMAT_VERSION, Manifest, ShardInfo, shard_name, write_shard
from lmforge.pipeline.data.loader import TokenWindows, TrainLoader

VOCAB = 100_000  # above every position, so token ids can equal positions
SEQ = 8


def make_data(path, train_sizes=(100, 37, 250, 1, 60), val_sizes=(50, 31)):
    infos = []
    for split, sizes in (("train", train_sizes), ("val", val_sizes)):
        start = 0
        for k, n in enumerate(sizes):
            name = shard_name(split, k)
            sha = write_shard(path / name, np.arange(start, start + n), VOCAB)
            infos.append(ShardInfo(file=name, split=split, tokens=n, documents=1, sha256=sha))
            start += n
    Manifest(version=FORMAT_VERSION, vocab_size=VOCAB, eot_id=0, tokenizer={}, source="test",
             args={}, shards=infos).save(path)
    return path


@pytest.fixture
def data(tmp_path):
    return make_data(tmp_path)


def ids(batch):
    """Window indices of an (x, y) micro-batch."""
    x, y = batch
    assert torch.equal(x[:, 1:], y[:, :-1])  # y is x shifted by one
    return (x[:, 0] // SEQ).tolist()


def run(data, steps, world, accum, mbs=2, seed=0, state=None):
    """Per step: the list over (rank, micro-step) of window-index lists, plus rank 0's state."""
    windows = TokenWindows(data, "train", SEQ, VOCAB)
    loaders = [TrainLoader(windows, mbs, accum, r, world, seed) for r in range(world)]
    if state is not None:
        for loader in loaders:
            loader.load_state_dict(state)
    out = [[ids(b) for loader in loaders for b in loader.next_micro_batches()] for _ in range(steps)]
    return out, loaders[0].state_dict(), loaders[0]


def test_windows_span_shards(data):
    w = TokenWindows(data, "train", SEQ, VOCAB)
    assert w.num_tokens == 448 and w.num_windows == (448 - 1) // SEQ
    for i in range(w.num_windows):  # shard boundaries at 100, 137, 387, 388
        (window,) = w.windows([i])
        assert window.dtype == np.int64
        assert window.tolist() == list(range(i * SEQ, i * SEQ + SEQ + 1))
    with pytest.raises(IndexError):
        w.windows([w.num_windows])
    assert w.tokens(95, 140).tolist() == list(range(95, 140))
    assert w.tokens(0, w.num_tokens).tolist() == list(range(448))


@pytest.mark.parametrize("world", [1, 2, 4])
def test_each_window_once_per_epoch(data, world):
    per_epoch = 55 // 8  # 55 windows, 8 per step (2 sequences x 4 micro-batches in all)
    steps, _, loader = run(data, 3 * per_epoch, world, 4 // world, seed=1)
    assert loader.steps_per_epoch == per_epoch
    for e in range(3):
        seen = Counter(i for step in steps[e * per_epoch:(e + 1) * per_epoch] for mb in step for i in mb)
        assert max(seen.values()) == 1  # no window twice in an epoch, across ranks
        assert len(seen) == per_epoch * 8 > 55 - 8  # only the partial tail is dropped


def test_epochs_roll_over_with_new_order(data):
    steps, state, loader = run(data, 2 * 6 + 1, world=2, accum=2)  # 55 windows, 8 per step: 6 steps/epoch
    assert loader.steps_per_epoch == 6
    cursor = state["sources"]["train"]
    assert cursor["epoch"] == 2 and cursor["position"] == 8
    assert steps[0] != steps[6]  # each epoch is a fresh permutation


@pytest.mark.parametrize("layouts", [[(1, 2), (2, 1)], [(1, 4), (2, 2), (4, 1)]])
def test_same_windows_per_step_whatever_the_layout(data, layouts):
    runs = [run(data, 20, world, accum)[0] for world, accum in layouts]
    for other in runs[1:]:
        # Same chunks in the same global order: the same multiset per step, and beyond that
        # the same micro-batches, so per-micro-batch losses can be compared too.
        assert other == runs[0]


def test_seed_changes_order(data):
    assert run(data, 3, 1, 2, seed=0)[0] != run(data, 3, 1, 2, seed=1)[0]
    assert run(data, 3, 1, 2, seed=0)[0] == run(data, 3, 1, 2, seed=0)[0]


def test_state_round_trip_is_bit_identical(data, tmp_path):
    windows = TokenWindows(data, "train", SEQ, VOCAB)
    loader = TrainLoader(windows, 2, 2, 1, 2, seed=3)
    for _ in range(9):  # crosses an epoch boundary (6 steps/epoch)
        loader.next_micro_batches()
    torch.save(loader.state_dict(), tmp_path / "loader.pt")
    expected = [loader.next_micro_batches() for _ in range(8)]
    state = torch.load(tmp_path / "loader.pt", weights_only=True)
    assert all(type(v) is int for v in state["sources"]["train"].values())
    resumed = TrainLoader(TokenWindows(data, "train", SEQ, VOCAB), 2, 2, 1, 2, seed=3)
    resumed.load_state_dict(state)
    for want, got in zip(expected, [resumed.next_micro_batches() for _ in range(8)], strict=True):
        for (wx, wy), (gx, gy) in zip(want, got, strict=True):
            assert torch.equal(wx, gx) and torch.equal(wy, gy)


def damage(state: dict, how: str):
    sources = state["sources"]["train"]
    if how == "not a dict":
        return "garbage"
    if how == "negative position":
        sources["position"] = -5
    elif how == "position past the rows":
        sources["position"] = sources["num_rows"] + 1
    elif how == "text step":
        state["step"] = "3"
    elif how == "bool epoch":
        sources["epoch"] = True
    else:  # "sources a list"
        state["sources"] = [sources]
    return state


@pytest.mark.parametrize("how", ["not a dict", "negative position", "position past the rows",
                                 "text step", "bool epoch", "sources a list"])
def test_a_damaged_loader_state_is_a_data_error(data, how):
    loader = TrainLoader(TokenWindows(data, "train", SEQ, VOCAB), 2, 2, 0, 1, seed=3)
    loader.next_micro_batches()
    state = loader.state_dict()
    loader.load_state_dict(state)  # the undamaged state loads
    with pytest.raises(DataError, match="loader state .* is malformed"):
        loader.load_state_dict(damage(state, how))


@pytest.mark.parametrize("before,after", [((2, 1), (1, 2)), ((1, 4), (4, 1)), ((4, 1), (2, 2))])
def test_resume_on_another_world_size(data, before, after):
    full = run(data, 15, *before)[0]
    head, state, _ = run(data, 7, *before)
    tail = run(data, 8, *after, state=state)[0]
    assert head + tail == full


def test_resume_rejects_other_data_order(data):
    _, state, _ = run(data, 1, 1, 1)
    with pytest.raises(DataError, match="same data.path, data.sources, data.align, data.seq_len and train.seed"):
        run(data, 1, 1, 1, seed=5, state=state)


def test_vocab_mismatch(data):
    with pytest.raises(DataError, match=f"data vocab {VOCAB} vs model vocab 4096.*model.vocab_size"):
        TokenWindows(data, "train", SEQ, 4096)
    assert TokenWindows(data, "train", SEQ, None).vocab_size == VOCAB
    assert TokenWindows(data, "train", SEQ, 0).vocab_size == VOCAB  # 0 = take it from the data


def test_too_little_data(data):
    with pytest.raises(DataError, match="fewer than seq_len"):
        TokenWindows(data, "val", 100, VOCAB)
    with pytest.raises(DataError, match="one step needs 64 windows"):
        TrainLoader(TokenWindows(data, "train", SEQ, VOCAB), 8, 4, 0, 2, seed=0)


def test_corrupt_shard_is_caught(data):
    shard = data / shard_name("train", 2)
    shard.write_bytes(shard.read_bytes()[:-4])
    with pytest.raises(DataError, match="bytes"):
        TokenWindows(data, "train", SEQ, VOCAB)
