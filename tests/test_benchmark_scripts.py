"""The benchmark scripts run end to end (as subprocesses, on a tiny model) and print their tables."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_calibration_step_benchmark(tiny_text_model_dir, tmp_path):
    root = tiny_text_model_dir
    output = tmp_path / "step.md"
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_calibration_step.py"), "--model", str(root / "model"),
         "--calibration", str(root / "calibration.txt"), "--batch-sizes", "1,2", "--seq-len", "16",
         "--steps", "1", "--repeats", "1", "--output", str(output)],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = re.findall(r"^\| (\d) x 16 \| ([\d.]+) \| ([\d.-]+) \| ([\d.-]+)x \|", result.stdout, re.MULTILINE)
    assert [r[0] for r in rows] == ["1", "2"]
    for _, reference, step, ratio in rows:
        expected = float(step) / float(reference)
        assert float(reference) > 0 and abs(float(ratio) - expected) <= 0.05 * abs(expected) + 0.01
    command = "Command: `python benchmarks/bench_calibration_step.py --model"
    assert output.read_text().startswith(f"# Calibration step cost\n\n{command}")
