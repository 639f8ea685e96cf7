"""Launched by tests/models/test_models_hf.py (``tpkit-launch --nproc-per-node 4``): Hugging Face
checkpoints read at several layouts in one process, through the public API only.

    hf_layouts.py WORK_DIR

``WORK_DIR/inputs.pt`` holds ``{"dirs": {name: checkpoint dir}, "x": tokens [B, S],
"y": targets [B, S]}``. For every layout of LAYOUTS (init_parallel -> destroy_parallel in
a loop) and every checkpoint, each rank loads ``hf.from_hf`` and computes the mean
loss of its tokens and the vocab-parallel logits of its shard; the losses are averaged
over dp x cp and the logits gathered over tp (vocab), cp (load-balanced chunks) and dp
(rows) with plain torch.distributed. At the first layout every model is exported with
``save_hf`` to ``WORK_DIR/<name>-a`` (in shards of SHARD_BYTES); at the second that export is read back and written
again to ``WORK_DIR/<name>-b``. Every rank saves what it computed to
``WORK_DIR/results<rank>.pt`` (the test compares each with transformers); rank 0 prints
``HF LAYOUTS OK``.
"""
import os
import sys

import torch
import torch.distributed as dist

import tpkit
from tpkit.models import hf

LAYOUTS = [(2, 2, False), (4, 1, True), (1, 2, False)]   # (tp, cp, sequence_parallel), 4 ranks
SHARD_BYTES = 100_000   # exports in several safetensors files with an index


def _gather(t: torch.Tensor, group) -> list[torch.Tensor]:
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return parts


def full_logits(logits: torch.Tensor, state) -> torch.Tensor:
    """``[B, S, V]`` from every rank's ``[S/cp, B/dp, V/tp]`` (the test's own unsharding:
    CP rank r holds chunks r and 2cp-1-r of 2cp)."""
    x = torch.cat(_gather(logits, state.tp_group), -1) if state.tp_size > 1 else logits
    if state.cp_size > 1:
        cp = state.cp_size
        chunks = [None] * (2 * cp)
        for r, part in enumerate(_gather(x, state.cp_group)):
            chunks[r], chunks[2 * cp - 1 - r] = part.chunk(2, 0)
        x = torch.cat(chunks, 0)
    if state.dp_size > 1:
        x = torch.cat(_gather(x, state.dp_group), 1)
    return x.transpose(0, 1).contiguous()


def check_layout(dirs: dict, x: torch.Tensor, y: torch.Tensor, tp: int, cp: int, sp: bool,
                 export: dict | None = None) -> dict:
    """{name: {"loss", "logits"}} of every checkpoint at layout (tp, cp, sp); ``export``
    maps names to directories to write the loaded model to."""
    state = tpkit.init_parallel(tp=tp, cp=cp, sequence_parallel=sp)
    rows = x.shape[0] // state.dp_size
    mine = slice(state.dp_rank * rows, (state.dp_rank + 1) * rows)
    out = {}
    for name, path in dirs.items():
        model = hf.from_hf(path, state)
        with torch.no_grad():
            logits = model(x[mine])
            loss = model(x[mine], y[mine]).reshape(1)
        dist.all_reduce(loss, group=state.dp_cp_group)
        out[name] = {"loss": loss.item() / state.dp_cp_size,
                     "logits": full_logits(logits, state)}
        if export and name in export:
            hf.save_hf(model, export[name], max_shard_size=SHARD_BYTES)
    tpkit.destroy_parallel()
    return out


def main(work: str) -> None:
    inputs = torch.load(os.path.join(work, "inputs.pt"))
    dirs, x, y = inputs["dirs"], inputs["x"], inputs["y"]
    results = {}
    for i, (tp, cp, sp) in enumerate(LAYOUTS):
        export = None
        if i == 0:
            export = {n: os.path.join(work, f"{n}-a") for n in dirs}
        layout_dirs = dict(dirs)
        if i == 1:   # read the first layout's exports back and write them again
            layout_dirs.update({f"{n}-a": os.path.join(work, f"{n}-a") for n in dirs})
            export = {f"{n}-a": os.path.join(work, f"{n}-b") for n in dirs}
        results[(tp, cp, sp)] = check_layout(layout_dirs, x, y, tp, cp, sp, export)
    rank = dist.get_rank()   # every rank's own gathered logits: the test checks them all
    torch.save(results, os.path.join(work, f"results{rank}.pt"))
    if rank == 0:
        print("HF LAYOUTS OK", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
