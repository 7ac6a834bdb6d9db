"""The MPI job's life: the one door to MPI and every tag (comm), the one exit path (guard), the one list of
statuses and exit codes (status), /dev/shm leftovers (cleanup), fault hooks for the tests (faults), what
cleans up after a rank killed from outside (reaper), and process trees started with a deadline and killed
whole (launch).

Public API: ``comm.Comm``, ``guard.GUARD``, ``status.STATUSES``, ``cleanup.sweep_orphans``, ``faults.hit``,
``launch.launch`` and ``launch.kill_tree``.  Nothing here imports another kvbench wing.
"""
