"""Launched by tests/observe/test_observe_launch.py as ``tpkit-launch --nproc-per-node 4 --tp 2
--cp 2 observe_run.py WORKDIR``: a user's own loop over the reference GPT with MoE
layers, logged with tpkit.observe's MetricsLogger (public API only): 6 steps, a window
of 2, steps 2..3 profiled, a checkpoint saved in step 3, a validation loss at the end. Rank 0 prints each row it
wrote as ``ROW {json}`` (the test compares them with the TensorBoard event files and
metrics.csv under WORKDIR/run); every rank writes its trace under WORKDIR/run/profile."""
import json
import os
import sys

import torch
import torch.distributed as dist

import tpkit
import tpkit.checkpoint
from tpkit.comm.collectives import all_reduce_sum
from tpkit.grads import grad_norm
from tpkit.models.gpt import GPT, GPTConfig
from tpkit.observe import MetricsLogger, model_flops_per_token, moe_scalars

STEPS, EVERY, BATCH, SEQ, LR = 6, 2, 2, 16, 1e-2


def main(workdir: str) -> None:
    state = tpkit.init_parallel(seed=7)            # tp 2 x cp 2 from tpkit-launch
    cfg = GPTConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_gqa_groups=2,
                    ffn_hidden_size=64, moe_experts=4, moe_topk=2)
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    data = torch.Generator().manual_seed(0)
    log = MetricsLogger(os.path.join(workdir, "run"), tokens_per_step=BATCH * SEQ,
                        flops_per_token=model_flops_per_token(cfg, SEQ), total_steps=STEPS,
                        every=EVERY, precision="fp32", profile_steps="2:4")
    n = state.dp_size * state.cp_size
    for step in range(STEPS):
        with log.phase("data"):
            x = torch.randint(0, cfg.vocab_size, (BATCH, SEQ + 1), generator=data)
        with log.phase("fwd_bwd"):
            loss = model(x[:, :-1], x[:, 1:])
            loss.backward()
        with log.phase("optimizer"):
            for p in model.parameters():              # average over the dp x cp replicas
                p.grad = all_reduce_sum(p.grad, state.dp_cp_group) / n
            norm = grad_norm(model.parameters(), state)
            opt.step()
            opt.zero_grad(set_to_none=True)
        if step == 3:                                 # a checkpoint stall in window 2
            with log.phase("checkpoint"):
                tpkit.checkpoint.save(os.path.join(workdir, "ckpt"), {"model": model})
        mean_loss = all_reduce_sum(loss.detach().clone(), state.dp_cp_group) / n
        row = log.step(step, loss=mean_loss, lr=LR, grad_norm=norm, **moe_scalars(model))
        if row is not None:
            print("ROW " + json.dumps({"step": step + 1, **row}), flush=True)
            print("RANKS " + json.dumps(log.ranks), flush=True)
    with torch.no_grad():
        x = torch.randint(0, cfg.vocab_size, (BATCH, SEQ + 1), generator=data)
        val = all_reduce_sum(model(x[:, :-1], x[:, 1:]), state.dp_cp_group) / n
    row = log.log(STEPS - 1, val_loss=val)
    if row is not None:
        print("ROW " + json.dumps({"step": STEPS, **row}), flush=True)
    log.close()
    dist.barrier()


if __name__ == "__main__":
    main(sys.argv[1])
