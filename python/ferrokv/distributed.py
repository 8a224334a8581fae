"""vLLM's ``vllm.distributed.cleanup_dist_env_and_memory``, which scripts call between two ``LLM``s
in one process. ferrokv keeps no distributed state (one process, one device), so it only collects
the garbage of the engines the script dropped and hands their cached GPU memory back to the driver.

Costs: one ``gc.collect()`` (and, on CUDA, one ``torch.cuda.empty_cache()``).
"""

from __future__ import annotations

import gc

import torch

__all__ = ["cleanup_dist_env_and_memory"]


def cleanup_dist_env_and_memory(shutdown_ray: bool = False) -> None:
    """Frees what dropped engines held (``shutdown_ray``: vLLM's, nothing to shut down here)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
