"""The training corpus: Python source files, read deterministically, with a held-out split.

The default corpus is the CPython standard library of the running interpreter (found through
``sysconfig``), which every machine that runs specdec has.  Files are read in sorted order of
their path relative to the corpus root, and each file is assigned to the held-out split by a
hash of that relative path, so the split is the same on every machine and every run and the
training code never sees a held-out file.

A wider corpus adds the Python source of installed packages (``package:NAME``, found without
importing them, only ``.py`` files); ``package_license`` reads each one's declared license so the
model card can list them, and ``site:permissive`` stands for every installed package whose
license is permissive (``expand``).  Users can also give their own corpus: any mix of files and
directories (all text files found under a directory are used).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import importlib.util
import os
import re
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, List, Sequence

from packaging.utils import canonicalize_name  # a transformers dependency

HELDOUT_PERCENT = 5

# Suffixes read when a user gives a directory; anything else is tried and kept if it decodes
# as UTF-8 text without NUL bytes.
_BINARY_SUFFIXES = {
    ".pyc", ".pyo", ".so", ".o", ".a", ".dll", ".dylib", ".exe", ".bin", ".pt", ".pth",
    ".safetensors", ".png", ".jpg", ".jpeg", ".gif", ".ico", ".zip", ".gz", ".bz2", ".xz",
    ".tar", ".whl", ".pdf", ".npy", ".npz", ".wav", ".mp3", ".mp4", ".ttf", ".woff",
}


@dataclass(frozen=True)
class Document:
    """One source file: its path relative to the corpus root, and its text."""

    name: str
    text: str


def is_heldout(name: str, percent: int = HELDOUT_PERCENT) -> bool:
    """True if the file with this relative path belongs to the held-out split."""
    digest = hashlib.sha256(name.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") % 100 < percent


def stdlib_root() -> Path:
    """Directory of the running interpreter's standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(include_tests: bool = True) -> List[str]:
    """Relative paths of the stdlib ``.py`` files, sorted; site-packages is never included."""
    root = stdlib_root()
    names = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = os.path.relpath(dirpath, root)
        parts = [] if rel_dir == "." else rel_dir.split(os.sep)
        if "site-packages" in parts or "dist-packages" in parts:
            dirnames[:] = []
            continue
        if not include_tests and any(p in ("test", "tests", "idle_test") for p in parts):
            dirnames[:] = []
            continue
        dirnames[:] = [d for d in dirnames if d not in ("site-packages", "dist-packages", "__pycache__")]
        for fn in filenames:
            if fn.endswith(".py"):
                names.append(fn if not parts else "/".join(parts + [fn]))
    return sorted(names)


def _read_text(path: Path) -> str | None:
    try:
        data = path.read_bytes()
    except OSError:
        return None
    if b"\x00" in data:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def stdlib_documents(split: str = "train", include_tests: bool = True) -> List[Document]:
    """The stdlib corpus, one split: ``"train"``, ``"heldout"`` or ``"all"``."""
    root = stdlib_root()
    return select_documents(root, stdlib_files(include_tests), split)


def select_documents(root: Path, names: Iterable[str], split: str, prefix: str = "") -> List[Document]:
    """The readable text files among `names` (paths under `root`) that fall in `split`: which split
    a file is in depends only on `prefix` + its relative path (``is_heldout``)."""
    if split not in ("train", "heldout", "all"):
        raise ValueError(f"unknown split {split!r}")
    docs = []
    for name in names:
        if split != "all" and is_heldout(prefix + name) != (split == "heldout"):
            continue
        text = _read_text(root / name)
        if text:
            docs.append(Document(name, text))
    return docs


def _walk_text_files(root: Path) -> Iterator[str]:
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") and d != "__pycache__")
        for fn in filenames:
            if fn.startswith(".") or Path(fn).suffix.lower() in _BINARY_SUFFIXES:
                continue
            yield os.path.relpath(os.path.join(dirpath, fn), root).replace(os.sep, "/")


def user_documents(paths: Sequence[str], split: str = "train") -> List[Document]:
    """A user-given corpus: files and/or directories (every text file found under them).

    Documents are named ``<argument index>:<relative path>`` and sorted, so the order and the
    held-out split do not depend on the file system's listing order. A tiny argument (one file, a
    small directory) may hash every file into the held-out split: it is then all trained on, and
    nothing of it is held out. That is decided per argument, as train.data tokenizes a corpus an
    argument at a time, so what distill trains on is never what the verdict or evaluate hold out.
    """
    docs: List[Document] = []
    for i, p in enumerate(paths):
        got = _user_split(p, split)
        if split != "all":
            trained = got if split == "train" else _user_split(p, "train")
            if not trained:
                got = _user_split(p, "all") if split == "train" else []
        docs += [Document(f"{i}:{d.name}", d.text) for d in got]
    return docs


def _user_split(p: str, split: str) -> List[Document]:
    path = Path(p)
    if path.is_dir():
        names = sorted(_walk_text_files(path))
        root = path
    elif path.is_file():
        names, root = [path.name], path.parent
    else:
        raise FileNotFoundError(f"corpus path not found: {p}")
    return list(select_documents(root, names, split))


def package_location(name: str) -> Path:
    """An installed package's directory, or the ``.py`` file of a single-module one
    (``typing_extensions``); FileNotFoundError if neither is installed."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):  # a parent package that is not installed, an empty name
        spec = None
    if spec is not None and spec.submodule_search_locations:
        return Path(list(spec.submodule_search_locations)[0])
    if spec is not None and spec.origin and spec.origin.endswith(".py"):
        return Path(spec.origin)
    raise FileNotFoundError(f"no installed package or Python module named {name!r}")


# Larger package files are generated tables and data, not code anyone writes; they are skipped.
MAX_PACKAGE_FILE_BYTES = 256_000
# At most this much source per package and split, so a few giant packages do not make up the
# corpus: files are taken in the order of a hash of their names until the budget is spent.
MAX_PACKAGE_BYTES = 16_000_000


def package_documents(name: str, split: str = "train") -> List[Document]:
    """The ``.py`` files of an installed package, named ``<name>/<relative path>`` (the held-out
    split is chosen by that name, so it does not depend on where the package is installed).
    Files over ``MAX_PACKAGE_FILE_BYTES`` are left out, and at most ``MAX_PACKAGE_BYTES`` are read."""
    root, names = package_files(name)
    docs = [Document(f"{name}/{d.name}", d.text) for d in select_documents(root, names, split, prefix=f"{name}/")]
    kept, total = [], 0
    for d in sorted(docs, key=lambda d: hashlib.sha256(d.name.encode("utf-8")).digest()):
        total += len(d.text)
        if total > MAX_PACKAGE_BYTES:
            break
        kept.append(d)
    return sorted(kept, key=lambda d: d.name)


def package_files(name: str) -> tuple[Path, List[str]]:
    """The root of an installed package (a single module: its directory) and its ``.py`` files
    under ``MAX_PACKAGE_FILE_BYTES``, relative to the root, sorted."""
    loc = package_location(name)
    root, names = (loc.parent, [loc.name]) if loc.is_file() else (loc, _walk_text_files(loc))
    return root, sorted(n for n in names if n.endswith(".py") and (root / n).stat().st_size <= MAX_PACKAGE_FILE_BYTES)


def source_files(spec: str, include_tests: bool = True) -> List[Path]:
    """The files a corpus spec (``stdlib``, ``package:NAME``, a file or a directory) reads, in
    both splits: what a token stream made from it depends on."""
    if spec == "stdlib":
        return [stdlib_root() / n for n in stdlib_files(include_tests)]
    if spec.startswith("package:"):
        root, names = package_files(spec.split(":", 1)[1])
        return [root / n for n in names]
    path = Path(spec)
    return [path / n for n in sorted(_walk_text_files(path))] if path.is_dir() else [path]


@functools.lru_cache(maxsize=1)
def _distributions() -> dict:
    """Top-level import name -> distributions (one scan of the installed metadata per process)."""
    return importlib.metadata.packages_distributions()


def package_license(name: str, distributions: dict | None = None) -> str:
    """The license an installed package declares (SPDX expression, License field or classifier).
    Where several distributions install the same top-level name (a wheel that also ships a stray
    `build/` directory, say), the one named like the package decides; failing that, every one's
    license is listed, so that `is_permissive` refuses the package if any of them is not.
    `distributions` maps top-level names to distributions (default: this interpreter's)."""
    top = name.split(".")[0]
    dists = list(dict.fromkeys((_distributions() if distributions is None else distributions).get(top, [])))
    own = [d for d in dists if canonicalize_name(d) == canonicalize_name(top)]
    found = []
    for dist in own or dists:
        meta = importlib.metadata.metadata(dist)
        lic = meta.get("License-Expression") or ""
        if not lic:
            field = (meta.get("License") or "").strip()
            lic = field.splitlines()[0] if field and len(field) < 100 else ""
        if not lic:
            lic = "; ".join(c.split("::")[-1].strip() for c in meta.get_all("Classifier") or [] if c.startswith("License ::"))
        found.append(f"{lic or 'unknown'} ({dist})")
    return "; ".join(found) or "unknown"


# Licenses that let the source be trained on and the weights shipped without conditions on them
# (whole words: "MIT" in "Limited" does not count), and terms that rule a license out (anywhere:
# "LGPL" contains "GPL").
_PERMISSIVE = re.compile(r"\b(MIT|BSD|APACHE|PSF|PYTHON SOFTWARE FOUNDATION|ISC|UNLICENSE|HPND|ZLIB)\b")
_EXCLUDED = re.compile(r"GPL|MPL|MOZILLA|EPL|CDDL|PROPRIETARY|COMMERCIAL")


def is_permissive(license_text: str) -> bool:
    """True for a declared license that is MIT, BSD, Apache, PSF, ISC and the like, and names
    no copyleft or proprietary terms (an ``OR`` with GPL is refused too: keep it simple)."""
    text = license_text.upper()
    return bool(_PERMISSIVE.search(text)) and not _EXCLUDED.search(text)


def permissive_packages(exclude: Sequence[str] = ()) -> List[str]:
    """The importable top-level packages of this interpreter's installed distributions whose
    declared license is permissive, sorted; ``exclude`` names packages to leave out (e.g. the
    out-of-domain evaluation set)."""
    names = set()
    for name in _distributions():
        if name in exclude or name.startswith("_") or not name.isidentifier():
            continue
        try:
            if package_location(name).is_dir() and is_permissive(package_license(name)):  # packages, not single modules
                names.add(name)
        except (FileNotFoundError, ImportError, ValueError):
            continue
    return sorted(names)


def expand(specs: Sequence[str], exclude: Sequence[str] = ()) -> List[str]:
    """Specs with ``site:permissive`` replaced by one ``package:NAME`` per permissive package."""
    out: List[str] = []
    for spec in specs:
        if spec == "site:permissive":
            out += [f"package:{n}" for n in permissive_packages(exclude) if f"package:{n}" not in specs]
        else:
            out.append(spec)
    return out


# A vendored copy's imports name its vendoring package (``from pip._vendor.rich import x``); a
# copy that differs only there is the same text to a model.
_VENDORED = re.compile(r"\b(?:[A-Za-z_]\w*\.)*_vendor\.")


def content_key(text: str) -> str:
    """A digest of a file's text with vendoring prefixes removed: equal for copies of one file."""
    return hashlib.sha256(_VENDORED.sub("", text).strip().encode("utf-8")).hexdigest()


def unseen(docs: Sequence[Document], seen: Sequence[Document]) -> List[Document]:
    """The docs whose text (``content_key``) is not among `seen`'s: the split is by path, so a file
    copied into several packages (a vendored library, setuptools' copy of distutils) can be held
    out in one place and trained on in another; and an out-of-domain package can be vendored by a
    trained one (pip's copy of rich)."""
    keys = {content_key(d.text) for d in seen}
    return [d for d in docs if content_key(d.text) not in keys]


def documents(specs: Sequence[str], split: str = "train", include_tests: bool = True,
              exclude: Sequence[str] = ()) -> List[Document]:
    """A corpus from specs: ``stdlib`` (the standard library), ``package:NAME`` (an installed
    package's Python source), ``site:permissive`` (see ``expand``; `exclude` as there), or any
    file or directory path."""
    docs: List[Document] = []
    paths = []
    for spec in expand(specs, exclude):
        if spec == "stdlib":
            docs += stdlib_documents(split, include_tests)
        elif spec.startswith("package:"):
            docs += package_documents(spec.split(":", 1)[1], split)
        else:
            paths.append(spec)
    if paths:
        docs += user_documents(paths, split)
    return docs


def check(specs, where: str) -> None:
    """SystemExit, one line starting with `where` (a tool and its flag), for a corpus spec that
    names nothing: a missing path, a package not installed."""
    for spec in specs:
        if spec.startswith("package:"):
            try:
                package_location(spec.split(":", 1)[1])
            except FileNotFoundError as e:
                raise SystemExit(f"{where} {spec}: {e}") from None
        elif spec != "stdlib" and not Path(spec).exists():
            raise SystemExit(f"{where} {spec}: no such file or directory")
