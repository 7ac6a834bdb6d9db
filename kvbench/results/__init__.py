"""What is stored: the row schema with its version and upgrades, the writer and the sidecar (store), the
result set's lock and the sweep of a killed run's files (lock), the per-layer costs kvbench itself adds to a
transfer (costs), and the machine facts a buyer needs (machine).

Public API: ``store.ResultWriter``, ``store.ROW_COLUMNS``, ``store.SCHEMA_VERSION``, ``store.upgrade``,
``store.case_stats``, ``lock.ResultLock``, ``costs``, ``machine.facts``.
"""
