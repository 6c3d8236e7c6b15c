"""Downstream task scoring: its speed against lm-evaluation-harness, and its memory against the
same run or eval without tasks.

    python -m bench.downstream_bench --ckpt runs/demo/run [--tasks hellaswag,arc_easy,piqa]
        [--max-examples 200] [--lm-eval-batch 32]
    python -m bench.downstream_bench --rss DATA [--hf]

Speed: ours (pipeline/tasks/score.py: shared prefixes, the head on the scored positions by
chunks, length-sorted batches) against lm-eval's HF backend on the `lmforge export` of the same
checkpoint: the same examples, the same machine, one run, fp32. Both sides score every choice of
every example; the figure is examples per second. lm-eval runs at --lm-eval-batch requests per
forward (its default is 1; a larger batch is the fair match). The two sides' acc/acc_norm are
printed too (they must agree).

Memory (--rss DATA, a dataset prepared at GPT-2's vocabulary): the peak RSS of shape A, a 4-step
`train --config configs/tiny.toml` with its default task (nextline) over the same run with
`--eval.tasks []`, and of `eval --tasks nextline --max-examples 100` over `eval` alone (the run's
16,384 val tokens) on its checkpoint. --hf: the same eval pair on a random 49,152-id Llama saved
by transformers and loaded with `--ckpt hf:` (the tasks as a JSONL file of DATA's questions).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.common import exit_on_sigterm, header
from lmforge.data_prep.tokenizer import load_tokenizer_dir
from lmforge.pipeline.inference import load_for_inference
from lmforge.pipeline.parallel.distributed import DistInfo
from lmforge.pipeline.parallel.parallelize import Precision
from lmforge.pipeline.tasks.evaluate import encode_task, load_task, timed_evaluate


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


SHAPE_A = ["--config", "configs/tiny.toml", "--train.global_batch_tokens", "2048",
           "--train.micro_batch_size", "8", "--train.max_steps", "4", "--eval.every", "0",
           "--sample.every", "0", "--train.compile", "off", "--checkpoint.every", "0"]
# The command in a process that prints its own peak RSS as it exits (ru_maxrss would carry this
# process's over the exec).
PEAK_SHIM = ("import atexit, runpy, sys; atexit.register(lambda: print('PEAK_KB', next(ln.split()[1] "
             "for ln in open('/proc/self/status') if ln.startswith('VmHWM')), file=sys.stderr)); "
             "sys.argv[0] = 'lmforge'; runpy.run_module('lmforge.launch.cli', run_name='__main__')")


def peak_mb(*args: str) -> float:
    """Peak RSS of `lmforge ARGS` in a fresh process."""
    res = subprocess.run([sys.executable, "-c", PEAK_SHIM, *args], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-3000:]
    return int(res.stderr.rsplit("PEAK_KB", 1)[1].split()[0]) / 1024


def ratio_line(what: str, with_tasks: float, without: float) -> str:
    return f"{what:<58} {with_tasks:6.0f} MB / {without:6.0f} MB = {with_tasks / without:.2f}x"


def hf_llama(out: Path, data: Path, vocab: int = 49152) -> Path:
    """A random Llama of `vocab` ids (d_model 256, 4 layers) with a byte-level BPE tokenizer.json
    of as many: the 256 byte symbols, then pairs of them (each one merge), then end-of-text."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    pairs = [(a, b) for a in alphabet for b in alphabet][:vocab - 1 - len(alphabet)]
    ids = {t: i for i, t in enumerate([*alphabet, *(a + b for a, b in pairs), "<|endoftext|>"])}
    tok = Tokenizer(models.BPE(ids, pairs))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>"])
    out.mkdir(parents=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=256, intermediate_size=768,
                                   num_hidden_layers=4, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=256,
                                   tie_word_embeddings=True, eos_token_id=vocab - 1)
    transformers.LlamaForCausalLM(cfg).save_pretrained(out)
    from lmforge.launch.prepare import main as prepare

    assert prepare(["--source", "builtin:pystdlib", "--tokenizer", f"hf:{out}", "--out", str(data),
                    "--max-docs", "200", "--val-docs", "40", "--quiet"]) == 0
    return out


def rss_main(data: Path, hf: bool) -> None:
    print(header())
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        run = ["train", *SHAPE_A, "--data.path", str(data)]
        train_a = peak_mb(*run, "--log.out_dir", str(root / "a"))
        train_b = peak_mb(*run, "--eval.tasks", "[]", "--log.out_dir", str(root / "b"))
        evals = ["eval", "--ckpt", str(root / "a")]
        eval_tasks = peak_mb(*evals, "--tasks", "nextline", "--max-examples", "100")
        eval_alone = peak_mb(*evals, "--data", str(data), "--max-tokens", "16384")
        print(ratio_line("shape A train, eval.tasks [nextline] / []", train_a, train_b))
        print(ratio_line("eval --tasks nextline --max-examples 100 / eval", eval_tasks, eval_alone))
        if hf:
            llama = hf_llama(root / "hf", root / "hf_data")
            task = load_task("nextline", root / "hf_data", 100)
            write_jsonl(task, root / "nextline.jsonl")
            evals = ["eval", "--ckpt", f"hf:{llama}"]
            eval_tasks = peak_mb(*evals, "--tasks", str(root / "nextline.jsonl"))
            eval_alone = peak_mb(*evals, "--data", str(root / "hf_data"), "--max-tokens", "16384")
            print(ratio_line("hf: Llama, 49,152 ids: eval --tasks (100 questions) / eval",
                             eval_tasks, eval_alone))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rss", type=Path, default=None, metavar="DATA")
    p.add_argument("--hf", action="store_true")
    p.add_argument("--ckpt")
    p.add_argument("--tasks", default="hellaswag,arc_easy,piqa")
    p.add_argument("--max-examples", type=int, default=200)
    p.add_argument("--lm-eval-batch", type=int, default=32)
    args = p.parse_args()
    exit_on_sigterm()
    if args.rss:
        return rss_main(args.rss, args.hf)
    from lmforge.launch.export import main as export

    ckpt = load_for_inference(args.ckpt)
    enc = load_tokenizer_dir(ckpt.tokenizer_dir)
    tasks = [encode_task(load_task(s, Path(ckpt.meta.config.data.first_path), args.max_examples),
                         enc, ckpt.config.max_seq_len) for s in args.tasks.split(",")]
    n = sum(len(t.examples) for t in tasks)
    info = DistInfo(0, 0, 1, torch.device("cpu"))
    ours, rate = timed_evaluate(ckpt.model, tasks, info, Precision.resolve("fp32", info.device))
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
