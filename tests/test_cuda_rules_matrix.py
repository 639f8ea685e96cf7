"""tpkit-train's road under CUDA's autocast rules on CPU (issue 48 item 2): one launched
script (tests/launch_scripts/cuda_rules_matrix.py, in tests/shared.py's trainer launch:
``tpkit-launch --nproc-per-node 4``, the launch's last script)
installs tests/cuda_autocast.py for the whole process and runs 42 configurations one after
another (each layout freed before the next): dense; MoE with a capacity factor, at tp 2,
tp 2 + SP and ep 2; packing at cp 1 and cp 2; cp 2 with p2p, all_gather and a2a, and
a2a+p2p at cp 4; recompute; activation offload; compile (aot_eager); FSDP; each under
bf16-mixed and 16-mixed; fp8 with every recipe and the bf16 fallback, dense and MoE; a
transformers Llama fine-tuned (--init-from-hf) and exported (--checkpoint.export_hf)
under both precisions, then sampled from under autocast with a CPU generator.
Every run must finish with finite losses on every rank, and generate must give every rank
the same text. About 70 s on the 2-core development machine.
Planted: MoE's index_copy without the cast fails moe_cf and moe_ep2 under both precisions
("index_copy_(): self and source expected to have the same dtype"; with TP the experts'
output reaches the combine through the TP gather); without clearing the C++ DTensor
dispatch cache, fsdp/16-mixed (after fsdp/bf16-mixed in the same process) fails ("Could
not resolve the process group registered under the name ...": FSDP2's gradients carried
the previous layout's mesh). The script checks the rules are active (softmax in fp32 under
bf16 autocast) before the first run.
"""
import json
import os

import pytest

from paths import SCRIPTS
from shared import register_trainer_script, script_dir

pytestmark = pytest.mark.slow
# last: it installs CUDA's autocast rules for the whole process
register_trainer_script("cuda-rules", os.path.join(SCRIPTS, "cuda_rules_matrix.py"), "{dir}",
                        last=True)


def test_trainer_matrix_under_cuda_autocast_rules(tmp_path_factory):
    from launch_scripts.cuda_rules_matrix import runs
    work = script_dir(tmp_path_factory, "cuda-rules")   # the launch exited 0
    want = set(runs(work)) | {"generate/bf16-mixed", "generate/16-mixed"}
    ranks = [json.load(open(os.path.join(work, f"rank{r}.json"))) for r in range(4)]
    assert len(want) == 42
    for r, res in enumerate(ranks):
        assert set(res) == want, (r, sorted(set(res) ^ want))
        bad = {k: v.get("error") or v for k, v in res.items() if not v.get("finite")}
        assert not bad, (r, bad, [v.get("trace") for v in res.values() if "trace" in v][:1])
    for name in ("generate/bf16-mixed", "generate/16-mixed"):
        assert all(res[name]["ids"] == ranks[0][name]["ids"] for res in ranks), name
