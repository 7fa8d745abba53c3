"""Checkpoint-defined tokenizers: a HF `tokenizer.json` (loaded with the `tokenizers` library) plus
`tokenizer_config.json` for the bos/eos spellings and stop tokens.

Encoding goes through `tokenizers` with special tokens read as text (`encode_special_tokens`), so a
user who types `<|im_end|>` gets the tokens of those characters. Decoding is done here from
per-token bytes (`token_bytes`), so one-shot `decode` and the incremental detokenizer follow one
rule. Two vocabulary kinds are understood: byte-level BPE (GPT-2 style, what every GGUF import
produces) and sentencepiece-style BPE ("▁" for spaces, `<0xNN>` byte-fallback tokens).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from engine.loading.generation_config import GENERATION_CONFIG_FILE, read_generation_config
from engine.loading.json_file import read_json_object
from engine.tokenizers.base import ByteTableTokenizer
from engine.types import CheckpointError

log = logging.getLogger(__name__)

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"

# Tokens that end a turn in common chat formats. llama.cpp treats these as end-of-generation
# whatever the metadata says, and so do we, so both servers stop at the same place.
END_OF_GENERATION_SPELLINGS = frozenset(
    {
        "<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
        "<|end_of_text|>", "<EOT>", "_<EOT>", "<｜end▁of▁sentence｜>", "<end_of_utterance>",
    }
)  # fmt: skip

_SP_SPACE = "\u2581"  # sentencepiece's visible space, "▁"


MAX_VOCAB_SIZE = 1 << 22  # the largest Llama vocabulary is 202,048; ids far past it are hostile


def gpt2_byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet reversed: the printable character each byte was mapped to -> byte."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


def _decoder_types(decoder: dict[str, Any] | None) -> list[dict[str, Any]]:
    if not decoder:
        return []
    if decoder.get("type") == "Sequence":
        return [d for inner in decoder.get("decoders", []) for d in _decoder_types(inner)]
    return [decoder]


def _token_spelling(value: Any) -> str | None:
    """tokenizer_config.json writes special tokens as a string or as an AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


class HFTokenizer(ByteTableTokenizer):
    """A `tokenizer.json` vocabulary behind the engine's Tokenizer protocol."""

    def __init__(self, tokenizer_json: str, config: dict[str, Any], *, source: str, generation_config: dict[str, Any] | None = None) -> None:
        from tokenizers import Tokenizer

        try:
            self._tk = Tokenizer.from_str(tokenizer_json)
            spec = json.loads(tokenizer_json)
        except Exception as exc:  # the Rust side raises its own exception type
            raise CheckpointError(f"{source}: not a readable tokenizer.json: {exc}") from None
        self._tk.encode_special_tokens = True  # special spellings in text are text
        self._source = source
        added = {int(t["id"]): t for t in spec.get("added_tokens", [])}
        # Only "special" added tokens are control tokens; others are ordinary vocabulary entries.
        self.special_tokens: dict[str, int] = {t["content"]: i for i, t in added.items() if t.get("special")}
        self._special_names = {i: name for name, i in self.special_tokens.items()}
        self._added_bytes = {i: t["content"].encode("utf-8") for i, t in added.items()}
        # ids may have holes (unused rows in the embedding): the vocabulary spans up to the largest id
        self.vocab_size = max(self._tk.get_vocab(with_added_tokens=True).values(), default=-1) + 1
        bad_ids = [i for i in added if not 0 <= i < self.vocab_size]  # the byte table is vocab_size long
        if self.vocab_size > MAX_VOCAB_SIZE or bad_ids:
            worst = max([self.vocab_size - 1, *bad_ids], key=abs)
            raise CheckpointError(f"{source}: token ids must lie in 0..{min(self.vocab_size, MAX_VOCAB_SIZE) - 1}; "
                                  f"this tokenizer.json uses id {worst}")
        self._strip_first_space = False  # set by _build_token_bytes for sentencepiece-style vocabularies
        self._bytes = self._build_token_bytes(spec)
        self.eos_id = self._eos_id(config, generation_config)
        self.bos_id = self._bos_id(config, spec)
        self.stop_token_ids = self._stop_ids(config, generation_config)
        self.bos_token = self._spelling(self.bos_id) if self.bos_id is not None else _token_spelling(config.get("bos_token"))
        self.eos_token = self._spelling(self.eos_id)
        self.add_eos = bool(config.get("add_eos_token", False))

    # ------------------------------------------------------------------ construction helpers
    def _spelling(self, token_id: int) -> str:
        return self._tk.id_to_token(token_id) or ""

    def _id_of(self, spelling: str | None, key: str) -> int | None:
        if spelling is None:
            return None
        token_id = self._tk.token_to_id(spelling)
        if token_id is None:
            raise CheckpointError(f"{self._source}: {key} {spelling!r} is not in the vocabulary")
        return token_id

    def _eos_id(self, config: dict[str, Any], generation_config: dict[str, Any] | None) -> int:
        eos = self._id_of(_token_spelling(config.get("eos_token")), "eos_token")
        if eos is None and generation_config:
            ids = generation_config.get("eos_token_id")
            eos = ids[0] if isinstance(ids, list) and ids else ids if isinstance(ids, int) else None
        if eos is None:
            raise CheckpointError(f"{self._source}: no eos_token in {TOKENIZER_CONFIG_FILE} or {GENERATION_CONFIG_FILE}")
        return eos

    def _bos_id(self, config: dict[str, Any], spec: dict[str, Any]) -> int | None:
        """The BOS that starts a raw prompt, or None when the checkpoint adds none (SmolLM2)."""
        bos = self._id_of(_token_spelling(config.get("bos_token")), "bos_token")
        if bos is None:
            return None
        add = config.get("add_bos_token")
        if add is None:  # HF tokenizers that add BOS say so in their post-processor template
            add = self._spelling(bos) in json.dumps(spec.get("post_processor") or {})
        return bos if add else None

    def _stop_ids(self, config: dict[str, Any], generation_config: dict[str, Any] | None) -> frozenset[int]:
        explicit = config.get("stop_token_ids")
        if isinstance(explicit, list) and explicit:
            ids = {int(i) for i in explicit}
        else:
            ids = {self.eos_id}
            gen_eos = (generation_config or {}).get("eos_token_id")
            ids.update(gen_eos if isinstance(gen_eos, list) else [gen_eos] if isinstance(gen_eos, int) else [])
            ids.update(i for name, i in self.special_tokens.items() if name in END_OF_GENERATION_SPELLINGS)
        bad = sorted(i for i in ids if not 0 <= i < self.vocab_size)
        if bad:
            raise CheckpointError(f"{self._source}: stop token ids {bad} are outside the vocabulary [0, {self.vocab_size})")
        return frozenset(ids)

    def _build_token_bytes(self, spec: dict[str, Any]) -> list[bytes]:
        """The bytes of every token, by the vocabulary's kind (read from its decoder)."""
        decoders = _decoder_types(spec.get("decoder"))
        kinds = {d.get("type") for d in decoders}
        vocab = self._tk.get_vocab(with_added_tokens=False)
        table = [b""] * self.vocab_size
        if "ByteLevel" in kinds:
            byte_of = gpt2_byte_decoder()
            for token, i in vocab.items():
                table[i] = bytes(byte_of[c] for c in token) if all(c in byte_of for c in token) else token.encode("utf-8")
        elif kinds & {"Metaspace", "Replace", "ByteFallback"}:
            self._strip_first_space = any(
                d.get("type") == "Strip" and d.get("start", 0) > 0 or d.get("type") == "Metaspace" and d.get("prepend_scheme", "always") != "never"
                for d in decoders
            )  # fmt: skip
            byte_fallback = "ByteFallback" in kinds
            for token, i in vocab.items():
                if byte_fallback and len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
                    table[i] = bytes([int(token[3:5], 16)])
                else:
                    table[i] = token.replace(_SP_SPACE, " ").encode("utf-8")
        else:
            raise CheckpointError(f"{self._source}: unsupported tokenizer decoder {sorted(k for k in kinds if k) or 'none'}")
        for i, data in self._added_bytes.items():
            table[i] = data
        return table

    # ------------------------------------------------------------------ the Tokenizer protocol
    def _encode_text(self, text: str) -> list[int]:
        # encode_batch releases the GIL while it works (encode does not), so a long prompt tokenized
        # on a worker thread does not stall the event loop's other streams
        return self._tk.encode_batch([text], add_special_tokens=False)[0].ids

    def first_token_bytes(self, token_id: int) -> bytes:
        """Sentencepiece-style vocabularies drop the dummy-prefix space of the first piece."""
        data = self.token_bytes(token_id)
        if self._strip_first_space and data.startswith(b" ") and token_id not in self._added_bytes:
            return data[1:]
        return data

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special_names


def read_tokenizer_config(checkpoint_dir: Path) -> dict[str, Any]:
    """tokenizer_config.json, or {} when the checkpoint has none."""
    return read_json_object(Path(checkpoint_dir) / TOKENIZER_CONFIG_FILE) or {}


def load_hf_tokenizer(checkpoint_dir: Path) -> HFTokenizer:
    """The tokenizer of a checkpoint dir holding tokenizer.json (a path to the file itself works too)."""
    checkpoint_dir = Path(checkpoint_dir)
    if checkpoint_dir.is_file():
        checkpoint_dir = checkpoint_dir.parent
    path = checkpoint_dir / TOKENIZER_FILE
    if not path.is_file():
        raise CheckpointError(f"{path}: tokenizer file not found")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: cannot read the tokenizer: {exc}") from None
    config = read_tokenizer_config(checkpoint_dir)
    return HFTokenizer(text, config, source=str(path), generation_config=read_generation_config(checkpoint_dir))


__all__ = ["END_OF_GENERATION_SPELLINGS", "HFTokenizer", "gpt2_byte_decoder", "load_hf_tokenizer", "read_tokenizer_config"]
