"""CUDA preparation: fixed-address arena, kernel-image capture, graph capture and export.

Import order matters: ``session.begin()`` must run before torch initialises
CUDA, so CUPTI sees every module load and the arena's address range is ours.
"""
