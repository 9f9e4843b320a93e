"""Wrapper of :mod:`hf_xformers.conversion.sentence_transformers_modules` (the code lives in the package, so that it ships in the wheel)."""

import importlib
import sys

# import_module, not `from hf_xformers.conversion import sentence_transformers_modules`: the package exports functions under some module names.
_module = importlib.import_module("hf_xformers.conversion.sentence_transformers_modules")

if __name__ == "__main__":
    if hasattr(_module, "main"):
        _module.main()
else:
    sys.modules[__name__] = _module
