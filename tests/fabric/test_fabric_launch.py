"""The strategy name "tpkit" and its layout from TPKIT_*. Fabric(strategy="tpkit") launched
by tpkit-launch and by Fabric's own launcher is test_fabric_conformance's."""
import pytest


def test_registered_name_and_env_layout(monkeypatch):
    import tpkit.fabric
    from lightning.fabric.strategies import STRATEGY_REGISTRY
    assert "tpkit" in STRATEGY_REGISTRY
    monkeypatch.setenv("TPKIT_TP", "2")
    monkeypatch.setenv("TPKIT_SEQUENCE_PARALLEL", "1")
    s = STRATEGY_REGISTRY.get("tpkit")
    assert isinstance(s, tpkit.fabric.TPKitStrategy)
    assert (s.config.tp, s.config.cp, s.config.sequence_parallel) == (2, 1, True)
    assert tpkit.fabric.TPKitStrategy(tp=4).config.tp == 4  # arguments win over env
    with pytest.raises(ValueError, match="sequence_parallel=True needs tp >= 2"):
        tpkit.fabric.TPKitStrategy(tp=1)
    with pytest.raises(ValueError, match="data_parallel='zero'"):
        tpkit.fabric.TPKitStrategy(data_parallel="zero")
    tpkit.fabric.TPKitStrategy(pp=2, data_parallel="fsdp")   # FSDP2 in the stages (issue 54)

