"""Launched by tests/train/test_llama_scratch.py: a Llama trained from scratch by tpkit's
trainer, through the public API, at the launch's layout.

    llama_scratch.py WORK_DIR TRAINER_ARGS...

Builds ``Trainer(job)`` from TRAINER_ARGS (``--arch llama`` sizes or ``--hf-config``),
multiplies its initial matrices by 10 (at the init's 0.02 attention is nearly uniform and
a wrong RoPE would go unseen), writes those weights with ``hf.save_hf`` to WORK_DIR/init, runs step 0's forward
and backward (``trainer.step_loss(0)``: every micro-batch, gradients synchronised) and
writes the gradients in the same Hugging Face names to WORK_DIR/grads (each parameter's
gradient put in its place, then saved as a model), step 0's batch and mean loss to
WORK_DIR/step0.pt; then zeroes the gradients and trains (``trainer.fit()``, whose
``--export-hf`` writes the trained model). Rank 0 prints ``LLAMA SCRATCH OK``.
"""
import os
import sys

import torch
import torch.distributed as dist

from tpkit.models import hf
from tpkit.train import Trainer, parse

work = sys.argv[1]
job, _ = parse(sys.argv[2:])
trainer = Trainer(job)
state, model = trainer.state, trainer.raw_model
with torch.no_grad():   # weights 10x the init's: attention far from uniform, RoPE matters
    for p in model.parameters():
        if p.dim() > 1:
            p.mul_(10.0)
hf.save_hf(model, os.path.join(work, "init"))
kind, (x, y) = trainer.batch(0)
loss = trainer.step_loss(0, (kind, (x, y))).detach().clone()
dist.all_reduce(loss, group=state.dp_cp_group)
xs = [torch.empty_like(x) for _ in range(state.dp_size)]
ys = [torch.empty_like(y) for _ in range(state.dp_size)]
dist.all_gather(xs, x.contiguous(), group=state.dp_group)
dist.all_gather(ys, y.contiguous(), group=state.dp_group)
params = list(model.parameters())
with torch.no_grad():
    kept = [p.detach().clone() for p in params]
    for p in params:
        p.copy_(p.grad)
hf.save_hf(model, os.path.join(work, "grads"))
with torch.no_grad():
    for p, k in zip(params, kept):
        p.copy_(k)
trainer.optimizer.zero_grad(set_to_none=True)
if state.rank == 0:
    torch.save({"x": torch.cat(xs).cpu(), "y": torch.cat(ys).cpu(),
                "loss": float(loss) / state.dp_cp_size}, os.path.join(work, "step0.pt"))
losses = trainer.fit()
if state.rank == 0:
    print(f"losses {losses}")
    print("LLAMA SCRATCH OK", flush=True)
