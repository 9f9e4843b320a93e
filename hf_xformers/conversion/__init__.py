"""Checkpoint conversion: the converters, importable from the installed package.

* :func:`hf_xformers.conversion.convert_roberta_to_long.convert_roberta_to_long` turns a short-context RoBERTa/BERT
  encoder into a long-context hf_xformers model (Longformer recipe: tiled position table, copied global projections).
* :func:`hf_xformers.conversion.convert_from_transformers.convert_from_transformers` imports a checkpoint of one of
  ``transformers``' own efficient architectures into the matching hf_xformers class.

Both are also command-line programs (``python -m hf_xformers.conversion.<name> --help``). The top-level
``conversion/`` folder of the repository keeps its old import paths and scripts as thin wrappers of these modules.
This package imports neither on its own: ``python -m`` would otherwise find the script already imported under its
package name and run a second copy of it as ``__main__``.
"""
