"""Two ranks: an mpi-sendrecv pull's source sends nothing until its destination asks (tests/test_honesty.py)."""
import sys
import time

import numpy as np

from kvbench.job import comm
from kvbench.model.layout import Pool
from kvbench.transports.base import Context
from kvbench.transports.mpi_sendrecv import MpiSendRecvTransport

c = comm.get()
t = MpiSendRecvTransport(Context(c.rank, c.size, c.hostname, "t", b"", {}))
pool = Pool(np.full(1 << 20, c.rank + 1, dtype=np.uint8))
meta = t.register(pool)
t.connect({1 - c.rank: c.allgather(meta)[1 - c.rank]})
t.ready()
descs = np.array([[0, 4096, 65536]], dtype=np.int64)
if c.rank == 0:  # the source: serve, then see that nothing was sent while nobody asked
    h = t.serve("pull", 1, descs, 5)
    time.sleep(0.3)
    sent_early = h.send is not None or h.asked.Test()
    c.barrier()  # the destination posts its read only now
    t.answer(h)
    t.wait(h)
    c.send(sent_early, 1)
else:
    c.barrier()
    t.wait(t.post("pull", 0, descs, 5))
    sent_early = c.recv(0)
    got = pool.array[4096:4096 + 65536]
    print(f"sent_early={sent_early} landed={bool((got == 1).all())}", flush=True)
t.close()
c.finalize()
sys.exit(0)
