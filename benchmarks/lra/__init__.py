"""Long Range Arena for the hf_xformers architectures: data (``data``), models (``models``) and the CLI (``run``)."""
