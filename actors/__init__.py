"""Ray actors hosting the drafter, the tensor-parallel verifier workers and the coordinator.

Imported as ``viasd.actors`` (never as a top-level ``actors``). The actors themselves are the
subject of the distributed-serving work; the decode algorithm they run lives in ``viasd.engine``.
"""
