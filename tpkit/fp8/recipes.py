"""fp8 recipes: Transformer Engine's four training recipes, with TE 2.20.2's field names and
defaults, as frozen dataclasses; ``from_any`` builds one from a name, a dict, tpkit's or
TE's object (read by attribute: TE is never imported here).

- ``DelayedScaling`` ("delayed"): one scale per tensor from the amax *history* of earlier
  steps, amaxes reduced over the amax group (tpkit.fp8.amax). ``interval`` and
  ``override_linear_precision`` are TE 1.x's fields, kept for the emulation only.
- ``Float8CurrentScaling`` ("current"): one scale per tensor from its own amax this step.
- ``Float8BlockScaling`` ("block"): a scale per 1x128 (``*_block_scaling_dim=1``) or
  128x128 (``=2``) tile; defaults: 1x128 activations and gradients, 128x128 weights,
  power-of-two scales, E4M3 everywhere.
- ``MXFP8BlockScaling`` ("mxfp8"): a power-of-two E8M0 scale per 32 consecutive
  elements; ``enable_2d_quantization`` gives weights 32x32 blocks.

``fp8_quant_fwd_inp/_fwd_weight/_bwd_grad`` (``QParams``: power-of-two scales, amax
epsilon) are class attributes in TE 2.20.2, fixed at import from the environment
(``NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES``, ``NVTE_FP8_BLOCK_SCALING_FP32_SCALES``)
and read by TE's linear layers; here they are fields derived from ``use_power_2_scales``
/ ``use_f32_scales`` when left None (tpkit.te sets them on TE's object, so both backends
quantize alike). ``backward_override`` defaults to ``NVTE_BACKWARD_OVERRIDE`` as in TE.
"""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Callable

import torch

from ..layout.config import FP8_RECIPES

E4M3 = (torch.float8_e4m3fn, 448.0)
E5M2 = (torch.float8_e5m2, 57344.0)
FORMATS = {"E4M3": (E4M3, E4M3), "HYBRID": (E4M3, E5M2)}  # (forward, backward)
BACKWARD_OVERRIDES = (None, "high_precision", "dequantized")
# TE's QParams fields that only its FP4 recipe uses; a QParams setting one is refused.
_FP4_ONLY = ("random_hadamard_transform", "stochastic_rounding", "fp4_2d_quantization")


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "0") == "1"


def _env_backward_override():
    return os.environ.get("NVTE_BACKWARD_OVERRIDE") or None


@dataclasses.dataclass(frozen=True)
class QParams:
    """How one tensor is quantized: power-of-two scales; amaxes below ``amax_epsilon``
    count as ``amax_epsilon``."""

    power_2_scale: bool = False
    amax_epsilon: float = 0.0

    @classmethod
    def from_any(cls, q) -> "QParams":
        if isinstance(q, cls):
            return q
        get = q.get if isinstance(q, Mapping) else (lambda k, d=None: getattr(q, k, d))
        used = [k for k in _FP4_ONLY if get(k, False)]
        if used:
            raise ValueError(f"QParams {used} are FP4 (NVFP4) options; fp8 recipes do not "
                             "use them: set them False")
        return cls(power_2_scale=bool(get("power_2_scale", False)),
                   amax_epsilon=float(get("amax_epsilon", 0.0)))


@dataclasses.dataclass(frozen=True)
class MMParams:
    """GEMM options; TE's fast (non-split) fp8 accumulation. The emulation always
    accumulates in float32."""

    use_split_accumulator: bool = True

    @classmethod
    def from_any(cls, m) -> "MMParams":
        if isinstance(m, cls):
            return m
        get = m.get if isinstance(m, Mapping) else (lambda k, d=None: getattr(m, k, d))
        return cls(use_split_accumulator=bool(get("use_split_accumulator", True)))


@dataclasses.dataclass(frozen=True)
class _Recipe:
    """Fields and checks every recipe shares (set in the subclasses, TE's order)."""

    name = ""  # "delayed" | "current" | "block" | "mxfp8"
    per_tensor = True  # one scale per tensor (delayed, current); else per block

    def _check_common(self):
        fmt = getattr(self.fp8_format, "name", self.fp8_format)  # TE's Format enum or a str
        if not isinstance(fmt, str) or fmt.upper() not in FORMATS:
            raise ValueError(f"fp8_format={self.fp8_format!r} is not supported by "
                             f"{type(self).__name__}; use 'E4M3' or 'HYBRID' (E4M3 forward, "
                             "E5M2 backward); pure E5M2 training is not supported (as in TE)")
        object.__setattr__(self, "fp8_format", fmt.upper())
        if self.backward_override not in BACKWARD_OVERRIDES:
            raise ValueError(f"backward_override={self.backward_override!r} must be one of "
                             f"{BACKWARD_OVERRIDES}")
        for f in ("fp8_dpa", "fp8_mha"):
            if not isinstance(getattr(self, f), bool):
                raise ValueError(f"{f}={getattr(self, f)!r} must be True or False")

    def _set_qparams(self, power_2: bool):
        for f in ("fp8_quant_fwd_inp", "fp8_quant_fwd_weight", "fp8_quant_bwd_grad"):
            v = getattr(self, f)
            object.__setattr__(self, f, QParams(power_2_scale=power_2) if v is None
                               else QParams.from_any(v))
        for f in ("fp8_gemm_fprop", "fp8_gemm_dgrad", "fp8_gemm_wgrad"):
            object.__setattr__(self, f, MMParams.from_any(getattr(self, f)))

    @property
    def formats(self):
        """((fwd dtype, fwd max), (bwd dtype, bwd max))."""
        return FORMATS[self.fp8_format]

    @classmethod
    def from_any(cls, recipe):
        """``from_any(recipe)`` (module function), which must give this class."""
        out = from_any(recipe)
        if cls is not _Recipe and not isinstance(out, cls):
            raise ValueError(f"recipe={recipe!r} is a {type(out).__name__}, not a "
                             f"{cls.__name__}")
        return out


@dataclasses.dataclass(frozen=True)
class DelayedScaling(_Recipe):
    """TE's ``DelayedScaling`` (see the tpkit.fp8.amax docstring for the update), plus TE
    1.x's ``interval`` and ``override_linear_precision`` ``(fprop, dgrad, wgrad)``: True
    runs that GEMM unquantized."""

    margin: int = 0
    interval: int = 1
    fp8_format: str = "HYBRID"
    amax_history_len: int = 1024
    amax_compute_algo: str | Callable = "max"
    override_linear_precision: tuple = (False, False, False)
    reduce_amax: bool = True
    scaling_factor_compute_algo: Callable | None = None
    fp8_dpa: bool = False
    fp8_mha: bool = False
    backward_override: str | None = dataclasses.field(default_factory=_env_backward_override)
    name = "delayed"

    def __post_init__(self):
        self._check_common()
        for name, low in (("margin", None), ("interval", 1), ("amax_history_len", 1)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or (low is not None and v < low):
                raise ValueError(f"{name}={v!r} must be an integer"
                                 + (f" >= {low}" if low is not None else ""))
        algo = self.amax_compute_algo
        if not callable(algo) and algo not in ("max", "most_recent"):
            raise ValueError(f"amax_compute_algo={algo!r} must be 'max', 'most_recent' or a "
                             "callable(amax_history) -> amax")
        olp = tuple(self.override_linear_precision)
        if len(olp) != 3 or not all(isinstance(b, bool) for b in olp):
            raise ValueError(f"override_linear_precision={self.override_linear_precision!r} "
                             "must be three bools (fprop, dgrad, wgrad)")
        object.__setattr__(self, "override_linear_precision", olp)
        if self.scaling_factor_compute_algo is not None:
            raise ValueError("scaling_factor_compute_algo is not supported by the emulated "
                             "fp8 (the scale is fp8_max * 2**-margin / amax); drop it")
        if self.backward_override is not None:
            raise ValueError(f"backward_override={self.backward_override!r}: delayed scaling "
                             "supports only None (as in TE); unset NVTE_BACKWARD_OVERRIDE or "
                             "use recipe='current'")


@dataclasses.dataclass(frozen=True)
class Float8CurrentScaling(_Recipe):
    """TE's ``Float8CurrentScaling``: scale = fp8_max / amax of the tensor itself, each
    time it is quantized (``QParams`` per tensor)."""

    use_power_2_scales: bool = dataclasses.field(
        default_factory=lambda: _env_flag("NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES"))
    fp8_format: str = "HYBRID"
    fp8_quant_fwd_inp: QParams | None = None
    fp8_quant_fwd_weight: QParams | None = None
    fp8_quant_bwd_grad: QParams | None = None
    fp8_gemm_fprop: MMParams = MMParams(use_split_accumulator=False)
    fp8_gemm_dgrad: MMParams = MMParams(use_split_accumulator=True)
    fp8_gemm_wgrad: MMParams = MMParams(use_split_accumulator=True)
    fp8_dpa: bool = False
    fp8_mha: bool = False
    backward_override: str | None = dataclasses.field(default_factory=_env_backward_override)
    name = "current"

    def __post_init__(self):
        self._check_common()
        self._set_qparams(bool(self.use_power_2_scales))


@dataclasses.dataclass(frozen=True)
class Float8BlockScaling(_Recipe):
    """TE's ``Float8BlockScaling``: a scale per 1x128 or 128x128 tile (float32, power of
    two unless ``use_f32_scales``)."""

    use_f32_scales: bool = dataclasses.field(
        default_factory=lambda: _env_flag("NVTE_FP8_BLOCK_SCALING_FP32_SCALES"))
    fp8_format: str = "E4M3"
    fp8_quant_fwd_inp: QParams | None = None
    fp8_quant_fwd_weight: QParams | None = None
    fp8_quant_bwd_grad: QParams | None = None
    x_block_scaling_dim: int = 1
    w_block_scaling_dim: int = 2
    grad_block_scaling_dim: int = 1
    fp8_gemm_fprop: MMParams = MMParams(use_split_accumulator=True)
    fp8_gemm_dgrad: MMParams = MMParams(use_split_accumulator=True)
    fp8_gemm_wgrad: MMParams = MMParams(use_split_accumulator=True)
    fp8_dpa: bool = False
    fp8_mha: bool = False
    backward_override: str | None = dataclasses.field(default_factory=_env_backward_override)
    name, per_tensor, block_len = "block", False, 128

    def __post_init__(self):
        self._check_common()
        self._set_qparams(not self.use_f32_scales)
        dims = {"x": self.x_block_scaling_dim, "w": self.w_block_scaling_dim,
                "grad": self.grad_block_scaling_dim}
        for k, v in dims.items():
            if v not in (1, 2):
                raise ValueError(f"{k}_block_scaling_dim={v!r} must be 1 (1x128 tiles) or 2 "
                                 "(128x128 tiles)")
        for a, b in (("x", "w"), ("x", "grad"), ("w", "grad")):
            if dims[a] == 2 and dims[b] == 2:
                raise ValueError(f"{a}_block_scaling_dim=2 with {b}_block_scaling_dim=2: a "
                                 "GEMM of two 128x128-tiled operands is not supported (as in "
                                 "TE); set one of them to 1")
        for f in ("fp8_gemm_fprop", "fp8_gemm_dgrad", "fp8_gemm_wgrad"):
            if not getattr(self, f).use_split_accumulator:
                raise ValueError(f"{f}.use_split_accumulator=False: block scaling needs split "
                                 "accumulation (as in TE); drop it")
        if self.fp8_dpa or self.fp8_mha:
            raise ValueError("fp8_dpa/fp8_mha are not supported with Float8BlockScaling (as "
                             "in TE); set them False")

    def dims(self, role: int) -> int:
        """The block dimensionality of INPUT (0), WEIGHT (1) or GRAD (2)."""
        return (self.x_block_scaling_dim, self.w_block_scaling_dim,
                self.grad_block_scaling_dim)[role]


@dataclasses.dataclass(frozen=True)
class MXFP8BlockScaling(_Recipe):
    """TE's ``MXFP8BlockScaling``: E8M0 (power-of-two) scales per 32 elements. ``margin``
    is accepted as TE does; TE's MXFP8 quantizer does not use it, nor does tpkit."""

    margin: int = 0
    fp8_format: str = "E4M3"
    fp8_dpa: bool = False
    fp8_mha: bool = False
    backward_override: str | None = dataclasses.field(default_factory=_env_backward_override)
    enable_2d_quantization: bool = False
    name, per_tensor, block_len = "mxfp8", False, 32

    def __post_init__(self):
        self._check_common()

    def dims(self, role: int) -> int:
        return 2 if role == 1 and self.enable_2d_quantization else 1


CLASSES = (DelayedScaling, Float8CurrentScaling, Float8BlockScaling, MXFP8BlockScaling)
BY_NAME = {c.name: c for c in CLASSES}
assert {n: c.__name__ for n, c in BY_NAME.items()} == FP8_RECIPES
_KINDS = {c.__name__: c for c in CLASSES}


def _te_kind(obj):
    """tpkit's class for a recipe object of TE (or a subclass), by class name; None when
    the object is none of the four."""
    for klass in type(obj).__mro__:
        if klass.__name__ in _KINDS:
            return _KINDS[klass.__name__]
    return None


def _fields(cls) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


def from_any(recipe) -> _Recipe:
    """A recipe from None (``DelayedScaling()``), a name (``"delayed"``, ``"current"``,
    ``"block"``, ``"mxfp8"``), a recipe of tpkit or TE (fields read by attribute), or a
    dict: ``{"recipe": name, **fields}``, or DelayedScaling's fields alone (Lightning's
    recipe dict; ``fp8_format`` as a string)."""
    if recipe is None:
        return DelayedScaling()
    if isinstance(recipe, _Recipe):
        return recipe
    if isinstance(recipe, str):
        if recipe not in BY_NAME:
            raise ValueError(f"recipe={recipe!r} is not an fp8 recipe name; use one of "
                             f"{sorted(BY_NAME)} (or a recipe object)")
        return BY_NAME[recipe]()
    if isinstance(recipe, Mapping):
        spec = dict(recipe)
        kind = spec.pop("recipe", "delayed")
        if kind not in BY_NAME:
            raise ValueError(f"recipe dict names recipe={kind!r}; use one of {sorted(BY_NAME)}")
        cls, names = BY_NAME[kind], _fields(BY_NAME[kind])
        unknown = sorted(set(spec) - set(names))
        if unknown:
            raise ValueError(f"unknown fp8 recipe keys {unknown} for {cls.__name__}; known "
                             f"keys: {names}")
        return cls(**spec)
    cls = _te_kind(recipe)
    if cls is None and hasattr(recipe, "margin") and hasattr(recipe, "fp8_format"):
        cls = DelayedScaling  # a DelayedScaling-like object (duck-typed, as before)
    if cls is None:
        raise TypeError(f"recipe={recipe!r} ({type(recipe).__name__}) is not an fp8 recipe: "
                        f"pass a name {sorted(BY_NAME)}, a dict, or one of "
                        f"{[c.__name__ for c in CLASSES]} (tpkit.fp8 or transformer_engine)")
    missing = object()
    kw = {n: v for n in _fields(cls) if (v := getattr(recipe, n, missing)) is not missing}
    if cls is DelayedScaling and kw.get("override_linear_precision") is not None:
        kw["override_linear_precision"] = tuple(kw["override_linear_precision"])
    return cls(**kw)
