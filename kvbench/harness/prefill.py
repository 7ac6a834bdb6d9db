"""Real prefill: each layer's matrix products of the model's sizes, computed where the pools live, in place of
the prefill clock (PrefillClock below, whose interface it keeps: start, wait_layer, ready_at, end).

Per layer and prompt token block [T, hidden]: the QKV projection (hidden -> (q_heads + 2 kv_heads) x head_dim),
the attention output projection (hidden -> hidden) and the SwiGLU MLP (hidden -> 2 x inter, inter -> hidden),
each divided by tp as a tensor-parallel rank computes it.  The attention scores (T x T) are left out: the
brief's cost is the projections.  Sizes a shape lacks are derived: hidden = q_heads x head_dim (q_heads
defaults to kv_heads: MHA); for MLA, hidden = 14 x kv_lora_rank (DeepSeek-V3: 7168 = 14 x 512); inter = 3.5 x
hidden rounded up to 256 (Llama 3's ratio).  One layer's weights are allocated once per case and used for every
layer (the layers are the same size).  The outputs are not written into the KV pool: the pool keeps the
check's pattern, so every transferred byte is still verified.

* CUDA (``--memory cuda`` or ``pinned``): the matmuls are queued on a compute stream with one CUDA event
  recorded after each layer; a watcher thread synchronizes the events in order and stamps the host clock when
  each fires (the harness's one-clock rule), and the transfer of that layer is posted as soon as it does.
* CPU tensors (``--memory torch-cpu``): a compute thread runs the matmuls and sets one threading.Event per
  layer after them, stamping the host clock.
"""
from __future__ import annotations

import math
import threading
import time

import numpy as np

from kvbench.memory.device import local_device
from kvbench.model import shapes as M

KINDS = ("clock", "real")
HELP = ("clock: the prefill is a timer of --prefill-ms (default); real: each layer's QKV, output and MLP "
        "matmuls of the model's sizes run where the pools live (needs --memory torch-cpu, pinned or cuda), and "
        "the layer's transfer starts when they finish")


class PrefillClock:
    """When each layer's KV becomes final during a prefill of ``total_s`` seconds.

    Layer i is final at ``start + total_s * cum[i]``; ``cum`` is uniform
    ((i+1)/L) unless a per-layer profile of relative costs is given.  This is
    the interface a GPU run replaces with real kernels: ``start()`` when the
    prefill begins, ``wait_layer(i)`` returns once layer i is final (there: a
    CUDA event per layer), ``end`` is when the last layer is final.
    """

    def __init__(self, total_s: float, layers: int, profile: list[float] | None = None):
        w = np.ones(layers) if profile is None else np.asarray(profile, dtype=float)
        if len(w) != layers or (w < 0).any() or w.sum() <= 0:
            raise ValueError(f"a prefill profile needs {layers} non-negative weights")
        self.total_s = float(total_s)
        self.cum = np.cumsum(w) / w.sum()
        self.t0 = 0.0

    def start(self, t0: float | None = None) -> None:
        self.t0 = time.perf_counter() if t0 is None else t0

    def ready_at(self, layer: int) -> float:
        """perf_counter time at which ``layer`` is final."""
        return self.t0 + self.total_s * float(self.cum[layer])

    @property
    def end(self) -> float:
        return self.t0 + self.total_s

    def wait_layer(self, layer: int) -> None:
        if self.total_s:  # no prefill (bulk rows, serial): every layer is final at the start
            sleep_until(self.ready_at(layer))


def sleep_until(deadline: float) -> None:
    """Sleep, then spin the last 0.2 ms: sleep alone wakes late."""
    left = deadline - time.perf_counter()
    if left > 3e-4:
        time.sleep(left - 2e-4)
    while time.perf_counter() < deadline:
        pass



def sizes(shape: M.ModelShape, tp: int = 1) -> dict[str, int]:
    """hidden, qkv (output width of the QKV projection), inter (MLP width), per tensor-parallel rank."""
    if shape.attention == "mla":
        hidden = 14 * shape.kv_lora_rank  # DeepSeek-V3's ratio: its config lacks nothing, ModelShape does
        qkv = hidden + shape.kv_lora_rank + shape.rope_dim  # queries at hidden width, the latent beside them
    else:
        heads = shape.q_heads or shape.kv_heads  # a shape without q_heads is taken as MHA
        hidden = heads * shape.head_dim
        qkv = (heads + 2 * shape.kv_heads) * shape.head_dim
    inter = -(-int(3.5 * hidden) // 256) * 256
    return {"hidden": hidden, "qkv": max(1, qkv // tp), "inter": max(1, inter // tp)}


def layer_flops(shape: M.ModelShape, tokens: int, tp: int = 1) -> float:
    """FLOPs of one layer's matmuls for ``tokens`` prompt tokens on one tensor-parallel rank."""
    s = sizes(shape, tp)
    h = s["hidden"]
    per_tok = h * s["qkv"] + (h // tp) * h + h * 2 * s["inter"] + s["inter"] * h
    return 2.0 * tokens * per_tok


class RealPrefill:
    """The prefill of one request as real matmuls, layer by layer, on ``device`` ("cpu" or "cuda:N")."""

    def __init__(self, shape: M.ModelShape, tokens: int, layers: int, device: str, dtype: str = "fp16",
                 tp: int = 1):
        import torch  # lazily: only device memory kinds have it

        self.torch, self.layers, self.device = torch, max(layers, 1), torch.device(device)
        cuda = self.device.type == "cuda"
        # CPU matmuls in fp16 are slow paths on most builds; the GPU computes in the KV's 16-bit type
        dt = (torch.bfloat16 if dtype == "bf16" else torch.float16) if cuda else torch.float32
        s = sizes(shape, tp)
        # drawn where they are used, in their type: a GPU case spends no time in host randn and an upload
        h, g = s["hidden"], torch.Generator(device=self.device).manual_seed(0)
        mk = lambda *d: torch.randn(*d, generator=g, device=self.device, dtype=dt).mul_(0.02)  # noqa: E731
        self.x = mk(tokens, h)
        self.w = {"qkv": mk(h, s["qkv"]), "out": mk(max(1, h // tp), h), "up": mk(h, 2 * s["inter"]),
                  "down": mk(s["inter"], h)}
        self.inter, self.tp = s["inter"], tp
        self.stream = torch.cuda.Stream(device=self.device) if cuda else None
        self.t0 = 0.0
        self.times = [math.nan] * self.layers
        self._ready = [threading.Event() for _ in range(self.layers)]
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None

    def _layer(self):
        """One layer's matmuls (the residual stream is not carried: each layer costs the same)."""
        w, x = self.w, self.x
        qkv = x @ w["qkv"]
        o = x[:, : w["out"].shape[0]] @ w["out"]  # the attention output's slice this rank holds
        up = x @ w["up"]
        act = self.torch.nn.functional.silu(up[:, : self.inter]) * up[:, self.inter :]
        return qkv, o + act @ w["down"]

    def start(self, t0: float | None = None) -> None:
        """Begin the prefill now: layers are computed in the background; ``t0`` is when it began."""
        self.wait_all()  # the previous iteration's work is finished before a new one starts
        self.t0 = time.perf_counter() if t0 is None else t0
        self.times = [math.nan] * self.layers
        for e in self._ready:
            e.clear()
        if self.stream is not None:  # the weights were written on the default stream
            self.stream.wait_stream(self.torch.cuda.current_stream(self.device))
        target = self._run_cuda if self.stream is not None else self._run_cpu
        self._thread = threading.Thread(target=target, name="kvbench-prefill", daemon=True)
        self._thread.start()

    def _run_cpu(self) -> None:
        try:
            for i in range(self.layers):
                self._layer()
                self.times[i] = time.perf_counter()
                self._ready[i].set()
        except BaseException as exc:  # surfaced by wait_layer: the main thread raises it
            self.error = exc
            for e in self._ready:
                e.set()

    def _run_cuda(self) -> None:
        torch = self.torch
        try:
            events = []
            with torch.cuda.stream(self.stream):  # queued at once: the GPU runs ahead of this thread
                for _ in range(self.layers):
                    self._layer()
                    ev = torch.cuda.Event()
                    ev.record(self.stream)
                    events.append(ev)
            for i, ev in enumerate(events):
                ev.synchronize()  # returns when the layer's kernels are done: its host stamp
                self.times[i] = time.perf_counter()
                self._ready[i].set()
        except BaseException as exc:
            self.error = exc
            for e in self._ready:
                e.set()

    def wait_layer(self, layer: int) -> None:
        """Return once ``layer``'s matmuls are done."""
        self._ready[layer].wait()
        if self.error is not None:
            raise RuntimeError(f"real prefill failed: {type(self.error).__name__}: {self.error}")

    def wait_all(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def ready_at(self, layer: int) -> float:
        """perf_counter time at which ``layer`` was final (after wait_layer(layer))."""
        return self.times[layer]

    @property
    def end(self) -> float:
        """When the last layer was final (waits for it)."""
        self.wait_layer(self.layers - 1)
        return self.times[-1]

    @property
    def measured_s(self) -> float:
        return self.end - self.t0


def device_for(memory: str) -> str:
    """Where a real prefill computes for pools of ``memory``: the rank's GPU, or the CPU for torch-cpu."""
    if memory in ("cuda", "pinned"):

        return f"cuda:{local_device()}"
    return "cpu"


def make_clock(case: dict, layers: int, prefill_s: float, computes: bool):
    """The clock an iteration runs by: a RealPrefill where this rank prefills with ``prefill: real``, else the
    prefill clock of ``prefill_s`` (a decode-only rank learns the source's real times afterwards)."""

    if case.get("prefill", "clock") != "real" or not computes:
        return PrefillClock(prefill_s, max(layers, 1))
    shape = M.get_model(case["model"])  # whole: sizes() divides by tp itself; layers come sharded by pp
    tokens = M.transferred_tokens(case["tokens"], case["prefix_hit"])
    return RealPrefill(shape, tokens, layers, device_for(case.get("memory", "host")), case.get("dtype", "fp16"),
                       case["tp"])
