"""Build hook: the committed tables and configs ship inside the wheel.

`tables/*.yaml`, `configs/*.yaml` and `configs/priors/*.yaml` are copied into the built package as
`mla_tune/data/tables/` and `mla_tune/data/configs/` (package data), so git keeps one copy
and a `pip install .` outside the checkout finds them (mla_tune/locate.py). An editable
install copies nothing: locate.py reads the checkout's folders. Everything else about the
package is in pyproject.toml.
"""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
# each folder's *.yaml (not the sweeps' results files); configs/priors/ holds the untuned
# priors that `mla-tune export --gpu NAME` writes before any sweep (mla_tune/tables/prior.py)
SHIPPED = ("tables", "configs", "configs/priors")


class BuildPyWithData(build_py):
    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):
            return
        for folder in SHIPPED:
            target = Path(self.build_lib, "mla_tune", "data", folder)
            self.mkpath(str(target))
            for source in sorted((ROOT / folder).glob("*.yaml")):
                self.copy_file(str(source), str(target / source.name))


setup(cmdclass={"build_py": BuildPyWithData})
