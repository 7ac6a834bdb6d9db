"""``-b``/``-e`` as nccl-tests users give them: a block size in tokens (a plain integer) or in bytes with a unit
(``32KiB``): the tokens whose one region (one layer's K or V block, or an MLA latent block) holds that many bytes
for the run's model and dtype.  A byte size that is not a whole power-of-two number of tokens is refused in one
line naming the nearest sizes that are.  The sweep -b/-e/-f make is built here (``block_sweep``)."""
from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from itertools import product

from kvbench.config import ConfigError
from kvbench.model import shapes as M
from kvbench.model import tpmap as T
from kvbench.model.formats import Format
from kvbench.model.inputs import UNITS

BINARY = (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))


@dataclass(frozen=True)
class ByteSize:
    """-b/-e given in bytes: the bytes and the text as typed (for the messages)."""

    nbytes: int
    text: str

    def __str__(self) -> str:
        return self.text


def block_arg(text: str) -> int | ByteSize:
    """argparse type of -b/-e: tokens (16) or bytes with a unit (32KiB, 1MiB, 4096B)."""
    t = text.strip()
    try:
        return int(t)
    except ValueError:
        pass
    m = re.fullmatch(r"([0-9]*\.?[0-9]+)\s*([a-zA-Z]+)", t) if len(t) <= 40 else None
    if m is None or m.group(2).lower() not in UNITS:
        raise argparse.ArgumentTypeError(f"'{text}' is not a block size: tokens (16) or bytes with a unit (32KiB)")
    n = float(m.group(1)) * UNITS[m.group(2).lower()]
    if n != int(n) or n <= 0:
        raise argparse.ArgumentTypeError(f"'{text}' is not a positive whole number of bytes")
    return ByteSize(int(n), t)


def human(n: int) -> str:
    """Bytes exactly, with a binary unit where one reads them back as they are (-b takes this text): 32768 ->
    '32KiB', 1152 -> '1.125KiB', 1572864 -> '1.5MiB', 100 -> '100B'."""
    for unit, size in BINARY:
        if n >= size and round(n / size, 3) * size == n:
            return f"{n / size:.3f}".rstrip("0").rstrip(".") + unit
    return f"{n}B"


def region_bytes_per_token(model: str, dtype: str, scales: str = "none", tp: int | str = 1, pp: int = 1) -> int:
    """Bytes one token adds to one region of one layer (the values; a scale plane is beside them): what a block's
    ``block_bytes`` is per token (harness/requests.py, model/planes.py); at P:D a decode rank's block, as the
    rows' blk(B) (harness/tprequests.py)."""
    shape = M.shard(M.get_model(model), T.parse_tp(tp).decode if isinstance(tp, str) else tp, pp)
    return Format(dtype, scales).value_bytes_token(shape)


def block_sweep(a, axes: dict) -> list[int] | None:
    """-b/-e/-f (nccl-tests style) -> block sizes in tokens (a size in bytes: in tokens of ``axes``' models and
    dtypes), checked before the sweep is built."""
    if a.stepfactor < 2:  # checked even when -f has no sweep to step: a typo is never ignored
        raise ConfigError(f"-f {a.stepfactor}: the step factor must be 2 or more")
    if a.minblock is None and a.maxblock is None:
        return None
    t = in_tokens(a, axes)
    lo = t.minblock if t.minblock is not None else t.maxblock
    hi = t.maxblock if t.maxblock is not None else lo
    for flag, b in (("-b", t.minblock), ("-e", t.maxblock)):  # named as typed: -e alone is not reported as -b
        try:
            if b is not None:
                M.check_block_size(b)
        except ValueError as exc:
            raise ConfigError(f"{flag} {b}: {exc}") from None
    if lo > hi:
        raise ConfigError(f"-b {lo} is larger than -e {hi}")
    out, b = [], lo
    while b <= hi:
        out.append(b)
        b *= a.stepfactor
    return out


def in_tokens(a, axes: dict):
    """The parsed flags with -b/-e in tokens: ``a`` itself when both are tokens, else a copy whose byte sizes are
    converted for ``axes``' models and dtypes (merged suite and flags); ConfigError when they cannot be."""
    given = [(flag, v) for flag, v in (("-b", a.minblock), ("-e", a.maxblock)) if isinstance(v, ByteSize)]
    if not given:
        return a
    per = {}
    for model, dtype, scales, tp, pp in product(axes["model"], axes["dtype"], axes["scales"], axes["tp"], axes["pp"]):
        per.setdefault(region_bytes_per_token(model, dtype, scales, tp, pp),
                       f"{model} {dtype}" + (f" tp {tp}" if str(tp) != "1" else ""))
    what = "; ".join(f"{name}: {n:,} B" for n, name in per.items())
    if len(per) > 1:
        raise ConfigError(f"{given[0][0]} {given[0][1]}: a byte size is one block size only where every model and "
                          f"dtype of the run has the same bytes per token in a region ({what}): give it in tokens, "
                          "or run one model, dtype and TP")
    (bpt, name), = per.items()
    out = argparse.Namespace(**vars(a))
    for flag, size in given:
        tokens = size.nbytes / bpt
        if tokens != int(tokens) or int(tokens) & (int(tokens) - 1):
            raise ConfigError(f"{flag} {size}: not a whole power-of-two number of tokens for {name} ({bpt:,} B per "
                              f"token in a region): nearest {nearest(tokens, bpt)}")
        setattr(out, "minblock" if flag == "-b" else "maxblock", int(tokens))
    if out.minblock is not None and out.maxblock is not None and out.minblock > out.maxblock:
        raise ConfigError(f"-b {a.minblock} ({out.minblock} tokens) is larger than -e {a.maxblock} "
                          f"({out.maxblock} tokens)")
    return out


def nearest(tokens: float, bpt: int) -> str:
    """The valid sizes either side of ``tokens`` (a power of two each), in bytes and tokens."""
    lo = 1 << (max(int(tokens), 1).bit_length() - 1)
    sizes = ([lo] if lo <= tokens else []) + [lo * 2 if lo <= tokens else lo]
    return " or ".join(f"{human(t * bpt)} ({t} token{'s' * (t != 1)})" for t in sizes)


def blocks_given(a) -> bool:
    """Whether -b/-e/-f ask for a block sweep (before the run's models are known: a resumed run's flags); a step
    factor alone counts, so that a mistaken one is refused where the sweep is built rather than ignored."""
    return a.minblock is not None or a.maxblock is not None or a.stepfactor != 2
