"""The Makefile's set-up steps as a fresh clone meets them (`make -n`: what make would run, nothing run)."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_a_fresh_clone_does_not_reinstall_requirements_the_environment_has(tmp_path):
    """The environment's stamp names the requirements' content (a hash): a fresh checkout, whose requirements.txt
    is newer than any stamp, installs nothing when the content is the same, and installs when it changed."""
    clone, venv = tmp_path / "clone", tmp_path / "venv"
    clone.mkdir()
    shutil.copy(ROOT / "Makefile", clone / "Makefile")
    shutil.copy(ROOT / "requirements.txt", clone / "requirements.txt")
    (venv / "bin").mkdir(parents=True)
    digest = subprocess.run(["sha256sum", "requirements.txt"], cwd=clone, capture_output=True, text=True,
                            check=True).stdout[:16]
    stamp = venv / f".installed-{digest}"
    stamp.touch()
    os.utime(stamp, (1_000_000_000, 1_000_000_000))  # installed long before this checkout was made

    def planned() -> str:
        return subprocess.run(["make", "-n", "env", f"VENV={venv}", f"CACHE={tmp_path}"], cwd=clone,
                              capture_output=True, text=True, check=True).stdout

    assert "pip install" not in planned()
    with open(clone / "requirements.txt", "a") as f:
        f.write("# another pin\n")
    assert "pip install" in planned()
