"""Task accuracy through lm-eval (EleutherAI's evaluation harness) on a model already in memory.

Perplexity (`evaluation`) is this package's own measure; papers and peers report zero-shot accuracy on lm-eval's
tasks (ARC, HellaSwag, PIQA, WinoGrande, ...). `evaluate_tasks` runs those on any model transformers loads,
dMX checkpoints included (their `MXLinear`s compute as served), through lm-eval's Hugging Face model class, so the
numbers are lm-eval's own. lm-eval is an optional dependency: `pip install "optimum-dmx[eval]"`.

lm-eval downloads its built-in tasks' datasets from the Hugging Face Hub; a task defined in a local folder
(`include_path`, lm-eval's task YAML) runs offline.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

LM_EVAL_MISSING = 'task evaluation needs lm-eval: pip install "optimum-dmx[eval]" (or pip install lm-eval)'


def evaluate_tasks(
    model: torch.nn.Module,
    tokenizer: Any,
    tasks: Sequence[str],
    include_path: str | Path | None = None,
    num_fewshot: int | None = None,
    limit: int | None = None,
    batch_size: int = 1,
) -> dict[str, dict[str, float]]:
    """lm-eval's metrics of `model` on `tasks`: task name -> metric name (e.g. `"acc,none"`,
    `"acc_stderr,none"`) -> value.

    Args:
        model: a causal LM in memory (a float model, or a dMX checkpoint loaded by `from_pretrained`).
        tokenizer: its tokenizer.
        tasks: lm-eval task or group names; each must be known to lm-eval or defined under `include_path`.
        include_path: a folder of task YAML files to add to lm-eval's own.
        num_fewshot: examples shown before each question (lm-eval's default for the task when None).
        limit: evaluate only the first `limit` examples of each task (a quick check; not comparable numbers).
        batch_size: sequences per forward pass.

    Raises:
        ImportError: lm-eval is not installed.
        ValueError: a task name lm-eval does not know, named with where to look.
    """
    try:
        import lm_eval
        from lm_eval.models.huggingface import HFLM
        from lm_eval.tasks import TaskManager
    except ImportError as err:
        raise ImportError(LM_EVAL_MISSING) from err
    if not tasks:
        raise ValueError("tasks is empty: name at least one lm-eval task")
    if getattr(tokenizer, "eos_token_id", None) is None and getattr(tokenizer, "bos_token_id", None) is None:
        raise ValueError("lm-eval starts its requests with the tokenizer's end-of-text or BOS token; it has neither")
    if include_path is not None and not Path(include_path).is_dir():
        raise ValueError(f"include_path={str(include_path)!r} is not a folder of lm-eval task files")
    manager = TaskManager(include_path=str(include_path) if include_path is not None else None)
    unknown = [task for task in tasks if task not in manager.all_tasks]
    if unknown:
        where = (
            f" or under {str(include_path)!r}" if include_path is not None else " (pass include_path for local tasks)"
        )
        raise ValueError(f"lm-eval knows no task {', '.join(map(repr, unknown))}{where}")
    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size)
    output = lm_eval.simple_evaluate(
        model=lm, tasks=list(tasks), num_fewshot=num_fewshot, limit=limit, task_manager=manager
    )
    return {
        task: {metric: value for metric, value in metrics.items() if isinstance(value, (int, float))}
        for task, metrics in output["results"].items()
    }
