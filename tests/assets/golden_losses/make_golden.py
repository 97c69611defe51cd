"""Write a golden-loss file from a run's results.json (the first 10 losses and how they were made).

    python examples/train_native_qwen3.py --preset tiny --steps 10 --out_dir runs/g
    python tests/assets/golden_losses/make_golden.py runs/g/results.json tests/assets/golden_losses/train_native_qwen3.tiny.json

Regenerate only when a change is meant to move the losses (a new torch/torchtitan pin, a new
default); the tests assert each CPU preset's first 10 losses against these files.
"""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from common.results import atomic_write_text  # noqa: E402

src, dst = Path(sys.argv[1]), Path(sys.argv[2])
res = json.loads(src.read_text())
cfg = res["config"]
golden = {"script": res["script"], "preset": cfg["preset"], "steps": len(res["losses"][:10]),
          "losses": res["losses"][:10], "device": res.get("device"), "world_size": res.get("world_size"),
          "versions": res["versions"],
          "note": "float32 on a 2-core x86 CPU; deterministic there (run-to-run difference 0.0)"}
atomic_write_text(dst, json.dumps(golden, indent=2) + "\n")
print(f"wrote {dst}: {golden['losses']}")
