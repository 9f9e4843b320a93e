"""The refusal of an example script's option: a ``ValueError`` where the script raises it itself, or, where the
argument dataclasses refuse it, a one-line usage error (exit status 2, the message on stderr)."""

from __future__ import annotations

import contextlib
import re

import pytest


@contextlib.contextmanager
def refused(capsys: pytest.CaptureFixture, match: str):
    """Expect the block to refuse its options with a message that matches ``match``."""
    with pytest.raises((ValueError, SystemExit)) as caught:
        yield
    if isinstance(caught.value, SystemExit):
        error = capsys.readouterr().err
        assert caught.value.code == 2 and re.search(match, error) and "Traceback" not in error, error
    else:
        assert re.search(match, str(caught.value)), caught.value
