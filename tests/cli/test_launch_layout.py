"""One layout per run (issue 49, item 1): the layout tpkit-launch's dry run prints is the
one its workers build, whether the sizes come from tpkit-launch's flags, from the job's
own flags (launch/train.py --tp 4), or from both agreeing; both with two values is one
error naming both, before any worker starts. The reference is what each launched worker
reports from its own process groups (tests/launch_scripts/layout_report.py: the trainer's
pre-flight and layout road)."""
import os
import re

import pytest

from tests.cli.test_launch_run import ROOT, finish, launch

SCRIPT = os.path.join(ROOT, "tests", "launch_scripts", "layout_report.py")
JOB = ["--hidden", "32", "--heads", "4", "--gqa-groups", "2", "--ffn", "64", "--seq-len", "16"]

pytestmark = pytest.mark.slow

# (tpkit-launch's flags, the job's flags, tp, dp, sequence_parallel)
AGREEING = [
    (["--nproc-per-node", "4", "--tp", "2"], ["--tp", "2"], 2, 2, False),
    (["--nproc-per-node", "4"], ["--tp", "4"], 4, 1, False),   # the job's --tp alone
    # --sequence-parallel means the same with experts as without, job's or launcher's
    (["--nproc-per-node", "2", "--tp", "2"], ["--moe-experts", "4", "--sequence-parallel"],
     2, 1, True),
]


def dry_run_rows(out: str) -> list[list[str]]:
    """The rank table's rows: rank tp cp dp pp tp_group cp_group dp_group pp_group."""
    lines = out.split("rank table:\n", 1)[1].splitlines()
    assert lines[0].split()[:11] == ["rank", "node", "local_rank", "tp", "cp", "dp", "pp",
                                     "tp_group", "cp_group", "dp_group", "pp_group"], out
    return [(ln.split()[:1] + ln.split()[3:11]) for ln in lines[1:]]


def test_dry_run_is_what_the_workers_build(tmp_path):
    logs = [str(tmp_path / str(i)) for i in range(len(AGREEING))]
    for log in logs:
        os.makedirs(log)
    dry = [launch("--backend", "gloo", "--dry-run", *flags, SCRIPT, *JOB, *job)
           for flags, job, *_ in AGREEING]
    dry = [finish(p) for p in dry]
    runs = [finish(p) for p in [launch("--backend", "gloo", *flags, SCRIPT, *JOB, *job,
                                       "--log-dir", log)
                                for (flags, job, *_), log in zip(AGREEING, logs)]]
    for (flags, job, tp, dp, sp), (rc, out, err), (wrc, _, werr), log in zip(
            AGREEING, dry, runs, logs):
        assert rc == 0, (flags, job, err[-2000:])
        assert wrc == 0, (flags, job, werr[-3000:])
        layout = re.search(r"^layout +(.*)$", out, re.M).group(1)
        assert layout.startswith(f"tp={tp} cp=1 pp=1 dp={dp} sequence_parallel={sp} "), layout
        env = re.search(r"^environment (.*)$", out, re.M).group(1).split()
        assert f"TPKIT_TP={tp}" in env and f"TPKIT_DP={dp}" in env, env
        reports = [open(os.path.join(log, name)).read().split()
                   for name in sorted(os.listdir(log)) if name.startswith("layout.")]
        workers = sorted((r[1:10] for r in reports), key=lambda r: int(r[0]))
        assert workers == dry_run_rows(out), (flags, job, out, reports)
        assert all(r[10] == f"sequence_parallel={sp}" for r in reports), reports


@pytest.mark.parametrize("dry", [True, False])
def test_two_values_for_one_size_are_one_error(dry):
    """tpkit-launch --tp 2 ... --tp 4: exit 2 naming both values and where each came from,
    no worker started (the issue's report: the dry run said tp=2, the workers built 4)."""
    rc, out, err = finish(launch("--backend", "gloo", *(["--dry-run"] if dry else []),
                                 "--nproc-per-node", "4", "--tp", "2", SCRIPT, *JOB,
                                 "--tp", "4"))
    assert rc == 2, err[-2000:]
    assert "LAYOUT" not in out and "rank table" not in out, out
    line = err.strip().splitlines()[-1]
    assert line.startswith("tpkit-launch: error: ") and "--tp=4 (parallelism.tp)" in line \
        and "tp=2 from tpkit-launch --tp" in line, err
