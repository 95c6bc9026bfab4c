"""``python -m semaphore.testing.workerd serve``: generate the config and serve the Worker."""

from __future__ import annotations

from ._harness import _main

raise SystemExit(_main())
