"""Build hook: install ``optimum_dmx_autoregister.pth`` at the root of site-packages.

Everything else is declared in pyproject.toml. The .pth file makes checkpoints with quant_method
"dmx" load without importing optimum_dmx first (see ``optimum_dmx_autoregister.py``). pyproject.toml
cannot place a file outside the packages, so ``build_py`` copies it: into the wheel for a regular
install, and next to the editable-install finder for ``pip install -e``.
"""

import os

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = "optimum_dmx_autoregister.pth"


class BuildPyWithPth(build_py):
    def run(self):
        super().run()
        # An editable build installs from the `install` command's staging directory, not from build_lib.
        root = self.get_finalized_command("install").install_lib if self.editable_mode else self.build_lib
        self.copy_file(PTH, os.path.join(root, PTH), preserve_mode=False)

    def get_outputs(self, include_bytecode=True):
        return [*super().get_outputs(include_bytecode), os.path.join(self.build_lib, PTH)]


setup(cmdclass={"build_py": BuildPyWithPth})
