"""Example scripts, run from the repository root as modules (``python -m examples.run_glue --help``) or as files
from any folder (``python path/to/examples/run_glue.py --help``).

``utils_examples`` holds what the Trainer scripts share; each ``run_*`` module is one script.
"""
