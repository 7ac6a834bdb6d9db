"""Element types of a KV cache or a layer's state: name -> bytes per element (shapes.py re-exports both)."""
from __future__ import annotations

DTYPES: dict[str, int] = {"fp32": 4, "fp16": 2, "bf16": 2, "fp8-e4m3": 1, "fp8-e5m2": 1}


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of a KV dtype name."""
    try:
        return DTYPES[dtype]
    except KeyError:
        raise ValueError(f"dtype '{dtype}' is not one of: {', '.join(DTYPES)}") from None
