"""tpkit.cp: context parallelism's own pieces, below the layers (docs/context-parallel.md).

- ``sharding``: the load-balanced CP layout, the one place it is written down
  (``cp_chunk_ids``, ``cp_positions``, ``shard_sequence``, ``unshard_sequence``,
  ``shard_position_ids``, the per-document THD layout ``packed_cp_indices``,
  ``shard_packed``, ``unshard_packed``; the divisibility rule). ``tpkit.data`` re-exports
  the functions users call on their batches.
- ``ring``: the ring driver the CP attention kernels of ``tpkit.nn`` run on (K/V around
  the ring, the per-step block calls and their saved states, the LSE merge).
"""
from .sharding import (check_sequence_length, cp_chunk_ids, cp_positions, packed_cp_indices,
                       sequence_multiple, shard_packed, shard_position_ids, shard_sequence,
                       unshard_packed, unshard_sequence)

__all__ = ["check_sequence_length", "cp_chunk_ids", "cp_positions", "packed_cp_indices",
           "sequence_multiple", "shard_packed", "shard_position_ids", "shard_sequence",
           "unshard_packed", "unshard_sequence"]
