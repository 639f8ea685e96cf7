"""Where a job's values come from: the TOML file (``read_toml``), the flags (``build_parser``,
``parse``), and the generated field reference (``field_docs``, ``markdown_table``)."""
from __future__ import annotations

import argparse
import difflib
import os
import re
import sys
from dataclasses import fields
from typing import Any, Callable

from .schema import SECTIONS
from .job import JobConfig, _toml_value


# --- reading a file and flags -----------------------------------------------------------
def _field_type(f) -> tuple[type, bool]:
    """(int/float/str/bool, may be None) from the annotation's text."""
    parts = [p.strip() for p in str(f.type).split("|")]
    base = {"int": int, "float": float, "str": str, "bool": bool}[parts[0]]
    return base, "None" in parts


def _coerce(f, value, where: str, path: str):
    """``value`` as field ``f``'s type, or ValueError naming it."""
    base, _ = _field_type(f)
    ok = (isinstance(value, bool) if base is bool else
          isinstance(value, int) and not isinstance(value, bool) if base is int else
          isinstance(value, (int, float)) and not isinstance(value, bool) if base is float
          else isinstance(value, str))
    if not ok:
        example = {int: "an integer, e.g. 1", float: "a number, e.g. 0.5",
                   str: 'a string, e.g. "x"', bool: "true or false"}[base]
        raise ValueError(f"{path}={value!r} ({where}) must be {example}")
    value = float(value) if base is float else value
    choices = f.metadata["choices"]
    if choices is not None and value not in choices:
        raise ValueError(f"{path}={value!r} ({where}) is not one of {list(choices)}; use one "
                         "of them")
    return value


def _toml_lines(text: str) -> dict[str, int]:
    """``section`` and ``section.key`` -> the line that sets it (for error messages)."""
    out, section = {}, ""
    for i, line in enumerate(text.splitlines(), 1):
        m = re.match(r"\s*\[\s*([^\]\s]+)\s*\]", line)
        if m:
            section = m.group(1)
            out.setdefault(section, i)
            continue
        m = re.match(r"\s*([A-Za-z0-9_\-\"']+)\s*=", line)
        if m:
            out.setdefault(f"{section}.{m.group(1).strip(chr(34) + chr(39))}"
                           if section else m.group(1), i)
    return out


def _suggest(name: str, options) -> str:
    close = difflib.get_close_matches(name, list(options), n=1)
    return f"did you mean {close[0]!r}? " if close else ""


def read_toml(path: str, job: JobConfig) -> None:
    """Set ``job``'s fields from the TOML file ``path`` (origin ``path:line``)."""
    try:
        import tomllib
    except ImportError:   # Python 3.10
        try:
            import tomli as tomllib
        except ImportError:
            raise ValueError(f"--config {path}: reading TOML on Python < 3.11 needs the "
                             "'tomli' package; pip install tomli") from None
    try:
        with open(path, "rb") as fh:
            raw = fh.read()
    except OSError as e:
        raise ValueError(f"--config {path}: {e.strerror}; pass an existing TOML file "
                         "(tpkit-train --print-config writes one)") from None
    text = raw.decode("utf-8", errors="replace")
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"--config {path}: not valid TOML: {e}; fix that line") from None
    lines = _toml_lines(text)
    for name, table in data.items():
        at = f"{path}:{lines.get(name, '?')}"
        if name not in SECTIONS:
            if not isinstance(table, dict):
                owners = [s for s, cls in SECTIONS.items()
                          if name in {f.name for f in fields(cls)}]
                fix = f"put it under [{owners[0]}]" if owners else "put it under a section"
                raise ValueError(f"{at}: {name} = {table!r} is outside any section; {fix}")
            raise ValueError(f"{at}: unknown section [{name}]; {_suggest(name, SECTIONS)}use "
                             f"one of {list(SECTIONS)}")
        if not isinstance(table, dict):
            raise ValueError(f"{at}: {name} must be a section ([{name}]), not a value")
        section = getattr(job, name)
        known = {f.name: f for f in fields(section)}
        for key, value in table.items():
            where = f"{path}:{lines.get(f'{name}.{key}', '?')}"
            if key not in known:
                raise ValueError(f"{where}: unknown key {key!r} in [{name}]; "
                                 f"{_suggest(key, known)}use one of {list(known)}")
            setattr(section, key, _coerce(known[key], value, where, f"{name}.{key}"))
            job.origin[f"{name}.{key}"] = where


class _Flag(argparse.Action):
    """Stores (value, the option string used) so that errors can name the flag."""
    def __call__(self, parser, namespace, values, option_string=None):
        value = self.const if values is None or values == [] else values
        getattr(namespace, "_flags").append((self.dest, value, option_string))


def _parse_bool(text: str) -> bool:
    t = text.strip().lower()
    if t in ("1", "true", "yes", "on"):
        return True
    if t in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"{text!r} is not true or false")


def _parse_number(base: type) -> Callable:
    def parse(text: str):
        try:
            return base(text)
        except ValueError:
            kind = "an integer" if base is int else "a number"
            raise argparse.ArgumentTypeError(f"{text!r} is not {kind}") from None
    parse.__name__ = base.__name__
    return parse


def build_parser(prog: str | None = None, description: str | None = None
                 ) -> argparse.ArgumentParser:
    """The flags of every field: ``--section.field`` and the field's short names;
    ``--help`` shows each with its doc and default."""
    ap = argparse.ArgumentParser(
        prog=prog, description=description, allow_abbrev=False,
        formatter_class=argparse.RawDescriptionHelpFormatter, argument_default=argparse.SUPPRESS)
    ap.add_argument("--config", metavar="FILE", default=None, action="append",
                    help="a TOML job file (flags override its values); one")
    ap.add_argument("--print-config", action="store_true", default=False,
                    help="print the resolved job as TOML and exit")
    for name, cls in SECTIONS.items():
        group = ap.add_argument_group(f"[{name}]", (cls.__doc__ or "").split("\n\n")[0]
                                      .replace("\n", " ").strip())
        for f in fields(cls):
            base, _ = _field_type(f)
            dest = f"{name}.{f.name}"
            doc = f.metadata["doc"] + f" (default: {f.default})"
            choices = f.metadata["choices"]
            if base is bool:
                group.add_argument(f"--{dest}", dest=dest, action=_Flag, nargs="?",
                                   const=True, type=_parse_bool, metavar="true|false",
                                   help=doc)
                if f.metadata["short"]:
                    group.add_argument(*f.metadata["short"], dest=dest, action=_Flag,
                                       nargs=0, const=True, help=f"same as --{dest}")
            else:
                group.add_argument(f"--{dest}", *f.metadata["short"], dest=dest,
                                   action=_Flag, choices=choices,
                                   type=str if base is str else _parse_number(base),
                                   metavar=None if choices else base.__name__.upper(),
                                   help=doc)
    return ap


_OLD_BACKEND = ("--backend {value}: the trainer's layer implementation (torch, te or auto) is "
                "--model.impl now; use --model.impl {value} (--backend is tpkit-launch's "
                "process-group backend, nccl or gloo, given before the script)")


def parse(argv=None, *, prog: str | None = None, description: str | None = None,
          env=None, defaults: dict | None = None) -> tuple[JobConfig, argparse.Namespace]:
    """(the checked JobConfig, the parsed namespace: ``config``, ``print_config``) from
    ``argv``: defaults < ``defaults`` (``{"section.field": (value, origin)}``, e.g. the
    Ray run's storage as checkpoint.save) < ``--config`` file < flags. Flag mistakes exit
    2 through argparse; value mistakes raise ValueError (one line: field, value, origin,
    fix)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    env = os.environ if env is None else env
    for i, a in enumerate(argv):
        if a == "--backend" or a.startswith("--backend="):
            value = a.split("=", 1)[1] if "=" in a else (argv[i + 1] if i + 1 < len(argv)
                                                         else "torch")
            raise ValueError(_OLD_BACKEND.format(value=value))
        m = re.match(r"(--\w+\.)([\w-]+)(=.*)?$", a)
        if m:   # --model.gqa-groups is --model.gqa_groups
            argv[i] = m.group(1) + m.group(2).replace("-", "_") + (m.group(3) or "")
    ap = build_parser(prog, description)
    ns = argparse.Namespace(_flags=[])
    ns = ap.parse_args(argv, namespace=ns)
    job = JobConfig()
    if ns.config and len(ns.config) > 1:   # the second silently replaced the first
        raise ValueError(f"--config given {len(ns.config)} times ({', '.join(ns.config)}); "
                         "pass one job file (flags override its values; tpkit-train "
                         "--config A --print-config > B writes one to edit)")
    ns.config = ns.config[0] if ns.config else None
    for dest, (value, origin) in (defaults or {}).items():
        setattr(getattr(job, dest.split(".")[0]), dest.split(".")[1], value)
        job.origin[dest] = origin
    if ns.config:
        read_toml(ns.config, job)
    for dest, value, flag in ns._flags:
        section, name = dest.split(".")
        setattr(getattr(job, section), name, value)
        job.origin[dest] = flag
    if job.recovery.hang_timeout is None and env.get("TPKIT_HANG_TIMEOUT", "").strip():
        raw = env["TPKIT_HANG_TIMEOUT"].strip()
        try:
            job.recovery.hang_timeout = float(raw)
        except ValueError:
            job.recovery.hang_timeout = -1.0
        job.origin["recovery.hang_timeout"] = "$TPKIT_HANG_TIMEOUT"
    return job.check(), ns


def field_docs() -> list[tuple[str, str, Any, str, tuple]]:
    """(section.field, type, default, doc, short flags) of every field, in order: the
    table docs/train.md shows (tests/train/test_job_config.py checks it)."""
    out = []
    for name, cls in SECTIONS.items():
        for f in fields(cls):
            out.append((f"{name}.{f.name}", str(f.type), f.default, f.metadata["doc"],
                        f.metadata["short"]))
    return out


def markdown_table() -> str:
    """docs/train.md's table of every field (section by section): its TOML key, flags,
    type, default and doc."""
    out = []
    for name, cls in SECTIONS.items():
        out += [f"**[{name}]** {' '.join((cls.__doc__ or '').split())}", "",
                "| key | flags | type | default | what |", "| --- | --- | --- | --- | --- |"]
        for f in fields(cls):
            flags = ", ".join(f"`{x}`" for x in (f"--{name}.{f.name}", *f.metadata["short"]))
            default = "unset" if f.default is None else f"`{_toml_value(f.default)}`"
            choices = f.metadata["choices"]
            doc = f.metadata["doc"] + (f"; one of {', '.join(map(str, choices))}"
                                       if choices else "")
            out.append(f"| `{f.name}` | {flags} | {str(f.type).replace('|', 'or')} | "
                       f"{default} | {doc} |")
        out.append("")
    return "\n".join(out)
