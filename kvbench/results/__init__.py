"""What is stored: the row schema with its version (schema), its upgrades, the writer and the sidecar (store), files
written whole and another rank's word in the sidecar (sidecar), the result set's lock and the sweep of a killed run's files (lock), the per-layer costs kvbench itself adds to a
transfer (costs), and the machine facts a buyer needs (machine).  Only store reads and writes frames (pandas):
every rank imports the rest, and a rank other than 0 never loads pandas.

Public API: ``store.ResultWriter``, ``store.ROW_COLUMNS``, ``store.SCHEMA_VERSION``, ``store.upgrade``,
``store.case_stats``, ``lock.ResultLock``, ``costs``, ``machine.facts``.
"""
