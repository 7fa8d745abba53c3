"""GGUF import: a tiny Llama written the way llama.cpp's converter writes one converts to a
checkpoint whose forward pass gives the original model's logits.

The original model is HF-layout (q/k rows ordered for HF's rotate_half RoPE); llama.cpp's convert
script permutes those rows into ggml's adjacent-pair RoPE order before writing the GGUF. The test
does the same, imports, and compares a Meta-style forward (complex RoPE over adjacent pairs) on the
imported weights with a HF-style forward on the original ones: equal logits prove the importer's
q/k layout, which shapes alone cannot.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from engine.loading.checkpoint import resolve_checkpoint
from engine.models.args import ModelArgs
from engine.loading.gguf_import import ffn_params, import_gguf, main
from engine.tokenizers.hf import gpt2_byte_decoder, load_hf_tokenizer
from engine.types import CheckpointError

gguf = pytest.importorskip("gguf")

DIM, N_LAYERS, N_HEADS, N_KV_HEADS, HIDDEN = 64, 2, 4, 2, 96  # 96: not what multiple_of=256 gives
HEAD_DIM = DIM // N_HEADS
THETA, EPS = 10000.0, 1e-5
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = [("h", "e"), ("Ġ", "t"), ("Ġt", "he"), ("l", "l"), ("he", "ll"), ("hell", "o"), ("1", "2")]
CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def byte_level_tokens() -> list[str]:
    """Specials, the 256 byte tokens in byte order, then one token per merge."""
    by_byte = {b: c for c, b in gpt2_byte_decoder().items()}
    return SPECIALS + [by_byte[b] for b in range(256)] + [a + b for a, b in MERGES]


TOKENS = byte_level_tokens()
VOCAB = len(TOKENS)


def byte_id(char: str) -> int:
    return len(SPECIALS) + ord(char)


# --------------------------------------------------------------------------- the original (HF-layout) model
def hf_weights(seed: int, tied: bool) -> dict[str, np.ndarray]:
    """GGUF tensor name -> float32 weights in HF layout (q/k not yet permuted)."""
    rng = np.random.default_rng(seed)

    def mat(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)

    def norm() -> np.ndarray:
        return (1 + 0.1 * rng.standard_normal(DIM)).astype(np.float32)

    w = {"token_embd.weight": rng.standard_normal((VOCAB, DIM)).astype(np.float32), "output_norm.weight": norm()}
    if not tied:
        w["output.weight"] = mat(VOCAB, DIM)
    for i in range(N_LAYERS):
        p = f"blk.{i}."
        w[p + "attn_q.weight"] = mat(N_HEADS * HEAD_DIM, DIM)
        w[p + "attn_k.weight"] = mat(N_KV_HEADS * HEAD_DIM, DIM)
        w[p + "attn_v.weight"] = mat(N_KV_HEADS * HEAD_DIM, DIM)
        w[p + "attn_output.weight"] = mat(DIM, DIM)
        w[p + "ffn_gate.weight"] = mat(HIDDEN, DIM)
        w[p + "ffn_up.weight"] = mat(HIDDEN, DIM)
        w[p + "ffn_down.weight"] = mat(DIM, HIDDEN)
        w[p + "attn_norm.weight"] = norm()
        w[p + "ffn_norm.weight"] = norm()
    return w


def llama_cpp_permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: HF rotate_half rows -> ggml adjacent pairs."""
    return weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:]).swapaxes(1, 2).reshape(weights.shape)


def _forward(w: dict[str, torch.Tensor], tokens: list[int], rope) -> torch.Tensor:
    """[len(tokens), vocab] float64 logits of a Llama, given named weights and a RoPE function."""

    def rms(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * weight

    n = len(tokens)
    h = w["embed"][tokens]
    mask = torch.full((n, n), float("-inf"), dtype=torch.float64).triu(1)
    for i in range(N_LAYERS):
        x = rms(h, w[f"{i}.attn_norm"])
        q = rope((x @ w[f"{i}.q"].T).view(n, N_HEADS, HEAD_DIM))
        k = rope((x @ w[f"{i}.k"].T).view(n, N_KV_HEADS, HEAD_DIM))
        v = (x @ w[f"{i}.v"].T).view(n, N_KV_HEADS, HEAD_DIM)
        k, v = (t.repeat_interleave(N_HEADS // N_KV_HEADS, dim=1) for t in (k, v))
        scores = torch.einsum("qhd,khd->hqk", q, k) / HEAD_DIM**0.5 + mask
        h = h + torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, DIM) @ w[f"{i}.o"].T
        x = rms(h, w[f"{i}.ffn_norm"])
        h = h + (torch.nn.functional.silu(x @ w[f"{i}.gate"].T) * (x @ w[f"{i}.up"].T)) @ w[f"{i}.down"].T
    return rms(h, w["norm"]) @ w["output"].T


def _angles(n: int) -> torch.Tensor:
    inv_freq = 1.0 / (THETA ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float64) / HEAD_DIM))
    return torch.outer(torch.arange(n, dtype=torch.float64), inv_freq)  # [n, head_dim / 2]


def hf_rope(x: torch.Tensor) -> torch.Tensor:
    """HF Llama: rotate_half pairs dimension j with j + head_dim / 2."""
    ang = torch.cat([_angles(x.shape[0])] * 2, dim=-1)[:, None, :]
    x1, x2 = x[..., : HEAD_DIM // 2], x[..., HEAD_DIM // 2 :]
    return x * ang.cos() + torch.cat([-x2, x1], dim=-1) * ang.sin()


def meta_rope(x: torch.Tensor) -> torch.Tensor:
    """Meta Llama: adjacent pairs (2j, 2j + 1) as complex numbers."""
    cis = torch.polar(torch.ones_like(_angles(x.shape[0])), _angles(x.shape[0]))[:, None, :]
    return torch.view_as_real(torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2).contiguous()) * cis).flatten(-2)


def hf_named(w: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    t = {k: torch.from_numpy(np.array(v)).double() for k, v in w.items()}
    out = {"embed": t["token_embd.weight"], "norm": t["output_norm.weight"]}
    out["output"] = t.get("output.weight", out["embed"])
    for i in range(N_LAYERS):
        for ours, theirs in (("q", "attn_q"), ("k", "attn_k"), ("v", "attn_v"), ("o", "attn_output"), ("gate", "ffn_gate"),
                             ("up", "ffn_up"), ("down", "ffn_down"), ("attn_norm", "attn_norm"), ("ffn_norm", "ffn_norm")):  # fmt: skip
            out[f"{i}.{ours}"] = t[f"blk.{i}.{theirs}.weight"]
    return out


def meta_named(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    t = {k: v.double() for k, v in state.items()}
    out = {"embed": t["tok_embeddings.weight"], "norm": t["norm.weight"]}
    out["output"] = t.get("output.weight", out["embed"])
    for i in range(N_LAYERS):
        p = f"layers.{i}."
        for ours, theirs in (("q", "attention.wq"), ("k", "attention.wk"), ("v", "attention.wv"), ("o", "attention.wo"),
                             ("gate", "feed_forward.w1"), ("up", "feed_forward.w3"), ("down", "feed_forward.w2"),
                             ("attn_norm", "attention_norm"), ("ffn_norm", "ffn_norm")):  # fmt: skip
            out[f"{i}.{ours}"] = t[f"{p}{theirs}.weight"]
    return out


# --------------------------------------------------------------------------- writing GGUF files
def write_gguf(path: Path, weights: dict[str, np.ndarray], *, qtype=None, arch: str = "llama", vocab=None, vocab_size: int = VOCAB) -> dict[str, np.ndarray]:
    """Write `weights` (HF layout) as llama.cpp would: q/k permuted, matrices in `qtype`, norms F32.
    Returns the HF-layout weights as the GGUF holds them after quantization (the reference)."""
    qtype = qtype or gguf.GGMLQuantizationType.F32
    writer = gguf.GGUFWriter(str(path), arch=arch)
    writer.add_block_count(N_LAYERS)
    writer.add_context_length(256)
    writer.add_embedding_length(DIM)
    writer.add_feed_forward_length(HIDDEN)
    writer.add_head_count(N_HEADS)
    writer.add_head_count_kv(N_KV_HEADS)
    writer.add_rope_freq_base(THETA)
    writer.add_layer_norm_rms_eps(EPS)
    writer.add_rope_dimension_count(HEAD_DIM)
    writer.add_vocab_size(vocab_size)
    (vocab or write_byte_level_vocab)(writer)
    reference = {}
    for name, value in weights.items():
        if name.endswith("attn_q.weight"):
            value = llama_cpp_permute(value, N_HEADS)
        elif name.endswith("attn_k.weight"):
            value = llama_cpp_permute(value, N_KV_HEADS)
        if value.ndim == 2 and qtype != gguf.GGMLQuantizationType.F32:
            stored = gguf.quants.quantize(value, qtype)
            writer.add_tensor(name, stored, raw_dtype=None if stored.dtype == np.float16 else qtype)
            dequantized = gguf.quants.dequantize(stored, qtype).reshape(value.shape).astype(np.float32)
        else:
            writer.add_tensor(name, value)
            dequantized = value
        reference[name] = dequantized
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    # Row permutation commutes with per-row quantization: un-permute to get the HF-layout reference.
    for name in list(reference):
        if name.endswith("attn_q.weight"):
            reference[name] = llama_cpp_unpermute(reference[name], N_HEADS)
        elif name.endswith("attn_k.weight"):
            reference[name] = llama_cpp_unpermute(reference[name], N_KV_HEADS)
    return reference


def write_byte_level_vocab(writer) -> None:
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(TOKENS)
    writer.add_token_types([3] * len(SPECIALS) + [1] * (VOCAB - len(SPECIALS)))
    writer.add_token_merges([f"{a} {b}" for a, b in MERGES])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHATML)


def llama_cpp_unpermute(weights: np.ndarray, n_head: int) -> np.ndarray:
    return weights.reshape(n_head, weights.shape[0] // n_head // 2, 2, *weights.shape[1:]).swapaxes(1, 2).reshape(weights.shape)


PROMPT = [5, 17, 200, 3, 99, 42, 260, 7, 1, 150, 64, 2]

Q = gguf.GGMLQuantizationType
CASES = [(Q.F32, False), (Q.F16, False), (Q.Q8_0, True), (Q.Q4_1, True)]


@pytest.fixture(scope="module", params=CASES, ids=lambda c: f"{c[0].name}-{'tied' if c[1] else 'untied'}")
def imported(request, tmp_path_factory):
    qtype, tied = request.param
    tmp = tmp_path_factory.mktemp(f"gguf_{qtype.name}")
    reference = write_gguf(tmp / "tiny.gguf", hf_weights(seed=1, tied=tied), qtype=qtype)
    out = import_gguf(tmp / "tiny.gguf", tmp / "ckpt", progress=False)
    return out, reference, tied


# --------------------------------------------------------------------------- tests: weights and architecture
def test_forward_matches_original_model(imported):
    out, reference, _ = imported
    state = torch.load(out / "consolidated.00.pth", weights_only=True, mmap=True)
    expected = _forward(hf_named(reference), PROMPT, hf_rope)
    got = _forward(meta_named(state), PROMPT, meta_rope)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-9)


def test_layout_check_is_sensitive(imported):
    """Control: q/k left in HF order (no permutation undone) must change the logits, or the test
    above would prove nothing."""
    out, reference, _ = imported
    expected = _forward(hf_named(reference), PROMPT, hf_rope)
    wrong = _forward(hf_named(reference), PROMPT, meta_rope)
    assert (wrong - expected).abs().max() > 1e-3


def test_params_and_checkpoint_resolve(imported):
    out, _, tied = imported
    params = json.loads((out / "params.json").read_text())
    assert params["hidden_dim"] == HIDDEN and params["max_seq_len"] == 256
    assert params["tie_word_embeddings"] is tied
    spec = resolve_checkpoint(out, model_id="tiny-gguf")
    assert spec.family == "hf"
    assert spec.max_seq_len == 256
    args = spec.model_args
    assert (args.dim, args.n_layers, args.n_heads, args.kv_heads, args.vocab_size) == (DIM, N_LAYERS, N_HEADS, N_KV_HEADS, VOCAB)
    assert args.ffn_hidden_dim == HIDDEN and args.rope_theta == THETA and args.norm_eps == EPS
    state = torch.load(out / "consolidated.00.pth", weights_only=True)
    assert ("output.weight" in state) is not tied
    assert all(t.dtype == torch.float32 for t in state.values())


def test_runs_through_the_engine_model(imported):
    """H1's paged Transformer on the imported checkpoint gives the original model's logits."""
    from engine.config import EngineConfig
    from engine.executor.worker_group import WorkerGroup
    from engine.executor.executor import build_step_inputs
    from engine.core.sequence import ScheduledBatch, Sequence
    from engine.types import SamplingParams

    out, reference, _ = imported
    spec = resolve_checkpoint(out, model_id="tiny-gguf")
    config = EngineConfig(dtype="float64", block_size_tokens=4, max_batch_size=2, kv_cache_bytes=1 << 20)
    executor = WorkerGroup(spec, config, max_seq_len=64)
    try:
        seq = Sequence(0, "r0", list(PROMPT), len(PROMPT), SamplingParams(temperature=0.0))
        seq.block_table.extend(range((len(PROMPT) + 3) // 4))
        inputs, _ = build_step_inputs(ScheduledBatch([seq], [len(PROMPT)]), 4)
        logits = executor.execute(inputs)
    finally:
        executor.shutdown()
    expected = _forward(hf_named(reference), PROMPT, hf_rope)[-1]
    # atol: the engine builds its RoPE table in float32, as the llama3 reference does
    torch.testing.assert_close(logits[-1].double(), expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dim,hidden", [(64, 96), (576, 1536), (2048, 5632), (3072, 8192), (4096, 14336), (64, 100)])
def test_ffn_params_reproduce_any_hidden_size(dim, hidden):
    assert ModelArgs(dim=dim, n_layers=1, n_heads=4, **ffn_params(dim, hidden)).ffn_hidden_dim == hidden


# --------------------------------------------------------------------------- tests: the tokenizer it writes
@pytest.fixture(scope="module")
def tiny_tokenizer(imported):
    return load_hf_tokenizer(imported[0])


def test_tokenizer_pre_tokenizes_digits_one_by_one(tiny_tokenizer):
    hello, the, twelve = (TOKENS.index(t) for t in ("hello", "Ġthe", "12"))
    assert tiny_tokenizer.encode("hello the") == [hello, the]
    # "12" is a vocabulary token, but smollm splits digits before BPE, as llama.cpp does
    assert twelve not in tiny_tokenizer.encode("12")
    assert tiny_tokenizer.encode("12") == [byte_id("1"), byte_id("2")]


def test_tokenizer_special_tokens_and_config(tiny_tokenizer, imported):
    tk = tiny_tokenizer
    assert tk.vocab_size == VOCAB
    assert tk.bos_id is None  # add_bos_token is false: raw prompts get no BOS
    assert tk.eos_id == 2 and tk.stop_token_ids == frozenset({0, 2})  # <|im_end|>, and <|endoftext|> by spelling
    assert tk.is_special(1) and not tk.is_special(byte_id("a"))
    assert tk.encode("<|im_end|>") == [byte_id(c) for c in "<|im_end|>"]  # user text stays text
    text = "hello the 12 héllo\n"
    assert tk.decode(tk.encode(text)) == text
    config = json.loads((imported[0] / "tokenizer_config.json").read_text())
    assert config["chat_template"] == CHATML and config["bos_token"] == "<|im_start|>" and config["eos_token"] == "<|im_end|>"


def sentencepiece_vocab(sp):
    """What llama.cpp's converter writes for a sentencepiece tokenizer.model."""

    def write(writer) -> None:
        n = sp.get_piece_size()
        types = [2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 5 if sp.is_unused(i) else 6 if sp.is_byte(i) else 1 for i in range(n)]
        writer.add_tokenizer_model("llama")
        writer.add_token_list([sp.id_to_piece(i) for i in range(n)])
        writer.add_token_scores([sp.get_score(i) for i in range(n)])
        writer.add_token_types(types)
        writer.add_bos_token_id(sp.bos_id())
        writer.add_eos_token_id(sp.eos_id())

    return write


SP_TEXTS = ["the quick brown fox", "hello  world\n\tllama café naïve", "42 3.14 {x}", "東京 🦙 emoji!", " leading space", "unseen QXZ glyphs ©®"]


def test_sentencepiece_vocabulary_matches_sentencepiece(tmp_path):
    import sentencepiece

    from tests.engine.tokenizer_fixtures import tiny_sentencepiece_model

    sp = sentencepiece.SentencePieceProcessor(model_proto=tiny_sentencepiece_model())
    weights = hf_weights(seed=3, tied=True)
    weights["token_embd.weight"] = np.resize(weights["token_embd.weight"], (sp.get_piece_size(), DIM)).astype(np.float32)
    path = tmp_path / "sp.gguf"
    write_gguf(path, weights, vocab=sentencepiece_vocab(sp), vocab_size=sp.get_piece_size())
    out = import_gguf(path, tmp_path / "ckpt", progress=False)
    tk = load_hf_tokenizer(out)
    assert tk.bos_id == sp.bos_id() and tk.eos_id == sp.eos_id()  # llama vocabularies add BOS by default
    for text in SP_TEXTS:
        assert tk.encode(text) == sp.encode(text), text
        assert tk.decode(tk.encode(text)) == sp.decode(sp.encode(text))
    # Random letter soup reaches merge orders that whole words do not (a wrong rank order fails here).
    rng = random.Random(0)
    alphabet = "the quick brown fox jumps over lazy dog hello world llama 42 café"
    for _ in range(1000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 20)))
        assert tk.encode(text) == sp.encode(text), text


def tiktoken_as_gguf_vocab(ranks: dict[bytes, int], specials: list[str]) -> tuple[list[str], list[int], list[list[str]]]:
    """(tokens, token types, merges) as llama.cpp's converter writes a Llama 3 vocabulary: byte-level
    spellings, merges recovered from the BPE ranks (each split of a token into two tokens, by rank)."""
    to_char = {b: c for c, b in gpt2_byte_decoder().items()}

    def spell(token: bytes) -> str:
        return "".join(to_char[b] for b in token)

    by_rank = sorted(ranks, key=ranks.__getitem__)
    merges = []
    for token in by_rank:
        splits = [(token[:i], token[i:]) for i in range(1, len(token)) if token[:i] in ranks and token[i:] in ranks]
        merges.extend(sorted(splits, key=lambda lr: (ranks[lr[0]], ranks[lr[1]])))
    merges.sort(key=lambda lr: ranks[lr[0] + lr[1]])
    return [spell(t) for t in by_rank] + specials, [1] * len(by_rank) + [3] * len(specials), [[spell(a), spell(b)] for a, b in merges]


@pytest.mark.slow
def test_llama3_pre_tokenizer_matches_tiktoken():
    """tokenizer.ggml.pre = "llama-bpe" (Llama 3 GGUFs): the tokenizer.json we build encodes as
    Llama 3's own tiktoken tokenizer does."""
    from engine.loading.gguf_import import PRE_TOKENIZERS, _tokenizer_json
    from engine.tokenizers.hf import HFTokenizer
    from engine.tokenizers.tokenizer import llama3_special_tokens, load_tiktoken_ranks, load_tokenizer
    from tests.engine.tokenizer_fixtures import llama_models_file

    path = llama_models_file("llama3/tokenizer.model")
    tokens, types, merges = tiktoken_as_gguf_vocab(load_tiktoken_ranks(path), llama3_special_tokens())
    config = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>", "add_bos_token": True}
    ours = HFTokenizer(json.dumps(_tokenizer_json(tokens, types, merges, PRE_TOKENIZERS["llama-bpe"])), config, source="llama3")
    reference = load_tokenizer("llama3", path)
    rng = random.Random(0)
    alphabet = "abcXYZ 0123 \n\t'!?.,éü日🙂"
    texts = SP_TEXTS + ["The year 2024 had 366 days; 1234567", "It's, DON'T, we'll", "<|eot_id|> as text", "    \n\n   x   "]
    texts += ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 30))) for _ in range(300)]
    for text in texts:
        assert ours.encode(text, bos=True) == reference.encode(text, bos=True), text


def _with_rope_freqs(factors: np.ndarray):
    def write(writer) -> None:
        write_byte_level_vocab(writer)
        writer.add_tensor("rope_freqs.weight", factors.astype(np.float32))

    return write


def test_llama31_rope_freqs_mean_scaled_rope(tmp_path):
    from engine.loading.gguf_import import meta_rope_factors

    path = tmp_path / "scaled.gguf"
    write_gguf(path, hf_weights(seed=4, tied=True), vocab=_with_rope_freqs(meta_rope_factors(HEAD_DIM, THETA)))
    out = import_gguf(path, tmp_path / "ckpt", progress=False)
    assert json.loads((out / "params.json").read_text())["use_scaled_rope"] is True
    assert "rope_freqs.weight" not in torch.load(out / "consolidated.00.pth", weights_only=True)
    path32 = tmp_path / "scaled32.gguf"
    write_gguf(path32, hf_weights(seed=4, tied=True), vocab=_with_rope_freqs(meta_rope_factors(HEAD_DIM, THETA, 32.0)))
    with pytest.raises(CheckpointError, match="factor 32 is not supported"):
        import_gguf(path32, tmp_path / "ckpt32", progress=False)


# --------------------------------------------------------------------------- tests: refusals
def _tiny_gguf(path: Path, **kw) -> Path:
    write_gguf(path, hf_weights(seed=2, tied=True), **kw)
    return path


def test_other_architecture_is_refused(tmp_path):
    path = _tiny_gguf(tmp_path / "qwen.gguf", arch="qwen2")
    with pytest.raises(CheckpointError, match="general.architecture is 'qwen2'"):
        import_gguf(path, tmp_path / "out", progress=False)


def _set_tensor_type(path: Path, tensor_name: str, type_id: int) -> None:
    reader = gguf.GGUFReader(str(path), "r+")
    tensor = next(t for t in reader.tensors if t.name == tensor_name)
    tensor.field.parts[-2][0] = type_id  # tensor info: name, n_dims, dims, type, offset
    reader.data.flush()


def test_unknown_tensor_type_is_refused(tmp_path):
    path = _tiny_gguf(tmp_path / "bad.gguf")
    _set_tensor_type(path, "blk.0.attn_norm.weight", 99)
    with pytest.raises(CheckpointError, match="99"):
        import_gguf(path, tmp_path / "out", progress=False)


def test_type_gguf_cannot_dequantize_is_refused(tmp_path):
    path = tmp_path / "q8_1.gguf"
    weights = hf_weights(seed=2, tied=True)
    writer = gguf.GGUFWriter(str(path), arch="llama")
    writer.add_block_count(N_LAYERS)
    writer.add_embedding_length(DIM)
    writer.add_feed_forward_length(HIDDEN)
    writer.add_head_count(N_HEADS)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(TOKENS)
    block_bytes = gguf.GGML_QUANT_SIZES[Q.Q8_1][1]
    raw = np.zeros((VOCAB, DIM // 32 * block_bytes), dtype=np.uint8)
    writer.add_tensor("token_embd.weight", raw, raw_dtype=Q.Q8_1)
    writer.add_tensor("output_norm.weight", weights["output_norm.weight"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(CheckpointError, match="token_embd.weight.*Q8_1"):
        import_gguf(path, tmp_path / "out", progress=False)


@pytest.mark.parametrize("keep", [0.5, 0.02])
def test_truncated_file_is_refused(tmp_path, keep):
    path = _tiny_gguf(tmp_path / "cut.gguf")
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(CheckpointError, match="truncated"):
        import_gguf(path, tmp_path / "out", progress=False)
    assert not (tmp_path / "out" / "params.json").exists()


def test_not_a_gguf_file(tmp_path):
    path = tmp_path / "x.gguf"
    path.write_bytes(b"not gguf at all" * 10)
    with pytest.raises(CheckpointError, match="not a readable GGUF"):
        import_gguf(path, tmp_path / "out", progress=False)


def test_cli_main(tmp_path, capsys):
    path = _tiny_gguf(tmp_path / "tiny.gguf", qtype=Q.Q8_0)
    assert main([str(path), str(tmp_path / "ckpt"), "--quiet"]) == 0
    assert (tmp_path / "ckpt" / "params.json").exists()
    assert main([str(tmp_path / "missing.gguf"), str(tmp_path / "ckpt2")]) == 1
    err = capsys.readouterr().err
    assert "missing.gguf" in err and "Traceback" not in err
