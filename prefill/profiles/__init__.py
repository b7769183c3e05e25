"""Prefill latency profiles (Eq. 1 coefficients with provenance) and the script that builds them."""
