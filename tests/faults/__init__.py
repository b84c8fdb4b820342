"""The fault suite: faults injected into real processes on loopback (see conftest.py)."""
