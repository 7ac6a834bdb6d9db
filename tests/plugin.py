"""A transport from outside kvbench, registered as a site's plugin is (KVBENCH_TRANSPORTS=name=module:Class):
tests/test_conformance.py shows that the conformance suite picks it up and tests it like a built-in one."""
from __future__ import annotations

from kvbench.transports.shm import ShmTransport


class SiteShm(ShmTransport):
    """The shm transport under a name of its own."""

    name = "site-shm"
