"""A byte-level BPE tokenizer: trained with HuggingFace `tokenizers`, stored in GGUF metadata.

Byte-level BPE (GPT-2's scheme) works on UTF-8 bytes, not characters. Each of the 256 byte
values is first given a printable stand-in character (space -> "Ġ", newline -> "Ċ"), so every
token is an ordinary string and the 256 one-byte tokens cover any text: nothing is ever
unknown. Encoding runs in three steps:

    text -> pre-tokenizer regex splits it into words (" def", "  ", "42", "'s")
         -> each word's UTF-8 bytes become stand-in characters
         -> BPE applies the learned merges, lowest rank first, inside each word.

Training learns the merges: start from the 256 bytes and repeatedly merge the most frequent
adjacent pair into a new token until the vocabulary has the size asked for.

llama.cpp reads such a vocabulary from these GGUF keys (src/llama-vocab.cpp, `load`):

    tokenizer.ggml.model           "gpt2" = byte-level BPE
    tokenizer.ggml.pre             which pre-tokenizer regex; "gpt-2" is GPT-2's own
    tokenizer.ggml.tokens          [str] the tokens as stand-in strings, index = token id
    tokenizer.ggml.token_type      [int] 1 normal, 3 control (special), 4 user-defined
    tokenizer.ggml.merges          [str] "left right", index = merge rank
    tokenizer.ggml.bos_token_id    int
    tokenizer.ggml.eos_token_id    int
    tokenizer.ggml.add_bos_token   bool, whether a prompt starts with BOS

The course's vocabulary uses "gpt-2"; "llama-bpe" (Llama 3) and "qwen2" also load, so the
tokenizers of common GGUF files work too. References: Radford et al. 2019 (GPT-2, section
2.2); Sennrich et al. 2016 (BPE for words); the `tokenizers` docs.

See chapter: intro
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors, trainers
from tokenizers import Tokenizer as HFTokenizer

EOT = "<|endoftext|>"  # the one special token: BOS and EOS at once, as in GPT-2
TOKEN_NORMAL, TOKEN_CONTROL, TOKEN_USER_DEFINED = 1, 3, 4

# `tokenizer.ggml.pre` -> (split regex, ignore_merges). None means ByteLevel's built-in regex,
# GPT-2's: 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
# The others are copied from the models' tokenizer.json, as llama.cpp's llama-vocab.cpp has them.
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = _LLAMA3.replace(r"\p{N}{1,3}", r"\p{N}")
PRE_TOKENIZERS: dict[str, tuple[str | None, bool]] = {
    "gpt-2": (None, False),
    "llama-bpe": (_LLAMA3, True),  # Llama 3: a word already in the vocab skips the merges
    "qwen2": (_QWEN2, False),
}


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> stand-in character table: printable bytes stand for themselves."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table, n = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:  # control characters, space, NBSP, soft hyphen -> U+0100 onwards
            table[b] = chr(256 + n)
            n += 1
    return table


_BYTE_OF = {c: b for b, c in bytes_to_unicode().items()}


class Tokenizer:
    """A byte-level BPE vocabulary (tokens + ranked merges) and a `tokenizers` engine built on it.

    `tokens[i]` is token i as a stand-in string; `merges[r]` is "left right", rank r.
    `encode` treats special tokens in the text as plain text, like llama.cpp's
    `tokenize(..., special=False)`; `decode` drops them.
    """

    def __init__(self, tokens: Sequence[str], merges: Sequence[str], token_types: Sequence[int],
                 bos_id: int, eos_id: int, add_bos: bool = True, pre: str = "gpt-2"):
        n = len(tokens)
        if len(token_types) != n:
            raise ValueError(f"{len(token_types)} token types for {n} tokens")
        if len(set(tokens)) != n:
            raise ValueError("tokens are not unique")
        for name, i in (("bos", bos_id), ("eos", eos_id)):
            if not 0 <= i < n:
                raise ValueError(f"{name} id {i} is outside the vocabulary (size {n})")
        if pre not in PRE_TOKENIZERS:
            raise ValueError(f"pre-tokenizer {pre!r} is not supported; known: {sorted(PRE_TOKENIZERS)}")
        self.tokens, self.merges = list(tokens), list(merges)
        self.token_types = [int(t) for t in token_types]
        self.bos_id, self.eos_id, self.add_bos, self.pre = int(bos_id), int(eos_id), bool(add_bos), pre
        self.hf = self._build_hf()

    def _build_hf(self) -> HFTokenizer:
        vocab = {t: i for i, t in enumerate(self.tokens)}
        pairs = []
        for rank, merge in enumerate(self.merges):
            cut = merge.find(" ", 1)  # as llama.cpp splits it; stand-ins never hold a real space
            left, right = merge[:cut], merge[cut + 1:]
            if cut < 0 or left not in vocab or right not in vocab or left + right not in vocab:
                raise ValueError(f"merge {rank} {merge!r} does not join two tokens into a token")
            pairs.append((left, right))
        regex, ignore_merges = PRE_TOKENIZERS[self.pre]
        # No unk token and no byte fallback: the 256 byte tokens cover every input.
        hf = HFTokenizer(models.BPE(vocab, pairs, ignore_merges=ignore_merges))
        if regex is None:
            hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        else:
            hf.pre_tokenizer = pre_tokenizers.Sequence([
                pre_tokenizers.Split(Regex(regex), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        hf.decoder = decoders.ByteLevel()
        hf.add_tokens([AddedToken(t, special=ty == TOKEN_CONTROL, normalized=False)
                       for t, ty in zip(self.tokens, self.token_types)
                       if ty in (TOKEN_CONTROL, TOKEN_USER_DEFINED)])
        hf.encode_special_tokens = True  # "<|endoftext|>" typed in a prompt is just text
        if self.add_bos:  # only used by HF-side callers (mlx-lm); `encode` adds BOS itself
            bos = self.tokens[self.bos_id]
            hf.post_processor = processors.TemplateProcessing(
                single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, self.bos_id)])
        return hf

    @property
    def vocab_size(self) -> int:
        return len(self.tokens)

    def encode(self, text: str, bos: bool = False) -> list[int]:
        """Token ids for `text`, with BOS in front when `bos` is true."""
        ids = self.hf.encode(text, add_special_tokens=False).ids
        return [self.bos_id, *ids] if bos else ids

    def decode(self, ids: Iterable[int]) -> str:
        """Text for token ids; special tokens are dropped, invalid UTF-8 becomes U+FFFD."""
        return self.hf.decode(list(ids), skip_special_tokens=True)

    def id_to_piece(self, token_id: int) -> str:
        """Token as stored in the vocabulary, e.g. "Ġdef" for " def"."""
        return self.tokens[token_id]

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes a token stands for (a special token gives its own text)."""
        piece = self.tokens[token_id]
        if self.token_types[token_id] != TOKEN_NORMAL or any(c not in _BYTE_OF for c in piece):
            return piece.encode()
        return bytes(_BYTE_OF[c] for c in piece)

    def gguf_metadata(self) -> dict[str, Any]:
        """The `tokenizer.ggml.*` keys llama.cpp reads for a byte-level BPE vocabulary."""
        return {
            "tokenizer.ggml.model": "gpt2",
            "tokenizer.ggml.pre": self.pre,
            "tokenizer.ggml.tokens": list(self.tokens),
            "tokenizer.ggml.token_type": list(self.token_types),
            "tokenizer.ggml.merges": list(self.merges),
            "tokenizer.ggml.bos_token_id": self.bos_id,
            "tokenizer.ggml.eos_token_id": self.eos_id,
            "tokenizer.ggml.add_bos_token": self.add_bos,
        }

    @classmethod
    def from_gguf_metadata(cls, metadata: dict[str, Any]) -> Tokenizer:
        """Rebuild the tokenizer from GGUF metadata (other keys in the dict are ignored).

        Raises ValueError unless the vocabulary is byte-level BPE ("gpt2") with a
        supported pre-tokenizer and consistent keys. A missing add_bos_token means
        false and missing token types mean all normal, as in llama.cpp.
        """
        model = metadata.get("tokenizer.ggml.model")
        if model != "gpt2":
            raise ValueError(f"tokenizer.ggml.model is {model!r}; only byte-level BPE ('gpt2') is supported")
        missing = [k for k in ("pre", "tokens", "merges", "bos_token_id", "eos_token_id")
                   if f"tokenizer.ggml.{k}" not in metadata]
        if missing:
            raise ValueError(f"GGUF metadata lacks tokenizer.ggml.{{{', '.join(missing)}}}")
        tokens = [str(t) for t in metadata["tokenizer.ggml.tokens"]]
        types = metadata.get("tokenizer.ggml.token_type", [TOKEN_NORMAL] * len(tokens))
        return cls(tokens, [str(m) for m in metadata["tokenizer.ggml.merges"]], [int(t) for t in types],
                   int(metadata["tokenizer.ggml.bos_token_id"]), int(metadata["tokenizer.ggml.eos_token_id"]),
                   bool(metadata.get("tokenizer.ggml.add_bos_token", False)), str(metadata["tokenizer.ggml.pre"]))

    def to_hf_json(self) -> str:
        """The vocabulary as a HuggingFace tokenizer.json string (for mlx-lm and transformers)."""
        return self.hf.to_str()

    def save_hf(self, directory: str | Path) -> None:
        """Write tokenizer.json and tokenizer_config.json, loadable by transformers' AutoTokenizer."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "tokenizer.json").write_text(self.to_hf_json(), encoding="utf-8")
        config = {"tokenizer_class": "PreTrainedTokenizerFast",
                  "bos_token": self.tokens[self.bos_id], "eos_token": self.tokens[self.eos_id],
                  "split_special_tokens": True,  # as `encode`: typed "<|endoftext|>" is text
                  "clean_up_tokenization_spaces": False}  # keep " ." and " 's" as written
        (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")


def train_tokenizer(texts: Iterable[str], vocab_size: int, *, min_frequency: int = 2,
                    max_token_length: int | None = 32, add_bos: bool = True) -> Tokenizer:
    """Learn a byte-level BPE vocabulary of `vocab_size` tokens from `texts`.

    Token 0 is EOT, used as BOS and EOS; tokens 1..256 are the bytes; the rest are merges,
    in rank order. The same texts give the same vocabulary. `max_token_length` caps a
    token at that many bytes: runs of indentation or '#' would otherwise take many slots,
    and llama-cpp-python's `detokenize` copies each piece through a 32-byte buffer.
    """
    if vocab_size < 257:
        raise ValueError(f"vocab_size {vocab_size} < 257 (256 bytes + {EOT})")
    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), max_token_length=max_token_length,
        show_progress=False)
    hf.train_from_iterator(texts, trainer)
    model = json.loads(hf.to_str())["model"]
    vocab: dict[str, int] = model["vocab"]
    tokens = sorted(vocab, key=vocab.__getitem__)
    assert [vocab[t] for t in tokens] == list(range(len(tokens))), "token ids are not 0..n-1"
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]  # list or "a b" form
    types = [TOKEN_CONTROL if t == EOT else TOKEN_NORMAL for t in tokens]
    eot = vocab[EOT]
    return Tokenizer(tokens, merges, types, bos_id=eot, eos_id=eot, add_bos=add_bos)
