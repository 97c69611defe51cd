"""Kernel ops (RoPE, grouped experts) with autograd, their NKI branches and torchtitan registry entries."""
