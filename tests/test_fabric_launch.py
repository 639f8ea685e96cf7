"""Fabric(strategy="tpkit") under tpkit-launch: the layout comes from TPKIT_*."""
import json
import os
import subprocess
import sys

import pytest

from fabric_helpers import reference_losses

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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
    with pytest.raises(ValueError, match="pp=2.*no pipeline"):
        tpkit.fabric.TPKitStrategy(pp=2)


def test_training_under_tpkit_launch(tmp_path):
    out = tmp_path / "out.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.path.join(ROOT, "tests")]),
           "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "tpkit.cli.launch", "--standalone", "--nproc-per-node", "4",
           "--tp", "2", "--sequence-parallel", "--backend", "gloo",
           os.path.join(ROOT, "tests", "fabric_launch_script.py"), str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["layout"] == [2, 1, 2, True]
    ref, _ = reference_losses(3, lr=0.05, clip=0.5)
    assert result["losses"] == pytest.approx(ref, rel=1e-5)


def test_training_under_fabrics_own_launcher(tmp_path):
    """``python script.py``: Fabric's subprocess launcher starts rank 1; layout from TPKIT_*."""
    out = tmp_path / "out.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.path.join(ROOT, "tests")]),
           "OMP_NUM_THREADS": "1", "FABRIC_DEVICES": "2", "TPKIT_TP": "2",
           "TPKIT_SEQUENCE_PARALLEL": "1", "MASTER_PORT": str(_free_port())}
    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        env.pop(var, None)
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "fabric_launch_script.py"),
                           str(out)], env=env, capture_output=True, text=True, timeout=240,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["layout"] == [2, 1, 1, True]
    ref, _ = reference_losses(3, lr=0.05, clip=0.5)
    assert result["losses"] == pytest.approx(ref, rel=1e-5)


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
