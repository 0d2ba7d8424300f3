"""platform: what the rest stands on. The optimized BLAS MLX's CPU backend calls (blas, loaded before MLX), the
machine record every results file carries (machine), and the one clock and its statistics (timing)."""
