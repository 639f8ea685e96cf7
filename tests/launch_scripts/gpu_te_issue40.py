"""GPU only, two GPUs (tests/test_gpu.py launches it with ``tpkit-launch
--nproc-per-node 2``): the rows of issue 40 that need two ranks, on real TE and nccl.

Row 2: MoE(backend="te") at ep=2 with every token routed to rank 0's expert, two steps
under te_autocast("delayed"): rank 1 receives no token, TE's amax reduction must neither
hang nor fail. Row 5: tpkit.models.hf.save_hf on the nccl-only default group. Row 8: TE attention
built by tpkit under tp=2 with SP draws different dropout masks on the two TP ranks.
Row 10: two pp=2 layouts in a row, each with a TE fp8 step (the second must not reduce
over the first's destroyed amax group). Prints "ISSUE40 OK" last.
"""
import sys
import tempfile

import torch
import torch.distributed as dist

import tpkit
from tpkit.nn import MoE
from tpkit.te import te_autocast

H, F = 64, 128

# row 2
st = tpkit.init_parallel(ep=2, seed=1)
moe = MoE(H, F, 2, 1, backend="te", dtype=torch.bfloat16)
with torch.no_grad():
    moe.router_weight.zero_()
    moe.router_weight[0] = 1.0
for step in range(2):
    x = (torch.rand(40, 1, H, device="cuda", dtype=torch.bfloat16) + 0.1).requires_grad_()
    with te_autocast(recipe="delayed"):
        y = moe(x)
    y.float().sum().backward()
assert torch.isfinite(x.grad).all()
tpkit.destroy_parallel()

# row 5
st = tpkit.init_parallel(tp=2, seed=1)
from tpkit.models import Llama, LlamaConfig  # noqa: E402
model = Llama(LlamaConfig(64, 64, 128, 1, 4), st)
path = tempfile.mkdtemp() if st.rank == 0 else None
box = [path]
dist.broadcast_object_list(box, src=0)
from tpkit.models.hf import save_hf  # noqa: E402
save_hf(model, box[0] + "/hf")
tpkit.destroy_parallel()

# row 8
st = tpkit.init_parallel(tp=2, sequence_parallel=True, seed=1)
from tpkit.nn.dot_product_attention import DotProductAttention  # noqa: E402
attn = DotProductAttention(4, 16, attention_dropout=0.5, state=st, backend="te").train()
torch.manual_seed(0)   # the same q, k, v on both ranks (each holds 2 of the 4 heads)
q = torch.randn(32, 1, 2, 16, device="cuda", dtype=torch.bfloat16)
out = attn(q, q, q)
both = [torch.empty_like(out) for _ in range(2)]
dist.all_gather(both, out, group=st.tp_group)
assert not torch.equal(both[0], both[1]), "identical dropout masks on both TP ranks"
tpkit.destroy_parallel()

# row 10
for step in range(2):
    st = tpkit.init_parallel(pp=2, seed=1)
    moe = MoE(H, F, 2, 1, backend="te", dtype=torch.bfloat16)
    with te_autocast(recipe="delayed"):
        moe(torch.randn(32, 1, H, device="cuda", dtype=torch.bfloat16)).float().sum().backward()
    tpkit.destroy_parallel()

print("ISSUE40 OK")
sys.stdout.flush()
