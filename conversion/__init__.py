"""Checkpoint conversion tools.

* :func:`~conversion.convert_roberta_to_long.convert_roberta_to_long` turns a short-context RoBERTa/BERT encoder
  into a long-context hf_xformers model (Longformer recipe: tiled position table, copied global projections).
* :func:`~conversion.convert_from_transformers.convert_from_transformers` imports a checkpoint of one of
  ``transformers``' own efficient architectures into the matching hf_xformers class.

Both are also command-line scripts (``python conversion/<name>.py --help``).
"""

from .convert_from_transformers import IMPORTERS, convert_from_transformers
from .convert_roberta_to_long import TARGETS, convert_roberta_to_long

__all__ = ["IMPORTERS", "TARGETS", "convert_from_transformers", "convert_roberta_to_long"]
