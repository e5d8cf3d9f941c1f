"""Command line of spikingjelly_mfpsn: ``python -m spikingjelly_mfpsn build`` builds the C++ kernels of
backend 'cpp' ahead of time (e.g. before a first training run), so that no first use waits for them."""
from __future__ import annotations

import argparse
import sys
from typing import Optional


def build() -> int:
    """Build (or load from the cache) the C++ kernels and print their directory; 1 where they cannot build."""
    from .ops import cpp_ops
    reason = cpp_ops.unavailable_reason()
    try:
        if reason is not None:
            raise cpp_ops.BuildError(f"backend 'cpp' cannot run here: {reason}")
        unwritable = cpp_ops.unwritable(cpp_ops.build_dir())
        if unwritable is not None:  # (a build for this process only would be gone when the command ends)
            raise cpp_ops.BuildError(f"the build cache {cpp_ops.build_dir()} cannot be written ({unwritable}): set "
                                     f"${cpp_ops.BUILD_ENV} to a writable directory")
        directory = cpp_ops.load()
    except cpp_ops.BuildError as e:
        print(f"spikingjelly_mfpsn build: {e}", file=sys.stderr)
        return 1
    print(f"spikingjelly_mfpsn: the C++ kernels of backend 'cpp' are built, in {directory}")
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m spikingjelly_mfpsn",
                                     description="Tools of spikingjelly_mfpsn, the multiplication-free PSN.")
    commands = parser.add_subparsers(dest="command", metavar="command", required=True)
    commands.add_parser("build", help="build the C++ kernels of backend 'cpp' now (once; then cached) and "
                                      "print where they are",
                        description="Build the C++ kernels of backend 'cpp' (or load them from the build cache, "
                                    "$SPIKINGJELLY_MFPSN_BUILD or ~/.cache/spikingjelly_mfpsn/build) and print "
                                    "their directory. Exits 1, with the reason, where they cannot build or the cache "
                                    "cannot be written.")
    args = parser.parse_args(argv)
    return {"build": build}[args.command]()


if __name__ == "__main__":
    sys.exit(main())
