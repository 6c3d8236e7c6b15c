"""Benchmarks and the GPU check, run from the repository root as modules: `python -m bench.NAME`
(bench/README.md lists them). Each prints ratios against a reference measured in the same run."""
