"""`nextline`: a multiple-choice task made from the held-out documents of a prepared dataset.

Each question shows a few lines of a val document and asks for the real next line among 4; the 3
others are lines of other val documents of about its length, given its indentation (so neither
indentation nor length, which acc_norm divides by, gives the answer away: with distractors of any
length an untrained model's acc_norm sat at 0.33). Made at eval time from the first val tokens, with a fixed seed:
the same dataset always gives the same questions. On the built-in corpus (Python's standard
library) a model that has learnt some Python picks the real line well above chance (0.25) within
the demo's minutes, long before it can answer HellaSwag.
"""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np

from lmforge.data_prep.errors import DataError
from lmforge.data_prep.tokenizer import dataset_tokenizer
from lmforge.pipeline.data.windows import TokenWindows
from lmforge.pipeline.tasks.example import Example

NAME = "nextline"
MAX_TOKENS = 1 << 21  # the val tokens read: plenty of questions, bounded time
CONTEXT_LINES = 6
CHOICES = 4
STRIDE = 4  # lines between two questions of one document
MIN_CHARS = 12  # shorter lines ("else:", a closing bracket) make poor questions and distractors
SEED = 0


def val_documents(data_dir: Path) -> list[str]:
    """The text of the val documents among the split's first MAX_TOKENS tokens."""
    windows = TokenWindows(data_dir, "val", 1, None)
    enc = dataset_tokenizer(data_dir)
    ids = windows.tokens(0, min(windows.num_tokens, MAX_TOKENS))
    cuts = np.flatnonzero(ids == windows.eot_id)
    docs = np.split(ids, cuts)
    return [enc.decode(d[d != windows.eot_id].tolist()) for d in docs if (d != windows.eot_id).any()]


def _good(line: str) -> bool:
    return len(line.strip()) >= MIN_CHARS


def nextline_examples(data_dir: Path) -> list[Example]:
    docs = [d.split("\n") for d in val_documents(data_dir)]
    pools = [[ln.strip() for ln in lines if _good(ln)] for lines in docs]
    donors = [i for i, pool in enumerate(pools) if pool]
    if len(donors) < 2:
        raise DataError(f"task {NAME} needs at least 2 val documents with lines of "
                        f"{MIN_CHARS}+ characters in {data_dir}; prepare more val data "
                        "(lmforge prepare --val-docs N)")
    rng, examples = random.Random(SEED), []
    for d, lines in enumerate(docs):
        for i in range(CONTEXT_LINES, len(lines), STRIDE):
            line, context = lines[i], "\n".join(lines[i - CONTEXT_LINES:i]) + "\n"
            if not _good(line) or not context.strip():
                continue
            indent, size = line[:len(line) - len(line.lstrip())], len(line.strip())
            others: list[str] = []
            for _ in range(50 * CHOICES):  # distinct lines of other documents, of about its length
                donor = rng.choice(donors)
                pick = rng.choice(pools[donor])
                if donor != d and abs(len(pick) - size) <= max(4, size // 4) and \
                        indent + pick != line and indent + pick not in others:
                    others.append(indent + pick)
                if len(others) == CHOICES - 1:
                    break
            else:
                continue
            gold = rng.randrange(CHOICES)
            examples.append(Example.of(context, others[:gold] + [line] + others[gold:], gold))
    rng.shuffle(examples)  # the first N (--max-examples) drawn from every document
    if not examples:
        raise DataError(f"task {NAME}: no val document of {data_dir} has {CONTEXT_LINES + 1}+ "
                        "lines; prepare more val data (lmforge prepare --val-docs N)")
    return examples
