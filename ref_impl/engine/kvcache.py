"""The key/value cache: what a decoder remembers between tokens.

Attention at step t needs the keys and values of every earlier position. Recomputing
them would make each token cost a full forward over the prefix, so they are kept. This
cache is *static*: its buffers are allocated once, for the longest sequence the caller
asks for, and each step writes its new keys and values into the next free slots. No
step allocates, grows or copies the history (the dispatch chapter measures why that
matters for inter-token jitter). Two growing caches with the same interface are here to be
measured against it: `ConcatKVCache` concatenates every step's keys onto the history (a new
buffer and a full copy per token), and `ChunkedKVCache` grows in chunks of `step` positions, as
mlx-lm's `KVCache` does (one allocation and copy every `step` tokens). `CACHES` names all three.
Quantized variants arrive with the KV-cache chapter.

Shapes: keys and values are (B, n_kv_heads, max_size, head_dim); `offset` is how many
positions are filled.

See chapter: kv-cache
"""

from __future__ import annotations

import mlx.core as mx


class KVCache:
    """A pre-allocated float key/value cache for one attention layer."""

    preallocate = True   # the growing caches below start empty instead

    def __init__(self, batch: int, n_kv_heads: int, head_dim: int, max_size: int,
                 dtype: mx.Dtype = mx.float32):
        if min(batch, n_kv_heads, head_dim, max_size) < 1:
            raise ValueError(f"KVCache sizes must be positive, got batch={batch}, "
                             f"n_kv_heads={n_kv_heads}, head_dim={head_dim}, max_size={max_size}")
        shape = (batch, n_kv_heads, max_size if self.preallocate else 0, head_dim)
        self.keys = mx.zeros(shape, dtype=dtype)
        self.values = mx.zeros(shape, dtype=dtype)
        self.max_size = max_size
        self.offset = 0

    def _end(self, k: mx.array, v: mx.array) -> int:
        """Check k, v (B, n_kv_heads, L, head_dim) against the cache; the offset after storing them."""
        if k.shape != v.shape or k.ndim != 4 or k.shape[:2] != self.keys.shape[:2] or k.shape[3] != self.keys.shape[3]:
            raise ValueError(f"KVCache expects keys/values of shape (B, H, L, D) = "
                             f"{self.keys.shape[:2] + ('L',) + self.keys.shape[3:]}, "
                             f"got {k.shape} and {v.shape}")
        end = self.offset + k.shape[2]
        if end > self.max_size:
            raise ValueError(f"KV cache full: {end} positions needed, {self.max_size} allocated "
                             "(raise max_size, or the model's context length is reached)")
        return end

    def update_and_fetch(self, k: mx.array, v: mx.array) -> tuple[mx.array, mx.array]:
        """Store k, v (B, n_kv_heads, L, head_dim) at the next L slots; return the whole history.

        The attention layer calls this once per forward: the returned arrays are
        (B, n_kv_heads, offset + L, head_dim).
        """
        end = self._end(k, v)
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


class StepCache:
    """One layer's cache inside a compiled decode step (generate.compiled_decoder): a KVCache's buffers and
    the write position, all arrays, so the step's graph is the same at every position and mx.compile traces
    it once. One token a step; attention reads the whole buffer with the unwritten slots masked out."""

    fused = True   # model.Attention hands q, k, v to `attend`

    def __init__(self, keys: mx.array, values: mx.array, pos: mx.array):
        self.keys, self.values, self.offset = keys, values, pos

    def attend(self, q: mx.array, k: mx.array, v: mx.array, scale: float, mask=None) -> mx.array:
        """Write k, v (B, n_kv_heads, 1, head_dim) at `pos`; attend q over every slot written so far."""
        if k.shape[2] != 1:
            raise ValueError(f"a compiled decode step takes one token, got {k.shape[2]}")
        at = self.offset.reshape(1)
        self.keys = mx.slice_update(self.keys, k, at, axes=(2,))
        self.values = mx.slice_update(self.values, v, at, axes=(2,))
        written = mx.arange(self.keys.shape[2]) <= self.offset
        return mx.fast.scaled_dot_product_attention(q, self.keys, self.values, scale=scale, mask=written)


class ConcatKVCache(KVCache):
    """A cache that grows by concatenation: every forward allocates a new history one step longer
    and copies the old one into it. Same interface as KVCache; max_size only caps the length."""

    preallocate = False

    def update_and_fetch(self, k: mx.array, v: mx.array) -> tuple[mx.array, mx.array]:
        """Append k, v (B, n_kv_heads, L, head_dim); return the whole history, a fresh array
        (after a trim, the forgotten tail is dropped)."""
        end = self._end(k, v)
        self.keys = mx.concatenate([self.keys[:, :, :self.offset, :], k.astype(self.keys.dtype)], axis=2)
        self.values = mx.concatenate([self.values[:, :, :self.offset, :], v.astype(self.values.dtype)], axis=2)
        self.offset = end
        return self.keys, self.values


class ChunkedKVCache(KVCache):
    """A cache that grows `step` positions at a time (mlx-lm's KVCache policy): writes land in
    free slots of the current buffer; when a forward does not fit, a zeroed chunk of whole steps
    is concatenated on, so every `step`-th token pays one allocation and a copy of the history."""

    preallocate = False

    def __init__(self, batch: int, n_kv_heads: int, head_dim: int, max_size: int,
                 dtype: mx.Dtype = mx.float32, step: int = 256):
        super().__init__(batch, n_kv_heads, head_dim, max_size, dtype)
        if step < 1:
            raise ValueError(f"step must be positive, got {step}")
        self.step = step

    def update_and_fetch(self, k: mx.array, v: mx.array) -> tuple[mx.array, mx.array]:
        """Store k, v (B, n_kv_heads, L, head_dim) at the next L slots, growing first if they do
        not fit; return the filled part, (B, n_kv_heads, offset + L, head_dim)."""
        end = self._end(k, v)
        if end > self.keys.shape[2]:   # the filled part, then a new chunk: one copy of the history
            b, h, _, d = self.keys.shape
            chunk = mx.zeros((b, h, -(-k.shape[2] // self.step) * self.step, d), dtype=self.keys.dtype)
            self.keys = mx.concatenate([self.keys[:, :, :self.offset, :], chunk], axis=2)
            self.values = mx.concatenate([self.values[:, :, :self.offset, :], chunk], axis=2)
        return super().update_and_fetch(k, v)


CACHES = {"static": KVCache, "chunked": ChunkedKVCache, "concat": ConcatKVCache}


def make_caches(kind: str, n_layers: int, batch: int, n_kv_heads: int, head_dim: int, max_size: int,
                dtype: mx.Dtype = mx.float32) -> list:
    """One cache of kind ("static", "chunked" or "concat") per layer; Model.make_cache builds "static"."""
    if kind not in CACHES:
        raise ValueError(f"unknown cache kind {kind!r}; have {', '.join(CACHES)}")
    return [CACHES[kind](batch, n_kv_heads, head_dim, max_size, dtype) for _ in range(n_layers)]
