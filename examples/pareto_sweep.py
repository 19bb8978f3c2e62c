"""Perplexity-vs-bits sweep of dMX and its baselines for any causal LM (drives benchmarks/pareto.py).

    python examples/pareto_sweep.py --model MODEL --calibration a.txt b.txt --eval heldout=c.txt --out results/
        [--methods float,uniform,dmx,kl,round_ste] [--pairs mxfp8-mxfp4] [--targets 4.5,5] [--steps 60]

Writes `pareto.csv`, `pareto.md` and `pareto.png` to `--out`; finished runs are kept, so a sweep can be
stopped and resumed. Every option of `benchmarks/pareto.py` is accepted (see its `--help`).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import pareto  # noqa: E402  (benchmarks/pareto.py)

if __name__ == "__main__":
    pareto.main()
