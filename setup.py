"""Build hook: ship the model-card templates (``model_cards/*.md``) inside the package.

The templates live at the top of the repository (contributors edit them there); ``hf_xformers.card`` needs them
after a plain ``pip install`` too, so wheels carry a copy in ``hf_xformers/model_cards/``. An editable install or a
source checkout reads them from the repository instead (``hf_xformers.card.TEMPLATE_DIRS``). Everything else about
the build is in pyproject.toml.
"""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent


class BuildPyWithModelCards(build_py):
    """``build_py`` that also copies ``model_cards/*.md`` into ``hf_xformers/model_cards/`` of the build."""

    def run(self) -> None:
        super().run()
        target = Path(self.build_lib) / "hf_xformers" / "model_cards"
        self.mkpath(str(target))
        for card in sorted((ROOT / "model_cards").glob("*.md")):
            self.copy_file(str(card), str(target / card.name))


setup(cmdclass={"build_py": BuildPyWithModelCards})
