"""YAML files as users write them: a duplicate key is an error, not the last value silently winning; and a
file is held to limits (its size, its nesting, its nodes once aliases are expanded, an integer's digits,
model/limits.py) before anything is built from it, so that an alias bomb is refused in a moment."""
from __future__ import annotations

import yaml

from kvbench.model.limits import MAX_DEPTH, MAX_DIGITS, MAX_FILE_BYTES, MAX_NODES

INT_TAG = "tag:yaml.org,2002:int"


class LimitError(Exception):
    """A YAML file beyond one of the limits (one line, without the file's name)."""


class _UniqueKeys(yaml.SafeLoader):
    _depth = 0

    def compose_node(self, parent, index):
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                raise LimitError(f"nested more than {MAX_DEPTH} deep (line {self.peek_event().start_mark.line + 1})")
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def compose_document(self):
        node = super().compose_document()
        if node is not None:
            expanded(node, {})
        return node


def expanded(node: yaml.Node, memo: dict) -> int:
    """Nodes under ``node`` with every alias expanded (each shared node counted once per use, computed once);
    LimitError past MAX_NODES, for an alias that contains itself, or for an integer of too many digits."""
    key = id(node)
    if key in memo:
        if memo[key] is None:
            raise LimitError(f"an alias contains itself (line {node.start_mark.line + 1})")
        return memo[key]
    memo[key] = None  # under way: met again below itself, it is recursive
    if isinstance(node, yaml.ScalarNode):
        digits = len(node.value.lstrip("+-"))
        if node.tag == INT_TAG and digits > MAX_DIGITS:
            raise LimitError(f"an integer of {digits:,} digits (line {node.start_mark.line + 1}; at most "
                             f"{MAX_DIGITS})")
        n = 1
    elif isinstance(node, yaml.SequenceNode):
        n = 1 + sum(expanded(c, memo) for c in node.value)
    else:
        n = 1 + sum(expanded(k, memo) + expanded(v, memo) for k, v in node.value)
    if n > MAX_NODES:
        raise LimitError(f"more than {MAX_NODES:,} values once its aliases are expanded (an alias bomb?)")
    memo[key] = n
    return n


def _mapping(loader: _UniqueKeys, node: yaml.MappingNode, deep: bool = False):
    seen = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key '{key}' (line {key_node.start_mark.line + 1})", key_node.start_mark)
        seen.add(key)
    return loader.construct_mapping(node, deep=deep)


_UniqueKeys.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping)


def read(path: str):
    """Parse ``path``; raise ValueError with one line naming the file on any problem."""
    try:
        with open(path, "rb") as fh:
            raw = fh.read(MAX_FILE_BYTES + 1)
        if len(raw) > MAX_FILE_BYTES:
            raise LimitError(f"larger than {MAX_FILE_BYTES:,} bytes")
        return yaml.load(raw.decode("utf-8"), Loader=_UniqueKeys)  # noqa: S506 - a SafeLoader subclass
    except LimitError as exc:
        raise ValueError(f"{path}: refused before it is read: {exc}") from None
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc.strerror}") from None
    except UnicodeDecodeError as exc:  # a binary file: its decoder's message names no file
        raise ValueError(f"{path}: not a UTF-8 text file (byte {exc.start}: {exc.reason})") from None
    except yaml.YAMLError as exc:
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark is not None and "line" not in problem else ""
        raise ValueError(f"{path}: not valid YAML: {problem}{where}") from None
    except (RecursionError, ValueError, OverflowError) as exc:  # a constructor's own (a date, a float) past its range
        raise ValueError(f"{path}: not valid YAML: {type(exc).__name__}: {str(exc)[:200]}") from None
