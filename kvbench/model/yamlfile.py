"""YAML files as users write them: a duplicate key is an error, not the last value silently winning."""
from __future__ import annotations

import yaml


class _UniqueKeys(yaml.SafeLoader):
    pass


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
        with open(path) as fh:
            return yaml.load(fh, Loader=_UniqueKeys)  # noqa: S506 - a SafeLoader subclass
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc.strerror}") from None
    except UnicodeDecodeError as exc:  # a binary file: its decoder's message names no file
        raise ValueError(f"{path}: not a UTF-8 text file (byte {exc.start}: {exc.reason})") from None
    except yaml.YAMLError as exc:
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark is not None and "line" not in problem else ""
        raise ValueError(f"{path}: not valid YAML: {problem}{where}") from None
