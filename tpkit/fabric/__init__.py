"""Lightning Fabric integration: TPKitStrategy and TPKitPrecision.

Importing this package registers the strategy name ``"tpkit"`` in Lightning's
STRATEGY_REGISTRY, so ``Fabric(strategy="tpkit")`` works after ``import tpkit.fabric``.
"""
from lightning.fabric.strategies import STRATEGY_REGISTRY

from .precision import TPKitPrecision
from .strategy import TPKitStrategy

if "tpkit" not in STRATEGY_REGISTRY:
    TPKitStrategy.register_strategies(STRATEGY_REGISTRY)

__all__ = ["TPKitStrategy", "TPKitPrecision"]
