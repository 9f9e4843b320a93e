from . import longformer

__all__ = ["longformer"]
