"""GPU-only check of issue 48's generate defect (``python -m pytest -m gpu``; skipped on
CPU with the reason): generate(generator=<a CPU generator>) on a CUDA model draws the CPU
generator's numbers (the text a CPU run with the same seed gets; torch.multinomial
refuses a generator of another device). The other CUDA defects of issue 48 are caught on
CPU: tests/test_cuda_autocast.py (CUDA's autocast rules), tests/nn/test_cp_cuda_like.py
(a block op that needs its forward's state), tests/test_host_conversion.py (.numpy()).
"""
from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs an NVIDIA GPU (run `python -m pytest -m gpu` "
                                          "on a GPU machine)")]


def test_draw_with_a_cpu_generator_on_cuda():
    from tpkit.models.generate import _draw
    probs = torch.rand(4, 50).softmax(-1)
    want = torch.multinomial(probs, 1, generator=torch.Generator().manual_seed(3))[:, 0]
    got = _draw(probs.cuda(), torch.Generator().manual_seed(3))
    assert got.device.type == "cuda" and torch.equal(got.cpu(), want)
