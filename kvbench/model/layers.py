"""Layer kinds of a hybrid model: their order, their checks, and the bytes each kind moves.

* full attention: KV per token (shapes.py's arithmetic);
* sliding-window attention: the same KV per token, for at most ``window`` tokens: a prompt longer than the
  window moves only the window's last tokens for those layers;
* linear attention / state space: a fixed state per request per layer, the recurrent state
  (state_heads x state_k_dim x state_v_dim of ``state_dtype``) plus the convolution state
  ((conv_kernel - 1) x conv_dim of ``conv_dtype``), whatever the prompt length.

Order: the counts are laid out in g = gcd(counts) equal groups, each group its linear layers first, then its
sliding ones, then its full ones.  That is Qwen3-Next's order (3 linear, then 1 full, repeated) and
gpt-oss's (sliding, full, repeated); an attention-only model is all full.
"""
from __future__ import annotations

import math

import numpy as np

from kvbench.model.dtypes import DTYPES, dtype_bytes

KINDS = ("full", "sliding", "linear")


def check_kinds(m) -> None:
    """One-line ValueError when the kinds of ``m`` (a shapes.ModelShape) do not add up or a state is not
    described."""
    for name in ("sliding_layers", "window", "linear_layers", "state_heads", "state_k_dim", "state_v_dim",
                 "conv_kernel", "conv_dim"):
        if getattr(m, name) < 0:
            raise ValueError(f"{name} {getattr(m, name)} is negative")
    if m.sliding_layers + m.linear_layers > m.layers:
        raise ValueError(f"layer kinds do not add up: {m.sliding_layers} sliding + {m.linear_layers} linear "
                         f"layers are more than the model's {m.layers} layers")
    if m.sliding_layers and not m.window:
        raise ValueError(f"{m.sliding_layers} sliding layers need a window > 0 (tokens each keeps)")
    if m.linear_layers:
        if not (m.state_heads and m.state_k_dim and m.state_v_dim):
            raise ValueError(f"{m.linear_layers} linear layers need state_heads, state_k_dim and state_v_dim > 0")
        if m.conv_dim and m.conv_kernel < 1:
            raise ValueError(f"a convolution state of {m.conv_dim} channels needs conv_kernel >= 1")
    for name in ("state_dtype", "conv_dtype"):
        if getattr(m, name) not in DTYPES:
            raise ValueError(f"{name} '{getattr(m, name)}' is not one of: {', '.join(DTYPES)}")


def layer_kinds(m) -> list[str]:
    """The kind of each layer, in the model's order (module docstring)."""
    counts = {"linear": m.linear_layers, "sliding": m.sliding_layers, "full": m.full_layers}
    g = math.gcd(*counts.values())
    group = [k for k, n in counts.items() for _ in range(n // g)]
    return group * g


def state_layer_bytes(m) -> int:
    """Bytes of one linear layer's state of one request: recurrent state + convolution state."""
    if not m.linear_layers:
        return 0
    rec = m.state_heads * m.state_k_dim * m.state_v_dim * dtype_bytes(m.state_dtype)
    conv = max(0, m.conv_kernel - 1) * m.conv_dim * dtype_bytes(m.conv_dtype)
    return rec + conv


def window_tokens(m, ntok: int) -> int:
    """Tokens a sliding layer moves of ``ntok`` transferred ones: the last ``window`` of them."""
    return min(m.window, ntok) if m.sliding_layers else 0


def parts(m, dtype: str, ntok: int) -> dict[str, int]:
    """Bytes of one request apart, for ``ntok`` transferred tokens: full-attention KV, sliding windows, states."""
    per_layer_token = m.regions * m.row_elems * dtype_bytes(dtype) + m.indexer_bytes if m.attn_layers else 0
    return {"kv": m.full_layers * per_layer_token * ntok,
            "window": m.sliding_layers * per_layer_token * window_tokens(m, ntok),
            "state": m.linear_layers * state_layer_bytes(m)}


def moved_bytes(m, dtype: str, ntok) -> int:
    """``parts`` summed over requests moving ``ntok`` tokens each (an array; one numpy pass, no loop per request)."""
    ntok = np.asarray(ntok, dtype=np.int64)
    per_layer_token = m.regions * m.row_elems * dtype_bytes(dtype) + m.indexer_bytes if m.attn_layers else 0
    window = int(np.minimum(ntok, m.window).sum()) if m.sliding_layers else 0
    return (m.full_layers * per_layer_token * int(ntok.sum()) + m.sliding_layers * per_layer_token * window
            + m.linear_layers * state_layer_bytes(m) * len(ntok))


def window_blocks(m, ntok: int, block_size: int) -> tuple[int, int]:
    """(first block, bytes skipped in it) of a sliding layer's window among a request's ``ntok`` tokens' blocks:
    the window is the last ``window_tokens`` tokens, starting inside block ``first``."""
    start = ntok - window_tokens(m, ntok)
    return start // block_size, start % block_size


def descriptors(m, ntok: int, block_size: int) -> int:
    """Descriptors of one request, uncoalesced: one per block and region of a full layer, of a sliding layer's
    window, and one per linear layer (its state)."""
    nb = -(-ntok // block_size)
    first, _ = window_blocks(m, ntok, block_size)
    return m.regions * (m.full_layers * nb + m.sliding_layers * (nb - first)) + m.linear_layers
