"""Per-layer fp8 state and delayed scaling's amax bookkeeping.

Every layer that ran in fp8 holds ``layer.fp8_meta`` (not part of the state dict): its
recipe and ``scale`` ``[3]`` (input, weight, grad). A grouped (expert) GEMM holds one meta
(``moe.fp8_meta_fc1``/``fc2``) with a last dimension of ``num_experts``: scale ``[3, E]``
and history ``[len, 3, E]``, indexed by *global* expert (``ExpertMeta`` is one expert's
view), so the reduction below gives each expert the max over every rank that touched it
and never mixes two experts (docs/moe.md, "fp8"). Under *current* scaling ``scale`` holds
the scales the layer's last quantization used (nothing else is kept); block recipes keep
no per-tensor scale. Under *delayed* scaling it also holds an amax history
``[amax_history_len, 3]`` (row 0 is the step being recorded), and an update (one per
step for the forward slots, one per backward for the grad slot) runs:
1. the recorded row-0 amaxes of all layers (and experts) are all-reduced (MAX) over
   ``fp8_group`` in ONE collective on one flat tensor (skipped for a group of one or
   ``reduce_amax=False``);
2. every ``interval``-th update the scale becomes ``fp8_max * 2**-margin / amax`` (float32,
   TE 2.x's formula, not rounded to a power of two) with amax = max of the history
   ('max'), row 0 ('most_recent') or ``algo(history)``; an amax of 0 or inf/nan keeps the
   previous scale and an overflowing ratio gives float32's max (as TE);
3. the history rolls by one and row 0 restarts at zero.
When the updates run (as in TE) is tpkit.fp8.autocast's business.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..comm.collectives import all_reduce_max

INPUT, WEIGHT, GRAD = 0, 1, 2


def compute_scale(amax: torch.Tensor, scale: torch.Tensor, fp8_max, margin: int) -> torch.Tensor:
    """TE 2.x's delayed-scaling update: ``(fp8_max * 2**-margin) / amax`` in float32; the
    old ``scale`` where amax is 0 or not finite; float32's max where the ratio overflows
    (transformer_engine/common/recipe/delayed_scaling.cu). No power-of-two rounding."""
    scaled_max = torch.as_tensor(fp8_max, dtype=torch.float32) * (2.0 ** -margin)
    amax = amax.float()
    new = scaled_max / amax
    new = torch.where(torch.isinf(new), torch.full_like(new, torch.finfo(torch.float32).max),
                      new)
    ok = (amax > 0) & torch.isfinite(amax)
    return torch.where(ok, new, scale.float()).to(scale.dtype)


class FP8Meta:
    """A layer's fp8 state: ``scale [3]`` and, for delayed scaling, the amax history;
    ``experts=E``: one column per global expert (``scale [3, E]``, history ``[len, 3, E]``)."""

    def __init__(self, recipe, experts: int | None = None):
        self.recipe = recipe
        length = recipe.amax_history_len if recipe.name == "delayed" else 1
        tail = (3,) if experts is None else (3, experts)
        self.amax_history = torch.zeros(length, *tail)
        self.scale = torch.ones(tail)
        self.experts = experts
        self.updates = [0, 0]  # forward, backward updates so far (delayed scaling)

    @property
    def root(self) -> "FP8Meta":
        """The meta that the reductions and updates see (itself; ExpertMeta's owner)."""
        return self

    def to(self, device: torch.device) -> None:
        """Keep the history and the scales on ``device`` (the recorded tensors')."""
        if self.amax_history.device != device:
            self.amax_history = self.amax_history.to(device)
            self.scale = self.scale.to(device)

    def record(self, slot: int, t: torch.Tensor, expert: int | None = None) -> None:
        """Fold ``t``'s amax into row 0, on ``t``'s device (no host sync: the history
        lives where the recorded tensors do)."""
        if t.numel():
            self.to(t.device)
            a = t.detach().abs().max().float()
            at = (0, slot) if expert is None else (0, slot, expert)
            self.amax_history[at] = torch.maximum(self.amax_history[at], a)

    def set_scale(self, slot: int, s: torch.Tensor, expert: int | None = None) -> None:
        """Keep the scale a current-scaling quantization used (on its device: no sync)."""
        if self.scale.device != s.device:
            self.scale = self.scale.to(s.device)
        self.scale[(slot,) if expert is None else (slot, expert)] = s

    def update(self, slots: list[int]) -> None:
        """Step 2 and 3 of the module docstring for ``slots`` (after the reduction)."""
        r = self.recipe
        which = 1 if slots == [GRAD] else 0
        self.updates[which] += 1
        hist = self.amax_history[:, slots]
        if self.updates[which] % r.interval == 0:
            if r.amax_compute_algo == "max":
                amax = hist.max(dim=0).values
            elif r.amax_compute_algo == "most_recent":
                amax = hist[0]
            else:   # TE's callable sees [len, n]: experts side by side
                amax = torch.as_tensor(r.amax_compute_algo(hist.reshape(len(hist), -1).clone()),
                                       dtype=torch.float32).reshape(hist.shape[1:])
            fwd, bwd = r.formats
            fmax = torch.stack([torch.full((), float(bwd[1] if s == GRAD else fwd[1]),
                                           device=hist.device) for s in slots])  # no copy
            fmax = fmax.view(-1, *[1] * (hist.dim() - 2))   # per slot, over experts
            self.scale[slots] = compute_scale(amax, self.scale[slots], fmax, r.margin)
        hist = torch.roll(hist, -1, dims=0)
        hist[0] = 0.0
        self.amax_history[:, slots] = hist


class ExpertMeta:
    """One expert's column of a grouped FP8Meta, seen as a layer's meta by the GEMM code
    (``scale [3]``, ``record``, ``set_scale``); ``root`` is the grouped meta."""

    def __init__(self, root: FP8Meta, expert: int):
        self.root, self.expert = root, expert

    @property
    def scale(self) -> torch.Tensor:
        return self.root.scale[:, self.expert]

    def record(self, slot: int, t: torch.Tensor) -> None:
        self.root.record(slot, t, self.expert)

    def set_scale(self, slot: int, s: torch.Tensor) -> None:
        self.root.set_scale(slot, s, self.expert)


def meta_of(layer, recipe, attr: str = "fp8_meta", experts: int | None = None) -> FP8Meta:
    """The layer's FP8Meta in ``attr`` (created on first use with ``recipe``, with
    ``experts`` columns; a new one when the layer runs another kind of recipe: its state
    follows the recipe it last ran)."""
    meta = getattr(layer, attr, None)
    if meta is None or meta.recipe.name != recipe.name or meta.experts != experts:
        meta = FP8Meta(recipe, experts)
        setattr(layer, attr, meta)
    elif meta.recipe is not recipe:
        if recipe.name == "delayed" and meta.recipe.amax_history_len != recipe.amax_history_len:
            raise ValueError(f"{type(layer).__name__} has an fp8 amax history of length "
                             f"{meta.recipe.amax_history_len} but the recipe asks for "
                             f"{recipe.amax_history_len}; use one recipe per model")
        meta.recipe = recipe
    return meta


def reduce_and_update(metas: list[FP8Meta], slots: list[int], group, reduce_amax: bool) -> None:
    """Steps 1-3 of the module docstring for the delayed-scaling ``metas``."""
    if not metas:
        return
    rows = [m.amax_history[0, slots] for m in metas]   # [S] per layer, [S, E] grouped
    flat = torch.cat([r.reshape(-1) for r in rows])
    if reduce_amax and group is not None and dist.get_world_size(group) > 1:
        dev = torch.device("cuda", torch.cuda.current_device()) \
            if dist.get_backend(group) == "nccl" else torch.device("cpu")
        flat = all_reduce_max(flat.to(dev).contiguous(), group).to(rows[0].device)
    at = 0
    for m, r in zip(metas, rows):
        m.amax_history[0, slots] = flat[at:at + r.numel()].view(r.shape)
        at += r.numel()
        m.update(slots)
