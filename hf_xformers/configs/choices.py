"""Option values that both a configuration and the module it configures check.

Kept apart from the modules so that configurations stay free of torch (as transformers keeps its configuration
files): ``configuration_performer.py`` validates ``favor_kernel`` against the same tuple that
``attention/favor.py`` dispatches on, without importing it. Options that only a configuration reads live in that
configuration's file.
"""

from __future__ import annotations

# attention/favor.py: the FAVOR+ feature maps (positive softmax features, or ReLU features).
FAVOR_KERNELS: tuple[str, ...] = ("softmax", "relu")
# attention/low_rank.py: which Linformer projections are shared (none, across heads, keys with values, across layers).
LINFORMER_SHARING_MODES: tuple[str, ...] = ("none", "headwise", "kv", "layerwise")

__all__ = ["FAVOR_KERNELS", "LINFORMER_SHARING_MODES"]
