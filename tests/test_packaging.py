"""The installed import names: the repository's folders install as lmforge.<folder>, so lmforge
runs from a user's project directory that holds its own model.py, pipeline.py, launch.py or
data_prep.py (`python -m` and torchrun put the working directory first on sys.path)."""

from __future__ import annotations

import sys
from pathlib import Path

import tomllib

from tests.harness import ROOT, TINY_ARGS, run

PRODUCT = ("model", "data_prep", "pipeline", "launch")


def test_every_package_folder_installs_under_lmforge():
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {".".join(p.parent.relative_to(ROOT).parts) for top in PRODUCT
               for p in (ROOT / top).rglob("__init__.py")}
    assert set(tool["packages"]) == {f"lmforge.{f}" for f in folders}
    assert tool["package-dir"] == {f"lmforge.{top}": top for top in PRODUCT}


def user_project(tmp_path: Path) -> Path:
    """A project directory whose own modules, if imported, end the process with a message."""
    proj = tmp_path / "myproject"
    proj.mkdir()
    for name in PRODUCT:
        (proj / f"{name}.py").write_text(f"raise SystemExit('the user\\'s {name}.py was imported')\n")
    return proj


def test_training_eval_and_sample_run_from_a_directory_holding_model_py(tiny_data, tmp_path):
    proj, out = user_project(tmp_path), tmp_path / "run"
    lmforge = [sys.executable, "-m", "lmforge.launch.cli"]
    args = ["--data.path", str(tiny_data), "--log.out_dir", str(out), *TINY_ARGS,
            "--train.max_steps", "2", "--eval.every", "0", "--checkpoint.every", "0"]
    # `--nproc 2` starts torchrun's agent, whose workers run `-m lmforge.launch.train` here.
    res = run([*lmforge, "train", "--nproc", "2", *args], timeout=300, cwd=proj)
    assert res.returncode == 0 and "was imported" not in res.stdout, res.stdout[-3000:]
    for cmd in (["eval", "--ckpt", str(out), "--data", str(tiny_data)],
                ["sample", "--ckpt", str(out), "--prompt", "def", "--max-new-tokens", "4"]):
        res = run([*lmforge, *cmd], timeout=180, cwd=proj)
        assert res.returncode == 0 and "was imported" not in res.stdout, res.stdout[-3000:]
    # The same directory without the fix's names: the shadowing this test guards against is real.
    res = run([sys.executable, "-c", "import pipeline"], timeout=60, cwd=proj)
    assert res.returncode != 0 and "the user's pipeline.py was imported" in res.stdout
