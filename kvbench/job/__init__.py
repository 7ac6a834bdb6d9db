"""The MPI job's life: the one door to MPI and every tag (comm), the one exit path (guard), the one list of
statuses and exit codes (status), /dev/shm leftovers (cleanup), fault hooks for the tests (faults), what
cleans up after a rank killed from outside (reaper), process trees started with a deadline and killed
whole (launch), and files opened in a folder others may write, never through a link (safefile).

Public API: ``comm.Comm``, ``guard.GUARD``, ``status.STATUSES``, ``cleanup.sweep_orphans``, ``faults.hit``,
``launch.launch``, ``launch.kill_tree`` and ``safefile.UnsafeFile``.  Nothing here imports another kvbench wing.
"""
