"""Install the fake ``transformer_engine`` (tests/fake_te) into ``sys.modules`` and out again.

Loaded from its files by importlib, never through ``sys.path``, so nothing else in the
session can import it by accident. Usable in pytest (``fake_te`` fixture) and in
multi-rank workers (call ``install()``/``uninstall()`` inside the rank function).
Also the ``cuda`` fixture (tpkit.te believes CUDA is there; streams are plain objects)
and ``fake_state`` (a tp=2, cp=2, SP state of an 8-rank world on the fake process group).
"""
from __future__ import annotations

import importlib.util
import os
import sys

import pytest

import tpkit.te

FAKE_ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fake_te")
NAMES = ("transformer_engine", "transformer_engine.pytorch", "transformer_engine.common",
         "transformer_engine.common.recipe", "transformer_engine.pytorch.quantization",
         "transformer_engine.pytorch.distributed")


def _load(name: str, path: str, parent=None):
    spec = importlib.util.spec_from_file_location(
        name, os.path.join(path, "__init__.py"), submodule_search_locations=[path])
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    if parent is not None:
        setattr(parent, name.rsplit(".", 1)[1], module)
    return module


def install():
    """Put the fake package in sys.modules; returns its ``transformer_engine.pytorch``."""
    assert not any(n in sys.modules for n in NAMES), "transformer_engine already imported"
    root = os.path.join(FAKE_ROOT, "transformer_engine")
    top = _load("transformer_engine", root)
    common = _load("transformer_engine.common", os.path.join(root, "common"), top)
    _load("transformer_engine.common.recipe", os.path.join(root, "common", "recipe"), common)
    return _load("transformer_engine.pytorch", os.path.join(root, "pytorch"), top)


def uninstall() -> None:
    for name in NAMES:
        sys.modules.pop(name, None)


@pytest.fixture
def fake_te():
    te = install()
    try:
        yield te
    finally:
        uninstall()


@pytest.fixture
def cuda(monkeypatch):
    """Pretend CUDA is available (only tpkit.te's check; no CUDA call is made)."""
    monkeypatch.setattr(tpkit.te, "_cuda_available", lambda: True)
    created = []
    monkeypatch.setattr(tpkit.te, "_new_cuda_stream",
                        lambda: created.append(object()) or created[-1])
    return created  # the "streams" tpkit.te created


@pytest.fixture
def fake_state():
    """The state rank 1 of a tp=2, cp=2, dp=2 world with SP builds, on the fake PG."""
    from tpkit import ParallelConfig
    from tpkit.layout.planning import build_fake_state, destroy_fake_state
    state = build_fake_state(ParallelConfig(tp=2, cp=2, sequence_parallel=True), 8, rank=1)
    yield state
    destroy_fake_state(state)
