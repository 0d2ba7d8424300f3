"""Tokenizers as llama.cpp runs them: byte-level BPE ("gpt2"), SentencePiece ("llama") and Gemma 4's BPE over
SentencePiece-style pieces ("gemma4"), on HF `tokenizers`.

Byte-level BPE (GPT-2's scheme) works on UTF-8 bytes, not characters. Each of the 256 byte
values is first given a printable stand-in character (space -> "Ġ", newline -> "Ċ"), so every
token is an ordinary string and the 256 one-byte tokens cover any text: nothing is ever
unknown. Encoding runs in three steps:

    text -> pre-tokenizer regexes split it into words (" def", "  ", "42", "'s")
         -> each word's UTF-8 bytes become stand-in characters
         -> BPE applies the learned merges, lowest rank first, inside each word.

Training learns the merges: start from the 256 bytes and repeatedly merge the most frequent
adjacent pair into a new token until the vocabulary has the size asked for.

SentencePiece vocabularies (Llama 1/2, Mistral, Phi-3) work on characters instead. A space
becomes "▁" and one "▁" goes in front of the text, so " the" and "the" at the start are the
same token; there are no merge rules, only a score per token: the adjacent pair whose joined
text is the highest-scoring token merges first. A character no token holds falls back to
its UTF-8 bytes, tokens "<0x00>".."<0xFF>". Here the scores become BPE merges (ranked by the
score of the token they make) and `tokenizers` runs them with byte fallback.

Gemma 4 ("gemma4") mixes the two: SentencePiece's pieces ("▁" for a space, no "▁" in front of
the text, "<0xE4>" byte tokens for characters no token holds) joined by ranked merges, as BPE.
llama.cpp runs it as its BPE tokenizer with pre-tokenizer "gemma4" (src/llama-vocab.cpp: `load`
overrides tokenizer.ggml.pre and add_bos_token; llm_tokenizer_bpe splits only newline runs from
the rest, `[^\n]+|[\n]+`, on raw UTF-8, byte_encode false). Encoding is then the byte-level
BPE's, on characters, with byte fallback; decoding is SentencePiece's.

llama.cpp reads a vocabulary from these GGUF keys (src/llama-vocab.cpp, `load`):

    tokenizer.ggml.model            "gpt2" = byte-level BPE, "llama" = SentencePiece, "gemma4"
    tokenizer.ggml.pre              gpt2 only: which pre-tokenizer regexes (missing = "default")
    tokenizer.ggml.tokens           [str] the tokens, index = token id
    tokenizer.ggml.token_type       [int] 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte
    tokenizer.ggml.merges           gpt2, gemma4: [str] "left right", index = merge rank
    tokenizer.ggml.scores           llama: [float] one per token, higher merges first (gemma4: kept, unused)
    tokenizer.ggml.bos_token_id     int
    tokenizer.ggml.eos_token_id     int
    tokenizer.ggml.add_bos_token    bool, whether a prompt starts with BOS
    tokenizer.ggml.add_eos_token    bool, whether a prompt ends with EOS
    tokenizer.ggml.add_space_prefix llama: bool, the leading "▁" (default true)

Control tokens typed in the text stay text (llama.cpp's `tokenize(..., special=False)`);
user-defined ones are matched first, as llama.cpp does. References: Radford et al. 2019
(GPT-2, section 2.2); Sennrich et al. 2016 (BPE for words); Kudo and Richardson 2018
(SentencePiece); the `tokenizers` docs.

See chapter: your-model
"""

from __future__ import annotations

import codecs
import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors, trainers
from tokenizers import Tokenizer as HFTokenizer

EOT = "<|endoftext|>"  # the one special token: BOS and EOS at once, as in GPT-2
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = 1, 2, 3, 4, 5, 6
MODELS = ("gpt2", "llama", "gemma4")
SPACE = "\u2581"  # "▁", SentencePiece's space

# `tokenizer.ggml.pre` -> (split regexes, applied one after the other to the pieces the previous left;
# ignore_merges: a word already in the vocabulary skips the merges). Written from llama.cpp's
# src/llama-vocab.cpp (llm_tokenizer_bpe), whose own fast paths (unicode.cpp) give the same splits.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = _LLAMA3.replace(r"\p{N}{1,3}", r"\p{N}")
_QWEN35 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
           r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_CJK = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"  # CJK ideographs, a wide block below them, Hangul
_CASED_LETTERS = (  # DeepSeek LLM's letters: the cased ones (Latin, Greek, Cyrillic, Armenian, ...)
    "A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af"
    "\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5"
    "\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba"
    "\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45"
    "\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe"
    "\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc"
    "\u2102\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134"
    "\u2139\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee"
    "\u2cf2\u2cf3\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf"
    "\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3"
    "\U000104d8-\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2\U000118a0-\U000118df"
    "\U0001e900-\U0001e943")
_STARCODER = ((r"\p{N}", _GPT2), False)  # every digit alone
PRE_TOKENIZERS: dict[str, tuple[tuple[str, ...], bool]] = {
    # llama.cpp's choice for a missing key: punctuation runs, then GPT-2's, digit runs, then threes
    "default": ((r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", "[0-9][0-9][0-9]"), False),
    "gpt-2": ((_GPT2,), False),
    "mpt": ((_GPT2,), False),
    "starcoder": _STARCODER,
    "refact": _STARCODER,
    "command-r": _STARCODER,
    "falcon": ((r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, "[0-9][0-9][0-9]"), False),
    "llama-bpe": ((_LLAMA3,), True),  # Llama 3
    "qwen2": ((_QWEN2,), False),
    "qwen35": ((_QWEN35,), False),
    "deepseek-llm": (("[\r\n]", f"\\s?[{_CASED_LETTERS}]+",
                      "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+",  # punctuation
                      r"\s+$", _CJK, r"\p{N}+"), False),
    "deepseek-coder": (("[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK, r"\p{N}"), False),
    # spaces already "▁", no byte stand-ins (see `_build_bpe`). llama.cpp keeps a newline run that is a token
    # whole; in Gemma 4's vocabulary the merges build each of them ("\n" .. 31 newlines) anyway.
    "gemma4": ((r"[^\n]+|[\n]+",), False),
}

# Where generation ends, by token text as llama.cpp decides it: the markers that close a text, a turn or a message,
# and the fill-in-the-middle pad, repository and file-separator tokens, besides EOS. Without them a chat would run
# on past the model's turn in files whose EOS is another token (Llama 3 Instruct: EOS <|end_of_text|>, turns
# <|eot_id|>).
END_TEXTS = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>", "<end_of_turn>",
    "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]", "<|end_of_text|>",
    "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>", "<\uff5cend\u2581of\u2581sentence\uff5c>", "[e~[",
    "<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]",                               # fill-in-the-middle pad
    "<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>", "<|file_sep|>"})  # repository, file

# Token texts llama.cpp treats as control whatever their stored type (llama-vocab.cpp `load`): the end markers
# and the other fill-in-the-middle markers. Typed in a prompt they are plain text, and decoding drops them.
CONTROL_TEXTS = END_TEXTS | frozenset({
    "<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<\uff5cfim\u2581begin\uff5c>", "<PRE>", "\u2581<PRE>",
    "<|code_prefix|>", "<|prefix|>",                                                             # prefix
    "<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<\uff5cfim\u2581hole\uff5c>", "<SUF>", "\u2581<SUF>",
    "<|code_suffix|>", "<|suffix|>",                                                             # suffix
    "<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<\uff5cfim\u2581end\uff5c>", "<MID>", "\u2581<MID>",
    "<|code_middle|>", "<|middle|>"})                                                            # middle


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
    """A llama.cpp vocabulary ("gpt2" byte-level BPE, "llama" SentencePiece, "gemma4") and a `tokenizers` engine.

    `tokens[i]` is token i as the vocabulary stores it; `merges[r]` is "left right", rank r ("gpt2", "gemma4");
    `scores[i]` is token i's score ("llama"). `encode` treats control tokens in the text as plain
    text, like llama.cpp's `tokenize(..., special=False)`; `decode` drops them.
    """

    def __init__(self, tokens: Sequence[str], merges: Sequence[str], token_types: Sequence[int],
                 bos_id: int, eos_id: int, add_bos: bool = True, pre: str = "gpt-2", *, model: str = "gpt2",
                 scores: Sequence[float] = (), add_eos: bool = False, add_space_prefix: bool = True):
        n = len(tokens)
        if model not in MODELS:
            raise ValueError(f"tokenizer model {model!r} is not supported; known: {list(MODELS)}")
        if len(token_types) != n:
            raise ValueError(f"{len(token_types)} token types for {n} tokens")
        if (model == "llama" or len(scores)) and len(scores) != n:
            raise ValueError(f"{len(scores)} scores for {n} tokens")
        if len(set(tokens)) != n:
            raise ValueError("tokens are not unique")
        for name, i in (("bos", bos_id), ("eos", eos_id)):
            if not 0 <= i < n:
                raise ValueError(f"{name} id {i} is outside the vocabulary (size {n})")
        if model == "gemma4":
            pre = "gemma4"  # as llama.cpp's `load`, whatever tokenizer.ggml.pre says
        if model != "llama" and pre not in PRE_TOKENIZERS:
            raise ValueError(f"pre-tokenizer {pre!r} is not supported; known: {sorted(PRE_TOKENIZERS)}")
        self.model, self.tokens, self.merges = model, list(tokens), list(merges)
        self.token_types, self.scores = [int(t) for t in token_types], [float(s) for s in scores]
        self.bos_id, self.eos_id, self.add_bos, self.add_eos = int(bos_id), int(eos_id), bool(add_bos), bool(add_eos)
        self.pre, self.add_space_prefix = pre, bool(add_space_prefix)
        self.spm_pieces = model == "llama" or pre == "gemma4"  # tokens spell a space "▁", a byte "<0xE4>"
        self.hf = self._build_spm() if model == "llama" else self._build_bpe()
        # llama.cpp's Gemma 4 workaround (llama-vocab.cpp `load`): beside "<|tool_response>", "</s>" is plain text
        plain = {"</s>"} if "<|tool_response>" in self.tokens else set()
        self.control = {i for i, (t, ty) in enumerate(zip(self.tokens, self.token_types))
                        if (ty == TOKEN_CONTROL or t in CONTROL_TEXTS) and t not in plain}
        self.end_markers = frozenset(i for i, t in enumerate(self.tokens) if t in END_TEXTS - plain)
        self.hf.add_tokens([AddedToken(t, special=i in self.control, normalized=False)
                            for i, (t, ty) in enumerate(zip(self.tokens, self.token_types))
                            if i in self.control or ty == TOKEN_USER_DEFINED])
        self.hf.encode_special_tokens = True  # "<|endoftext|>" typed in a prompt is just text
        if self.add_bos:  # only used by HF-side callers (mlx-lm); `encode` adds BOS itself
            bos = self.tokens[self.bos_id]
            self.hf.post_processor = processors.TemplateProcessing(
                single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, self.bos_id)])

    def _build_bpe(self) -> HFTokenizer:
        """Byte-level BPE: the pre-tokenizer's regexes, GPT-2's byte stand-ins, ranked merges. Pre-tokenizer
        "gemma4" merges characters instead: spaces become "▁" first, and byte tokens stand in for the rest."""
        vocab = {t: i for i, t in enumerate(self.tokens)}
        pairs = []
        for rank, merge in enumerate(self.merges):
            cut = merge.find(" ", 1)  # as llama.cpp splits it; stand-ins never hold a real space
            left, right = merge[:cut], merge[cut + 1:]
            if cut < 0 or left not in vocab or right not in vocab or left + right not in vocab:
                raise ValueError(f"merge {rank} {merge!r} does not join two tokens into a token")
            pairs.append((left, right))
        regexes, ignore_merges = PRE_TOKENIZERS[self.pre]
        splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in regexes]
        if self.spm_pieces:
            hf = HFTokenizer(models.BPE(vocab, pairs, ignore_merges=ignore_merges, byte_fallback=True))
            hf.normalizer = normalizers.Replace(" ", SPACE)
            hf.pre_tokenizer = pre_tokenizers.Sequence(splits)
            hf.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
            return hf
        # No unk token and no byte fallback: the 256 byte tokens cover every input.
        hf = HFTokenizer(models.BPE(vocab, pairs, ignore_merges=ignore_merges))
        hf.pre_tokenizer = pre_tokenizers.Sequence([*splits, pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                                                      use_regex=False)])
        hf.decoder = decoders.ByteLevel()
        return hf

    def _build_spm(self) -> HFTokenizer:
        """SentencePiece as BPE: every split of a token into two tokens is a merge, ranked by that token's score.

        llama.cpp's SPM tokenizer repeatedly joins the adjacent pair that makes the highest-scoring
        token; ranking the merges by that score makes BPE join the same pairs in the same order.
        """
        vocab = {t: i for i, t in enumerate(self.tokens)}
        ranked = []
        for i, token in enumerate(self.tokens):
            if self.token_types[i] == TOKEN_BYTE:
                continue
            ranked += [(-self.scores[i], i, token[:k], token[k:]) for k in range(1, len(token))
                       if token[:k] in vocab and token[k:] in vocab]
        ranked.sort(key=lambda m: m[:2])
        unk = next((t for t, ty in zip(self.tokens, self.token_types) if ty == TOKEN_UNKNOWN), None)
        hf = HFTokenizer(models.BPE(vocab, [(a, b) for *_, a, b in ranked], unk_token=unk, byte_fallback=True))
        spaces = normalizers.Replace(" ", SPACE)
        hf.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE), spaces]) if self.add_space_prefix else spaces
        steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
        hf.decoder = decoders.Sequence([*steps, decoders.Strip(" ", 1, 0)] if self.add_space_prefix else steps)
        return hf

    @property
    def vocab_size(self) -> int:
        return len(self.tokens)

    @property
    def end_ids(self) -> frozenset[int]:
        """The tokens that end generation: EOS and the vocabulary's END_TEXTS markers (llama.cpp's set)."""
        return self.end_markers | {self.eos_id}

    def encode(self, text: str, bos: bool = False, eos: bool = False) -> list[int]:
        """Token ids for `text`, with BOS in front when `bos` is true and EOS at the end when `eos` is."""
        ids = self.hf.encode(text, add_special_tokens=False).ids
        return [self.bos_id] * bos + ids + [self.eos_id] * eos

    def decode(self, ids: Iterable[int]) -> str:
        """Text for token ids, piece by piece as llama.cpp's `token_to_piece`: control, unknown and
        unused tokens give nothing; invalid UTF-8 becomes U+FFFD. For SentencePiece the space
        `encode` put in front is taken off again.
        """
        data = b"".join(self.piece_bytes(i) for i in ids)
        if self.model == "llama" and self.add_space_prefix and data.startswith(b" "):
            data = data[1:]
        return data.decode("utf-8", errors="replace")

    def piece_bytes(self, token_id: int) -> bytes:
        """The bytes a token adds to decoded text: its own, or none for a control, unknown or unused token."""
        silent = token_id in self.control or self.token_types[token_id] in (TOKEN_UNKNOWN, TOKEN_UNUSED)
        return b"" if silent else self.token_bytes(token_id)

    def stream(self) -> TextStream:
        """An incremental `decode` for tokens that arrive one at a time (see TextStream)."""
        return TextStream(self)

    def id_to_piece(self, token_id: int) -> str:
        """Token as stored in the vocabulary, e.g. "Ġdef" (gpt2) or "▁def" (llama, gemma4) for " def"."""
        return self.tokens[token_id]

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes a token stands for (a control or user-defined token gives its own text)."""
        piece, kind = self.tokens[token_id], self.token_types[token_id]
        if self.spm_pieces:
            if kind == TOKEN_BYTE:
                return bytes([int(piece[3:-1], 16)])  # "<0x41>" -> b"A"
            return piece.replace(SPACE, " ").encode() if kind == TOKEN_NORMAL else piece.encode()
        if kind != TOKEN_NORMAL or any(c not in _BYTE_OF for c in piece):
            return piece.encode()
        return bytes(_BYTE_OF[c] for c in piece)

    def gguf_metadata(self) -> dict[str, Any]:
        """The `tokenizer.ggml.*` keys llama.cpp reads for this vocabulary."""
        common = {
            "tokenizer.ggml.model": self.model,
            "tokenizer.ggml.tokens": list(self.tokens),
            "tokenizer.ggml.token_type": list(self.token_types),
            "tokenizer.ggml.bos_token_id": self.bos_id,
            "tokenizer.ggml.eos_token_id": self.eos_id,
            "tokenizer.ggml.add_bos_token": self.add_bos,
            "tokenizer.ggml.add_eos_token": self.add_eos,
        }
        if self.model == "llama":
            return {**common, "tokenizer.ggml.scores": list(self.scores),
                    "tokenizer.ggml.add_space_prefix": self.add_space_prefix}
        scores = {"tokenizer.ggml.scores": list(self.scores)} if self.scores else {}
        return {**common, "tokenizer.ggml.pre": self.pre, "tokenizer.ggml.merges": list(self.merges), **scores}

    @classmethod
    def from_gguf_metadata(cls, metadata: dict[str, Any]) -> Tokenizer:
        """Rebuild the tokenizer from GGUF metadata (other keys in the dict are ignored).

        Raises ValueError unless the vocabulary is "gpt2" (with a supported pre-tokenizer),
        "llama" or "gemma4", with consistent keys. Defaults are llama.cpp's: a missing pre-tokenizer is
        "default"; add_bos_token is false for gpt2 ("llama-bpe": true), true for llama and always for gemma4;
        add_eos_token false; add_space_prefix true; missing token types mean all normal.
        """
        model = metadata.get("tokenizer.ggml.model")
        if model not in MODELS:
            raise ValueError(f"tokenizer.ggml.model is {model!r}; supported: {', '.join(MODELS)}")
        needed = ("tokens", "bos_token_id", "eos_token_id", "scores" if model == "llama" else "merges")
        missing = [k for k in needed if f"tokenizer.ggml.{k}" not in metadata]
        if missing:
            raise ValueError(f"GGUF metadata lacks tokenizer.ggml.{{{', '.join(missing)}}}")
        tokens = [str(t) for t in metadata["tokenizer.ggml.tokens"]]
        types = [int(t) for t in metadata.get("tokenizer.ggml.token_type", [TOKEN_NORMAL] * len(tokens))]
        pre = "gemma4" if model == "gemma4" else str(metadata.get("tokenizer.ggml.pre", "default"))
        add_bos = metadata.get("tokenizer.ggml.add_bos_token", model == "llama" or pre == "llama-bpe") \
            or pre == "gemma4"  # llama.cpp turns it on for Gemma 4 (llama-vocab.cpp, `load`)
        return cls(tokens, [str(m) for m in metadata.get("tokenizer.ggml.merges", [])], types,
                   int(metadata["tokenizer.ggml.bos_token_id"]), int(metadata["tokenizer.ggml.eos_token_id"]),
                   bool(add_bos), pre, model=model, scores=metadata.get("tokenizer.ggml.scores", ()),
                   add_eos=bool(metadata.get("tokenizer.ggml.add_eos_token", False)),
                   add_space_prefix=bool(metadata.get("tokenizer.ggml.add_space_prefix", True)))

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


class TextStream:
    """The text of a growing token list at constant work per token, where decoding the whole list again at
    every step costs more the longer the answer (a 4,000-token answer would re-decode 4,000 tokens per token).
    `add` returns the text a token completes: a character whose UTF-8 bytes are still incomplete is held
    back until its last byte arrives, and SentencePiece's leading space is dropped once, as `decode` drops it.
    The pieces joined, with `flush`, are `decode` of all the tokens."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.first = tokenizer.model == "llama" and tokenizer.add_space_prefix   # a leading space still to drop

    def add(self, token_id: int) -> str:
        """The text token_id completes (often one piece; empty while a character's bytes are incomplete)."""
        data = self.tokenizer.piece_bytes(token_id)
        if self.first and data:
            data, self.first = data.removeprefix(b" "), False
        return self.utf8.decode(data)

    def flush(self) -> str:
        """What is held back at the end: an incomplete character, as U+FFFD, as `decode` gives it."""
        return self.utf8.decode(b"", final=True)


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
