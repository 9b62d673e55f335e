"""`python -m benchmarks`: every performance ratio of the project, one JSON object per line.

The same measurements as the `thoughtscope bench ...` commands, in one run; see README for the
figures measured on a 2-core CPU machine.
"""

from __future__ import annotations

import os
import subprocess
import sys

GROUPS = ["hooks", "server", "cot", "rise"]


def main() -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    groups = sys.argv[1:] or GROUPS
    failed = 0
    for group in groups:
        # one process per group: a model loaded for one group does not slow the next
        failed |= subprocess.call([sys.executable, "-m", "probes.cli", "bench", group, "--json"])
    return failed


if __name__ == "__main__":
    sys.exit(main())
