"""``compile_blocks``: each transformer block under ``torch.compile(fullgraph=True)``.

torchtitan's recipe: compile every block on its own (the blocks are alike, so one
compiled graph serves them all after the first; the stem, head and loss stay eager) with
``fullgraph=True``, so a construct dynamo cannot trace is an error at the first call, never
a silent graph break. Blocks are compiled in place (``nn.Module.compile``): parameter names,
state dicts, checkpoints, pipeline splitting and recompute see the same modules.

What makes tpkit's torch blocks traceable (docs/layers.md, "torch.compile"):
- TP/SP collectives inside the autograd functions of ``mappings`` trace as torch's
  functional collectives; a TP sum inside a compiled region runs over the group's
  backend (gloo on CPU, nccl on GPUs), not the shared-memory transport
  (``collectives.all_reduce_sum``);
- the CP p2p ring (also inside a2a+p2p) is an opaque custom op pair
  (``tpkit::ring_attention_fwd/bwd``, ``fused_cp``) that runs eagerly on the ring's own
  transport (shm on CPU); all_gather and a2a trace as collectives;
- MoE's token counts become unbacked sizes (no graph break, no recompile per step),
  declared sizes so that inductor can lower the slices they give (``moe._size_hints``).

Refused with a ValueError naming the combination (not yet traceable): TE modules, dropout
(the RNG tracker's fork and eager-identical masks), CP attention on the reference kernels
(``TPKIT_FUSED_ATTN=0``), and emulated fp8 (``fp8_autocast`` refuses to start while a
compiled block lives: its amax/scale bookkeeping mutates process state in backward).
"""
from __future__ import annotations

import gc
import weakref

from torch import nn

from ..layout.config import fused_attn_enabled
from .dot_product_attention import DotProductAttention
from .transformer import TransformerLayer

__all__ = ["compile_blocks", "compiled_blocks_alive"]

_COMPILED: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()


def compiled_blocks_alive() -> bool:
    """True while a block compiled by ``compile_blocks`` exists (fp8_autocast asks). A
    compiled module refers to itself (its compiled call is a bound method), so a dropped one
    lives until the cyclic collector runs: collect once before answering."""
    if _COMPILED:
        gc.collect()
    return len(_COMPILED) > 0


def _blocks(model: nn.Module) -> list[nn.Module]:
    """The model's transformer blocks: its pp protocol's ``pp_blocks`` list, else every
    outermost ``TransformerLayer``, else the model itself if it is one."""
    name = getattr(type(model), "pp_blocks", None)
    if isinstance(name, str) and isinstance(getattr(model, name, None), nn.ModuleList):
        return list(getattr(model, name))
    if isinstance(model, TransformerLayer):
        return [model]
    found, inner = [], set()
    for mod in model.modules():
        if id(mod) in inner:
            continue
        if isinstance(mod, TransformerLayer):
            found.append(mod)
            inner.update(id(m) for m in mod.modules())
    return found


def _refusal(i: int, block: nn.Module) -> str | None:
    """Why block ``i`` cannot be compiled yet, or None."""
    from ..te import is_te_module
    where = f"compile_blocks: block {i} ({type(block).__name__})"
    for name, mod in block.named_modules():
        if is_te_module(mod):
            return (f"{where} holds a Transformer Engine module ({name or 'the block'}): "
                    "compile needs tpkit's torch backend (backend='torch'); TE's modules "
                    "are not compiled by tpkit yet")
        p = getattr(mod, "hidden_dropout", 0.0) if isinstance(mod, TransformerLayer) else \
            getattr(mod, "attention_dropout", 0.0) if isinstance(mod, DotProductAttention) \
            else 0.0
        if p:
            return (f"{where}: dropout {p} in {name or 'the block'} under torch.compile is "
                    "not supported yet (the RNG tracker's fork and masks identical to eager "
                    "are not traced); use dropout 0 or run eagerly")
        if isinstance(mod, DotProductAttention) and mod.cp_size > 1 \
                and "p2p" in mod.cp_comm_type and not fused_attn_enabled():
            return (f"{where}: cp_comm_type={mod.cp_comm_type!r} on the reference kernels "
                    "(TPKIT_FUSED_ATTN=0) cannot be compiled (their ring's sends are not "
                    "traceable); unset TPKIT_FUSED_ATTN or run eagerly")
    return None


def compile_blocks(model: nn.Module, **torch_compile_kwargs) -> nn.Module:
    """Compile each transformer block of ``model`` in place with
    ``torch.compile(fullgraph=True, **torch_compile_kwargs)`` (``backend=``, ``mode=``,
    ``dynamic=``, ...) and return ``model``. The blocks are ``model.pp_blocks`` (the pp
    protocol: tpkit's models), else every outermost ``tpkit.nn.TransformerLayer``. A block
    that cannot be compiled yet (TE modules, dropout, CP on the reference kernels) is a
    ValueError naming it, before anything compiles."""
    if torch_compile_kwargs.get("fullgraph") is False:
        raise ValueError("compile_blocks(fullgraph=False): blocks are compiled whole "
                         "(fullgraph=True) so that a graph break is an error; drop fullgraph")
    torch_compile_kwargs.pop("fullgraph", None)
    blocks = _blocks(model)
    if not blocks:
        raise ValueError(f"compile_blocks: {type(model).__name__} has no transformer blocks "
                         "(no pp_blocks list, no tpkit.nn.TransformerLayer); compile your "
                         "own blocks with torch.compile(block, fullgraph=True)")
    for i, block in enumerate(blocks):
        reason = _refusal(i, block)
        if reason:
            raise ValueError(reason)
    for block in blocks:
        block.compile(fullgraph=True, **torch_compile_kwargs)
        _COMPILED.add(block)
    return model
