"""Load a variant's files as modules with unique names.

Every variant has its own `model.py`; importing them all as `model` would make one
shadow another. `sibling(__file__, "model")` loads the `model.py` next to the calling
file under a name derived from its folder (e.g. `variants.dense.model`), so a copied
variant picks up its own model without editing any import line.
"""

from __future__ import annotations

import importlib.util
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load(path: str):
    """Import the Python file at `path` (once) and return the module."""
    path = os.path.abspath(path)
    rel = os.path.relpath(path, ROOT)
    name = (
        rel[:-3].replace(os.sep, ".") if not rel.startswith("..") else "stencil_ext." + path[1:-3].replace(os.sep, ".")
    )
    if name in sys.modules:
        return sys.modules[name]
    if not os.path.exists(path):
        raise FileNotFoundError(f"no such file: {path}")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def sibling(file: str, stem: str):
    """The module `<stem>.py` in the same folder as `file`."""
    return load(os.path.join(os.path.dirname(os.path.abspath(file)), stem + ".py"))


def discover() -> list[str]:
    """Every folder under templates/ and variants/ holding both model.py and train.py."""
    found = []
    for top in ("templates", "variants"):
        base = os.path.join(ROOT, top)
        for name in sorted(os.listdir(base)) if os.path.isdir(base) else []:
            d = os.path.join(base, name)
            if os.path.isfile(os.path.join(d, "model.py")) and os.path.isfile(os.path.join(d, "train.py")):
                found.append(f"{top}/{name}")
    return found
