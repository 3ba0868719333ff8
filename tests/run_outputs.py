"""Reading a finished run's outputs in tests."""

import json
import os


def losses(workdir) -> dict[int, float]:
    """step → loss; a step logged twice (before a failure and after the resume) keeps its last value."""
    out = {}
    for line in open(os.path.join(workdir, "metrics.jsonl")):
        record = json.loads(line)
        if "loss" in record:
            out[record["step"]] = record["loss"]
    return out
