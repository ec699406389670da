"""Serving configuration, placement, the Ray Serve application and launch (``viasd.cluster``)."""
