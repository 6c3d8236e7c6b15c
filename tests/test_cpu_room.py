"""CPU-only code lives in pipeline/cpu and a CUDA run never imports it: nothing on the training
path imports it at module level, and the choices a CUDA run makes (compile, attention, loss,
optimizer) leave it unimported. bench/gpu_check.py asserts the same after a real CUDA step."""

from __future__ import annotations

import ast
import subprocess
import sys

from tests.harness import ROOT

PACKAGES = ("model", "data_prep", "pipeline", "launch")
ENTRY_POINTS = tuple(f"lmforge.{m}" for m in ("launch.train", "pipeline.train", "launch.evaluate",
                                                "launch.sample", "launch.export", "pipeline.inference"))


def _module_name(path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(("lmforge", *(parts[:-1] if parts[-1] == "__init__" else parts)))


def module_level_imports() -> dict[str, set[str]]:
    """Each module's imports outside any function (what importing it imports)."""
    graph = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            found = set()
            for node in ast.parse(path.read_text()).body:
                if isinstance(node, ast.Import):
                    found |= {a.name for a in node.names}
                elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                    found.add(node.module)
                    found |= {f"{node.module}.{a.name}" for a in node.names}
            graph[_module_name(path)] = found
    return graph


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        name = todo.pop()
        if name in seen or name not in graph:
            continue
        seen.add(name)
        parents = [".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)]
        todo += [*graph[name], *parents]  # importing a.b.c runs a and a.b first
    return seen


def test_no_module_on_the_training_path_imports_the_cpu_room():
    graph = module_level_imports()
    assert "lmforge.pipeline.cpu.attention" in graph and "lmforge.pipeline.cpu.allocator" in graph
    for entry in ENTRY_POINTS:
        room = sorted(m for m in reachable(graph, entry) if m.startswith("lmforge.pipeline.cpu"))
        assert room == [], f"{entry} imports {room} at module level"


CHOICES = """
import sys, torch
from lmforge.model import GPT, ModelConfig
from lmforge.pipeline import attention
from lmforge.pipeline.config import OptimConfig, TrainConfig
from lmforge.pipeline.loss import build_loss
from lmforge.pipeline.optim.optimizers import build_optimizer
from lmforge.pipeline.parallel.parallelize import resolve_choices
import lmforge.launch.train, lmforge.launch.evaluate, lmforge.launch.sample
import lmforge.pipeline.train, lmforge.pipeline.inference
device, dtype = torch.device(sys.argv[1]), getattr(torch, sys.argv[2])
t = resolve_choices(TrainConfig(), device, dtype, 256, 50304)
attention.kernel(t.attention)
build_loss(t.loss, device)
model = GPT(ModelConfig(vocab_size=64, n_layer=1, d_model=32, n_head=2, n_kv_head=2))
build_optimizer(model, OptimConfig(name="muon"), device)
print(t.compile, t.attention, t.loss, sorted(m for m in sys.modules if m.startswith("lmforge.pipeline.cpu")))
"""


def choices(device: str, dtype: str) -> str:
    return subprocess.run([sys.executable, "-c", CHOICES, device, dtype], cwd=ROOT, check=True,
                          capture_output=True, text=True, timeout=120).stdout.strip()


def test_a_cuda_runs_choices_leave_the_cpu_room_unimported():
    assert choices("cuda", "bfloat16") == "on sdpa full []"


def test_a_cpu_run_takes_its_kernels_from_the_cpu_room():
    # The same script sees the room where a CPU run uses it: the check above can fail.
    assert choices("cpu", "bfloat16") == ("off eager chunked ['lmforge.pipeline.cpu', "
                                          "'lmforge.pipeline.cpu.allocator', 'lmforge.pipeline.cpu.attention']")
