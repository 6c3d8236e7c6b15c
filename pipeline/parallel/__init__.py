"""Distribution applied from outside the model: process groups, DDP / FSDP2 and compile (parallelize), the meta-device build, the memory and traffic plan."""
