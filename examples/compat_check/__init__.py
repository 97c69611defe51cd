"""Plumbing used by examples/generate_compat_check.py alone: copy this folder with it."""
