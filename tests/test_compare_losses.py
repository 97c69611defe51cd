"""--compare_losses against each kind of reference file, in-process (no training): a golden file (`losses` alone,
from step 1), and a resumed run's results.json, whose `losses` are only its last part (`steps` numbers them) and
whose `history` is the whole curve across stops."""
from __future__ import annotations

import json

import pytest

from common.errors import UserError
from common.harness.checks import compare_losses, format_loss_comparison, read_reference_losses

CURVE = [11.951743125915527, 11.907217979431152, 11.826342582702637, 11.61203384399414, 11.416754722595215]


def resumed_results(curve: list[float], stopped_after: int) -> dict:
    """What common/recipe.py `train()` writes for a run stopped after step `stopped_after` and resumed to the end:
    this process's steps and losses, the whole run's in `history`."""
    steps = list(range(stopped_after + 1, len(curve) + 1))
    return {"script": "train_native_qwen3.py", "steps": steps, "resumed_from_step": stopped_after,
            "losses": curve[stopped_after:], "first_step_loss": curve[stopped_after],
            "history": {"steps": list(range(1, len(curve) + 1)), "losses": list(curve)}}


def test_a_run_like_a_resumed_reference_reproduces_it(tmp_path):
    """A run bit-identical to a reference that was killed after step 3 and resumed is judged by step number: the
    whole curve (`history`) where the results.json has it, else its own `steps` (4 and 5); a step the reference has
    no loss for is not compared."""
    ref = tmp_path / "resumed" / "results.json"
    ref.parent.mkdir()
    ref.write_text(json.dumps(resumed_results(CURVE, stopped_after=3)))
    comp = compare_losses(CURVE, ref, 1e-6)
    assert comp["passed"] and comp["first_differing_step"] is None, format_loss_comparison(comp)
    assert [r["step"] for r in comp["per_step"]] == [1, 2, 3, 4, 5] and comp["max_abs_diff"] == 0.0
    assert read_reference_losses(ref) == CURVE  # lifecycle's early check reads it as before

    part = resumed_results(CURVE, stopped_after=3)
    del part["history"]  # a results.json without the whole curve: its own part, by its own steps
    ref.write_text(json.dumps(part))
    comp = compare_losses(CURVE, ref, 1e-6)
    assert comp["passed"] and [r["step"] for r in comp["per_step"]] == [4, 5], format_loss_comparison(comp)

    shifted = CURVE[:3] + [x + 0.01 for x in CURVE[3:]]
    ref.write_text(json.dumps(resumed_results(shifted, stopped_after=3)))
    comp = compare_losses(CURVE, ref, 1e-3)
    assert comp["first_differing_step"] == 4 and "from step 4" in format_loss_comparison(comp)


def test_a_golden_file_is_numbered_from_step_1(tmp_path):
    """A golden file holds `losses` and the count of steps (`"steps": 5`, not a list): its losses are steps 1 on; a
    resumed run (steps 4 and 5) is compared with the golden steps 4 and 5."""
    golden = tmp_path / "golden.json"
    golden.write_text(json.dumps({"script": "train_native_qwen3.py", "preset": "tiny", "steps": 5, "losses": CURVE}))
    comp = compare_losses(CURVE[3:], golden, 1e-6, steps=[4, 5])
    assert comp["passed"] and [r["reference"] for r in comp["per_step"]] == CURVE[3:]
    assert compare_losses(CURVE + [1.0], golden, 1e-6)["steps_compared"] == 5  # step 6: nothing to compare with


@pytest.mark.parametrize("data, message", [
    ({"history": {"steps": [1, 2], "losses": [11.0, float("nan")]}, "losses": [11.0]},
     "holds NaN or infinite losses"),
    ({"steps": [4, 5], "losses": [11.0]}, "numbers 1 losses with 2 steps"),
    ({"steps": [4.5], "losses": [11.0]}, "not a JSON file with a 'losses' list"),
    ({"steps": [], "losses": []}, "holds no losses"),
    ([11.0], "not a JSON file with a 'losses' list"),
])
def test_a_bad_reference_is_one_error_line(tmp_path, data, message):
    ref = tmp_path / "ref.json"
    ref.write_text(json.dumps(data))
    with pytest.raises(UserError, match=message) as e:
        compare_losses([11.0], ref, 1e-6)
    assert "\n" not in str(e.value)
