"""MkDocs hooks of the documentation site (``mkdocs.yml``: ``hooks``).

* The benchmark plots stay where the benchmarks write them (``benchmarks/results/**/*.png``); this hook adds them to
  the site at the same relative path, so a page links ``benchmarks/results/<name>.png`` and ``--strict`` checks the
  link like any other, without a second copy of the plots in git.
* griffe cannot read the architectures' ``__all__`` (``["ARCHITECTURE", *ARCHITECTURE.exports]``, built from each
  declaration) and warns once per architecture; under ``--strict`` that would fail every build although nothing in
  the documentation is wrong. Only that message, for those modules, is dropped: every other griffe warning (a
  documented parameter the signature lacks, a docstring section that does not parse) still fails the build.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

from mkdocs.structure.files import File, Files

REPO = Path(__file__).resolve().parents[1]
PLOTS = REPO / "benchmarks" / "results"


class _DynamicAllFilter(logging.Filter):
    """Drops griffe's "Unsupported item in hf_xformers.models.<arch>.__all__: exports" warning."""

    def filter(self, record: logging.LogRecord) -> bool:
        # mkdocstrings' logger adapter puts "griffe: " in front of griffe's format string.
        if "Unsupported item in %s.__all__" not in str(record.msg) or len(record.args or ()) != 2:
            return True
        module, item = record.args
        return not (str(module).startswith("hf_xformers.models.") and str(item).endswith("exports"))


_FILTER = _DynamicAllFilter()
# griffe's messages reach MkDocs through this logger once mkdocstrings' python handler has patched griffe's loggers.
for name in ("mkdocs.plugins.griffe", "griffe"):
    if _FILTER not in logging.getLogger(name).filters:
        logging.getLogger(name).addFilter(_FILTER)


def benchmark_plots() -> list[Path]:
    """Every plot under ``benchmarks/results/``, sorted."""
    return sorted(PLOTS.rglob("*.png"))


def on_files(files: Files, config) -> Files:
    for path in benchmark_plots():
        uri = path.relative_to(REPO).as_posix()
        if files.get_file_from_path(uri) is None:
            files.append(File.generated(config, uri, abs_src_path=str(path)))
    return files


# The docstrings cross-reference in Sphinx's roles (":class:`X`", ":func:`~pkg.mod.f`"), which Markdown renders as
# the role's name followed by the code span; the site shows the code span alone (with "~", the last name only), as a
# link where the role names a full path that the site documents (mkdocs-autorefs resolves `optional` references once
# every page is built, and leaves the others plain text without a warning).
_SPHINX_ROLE = re.compile(r":(?:py:)?(?:class|func|meth|mod|data|attr|exc|obj):<code>(~?)([^<]*)</code>")


def _role(match: re.Match) -> str:
    target = match.group(2)
    code = f"<code>{target.rsplit('.', 1)[-1] if match.group(1) else target}</code>"
    if target.startswith("hf_xformers."):
        return f'<autoref identifier="{target}" optional>{code}</autoref>'
    return code


def on_page_content(html: str, page, config, files) -> str:
    return _SPHINX_ROLE.sub(_role, html)
