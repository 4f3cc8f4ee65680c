"""The emulated serving bench's table again, from its ``serve.json``, with the planner's predictions recomputed by
the planner as it is now from the figures the run recorded (measured acceptance, lookups, prompt length; never the
measured rates). For checking a change to the planner against a run already made.

    python benchmarks/emulation_replan.py bench-out/serve.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from cascade.bench.emulated import decisions_table, replan
from cascade.bench.serving import LevelResult
from cascade.config import CascadeConfig


def main(path: str) -> None:
    run = json.loads(Path(path).read_text())
    config = CascadeConfig.model_validate(run["config"])
    rows = [LevelResult(**r) for r in run["rows"] if r["system"] != "transformers"]
    replan(config, rows, run["options"]["max_tokens"])
    print(decisions_table(rows))


if __name__ == "__main__":
    main(sys.argv[1])
