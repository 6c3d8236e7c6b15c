"""What a checkpoint costs the training loop, synchronous vs checkpoint.async_save, on CPU.

    python -m bench.checkpoint_stall                          # 51M params, 3 interleaved rounds
    python -m bench.checkpoint_stall --d-model 128 --n-layer 2 --rounds 1   # a quick look

One process runs the trainer's own step (pipeline.train.Trainer.train_step: fp32, AdamW) and its
checkpointer (pipeline.checkpoint.async_writer.Checkpointer), a synchronous and a background one in the
same process, rounds interleaved (sync, async, sync, ...) so that both see the same machine.
sync stall: the saving step's time minus a plain step's (median of the round's plain steps).
async stall: the same for the step that starts the save (it stages the state to host memory),
plus what the steps run while the write is in flight lose against a plain step (the background
thread shares the cores), until the write is done.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

from bench.common import add_model_args, emit, header
from bench.fsdp_memory import write_data


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def one_round(trainer, sync, background, plain_steps: int) -> dict[str, float]:
    plain = statistics.median(timed(trainer.train_step) for _ in range(plain_steps))
    trainer.step += 1

    def save(ckpt):
        trainer.step += 1
        return ckpt.save(trainer.run_dir, trainer.parallel.module, trainer.optimizer,
                         trainer.meta(with_loader=True), trainer.data.tokenizer_dir, keep=1)

    sync_s = timed(lambda: (trainer.train_step(), save(sync)))
    start = time.perf_counter()
    async_s = timed(lambda: (trainer.train_step(), save(background)))
    overlapped, lost = 0, 0.0
    while background.in_flight is not None and not background.in_flight.future.done():
        lost += timed(trainer.train_step) - plain
        overlapped += 1
    write_s = time.perf_counter() - start
    background.wait()
    return {"plain": plain, "sync_stall": sync_s - plain, "async_call": async_s - plain,
            "async_stall": async_s - plain + lost, "overlapped_steps": overlapped,
            "write_s": write_s}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--plain-steps", type=int, default=3)
    add_model_args(p, d_model=768, n_layer=8, n_head=12)
    a = p.parse_args()
    os.environ.setdefault("WANDB_MODE", "disabled")
    from lmforge.pipeline.checkpoint.async_writer import Checkpointer
    from lmforge.pipeline.config import load_config
    from lmforge.pipeline.parallel.distributed import DistInfo
    from lmforge.pipeline.train import Trainer

    info = DistInfo(0, 0, 1, __import__("torch").device("cpu"))
    with tempfile.TemporaryDirectory() as tmp:
        data = a.data or write_data(a, Path(tmp))
        cfg = load_config(None, [
            f"--data.path={data}", f"--log.out_dir={tmp}/run", f"--data.seq_len={a.seq_len}",
            f"--model.vocab_size={a.vocab}", f"--model.d_model={a.d_model}",
            f"--model.n_layer={a.n_layer}", f"--model.n_head={a.n_head}",
            f"--model.n_kv_head={a.n_head}", f"--model.max_seq_len={a.seq_len}",
            f"--train.micro_batch_size={a.micro_batch}",
            f"--train.global_batch_tokens={a.seq_len * a.micro_batch}", "--train.dtype=fp32",
            "--train.compile=off", "--train.parallel=none", "--train.max_steps=100000",
            "--eval.every=0", "--sample.every=0"])
        trainer = Trainer(cfg, info)
        sync, background = Checkpointer(info, False), Checkpointer(info, True)
        trainer.train_step()  # warm-up; the optimizer state exists from here on
        rounds = [one_round(trainer, sync, background, a.plain_steps) for _ in range(a.rounds)]
        n_params = trainer.model.num_params()
    lines = [header(),
             f"# {n_params / 1e6:.1f}M params (d{a.d_model} L{a.n_layer} V{a.vocab}), fp32, AdamW, "
             f"1 process, {a.micro_batch} x {a.seq_len} tokens/step; checkpoint to a temp dir",
             f"{'round':>5}{'plain ms':>10}{'sync stall ms':>15}{'async call ms':>15}"
             f"{'async stall ms':>16}{'steps during write':>20}{'write s':>9}"]
    for i, r in enumerate(rounds):
        lines.append(f"{i + 1:>5}{r['plain'] * 1e3:>10.0f}{r['sync_stall'] * 1e3:>15.0f}"
                     f"{r['async_call'] * 1e3:>15.0f}{r['async_stall'] * 1e3:>16.0f}"
                     f"{r['overlapped_steps']:>20}{r['write_s']:>9.2f}")
    med = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
    lines.append(f"median: plain step {med['plain'] * 1e3:.0f} ms; sync stall "
                 f"{med['sync_stall'] * 1e3:.0f} ms ({med['sync_stall'] / med['plain']:.2f}x a step), "
                 f"async stall {med['async_stall'] * 1e3:.0f} ms "
                 f"({med['async_stall'] / med['plain']:.2f}x a step; the saving step itself "
                 f"{med['async_call'] * 1e3:.0f} ms)")
    emit(lines, a.out)


if __name__ == "__main__":
    main()
