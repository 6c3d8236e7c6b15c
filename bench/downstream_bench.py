"""Downstream task scoring speed: ours (pipeline/tasks/score.py: shared-prefix KV cache, head on
the scored positions, length-sorted batches) against lm-evaluation-harness's HF backend on the
`lmforge export` of the same checkpoint: the same examples, the same machine, one run, fp32.

    python -m bench.downstream_bench --ckpt runs/demo/run [--tasks hellaswag,arc_easy,piqa]
        [--max-examples 200] [--lm-eval-batch 32]

Both sides score every choice of every example; the figure is examples per second. lm-eval runs
at --lm-eval-batch requests per forward (its default is 1; a larger batch is the fair match).
The two sides' acc/acc_norm are printed too (they must agree).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from bench.common import header
from lmforge.data_prep.tokenizer import load_tokenizer_dir
from lmforge.pipeline.inference import load_for_inference
from lmforge.pipeline.parallel.distributed import DistInfo
from lmforge.pipeline.parallel.parallelize import Precision
from lmforge.pipeline.tasks.evaluate import load_task, timed_evaluate


def write_jsonl(task, path: Path) -> str:
    """A task's examples as lm-eval's custom task reads them: the choices as the task lists them
    (acc_norm divides by their length) and the delimiter before them, returned (" " for the
    named tasks). One shared context per example: not for WinoGrande."""
    with path.open("w") as f:
        for ex in task.examples:
            conts = [c for _, c in ex.requests]
            choices = [c[len(c) - n:] for c, n in zip(conts, ex.norm_chars)]
            f.write(json.dumps({"context": ex.requests[0][0], "gold": ex.gold,
                                "choices": choices}) + "\n")
    return conts[0][:len(conts[0]) - ex.norm_chars[0]]


def lm_eval_run(hf_dir: Path, files: dict[str, tuple[Path, str]], batch: int, root: Path):
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    for name, (f, delimiter) in files.items():
        (root / f"{name}.yaml").write_text(
            f"task: bench_{name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {f}\n"
            "output_type: multiple_choice\ntest_split: test\ndoc_to_text: context\n"
            f"doc_to_choice: choices\ndoc_to_target: gold\ntarget_delimiter: {json.dumps(delimiter)}\n"
            "metric_list:\n  - metric: acc\n  - metric: acc_norm\n")
    lm = HFLM(pretrained=str(hf_dir), device="cpu", batch_size=batch, dtype="float32")
    t0 = time.perf_counter()
    out = simple_evaluate(model=lm, tasks=[f"bench_{n}" for n in files],
                          task_manager=TaskManager(include_path=str(root)))
    return out["results"], time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ckpt", required=True)
    p.add_argument("--tasks", default="hellaswag,arc_easy,piqa")
    p.add_argument("--max-examples", type=int, default=200)
    p.add_argument("--lm-eval-batch", type=int, default=32)
    args = p.parse_args()
    from lmforge.launch.export import main as export

    ckpt = load_for_inference(args.ckpt)
    enc = load_tokenizer_dir(ckpt.tokenizer_dir)
    tasks = [load_task(s, Path(ckpt.meta.config.data.first_path), args.max_examples)
             for s in args.tasks.split(",")]
    n = sum(len(t.examples) for t in tasks)
    info = DistInfo(0, 0, 1, torch.device("cpu"))
    ours, rate = timed_evaluate(ckpt.model, tasks, enc, info,
                                Precision.resolve("fp32", info.device))
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        assert export(["--ckpt", args.ckpt, "--hf", str(root / "hf")]) == 0
        files = {t.name: (root / f"{t.name}.jsonl", "") for t in tasks}
        for t in tasks:
            files[t.name] = (files[t.name][0], write_jsonl(t, files[t.name][0]))
        theirs, seconds = lm_eval_run(root / "hf", files, args.lm_eval_batch, root)
    print(header())
    print(f"model: {ckpt.path}, {ckpt.model.num_params():,} parameters, d_model "
          f"{ckpt.config.d_model}, {ckpt.config.n_layer} layers, vocab {ckpt.config.vocab_size}, "
          f"fp32, {torch.get_num_threads()} threads; {n} examples of {args.tasks}")
    for t in tasks:
        r, q = ours[t.name], theirs[f"bench_{t.name}"]
        print(f"  {t.name:<12} ours acc {r.acc:.4f} acc_norm {r.acc_norm:.4f} | lm-eval acc "
              f"{q['acc,none']:.4f} acc_norm {q['acc_norm,none']:.4f}  (n {r.n})")
    print(f"ours     {rate:8.1f} examples/s")
    print(f"lm-eval  {n / seconds:8.1f} examples/s (HF backend, batch_size {args.lm_eval_batch})")
    print(f"ratio    {rate * seconds / n:8.2f}x")


if __name__ == "__main__":
    main()
