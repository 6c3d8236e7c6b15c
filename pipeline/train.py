"""Training entry point: `python -m pipeline.train --config configs/tiny.toml [--a.b value ...]`.

Runs unchanged as one process, under `torchrun --nproc_per_node=N` (one node or many), and under
`accelerate launch`. `lmforge train --nproc N ...` starts torchrun for the user.

The spine is a short build chain (config -> data -> model -> parallelism -> optimizer ->
checkpoint) and a short loop; evaluation, samples and checkpoints are hooks on step numbers.
Step numbers count completed optimizer steps: step s's loss is the loss of the s-th update.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import sys
import time
from dataclasses import replace
from pathlib import Path

import tiktoken
import torch
from torch import nn

from data_prep.errors import DataError
from data_prep.shards import load_manifest
from data_prep.tokenizer import encode_prompt, eot_id, load_tokenizer_dir, token_byte_lengths
from model import GPT, ModelConfig, generate
from pipeline import budget
from pipeline import checkpoint as ckpt
from pipeline.config import (
    ConfigError,
    JobConfig,
    SampleConfig,
    config_to_dict,
    derive,
    describe,
    load_config,
    save_resolved,
    to_toml,
)
from pipeline.data import TokenWindows, TrainLoader
from pipeline.distributed import DistInfo, all_reduce_sum, init_distributed, teardown
from pipeline.evaluate import eval_batches, evaluate
from pipeline.hardware import dtype_name, matmul_peak, resolve_dtype, to_device
from pipeline.metrics import (
    MetricsLogger,
    Progress,
    get_logger,
    peak_flops,
    plot_losses,
    setup_logging,
)
from pipeline.optim import apply_schedule, build_optimizer
from pipeline.parallelize import (
    RecompileWatch,
    autocast,
    grad_sync,
    needs_autocast,
    parallelize,
    resolve_compile,
    resolve_parallel,
)
from pipeline.plan import report as plan_report

log = get_logger()


class TrainingStopped(Exception):
    """Too many consecutive non-finite losses: the run stops, its last good checkpoint kept."""


# --------------------------------------------------------------------------------------------
# Build chain


def model_config_for(cfg: JobConfig, data_vocab: int) -> ModelConfig:
    """The model section with the vocabulary taken from the data when the config leaves it 0."""
    if cfg.model.vocab_size == 0:
        return replace(cfg.model, vocab_size=data_vocab)
    return cfg.model


def count_params(cfg: JobConfig) -> int:
    """Parameters of the configured model, built on the meta device (no memory, no data read
    beyond the manifest; before `prepare` has run, the embedding is left out of the count)."""
    try:
        model_cfg = model_config_for(cfg, load_manifest(cfg.data.path).vocab_size)
    except DataError:
        model_cfg = replace(cfg.model, vocab_size=cfg.model.vocab_size or 1)
    with torch.device("meta"):
        model = GPT(model_cfg)
    return model.num_params(exclude_embeddings=model_cfg.vocab_size == 1)


def find_resume(cfg: JobConfig, run_dir: Path) -> Path | None:
    existing = ckpt.list_complete(run_dir / "checkpoints")
    if cfg.checkpoint.resume == "none":
        if existing:
            raise ConfigError(
                f"{run_dir} already holds checkpoints (newest {existing[-1].name}); pass "
                "--resume auto to continue that run, or set --log.out_dir to a new directory"
            )
        return None
    if cfg.checkpoint.resume == "auto":
        return existing[-1] if existing else None
    return ckpt.resolve_resumable(cfg.checkpoint.resume)


CPU_EAGER_MFU = 0.5  # fraction of the measured matmul peak an eager CPU step reaches (bench)


def estimated_eager_run_s(model: GPT, cfg: JobConfig, info: DistInfo, bf16: bool) -> float | None:
    """Seconds the run's steps would take eagerly on this device, from their FLOPs: what
    train.compile = auto weighs against the cold compile on CPU (None when there is no peak)."""
    if info.device.type != "cpu":
        return None
    peak = matmul_peak(info.device, torch.bfloat16 if bf16 else torch.float32)
    flops = model.flops_per_token(cfg.data.seq_len) * cfg.train.global_batch_tokens * cfg.train.max_steps
    return flops / (peak * CPU_EAGER_MFU * info.world_size) if peak else None


def build_model(
    model_cfg: ModelConfig, cfg: JobConfig, info: DistInfo, bf16: bool
) -> tuple[GPT, nn.Module]:
    # Every rank builds the same full model from the same seed before sharding, so the initial
    # weights do not depend on the world size or the parallelism (what parity tests rely on).
    torch.manual_seed(cfg.train.seed)
    model = GPT(model_cfg).to(info.device)
    parallel = resolve_parallel(cfg.train.parallel, info)
    trained = parallelize(
        model,
        info,
        parallel=parallel,
        bf16=bf16,
        compile_model=resolve_compile(
            cfg.train.compile, info.device, estimated_eager_run_s(model, cfg, info, bf16)
        ),
        activation_checkpointing=cfg.train.activation_checkpointing,
    )
    return model, trained


def sample_prompt_ids(
    sc: SampleConfig, enc: tiktoken.Encoding, model_cfg: ModelConfig
) -> list[list[int]]:
    """The sample prompts as token ids, each checked here to leave room for new tokens: a prompt
    too long for the model then stops the run before step 1, not at its last step."""
    prompts = [encode_prompt(enc, text) for text in sc.prompts]
    for i, ids in enumerate(prompts):
        try:
            sc.params().fit(len(ids), model_cfg.max_seq_len)
        except ValueError as e:
            raise ConfigError(f"sample.prompts[{i}] (with the end-of-text token every prompt "
                              f"starts with): {e}, or raise model.max_seq_len") from None
    return prompts


def due(step: int, every: int, last: bool) -> bool:
    """Hooks run every `every` steps (0: never periodically) and always at the last step."""
    return last or (every > 0 and step % every == 0)


def trim_metrics(path: Path, last_step: int) -> None:
    """On resume, drop the records a crashed run wrote after the checkpoint it resumes from."""
    if not path.is_file():
        return
    kept = [ln for ln in path.read_text().splitlines() if json.loads(ln).get("step", 0) <= last_step]
    path.write_text("".join(ln + "\n" for ln in kept))


# --------------------------------------------------------------------------------------------
# The trainer


class Trainer:
    def __init__(self, cfg: JobConfig, info: DistInfo):
        # First, so that the budget's clock covers the whole set-up.
        self.time_budget = budget.TimeBudget(cfg.train.time_budget_s) if cfg.train.time_budget_s else None
        self.cfg, self.info = cfg, info
        self.run_dir = Path(cfg.log.out_dir)
        manifest = load_manifest(cfg.data.path)
        self.model_cfg = model_config_for(cfg, manifest.vocab_size)
        self.derived = derive(cfg, info.world_size)
        self.parallel = resolve_parallel(cfg.train.parallel, info)
        self.dtype = resolve_dtype(cfg.train.dtype, info.device)  # auto: what the hardware does well
        self.bf16 = self.dtype == torch.bfloat16
        self.amp = needs_autocast(self.parallel, self.bf16)
        resume_from = find_resume(cfg, self.run_dir)

        self.tokenizer_dir = Path(cfg.data.path) / "tokenizer"
        self.tokenizer = load_tokenizer_dir(self.tokenizer_dir)
        self.sample_prompts = sample_prompt_ids(cfg.sample, self.tokenizer, self.model_cfg)
        self.token_bytes = torch.from_numpy(token_byte_lengths(self.tokenizer)).long()
        seq_len = cfg.data.seq_len
        train_windows = TokenWindows(cfg.data.path, "train", seq_len, self.model_cfg.vocab_size)
        self.loader = TrainLoader(
            train_windows,
            cfg.train.micro_batch_size,
            self.derived.grad_accum_steps,
            info.rank,
            info.world_size,
            cfg.train.seed,
        )
        val_windows = TokenWindows(cfg.data.path, "val", seq_len, self.model_cfg.vocab_size)
        self.val = eval_batches(
            val_windows, cfg.eval.batch_size, info.rank, info.world_size, cfg.eval.tokens
        )

        self.model, self.trained = build_model(self.model_cfg, cfg, info, self.bf16)
        self.optimizer = build_optimizer(self.trained, cfg.optim, info.device, self.dtype)
        self.step, self.bad_steps = 0, 0
        self.lineage, self.parent_step = ckpt.new_lineage(), None
        if resume_from is not None:
            self._resume(resume_from)

        if info.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            save_resolved(cfg, self.run_dir)
            trim_metrics(self.run_dir / "metrics.jsonl", self.step)
        self.metrics = MetricsLogger(
            self.run_dir, config_to_dict(cfg), cfg.log.wandb, cfg.log.wandb_project,
            cfg.log.run_name, info.is_main,
        )
        self.peak = peak_flops(info.device, self.dtype)  # the dtype matmuls really run in
        self.flops_per_token = self.model.flops_per_token(seq_len)
        self.recompiles = RecompileWatch()
        self.stop_requested = False
        self.sampler: GPT | None = None

    def _resume(self, where: Path) -> None:
        meta = ckpt.load_training(where, self.trained, self.optimizer, self.model_cfg, self.info)
        self.loader.load_state_dict(meta.loader)
        self.step, self.bad_steps = meta.step, meta.bad_steps
        self.lineage, self.parent_step = meta.lineage, meta.step
        self._keep_fixed_length(meta.config)
        if self.info.is_main:  # a rollback: the newer checkpoints leave the current line
            ckpt.abandon_newer(self.run_dir, self.step)
        log.info("resumed from %s at step %d (written by %d ranks)", where, self.step, meta.world_size)

    # ---- one optimizer step -----------------------------------------------------------------

    def train_step(self) -> tuple[float, float, bool]:
        """Forward/backward over this rank's micro-batches, then (if the loss is finite) clip and
        update. Returns (mean loss over the global batch, grad norm, stop requested by any rank)."""
        cfg, info = self.cfg, self.info
        micro_batches = self.loader.next_micro_batches()
        # Sum token losses and divide by the tokens of the whole step, so the gradient is the
        # same for any split into ranks and accumulation steps (DDP/FSDP average over ranks).
        tokens_per_rank = self.derived.tokens_per_micro_step * len(micro_batches)
        loss_sum = torch.zeros((), dtype=torch.float64, device=info.device)
        for i, (x_BT, y_BT) in enumerate(micro_batches):
            x_BT, y_BT = to_device(x_BT, info.device), to_device(y_BT, info.device)
            with grad_sync(self.trained, self.parallel, sync=i == len(micro_batches) - 1):
                with autocast(info.device, self.amp):
                    loss = self.trained(x_BT, y_BT, reduction="sum")
                (loss / tokens_per_rank).backward()
            loss_sum += loss.detach().double()
        # torch.full, not torch.tensor: a fill kernel instead of a host->device copy.
        stop_flag = torch.full((), float(self.stop_requested), dtype=torch.float64, device=info.device)
        totals = torch.stack([loss_sum, stop_flag])
        all_reduce_sum(totals, info)
        max_norm = cfg.optim.grad_clip if cfg.optim.grad_clip > 0 else math.inf
        norm = torch.nn.utils.clip_grad_norm_(self.trained.parameters(), max_norm)
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        # The step's one host-device sync (the skip decision needs it): loss, stop flag and grad
        # norm come back in a single transfer.
        loss_total, stop_total, grad_norm = torch.cat([totals, norm.double().reshape(1)]).tolist()
        mean_loss = loss_total / cfg.train.global_batch_tokens
        stop = stop_total > 0
        if math.isfinite(mean_loss) and math.isfinite(grad_norm):
            self.optimizer.step()
            self.bad_steps = 0
        else:
            self.bad_steps += 1
            log.warning("step %d: non-finite loss/grad (%s, %s): update skipped", self.step + 1, mean_loss, grad_norm)
        self.optimizer.zero_grad(set_to_none=True)
        return mean_loss, grad_norm, stop

    # ---- hooks ------------------------------------------------------------------------------

    def run_eval(self, n_batches: int | None = None) -> dict:
        result = evaluate(self.trained, self.val[:n_batches], self.token_bytes, self.info, bf16=self.amp)
        return {"val_loss": result.loss, "val_ppl": result.perplexity, "val_bpb": result.bits_per_byte}

    def run_samples(self) -> list[str]:
        """Rank 0 generates from an unsharded eager copy (all ranks join the weight gather)."""
        if not self.sample_prompts:  # sample.prompts = []: samples are off
            return []
        state = ckpt.full_model_state(self.trained)
        if not self.info.is_main:
            return []
        if self.sampler is None:
            self.sampler = GPT(self.model_cfg).to(self.info.device)
        self.sampler.load_state_dict(state, strict=False)
        prompts = self.sample_prompts
        sampling = self.cfg.sample.params(seed=self.cfg.train.seed)
        sampling = sampling.fit(max(map(len, prompts)), self.model_cfg.max_seq_len)
        with autocast(self.info.device, self.bf16):
            outs = generate(self.sampler, prompts, sampling, stop_token=eot_id(self.tokenizer))
        texts = self.cfg.sample.prompts
        return [p + self.tokenizer.decode(o) for p, o in zip(texts, outs, strict=True)]

    def meta(self, with_loader: bool) -> ckpt.CheckpointMeta:
        return ckpt.CheckpointMeta(
            step=self.step, model=self.model_cfg, config=self.cfg, lineage=self.lineage,
            parent_step=self.parent_step, world_size=self.info.world_size,
            bad_steps=self.bad_steps, loader=self.loader.state_dict() if with_loader else None,
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
        return ckpt.save_training(
            self.run_dir, self.trained, self.optimizer, self.meta(with_loader=True),
            self.tokenizer_dir, self.info, self.cfg.checkpoint.keep,
        )

    def export_final(self) -> Path:
        state = ckpt.full_model_state(self.trained)
        out = self.run_dir / "final"
        if self.info.is_main:
            ckpt.save_consolidated(out, state, self.meta(with_loader=False), self.tokenizer_dir)
        return out

    # ---- time budget (pipeline/budget.py) ---------------------------------------------------

    def _keep_fixed_length(self, saved: JobConfig) -> None:
        """Resuming a run whose length is already fixed (budget measured, or none): keep that
        length. The budget sizes a run once; measuring again would change its lr schedule."""
        if self.time_budget is None or saved.train.time_budget_s:
            return  # no budget, or a checkpoint from before the measurement: it happens again
        budget.apply(self.cfg, budget.plan_of(saved))
        self.derived = derive(self.cfg, self.info.world_size)
        self.time_budget = None
        log.info("time budget: this run's length was fixed when it started: %d steps (not "
                 "measured again)", self.cfg.train.max_steps)

    def _hook_costs(self) -> budget.HookCosts:
        """One eval batch and one round of samples, timed; checkpoints estimated from size."""
        t0 = budget.now()
        self.run_eval(n_batches=1)
        eval_s = (budget.now() - t0) * len(self.val)
        t0 = budget.now()
        self.run_samples()
        return budget.HookCosts.estimate(eval_s, budget.now() - t0, self.model.num_params())

    def _apply_time_budget(self, progress: Progress) -> None:
        """With train.time_budget_s: time the first steps, then fix the run's length once."""
        tb = self.time_budget
        if tb is None:
            return
        tb.step_done()
        if self.step < budget.CALIBRATION_STEPS:
            return
        costs = self._hook_costs()
        # Every rank must choose the same length: plan from the ranks' mean measurements.
        measured = torch.tensor([tb.step_seconds(), costs.eval_s, costs.sample_s, tb.elapsed()],
                                dtype=torch.float64, device=self.info.device)
        all_reduce_sum(measured, self.info)
        step_s, eval_s, sample_s, elapsed = (measured / self.info.world_size).tolist()
        costs = replace(costs, eval_s=eval_s, sample_s=sample_s)
        cap = self.cfg.train.max_steps
        p = budget.plan(self.cfg, elapsed, self.step, step_s, costs, tb.budget_s)
        budget.apply(self.cfg, p)
        self.derived = derive(self.cfg, self.info.world_size)
        self.time_budget = None
        progress.set_length(p.max_steps, p.log_every)
        if self.info.is_main:
            save_resolved(self.cfg, self.run_dir)
        tok_s = self.cfg.train.global_batch_tokens / step_s
        log.info("time budget %g s: %.2f s/step (%s tokens/s, median of steps 2-%d), eval %.1f s, "
                 "samples %.1f s, checkpoint ~%.1f s -> max_steps %d (at most %d), ~%.0f s in all; "
                 "eval every %d, samples every %d, checkpoints every %d (in %s)",
                 tb.budget_s, step_s, f"{tok_s:,.0f}", self.step, eval_s, sample_s,
                 costs.checkpoint_s, p.max_steps, cap, p.estimated_s, p.eval_every,
                 p.sample_every, p.checkpoint_every, self.run_dir / "config.toml")
        if not p.fits:
            log.warning("time budget %g s: even %d steps (warmup + 1) need ~%.0f s; raise "
                        "train.time_budget_s or lower optim.warmup_steps", tb.budget_s,
                        p.max_steps, p.estimated_s)

    # ---- the loop ---------------------------------------------------------------------------

    def fit(self) -> int:
        cfg, info = self.cfg, self.info
        if info.is_main:
            log.info("%s", self.model.summary())
            log.info("%s", describe(cfg, self.derived, self.model.num_params()))
            log.info("parallel=%s world=%d device=%s dtype=%s", self.parallel, info.world_size, info.device, dtype_name(self.dtype))
        progress = Progress(cfg.train.max_steps, cfg.log.log_every, info.is_main, start_step=self.step)
        step_tokens = cfg.train.global_batch_tokens
        final = None
        while self.step < cfg.train.max_steps:
            lr = apply_schedule(self.optimizer, self.step, cfg.train.max_steps, cfg.optim)
            t0 = time.perf_counter()
            loss, grad_norm, stop = self.train_step()
            # No extra cuda.synchronize: train_step syncs once before its optimizer step, which
            # then overlaps the next step's start; in steady state dt is still one step's time.
            dt = time.perf_counter() - t0
            self.step += 1
            self.recompiles.check("train", self.step)
            self._apply_time_budget(progress)
            tok_s = step_tokens / dt
            mfu = self.flops_per_token * tok_s / (self.peak * info.world_size) if self.peak else None
            record = {"loss": loss, "lr": lr, "grad_norm": grad_norm, "tokens_per_s": tok_s,
                      "mfu": mfu, "tokens": self.step * step_tokens, "epoch": self.loader.epoch}
            progress.update(self.step, loss, lr, tok_s, mfu)
            if self.bad_steps >= cfg.train.max_bad_steps:
                raise TrainingStopped(
                    f"{self.bad_steps} consecutive non-finite losses at step {self.step}; "
                    "lower optim.lr or use train.dtype=fp32, then --resume auto from the last good checkpoint"
                )
            finished = self.step == cfg.train.max_steps
            # Weights first at the last step and at a stop (preemption: the scheduler's SIGKILL
            # follows its SIGTERM within seconds): checkpoint and final export come before eval
            # and samples, which only read the weights and whose failure is only logged. Other
            # checkpoints come after the step's metrics record, so a kill right after one
            # cannot lose that record.
            if finished or stop:
                log.info("checkpoint %s", self.save())
            if finished:
                final = self.export_final()
            if stop:
                self.metrics.log(self.step, **record)
                log.info("stop requested (SIGTERM): checkpoint saved at step %d, exiting "
                         "(eval and samples skipped)", self.step)
                break
            if due(self.step, cfg.eval.every, finished) and (val := self._guarded("eval", self.run_eval)):
                record |= val
                self.recompiles.check("eval", self.step)
                log.info("step %d: val loss %.4f, ppl %.2f, bpb %.4f", self.step, record["val_loss"], record["val_ppl"], record["val_bpb"])
            if due(self.step, cfg.sample.every, finished):
                samples = self._guarded("sampling", self.run_samples)
                if samples is not None:
                    record["samples"] = samples
                for text in samples or []:
                    log.info("sample: %r", text)
            if due(self.step, cfg.log.log_every, finished) or "val_loss" in record:
                self.metrics.log(self.step, **record)
            if not finished and due(self.step, cfg.checkpoint.every, False):
                log.info("checkpoint %s", self.save())
        progress.close()
        if self.step == cfg.train.max_steps:
            if final is None:  # resumed from the last step's checkpoint: export it
                final = self.export_final()
            if info.is_main:
                plot_losses(self.run_dir / "metrics.jsonl", self.run_dir / "loss.png")
                log.info("done: %d steps; model %s; metrics %s", self.step, final, self.run_dir / "metrics.jsonl")
        self.metrics.close()
        return 0


# --------------------------------------------------------------------------------------------
# Command line


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(
        prog="python -m pipeline.train",
        description="Train a GPT. Any config key can be overridden: --train.max_steps 100",
    )
    p.add_argument("--config", help="TOML file in configs/ (defaults when omitted)")
    p.add_argument("--resume", help="none | auto | PATH (shortcut for --checkpoint.resume)")
    p.add_argument("--dry-run", action="store_true", help="print the resolved config and derived sizes, then exit")
    plan = p.add_argument_group("--dry-run planning (pipeline/plan.py): memory per GPU, traffic, time")
    plan.add_argument("--nproc", type=int, help="processes (GPUs) per node (default: $WORLD_SIZE or 1)")
    plan.add_argument("--nnodes", type=int, default=1, help="nodes (default 1)")
    plan.add_argument("--gpu", default="H100", help="GPU model for memory and peak FLOP/s (default H100)")
    plan.add_argument("--mfu", type=float, default=0.4, help="assumed model FLOPs utilisation (default 0.4)")
    args, overrides = p.parse_known_args(argv)
    if args.resume:
        overrides += ["--checkpoint.resume", args.resume]
    return args, overrides


def dry_run(cfg: JobConfig, args: argparse.Namespace) -> int:
    nproc = args.nproc or int(os.environ.get("WORLD_SIZE", "1"))
    if nproc < 1 or args.nnodes < 1 or not 0 < args.mfu <= 1:
        raise ConfigError(f"--nproc {nproc} --nnodes {args.nnodes} --mfu {args.mfu:g}: expected "
                          "--nproc >= 1, --nnodes >= 1 and 0 < --mfu <= 1 (e.g. 0.4)")
    derived = derive(cfg, nproc * args.nnodes)  # a batch that does not divide: error, no output
    plan = plan_report(cfg, nproc, args.nnodes, args.gpu, args.mfu)
    print(to_toml(cfg))
    print(describe(cfg, derived, count_params(cfg)))
    print()
    print(plan)
    return 0


def main(argv: list[str] | None = None) -> int:
    args, overrides = parse_args(list(sys.argv[1:] if argv is None else argv))
    cfg = load_config(args.config, overrides)
    if args.dry_run:
        return dry_run(cfg, args)
    if (args.nproc or 1) != 1 or args.nnodes != 1:
        raise ConfigError("--nproc/--nnodes plan a --dry-run here; to train on N processes run "
                          "`lmforge train --nproc N` or torchrun")
    info = init_distributed(cfg.train.device)
    setup_logging(info.rank, Path(cfg.log.out_dir) if info.is_main else None)
    try:
        trainer = Trainer(cfg, info)
        signal.signal(signal.SIGTERM, lambda *_: setattr(trainer, "stop_requested", True))
        return trainer.fit()
    except TrainingStopped as e:
        log.error("%s", e)
        return 3
    finally:
        teardown()


def cli_main(argv: list[str]) -> int:
    """`lmforge train [--nproc N] ...`: one process, or torchrun with N processes on this node."""
    p = argparse.ArgumentParser(prog="lmforge train", add_help=False)
    p.add_argument("--nproc", type=int, default=1)
    args, rest = p.parse_known_args(argv)
    if args.nproc <= 1 or "--dry-run" in rest:  # a dry run plans --nproc, it starts nothing
        return main(argv)
    parsed, overrides = parse_args(rest)
    # Config and data mistakes: one line here, not one per rank under a torchrun traceback.
    load_manifest(load_config(parsed.config, overrides).data.path)
    torchrun = shutil.which("torchrun") or sys.executable
    prefix = [torchrun] if torchrun != sys.executable else [sys.executable, "-m", "torch.distributed.run"]
    cmd = prefix + ["--standalone", f"--nproc_per_node={args.nproc}", "-m", "pipeline.train", *rest]
    os.execv(cmd[0], cmd)
    return 0  # unreachable


if __name__ == "__main__":
    from launch.cli import run_user_command

    sys.exit(run_user_command(main, sys.argv[1:]))
