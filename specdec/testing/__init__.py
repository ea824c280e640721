"""Helpers for the tests, the demo and the benchmarks, run from a checkout of the repository:

* `tinymodels` builds tiny seeded Llama models and word-level tokenizers on disk (nothing is
  downloaded);
* `launch` starts the services as their own processes through their real command lines.

Not part of the installed package (see DESIGN.md §10): it needs the server extras and the
repository's layout (services are started with `python -m` from the repository root)."""
