"""RNG states tracker with TE's CudaRNGStatesTracker interface, on CPU or CUDA.

Seeding (``model_parallel_seed``):
- the *default* stream is the same on every rank of one pipeline stage (all TP, CP and
  DP ranks) — replicated computations (e.g. dropout on activations every TP rank holds)
  must draw identical masks;
- the *model-parallel* stream (``fork()``) differs per (tp, pp) coordinate — TP shards
  hold different weights/heads — and is the same across DP replicas and across CP ranks,
  as in Megatron-Core and TE: layers initialise their weight shards from this stream, and
  the ranks of one CP group hold ONE copy of the model, so they must draw the same shards
  (a CP-dependent stream silently gave every CP rank different weights).
Seeds are ``mix63(pack(stream, tp, cp, pp) xor mix63(seed))`` where ``pack`` is
injective (20 bits per coordinate, 62 bits in all) and ``mix63`` is a bijection of 63-bit
integers, so two distinct (stream, coordinate) pairs can never get the same seed for a
given base seed.
"""
from __future__ import annotations

import contextlib

import torch

from .topology import resolve_state

MODEL_PARALLEL_RNG = "model-parallel-rng"
# Megatron-Core's name for the expert weights' stream: distinct per (etp, ep, pp) expert
# shard, the same across expert-data-parallel replicas.
EXPERT_PARALLEL_RNG = "expert-parallel-rng"
_MASK63 = (1 << 63) - 1
_COORD_BITS = 20


def _mix63(x: int) -> int:
    """splitmix64's finaliser done modulo 2**63: xor-shifts and multiplications by odd
    constants are each bijections of 63-bit integers, so this is one too."""
    x &= _MASK63
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK63
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK63
    return x ^ (x >> 31)


def derive_seed(seed: int, stream: int, tp: int = 0, cp: int = 0, pp: int = 0) -> int:
    """The seed of ``stream`` (0 default, 1 model-parallel, 2 expert-parallel, whose
    coordinates are (etp, ep, pp) in the tp, cp, pp slots) at the given coordinates, in
    [0, 2**63) so every generator API accepts it."""
    limit = 1 << _COORD_BITS
    for name, v in (("tp", tp), ("cp", cp), ("pp", pp)):
        if not 0 <= v < limit:
            raise ValueError(f"{name} rank {v} is out of the supported range [0, {limit})")
    packed = stream | (tp << 2) | (cp << (2 + _COORD_BITS)) | (pp << (2 + 2 * _COORD_BITS))
    return _mix63(packed ^ _mix63(seed))


def get_device_rng_state(device: torch.device) -> torch.Tensor:
    """The default generator's state of ``device`` (the CPU generator for cpu)."""
    if device.type == "cuda":
        return torch.cuda.get_rng_state(device)
    return torch.get_rng_state()


def set_device_rng_state(state: torch.Tensor, device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


class RNGStatesTracker:
    """Named RNG states that ``fork()`` swaps in and out of the device's default generator.

    Same methods as TE's ``CudaRNGStatesTracker`` (add, fork, get_states, set_states,
    reset), so it can be passed to TE as ``get_rng_state_tracker``. ``device`` is
    "cuda" when CUDA is available, else "cpu"; the CPU generator is used on CPU.
    """

    def __init__(self, device: str | torch.device | None = None):
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()

    # --- generator access ---
    def _get(self) -> torch.Tensor:
        return get_device_rng_state(self.device)

    def _set(self, state: torch.Tensor) -> None:
        set_device_rng_state(state, self.device)

    def _seed(self, seed: int) -> None:
        if self.device.type == "cuda":
            with torch.cuda.device(self.device):
                torch.cuda.manual_seed(seed)
        else:
            torch.manual_seed(seed)

    # --- TE interface ---
    def reset(self) -> None:
        self.states_ = {}
        self.seeds_ = set()

    def get_states(self) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self.states_.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self.states_ = {k: v.clone() for k, v in states.items()}

    def add(self, name: str, seed: int) -> None:
        if seed in self.seeds_:
            raise ValueError(f"seed {seed} already exists in the RNG tracker; use another seed")
        if name in self.states_:
            raise ValueError(f"RNG state {name!r} already exists; call reset() first")
        self.seeds_.add(seed)
        orig = self._get()
        self._seed(seed)
        self.states_[name] = self._get()
        self._set(orig)

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG):
        """Run the block on the named stream; the outer stream is restored afterwards and
        the named stream advances by what the block drew."""
        if name not in self.states_:
            raise KeyError(f"RNG state {name!r} is not in the tracker; seed it with "
                           "tpkit.layout.random.model_parallel_seed(seed, state) or tracker.add()")
        orig = self._get()
        self._set(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = self._get()
            self._set(orig)


_TRACKER: RNGStatesTracker | None = None


def get_rng_tracker() -> RNGStatesTracker:
    """The process-wide tracker (created on first use)."""
    global _TRACKER
    if _TRACKER is None:
        _TRACKER = RNGStatesTracker()
    return _TRACKER


def model_parallel_seed(seed: int, state=None) -> RNGStatesTracker:
    """Seed the default stream (same on a whole PP stage), the tracker's model-parallel
    stream (distinct per tp and pp coordinate) and its expert-parallel stream (distinct
    per etp, ep and pp coordinate). Returns the tracker."""
    state = resolve_state(state)
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed={seed!r} must be a non-negative integer")
    tracker = get_rng_tracker()
    if tracker.device.type != state.device.type:
        tracker.device = torch.device(state.device)
    default_seed = derive_seed(seed, 0, pp=state.pp_rank)
    torch.manual_seed(default_seed)  # CPU generator and every CUDA device
    tracker.reset()
    tracker.add(MODEL_PARALLEL_RNG,
                derive_seed(seed, 1, tp=state.tp_rank, pp=state.pp_rank))
    tracker.add(EXPERT_PARALLEL_RNG,
                derive_seed(seed, 2, tp=state.etp_rank, cp=state.ep_rank, pp=state.pp_rank))
    return tracker
