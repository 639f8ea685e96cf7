"""Prove a model's parallelization before it costs GPU hours (docs/verify.md):
``tpkit.verify(build_model, make_batch, layouts=...)`` trains the model in one process
and at each layout on CPU with gloo from the same full weights, and names the first
module whose output, gradient or updated weights differ, with a hint; ``tpkit-verify``
is its command line (tpkit.cli.verify)."""
from .compare import expected_piece
from .findings import Finding, Tolerance, tolerance
from .run import (DEFAULT_LAYOUTS, PRECISIONS, Layout, LayoutResult, Report, parse_layouts,
                  verify, verify_all)

__all__ = ["verify", "verify_all", "Report", "LayoutResult", "Layout", "parse_layouts",
           "Finding", "Tolerance", "tolerance", "expected_piece", "DEFAULT_LAYOUTS", "PRECISIONS"]
