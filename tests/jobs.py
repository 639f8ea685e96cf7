"""Harness for tpkit-train's job configs: the message a command line is refused with."""
import contextlib
import io


def refusal(argv, env=None) -> str:
    """The one line tpkit-train refuses ``argv`` with before any process starts: argparse's
    (exit 2) or the JobConfig's ValueError. AssertionError when it is accepted."""
    from tpkit.train import parse
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            parse(argv, env=env or {})
    except SystemExit as e:
        assert e.code == 2, e.code
        lines = [ln for ln in err.getvalue().splitlines() if ln.strip()]
        return lines[-1]
    except ValueError as e:
        assert "\n" not in str(e), str(e)
        return str(e)
    raise AssertionError(f"{argv} was accepted")
