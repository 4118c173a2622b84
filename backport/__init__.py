"""gdn-backport: backport Megatron-LM chunkwise CP for Gated DeltaNet onto a pinned tree.

The engine (this package) returns data; ``backport.cli`` is a thin command line over it.
"""

__version__ = "0.1.0"
