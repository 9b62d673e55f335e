"""`python -m benchmarks [GROUP ...]`: every performance ratio of the project, one JSON object per line.

The groups are discovered as `thoughtscope bench` discovers them (probes.bench and each method
package's bench.py); each runs in its own process, so a model loaded for one group does not slow
the next. See README for the figures measured on a 2-core CPU machine.
"""

from __future__ import annotations

import os
import subprocess
import sys


def main() -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from thoughtscope.cli import benchmark_groups

    groups = sys.argv[1:] or sorted(benchmark_groups())
    failed = 0
    for group in groups:
        failed |= subprocess.call([sys.executable, "-m", "thoughtscope", "bench", group, "--json"])
    return failed


if __name__ == "__main__":
    sys.exit(main())
