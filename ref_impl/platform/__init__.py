"""platform: what the rest stands on. The optimized BLAS MLX's CPU backend calls (blas, loaded before MLX), the
machine record every results file carries (machine), the one clock and its statistics (timing), the
kernel's view of a process's TCP connections (tcp: bytes counted, data waiting), and a C library's stderr held
aside (quiet)."""
