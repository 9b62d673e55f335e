"""`python -m thoughtscope`: the same as the `thoughtscope` command."""

from thoughtscope.cli import main

main()
