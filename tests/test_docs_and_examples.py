"""The README's Python snippets and the examples run as written."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def readme_python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.DOTALL)


def test_readme_python_snippets_run_in_order():
    blocks = readme_python_blocks()
    assert len(blocks) >= 2
    namespace: dict = {}
    for block in blocks:
        exec(compile(block, "README.md", "exec"), namespace)  # noqa: S102 - executing our own documentation


@pytest.mark.parametrize("script", ["quickstart.py"])
def test_example_runs(script):
    result = subprocess.run([sys.executable, str(ROOT / "examples" / script)], capture_output=True, text=True,
                            timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "mxfp4_e2m1" in result.stdout and "beta=2.0" in result.stdout
