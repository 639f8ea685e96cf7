"""What tpkit-launch reads from a Slurm allocation: node count, node rank, the rendezvous
host and a job-derived rendezvous id and port, all checked (never guessed).

Only used when ``SLURM_JOB_ID`` is set. Inside an ``srun`` step the step's values win
over the job's (a step may use a subset of the nodes); in the batch script itself (no
``SLURM_STEP_ID``) only single-node jobs can launch, because the batch script runs on
the first node only.
"""
from __future__ import annotations

import dataclasses
import shutil
import subprocess
from typing import Mapping

#: Rendezvous ports derived from the job id fall in [BASE_PORT, BASE_PORT + PORT_SPAN),
#: below Linux's ephemeral range; MASTER_PORT in the environment overrides.
BASE_PORT, PORT_SPAN = 20000, 10000


class SlurmError(ValueError):
    """The Slurm environment cannot give a consistent launch; the message says the fix."""


@dataclasses.dataclass(frozen=True)
class SlurmInfo:
    job_id: str
    step_id: str | None
    nnodes: int
    node_rank: int
    nodelist: str
    cpus_per_task: int | None

    @property
    def rdzv_id(self) -> str:
        return f"slurm-{self.job_id}" + (f".{self.step_id}" if self.step_id else "")

    def rdzv_port(self, env: Mapping[str, str]) -> int:
        if env.get("MASTER_PORT"):
            return int(env["MASTER_PORT"])
        return BASE_PORT + int("".join(c for c in self.job_id if c.isdigit()) or 0) % PORT_SPAN

    def first_host(self) -> str:
        """First host of the node list, expanded by ``scontrol show hostnames``."""
        scontrol = shutil.which("scontrol")
        fix = "; pass --rdzv-endpoint HOST:PORT of the first node explicitly"
        if scontrol is None:
            raise SlurmError(f"cannot expand the Slurm node list {self.nodelist!r}: scontrol "
                             f"is not on PATH{fix}")
        proc = subprocess.run([scontrol, "show", "hostnames", self.nodelist],
                              capture_output=True, text=True, timeout=30)
        hosts = proc.stdout.split()
        if proc.returncode != 0 or not hosts:
            why = proc.stderr.strip().splitlines()[-1:] or [f"exit code {proc.returncode}"]
            raise SlurmError(f"cannot expand the Slurm node list {self.nodelist!r} with "
                             f"'scontrol show hostnames': {why[0]}{fix}")
        return hosts[0]


def _int(env: Mapping[str, str], *names: str) -> int | None:
    for name in names:
        raw = env.get(name)
        if raw:
            try:
                return int(raw)
            except ValueError:
                raise SlurmError(f"{name}={raw!r} is not an integer; is this a Slurm "
                                 "allocation? unset SLURM_JOB_ID to launch outside Slurm") from None
    return None


def slurm_info(env: Mapping[str, str]) -> SlurmInfo | None:
    """The allocation this process runs in, or None outside Slurm."""
    job_id = env.get("SLURM_JOB_ID")
    if not job_id:
        return None
    step_id = env.get("SLURM_STEP_ID") or None
    nnodes = _int(env, "SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES")
    node_rank = _int(env, "SLURM_NODEID")
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") \
        or env.get("SLURM_NODELIST")
    if nnodes is None or node_rank is None or not nodelist:
        raise SlurmError(f"SLURM_JOB_ID={job_id} is set but SLURM_NNODES, SLURM_NODEID or "
                         "SLURM_JOB_NODELIST is missing; run tpkit-launch inside the job "
                         "(sbatch/srun), or unset SLURM_JOB_ID to launch outside Slurm")
    if step_id is None and nnodes > 1:
        raise SlurmError(f"tpkit-launch runs in the batch script of a {nnodes}-node job, i.e. "
                         "on the first node only; start one per node with "
                         "'srun --ntasks-per-node=1 tpkit-launch ...'")
    tasks = _int(env, "SLURM_STEP_NUM_TASKS")
    if step_id is not None and tasks is not None and tasks != nnodes:
        raise SlurmError(f"the Slurm step runs {tasks} tasks on {nnodes} node(s); tpkit-launch "
                         "must run once per node (it starts the workers itself): use "
                         f"'srun --ntasks={nnodes} --ntasks-per-node=1 tpkit-launch ...'")
    return SlurmInfo(job_id=job_id, step_id=step_id, nnodes=nnodes, node_rank=node_rank,
                     nodelist=nodelist, cpus_per_task=_int(env, "SLURM_CPUS_PER_TASK"))
