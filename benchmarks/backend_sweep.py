"""Every model under the installed onnx package's backend/test/data through `fusectl optimize`,
held to the contract (exit 0 or 2, never 3; a checker-valid input gives a checker-valid output;
an output that runs and matches the original on its test_data_set_0 inputs), with counts.

    python benchmarks/backend_sweep.py
"""

from __future__ import annotations

import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.backend_models import DATA, backend_models, sweep_one


def main() -> int:
    start = time.perf_counter()
    counts: Counter[str] = Counter()
    defects = []
    with tempfile.TemporaryDirectory() as workdir:
        for model in backend_models():
            outcome = sweep_one(model, Path(workdir))
            counts["models"] += 1
            counts[f"exit {outcome.exit_code}"] += 1
            counts["checker-valid inputs"] += outcome.input_valid
            counts["checker-valid outputs"] += bool(outcome.output_valid)
            counts["originals that run"] += outcome.original_runs
            counts["outputs compared equal"] += bool(
                outcome.output_runs and outcome.mismatch is None
            )
            defects += [f"{outcome.name}: {d}" for d in outcome.defects()]
    print(f"backend models under {DATA}")
    for key, value in counts.items():
        print(f"  {key}: {value}")
    print(f"  defects: {len(defects)}")
    for line in defects:
        print(f"    {line}")
    print(f"  {time.perf_counter() - start:.1f} s")
    return 1 if defects else 0


if __name__ == "__main__":
    sys.exit(main())
