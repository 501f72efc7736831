"""Every model the onnx wheel ships for backend tests, through `fusectl optimize`: a valid input
gives a checker-valid output that computes the same on onnxruntime (tests/backend_models.py;
benchmarks/backend_sweep.py prints the counts)."""

from __future__ import annotations

from pathlib import Path

from tests.backend_models import DATA, backend_models, sweep_one


def test_every_backend_model_keeps_the_contract(tmp_path: Path) -> None:
    models = backend_models()
    assert len(models) >= 100, f"expected the onnx wheel's backend models under {DATA}"
    outcomes = [sweep_one(model, tmp_path) for model in models]
    defects = [f"{o.name}: {d}" for o in outcomes for d in o.defects()]
    assert not defects, "\n".join(defects)
    compared = [o for o in outcomes if o.original_runs and o.output_runs]
    assert len(compared) >= 90, "most backend models run on onnxruntime and are compared"


def test_sequence_model_keeps_its_sequences(tmp_path: Path) -> None:
    """SequenceEmpty feeds a SequenceInsert chain: folding it into a tensor initializer made
    an output onnxruntime refused."""
    outcome = sweep_one(DATA / "simple" / "test_sequence_model1" / "model.onnx", tmp_path)
    assert outcome.exit_code == 0, outcome.message
    assert outcome.original_runs and outcome.output_runs and outcome.mismatch is None
