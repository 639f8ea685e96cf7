"""Exact collectives per training step of tpkit/models/gpt.py's GPT at tp=2, with and without
sequence parallelism: guards bench/train.py's analytical count (and catches any layer that
starts issuing extra collectives)."""
from bench.train import analytical_collectives, count_step_collectives
from dist import run


def _counts():
    import tpkit
    from tpkit.models.gpt import GPTConfig
    tpkit.init_parallel(tp=2, seed=1234)
    out = {}
    for layers, h in ((1, 32), (2, 128)):
        cfg = GPTConfig(hidden_size=h, num_layers=layers, num_heads=4, num_gqa_groups=2,
                        ffn_hidden_size=2 * h)
        for sp in (False, True):
            out[layers, sp] = count_step_collectives(cfg, 16, 2, sp)
    return out


def test_gpt_step_collectives_match_the_analytical_count():
    counts = run(_counts, 2)
    assert counts[0] == counts[1]
    got = counts[0]
    # per layer: 2 fwd + 2 bwd all-reduces; + embedding (fwd), head (bwd), CE (2 fwd)
    assert got[2, False] == {"all_reduce": 12}
    assert got[1, False] == {"all_reduce": 8}
    # SP: per layer 4 all-gathers + 4 reduce-scatters; + embedding and head pairs;
    # all-reduces: CE's 2 + one flattened norm-gradient sync
    assert got[2, True] == {"all_gather_into_tensor": 10, "reduce_scatter_tensor": 10,
                            "all_reduce": 3}
    assert got[1, True] == {"all_gather_into_tensor": 6, "reduce_scatter_tensor": 6,
                            "all_reduce": 3}
    for (layers, sp), calls in got.items():
        assert calls == analytical_collectives(layers, sp), (layers, sp)
