"""Fake ``transformer_engine.pytorch`` with TE 2.20.2's signatures (the subset tpkit uses).

Every constructor records its bound arguments (defaults included) in ``init_args`` and
every ``set_*_parallel_group`` call in ``calls``; the container setters recurse into
children the way TE's do. ``tp_size`` follows TE: the group's size when ``tp_group`` is
given, else the ``tp_size`` argument. No math: ``forward`` raises, except
``GroupedLinear.forward`` (the expert GEMMs, computed in torch: tpkit.nn.MoE's TE backend
is checked against the torch backend through it) and ``DotProductAttention.forward``,
which records its bound arguments in ``calls`` (what tpkit passes through) and returns
zeros of the output's shape. ``tests/te_contract.py`` compares these signatures with
TE's real sources.
"""
from __future__ import annotations

import contextlib
import enum
import inspect

import torch
import torch.distributed as dist

from ..common.recipe import DelayedScaling
from . import distributed as _distributed
from .distributed import CudaRNGStatesTracker  # noqa: F401  (exported, as TE)
from .quantization import FP8GlobalStateManager, get_align_size_for_quantization

RECORD: list = []  # (name, bound arguments) of module-level calls: autocast, model init
# What the is_*_available checks answer: (available, TE's reason). Tests change it; the
# default is an H100's answer (no MXFP8, no NVFP4), reasons worded as TE words them.
SUPPORT = {
    "fp8": (True, ""),
    "mxfp8": (False, "Device compute capability 10.0 or higher required for MXFP8 execution."),
    "fp8_block_scaling": (True, ""),
    "nvfp4": (False, "Device compute capability 10.0 or higher required for NVFP4 execution."),
}


class CPLoadBalancingStrategy(enum.Enum):
    DUAL_CHUNK_SWAP = "dual_chunk_swap"
    NO_LOAD_BALANCE = "no_load_balance"


def _bound(fn, args, kwargs) -> dict:
    sig = inspect.signature(fn)
    b = sig.bind(*args, **kwargs)
    b.apply_defaults()
    out = dict(b.arguments)
    out.pop("self", None)
    return out


def _group_size(group) -> int:
    return dist.get_world_size(group)


# Hopper (compute capability 9.0): fp8 GEMMs of a token count that is not a multiple of
# 16 fail in cuBLASLt (TE's grouped wgrad is NT, done as TN on Hopper: "Caller must pad").
DEVICE_CAPABILITY = (9, 0)
_BUILT = [0]  # modules built so far: each module's build index (same on every rank)


class _FakeModule(torch.nn.Module):
    """Shared recording; ``__init__`` of subclasses binds their own arguments."""

    def _record_init(self, init, loc):
        """Record ``init``'s arguments from its ``locals()`` (taken first thing)."""
        torch.nn.Module.__init__(self)
        self.build_index = _BUILT[0]
        _BUILT[0] += 1
        if FP8GlobalStateManager.with_fp8_parameters():
            # TE's modules ask the recipe of quantized_model_init for its type
            FP8GlobalStateManager.get_fp8_recipe().delayed()
        loc = {k: v for k, v in loc.items() if k not in ("self", "__class__")}
        extra = loc.pop("kwargs", {})
        self.init_args = _bound(init, (self,), {**loc, **extra})
        self.calls = []

    def forward(self, *args, **kwargs):
        raise NotImplementedError("fake Transformer Engine module: no forward on CPU")


class _TPModule(_FakeModule):
    """Like TE's TransformerEngineBaseModule: a non-recursive set_tensor_parallel_group."""

    def _init_tp(self, tp_group, tp_size):
        self.tp_group_initialized = False
        self.tp_group = None
        if tp_group is None:
            self.tp_size = tp_size
            if tp_size == 1:
                self.set_tensor_parallel_group(tp_group)
        else:
            self.tp_size = _group_size(tp_group)
            self.set_tensor_parallel_group(tp_group)
        self.calls.clear()  # construction-time calls are not wiring

    def set_tensor_parallel_group(self, tp_group):
        self.calls.append(("set_tensor_parallel_group", {"tp_group": tp_group}))
        self.tp_group = tp_group
        self.tp_group_initialized = True


class Linear(_TPModule):
    def __init__(self, in_features, out_features, sequence_parallel=False,
                 fuse_wgrad_accumulation=False, tp_group=None, tp_size=1,
                 get_rng_state_tracker=None, rng_tracker_name=None, init_method=None,
                 bias=True, return_bias=False, params_dtype=None, parallel_mode=None,
                 parameters_split=None, device='cuda', ub_overlap_ag=False,
                 ub_overlap_rs=False, ub_overlap_rs_dgrad=False, ub_bulk_dgrad=False,
                 ub_bulk_wgrad=False, ub_name=None, delay_wgrad_compute=False,
                 symmetric_ar_type=None, save_original_input=False, name=None):
        self._record_init(Linear.__init__, locals())
        if parallel_mode not in ("column", "row", None):
            raise AssertionError(f"parallel_mode {parallel_mode} not supported")
        self.parallel_mode = parallel_mode
        self.sequence_parallel = sequence_parallel
        self._init_tp(tp_group, tp_size)


class LayerNormLinear(_TPModule):
    def __init__(self, in_features, out_features, eps=1e-05, sequence_parallel=False,
                 fuse_wgrad_accumulation=False, tp_group=None, tp_size=1,
                 get_rng_state_tracker=None, init_method=None, bias=True,
                 normalization='LayerNorm', return_bias=False, params_dtype=None,
                 parallel_mode=None, return_layernorm_output=False,
                 return_layernorm_output_gathered=False, parameters_split=None,
                 zero_centered_gamma=False, device='cuda', ub_overlap_ag=False,
                 ub_overlap_rs=False, ub_overlap_rs_dgrad=False, ub_bulk_wgrad=False,
                 ub_bulk_dgrad=False, ub_name=None, delay_wgrad_compute=False,
                 symmetric_ar_type=None, name=None):
        self._record_init(LayerNormLinear.__init__, locals())
        self.parallel_mode = parallel_mode
        self.sequence_parallel = sequence_parallel
        self._init_tp(tp_group, tp_size)


class LayerNormMLP(_TPModule):
    def __init__(self, hidden_size, ffn_hidden_size, eps=1e-05, sequence_parallel=False,
                 return_bias=False, get_rng_state_tracker=None, tp_group=None, tp_size=1,
                 init_method=None, bias=True, normalization='LayerNorm', activation='gelu',
                 activation_params=None, output_layer_init_method=None,
                 fuse_wgrad_accumulation=False, params_dtype=None,
                 return_layernorm_output=False, return_layernorm_output_gathered=False,
                 seq_length=None, micro_batch_size=None, set_parallel_mode=False,
                 zero_centered_gamma=False, device='cuda', ub_overlap_ag=False, name=None,
                 ub_overlap_rs=False, ub_overlap_rs_dgrad=False, ub_bulk_dgrad=False,
                 ub_bulk_wgrad=False, delay_wgrad_compute=False, symmetric_ar_type=None,
                 checkpoint=False):
        self._record_init(LayerNormMLP.__init__, locals())
        self.sequence_parallel = sequence_parallel
        self.set_parallel_mode = set_parallel_mode
        self._init_tp(tp_group, tp_size)


class GroupedLinear(_TPModule):
    """TE's grouped GEMM for experts, with math (pure torch, any device): ``forward(inp,
    m_splits)`` multiplies the i-th block of ``m_splits[i]`` rows by ``weight{i}``
    ([out, in], read with ``getattr`` on every call, as TE does) transposed, plus
    ``bias{i}``. Weights are initialised per GEMM by ``init_method`` (TE's default
    normal(0, 0.023) when None) on ``rng_tracker_name``'s stream of the tracker, except
    on the meta device (TE defers initialisation there)."""

    def __init__(self, num_gemms, in_features, out_features, sequence_parallel=False,
                 fuse_wgrad_accumulation=False, tp_group=None, tp_size=1,
                 get_rng_state_tracker=None, rng_tracker_name=None, init_method=None,
                 bias=True, return_bias=False, params_dtype=None, parallel_mode=None,
                 device='cuda', ub_overlap_rs=False, ub_overlap_ag=False, ub_name=None,
                 delay_wgrad_compute=False, save_original_input=False,
                 single_grouped_weight=False, single_grouped_bias=False, name=None,
                 use_grouped_tensor=None):
        self._record_init(GroupedLinear.__init__, locals())
        dtype = torch.get_default_dtype() if params_dtype is None else params_dtype
        self.num_gemms, self.in_features, self.out_features = num_gemms, in_features, out_features
        self.use_bias, self.return_bias = bias, return_bias
        self._init_tp(tp_group, tp_size)
        if self.tp_size > 1 and bias:
            raise ValueError("GroupedLinear doesn't support bias when TP > 1.")
        if parallel_mode not in ("column", "row", None):
            raise ValueError(f"parallel_mode {parallel_mode!r} not supported.")
        self.parallel_mode = parallel_mode
        if parallel_mode == "column":
            self.out_features //= self.tp_size
        elif parallel_mode == "row":
            self.in_features //= self.tp_size
        self.sequence_parallel = self.tp_size > 1 and sequence_parallel
        self.primary_weights_in_fp8 = False
        for i in range(num_gemms):
            self.register_parameter(f"weight{i}", torch.nn.Parameter(torch.empty(
                self.out_features, self.in_features, device=device, dtype=dtype)))
            if bias:
                self.register_parameter(f"bias{i}", torch.nn.Parameter(torch.zeros(
                    self.out_features, device=device, dtype=dtype)))
            else:
                setattr(self, f"bias{i}", torch.Tensor().to(dtype=dtype, device=device))
        if torch.device(device).type != "meta":
            init = init_method or (lambda w: torch.nn.init.normal_(w, 0.0, 0.023))
            for i in range(num_gemms):
                fork = (get_rng_state_tracker().fork(rng_tracker_name) if rng_tracker_name
                        else get_rng_state_tracker().fork()) if get_rng_state_tracker else None
                with torch.no_grad():
                    if fork is None:
                        init(getattr(self, f"weight{i}"))
                    else:
                        with fork:
                            init(getattr(self, f"weight{i}"))

    def forward(self, inp, m_splits, is_first_microbatch=None, out=None, dgrad_out=None):
        splits = [int(m) for m in (m_splits.tolist() if isinstance(m_splits, torch.Tensor)
                                   else m_splits)]
        if len(splits) != self.num_gemms:
            raise ValueError(f"Shape of splits tensor (({len(splits)},)) does not match "
                             f"number of GEMMs ({self.num_gemms}).")
        self.calls.append(("forward", {"m_splits": list(splits)}))
        self._prepare_fp8_forward(inp, splits)
        outs = []
        for i, x in enumerate(inp.split(splits, 0)):
            y = x @ getattr(self, f"weight{i}").t()
            if self.use_bias and not self.return_bias:
                y = y + getattr(self, f"bias{i}")
            outs.append(y)
        y = torch.cat(outs, 0) if outs else inp.new_zeros(0, self.out_features)
        if self.return_bias:
            return y, [getattr(self, f"bias{i}") for i in range(self.num_gemms)]
        return y

    def _prepare_fp8_forward(self, inp, splits):
        """TE's prepare_forward under fp8 autocast: in the recompute phase of TE's
        checkpoint, replay (record nothing); else register the amax in the global buffer
        on the first forward (delayed scaling) and record this forward's amaxes
        (``amax_records`` counts them). Then the GEMM's alignment: on Hopper every
        split must be a multiple of the recipe's alignment."""
        if not FP8GlobalStateManager.is_fp8_enabled():
            return
        if not _distributed.in_fp8_activation_recompute_phase():
            recipe = FP8GlobalStateManager.get_fp8_recipe()
            meta = self.__dict__.setdefault("fp8_meta", {})
            meta["recipe"], meta["fp8_group"] = recipe, FP8GlobalStateManager.get_fp8_group()
            meta["build_index"] = self.build_index
            if "scaling_fwd" not in meta:
                meta["scaling_fwd"] = _Scaling(torch.zeros(1, 2 * self.num_gemms))
            FP8GlobalStateManager.add_fp8_tensors_to_global_buffer(meta)
            amax = meta["scaling_fwd"].amax_history[0]
            for i, x in enumerate(inp.detach().split(splits, 0)):
                if x.numel():
                    amax[2 * i] = torch.maximum(amax[2 * i], x.abs().max().float().to("cpu"))
            self.amax_records = getattr(self, "amax_records", 0) + 1
        align = get_align_size_for_quantization(FP8GlobalStateManager.get_fp8_recipe())
        if DEVICE_CAPABILITY == (9, 0) and any(m % align for m in splits):
            raise RuntimeError(
                "fake TE (cuBLASLt on Hopper): fp8 grouped GEMM wgrad needs every m_split to "
                f"be a multiple of {align}, got m_splits={splits} (Caller must pad)")

    # TE's TransformerEngineBaseModule keeps fp8 metadata as extra state (a uint8 tensor)
    def get_extra_state(self):
        return torch.empty(0, dtype=torch.uint8)

    def set_extra_state(self, state):
        self.calls.append(("set_extra_state", {"state": state}))


# Keyword-only options TE's LayerNorm/RMSNorm forward through **kwargs to their fused op
# (ops/basic/layer_norm.py and ops/basic/rmsnorm.py); the contract test checks this list too.
NORM_OP_KWARGS = ("eps", "device", "dtype", "zero_centered_gamma", "sm_margin")


class _Norm(_FakeModule):
    def _init_norm(self, init, loc):
        self._record_init(init, loc)
        extra = set(self.init_args["kwargs"]) - set(NORM_OP_KWARGS)
        if extra:
            raise TypeError(f"unexpected keyword arguments {sorted(extra)}")
        self.sequence_parallel = self.init_args["sequence_parallel"]


class LayerNorm(_Norm):
    def __init__(self, normalized_shape=None, eps=1e-05, sequence_parallel=None,
                 params_dtype=None, zero_centered_gamma=False, hidden_size=None, **kwargs):
        self._init_norm(LayerNorm.__init__, locals())


class RMSNorm(_Norm):
    def __init__(self, normalized_shape=None, eps=1e-05, sequence_parallel=None,
                 params_dtype=None, zero_centered_gamma=False, hidden_size=None, **kwargs):
        self._init_norm(RMSNorm.__init__, locals())


class DotProductAttention(_TPModule):
    def __init__(self, num_attention_heads, kv_channels, num_gqa_groups=None,
                 attention_dropout=0.0, qkv_format='sbhd', attn_mask_type='causal',
                 window_size=None, bottom_right_diagonal=None, softcap=0.0,
                 sequence_parallel=False, tp_size=1, get_rng_state_tracker=None,
                 tp_group=None, layer_number=None, attention_type='self', cp_group=None,
                 cp_global_ranks=None, cp_stream=None, cp_comm_type='p2p',
                 softmax_scale=None, softmax_type='vanilla', return_max_logit=False,
                 name=None):
        self._record_init(DotProductAttention.__init__, locals())
        self._init_tp(tp_group, tp_size)
        # As TE: with sequence parallelism (or no tracker) attention dropout does not fork
        # the tracker; otherwise TE registers the tracker's states for CUDA graphs.
        self.rng_states_tracker = None
        if sequence_parallel or get_rng_state_tracker is None:
            attention_dropout_ctx = contextlib.nullcontext
        else:
            self.rng_states_tracker = get_rng_state_tracker()
            _distributed.set_all_rng_states(self.rng_states_tracker.get_states())
            attention_dropout_ctx = (
                self.rng_states_tracker.fork if attention_dropout > 0 else contextlib.nullcontext)
        self.attention_dropout_ctx = attention_dropout_ctx
        self.cp_group, self.cp_global_ranks = cp_group, cp_global_ranks
        self.cp_stream, self.cp_comm_type = cp_stream, cp_comm_type

    def set_context_parallel_group(self, cp_group, cp_global_ranks, cp_stream,
                                   cp_comm_type='p2p',
                                   load_balancing_strategy=CPLoadBalancingStrategy.DUAL_CHUNK_SWAP):
        self.calls.append(("set_context_parallel_group", _bound(
            DotProductAttention.set_context_parallel_group,
            (self, cp_group, cp_global_ranks, cp_stream, cp_comm_type, load_balancing_strategy),
            {})))
        self.cp_group, self.cp_global_ranks = cp_group, cp_global_ranks
        self.cp_stream, self.cp_comm_type = cp_stream, cp_comm_type

    def forward(self, query_layer=None, key_layer=None, value_layer=None, attention_mask=None,
                qkv_format=None, cu_seqlens_q=None, cu_seqlens_kv=None,
                cu_seqlens_q_padded=None, cu_seqlens_kv_padded=None, max_seqlen_q=None,
                max_seqlen_kv=None, attn_mask_type=None, window_size=None,
                bottom_right_diagonal=None, softcap=None, checkpoint_core_attention=False,
                core_attention_bias_type='no_bias', core_attention_bias=None,
                alibi_slopes=None, fast_zero_fill=True, inference_params=None,
                pad_between_seqs=None, fp8_output=False, bf16_backward=False, num_splits=1,
                score_mod=None, score_mod_bprop=None, score_mod_tensors=None,
                score_mod_bprop_tensors=None, qkv_layer=None, kv_layer=None,
                qkv_interleave_dim=-3, thd_attention_policies=None,
                thd_attention_policy_dispatch='auto'):
        args = {k: v for k, v in locals().items() if k not in ("self", "__class__")}
        if self.rng_states_tracker is not None and _GRAPH_CAPTURING[0]:
            assert isinstance(self.rng_states_tracker, CudaRNGStatesTracker), \
                "Unsupported RNG states tracker."
        self.calls.append(("forward", args))
        q = query_layer
        return q.new_zeros(*q.shape[:-2], q.shape[-2] * q.shape[-1])


class TransformerLayer(_FakeModule):
    """Children mirror TE's structure closely enough for wiring: a column-parallel QKV,
    the core attention, a row-parallel projection and the MLP."""

    def __init__(self, hidden_size, ffn_hidden_size, num_attention_heads, num_gqa_groups=None,
                 layernorm_epsilon=1e-05, hidden_dropout=0.1, attention_dropout=0.1,
                 init_method=None, output_layer_init_method=None, layer_number=None,
                 kv_channels=None, self_attn_mask_type='causal', window_size=None,
                 bottom_right_diagonal=None, softcap=0.0, enc_dec_attn_mask_type='no_mask',
                 enc_dec_bottom_right_diagonal=None, enc_dec_window_size=None, tp_group=None,
                 tp_size=1, params_dtype=None, get_rng_state_tracker=None,
                 fuse_wgrad_accumulation=False, seq_length=None, micro_batch_size=None,
                 sequence_parallel=False, apply_residual_connection_post_layernorm=False,
                 output_layernorm=False, parallel_attention_mlp=False, layer_type='encoder',
                 drop_path_rate=0.0, set_parallel_mode=False, fuse_qkv_params=False,
                 rotary_pos_interleaved=False, zero_centered_gamma=False,
                 qkv_weight_interleaved=True, ub_tp_comm_overlap=False, ub_overlap_ag=True,
                 ub_overlap_rs=True, ub_overlap_rs_dgrad=False, ub_bulk_dgrad=True,
                 ub_bulk_wgrad=True, bias=True, activation='gelu', activation_params=None,
                 normalization='LayerNorm', device='cuda', attn_input_format='sbhd', name=None,
                 qk_norm_type=None, qk_norm_eps=1e-06, qk_norm_before_rope=False,
                 softmax_type='vanilla'):
        self._record_init(TransformerLayer.__init__, locals())
        # As TE: the container keeps tp_size (not tp_group) and turns SP off at tp_size 1.
        self.tp_size = tp_size if tp_group is None else _group_size(tp_group)
        self.sequence_parallel = self.tp_size > 1 and sequence_parallel
        common = dict(tp_group=tp_group, tp_size=tp_size, sequence_parallel=sequence_parallel,
                      get_rng_state_tracker=get_rng_state_tracker, device=device)
        kv = kv_channels or hidden_size // num_attention_heads
        self.layernorm_qkv = LayerNormLinear(hidden_size, 3 * hidden_size,
                                             parallel_mode="column", **common)
        self.core_attention = DotProductAttention(
            num_attention_heads, kv, num_gqa_groups=num_gqa_groups, qkv_format=attn_input_format,
            tp_size=tp_size, tp_group=tp_group, sequence_parallel=sequence_parallel,
            get_rng_state_tracker=get_rng_state_tracker)
        self.proj = Linear(hidden_size, hidden_size, parallel_mode="row", **common)
        self.layernorm_mlp = LayerNormMLP(hidden_size, ffn_hidden_size,
                                          set_parallel_mode=set_parallel_mode, **common)

    def set_tensor_parallel_group(self, tp_group):
        self.calls.append(("set_tensor_parallel_group", {"tp_group": tp_group}))
        for index, child in enumerate(self.modules()):
            if index and hasattr(child, "set_tensor_parallel_group"):
                child.set_tensor_parallel_group(tp_group)

    def set_context_parallel_group(self, cp_group, cp_global_ranks, cp_stream,
                                   cp_comm_type='p2p',
                                   load_balancing_strategy=CPLoadBalancingStrategy.DUAL_CHUNK_SWAP):
        self.calls.append(("set_context_parallel_group", _bound(
            TransformerLayer.set_context_parallel_group,
            (self, cp_group, cp_global_ranks, cp_stream, cp_comm_type, load_balancing_strategy),
            {})))
        for index, child in enumerate(self.modules()):
            if index and hasattr(child, "set_context_parallel_group"):
                child.set_context_parallel_group(cp_group, cp_global_ranks, cp_stream,
                                                 cp_comm_type)


class autocast:
    def __init__(self, enabled=True, calibrating=False, recipe=None,
                 amax_reduction_group=None, _graph=False):
        self.args = _bound(autocast.__init__, (self, enabled, calibrating, recipe,
                                               amax_reduction_group, _graph), {})

    def __enter__(self):
        RECORD.append(("autocast", self.args))
        a = self.args
        self._state = FP8GlobalStateManager.get_autocast_state()
        FP8GlobalStateManager.autocast_enter(a["enabled"], a["calibrating"], a["recipe"],
                                             a["amax_reduction_group"], a["_graph"])
        return self

    def __exit__(self, *exc):
        FP8GlobalStateManager.set_autocast_state(self._state)
        FP8GlobalStateManager.autocast_exit(self.args["enabled"], self.args["_graph"])
        return None


def fp8_autocast(enabled=True, calibrating=False, fp8_recipe=None, fp8_group=None,
                 _graph=False):
    return _Recorded("fp8_autocast", _bound(fp8_autocast, (enabled, calibrating, fp8_recipe,
                                                          fp8_group, _graph), {}))


class _Recorded:
    """A context manager recording its call when entered."""

    def __init__(self, name, args):
        self.name, self.args = name, args

    def __enter__(self):
        RECORD.append((self.name, self.args))

    def __exit__(self, *exc):
        return None


@contextlib.contextmanager
def quantized_model_init(enabled=True, recipe=None, preserve_high_precision_init_val=False):
    """As TE: the recipe is stored as given (modules built inside ask it its type)."""
    RECORD.append(("quantized_model_init", _bound(
        quantized_model_init.__wrapped__, (enabled, recipe, preserve_high_precision_init_val),
        {})))
    qstate = FP8GlobalStateManager.quantization_state
    saved = qstate.fp8_parameters, qstate.fp8_recipe
    qstate.fp8_parameters = enabled
    qstate.fp8_recipe = DelayedScaling() if recipe is None else recipe
    try:
        yield
    finally:
        qstate.fp8_parameters, qstate.fp8_recipe = saved


def fp8_model_init(enabled=True, recipe=None, preserve_high_precision_init_val=False):
    return _Recorded("fp8_model_init", _bound(
        fp8_model_init, (enabled, recipe, preserve_high_precision_init_val), {}))


def checkpoint(function, *args, **kwargs):
    """Records TE's keywords, then calls ``function`` with the rest (no recompute)."""
    te_kwargs = {k: kwargs.pop(k) for k in ("distribute_saved_activations",
                                            "get_rng_state_tracker", "tp_group",
                                            "use_reentrant") if k in kwargs}
    RECORD.append(("checkpoint", dict(te_kwargs, function=function)))
    # TE's first forward: the recompute region (its modules keep their fp8 scales for the
    # recompute, which replays them; the fake does not recompute)
    with _distributed.activation_recompute_forward(activation_recompute=True,
                                                   recompute_phase=False):
        return function(*args, **kwargs)


_GRAPH_CAPTURING = [False]


def make_graphed_callables(modules, sample_args, num_warmup_iters=3, allow_unused_input=False,
                           sample_kwargs=None, fp8_enabled=None, fp8_calibrating=None,
                           fp8_recipe=None, fp8_group=None, fp8_weight_caching=None,
                           enabled=None, calibrating=None, recipe=None,
                           amax_reduction_group=None, cache_quantized_params=None, _order=None,
                           _num_layers_per_chunk=None, pool=None, retain_graph_in_backward=False,
                           _reuse_graph_input_output_buffers=False,
                           clone_param_grads_on_return=True, pre_warmup_hook=None,
                           post_warmup_hook=None, capture_time_hooks=None):
    """TE's graph capture, as far as the RNG goes: every registered RNG state goes to
    ``CUDAGraph.register_generator_state`` (a ``torch.Generator`` only), then the callables
    run once under capture (DotProductAttention asserts TE's tracker there)."""
    for state in _distributed.get_all_rng_states().values():
        if not isinstance(state, torch.Generator):
            raise TypeError("register_generator_state(): argument 'generator' must be "
                            f"torch.Generator, not {type(state).__name__}")
    single = not isinstance(modules, tuple)
    mods = (modules,) if single else modules
    args = (sample_args,) if single else sample_args
    _GRAPH_CAPTURING[0] = True
    try:
        for m, a in zip(mods, args):
            m(*a)
    finally:
        _GRAPH_CAPTURING[0] = False
    return modules


class _Scaling:
    """A module's ``fp8_meta["scaling_fwd"]`` (its amax history, as TE's)."""

    def __init__(self, amax_history):
        self.amax_history = amax_history


def _support(kind, return_reason):
    ok, reason = SUPPORT[kind]
    return (ok, reason) if return_reason else ok


def is_fp8_available(return_reason=False):
    return _support("fp8", return_reason)


def is_mxfp8_available(return_reason=False):
    return _support("mxfp8", return_reason)


def is_fp8_block_scaling_available(return_reason=False):
    return _support("fp8_block_scaling", return_reason)


def is_nvfp4_available(return_reason=False):
    return _support("nvfp4", return_reason)
