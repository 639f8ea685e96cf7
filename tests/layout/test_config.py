"""ParallelConfig: validation messages, dp resolution, TPKIT_* round trip."""
import pytest

from tpkit.layout.config import ParallelConfig

# (kwargs, world_size or None, text that must appear in the message)
BAD = [
    (dict(tp=0), None, "tp=0"),
    (dict(cp=-2), None, "cp=-2"),
    (dict(pp=1.5), None, "pp=1.5"),
    (dict(tp=True), None, "tp=True"),
    (dict(dp=0), None, "dp=0"),
    (dict(tp=3), 8, "world size 8"),
    (dict(tp=2, cp=2, pp=3), 8, "2*2*3"),
    (dict(tp=2, dp=3), 8, "dp=3"),
    (dict(tp=2, dp=8), 8, "dp=8"),
    (dict(tp=1, sequence_parallel=True), None, "sequence_parallel=True"),
    (dict(tp=2, sequence_parallel="yes"), None, "sequence_parallel='yes'"),
    (dict(cp=2, cp_comm_type="ring"), None, "cp_comm_type='ring'"),
    (dict(cp=4, cp_comm_type="a2a+p2p"), None, "cp_a2a_size"),
    (dict(cp=6, cp_comm_type="a2a+p2p", cp_a2a_size=4), None, "cp_a2a_size=4 does not divide"),
    (dict(tp=None), None, "tp=None"),
    (dict(tp=2), None, "world_size=None"),
    (dict(cp=4, cp_comm_type="a2a+p2p", cp_a2a_size=4), None, "cp_a2a_size=4"),
    (dict(cp=4, cp_comm_type="a2a+p2p", cp_a2a_size=1), None, "cp_a2a_size=1"),
    (dict(cp=4, cp_comm_type="p2p", cp_a2a_size=2), None, "cp_a2a_size=2"),
    (dict(tp=2), 0, "world_size=0"),
]


@pytest.mark.parametrize("kwargs,world,needle", BAD, ids=[str(b[0]) + str(b[1]) for b in BAD])
def test_bad_configs(kwargs, world, needle):
    with pytest.raises(ValueError) as err:
        cfg = ParallelConfig(**kwargs)
        cfg.validate(world)
    assert needle in str(err.value)


def test_dp_filled_and_checked():
    cfg = ParallelConfig(tp=2, cp=2).validate(16)
    assert cfg.dp == 4 and cfg.world_size == 16
    assert ParallelConfig(tp=2, cp=2, dp=4).validate(16).dp == 4
    with pytest.raises(ValueError, match="validate"):
        ParallelConfig(tp=2).world_size


def test_env_round_trip():
    cfg = ParallelConfig(tp=2, cp=4, pp=2, dp=3, sequence_parallel=True,
                         cp_comm_type="a2a+p2p", cp_a2a_size=2)
    env = cfg.to_env()
    assert env["TPKIT_TP"] == "2" and env["TPKIT_SEQUENCE_PARALLEL"] == "1"
    assert ParallelConfig.from_env(env) == cfg
    assert ParallelConfig.from_env({}) == ParallelConfig()
    assert ParallelConfig.from_env(env, tp=4, sequence_parallel=False).tp == 4


def test_env_overrides_drop_what_they_make_stale():
    """tpkit-launch exports the dp it derived (TPKIT_DP); a script that builds another
    layout (init_parallel(tp=4) after destroy_parallel) must not be held to it."""
    env = ParallelConfig(tp=2, dp=4).to_env()               # tpkit-launch --tp 2, 8 ranks
    assert ParallelConfig.from_env(env).dp == 4
    assert ParallelConfig.from_env(env, tp=2).dp == 4        # same size: dp still holds
    for changed in ({"tp": 4}, {"cp": 2}, {"pp": 2}, {"tp": 1}):
        cfg = ParallelConfig.from_env(env, **changed)
        assert cfg.dp is None and cfg.validate(8).dp == 8 // cfg.model_size, changed
    assert ParallelConfig.from_env(env, tp=4, dp=2).dp == 2  # an explicit dp is kept
    with pytest.raises(ValueError, match="dp=4 is inconsistent"):
        ParallelConfig.from_env(env, tp=2, dp=4).validate(16)
    hier = ParallelConfig(cp=4, cp_comm_type="a2a+p2p", cp_a2a_size=2).to_env()
    assert ParallelConfig.from_env(hier, cp_comm_type="p2p").cp_a2a_size is None
    assert ParallelConfig.from_env(hier, cp_comm_type="a2a+p2p").cp_a2a_size == 2
    assert ParallelConfig.from_env(hier).cp_a2a_size == 2


@pytest.mark.parametrize("env,needle", [
    ({"TPKIT_TP": "two"}, "TPKIT_TP='two'"),
    ({"TPKIT_SEQUENCE_PARALLEL": "maybe"}, "TPKIT_SEQUENCE_PARALLEL='maybe'"),
    ({"TPKIT_CP": "2", "TPKIT_CP_COMM_TYPE": "tree"}, "cp_comm_type='tree'"),
])
def test_bad_env(env, needle):
    with pytest.raises(ValueError) as err:
        ParallelConfig.from_env(env)
    assert needle in str(err.value)


def test_shm_allreduce_switch():
    from tpkit.comm.shm import shm_allreduce_enabled
    assert shm_allreduce_enabled({}) is True
    assert shm_allreduce_enabled({"TPKIT_SHM_ALLREDUCE": "0"}) is False
    assert shm_allreduce_enabled({"TPKIT_SHM_ALLREDUCE": "yes"}) is True
    with pytest.raises(ValueError, match="TPKIT_SHM_ALLREDUCE='sometimes' is not a boolean"):
        shm_allreduce_enabled({"TPKIT_SHM_ALLREDUCE": "sometimes"})


def test_shm_p2p_switch():
    from tpkit.comm.shm import shm_p2p_enabled
    assert shm_p2p_enabled({}) is True
    assert shm_p2p_enabled({"TPKIT_SHM_P2P": "0"}) is False
    with pytest.raises(ValueError, match="TPKIT_SHM_P2P='often' is not a boolean"):
        shm_p2p_enabled({"TPKIT_SHM_P2P": "often"})


def test_fused_attn_switch():
    from tpkit.layout.config import fused_attn_enabled
    assert fused_attn_enabled({}) is True
    assert fused_attn_enabled({"TPKIT_FUSED_ATTN": "0"}) is False
    with pytest.raises(ValueError, match="TPKIT_FUSED_ATTN='fast' is not a boolean; use 1"):
        fused_attn_enabled({"TPKIT_FUSED_ATTN": "fast"})


def test_env_details_mutation_testing_found_untested():
    """Survivors of tools/mutation.py config (docs/testing.md)."""
    # the p2p level of a2a+p2p: cp / a2a size (8 / 2 = 4; a shift would give 2)
    assert ParallelConfig(cp=8, cp_comm_type="a2a+p2p", cp_a2a_size=2).cp_p2p_size == 4
    assert ParallelConfig(cp=8).cp_p2p_size is None
    # env_is_set is asked on the class, with an environment of the caller's
    assert ParallelConfig.env_is_set({"TPKIT_CP_COMM_TYPE": "p2p"}) is True
    assert ParallelConfig.env_is_set({"OMP_NUM_THREADS": "1"}) is False
    # an unset TPKIT_TP means tp=1: overriding it with 1 keeps the exported dp, 2 drops it
    assert ParallelConfig.from_env({"TPKIT_DP": "4"}, tp=1, cp=1, pp=1).dp == 4
    assert ParallelConfig.from_env({"TPKIT_DP": "4"}, tp=2).dp is None
    # every comm type but a2a+p2p takes no cp_a2a_size ("a2a" sorts before "a2a+p2p")
    for comm in ("p2p", "all_gather", "a2a"):
        assert ParallelConfig(cp=4, cp_comm_type=comm).validate(8).cp_p2p_size is None
    # the shm switch lives in tpkit.comm.shm only (no old-path alias: nothing was released);
    # a missing name is an AttributeError
    import tpkit.layout.config
    assert not hasattr(tpkit.layout.config, "shm_allreduce_enabled")
    with pytest.raises(AttributeError, match="world_default"):
        tpkit.layout.config.world_default  # noqa: B018
    # tp * cp * pp with no two sizes equal (2 ** 3 * 2 or 2 * 3 ** 2 would pass with 2, 2, 3)
    assert ParallelConfig(tp=2, cp=3, pp=2).validate(24).dp == 2
    # a layout is a value: frozen (it keys the state and travels in TPKIT_*)
    import dataclasses
    with pytest.raises(dataclasses.FrozenInstanceError):
        ParallelConfig().tp = 2
    # a divisor that shares no bit pattern with cp (6 = 2 * 3; 6 & 3 != 0 is no divisibility)
    assert ParallelConfig(cp=6, cp_comm_type="a2a+p2p", cp_a2a_size=3).cp_p2p_size == 2


# (tp, cp, world, ep, etp) -> edp = tp*cp*dp / (etp*ep), dp = world / (tp*cp), by hand
EXPERT_LAYOUTS = [((2, 3, 30, 3, 1), 10), ((2, 3, 30, 3, 2), 5), ((2, 3, 30, 3, 5), 2),
                  ((2, 1, 12, 2, 2), 3), ((4, 1, 16, 2, None), 2), ((2, 2, 8, 1, None), 4),
                  ((1, 3, 9, 3, 3), 1)]


@pytest.mark.parametrize("layout,edp", EXPERT_LAYOUTS, ids=str)
def test_expert_layout_sizes(layout, edp):
    tp, cp, world, ep, etp = layout
    cfg = ParallelConfig(tp=tp, cp=cp, ep=ep, etp=etp)
    with pytest.raises(ValueError, match="dp is not resolved yet; call validate"):
        cfg.edp
    v = cfg.validate(world)
    assert v.edp == edp and type(v.edp) is int
    assert v.dp == world // (tp * cp) and v.expert_tp == (tp if etp is None else etp)
    assert v.has_experts is (ep > 1 or (etp is not None and etp != tp))


def test_has_experts_and_expert_env():
    assert ParallelConfig().has_experts is False
    assert ParallelConfig(tp=2, etp=2).has_experts is False
    assert ParallelConfig(tp=2, etp=1).has_experts is True
    assert ParallelConfig(tp=2, etp=4).has_experts is True
    assert ParallelConfig(ep=2).has_experts is True
    env = ParallelConfig(tp=2, ep=2, etp=1).to_env()
    assert env["TPKIT_EP"] == "2" and env["TPKIT_ETP"] == "1"
    assert "TPKIT_EP" not in ParallelConfig().to_env()
    assert "TPKIT_ETP" not in ParallelConfig(ep=3).to_env()
    assert ParallelConfig.from_env(env) == ParallelConfig(tp=2, ep=2, etp=1)
    # the defaults, spelled out
    assert ParallelConfig() == ParallelConfig(tp=1, cp=1, pp=1, dp=None, ep=1, etp=None,
                                              sequence_parallel=False, cp_comm_type="p2p")
    d = ParallelConfig()
    assert (d.tp, d.cp, d.pp, d.ep) == (1, 1, 1, 1)


@pytest.mark.parametrize("layout,world,sizes", [
    (dict(tp=2, ep=3, etp=2), 8, "etp*ep = 2*3 = 6 does not divide tp*cp*dp = 2*1*4 = 8"),
    (dict(tp=2, cp=3, ep=4, etp=1), 30, "etp*ep = 1*4 = 4 does not divide tp*cp*dp = "
                                         "2*3*5 = 30"),
    (dict(tp=2, ep=3, etp=1), 8, "etp*ep = 1*3 = 3 does not divide tp*cp*dp = 2*1*4 = 8"),
    (dict(tp=3, ep=2), 9, "etp*ep = 3*2 = 6 does not divide tp*cp*dp = 3*1*3 = 9"),
])
def test_expert_layout_errors(layout, world, sizes):
    with pytest.raises(ValueError) as e:
        ParallelConfig(**layout).validate(world)
    assert str(e.value).startswith(sizes + " (the ranks of one pipeline stage")
    stage = sizes.rsplit(" ", 1)[1]
    assert f"choose ep and etp whose product divides {stage}, or change" in str(e.value)


def test_origin_in_messages():
    # a value from the environment names its variable and how it got there
    with pytest.raises(ValueError) as e:
        ParallelConfig.from_env({"TPKIT_TP": "1", "TPKIT_CP": "3"}).validate(8)
    msg = str(e.value)
    assert msg.endswith("[cp=3 from $TPKIT_CP; tpkit-launch exports $TPKIT_*, or your "
                        "shell set them]")   # tp=1 is the default: not named
    with pytest.raises(ValueError) as e:
        ParallelConfig.from_env({}, given_as="tpkit-launch --{flag}", cp=3,
                                cp_comm_type="all_gather").validate(8)
    assert str(e.value).endswith("[cp=3 from tpkit-launch --cp]")
    # a value without an origin is not named, and does not break the message
    with pytest.raises(ValueError) as e:
        ParallelConfig(tp=3, cp=2, origin={"cp": "the cp argument"}).validate(8)
    assert str(e.value).endswith("smaller tp/cp/pp [cp=2 from the cp argument]")
    with pytest.raises(ValueError) as e:
        ParallelConfig(tp=3, origin={"cp": "the cp argument"}).validate(8)
    assert str(e.value).endswith("smaller tp/cp/pp")
    # origin is keyword-only and not part of the value
    with pytest.raises(TypeError):
        ParallelConfig(1, 1, 1, None, False, "p2p", None, 1, None, {"tp": "x"})
    cfg = ParallelConfig(tp=2, origin={"tp": "x"})
    assert "origin" not in repr(cfg) and cfg == ParallelConfig(tp=2)
    # from_env: env is positional or keyword, given_as keyword-only
    assert ParallelConfig.from_env(env={"TPKIT_TP": "2"}).tp == 2
    with pytest.raises(TypeError):
        ParallelConfig.from_env({}, "the {name} argument")


def test_from_env_keeps_dependent_values_of_unchanged_sizes():
    # an override equal to the exported value keeps TPKIT_DP (also for ints Python does
    # not cache: compared by value, not identity)
    env = {"TPKIT_TP": str(1000), "TPKIT_DP": "2"}
    assert ParallelConfig.from_env(env, tp=int("1000")).dp == 2
    assert ParallelConfig.from_env(env, tp=500).dp is None
    assert ParallelConfig(tp=1, dp=int("1000")).validate(1000).dp == 1000
    # an overridden comm type other than a2a+p2p drops the exported cp_a2a_size
    env = {"TPKIT_CP": "4", "TPKIT_CP_COMM_TYPE": "a2a+p2p", "TPKIT_CP_A2A_SIZE": "2"}
    for comm in ("a2a", "p2p", "all_gather"):
        assert ParallelConfig.from_env(env, cp_comm_type=comm).cp_a2a_size is None
    assert ParallelConfig.from_env(env).cp_a2a_size == 2
    assert str(ParallelConfig.from_env(env).cp_p2p_size) == "2"   # an int, not 2.0


def test_no_old_path_by_any_string():
    import tpkit.layout.config as config
    name = "".join(["shm_", "allreduce_enabled"])   # not an interned constant
    with pytest.raises(AttributeError, match="shm_allreduce_enabled"):
        getattr(config, name)
    with pytest.raises(AttributeError, match="has no attribute 'nope'"):
        config.nope


def test_values_compare_by_value_not_identity():
    # what the environment holds are fresh strings, not the module's constants
    env = {"TPKIT_CP": "4", "TPKIT_CP_COMM_TYPE": "".join(["p", "2p"]), "TPKIT_CP_A2A_SIZE": "2"}
    with pytest.raises(ValueError) as e:
        ParallelConfig.from_env(env)
    assert str(e.value).endswith("[cp_a2a_size=2 from $TPKIT_CP_A2A_SIZE; tpkit-launch "
                                 "exports $TPKIT_*, or your shell set them]")
    assert ParallelConfig(tp=1000, etp=int("1000")).has_experts is False
    assert ParallelConfig.from_env({"TPKIT_TP": "300", "TPKIT_ETP": "300"}).has_experts is False
