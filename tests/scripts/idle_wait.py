"""Two ranks: rank 0 works 1 s before each control-plane collective; rank 1 prints the CPU seconds it spent
waiting in each (tests/test_comm_wait.py)."""
import time

from kvbench.job import comm

c = comm.get()
WORK_S = 1.0
for name, call in (("bcast", lambda: c.bcast("x")), ("gather", lambda: c.gather(c.rank)),
                   ("allgather", lambda: c.allgather(c.rank)), ("barrier_asleep", c.barrier_asleep),
                   ("barrier", c.barrier)):
    c.barrier()
    if c.rank == 0:
        time.sleep(WORK_S)
    cpu, wall = time.process_time(), time.perf_counter()
    call()
    if c.rank == 1:
        print(f"{name} cpu={time.process_time() - cpu:.3f} wall={time.perf_counter() - wall:.3f}", flush=True)
c.finalize()
