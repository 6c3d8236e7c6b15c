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

import torch
from torch import nn

from data_prep.errors import DataError
from data_prep.shards import load_manifest
from data_prep.tokenizer import eot_id, load_tokenizer_dir, token_byte_lengths
from model import GPT, ModelConfig, generate
from pipeline import checkpoint as ckpt
from pipeline.config import (
    ConfigError,
    JobConfig,
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
from pipeline.metrics import (
    MetricsLogger,
    Progress,
    get_logger,
    peak_flops,
    plot_losses,
    setup_logging,
)
from pipeline.optim import build_optimizer, lr_at, set_lr
from pipeline.parallelize import (
    autocast,
    grad_sync,
    needs_autocast,
    parallelize,
    resolve_compile,
    resolve_parallel,
)

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
    return ckpt.resolve(cfg.checkpoint.resume)


def build_model(model_cfg: ModelConfig, cfg: JobConfig, info: DistInfo) -> tuple[GPT, nn.Module]:
    # Every rank builds the same full model from the same seed before sharding, so the initial
    # weights do not depend on the world size or the parallelism (what parity tests rely on).
    torch.manual_seed(cfg.train.seed)
    model = GPT(model_cfg).to(info.device)
    parallel = resolve_parallel(cfg.train.parallel, info)
    trained = parallelize(
        model,
        info,
        parallel=parallel,
        bf16=cfg.train.dtype == "bf16",
        compile_model=resolve_compile(cfg.train.compile, info.device),
        activation_checkpointing=cfg.train.activation_checkpointing,
    )
    return model, trained


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
        self.cfg, self.info = cfg, info
        self.run_dir = Path(cfg.log.out_dir)
        manifest = load_manifest(cfg.data.path)
        self.model_cfg = model_config_for(cfg, manifest.vocab_size)
        self.derived = derive(cfg, info.world_size)
        self.parallel = resolve_parallel(cfg.train.parallel, info)
        self.bf16 = cfg.train.dtype == "bf16"
        self.amp = needs_autocast(self.parallel, self.bf16)
        resume_from = find_resume(cfg, self.run_dir)

        self.tokenizer_dir = Path(cfg.data.path) / "tokenizer"
        self.tokenizer = load_tokenizer_dir(self.tokenizer_dir)
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

        self.model, self.trained = build_model(self.model_cfg, cfg, info)
        self.optimizer = build_optimizer(self.trained, cfg.optim, info.device)
        self.step, self.bad_steps = 0, 0
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
        self.peak = peak_flops(info.device, torch.bfloat16 if self.bf16 else torch.float32)
        self.flops_per_token = self.model.flops_per_token(seq_len)
        self.stop_requested = False
        self.sampler: GPT | None = None

    def _resume(self, where: Path) -> None:
        meta = ckpt.read_meta(where)
        ckpt.check_same_model(meta, self.model_cfg, where)
        ckpt.load_training(where, self.trained, self.optimizer, self.info)
        self.loader.load_state_dict(meta["loader"])
        self.step, self.bad_steps = int(meta["step"]), int(meta["bad_steps"])
        log.info("resumed from %s at step %d (written by %d ranks)", where, self.step, meta["world_size"])

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
            x_BT, y_BT = x_BT.to(info.device, non_blocking=True), y_BT.to(info.device, non_blocking=True)
            with grad_sync(self.trained, self.parallel, sync=i == len(micro_batches) - 1):
                with autocast(info.device, self.amp):
                    loss = self.trained(x_BT, y_BT, reduction="sum")
                (loss / tokens_per_rank).backward()
            loss_sum += loss.detach().double()
        totals = torch.stack([loss_sum, torch.tensor(float(self.stop_requested), dtype=torch.float64, device=info.device)])
        all_reduce_sum(totals, info)
        mean_loss = totals[0].item() / cfg.train.global_batch_tokens
        stop = totals[1].item() > 0
        max_norm = cfg.optim.grad_clip if cfg.optim.grad_clip > 0 else math.inf
        grad_norm = torch.nn.utils.clip_grad_norm_(self.trained.parameters(), max_norm)
        grad_norm = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)
        if math.isfinite(mean_loss) and math.isfinite(grad_norm):
            self.optimizer.step()
            self.bad_steps = 0
        else:
            self.bad_steps += 1
            log.warning("step %d: non-finite loss/grad (%s, %s): update skipped", self.step + 1, mean_loss, grad_norm)
        self.optimizer.zero_grad(set_to_none=True)
        return mean_loss, grad_norm, stop

    # ---- hooks ------------------------------------------------------------------------------

    def run_eval(self) -> dict:
        result = evaluate(self.trained, self.val, self.token_bytes, self.info, bf16=self.amp)
        return {"val_loss": result.loss, "val_ppl": result.perplexity, "val_bpb": result.bits_per_byte}

    def run_samples(self) -> list[str]:
        """Rank 0 generates from an unsharded eager copy (all ranks join the weight gather)."""
        state = ckpt.full_model_state(self.trained)
        if not self.info.is_main:
            return []
        if self.sampler is None:
            self.sampler = GPT(self.model_cfg).to(self.info.device)
        self.sampler.load_state_dict(state, strict=False)
        sc = self.cfg.sample
        # Documents start with end-of-text in the shards, so prompts do too (as lmforge sample).
        eot = eot_id(self.tokenizer)
        prompts = [[eot, *self.tokenizer.encode_ordinary(p)] for p in sc.prompts]
        max_new = min(sc.max_new_tokens, self.model_cfg.max_seq_len - max(len(p) for p in prompts))
        with autocast(self.info.device, self.bf16):
            outs = generate(
                self.sampler, prompts, max_new, temperature=sc.temperature, top_k=sc.top_k or None,
                top_p=sc.top_p, seed=self.cfg.train.seed, stop_token=eot,
            )
        return [p + self.tokenizer.decode(o) for p, o in zip(sc.prompts, outs, strict=True)]

    def save(self) -> Path:
        meta = {
            "model": self.model_cfg.to_dict(),
            "config": config_to_dict(self.cfg),
            "loader": self.loader.state_dict(),
            "bad_steps": self.bad_steps,
            "parallel": self.parallel,
        }
        return ckpt.save_training(
            self.run_dir, self.step, self.trained, self.optimizer, meta, self.tokenizer_dir,
            self.info, self.cfg.checkpoint.keep,
        )

    def export_final(self) -> Path:
        state = ckpt.full_model_state(self.trained)
        out = self.run_dir / "final"
        if self.info.is_main:
            meta = {"step": self.step, "model": self.model_cfg.to_dict(), "config": config_to_dict(self.cfg)}
            ckpt.save_consolidated(out, state, meta, self.tokenizer_dir, self.model_cfg)
        return out

    # ---- the loop ---------------------------------------------------------------------------

    def fit(self) -> int:
        cfg, info = self.cfg, self.info
        if info.is_main:
            log.info("%s", self.model.summary())
            log.info("%s", describe(cfg, self.derived, self.model.num_params()))
            log.info("parallel=%s world=%d device=%s dtype=%s", self.parallel, info.world_size, info.device, cfg.train.dtype)
        progress = Progress(cfg.train.max_steps, cfg.log.log_every, info.is_main, start_step=self.step)
        step_tokens = cfg.train.global_batch_tokens
        while self.step < cfg.train.max_steps:
            set_lr(self.optimizer, lr := lr_at(self.step, cfg.train.max_steps, cfg.optim))
            t0 = time.perf_counter()
            loss, grad_norm, stop = self.train_step()
            if info.device.type == "cuda":
                torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            self.step += 1
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
            last = self.step == cfg.train.max_steps or stop
            if due(self.step, cfg.eval.every, last):
                record |= self.run_eval()
                log.info("step %d: val loss %.4f, ppl %.2f, bpb %.4f", self.step, record["val_loss"], record["val_ppl"], record["val_bpb"])
            if due(self.step, cfg.sample.every, last):
                record["samples"] = self.run_samples()
                for text in record["samples"]:
                    log.info("sample: %r", text)
            if due(self.step, cfg.log.log_every, last) or "val_loss" in record:
                self.metrics.log(self.step, **record)
            if due(self.step, cfg.checkpoint.every, last):
                path = self.save()
                log.info("checkpoint %s", path)
            if stop:
                log.info("stop requested (SIGTERM): checkpoint saved at step %d, exiting", self.step)
                break
        progress.close()
        if self.step == cfg.train.max_steps:
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
    args, overrides = p.parse_known_args(argv)
    if args.resume:
        overrides += ["--checkpoint.resume", args.resume]
    return args, overrides


def main(argv: list[str] | None = None) -> int:
    args, overrides = parse_args(list(sys.argv[1:] if argv is None else argv))
    cfg = load_config(args.config, overrides)
    if args.dry_run:
        print(to_toml(cfg))
        print(describe(cfg, derive(cfg, int(os.environ.get("WORLD_SIZE", "1"))), count_params(cfg)))
        return 0
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
    if args.nproc <= 1:
        return main(rest)
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
