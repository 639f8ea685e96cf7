"""Launched by tests/data/test_datasets.py as
``tpkit-launch --nproc-per-node 4 --cp 2 data_loader.py PREFIX TOKENIZER`` (dp=2 x cp=2):
a dataset tpkit-data wrote, read the way a training loop reads it (public API only).

Every rank builds its loader with ``tpkit.data.build_data(..., state=state, pack=True)``,
takes 3 steps and the first validation batch, packs its rows and keeps its CP shard.
Rank 0 checks, from every rank's indices: the CP ranks of a replica read the same rows,
the DP ranks' rows together are the global batch of a single-process loader on the same
data (the order does not depend on the layout), and the shards unshard to the row.
"""
import sys

import torch
import torch.distributed as dist

import tpkit
from tpkit.data import Loader, build_data, unshard_packed

prefix, tokenizer = sys.argv[1:3]
st = tpkit.init_parallel()
assert (st.dp_size, st.cp_size) == (2, 2), (st.dp_size, st.cp_size)
kw = dict(tokenizer=tokenizer, seq_len=32, global_batch=4, pack=True, split="90,10", seed=3,
          vocab_size=300)
data = build_data(prefix, state=st, **kw)
mine = []
for _ in range(3):
    mine.append(data.train.indices())
    row = data.batch(next(data.train), st)
    local = row.shard(st)
    assert local.tokens.numel() * st.cp_size == row.tokens.numel()
    assert torch.equal(unshard_packed(local.tokens, row.cu_seqlens_padded, 0, st), row.tokens)
valid = [[int(t) for seg in s for t in seg[0]] for s in next(data.valid_batches())]
got = [None] * st.world_size
dist.all_gather_object(got, (st.dp_rank, st.cp_rank, mine, valid))
if st.rank == 0:
    single = build_data(prefix, dp_rank=0, dp_size=1, **kw)
    want, want_valid = [], [[int(t) for seg in s for t in seg[0]]
                            for s in next(single.valid_batches())]
    for _ in range(3):
        want.append(single.train.indices())
        next(single.train)
    for dp, cp, rows, v in got:
        same = [r for d, c, r, _ in got if d == dp]
        assert all(r == rows for r in same), (dp, cp)
    for step in range(3):
        joined = [i for d in range(2) for dd, c, r, _ in got if dd == d and c == 0
                  for i in r[step]]
        assert joined == want[step], (step, joined, want[step])
    joined_valid = [s for d in range(2) for dd, c, _, v in got if dd == d and c == 0
                    for s in v]
    assert joined_valid == want_valid
    assert isinstance(data.train, Loader) and data.vocab_size == 300
dist.barrier()
print(f"DATA OK rank={st.rank} dp={st.dp_rank} cp={st.cp_rank} rows={mine[0]}", flush=True)
tpkit.destroy_parallel()
