"""An installed optimum-dmx registers itself with transformers: dMX checkpoints load without `import optimum_dmx`.

Each test installs the package (from a copy of the source tree) into a fresh virtual environment that
sees the packages of the environment running the tests (torch, transformers: a system install or the user's
own venv alike), then loads a dMX checkpoint in that environment's interpreter, from a working directory
where the source tree is not importable, with code that never imports optimum_dmx.
"""

import shutil
import site
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from optimum_dmx import DMXConfig

from .helpers import INPUT_IDS, REPO_ROOT, cycling_format_map, last_json_line, run_python

LOAD_WITHOUT_IMPORT = """
import json, sys
startup = sorted(m for m in ("optimum_dmx", "torch", "transformers") if m in sys.modules)
import optimum_dmx_autoregister
hook_at_startup = optimum_dmx_autoregister.AutoRegisterFinder in sys.meta_path
import torch
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained(sys.argv[1])
with torch.no_grad():
    torch.save(model(torch.tensor({input_ids})).logits, sys.argv[2])
print(json.dumps({{
    "startup": startup, "hook_file": optimum_dmx_autoregister.__file__,
    "hook": [hook_at_startup, optimum_dmx_autoregister.AutoRegisterFinder in sys.meta_path],
    "package_file": sys.modules["optimum_dmx"].__file__,
    "q_proj": type(model.model.layers[0].self_attn.q_proj).__name__,
}}))
"""


@pytest.fixture(scope="module")
def dmx_checkpoint(tmp_path_factory, tiny_llama_dir):
    out = tmp_path_factory.mktemp("dmx")
    config = DMXConfig(format_map=cycling_format_map(tiny_llama_dir))
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, quantization_config=config)
    model.save_pretrained(out)
    with torch.no_grad():
        return out, model(INPUT_IDS).logits


def _source_copy(tmp_path: Path) -> Path:
    """The checkout without what a build does not read: hidden folders (`.git`, and a developer's `.venv` of
    gigabytes, which the copy took most of this test's time on), build outputs, tests, benchmarks and research."""
    src = tmp_path / "src"
    unread = (".*", "build", "dist", "*.egg-info", "__pycache__", "tests", "benchmarks", "research", "examples")
    shutil.copytree(REPO_ROOT, src, ignore=shutil.ignore_patterns(*unread))
    return src


def _venv_seeing_this_environment(venv: Path) -> None:
    """A new venv whose interpreter also finds the packages this interpreter finds, after its own.

    `venv --system-site-packages` would expose the *base* interpreter's packages, which is not where torch
    lives when the tests run inside a venv. A `.pth` file listing this interpreter's site directories does it
    for both; its lines only extend `sys.path`, so the `.pth` hooks of those directories (this checkout's
    editable install) stay inactive and the venv's own optimum_dmx is the one imported.
    """
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    child = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    ours = [*site.getsitepackages(), sysconfig.get_paths()["purelib"]]
    ours += [p for p in sys.path if p.endswith(("site-packages", "dist-packages")) and p not in ours]
    Path(child, "parent_environment.pth").write_text("\n".join(dict.fromkeys(ours)) + "\n")


def _pip(venv: Path, *args: str) -> None:
    pip = [sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python")]
    install = [*pip, "install", "-q", "--no-deps", "--ignore-installed", *args]
    subprocess.run(install, check=True, capture_output=True, timeout=300)


# Building and installing a wheel takes minutes: slow (the editable install runs the same checks by default).
@pytest.mark.parametrize("install", [pytest.param("wheel", marks=pytest.mark.slow), "editable"])
def test_installed_package_loads_dmx_checkpoints_without_import(tmp_path, dmx_checkpoint, install):
    checkpoint, logits = dmx_checkpoint
    src = _source_copy(tmp_path)
    venv = tmp_path / "venv"
    _venv_seeing_this_environment(venv)
    if install == "wheel":
        wheel = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation"]
        subprocess.run([*wheel, "-w", str(tmp_path / "dist"), str(src)], check=True, capture_output=True, timeout=300)
        _pip(venv, str(next((tmp_path / "dist").glob("*.whl"))))
    else:
        _pip(venv, "--no-build-isolation", "-e", str(src))

    def load(prelude: str, logits_file: str) -> dict:
        """Load the checkpoint in the venv's interpreter, away from the source tree; the script's report."""
        code = prelude + LOAD_WITHOUT_IMPORT.format(input_ids=INPUT_IDS.tolist())
        proc = subprocess.run(
            [str(venv / "bin" / "python"), "-c", code, str(checkpoint), str(tmp_path / logits_file)],
            capture_output=True,
            text=True,
            cwd=tmp_path,
            # a user's bare environment, with the suite's eager MX kernels (conftest)
            env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "OPTIMUM_DMX_COMPILE": "0"},
            timeout=300,
        )
        assert proc.returncode == 0, proc.stderr
        assert torch.equal(torch.load(tmp_path / logits_file), logits)
        return last_json_line(proc)

    result = load("", "logits.pt")
    assert result["startup"] == []  # the start-up hook imports nothing heavy
    assert result["hook"] == [True, False]  # installed at start-up; acted once, then removed itself
    expected_root = src if install == "editable" else venv
    assert Path(result["package_file"]).is_relative_to(expected_root)
    assert Path(result["hook_file"]).is_relative_to(expected_root)
    assert result["q_proj"] == "MXLinear"
    # importing optimum_dmx first (the hook then fires while the package is registering itself) works too
    assert load("import optimum_dmx\n", "logits_imported.pt")["q_proj"] == "MXLinear"


def test_without_the_hook_a_dmx_checkpoint_would_load_as_float(dmx_checkpoint, tmp_path):
    """What the hook prevents: transformers alone skips the unknown quant_method and keeps float linears."""
    checkpoint, _ = dmx_checkpoint
    code = f"""
import json, sys
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained({str(checkpoint)!r})
print(json.dumps([type(model.model.layers[0].self_attn.q_proj).__name__, "optimum_dmx" in sys.modules]))
"""
    proc = run_python(code, env={"PYTHONPATH": "", "OPTIMUM_DMX_NO_AUTOREGISTER": "1"})
    assert last_json_line(proc) == ["Linear", False]
