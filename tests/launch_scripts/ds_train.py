"""``tpkit-launch --nproc-per-node 4 --tp 2 ds_train.py OUT`` (tests/test_userpath.py runs its
main() after fabric_layouts.py's in one launch: tests/launch_scripts/fabric_then_deepspeed.py):
DeepSpeed the way README shows it, in one process over two layouts.

1. ``tpkit.init_parallel(sequence_parallel=False)`` (tp=2, dp=2 from tpkit-launch; that
   launch's --sequence-parallel is for the Fabric part), then
   ``deepspeed.initialize(..., mpu=DeepSpeedMPU())`` with ZeRO 2 and gradient clipping on
   the TP MLP of test_deepspeed (parameters marked with mark_tensor_parallel_params);
2. ``destroy_parallel()``, ``init_parallel(tp=1, cp=2)`` (dp=2: TPKIT_DP no longer applies), a
   new engine with ZeRO 1, the loss split with sequence_share.

Each run's losses and every step's full weights must equal the single-process reference
(plain SGD on the global batch, test_deepspeed.reference_run) to 1e-5, and the weights
must be identical on every DP/CP replica. Rank 0 writes a JSON summary to OUT.

The one difference from a user's script: DeepSpeed's CPU shared-memory comm op (only
inference_all_reduce uses it) is not JIT-compiled, as in test_deepspeed (40-60 s of g++).
"""
import json
import sys

import torch
import torch.distributed as dist

import tpkit
from test_deepspeed import CLIP, STEPS, _quiet_deepspeed, _train, reference_run


def check(out, clip, what):
    ref_losses, _, ref_weights = reference_run(clip=clip)
    assert out["replicas_equal"], what
    for step in range(STEPS):
        rel = abs(out["losses"][step] - ref_losses[step]) / abs(ref_losses[step])
        assert rel <= 1e-5, (what, step, out["losses"][step], ref_losses[step])
        for k, v in ref_weights[step].items():
            torch.testing.assert_close(out["weights"][step][k], v, rtol=1e-5, atol=1e-6,
                                       msg=f"{what} step {step} {k}")
    return out["losses"]


def main(out_path):
    deepspeed = _quiet_deepspeed()
    summary = {}
    s = tpkit.init_parallel(sequence_parallel=False)  # the rest is what tpkit-launch exported
    assert (s.tp_size, s.cp_size, s.dp_size) == (2, 1, 2), (s.tp_size, s.cp_size, s.dp_size)
    out = _train(deepspeed, s, 2, clip=CLIP)
    assert out["engine"]["mp_world_size"] == 2 and out["engine"]["dp_world_size"] == 2
    summary["tp2dp2_zero2_clip"] = check(out, CLIP, "tp2dp2 zero2")
    tpkit.destroy_parallel()

    s = tpkit.init_parallel(tp=1, cp=2, sequence_parallel=False)  # dp=2: another layout
    assert (s.tp_size, s.cp_size, s.dp_size) == (1, 2, 2), (s.tp_size, s.cp_size, s.dp_size)
    out = _train(deepspeed, s, 1)
    assert out["engine"]["sequence_parallel_size"] == 2 and out["engine"]["seq_dp_world_size"] == 4
    summary["cp2dp2_zero1"] = check(out, None, "cp2dp2 zero1")
    tpkit.destroy_parallel()
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(summary, f)


if __name__ == "__main__":
    main(sys.argv[1])
