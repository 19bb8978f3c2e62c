"""The package's layering and style: the import contracts and ruff hold, and the inference path stays light."""

import ast
import json
import subprocess

import pytest
from transformers import AutoModelForCausalLM

from optimum_dmx import DMXConfig

from .helpers import REPO_ROOT, cycling_format_map, installed_script, last_json_line, run_python


def test_import_contracts_hold():
    """`lint-imports` checks the one-way layers, acyclic packages and the light inference modules."""
    lint = installed_script("lint-imports") or pytest.fail(
        "import-linter is a test dependency: pip install -e '.[dev]'"
    )
    proc = subprocess.run([lint, "--no-cache"], cwd=REPO_ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "3 kept, 0 broken" in proc.stdout


@pytest.mark.parametrize("command", [["check"], ["format", "--check"]])
def test_the_tree_passes_ruff(command):
    """ruff (pyproject.toml's settings: line length 120, pycodestyle, pyflakes, import order, bugbear, pyupgrade)."""
    ruff = installed_script("ruff") or pytest.fail("ruff is a test dependency: pip install -e '.[dev]'")
    proc = subprocess.run([ruff, *command, "--no-cache", "."], cwd=REPO_ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_importing_the_package_and_the_commands_help_import_neither_torch_nor_transformers():
    """The package's names load on first use (`optimum_dmx.lazy`): `import optimum_dmx` costs no torch, and
    `optimum-dmx quantize --help` (choices listed from the layers that define them) no transformers."""
    code = """
import json, sys
import optimum_dmx
after_import = sorted(m for m in ("torch", "transformers") if m in sys.modules)
from optimum_dmx.cli import main
for argv in (["--help"], ["quantize", "--help"], ["export", "--help"]):
    try:
        main(argv)
    except SystemExit:
        pass
after_help = sorted(m for m in ("transformers", "datasets", "safetensors") if m in sys.modules)
print(json.dumps([after_import, after_help, "DMXConfig" in dir(optimum_dmx), "torch" in sys.modules]))
"""
    after_import, after_help, listed, torch_after_help = last_json_line(run_python(code))
    assert after_import == []
    assert after_help == []
    assert listed  # the lazy names are listed before they load
    assert torch_after_help  # the check above ran the parsers, whose choices come from modules that use torch


@pytest.mark.parametrize("package", ["", "calibration", "export", "integration"])
def test_what_type_checkers_see_is_what_loads_on_first_use(package):
    """A package whose names load on first use (`optimum_dmx.lazy`) imports the same names from the same modules
    under `TYPE_CHECKING`, for type checkers and editors, which do not run `__getattr__`."""
    init = REPO_ROOT / "optimum_dmx" / package / "__init__.py"
    tree = ast.parse(init.read_text())
    exports = next(
        ast.literal_eval(node.value)
        for node in tree.body
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "_EXPORTS"
    )
    checked = next(node for node in tree.body if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING")
    seen = {alias.name: node.module for node in checked.body for alias in node.names if alias.asname == alias.name}
    assert seen == exports


def test_the_packages_names_load_on_first_use_and_an_unknown_one_is_named():
    import optimum_dmx
    from optimum_dmx.formats import quantize_mx
    from optimum_dmx.integration.configuration import DMXConfig as Defined

    assert optimum_dmx.DMXConfig is Defined
    assert optimum_dmx.quantize_mx is quantize_mx
    assert sorted(optimum_dmx.__all__) == optimum_dmx.__all__ and "MXLinear" in optimum_dmx.__all__
    for name in optimum_dmx.__all__:
        assert getattr(optimum_dmx, name) is not None
    with pytest.raises(AttributeError, match="module 'optimum_dmx' has no attribute 'DMXConfg'"):
        optimum_dmx.DMXConfg  # noqa: B018


def test_inspecting_a_checkpoint_does_not_import_transformers_quantizer_registry(tmp_path, tiny_llama_dir):
    """`optimum-dmx inspect` reads config.json and the safetensors files: it loads no model, so it does not import
    transformers' quantizer registry (every installed quantization library: seconds with torchao)."""
    config = DMXConfig(format_map=cycling_format_map(tiny_llama_dir))
    AutoModelForCausalLM.from_pretrained(tiny_llama_dir, quantization_config=config).save_pretrained(tmp_path)
    code = f"""
import json, sys
from optimum_dmx.cli import main
status = main(["inspect", {str(tmp_path)!r}])
print(json.dumps([status, "transformers.quantizers.auto" in sys.modules]))
"""
    proc = run_python(code)
    assert last_json_line(proc) == [0, False]
    assert "MX linears" in proc.stdout  # the summary was printed


@pytest.mark.parametrize("transformers_first", [False, True])
def test_importing_the_package_registers_dmx_before_or_after_transformers(tmp_path, tiny_llama_dir, transformers_first):
    """With the start-up hook switched off, `import optimum_dmx` registers quant_method "dmx": at once when
    transformers' quantizer registry is already imported, otherwise when it is (the package puts the hook's finder
    in place), although the import itself loads neither."""
    config = DMXConfig(format_map=cycling_format_map(tiny_llama_dir))
    AutoModelForCausalLM.from_pretrained(tiny_llama_dir, quantization_config=config).save_pretrained(tmp_path)
    first, second = "import transformers.quantizers.auto", "import optimum_dmx"
    if not transformers_first:
        first, second = second, first
    code = f"""
import json, sys
{first}
{second}
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained({str(tmp_path)!r})
print(json.dumps(type(model.model.layers[0].self_attn.q_proj).__name__))
"""
    assert last_json_line(run_python(code, env={"OPTIMUM_DMX_NO_AUTOREGISTER": "1"})) == "MXLinear"


def test_loading_a_dmx_checkpoint_imports_no_calibration_machinery(tmp_path, tiny_llama_dir):
    config = DMXConfig(format_map=cycling_format_map(tiny_llama_dir))
    AutoModelForCausalLM.from_pretrained(tiny_llama_dir, quantization_config=config).save_pretrained(tmp_path)
    # Baseline: what transformers itself imports to load a float model (its progress bars import tqdm).
    code = f"""
import json, sys
from transformers import AutoModelForCausalLM
AutoModelForCausalLM.from_pretrained({str(tiny_llama_dir)!r})
before = set(sys.modules)
import optimum_dmx
from optimum_dmx.nn import MXLinear
model = AutoModelForCausalLM.from_pretrained({str(tmp_path)!r})
assert isinstance(model.model.layers[0].self_attn.q_proj, MXLinear)
print(json.dumps(sorted(set(sys.modules) - before)))
"""
    added = json.loads(run_python(code, env={"OPTIMUM_DMX_NO_AUTOREGISTER": "1"}).stdout.strip().splitlines()[-1])
    heavy = [
        m
        for m in added
        if m.split(".")[0] in ("datasets", "tqdm", "pyarrow")
        or m.startswith(("optimum_dmx.calibration.trainer", "optimum_dmx.calibration.baselines"))
    ]
    assert heavy == [], heavy
    assert "optimum_dmx.nn.mx_linear" in added  # the check above looked at the right import
