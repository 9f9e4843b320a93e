"""The documentation: the README's quickstart runs, and the site builds under ``mkdocs build --strict``.

The strict build fails on a broken link or anchor, on a ``:::`` block whose object is gone, and on griffe's warnings
about the docstrings it renders (a documented parameter the signature lacks, a section that does not parse), so a
docstring that stops matching its function fails here. On top of the build: every public name of
``hf_xformers.__all__`` has an API entry, and every committed benchmark plot is shown on some page.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import json  # noqa: E402
import re  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import zlib  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import yaml  # noqa: E402
from transformers import RobertaConfig, RobertaForMaskedLM  # noqa: E402

import hf_xformers  # noqa: E402
from tests.test_conversion import SOURCE_TOKENS, TINY, perturb_  # noqa: E402
from tests.test_doc_examples import public_model_classes  # noqa: E402
from tests.tiny_tokenizers import roberta_tokenizer  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
# The README is the front door; the documentation lives in docs/ (issue 42).
README_MAX_LINES = 150
# The checkpoint folder the quickstart converts; the test puts a tiny local RoBERTa there.
QUICKSTART_SOURCE = '"path/to/roberta-base"'
BUILD_ENV = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "HF_HUB_OFFLINE": "1"}


def readme_section(name: str) -> str:
    """The text between README's ``<!-- --8<-- [start:name] -->`` and ``[end:name]`` markers (the snippets the site
    includes)."""
    text = README.read_text(encoding="utf-8")
    match = re.search(rf"<!-- --8<-- \[start:{name}\] -->\n(.*?)<!-- --8<-- \[end:{name}\] -->", text, re.S)
    assert match, f"README.md has no [start:{name}] ... [end:{name}] section"
    return match.group(1)


def quickstart_code() -> str:
    blocks = re.findall(r"```python\n(.*?)```", readme_section("quickstart"), re.S)
    assert len(blocks) == 1, "the quickstart section holds one python block"
    return blocks[0]


def test_readme_is_the_front_door():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; move details to docs/"
    text = "\n".join(lines)
    # CI runs `make test` (.ci/run), the README's test command; both set-up commands stay in the README.
    assert "make test" in text and "make demo" in text
    assert "make test" in (REPO / ".ci" / "run").read_text()
    # Every page the README links to exists.
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text):
        if "://" not in target:
            assert (REPO / target).exists(), f"README.md links to {target}, which does not exist"


def test_readme_quickstart_runs(tmp_path, monkeypatch, capsys):
    """The quickstart as written, with a tiny local RoBERTa in place of ``path/to/roberta-base``: it converts, loads
    the result with AutoModel, runs 4,096 tokens through it and trains one Trainer step."""
    tokenizer = roberta_tokenizer()
    torch.manual_seed(0)
    source = tmp_path / "roberta"
    config = RobertaConfig(vocab_size=len(tokenizer), max_position_embeddings=SOURCE_TOKENS + 2, **TINY)
    perturb_(RobertaForMaskedLM(config)).save_pretrained(source)
    tokenizer.save_pretrained(source)

    code = quickstart_code()
    assert code.count(QUICKSTART_SOURCE) == 1, "the quickstart converts from path/to/roberta-base"
    code = code.replace(QUICKSTART_SOURCE, repr(str(source)))
    monkeypatch.chdir(tmp_path)  # the quickstart writes roberta-4096/ and out/ into the working directory
    namespace: dict = {"__name__": "readme_quickstart"}
    exec(compile(code, str(README), "exec"), namespace)

    # The printed shape: the whole 4,096-token document went through the long model.
    assert f"torch.Size([1, 4096, {TINY['hidden_size']}])" in capsys.readouterr().out
    assert namespace["model"].config.model_type == "hfx-longformer"
    saved = json.loads((tmp_path / "roberta-4096" / "config.json").read_text())
    assert saved["model_type"] == "hfx-longformer"
    # Trainer took a step: the classifier's encoder moved away from the converted weights it was loaded with.
    trained = namespace["classifier"].base_model.state_dict()
    loaded = namespace["model"].state_dict()
    assert any(not torch.equal(trained[key], loaded[key]) for key in loaded if key in trained)


def _inventory(site: Path) -> set[str]:
    """The object names of the site's ``objects.inv`` (Sphinx's format: four header lines, then zlib)."""
    raw = (site / "objects.inv").read_bytes()
    body = zlib.decompress(raw.split(b"\n", 4)[4]).decode()
    return {line.split(" ", 1)[0] for line in body.splitlines() if line}


def _inventory_urls(site: Path) -> dict[str, str]:
    """``{object name: page#anchor}`` of the site's ``objects.inv`` (``$`` in a location stands for the name)."""
    raw = (site / "objects.inv").read_bytes()
    body = zlib.decompress(raw.split(b"\n", 4)[4]).decode()
    urls = {}
    for line in body.splitlines():
        name, _role, _priority, location = line.split(" ", 4)[:4]
        urls[name] = location.replace("$", name) if location.endswith("$") else location
    return urls


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """``mkdocs build --strict`` of the repository's site into a temporary folder (about 15 s on 2 busy cores)."""
    out = tmp_path_factory.mktemp("site")
    start = time.perf_counter()
    run = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=REPO, env=BUILD_ENV, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    seconds = time.perf_counter() - start
    assert run.returncode == 0, f"mkdocs build --strict failed:\n{run.stdout}\n{run.stderr}"
    assert "WARNING" not in run.stderr, run.stderr
    print(f"mkdocs build --strict: {seconds:.1f} s")
    return out


def _nav_pages(entries) -> set[str]:
    pages = set()
    for entry in entries:
        values = entry.values() if isinstance(entry, dict) else [entry]
        for value in values:
            pages |= _nav_pages(value) if isinstance(value, list) else {value}
    return pages


def test_site_builds_strict_with_every_page(site):
    pages = _nav_pages(yaml.safe_load((REPO / "mkdocs.yml").read_text())["nav"])
    assert len(pages) >= 30
    for page in pages:
        assert (site / page.replace(".md", ".html")).is_file(), page
    # The README's sections are included on the site, not copied.
    assert "roberta-4096" in (site / "index.html").read_text()
    assert "hfx-universal" in (site / "architectures" / "index.html").read_text()


def test_every_public_name_has_an_api_entry(site):
    documented = _inventory(site)
    missing = []
    for name in hf_xformers.__all__:
        obj = getattr(hf_xformers, name)
        if isinstance(obj, type) or callable(obj):
            path = f"{obj.__module__}.{obj.__qualname__}"
        else:  # data: ARCHITECTURES (models/__init__.py), REGISTRY (registration.py)
            path = {
                "ARCHITECTURES": "hf_xformers.models.ARCHITECTURES",
                "REGISTRY": "hf_xformers.registration.REGISTRY",
            }[name]
        if path not in documented:
            missing.append(path)
    assert not missing, f"hf_xformers.__all__ names without a ::: block in docs/api/ or docs/architectures/: {missing}"


def test_every_benchmark_plot_is_shown(site):
    shown = set()
    for page in site.rglob("*.html"):
        for src in re.findall(r'<img[^>]+src="([^"]+\.png)"', page.read_text(encoding="utf-8")):
            shown.add((page.parent / src).resolve())
    plots = sorted((REPO / "benchmarks" / "results").rglob("*.png"))
    assert plots
    for plot in plots:
        copy = site / plot.relative_to(REPO)
        assert copy.is_file(), f"{plot.relative_to(REPO)} is not in the site (docs/hooks.py adds the plots)"
        assert copy.resolve() in shown, f"no page shows {plot.relative_to(REPO)}"


def test_every_benchmark_table_is_shown(site):
    """Every committed result table (``benchmarks/results/**/*.md``) is on a results page, beside its plot, through
    a ``<!-- benchmark-result: NAME -->`` line that docs/hooks.py expands."""
    results = REPO / "benchmarks" / "results"
    shown = {}
    for page in (REPO / "docs").rglob("*.md"):
        for name in re.findall(r"^<!-- benchmark-result: ([\w./-]+) -->$", page.read_text(encoding="utf-8"), re.M):
            shown[name] = page.relative_to(REPO / "docs")
    tables = sorted(path.relative_to(results).with_suffix("").as_posix() for path in results.rglob("*.md"))
    assert tables
    missing = [name for name in tables if name not in shown]
    assert not missing, f"benchmark results on no page (add a benchmark-result line to docs/results/): {missing}"
    for name, page in shown.items():
        html = (site / page.with_suffix(".html")).read_text(encoding="utf-8")
        # The table's first data row is on the built page, and the marker itself is gone.
        first_row = next(
            line for line in (results / f"{name}.md").read_text(encoding="utf-8").splitlines() if line.startswith("| ")
        )
        first_cell = first_row.strip("|").split("|")[0].strip().strip("`")
        assert first_cell in html, f"{page}: the table of {name} is not on the page"
        assert f"benchmark-result: {name}" not in html


def test_header_shows_the_version(site):
    version = re.search(r'^version = "([^"]+)"', (REPO / "pyproject.toml").read_text(), re.M).group(1)
    index = (site / "index.html").read_text(encoding="utf-8")
    assert f"hf_xformers {version}" in index
    # The changelog page is CHANGELOG.md, included (one source).
    changelog = (site / "changelog.html").read_text(encoding="utf-8")
    assert "Unreleased" in changelog and version in changelog


def test_strict_build_fails_on_a_docstring_that_does_not_match_its_signature(tmp_path):
    """The repository's mkdocstrings settings and hooks, on a module whose docstring documents a parameter the
    function does not have: the strict build must fail and name it (so such docstrings in hf_xformers fail the site
    build above)."""
    config = yaml.safe_load((REPO / "mkdocs.yml").read_text())
    (tmp_path / "docs").mkdir()
    (tmp_path / "stale_doc.py").write_text(
        'def resize(length: int) -> int:\n    """Resize.\n\n    Args:\n        length: the new length.\n'
        '        width: a parameter the signature lost.\n    """\n    return length\n'
    )
    (tmp_path / "docs" / "index.md").write_text("# Stale\n\n::: stale_doc.resize\n")
    plugins = [p for p in config["plugins"] if isinstance(p, dict) and "mkdocstrings" in p]
    plugins[0]["mkdocstrings"]["handlers"]["python"]["paths"] = [str(tmp_path)]
    small = {
        "site_name": "stale",
        "strict": True,
        "theme": config["theme"],
        "hooks": [str(REPO / "docs" / "hooks.py")],
        "markdown_extensions": config["markdown_extensions"],
        "plugins": plugins,
    }
    (tmp_path / "mkdocs.yml").write_text(yaml.safe_dump(small))
    run = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict"],
        cwd=tmp_path, env=BUILD_ENV, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode != 0
    assert "Parameter 'width' does not appear in the function signature" in run.stderr


# Helpers of a model's base class that its page must not show: they are how the model works, not how it is used.
INTERNAL_METHODS = (
    "prepare_attention_inputs", "attention_factory", "packed_batch", "packed_position_ids", "head_logits",
    "head_loss", "head_input_size", "causal_config", "encode",
)  # fmt: skip


def test_every_model_and_head_page_shows_forward_and_an_example(site):
    """Issue 47: each public model and head class documents its ``forward`` on its own page (inherited or not) and
    shows an example there (the examples run in tests/test_doc_examples.py); internal helpers stay off the page."""
    urls = _inventory_urls(site)
    classes = public_model_classes()
    for cls in classes:
        path = f"{cls.__module__}.{cls.__qualname__}"
        page, anchor = urls[path].split("#")
        assert page.startswith("api/"), f"{path} is documented on {page}, not on an API page"
        assert urls.get(f"{path}.forward", "").split("#")[0] == page, f"{page} shows no forward for {path}"
        html = (site / page).read_text(encoding="utf-8")
        start = html.index(f'id="{anchor}"')
        end = html.find('class="doc doc-object doc-class"', start)
        section = html[start : end if end > 0 else len(html)]
        assert "Examples:" in section and "&gt;&gt;&gt;" in section, f"{page}: {path} shows no example"
        assert "Parameters:" in section, f"{page}: the forward of {path} lists no parameters"
        shown = [m for m in INTERNAL_METHODS if f"{path}.{m}" in urls]
        assert not shown, f"{page} shows internal helpers of {path}: {shown}"


def test_docstring_roles_link_to_documented_objects(site):
    """A ``:class:`` role with a full path becomes a link where the site documents the target (docs/hooks.py), and
    plain code where it does not; no role syntax is left on a page."""
    html = (site / "api" / "longformer.html").read_text(encoding="utf-8")
    # The heads' shared forward names the packed-batch keywords by their class, documented on the packing page.
    assert 'href="packing.html#hf_xformers.ops.packing.CuSeqLensKwargs"><code>CuSeqLensKwargs</code></a>' in html
    for page in (site / "api").glob("*.html"):
        text = page.read_text(encoding="utf-8")
        assert ":class:<code>" not in text and "<autoref" not in text, page.name
