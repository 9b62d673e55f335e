"""thoughtscope: a browser workbench for looking inside language models while they reason.

This package holds only what sits outside the layered packages (see docs/architecture.md):
- `thoughtscope.errors` and `thoughtscope.provenance`: leaf modules every package may import
  (they import nothing of the project);
- `thoughtscope.cli`: the `thoughtscope` command, which sits above every package and discovers
  the sub-commands and benchmarks each one offers.
"""

__version__ = "0.2.0"
