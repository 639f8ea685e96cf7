"""Worker script for tests/nn/test_compile.py: ``tpkit-train --compile`` the way a user
runs it, under ``tpkit-launch --nproc-per-node 2``, public API only (``tpkit.train.main``,
the flags). For each layout of the acceptance table, (2,1,1)+SP, (1,2,1) p2p and a2a,
pp=2 and ep=2 (4 experts), a2a with ``--recompute`` (the compiled block inside
tpkit.recompute.checkpoint), the same 20 steps run eagerly and with ``--compile``:

- compiled, every block is one graph (``fullgraph=True``: any graph break is an error
  at the first step, so reaching the end proves there was none), and dynamo recorded no
  graph break at all (``counters["graph_break"]`` empty);
- the compiled loss curve is within 1e-4 relative of the eager one at every step, and
  bitwise the eager one under aot_eager (it keeps eager's op order; a 1 % error in the
  ring's compiled backward moved the loss by only 4e-5 relative in 20 steps, so the
  bitwise check is the one that catches it).

The backend is ``--compile-backend`` from argv[1] per layout (``aot_eager``: dynamo and
AOTAutograd, the whole trace, no code generation; ``inductor`` for the layouts named in
argv[2], comma-separated), so that the suite stays small. One line per layout:
``rank R LAYOUT OK graphs=G max_rel=X``.
"""
import sys

import torch
from torch._dynamo.utils import counters

import tpkit
from tpkit.train import main

SMALL = ["--steps", "20", "--hidden", "32", "--layers", "2", "--heads", "4",
         "--gqa-groups", "2", "--ffn", "64", "--seq-len", "16", "--global-batch", "4",
         "--warmup", "5", "--log-every", "100"]
LAYOUTS = {
    "tp2-sp": ["--tp", "2", "--sequence-parallel"],
    "cp2-p2p": ["--cp", "2", "--cp-comm-type", "p2p"],
    "cp2-a2a": ["--cp", "2", "--cp-comm-type", "a2a", "--recompute"],
    "pp2": ["--pp", "2", "--microbatches", "2"],
    "ep2": ["--ep", "2", "--moe-experts", "4", "--moe-topk", "2"],
}
REL = 1e-4


def one(name: str, backend: str) -> None:
    flags = SMALL + LAYOUTS[name]
    eager = main(flags)
    torch._dynamo.reset()   # a fresh cache per layout: no recompile limit across layouts
    counters.clear()
    compiled = main(flags + ["--compile", "--compile-backend", backend])
    breaks = dict(counters["graph_break"])
    assert not breaks, f"{name}: graph breaks {breaks}"
    graphs = counters["stats"]["unique_graphs"]
    assert graphs >= 1, f"{name}: nothing was compiled"
    rel = [abs(c - e) / abs(e) for c, e in zip(compiled, eager)]
    bound = 0.0 if backend == "aot_eager" else REL
    assert len(compiled) == len(eager) == 20 and max(rel) <= bound, \
        f"{name} ({backend}): compiled {compiled} vs eager {eager}"
    rank = torch.distributed.get_rank()
    print(f"rank {rank} {name} OK graphs={graphs} max_rel={max(rel):.2e}", flush=True)
    tpkit.destroy_parallel()   # the next layout builds its own


if __name__ == "__main__":
    default = sys.argv[1] if len(sys.argv) > 1 else "aot_eager"
    inductor = set(sys.argv[2].split(",")) if len(sys.argv) > 2 else set()
    only = sys.argv[3].split(",") if len(sys.argv) > 3 else list(LAYOUTS)
    for layout in only:
        one(layout, "inductor" if layout in inductor else default)
