"""TPKitPrecision takes Lightning's MixedPrecision arguments: a given ``scaler`` is the
one "16-mixed" scales the loss with (the refusals of ``device``, ``weights_dtype`` and a
scaler for another precision are rows of tests/test_bad_input.py)."""
import torch

from tpkit.fabric import TPKitPrecision


def test_given_scaler_scales_the_loss():
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)   # the default starts at 2**16
    p = TPKitPrecision("16-mixed", scaler=scaler)
    assert p.scaler is scaler
    w = torch.ones(2, requires_grad=True)
    p.backward((w * 3).sum(), None)
    assert torch.equal(w.grad, torch.full((2,), 12.0))
    assert TPKitPrecision("16-mixed").scaler is not scaler
