"""The flags and helpers that every kvbench command shares: one-line argparse errors, lists, the model group."""
from __future__ import annotations

import argparse
import sys

from kvbench.job.guard import env_rank
from kvbench.model import shapes as M
from kvbench.model.tpmap import HEAD_LAYOUT_HELP, HEAD_LAYOUTS, parse_tp
from kvbench.results.samples import parse_target


class ArgError(Exception):
    pass


class Parser(argparse.ArgumentParser):
    """argparse that raises (one line, exit 1) instead of printing usage on every rank."""

    def error(self, message):
        raise ArgError(message)


def say_error(msg: str) -> int:
    if env_rank() == 0:
        print(f"kvbench: error: {msg}", file=sys.stderr, flush=True)
    return 1


def csv(kind):
    """argparse type: comma-separated list of ``kind``; an empty item is refused, never read as the default."""
    def parse(text: str):
        items = text.split(",")
        if "" in (x.strip() for x in items):
            raise argparse.ArgumentTypeError(f"'{text}' has an empty item: give a comma-separated list of "
                                             f"{kind.__name__}")
        try:
            return [kind(x) for x in items]
        except ValueError:
            raise argparse.ArgumentTypeError(f"'{text}' is not a comma-separated list of {kind.__name__}") from None
    parse.__name__ = f"list of {kind.__name__}"
    return parse


def text(value: str) -> str:
    """argparse type: a string that is not empty (an empty value would silently mean the default)."""
    if not value.strip():
        raise argparse.ArgumentTypeError("an empty value: give one, or leave the flag out for its default")
    return value


def target_pct(value: str) -> float:
    """argparse type of --target-ci: '2%' or '2' -> 2.0, refused in one line outside (0, 100) (samples.py)."""
    try:
        return parse_target(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("--target-ci ")) from None


def ms(text: str):
    return text if text == "auto" else float(text)


def tp_list(text: str):
    """argparse type of --tp: a comma-separated list of N (as ever: a list of int) or of P:D (prefill TP : decode
    TP, kept as the text 'P:D', a case's tp)."""
    if ":" not in text:
        return csv(int)(text)
    try:
        return [str(parse_tp(x)) if ":" in x else int(x) for x in text.split(",")]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


tp_list.__name__ = "list of int or P:D"


def head_layouts(text: str) -> list[str]:
    """argparse type of --head-layout: a comma-separated list of NHD, HND."""
    items = [x.strip() for x in text.split(",")]
    bad = [x for x in items if x not in HEAD_LAYOUTS]
    if bad:
        raise argparse.ArgumentTypeError(f"head layout '{bad[0]}' is not one of: {', '.join(HEAD_LAYOUTS)}")
    if len(set(items)) < len(items):
        raise argparse.ArgumentTypeError(f"'{text}' lists a head layout twice")
    return items


head_layouts.__name__ = "list of NHD, HND"


def add_model_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model (a preset, a YAML file, or a shape from flags)")
    g.add_argument("-m", "--model", type=csv(str), help=f"presets: {', '.join(M.PRESETS)}; or path/to/model.yaml")
    g.add_argument("--layers", type=int, help="custom model: number of layers")
    g.add_argument("--kv-heads", type=int, help="custom model: KV heads (GQA groups; 1 = MQA)")
    g.add_argument("--head-dim", type=int, help="custom model: head dimension")
    g.add_argument("--attention", choices=M.ATTENTION, help="custom model: attention kind")
    g.add_argument("--kv-lora-rank", type=int, default=0, help="custom MLA model: latent width")
    g.add_argument("--rope-dim", type=int, default=0, help="custom MLA model: decoupled RoPE width")
    g.add_argument("--tp", type=tp_list, help="tensor parallel degree: divides KV heads (replicates when heads < tp); "
                   "run: P:D = prefill TP : decode TP on P + D ranks (docs/layouts.md)")
    g.add_argument("--head-layout", type=head_layouts, help="heads' order in a block, with --tp P:D: " + HEAD_LAYOUT_HELP)
    g.add_argument("--pp", type=csv(int), help="pipeline parallel degree: divides layers")
    g.add_argument("--prefix-hit", type=csv(int), help="prompt tokens already cached at decode (not transferred)")
