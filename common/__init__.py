"""Thin plumbing shared by the examples. Each example's header lists the files of this package it imports: copy
those with the example into your project (docs/layout.md); within this repository they are imported from here.

A Python without torch (the system's, not the environment `make setup` made) gets one line saying which Python to
use, instead of an import traceback (without torchtitan: common.device says the same).
"""
import importlib.util as _util
import os as _os
import sys as _sys

if _util.find_spec("torch") is None:
    _venv = _os.path.join(_os.environ.get("QWEN3_RECIPES_CACHE") or
                          _os.path.join(_os.path.expanduser("~"), ".cache", "qwen3-trainium-recipes"), "venv")
    print(f"error: {_sys.executable} has no torch: use the environment `make setup` made "
          f"({_venv}/bin/python, or `. {_venv}/bin/activate` first), or on trn2 the Neuron environment of "
          "docs/first-hour-trn2.md", file=_sys.stderr)
    raise SystemExit(2)

