"""What tpkit-launch says when something is wrong: ``LaunchError`` (a bad invocation, before any
worker starts), and a failed worker's record turned into one line (``describe_failure``),
peers' collateral failures told apart, user errors recognised."""
from __future__ import annotations

import logging

PROG = "tpkit-launch"


class LaunchError(ValueError):
    """A bad invocation, found before any worker starts; main() exits 2 with it."""


def _raise(message: str):
    raise LaunchError(f"{message}; see {PROG} --help")  # argparse's own messages


HANG_PREFIX = "HangError: "  # tpkit.recovery.hang.HangError, as torchrun records it


def _message(failure) -> str:
    msg = failure.message
    return str(msg.get("message", msg) if isinstance(msg, dict) else msg).strip()


class _DropFailureLog(logging.Filter):
    """Drops torch's routine failure records ("failed (exitcode: N) local_rank: ...",
    "Sending process P closing signal SIGTERM"): the line tpkit-launch prints after them
    names the failing rank, its exit code, its error and how many others were stopped."""
    ROUTINE = ("failed (exitcode:", "Sending process ", "Closing process ")

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.ROUTINE)


# A rank's error that only says a peer went away (the peer's own error is the cause; the
# error files' timestamps are whole seconds, so both often carry the same one).
_PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
              "communicator was aborted")


def _collateral(message) -> bool:
    text = str(message.get("message", message) if isinstance(message, dict) else message)
    return any(p in text for p in _PEER_GONE)


def describe_failure(e) -> str:
    """One line naming the rank that failed first and its error (from torchrun's per-rank
    error file); ranks the agent then stopped with a signal are only counted. After a
    hang, the verdict of tpkit.recovery's watchdog: the stuck ranks and where."""
    hangs = [m for m in map(_message, e.failures.values()) if m.startswith(HANG_PREFIX)]
    if hangs:  # every rank recorded rank 0's verdict, unless it never reached them
        return "hang: " + min(hangs, key=lambda m: "verdict did not reach" in m)[
            len(HANG_PREFIX):]
    own = [(_collateral(f.message), f.timestamp, r) for r, f in e.failures.items()
           if f.exitcode > 0]
    rank = min(own)[2] if own else e.get_first_failure()[0]
    f = e.failures[rank]
    msg = _message(f)
    # One line: a message with tracebacks in it (torch's CheckpointException gathers every
    # rank's) keeps its unindented lines but the "Traceback" headers, each once.
    lines = [ln.strip() for ln in msg.splitlines()
             if ln.strip() and not ln.startswith((" ", "\t", "Traceback (most recent call"))]
    msg = "; ".join(dict.fromkeys(lines))
    if f.exitcode > 0 and f.error_file_data.get("message") in (None, "", "<NONE>"):
        # no error file: torch's placeholder record is {"message": "<NONE>"}
        msg = "exited without a Python exception (sys.exit or a crash); see its output above"
    others = len(e.failures) - 1
    more = (f" ({others} other rank{'s' * (others > 1)} failed or "
            f"{'were' if others > 1 else 'was'} stopped)" if others else "")
    return (f"rank {rank} (local rank {f.local_rank}, exit code {f.exitcode}) failed: "
            f"{msg}{more}")


def user_error(line: str) -> bool:
    """Whether describe_failure's ``line`` reports a plain ValueError, which the worker
    wrapper records without printing a traceback (tpkit.cli._worker)."""
    return ") failed: ValueError: " in line
