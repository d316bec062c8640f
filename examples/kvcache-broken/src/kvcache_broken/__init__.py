"""A deliberately broken kvcache backend plugin (used only by kvcache's tests).

It fails the way real plugins most often do: its native extension is missing, so the
module raises ``ImportError`` when discovery imports it. Discovery must warn, naming
this distribution, and still list every other backend.
"""

from kvcache_broken._native import paged_kernels  # noqa: F401  (there is no _native module)
