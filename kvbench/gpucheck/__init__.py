"""make gpu-check: the device layer measured on one GPU machine in about 5 minutes (docs/gpu.md)."""
