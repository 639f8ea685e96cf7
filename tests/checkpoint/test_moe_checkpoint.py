"""Sharded checkpoints of expert weights (tpkit.nn.MoE) keep global expert indices: a
checkpoint written at one (ep, etp, tp, dp) loads at another, and every expert weight and
its Adam moments (and step) on every rank equal a single-process reference taken at the
rank's global expert index and etp columns, computed here from full tensors (torch's
Adam on the unsharded weights, sliced by the layout formula written in this file, not by
tpkit's sharding helpers). ``read`` returns the full tensors under full_state_dict's
names, and ``load_full`` of them (load_raw's road) gives the same shards. The user's road
(train.py --save at ep=2 x tp=2, --resume at ep=4 and at ep=1 x tp=1) is at the end."""
import os

import pytest
import torch

from dist import run
from shared import register_trainer_runs, trainer_runs, trainer_work
from test_moe import MOE, TRAIN_SMALL, _train

H, F, E = 8, 6, 4


# --- the reference: full tensors, one process -----------------------------------------------
def _full_reference(generation: int):
    """The full weights, gradient and Adam state after one step of torch's Adam on the
    unsharded weights (fp64): {name: {"param", "exp_avg", "exp_avg_sq"}}, and the step."""
    g = torch.Generator().manual_seed(100 + generation)
    full = {"router_weight": torch.randn(E, H, generator=g, dtype=torch.float64),
            "experts_fc1": torch.randn(E, H, 2 * F, generator=g, dtype=torch.float64),
            "experts_fc2": torch.randn(E, F, H, generator=g, dtype=torch.float64)}
    params = {k: torch.nn.Parameter(v.clone()) for k, v in full.items()}
    opt = torch.optim.Adam(list(params.values()), lr=0.1)
    for k, p in params.items():
        p.grad = torch.randn(p.shape, generator=g, dtype=torch.float64)
    opt.step()
    return {k: {"param": p.detach().clone(), **{s: opt.state[p][s].clone()
                                                for s in ("exp_avg", "exp_avg_sq")}}
            for k, p in params.items()}, float(opt.state[params["router_weight"]]["step"])


def _my_slice(name: str, full: torch.Tensor, st) -> torch.Tensor:
    """This rank's piece of ``full`` by the layout formula: experts [ep_rank*E/ep, ...),
    fc1's gate and up columns (each F/etp of F), fc2's rows; the router whole."""
    if name == "router_weight":
        return full
    n = E // st.ep_size
    t = full[st.ep_rank * n:(st.ep_rank + 1) * n]
    f = F // st.etp_size
    cols = list(range(st.etp_rank * f, (st.etp_rank + 1) * f))
    if name == "experts_fc1":
        return t[:, :, cols + [F + c for c in cols]]
    return t[:, cols, :]


def _model_and_opt():
    from tpkit.nn import MoE
    moe = MoE(H, F, E, 2, activation="swiglu", dtype=torch.float64)
    return moe, torch.optim.Adam(moe.parameters(), lr=0.1)


def _check_rank(moe, opt, ref, step, st, what):
    for name, p in moe.named_parameters():
        want = {k: _my_slice(name, v, st) for k, v in ref[name].items()}
        assert torch.equal(p.detach(), want["param"]), (what, name, "param")
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(opt.state[p][k], want[k]), (what, name, k)
        assert float(opt.state[p]["step"]) == step, (what, name, opt.state[p]["step"])


def _rank_chain(layout, load_from, save_to, gen_load, gen_save):
    """At ``layout`` (tp, ep, etp, dp): load ``load_from`` (written from generation
    ``gen_load``) and check every rank's shards; then put generation ``gen_save`` in (by
    the formula) and save it to ``save_to``."""
    import tpkit
    from tpkit import checkpoint
    tp, ep, etp, dp = layout
    st = tpkit.init_parallel(tp=tp, dp=dp, ep=ep, etp=etp, seed=1)
    assert (st.ep_size, st.etp_size, st.tp_size) == (ep, etp, tp)
    if load_from is not None:
        ref, step = _full_reference(gen_load)
        moe, opt = _model_and_opt()
        checkpoint.load(load_from, {"model": moe, "optimizer": opt})
        _check_rank(moe, opt, ref, step, st, f"load at {layout}")
        full = checkpoint.read(load_from)   # full tensors, full_state_dict's names
        assert sorted(full["model"]) == sorted(checkpoint.full_state_dict(moe)), full["model"]
        for name, r in ref.items():
            assert torch.equal(full["model"][name], r["param"]), name
            for k in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(full["optimizer"]["state"][name][k], r[k]), (name, k)
        for name, t in checkpoint.full_state_dict(moe).items():
            assert torch.equal(t, ref[name]["param"]), ("full_state_dict", name)
        moe2, opt2 = _model_and_opt()        # load_raw's road: full dicts into the shards
        checkpoint.load_full(full, {"model": moe2, "optimizer": opt2})
        _check_rank(moe2, opt2, ref, step, st, f"load_full at {layout}")
    if save_to is not None:
        ref, step = _full_reference(gen_save)
        moe, opt = _model_and_opt()
        with torch.no_grad():
            for name, p in moe.named_parameters():
                p.copy_(_my_slice(name, ref[name]["param"], st))
                opt.state[p] = {"step": torch.tensor(step, dtype=torch.float64),
                                **{k: _my_slice(name, ref[name][k], st).clone()
                                   for k in ("exp_avg", "exp_avg_sq")}}
        if ep == 4:   # the background writer (train.py --async-save) too
            import torch.distributed as dist
            group = dist.new_group(backend="gloo")
            checkpoint.async_save(save_to, {"model": moe, "optimizer": opt},
                                  process_group=group).wait()
            dist.destroy_process_group(group)
        else:
            checkpoint.save(save_to, {"model": moe, "optimizer": opt})
    tpkit.destroy_parallel()


def test_expert_checkpoint_reshards_across_ep_etp(tmp_path):
    """(tp, ep, etp, dp): (2,2,2,2) -> (1,4,1,4) -> (1,1,1,1) -> (2,2,1,2) -> (2,1,2,2)
    -> (2,2,2,2), each loading the previous one's checkpoint and saving its own (a new
    generation of weights, so every hop is checked; at ep=4 with async_save)."""
    chain = [(4, (2, 2, 2, 2)), (4, (1, 4, 1, 4)), (1, (1, 1, 1, 1)), (4, (2, 2, 1, 2)),
             (4, (2, 1, 2, 2)), (4, (2, 2, 2, 2))]
    prev = None
    for gen, (world, layout) in enumerate(chain):
        path = str(tmp_path / f"ck{gen}") if gen + 1 < len(chain) else None
        run(_rank_chain, world, layout, prev, path, gen - 1, gen)
        prev = path


# --- the user's road: launch/train.py --save / --resume at another ep ---------------------------
_STEPS = ["--steps", "12"]
_CKPT = os.path.join("{work}", "moe-ckpt")
_STEP6 = os.path.join(_CKPT, "step000006")
# launched in tests/shared.py's trainer launch (4 ranks, with other modules' runs)
LAUNCHED = {name: TRAIN_SMALL + MOE + _STEPS + extra for name, extra in {
    "moe-ep2tp2": ["--tp", "2", "--ep", "2", "--save", _CKPT, "--save-every", "6"],
    "moe-resume-ep4": ["--tp", "1", "--ep", "4", "--resume", _STEP6],
}.items()}
register_trainer_runs(LAUNCHED)


@pytest.mark.slow
def test_train_resume_at_another_ep(tmp_path_factory):
    """launch/train.py under tpkit-launch (tests/shared.py's trainer launch, 4 ranks): 12
    steps at ep=2 x tp=2 (etp=2) saving after step 6, then --resume of that checkpoint at
    ep=4 (4 ranks, etp=1) and at ep=1 x tp=1 (one process): the next losses are the
    uninterrupted single-process run's within 1e-5 relative, and so is the saving run's
    whole curve."""
    (reference,) = run(_train, 1, _STEPS + ["--tp", "1", "--ep", "1"])
    runs = trainer_runs(tmp_path_factory)
    got = {name: runs[name] for name in LAUNCHED}
    step6 = _STEP6.replace("{work}", trainer_work(tmp_path_factory))
    (got["moe-resume-ep1"],) = run(_train, 1, _STEPS + ["--tp", "1", "--ep", "1",
                                                        "--resume", step6])
    for name, losses in got.items():
        want = reference[6:] if "resume" in name else reference
        assert len(want) == (6 if "resume" in name else 12)
        assert len(losses) == len(want), (name, len(losses))
        for i, (x, y) in enumerate(zip(losses, want)):
            assert abs(x - y) <= 1e-5 * abs(y), f"{name} step {i}: {x} vs {y}"
