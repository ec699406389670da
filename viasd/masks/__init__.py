"""DIMR layer masks shipped with via-sd (package data): one JSON artifact per verifier and skip ratio.

`viasd.llm.LLM` uses the artifact whose verifier and number of skipped layers match the engine
configuration when no mask is given, after checking its model fingerprint (`viasd.dimr.shipped_mask`).
Regenerate them with the commands in docs/DIMR.md.
"""
