"""glm-cache-server: a standalone LRU cache for hybrid (KDA + sparse-MLA) prompt state.

This package imports neither vLLM nor torch.
"""
