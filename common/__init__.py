"""Thin plumbing shared by the examples: imported, never copied (see README, "read these files first")."""
