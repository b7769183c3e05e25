"""The startup heap of a process that exists to serve (`nanocp serve`, an instance process), out of the cyclic GC.

A full collection walks every tracked object: in a serving process (about 200,000 once torch, the model and the
engine are loaded) it took 100 ms on this project's VM, holding the GIL, so the engine loop, or an instance and with
it its EP group at the next exchange, stalled meanwhile. Startup objects that end up in garbage cycles stay until
`gc.unfreeze()`, which such a process calls on its way out (then interpreter exit frees them).
"""

from __future__ import annotations

import gc


def freeze_startup_heap() -> None:
    """Collect what is garbage now, then take everything still alive out of the collector's scans."""
    gc.collect()
    gc.freeze()
