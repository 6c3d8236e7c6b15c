"""CPU-only code: the eager attention the CPU demo computes with where bf16 is native, the CPU's
facts (ISA flags, measured matmul peak) and glibc malloc's policy. Selected by one rule each
(pipeline.attention, pipeline.hardware, pipeline.optim.optimizers, pipeline.parallel.parallelize), imported only when
the device is a CPU: a CUDA run never imports this package (tests/test_cpu_room.py)."""
