"""make gpu-check: the GPU half checked on one GPU machine, bare CUDA image and no network, in at most 8 minutes; --device cpu rehearses it on torch-cpu pools (docs/gpu.md)."""
