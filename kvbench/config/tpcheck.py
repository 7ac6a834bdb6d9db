"""``--tp P:D`` (prefill TP : decode TP) and ``--head-layout`` at the door of a run: the rank count, what a TP map
runs with, and the case fields a P:D case carries (model/tpmap.py, harness/tprequests.py).

A case's ``tp`` is one number (what it always meant: both sides, pairs from the scheme) or the text 'P:D': ranks
0..P-1 prefill, P..P+D-1 decode, a pair per piece of the map, and ``head_layout`` beside it.
"""
from __future__ import annotations

import itertools
import re
from typing import Annotated

from pydantic import AfterValidator

from kvbench.config import ConfigError
from kvbench.model import shapes as M
from kvbench.model import tpmap as T
from kvbench.model.schemes import SCHEMES, SchemeError, tp_pairs, tp_scheme


def _pair_text(text: str) -> str:
    if ":" not in text:
        raise ValueError(f"'{text}' is not a TP degree: give P:D (prefill TP : decode TP, e.g. 4:2) or one N")
    return str(T.parse_tp(text))


TPText = Annotated[str, AfterValidator(_pair_text)]  # a suite's tp: 'P:D' (quoted in YAML: 2:2 reads as 122)


def _scheme(text: str) -> str:
    if text not in SCHEMES and not re.fullmatch(r"tp:\d+:\d+(,\d+:\d+)*", text):
        raise ValueError("Input should be " + ", ".join(f"'{x}'" for x in SCHEMES[:-1]) + f" or '{SCHEMES[-1]}'")
    return text


Scheme = Annotated[str, AfterValidator(_scheme)]  # a scheme (model/schemes.py) or, at --tp P:D, 'tp:P:D[,P:D...]'


def check(a, suite, world: int) -> bool:
    """One line unless the run's TP pairs fit ``world`` ranks and what a TP map runs with; True when they are P:D
    (the scheme then pairs nothing: the maps do).  ``a.head_layout`` (--head-layout) becomes the suite's axis."""
    if getattr(a, "head_layout", None):
        suite.axes.head_layout = a.head_layout
    pairs = [T.parse_tp(t) for t in suite.axes.tp if isinstance(t, str)]
    if not pairs:
        if suite.scheme.startswith("tp:"):
            raise ConfigError(f"scheme {suite.scheme} comes with --tp P:D (which sets it): give --tp P:D instead")
        if suite.axes.head_layout != ["NHD"]:
            raise ConfigError("--head-layout goes with --tp P:D (prefill TP : decode TP): one TP degree moves every "
                              "head of a block")
        return False
    if len(pairs) != len(suite.axes.tp):
        raise ConfigError(f"--tp {','.join(map(str, suite.axes.tp))}: give every TP degree as P:D, or none (a P:D "
                          "run's ranks are its prefill and decode ranks)")
    try:  # the rank count is the scheme's own rule (model/schemes.py tp_pairs), said once
        tp_pairs(tp_scheme(pairs), world)
    except SchemeError as exc:
        raise ConfigError(str(exc) + (" (a sweep of TP pairs runs on the largest pair's ranks; a smaller pair's "
                                      "cases run on its first ranks while the rest wait)" if len(pairs) > 1 else "")
                          ) from None
    why = ("--scheme (the TP map pairs the ranks)" if suite.scheme not in ("pairwise", tp_scheme(pairs)) else
           "a workload (arrivals, traces)" if suite.workload is not None else
           "a codec" if suite.axes.codec != ["none"] else
           "scale planes (--scales)" if suite.axes.scales != ["none"] else
           "--prefill real" if "real" in suite.axes.prefill else "")
    if why:
        raise ConfigError(f"--tp {pairs[0]} runs plain transfers of one request per pair: it does not take {why}")
    suite.scheme = tp_scheme(pairs)  # what every reader of the scheme pairs (a superset of each case's own pairs)
    return True


def shard(shape: M.ModelShape, case: dict) -> None:
    """Raise ValueError (its one line) unless the case's model splits by its TP: one degree, or both sides of P:D
    in its head layout."""
    tp = T.case_pair(case["tp"])
    if tp is None:
        M.shard(shape, case["tp"], case["pp"])
        return
    T.check(shape, tp, case["head_layout"], case["layout"])
    M.shard(shape, tp.prefill, case["pp"])
    M.shard(shape, tp.decode, case["pp"])


def prefill_tp(tp) -> int:
    """The TP degree a prefill rank computes with: one number, or P of P:D."""
    return tp if isinstance(tp, int) else T.parse_tp(tp).prefill


def cases(axes, keys: tuple[str, ...]):
    """The axes' product as case dicts, in sweep order; a P:D case once per head layout (``head_layout`` beside
    its tp), a case of one TP degree as it always was."""
    for values in itertools.product(*(getattr(axes, k) for k in keys)):
        case = dict(zip(keys, values))
        if not isinstance(case["tp"], str):
            yield case
            continue
        for h in axes.head_layout:
            yield dict(case, head_layout=h)
