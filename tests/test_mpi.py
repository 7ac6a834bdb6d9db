"""mpi transport options: the sendrecv alias and one-line option errors (no MPI needed to build them)."""
import pytest

from kvbench.transports.base import Context, TransportError
from kvbench.transports.mpi import MpiTransport
from kvbench.transports.mpi_sendrecv import MpiSendRecvTransport


def ctx(**opts):
    return Context(0, 2, "h", "t", b"", {k: str(v) for k, v in opts.items()})


def test_mode_sendrecv_selects_the_two_sided_transport_fully_initialised():
    t = MpiTransport(ctx(mode="sendrecv", prep="on"))
    assert type(t) is MpiSendRecvTransport and t.name == "mpi-sendrecv"
    assert t._types.enabled and not t._open  # its __init__ ran
    assert t.info()["mode"] == "sendrecv"
    rma = MpiTransport(ctx(split=2))
    assert type(rma) is MpiTransport and rma.split == 2 and rma.window == "allocate"


@pytest.mark.parametrize("opts,needle", [
    (dict(mode="rdma"), "mode 'rdma' is not one of: rma, sendrecv"),
    (dict(window="shared"), "window 'shared' is not one of: allocate, create"),
    (dict(epoch="fence"), "epoch 'fence' is not one of: lock_all, lock"),
    (dict(prep="maybe"), "prep='maybe' must be on or off"),
    (dict(split="two"), "split='two' must be an integer >= 0"),
])
def test_bad_option_is_one_line(opts, needle):
    with pytest.raises(TransportError, match=needle) as e:
        MpiTransport(ctx(**opts))
    assert "\n" not in str(e.value)
