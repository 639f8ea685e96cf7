"""Smoke run: initialise the layout given on the command line (or by TPKIT_*) and print
the rank table on rank 0 after checking one all-reduce over every group."""
import argparse

import torch
import torch.distributed as dist

import tpkit
from tpkit.layout.planning import format_rank_table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    for dim in ("tp", "cp", "pp", "dp"):
        ap.add_argument(f"--{dim}", type=int, default=None)
    args = ap.parse_args()
    state = tpkit.init_parallel(tp=args.tp, cp=args.cp, pp=args.pp, dp=args.dp)
    for name, group in state.all_groups().items():
        t = torch.ones(1)
        dist.all_reduce(t, group=group)
        assert t.item() == dist.get_world_size(group), name
    if state.rank == 0:
        print(format_rank_table(state.rank_table()), flush=True)
        print(f"ok: tp={state.tp_size} cp={state.cp_size} dp={state.dp_size} "
              f"pp={state.pp_size} on {state.world_size} ranks ({state.backend})", flush=True)
    tpkit.destroy_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
