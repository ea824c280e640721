"""No import cycles between the top-level packages (import-linter's acyclic_siblings contract, in
pyproject.toml, covers the modules inside each package but not the packages themselves).
Exit 1 naming each pair of packages that import each other, directly or not."""
from __future__ import annotations

import itertools
import os
import sys

import grimp

ROOTS = ("specdec", "draft_service", "verify_service", "client", "bench", "train")


def main() -> int:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout's packages
    graph = grimp.build_graph(*ROOTS, cache_dir=None)
    bad = [(a, b) for a, b in itertools.combinations(ROOTS, 2)
           if graph.chain_exists(a, b, as_packages=True) and graph.chain_exists(b, a, as_packages=True)]
    for a, b in bad:
        chain = graph.find_shortest_chain(a, b, as_packages=True) if hasattr(graph, "find_shortest_chain") else None
        print(f"import cycle: {a} <-> {b}" + (f" (e.g. {' -> '.join(chain)})" if chain else ""))
    if not bad:
        print(f"no import cycles between {', '.join(ROOTS)}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
