"""The key/value cache: what a decoder remembers between tokens.

Attention at step t needs the keys and values of every earlier position. Recomputing
them would make each token cost a full forward over the prefix, so they are kept. This
cache is *static*: its buffers are allocated once, for the longest sequence the caller
asks for, and each step writes its new keys and values into the next free slots. No
step allocates, grows or copies the history (the dispatch chapter measures why that
matters for inter-token jitter). Quantized variants arrive with the KV-cache chapter.

Shapes: keys and values are (B, n_kv_heads, max_size, head_dim); `offset` is how many
positions are filled.

See chapter: kv-cache
"""

from __future__ import annotations

import mlx.core as mx


class KVCache:
    """A pre-allocated float key/value cache for one attention layer."""

    def __init__(self, batch: int, n_kv_heads: int, head_dim: int, max_size: int,
                 dtype: mx.Dtype = mx.float32):
        if min(batch, n_kv_heads, head_dim, max_size) < 1:
            raise ValueError(f"KVCache sizes must be positive, got batch={batch}, "
                             f"n_kv_heads={n_kv_heads}, head_dim={head_dim}, max_size={max_size}")
        shape = (batch, n_kv_heads, max_size, head_dim)
        self.keys = mx.zeros(shape, dtype=dtype)
        self.values = mx.zeros(shape, dtype=dtype)
        self.max_size = max_size
        self.offset = 0

    def update_and_fetch(self, k: mx.array, v: mx.array) -> tuple[mx.array, mx.array]:
        """Store k, v (B, n_kv_heads, L, head_dim) at the next L slots; return the whole history.

        The attention layer calls this once per forward: the returned arrays are
        (B, n_kv_heads, offset + L, head_dim).
        """
        if k.shape != v.shape or k.shape[:2] != self.keys.shape[:2] or k.shape[3] != self.keys.shape[3]:
            raise ValueError(f"KVCache expects keys/values of shape (B, H, L, D) = "
                             f"{self.keys.shape[:2] + ('L',) + self.keys.shape[3:]}, "
                             f"got {k.shape} and {v.shape}")
        end = self.offset + k.shape[2]
        if end > self.max_size:
            raise ValueError(f"KV cache full: {end} positions needed, {self.max_size} allocated "
                             "(raise max_size, or the model's context length is reached)")
        self.keys[:, :, self.offset:end, :] = k
        self.values[:, :, self.offset:end, :] = v
        self.offset = end
        return self.keys[:, :, :end, :], self.values[:, :, :end, :]

    def trim(self, n: int) -> int:
        """Forget the last n positions (speculative decoding rewinds rejected drafts this way)."""
        n = max(0, min(self.offset, n))
        self.offset -= n
        return n

    @property
    def state(self) -> tuple[mx.array, mx.array]:
        """The filled part of the cache: (keys, values), each (B, n_kv_heads, offset, head_dim)."""
        return self.keys[:, :, :self.offset, :], self.values[:, :, :self.offset, :]

    @property
    def nbytes(self) -> int:
        """Bytes held by the allocated buffers (not only the filled part)."""
        return self.keys.nbytes + self.values.nbytes
