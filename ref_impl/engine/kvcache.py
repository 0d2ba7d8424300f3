"""The key/value cache: what a decoder remembers between tokens.

Attention at step t needs the keys and values of every earlier position. Recomputing
them would make each token cost a full forward over the prefix, so they are kept.

`Cache` is the interface every cache has, here and in kvquant.py: `update_and_fetch` (store
a forward's keys and values, return the whole history), `trim` (forget the newest positions; `rewinds`
says whether a trim leaves an exact cache), `state` (the filled part), `buffers` (every array it holds),
`nbytes`, and `attends`, which tells `model.Attention` how to read it:

* "dense": Attention runs `mx.fast.scaled_dot_product_attention` on what `update_and_fetch`
  returns (the float caches here, and the quantized ones when they dequantize);
* "fused": Attention hands q, k, v to the cache's own `attend(q, k, v, scale, mask)`, which
  stores k, v and attends in one (kvquant's attention on packed codes, `StepCache` below).

`FloatCache` keeps the history as float buffers; `KVCache` is the *static* cache: its buffers are allocated once, for the longest sequence the
caller asks for, and each step writes its new keys and values into the next free slots. No
step allocates, grows or copies the history (the dispatch chapter measures why that matters
for inter-token jitter). Two growing caches with the same interface are here to be measured
against it: `ConcatKVCache` concatenates every step's keys onto the history (a new buffer and
a full copy per token), and `ChunkedKVCache` grows in chunks of `step` positions, as mlx-lm's
`KVCache` does (one allocation and copy every `step` tokens). `kvquant.SCHEMES` names all three
("float", "chunked", "concat") beside the quantized schemes, and `kvquant.make_caches` builds them all.
`WindowKVCache` is the float cache of a sliding-window layer (Gemma's): it keeps only the positions a query's
window can reach, so its memory stops growing with the context (`Model.make_cache` gives it to those layers).

Shapes: keys and values are (B, n_kv_heads, positions, head_dim); `offset` is how many
positions are filled.

See chapter: kv-cache
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import mlx.core as mx


class Cache(ABC):
    """One attention layer's key/value cache: the interface (see the module docstring) and the
    bookkeeping every cache shares: its sizes, dtype and `offset`, the shape and room check
    (`reserve`), and `trim`."""

    attends = "dense"   # or "fused": Attention calls `attend` instead of `update_and_fetch`
    # what a position stores depends on that position alone, so writing L positions in one forward,
    # trimming some and writing again leaves what one-at-a-time decoding would: speculative
    # verification then sees plain decoding's cache (engine/compose.py refuses a cache without it)
    rewinds_exactly = True

    def __init__(self, batch: int, n_kv_heads: int, head_dim: int, max_size: int, dtype: mx.Dtype = mx.float32):
        if min(batch, n_kv_heads, head_dim, max_size) < 1:
            raise ValueError(f"KVCache sizes must be positive, got batch={batch}, "
                             f"n_kv_heads={n_kv_heads}, head_dim={head_dim}, max_size={max_size}")
        self.batch, self.n_kv_heads, self.head_dim = batch, n_kv_heads, head_dim
        self.max_size, self.dtype = max_size, dtype
        self.offset = 0

    def reserve(self, k: mx.array, v: mx.array) -> int:
        """Check k, v (B, n_kv_heads, L, head_dim) against the cache; the offset after storing them."""
        if k.shape != v.shape or k.ndim != 4 or k.shape[:2] != (self.batch, self.n_kv_heads) \
                or k.shape[3] != self.head_dim:
            raise ValueError(f"KVCache expects keys/values of shape (B, H, L, D) = "
                             f"{(self.batch, self.n_kv_heads, 'L', self.head_dim)}, got {k.shape} and {v.shape}")
        return self.room(k.shape[2])

    def room(self, n: int) -> int:
        """The offset after storing n more positions; a ValueError when they do not fit."""
        end = self.offset + n
        if end > self.max_size:
            raise ValueError(f"KV cache full: {end} positions needed, {self.max_size} allocated "
                             "(raise max_size, or the model's context length is reached)")
        return end

    @abstractmethod
    def update_and_fetch(self, k: mx.array, v: mx.array) -> tuple[mx.array, mx.array]:
        """Store k, v (B, n_kv_heads, L, head_dim) at the next L slots; return the whole history,
        (B, n_kv_heads, offset + L, head_dim). The attention layer calls this once per forward."""

    def attend(self, q: mx.array, k: mx.array, v: mx.array, scale: float, mask=None) -> mx.array:
        """For attends == "fused": store k, v (B, n_kv_heads, L, D), return attention of q (B, H, L, D)
        over the whole history, (B, H, L, D)."""
        raise TypeError(f"{type(self).__name__} attends {self.attends!r}: use update_and_fetch")

    def buffers(self) -> list[mx.array]:
        """Every array the cache holds, codes, scales and float windows alike: evaluating them runs what a
        forward wrote into the cache, and nothing the cache does not keep (a prefill's last layer output)."""
        out = []
        for v in vars(self).values():
            out += [v] if isinstance(v, mx.array) else [x for x in v if isinstance(x, mx.array)] \
                if isinstance(v, (list, tuple)) else []
        return out

    def rewinds(self, n: int) -> bool:
        """Whether trimming the last n positions leaves exactly the cache of the positions before them."""
        return self.rewinds_exactly or n >= self.offset

    def trim(self, n: int) -> int:
        """Forget the last n positions (speculative decoding rewinds rejected drafts this way)."""
        n = max(0, min(self.offset, n))
        self.offset -= n
        return n

    @property
    @abstractmethod
    def state(self) -> tuple[mx.array, mx.array]:
        """The filled part: (keys, values), each (B, n_kv_heads, offset, head_dim)."""

    @property
    @abstractmethod
    def nbytes(self) -> int:
        """Bytes held by the allocated buffers (not only the filled part)."""


class FloatCache(Cache):
    """A cache that holds the history as it came, in float buffers `keys` and `values` (B, n_kv_heads, length,
    head_dim), of which the first `offset` positions are filled. The three float caches differ only in how the
    buffers are allocated and grown."""

    def __init__(self, batch: int, n_kv_heads: int, head_dim: int, max_size: int, dtype: mx.Dtype, length: int):
        super().__init__(batch, n_kv_heads, head_dim, max_size, dtype)
        self.keys, self.values = (mx.zeros((batch, n_kv_heads, length, head_dim), dtype=dtype) for _ in range(2))

    @property
    def state(self) -> tuple[mx.array, mx.array]:
        return self.keys[:, :, :self.offset, :], self.values[:, :, :self.offset, :]

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes


class KVCache(FloatCache):
    """A pre-allocated float key/value cache for one attention layer."""

    def __init__(self, batch: int, n_kv_heads: int, head_dim: int, max_size: int, dtype: mx.Dtype = mx.float32):
        super().__init__(batch, n_kv_heads, head_dim, max_size, dtype, length=max_size)

    def update_and_fetch(self, k: mx.array, v: mx.array) -> tuple[mx.array, mx.array]:
        """Store k, v (B, n_kv_heads, L, head_dim) at the next L slots, in place; return the whole
        history (B, n_kv_heads, offset + L, head_dim)."""
        end = self.reserve(k, v)
        self.keys[:, :, self.offset:end, :] = k
        self.values[:, :, self.offset:end, :] = v
        self.offset = end
        return self.state


class StepCache:
    """One layer's cache inside a compiled decode step (generate.compiled_decoder): a KVCache's buffers and
    the write position, all arrays, so the step's graph is the same at every position and mx.compile traces
    it once. One token a step; attention reads the whole buffer with the unwritten slots masked out. Not a
    `Cache`: a step's view of one, with only what Attention reads (`offset`, `attends`, `attend`)."""

    attends = "fused"

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


class ConcatKVCache(FloatCache):
    """A cache that grows by concatenation: every forward allocates a new history one step longer
    and copies the old one into it. Same interface as KVCache; max_size only caps the length."""

    def __init__(self, batch: int, n_kv_heads: int, head_dim: int, max_size: int, dtype: mx.Dtype = mx.float32):
        super().__init__(batch, n_kv_heads, head_dim, max_size, dtype, length=0)

    def update_and_fetch(self, k: mx.array, v: mx.array) -> tuple[mx.array, mx.array]:
        """Append k, v (B, n_kv_heads, L, head_dim); return the whole history, a fresh array
        (after a trim, the forgotten tail is dropped)."""
        end = self.reserve(k, v)
        self.keys = mx.concatenate([self.keys[:, :, :self.offset, :], k.astype(self.dtype)], axis=2)
        self.values = mx.concatenate([self.values[:, :, :self.offset, :], v.astype(self.dtype)], axis=2)
        self.offset = end
        return self.keys, self.values


class ChunkedKVCache(FloatCache):
    """A cache that grows `step` positions at a time (mlx-lm's KVCache policy): writes land in
    free slots of the current buffer; when a forward does not fit, a zeroed chunk of whole steps
    is concatenated on, so every `step`-th token pays one allocation and a copy of the history."""

    def __init__(self, batch: int, n_kv_heads: int, head_dim: int, max_size: int,
                 dtype: mx.Dtype = mx.float32, step: int = 256):
        if step < 1:
            raise ValueError(f"step must be positive, got {step}")
        super().__init__(batch, n_kv_heads, head_dim, max_size, dtype, length=0)
        self.step = step

    def update_and_fetch(self, k: mx.array, v: mx.array) -> tuple[mx.array, mx.array]:
        """Store k, v (B, n_kv_heads, L, head_dim) at the next L slots, growing first if they do
        not fit; return the filled part, (B, n_kv_heads, offset + L, head_dim)."""
        end = self.reserve(k, v)
        if end > self.keys.shape[2]:   # the filled part, then a new chunk: one copy of the history
            grow = -(-k.shape[2] // self.step) * self.step
            chunk = mx.zeros((self.batch, self.n_kv_heads, grow, self.head_dim), dtype=self.dtype)
            self.keys = mx.concatenate([self.keys[:, :, :self.offset, :], chunk], axis=2)
            self.values = mx.concatenate([self.values[:, :, :self.offset, :], chunk], axis=2)
        self.keys[:, :, self.offset:end, :] = k
        self.values[:, :, self.offset:end, :] = v
        self.offset = end
        return self.state


REWIND_MARGIN = 64   # positions a WindowKVCache keeps beyond its window, so speculation can trim its rejected drafts


class WindowKVCache(FloatCache):
    """The cache of a sliding-window layer, whose queries see only the `window` newest positions (Gemma): it keeps
    the last window - 1 positions a future query can need, plus `margin` more so that speculative decoding can trim
    rejected drafts, in a buffer of `step` free slots beyond those. Writes land in free slots; when a forward does
    not fit, the kept positions move to the front of a new buffer (one copy every `step` tokens, as ChunkedKVCache).
    So its memory stays at (window - 1 + margin + step) positions however long the context grows.

    `update_and_fetch` returns the window - 1 positions before a forward's queries and the queries' own, newest
    last: Attention masks each query to its window (model.window_bias), which needs only that the newest key is
    the newest query's own; a decode step reads `window` positions, not all the buffer holds."""

    def __init__(self, batch: int, n_kv_heads: int, head_dim: int, max_size: int, dtype: mx.Dtype = mx.float32,
                 window: int = 4096, margin: int = REWIND_MARGIN, step: int = 256):
        if window < 1 or margin < 0 or step < 1:
            raise ValueError(f"a window cache needs window >= 1, margin >= 0, step >= 1; "
                             f"got {window}, {margin}, {step}")
        self.window, self.margin = window, margin
        self.keep = window - 1 + margin
        super().__init__(batch, n_kv_heads, head_dim, max_size, dtype, length=min(max_size, self.keep + step))
        self.start = 0   # the position held in slot 0

    @property
    def state(self) -> tuple[mx.array, mx.array]:
        """The positions the next query's window reaches: the newest window - 1 (all of them, early on)."""
        held = self.offset - self.start
        seen = max(0, held - (self.window - 1))
        return self.keys[:, :, seen:held, :], self.values[:, :, seen:held, :]

    def update_and_fetch(self, k: mx.array, v: mx.array) -> tuple[mx.array, mx.array]:
        """Store k, v (B, n_kv_heads, L, head_dim) after the newest position; return what this forward's queries
        see: (B, n_kv_heads, T, head_dim), the window - 1 positions before them (fewer early on), then k, v."""
        end, held, L = self.reserve(k, v), self.offset - self.start, k.shape[2]
        seen = max(0, held - (self.window - 1))
        if held + L <= self.keys.shape[2]:
            self.keys[:, :, held:held + L, :] = k
            self.values[:, :, held:held + L, :] = v
            self.offset = end
            return self.keys[:, :, seen:held + L, :], self.values[:, :, seen:held + L, :]
        # the last `keep` positions before this forward, then its own, move to the front of a new buffer
        kept = min(held, self.keep)
        keys = mx.concatenate([self.keys[:, :, held - kept:held, :], k.astype(self.dtype)], axis=2)
        values = mx.concatenate([self.values[:, :, held - kept:held, :], v.astype(self.dtype)], axis=2)
        last = min(keys.shape[2], self.keep)
        room = mx.zeros((self.batch, self.n_kv_heads, self.keys.shape[2] - last, self.head_dim), dtype=self.dtype)
        self.keys = mx.concatenate([keys[:, :, -last:, :], room], axis=2)
        self.values = mx.concatenate([values[:, :, -last:, :], room], axis=2)
        self.offset, self.start = end, end - last
        first = max(0, keys.shape[2] - (self.window - 1 + L))
        return keys[:, :, first:, :], values[:, :, first:, :]

    def trim(self, n: int) -> int:
        """Forget the last n positions; a ValueError when the window of the next query would reach past what
        the cache kept (more than `margin` positions trimmed after the oldest were dropped)."""
        n = max(0, min(self.offset, n))
        if not self.rewinds(n):
            raise ValueError(f"a sliding-window cache keeps {self.margin} positions to rewind, asked for {n}")
        self.offset -= n
        if self.offset == 0:
            self.start = 0
        return n

    def rewinds(self, n: int) -> bool:
        """Whether trimming n positions leaves every key the next query's window needs."""
        return n >= self.offset or self.start == 0 or self.offset - n - self.start >= self.window - 1
