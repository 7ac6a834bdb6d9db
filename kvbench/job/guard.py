"""One exit path: every failure ends the job with one line, a failed sidecar and a non-zero code.

A failure is an exception on any rank, a deadline that passed (the watchdog) or
a signal.  The rank that sees it builds the line (rank, host, what the job was
doing, cause); rank 0 writes it into the sidecar and prints it; every rank then
removes this run's segments and ends the job.  ``MPI_Abort`` can return with
the mpich wheel (docs/pitfalls.md#abort-returns), so the process exits right after it
whatever it did, and a timer ends it even if the exit path itself hangs.

Signals reach a thread of ours through Python's wake-up file descriptor: a
Python signal handler would only run once the main thread leaves a blocking MPI
call, which in a hung collective is never (the handler itself does nothing, so
no KeyboardInterrupt traceback either).
"""
from __future__ import annotations

import json
import os
import signal
import socket
import sys
import threading
import time
import traceback
from contextlib import contextmanager

from kvbench.job import status as ST
from kvbench.job.comm import TAG_ACK, TAG_FAIL, _mpi
from kvbench.job.reaper import Reaper

SIGNALS = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}
ACK_WAIT_S = 3.0  # how long a rank waits for rank 0 to take over its failure before it prints it itself
GRACE_S = 2.0  # ranks other than 0 wait this much longer on a deadline, so rank 0 (the sidecar's writer) fires first
EXIT_BACKSTOP_S = 15.0  # the exit path itself may not hang (a stuck file system, a wedged MPI)


def env_rank() -> int:
    """This process's rank as the launcher says, without starting MPI."""
    for k in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID"):
        try:
            return int(os.environ[k])
        except (KeyError, ValueError):
            pass
    return 0


class Guard:
    """The process's exit path, watchdog and signal taker (one per process: ``GUARD``)."""

    def __init__(self):
        self.comm = None
        self.rank, self.size, self.host = env_rank(), 1, socket.gethostname()
        self.run_id: str | None = None
        self.writer = None  # rank 0's ResultWriter, once files exist
        self.case = ""  # what the job is doing now, for the one line
        self.cleanups: list = []  # callables run on the exit path, before the job ends
        self._lock = threading.Lock()
        self._failing = False
        self._cond = threading.Condition()
        self._deadline: float | None = None
        self._what, self._limit = "", 0.0
        self._gap: tuple[str, float] | None = None  # the deadline between two armed steps (``between``)
        self.stand_in = None  # ranks but 0: (status, line) -> None, records a failure rank 0 did not take over
        self.reaper = Reaper(None)  # kvbench run's: what cleans up after a kill from outside (job/reaper.py)
        self._listener: threading.Thread | None = None
        self._stop = threading.Event()
        self._installed = False

    # ----- start and stop ----------------------------------------------------------------
    def install(self) -> None:
        """Before MPI starts: take signals on our own thread, start the watchdog."""
        if self._installed:
            return
        self._installed = True
        rfd, wfd = os.pipe()
        os.set_blocking(wfd, False)
        signal.set_wakeup_fd(wfd, warn_on_full_buffer=False)
        self.retake()
        threading.Thread(target=self._signals, args=(rfd,), name="kvbench-signals", daemon=True).start()
        threading.Thread(target=self._watch, name="kvbench-watchdog", daemon=True).start()
        threading.excepthook = lambda a: self.fail("ERROR", describe(a.exc_value), a.exc_value)

    def attach(self, comm) -> None:
        """MPI is up: learn the rank; rank 0 listens for the other ranks' failures."""
        self.comm, self.rank, self.size, self.host = comm, comm.rank, comm.size, comm.hostname
        if self.rank == 0 and self.size > 1:
            self._listener = threading.Thread(target=self._listen, name="kvbench-failures", daemon=True)
            self._listener.start()
        self.retake()

    def retake(self) -> None:
        """Our handlers for SIGNALS (they only wake the signal thread through the wake-up fd); again after a
        library set its own (UCX takes SIGHUP for its debug dump when MPI starts: the hang-up would be ignored)."""
        for sig in SIGNALS:
            signal.signal(sig, lambda *_: None)

    def detach(self) -> None:
        """Before MPI_Finalize: stop listening (the run ended by itself); the caller's deadline still runs."""
        self._stop.set()
        if self._listener is not None:
            self._listener.join(timeout=5)
            self._listener = None

    # ----- deadlines -----------------------------------------------------------------------
    def arm(self, what: str, seconds: float) -> None:
        """The job fails with TIMEOUT unless ``disarm`` comes within ``seconds``."""
        with self._cond:
            grace = GRACE_S if self.rank else 0.0
            self._deadline = time.monotonic() + seconds + grace
            self._what, self._limit = what, seconds
            self._cond.notify()

    def disarm(self) -> None:
        """The armed step ended: the deadline between steps (``between``) runs from now, if one is set."""
        with self._cond:
            self._deadline = None
            if self._gap is not None:
                self._what, self._limit = self._gap
                self._deadline = time.monotonic() + self._limit + (GRACE_S if self.rank else 0.0)
            self._cond.notify()

    def between(self, what: str | None, seconds: float = 0.0) -> None:
        """Every gap between two armed steps must end within ``seconds`` too (a rank stopped between cases
        would otherwise hang the job); ``None`` ends that, and disarms."""
        self._gap = (what, seconds) if what else None
        self.disarm()

    @contextmanager
    def deadline(self, what: str, seconds: float):
        """``with GUARD.deadline("setup of shm", 60):`` a phase that must end in time."""
        self.arm(what, seconds)
        try:
            yield
        finally:
            self.disarm()

    def _watch(self) -> None:
        while True:
            with self._cond:
                while self._deadline is None or time.monotonic() < self._deadline:
                    self._cond.wait(None if self._deadline is None else self._deadline - time.monotonic())
                what, limit = self._what, self._limit
                self._deadline = None
            self.fail("TIMEOUT", f"{what} did not end within {limit:g} s")

    def _signals(self, rfd: int) -> None:
        sig = os.read(rfd, 1)[0]
        name = signal.Signals(sig).name
        self.fail("INTERRUPTED", f"{name}{' (Ctrl-C)' if sig == signal.SIGINT else ''}; finished cases are kept")

    # ----- the exit path -------------------------------------------------------------------
    def where(self) -> str:
        return f"rank {self.rank} on {self.host}" + (f", {self.case}" if self.case else "")

    def fail(self, status: str, cause: str, exc: BaseException | None = None) -> None:
        """End the job: one line, the sidecar's status, cleanup, a non-zero exit on every rank.  Never returns."""
        if not self._claim():
            _park()
        code = ST.exit_code(status)
        _backstop(code)
        self.disarm()
        if exc is not None and os.environ.get("KVBENCH_DEBUG"):
            traceback.print_exception(exc)
        line = f"kvbench: {status.lower()}: {self.where()}: {cause}"
        if self.rank == 0 or self.comm is None or self.size == 1:
            _say(line + self._record(status, line))
        elif not self._tell_rank0(status, line) and status != "INTERRUPTED" and self._first_to_say():
            _say(line)  # rank 0 did not take it over (stopped, hung): say it here, and in the sidecar
            if self.stand_in is not None:
                try:
                    self.stand_in(status, line)
                except Exception:  # the line is out; the exit must not wait on a file
                    pass
        self._end(code)

    def fail_from(self, exc: BaseException) -> None:
        """``fail`` for an exception: TIMEOUT for a TimeoutError, else ERROR.  Never returns."""
        self.fail("TIMEOUT" if isinstance(exc, TimeoutError) else "ERROR", describe(exc), exc)

    def fail_early(self, exc: BaseException) -> None:
        """In a process that installed the guard (``kvbench run``), ``fail_from`` now, before the exception
        unwinds through cleanups that would let a peer fail first on what they removed; elsewhere, nothing."""
        if self._installed:
            self.fail_from(exc)

    def _first_to_say(self) -> bool:
        """Of the ranks of this host that find rank 0 gone (stopped, hung), the first says the line and records it:
        one line, however many ranks time out on it.  The claim is an abstract socket name held until this process
        ends (nothing to remove afterwards)."""
        if not self.run_id:
            return True
        try:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.bind("\0kvbench-said-" + self.run_id)
        except OSError:
            return False
        self._said = s
        return True

    def _claim(self) -> bool:
        with self._lock:
            first = not self._failing
            self._failing = True
            return first

    def _record(self, status: str, line: str) -> str:
        """Write the failure into the sidecar; what to add to the line when that failed (one line still)."""
        if self.writer is not None:
            try:
                self.writer.finish(final=True, status=status, reason=line, finished=time.strftime("%Y-%m-%dT%H:%M:%S%z"))
            except Exception as exc:  # the line still goes out, saying the sidecar does not hold it
                return f" (not recorded in {self.writer.meta_path}: {exc})"
        return ""

    def _tell_rank0(self, status: str, line: str) -> bool:
        """Hand the failure to rank 0 (the sidecar's writer); True once it acknowledged."""
        MPI = _mpi()
        try:
            msg = json.dumps({"status": status, "line": line}).encode()
            self.comm.world.Isend([msg, MPI.BYTE], dest=0, tag=TAG_FAIL)
            ack = self.comm.world.Irecv([bytearray(1), MPI.BYTE], source=0, tag=TAG_ACK)
            end = time.monotonic() + ACK_WAIT_S
            while time.monotonic() < end:
                if ack.Test():
                    return True
                time.sleep(0.01)
        except Exception:  # MPI itself is broken: say it here
            pass
        return False

    def _listen(self) -> None:
        MPI = _mpi()
        buf = bytearray(1 << 16)
        req = self.comm.world.Irecv([buf, MPI.BYTE], source=MPI.ANY_SOURCE, tag=TAG_FAIL)
        st = MPI.Status()
        while not self._stop.is_set():
            if req.Test(st):
                msg = json.loads(bytes(buf[: st.Get_count(MPI.BYTE)]))
                if self._claim():
                    _backstop(ST.exit_code(msg["status"]))
                    self.disarm()
                    _say(msg["line"] + self._record(msg["status"], msg["line"]))
                    self._cleanup()  # before the ack: the failing rank's abort may kill this process at once
                    self.comm.world.Isend([b"\x01", MPI.BYTE], dest=st.Get_source(), tag=TAG_ACK)
                    self._end(ST.exit_code(msg["status"]))
                _park()
            time.sleep(0.02)
        req.Cancel()
        req.Wait()

    def _cleanup(self) -> None:
        fns, self.cleanups = self.cleanups, []  # once, whoever calls first
        for fn in fns:
            try:
                fn()
            except Exception:  # cleanup must not stop the exit
                pass

    def _end(self, code: int) -> None:
        self._cleanup()
        self.reaper.done()  # this exit path did the cleaning: the reaper leaves everything as it is
        sys.stdout.flush()
        sys.stderr.flush()
        if self.comm is not None and self.size > 1:
            try:
                self.comm.abort(code)
            except Exception:
                pass
        os._exit(code)  # Abort can return (docs/pitfalls.md#abort-returns)


def describe(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _park() -> None:
    """Another thread is ending the job: wait for it."""
    while True:
        time.sleep(3600)


def _backstop(code: int) -> None:
    t = threading.Timer(EXIT_BACKSTOP_S, os._exit, args=(code,))
    t.daemon = True
    t.start()


GUARD = Guard()
