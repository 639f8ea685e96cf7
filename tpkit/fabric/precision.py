"""TPKitPrecision: Fabric precision plugin for bf16/fp16 autocast and fp8 with amax groups.

Lightning's TransformerEnginePrecision hard-codes CUDA autocast and never passes an fp8
group, so under TP/CP/DP every rank keeps its own amax and the scaling factors of one
GEMM diverge across ranks that must agree. Here:
- autocast's device type is the model's device (CPU works too);
- "fp8" enters TE's autocast (TE models, via tpkit.te) or tpkit's emulated fp8 autocast
  (torch backend, tpkit.fp8) with ``fp8_group=state.amax_group`` (tp x cp x dp of one
  stage, Megatron's default), inside an outer autocast with ``fallback_compute_dtype``
  for the operations fp8 does not cover;
- ``recipe`` is any of TE's four fp8 recipes: a name ("delayed", "current", "block",
  "mxfp8"), a recipe object of tpkit.fp8 or transformer_engine, or a dict
  (``{"recipe": name, **fields}``, or DelayedScaling's fields with ``fp8_format`` as a
  string, as in Lightning's plugin). The TE backend gets TE's own object
  (tpkit.te.te_recipe), refused at ``setup`` when the installed TE or the GPU cannot run
  it; the torch backend emulates it (tpkit.fp8).

Lightning's ``TransformerEnginePrecision(weights_dtype=..., recipe=..., replace_layers=...,
fallback_compute_dtype=...)`` is ``TPKitPrecision(...)`` with the same keywords and the
same meaning (the one-word change): ``weights_dtype`` without ``precision`` means
``precision="fp8"``; the module is cast to ``weights_dtype`` after its layers are
replaced, built under ``weights_dtype`` as the default dtype, and runs with it as the
default dtype and its floating inputs cast to it; ``fallback_compute_dtype`` defaults to
``weights_dtype``; ``replace_layers`` None or True replaces in ``convert_module`` (True
also in ``module_init_context``), False never. What the layers are replaced by is the
backend's: TE's ``Linear``/``LayerNorm`` where TE runs (tpkit.te.te_available), as
Lightning's plugin, else tpkit's emulated-fp8 ``FP8Linear`` (tpkit.fabric.replace).
"""
from __future__ import annotations

import warnings
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from typing import Any, Mapping

import torch
import torch.distributed as dist
from lightning.fabric.plugins.precision.precision import Precision
from torch import nn

from .. import fp8
from ..layout.config import FP8_RECIPES
from ..te import (check_recipe_support, is_te_module, require_te, te_autocast, te_available,
                  te_recipe)
from ..layout.topology import get_parallel_state
from .replace import FP8Linear, replace_layers, replace_with_te

PRECISIONS = ("bf16-mixed", "16-mixed", "32-true", "fp8")
_DTYPES = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


def _uses_te(module: nn.Module) -> bool:
    return any(is_te_module(m) for m in module.modules())


@contextmanager
def _default_dtype(dtype: torch.dtype | None):
    """``dtype`` as torch's default floating dtype inside (Lightning's weights_dtype)."""
    if dtype is None:
        yield
        return
    saved = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(saved)


@contextmanager
def _classes_replaced(replacements: dict):
    """``torch.nn.<name>`` is ``replacements[name]`` inside (modules built then are those)."""
    saved = {name: getattr(torch.nn, name) for name in replacements}
    for name, cls in replacements.items():
        setattr(torch.nn, name, cls)
    try:
        yield
    finally:
        for name, cls in saved.items():
            setattr(torch.nn, name, cls)


class TPKitPrecision(Precision):
    """See the module docstring. On the torch backend ``replace_layers`` routes every
    exact ``nn.Linear`` through tpkit's emulated fp8 (tpkit.fabric.replace: same
    parameters, ``F.linear`` outside fp8); ``replace_layers=True`` warns with the names it
    left unchanged (nn.Linear subclasses, and nn.LayerNorm: emulated fp8 converts GEMMs
    only). Where TE runs it swaps ``nn.Linear``/``nn.LayerNorm`` for TE's modules (their
    own parameters, with the weights copied), as Lightning's plugin.

    Lightning's ``MixedPrecision(precision, device, scaler)`` arguments: ``scaler``
    replaces the GradScaler of "16-mixed" (the only precision with one); ``device`` is
    refused (the layout's device is used)."""

    def __init__(self, precision: str | None = None, device: str | None = None,
                 scaler: Any = None, *, recipe: Any = None,
                 fallback_compute_dtype: torch.dtype | None = None,
                 replace_layers: bool | None = None,
                 weights_dtype: torch.dtype | None = None) -> None:
        if precision is None:   # Lightning's TransformerEnginePrecision(weights_dtype=...)
            precision = "fp8" if weights_dtype is not None else "bf16-mixed"
        if precision not in PRECISIONS:
            raise ValueError(f"precision={precision!r} is not supported; use one of {PRECISIONS}")
        if device is not None:
            raise ValueError(f"device={device!r} is not taken by TPKitPrecision: autocast "
                             "runs on the device of the layout's model (TPKitStrategy); "
                             "drop the argument")
        if scaler is not None and precision != "16-mixed":
            raise ValueError(f"scaler={scaler!r} only applies to precision='16-mixed', got "
                             f"precision={precision!r}; drop the scaler")
        if weights_dtype is not None and (not isinstance(weights_dtype, torch.dtype)
                                          or not weights_dtype.is_floating_point):
            raise ValueError(f"weights_dtype={weights_dtype!r} must be a floating torch.dtype "
                             "(torch.bfloat16, torch.float16, torch.float32), as Lightning's "
                             "TransformerEnginePrecision")
        if precision != "fp8" and (recipe is not None or replace_layers is not None
                                   or weights_dtype is not None):
            raise ValueError(f"recipe/replace_layers/weights_dtype only apply to "
                             f"precision='fp8' (Lightning's TransformerEnginePrecision), got "
                             f"precision={precision!r}; drop them or use 'fp8'")
        if replace_layers not in (None, True, False):
            raise ValueError(f"replace_layers={replace_layers!r} must be None (Lightning's "
                             "default: replace), True or False")
        if fallback_compute_dtype not in (None, torch.bfloat16, torch.float16, torch.float32):
            raise ValueError(f"fallback_compute_dtype={fallback_compute_dtype!r} must be "
                             "torch.bfloat16, torch.float16, torch.float32 or None")
        if isinstance(recipe, str) and recipe not in FP8_RECIPES:
            raise ValueError(f"recipe={recipe!r} is not an fp8 recipe name; use one of "
                             f"{sorted(FP8_RECIPES)}, a dict or a recipe object")
        if recipe is not None and not isinstance(recipe, (str, Mapping)) and not any(
                c.__name__ in FP8_RECIPES.values() or c.__name__ == "Recipe"
                for c in type(recipe).__mro__) and not hasattr(recipe, "margin"):
            raise TypeError(f"recipe={recipe!r} must be a recipe name {sorted(FP8_RECIPES)}, "
                            "a dict, or a recipe object (tpkit.fp8 or transformer_engine)")
        self.precision = precision
        # None: Lightning's DelayedScaling() in Lightning's form (weights_dtype given),
        # else TE's own default on the TE backend (tpkit-train's documented default)
        self.recipe_spec = dict(recipe) if isinstance(recipe, Mapping) else (
            "delayed" if recipe is None and weights_dtype is not None else recipe)
        self._recipe = None
        self.weights_dtype = weights_dtype
        # Lightning's: the fallback defaults to the weights' dtype
        self.fallback_compute_dtype = fallback_compute_dtype or weights_dtype
        self.replace_layers = replace_layers
        self._device: torch.device | None = None
        self._state = None
        self._te: bool | None = None
        self.scaler = None
        if precision == "16-mixed":
            self.scaler = scaler if scaler is not None else torch.amp.GradScaler(
                "cuda" if torch.cuda.is_available() else "cpu")

    # --- wiring (called by TPKitStrategy.setup_module) ---------------------------------
    def attach(self, state, device: torch.device) -> None:
        """Bind the parallel state (its amax group) and the device autocast runs on."""
        self._state = state
        self._device = torch.device(device)

    @property
    def amax_group(self):
        if self._state is None:
            self._state = get_parallel_state()
        return self._state.amax_group

    def _device_type(self) -> str:
        if self._device is not None:
            return self._device.type
        return "cuda" if torch.cuda.is_available() else "cpu"

    @property
    def recipe(self):
        """The recipe object for the active backend (TE's or tpkit.fp8's), built once from
        ``recipe`` when the backend is known."""
        if self._recipe is None or self._recipe[0] != bool(self._te):
            spec = self.recipe_spec
            self._recipe = (bool(self._te), te_recipe(spec) if self._te else fp8.from_any(spec))
        return self._recipe[1]

    # --- Precision hooks -----------------------------------------------------------------
    def convert_module(self, module: nn.Module) -> nn.Module:
        params = list(module.parameters())
        if params and self._device is None and not params[0].is_meta:
            self._device = params[0].device
        if self.precision == "fp8":
            if self.replace_layers is not False and not _uses_te(module):
                if te_available():        # Lightning's: TE's Linear and LayerNorm
                    replace_with_te(module, require_te())
                else:                     # the torch backend: tpkit's emulated fp8
                    replace_layers(module, warn=self.replace_layers is True)
            if self.weights_dtype is not None:
                module = module.to(dtype=self.weights_dtype)
            self._te = _uses_te(module)
            if self._te:   # refuse a recipe this TE or GPU cannot run, before any step
                check_recipe_support(self.recipe)
            else:
                self.recipe  # noqa: B018  (a bad recipe fails at setup, not at the first step)
        return module

    def tensor_init_context(self) -> AbstractContextManager:
        return _default_dtype(self.weights_dtype)

    def module_init_context(self) -> AbstractContextManager:
        """Lightning's: ``weights_dtype`` as the default dtype, and with
        ``replace_layers=True`` ``torch.nn.Linear``/``LayerNorm`` built as the backend's
        replacements (TE's modules; on the torch backend ``FP8Linear``)."""
        stack = ExitStack()
        if self.precision == "fp8" and self.replace_layers is True:
            if te_available():
                te = require_te()
                stack.enter_context(_classes_replaced({"Linear": te.Linear,
                                                       "LayerNorm": te.LayerNorm}))
            else:
                stack.enter_context(_classes_replaced({"Linear": FP8Linear}))
        stack.enter_context(self.tensor_init_context())
        return stack

    def forward_context(self) -> AbstractContextManager:
        if self.precision == "32-true":
            return nullcontext()
        if self.precision in _DTYPES:
            return torch.autocast(device_type=self._device_type(), dtype=_DTYPES[self.precision])
        stack = ExitStack()
        stack.enter_context(_default_dtype(self.weights_dtype))
        if self.fallback_compute_dtype not in (None, torch.float32):
            stack.enter_context(torch.autocast(device_type=self._device_type(),
                                               dtype=self.fallback_compute_dtype))
        if self._te:
            stack.enter_context(te_autocast(enabled=True, recipe=self.recipe,
                                            group=self.amax_group))
        else:
            stack.enter_context(fp8.fp8_autocast(enabled=True, recipe=self.recipe,
                                                 fp8_group=self.amax_group))
        return stack

    def convert_input(self, data: Any) -> Any:
        if self.weights_dtype is None:
            return data  # autocast casts at each op; inputs stay in their own dtype
        from lightning_utilities import apply_to_collection
        return apply_to_collection(    # Lightning's: floating inputs in the weights' dtype
            data, torch.Tensor,
            lambda t: t.to(self.weights_dtype) if t.is_floating_point() else t)

    def convert_output(self, data: Any) -> Any:
        if self.precision == "32-true":
            return data
        from lightning_utilities import apply_to_collection
        return apply_to_collection(
            data, torch.Tensor,
            lambda t: t.to(torch.get_default_dtype()) if t.is_floating_point() else t)

    def backward(self, tensor: torch.Tensor, model, *args: Any, **kwargs: Any) -> None:
        if self.scaler is not None:
            tensor = self.scaler.scale(tensor)
        tensor.backward(*args, **kwargs)

    def unscale_gradients(self, optimizer) -> None:
        """16-mixed: unscale once per step, then agree on ``found_inf`` over every rank
        (a MAX all-reduce on the default group), as Megatron does over its model-parallel
        group: each rank's scaler sees only its own shards (TP, PP stages, experts, FSDP),
        so without it ranks would skip different steps and drift apart."""
        if self.scaler is None:
            return
        st = self.scaler._per_optimizer_states[id(optimizer)]
        if st["stage"] is torch.amp.grad_scaler.OptState.UNSCALED:
            return
        self.scaler.unscale_(optimizer)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            for flag in st["found_inf_per_device"].values():
                dist.all_reduce(flag, op=dist.ReduceOp.MAX)

    def found_inf(self, optimizer) -> bool:
        """16-mixed, after ``unscale_gradients``: whether the scaler will skip this step
        (the same answer on every rank)."""
        if self.scaler is None:
            return False
        st = self.scaler._per_optimizer_states[id(optimizer)]
        return any(bool(f.item()) for f in st["found_inf_per_device"].values())

    def optimizer_step(self, optimizer, **kwargs: Any) -> Any:
        if self.scaler is None:
            return optimizer.step(**kwargs)
        self.unscale_gradients(optimizer)   # found_inf agreed on every rank before the step
        out = self.scaler.step(optimizer, **kwargs)
        self.scaler.update()
        return out

    def state_dict(self) -> dict[str, Any]:
        return {} if self.scaler is None else self.scaler.state_dict()

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        if self.scaler is not None:
            self.scaler.load_state_dict(dict(state_dict))
        elif state_dict:
            warnings.warn(f"TPKitPrecision({self.precision!r}) has no state; ignoring "
                          f"{sorted(state_dict)}")
