"""via-sd: multi-tier speculative decoding (VIA-SD) — drafter p, slim verifier q', full verifier q.

This top-level package stays light (no torch, no Ray, no gRPC at import time) so that the
client SDK in ``viasd.client`` installs and imports without the serving stack.
"""

__version__ = "0.1.0"
