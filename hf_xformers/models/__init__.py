from . import bigbird, linformer, longformer, performer, swin, transfo_xl

__all__ = ["bigbird", "linformer", "longformer", "performer", "swin", "transfo_xl"]
