"""CPU-only code, each piece selected by one rule (pipeline.attention, .hardware, .optim,
.parallel) and imported only when the device is a CPU: a CUDA run never imports this package
(tests/test_cpu_room.py)."""
