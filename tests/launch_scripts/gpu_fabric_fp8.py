"""GPU only (tests/test_gpu.py launches it with tpkit-launch): Fabric + TPKitStrategy +
TPKitPrecision("fp8") on a model of TE-backed tpkit layers. Asserts that every forward of
the TE layer ran with TE's fp8 enabled and the state's amax group, and that TE's delayed
scales moved off their initial 1; prints "FABRIC FP8 OK" last."""
import torch
from lightning.fabric import Fabric
from torch import nn
from transformer_engine.pytorch.quantization import FP8GlobalStateManager

from tpkit.fabric import TPKitPrecision, TPKitStrategy
from tpkit.nn import TransformerLayer

fabric = Fabric(accelerator="cuda", devices=1, strategy=TPKitStrategy(),
                plugins=[TPKitPrecision("fp8", fallback_compute_dtype=torch.bfloat16)])
fabric.launch()
state = fabric.strategy.parallel_state
model = nn.Sequential(*[TransformerLayer(256, 1024, 4, normalization="RMSNorm", backend="te")
                        for _ in range(2)])
seen = []
model[0].register_forward_pre_hook(lambda m, a: seen.append(
    (FP8GlobalStateManager.is_fp8_enabled(),
     FP8GlobalStateManager.get_fp8_group() is state.amax_group)))
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
model, opt = fabric.setup(model, opt)
losses = []
for step in range(4):
    x = torch.randn(128, 4, 256, device=fabric.device)
    loss = model(x).float().pow(2).mean()
    fabric.backward(loss)
    opt.step()
    opt.zero_grad()
    losses.append(loss.item())
assert len(seen) == 4 and all(a and b for a, b in seen), seen
# the GEMM modules (TE's attention core has fp8 metadata too but stays bf16 without fp8_dpa)
metas = [m.fp8_meta for m in model.modules()
         if type(m).__name__ in ("Linear", "LayerNormLinear", "LayerNormMLP")
         and "scaling_fwd" in getattr(m, "fp8_meta", {})]
assert len(metas) == 6, f"{len(metas)} TE GEMM modules with fp8 metadata, expected 6"
assert all((m["scaling_fwd"].scale != 1).any() for m in metas)
assert all(torch.isfinite(torch.tensor(losses))), losses
print(f"FABRIC FP8 OK losses={[round(v, 4) for v in losses]} te_modules_with_fp8={len(metas)}",
      flush=True)
