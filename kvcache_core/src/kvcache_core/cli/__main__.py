"""``python -m kvcache_core.cli``: the ``kvcache`` command."""

from __future__ import annotations

import sys

from kvcache_core.cli import main

if __name__ == "__main__":
    sys.exit(main())
