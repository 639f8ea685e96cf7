"""Fake ``transformer_engine.pytorch.distributed``: what TE's checkpoint and CUDA-graph
capture depend on (tests/te_contract.py checks each against TE's source):

- the activation-recompute flags: TE's ``checkpoint`` runs the first forward inside
  ``activation_recompute_forward(activation_recompute=True, recompute_phase=False)`` and
  the recompute with ``recompute_phase=True``; a module in the recompute phase replays the
  fp8 scales and amaxes of its first forward (records nothing new). Only TE's checkpoint
  sets them: under any other recompute a TE module records its amaxes a second time;
- ``set_all_rng_states``/``get_all_rng_states``: the states TE's DotProductAttention
  registers from its tracker (``get_states()``) and ``make_graphed_callables`` hands to
  ``CUDAGraph.register_generator_state``, which takes ``torch.Generator`` objects only;
- ``CudaRNGStatesTracker``: the tracker class DotProductAttention asserts under capture.
"""
from __future__ import annotations

import contextlib

import torch

_IN_ACTIVATION_RECOMPUTE_REGION = False
_ACTIVATION_RECOMPUTE_PHASE = False
_ALL_ACTIVE_RNG_STATES = {}


def get_all_rng_states():
    return _ALL_ACTIVE_RNG_STATES


def set_all_rng_states(states) -> None:
    global _ALL_ACTIVE_RNG_STATES
    _ALL_ACTIVE_RNG_STATES = states


def in_fp8_activation_recompute_phase() -> bool:
    return _ACTIVATION_RECOMPUTE_PHASE


@contextlib.contextmanager
def activation_recompute_forward(activation_recompute: bool = False,
                                 recompute_phase: bool = False):
    global _IN_ACTIVATION_RECOMPUTE_REGION, _ACTIVATION_RECOMPUTE_PHASE
    _IN_ACTIVATION_RECOMPUTE_REGION = activation_recompute
    _ACTIVATION_RECOMPUTE_PHASE = recompute_phase
    try:
        yield
    finally:
        _IN_ACTIVATION_RECOMPUTE_REGION = False
        _ACTIVATION_RECOMPUTE_PHASE = False


class CudaRNGStatesTracker:
    """TE's tracker (graph-safe: its states are ``torch.Generator`` objects)."""

    def __init__(self):
        self.states_ = {}

    def get_states(self):
        return dict(self.states_)

    def set_states(self, states) -> None:
        self.states_ = states
        set_all_rng_states(self.states_)

    def add(self, name: str, seed: int) -> None:
        gen = torch.Generator()
        gen.manual_seed(seed)
        self.states_[name] = gen
        set_all_rng_states(self.states_)

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng"):
        yield
