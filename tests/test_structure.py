"""The layering, read from the source with `ast`: `model/` is a pure nn.Module library (no
process groups, no logging, nothing of the training code), `data_prep/` and `pipeline/` are
libraries, and `launch/` is the command line on top of them. An import anywhere in a file counts,
inside a function or under `if __name__ == "__main__":` too, since a lazy import breaks the
layering just the same when that code runs."""

from __future__ import annotations

import ast
import contextlib
import re
from pathlib import Path

import pytest
import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]

# package -> modules it must never import (a prefix forbids its submodules too).
FORBIDDEN = {
    "model": ("lmforge.launch", "lmforge.pipeline", "lmforge.data_prep", "torch.distributed",
              "logging"),
    "data_prep": ("lmforge.launch", "lmforge.pipeline"),
    "pipeline": ("lmforge.launch",),
}
# The product's folders are installed as lmforge.<folder> (pyproject.toml's package-dir), so a
# user's own model.py or pipeline.py can never shadow them.
PRODUCT = ("model", "data_prep", "pipeline", "launch")


def dotted(path: Path) -> str:
    """The import name of a file of the tree: lmforge.pipeline.train for pipeline/train.py."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    parts = parts[:-1] if parts[-1] == "__init__" else parts
    return ".".join(("lmforge", *parts) if parts[0] in PRODUCT else parts)


def imported_modules(source: str, module: str) -> list[tuple[int, str]]:
    """(line, dotted module) of every import in `source`, the file of dotted name `module`:
    import statements, relative ones resolved, and importlib.import_module / __import__ calls
    with a literal name."""
    package = module.split(".")[:-1]
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            parts = [*base, node.module] if node.module else base
            # `from pipeline import train` imports pipeline.train: count the submodules too.
            found += [(node.lineno, ".".join(parts))]
            found += [(node.lineno, ".".join([*parts, alias.name])) for alias in node.names]
        elif (isinstance(node, ast.Call) and node.args
              and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)
              and getattr(node.func, "attr", getattr(node.func, "id", None))
              in ("import_module", "__import__")):
            found.append((node.lineno, node.args[0].value))
    return found


def violations(source: str, module: str) -> list[str]:
    banned = FORBIDDEN[module.split(".")[1]]
    return [f"{module}:{line} imports {name}" for line, name in imported_modules(source, module)
            if any(name == b or name.startswith(b + ".") for b in banned)]


def test_libraries_never_import_the_layers_above_them():
    problems = []
    for package in FORBIDDEN:
        files = sorted((ROOT / package).rglob("*.py"))
        assert files, f"no sources found under {ROOT / package}"
        for path in files:
            problems += violations(path.read_text(encoding="utf-8"), dotted(path))
    assert not problems, "layering broken:\n" + "\n".join(problems)


@pytest.mark.parametrize("module, source", [
    ("lmforge.pipeline.train", "if __name__ == '__main__':\n    from lmforge.launch.cli import run_user_command\n"),
    ("lmforge.pipeline.x", "def f():\n    import lmforge.launch.train\n"),
    ("lmforge.pipeline.x", "from .. import launch\n"),
    ("lmforge.pipeline.x", "import importlib\nimportlib.import_module('lmforge.launch.cli')\n"),
    ("lmforge.model.model", "import torch.distributed as dist\n"),
    ("lmforge.model.model", "from lmforge.pipeline import checkpoint\n"),
    ("lmforge.model.model", "import logging\n"),
    ("lmforge.data_prep.shards", "from lmforge.pipeline.config import ConfigError\n"),
])
def test_the_check_sees_every_form_of_import(module, source):
    assert violations(source, module), source


def test_allowed_imports_pass():
    source = "import torch\nfrom torch import nn\nfrom lmforge.model.model import GPT\nfrom . import generate\n"
    assert not violations(source, "lmforge.model.hf")
    assert not violations("from lmforge.data_prep.shards import load_manifest\n", "lmforge.pipeline.data.loader")


# ---- model/ is a model: no private torch op; pipeline/ never sets attributes on it -----------


MODEL_NAMES = {"model", "module", "gpt", "trained", "sampler"}


def model_attribute_writes(source: str) -> list[int]:
    """Lines where an attribute of something named like a model is assigned (or setattr'd)."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        targets = (node.targets if isinstance(node, ast.Assign) else
                   [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
        for t in targets:
            base = t.value if isinstance(t, ast.Attribute) else None
            if isinstance(base, ast.Attribute) and isinstance(base.value, ast.Name) \
                    and base.value.id == "self":
                base = ast.Name(base.attr)  # self.model.x = ...
            if isinstance(base, ast.Name) and base.id in MODEL_NAMES:
                lines.append(node.lineno)
        if (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setattr"
                and node.args and getattr(node.args[0], "id", None) in MODEL_NAMES):
            lines.append(node.lineno)
    return lines


def private_torch_uses(source: str) -> list[int]:
    """Lines using torch.ops.* or a private torch attribute (torch._x, torch.a._b)."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute):
            chain, inner = [node.attr], node.value
            while isinstance(inner, ast.Attribute):
                chain.append(inner.attr)
                inner = inner.value
            if isinstance(inner, ast.Name) and inner.id == "torch":
                if chain[-1] == "ops" or any(part.startswith("_") for part in chain):
                    lines.append(node.lineno)
    return sorted(set(lines))


def sources(package: str):
    for path in sorted((ROOT / package).rglob("*.py")):
        yield path.relative_to(ROOT), path.read_text(encoding="utf-8")


def test_model_uses_no_private_torch_op():
    found = [f"{path}:{line}" for path, src in sources("model") for line in private_torch_uses(src)]
    assert not found, "private torch ops in model/ (kernel choices belong in pipeline/loss.py): " \
        + ", ".join(found)


def test_pipeline_never_sets_attributes_on_the_model():
    found = [f"{path}:{line}" for path, src in sources("pipeline")
             for line in model_attribute_writes(src)]
    assert not found, "pipeline/ sets model attributes (pass choices explicitly): " + ", ".join(found)


@pytest.mark.parametrize("source, check", [
    ("model.chunked_loss = torch.compiler.disable(model.chunked_loss)\n", model_attribute_writes),
    ("self.model.loss_whole_tokens = 4\n", model_attribute_writes),
    ("setattr(module, 'x', 1)\n", model_attribute_writes),
    ("f = torch.ops.mkldnn._linear_pointwise\n", private_torch_uses),
    ("torch._dynamo.reset()\n", private_torch_uses),
])
def test_the_model_checks_can_fail(source, check):
    assert check(source), source


# ---- the parallel wrapper's contract: mode-specific behaviour stays inside ParallelModel -------


class _SyncRecorder(nn.Module):
    """Stands in for a DDP / FSDP module: records what a micro-step asks of it."""

    def __init__(self):
        super().__init__()
        self.calls: list[str] = []

    def set_requires_gradient_sync(self, sync: bool) -> None:  # FSDP2's persistent switch
        self.calls.append(f"sync={sync}")

    @contextlib.contextmanager
    def no_sync(self):  # DDP's scoped one
        self.calls.append("no_sync enter")
        try:
            yield
        finally:
            self.calls.append("no_sync exit")


@pytest.mark.parametrize("mode, skipped", [
    ("fsdp", ["sync=False", "sync=True"]),
    ("ddp", ["no_sync enter", "no_sync exit"]),
    ("none", []),
])
def test_micro_step_is_scoped_and_restores_syncing_even_on_error(mode, skipped):
    from lmforge.model.model import cross_entropy
    from lmforge.pipeline.parallel.parallelize import ParallelModel, Precision

    pm = ParallelModel(_SyncRecorder(), mode, Precision(torch.float32, torch.device("cpu")),
                       cross_entropy)
    with pytest.raises(RuntimeError, match="inside"), pm.micro_step(sync=False):
        assert pm.module.calls == skipped[:1]  # in force for the forward, not only the backward
        raise RuntimeError("inside")
    assert pm.module.calls == skipped  # FSDP's switch is back on after the micro-step
    with pm.micro_step(sync=True):
        pass
    assert pm.module.calls == skipped  # a syncing micro-step needs nothing of the module


@pytest.mark.parametrize("dtype, autocast", [(torch.bfloat16, True), (torch.float32, False)])
def test_precision_autocasts_a_plain_module_exactly_when_computing_in_bf16(dtype, autocast):
    from lmforge.pipeline.parallel.parallelize import Precision

    with Precision(dtype, torch.device("cpu")).autocast(nn.Linear(2, 2)):
        assert torch.is_autocast_enabled("cpu") is autocast


# ---- the sizes the project set itself, and no import circles -------------------------------------

# Every package of the tree, the benches and the tests included: the rules are the house's, not
# the product's alone.
PACKAGES = ("model", "data_prep", "pipeline", "launch", "bench", "tests")
MAX_FILE_LINES, MAX_FUNCTION_LINES = 600, 60


def project_modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            found[dotted(path)] = path
    return found


def oversized(source: str, where: str) -> list[str]:
    lines = source.count("\n") + (not source.endswith("\n"))
    found = [f"{where}: {lines} lines > {MAX_FILE_LINES}"] if lines > MAX_FILE_LINES else []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            n = node.end_lineno - node.lineno + 1
            if n > MAX_FUNCTION_LINES:
                found.append(f"{where}:{node.lineno} {node.name}: {n} lines > {MAX_FUNCTION_LINES}")
    return found


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def import_graph(sources: dict[str, str]) -> dict[str, set[str]]:
    """module -> the project modules it imports anywhere (lazily and under TYPE_CHECKING too:
    a circle broken only by an import's position is still two modules that need each other)."""
    return {m: {name for _, name in imported_modules(src, m) if name in sources and name != m}
            for m, src in sources.items()}


def test_no_file_or_function_is_past_the_projects_sizes():
    problems = []
    for path in project_modules().values():
        problems += oversized(path.read_text(encoding="utf-8"), str(path.relative_to(ROOT)))
    assert not problems, "split these by responsibility:\n" + "\n".join(problems)


def test_no_import_circles_between_the_projects_modules():
    sources = {m: p.read_text(encoding="utf-8") for m, p in project_modules().items()}
    cycles = import_cycles(import_graph(sources))
    assert not cycles, "modules that import each other:\n" + "\n".join(" <-> ".join(c) for c in cycles)


# Where a product file or the README names its evidence: a bench, a result, a test.
CITED = re.compile(r"\b(?:bench|tests)/[\w./*-]*[\w*]")


def missing_citations(text: str, where: str) -> list[str]:
    return [f"{where}: {path}" for path in CITED.findall(text) if not any(ROOT.glob(path))]


def test_every_file_a_comment_cites_exists():
    """A bench that leaves bench/ (its figures kept in bench/results) leaves no comment naming it."""
    files = [ROOT / "README.md", *(p for d in ("model", "data_prep", "pipeline", "launch", "configs")
                                   for p in sorted((ROOT / d).rglob("*.*")) if p.suffix in (".py", ".toml", ".sh"))]
    missing = [m for f in files for m in missing_citations(f.read_text(encoding="utf-8"), f.name)]
    assert not missing, "cited but not in the tree (cite bench/results instead):\n" + "\n".join(missing)
    assert missing_citations("(bench/gone.py's figure)", "x.py") == ["x.py: bench/gone.py"]


def test_the_size_and_circle_checks_can_fail():
    long_function = "def f():\n" + "    x = 1\n" * MAX_FUNCTION_LINES
    assert oversized(long_function, "x.py") and not oversized("def f():\n    pass\n", "x.py")
    assert oversized("x = 1\n" * (MAX_FILE_LINES + 1), "x.py")
    lazy_circle = {"pipeline.a": "def f():\n    from pipeline.b import g\n",
                   "pipeline.b": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pipeline.a\n",
                   "pipeline.c": "from pipeline import a\n"}
    assert import_cycles(import_graph(lazy_circle)) == [["pipeline.a", "pipeline.b"]]


# ---- every file is opened by data_prep/safe_files.py ---------------------------------------------

# What opens a file by its path, following a link and waiting on a FIFO: `open` and `gzip.open`
# alike (called or passed as a value), Path's reading and writing methods, and the file functions
# of numpy, torch, safetensors, pyarrow, shutil and logging. A bare `read_text(...)` is
# safe_files' own; `.open`, `.read_text` and the like, called on anything, are Path's kind.
OPENERS = {"open", "safe_open", "load_file", "save_file", "FileHandler"}  # as a name or attribute
PATH_METHODS = {"open", "read_text", "read_bytes", "write_text", "write_bytes", "tofile",
                "open_file", "open_stream", "memory_map"}  # as attributes only
QUALIFIED = {"np.memmap", "np.load", "np.save", "np.fromfile", "np.loadtxt", "torch.load",
             "torch.save", "shutil.copy", "shutil.copy2", "shutil.copyfile", "shutil.copytree"}
NOT_A_FILE = {"os.devnull"}  # the null device, opened on purpose
IN_MEMORY = {"io.BytesIO", "BytesIO", "pa.py_buffer", "pa.BufferReader"}

# file -> (the openers it may use, why). An opener no longer used there fails the test.
FILES_OPENED_ELSEWHERE = {
    "pipeline/cpu/machine.py": ({".read_text"}, "/proc/cpuinfo: the kernel's, not input"),
    "launch/cli.py": ({".write_text"}, "a rank's error line, into the launcher's own "
                      "TemporaryDirectory (mode 0700): nothing else writes there"),
    "launch/train.py": ({".read_text"}, "the ranks' error lines, from that same directory"),
    "data_prep/shards.py": ({"np.memmap", "shutil.copytree"}, "maps the file object open_file "
                            "checked; copy_plain_tree: check_tree, then symlinks=True"),
    "pipeline/checkpoint/safe_dcp.py": ({"torch.load"}, "bytes SafeFileSystemReader read"),
    "data_prep/sources.py": ({"open", ".open", ".open_file", ".open_stream"}, "the corpus "
        "(--source) is the user's: links followed on purpose; only regular files are listed "
        "(local_files: is_file), so a FIFO or device is never opened"),
    "launch/export.py": ({".read_text", ".write_text", "shutil.copyfile"}, "files of the fresh "
                         "mkdtemp directory the export is written into, nothing planted there"),
    "model/hf.py": ({"save_file", ".write_text"}, "into the caller's fresh directory (export's "
                    "mkdtemp); model/ may not import data_prep"),
    "pipeline/checkpoint/format.py": ({"torch.save", ".write_text", "save_file"}, "into the "
        ".tmp directory this process has just made (mkdir, never exist_ok), renamed into place"),
    "pipeline/checkpoint/hf_init.py": ({"safe_open"}, "safetensors reads the descriptor "
        "open_fd opened (/proc/self/fd/N): the one safetensors reader"),
}


def file_opens(source: str) -> list[tuple[int, str]]:
    """(line, opener) of each use in `source` of something that opens a file by its path."""
    tree, skip = ast.parse(source), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):  # a subclass (of FileHandler, say) opens nothing itself
            skip |= {id(n) for base in node.bases for n in ast.walk(base)}
        elif isinstance(node, ast.Call) and node.args and not_a_file(node.args[0]):
            skip |= {id(n) for n in ast.walk(node.func)}
    found = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Attribute):
            if ast.unparse(node) in QUALIFIED:
                found.append((node.lineno, ast.unparse(node)))
            elif node.attr in PATH_METHODS:
                found.append((node.lineno, "." + node.attr))
            elif node.attr in OPENERS:
                found.append((node.lineno, node.attr))
        elif isinstance(node, ast.Name) and node.id in OPENERS and isinstance(node.ctx, ast.Load):
            found.append((node.lineno, node.id))
    return found


def not_a_file(arg: ast.expr) -> bool:
    """/dev/null, or bytes already in memory (read by safe_files)."""
    return ast.unparse(arg) in NOT_A_FILE or (isinstance(arg, ast.Call) and ast.unparse(
        arg.func) in IN_MEMORY)


def test_every_file_is_opened_by_safe_files():
    found, needed = [], set()
    for package in PRODUCT:
        for path, src in sources(package):
            if path.as_posix() == "data_prep/safe_files.py":
                continue
            allowed = FILES_OPENED_ELSEWHERE.get(path.as_posix(), (set(), ""))[0]
            for line, opener in file_opens(src):
                needed.add((path.as_posix(), opener)) if opener in allowed else found.append(
                    f"{path}:{line} {opener}")
    assert not found, ("files opened outside data_prep/safe_files.py (open_file, read_text, "
                       "atomic_write_bytes, ...):\n" + "\n".join(found))
    listed = {(path, opener) for path, (openers, _) in FILES_OPENED_ELSEWHERE.items()
              for opener in openers}
    assert needed == listed, f"allowed openers no file uses any more: {listed - needed}"


@pytest.mark.parametrize("source", [
    "open(path)\n", "with open(path, 'rb') as f:\n    pass\n", "Path(p).read_text()\n",
    "run.metrics.open()\n", "p.write_bytes(b'')\n", "np.memmap(p, mode='r')\n",
    "torch.load(p, weights_only=True)\n", "json.load(open(p))\n", "shutil.copyfile(a, b)\n",
    "OPEN = {'.gz': gzip.open}\n", "opener = table.get(suffix, open)\n",
    "safe_open(p, framework='pt')\n", "logging.FileHandler(p)\n", "pa.ipc.open_file(p)\n",
    "os.open(p, os.O_RDONLY)\n", "torch.save(state, tmp / 'rng.pt')\n",
])
def test_the_safe_files_check_sees_every_way_of_opening(source):
    assert file_opens(source), source


def test_what_opens_no_file_passes_the_safe_files_check():
    source = ("from lmforge.data_prep.safe_files import open_file, read_text\n"
              "read_text(p, 10, what='x')\nwith open_file(p) as f:\n    f.read()\n"
              "torch.load(io.BytesIO(data), weights_only=True)\n"
              "null = os.open(os.devnull, os.O_WRONLY)\nx = w.copy()\nself.save()\n")
    assert file_opens(source) == []
