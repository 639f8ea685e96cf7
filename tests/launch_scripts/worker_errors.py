"""Worker script for tests/test_bad_input.py: a mistake only the workers can see.

Under ``tpkit-launch --nproc-per-node 2`` (which exports TPKIT_TP=1 and TPKIT_DP=2),
``init_parallel(tp=2)`` must build tp=2 x dp=1: the exported dp is dropped, not
contradicted. Then ``init_parallel(tp=4)`` in a world of 2 raises the same ValueError on
every rank; tpkit-launch reports it as one line, with no traceback.
"""
import tpkit

state = tpkit.init_parallel(tp=2)
assert (state.tp_size, state.dp_size) == (2, 1), (state.tp_size, state.dp_size)
print(f"TP2 OK rank={state.rank}", flush=True)
tpkit.destroy_parallel()
tpkit.init_parallel(tp=4)
