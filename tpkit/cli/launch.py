"""tpkit-launch: torchrun plus the parallel layout.

``tpkit-launch --tp 4 --cp 2 train.py ARGS`` checks the layout against the world size
before any process starts (exit 2 with one line on stderr), exports it as ``TPKIT_*``
so ``tpkit.init_parallel()`` needs no arguments, derives nodes, node rank and rendezvous
from Slurm when inside an allocation, and then runs torchrun's own launcher
(``torch.distributed.run.run``) in this process. Every other torchrun flag passes through.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import sys
from typing import Mapping

from .preflight import HOOK, LaunchInfo, PreflightError, find_hook, run_hook
from .errors import PROG, LaunchError, _DropFailureLog, _raise, describe_failure, user_error
from .counts import _env_int, _from_cluster, _nnodes, _nproc

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_worker.py")
DRY_RUN_ROWS = 64
# nccl's flight recorder, on unless the user set these (tpkit.recovery's hang watchdog
# dumps it; NCCL dumps it itself on a collective timeout).
NCCL_FLIGHT_RECORDER = {"TORCH_NCCL_TRACE_BUFFER_SIZE": "2000", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}
SHARED_STORE_OFF = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
TORCHRUN_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"  # torchrun's default; tpkit adds SIGUSR1


# --- command line ------------------------------------------------------------------
# torchrun options whose defaults tpkit resolves itself (Slurm, one node, auto).
_RESOLVED = {
    "nproc_per_node": (("--nproc-per-node", "--nproc_per_node"), "N",
                       "workers per node: N, or auto (default) = the visible GPUs; without "
                       "GPUs tp*cp*pp, or with --dp the whole layout split over the nodes "
                       "(tp*cp*pp*dp / nnodes)"),
    "nnodes": (("--nnodes",), "N", "nodes, N or MIN:MAX (default 1; SLURM_NNODES inside Slurm)"),
    "node_rank": (("--node-rank", "--node_rank"), "R",
                  "this node's rank (SLURM_NODEID inside Slurm; used by --rdzv-backend static)"),
    "rdzv_backend": (("--rdzv-backend", "--rdzv_backend"), "B", "c10d (default) or static"),
    "rdzv_endpoint": (("--rdzv-endpoint", "--rdzv_endpoint"), "HOST:PORT",
                      "HOST:PORT of the first node (inside Slurm: first host of the job)"),
    "rdzv_id": (("--rdzv-id", "--rdzv_id"), "ID",
                "job id shared by all nodes (inside Slurm: slurm-JOBID.STEPID)"),
}
_DESCRIPTION = __doc__.split("\n\n")[1].replace("\n", " ")
_HELP_ALL = "this help with every torchrun option (imports torch: slower)"


def _add_tpkit_options(parser) -> None:
    g = parser.add_argument_group("tpkit layout (exported to every worker as TPKIT_*)")
    for dim, what in (("tp", "tensor"), ("cp", "context"), ("pp", "pipeline")):
        g.add_argument(f"--{dim}", type=int, default=None, metavar="N",
                       help=f"{what}-parallel size (default 1 or $TPKIT_{dim.upper()})")
    g.add_argument("--dp", type=int, default=None, metavar="N",
                   help="data-parallel size; checked against the world if given, else the rest")
    g.add_argument("--sequence-parallel", "--sequence_parallel", action="store_true",
                   default=None, help="shard activations along the sequence inside TP (tp >= 2)")
    g.add_argument("--cp-comm-type", "--cp_comm_type", default=None, metavar="T",
                   help="p2p (default), all_gather, a2a or a2a+p2p")
    g.add_argument("--cp-a2a-size", "--cp_a2a_size", type=int, default=None, metavar="N",
                   help="inner all-to-all level size for --cp-comm-type a2a+p2p")
    g.add_argument("--ep", type=int, default=None, metavar="N",
                   help="expert-parallel size: experts sharded over N ranks (docs/moe.md)")
    g.add_argument("--etp", type=int, default=None, metavar="N",
                   help="expert-tensor-parallel size (default: tp); etp*ep divides tp*cp*dp")
    g = parser.add_argument_group("tpkit launch")
    g.add_argument("--backend", choices=("nccl", "gloo"), default=None,
                   help="process-group backend the workers use (default: nccl with GPUs, "
                        "else gloo); exported as TPKIT_BACKEND")
    g.add_argument("--dry-run", "--dry_run", action="store_true",
                   help="print the rank table and groups this launch would build; start nothing")
    from .memory import add_memory_options
    add_memory_options(parser)


def build_parser():
    """torchrun's own parser (so every torchrun flag works) plus tpkit's layout flags.
    Flags tpkit resolves itself default to None, meaning "not given"."""
    from torch.distributed.run import get_args_parser
    parser = get_args_parser()
    parser.allow_abbrev = False   # --data must not be read as --data-parallel, nor --step as --steps
    parser.prog = PROG
    parser.description = _DESCRIPTION
    parser.error = _raise
    _add_tpkit_options(parser)
    parser.add_argument("--help-all", action="help", help=_HELP_ALL)
    env = os.environ
    # None = not given: resolve() takes nodes, node rank and workers per node from Slurm,
    # Kubernetes or SkyPilot (tpkit.cli.clusters), else torchrun's PET_* variables.
    parser.set_defaults(
        nproc_per_node=None, nnodes=None, node_rank=None, rdzv_backend=env.get("PET_RDZV_BACKEND"),
        rdzv_endpoint=env.get("PET_RDZV_ENDPOINT"), rdzv_id=env.get("PET_RDZV_ID"))
    for action in parser._actions:
        if action.dest in _RESOLVED:
            action.help = _RESOLVED[action.dest][2]
    return parser


def help_parser():
    """The parser ``--help`` prints without importing torch: tpkit's flags and the torchrun
    flags tpkit resolves; the others pass through to torchrun (``--help-all`` lists them)."""
    import argparse
    parser = argparse.ArgumentParser(
        prog=PROG, description=_DESCRIPTION, allow_abbrev=False,
        usage=f"{PROG} [options] SCRIPT [SCRIPT ARGS ...]",
        epilog="Every other torchrun option (--max-restarts, --log-dir, --monitor-interval, "
               "--standalone, -m, ...) is accepted too and passed through; "
               f"`{PROG} --help-all` lists them.")
    g = parser.add_argument_group("torchrun options tpkit resolves")
    for dest, (flags, metavar, text) in _RESOLVED.items():
        g.add_argument(*flags, dest=dest, metavar=metavar, help=text)
    _add_tpkit_options(parser)
    parser.add_argument("--help-all", action="store_true", help=_HELP_ALL)
    return parser


def _asks_for_help(argv: list[str]) -> bool:
    """``-h``/``--help`` before the first non-option word (later ones may be the script's,
    or follow an option's value: those go through the full parser)."""
    for tok in argv:
        if tok in ("-h", "--help"):
            return True
        if not tok.startswith("-"):
            return False
    return False


@dataclasses.dataclass
class Plan:
    """Everything resolved before a worker starts."""

    config: object  # the Layout (a ParallelConfig, dp unresolved, for --nnodes MIN:MAX)
    nproc_per_node: int
    min_nodes: int
    max_nodes: int
    node_rank: int | None
    rdzv_backend: str
    rdzv_endpoint: str
    rdzv_id: str
    backend: str
    command: list[str]
    exports: dict[str, str]
    slurm: object = None
    preflight: list = dataclasses.field(default_factory=list)  # LaunchInfo per node count
    memory_jobs: list = dataclasses.field(default_factory=list)  # the hook's MemoryJobs


def _visible_gpus() -> int:
    import torch
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def resolve(args, env: Mapping[str, str]) -> Plan:
    """Check the invocation against the layout, the machine and Slurm; raise LaunchError."""
    from tpkit._env import env_flag
    from tpkit.layout.config import LAUNCH_GIVEN, ParallelConfig, fused_attn_enabled
    from tpkit.comm.shm import shm_allreduce_enabled, shm_p2p_enabled
    from .clusters import cluster_info
    from .slurm import slurm_info
    try:
        shm_allreduce_enabled(env)
        shm_p2p_enabled(env)
        fused_attn_enabled(env)
        env_flag("TPKIT_TRACEBACK", env, default=False,
                 fix="use 1 (print every failing rank's traceback) or 0")
        config = ParallelConfig.from_env(
            {k: v for k, v in env.items() if k != LAUNCH_GIVEN},
            tp=args.tp, cp=args.cp, pp=args.pp, dp=args.dp,
            sequence_parallel=args.sequence_parallel, cp_comm_type=args.cp_comm_type,
            cp_a2a_size=args.cp_a2a_size, ep=args.ep, etp=args.etp, given_as="tpkit-launch --{flag}")
        slurm = slurm_info(env)
        cluster = None if slurm is not None else cluster_info(env)
    except ValueError as e:
        raise LaunchError(str(e)) from None
    gpus = _visible_gpus()

    node_rank = args.node_rank
    endpoint, rdzv_id = args.rdzv_endpoint, args.rdzv_id
    nproc_value = args.nproc_per_node
    if cluster is not None:
        lo, hi, node_rank, nproc_value = _from_cluster(args, cluster)
        endpoint = endpoint or cluster.endpoint
        rdzv_id = rdzv_id or cluster.rdzv_id
    elif slurm is None:
        if node_rank is None and env.get("PET_NODE_RANK"):
            node_rank = _env_int(env, "PET_NODE_RANK")
        nproc_value = nproc_value or env.get("PET_NPROC_PER_NODE")
    if slurm is not None:
        if args.nnodes is not None and _nnodes(args.nnodes) != (slurm.nnodes, slurm.nnodes):
            raise LaunchError(f"--nnodes={args.nnodes} conflicts with the Slurm allocation's "
                              f"{slurm.nnodes} node(s); drop --nnodes inside Slurm")
        if node_rank is not None and node_rank != slurm.node_rank:
            raise LaunchError(f"--node-rank={node_rank} conflicts with SLURM_NODEID="
                              f"{slurm.node_rank}; drop --node-rank inside Slurm")
        lo = hi = slurm.nnodes
        node_rank = slurm.node_rank
        if not endpoint:
            try:
                endpoint = f"{slurm.first_host()}:{slurm.rdzv_port(env)}"
            except ValueError as e:
                raise LaunchError(str(e)) from None
        rdzv_id = rdzv_id or slurm.rdzv_id
    elif cluster is None:
        lo, hi = _nnodes(args.nnodes or env.get("PET_NNODES") or "1")
    nproc = _nproc(nproc_value or "auto", config, gpus=gpus, nnodes=lo,
                   given_as=(f"{cluster.nproc_var}" if cluster and not args.nproc_per_node
                             and nproc_value else "--nproc-per-node"))
    rdzv_backend = args.rdzv_backend or (cluster.rdzv_backend if cluster else "c10d")
    if rdzv_backend == "c10d" and hi == 1 and not endpoint:
        endpoint = "localhost:0"  # one node: c10d store on a free port (torchrun --standalone)
        rdzv_id = rdzv_id or f"tpkit-{os.getpid()}"
    if node_rank is not None and not 0 <= node_rank < hi:
        raise LaunchError(f"--node-rank={node_rank} is out of range for {hi} node(s); pass a "
                          f"different node rank 0..{hi - 1} on each node")
    _check_torchrun_flags(args, rdzv_backend, endpoint)
    if rdzv_backend == "static" and hi > 1 and node_rank is None:
        raise LaunchError("--rdzv-backend static with several nodes needs --node-rank on "
                          "every node (or use the default c10d rendezvous)")
    if hi > 1 and not endpoint and not (rdzv_backend == "static" and args.master_addr) \
            and not args.standalone and not args.dry_run:
        raise LaunchError(f"--nnodes={args.nnodes} needs --rdzv-endpoint HOST:PORT of the "
                          "first node (the same on every node), or run inside Slurm")

    if lo != hi and config.dp is not None:
        raise LaunchError(f"--dp={config.dp} cannot hold for every node count in --nnodes="
                          f"{lo}:{hi}; drop --dp for elastic launches")
    layouts = _layouts(config, lo, hi, nproc)

    backend = args.backend or ("nccl" if gpus else "gloo")
    if backend == "nccl" and not gpus and not args.dry_run:
        raise LaunchError("--backend nccl needs CUDA GPUs and none are visible here; use "
                          "--backend gloo")
    command = _command(args, env)
    exports = dict(TPKIT_BACKEND=backend)
    exports[LAUNCH_GIVEN] = ",".join(   # a script's init_parallel may not contradict them
        f for f in ("tp", "cp", "pp", "dp", "ep", "etp", "sequence_parallel", "cp_comm_type",
                    "cp_a2a_size") if getattr(args, f, None) is not None)
    if backend == "nccl":
        exports.update({k: v for k, v in NCCL_FLIGHT_RECORDER.items() if k not in env})
        if args.log_dir and "TORCH_NCCL_DEBUG_INFO_TEMP_FILE" not in env:
            exports["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] = os.path.join(
                os.path.abspath(args.log_dir), "nccl_trace_rank_")
    if (int(getattr(args, "max_restarts", 0) or 0) > 0 or lo != hi) \
            and rdzv_backend == "c10d" and SHARED_STORE_OFF not in env:
        # Restarts (and elastic membership changes) start a new rendezvous round. Workers
        # that share the agent's store see the previous round's keys (torch issue 135712:
        # the new gloo/nccl group reads its peers' old addresses and fails to connect, or
        # hangs): give every round a store of its own.
        exports[SHARED_STORE_OFF] = "1"
    if "OMP_NUM_THREADS" not in env:
        cpus = (slurm.cpus_per_task if slurm and slurm.cpus_per_task
                else len(os.sched_getaffinity(0)))
        exports["OMP_NUM_THREADS"] = str(max(1, cpus // nproc))
    plan = Plan(config=config, nproc_per_node=nproc, min_nodes=lo, max_nodes=hi,
                node_rank=node_rank, rdzv_backend=rdzv_backend, rdzv_endpoint=endpoint or "",
                rdzv_id=rdzv_id or "none", backend=backend, command=command,
                exports=exports, slurm=slurm)
    _settle(plan, layouts, env, dry_run=args.dry_run)
    return plan


def _layouts(config, lo: int, hi: int, nproc: int) -> list:
    """``config`` checked once against every world ``--nnodes`` allows (an elastic job
    must be valid at every size it may take): the Layout of each node count."""
    layouts = []
    for n in range(lo, hi + 1):
        try:
            layouts.append(config.validate(n * nproc))
        except ValueError as e:
            raise LaunchError(f"{e} [world = {n} node(s) x {nproc} processes per node]") from None
    _tp_in_node(config.tp, nproc, hi)
    return layouts


def _tp_in_node(tp: int, nproc: int, nnodes: int) -> None:
    if nnodes > 1 and nproc % tp != 0:
        raise LaunchError(
            f"tp={tp} does not fit in one node of {nproc} processes: TP groups would "
            "span nodes and all-reduce every layer over the network; choose tp dividing "
            f"--nproc-per-node={nproc} (TP stays inside a node)")


def _settle(plan: Plan, layouts: list, env: Mapping[str, str], *, dry_run: bool) -> None:
    """Make ``layouts`` (one Layout per node count) the plan's final layout: its config
    (the Layout; for an elastic launch the sizes with dp left to the world), its
    TPKIT_* exports and the pre-flight's LaunchInfo per node count."""
    from tpkit.layout.config import ENV_VARS, ParallelConfig
    first = layouts[0]
    if plan.min_nodes == plan.max_nodes:
        plan.config = first
    else:
        plan.config = ParallelConfig(**{f: getattr(first, f) for f in ENV_VARS if f != "dp"},
                                     origin=first.origin)
    for var in ENV_VARS.values():
        plan.exports.pop(var, None)
    plan.exports.update(plan.config.to_env())
    plan.preflight = [
        LaunchInfo(config=layout, world_size=layout.world_size,
                   nproc_per_node=plan.nproc_per_node, nnodes=n, env={**env, **plan.exports},
                   dry_run=dry_run)
        for n, layout in zip(range(plan.min_nodes, plan.max_nodes + 1), layouts)]


def _command(args, env: Mapping[str, str]) -> list[str]:
    """The worker command line; scripts and modules run under the error-recording wrapper."""
    script = args.training_script
    if args.no_python and args.module:
        raise LaunchError("--no-python and -m cannot be combined: -m runs a Python module; "
                          "drop one of them")
    if args.no_python or args.run_path:
        return [script, *args.training_script_args]  # torchrun's own handling, unwrapped
    python = env.get("PYTHON_EXEC", sys.executable)
    target = ["-m", script] if args.module else [script]
    return [python, "-u", WORKER, *target, *args.training_script_args]


def preflight(args, plan: Plan) -> str | None:
    """The script's file checks, then its ``tpkit_preflight`` hook if it has one
    (tpkit.cli.preflight); PreflightError when it refuses, its text when it answered."""
    if args.no_python or args.run_path:
        return None
    source = find_hook(args)
    if source is None:   # a script with a hook checks its own arguments (launch/train.py --tp)
        _warn_flags_after_script(args)
        return None
    layouts: list = []
    answer = run_hook(args, source, plan.preflight, jobs=plan.memory_jobs, layouts=layouts)
    if layouts and layouts != [info.config for info in plan.preflight]:
        # the script's own sizes (launch/train.py --tp 4): the launch is that layout, the
        # one its workers build (a size given to both with two values, the hook refused)
        if len(layouts) != len(plan.preflight):
            raise PreflightError(f"{HOOK} returned a layout for some node counts only; "
                                 "return one for every call")
        _tp_in_node(layouts[0].tp, plan.nproc_per_node, plan.max_nodes)
        env = {k: v for k, v in plan.preflight[0].env.items() if k not in plan.exports}
        _settle(plan, layouts, env, dry_run=args.dry_run)
    return answer


def _check_torchrun_flags(args, rdzv_backend: str, endpoint: str | None) -> None:
    """The values torchrun itself would refuse only after starting (with a traceback)."""
    from torch.distributed.elastic.multiprocessing.api import Std
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint
    if args.max_restarts < 0:
        raise LaunchError(f"--max-restarts={args.max_restarts} must be >= 0 (0: no restarts)")
    if not args.monitor_interval > 0:
        raise LaunchError(f"--monitor-interval={args.monitor_interval} must be > 0 seconds; "
                          "e.g. 0.1 (the default)")
    for flag in ("redirects", "tee"):
        try:
            Std.from_str(getattr(args, flag))
        except ValueError:
            raise LaunchError(f"--{flag}={getattr(args, flag)!r} is not a stream number: pass "
                              "0 (none), 1 (stdout), 2 (stderr) or 3 (both), or per local "
                              "rank like 0:1,1:3") from None
    known = sorted(getattr(rendezvous_handler_registry, "_registry", None) or ())
    if known and rdzv_backend not in known:
        raise LaunchError(f"--rdzv-backend={rdzv_backend!r} is unknown; use one of {known}")
    if endpoint:
        try:
            parse_rendezvous_endpoint(endpoint, default_port=29400)
        except ValueError as e:
            raise LaunchError(f"--rdzv-endpoint={endpoint!r}: {e}; pass HOST:PORT, e.g. "
                              "node0:29400") from None
    if args.master_port is not None and not 0 <= args.master_port <= 65535:
        raise LaunchError(f"--master-port={args.master_port} is not a port; pass 0..65535")
    if args.log_dir:
        from tpkit.checkpoint._dcp_verify import dir_problem
        problem = dir_problem(args.log_dir)
        if problem:
            raise LaunchError(f"--log-dir={args.log_dir!r} cannot be used ({problem}); pass "
                              "a writable directory")
    if args.local_ranks_filter:
        try:
            [int(r) for r in args.local_ranks_filter.split(",")]
        except ValueError:
            raise LaunchError(f"--local-ranks-filter={args.local_ranks_filter!r} is not a "
                              "comma-separated list of local ranks; pass e.g. 0,1") from None


# --- running -----------------------------------------------------------------------
def _launch(args, plan: Plan) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import run

    os.environ.update(plan.exports)
    script = args.training_script
    args.nnodes = f"{plan.min_nodes}:{plan.max_nodes}"
    args.nproc_per_node = str(plan.nproc_per_node)
    args.node_rank = plan.node_rank or 0
    args.rdzv_backend, args.rdzv_id = plan.rdzv_backend, plan.rdzv_id
    args.rdzv_endpoint = plan.rdzv_endpoint
    if not (args.no_python or args.run_path):
        args.module = False
        args.training_script = WORKER
        args.training_script_args = plan.command[3:]
    if getattr(args, "signals_to_handle", None) == TORCHRUN_SIGNALS:
        args.signals_to_handle += ",SIGUSR1"  # Slurm's --signal; the workers may save on it
    _signal_once()
    quiet = _DropFailureLog()
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(quiet)
    try:
        try:
            run(args)
        except UnboundLocalError as e:
            # torch's elastic metrics wrapper (metrics/api.py) sets ``start`` inside its try:
            # a signal arriving just before that line makes its ``finally`` raise
            # UnboundLocalError over the SignalException. It is still the signal.
            if not isinstance(e.__context__, SignalException):
                raise
            raise e.__context__ from None
    except ChildFailedError as e:
        e.name = script  # torchrun would name the wrapper module
        line = describe_failure(e)
        if user_error(line):  # a user's ValueError: the one line says it all
            from tpkit._env import env_flag
            if not env_flag("TPKIT_TRACEBACK", default=False):   # checked by resolve()
                line += " [TPKIT_TRACEBACK=1 shows the traceback]"
        else:
            print(e.format_msg(), file=sys.stderr)
        print(f"{PROG}: {line}", file=sys.stderr, flush=True)
        return 1
    except SignalException as e:
        print(f"{PROG}: stopped by {e.sigval.name}; the workers were sent it too",
              file=sys.stderr, flush=True)
        return 128 + int(e.sigval)
    finally:
        logging.getLogger("torch.distributed.elastic.multiprocessing.api").removeFilter(quiet)
    return 0


def _signal_once() -> None:
    """torchrun's agent turns a handled signal into SignalException, then sends it to the
    workers and waits for them (SIGKILL after its shutdown timeout). A repeated signal
    would abort that wait and leave workers that are still saving behind: after the
    first, report and ignore them."""
    import signal
    from torch.distributed.elastic.multiprocessing import api
    first, seen = api._terminate_process_handler, []

    def handler(signum, frame):
        if seen:
            os.write(2, f"{PROG}: {signal.Signals(signum).name} again: still waiting for "
                        "the workers to stop\n".encode())
            return
        seen.append(signum)
        first(signum, frame)

    api._terminate_process_handler = handler


# tpkit-launch's own flags that a user may put after the script by mistake
_OWN_AFTER_SCRIPT = {"--tp": "tp", "--cp": "cp", "--pp": "pp", "--dp": "dp", "--ep": "ep",
                     "--etp": "etp", "--sequence-parallel": "sequence_parallel",
                     "--cp-comm-type": "cp_comm_type", "--cp-a2a-size": "cp_a2a_size",
                     "--nproc-per-node": None, "--nnodes": None, "--backend": "backend",
                     "--dry-run": "dry_run"}


def _warn_flags_after_script(args) -> None:
    """A tpkit-launch flag after the script goes to the script, not to tpkit-launch: say so
    (one line on stderr) when tpkit-launch was not given the same flag itself and the
    script has no ``tpkit_preflight`` hook (one that takes such flags checks them)."""
    script = getattr(args, "training_script", "")
    rest = list(getattr(args, "training_script_args", []) or [])
    for i, tok in enumerate(rest):
        flag = tok.split("=", 1)[0]
        if flag not in _OWN_AFTER_SCRIPT:
            continue
        dest = _OWN_AFTER_SCRIPT[flag]
        if dest is not None and getattr(args, dest, None) not in (None, False):
            continue
        given = tok
        if "=" not in tok and i + 1 < len(rest) and not rest[i + 1].startswith("-"):
            given = f"{tok} {rest[i + 1]}"
        print(f"{PROG}: warning: {flag} comes after the script {script}, so it is passed to "
              f"the script and {PROG} does not use it; put {PROG}'s flags before the script: "
              f"{PROG} {given} {script} ...", file=sys.stderr, flush=True)


def check_repeated(parser, argv: list[str]) -> None:
    """LaunchError when one of tpkit-launch's own options (before the script) is given
    twice with different values, e.g. ``--tp 2 ... --tp 4``: argparse keeps the last one
    silently. Spellings of one option (``--nproc-per-node``, ``--nproc_per_node``) count
    as one."""
    seen: dict[str, tuple[str, str]] = {}
    i = 0
    while i < len(argv):
        tok = argv[i]
        if tok == "--" or not tok.startswith("-") or tok == "-m":
            return   # the script (or -m MODULE) starts: the rest is the script's
        name, eq, inline = tok.partition("=")
        action = parser._option_string_actions.get(name)
        if action is None:
            i += 1
            continue
        if eq or action.nargs == 0:
            value, i = (inline if eq else "(set)"), i + 1
        else:
            value, i = (argv[i + 1] if i + 1 < len(argv) else ""), i + 2
        if action.dest in seen and seen[action.dest][1] != value:
            first, before = seen[action.dest]
            _raise(f"{name} given twice ({first} {before}, then {name} {value}); "
                   f"{PROG} would use the last one silently: pass it once")
        seen[action.dest] = (name, value)


def main(argv: list[str] | None = None) -> int:
    """Console entry: returns the exit code (0 ok, 1 a worker failed, 2 bad invocation)."""
    argv = sys.argv[1:] if argv is None else argv
    if _asks_for_help(argv):
        help_parser().parse_args(["--help"])   # prints, SystemExit(0); torch not imported
    try:
        parser = build_parser()
        args = parser.parse_args(argv)
        check_repeated(parser, argv)
        plan = resolve(args, os.environ)
        answer = preflight(args, plan)
    except (LaunchError, PreflightError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr, flush=True)
        return 2
    if answer is not None:  # the script answered by itself (its --help): nothing to start
        print(answer, end="", flush=True)
        return 0
    from .memory import MemoryError_, check_memory
    try:
        memory = check_memory(args, plan, plan.memory_jobs)
    except MemoryError_ as e:
        if args.dry_run and e.report:   # the report, the estimate, the layouts that fit
            from .plan import report
            print(report(plan, limit=DRY_RUN_ROWS, memory=e.report), flush=True)
        print(f"{PROG}: error: {e}", file=sys.stderr, flush=True)
        return 2
    if args.dry_run:
        from .plan import report
        print(report(plan, limit=DRY_RUN_ROWS, memory=memory), flush=True)
        return 0
    return _launch(args, plan)


if __name__ == "__main__":
    sys.exit(main())
