"""kvbench: nccl-tests-style microbenchmarks for KV-cache transfer between prefill and decode."""
__version__ = "0.1.0"
