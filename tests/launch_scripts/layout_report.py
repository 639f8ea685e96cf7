"""Worker script for tests/cli/test_launch_layout.py: the trainer's layout road without the
training. Its pre-flight is the trainer's (tpkit.train.preflight); each worker resolves the
job's layout as ``Trainer`` does (tpkit.train.trainer.resolve_layout), builds it with
``tpkit.init_parallel`` and writes one line with its coordinates and groups, in the
columns of the dry run's rank table, to ``LOG_DIR/layout.RANK`` (the job's ``--log-dir``):

    LAYOUT rank tp cp dp pp tp_group cp_group dp_group pp_group sequence_parallel=B
"""
from tpkit.train import parse, preflight


def tpkit_preflight(argv, launch):
    return preflight(argv, launch)


if __name__ == "__main__":
    import os

    import torch.distributed as dist

    import tpkit
    from tpkit.layout.planning import format_ranks
    from tpkit.train.trainer import resolve_layout
    job, _ = parse()
    state = tpkit.init_parallel(config=resolve_layout(job))
    groups = [format_ranks(dist.get_process_group_ranks(getattr(state, f"{d}_group")))
              for d in ("tp", "cp", "dp", "pp")]
    with open(os.path.join(job.logging.log_dir, f"layout.{state.rank}"), "w") as f:
        print("LAYOUT", state.rank, state.tp_rank, state.cp_rank, state.dp_rank,
              state.pp_rank, *groups, f"sequence_parallel={state.config.sequence_parallel}",
              file=f)
    tpkit.destroy_parallel()
