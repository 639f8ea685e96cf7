"""Transformer Engine adapter: the only tpkit module that imports ``transformer_engine``.

- ``import_te``/``require_te``: lazy import with an error that says what to install
  (``pip install 'tpkit[te]'``) and that TE needs CUDA; no fallback.
- ``te_recipe``/``check_recipe_support``: TE's recipe object from a name, a dict or
  tpkit.fp8's recipe, refused when the installed TE or the GPU cannot run it.
- ``te_autocast``/``te_model_init``: one name over TE's API renames (``autocast`` and
  ``quantized_model_init`` since TE 2.9; ``fp8_autocast``/``fp8_model_init`` before).
- ``wire_parallel_groups``: feed a ParallelState's TP and CP groups into every TE module
  of a model (TE modules keep groups as attributes set through ``set_*_parallel_group``).
- ``make``: build one TE module (the ``backend="te"`` path of tpkit.nn) from a state;
  ``"grouped_linear"`` is the expert GEMMs of tpkit.nn.MoE (no TE communication).
- ``holds_te_modules``/``fp8_enabled``/``checkpoint``: tpkit.recompute hands TE modules
  (and anything recomputed inside TE's fp8 autocast) to TE's checkpoint.
- ``fp8_alignment``: the token-count alignment TE's fp8 grouped GEMMs need (tpkit.nn.MoE
  pads each expert's rows to it).
- ``make_graphed_callables``: TE's, refused while tpkit's RNG tracker states are
  registered with TE (TE's graph capture takes ``torch.Generator`` states only).
- ``forget_groups``: drop TE's fp8 global state of process groups tpkit destroys.

Checked against TE 2.20.2's sources (tests/te_contract.py); TE 2.9 or newer 2.x expected.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import sys
import weakref
from collections.abc import Mapping

import torch

from ..layout.config import FP8_RECIPES
from ..layout.random import EXPERT_PARALLEL_RNG, get_rng_tracker
from ..layout.topology import add_destroy_hook, is_initialized, resolve_state

CHECKED_TE_VERSION = "2.20.2"
INSTALL_HINT = "pip install 'tpkit[te]'"


def _cuda_available() -> bool:
    """Whether TE could run here: tpkit.te's one CUDA check."""
    return torch.cuda.is_available()


def import_te():
    """``transformer_engine.pytorch``, or ImportError saying what to install."""
    try:
        import transformer_engine
        import transformer_engine.pytorch as te
    except Exception as exc:  # ImportError, or TE failing to load its CUDA libraries
        raise ImportError(
            f"backend='te' needs NVIDIA Transformer Engine 2.x (tpkit is checked against "
            f"{CHECKED_TE_VERSION}), which could not be imported ({type(exc).__name__}: "
            f"{exc}). Install it with `{INSTALL_HINT}` on a machine with an NVIDIA GPU and a "
            "CUDA build of torch (TE does not run on CPU), or use backend='torch' "
            "('auto' picks torch where TE is missing)") from exc
    version = str(getattr(transformer_engine, "__version__", "unknown"))
    if not version.startswith("2."):
        raise ImportError(
            f"transformer_engine {version} is installed but tpkit needs TE 2.x (checked "
            f"against {CHECKED_TE_VERSION}); install it with `{INSTALL_HINT}`")
    return te


def require_te():
    """``transformer_engine.pytorch`` when TE imports and CUDA is available, else raise."""
    te = import_te()
    if not _cuda_available():
        raise RuntimeError(
            "backend='te' needs CUDA: Transformer Engine modules only run on NVIDIA GPUs and "
            f"torch.cuda.is_available() is False here (torch {torch.__version__}, CUDA build "
            f"{torch.version.cuda}). Use backend='torch' (or 'auto', which picks torch "
            "without CUDA) on this machine")
    return te


def te_available() -> bool:
    """True when ``backend="auto"`` should pick TE: CUDA is available and TE imports."""
    if not _cuda_available():
        return False
    try:
        import_te()
    except ImportError:
        return False
    return True


# --- recipes --------------------------------------------------------------------------
# tpkit.fp8's fields that TE 2.x's classes do not have, with the value that means "TE's
# behaviour" (anything else is refused on the TE backend).
_TPKIT_ONLY = {"interval": 1, "override_linear_precision": (False, False, False)}
# TE 2.20.2 keeps these on the class (fixed at import), not as constructor fields.
_CLASS_ATTRS = ("fp8_quant_fwd_inp", "fp8_quant_fwd_weight", "fp8_quant_bwd_grad")
# recipe class -> TE's availability check (transformer_engine.pytorch.is_*_available)
_SUPPORT = {"DelayedScaling": "is_fp8_available", "Float8CurrentScaling": "is_fp8_available",
            "Float8BlockScaling": "is_fp8_block_scaling_available",
            "MXFP8BlockScaling": "is_mxfp8_available",
            "NVFP4BlockScaling": "is_nvfp4_available"}


def _is_te_object(obj) -> bool:
    return type(obj).__module__.split(".")[0] == "transformer_engine"


def _recipe_spec(spec) -> tuple[str, dict]:
    """(recipe name, fields) from a name, a dict or tpkit.fp8's recipe object."""
    if isinstance(spec, str):
        kind, fields = spec, {}
    elif isinstance(spec, Mapping):
        fields = dict(spec)
        kind = fields.pop("recipe", "delayed")
    else:
        names = {v: k for k, v in FP8_RECIPES.items()}
        kind = next((names[c.__name__] for c in type(spec).__mro__ if c.__name__ in names),
                    None)
        if kind is None or not dataclasses.is_dataclass(spec):
            raise TypeError(f"recipe={spec!r} ({type(spec).__name__}) is not an fp8 recipe: "
                            f"pass a name {sorted(FP8_RECIPES)}, a dict, or a recipe object "
                            "of tpkit.fp8 or transformer_engine.common.recipe")
        fields = {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec)}
    if kind not in FP8_RECIPES:
        raise ValueError(f"recipe={kind!r} is not an fp8 recipe name; use one of "
                         f"{sorted(FP8_RECIPES)}")
    return kind, fields


def _te_value(mod, name: str, value):
    """A field value as TE's own types: a Format member, QParams, MMParams."""
    if name == "fp8_format" and isinstance(value, str):
        if value.upper() not in mod.Format.__members__:
            raise ValueError(f"fp8_format={value!r} is not a member of TE's Format "
                             f"{sorted(mod.Format.__members__)}")
        return mod.Format[value.upper()]
    if (name in _CLASS_ATTRS or name.startswith("fp8_gemm_")) and not _is_te_object(value):
        cls = mod.QParams if name in _CLASS_ATTRS else mod.MMParams
        get = value.get if isinstance(value, Mapping) else (lambda k: getattr(value, k, None))
        return cls(**{f.name: get(f.name) for f in dataclasses.fields(cls)
                      if get(f.name) is not None})
    return value


def te_recipe(spec):
    """TE's recipe object from None (TE's default recipe, chosen by TE for the GPU), a TE
    recipe (as is), a name ("delayed", "current", "block", "mxfp8"), a dict
    (``{"recipe": name, **fields}``, or DelayedScaling's fields alone as in Lightning's
    plugin; ``fp8_format`` may be a string) or a tpkit.fp8 recipe (fields read by
    attribute). A field the installed TE lacks is refused unless it has its default."""
    if spec is None or _is_te_object(spec):
        return spec
    kind, fields = _recipe_spec(spec)
    require_te()  # the clear "install TE / needs CUDA" error first
    mod = importlib.import_module("transformer_engine.common.recipe")
    cls_name = FP8_RECIPES[kind]
    cls = getattr(mod, cls_name, None)
    if cls is None:
        raise ValueError(f"recipe={kind!r}: the installed Transformer Engine has no "
                         f"{cls_name}; upgrade it (tpkit is checked against "
                         f"{CHECKED_TE_VERSION}) or use backend='torch', which emulates it")
    te_fields = {f.name for f in dataclasses.fields(cls)}
    kw, extra = {}, {}
    for name, value in fields.items():
        if name in te_fields:
            kw[name] = _te_value(mod, name, value)
        elif name in _CLASS_ATTRS and hasattr(cls, name):
            if value is not None:
                extra[name] = _te_value(mod, name, value)
        elif name in _TPKIT_ONLY and _TPKIT_ONLY[name] == (
                tuple(value) if isinstance(value, (list, tuple)) else value):
            continue
        elif value is None or value is False:
            continue  # a field newer than this TE, left at its default
        else:
            raise ValueError(f"{cls_name} field {name}={value!r} is not a field of the "
                             f"installed Transformer Engine's {cls_name}; drop it, or use "
                             "backend='torch' (tpkit's emulation has it)")
    try:
        recipe = cls(**kw)
    except (AssertionError, TypeError, ValueError) as exc:
        raise ValueError(f"Transformer Engine refused {cls_name}({kw}): {exc}") from exc
    for name, value in extra.items():
        setattr(recipe, name, value)
    return recipe


def _device_description() -> str:
    try:
        major, minor = torch.cuda.get_device_capability()
        return f"{torch.cuda.get_device_name()}, compute capability {major}.{minor}"
    except Exception:  # noqa: BLE001  (a description only)
        return "this GPU"


def check_recipe_support(recipe) -> None:
    """ValueError when the installed TE or this GPU cannot run ``recipe`` (a TE recipe
    object; None is TE's default, which TE picks for the GPU): TE's own availability
    check and its reason, so that nothing falls back to another recipe."""
    if recipe is None:
        return
    te = require_te()
    name = next((c.__name__ for c in type(recipe).__mro__ if c.__name__ in _SUPPORT), None)
    check = getattr(te, _SUPPORT.get(name, ""), None)
    if check is None:
        return  # a custom recipe, or a TE without the check: TE's autocast checks itself
    try:
        ok, reason = check(return_reason=True)
    except TypeError:  # an older TE without return_reason
        ok, reason = check(), "not supported by the installed Transformer Engine"
    if not ok:
        raise ValueError(
            f"fp8 recipe {name} cannot run here ({_device_description()}): {reason} "
            "tpkit does not fall back to another recipe: choose one this GPU runs "
            "(MXFP8 needs Blackwell; 'delayed' and 'current' run on Ada/Hopper, 'block' on "
            "Hopper with CUDA >= 12.9), or emulate it with backend='torch'")


# --- API-name shims ----------------------------------------------------------------------
def te_autocast(enabled: bool = True, recipe=None, group=None, *, calibrating: bool = False,
                state=None):
    """TE's fp8 autocast context under either API name. ``recipe``: anything ``te_recipe``
    takes (a name, a dict, a recipe of tpkit or TE); one the installed TE or this GPU
    cannot run is refused (``check_recipe_support``). ``group=None`` means the state's
    ``amax_group`` (tp×cp×dp of one pipeline stage) when tpkit is initialised — TE's own
    default would reduce amaxes over the whole world, across pipeline stages."""
    te = require_te()
    recipe = te_recipe(recipe)
    if enabled:
        check_recipe_support(recipe)
    if group is None:
        if state is not None or is_initialized():
            group = resolve_state(state).amax_group
    if hasattr(te, "autocast"):  # TE >= 2.9
        return te.autocast(enabled=enabled, calibrating=calibrating, recipe=recipe,
                           amax_reduction_group=group)
    return te.fp8_autocast(enabled=enabled, calibrating=calibrating, fp8_recipe=recipe,
                           fp8_group=group)


def te_model_init(enabled: bool = True, recipe=None, *,
                  preserve_high_precision_init_val: bool = False):
    """TE's quantized-parameter init context (``quantized_model_init`` since 2.9).
    ``recipe``: anything ``te_recipe`` takes (TE stores it as given and its modules ask
    it for its type, so a name must become TE's recipe object first)."""
    te = require_te()
    recipe = te_recipe(recipe)
    if enabled:
        check_recipe_support(recipe)
    fn = getattr(te, "quantized_model_init", None) or te.fp8_model_init
    return fn(enabled=enabled, recipe=recipe,
              preserve_high_precision_init_val=preserve_high_precision_init_val)


# --- TE's global fp8 state (module transformer_engine.pytorch.quantization, .fp8 before 2.9)
def _quantization():
    """TE's module holding FP8GlobalStateManager, or None when TE is not imported (tpkit
    never imports TE just to ask about its state)."""
    if "transformer_engine.pytorch" not in sys.modules:
        return None
    for name in ("transformer_engine.pytorch.quantization", "transformer_engine.pytorch.fp8"):
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    return None


def fp8_enabled() -> bool:
    """True inside TE's fp8 autocast (``te_autocast``/TE's own)."""
    q = _quantization()
    return bool(q is not None and q.FP8GlobalStateManager.is_fp8_enabled())


def fp8_alignment() -> int:
    """Rows per GEMM group that TE's fp8 grouped GEMMs need under the active autocast's
    recipe (TE's ``get_align_size_for_quantization``: 16, 32 for MXFP8, ...); 0 outside
    TE's fp8 autocast. cuBLASLt refuses an fp8 wgrad GEMM whose token dimension is not a
    multiple of 16 on Hopper ("Caller must pad"), and TE's GroupedLinear does not pad."""
    if not fp8_enabled():
        return 0
    q = _quantization()
    return int(q.get_align_size_for_quantization(q.FP8GlobalStateManager.get_fp8_recipe()))


def forget_groups(groups) -> None:
    """Drop TE's fp8 global state that refers to ``groups`` (being destroyed by
    tpkit.layout.topology): the autocast arguments keyed by ``id(group)`` and their amax
    buffers, which TE's next reduction would otherwise all-reduce over a destroyed group.
    Modules registered there re-register under the new layout's key once
    ``wire_parallel_groups`` has rewired them (it clears their registration)."""
    q = _quantization()
    if q is None:
        return
    ids = {id(g) for g in groups if g is not None}
    qstate = q.FP8GlobalStateManager.quantization_state
    args = getattr(qstate, "autocast_arguments", {})
    if getattr(qstate, "autocast_depth", 0) > 0 and any(
            id(g) in ids for _, g in args.values()):
        raise ValueError("destroy_parallel was called inside Transformer Engine's fp8 "
                         "autocast over the layout's groups (te_autocast): leave the "
                         "autocast first, then destroy the layout")
    dead = {key for key, (_, g) in args.items() if g is not None and id(g) in ids}
    for key in dead:
        del args[key]
    for name in ("global_amax_buffer", "global_amax_history_buffer", "global_scale_buffer",
                 "registrants"):
        buffers = getattr(qstate, name, None)
        if isinstance(buffers, dict):
            for buffer_key in [k for k in buffers if k.split("_", 1)[-1] in dead]:
                del buffers[buffer_key]


add_destroy_hook(forget_groups)


def _forget_registration(module) -> None:
    """Make a TE module register its amaxes again on its next forward (under the
    autocast key of the groups it is wired to now)."""
    q = _quantization()
    meta = getattr(module, "fp8_meta", None)
    if q is not None and isinstance(meta, dict):
        meta.pop(q.FP8GlobalStateManager.get_buffer_info(), None)


# --- CUDA graphs --------------------------------------------------------------------------
def make_graphed_callables(modules, sample_args, **kwargs):
    """TE's ``make_graphed_callables``, refused while TE holds RNG states of tpkit's
    tracker: TE's DotProductAttention registers its tracker's states at construction and
    graph capture hands them to ``CUDAGraph.register_generator_state``, which takes
    ``torch.Generator`` objects (TE's graph-safe ``CudaRNGStatesTracker``), and asserts a
    ``CudaRNGStatesTracker`` under capture; tpkit's tracker keeps ByteTensor states."""
    te = require_te()
    dist_mod = importlib.import_module("transformer_engine.pytorch.distributed")
    states = dist_mod.get_all_rng_states()
    foreign = sorted(k for k, v in states.items() if not isinstance(v, torch.Generator))
    for c in (modules if isinstance(modules, tuple) else (modules,)):
        for m in c.modules() if isinstance(c, torch.nn.Module) else ():
            tracker = getattr(m, "rng_states_tracker", None)   # TE's attention asserts it
            if tracker is not None and not isinstance(tracker, dist_mod.CudaRNGStatesTracker):
                foreign.append(f"{type(tracker).__name__} of {type(m).__name__}")
    if foreign:
        raise ValueError(
            f"make_graphed_callables with tpkit's RNG tracker is not supported: TE's "
            f"DotProductAttention registered the tracker's states {foreign} (ByteTensors, "
            "not the torch.Generator objects CUDA-graph capture needs, and TE asserts its own "
            "CudaRNGStatesTracker under capture). Run without CUDA graphs, or build the TE "
            "modules with get_rng_state_tracker=None (no attention dropout)")
    return te.make_graphed_callables(modules, sample_args, **kwargs)


# --- wiring ------------------------------------------------------------------------------
_STREAMS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _new_cuda_stream():
    """A new CUDA stream for TE to overlap CP communication on (cp_stream keeps one per state)."""
    return torch.cuda.Stream()


def cp_stream(state):
    """One CUDA stream per state, shared by every attention module (as Megatron does)."""
    stream = _STREAMS.get(state)
    if stream is None:
        if not _cuda_available():
            raise RuntimeError(
                f"context parallelism with Transformer Engine (cp={state.cp_size}) needs a "
                "CUDA stream and CUDA is not available; use the torch backend on CPU")
        stream = _STREAMS[state] = _new_cuda_stream()
    return stream


def cp_group_arg(state):
    """TE's ``cp_group`` argument: the CP group, or ``[a2a, p2p]`` groups for "a2a+p2p"."""
    if state.cp_comm_type == "a2a+p2p":
        return [state.cp_a2a_group, state.cp_p2p_group]
    return state.cp_group


def is_te_module(module) -> bool:
    """A Transformer Engine module (or a subclass of one, e.g. Megatron's TE wrappers).
    tpkit's own layers take the state at construction and are left alone, even where they
    share TE's method names (tpkit.nn.DotProductAttention.set_context_parallel_group)."""
    return any(c.__module__.split(".")[0] == "transformer_engine" for c in type(module).__mro__)


def wire_parallel_groups(model: torch.nn.Module, state=None) -> list[tuple[str, str]]:
    """Call ``set_tensor_parallel_group(tp_group)`` and, when cp > 1,
    ``set_context_parallel_group(cp_group, cp_global_ranks, cp_stream, cp_comm_type)`` on
    every TE module of ``model`` that has them; return ``(module name, method)`` per call
    (empty for a model without TE modules, e.g. one built with backend="auto" on CPU).

    Expert GEMMs built by ``make("grouped_linear")`` (marked ``tpkit_explicit_comm``) are
    left alone: tpkit's MoE dispatcher does their communication and TE has no group.
    Modules whose ``tp_size`` differs from the state's were built for another layout
    (their weights are sharded differently) and are refused before anything is set.
    With cp == 1 nothing CP-related is set: TE treats ``cp_group=None`` as no CP, and no
    CUDA stream is needed. TE's container setters (TransformerLayer) also recurse into
    their children; the calls are idempotent, so every module is set directly as well.
    """
    state = resolve_state(state)
    modules = [(name, m) for name, m in model.named_modules() if is_te_module(m) and (
        hasattr(m, "set_tensor_parallel_group") or hasattr(m, "set_context_parallel_group"))
        and not getattr(m, EXPLICIT_COMM, False)]  # expert GEMMs: tpkit communicates
    for name, m in modules:
        tp_size = getattr(m, "tp_size", None)
        if isinstance(tp_size, int) and tp_size != state.tp_size:
            raise ValueError(
                f"module {name or type(m).__name__!r} ({type(m).__name__}) was built with "
                f"tp_size={tp_size} but the parallel state has tp={state.tp_size}; build it "
                f"with tp_size={state.tp_size} and tp_group=state.tp_group (tpkit.nn layers "
                "with backend='te' do this), or wire it with a state of that layout")
    wired = []
    tp_group = state.tp_group
    cp = None
    if state.cp_size > 1 and any(hasattr(m, "set_context_parallel_group") for _, m in modules):
        cp = (cp_group_arg(state), state.cp_global_ranks, cp_stream(state), state.cp_comm_type)
    for name, m in modules:
        _forget_registration(m)   # its amaxes go to this layout's amax group from now on
        if hasattr(m, "set_tensor_parallel_group"):
            m.set_tensor_parallel_group(tp_group)
            wired.append((name, "set_tensor_parallel_group"))
        if cp is not None and hasattr(m, "set_context_parallel_group"):
            m.set_context_parallel_group(*cp)
            wired.append((name, "set_context_parallel_group"))
    return wired


# --- recompute (tpkit.recompute.checkpoint delegates here for TE modules) -----------------
def holds_te_modules(function, _depth: int = 0) -> bool:
    """True when ``function`` reaches TE modules: a module containing one, a bound method
    of such a module, a ``functools.partial`` of one or over one, or a function (lambda,
    closure) whose closure cells, defaults or referenced globals hold one. Their fp8 state
    must be recomputed by TE's own checkpoint. Never imports TE."""
    if "transformer_engine" not in sys.modules or _depth > 4:
        return False
    owner = getattr(function, "__self__", function)
    if isinstance(owner, torch.nn.Module):
        return any(is_te_module(m) for m in owner.modules())
    refs = []
    if isinstance(function, functools.partial):
        refs = [function.func, *function.args, *function.keywords.values()]
    elif inspect.isfunction(function):
        code = function.__code__
        refs = [c.cell_contents for c in (function.__closure__ or ())
                if _cell_filled(c)]
        refs += list(function.__defaults__ or ()) + list((function.__kwdefaults__ or {}).values())
        refs += [function.__globals__[n] for n in code.co_names if n in function.__globals__]
    return any(holds_te_modules(r, _depth + 1) for r in refs
               if isinstance(r, torch.nn.Module) or callable(r))


def _cell_filled(cell) -> bool:
    try:
        cell.cell_contents
    except ValueError:
        return False
    return True


def checkpoint(function, *args, distribute_saved_activations: bool = False,
               get_rng_state_tracker=None, tp_group=None, use_reentrant: bool = True,
               **kwargs):
    """TE's ``checkpoint`` with tpkit's defaults: the RNG tracker is tpkit's and
    ``tp_group`` the state's (TE's own default would be the whole world)."""
    te = require_te()
    if get_rng_state_tracker is None:
        get_rng_state_tracker = get_rng_tracker
    if tp_group is None:
        if is_initialized():
            tp_group = resolve_state(None).tp_group
    return te.checkpoint(function, *args,
                         distribute_saved_activations=distribute_saved_activations,
                         get_rng_state_tracker=get_rng_state_tracker, tp_group=tp_group,
                         use_reentrant=use_reentrant, **kwargs)


# --- building ----------------------------------------------------------------------------
# kind -> (TE class name, arguments tpkit fixes because the layout requires them)
KINDS = {
    "column": ("Linear", {"parallel_mode": "column"}),
    "row": ("Linear", {"parallel_mode": "row"}),
    "layernorm": ("LayerNorm", {}),
    "rmsnorm": ("RMSNorm", {}),
    "layernorm_linear": ("LayerNormLinear", {"parallel_mode": "column"}),
    "layernorm_mlp": ("LayerNormMLP", {"set_parallel_mode": True}),
    "attention": ("DotProductAttention", {}),
    "transformer_layer": ("TransformerLayer", {"set_parallel_mode": True}),
    # Expert GEMMs (tpkit.nn.MoE, backend="te"): tpkit's dispatcher does every expert
    # communication (all-to-all over ep, gather / reduce-scatter over etp), so TE gets no
    # group and no parallel mode and the sizes are the local shard's, as Megatron-Core's
    # TEGroupedLinear with explicit expert communication; wire_parallel_groups skips it.
    "grouped_linear": ("GroupedLinear", {"parallel_mode": None, "tp_size": 1,
                                         "tp_group": None, "sequence_parallel": False}),
}
# Kinds whose communication is tpkit's, not TE's (the modules carry this attribute).
EXPLICIT_COMM = "tpkit_explicit_comm"


def make(kind: str, state=None, **kwargs) -> torch.nn.Module:
    """Build TE's module for ``kind`` (see KINDS) with the state's TP group and size,
    sequence parallelism and tpkit's RNG tracker, then wire its groups (CP included).
    ``kwargs`` are TE's own arguments; ones that contradict the state are refused."""
    if kind not in KINDS:
        raise ValueError(f"kind={kind!r} has no Transformer Engine module; use one of "
                         f"{sorted(KINDS)}")
    te = require_te()
    state = resolve_state(state)
    cls_name, fixed = KINDS[kind]
    cls = getattr(te, cls_name)
    accepted = inspect.signature(cls).parameters
    for key, value in fixed.items():
        if key in kwargs and kwargs[key] != value:
            raise ValueError(f"{key}={kwargs[key]!r} contradicts kind={kind!r}, which needs "
                             f"{key}={value!r}; drop the argument")
    for key, value in (("tp_size", state.tp_size), ("tp_group", state.tp_group)):
        if key in kwargs and key not in fixed and kwargs[key] is not value and \
                kwargs[key] != value:
            raise ValueError(f"{key}={kwargs[key]!r} contradicts the parallel state "
                             f"(tp={state.tp_size}); drop it, tpkit passes the state's")
    defaults = {"tp_group": state.tp_group, "tp_size": state.tp_size,
                "sequence_parallel": state.sequence_parallel,
                "get_rng_state_tracker": get_rng_tracker}
    if kind == "grouped_linear" and EXPERT_PARALLEL_RNG in get_rng_tracker().states_:
        defaults["rng_tracker_name"] = EXPERT_PARALLEL_RNG  # TE's own init: the expert stream
    args = {k: v for k, v in defaults.items() if k in accepted}
    args.update(fixed)
    args.update(kwargs)
    if cls_name == "DotProductAttention":
        # TE's DotProductAttention uses sequence_parallel for one thing: with it, attention
        # dropout does not fork the tracker, so every TP rank draws its heads' masks from
        # the same default stream (identical masks on different heads). tpkit's
        # attention dropout always forks the model-parallel stream: so does TE's here.
        args["sequence_parallel"] = False
    elif cls_name == "TransformerLayer" and args.get("sequence_parallel") and \
            state.tp_size > 1 and args.get(
                "attention_dropout", accepted["attention_dropout"].default) > 0:
        raise ValueError(
            f"TransformerLayer with sequence_parallel=True, tp={state.tp_size} and "
            f"attention_dropout={args.get('attention_dropout', accepted['attention_dropout'].default)}"
            " (TE's default is 0.1) is refused: TE's attention does not fork the RNG tracker "
            "under sequence parallelism, so every TP rank would drop the same positions on "
            "its different heads. Pass attention_dropout=0.0, or build the layer from "
            "tpkit.nn parts with backend='te' (DotProductAttention forks the tracker)")
    if cls_name in ("LayerNorm", "RMSNorm") and args.get("params_dtype") is not None:
        args["dtype"] = args.pop("params_dtype")  # params_dtype is deprecated on TE norms
    module = cls(**args)
    if kind == "grouped_linear":
        setattr(module, EXPLICIT_COMM, True)
    wire_parallel_groups(module, state)
    return module
