"""formats: the bytes of a model file. GGML's type facts (ggml), the GGUF container (gguf), K-quants bit-exact
with llama.cpp (kquants), and whole-file quantization with llama.cpp's per-tensor type rules (quantize).
numpy only: nothing here needs MLX."""
