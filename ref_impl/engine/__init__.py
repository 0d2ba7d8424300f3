"""engine: the decoder. The Llama-family model (model), GGUF load/save (checkpoint), quantized weights kept
quantized in MLX (transcode), the tokenizer (tokenizer), KV caches (kvcache; quantized ones in kvquant), the decode
loop (generate), speculative decoding (speculative) and multi-token-prediction heads (mtp), every technique as a
switch of one loop (compose), random-weight models in public shapes (random), and the layers split over processes
that talk through mx.distributed (pipeline; launch starts and supervises their ranks)."""
