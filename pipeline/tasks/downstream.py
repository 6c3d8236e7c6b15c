"""Training's downstream evals (`eval.tasks`): the tasks, loaded and encoded once before step 1,
scored every `eval.tasks_every` steps (the trainer's `due`) and at the end on the model being
trained, eagerly, in the dtype training computes in: no copy of it. Each rank scores its stripe
of the examples (pipeline/tasks/evaluate.py); under FSDP2 the model stays sharded and every rank
runs as many forwards. A task that cannot be loaded or scored (an example too long for the model)
is one warning before step 1 and the run goes on without it; a failed scoring is the trainer's
one warning (Trainer._guarded)."""

from __future__ import annotations

import tiktoken
from torch import nn

from lmforge.data_prep.errors import DataError
from lmforge.model import ModelConfig
from lmforge.pipeline.config import EvalConfig
from lmforge.pipeline.metrics import get_logger
from lmforge.pipeline.parallel.distributed import DistInfo
from lmforge.pipeline.parallel.parallelize import Precision
from lmforge.pipeline.samples import eager_model
from lmforge.pipeline.tasks.evaluate import Task, downstream, encode_task, evaluate_tasks, load_task

log = get_logger()


class Downstream:
    def __init__(self, ec: EvalConfig, data_dir: str, enc: tiktoken.Encoding,
                 model_cfg: ModelConfig, precision: Precision, info: DistInfo):
        self.precision, self.info = precision, info
        self.tasks: list[Task] = []
        for spec in ec.tasks:
            try:
                task = load_task(spec, data_dir, ec.tasks_max_examples or None)
                self.tasks.append(encode_task(task, enc, model_cfg.max_seq_len))
            except DataError as e:
                log.warning("eval.tasks: %s is left out (%s); training goes on without it", spec, e)

    def __call__(self, module: nn.Module) -> dict:
        """metrics: downstream, and acc / acc_norm / centered of each task."""
        with eager_model(module) as model:
            results = evaluate_tasks(model, self.tasks, self.info, self.precision)
        record = {"downstream": downstream(results)}
        for name, r in results.items():
            record |= {f"acc/{name}": r.acc, f"acc_norm/{name}": r.acc_norm,
                       f"centered/{name}": r.centered}
        return record

    def log(self, step: int, record: dict) -> None:
        per_task = ", ".join(f"{t.name} {record[f'acc_norm/{t.name}']:.3f}" for t in self.tasks)
        log.info("step %d: downstream %.4f (acc_norm: %s)", step, record["downstream"], per_task)
