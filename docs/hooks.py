"""MkDocs hooks of the documentation site (``mkdocs.yml``: ``hooks``).

* The benchmark plots stay where the benchmarks write them (``benchmarks/results/**/*.png``); this hook adds them to
  the site at the same relative path, so a page links ``benchmarks/results/<name>.png`` and ``--strict`` checks the
  link like any other, without a second copy of the plots in git.
* Benchmark result pages show every committed table beside its plot without a copy: a line
  ``<!-- benchmark-result: NAME -->`` (``NAME`` relative to ``benchmarks/results/``, without ``.md``) becomes the
  plot ``NAME.png``, when there is one, followed by the table ``NAME.md`` without its title and with its sections two
  levels down (h4), under the page's own ``##`` heading.
* The header shows the package's version (pyproject.toml's ``version``) after the site name, so a reader knows which
  release a page describes; CHANGELOG.md, shown as the Changelog page, says what each release holds.
* griffe cannot read the architectures' ``__all__`` (``["ARCHITECTURE", *ARCHITECTURE.exports]``, built from each
  declaration) and warns once per architecture; under ``--strict`` that would fail every build although nothing in
  the documentation is wrong. Only that message, for those modules, is dropped: every other griffe warning (a
  documented parameter the signature lacks, a docstring section that does not parse) still fails the build.
"""

from __future__ import annotations

import logging
import posixpath
import re
from pathlib import Path

from mkdocs.structure.files import File, Files

REPO = Path(__file__).resolve().parents[1]
PLOTS = REPO / "benchmarks" / "results"


def package_version() -> str:
    """``version`` of pyproject.toml's ``[project]`` table (read as text: tomllib is Python 3.11+)."""
    text = (REPO / "pyproject.toml").read_text(encoding="utf-8")
    match = re.search(r'^version\s*=\s*"([^"]+)"', text, re.M)
    if match is None:
        raise ValueError('pyproject.toml has no version = "..." line; the docs header shows it')
    return match.group(1)


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


def on_config(config):
    config.site_name = f"{config.site_name} {package_version()}"
    return config


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


RESULT_MARKER = re.compile(r"^<!-- benchmark-result: ([\w./-]+) -->$", re.M)


def result_markers(markdown: str) -> list[str]:
    """The result names that ``markdown``'s ``<!-- benchmark-result: NAME -->`` lines show."""
    return RESULT_MARKER.findall(markdown)


def _result_block(name: str, page_uri: str) -> str:
    table = PLOTS / f"{name}.md"
    if not table.is_file():
        raise ValueError(f"{page_uri} shows benchmark result {name!r}, but benchmarks/results/{name}.md does not exist")
    parts = []
    plot = PLOTS / f"{name}.png"
    if plot.is_file():
        link = posixpath.relpath(plot.relative_to(REPO).as_posix(), posixpath.dirname(page_uri) or ".")
        parts.append(f"![{posixpath.basename(name)}]({link})")
    body = table.read_text(encoding="utf-8")
    # The page's own `## ` heading names the result: the table's title goes, and its sections move two levels down
    # (h4: out of the table of contents, which lists the results, not every mode of each).
    body = re.sub(r"\A# [^\n]*\n", "", body)
    body = re.sub(r"^(#{2,4}) ", lambda m: m.group(1) + "## ", body, flags=re.M)
    parts.append(body.strip())
    parts.append(f"*Source: `benchmarks/results/{name}.md`.*")
    return "\n\n".join(parts)


def on_page_markdown(markdown: str, page, config, files) -> str:
    return RESULT_MARKER.sub(lambda m: _result_block(m.group(1), page.file.src_uri), markdown)


def on_page_content(html: str, page, config, files) -> str:
    return _SPHINX_ROLE.sub(_role, html)
