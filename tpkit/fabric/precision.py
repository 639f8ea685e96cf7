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
"""
from __future__ import annotations

import warnings
from contextlib import AbstractContextManager, ExitStack, nullcontext
from typing import Any, Mapping

import torch
from lightning.fabric.plugins.precision.precision import Precision
from torch import nn

from .. import fp8
from ..config import FP8_RECIPES
from ..te import check_recipe_support, is_te_module, te_autocast, te_recipe
from ..topology import get_parallel_state
from .replace import replace_layers

PRECISIONS = ("bf16-mixed", "16-mixed", "32-true", "fp8")
_DTYPES = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


def _uses_te(module: nn.Module) -> bool:
    return any(is_te_module(m) for m in module.modules())


class TPKitPrecision(Precision):
    """See the module docstring. ``replace_layers=True`` (fp8 with the torch backend only)
    routes every exact ``nn.Linear`` through tpkit's emulated fp8 (tpkit.fabric.replace:
    same parameters, ``F.linear`` outside fp8), warning with the names it left unchanged
    (nn.Linear subclasses, and nn.LayerNorm: emulated fp8 converts GEMMs only).

    Lightning's ``MixedPrecision(precision, device, scaler)`` arguments: ``scaler``
    replaces the GradScaler of "16-mixed" (the only precision with one); ``device`` is
    refused (the layout's device is used). ``TransformerEnginePrecision``'s
    ``weights_dtype`` is refused: not yet (docs/te_api.md)."""

    def __init__(self, precision: str = "bf16-mixed", device: str | None = None,
                 scaler: Any = None, *, recipe: Any = None,
                 fallback_compute_dtype: torch.dtype | None = None,
                 replace_layers: bool = False, weights_dtype: torch.dtype | None = None) -> None:
        if precision not in PRECISIONS:
            raise ValueError(f"precision={precision!r} is not supported; use one of {PRECISIONS}")
        if device is not None:
            raise ValueError(f"device={device!r} is not taken by TPKitPrecision: autocast "
                             "runs on the device of the layout's model (TPKitStrategy); "
                             "drop the argument")
        if scaler is not None and precision != "16-mixed":
            raise ValueError(f"scaler={scaler!r} only applies to precision='16-mixed', got "
                             f"precision={precision!r}; drop the scaler")
        if weights_dtype is not None:
            raise ValueError(f"weights_dtype={weights_dtype!r} is not yet supported by "
                             "TPKitPrecision (parameters keep their dtype; issue 44 item 6); "
                             "cast the model with model.to(dtype) before fabric.setup")
        if precision != "fp8" and (recipe is not None or replace_layers):
            raise ValueError(f"recipe/replace_layers only apply to precision='fp8', got "
                             f"precision={precision!r}; drop them or use 'fp8'")
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
        self.recipe_spec = dict(recipe) if isinstance(recipe, Mapping) else recipe
        self._recipe = None
        self.fallback_compute_dtype = fallback_compute_dtype
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
            if self.replace_layers and not _uses_te(module):
                replace_layers(module)
            self._te = _uses_te(module)
            if self._te:   # refuse a recipe this TE or GPU cannot run, before any step
                check_recipe_support(self.recipe)
            else:
                self.recipe  # noqa: B018  (a bad recipe fails at setup, not at the first step)
        return module

    def module_init_context(self) -> AbstractContextManager:
        return nullcontext()

    def forward_context(self) -> AbstractContextManager:
        if self.precision == "32-true":
            return nullcontext()
        if self.precision in _DTYPES:
            return torch.autocast(device_type=self._device_type(), dtype=_DTYPES[self.precision])
        stack = ExitStack()
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
        return data  # autocast casts at each op; inputs stay in their own dtype

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
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)

    def optimizer_step(self, optimizer, **kwargs: Any) -> Any:
        if self.scaler is None:
            return optimizer.step(**kwargs)
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
