"""--register per-request in a transport: the calls an engine that pins on demand makes around each request, and
the request's local byte ranges and posted arrays they take (a mixin of ``base.Transport``).

The harness (harness/schedule.py) calls ``register_request`` on the initiator inside the timed request, before
its first post, and ``deregister_request`` after the iteration's last landing; a transport that registers memory
with a library overrides both (nixl, mooncake).  Its target's pool stays registered from setup (``pool_once``).
"""
from __future__ import annotations

import numpy as np

from kvbench.model.descriptors import DST, LEN, SRC, regions


def pool_once(ctx) -> bool:
    """Register the whole pool at setup: always under ``once``; under ``per-request`` where peers reach it."""
    return ctx.register == "once" or ctx.reached


class PerRequest:
    """Per-request registration: not overridden, a transport has none (``per_request``)."""

    def register_request(self, op: str, peer: int, groups: list[list[np.ndarray]]):
        """Register this request's local blocks with the library (``request_regions`` of its descriptor arrays,
        posted as ``groups`` of layers) and rebuild what that registration invalidates (prepared descriptor
        lists); a handle for ``deregister_request``."""
        raise NotImplementedError

    def deregister_request(self, handle) -> None:
        """Undo ``register_request`` once the request's transfers completed (what referenced it first)."""
        raise NotImplementedError

    @classmethod
    def per_request(cls) -> bool:
        """It registers a request's blocks around its transfer under --register per-request."""
        return cls.register_request is not PerRequest.register_request

    def request_regions(self, op: str, groups: list[list[np.ndarray]]) -> np.ndarray:
        """The local byte ranges of a request, pool offsets merged where they touch (descriptors.regions): the
        source column for a push, the destination's for a pull.  Built once per list: the harness passes the
        same list every iteration (the cache holds it, so its id stays its own)."""
        cache = self.__dict__.setdefault("_regions", {})
        hit = cache.get(id(groups))
        if hit is not None and hit[0] is groups:
            return hit[1]
        arrays = [d for g in groups for d in g]
        d = np.concatenate(arrays) if arrays else np.empty((0, 3), dtype=np.int64)
        got = regions(d[:, SRC if op == "push" else DST], d[:, LEN])
        if len(cache) >= 4096:
            cache.clear()
        cache[id(groups)] = (groups, got)
        return got

    def request_posts(self, groups: list[list[np.ndarray]]) -> list[np.ndarray]:
        """The distinct descriptor arrays the harness posts for a request's ``groups``: per group the joined array
        (``one_post``) or its layers."""
        out: dict[int, np.ndarray] = {}
        for g in groups:
            one = self.one_post(g)
            for d in ([one] if one is not None else g):
                out.setdefault(id(d), d)
        return list(out.values())
