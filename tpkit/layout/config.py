"""ParallelConfig: the parallel layout as plain sizes and options.

It is validated before any process group exists (the launcher checks it before any
worker starts) and travels to workers as ``TPKIT_*`` environment variables.
Every bad value raises ``ValueError`` naming the value and what would fix it.
"""
from __future__ import annotations

import dataclasses
import os
import re
from typing import Mapping

from .._env import env_flag

CP_COMM_TYPES = ("p2p", "all_gather", "a2a", "a2a+p2p")
# fp8 recipes by name -> the class name they share in tpkit.fp8 and Transformer Engine
# (transformer_engine.common.recipe); no torch here, so launch/train.py's --help and
# tpkit.te read it without importing tpkit.fp8.
FP8_RECIPES = {"delayed": "DelayedScaling", "current": "Float8CurrentScaling",
               "block": "Float8BlockScaling", "mxfp8": "MXFP8BlockScaling"}

ENV_VARS = {
    "tp": "TPKIT_TP",
    "cp": "TPKIT_CP",
    "pp": "TPKIT_PP",
    "dp": "TPKIT_DP",
    "sequence_parallel": "TPKIT_SEQUENCE_PARALLEL",
    "cp_comm_type": "TPKIT_CP_COMM_TYPE",
    "cp_a2a_size": "TPKIT_CP_A2A_SIZE",
    "ep": "TPKIT_EP",
    "etp": "TPKIT_ETP",
}


def _check_size(name: str, value, *, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name}={value!r} must be an integer >= 1; pass e.g. {name}=1")
    if value < 1:
        raise ValueError(f"{name}={value} must be >= 1; use {name}=1 to disable this dimension")


@dataclasses.dataclass(frozen=True, eq=False)
class ParallelConfig:
    """Sizes of the tp, cp, dp and pp dimensions and the options that go with them.

    ``dp=None`` means "whatever is left of the world". ``sequence_parallel=True`` needs
    ``tp >= 2``: with one TP rank there is nothing to shard, and we refuse rather than
    silently ignore the flag (Megatron silently turns it off). ``cp_a2a_size`` is the
    size of the inner (all-to-all) level of ``cp_comm_type="a2a+p2p"`` and is only
    meaningful there.

    ``ep`` and ``etp`` re-cut the ``tp * cp * dp`` ranks of each pipeline stage for the
    expert layers (Megatron-Core's "parallel folding"): ``etp`` (expert-tensor, default
    ``tp``) innermost, then ``ep`` (expert-parallel), then ``edp = tp*cp*dp / (etp*ep)``
    (expert-data-parallel). Dense layers keep tp/cp/dp.
    """

    tp: int = 1
    cp: int = 1
    pp: int = 1
    dp: int | None = None
    sequence_parallel: bool = False
    cp_comm_type: str = "p2p"
    cp_a2a_size: int | None = None
    ep: int = 1
    etp: int | None = None
    #: Where each value came from, for error messages (``from_env`` fills it): field name
    #: -> e.g. "$TPKIT_DP (...)" or "init_parallel's tp argument". Not part of the layout.
    origin: Mapping[str, str] | None = dataclasses.field(
        default=None, compare=False, repr=False, kw_only=True)

    def __post_init__(self) -> None:
        try:
            self._check()
        except ValueError as e:
            raise ValueError(self._with_origin(str(e))) from None

    def _key(self) -> tuple:
        return tuple(getattr(self, f.name) for f in dataclasses.fields(self) if f.compare)

    def __eq__(self, other) -> bool:   # a Layout equals the ParallelConfig of its sizes
        if not isinstance(other, ParallelConfig):
            return NotImplemented
        return self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def _with_origin(self, message: str, fields=None) -> str:
        """``message`` plus where the values it names came from (those of ``fields``, or
        every field the message mentions as ``name=``), when they were not defaults."""
        if not self.origin:
            return message
        if fields is None:
            fields = [f for f in ENV_VARS if re.search(rf"\b{f}=", message)]
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        fields = [f for f in fields if f in self.origin and getattr(self, f) != defaults[f]]
        known = [f"{f}={getattr(self, f)!r} from {self.origin[f]}" for f in fields]
        if not known:
            return message
        env = any(self.origin[f].startswith("$") for f in fields)
        return (f"{message} [{'; '.join(known)}"
                + ("; tpkit-launch exports $TPKIT_*, or your shell set them" if env else "") + "]")

    def _check(self) -> None:
        for name in ("tp", "cp", "pp", "ep"):
            _check_size(name, getattr(self, name))
        _check_size("dp", self.dp, allow_none=True)
        _check_size("etp", self.etp, allow_none=True)
        if not isinstance(self.sequence_parallel, bool):
            raise ValueError(
                f"sequence_parallel={self.sequence_parallel!r} must be True or False")
        if self.sequence_parallel and self.tp == 1:
            raise ValueError(
                "sequence_parallel=True needs tp >= 2 (with tp=1 there is nothing to shard "
                "the sequence over); set tp >= 2 or sequence_parallel=False")
        if self.cp_comm_type not in CP_COMM_TYPES:
            raise ValueError(
                f"cp_comm_type={self.cp_comm_type!r} is unknown; use one of {CP_COMM_TYPES}")
        if self.cp_comm_type == "a2a+p2p":
            if self.cp_a2a_size is None:
                raise ValueError(
                    "cp_comm_type='a2a+p2p' needs cp_a2a_size (the size of the inner "
                    f"all-to-all level, a divisor of cp={self.cp} between 2 and cp/2)")
            _check_size("cp_a2a_size", self.cp_a2a_size)
            if self.cp % self.cp_a2a_size != 0:
                raise ValueError(
                    f"cp_a2a_size={self.cp_a2a_size} does not divide cp={self.cp}; choose a "
                    "divisor of cp")
            if self.cp_a2a_size in (1, self.cp):
                raise ValueError(
                    f"cp_a2a_size={self.cp_a2a_size} with cp={self.cp} leaves one "
                    "hierarchy level empty; use cp_comm_type='p2p' or 'a2a', or a "
                    "cp_a2a_size strictly between 1 and cp")
        elif self.cp_a2a_size is not None:
            raise ValueError(
                f"cp_a2a_size={self.cp_a2a_size} is only used with cp_comm_type='a2a+p2p' "
                f"(got cp_comm_type={self.cp_comm_type!r}); drop it or change the comm type")

    @property
    def model_size(self) -> int:
        """Ranks that hold one copy of the model: tp * cp * pp."""
        return self.tp * self.cp * self.pp

    @property
    def expert_tp(self) -> int:
        """The expert-tensor-parallel size: ``etp``, or ``tp`` when etp is unset."""
        return self.tp if self.etp is None else self.etp

    @property
    def has_experts(self) -> bool:
        """Do the expert layers have their own decomposition (ep > 1 or etp != tp)?"""
        return self.ep > 1 or self.expert_tp != self.tp

    @property
    def edp(self) -> int:
        """Expert-data-parallel size, ``tp*cp*dp / (etp*ep)`` (dp must be resolved)."""
        if self.dp is None:
            raise ValueError("dp is not resolved yet; call validate(world_size) first")
        return self.tp * self.cp * self.dp // (self.expert_tp * self.ep)

    @property
    def cp_p2p_size(self) -> int | None:
        return None if self.cp_a2a_size is None else self.cp // self.cp_a2a_size

    def validate(self, world_size: int) -> "Layout":
        """Check the layout against ``world_size``; return it resolved: a :class:`Layout`
        (``dp`` filled in), which nothing downstream checks again."""
        _check_size("world_size", world_size)
        if world_size % self.model_size != 0:
            raise ValueError(self._with_origin(
                f"world size {world_size} is not divisible by tp*cp*pp = {self.tp}*{self.cp}*"
                f"{self.pp} = {self.model_size}; use a world size that is a multiple of "
                f"{self.model_size} or smaller tp/cp/pp", ("tp", "cp", "pp")))
        dp = world_size // self.model_size
        if self.dp is not None and self.dp != dp:
            var = ENV_VARS["dp"]
            fix = (f"unset {var} (a value left from another job?) or set {var}={dp}"
                   if (self.origin or {}).get("dp") == f"${var}" else
                   f"pass dp={dp} or leave dp unset")
            raise ValueError(self._with_origin(
                f"dp={self.dp} is inconsistent with world size {world_size} and tp*cp*pp="
                f"{self.model_size} (which leave dp={dp}); {fix}", ("dp", "tp", "cp", "pp")))
        stage = self.tp * self.cp * dp
        if stage % (self.expert_tp * self.ep):
            raise ValueError(self._with_origin(
                f"etp*ep = {self.expert_tp}*{self.ep} = {self.expert_tp * self.ep} does not "
                f"divide tp*cp*dp = {self.tp}*{self.cp}*{dp} = {stage} (the ranks of one "
                "pipeline stage, which the expert layers re-cut as etp x ep x edp); choose ep "
                f"and etp whose product divides {stage}, or change the world size",
                ("ep", "etp", "tp", "cp")))
        return Layout(**{f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                         if f.init and f.name != "dp"}, dp=dp)

    @property
    def world_size(self) -> int:
        if self.dp is None:
            raise ValueError("dp is not resolved yet; call validate(world_size) first")
        return self.model_size * self.dp

    # --- environment ---------------------------------------------------------------
    def to_env(self) -> dict[str, str]:
        """The ``TPKIT_*`` variables that :meth:`from_env` reads back."""
        env = {
            ENV_VARS["tp"]: str(self.tp),
            ENV_VARS["cp"]: str(self.cp),
            ENV_VARS["pp"]: str(self.pp),
            ENV_VARS["sequence_parallel"]: "1" if self.sequence_parallel else "0",
            ENV_VARS["cp_comm_type"]: self.cp_comm_type,
        }
        if self.dp is not None:
            env[ENV_VARS["dp"]] = str(self.dp)
        if self.cp_a2a_size is not None:
            env[ENV_VARS["cp_a2a_size"]] = str(self.cp_a2a_size)
        if self.ep != 1:
            env[ENV_VARS["ep"]] = str(self.ep)
        if self.etp is not None:
            env[ENV_VARS["etp"]] = str(self.etp)
        return env

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, *, given_as: str = "the {name} argument",
                 **overrides) -> "ParallelConfig":
        """Build from ``TPKIT_*`` variables (unset ones take defaults); keyword overrides win.
        Error messages say where each value came from: the variable, or ``given_as``
        (``{name}`` and ``{flag}`` are filled in, e.g. "tpkit-launch --{flag}").

        The variables describe one layout, so values derived from a size an override
        changes are dropped rather than contradicted: ``TPKIT_DP`` (the rest of the world at
        the exported tp*cp*pp) when tp, cp or pp is overridden with another value (dp is
        then re-derived), and ``TPKIT_CP_A2A_SIZE`` when cp_comm_type is overridden with
        something other than "a2a+p2p". So ``init_parallel(tp=4)`` under a plain
        ``tpkit-launch`` builds tp=4 with dp = world / 4; under ``tpkit-launch --tp 2``
        (a size the launch was given, listed in ``$TPKIT_LAUNCH_GIVEN``) a different value
        is a ValueError for the first layout the process builds: the layout is given once;
        after destroy_parallel(), another layout is the script's choice."""
        env = os.environ if env is None else env
        kwargs: dict = {}
        origin: dict = {}
        for field, var in ENV_VARS.items():
            raw = env.get(var)
            if raw is None:
                continue
            origin[field] = f"${var}"
            if field == "cp_comm_type":
                kwargs[field] = raw
            elif field == "sequence_parallel":
                kwargs[field] = env_flag(var, env, default=False)
            else:
                try:
                    kwargs[field] = int(raw)
                except ValueError:
                    raise ValueError(f"{var}={raw!r} is not an integer; set e.g. {var}=1") from None
        overrides = {k: v for k, v in overrides.items() if v is not None}
        # the launch's sizes bind this process's first layout (note_layout_built)
        given = set() if _LAYOUT_BUILT and env is os.environ else \
            {f for f in env.get(LAUNCH_GIVEN, "").split(",") if f}
        for k, v in overrides.items():   # a size the launch was given, contradicted
            if k in given and k in kwargs and v != kwargs[k]:
                raise ValueError(
                    f"{k}={v!r} from {given_as.format(name=k, flag=k.replace('_', '-'))} "
                    f"contradicts {k}={kwargs[k]!r} from tpkit-launch --{k.replace('_', '-')} "
                    f"(this job's launch, exported as ${ENV_VARS[k]}); give the layout once: "
                    f"drop one of them, or make them agree")
        if "dp" not in overrides and any(
                k in overrides and overrides[k] != kwargs.get(k, 1) for k in ("tp", "cp", "pp")):
            kwargs.pop("dp", None)
        if "cp_a2a_size" not in overrides and overrides.get("cp_comm_type", "a2a+p2p") != "a2a+p2p":
            kwargs.pop("cp_a2a_size", None)
        kwargs.update(overrides)
        origin = {f: o for f, o in origin.items() if f in kwargs}
        origin.update({f: given_as.format(name=f, flag=f.replace("_", "-")) for f in overrides})
        return cls(**kwargs, origin=origin)

    @classmethod
    def env_is_set(cls, env: Mapping[str, str] | None = None) -> bool:
        env = os.environ if env is None else env
        return any(var in env for var in ENV_VARS.values())


@dataclasses.dataclass(frozen=True, eq=False)
class Layout(ParallelConfig):
    """A ParallelConfig checked against its world (``dp`` resolved): what
    :meth:`ParallelConfig.validate` returns, and the one form the layout travels in after
    that (tpkit-launch's plan, its dry run and memory estimate, the pre-flight hook, the
    workers' ``init_parallel``). It is not checked again: ``validate(world)`` only says
    whether it is the layout of that world."""

    def __post_init__(self) -> None:   # ParallelConfig.validate made it from a checked one
        pass

    def validate(self, world_size: int) -> "Layout":
        """This layout, when ``world_size`` is its world; else ValueError naming both."""
        if world_size != self.world_size:
            raise ValueError(self._with_origin(
                f"world size {world_size} is not this layout's: tp*cp*pp*dp = {self.tp}*"
                f"{self.cp}*{self.pp}*{self.dp} = {self.world_size}; launch "
                f"{self.world_size} processes, or leave dp unset", ("dp", "tp", "cp", "pp")))
        return self

    def sizes(self) -> str:
        """``tp=2 cp=1 pp=1 dp=4 ...``: the layout as the dry run and errors print it."""
        return (f"tp={self.tp} cp={self.cp} pp={self.pp} dp={self.dp} "
                f"sequence_parallel={self.sequence_parallel} cp_comm_type={self.cp_comm_type}"
                + (f" cp_a2a_size={self.cp_a2a_size}" if self.cp_a2a_size else "")
                + (f" ep={self.ep} etp={self.expert_tp} edp={self.edp}"
                   if self.has_experts else ""))


#: The layout flags tpkit-launch was given (comma-separated field names), exported to the
#: workers: a script's own value for one of them that differs is refused (from_env).
LAUNCH_GIVEN = "TPKIT_LAUNCH_GIVEN"
_LAYOUT_BUILT = False   # this process built a layout: the launch's flags are spent


def note_layout_built() -> None:
    """init_parallel (and so TPKitStrategy) calls it after building a layout: the sizes
    tpkit-launch was given ($TPKIT_LAUNCH_GIVEN) bind the first layout a process builds;
    after destroy_parallel() another one is the script's own choice (README's re-init)."""
    global _LAYOUT_BUILT
    _LAYOUT_BUILT = True


def fused_attn_enabled(env: Mapping[str, str] | None = None) -> bool:
    """``TPKIT_FUSED_ATTN`` (default on): may context-parallel attention run on fused
    per-device kernels (``tpkit.nn.attention_ops``)? 0 runs the plain-torch reference
    kernels everywhere, like TE's ``NVTE_FUSED_ATTN=0``."""
    return env_flag("TPKIT_FUSED_ATTN", env, default=True,
                    fix="use 1 (fused kernels where available) or 0 (reference kernels)")

