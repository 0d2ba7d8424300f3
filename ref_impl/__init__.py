"""ref_impl: the engine of "Local Inference Acceleration, measured".

Small modules, one concept each, that compose into one working MLX decoder:
gguf -> kquants -> model (+kvcache) -> generate -> bench -> results/.

On Linux the MLX CPU wheel calls a slow reference BLAS; an optimized one is loaded here,
before anything imports mlx (see blas.py).
"""

from pathlib import Path

from . import blas

blas.load_optimized_blas()

MODELS_DIR = Path(__file__).resolve().parent.parent / "models"  # the shipped GGUF models
