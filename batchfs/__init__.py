"""batchfs: feed map-style training loaders from object storage, a batch at a time.

Importing this package is cheap and never imports torch, pyfuse3 or trio.
"""

__version__ = "0.1.0"

_LAZY = {"read_batch": "batchfs.sampler", "EpochSampler": "batchfs.sampler", "PlanSampler": "batchfs.sampler",
         "epoch_order": "batchfs.sampler"}


def __getattr__(name: str):
    """``batchfs.read_batch`` and the samplers, imported on first use (nothing heavy at import)."""
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'batchfs' has no attribute {name!r}")
