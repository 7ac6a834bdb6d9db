"""The one list of codecs: name -> where its class lives, its id in the frame header, and the pool dtypes it carries.

fsspec's style: an entry names its class by import string, so nothing here imports a codec (or the
compressor library it needs) until ``kvbench.codecs.get`` asks for it.  ``NAMES``, the frame's
``CODEC_IDS`` and ``check`` are read from this table; a new codec is one entry here and one file.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Entry:
    """One codec: its class, its frame id and the pool dtypes it accepts."""

    target: str  # "module:Class", imported on first use
    frame_id: int  # the frame header's codec id: part of the wire format, never renumbered or reused
    dtypes: tuple[str, ...] | None = None  # the pool dtypes it carries (None: any)
    refuse: str = ""  # why another dtype is refused ({name}, {dtype}), one line
    reasons: dict[str, str] = field(default_factory=dict)  # a sharper reason for one dtype it refuses
    args: tuple = ()  # the class's arguments
    table: bool = False  # takes the connection's calibrated exponent table

    def check(self, name: str, dtype: str) -> str | None:
        """Why this codec cannot carry a pool of ``dtype`` (None: it can)."""
        if dtype in self.reasons:
            return self.reasons[dtype]
        if self.dtypes is not None and dtype not in self.dtypes:
            return self.refuse.format(name=name, dtype=dtype)
        return None


_CAST = ("bf16", "fp16")
REGISTRY: dict[str, Entry] = {
    "none": Entry("kvbench.codecs.general:NoneCodec", 0),
    "exp-split": Entry("kvbench.codecs.exp_split:ExpSplit", 1, ("bf16", "fp16", "fp8-e5m2"),
                       "{name} codes bf16, fp16 and fp8-e5m2 pools, not {dtype}",
                       {"fp8-e4m3": "exp-split on fp8-e4m3: its 4 exponent bits already are 16 values, a 4-bit code "
                                    "saves nothing (use none)"}, table=True),
    "cast-fp8-e4m3": Entry("kvbench.codecs.cast:CastFP8", 2, _CAST, "{name} converts fp16 or bf16 pools, not {dtype}",
                           args=("fp8-e4m3",)),
    "cast-fp8-e5m2": Entry("kvbench.codecs.cast:CastFP8", 3, _CAST, "{name} converts fp16 or bf16 pools, not {dtype}",
                           args=("fp8-e5m2",)),
    "zstd": Entry("kvbench.codecs.general:Zstd", 4),
    "lz4": Entry("kvbench.codecs.general:LZ4", 5),
}

NAMES = tuple(REGISTRY)
CODEC_IDS = {name: e.frame_id for name, e in REGISTRY.items()}
