"""The [data] section made concrete: every source's manifest, training rows and val batches.

A mixture's sources share one tokenizer: the run has one embedding. A source without a val split
is skipped at eval (said at start-up); the weighted `val_loss` averages the others by the first
phase's weights, so that it stays one curve across phase switches.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lmforge.data_prep.errors import DataError
from lmforge.data_prep.shards import Manifest, load_manifest
from lmforge.pipeline.config import EvalConfig
from lmforge.pipeline.data.config import (
    DataConfig,
    SourceConfig,
    named,
    phase_start,
    schedule,
    weights,
)
from lmforge.pipeline.data.loader import Phase, Source
from lmforge.pipeline.data.rows import build_rows
from lmforge.pipeline.data.windows import TokenWindows
from lmforge.pipeline.evaluate import eval_batches
from lmforge.pipeline.metrics import get_logger

log = get_logger()


@dataclass(frozen=True)
class ValSet:
    """One source's eval batches (this rank's) and its weight in the weighted val_loss."""

    name: str
    weight: float
    batches: list[tuple[torch.Tensor, torch.Tensor]]


def all_sources(d: DataConfig) -> list[SourceConfig]:
    """Every source of every phase, once each (by name), in order of first appearance."""
    seen: dict[str, SourceConfig] = {}
    for s in d.mixture() + [s for p in d.phases for s in named(p.sources)]:
        seen.setdefault(s.name, s)
    return list(seen.values())


def is_mixture(d: DataConfig) -> bool:
    return len(all_sources(d)) > 1 or bool(d.phases)


def open_sources(d: DataConfig) -> list[tuple[SourceConfig, Manifest]]:
    """Each source with its manifest; one DataError for a directory that is missing or not
    prepared, or for two sources prepared with different tokenizers."""
    opened = [(s, load_manifest(s.path)) for s in all_sources(d)]
    (s0, m0), tok0 = opened[0], _tokenizer_of(opened[0][1])
    for s, m in opened[1:]:
        if _tokenizer_of(m) != tok0:
            raise DataError(
                f"data sources {s0.path} and {s.path} were prepared with different tokenizers "
                f"({m0.tokenizer.get('name')} vs {m.tokenizer.get('name')}, vocab {m0.vocab_size} "
                f"vs {m.vocab_size}); prepare {s.path} again with --tokenizer {s0.path}/tokenizer")
    return opened


def _tokenizer_of(m: Manifest) -> tuple:
    return m.tokenizer.get("sha256"), m.eot_id, m.vocab_size


def train_sources(d: DataConfig, vocab_size: int) -> tuple[list[Source], list[Phase]]:
    """The loader's sources (rows of each train split) and phases."""
    mixture = is_mixture(d)
    sources = []
    for s, _ in open_sources(d):
        rows = build_rows(TokenWindows(s.path, "train", d.seq_len, vocab_size), d.align)
        if d.align == "doc":
            log.info("data.align = doc: %s packs into %d rows of %d tokens, %.2f%% of their "
                     "target positions padding (not trained)", s.name, rows.num_rows,
                     d.seq_len + 1, 100 * rows.padding)
        # One directory keeps the permutations of lmforge before mixtures (its checkpoints).
        sources.append(Source.keyed(s.name, rows) if mixture else Source(s.name, rows))
    return sources, [Phase(*phase) for phase in schedule(d)]


def val_sets(d: DataConfig, e: EvalConfig, vocab_size: int, rank: int,
             world_size: int) -> list[ValSet]:
    """Each source's val batches; sources without a val split skipped (said once)."""
    base = weights(d.mixture())
    out = []
    for s, m in open_sources(d):
        if m.num_tokens("val") <= d.seq_len and is_mixture(d):
            log.warning("data source %s has no val split to speak of (%d tokens); its "
                        "val_loss/%s is skipped, the weighted val_loss leaves it out", s.name,
                        m.num_tokens("val"), s.name)
            continue
        windows = TokenWindows(s.path, "val", d.seq_len, vocab_size)
        out.append(ValSet(s.name, base.get(s.name, 0.0),
                          eval_batches(windows, e.batch_size, rank, world_size, e.tokens)))
    if not out:
        raise DataError(f"no data source has a val split ({', '.join(s.path for s in all_sources(d))}); "
                        "prepare one with --val-fraction > 0")
    return out


def describe_mixture(d: DataConfig, max_steps: int, global_batch_tokens: int) -> str:
    """The --dry-run lines: per source its tokens, weight per phase and the epochs the run
    takes of it (rows drawn x seq_len / train tokens), and the padding with align = doc."""
    try:
        opened = open_sources(d)
    except DataError as e:
        return f"data:      {e}"
    starts = [0] + [phase_start(p.from_step, max_steps) for p in d.phases] + [max_steps]
    phase_weights = [w for _, w in schedule(d)]
    lines = [f"data:      align {d.align}, {len(opened)} source(s), "
             f"{len(phase_weights)} phase(s) from steps {starts[:-1]}"]
    for s, m in opened:
        tokens = m.num_tokens("train")
        drawn = sum(max(0, min(b, max_steps) - a) * w.get(s.name, 0.0)
                    for a, b, w in zip(starts, starts[1:], phase_weights))
        epochs = drawn * global_batch_tokens / max(tokens, 1)
        shares = "/".join(f"{w.get(s.name, 0.0):.3g}" for w in phase_weights)
        padding = ""
        if d.align == "doc":
            rows = build_rows(TokenWindows(s.path, "train", d.seq_len, None), "doc")
            padding = f", {100 * rows.padding:.2f}% of doc rows padding"
        lines.append(f"  {s.name:<12} {tokens:>14,} train tokens, weight {shares}, "
                     f"{epochs:.2f} epochs in this run{padding}  ({s.path})")
    return "\n".join(lines)
