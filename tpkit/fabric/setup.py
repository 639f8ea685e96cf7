"""What ``TPKitStrategy.setup_module`` and ``setup_optimizer`` do to a module, as functions: the
user's parallelize function called and checked, DTensors refused, TP shards checked, the
pipeline's arguments, meta tensors materialized, FSDP2 applied; the order messages."""
from __future__ import annotations

import re
import warnings

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ..layout.param_tags import is_expert, tp_spec
from ..te import is_te_module


_FSDP_ORDER = ("with data_parallel='fsdp' the optimizer must be created after the module "
               "is sharded (FSDP2 replaces the parameters): call model = "
               "fabric.setup_module(model), then build the optimizer from model.parameters() "
               "and call fabric.setup_optimizers(optimizer)")


_SWAP_ORDER = ("build the optimizer after the model is parallelized (its layers' parameters "
               "are new tensors): call model = fabric.setup_module(model), then build the "
               "optimizer from model.parameters() and call fabric.setup_optimizers(optimizer)")

# What a collective that timed out (or lost a peer) says, on gloo and NCCL.
_TIMED_OUT = re.compile(r"timed out|timeout|connection closed|connection reset|"
                        r"closed by peer|broken pipe", re.IGNORECASE)


def _call_parallelize_fn(fn, module: nn.Module, state):
    """``fn(module, state)``, or ``fn(module, state=state)`` for a function whose second
    positional parameter is taken already, e.g. ``partial(tpkit.parallelize, plan=plan)``
    (positionally, the state would land on ``plan`` twice)."""
    import inspect
    try:
        inspect.signature(fn).bind(module, state)
    except TypeError:
        try:
            inspect.signature(fn).bind(module, state=state)
        except TypeError:
            raise TypeError(f"parallelize_fn {fn!r} cannot be called as fn(module, state) nor "
                            "fn(module, state=state); pass a function of the module and the "
                            "tpkit ParallelState, e.g. partial(tpkit.parallelize, plan=plan)"
                            ) from None
        return fn(module, state=state)
    except ValueError:   # no signature (a builtin): call it as documented
        pass
    return fn(module, state)


def _refuse_dtensors(module: nn.Module, where: str = "") -> None:
    """DTensor parameters (torch's parallelize_module) are refused: tpkit's clipping and
    checkpoints read tpkit's tags and meshes, and would compute a wrong norm."""
    names = [n for n, p in module.named_parameters() if isinstance(p, DTensor)]
    if names:
        raise ValueError(
            f"{len(names)} parameter(s) of the model are DTensors"
            f"{' after ' + where if where else ''} ({names[:3]}, ...: torch's "
            "parallelize_module or fully_shard): TPKitStrategy's gradient clipping and "
            "checkpoints work on tpkit's TP shards and would compute a wrong norm and fail "
            "to save them; parallelize with tpkit.parallelize (TPKitStrategy(parallelize_fn="
            "tpkit.parallelize)) and data_parallel='fsdp' for sharded data parallelism")


def _check_tp_sharded(module: nn.Module, state) -> None:
    """At tp > 1 a model with no TP-sharded parameter trains the same full model on every
    TP rank (tp - 1 ranks' work wasted, with no word): warned about, naming the module (an
    auxiliary replicated module set up beside the model is legitimate)."""
    if state.tp_size == 1:
        return
    params = list(module.parameters())
    if any(is_te_module(m) for m in module.modules()):
        return   # TE's modules shard by their own tp_size (wired to the layout's groups)
    if params and not any(tp_spec(p) is not None or is_expert(p) for p in params):
        warnings.warn(
            f"tp={state.tp_size} but none of the {len(params)} parameters of "
            f"{type(module).__name__} is TP-sharded: every TP rank trains the whole model on "
            "the same data. Parallelize it (TPKitStrategy(parallelize_fn=tpkit.parallelize), "
            "a plan for your model: docs/byom.md), build it from tpkit.nn layers, or launch "
            "with tp=1", stacklevel=3)


_PP_ORDER = ("with pp > 1 the optimizer must be created after the module is split into "
             "pipeline stages (this rank keeps only its stages' parameters): call model = "
             "fabric.setup_module(model), then build the optimizer from model.parameters() "
             "and call fabric.setup_optimizers(optimizer)")


def _pipeline_args(pp: int, microbatches, schedule, virtual_stages, data_parallel) -> dict:
    """TPKitStrategy's pipeline arguments, checked before any process starts (the number of
    blocks is checked by setup_module, which sees the model)."""
    from ..distributed.pipeline import plan_pipeline
    if pp == 1:
        given = [f"{k}={v!r}" for k, v, d in (("microbatches", microbatches, None),
                                               ("pp_schedule", schedule, "1F1B"),
                                               ("virtual_stages", virtual_stages, None))
                 if v != d]
        if given:
            raise ValueError(f"{', '.join(given)} only apply with pp > 1 (pp=1 here); drop "
                             "them or set pp")
        return {}
    m = 2 * pp if microbatches is None else microbatches
    vs = virtual_stages if isinstance(virtual_stages, int) and virtual_stages > 0 else 1
    # Every check that does not need the model (its blocks: setup_module); 2 x pp x vs
    # blocks fit every default.
    plan = plan_pipeline(pp=pp, num_blocks=2 * pp * vs, microbatches=m, schedule=schedule,
                         virtual_stages=virtual_stages)
    return dict(microbatches=m, schedule=plan.schedule, virtual_stages=virtual_stages)


def clear_dtensor_caches() -> None:
    """Drop DTensor's sharding-propagation and redistribute-plan caches. They key on a
    mesh's *layout*, not its groups, so after a layout is destroyed and rebuilt in the same
    process (tests, notebooks) FSDP2 parameters would pick up specs naming dead groups."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor import _redistribute
    DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()
    for name in ("_gen_transform_infos",):
        fn = getattr(_redistribute, name, None)
        if hasattr(fn, "cache_clear"):
            fn.cache_clear()
    if hasattr(_redistribute, "clear_redistribute_planner_cache"):
        _redistribute.clear_redistribute_planner_cache()
    # the C++ dispatch fast path's own cache (torch >= 2.10): its output specs name the
    # mesh of the layout that filled it (an FSDP2 gradient on a destroyed layout's mesh:
    # 16-mixed's found_inf reduction then asked for a dead group by name)
    native = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)
    if native is not None:
        native()


def _materialize(module: nn.Module, device: torch.device) -> None:
    """Meta tensors -> real ones, module by module: each module whose own parameters and
    buffers are on the meta device is emptied onto ``device`` and re-initialised with its
    reset_parameters(); modules with real tensors (tpkit's layers, anything created outside
    empty_init) are left as they are."""
    for name, m in module.named_modules():
        own = [*m.parameters(recurse=False), *m.buffers(recurse=False)]
        meta = sum(t.is_meta for t in own)
        if not meta:
            continue
        what = f"module {name or type(module).__name__!r} ({type(m).__name__})"
        if meta != len(own):
            raise ValueError(f"{what} has tensors both on the meta device and real ones; create "
                             "it entirely inside or entirely outside init_module(empty_init=True)")
        if not callable(getattr(m, "reset_parameters", None)):
            raise ValueError(f"{what} was created on the meta device but has no "
                             "reset_parameters() to initialise it; create the model with "
                             "empty_init=False")
        m.to_empty(device=device, recurse=False)
        m.reset_parameters()


def _apply_fsdp(module: nn.Module, state, **fsdp) -> nn.Module:
    """FSDP2 over the dp x cp ranks, a unit per block (tpkit.distributed.fsdp.shard_model); tpkit's
    parameter tags are carried over to the DTensor parameters FSDP creates."""
    from ..distributed.fsdp import shard_model
    return shard_model(module, state, **fsdp)
