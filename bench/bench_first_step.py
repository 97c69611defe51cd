"""Time to step 1 of a training script against the same script at another commit of this repository, in one run on
one machine: what the checks, the load check and the build cost before training, and what a change to them saved.

For each script, two kinds of process alternate (this tree, the other; then the other, this tree; ...), `--repeats` of
each, the same command in both: `python examples/X.py --steps 2 --no-export --out_dir RUN` (plus --args). The other
commit is checked out with `git worktree add --detach` into the bench's out_dir and removed after. Time to step 1:
from the process's spawn to the moment its output shows torchtitan's step-1 line (`step:  1`), which every version of
the scripts prints; the median over the repeats. Both read the same prepared assets.

    python bench/bench_first_step.py --against d36afcc --scripts hf --out_dir runs/bench/first_step   # ~3 min

results.json: `rows` (one per script: this tree's and the other's medians, `saved_s` = the other's - this tree's).
"""
from __future__ import annotations

import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import common_bench as cb  # noqa: E402
from common import cli  # noqa: E402
from common.errors import UserError  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = cb.TRAINING_SCRIPTS
STEP_1 = "step:  1 "  # torchtitan's step line (its metrics processor's log)


@dataclass
class Config:
    preset: str = "default"
    against: str = field(default="HEAD~1", metadata={"help": "the commit (or tag, branch) to compare this tree with"})
    scripts: str = field(default="hf", metadata={"help": "comma-separated: native, hf, moe"})
    args: str = field(default="", metadata={"help": "flags added to both commands (e.g. '--seq_len 64')"})
    repeats: int = field(default=3, metadata={"help": "processes of each kind, alternating", **cli.bounds(1, 100)})
    out_dir: str = field(default="runs/bench/first_step", metadata={"help": "results.json and runs/ go here"})


PRESETS = {"default": Config}


def to_step_1(root: Path, script: str, args: list[str], run_dir: Path) -> float:
    """Seconds from the spawn of `python examples/SCRIPT ARGS` in the tree `root` to its step-1 line."""
    cmd = [sys.executable, str(root / "examples" / script), "--steps", "2", "--no-export", *args,
           "--out_dir", str(run_dir)]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=root, env=cb.training_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    seen, lines = None, []
    for line in proc.stdout:
        lines.append(line)
        if seen is None and STEP_1 in line:
            seen = time.perf_counter() - start
    if proc.wait() != 0 or seen is None:
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}:\n{''.join(lines[-30:])}")
    return seen


def main(cfg: Config) -> dict:
    out_dir = cli.check_out_dir(cfg.out_dir).resolve()
    names = cb.script_names(cfg.scripts)
    rev = subprocess.run(["git", "rev-parse", "--verify", f"{cfg.against}^{{commit}}"], cwd=ROOT, capture_output=True,
                         text=True)
    if rev.returncode:
        raise UserError(f"--against {cfg.against}: not a commit of this repository")
    other = out_dir / "other_tree"
    subprocess.run(["git", "worktree", "remove", "--force", str(other)], cwd=ROOT, capture_output=True)
    subprocess.run(["git", "worktree", "add", "--detach", str(other), rev.stdout.strip()], cwd=ROOT, check=True,
                   capture_output=True)
    rows = []
    try:
        for name in names:
            count = {"this": 0, "other": 0}

            def one(kind: str, root: Path):
                def call() -> float:
                    count[kind] += 1
                    return to_step_1(root, SCRIPTS[name], cfg.args.split(),
                                     out_dir / "runs" / f"{name}.{kind}.{count[kind]}")
                return call

            print(f"[bench] {SCRIPTS[name]}: this tree against {cfg.against}, {cfg.repeats} repeat(s)", flush=True)
            samples = cb.alternate({"this": one("this", ROOT), "other": one("other", other)}, repeats=cfg.repeats,
                                   warmup=0)
            this, then = cb.summary(samples["this"]), cb.summary(samples["other"])
            rows.append({"script": SCRIPTS[name], "this_s": this["median"], "other_s": then["median"],
                         "saved_s": then["median"] - this["median"], "this": this, "other": then})
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(other)], cwd=ROOT, capture_output=True)
    table = cb.format_table(rows, [("script", "script", ""), ("this_s", "this tree: to step 1 s", ".1f"),
                                   ("other_s", f"{cfg.against}: to step 1 s", ".1f"), ("saved_s", "saved s", ".1f")])
    results = {"config": cfg, "against": {"name": cfg.against, "commit": rev.stdout.strip()},
               "method": {"repeats": cfg.repeats, "order": "alternating this/other processes",
                          "statistic": "median over processes of spawn to torchtitan's step-1 line"},
               "rows": rows}
    cb.write(out_dir, "first_step", results, table)
    return results


if __name__ == "__main__":
    sys.exit(cli.run_cli(main, Config, PRESETS, __doc__, default_preset="default"))
