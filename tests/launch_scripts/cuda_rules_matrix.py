"""Launched by tests/test_cuda_rules_matrix.py as ``tpkit-launch --nproc-per-node 4
cuda_rules_matrix.py WORKDIR [NAME ...]``: tpkit-train's road under CUDA's autocast rules
(tests/cuda_autocast.py installed for the whole process), every configuration one
``train.main(argv)`` after another in this one process start (the layout freed between
runs), each under bf16-mixed and 16-mixed (fp8: its bf16 fallback):
dense; MoE (capacity factor, tp 2, tp 2 + SP, ep 2); packing (cp 1 and cp 2); cp 2 with
each comm type (a2a+p2p at cp 4); recompute; activation offload; compile (aot_eager);
fp8 with every recipe and the bf16 fallback, with MoE too; FSDP; Hugging Face export,
then init from it, then generate (sampled with a CPU generator) from the export under
autocast. Every rank writes WORKDIR/rankN.json: per run, the losses or the error's last
line; the test asserts no error and finite losses.
"""
import json
import math
import os
import sys
import traceback

import torch

import tpkit
from cuda_autocast import install

TRAIN = ["--steps", "3", "--hidden", "32", "--layers", "2", "--heads", "4",
         "--gqa-groups", "2", "--ffn", "64", "--seq-len", "16", "--global-batch", "4",
         "--warmup", "1", "--log-every", "100"]
MOE = ["--experts.num", "4", "--experts.topk", "2"]
CF = ["--experts.capacity_factor", "1.5"]
MIXED = ("bf16-mixed", "16-mixed")
RULES = None


def runs(workdir: str) -> dict[str, list[str]]:
    hf = os.path.join(workdir, "hf")
    out = {}
    base = {
        "dense": [],
        "moe_cf": MOE + CF,
        "moe_tp2": MOE + ["--tp", "2"],
        "moe_tp2_sp": MOE + CF + ["--tp", "2", "--sequence-parallel"],
        "moe_ep2": MOE + CF + ["--ep", "2"],
        "pack": ["--pack"],
        "pack_cp2": ["--pack", "--cp", "2"],
        "cp2_p2p": ["--cp", "2", "--cp-comm-type", "p2p"],
        "cp2_all_gather": ["--cp", "2", "--cp-comm-type", "all_gather"],
        "cp2_a2a": ["--cp", "2", "--cp-comm-type", "a2a"],
        "cp4_a2a_p2p": ["--cp", "4", "--cp-comm-type", "a2a+p2p"],
        "recompute": ["--recompute", "--tp", "2"],
        "offload": ["--training.cpu_offload_layers", "1"],
        "compile": ["--compile", "--training.compile_backend", "aot_eager", "--tp", "2"],
        "fsdp": ["--data-parallel", "fsdp", "--tp", "2"],
    }
    for name, extra in base.items():
        for mode in MIXED:
            out[f"{name}/{mode}"] = extra + ["--precision", mode]
    for recipe in ("delayed", "current", "block", "mxfp8"):
        for moe in (False, True):
            out[f"fp8_{recipe}{'_moe' if moe else ''}"] = (MOE if moe else []) + [
                "--precision", "fp8", "--precision.fp8_recipe", recipe,
                "--fp8-compute-dtype", "bfloat16", "--tp", "2"]
    for mode in MIXED:   # init from a transformers checkpoint, train, export it
        out[f"hf/{mode}"] = ["--precision", mode, "--tp", "2", "--init-from-hf", hf,
                             "--checkpoint.export_hf", f"{hf}-{mode}"]
    return out


def hf_base(path: str) -> None:
    """A tiny random transformers Llama (its vocabulary holds the corpus' byte ids)."""
    import torch.distributed as dist
    if not dist.is_initialized():
        tpkit.init_parallel()
    if int(os.environ.get("RANK", 0)) == 0:
        from transformers import LlamaConfig, LlamaForCausalLM
        torch.manual_seed(0)
        cfg = LlamaConfig(vocab_size=260, hidden_size=32, intermediate_size=64,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          max_position_embeddings=64)
        LlamaForCausalLM(cfg).float().save_pretrained(path)
    dist.barrier()


def generate(hf_dir: str, dtype) -> list[list[int]]:
    from tpkit.models import hf
    state = tpkit.init_parallel(tp=2)
    try:
        model = hf.from_hf(hf_dir, state).eval()
        ids = torch.tensor([[5, 6, 7, 8], [0, 9, 10, 11]])
        mask = torch.tensor([[1, 1, 1, 1], [0, 1, 1, 1]])
        with torch.autocast("cpu", dtype=dtype):
            out = model.generate(ids, mask, max_new_tokens=4, do_sample=True, top_k=20,
                                 generator=torch.Generator().manual_seed(1))
        return out.tolist()
    finally:
        tpkit.destroy_parallel()


def main(workdir: str, only: list[str]) -> None:
    from tpkit.train import trainer as train
    global RULES
    RULES = install()   # CUDA's autocast rules for every autocast of this process (kept:
    # a collected torch.library.Library drops its kernels)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.ones(2, 2).softmax(-1).dtype == torch.float32, "CUDA rules not active"
    rank = int(os.environ.get("RANK", 0))
    results = {}
    hf_made = False   # decided alike on every rank (hf_base is collective: its barrier)
    for name, extra in runs(workdir).items():
        if only and name.split("/")[0] not in only:
            continue
        argv = TRAIN + extra
        if name.startswith("hf/") and not hf_made:
            hf_base(os.path.join(workdir, "hf"))
            hf_made = True
        # a2a+p2p's inner all-to-all size comes from the launcher's variable
        os.environ.pop("TPKIT_CP_A2A_SIZE", None)
        if "a2a+p2p" in extra:
            os.environ["TPKIT_CP_A2A_SIZE"] = "2"
        if "--init-from-hf" in extra:   # the sizes come from the HF config
            argv = _drop_values(TRAIN, ("--hidden", "--layers", "--heads", "--gqa-groups",
                                        "--ffn")) + extra
        try:
            losses = train.main(argv)
            results[name] = {"losses": losses,
                             "finite": all(math.isfinite(x) for x in losses)}
        except Exception as e:   # noqa: BLE001  (reported per run; the test fails on it)
            results[name] = {"error": f"{type(e).__name__}: {e}".splitlines()[0][:500],
                             "trace": traceback.format_exc()[-3000:]}
        finally:
            tpkit.destroy_parallel()
    for mode, dtype in (("bf16-mixed", torch.bfloat16), ("16-mixed", torch.float16)):
        name = f"generate/{mode}"
        if only and "generate" not in only:
            continue
        try:
            results[name] = {"ids": generate(os.path.join(workdir, f"hf-{mode}"), dtype),
                             "finite": True}
        except Exception as e:   # noqa: BLE001
            results[name] = {"error": f"{type(e).__name__}: {e}".splitlines()[0][:500],
                             "trace": traceback.format_exc()[-3000:]}
    with open(os.path.join(workdir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)


def _drop_values(argv, flags):
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a in flags:
            skip = True
            continue
        out.append(a)
    return out


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
