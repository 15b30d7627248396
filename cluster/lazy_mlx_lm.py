"""mlx-lm's package, registered without running its `__init__` until a name in it is used.

`mlx_lm/__init__.py` imports mlx-lm's converter, generator and loader, and through them
`transformers`: most of what `python -m cluster node` spends importing. Importing any of
mlx-lm's modules (`mlx_lm.models.qwen3_5`, which every node needs) runs the package's `__init__`
first. A node never tokenizes, and `cluster status` or `down` neither tokenizes nor runs a
model, yet each would pay that import at every start.

So `cluster/__init__.py` registers the package from its own import spec, with its path but
without running its body. Its modules import as before, each with only what it imports itself:
the tokenizer's module still brings `transformers` in, where a process needs it. The first
use of a name of the package itself (`mlx_lm.load`, `from mlx_lm import stream_generate`) runs
the package's `__init__` then, in the same module object, and every name is there from then
on. Where mlx-lm was imported before `cluster` (a test importing it first), nothing changes.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import threading

PACKAGE = "mlx_lm"


def defer_package_init() -> None:
    """Register mlx-lm's package with its body deferred to the first use of one of its names;
    nothing when it is imported already (or not installed)."""
    if PACKAGE in sys.modules:
        return
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or spec.loader is None:
        return
    # What the body does first, for the process: transformers' advisory warnings off (the
    # tokenizer's module brings transformers in before the body runs, if ever).
    os.environ["TRANSFORMERS_NO_ADVISORY_WARNINGS"] = "1"
    package = importlib.util.module_from_spec(spec)  # its path is set: its modules import
    # Held while the body runs: another thread's first use waits for every name. The thread
    # running the body re-enters (the body's own imports look names up here) and finds the
    # package partly initialised, as any package is during its body.
    lock = threading.RLock()
    running = False

    def run_body_for(name: str) -> object:
        nonlocal running
        with lock:
            if not running and "__getattr__" in package.__dict__:
                running = True
                try:
                    spec.loader.exec_module(package)
                finally:
                    del package.__getattr__  # the body's own names, not this, from now on
        try:
            return package.__dict__[name]
        except KeyError:
            raise AttributeError(f"module {PACKAGE!r} has no attribute {name!r}") from None

    package.__getattr__ = run_body_for  # module-level __getattr__: only for names not there
    sys.modules[PACKAGE] = package
