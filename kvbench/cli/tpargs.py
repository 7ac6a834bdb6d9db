"""`--tp P:D` and `--head-layout`: prefill TP : decode TP (one number: both) and the heads' order in a block."""
from __future__ import annotations

import argparse

from kvbench.model.tpmap import HEAD_LAYOUT_HELP, HEAD_LAYOUTS, TPPair, parse_tp


def tp_pairs(text: str) -> list[TPPair]:
    """argparse type: a comma-separated list of P:D (or N) TP pairs; one line naming the form otherwise."""
    items = text.split(",")
    try:
        return [parse_tp(x) for x in items]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


tp_pairs.__name__ = "list of P:D"


def add_tp_flags(p: argparse.ArgumentParser) -> None:
    """Make a parser's --tp and --head-layout (from args.add_model_flags) take P:D pairs and one head layout."""
    tp = p._option_string_actions["--tp"]  # argparse keeps no public way to retype an added flag
    tp.type = tp_pairs
    tp.help = ("tensor parallel degree, P:D = prefill TP : decode TP (one number: both): divides KV heads "
               "(replicates when heads < tp); P:D prints what each decode rank receives from which prefill ranks")
    hl = p._option_string_actions["--head-layout"]  # size takes one head layout, run a list of them
    hl.type, hl.choices = None, HEAD_LAYOUTS
    hl.help = "heads' order in a block (with --tp P:D): " + HEAD_LAYOUT_HELP
