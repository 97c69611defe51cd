"""Plumbing used by examples/generate_compat_check.py alone: copy this folder with it.

rows.py     the Parquet results: columns, version stack, reading any public-schema file, writing a row
sizing.py   weight bytes from safetensors headers, fewest cores, sharding plan, model kind
judge.py    the English judge (a small causal LM plus word-level checks)
measure.py  what a run measures besides tokens: compile time and cache, non-finite weights or logits
processes.py  a time-limited process that leaves nothing behind (its whole tree is killed)
lookup.py   the `lookup` subcommand: search, filter, print a table or a row's run_py, write the page
page.py     the static HTML lookup page (one self-contained file, data embedded, shown as text)
training.py  `--task train`: a few steps of examples/train_hf_backend.py per model, its loss and export check
compile_audit.py  the compile audit: graphs, recompiles and graph breaks of a generation, counted by Dynamo
rankings.py  the `rankings` subcommand: the Hub's most downloaded and trending models per task, for lookup's views
subcommands.py  the entry point's subcommands (lookup, rankings) and what the lookup takes from the check
"""
