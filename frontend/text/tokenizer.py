"""The model's tokenizer and chat template, loaded from a GGUF file's metadata or a Hugging Face folder.

A GGUF carries no tokenizer.json: the vocabulary, merges, token types and special ids live in metadata under
llama.cpp's key names. We rebuild the same `tokenizers.Tokenizer` that transformers builds for
`AutoTokenizer.from_pretrained(dir, gguf_file=name)`, so ids and text match it exactly. A GGUF without
`tokenizer.chat_template` gets the built-in template of its architecture where RingServe has one
(frontend/text/chat_templates.py).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from ringserve.frontend.text.chat_templates import builtin_chat_template
from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors
from tokenizers.models import BPE

# llama.cpp token types (tokenizer.ggml.token_type).
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4

# Pre-tokenizer splits for `tokenizer.ggml.pre` values whose merges were learned on a split other than GPT-2's.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_TOKENIZER_SPLITS = {
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "dbrx": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
}


def byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character map: printable Latin-1 bytes stand for themselves, the rest are shifted
    past U+0100 in byte order, so every byte string has a whitespace-free spelling."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    alphabet = {byte: chr(byte) for byte in printable}
    shifted = 0
    for byte in range(256):
        if byte not in alphabet:
            alphabet[byte] = chr(256 + shifted)
            shifted += 1
    return alphabet


class ChatTemplate:
    """A Hugging Face chat template compiled once in a sandbox, rendered like transformers' apply_chat_template."""

    def __init__(self, source: str, special_tokens: Mapping[str, str | None]) -> None:
        self.source = source
        self._special_tokens = {name: value for name, value in special_tokens.items() if value is not None}
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        self._template = env.from_string(source)

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, **extra: Any) -> str:
        """The prompt text; raises jinja2.TemplateError when the template rejects the conversation."""
        context = {**self._special_tokens, **extra}
        return self._template.render(
            messages=[dict(message) for message in messages], add_generation_prompt=add_generation_prompt, **context
        )


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # Jinja's own tojson HTML-escapes, which would change prompts.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@dataclass
class ModelTokenizer:
    """Text <-> token ids for one model, with its special tokens and chat template."""

    backend: Tokenizer
    bos_token: str | None = None
    eos_token: str | None = None
    unk_token: str | None = None
    pad_token: str | None = None
    chat_template_source: str | None = None
    # The name of the built-in template in chat_template_source when the model's files carry none (GGUF only).
    chat_template_builtin: str | None = None
    # Every id that ends generation (the tokenizer's EOS plus generation_config's, for HF folders).
    eos_token_ids: list[int] = field(default_factory=list)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token_id(self) -> int | None:
        return self.token_to_id(self.bos_token)

    @property
    def eos_token_id(self) -> int | None:
        return self.token_to_id(self.eos_token)

    def token_to_id(self, token: str | None) -> int | None:
        return None if token is None else self.backend.token_to_id(token)

    @cached_property
    def chat_template(self) -> ChatTemplate | None:
        if not self.chat_template_source:
            return None
        special = {"bos_token": self.bos_token, "eos_token": self.eos_token, "unk_token": self.unk_token,
                   "pad_token": self.pad_token}
        return ChatTemplate(self.chat_template_source, special)

    @cached_property
    def max_bytes_per_token(self) -> int:
        """The most bytes of UTF-8 text one token can stand for: what `max_prompt_bytes` divides by.

        A token covers the input it spells: a byte-level vocabulary's token (GPT-2's byte alphabet) spells one byte
        per character, any other vocabulary's token at most its own UTF-8 length (SentencePiece's "▁" and byte
        tokens such as "<0x41>" stand for fewer bytes than they have, never more); special tokens the post-processor
        adds spell none. A normalizer can shrink text before the model sees it, by at most 3 to 1 per character
        (Unicode composition: three 3-byte Hangul jamo become one 3-byte syllable; lowercase: the 3-byte Kelvin sign
        becomes "k"), so with one the bound is three times as wide. (A normalizer that strips or replaces whole runs
        of text, e.g. `Strip`, can shrink it further: a prompt padded that way may be refused though it would fit.)"""
        byte_level = isinstance(self.backend.decoder, decoders.ByteLevel)
        spelling = {char: byte for byte, char in byte_alphabet().items()} if byte_level else {}

        def covered(token: str) -> int:
            if byte_level and all(char in spelling for char in token):
                return len(token)
            return len(token.encode("utf-8"))

        longest = max((covered(token) for token in self.backend.get_vocab(with_added_tokens=True)), default=1)
        return max(1, longest) * (3 if self.backend.normalizer is not None else 1)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Holds the interpreter lock while it runs: for short texts (see `encode_unlocked`)."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_unlocked(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """`encode` through the batch API, which releases the interpreter lock while Rust tokenizes: called in a
        thread, it lets the event loop run meanwhile (the single-text `encode` holds the lock throughout)."""
        return self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def decode_unlocked(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """`decode` through the batch API, which releases the interpreter lock (for long id lists, in a thread)."""
        return self.backend.decode_batch([list(token_ids)], skip_special_tokens=skip_special_tokens)[0]

    def render_chat(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True) -> str:
        if self.chat_template is None:
            raise ValueError("this model has no chat template (its files carry none and the server was started "
                             "without --chat-template); send `text` or `token_ids` instead of `messages`")
        return self.chat_template.render(messages, add_generation_prompt=add_generation_prompt)

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True) -> list[int]:
        # The template writes its own special tokens, so (like transformers) none are added on top.
        return self.encode(self.render_chat(messages, add_generation_prompt), add_special_tokens=False)


def load_tokenizer(path: str | os.PathLike[str]) -> ModelTokenizer:
    """From a `.gguf` file, or a Hugging Face folder with tokenizer.json (and tokenizer_config.json)."""
    location = Path(path)
    if location.is_file() and location.suffix == ".gguf":
        return tokenizer_from_gguf(location)
    if location.is_dir() and (location / "tokenizer.json").is_file():
        return tokenizer_from_hf_folder(location)
    raise FileNotFoundError(f"{location}: expected a .gguf file or a folder containing tokenizer.json")


def tokenizer_from_gguf(source: str | os.PathLike[str] | Any) -> ModelTokenizer:
    """`source` is a path or an open `gguf.GGUFReader` (reuse the model loader's; opening one takes a while)."""
    import gguf
    from ringserve.formats.gguf_file import GGUFFile

    reader = source if isinstance(source, gguf.GGUFReader) else GGUFFile(os.fspath(source))

    def meta(key: str, default: Any = None) -> Any:
        entry = reader.fields.get(key)
        return default if entry is None else entry.contents()

    kind = meta("tokenizer.ggml.model")
    if kind not in ("gpt2", "llama"):
        raise ValueError(f"GGUF tokenizer.ggml.model={kind!r} is not supported (supported: 'gpt2', byte-level BPE; "
                         "'llama', SentencePiece BPE)")  # fmt: skip
    tokens: list[str] = list(meta("tokenizer.ggml.tokens"))
    token_types: list[int] = list(meta("tokenizer.ggml.token_type", []))
    add_prefix_space = bool(meta("tokenizer.ggml.add_space_prefix", kind == "llama"))
    if kind == "llama":
        scores = list(meta("tokenizer.ggml.scores", [0.0] * len(tokens)))
        unk = meta("tokenizer.ggml.unknown_token_id")
        backend = _sentencepiece_bpe(tokens, scores, None if unk is None else tokens[unk], add_prefix_space)
        alphabet = None
    else:
        backend, alphabet = _byte_level_bpe(tokens, list(meta("tokenizer.ggml.merges", [])),
                                            meta("tokenizer.ggml.pre", ""), add_prefix_space)  # fmt: skip
    vocab = backend.get_vocab()

    def token_at(key: str) -> str | None:
        index = meta(key)
        return tokens[index] if index is not None and 0 <= index < len(tokens) else None

    special = {name: token_at(f"tokenizer.ggml.{key}") for name, key in
               (("bos", "bos_token_id"), ("eos", "eos_token_id"), ("unk", "unknown_token_id"),
                ("pad", "padding_token_id"))}
    # Control tokens stay whole and are skippable; one spelled outside the byte alphabet is a llama.cpp mislabel.
    typed = list(zip(tokens, token_types, strict=False))
    control = [t for t, kind in typed if kind == _TOKEN_TYPE_CONTROL and (alphabet is None or set(t) <= alphabet)]
    control += [t for t in special.values() if t is not None and t not in control]
    backend.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in control])
    user_defined = [t for t, kind in typed if kind == _TOKEN_TYPE_USER_DEFINED and t in vocab]
    if user_defined:
        backend.add_tokens([AddedToken(t, normalized=False, special=False) for t in user_defined])

    add_bos = bool(meta("tokenizer.ggml.add_bos_token", False))
    add_eos = bool(meta("tokenizer.ggml.add_eos_token", False))
    _set_post_processor(backend, special["bos"] if add_bos else None, special["eos"] if add_eos else None)

    eos_id = meta("tokenizer.ggml.eos_token_id")
    eot_id = meta("tokenizer.ggml.eot_token_id")
    eos_ids = [i for i in dict.fromkeys((eos_id, eot_id)) if i is not None]
    template, builtin = meta("tokenizer.chat_template"), None
    if not template and (builtin := builtin_chat_template(meta("general.architecture"))) is not None:
        template = builtin.source
        end_of_turn = backend.token_to_id(builtin.end_of_turn)
        if end_of_turn is not None and end_of_turn not in eos_ids:
            eos_ids.append(end_of_turn)  # a chat reply ends with its turn (Gemma's files list only <eos>)
    return ModelTokenizer(backend=backend, bos_token=special["bos"], eos_token=special["eos"], unk_token=special["unk"],
                          pad_token=special["pad"], chat_template_source=template,
                          chat_template_builtin=None if builtin is None else builtin.name, eos_token_ids=eos_ids)


def _byte_level_bpe(
    tokens: list[str], merges: list[str], pre: str, add_prefix_space: bool
) -> tuple[Tokenizer, set[str]]:
    """GGUF `gpt2` (byte-level BPE): the backend and its byte alphabet."""
    spelling = byte_alphabet()
    alphabet = set(spelling.values())
    # A token written outside the byte alphabet is stored as its text; spell it as bytes so the BPE model finds it.
    vocab = {
        token if set(token) <= alphabet else "".join(spelling[b] for b in token.encode("utf-8")): index
        for index, token in enumerate(tokens)
    }
    model = BPE(vocab=vocab, merges=[tuple(m.split(" ", 1)) for m in merges], dropout=None,
                continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False)  # fmt: skip
    backend = Tokenizer(model)
    split = _PRE_TOKENIZER_SPLITS.get(pre)
    if split is None:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space)
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(split), behavior="isolated"),
             pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
    backend.decoder = decoders.ByteLevel()
    return backend, alphabet


def _sentencepiece_bpe(tokens: list[str], scores: list[float], unk: str | None, add_prefix_space: bool) -> Tokenizer:
    """GGUF `llama` (SentencePiece BPE with byte fallback, as Gemma and Llama 2 use), built as transformers'
    SpmConverter does: spaces become U+2581, merges are every split of a piece into two pieces, ranked by the merged
    piece's score (SentencePiece merges the highest-scoring pair first), and unknown bytes fall back to <0xNN>."""
    vocab: dict[str, int] = {}
    for index, token in enumerate(tokens):
        vocab.setdefault(token, index)
    ranked = []
    for piece, index in vocab.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                ranked.append((-scores[index], vocab[left], vocab[right], left, right))
    ranked.sort()
    model = BPE(vocab=vocab, merges=[(left, right) for *_, left, right in ranked], unk_token=unk, fuse_unk=True,
                byte_fallback=True, dropout=None)  # fmt: skip
    backend = Tokenizer(model)
    steps = [normalizers.Prepend("\u2581")] if add_prefix_space else []
    backend.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", "\u2581")])
    strip = [decoders.Strip(content=" ", left=1)] if add_prefix_space else []
    backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         *strip])  # fmt: skip
    return backend


def _set_post_processor(backend: Tokenizer, bos: str | None, eos: str | None) -> None:
    single = ([bos] if bos else []) + ["$A:0"] + ([eos] if eos else [])
    pair = single + (([bos] if bos else []) + ["$B:1"] + ([eos] if eos else []))
    special = [(t, backend.token_to_id(t)) for t in dict.fromkeys(x for x in (bos, eos) if x)]
    backend.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=special)


def tokenizer_from_hf_folder(folder: str | os.PathLike[str]) -> ModelTokenizer:
    root = Path(folder)
    backend = Tokenizer.from_file(str(root / "tokenizer.json"))
    config = _read_json(root / "tokenizer_config.json")
    special_map = _read_json(root / "special_tokens_map.json")

    def special(name: str) -> str | None:
        value = config.get(name, special_map.get(name))
        return value.get("content") if isinstance(value, dict) else value

    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        named = {entry.get("name"): entry.get("template") for entry in template}
        template = named.get("default") or next(iter(named.values()), None)
    template_file = root / "chat_template.jinja"
    if template is None and template_file.is_file():
        template = template_file.read_text(encoding="utf-8")

    eos_token = special("eos_token")
    eos_ids: list[int] = []
    if eos_token is not None and backend.token_to_id(eos_token) is not None:
        eos_ids.append(backend.token_to_id(eos_token))
    generation_eos = _read_json(root / "generation_config.json").get("eos_token_id")
    for token_id in generation_eos if isinstance(generation_eos, list) else [generation_eos]:
        if isinstance(token_id, int) and token_id not in eos_ids:
            eos_ids.append(token_id)
    return ModelTokenizer(backend=backend, bos_token=special("bos_token"), eos_token=eos_token,
                          unk_token=special("unk_token"), pad_token=special("pad_token"),
                          chat_template_source=template, eos_token_ids=eos_ids)


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    with path.open(encoding="utf-8") as handle:
        data = json.load(handle)
    return data if isinstance(data, dict) else {}
