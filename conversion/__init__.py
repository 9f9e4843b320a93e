"""The repository's conversion scripts: thin wrappers of :mod:`hf_xformers.conversion`, kept beside the library as
transformers keeps its ``convert_*`` scripts (``python -m conversion.<name> --help`` from the repository root).

``conversion.<name>`` is the same module object as ``hf_xformers.conversion.<name>``, so old imports keep working.
"""
