"""The layout: one description of how ranks split a job, and what is built from it.

``config`` (``ParallelConfig``, the resolved ``Layout``; no torch), ``param_tags`` (how a
parameter is sharded over the groups; no torch), ``topology`` (``ParallelState``: the mesh
and every group), ``random`` (the RNG streams per group), ``planning`` (a layout planned
without workers, the rank table), ``parallel_state`` (``init_parallel``, Megatron-Core's
getters). Import the modules themselves; this file imports nothing, so that the no-torch
modules stay fast (``tpkit-launch --help``)."""
