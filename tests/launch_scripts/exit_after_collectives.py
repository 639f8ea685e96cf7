"""Launched by tests/test_userpath.py::test_exit_right_after_collectives as
``tpkit-launch --nproc-per-node 4 exit_after_collectives.py``: gloo collectives up to the
script's last line, and no destroy_process_group. Ranks 0 and 1 keep the default group in
a global (the wrapper cannot free it: it ends the process without finalizing the
interpreter), ranks 2 and 3 do not (the wrapper frees it). Before tpkit-launch's worker
freed the groups, a gloo worker thread releasing the last collective's tensors during
interpreter finalization aborted a rank ("terminate called without an active exception")
in most runs of this script."""
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
if rank < 2:
    HELD = dist.group.WORLD
for i in range(30):
    x = torch.full((4,), float(rank))
    out = torch.empty(4 * world)
    dist.all_gather_into_tensor(out, x)
    objs = [None] * world
    dist.all_gather_object(objs, {"rank": rank, "i": i})
assert out.tolist() == [float(r) for r in range(world) for _ in range(4)]
print(f"rank {rank} done", flush=True)
