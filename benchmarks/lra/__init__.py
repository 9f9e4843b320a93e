"""Long Range Arena for the hf_xformers architectures: the data (``data``, the index of the five task modules
``listops``, ``text``, ``retrieval``, ``image``, ``pathfinder`` and their shared ``task_data``), the models
(``models``) and the CLI (``run``: ``python -m benchmarks.lra.run --help``)."""
