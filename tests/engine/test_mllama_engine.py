"""Llama 3.2 Vision through the whole engine (scheduler, executor, workers, per-sequence
cross-attention states): greedy tokens and logprobs equal llama-models' own generation (its
CrossAttentionTransformer, full recompute each token) for the same images and text; batching with
images in some rows, preemption, model parallelism and aborts never change a request's tokens, and
every cross-attention state is dropped with its sequence."""

from __future__ import annotations

import dataclasses
import hashlib

import pytest
import torch

from engine.config import EngineConfig
from engine.core.engine_core import EngineCore
from engine.executor.executor import ModelExecutor
from engine.executor.worker_group import WorkerGroup
from engine.loading.checkpoint import resolve_checkpoint
from engine.types import EngineRequest, ImagePlacement, PreparedImage, SamplingParams
from engine.vision.mllama import MllamaImagePreprocessor
from tests.engine.fakes import ByteTokenizer
from tests.engine.test_mllama import IMAGE, image, vision_spans_reference
from tests.mllama_fixtures import TINY_VISION_DESCRIPTOR, reference_model, write_tiny_vision_checkpoint

BLOCK = 4
MAX_SEQ_LEN = 64
MARKER = 7  # the prompt's <|image|> token in these tests (the Llama 3 tokenizer's is 128011): the engine feeds vocab_size
PREPROCESS = MllamaImagePreprocessor(chunk_size=28, max_num_chunks=4)


def prepared(width: int, height: int, seed: int) -> PreparedImage:
    pil = image(width, height, seed)
    out = PREPROCESS.preprocess(pil)
    return PreparedImage(hashlib.sha256(pil.tobytes()).digest(), out.aspect_ratio, out.num_chunks, 0, out.pixels)


def vision_request(rid: str, prompt: list[int], images: list[tuple[int, PreparedImage]], max_tokens: int = 8,
                   logprobs: int | None = None) -> EngineRequest:  # fmt: skip
    placements = tuple(ImagePlacement(im, offset, 1) for offset, im in images)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=logprobs)
    return EngineRequest(rid, prompt, params, images=placements)


REQUESTS = [
    (list(range(20, 30)) + [MARKER, 31, 32, 33], [(10, (40, 20, 0))]),
    ([1, MARKER, MARKER, 40, 41, MARKER, 42, 43, 44], [(1, (30, 30, 1)), (2, (60, 20, 2)), (5, (10, 50, 3))]),
    ([5, 6, 8, 9, 10, 11], []),  # text only, in the same batch
    ([MARKER, 50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 60, 61, 62, 63], [(0, (57, 83, 4))]),
]


def make_requests(logprobs: int | None = None) -> list[EngineRequest]:
    return [vision_request(f"r{i}", prompt, [(o, prepared(*size)) for o, size in images], logprobs=logprobs)
            for i, (prompt, images) in enumerate(REQUESTS)]  # fmt: skip


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_vision_checkpoint(tmp_path_factory.mktemp("mllama_engine"))


def make_core(checkpoint, *, dtype: str = "float32", mp_size: int = 1, num_blocks: int = 256, cpu_kernels: bool = False,
              **overrides) -> EngineCore:  # fmt: skip
    spec = resolve_checkpoint(checkpoint, model_id="tiny-vision", llama_model=TINY_VISION_DESCRIPTOR)
    cfg = EngineConfig(dtype=dtype, block_size_tokens=BLOCK, max_batch_size=8, max_num_batched_tokens=16, max_prefill_chunk_tokens=0,
                       model_parallel_size=mp_size, cpu_kernels=cpu_kernels, **overrides)  # fmt: skip
    workers = WorkerGroup(spec, cfg, max_seq_len=MAX_SEQ_LEN)
    if num_blocks < workers.num_blocks:  # a small pool, to force preemption
        workers.num_blocks = num_blocks
    return EngineCore(ModelExecutor(workers), ByteTokenizer(), cfg, MAX_SEQ_LEN)


def run(core: EngineCore, requests: list[EngineRequest]) -> dict[str, list]:
    outputs: dict[str, list] = {r.request_id: [] for r in requests}
    for r in requests:
        core.add_request(r)
    while core.has_unfinished:
        for out in core.step():
            outputs[out.request_id].append(out)
    return outputs


def tokens_of(outputs) -> dict[str, list[int]]:
    return {rid: [t for out in outs for t in out.new_token_ids] for rid, outs in outputs.items()}


def states(core: EngineCore) -> int:
    return core.runner._workers.cross_attention.num_states  # noqa: SLF001 (the test's view of rank 0's cache)


@pytest.mark.parametrize("cpu_kernels", [False, True])  # the text layers over torch ops, and over the C kernels
def test_greedy_generation_equals_llama_models(checkpoint, cpu_kernels):
    core = make_core(checkpoint, cpu_kernels=cpu_kernels)
    try:
        requests = make_requests(logprobs=0)
        outputs = run(core, [requests[0]])
        assert states(core) == 0  # dropped with its sequence
        for r in requests[1:]:
            outputs.update(run(core, [r]))
    finally:
        core.runner.shutdown()
    with reference_model(checkpoint) as model, torch.inference_mode():
        for (prompt, images), r in zip(REQUESTS, requests):
            pil = [image(*size) for _, size in images]
            tokens = [IMAGE if i in {o for o, _ in images} else t for i, t in enumerate(prompt)]
            total = len(tokens) + r.params.max_tokens
            mask = vision_spans_reference(tokens)
            xattn, masks, rows = model.compute_vision_tokens_masks([pil], [mask], total, torch.device("cpu"))
            expected, expected_logprobs = [], []
            for _ in range(r.params.max_tokens):
                padded = torch.tensor([tokens + [0] * (total - len(tokens))])
                logits = model.forward(torch.arange(len(tokens)), padded, masks, rows, xattn, text_only_inference=not pil)[0, -1]
                token = int(logits.argmax())
                expected.append(token)
                expected_logprobs.append(float(torch.log_softmax(logits.double(), -1)[token]))
                tokens.append(token)
            got = [t for out in outputs[r.request_id] for t in out.new_token_ids]
            got_logprobs = [lp.logprob for out in outputs[r.request_id] for lp in out.logprobs]
            assert got == expected, r.request_id
            assert max(abs(a - b) for a, b in zip(got_logprobs, expected_logprobs)) < 2e-3


@pytest.fixture(scope="module")
def alone(checkpoint):
    core = make_core(checkpoint, dtype="float64", enable_prefix_caching=False)
    try:
        yield {r.request_id: tokens_of(run(core, [r]))[r.request_id] for r in make_requests()}
    finally:
        core.runner.shutdown()


@pytest.mark.parametrize("num_blocks", [256, 12])
def test_batched_and_preempted_equal_alone(checkpoint, alone, num_blocks):
    core = make_core(checkpoint, dtype="float64", num_blocks=num_blocks)
    try:
        assert tokens_of(run(core, make_requests())) == alone
        if num_blocks == 12:
            assert core.scheduler.num_preempted_total > 0
        assert states(core) == 0 and core.pool.num_free == core.pool.num_blocks
    finally:
        core.runner.shutdown()


def test_abort_drops_the_state(checkpoint):
    core = make_core(checkpoint)
    try:
        request = make_requests()[0]
        core.add_request(request)
        core.step()
        assert states(core) == 1
        core.abort_request(request.request_id)
        assert states(core) == 0
    finally:
        core.runner.shutdown()


def test_model_parallel_2_equals_1(checkpoint, alone):
    core = make_core(checkpoint, dtype="float64", mp_size=2)
    try:
        assert tokens_of(run(core, make_requests())) == alone
        assert states(core) == 0
    finally:
        core.runner.shutdown()


def test_prefix_cache_hit_with_the_same_image_gives_the_same_tokens(checkpoint, alone):
    """The second run of each request reuses the first's KV blocks (the text before and after its
    image) and recomputes only the cross-attention state; its tokens do not change. (A different
    image behind the same tokens must miss: the block keys hash the image content, kv_blocks.py.)"""
    core = make_core(checkpoint, dtype="float64", enable_prefix_caching=True)
    try:
        first = tokens_of(run(core, make_requests()))
        hits_before = core.pool.prefix_hits_tokens
        again = [EngineRequest(f"again-{r.request_id}", r.prompt_token_ids, r.params, images=r.images) for r in make_requests()]
        second = tokens_of(run(core, again))
        assert core.pool.prefix_hits_tokens - hits_before >= 3 * BLOCK
        assert first == alone and {k.removeprefix("again-"): v for k, v in second.items()} == alone
        assert states(core) == 0
    finally:
        core.runner.shutdown()


def test_a_different_image_behind_the_same_tokens_misses_the_prefix_cache(checkpoint):
    """Blocks from the image's <|image|> on are keyed by the image's content (kv_blocks.py), so the
    same tokens with another image reuse only the blocks before it, and answer as they would alone."""
    prompt, ((offset, _),) = REQUESTS[0]
    first = vision_request("first", prompt, [(offset, prepared(40, 20, 0))])
    other = vision_request("other", prompt, [(offset, prepared(40, 20, 9))])
    alone_core = make_core(checkpoint, dtype="float64", enable_prefix_caching=False)
    try:
        expected = tokens_of(run(alone_core, [vision_request("other", prompt, [(offset, prepared(40, 20, 9))])]))
    finally:
        alone_core.runner.shutdown()
    core = make_core(checkpoint, dtype="float64", enable_prefix_caching=True)
    try:
        run(core, [first])
        hits_before = core.pool.prefix_hits_tokens
        assert tokens_of(run(core, [other])) == expected
        assert core.pool.prefix_hits_tokens - hits_before == (offset // BLOCK) * BLOCK  # the blocks before the image
    finally:
        core.runner.shutdown()


def test_cross_attention_states_are_reserved_in_the_kv_budget(checkpoint):
    """One image at the most tiles per sequence of a full batch comes out of the KV budget (here
    8 x 2 layers x K and V x 2 heads x 4 tiles x 5 tokens x 16 x 4 bytes), at most half of it."""
    from engine.models.llama import kv_cache_bytes_per_block

    spec = resolve_checkpoint(checkpoint, model_id="tiny-vision", llama_model=TINY_VISION_DESCRIPTOR)
    per_block = kv_cache_bytes_per_block(spec.model_args, 1, BLOCK, torch.float32)
    reserve = 8 * 2 * 2 * 2 * (4 * 5) * 16 * 4
    for budget, expected in ((256 << 10, (256 << 10) - reserve), (96 << 10, 48 << 10)):
        cfg = EngineConfig(dtype="float32", block_size_tokens=BLOCK, max_batch_size=8, cpu_kernels=False, kv_cache_bytes=budget)
        workers = WorkerGroup(spec, cfg, max_seq_len=MAX_SEQ_LEN)
        try:
            assert workers.num_blocks == expected // per_block
        finally:
            workers.shutdown()


def test_speculating_sequences_with_images_equal_alone(checkpoint):
    """ngram speculation: a speculating sequence's draft rows are query groups of their own
    (engine/executor/step_inputs.py), each reading its sequence's cross-attention state, and the
    groups of the sequences after it keep theirs. 24 tokens each: drafts in most steps, beside
    sequences with and without images."""
    from engine.spec.config import SpeculativeConfig

    requests = [dataclasses.replace(r, params=dataclasses.replace(r.params, max_tokens=24)) for r in make_requests()]
    core = make_core(checkpoint, dtype="float64", enable_prefix_caching=False)
    try:
        alone = {r.request_id: tokens_of(run(core, [r]))[r.request_id] for r in requests}
    finally:
        core.runner.shutdown()
    ngram = SpeculativeConfig("ngram", 3, prompt_lookup_max=3, prompt_lookup_min=1)
    core = make_core(checkpoint, dtype="float64", speculative_config=ngram)
    try:
        assert tokens_of(run(core, requests)) == alone
        assert core.stats().spec_decode_num_accepted_tokens_total > 0
        assert states(core) == 0 and core.pool.num_free == core.pool.num_blocks
    finally:
        core.runner.shutdown()
