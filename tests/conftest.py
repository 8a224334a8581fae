"""Shared pytest setup.

TRITON_INTERPRET must be set before any ``@triton.jit`` decorator runs, i.e. before any ferrokv
kernel module is imported, so it is set here at the very top when no GPU is present.
"""
import os

try:  # pragma: no cover - depends on the machine
    import torch

    _HAS_CUDA = torch.cuda.is_available()
except Exception:  # torch missing: pure-core tests still run
    _HAS_CUDA = False

if not _HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_configure(config):
    # `-m "not slow"` skips the tests that load the real embedded model (~20-30 s each).
    config.addinivalue_line("markers", "slow: loads/converts the real embedded SmolLM2 model")
