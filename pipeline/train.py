"""The trainer: `Trainer(cfg, info).fit()` trains a GPT as its config says, as one process or as
one rank of torchrun / accelerate. Its command line is launch/train.py (`python -m lmforge.launch.train`).

The constructor is a build chain, each step given its own config section: data -> model and
precision -> parallelism -> optimizer -> checkpoint state (restored last when resuming). The loop
is short; evaluation, samples and checkpoints are hooks on step numbers. Step numbers count
completed optimizer steps: step s's loss is the loss of the s-th update.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from pathlib import Path

import tiktoken
import torch

from lmforge.data_prep.shards import load_manifest
from lmforge.data_prep.tokenizer import check_tokenizer_is, dataset_tokenizer, token_byte_lengths
from lmforge.model import GPT, ModelConfig
from lmforge.pipeline import attention
from lmforge.pipeline.checkpoint import format as ckpt
from lmforge.pipeline.checkpoint.async_writer import Checkpointer
from lmforge.pipeline.checkpoint.hf_init import start_from
from lmforge.pipeline.checkpoint.run_dir import RunDir
from lmforge.pipeline.config import (
    ConfigError,
    DataConfig,
    EvalConfig,
    JobConfig,
    TrainConfig,
    config_to_dict,
    derive,
    describe,
    save_resolved,
)
from lmforge.pipeline.data.loader import TrainLoader
from lmforge.pipeline.data.mixture import ValSet, is_mixture, train_sources, val_sets
from lmforge.pipeline.evaluate import evaluate
from lmforge.pipeline.hardware import dtype_name, peak_flops, to_device
from lmforge.pipeline.loss import build_loss, eval_loss_name
from lmforge.pipeline.metrics import MetricsLogger, Progress, get_logger, plot_losses, trim_metrics
from lmforge.pipeline.optim.optimizers import apply_schedule, build_optimizer
from lmforge.pipeline.parallel.distributed import DistInfo, all_reduce_sum
from lmforge.pipeline.parallel.materialize import meta_gpt
from lmforge.pipeline.parallel.parallelize import (
    ParallelModel,
    Precision,
    RecompileWatch,
    kept,
    parallelize,
    resolve_choices,
    resolve_parallel,
)
from lmforge.pipeline.samples import Samples
from lmforge.pipeline.tasks.downstream import Downstream

log = get_logger()


class TrainingStopped(Exception):
    """Too many consecutive non-finite losses: the run stops, its last good checkpoint kept."""


# --------------------------------------------------------------------------------------------
# Build chain


def model_config_for(model_cfg: ModelConfig, data_vocab: int) -> ModelConfig:
    """The model section with the vocabulary taken from the data when the config leaves it 0."""
    return replace(model_cfg, vocab_size=data_vocab) if model_cfg.vocab_size == 0 else model_cfg


@dataclass(frozen=True)
class TrainData:
    """What the trainer reads from the prepared data directory."""

    tokenizer: tiktoken.Encoding
    tokenizer_dir: Path  # copied into every checkpoint
    token_bytes: torch.Tensor  # UTF-8 bytes of each token id, for bits per byte
    loader: TrainLoader
    val: list[ValSet]  # this rank's eval batches of each source with a val split
    mixture: bool  # more than one source, or phases: per-source metrics


def build_data(data_cfg: DataConfig, train_cfg: TrainConfig, eval_cfg: EvalConfig, *,
               vocab_size: int, grad_accum_steps: int, info: DistInfo) -> TrainData:
    tokenizer_dir = Path(data_cfg.first_path) / "tokenizer"  # every source's (checked)
    tokenizer = dataset_tokenizer(data_cfg.first_path)
    sources, phases = train_sources(data_cfg, vocab_size)
    loader = TrainLoader(sources, train_cfg.micro_batch_size, grad_accum_steps, info.rank,
                         info.world_size, train_cfg.seed, phases, train_cfg.max_steps)
    val = val_sets(data_cfg, eval_cfg, vocab_size, info.rank, info.world_size)
    token_bytes = torch.from_numpy(token_byte_lengths(tokenizer)).long()
    return TrainData(tokenizer, tokenizer_dir, token_bytes, loader, val, is_mixture(data_cfg))


def build_parallel(model: GPT, train_cfg: TrainConfig, precision: Precision,
                   info: DistInfo) -> ParallelModel:
    """train_cfg.compile, .attention and .loss resolved (Trainer._resolve_choices)."""
    return parallelize(
        model, info, parallel=resolve_parallel(train_cfg.parallel, info), precision=precision,
        compile_model=train_cfg.compile == "on",
        activation_checkpointing=train_cfg.activation_checkpointing, loss=train_cfg.loss,
        ddp_bucket_mb=train_cfg.ddp_bucket_mb,
        attend=attention.kernel(train_cfg.attention), init_seed=train_cfg.seed,
    )


def due(step: int, every: int, last: bool) -> bool:
    """Hooks run every `every` steps (0: never periodically) and always at the last step."""
    return last or (every > 0 and step % every == 0)


# --------------------------------------------------------------------------------------------
# The trainer


class Trainer:
    def __init__(self, cfg: JobConfig, info: DistInfo):
        self.cfg, self.info = cfg, info
        self.run_dir = Path(cfg.log.out_dir)
        self.model_cfg = model_config_for(cfg.model, load_manifest(cfg.data.first_path).vocab_size)
        self.derived = derive(cfg, info.world_size)  # a batch that does not divide: error
        grad_accum_steps = self.derived.grad_accum_steps
        resume_from = ckpt.find_resume(cfg.checkpoint.resume, self.run_dir)
        resume_meta = None if resume_from is None else ckpt.read_resumable(
            resume_from, self.model_cfg, cfg.optim, cfg.data)

        self.data = build_data(cfg.data, cfg.train, cfg.eval, vocab_size=self.model_cfg.vocab_size,
                               grad_accum_steps=grad_accum_steps, info=info)
        started = None if resume_meta is None else resume_meta.config.train
        dtype = kept(cfg.train, started, "dtype")  # a resume computes in its run's dtype
        self.precision = Precision.resolve(dtype, info.device)
        self.samples = Samples(cfg.sample, self.data.tokenizer, self.model_cfg,
                               Precision.resolve(dtype, info.device, "sample"), info,
                               cfg.train.seed)
        self.model = meta_gpt(self.model_cfg)  # parallelize allocates it (pipeline/parallel/materialize.py)
        self._resolve_choices(None if resume_meta is None else resume_meta.config)
        self.downstream = Downstream(self.cfg.eval, cfg.data.first_path, self.data.tokenizer,
                                     self.model_cfg, self.precision, info)
        self.parallel = build_parallel(self.model, self.cfg.train, self.precision, info)
        self.optimizer = build_optimizer(self.parallel.module, cfg.optim, info.device,
                                         self.precision.dtype)
        self.checkpointer = Checkpointer(info, cfg.checkpoint.async_save)
        self.step, self.bad_steps = 0, 0
        self.step_record: dict | None = None  # the last step's training record (see meta)
        self.lineage, self.parent_step = ckpt.new_lineage(), None
        self.source = None  # the Hugging Face model the run started from (checkpoint.init_from)
        if cfg.checkpoint.init_from and resume_meta is None:
            check_tokenizer_is(self.data.tokenizer_dir, cfg.checkpoint.init_from)
            self.source = start_from(self.model, Path(cfg.checkpoint.init_from))
        if resume_meta is not None:
            self._resume(resume_from, resume_meta)

        self.metrics = self._open_run_dir(resume_from)
        self.peak = peak_flops(info.device, self.precision.dtype)  # the dtype matmuls run in
        self.flops_per_token = self.model.flops_per_token(cfg.data.seq_len)
        self.recompiles = RecompileWatch()
        self.stop_requested = False

    def _resolve_choices(self, started: JobConfig | None) -> None:
        """train.dtype's, .compile's, .attention's and .loss's choices into the config (run
        dir, checkpoints): a resumed run keeps those it started with."""
        t = resolve_choices(self.cfg.train, self.info.device, self.precision.dtype,
                            self.cfg.data.seq_len, self.model_cfg.padded_vocab_size,
                            started and started.train)
        self.cfg = replace(self.cfg, train=t)  # set once: the config is fixed from here on

    def _resume(self, where: Path, meta: ckpt.CheckpointMeta) -> None:
        ckpt.load_training(where, self.parallel.module, self.optimizer, self.info)
        self.data.loader.load_state_dict(meta.loader)
        self.step, self.bad_steps = meta.step, meta.bad_steps
        self.step_record = meta.record
        self.lineage, self.parent_step, self.source = meta.lineage, meta.step, meta.source
        if self.step > (max_steps := self.cfg.train.max_steps):
            raise ConfigError(f"checkpoint {where} is at step {self.step}, past this run's "
                              f"train.max_steps = {max_steps}: there is nothing to train; resume "
                              f"with --train.max_steps {self.step} or more, or resume an earlier "
                              "checkpoint (--resume PATH)")
        log.info("resumed from %s at step %d (written by %d ranks)", where, self.step,
                 meta.world_size)

    def _open_run_dir(self, resumed_from: Path | None) -> MetricsLogger:
        cfg = self.cfg
        if self.info.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            if resumed_from is None:  # an earlier start's records: kept, never written over
                ckpt.abandon_history(self.run_dir)
            save_resolved(cfg, self.run_dir)
            recorded = trim_metrics(RunDir(self.run_dir).metrics, self.step)
            # Last: checkpoints move only once the resume has passed every check.
            if resumed_from is not None:  # newer checkpoints (a rollback) leave the line
                ckpt.abandon_newer(self.run_dir, self.step, resumed_from)
        metrics = MetricsLogger(self.run_dir, config_to_dict(cfg), cfg.log.wandb,
                                cfg.log.wandb_project, cfg.log.run_name, self.info.is_main)
        # Killed between the checkpoint and its step's record (the last step saves first): the
        # record is in the checkpoint. Only that gap: a run directory holding a copied
        # checkpoint and no history of its own stays without it.
        if self.info.is_main and self.step_record and recorded == self.step - 1:
            metrics.log(self.step, **self.step_record)
        return metrics

    # ---- one optimizer step -----------------------------------------------------------------

    def train_step(self) -> tuple[float, float, bool]:
        """Forward/backward over this rank's micro-batches, then (if the loss is finite) clip and
        update. Returns (mean loss over the global batch, grad norm, stop requested by any rank)."""
        cfg, info, pm = self.cfg, self.info, self.parallel
        micro_batches = self.data.loader.next_micro_batches()
        # Sum token losses and divide by the targets of the whole step (padding of doc rows not
        # counted), so the gradient is the same for any split into ranks and accumulation steps
        # (DDP/FSDP average over ranks). Every rank knows the step's count: no collective.
        step_targets = self.data.loader.step_targets
        tokens_per_rank = step_targets / info.world_size
        loss_sum = torch.zeros((), dtype=torch.float64, device=info.device)
        for i, (x_BT, y_BT) in enumerate(micro_batches):
            x_BT, y_BT = to_device(x_BT, info.device), to_device(y_BT, info.device)
            with pm.micro_step(sync=i == len(micro_batches) - 1):
                with pm.autocast():
                    loss = pm.loss(x_BT, y_BT, reduction="sum")
                (loss / tokens_per_rank).backward()
            loss_sum += loss.detach().double()
        # torch.full, not torch.tensor: a fill kernel instead of a host->device copy.
        stop_flag = torch.full((), float(self.stop_requested), dtype=torch.float64,
                               device=info.device)
        totals = torch.stack([loss_sum, stop_flag])
        all_reduce_sum(totals, info)
        max_norm = cfg.optim.grad_clip if cfg.optim.grad_clip > 0 else math.inf
        norm = torch.nn.utils.clip_grad_norm_(pm.module.parameters(), max_norm)
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        # The step's one host-device sync (the skip decision needs it): loss, stop flag and grad
        # norm come back in a single transfer.
        loss_total, stop_total, grad_norm = torch.cat([totals, norm.double().reshape(1)]).tolist()
        mean_loss = loss_total / step_targets
        if math.isfinite(mean_loss) and math.isfinite(grad_norm):
            self.optimizer.step()
            self.bad_steps = 0
        else:
            self.bad_steps += 1
            log.warning("step %d: non-finite loss/grad (%s, %s): update skipped", self.step + 1,
                        mean_loss, grad_norm)
        self.optimizer.zero_grad(set_to_none=True)
        return mean_loss, grad_norm, stop_total > 0

    # ---- hooks ------------------------------------------------------------------------------

    def run_eval(self, n_batches: int | None = None) -> dict:
        """val_loss/ppl/bpb; of a mixture, per source (val_loss/NAME, val_bpb/NAME) and the
        sources' weighted mean (see pipeline/data/mixture.py)."""
        record, loss, bpb = {}, 0.0, 0.0
        total = sum(v.weight for v in self.data.val)
        tokens = self.cfg.eval.batch_size * self.cfg.data.seq_len
        name = eval_loss_name(self.cfg.train.loss, self.model_cfg.padded_vocab_size, tokens)
        loss_fn = self.parallel.head_loss if name == self.cfg.train.loss else build_loss(
            name, self.info.device)
        for v in self.data.val:
            result = evaluate(self.parallel.module, v.batches[:n_batches], self.data.token_bytes,
                              self.info, precision=self.precision,
                              loss_fn=loss_fn, attend=self.parallel.attend)
            share = v.weight / total if total else 1 / len(self.data.val)
            loss, bpb = loss + share * result.loss, bpb + share * result.bits_per_byte
            if self.data.mixture:
                record |= {f"val_loss/{v.name}": result.loss, f"val_bpb/{v.name}":
                           result.bits_per_byte}
        return {"val_loss": loss, "val_ppl": math.exp(loss), "val_bpb": bpb} | record

    def run_samples(self) -> list[str]:
        return self.samples(self.parallel.module)

    def meta(self, with_loader: bool) -> ckpt.CheckpointMeta:
        return ckpt.CheckpointMeta(
            step=self.step, model=self.model_cfg, config=self.cfg, lineage=self.lineage,
            parent_step=self.parent_step, world_size=self.info.world_size,
            bad_steps=self.bad_steps, loader=self.data.loader.state_dict() if with_loader else None,
            record=self.step_record if with_loader else None, source=self.source,
        )

    def _guarded(self, what: str, hook):
        """Run an eval/sampling hook; a failure is one warning line, never the end of the run."""
        try:
            return hook()
        except Exception as e:  # noqa: BLE001 - whatever broke, the run and its weights go on
            log.warning("step %d: %s failed (%s: %s); training continues, checkpoints unaffected",
                        self.step, what, type(e).__name__, e)
            return None

    def save(self) -> Path:
        return self.checkpointer.save(
            self.run_dir, self.parallel.module, self.optimizer, self.meta(with_loader=True),
            self.data.tokenizer_dir, self.cfg.checkpoint.keep,
        )

    def export_final(self) -> Path:
        state = ckpt.full_model_state(self.parallel.module)
        out = RunDir(self.run_dir).final
        if self.info.is_main:
            ckpt.save_consolidated(out, state, self.meta(with_loader=False),
                                   self.data.tokenizer_dir)
        return out

    # ---- the loop ---------------------------------------------------------------------------

    def fit(self) -> int:
        self._log_start()
        progress = Progress(self.cfg.train.max_steps, self.cfg.log.log_every, self.info.is_main,
                            start_step=self.step)
        final = None
        while self.step < self.cfg.train.max_steps:
            self.checkpointer.poll()  # completes a background save whose write is done
            record, stop = self._step(progress)
            finished = self.step == self.cfg.train.max_steps
            # Weights first at the last step and at a stop (preemption: the scheduler's SIGKILL
            # follows its SIGTERM within seconds): checkpoint and final export come before eval
            # and samples, which only read the weights and whose failure is only logged. Other
            # checkpoints come after the step's metrics record, so a kill right after one
            # cannot lose that record.
            if finished or stop:
                self.save()
                self.checkpointer.wait()  # a background write: complete before anything else
            if finished:
                final = self.export_final()
            if stop:
                self.metrics.log(self.step, **record)
                log.info("stop requested (SIGTERM): checkpoint saved at step %d, exiting "
                         "(eval and samples skipped)", self.step)
                break
            self._after_step(record, finished)
        progress.close()
        self._finish(final)
        return 0

    def _log_start(self) -> None:
        if self.info.is_main:
            log.info("%s", self.model.summary())
            if self.source and self.parent_step is None:
                log.info("model: %s/config.json (replaces the config's [model]); weights from its "
                         "%d safetensors files (sha256 in meta.json)", self.source["path"],
                         len(self.source["sha256"]))
            log.info("%s", describe(self.cfg, self.derived, self.model.num_params()))
            log.info("parallel=%s world=%d device=%s dtype=%s", self.parallel.mode,
                     self.info.world_size, self.info.device, dtype_name(self.precision.dtype))

    def _step(self, progress: Progress) -> tuple[dict, bool]:
        """One optimizer step with its bookkeeping: (the step's metrics record, stop requested)."""
        cfg, step_tokens = self.cfg, self.cfg.train.global_batch_tokens
        lr = apply_schedule(self.optimizer, self.step, cfg.train.max_steps, cfg.optim,
                            self.model_cfg.d_model)
        t0 = time.perf_counter()
        loss, grad_norm, stop = self.train_step()
        # No extra cuda.synchronize: train_step syncs once before its optimizer step, which
        # then overlaps the next step's start; in steady state dt is still one step's time.
        dt = time.perf_counter() - t0
        self.step += 1
        self.recompiles.check("train", self.step)
        tok_s = step_tokens / dt
        mfu = self.flops_per_token * tok_s / (self.peak * self.info.world_size) if self.peak else None
        record = {"loss": loss, "lr": lr, "grad_norm": grad_norm, "tokens_per_s": tok_s,
                  "mfu": mfu, "epoch": self.data.loader.epoch,
                  # the targets trained so far, as the loader's cursors count them: right across
                  # a resume with another batch size, and without the padding of doc-aligned rows
                  "tokens": sum(c["tokens"] for c in self.data.loader.cursors.values())}
        if self.data.mixture:
            for name, c in self.data.loader.cursors.items():
                record |= {f"tokens/{name}": c["tokens"], f"epoch/{name}": c["epoch"]}
        self.step_record = dict(record)
        progress.update(self.step, loss, lr, tok_s, mfu)
        if self.bad_steps >= cfg.train.max_bad_steps:
            raise TrainingStopped(
                f"{self.bad_steps} consecutive non-finite losses at step {self.step}; "
                "lower optim.lr or use train.dtype=fp32, then --resume auto from the last good "
                "checkpoint"
            )
        return record, stop

    def _after_step(self, record: dict, finished: bool) -> None:
        """The hooks on step numbers: eval, samples, the metrics record, periodic checkpoints."""
        cfg, step = self.cfg, self.step
        if due(step, cfg.eval.every, finished) and (val := self._guarded("eval", self.run_eval)):
            record |= val
            self.recompiles.check("eval", step)
            log.info("step %d: val loss %.4f, ppl %.2f, bpb %.4f", step, record["val_loss"],
                     record["val_ppl"], record["val_bpb"])
        if self.downstream.tasks and due(step, cfg.eval.tasks_every, finished) and (
                tasks := self._guarded("downstream evals",
                                       lambda: self.downstream(self.parallel.module))):
            record |= tasks
            self.downstream.log(step, tasks)
        if due(step, cfg.sample.every, finished):
            samples = self._guarded("sampling", self.run_samples)
            if samples is not None:
                record["samples"] = samples
            for text in samples or []:
                log.info("sample: %r", text)
        if due(step, cfg.log.log_every, finished) or "val_loss" in record or "downstream" in record:
            self.metrics.log(step, **record)
        if not finished and due(step, cfg.checkpoint.every, False):
            self.save()

    def _finish(self, final: Path | None) -> None:
        if self.step == self.cfg.train.max_steps:
            if final is None:  # resumed from the last step's checkpoint: export it
                final = self.export_final()
            if self.info.is_main:
                plot_losses(RunDir(self.run_dir).metrics, RunDir(self.run_dir).loss_plot)
                log.info("done: %d steps; model %s; metrics %s", self.step, final,
                         RunDir(self.run_dir).metrics)
        self.metrics.close()


if __name__ == "__main__":  # the command line lives in launch/ (pipeline never imports launch)
    import sys

    print("error: pipeline.train is the trainer, not a command: run `python -m lmforge.launch.train` "
          "(torchrun/accelerate: -m lmforge.launch.train) or `lmforge train`", file=sys.stderr)
    sys.exit(2)
