"""Plumbing used by examples/train_hf_backend.py alone: copy this folder with it."""
