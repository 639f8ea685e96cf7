"""Communication: ``tpkit.comm.collectives`` (every collective tpkit issues on tensors, no
autograd) and ``tpkit.comm.shm`` (the shared-memory transports of CPU groups on one host,
which the collectives use). Import the modules themselves; this file re-exports nothing."""
