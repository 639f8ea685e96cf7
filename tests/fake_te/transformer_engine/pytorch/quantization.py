"""Fake ``transformer_engine.pytorch.quantization``: TE 2.20.2's global fp8 state, the part
of it the multi-GPU paths depend on (tests/te_contract.py checks each against TE's source):

- ``FP8GlobalStateManager.quantization_state``: autocast state, the *global amax buffer*
  (one list per ``forward_``/``backward_`` + autocast key, where the autocast key holds
  the recipe and ``id(group)``), ``autocast_arguments`` (autocast key -> (recipe, group));
- a delayed-scaling module registers its amax in that buffer on its first forward
  (``add_fp8_tensors_to_global_buffer``, once per module: the index stays in its
  ``fp8_meta``); the outermost autocast's exit concatenates every buffer in registration
  order and MAX-all-reduces it over the key's group (``reduce_and_update_fp8_tensors``).
  TE's all-reduce of buffers that differ across ranks hangs or mixes layers up; the fake
  compares the ranks' registrations first (who registered, in which order: each module's
  build index) and raises instead, so a CPU test fails where TE would hang; it also
  raises for a key whose group was destroyed (TE reduces over it);
- ``get_align_size_for_quantization``: the row alignment a grouped fp8 GEMM needs.
No math beyond amax bookkeeping.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Optional

import torch
import torch.distributed as dist

from ..common.recipe import DelayedScaling, Recipe


@dataclass
class FP8GlobalState:
    fp8_enabled: bool = False
    fp8_calibration: bool = False
    fp8_recipe: Optional[Recipe] = None
    fp8_distributed_group: Any = None
    fp8_parameters: bool = False
    high_precision_init_val: bool = False
    fp8_graph_capturing: bool = False
    autocast_depth: int = 0
    global_amax_buffer: Dict[str, list] = field(default_factory=dict)
    autocast_arguments: Dict[Any, tuple] = field(default_factory=dict)
    # fake only: the build index of each registered amax's module, per buffer key
    registrants: Dict[str, list] = field(default_factory=dict)


def get_default_fp8_recipe() -> Recipe:
    return DelayedScaling()  # an H100's default


def get_align_size_for_quantization(recipe: Recipe) -> int:
    if recipe.custom():
        return recipe.quantization_alignment
    if recipe.mxfp8():
        return 32
    if recipe.nvfp4():
        return 128
    return 16


class FP8GlobalStateManager:
    quantization_state = FP8GlobalState()

    @classmethod
    def reset(cls) -> None:
        cls.quantization_state = FP8GlobalState()

    @classmethod
    def is_fp8_enabled(cls) -> bool:
        return cls.quantization_state.fp8_enabled

    @classmethod
    def with_fp8_parameters(cls) -> bool:
        return cls.quantization_state.fp8_parameters

    @classmethod
    def fp8_graph_capturing(cls) -> bool:
        return cls.quantization_state.fp8_graph_capturing

    @classmethod
    def get_fp8_recipe(cls) -> Recipe:
        if cls.quantization_state.fp8_recipe is not None:
            return cls.quantization_state.fp8_recipe
        return get_default_fp8_recipe()

    @classmethod
    def get_fp8_group(cls):
        return cls.quantization_state.fp8_distributed_group

    @classmethod
    def get_buffer_info(cls) -> str:
        return "buffer_index_and_autocast_key"

    @staticmethod
    def get_unique_autocast_key(recipe=None, group=None):
        group_id = id(group) if group is not None else None
        return f"recipe={recipe!r},group={group_id}"

    @classmethod
    def get_key_in_buffer(cls, forward, fp8_recipe, fp8_group) -> str:
        autocast_key = cls.get_unique_autocast_key(fp8_recipe, fp8_group)
        return f"{'forward' if forward else 'backward'}_{autocast_key}"

    @classmethod
    def add_fp8_tensors_to_global_buffer(cls, fp8_meta: Dict[str, Any]) -> None:
        """Once per module (delayed scaling): append its amax to the buffer of its key."""
        if not isinstance(fp8_meta["recipe"], DelayedScaling):
            return
        index_in_buffer = cls.get_buffer_info()
        if index_in_buffer in fp8_meta:
            return
        fp8_meta[index_in_buffer] = []
        qstate = cls.quantization_state
        key = cls.get_key_in_buffer(True, fp8_meta["recipe"], fp8_meta["fp8_group"])
        qstate.global_amax_buffer.setdefault(key, []).append(
            fp8_meta["scaling_fwd"].amax_history[0])
        qstate.registrants.setdefault(key, []).append(fp8_meta["build_index"])
        fp8_meta[index_in_buffer] += [len(qstate.global_amax_buffer[key]) - 1, key]

    @classmethod
    def reduce_and_update_fp8_tensors(cls, forward: bool = True) -> None:
        """TE's loop over the buffers (a key per recipe and group), with one difference:
        TE skips a key whose buffer is empty or missing on this rank while its peers
        all-reduce theirs (a hang); the fake visits every autocast key it has seen and
        compares the ranks' registrations first, so that case raises here."""
        qstate = cls.quantization_state
        prefix = "forward" if forward else "backward"
        for autocast_key, (recipe, group) in list(qstate.autocast_arguments.items()):
            buffer_key = f"{prefix}_{autocast_key}"
            amax_buffer = qstate.global_amax_buffer.get(buffer_key, [])
            if not isinstance(recipe, DelayedScaling):
                continue
            if group is not None and dist.is_initialized() and \
                    group not in dist.distributed_c10d._world.pg_map:
                # TE all-reduces over it when it had more than one rank (a destroyed
                # communicator: an error or a hang); the fake raises for any size
                raise RuntimeError(
                    f"fake TE: the amax reduction of autocast key {autocast_key!r} runs over "
                    "a destroyed process group")
            if recipe.reduce_amax and dist.is_initialized() and \
                    dist.get_world_size(group=group) > 1:
                mine = qstate.registrants.get(buffer_key, [])
                everyone = [None] * dist.get_world_size(group=group)
                dist.all_gather_object(everyone, mine, group=group)
                if any(r != mine for r in everyone):
                    raise RuntimeError(
                        "fake TE: the global amax buffers differ across the ranks of the "
                        f"amax group (registrations by module build index: {everyone}); TE's "
                        "MAX all-reduce of them would hang or reduce one layer's amax with "
                        "another's")
                if not amax_buffer:
                    continue
                contiguous_amax = torch.cat(amax_buffer)
                dist.all_reduce(contiguous_amax, op=dist.ReduceOp.MAX, group=group)
                at = 0
                for amax in amax_buffer:
                    amax.copy_(contiguous_amax[at:at + amax.numel()])
                    at += amax.numel()

    @classmethod
    def autocast_enter(cls, enabled=False, calibrating=False, fp8_recipe=None, fp8_group=None,
                       _graph=False) -> None:
        fp8_recipe = get_default_fp8_recipe() if fp8_recipe is None else fp8_recipe
        autocast_key = cls.get_unique_autocast_key(fp8_recipe, fp8_group)
        qstate = cls.quantization_state
        qstate.autocast_arguments[autocast_key] = (fp8_recipe, fp8_group)
        qstate.fp8_enabled = enabled
        qstate.fp8_calibration = calibrating
        qstate.fp8_recipe = fp8_recipe
        qstate.fp8_distributed_group = fp8_group
        qstate.fp8_graph_capturing = _graph
        qstate.autocast_depth += 1

    @classmethod
    def autocast_exit(cls, enabled: bool, _graph: bool) -> None:
        qstate = cls.quantization_state
        qstate.autocast_depth -= 1
        if enabled and qstate.autocast_depth == 0 and not _graph and torch.is_grad_enabled():
            cls.reduce_and_update_fp8_tensors(forward=True)

    @classmethod
    def get_autocast_state(cls) -> tuple:
        q = cls.quantization_state
        return (q.fp8_enabled, q.fp8_calibration, q.fp8_recipe, q.fp8_distributed_group,
                q.fp8_graph_capturing)

    @classmethod
    def set_autocast_state(cls, state: tuple) -> None:
        q = cls.quantization_state
        (q.fp8_enabled, q.fp8_calibration, q.fp8_recipe, q.fp8_distributed_group,
         q.fp8_graph_capturing) = state
