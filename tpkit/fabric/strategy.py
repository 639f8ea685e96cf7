"""TPKitStrategy: Lightning Fabric over a tpkit layout (TP, SP, CP and DP at once).

Lightning's ModelParallelStrategy is 2-D (FSDP2 x DTensor TP) and cannot checkpoint TE
tensor-parallel weights. This strategy builds a full tpkit ParallelState in
``setup_environment`` and uses its groups everywhere:
- data parallelism runs over the dp x cp group (DDP, or FSDP2 on the flattened dp_cp
  mesh): TP ranks never average with each other, and CP ranks average like data
  replicas — which, with the loss convention below, sums the CP partial gradients;
- the distributed sampler splits over DP ranks only: a TP/CP group sees the same batch
  (CP shards its sequence itself, e.g. with tpkit.data.shard_sequence);
- sequence-parallel gradients are summed over TP once, right before clipping or the
  optimizer step (so gradient accumulation stays correct);
- gradient-norm clipping counts TP shards once each and replicated params once;
- checkpoints go through tpkit.checkpoint.save/load (sharded, reshardable, atomic).

Loss convention: each rank's loss is the mean over *its own* tokens (its CP chunk of its
DP micro-batch, every rank holding the same number of tokens). DP(x CP) averaging then
gives exactly the gradient of the global-batch token mean, the single-process loss: a
CP rank's parameter gradient is the partial derivative through its own computation of
*all* CP ranks' losses (attention backward returns dK/dV to their owners), so
average_{dp,cp} = (1/dp) sum_dp sum_cp (1/cp) d(loss_cp)/dtheta. The reported loss is
``strategy.all_reduce(loss, group=state.dp_cp_group)`` (mean).

``import tpkit.fabric`` registers the name ``"tpkit"``, so ``Fabric(strategy="tpkit")``
works with the layout taken from the ``TPKIT_*`` variables (tpkit-launch).
"""
from __future__ import annotations

import os
from contextlib import AbstractContextManager, ExitStack, nullcontext
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.fabric.strategies.parallel import ParallelStrategy
from lightning.fabric.strategies.strategy import _BackwardSyncControl
from lightning.fabric.utilities.distributed import (_get_default_process_group_backend_for_device,
                                                    _init_dist_connection,
                                                    _sync_ddp_if_available)
from lightning.fabric.utilities.rank_zero import rank_zero_only
from torch import nn

from .. import checkpoint, grads, parallel_state, topology
from ..config import ParallelConfig
from ..param_tags import set_tags, tags_of
from ..random import MODEL_PARALLEL_RNG, get_rng_tracker, model_parallel_seed
from ..te import is_te_module, wire_parallel_groups

DATA_PARALLEL = ("ddp", "fsdp")


class TPKitStrategy(ParallelStrategy):
    """Fabric strategy for tpkit layouts; see the module docstring. Sizes left ``None``
    come from ``TPKIT_*`` variables, else 1; dp is what is left of the world."""

    def __init__(self, tp: int | None = None, cp: int | None = None, pp: int | None = None, *,
                 sequence_parallel: bool | None = None, cp_comm_type: str | None = None,
                 cp_a2a_size: int | None = None, data_parallel: str = "ddp",
                 parallelize_fn: Callable | None = None, seed: int | None = None,
                 accelerator=None, parallel_devices=None, cluster_environment=None,
                 checkpoint_io=None, precision=None, process_group_backend: str | None = None,
                 timeout: timedelta | None = default_pg_timeout, **ddp_kwargs: Any) -> None:
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                         precision=precision)
        # Validate the sizes now (clear errors before any process starts); dp later.
        self._config = ParallelConfig.from_env(
            tp=tp, cp=cp, pp=pp, sequence_parallel=sequence_parallel,
            cp_comm_type=cp_comm_type, cp_a2a_size=cp_a2a_size,
            given_as="TPKitStrategy's {name} argument")
        if self._config.pp != 1:
            raise ValueError(f"pp={self._config.pp}: TPKitStrategy has no pipeline schedule; "
                             "use pp=1 (pipeline stages need their own training loop)")
        if data_parallel not in DATA_PARALLEL:
            raise ValueError(f"data_parallel={data_parallel!r} is unknown; use one of "
                             f"{DATA_PARALLEL}")
        if data_parallel == "fsdp" and ddp_kwargs:
            raise ValueError(f"{sorted(ddp_kwargs)} are DistributedDataParallel options and "
                             "do not apply with data_parallel='fsdp'")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
            raise ValueError(f"seed={seed!r} must be a non-negative integer or None")
        self._data_parallel = data_parallel
        self._parallelize_fn = parallelize_fn
        self._seed = seed
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self._ddp_kwargs = ddp_kwargs
        self._num_nodes = 1
        self._state: topology.ParallelState | None = None
        self._owns_state = False
        self._modules: list[nn.Module] = []
        self._grads_pending = False
        self._backward_sync_control = _TPKitBackwardSyncControl()

    # --- layout ----------------------------------------------------------------------
    @property
    def parallel_state(self) -> topology.ParallelState:
        if self._state is None:
            raise RuntimeError("the tpkit layout exists only after setup_environment() "
                               "(fabric.launch())")
        return self._state

    @property
    def config(self) -> ParallelConfig:
        return self._state.config if self._state is not None else self._config

    @property
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        s = self.parallel_state
        return {"num_replicas": s.dp_size, "rank": s.dp_rank}

    @property
    def process_group_backend(self) -> str | None:
        return self._process_group_backend

    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if not self.cluster_environment.creates_processes_externally:
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment,
                                                       self.num_processes, self.num_nodes)

    def _set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(
                self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = self.global_rank

    def setup_environment(self) -> None:
        """Process group (reused when one exists), then the tpkit layout over it."""
        super().setup_environment()
        self._set_world_ranks()
        if self._process_group_backend is None:  # tpkit-launch's --backend, else Lightning's
            self._process_group_backend = os.environ.get("TPKIT_BACKEND") or \
                _get_default_process_group_backend_for_device(self.root_device)
        if not dist.is_initialized():
            _init_dist_connection(self.cluster_environment, self._process_group_backend,
                                  timeout=self._timeout)
        if dist.get_world_size() != self.world_size:
            raise ValueError(f"the process group has {dist.get_world_size()} ranks but Fabric "
                             f"expects {self.world_size} (devices x num_nodes); make them match")
        if topology.is_initialized():
            state = topology.get_parallel_state()
            wanted = self._config.validate(dist.get_world_size())
            if state.config != wanted:
                raise ValueError(f"a tpkit layout {state.config} is already initialised but "
                                 f"the strategy wants {wanted}; call tpkit.destroy_parallel() "
                                 "first or pass matching sizes")
            self._state = state
        else:
            self._state = parallel_state.init_parallel(
                config=self._config, seed=1234 if self._seed is None else self._seed)
            self._owns_state = True
        clear_dtensor_caches()

    # --- modules -----------------------------------------------------------------------
    def module_init_context(self, empty_init: bool | None = None) -> AbstractContextManager:
        """``empty_init=True`` creates parameters on the meta device (no memory, no init
        cost); setup_module materialises them with each module's reset_parameters()."""
        stack = ExitStack()
        stack.enter_context(torch.device("meta") if empty_init else self.root_device)
        stack.enter_context(self.precision.module_init_context())
        return stack

    def module_to_device(self, module: nn.Module) -> None:
        if not any(t.is_meta for t in module.parameters()):
            module.to(self.root_device)

    def setup_module(self, module: nn.Module) -> nn.Module:
        state = self.parallel_state
        if self._parallelize_fn is not None:
            module = self._parallelize_fn(module, state)
            if not isinstance(module, nn.Module):
                raise TypeError(f"parallelize_fn must return an nn.Module, got "
                                f"{type(module).__name__}")
        _materialize(module, self.root_device)
        if any(is_te_module(m) for m in module.modules()):
            wire_parallel_groups(module, state)
        if MODEL_PARALLEL_RNG not in get_rng_tracker().states_:
            model_parallel_seed(1234 if self._seed is None else self._seed, state)
        if hasattr(self.precision, "attach"):
            self.precision.attach(state, self.root_device)
        if self._data_parallel == "fsdp":
            module = _apply_fsdp(module, state)
        elif state.dp_cp_size > 1:
            # DDP over a group of one would only copy every gradient into its buckets and
            # back (measured on an H100: ~3 % of a 0.7B-parameter step); nothing to average.
            ids = None if self.root_device.type == "cpu" else [self.root_device.index]
            module = nn.parallel.DistributedDataParallel(
                module, device_ids=ids, process_group=state.dp_cp_group, **self._ddp_kwargs)
        self._modules.append(module)
        return module

    def setup_module_and_optimizers(self, module, optimizers, scheduler=None):
        module = self.setup_module(module)
        if self._data_parallel == "fsdp":
            live = {id(p) for p in module.parameters()}
            for opt in optimizers:
                if any(id(p) not in live for g in opt.param_groups for p in g["params"]):
                    raise ValueError(
                        "with data_parallel='fsdp' the optimizer must be created after the "
                        "module is sharded (FSDP2 replaces the parameters): call "
                        "model = fabric.setup_module(model), then build the optimizer from "
                        "model.parameters() and call fabric.setup_optimizers(optimizer)")
        return module, [self.setup_optimizer(o) for o in optimizers], scheduler

    def _params(self):
        seen = set()
        for m in self._modules:
            for p in m.parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    yield p

    def finalize_gradients(self) -> None:
        """Sum sequence-parallel gradients over TP, once per optimizer step (called by
        clip_gradients_norm and optimizer_step; idempotent until the next backward)."""
        if self._grads_pending:
            grads.sync_sequence_parallel_grads(self._params(), self.parallel_state)
            self._grads_pending = False

    def backward(self, tensor: torch.Tensor, module: nn.Module | None, *args, **kwargs) -> None:
        super().backward(tensor, module, *args, **kwargs)
        self._grads_pending = True

    def optimizer_step(self, optimizer, **kwargs: Any) -> Any:
        self.finalize_gradients()
        return super().optimizer_step(optimizer, **kwargs)

    def clip_gradients_norm(self, module, optimizer, max_norm, norm_type=2.0,
                            error_if_nonfinite: bool = True) -> torch.Tensor:
        self.finalize_gradients()
        self.precision.unscale_gradients(optimizer)
        return grads.clip_grad_norm(self.precision.main_params(optimizer), max_norm,
                                    self.parallel_state, norm_type=norm_type,
                                    error_if_nonfinite=error_if_nonfinite)

    # --- collectives -------------------------------------------------------------------
    def all_reduce(self, tensor, group: Any | None = None, reduce_op: Any = "mean"):
        if isinstance(tensor, torch.Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    def barrier(self, *args: Any, **kwargs: Any) -> None:
        if dist.is_initialized():
            if dist.get_backend() == "nccl":
                dist.barrier(device_ids=[self.root_device.index])
            else:
                dist.barrier()

    def broadcast(self, obj, src: int = 0):
        if not dist.is_initialized():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src)
        return box[0]

    # --- checkpoints ---------------------------------------------------------------------
    def get_module_state_dict(self, module: nn.Module) -> dict[str, Any]:
        return checkpoint.unwrap_module(module).state_dict()

    def load_module_state_dict(self, module: nn.Module, state_dict, strict: bool = True) -> None:
        checkpoint.unwrap_module(module).load_state_dict(state_dict, strict=strict)

    def save_checkpoint(self, path, state: dict, storage_options: Any | None = None,
                        filter: dict | None = None) -> None:
        """A sharded checkpoint directory (tpkit.checkpoint.save); loads at any layout."""
        if storage_options is not None or filter is not None:
            raise ValueError("TPKitStrategy.save_checkpoint does not support storage_options "
                             "or filter; save a smaller state dict instead")
        checkpoint.save(self.broadcast(str(path)), state)

    def load_checkpoint(self, path, state=None, strict: bool = True,
                        weights_only: bool | None = None) -> dict[str, Any]:
        """Load into ``state`` (a dict with the module/optimizer objects) in place, from a
        checkpoint written at any layout; returns the checkpoint's values not in ``state``."""
        if not isinstance(state, dict) or not state:
            raise ValueError("TPKitStrategy.load_checkpoint needs state={'model': model, ...} "
                             "with the objects to restore in place")
        path = self.broadcast(str(path))
        checkpoint.load(path, state, strict=strict)
        return checkpoint.read_extras(path, exclude=state.keys())

    def teardown(self) -> None:
        """Free the layout this strategy built (destroy_parallel: its groups, not the
        default process group, which a later Fabric or init_parallel reuses)."""
        self._modules = []
        if self._owns_state and topology.is_initialized() \
                and topology.get_parallel_state() is self._state:
            parallel_state.destroy_parallel()
        self._state = None
        self._owns_state = False
        clear_dtensor_caches()
        super().teardown()

    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        strategy_registry.register(
            "tpkit", cls, description="tpkit TP/SP/CP/DP layout from TPKIT_* (tpkit-launch)")


class _TPKitBackwardSyncControl(_BackwardSyncControl):
    def no_backward_sync(self, module: nn.Module, enabled: bool) -> AbstractContextManager:
        if not enabled:
            return nullcontext()
        if isinstance(module, nn.parallel.DistributedDataParallel):
            return module.no_sync()
        if hasattr(module, "set_requires_gradient_sync"):  # FSDP2
            return _FSDPNoSync(module)
        if isinstance(module, nn.Module) and not any(
                isinstance(m, nn.parallel.DistributedDataParallel) for m in module.modules()):
            return nullcontext()   # dp x cp == 1: TPKitStrategy wraps nothing, nothing to sync
        raise TypeError(f"no_backward_sync needs a module set up by TPKitStrategy, got "
                        f"{type(module).__name__}")


class _FSDPNoSync(AbstractContextManager):
    def __init__(self, module):
        self.module = module

    def __enter__(self):
        self.module.set_requires_gradient_sync(False)

    def __exit__(self, *exc):
        self.module.set_requires_gradient_sync(True)


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


def _materialize(module: nn.Module, device: torch.device) -> None:
    """Meta parameters -> real ones via each owning module's reset_parameters()."""
    if not any(t.is_meta for t in [*module.parameters(), *module.buffers()]):
        return
    module.to_empty(device=device)
    for name, m in module.named_modules():
        own = [*m.parameters(recurse=False), *m.buffers(recurse=False)]
        if not own:
            continue
        if not callable(getattr(m, "reset_parameters", None)):
            raise ValueError(f"module {name or type(module).__name__!r} ({type(m).__name__}) "
                             "was created on the meta device but has no reset_parameters() to "
                             "initialise it; create the model with empty_init=False")
        m.reset_parameters()


def _apply_fsdp(module: nn.Module, state) -> nn.Module:
    """FSDP2 over the flattened dp x cp mesh; tpkit's parameter tags are carried over to the
    DTensor parameters FSDP creates."""
    from torch.distributed.fsdp import fully_shard
    saved = {n: tags_of(p) for n, p in module.named_parameters()}
    fully_shard(module, mesh=state.dp_cp_mesh)
    for n, p in module.named_parameters():
        set_tags(p, saved.get(n, {}))
    return module
