"""The one completion rule's target side: a one-sided transport's ``serve`` returns None (nothing of its own to
post), and the harness waits on what ``serve_request`` returned, so ``wait(None)`` must return None at once on
every transport whose ``serve`` is the base class's.  cuda_ipc crashed here on its first real GPU run."""
import importlib

import pytest

from kvbench.transports import REGISTRY
from kvbench.transports.base import Transport


def _cls(name):
    mod, cls = REGISTRY[name][0].split(":")
    try:
        return getattr(importlib.import_module(mod), cls)
    except ImportError as exc:  # an optional library missing: its module cannot be read here
        pytest.skip(f"{name}: {exc}")


def one_sided() -> list[str]:
    """The registered transports whose ``serve`` is the base class's (one whose module cannot be imported here is
    kept: its test skips, saying why).  A transport that serves with a handle of its own waits on that handle."""
    names = []
    for name in sorted(REGISTRY):
        mod, cls = REGISTRY[name][0].split(":")
        try:
            if getattr(importlib.import_module(mod), cls).serve is not Transport.serve:
                continue
        except ImportError:
            pass
        names.append(name)
    return names


@pytest.mark.parametrize("name", one_sided())
def test_wait_on_what_a_one_sided_serve_returned_is_a_no_op(name):
    cls = _cls(name)
    assert cls.serve is Transport.serve
    bare = object.__new__(cls)  # no connection or device: wait(None) must not touch any
    assert cls.wait(bare, None) is None
