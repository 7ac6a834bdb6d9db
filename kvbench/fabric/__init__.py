"""The fabric as data: every NIC's byte counters on this host or namespace (nics: kernel NICs, RDMA ports,
NVLink through NVML), and which of them carried a case's bytes (carriers: deltas, the >= 90% rule, wire
over payload, the misroute note).  Stdlib only (NVML imported lazily); nothing here imports another wing.

Public API: ``nics.sample``, ``nics.names``, ``carriers.delta``, ``carriers.carriage``, ``carriers.per_nic``, ``carriers.note``,
``carriers.encode`` and ``carriers.decode``; what each engine chose and the path a case is meant to measure (issue 44):
``proto.carried``, ``proto.klass``, ``expect.expected``, ``expect.fallback``, ``procsock.sample``/``delta`` (this
process's own TCP connections), ``ucxproto.endpoints`` (UCX's endpoints and lanes), ``mpich.read`` (MPI_T).
"""
