"""Splitting a built model over ranks beyond the layers' own tensor parallelism:
``pipeline`` (pipeline stages from the pp protocol, torch's schedules by name) and
``fsdp`` (FSDP2 units per transformer block, HSDP, the bf16 policy). Import the modules
themselves; this file imports nothing."""
