"""Tasks by name or file, and their scores over ranks: what `lmforge eval --tasks` and the
training loop's downstream evals (pipeline/downstream.py) both call.

A task spec is a named task (`arc_easy`; `arc_easy@hub` loads it from the Hugging Face hub), the
built-in `nextline` (from a prepared dataset's val documents), or a .jsonl file of our format.
Per task: `acc` and `acc_norm` (lm-eval's), `centered` = (acc_norm - chance) / (1 - chance) with
chance the mean of 1/len(choices) over its examples, and `downstream`, the mean of `centered`
over the tasks (nanochat's CORE convention). Every rank encodes every example before any
collective (an example that cannot be scored is the same error on every rank, never one rank's
alone), then scores example j if j % world_size is its rank; the sums are all-reduced, so any
number of ranks gives the figures of one. A sharded (FSDP2) model is scored as it is: each
forward gathers the weights from every rank, so every rank runs as many forwards.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import tiktoken
import torch
from torch.distributed.fsdp import FSDPModule
from tqdm import tqdm

from lmforge.data_prep.errors import DataError
from lmforge.data_prep.safe_files import user_path
from lmforge.data_prep.tokenizer import eot_id
from lmforge.model import GPT
from lmforge.pipeline.parallel.distributed import DistInfo, all_reduce_max, all_reduce_sum
from lmforge.pipeline.parallel.parallelize import Precision
from lmforge.pipeline.tasks import named, nextline
from lmforge.pipeline.tasks.example import Example, load_jsonl
from lmforge.pipeline.tasks.score import (
    Encoded,
    choice_loglikelihoods,
    encode_example,
    scoring_batches,
    verdict,
)

HUB_SUFFIX = "@hub"


@dataclass(frozen=True)
class Task:
    name: str
    examples: list[Example]
    generated: bool = False  # nextline's: a question too long for the model is dropped
    encoded: list[Encoded] = field(default_factory=list, compare=False)  # by encode_task


@dataclass(frozen=True)
class TaskResult:
    acc: float
    acc_norm: float
    centered: float
    n: int


def task_name(spec: str) -> str:
    """The name a spec's results go under: a file's stem, else the task's name."""
    return Path(spec).stem if spec.endswith(".jsonl") else spec.removesuffix(HUB_SUFFIX)


def check_specs(specs: list[str]) -> None:
    """Before any work: each spec a known name or a .jsonl path, no name twice."""
    known = [*named.TASKS, nextline.NAME]
    for spec in specs:
        name = spec.removesuffix(HUB_SUFFIX)
        if spec.endswith(".jsonl") or (name in named.TASKS) or spec == nextline.NAME:
            continue
        raise DataError(f"unknown task {spec!r}: name one of {', '.join(known)} (NAME@hub for "
                        "the hub copy of a named task), or give a .jsonl file of our format "
                        '({"context", "choices", "gold"} per line)')
    names = [task_name(s) for s in specs]
    if dup := next((n for n in names if names.count(n) > 1), None):
        raise DataError(f"two tasks are named {dup!r}; give each task once (rename a file)")


def load_task(spec: str, data_dir: Path | None, max_examples: int | None = None) -> Task:
    """The examples of one spec (the first max_examples of them when given)."""
    check_specs([spec])
    if spec.endswith(".jsonl"):
        if not os.path.lexists(spec):  # anything else there is safe_files' to name
            raise DataError(f"task file {spec} does not exist; give the path of a .jsonl task")
        examples = load_jsonl(user_path(spec))  # a path you name may be a link
    elif spec == nextline.NAME:
        if data_dir is None or not Path(data_dir).is_dir():
            raise DataError(f"task {spec} reads the val split of a prepared dataset, and there is "
                            f"none at {data_dir}; pass --data DIR")
        examples = nextline.nextline_examples(Path(data_dir))
    else:
        examples = named.load_named(spec.removesuffix(HUB_SUFFIX), spec.endswith(HUB_SUFFIX))
    return Task(task_name(spec), examples[:max_examples] if max_examples else examples,
                generated=spec == nextline.NAME)


def encode_task(task: Task, enc: tiktoken.Encoding, max_len: int) -> Task:
    """`task` with every example encoded for a model of context max_len (the same on every
    rank). A generated question that does not fit is dropped; any other example that does not
    is an error, before any work."""
    examples, encoded = [], []
    for j, ex in enumerate(task.examples):
        try:
            encoded.append(encode_example(enc, ex, max_len, eot_id(enc)))
            examples.append(ex)
        except ValueError as e:
            if not task.generated:
                raise DataError(f"task {task.name} example {j}: {e} (drop or shorten the "
                                "example, or evaluate a model of a longer context)") from None
    if not examples:
        raise DataError(f"task {task.name}: none of its questions fits the model's context of "
                        f"{max_len} tokens; evaluate a model of a longer context")
    return Task(task.name, examples, task.generated, encoded)


def evaluate_tasks(model: GPT, tasks: list[Task], info: DistInfo, precision: Precision,
                   progress: bool = False) -> dict[str, TaskResult]:
    """Every task's figures, the same on every rank (a collective: every rank calls it), of
    tasks encode_task encoded."""
    mine = [t.encoded[info.rank::info.world_size] for t in tasks]
    forwards = [None] * len(tasks)
    if isinstance(model, FSDPModule):  # as many forwards on every rank, task by task
        counts = torch.tensor([len(scoring_batches(model, e)) for e in mine], device=info.device)
        forwards = all_reduce_max(counts, info).tolist()
    bar = tqdm(total=sum(len(t.examples) for t in tasks), unit="ex", desc="tasks",
               disable=not progress, dynamic_ncols=True)
    # Per task: examples, acc and acc_norm counted over this rank's examples (integers: exact in
    # any order of summation, so any world size gives the same figures).
    sums = torch.zeros(len(tasks), 3, dtype=torch.float64)
    for k, (task, encoded, n_batches) in enumerate(zip(tasks, mine, forwards)):
        # Every rank's share advances the bar by as much (rank 0's count x world size).
        lls = choice_loglikelihoods(model, encoded, precision,
                                    done=lambda n: bar.update(n * info.world_size),
                                    n_batches=n_batches)
        for j, ll in zip(range(info.rank, len(task.examples), info.world_size), lls):
            ex = task.examples[j]
            acc, acc_norm = verdict(ex, ll)
            sums[k] += torch.tensor([1.0, acc, acc_norm], dtype=torch.float64)
    bar.close()
    sums = all_reduce_sum(sums.to(info.device), info).cpu()
    results = {}
    for task, (n, acc, acc_norm) in zip(tasks, sums.tolist()):
        # Every rank holds every example: the chance level needs no collective.
        chance = sum(ex.chance for ex in task.examples) / len(task.examples)  # < 1: 2+ choices
        acc, acc_norm = acc / n, acc_norm / n
        results[task.name] = TaskResult(acc, acc_norm, (acc_norm - chance) / (1 - chance), int(n))
    return results


def downstream(results: dict[str, TaskResult]) -> float:
    return sum(r.centered for r in results.values()) / len(results)


def timed_evaluate(model: GPT, tasks: list[Task], info: DistInfo, precision: Precision,
                   progress: bool = False) -> tuple[dict[str, TaskResult], float]:
    """evaluate_tasks and the examples per second it ran at."""
    t0 = time.perf_counter()
    results = evaluate_tasks(model, tasks, info, precision, progress)
    return results, sum(r.n for r in results.values()) / (time.perf_counter() - t0)


def table(results: dict[str, TaskResult]) -> str:
    """One line per task, then the downstream mean."""
    width = max(12, *map(len, results))
    lines = [f"{'task':<{width}}  {'acc':>7}  {'acc_norm':>8}  {'centered':>8}  {'n':>6}"]
    lines += [f"{name:<{width}}  {r.acc:7.4f}  {r.acc_norm:8.4f}  {r.centered:8.4f}  {r.n:6d}"
              for name, r in results.items()]
    lines.append(f"{'downstream':<{width}}  {'':7}  {'':8}  {downstream(results):8.4f}")
    return "\n".join(lines)
