"""Register the optimum-dmx backend with transformers when transformers' quantizer registry is imported.

transformers has no plug-in discovery for quantization methods: a checkpoint whose config.json says
``quant_method: "dmx"`` is loaded as a plain float model (with only a logged warning) unless
``optimum_dmx`` was imported first. To make such loads just work, the installed package ships
``optimum_dmx_autoregister.pth``, whose single line calls :func:`install` at interpreter start-up.

:func:`install` only puts a finder at the front of ``sys.meta_path``; nothing heavy is imported, so
start-up stays as fast as without it. The finder ignores every import except
``transformers.quantizers.auto``; once that module has run, it imports ``optimum_dmx.integration.hf_quantizer``,
whose import registers quant_method ``"dmx"``, and removes itself. If that cannot be imported the error is raised
there, never swallowed: a dMX checkpoint must not load silently as a wrong model.

Set ``OPTIMUM_DMX_NO_AUTOREGISTER=1`` to switch the hook off at start-up; ``import optimum_dmx`` then puts the same
finder in place (or registers at once, when transformers' quantizer registry is already imported).
"""

import importlib
import os
import sys

TRIGGER = "transformers.quantizers.auto"
REGISTRAR = "optimum_dmx.integration.hf_quantizer"  # importing it registers quant_method "dmx"


class _RegisterAfterExec:
    """Wraps the trigger module's loader: runs it, then imports the module that registers the backend."""

    def __init__(self, loader):
        self._loader = loader

    def __getattr__(self, name):
        return getattr(self._loader, name)

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        importlib.import_module(REGISTRAR)


class AutoRegisterFinder:
    """Meta-path finder that acts once, on the import of ``transformers.quantizers.auto``."""

    @classmethod
    def find_spec(cls, fullname, path=None, target=None):
        if fullname != TRIGGER:
            return None
        sys.meta_path.remove(cls)
        for finder in sys.meta_path:
            find_spec = getattr(finder, "find_spec", None)
            spec = find_spec(fullname, path, target) if find_spec is not None else None
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _RegisterAfterExec(spec.loader)
                return spec
        return None


def install(at_startup=True):
    """Put :class:`AutoRegisterFinder` first on ``sys.meta_path`` (once; at start-up, a no-op when switched off by
    ``OPTIMUM_DMX_NO_AUTOREGISTER``; ``import optimum_dmx`` calls it with ``at_startup=False``)."""
    if at_startup and os.environ.get("OPTIMUM_DMX_NO_AUTOREGISTER", "") not in ("", "0"):
        return
    if AutoRegisterFinder not in sys.meta_path and TRIGGER not in sys.modules:
        sys.meta_path.insert(0, AutoRegisterFinder)
