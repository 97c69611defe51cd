"""The compile cache shared across hosts (common/harness/compile_cache.py), by hand: this host's key, and a pull or
push of its entries.

    python -m tools.compile_cache key                              # this host's key, one line
    python -m tools.compile_cache pull URL [--to DIR] [--key KEY]  # the store's entries of this key into DIR
    python -m tools.compile_cache push URL [--from DIR]            # DIR's entries the store lacks, under this key

URL: a folder on shared storage (/fsx/compile-cache), file:///fsx/compile-cache, or s3://bucket/prefix (needs the
s3fs package). DIR, by default, is the folder a run on this host compiles into: on Trainium TORCH_NEURONX_NEFF_CACHE_DIR
(export it as the run will see it, or name the run's --neff_cache_dir, else OUT_DIR/neff_cache, with --to), elsewhere
inductor's cache (TORCHINDUCTOR_CACHE_DIR, else torch's default folder). `--key KEY` (the compatibility lookup's pull
commands give it) is checked against this host's key: graphs another compiler version made are never pulled.
`--device` picks the key's device where `auto` (neuron, then cuda, then cpu) would pick another.

Prints one line saying what was copied. Bad input, a store it cannot reach, read or write: one `error:` line and
exit code 2. Set-up tooling: no example imports it, nothing copies it.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

if __package__ in (None, ""):  # `python tools/compile_cache.py` as well as `python -m tools.compile_cache`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common.errors import ArgumentParser, UserError, one_line  # noqa: E402
from common.harness import compile_cache  # noqa: E402

DEVICES = ("auto", "cpu", "cuda", "neuron")


def device_type(requested: str) -> str:
    """The key's device: as named, or the one a run picks (`auto`: common.device's order)."""
    if requested == "cpu":  # no torch import for the CPU key
        return "cpu"
    from common import device

    return device.resolve_device_type(requested)


def default_folder(dev: str) -> str:
    """The folder a run on this host compiles into (compile_cache.local_folder). On Trainium only where
    TORCH_NEURONX_NEFF_CACHE_DIR is set: a run without it uses its own --neff_cache_dir or OUT_DIR/neff_cache."""
    from common.device import NEFF_CACHE_VAR

    if dev == "neuron" and not os.environ.get(NEFF_CACHE_VAR):
        raise UserError(f"{NEFF_CACHE_VAR} is not set: name the run's NEFF cache with --to/--from (its "
                        f"--neff_cache_dir, else OUT_DIR/neff_cache), or export {NEFF_CACHE_VAR} as the run sees it")
    return compile_cache.local_folder(dev, compiled=True)


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(prog="python -m tools.compile_cache",
                            description="A compile cache shared across hosts: this host's key, pull, push.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{key,pull,push}")
    key = sub.add_parser("key", help="print this host's key")
    pull = sub.add_parser("pull", help="copy the store's entries of this host's key into the local folder")
    push = sub.add_parser("push", help="copy the local folder's entries the store lacks, under this host's key")
    for p in (key, pull, push):
        p.add_argument("--device", choices=DEVICES, default="auto", help="the key's device (default: auto)")
    for p, flag, what in ((pull, "--to", "into"), (push, "--from", "from")):
        p.add_argument("url", metavar="URL", help="a shared folder, file://..., or s3://bucket/prefix")
        p.add_argument(flag, dest="dir", metavar="DIR",
                       help=f"the local compile cache to copy {what} (default: the folder a run here compiles into)")
    pull.add_argument("--key", help="the key the entries were pushed under: must be this host's")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        dev = device_type(args.device)
        key = compile_cache.cache_key(dev)
        if args.command == "key":
            print(key)
            return 0
        if getattr(args, "key", None) is not None and args.key != key:
            raise UserError(f"--key {one_line(args.key)} is not this host's key {key}: those graphs were compiled by "
                            "another compiler version; install that stack first (the row's pip install line)")
        folder = args.dir or default_folder(dev)
        kind = "neff" if dev == "neuron" else "inductor"
        shared = compile_cache.SharedCache(args.url, key, folder, kind=kind)
        if args.command == "pull":
            n = shared.pull()
            done, size = f"pulled {n} entr{'y' if n == 1 else 'ies'}", shared.pulled_bytes
            where = f"from {compile_cache.shown_url(args.url)}/{key} into {one_line(folder)}"
        else:
            n = shared.push()
            done, size = f"pushed {n} entr{'y' if n == 1 else 'ies'}", shared.pushed_bytes
            where = f"from {one_line(folder)} to {compile_cache.shown_url(args.url)}/{key}"
        seconds = shared.pull_s if args.command == "pull" else shared.push_s
        print(f"{done} ({size / 2**20:.1f} MiB) {where} in {seconds:.1f} s")
        if shared.unsafe:
            print(f"skipped {shared.unsafe} name(s) in the store that lead outside the folder ('..') or are not "
                  "printable",
                  file=sys.stderr)
    except UserError as e:
        print(f"error: {one_line(str(e))}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
