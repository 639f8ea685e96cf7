"""Hugging Face checkpoints in and out: config.json <-> LlamaConfig, safetensors <-> shards.

Import reads each tensor's headers first (names, shapes: every mismatch is a ValueError
before a weight is read), then each rank reads only the rows or columns it keeps with
``safetensors``' slices, one tensor at a time, opening the file for each read so that no
more than one tensor's pages are ever mapped: peak memory is the rank's own shard plus
one tensor. Fused segments (q/k/v, gate/up) are filled segment by segment from their
Hugging Face tensors. Export gathers one parameter at a time over TP
(tpkit.checkpoint.gather_param, FSDP2 shards first) and rank 0 streams it into the
safetensors file it belongs to, so it too holds one tensor beyond its shard. An export
is written into a staging directory next to ``path`` (the files of an earlier export that
are not weights or config.json, e.g. tokenizer files, copied in first), fsynced, and
swapped into place (``_dcp_verify.replace_dir``): a process killed at any moment leaves
the previous export intact. Every file an index names must lie inside its directory (as
written: the hub cache's files are links to blobs elsewhere).
The parameter <-> tensor-name table is the model's (``Llama.hf_names``); the partition
dim of each parameter comes from its tags (tpkit.layout.param_tags.tp_spec), so TE's modules
are read and written the same way.
"""
from __future__ import annotations

import dataclasses
import glob
import json
import os
import shutil
import struct

import torch
import torch.distributed as dist

from ..checkpoint._dcp_verify import agree, inside, link_problem, replace_dir, staging_path
from ..checkpoint import gather_param
from ..comm.collectives import any_rank
from ..layout.param_tags import tp_spec
from .llama import ARCHITECTURES, ROPE_TYPES, LlamaConfig

__all__ = ["config_from_hf", "config_to_hf", "read_config", "load_llama", "save_llama",
           "CheckpointIndex"]

_HF_CLASSES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
               "mistral": "MistralForCausalLM"}
_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16",
           torch.float64: "F64"}
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)   # buffers some old checkpoints carry
_TRAINING_FIELDS = ("backend", "recompute", "hidden_dropout", "attention_dropout",
                    "initializer_range", "vocab_multiple", "cpu_offload_layers")


# --- config.json ---------------------------------------------------------------------------
def config_from_hf(d: dict) -> LlamaConfig:
    """LlamaConfig from a config.json dict, or ValueError naming the key tpkit cannot honour."""
    mt = d.get("model_type")
    arch = d.get("architectures") or [_HF_CLASSES.get(mt)]
    if mt not in _HF_CLASSES or list(arch) != [_HF_CLASSES[mt]]:
        raise ValueError(f"config.json: model_type={mt!r} with architectures={arch} is not "
                         f"supported; tpkit.models.llama reads {sorted(_HF_CLASSES.items())}")

    def get(key, default=KeyError):
        if key in d and d[key] is not None:
            return d[key]
        if default is KeyError:
            raise ValueError(f"config.json lacks {key!r} (model_type={mt!r})")
        return default

    def refuse(key, value, why):
        raise ValueError(f"config.json: {key}={value!r} is not supported ({why})")

    if get("hidden_act", "silu") != "silu":
        refuse("hidden_act", d["hidden_act"], "Llama-family MLPs are SwiGLU: 'silu'")
    if d.get("quantization_config"):
        refuse("quantization_config", d["quantization_config"], "load unquantized weights")
    hidden, heads = get("hidden_size"), get("num_attention_heads")
    head_dim = get("head_dim", None)
    if head_dim is not None and head_dim * heads != hidden:
        refuse("head_dim", head_dim, f"tpkit's attention has head_dim = hidden_size / "
                                     f"num_attention_heads = {hidden}/{heads}")
    rope = dict(d.get("rope_scaling") or {})
    rope.update(d.get("rope_parameters") or {})
    if rope and all(isinstance(v, dict) for v in rope.values()):
        refuse("rope_parameters", rope, "one RoPE for every layer")
    theta = rope.pop("rope_theta", None) or get("rope_theta", 10000.0)
    kind = rope.pop("rope_type", rope.pop("type", "default"))
    if kind not in ROPE_TYPES:
        refuse("rope_type", kind, f"supported: {ROPE_TYPES}")
    partial = rope.pop("partial_rotary_factor", None) or get("partial_rotary_factor", 1.0)
    if partial != 1.0:
        refuse("partial_rotary_factor", partial, "rotary embeddings cover the whole head")
    if kind == "llama3":
        rope.setdefault("original_max_position_embeddings", get("max_position_embeddings"))
    scaling = None if kind == "default" else {"rope_type": kind, **rope}
    if mt == "llama":
        attn_bias, mlp_bias = bool(get("attention_bias", False)), bool(get("mlp_bias", False))
        if attn_bias != mlp_bias:
            refuse("attention_bias", attn_bias, f"with mlp_bias={mlp_bias}: tpkit's blocks "
                                               "bias all linear layers or none")
        bias, qkv_bias = attn_bias, None
    else:
        bias, qkv_bias = False, mt == "qwen2"
    window = get("sliding_window", None) if get("use_sliding_window", mt == "mistral") else None
    layer_types = set(get("layer_types", None) or ["full_attention"])
    if window is not None or layer_types != {"full_attention"}:
        refuse("sliding_window", window if window is not None else sorted(layer_types),
               "tpkit's attention is full causal attention")
    return LlamaConfig(
        vocab_size=get("vocab_size"), hidden_size=hidden,
        ffn_hidden_size=get("intermediate_size"), num_layers=get("num_hidden_layers"),
        num_heads=heads, num_gqa_groups=get("num_key_value_heads", heads),
        rms_norm_eps=float(get("rms_norm_eps", 1e-6)), rope_theta=float(theta),
        rope_scaling=scaling, qkv_bias=qkv_bias, bias=bias,
        tie_word_embeddings=bool(get("tie_word_embeddings", False)),
        max_position_embeddings=get("max_position_embeddings", 4096), architecture=mt,
        initializer_range=float(get("initializer_range", 0.02)),
        attention_dropout=float(get("attention_dropout", 0.0))).validate()


def config_to_hf(cfg: LlamaConfig, base: dict | None = None, dtype=None) -> dict:
    """config.json for ``cfg``: ``base`` (the one read by from_hf, other keys kept) with the
    architecture's keys rewritten. RoPE is written both ways transformers reads it
    (``rope_theta``/``rope_scaling`` and 5.x's ``rope_parameters``)."""
    mt = cfg.architecture
    out = dict(base or {})
    for key in ("rope_parameters", "rope_scaling", "dtype", "torch_dtype"):
        out.pop(key, None)
    rope = dict(cfg.rope_scaling or {})
    out.update({
        "architectures": [_HF_CLASSES[mt]], "model_type": mt, "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.ffn_hidden_size,
        "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.head_dim, "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta,
        "rope_scaling": rope or None,
        "rope_parameters": {"rope_type": "default", **rope, "rope_theta": cfg.rope_theta},
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "max_position_embeddings": cfg.max_position_embeddings,
        "initializer_range": cfg.initializer_range,
        "attention_dropout": cfg.attention_dropout})
    if mt == "llama":
        out.update(attention_bias=cfg.bias, mlp_bias=cfg.bias)
    else:
        out.update(sliding_window=None, use_sliding_window=False)
        out.pop("layer_types", None)
    if dtype is not None:
        out["torch_dtype"] = str(dtype).removeprefix("torch.")
    return out


def read_config(path: str) -> tuple[LlamaConfig, dict]:
    """(LlamaConfig, the raw dict) of ``path``/config.json; ValueError if absent or unusable."""
    file = os.path.join(path, "config.json")
    if not os.path.isfile(file):
        raise ValueError(f"{path!r} has no config.json; pass a Hugging Face model directory "
                         "(what save_pretrained or tpkit.models.hf.save_hf writes)")
    with open(file) as f:
        raw = json.load(f)
    return config_from_hf(raw), raw


# --- reading safetensors -------------------------------------------------------------------
class CheckpointIndex:
    """Every tensor of a checkpoint directory: name -> (file, shape), from the headers."""

    def __init__(self, path: str):
        from safetensors import safe_open
        index = os.path.join(path, "model.safetensors.index.json")
        if os.path.isfile(index):
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
            for name, v in weight_map.items():
                if inside(path, v, links=False) is None:
                    raise ValueError(f"{index}: weight_map[{name!r}] = {v!r} is outside "
                                     f"{path} (a crafted index); not read")
            files = sorted({os.path.join(path, v) for v in weight_map.values()})
        else:
            weight_map, files = None, sorted(glob.glob(os.path.join(path, "*.safetensors")))
        if not files:
            raise ValueError(f"{path!r} holds no *.safetensors files; tpkit reads safetensors "
                             "only (re-save with save_pretrained(safe_serialization=True))")
        self.tensors: dict[str, tuple[str, list[int]]] = {}
        for file in files:
            if not os.path.isfile(file):
                raise ValueError(f"{index} names {os.path.basename(file)!r}, which is missing")
            with safe_open(file, framework="pt") as f:
                for name in f.keys():
                    if name in self.tensors:
                        raise ValueError(f"tensor {name!r} is in both {self.tensors[name][0]} "
                                         f"and {file}")
                    self.tensors[name] = (file, list(f.get_slice(name).get_shape()))
        if weight_map is not None:
            lost = sorted(n for n in weight_map if n not in self.tensors)
            if lost:
                raise ValueError(f"missing tensor {lost[0]!r} ({len(lost)} in all): the index "
                                 f"names it but its file {weight_map[lost[0]]!r} does not hold it")

    def check(self, expected: dict[str, list[int]], path: str) -> None:
        """ValueError for a missing, unexpected or wrongly shaped tensor."""
        missing = [n for n in expected if n not in self.tensors]
        if missing:
            raise ValueError(f"missing tensor {missing[0]!r} in {path!r} ({len(missing)} "
                             f"missing: {missing[:4]}); the checkpoint does not match its "
                             "config.json")
        extra = sorted(n for n in self.tensors if n not in expected and
                       not n.endswith(_IGNORED_SUFFIXES) and n != "lm_head.weight")
        if extra:
            raise ValueError(f"unexpected tensor {extra[0]!r} in {path!r} ({len(extra)} in "
                             f"all): an option of config.json tpkit does not model?")
        for name, shape in expected.items():
            if self.tensors[name][1] != shape:
                raise ValueError(f"tensor {name!r} has shape {self.tensors[name][1]} in "
                                 f"{self.tensors[name][0]}, but config.json implies {shape}")

    def read(self, name: str, dim: int | None = None, start: int = 0,
             stop: int | None = None) -> torch.Tensor:
        """Rows ``start:stop`` of tensor ``name`` along ``dim`` (None: all of it). The file is
        opened for this read only, so its mapped pages go when it returns."""
        from safetensors import safe_open
        file = self.tensors[name][0]
        with safe_open(file, framework="pt") as f:
            if dim is None:
                return f.get_tensor(name)
            return f.get_slice(name)[(slice(None),) * dim + (slice(start, stop),)]


def expected_shapes(cfg: LlamaConfig) -> dict[str, list[int]]:
    """Hugging Face tensor name -> shape, from the config alone (the reference every
    checkpoint is checked against before a weight is read)."""
    h, d, ffn = cfg.hidden_size, cfg.head_dim, cfg.ffn_hidden_size
    q, kv = cfg.num_heads * d, cfg.kv_heads * d
    out = {"model.embed_tokens.weight": [cfg.vocab_size, h], "model.norm.weight": [h]}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = [cfg.vocab_size, h]
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        layer = {"input_layernorm.weight": [h], "post_attention_layernorm.weight": [h],
                 "self_attn.q_proj.weight": [q, h], "self_attn.k_proj.weight": [kv, h],
                 "self_attn.v_proj.weight": [kv, h], "self_attn.o_proj.weight": [h, q],
                 "mlp.gate_proj.weight": [ffn, h], "mlp.up_proj.weight": [ffn, h],
                 "mlp.down_proj.weight": [h, ffn]}
        if cfg.has_qkv_bias:
            layer.update({"self_attn.q_proj.bias": [q], "self_attn.k_proj.bias": [kv],
                          "self_attn.v_proj.bias": [kv]})
        if cfg.bias:
            layer.update({"self_attn.o_proj.bias": [h], "mlp.gate_proj.bias": [ffn],
                          "mlp.up_proj.bias": [ffn], "mlp.down_proj.bias": [h]})
        out.update({p + k: v for k, v in layer.items()})
    return out


def _layout(param, names, shapes) -> tuple[int | None, list[int]]:
    """(partition dim or None, segment lengths along it) of one parameter."""
    spec = tp_spec(param)
    if spec is None:   # replicated; several names are segments along dim 0 ([k; v])
        return None, [shapes[n][0] for n in names]
    dim, sizes = spec
    lengths = [shapes[n][dim] for n in names]
    assert sizes is None or list(sizes) == lengths, (names, sizes, lengths)
    return dim, lengths


def stage_params(names, plan, pp_rank: int, blocks: str = "layers",
                 stem=("embedding",), head=("final_norm", "output")) -> set[str]:
    """The parameter names of ``names`` that pipeline rank ``pp_rank`` holds under ``plan``
    (tpkit.distributed.pipeline.PipelinePlan: its stages' blocks under their global indices,
    the stem on the first stage, the head on the last)."""
    stages = plan.stages_of(pp_rank)
    mine = {str(i) for st in stages for i in plan.blocks_of(st)}
    parts = (stem if 0 in stages else ()) + (head if plan.num_stages - 1 in stages else ())
    out = set()
    for n in names:
        first, rest = n.split(".", 1)[0], n.split(".", 2)
        if (first == blocks and rest[1] in mine) or first in parts:
            out.add(n)
    return out


def load_llama(cls, path: str, state, *, dtype: torch.dtype, overrides: dict, pipeline=None):
    from ..layout.topology import resolve_state
    bad = sorted(set(overrides) - set(_TRAINING_FIELDS))
    if bad:
        raise ValueError(f"from_hf({bad[0]}=...) is not a training option; the model's "
                         f"sizes come from config.json. Use one of {_TRAINING_FIELDS}")
    cfg, raw = read_config(path)
    state = resolve_state(state)
    cfg = dataclasses.replace(cfg, **overrides).validate().check_tp(state.tp_size)
    if pipeline is not None and pipeline.pp != state.pp_size:
        raise ValueError(f"from_hf(pipeline=a plan of pp={pipeline.pp}) on a layout of pp="
                         f"{state.pp_size}; plan the pipeline at this layout")
    if pipeline is not None and pipeline.pp > 1 and cfg.tie_word_embeddings:
        raise ValueError(f"{path}/config.json has tie_word_embeddings=true: the embedding "
                         f"(first stage) and lm_head (last stage) share one weight, which "
                         f"pipeline stages (pp={pipeline.pp}) cannot split; use pp=1")
    expected = expected_shapes(cfg)
    index = CheckpointIndex(path)
    index.check(expected, path)
    from .llama import _no_init
    model = cls(cfg, state, dtype=dtype, init_method=_no_init)
    model.hf_config = raw
    n, rank = state.tp_size, state.tp_rank
    params = dict(model.named_parameters())
    table = model.hf_names()
    keep = set(table) if pipeline is None else stage_params(table, pipeline, state.pp_rank)
    with torch.no_grad():
        for pname, names in table.items():
            p = params[pname]
            if pname not in keep:   # another stage's: never read; NaN until
                p.fill_(float("nan"))   # build_pipeline drops it (a misuse shows at once)
                continue
            dim, lengths = _layout(p, names, expected)
            at = 0
            for name, length in zip(names, lengths):
                if dim is None:   # replicated: the whole tensor of every segment
                    p.narrow(0, at, length).copy_(index.read(name))
                    at += length
                    continue
                # a padded vocabulary's shard: its rows past the checkpoint's are zero
                k = p.shape[dim] if len(names) == 1 else length // n
                start, stop = rank * k, min((rank + 1) * k, length)
                if stop > start:
                    p.narrow(dim, at, stop - start).copy_(index.read(name, dim, start, stop))
                if stop - start < k:
                    p.narrow(dim, at + max(stop - start, 0), k - max(stop - start, 0)).zero_()
                at += k
            assert at == p.shape[0 if dim is None else dim], (pname, at, p.shape)
    return model


# --- writing safetensors -------------------------------------------------------------------
def _header(entries: list[tuple[str, str, list[int], int]]) -> bytes:
    """The safetensors header (8-byte little-endian length, then JSON padded to 8 bytes)
    for (name, dtype code, shape, byte size) entries stored back to back."""
    meta, at = {"__metadata__": {"format": "pt"}}, 0
    for name, code, shape, size in entries:
        meta[name] = {"dtype": code, "shape": shape, "data_offsets": [at, at + size]}
        at += size
    text = json.dumps(meta, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def _full_tensor(p, dim, lengths, state) -> torch.Tensor:
    """The unsharded tensor of parameter ``p`` on every rank (collective over TP, and over
    dp x cp first for an FSDP2 shard)."""
    t = p
    if hasattr(p, "to_local"):   # an FSDP2 DTensor: this rank's TP shard first
        from ..checkpoint._dcp_views import _gather_fsdp
        t = _gather_fsdp(p, state.dp_cp_group)
    t = t.detach()
    if dim is None:
        return t
    return gather_param(t, dim, lengths if len(lengths) > 1 else None, state.tp_group)


def _whole_model_names(model) -> tuple[dict, dict]:
    """(every parameter of the whole model -> its Hugging Face names, in one process's
    order; parameter -> the pipeline rank holding it). At pp > 1 each rank holds its
    stages' parameters only: their tables are gathered over the pipeline group (names
    only, no tensors)."""
    state, mine = model.state, model.hf_names()
    if state.pp_size == 1:
        return mine, dict.fromkeys(mine, 0)
    every = [None] * state.pp_size
    dist.all_gather_object(every, list(mine.items()), group=state.pp_group)
    owner, table, at = {}, {}, {}
    for r, items in enumerate(every):
        for k, (pname, hfs) in enumerate(items):
            owner[pname], table[pname], at[pname] = r, tuple(hfs), k
    section = {"embedding": 0, "layers": 1, "final_norm": 2, "output": 3}

    def order(pname):
        parts = pname.split(".")
        layer = int(parts[1]) if parts[0] == "layers" else 0
        return section.get(parts[0], 4), layer, at[pname]
    return {n: table[n] for n in sorted(table, key=order)}, owner


def _whole_layout(hfs, shapes) -> tuple[int | None, list[int]]:
    """_layout of another stage's parameter, from its names alone: q/k/v and gate/up are
    segments of dim 0, as every fused tpkit parameter; one name's dim does not matter."""
    return (0 if len(hfs) > 1 else None), [shapes[n][0] for n in hfs]


def _to_rank0(full, owner: int, hfs, dim, shapes, out_dtype, state):
    """The full tensor on global rank 0: ``full`` itself there when its stage holds it;
    else sent by the rank of rank 0's pipeline group that holds it (pipeline rank
    ``owner``). Every other rank: ``full`` (unused)."""
    if state.pp_size == 1 or owner == 0:
        return full
    group = state.pp_group
    if dist.get_global_rank(group, 0) != 0:   # not rank 0's pipeline group: nothing to do
        return full
    if state.pp_rank == owner:
        dist.send(full.to(out_dtype).contiguous(), 0)
        return full
    if state.rank != 0:
        return full
    d = 0 if dim is None else dim
    shape = list(shapes[hfs[0]])
    shape[d] = sum(shapes[n][d] for n in hfs)
    buf = torch.empty(shape, dtype=out_dtype, device=state.device)
    dist.recv(buf, dist.get_global_rank(group, owner))
    return buf


def save_llama(model, path: str, *, dtype, max_shard_size: int) -> None:
    state = model.state
    if max_shard_size <= 0:
        raise ValueError(f"max_shard_size={max_shard_size} must be a positive byte count")
    path = os.path.abspath(os.fspath(path))
    failed, tmp = False, None
    if state.rank == 0:
        try:
            if link_problem(path):
                raise OSError(link_problem(path))
            os.makedirs(os.path.dirname(path), exist_ok=True)
            tmp = staging_path(path)
            os.mkdir(tmp)
            _keep_extras(path, tmp)
        except OSError as e:
            failed = True
            error = e
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)
    # every rank learns it before any gather starts, on the default group's device (an
    # nccl-only default group rejects a CPU tensor)
    if any_rank(failed, None) if dist.is_initialized() else failed:
        raise ValueError(f"save_hf({path!r}): rank 0 cannot write there "
                         f"({error if state.rank == 0 else 'see rank 0'})")
    shapes = expected_shapes(model.cfg)
    names, owner = _whole_model_names(model)
    params = dict(model.named_parameters())
    out_dtype = dtype or next(iter(params.values())).dtype
    if out_dtype not in _DTYPES:
        raise ValueError(f"dtype={out_dtype} cannot be written; use one of {list(_DTYPES)}")
    item = torch.empty((), dtype=out_dtype).element_size()
    order = [(pname, hf) for pname, hfs in names.items() for hf in hfs]
    sizes = {hf: item * int(torch.Size(shapes[hf]).numel()) for _, hf in order}
    shards, cur, cur_size = [], [], 0    # shards: lists of hf names, in order
    for _, hf in order:
        if cur and cur_size + sizes[hf] > max_shard_size:
            shards.append(cur)
            cur, cur_size = [], 0
        cur.append(hf)
        cur_size += sizes[hf]
    shards.append(cur)
    files = ["model.safetensors"] if len(shards) == 1 else \
        [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    file_of = {hf: files[i] for i, shard in enumerate(shards) for hf in shard}
    writers = {}
    try:
        if state.rank == 0:
            for file, shard in zip(files, shards):
                fh = writers[file] = open(os.path.join(tmp, file), "wb")
                fh.write(_header([(hf, _DTYPES[out_dtype], shapes[hf], sizes[hf])
                                  for hf in shard]))
        for pname, hfs in names.items():
            full = None
            if owner[pname] == state.pp_rank:   # this stage's: gathered over its ranks
                p = params[pname]
                dim, lengths = _layout(p, hfs, shapes)
                full = _full_tensor(p, dim, lengths, state)
                if dim is not None and full.shape[dim] > sum(lengths):   # padded vocabulary
                    full = full.narrow(dim, 0, sum(lengths))
            else:
                dim, lengths = _whole_layout(hfs, shapes)
            full = _to_rank0(full, owner[pname], hfs, dim, shapes, out_dtype, state)
            if state.rank == 0:
                for hf, t in zip(hfs, full.split(lengths, 0 if dim is None else dim)):
                    t = t.to(device="cpu", dtype=out_dtype).contiguous()   # .numpy(): host
                    assert list(t.shape) == shapes[hf], (hf, t.shape)
                    writers[file_of[hf]].write(t.reshape(-1).view(torch.uint8).numpy().data)
            del full
        for fh in writers.values():
            fh.flush()
            os.fsync(fh.fileno())
    except BaseException:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        for fh in writers.values():
            fh.close()
    error = None
    if state.rank == 0:
        try:
            if len(files) > 1:
                _write_json(os.path.join(tmp, "model.safetensors.index.json"),
                            {"metadata": {"total_size": sum(sizes.values())},
                             "weight_map": file_of})
            _write_json(os.path.join(tmp, "config.json"),
                        config_to_hf(model.cfg, model.hf_config, out_dtype), sort_keys=True)
            replace_dir(tmp, path)
        except OSError as e:
            shutil.rmtree(tmp, ignore_errors=True)
            error = ValueError(f"save_hf({path!r}): cannot put the export in place ({e}); "
                               "the previous one (if any) is unchanged")
    agree(error)   # every rank learns rank 0's outcome (and waits for it)


def _write_json(file: str, obj, sort_keys: bool = False) -> None:
    with open(file, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=sort_keys)
        f.flush()
        os.fsync(f.fileno())


def _keep_extras(path: str, tmp: str) -> None:
    """Copy what an earlier export at ``path`` holds besides its weights, their index and
    config.json (tokenizer files, generation_config.json, a README) into ``tmp``; symbolic
    links are copied as links."""
    if not os.path.isdir(path):
        if os.path.lexists(path):
            raise OSError(f"{path} is a file, not a directory")
        return
    for name in os.listdir(path):
        if name == "config.json" or (name.startswith("model") and ".safetensors" in name):
            continue
        src, dst = os.path.join(path, name), os.path.join(tmp, name)
        if os.path.isdir(src) and not os.path.islink(src):
            shutil.copytree(src, dst, symlinks=True)
        else:
            shutil.copy2(src, dst, follow_symlinks=False)


# --- the adapter's entry points (the models never import this module) ---------------------
def from_hf(path: str, state=None, *, dtype: torch.dtype = torch.float32, pipeline=None,
            **overrides):
    """The ``tpkit.models.Llama`` of the Hugging Face checkpoint directory ``path``
    (config.json and ``*.safetensors``, sharded or not) on ``state``'s layout, in ``dtype``.
    Each rank reads only the slices it keeps; no collective. ``overrides`` set LlamaConfig's
    training fields (``backend``, ``recompute``, ``hidden_dropout``, ...).

    ``pipeline``: the ``PipelinePlan`` (tpkit.distributed.pipeline.plan_pipeline) the model
    will be split by at ``state.pp_size > 1``: each rank reads only its stages' tensors
    (Hugging Face's ``model.layers.<i>`` into block ``i`` of the stage holding it: stage
    modules keep the global indices; the embedding on the first stage, the final norm and
    lm_head on the last), the other stages' parameters are NaN until ``build_pipeline``
    drops them. Tied embeddings cannot be split (Llama.pp_stem refuses them)."""
    from .llama import Llama
    return load_llama(Llama, path, state, dtype=dtype, overrides=overrides, pipeline=pipeline)


def save_hf(model, path: str, *, dtype: torch.dtype | None = None,
            max_shard_size: int = 2 * 2**30) -> None:
    """Write ``model`` (a ``tpkit.models.Llama``) to ``path``/config.json and safetensors
    shards (at most ``max_shard_size`` bytes each, with an index when there are several)
    that ``transformers`` loads unchanged. Collective (every rank calls it); rank 0 writes,
    gathering one tensor at a time. ``dtype``: the tensors' (default: the parameters').

    Also a Hugging Face ``transformers`` model parallelized by ``tpkit.parallelize``
    (wrapped by Fabric, DDP or FSDP2 or not): its full state dict
    (``tpkit.checkpoint.full_state_dict``, full shapes under its own names) written by its
    own ``save_pretrained`` on rank 0."""
    from ..checkpoint import user_module
    from .llama import Llama
    inner = user_module(model)
    if isinstance(inner, Llama):
        return save_llama(inner, path, dtype=dtype, max_shard_size=max_shard_size)
    if not (hasattr(inner, "save_pretrained") and hasattr(inner, "config")):
        raise ValueError(f"save_hf({type(inner).__name__}): writes a tpkit.models.Llama or a "
                         "Hugging Face (transformers) model parallelized by tpkit.parallelize;"
                         " for another model, tpkit.checkpoint.full_state_dict(model) gives "
                         "its full tensors (collective) to save as you like")
    _save_pretrained(inner, path, dtype=dtype, max_shard_size=max_shard_size)


def _save_pretrained(model, path: str, *, dtype, max_shard_size: int) -> None:
    """save_hf of a tpkit.parallelize'd transformers model. Collective."""
    from ..checkpoint import full_state_dict
    from ..layout.topology import resolve_state
    sd = full_state_dict(model)
    if dtype is not None:
        sd = {k: v.to(dtype) if v.is_floating_point() else v for k, v in sd.items()}
    error = None
    if resolve_state(None).rank == 0:
        try:
            model.save_pretrained(os.path.abspath(os.fspath(path)), state_dict=sd,
                                  max_shard_size=max_shard_size, safe_serialization=True)
        except OSError as e:
            error = ValueError(f"save_hf({path!r}): rank 0 cannot write there ({e}); pass a "
                               "directory you can write")
    agree(error)   # every rank learns rank 0's outcome (and waits for it)
