"""numpy arrays and torch tensors behind one door: codecs work on little-endian bytes.

A torch tensor (CPU, or CUDA where the device layer exists) is read through a
byte view; CPU tensors share memory with the numpy view (no copy), CUDA tensors
are copied to the host, where the numpy reference runs.  Decoded bytes go back
into the caller's tensor in place.
"""
from __future__ import annotations

import numpy as np


def is_torch(x) -> bool:
    return type(x).__module__.startswith("torch")


def as_bytes(x) -> np.ndarray:
    """A flat uint8 numpy view (or host copy, for a device tensor) of ``x``'s bytes."""
    if is_torch(x):
        import torch

        t = x.detach()
        if not t.is_contiguous():
            t = t.contiguous()
        t = t.reshape(-1).view(torch.uint8)
        return (t if t.device.type == "cpu" else t.cpu()).numpy()
    a = np.asarray(x)
    if not a.flags.c_contiguous:
        a = np.ascontiguousarray(a)
    return a.reshape(-1).view(np.uint8)


def write_back(out, data: np.ndarray) -> None:
    """Put ``data`` (uint8) into ``out`` (numpy array or torch tensor) in place."""
    if is_torch(out):
        import torch

        view = out.reshape(-1).view(torch.uint8)
        if view.device.type == "cpu":
            view.numpy()[:] = data
        else:
            view.copy_(torch.from_numpy(data).to(view.device))
        return
    as_bytes(out)[:] = data
