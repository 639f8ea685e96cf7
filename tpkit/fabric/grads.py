"""Moved to tpkit.grads (issue 23): gradient finalisation is not Fabric's alone. This path
works for one release (docs/design.md, "Old import paths")."""
from ..grads import clip_grad_norm, grad_norm, sync_sequence_parallel_grads  # noqa: F401
