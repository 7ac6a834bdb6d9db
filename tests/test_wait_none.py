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


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_wait_on_what_a_one_sided_serve_returned_is_a_no_op(name):
    cls = _cls(name)
    if cls.serve is not Transport.serve:
        pytest.skip(f"{name} serves with a handle of its own")
    bare = object.__new__(cls)  # no connection or device: wait(None) must not touch any
    assert cls.wait(bare, None) is None
