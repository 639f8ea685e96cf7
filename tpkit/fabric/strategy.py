"""TPKitStrategy: Lightning Fabric over a tpkit layout (TP, SP, CP and DP at once).

Lightning's ModelParallelStrategy is 2-D (FSDP2 x DTensor TP) and cannot checkpoint TE
tensor-parallel weights. This strategy builds a full tpkit ParallelState in
``setup_environment`` and uses its groups everywhere:
- data parallelism runs over the dp x cp group (DDP, or FSDP2 on the flattened dp_cp
  mesh): TP ranks never average with each other, and CP ranks average like data
  replicas — which, with the loss convention below, sums the CP partial gradients;
- the distributed sampler splits over DP ranks only: a TP/CP group sees the same batch
  (CP shards its sequence itself, e.g. with tpkit.data.shard_sequence);
- sequence-parallel gradients are summed over TP at the end of ``fabric.backward``, as
  DDP averages there: only what this backward added, so ``.grad`` is complete after every
  backward outside ``no_backward_sync`` (which defers the sum, as it defers DDP's) and
  accumulating without ``no_backward_sync`` stays correct; clipping and the optimizer step
  sum what is still pending (a step inside ``no_backward_sync``);
- gradient-norm clipping counts TP shards once each and replicated params once; clipping
  by value clamps the summed gradients;
- checkpoints go through tpkit.checkpoint.save/load (sharded, reshardable, atomic);
  ``fabric.load(path)`` without state returns the whole checkpoint with full tensors
  (tpkit.checkpoint.read); a single file (``torch.save``: ``fabric.load_raw``, or a full
  checkpoint dict) loads full state dicts into the shards (load_full_state_dict,
  load_full_optimizer_state_dict), as Lightning's ModelParallelStrategy does.

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
import weakref
from contextlib import AbstractContextManager, ExitStack, contextmanager
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
from lightning.fabric.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.fabric.strategies.parallel import ParallelStrategy
from lightning.fabric.utilities.distributed import (_get_default_process_group_backend_for_device,
                                                    _init_dist_connection, _sync_ddp_if_available)
from lightning.fabric.utilities.rank_zero import rank_zero_only
from torch import nn

from .. import checkpoint, grads
from ..layout import parallel_state, topology
from ..layout.config import ParallelConfig
from ..layout.param_tags import is_expert
from ..layout.random import MODEL_PARALLEL_RNG, get_rng_tracker, model_parallel_seed
from ..te import is_te_module, wire_parallel_groups
from .sync import ExpertGradSum, SequenceParallelSum, TPKitBackwardSyncControl
from .setup import (_FSDP_ORDER, _PP_ORDER, _SWAP_ORDER, _TIMED_OUT, _apply_fsdp,
                    _call_parallelize_fn, _check_tp_sharded, _materialize, _pipeline_args,
                    _refuse_dtensors, clear_dtensor_caches)

DATA_PARALLEL = ("ddp", "fsdp")


class TPKitStrategy(ParallelStrategy):
    """Fabric strategy for tpkit layouts; see the module docstring. Sizes left ``None``
    come from ``TPKIT_*`` variables, else 1; dp is what is left of the world. ``layout``: a
    ParallelConfig resolved by the caller, used as it is (instead of the sizes).
    ``data_parallel="fsdp"``: FSDP2 in ``fsdp_units`` ("blocks": a unit per transformer
    block, the stem and the head their own; "model": one), HSDP with ``fsdp_replicate`` >
    1 replicas, ``fsdp_mixed_precision="bf16"`` (bf16 compute, fp32 reduce);
    tpkit.distributed.fsdp."""

    def __init__(self, tp: int | None = None, cp: int | None = None, pp: int | None = None, *,
                 sequence_parallel: bool | None = None, cp_comm_type: str | None = None,
                 cp_a2a_size: int | None = None, ep: int | None = None,
                 etp: int | None = None, data_parallel: str = "ddp",
                 microbatches: int | None = None, pp_schedule: str = "1F1B",
                 virtual_stages: int | None = None, fsdp_units: str = "blocks",
                 fsdp_replicate: int = 1, fsdp_mixed_precision: str | None = None,
                 layout: ParallelConfig | None = None,
                 parallelize_fn: Callable | None = None, seed: int | None = None,
                 accelerator=None, parallel_devices=None, cluster_environment=None,
                 checkpoint_io=None, precision=None, process_group_backend: str | None = None,
                 timeout: timedelta | None = None, **ddp_kwargs: Any) -> None:
        if cluster_environment is None:   # inside a Ray Train worker: Ray's ranks
            from .environment import RayEnvironment, ray_train_context
            ctx = ray_train_context()
            cluster_environment = RayEnvironment(ctx) if ctx is not None else None
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                         precision=precision)
        # Validate the sizes now (clear errors before any process starts); dp later. A
        # caller that resolved the layout already (tpkit.train) hands it over as ``layout``.
        sizes = dict(tp=tp, cp=cp, pp=pp, sequence_parallel=sequence_parallel,
                     cp_comm_type=cp_comm_type, cp_a2a_size=cp_a2a_size, ep=ep, etp=etp)
        if layout is not None:
            given = [f"{k}={v!r}" for k, v in sizes.items() if v is not None]
            if given or not isinstance(layout, ParallelConfig):
                raise ValueError(f"TPKitStrategy(layout={layout!r}, {', '.join(given)}): pass "
                                 "the layout either as one ParallelConfig (layout=) or as "
                                 "sizes, not both")
            self._config = layout
        else:
            self._config = ParallelConfig.from_env(
                **sizes, given_as="TPKitStrategy's {name} argument")
        self._pipeline_args = _pipeline_args(self._config.pp, microbatches, pp_schedule,
                                             virtual_stages, data_parallel)
        self._pipeline = None
        if data_parallel not in DATA_PARALLEL:
            raise ValueError(f"data_parallel={data_parallel!r} is unknown; use one of "
                             f"{DATA_PARALLEL}")
        if data_parallel == "fsdp" and ddp_kwargs:
            raise ValueError(f"{sorted(ddp_kwargs)} are DistributedDataParallel options and "
                             "do not apply with data_parallel='fsdp'")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
            raise ValueError(f"seed={seed!r} must be a non-negative integer or None")
        self._data_parallel = data_parallel
        from ..distributed.fsdp import MIXED_PRECISION, UNITS   # FSDP2's options
        fsdp = dict(units=fsdp_units, replicate=fsdp_replicate,
                    mixed_precision=fsdp_mixed_precision)
        for (name, v), ok, default in zip(fsdp.items(), (UNITS, None, MIXED_PRECISION),
                                          ("blocks", 1, None)):
            if ok is not None and v not in ok:
                raise ValueError(f"fsdp_{name}={v!r} is unknown; use one of {list(ok)}")
            if v != default and data_parallel != "fsdp":
                raise ValueError(f"fsdp_{name}={v!r} applies with data_parallel='fsdp' "
                                 f"(here {data_parallel!r}); set it or drop fsdp_{name}")
        if isinstance(fsdp_replicate, bool) or not isinstance(fsdp_replicate, int) \
                or fsdp_replicate < 1:
            raise ValueError(f"fsdp_replicate={fsdp_replicate!r} must be an int >= 1 (HSDP: "
                             "the replicas; 1: plain FSDP)")
        self._fsdp = fsdp
        self._parallelize_fn = parallelize_fn
        self._seed = seed
        self._process_group_backend = process_group_backend
        # as init_parallel: TPKIT_PG_TIMEOUT (else 600 s), not Lightning's 30 minutes
        self._timeout = parallel_state.pg_timeout() if timeout is None else timeout
        self._ddp_kwargs = ddp_kwargs
        self._num_nodes = 1
        self._state: topology.ParallelState | None = None
        self._owns_state = False
        self._modules: list[nn.Module] = []
        self._sp_sum = SequenceParallelSum()
        self._expert_sum = ExpertGradSum()
        self._replaced: dict[int, weakref.ref] = {}   # parameters FSDP2 replaced
        self._swapped: dict[int, tuple] = {}   # parameters parallelize_fn replaced: (ref, name)
        self._optimizers: list[weakref.ref] = []
        self._backward_sync_control = TPKitBackwardSyncControl(self._sp_sum, self._expert_sum)

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
        """``empty_init=True`` creates plain modules' parameters on the meta device (no
        memory, no init cost); setup_module materialises them with each module's
        reset_parameters(). tpkit's layers create their shards on the layout's device and
        initialise them anyway (their RNG streams differ per TP rank), and stay as they are."""
        stack = ExitStack()
        stack.enter_context(torch.device("meta") if empty_init else self.root_device)
        stack.enter_context(self.precision.module_init_context())
        return stack

    def module_to_device(self, module: nn.Module) -> None:
        if not any(t.is_meta for t in module.parameters()):
            module.to(self.root_device)

    def setup_module(self, module: nn.Module) -> nn.Module:
        state = self.parallel_state
        _refuse_dtensors(module)
        if self._parallelize_fn is not None:
            before = {id(p): (weakref.ref(p), n) for n, p in module.named_parameters()}
            module = _call_parallelize_fn(self._parallelize_fn, module, state)
            if not isinstance(module, nn.Module):
                raise TypeError(f"parallelize_fn must return an nn.Module, got "
                                f"{type(module).__name__}")
            _refuse_dtensors(module, "parallelize_fn")   # e.g. torch's parallelize_module
            for p in module.parameters():
                before.pop(id(p), None)
            self._swapped.update(before)
            for ref in self._optimizers:   # optimizers set up before this module
                if ref() is not None:
                    self._check_stale(ref(), module)
        _check_tp_sharded(module, state)
        _materialize(module, self.root_device)
        if any(is_te_module(m) for m in module.modules()):
            wire_parallel_groups(module, state)
        if MODEL_PARALLEL_RNG not in get_rng_tracker().states_:
            model_parallel_seed(1234 if self._seed is None else self._seed, state)
        if hasattr(self.precision, "attach"):
            self.precision.attach(state, self.root_device)
        experts = [n for n, p in module.named_parameters() if is_expert(p)]
        if state.pp_size > 1:   # expert weights: summed over edp by Pipeline.step
            return self._setup_pipeline(module, state)
        if self._data_parallel == "fsdp":
            self._check_optimizers_after(module)
            old = {id(p): weakref.ref(p) for p in module.parameters()}
            module = _apply_fsdp(module, state, **self._fsdp)
            for p in module.parameters():
                old.pop(id(p), None)
            self._replaced.update(old)
        elif state.dp_cp_size > 1:
            # DDP over a group of one would only copy every gradient into its buckets and
            # back (measured on an H100: ~3 % of a 0.7B-parameter step); nothing to average.
            ids = None if self.root_device.type == "cpu" else [self.root_device.index]
            # Expert weights are reduced over edp by the expert sum (docs/moe.md), never
            # averaged over dp x cp, which would mix different experts' gradients.
            nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
                module, experts)
            module = nn.parallel.DistributedDataParallel(
                module, device_ids=ids, process_group=state.dp_cp_group, **self._ddp_kwargs)
        self._modules.append(module)
        self._sp_sum.add(module)
        self._expert_sum.add(module)
        return module

    # --- pipeline parallelism (pp > 1; docs/pipeline.md "Fabric") ---------------------
    def _setup_pipeline(self, module: nn.Module, state) -> nn.Module:
        """Split ``module`` into this rank's stages and build the schedule
        (tpkit.distributed.pipeline.build_pipeline); returns the stages' PipelineModule."""
        from ..distributed.pipeline import build_pipeline
        if self._pipeline is not None:
            raise ValueError("TPKitStrategy(pp > 1) pipelines one model; set up a single "
                             "module (a second fabric.setup_module call found one already)")
        self._check_optimizers_after(module, _PP_ORDER)
        # the precision's forward context around every stage forward and loss (Fabric's
        # module wrapper is not on the schedule's path); 16-mixed's GradScaler scales each
        # micro-batch's loss, as its backward() does at pp = 1
        scaler = getattr(self.precision, "scaler", None)
        forward_context = getattr(self.precision, "forward_context", None)
        before = {id(p): weakref.ref(p) for p in module.parameters()}
        # One flattened all-reduce per dtype over dp x cp after the step: right for every
        # schedule and micro-batch count (DDP inside the stages is not, tpkit.distributed.pipeline);
        # with FSDP2 each stage module is sharded, reduced once per step by the schedule.
        fsdp = self._data_parallel == "fsdp"
        pipe = build_pipeline(module, state=state, device=self.root_device,
                              data_parallel="fsdp" if fsdp else "allreduce",
                              fsdp=self._fsdp if fsdp else None,
                              forward_context=forward_context,
                              loss_scale=None if scaler is None or not scaler.is_enabled()
                              else scaler, **self._pipeline_args)
        for p in pipe.module.parameters():
            before.pop(id(p), None)
        self._replaced.update(before)   # other stages' parameters: not this rank's to train
        self._pipeline = pipe
        self._modules.append(pipe.module)
        self._sp_sum.add(pipe.module)
        return pipe.module

    @property
    def pipeline(self):
        """The tpkit.distributed.pipeline.Pipeline built by setup_module (pp > 1), else None."""
        return self._pipeline

    def pipeline_step(self, *inputs, target: torch.Tensor) -> torch.Tensor:
        """Forward and backward of one batch through every pipeline stage (what
        ``loss = model(x, y); fabric.backward(loss)`` is at pp = 1): gradients accumulate in
        ``.grad`` (sequence-parallel ones summed over TP, as after fabric.backward), and the
        batch-mean loss of this dp x cp rank comes back (detached) on every stage."""
        if self._pipeline is None:
            raise RuntimeError("pipeline_step needs TPKitStrategy(pp > 1) and a model set up "
                               "with fabric.setup_module(model); at pp=1 call model(...) and "
                               "fabric.backward(loss)")
        state = self.parallel_state
        self._sp_sum.before_backward(state)
        loss = self._pipeline.step(*inputs, target=target)
        self._sp_sum.after_backward(state)
        return loss

    def setup_module_and_optimizers(self, module, optimizers, scheduler=None):
        module = self.setup_module(module)
        own = {id(p) for p in module.parameters()}
        for o in optimizers:
            self._check_stale(o, module)
            foreign = [p for g in o.param_groups for p in g["params"] if id(p) not in own]
            if foreign and own:
                raise ValueError(
                    f"the optimizer passed to fabric.setup holds {len(foreign)} parameter(s) "
                    f"(shapes {[tuple(p.shape) for p in foreign[:3]]}, ...) that are not the "
                    "model's: layers were replaced after the optimizer was built, and those "
                    "parameters would never train. " + _SWAP_ORDER.split(": ", 1)[1])
        return module, [self.setup_optimizer(o) for o in optimizers], scheduler

    def _check_stale(self, optimizer, live: nn.Module | None = None) -> None:
        """Refuse an optimizer holding parameters parallelize_fn replaced unless it also
        holds every live one: built from Fabric's module after setup_module, it holds the
        original module's parameters too (Fabric keeps that module), which never get a
        gradient; built before, it lacks the new ones, which would never train."""
        swapped = self._swapped
        held = {id(p) for g in optimizer.param_groups for p in g["params"]}
        hits = [swapped[i][1] for i in held if i in swapped and swapped[i][0]() is not None]
        if hits:
            mods = [live] if live is not None else self._modules
            now = {id(p) for m in mods for p in m.parameters()}
            if not now or not now <= held:
                raise ValueError(f"the optimizer holds parameter {hits[0]!r}, which "
                                 f"parallelize_fn replaced; {_SWAP_ORDER}")
        stale = self._replaced
        if any(id(p) in stale and stale[id(p)]() is p
               for g in optimizer.param_groups for p in g["params"]):
            raise ValueError(_PP_ORDER if self._pipeline is not None else _FSDP_ORDER)

    def setup_optimizer(self, optimizer):
        """An optimizer holding parameters that parallelize_fn or FSDP2 replaced (or another
        pipeline stage's) is a ValueError: it would train tensors that are no longer the
        model's."""
        self._check_stale(optimizer)
        self._optimizers.append(weakref.ref(optimizer))
        return super().setup_optimizer(optimizer)

    def _check_optimizers_after(self, module: nn.Module, why: str = None) -> None:
        own = {id(p) for p in module.parameters()}
        for ref in self._optimizers:
            opt = ref()
            if opt is not None and any(id(p) in own for g in opt.param_groups
                                       for p in g["params"]):
                raise ValueError(why or _FSDP_ORDER)

    def finalize_gradients(self) -> None:
        """Sum over TP what was added to the sequence-parallel gradients since the last sum
        (tpkit.fabric.sync; idempotent). Public for loops that call backward themselves."""
        self._sp_sum.finalize(self.parallel_state)
        self._expert_sum.finalize(self.parallel_state)

    def backward(self, tensor: torch.Tensor, module: nn.Module | None, *args, **kwargs) -> None:
        self._sp_sum.before_backward(self.parallel_state)
        self._expert_sum.before_backward(self.parallel_state)
        super().backward(tensor, module, *args, **kwargs)
        self._sp_sum.after_backward(self.parallel_state)
        self._expert_sum.after_backward(self.parallel_state)

    def optimizer_step(self, optimizer, **kwargs: Any) -> Any:
        self.finalize_gradients()
        return super().optimizer_step(optimizer, **kwargs)

    def clip_gradients_norm(self, module, optimizer, max_norm, norm_type=2.0,
                            error_if_nonfinite: bool = True) -> torch.Tensor:
        with self._collective("fabric.clip_gradients"):
            self.finalize_gradients()
            self.precision.unscale_gradients(optimizer)
            found_inf = getattr(self.precision, "found_inf", None)   # TPKitPrecision's
            if found_inf is not None and found_inf(optimizer):   # 16-mixed overflow: skipped
                # this step on every rank (found_inf agreed); report the norm, clip nothing
                return grads.grad_norm(self.precision.main_params(optimizer),
                                       self.parallel_state, norm_type)
            return grads.clip_grad_norm(self.precision.main_params(optimizer), max_norm,
                                        self.parallel_state, norm_type=norm_type,
                                        error_if_nonfinite=error_if_nonfinite)

    def _all_arrive(self) -> None:
        """One all-reduce of one element on the default group: a rank calling a collective
        alone (``fabric.save`` under ``if rank == 0``) waits here, where the timeout is
        the strategy's, not inside a layout subgroup."""
        if dist.is_initialized() and dist.get_world_size() > 1:
            device = self.root_device if dist.get_backend() == "nccl" else "cpu"
            dist.all_reduce(torch.zeros(1, device=device))

    @contextmanager
    def _collective(self, call: str):
        """A collective that fails on its timeout (or on a peer that left) ends with one line
        naming ``call``, that it is collective, and that every rank must call it."""
        try:
            yield
        except RuntimeError as e:
            if not _TIMED_OUT.search(str(e)):
                raise
            seconds = self._timeout.total_seconds() if self._timeout else float("nan")
            rank = dist.get_rank() if dist.is_initialized() else 0
            raise TimeoutError(
                f"rank {rank}: {call} waited for the other ranks and gave up (timeout "
                f"{seconds:g} s, TPKIT_PG_TIMEOUT or TPKitStrategy(timeout=)): {call} is "
                "collective, every rank must call it (not only rank 0, e.g. under `if "
                "fabric.global_rank == 0`)") from None

    def clip_gradients_value(self, module, optimizer, clip_val) -> None:
        self.finalize_gradients()
        self.precision.unscale_gradients(optimizer)
        grads.clip_grad_value(self.precision.main_params(optimizer), clip_val)

    # --- collectives -------------------------------------------------------------------
    def all_reduce(self, tensor, group: Any | None = None, reduce_op: Any = "mean"):
        if isinstance(tensor, torch.Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    def barrier(self, *args: Any, **kwargs: Any) -> None:
        if dist.is_initialized():
            with self._collective("fabric.barrier"):
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
        """A sharded checkpoint directory (tpkit.checkpoint.save); loads at any layout.
        ``filter`` as Fabric documents it (load the result with ``strict=False``)."""
        if storage_options is not None:
            raise TypeError("TPKitStrategy.save_checkpoint(storage_options=...) is not "
                            "supported: it writes torch.distributed.checkpoint directories, "
                            "not through a CheckpointIO plugin")
        with self._collective("fabric.save"):
            self._all_arrive()
            checkpoint.save(self.broadcast(str(path)), state, filter=filter)

    def load_checkpoint(self, path, state=None, strict: bool = True,
                        weights_only: bool | None = None) -> dict[str, Any]:
        """Fabric's ``load``/``load_raw`` contract. A checkpoint directory (``fabric.save``,
        any layout): ``state`` (a dict) loads in place and the entries not in it come back;
        without ``state`` the whole checkpoint comes back, tensors full-size on every rank.
        A single file (``torch.save``, e.g. one process's ``model.state_dict()`` or a full
        checkpoint dict): full state dicts load into the shards at this layout.
        ``weights_only`` (None: True, torch.load's default) holds for both: a directory's
        plain entries are read with it (its ``.metadata`` never runs code)."""
        with self._collective("fabric.load"):
            return self._load_checkpoint(path, state, strict, weights_only)

    def _load_checkpoint(self, path, state, strict, weights_only) -> dict[str, Any]:
        """The body of load_checkpoint."""
        path, s = self.broadcast(str(path)), self.parallel_state
        if isinstance(state, (nn.Module, torch.optim.Optimizer)):   # fabric.load_raw
            if not os.path.isfile(path):
                raise ValueError(f"load_raw needs one file holding a full state dict "
                                 f"(torch.save); {path} is not a file. Load a checkpoint "
                                 "directory with fabric.load(path, {'model': model, ...})")
            full = self._torch_load(path, weights_only)
            if isinstance(state, nn.Module):
                module = checkpoint.unwrap_module(state)
                if s.pp_size > 1:   # a whole model's file: other stages' keys are theirs
                    mine = set(module.state_dict())
                    every = [None] * s.pp_size
                    dist.all_gather_object(every, sorted(mine), group=s.pp_group)
                    theirs = set().union(*map(set, every)) - mine
                    full = {k: v for k, v in full.items() if k not in theirs}
                checkpoint.load_full_state_dict(module, full, s, strict=strict)
            else:
                checkpoint.load_full_optimizer_state_dict(state, full, self._modules, s)
            return {}
        if os.path.isfile(path):
            if not state:
                return self._torch_load(path, weights_only, mmap=False)   # the user's to keep
            return checkpoint.load_full(self._torch_load(path, weights_only), state, s,
                                        strict=strict)
        safe = weights_only is not False   # a directory's plain entries: as torch.load's
        if not state:
            return checkpoint.read(path, weights_only=safe)
        checkpoint.load(path, state, strict=strict, weights_only=safe)
        return checkpoint.read_extras(path, exclude=state.keys(), weights_only=safe)

    @staticmethod
    def _torch_load(path: str, weights_only: bool | None, mmap: bool = True):
        """mmap (as Lightning's ModelParallelStrategy): the ranks share one copy in memory."""
        kwargs = {} if weights_only is None else {"weights_only": weights_only}
        return torch.load(path, map_location="cpu", mmap=mmap, **kwargs)

    def teardown(self) -> None:
        """Free the layout this strategy built (destroy_parallel: its groups, not the
        default process group, which a later Fabric or init_parallel reuses)."""
        self._modules = []
        self._pipeline = None
        self._sp_sum.clear()
        self._expert_sum.clear()
        self._optimizers, self._replaced, self._swapped = [], {}, {}
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
