"""The benchmark scripts run end to end (as subprocesses, on a tiny model) and print their tables."""

import csv
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

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


def test_calibration_time_benchmark(tiny_text_model_dir, tmp_path):
    root = tiny_text_model_dir
    output = tmp_path / "time.md"
    stdout = run_benchmark("bench_calibration_time.py", "--model", root / "model", "--calibration",
                           root / "calibration.txt", "--steps", 3, "--batch-size", 2, "--seq-len", 16,
                           "--output", output)
    rows = re.findall(r"^\| (KL pre-selection|dMX default recipe)[^|]*\| ([\d.]+) \| ([\d.]+)x \|", stdout, re.MULTILINE)
    assert [r[0] for r in rows] == ["KL pre-selection", "dMX default recipe"]
    (_, kl, kl_ratio), (_, dmx, ratio) = rows
    assert float(kl) > 0 and float(kl_ratio) == 1.0
    # the printed times are rounded to 0.01 s and the ratio to 0.01: it must lie in the range they allow
    d, k, half = float(dmx), float(kl), 0.005
    assert (d - half) / (k + half) - half <= float(ratio) <= (d + half) / (k - half) + half
    assert output.read_text().startswith("# Calibration wall time\n\nCommand: `python benchmarks/bench_calibration_time.py")


def test_calibration_step_profile(tiny_text_model_dir, tmp_path):
    root = tiny_text_model_dir
    stdout = run_benchmark("profile_calibration_step.py", "--model", root / "model", "--calibration",
                           root / "calibration.txt", "--steps", 2, "--batch-size", 2, "--seq-len", 16)
    rows = dict(re.findall(r"^\| ([^|]+?) \| [\d.]+ \| ([\d.-]+)% \|", stdout, re.MULTILINE))
    assert len(rows) == 5 and abs(sum(map(float, rows.values())) - 100) < 0.5
    assert float(rows["input-activation quantization (forward)"]) > 0
    assert float(rows["quantizers' backward (dL/dx, dL/dbeta)"]) > 0


def test_calibration_memory_benchmark(tiny_text_model_dir, tmp_path):
    root = tiny_text_model_dir
    output = tmp_path / "memory.md"
    stdout = run_benchmark("bench_calibration_memory.py", "--model", root / "model", "--calibration",
                           root / "calibration.txt", "--batch-sizes", 2, "--seq-len", 16, "--output", output)
    rows = {w: (float(p), r) for w, p, r in re.findall(r"^\| 2 x 16 \| ([^|]+?) \| (\d+) \| ([\d.]+)x \|", stdout,
                                                         re.MULTILINE)}
    assert list(rows) == ["unquantized", "dMX", "dMX eager", "dMX checkpointed"]
    assert all(peak > 100 for peak, _ in rows.values())  # whole-process peaks: torch alone is hundreds of MiB
    reference = rows["unquantized"][0]
    for peak, ratio in rows.values():
        assert abs(float(ratio) - peak / reference) <= 0.01 + 0.01 * peak / reference  # ratio of rounded peaks
    assert output.read_text().startswith("# Calibration step memory\n\nCommand: `python benchmarks/bench_calibration_memory.py")


def run_benchmark(script: str, *args) -> str:
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *map(str, args)],
                            capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def test_layer_overhead_benchmark_times_the_reference_and_both_probes(tmp_path):
    output = tmp_path / "layer.md"
    stdout = run_benchmark("bench_layer_overhead.py", "--tokens", 2, "--width", 64, "--repeats", 1, "--calls", 2,
                           "--threads", 1, "--profile", 4, "--output", output)
    timed, profiled = stdout.split("Host time by operation")
    rows = [line for line in timed.splitlines() if line.startswith("| `")]
    assert len(rows) == 3 and rows[0].endswith("| 1.00x |")
    assert all(float(row.split("|")[2]) > 0 for row in rows)
    # Four operations for each DMXLinear row; the backward pass's autograd functions are among them.
    operations = [line.split("|")[2].strip() for line in profiled.splitlines() if line.startswith("| `")]
    assert len(operations) == 8 and "`_AttachContinuousMXBackward`" in operations
    assert output.read_text().startswith("# Host cost of a quantized layer\n\nCommand: `python benchmarks/bench_layer")


def test_pareto_sweep_resumes_and_runs_on_any_model(tiny_text_model_dir, tmp_path):
    root = tiny_text_model_dir
    inputs = ["--model", root / "model", "--calibration", root / "calibration.txt",
              "--eval", f"heldout={root / 'heldout.txt'}", "--out", tmp_path, "--eval-tokens", 256, "--eval-seq-len", 16]
    args = [*inputs, "--methods", "float,uniform,dmx", "--pairs", "mxfp8-mxfp4", "--targets", "5",
            "--steps", 4, "--batch-size", 2, "--seq-len", 16]
    run_benchmark("pareto.py", *args)
    rows = (tmp_path / "pareto.csv").read_text().splitlines()
    assert len(rows) == 1 + 1 + 3 + 1  # header, float, three uniform formats, one dMX run
    # A repeated sweep finds every run in the CSV and adds nothing; a changed setting is a new run.
    assert "0 runs to do, 5 already" in run_benchmark("pareto.py", *args)
    assert (tmp_path / "pareto.csv").read_text().splitlines() == rows
    assert "1 runs to do, 4 already" in run_benchmark("pareto.py", *args, "--lr", 2.0)
    # A rotated model is a new set of runs; its float perplexity is the float model's (the rotation preserves it).
    assert "1 runs to do, 0 already" in run_benchmark("pareto.py", *inputs, "--methods", "float",
                                                      "--rotation", "block_hadamard")
    floats = [r for r in csv.DictReader(open(tmp_path / "pareto.csv")) if r["method"] == "float"]
    assert [r["rotation"] for r in floats] == ["none", "block_hadamard"]
    assert float(floats[1]["ppl_heldout"]) == pytest.approx(float(floats[0]["ppl_heldout"]), rel=1e-4)
    assert (tmp_path / "pareto.md").is_file() and (tmp_path / "pareto.png").stat().st_size > 1000
    # --reevaluate measures the saved maps again: spoiled perplexities come back, the other rows stay as they were.
    table = list(csv.DictReader(open(tmp_path / "pareto.csv")))
    measured = {r["method"] + r["target"] + r["lr"]: r["ppl_heldout"] for r in table}
    for r in table:
        r["ppl_heldout"] = "-1"
    with open(tmp_path / "pareto.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(table[0]))
        writer.writeheader()
        writer.writerows(table)
    out = run_benchmark("pareto.py", *inputs, "--methods", "uniform,dmx", "--pairs", "mxfp8-mxfp4", "--reevaluate",
                        "--steps", 4, "--batch-size", 2, "--seq-len", 16)
    assert "5 rows to evaluate again, 0 done" in out  # three uniform rows, two dMX runs (lr 20 and 2)
    again = {r["method"] + r["target"] + r["lr"]: r["ppl_heldout"] for r in csv.DictReader(open(tmp_path / "pareto.csv"))}
    assert {k: v for k, v in again.items() if v != "-1"} == {k: v for k, v in measured.items() if not k.startswith("float")}
    assert not (tmp_path / "reevaluation.jsonl").exists()


HELP_OF_EVERY_SCRIPT = """
import contextlib, io, json, runpy, sys, traceback
scripts = sys.argv[1:]
sys.path.insert(0, {folder!r})  # what `python benchmarks/<script>.py` puts first on the path
answers = {{}}
for script in scripts:
    sys.argv = [script, "--help"]
    stdout = io.StringIO()
    try:
        with contextlib.redirect_stdout(stdout):
            runpy.run_path(script, run_name="__main__")
        code = "returned without exiting"
    except SystemExit as stopped:
        code = stopped.code
    except Exception:
        code = traceback.format_exc()
    answers[script] = [code, stdout.getvalue()]
print(json.dumps(answers))
"""


def test_benchmarks_answer_help_from_a_clone_alone(tmp_path):
    """The repository's files alone (no shared/ folder beside them, nothing fetched yet) run every --help.

    All scripts run in one interpreter, each as `__main__` with its folder first on the path, as `python
    benchmarks/<script>.py --help` runs it: a fresh interpreter per script would spend seconds importing torch."""
    clone = tmp_path / "clone"
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, text=True, check=True).stdout.split()
    for name in listed:
        if (ROOT / name).is_file():
            (clone / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, clone / name)
    scripts = sorted(str(s) for s in (clone / "benchmarks").glob("*.py") if s.name != "common.py")
    assert len(scripts) >= 15
    result = subprocess.run(
        [sys.executable, "-c", HELP_OF_EVERY_SCRIPT.format(folder=str(clone / "benchmarks")), *scripts],
        capture_output=True, text=True, timeout=600, cwd=tmp_path,
        env={**os.environ, "OPTIMUM_DMX_CACHE": str(tmp_path / "cache")},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    answers = json.loads(result.stdout.splitlines()[-1])
    assert sorted(answers) == scripts
    for script, (code, stdout) in answers.items():
        assert code == 0 and "usage" in stdout, (Path(script).name, code)
    assert not (tmp_path / "cache").exists()  # --help fetched nothing


def test_learned_rotations_benchmark_runs_resumes_and_reports(tiny_text_model_dir, tmp_path):
    root = tiny_text_model_dir
    out = tmp_path / "rows.jsonl"
    args = ["--model", root / "model", "--calibration", root / "calibration.txt", "--eval", f"heldout={root / 'heldout.txt'}",
            "--eval-tokens", 256, "--eval-seq-len", 16, "--steps", 3, "--batch-size", 2, "--seq-len", 16,
            "--kl-samples", 2, "--out", out]
    run_benchmark("learned_rotations.py", *args, "--learn")
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["map"] for r in rows] == ["uniform_mxfp4", "dmx_kl", "dmx", "kl"]
    assert all(r["learn_rotations"] and r["ppl_heldout"] > 1 for r in rows)
    assert abs(rows[1]["bits_simple"] - 5) <= 0.3 and rows[0]["bits_simple"] == 4.0
    assert "skipping" in run_benchmark("learned_rotations.py", *args, "--learn")  # already there: nothing rerun
    assert len(out.read_text().splitlines()) == 4
    table = run_benchmark("learned_rotations.py", "--report", "--out", out)
    assert len(re.findall(r"^\| hadamard \| yes \| mxfp8-mxfp4 \| 5 \| 0 \|", table, re.MULTILINE)) == 4


def test_random_maps_fit_recovers_additive_effects_under_batch_offsets(monkeypatch):
    """`random_maps.effects` (the ablation's estimator) finds known per-layer effects of maps drawn at a fixed
    budget, although each batch adds an offset a hundred times larger than any effect."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import torch
    from random_maps import effects, spearman

    generator = torch.Generator().manual_seed(0)
    layers, samples, high, batches = 60, 400, 15, 8
    true = torch.randn(layers, generator=generator, dtype=torch.float64) * 0.01
    design = torch.zeros(samples, layers)
    for row in design:
        row[torch.randperm(layers, generator=generator)[:high]] = 1.0
    batch = torch.arange(samples) % batches
    offsets = torch.randn(batches, generator=generator, dtype=torch.float64)
    losses = offsets[batch] + design.double() @ true + 1e-3 * torch.randn(samples, generator=generator, dtype=torch.float64)
    fitted = effects(design, batch, losses)
    assert spearman(fitted, true) > 0.95
    assert spearman(effects(design, torch.zeros(samples, dtype=torch.long), losses), true) < 0.5  # offsets ignored


def test_eval_reproducibility_report_counts_wins_and_spread_per_machine(monkeypatch):
    """`eval_reproducibility.report` lines up the sweep's CSV values and each machine's re-evaluation of the same
    maps: the default recipe's wins against KL counted per column, and how far one map's perplexity moved."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from eval_reproducibility import report

    cell = {"pair": "mxfp8-mxfp4", "target": "5", "seed": 0, "texts": ["a", "b"], "threads": 1}
    csv_rows = [{"method": m, "pair": "mxfp8-mxfp4", "target": "5", "seed": "0", "rotation": "none",
                 "ppl_a": a, "ppl_b": b} for m, a, b in (("kl", "10", "20"), ("dmx_kl", "11", "19"))]
    records = [{**cell, "method": "kl", "machine": "cpu X", "dispatch": "default", "perplexities": [10.0, 20.2]},
               {**cell, "method": "dmx_kl", "machine": "cpu X", "dispatch": "default", "perplexities": [9.9, 19.0]}]
    text = report(records, csv_rows, "COMMAND")
    assert "| mxfp8-mxfp4 | 5 | 0 | 10.00 / 20.00 | 11.00 (+10.0%) / 19.00 (-5.0%) | 10.00 / 20.20 |" in text
    assert "sweep: 1 of 2; machine 1, default, 1 thr.: 2 of 2." in text
    # the four map-text pairs moved by 0% (KL, a), 1% (KL, b: 20.2 / 20), 11.11% (default, a: 11 / 9.9) and 0%
    assert "4 of them): median 0.50%, largest 11.11%." in text
