"""JobConfig: one typed description of a training job, from a TOML file and flags.

Every value comes from exactly one of: the field's default, the TOML file given with
``--config job.toml``, or a flag (``--training.steps 100``, or the short name the old
script had: ``--steps 100``); flags win over the file, the file over defaults, and
nothing else changes a value (``recovery.hang_timeout`` alone falls back to
``$TPKIT_HANG_TIMEOUT``, which the Slurm templates set). Every field is declared once,
with its type, default and a one-line doc; the flags, ``--help``, ``--print-config`` and
docs/train.md are all generated from those declarations.

Each section checks its own values (``check``) and ``JobConfig.check`` checks the ones
that involve several sections; what needs the layout (the data-parallel size, the
sequence shards, the pipeline stages) is ``check_layout(state)``. Every error is one
line naming the field, the value, where the value came from (``job.toml:12``, the flag
``--steps``, the default) and the fix. No torch import here: ``--help`` stays fast.

To add a field: declare it in its section with ``opt(default, doc)``; to add a section:
a dataclass of such fields and an entry of ``JobConfig``. Nothing else needs to change.

This module is the public face; the parts live beside it: ``schema`` (the sections and
their own checks), ``job`` (JobConfig and the checks across sections and with the layout),
``sources`` (TOML, flags, the generated field reference).
"""
from __future__ import annotations

from .job import JobConfig
from .schema import (IMPLS, PRECISIONS, SECTIONS, Checkpoint, Data, Experts, Logging, Model,
                     Optimizer, Parallelism, Pipeline, Precision, Recovery, Training, opt,
                     output_dir_problem)
from .sources import build_parser, field_docs, markdown_table, parse, read_toml

__all__ = ["JobConfig", "SECTIONS", "parse", "read_toml", "build_parser", "field_docs",
           "markdown_table",
           *[cls.__name__ for cls in SECTIONS.values()]]
