"""``-O`` transport options: known keys, typed values, allowed ranges, scoped per transport.

``-O key=value`` applies to every transport of the run that has an option
``key`` (an error only when none has it); ``-O tcp.key=value`` to tcp alone.
Each transport's options are a pydantic model here, not in the transport's
module, so that they are validated on rank 0 before anything starts and
without importing optional libraries.
"""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from kvbench.model.inputs import MAX_SECONDS

# setsockopt takes a C int; a larger socket buffer fails at setup rather than here
MAX_SOCKBUF = 2**31 - 1

OnOff = Literal["on", "off"]
_BOOL = {"on": "on", "off": "off", "true": "on", "false": "off", "1": "on", "0": "off", "yes": "on", "no": "off"}


class _Opts(BaseModel):
    """Values arrive as the strings typed after '='; pydantic turns them into the option's type."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _onoff(cls, v, info):
        field = cls.model_fields[info.field_name]
        if field.annotation == OnOff and isinstance(v, str | int):
            return _BOOL.get(str(v).lower(), v)
        return v


class _Net(_Opts):
    addr: str | None = Field(None, description="address to listen on and advertise (beats ifname); tcp: A,B = one rail each")
    ifname: str | None = Field(None, description="interface name prefixes, ^exclude, =exact (NCCL style); tcp: X,Y = one rail each")


class TcpOptions(_Net):
    sockbuf: int = Field(0, ge=0, le=MAX_SOCKBUF, description="socket buffer bytes (0: kernel autotuning)")
    connect_timeout: float = Field(60.0, gt=0, le=MAX_SECONDS, description="seconds to wait for peers at setup")
    poll: Literal["block", "control", "spin"] = Field("block", description="how receive threads wait")
    ready: Literal["socket", "mpi"] = Field("socket", description="how a pull's layer-ready signal travels")
    switch_interval_us: float = Field(50.0, gt=0, le=1e6, description="Python thread switch interval while tcp runs")
    rails: int = Field(0, ge=0, le=64, description="stripe each request over N NICs (of ifname= or --nic auto); "
                       "0: one rail per entry of ifname=X,Y or addr=A,B, else one")


class MpiOptions(_Opts):
    window: Literal["allocate", "create"] = Field("allocate", description="Win.Allocate (pool from MPI) or Win.Create")
    epoch: Literal["lock_all", "lock"] = Field("lock_all", description="passive-target epoch")
    prep: OnOff = Field("on", description="keep committed datatypes while a descriptor array is unchanged (off: "
                        "build them in every post, as a request with a new block table must)")
    split: int = Field(4, ge=0, description="layers of at most N descriptors move as N contiguous calls")
    calls: Literal["native", "mpi4py"] = Field("native", description="native: a request's Puts/Gets, its Flush and "
                                                "notice, the destination's receive and Win.Sync each one call into "
                                                "C; mpi4py: every MPI call through mpi4py")
    mode: Literal["rma", "sendrecv"] = Field("rma", description="sendrecv: the two-sided mpi-sendrecv")


class MpiSendRecvOptions(_Opts):
    prep: OnOff = Field("on", description="keep committed datatypes while a descriptor array is unchanged (off: "
                        "build them in every post, as a request with a new block table must)")


class _UcxRails(_Opts):
    """An engine whose lanes UCX picks (nixl, ucx): how many of the rank's NICs it is handed."""
    rails: int = Field(0, ge=0, le=64, description="the first N NICs handed to this rank (--nic, the lab's) as "
                       "UCX_NET_DEVICES, each one's bytes counted; a rail under half its share is FALLBACK")


class NixlOptions(_UcxRails):
    prep: OnOff = Field("on", description="prepared descriptor lists reused while unchanged, as serving engines do "
                        "(off: initialize_xfer in every post)")
    progress_thread: OnOff = Field("off", description="NIXL's own progress thread")
    telemetry: OnOff = Field("off", description="capture NIXL's per-transfer telemetry")


class UcxOptions(_UcxRails):
    mode: Literal["rma", "tag"] = Field("rma", description="rma: one-sided put/get per descriptor + flush, the harness "
                                        "notifies; tag: the two-sided tag path (header + data messages)")
    tls: str | None = Field(None, description="UCX_TLS for kvbench's context, e.g. sm or tcp")
    err_handling: OnOff = Field("off", description="peer error handling (excludes shared memory)")
    staging_mib: float = Field(1024.0, gt=0, le=2**20, description="cap on packed pushes' staging in use, MiB (receives stage what is in flight)")
    progress: Literal["event", "poll"] = Field("poll", description="poll: a wait spins, as ucx_perftest does; event: it "
                                              "spins for spin_us, then sleeps on the event fd (hosts with fewer cores than ranks)")
    spin_us: float = Field(50.0, ge=0, le=1e6, description="progress=event: microseconds a wait spins after each "
                           "wake-up before it sleeps")


class MooncakeOptions(_Net):
    protocol: Literal["tcp", "rdma"] | None = Field(None, description="default: rdma when an RDMA device exists")
    host: str | None = Field(None, description="address peers reach (default from addr/ifname)")
    device: str | None = Field(None, description="HCA filter, e.g. mlx5_0,mlx5_1")
    batch: int = Field(2048, ge=1, le=65535, description="descriptors per Mooncake batch")
    notify: Literal["socket", "mpi"] = Field("socket", description="how the destination learns a write landed")


class StagedOptions(_Opts):
    inner: Literal["tcp", "ucx", "mpi"] = Field("tcp", description="two-sided host transport between the bounce "
                                                "buffers (mpi: its sendrecv mode)")
    pipeline: OnOff = Field("on", description="off: each layer whole, gather then wire then scatter (the comparison)")
    slot_mib: int = Field(4, ge=1, le=1024, description="MiB per slot: a layer moves in slot-sized chunks")
    chunk_kib: int | None = Field(None, ge=4, le=1 << 20, description="KiB per slot instead (finer; beats slot_mib)")
    slots: int = Field(3, ge=1, le=64, description="slots per peer and direction: chunks being copied or on the wire")


class VerbsOptions(_Opts):
    device: str | None = Field(None, description="RDMA device, e.g. mlx5_0 (default: the first)")
    port: int = Field(1, ge=1, le=255, description="port number on the device")
    qps: int = Field(1, ge=1, le=64, description="RC queue pairs per peer")
    gid: int | None = Field(None, ge=0, le=65535, description="GID index (default: the port's RoCE v2 GID, "
                            "IPv4-mapped first; InfiniBand ports: 0)")
    tc: int = Field(0, description="RoCE traffic class in the GRH, 0-255 (DSCP x 4)")
    sl: int = Field(0, description="service level in the address handle, 0-15")
    timeout: int = Field(20, description="ACK timeout, 0-31: 4.096 us x 2^N per retry (NCCL_IB_TIMEOUT's 20)")

    @field_validator("tc", "sl", "timeout")
    @classmethod
    def _within(cls, v, info):  # the refusal names the range, not only the bound crossed
        lo, hi, what = {"tc": (0, 255, "the RoCE traffic class"), "sl": (0, 15, "the service level"),
                        "timeout": (0, 31, "the ACK timeout exponent")}[info.field_name]
        if not lo <= v <= hi:
            raise ValueError(f"{what} is {lo}-{hi}")
        return v


SCHEMAS: dict[str, type[_Opts]] = {
    "tcp": TcpOptions, "mpi": MpiOptions, "mpi-sendrecv": MpiSendRecvOptions, "nixl": NixlOptions,
    "ucx": UcxOptions, "mooncake": MooncakeOptions, "staged": StagedOptions,
    "verbs": VerbsOptions,
}


class OptionError(ValueError):
    """A bad -O option; the message is one line."""


def known(name: str) -> list[str]:
    schema = SCHEMAS.get(name)
    return list(schema.model_fields) if schema else []


def help_text() -> str:
    """One line per transport: its options, for --help."""
    return "; ".join(f"{n}: {' '.join(known(n))}" for n in SCHEMAS)


def parse(items: list[str], selected: list[str]) -> dict[str, dict]:
    """``-O`` items -> {transport: {key: typed value}} for the transports of this run (given keys only)."""
    raw: dict[str, dict] = {n: {} for n in selected}
    for item in items:
        key, sep, val = item.partition("=")
        if not sep or not key or key.endswith("."):
            raise OptionError(f"-O {item}: expected key=value or transport.key=value")
        if not val.strip():  # an empty value would reach the transport as '' (an address, a device name)
            raise OptionError(f"-O {item}: an empty value: give one, or leave the option out for its default")
        scope, dot, k = key.rpartition(".")
        if dot:
            if scope not in raw:
                raise OptionError(f"-O {item}: transport '{scope}' is not in this run (transports: {', '.join(selected)})")
            if k not in known(scope):
                raise OptionError(f"-O {item}: {scope} has no option '{k}' ({_options_of(scope)})")
            targets = [scope]
        else:
            targets = [n for n in selected if k in known(n)]
            if not targets:
                have = "; ".join(f"{n}: {_options_of(n)}" for n in selected)
                raise OptionError(f"-O {item}: no transport of this run has an option '{k}' ({have})")
        for n in targets:
            if k in raw[n] and raw[n][k] != val:
                raise OptionError(f"-O {item}: {n} option '{k}' is given twice with different values")
            raw[n][k] = val
    out = {}
    for n, given in raw.items():
        if not given:
            continue
        try:
            out[n] = SCHEMAS[n].model_validate(given).model_dump(include=set(given))
        except ValidationError as exc:
            err = exc.errors()[0]
            k = err["loc"][0] if err["loc"] else "?"
            msg = err["msg"].removeprefix("Value error, ")
            raise OptionError(f"-O: {n} option {k}={given.get(k)!r}: {msg}") from None
    return out


def _options_of(name: str) -> str:
    return ", ".join(known(name)) or "it has no options"
