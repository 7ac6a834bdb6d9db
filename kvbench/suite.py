"""Suites: YAML sweep definitions, validated, expanded into cases.

Axes are data: every list under ``axes`` is swept, and the cases are their
cartesian product (transport outermost).  Validation errors name the field
and the allowed values in one line.
"""
from __future__ import annotations

import itertools
import os
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from . import model as M
from . import transports
from .pool import LAYOUTS, parse_alloc

SUITE_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "suites")


class SuiteError(ValueError):
    """A bad suite or flag; the message is the one line the user sees."""


class Axes(BaseModel):
    """Sweep axes; each is a list of values."""

    model_config = ConfigDict(extra="forbid")
    transport: list[str] = Field(default=["loopback", "shm"], min_length=1)
    op: list[Literal["push", "pull"]] = Field(default=["push"], min_length=1)
    model: list[str] = Field(default=["llama-3-8b"], min_length=1)
    tokens: list[int] = Field(default=[1024], min_length=1)
    prefix_hit: list[int] = Field(default=[0], min_length=1)
    block_size: list[int] = Field(default=[16], min_length=1)
    layout: list[Literal["auto", "layer-major", "block-major", "mla"]] = Field(default=["auto"], min_length=1)
    alloc: list[str] = Field(default=["random"], min_length=1)
    coalesce: list[Literal["off", "on"]] = Field(default=["off"], min_length=1)
    dtype: list[Literal["fp32", "fp16", "bf16", "fp8-e4m3", "fp8-e5m2"]] = Field(default=["fp16"], min_length=1)
    tp: list[int] = Field(default=[1], min_length=1)
    pp: list[int] = Field(default=[1], min_length=1)
    inflight: list[int] = Field(default=[1], min_length=1)

    @field_validator("transport")
    @classmethod
    def _transport(cls, v):
        for t in v:
            if t not in transports.REGISTRY:
                raise ValueError(f"'{t}' is not one of: {', '.join(transports.names())}")
        return v

    @field_validator("model")
    @classmethod
    def _model(cls, v):
        for m in v:
            M.get_model(m)
        return v

    @field_validator("block_size")
    @classmethod
    def _block(cls, v):
        for b in v:
            M.check_block_size(b)
        return v

    @field_validator("tokens", "tp", "pp", "inflight")
    @classmethod
    def _positive(cls, v):
        for x in v:
            if x <= 0:
                raise ValueError(f"{x} is not a positive integer")
        return v

    @field_validator("alloc")
    @classmethod
    def _alloc(cls, v):
        for a in v:
            parse_alloc(a)
        return v


class Suite(BaseModel):
    """A whole sweep: axes plus how to run each case."""

    model_config = ConfigDict(extra="forbid")
    name: str = "cli"
    description: str = ""
    iters: int = Field(default=20, ge=1)
    warmup: int = Field(default=3, ge=0)
    check: bool = True
    scheme: Literal["pairwise", "many-to-one", "one-to-many", "all-pairs"] = "pairwise"
    seed: int = 0
    pool_factor: float = Field(default=2.0, ge=1.0)
    timeout: float = Field(default=600.0, gt=0)
    variants: list[Literal["bulk", "paged"]] = Field(default=["bulk", "paged"], min_length=1)
    axes: Axes = Field(default_factory=Axes)


def _one_line(exc: ValidationError, where: str) -> str:
    err = exc.errors()[0]
    loc = ".".join(str(p) for p in err["loc"]) or "(top level)"
    msg = err["msg"].removeprefix("Value error, ")
    if err["type"] == "extra_forbidden":
        parent = Axes if err["loc"][:1] == ("axes",) else Suite
        msg = f"unknown field (allowed: {', '.join(parent.model_fields)})"
    return f"{where}: field '{loc}': {msg}"


def validate(data: dict, where: str = "suite") -> Suite:
    """Validate a suite mapping; raise SuiteError with one line on failure."""
    if not isinstance(data, dict):
        raise SuiteError(f"{where}: expected a mapping with 'name' and 'axes'")
    try:
        return Suite.model_validate(data)
    except ValidationError as exc:
        raise SuiteError(_one_line(exc, where)) from None


def resolve_path(name: str) -> str:
    """A suite path, or a bare name looked up in suites/ (``quick`` -> suites/quick.yaml)."""
    if os.path.exists(name):
        return name
    cand = os.path.join(SUITE_DIR, name if name.endswith((".yaml", ".yml")) else name + ".yaml")
    if os.path.exists(cand):
        return cand
    raise SuiteError(f"suite '{name}' not found (suites: {', '.join(list_suites())})")


def load(name: str) -> Suite:
    """Read and validate a suite file (or a name from suites/)."""
    path = resolve_path(name)
    with open(path) as fh:
        try:
            data = yaml.safe_load(fh)
        except yaml.YAMLError as exc:
            raise SuiteError(f"{path}: not valid YAML: {str(exc).splitlines()[0]}") from None
    return validate(data, path)


def list_suites() -> list[str]:
    """Names of the suites shipped in suites/."""
    if not os.path.isdir(SUITE_DIR):
        return []
    return sorted(f[:-5] for f in os.listdir(SUITE_DIR) if f.endswith(".yaml"))


CASE_KEYS = ("transport", "op", "model", "tokens", "prefix_hit", "block_size", "layout", "alloc",
             "coalesce", "dtype", "tp", "pp", "inflight")


def expand(suite: Suite) -> list[dict]:
    """The cases of a suite, in sweep order; layout 'auto' resolved per model."""
    ax = suite.axes
    cases = []
    for values in itertools.product(*(getattr(ax, k) for k in CASE_KEYS)):
        case = dict(zip(CASE_KEYS, values))
        shape = M.get_model(case["model"])
        if case["layout"] == "auto":
            case["layout"] = "mla" if shape.attention == "mla" else "layer-major"
        if (case["layout"] == "mla") != (shape.attention == "mla"):
            raise SuiteError(f"layout '{case['layout']}' does not fit model '{case['model']}' "
                             f"({shape.attention}); use 'auto', or one of: {', '.join(LAYOUTS)}")
        if case["prefix_hit"] >= case["tokens"]:
            raise SuiteError(f"prefix_hit {case['prefix_hit']} leaves nothing to transfer of {case['tokens']} tokens")
        try:
            M.shard(shape, case["tp"], case["pp"])
        except ValueError as exc:
            raise SuiteError(str(exc)) from None
        case["scheme"] = suite.scheme
        cases.append(case)
    return cases
