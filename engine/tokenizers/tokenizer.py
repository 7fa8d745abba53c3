"""Tokenizers for the Llama families: tiktoken BPE (Llama 3.x, Llama 4) and sentencepiece (Llama 2).

Every tokenizer speaks the same `Tokenizer` protocol, so the detokenizer, the chat formats and the
engine never ask which family they hold. Chat content from users is always encoded as text: a
user who types `<|eot_id|>` gets the tokens of those characters, never the control token; only the
chat format appends control tokens, by id. A completions text prompt is the one exception
(`parse_special`): whoever sends it applied the template, as vLLM and llama.cpp assume.

The family comes from the checkpoint's descriptor (`load_tokenizer(family, path)`), never from a
guess at the file's size or contents; a file that does not fit its family is refused.
"""

from __future__ import annotations

import base64
import re
from pathlib import Path
from typing import Iterator, Protocol, Sequence, runtime_checkable

from engine.tokenizers.base import ByteTableTokenizer, SpecialTokenTable
from engine.types import CheckpointError, Family

# tiktoken panics on inputs above ~400k characters and goes quadratic on very long runs of
# whitespace or of non-whitespace (https://github.com/openai/tiktoken/issues/195), so long text is
# cut into chunks that respect both limits (the numbers llama-models uses).
TIKTOKEN_MAX_ENCODE_CHARS = 400_000
MAX_CONSECUTIVE_RUN_CHARS = 25_000

_RUNS = re.compile(r"\s+|\S+")


@runtime_checkable
class Tokenizer(Protocol):
    """What the engine, the detokenizer and the chat formats need from a tokenizer."""

    vocab_size: int  # ids in [0, vocab_size), special tokens included
    bos_id: int | None
    eos_id: int
    stop_token_ids: frozenset[int]  # the family's end tokens (end of text, turn, message)

    def encode(self, text: str, *, bos: bool = False, eos: bool = False, parse_special: bool = False) -> list[int]:
        """Special-token spellings in `text` are plain text, never control tokens, unless
        `parse_special` (a completions prompt its sender templated, as vLLM and llama.cpp read it)."""
        ...

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        """Invalid UTF-8 becomes U+FFFD; ids outside the vocabulary decode to nothing."""
        ...

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes of one token (a special token's spelling; b"" outside the vocabulary)."""
        ...

    def first_token_bytes(self, token_id: int) -> bytes:
        """The bytes of `token_id` when it is the first non-special token of a sequence: what
        `decode` prints there (sentencepiece drops one leading space). Usually token_bytes."""
        ...

    def is_special(self, token_id: int) -> bool: ...

    def special_token_id(self, name: str) -> int:
        """The id of a special token by its spelling, e.g. "<|eot_id|>"; KeyError if none."""
        ...


# --------------------------------------------------------------------------- long-input safety
def split_for_tiktoken(
    text: str,
    *,
    max_chunk_chars: int = TIKTOKEN_MAX_ENCODE_CHARS,
    max_run_chars: int = MAX_CONSECUTIVE_RUN_CHARS,
) -> Iterator[str]:
    """Cut `text` into chunks tiktoken encodes safely: no chunk longer than `max_chunk_chars` and
    no run of whitespace or non-whitespace longer than `max_run_chars` inside one chunk.

    Ordinary text (no overlong run, under the chunk limit) comes back whole, so its tokens are
    exactly what one tiktoken call gives. Chunks are cut at run boundaries where possible."""
    if len(text) <= max_run_chars:
        yield text
        return
    start = 0  # start of the chunk being built
    space_cut = -1  # the best cut inside the latest whitespace run of the current chunk
    for run in _RUNS.finditer(text):
        run_start, run_end = run.span()
        if run_end - run_start > max_run_chars:  # an overlong run: cut before it, then into pieces
            if run_start > start:
                yield text[start:run_start]
            start = run_start
            while run_end - start > max_run_chars:
                yield text[start : start + max_run_chars]
                start += max_run_chars
            space_cut = -1
        elif run_end - start > max_chunk_chars:
            cut = space_cut if start < space_cut <= run_start else run_start
            yield text[start:cut]
            start = cut
        if text[run_start].isspace():
            space_cut = _cut_in_space_run(text, run_start, run_end)


    if start < len(text):
        yield text[start:]


def _cut_in_space_run(text: str, run_start: int, run_end: int) -> int:
    """Where to cut a whitespace run so that both sides tokenize as the whole would: after its last
    newline (punctuation keeps the newlines that follow it), and before its last space (a word
    keeps one leading space)."""
    last_newline = max(text.rfind("\n", run_start, run_end), text.rfind("\r", run_start, run_end))
    return max(last_newline + 1, run_end - 1)


def load_tiktoken_ranks(path: Path) -> dict[bytes, int]:
    """Read a tiktoken BPE file: one `base64(token) rank` pair per line."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: cannot read the tokenizer: {exc}") from exc
    ranks: dict[bytes, int] = {}
    for line_no, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            token_b64, rank = line.split()
            ranks[base64.b64decode(token_b64, validate=True)] = int(rank)
        except ValueError as exc:
            raise CheckpointError(f"{path}:{line_no}: not a tiktoken BPE line: {line[:80]!r}") from exc
    return ranks


# --------------------------------------------------------------------------- tiktoken families
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
LLAMA3_NUM_BASE_TOKENS = 128_000
LLAMA3_NUM_SPECIAL_TOKENS = 256


def llama3_special_tokens() -> list[str]:
    """Llama 3.x's 256 special tokens in id order, starting at 128000."""
    named = [
        "<|begin_of_text|>",  # 128000
        "<|end_of_text|>",  # 128001
        "<|reserved_special_token_0|>",
        "<|reserved_special_token_1|>",
        "<|finetune_right_pad_id|>",  # 128004
        "<|step_id|>",  # 128005
        "<|start_header_id|>",  # 128006
        "<|end_header_id|>",  # 128007
        "<|eom_id|>",  # 128008, end of message
        "<|eot_id|>",  # 128009, end of turn
        "<|python_tag|>",  # 128010
        "<|image|>",  # 128011
    ]
    reserved = [f"<|reserved_special_token_{2 + i}|>" for i in range(LLAMA3_NUM_SPECIAL_TOKENS - len(named))]
    return named + reserved


LLAMA4_PATTERN = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
LLAMA4_NUM_BASE_TOKENS = 200_000
LLAMA4_NUM_SPECIAL_TOKENS = 2048


def llama4_special_tokens() -> list[str]:
    """Llama 4's 2048 special tokens in id order, starting at 200000 (vocabulary 202048)."""
    basic = ["<|begin_of_text|>", "<|end_of_text|>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>"]
    text_post_train = [  # 200005 ...
        "<|header_start|>",
        "<|header_end|>",
        "<|eom|>",
        "<|eot|>",
        "<|step|>",
        *(f"<|text_post_train_reserved_special_token_{i}|>" for i in range(6)),
        "<|python_start|>",
        "<|python_end|>",
        "<|finetune_right_pad|>",
        *(f"<|text_post_train_reserved_special_token_{i}|>" for i in range(8, 69)),
    ]  # ... 200079
    vision = [  # 200080 ...
        "<|image_start|>",
        "<|image_end|>",
        "<|vision_reserved_special_token_0|>",
        "<|vision_reserved_special_token_1|>",
        "<|tile_x_separator|>",
        "<|tile_y_separator|>",
        *(f"<|vision_reserved_special_token_{i}|>" for i in range(2, 6)),
        "<|image|>",
        "<|vision_reserved_special_token_6|>",
        "<|patch|>",
        *(f"<|vision_reserved_special_token_{i}|>" for i in range(7, 1048)),
    ]  # ... 201133
    reasoning = [  # 201134 ... 201143
        *(f"<|reasoning_reserved_special_token_{i}|>" for i in range(8)),
        "<|reasoning_thinking_start|>",
        "<|reasoning_thinking_end|>",
    ]
    named = basic + text_post_train + vision + reasoning
    reserved = [f"<|reserved_special_token_{i}|>" for i in range(LLAMA4_NUM_SPECIAL_TOKENS - len(named))]
    return named + reserved


class TiktokenTokenizer(SpecialTokenTable):
    """A tiktoken BPE vocabulary followed by a block of special tokens (Llama 3.x and Llama 4)."""

    def __init__(
        self,
        path: Path,
        *,
        name: str,
        pattern: str,
        num_base_tokens: int,
        special_tokens: Sequence[str],
        stop_tokens: Sequence[str],
    ) -> None:
        import tiktoken  # here, not at module level: the protocol is importable without it

        ranks = load_tiktoken_ranks(path)
        if len(ranks) != num_base_tokens:
            raise CheckpointError(
                f"{path}: {name} expects a tokenizer.model with {num_base_tokens} BPE tokens, this one has "
                f"{len(ranks)}; is it the tokenizer of another model family?"
            )
        self.num_base_tokens = num_base_tokens
        self.special_tokens: dict[str, int] = {tok: num_base_tokens + i for i, tok in enumerate(special_tokens)}
        self._special_names = {i: tok for tok, i in self.special_tokens.items()}
        self._encoding = tiktoken.Encoding(
            name=f"{name}:{path}", pat_str=pattern, mergeable_ranks=ranks, special_tokens=self.special_tokens
        )
        self.vocab_size = num_base_tokens + len(special_tokens)
        self.bos_id: int | None = self.special_tokens["<|begin_of_text|>"]
        self.eos_id = self.special_tokens["<|end_of_text|>"]
        self.stop_token_ids = frozenset(self.special_tokens[tok] for tok in stop_tokens)

    def encode(self, text: str, *, bos: bool = False, eos: bool = False, parse_special: bool = False) -> list[int]:
        ids: list[int] = [self.bos_id] if bos and self.bos_id is not None else []
        for chunk in split_for_tiktoken(text):
            if parse_special:
                ids.extend(self._encoding.encode(chunk, allowed_special="all"))
            else:  # special spellings are ordinary text, not an error
                ids.extend(self._encoding.encode_ordinary(chunk))
        if eos:
            ids.append(self.eos_id)
        return ids

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        limit = self.num_base_tokens if skip_special_tokens else self.vocab_size
        kept = [t for t in token_ids if 0 <= t < limit]
        return self._encoding.decode_bytes(kept).decode("utf-8", errors="replace")

    def token_bytes(self, token_id: int) -> bytes:
        if not 0 <= token_id < self.vocab_size:
            return b""
        return self._encoding.decode_single_token_bytes(token_id)

    def first_token_bytes(self, token_id: int) -> bytes:
        return self.token_bytes(token_id)

    def is_special(self, token_id: int) -> bool:
        return self.num_base_tokens <= token_id < self.vocab_size


def llama3_tokenizer(path: Path) -> TiktokenTokenizer:
    return TiktokenTokenizer(
        path,
        name="llama3",
        pattern=LLAMA3_PATTERN,
        num_base_tokens=LLAMA3_NUM_BASE_TOKENS,
        special_tokens=llama3_special_tokens(),
        stop_tokens=("<|end_of_text|>", "<|eot_id|>", "<|eom_id|>"),
    )


def llama4_tokenizer(path: Path) -> TiktokenTokenizer:
    return TiktokenTokenizer(
        path,
        name="llama4",
        pattern=LLAMA4_PATTERN,
        num_base_tokens=LLAMA4_NUM_BASE_TOKENS,
        special_tokens=llama4_special_tokens(),
        stop_tokens=("<|end_of_text|>", "<|eot|>", "<|eom|>"),
    )


# --------------------------------------------------------------------------- sentencepiece (Llama 2)
_SP_SPACE = "\u2581"  # sentencepiece's visible space, "▁"
_SP_UNK_SURFACE = " \u2047 "  # what sentencepiece prints for <unk>


class SentencePieceTokenizer(ByteTableTokenizer):
    """Llama 2's sentencepiece model (with byte fallback). Decoding is done here from per-token
    bytes so that one-shot and incremental decoding follow one rule: sentencepiece's own output
    for valid UTF-8 (dummy-prefix space dropped once, <unk> as " ⁇ "), with one U+FFFD per
    invalid sequence where sentencepiece writes one per byte, as tiktoken and Python do."""

    def __init__(self, path: Path) -> None:
        import sentencepiece

        try:
            self._sp = sentencepiece.SentencePieceProcessor(model_file=str(path))
        except (OSError, RuntimeError) as exc:
            raise CheckpointError(f"{path}: not a sentencepiece model: {exc}") from exc
        sp = self._sp
        self.vocab_size = sp.get_piece_size()
        self.bos_id = sp.bos_id() if sp.bos_id() >= 0 else None
        if sp.eos_id() < 0:
            raise CheckpointError(f"{path}: the sentencepiece model has no end-of-sequence token")
        self.eos_id = sp.eos_id()
        self.stop_token_ids = frozenset({self.eos_id})
        self._bytes = [self._piece_bytes(i) for i in range(self.vocab_size)]
        self._special = frozenset(i for i in range(self.vocab_size) if sp.is_control(i))
        self.special_tokens = {sp.id_to_piece(i): i for i in self._special}
        self._special_names = {i: name for name, i in self.special_tokens.items()}

    def _piece_bytes(self, token_id: int) -> bytes:
        sp = self._sp
        piece = sp.id_to_piece(token_id)
        if sp.is_byte(token_id):  # "<0xE2>"
            return bytes([int(piece[3:5], 16)])
        if sp.is_unknown(token_id):
            return _SP_UNK_SURFACE.encode()
        return piece.replace(_SP_SPACE, " ").encode("utf-8")

    def _encode_text(self, text: str) -> list[int]:
        # sentencepiece never reads control tokens from input text, so "<s>" stays text
        return self._sp.encode(text)

    def first_token_bytes(self, token_id: int) -> bytes:
        """Sentencepiece's dummy prefix: the first visible piece loses one leading space, unless it
        is a byte-fallback or unknown piece (their spaces are real text)."""
        data = self.token_bytes(token_id)
        if data.startswith(b" ") and not (self._sp.is_byte(token_id) or self._sp.is_unknown(token_id)):
            return data[1:]
        return data

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special


# --------------------------------------------------------------------------- factory
def load_tokenizer(family: Family, path: Path) -> Tokenizer:
    """The tokenizer of `family` (from the checkpoint's descriptor) read from `path`."""
    path = Path(path)
    if family == "hf":
        try:
            from engine.tokenizers.hf import load_hf_tokenizer
        except ImportError as exc:
            raise CheckpointError(f"{path}: HF tokenizers are not available in this build ({exc})") from exc
        return load_hf_tokenizer(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: tokenizer file not found")
    if family in ("llama3", "llama3_1", "llama3_2", "llama3_3"):
        return llama3_tokenizer(path)
    if family == "llama4":
        return llama4_tokenizer(path)
    if family == "llama2":
        return SentencePieceTokenizer(path)
    raise CheckpointError(f"{path}: no tokenizer for model family {family!r}")
