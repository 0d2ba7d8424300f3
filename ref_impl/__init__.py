"""ref_impl: the engine of "Local Inference Acceleration, measured".

Small modules, one concept each, that compose into one working MLX decoder:
platform -> formats -> engine -> kernels -> training, measure -> ledger, with theory (numpy, first
principles) and viz (figures) beside them; see README.md, "Layout".

On Linux the MLX CPU wheel calls a slow reference BLAS; an optimized one is loaded here,
before anything imports mlx (see platform/blas.py).
"""

from pathlib import Path

from ref_impl.platform import blas

blas.load_optimized_blas()

ROOT = Path(__file__).resolve().parent.parent
MODELS_DIR = ROOT / "models"     # the shipped GGUF models
RESULTS_DIR = ROOT / "results"   # measured results, one JSON file per machine and run
VOCAB_DIR = ROOT / ".vocab"      # llama.cpp's tokenizer test vocabularies, extracted by `make setup`
