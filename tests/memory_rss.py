"""Run by tests/memory/test_memory_rss.py in a fresh process: two training steps of tpkit's GPT
(fp32, AdamW, one rank) and the resident set's growth over the process before the model
(peak RSS from getrusage minus RSS before), printed as JSON next to tpkit.memory's
estimate for the same job. Arguments: hidden layers heads groups ffn vocab seq batch."""
import json
import os
import resource
import sys

import torch
import torch.distributed as dist

os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("PORT", "29588"),
                  RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
dist.init_process_group("gloo")
import tpkit  # noqa: E402
from tpkit.layout.config import ParallelConfig  # noqa: E402
from tpkit.memory import MemoryJob, ModelShape, estimate_memory  # noqa: E402
from tpkit.models.gpt import GPT, GPTConfig  # noqa: E402

h, L, heads, groups, ffn, V, s, b = (int(a) for a in sys.argv[1:9])
st = tpkit.init_parallel()
torch.manual_seed(0)
x, y = torch.randint(0, V, (b, s)), torch.randint(0, V, (b, s))
before = int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
model = GPT(GPTConfig(vocab_size=V, hidden_size=h, num_layers=L, num_heads=heads,
                      num_gqa_groups=groups, ffn_hidden_size=ffn), st)
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
for _ in range(2):
    model(x, y).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
est = estimate_memory(MemoryJob(model=ModelShape(layers=L, hidden=h, ffn=ffn, heads=heads,
                                                 kv_heads=groups, vocab=V),
                                micro_batch=b, seq_len=s), ParallelConfig(), world_size=1)
print(json.dumps({"rss_growth": peak - before, "estimate": est.peak, "phase": est.phase}))
tpkit.destroy_parallel()
