"""Training's downstream evals (`eval.tasks`): the tasks, loaded once before step 1, scored every
`eval.tasks_every` steps (the trainer's `due`) and at the end on an unsharded eager copy of the model on every rank
(each rank scores its stripe of the examples: pipeline/tasks/evaluate.py), in the dtype training
computes in. A task that cannot be loaded is one warning and the run goes on without it; a
failed scoring is the trainer's one warning (Trainer._guarded)."""

from __future__ import annotations

import time
from dataclasses import replace

import tiktoken
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from lmforge.data_prep.errors import DataError
from lmforge.model import GPT, ModelConfig
from lmforge.pipeline.config import EvalConfig, JobConfig
from lmforge.pipeline.metrics import get_logger
from lmforge.pipeline.parallel.distributed import DistInfo
from lmforge.pipeline.parallel.parallelize import Precision
from lmforge.pipeline.tasks.evaluate import Task, downstream, evaluate_tasks, load_task

log = get_logger()
TIMED_EXAMPLES = 8  # the budget's estimate: this many examples of each task timed, then scaled


def keep_tasks(cfg: JobConfig, started: JobConfig | None) -> JobConfig:
    """A resumed run keeps the tasks it started with when its command line names none."""
    if started is None or cfg.eval.tasks or not started.eval.tasks:
        return cfg
    e = started.eval
    return replace(cfg, eval=replace(cfg.eval, tasks=e.tasks, tasks_every=e.tasks_every,
                                     tasks_max_examples=e.tasks_max_examples))


class Downstream:
    def __init__(self, ec: EvalConfig, data_dir: str, enc: tiktoken.Encoding,
                 model_cfg: ModelConfig, precision: Precision, info: DistInfo):
        self.enc, self.model_cfg, self.precision, self.info = enc, model_cfg, precision, info
        self.copy: GPT | None = None
        self.tasks: list[Task] = []
        for spec in ec.tasks:
            try:
                self.tasks.append(load_task(spec, data_dir, ec.tasks_max_examples or None))
            except DataError as e:
                log.warning("eval.tasks: %s is left out (%s); training goes on without it", spec, e)

    def _model(self, module: nn.Module) -> GPT:
        """Collective: the trained weights, unsharded on every rank, in a plain GPT."""
        state = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True))
        if self.copy is None:
            self.copy = GPT(self.model_cfg).to(self.info.device)
        self.copy.load_state_dict(state, strict=False)  # a tied head may be absent
        return self.copy

    def __call__(self, module: nn.Module, tasks: list[Task] | None = None) -> dict:
        """metrics: downstream, and acc / acc_norm / centered of each task."""
        results = evaluate_tasks(self._model(module), tasks or self.tasks, self.enc, self.info,
                                 self.precision)
        record = {"downstream": downstream(results)}
        for name, r in results.items():
            record |= {f"acc/{name}": r.acc, f"acc_norm/{name}": r.acc_norm,
                       f"centered/{name}": r.centered}
        return record

    def estimate_s(self, module: nn.Module) -> float:
        """Seconds one round of the tasks takes: TIMED_EXAMPLES of each timed (after one untimed
        batch, which pays for set-up), scaled to the examples each rank scores."""
        if not self.tasks:
            return 0.0
        few = [Task(t.name, t.examples[:TIMED_EXAMPLES * self.info.world_size]) for t in self.tasks]
        self(module, few[:1])
        t0 = time.perf_counter()
        self(module, few)
        n_few, n_all = sum(len(t.examples) for t in few), sum(len(t.examples) for t in self.tasks)
        return (time.perf_counter() - t0) * n_all / n_few

    def log(self, step: int, record: dict) -> None:
        per_task = ", ".join(f"{t.name} {record[f'acc_norm/{t.name}']:.3f}" for t in self.tasks)
        log.info("step %d: downstream %.4f (acc_norm: %s)", step, record["downstream"], per_task)
