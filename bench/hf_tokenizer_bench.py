"""What exactness with `tokenizers` costs an `hf:DIR` tokenizer (data_prep/encoding.py).

For each tokenizer.json shape of tests/hf_tok_shapes.py (built here with `tokenizers`): encode
throughput of lmforge's Encoding against the same ranks and pattern through plain tiktoken (the
reference: what the Encoding costs on top), and `tokenizers` itself, on the same documents, best
of --reps, in one process. Then the conversion's cost: CPU seconds of reading each tokenizer.json
(bpe_ranks' merge check included), and of GPT-2's 50,257-id vocabulary as lmforge's own
`export --hf` writes it (transformers' TikTokenConverter: 108,299 merges), where transformers is
installed.

usage: python -m bench.hf_tokenizer_bench [--docs N] [--reps R]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import tiktoken

from bench.common import GPT2_VOCAB, header


def best(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    from tokenizers import Tokenizer

    from lmforge.data_prep.hf_tokenizer import read_hf_tokenizer
    from lmforge.data_prep.tokenizer import load_tokenizer
    from tests.hf_dirs import corpus
    from tests.hf_tok_shapes import SHAPES, make_shape

    p = argparse.ArgumentParser()
    p.add_argument("--docs", type=int, default=400)
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args()
    texts = corpus(args.docs)
    mb = sum(len(t.encode()) for t in texts) / 1e6
    print(header())
    print(f"{args.docs} builtin:pystdlib documents, {mb:.2f} MB, best of {args.reps}")
    with tempfile.TemporaryDirectory() as tmp:
        for shape in SHAPES:
            d = make_shape(Path(tmp) / shape, shape)
            cpu = time.process_time()
            read_hf_tokenizer(d)
            cpu = time.process_time() - cpu
            enc = load_tokenizer(f"hf:{d}")
            plain = tiktoken.Encoding(name="plain", pat_str=enc._pat_str,
                                      mergeable_ranks=enc._mergeable_ranks,
                                      special_tokens=enc._special_tokens)
            hf = Tokenizer.from_file(str(d / "tokenizer.json"))
            hf.encode_special_tokens = True
            ours = best(lambda: [enc.encode_ordinary(t) for t in texts], args.reps)
            ref = best(lambda: [plain.encode_ordinary(t) for t in texts], args.reps)
            theirs = best(lambda: [hf.encode(t, add_special_tokens=False) for t in texts], args.reps)
            print(f"{shape:9s} lmforge {mb / ours:5.2f} MB/s  plain tiktoken {mb / ref:5.2f} MB/s  "
                  f"tokenizers {mb / theirs:5.2f} MB/s  lmforge/plain {ref / ours:4.2f}x  "
                  f"read {cpu:.2f} s CPU ({enc.n_vocab} ids)")
        gpt2_read_cost(Path(tmp) / "gpt2")


def gpt2_read_cost(out: Path) -> None:
    import json

    from lmforge.data_prep.hf_tokenizer import read_hf_tokenizer
    from lmforge.data_prep.tokenizer import load_tokenizer, save_tokenizer_dir
    from lmforge.launch.export import save_hf_tokenizer

    try:
        import transformers  # noqa: F401
    except ImportError:
        print("gpt2: transformers not installed, conversion cost not measured")
        return
    save_tokenizer_dir(load_tokenizer(str(GPT2_VOCAB)), out / "tiktoken", "file", "gpt2")
    save_hf_tokenizer(out / "tiktoken", out, 1024)
    cpu = time.process_time()
    spec = read_hf_tokenizer(out)
    merges = len(json.loads((out / "tokenizer.json").read_text())["model"]["merges"])
    print(f"gpt2 as exported ({len(spec.ranks)} ranks, {merges} merges): read "
          f"{time.process_time() - cpu:.2f} s CPU")


if __name__ == "__main__":
    main()
