"""ModelExecutor (the executor) over a fake worker group: the StepInputs it builds and the StepOutput it returns."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.executor.executor import ModelExecutor, build_step_inputs
from engine.core.sequence import ScheduledBatch, Sequence
from engine.executor.step_inputs import StepInputs
from engine.types import SamplingParams

VOCAB = 32
BLOCK_SIZE = 4


class FakeExecutor:
    """Records each StepInputs; row j of the logits it returns peaks at next_token(j)."""

    vocab_size = VOCAB
    num_blocks = 64
    block_size = BLOCK_SIZE
    argmax_kernels = None

    def __init__(self, fail: bool = False) -> None:
        self.calls: list[StepInputs] = []
        self.fail = fail
        self.shut_down = False

    def execute(self, inputs: StepInputs) -> torch.Tensor:
        self.calls.append(inputs)
        if self.fail:
            raise RuntimeError("forward exploded")
        logits = torch.zeros(len(inputs.logits_indices), VOCAB)
        # the next token is (last input token + 1) mod VOCAB: a checkable function of the inputs
        last = inputs.input_ids[inputs.logits_indices]
        logits[torch.arange(len(last)), (last + 1) % VOCAB] = 5.0
        return logits

    def shutdown(self) -> None:
        self.shut_down = True


def make_seq(seq_id: int, token_ids: list[int], num_prompt: int, computed: int, blocks: list[int], **params) -> Sequence:
    return Sequence(
        seq_id=seq_id,
        request_id=f"r{seq_id}",
        token_ids=token_ids,
        num_prompt_tokens=num_prompt,
        num_computed_tokens=computed,
        block_table=blocks,
        params=SamplingParams(temperature=0, **params),
    )


def mixed_batch() -> ScheduledBatch:
    # a decode at position 9 (blocks 7, 3, 5), a decode at position 4 (blocks 2, 8),
    # a partial prefill chunk [0, 6) of 10 prompt tokens (blocks 10, 11), and a last prefill chunk
    # [4, 7) of 7 prompt tokens after a prefix hit of 4 (blocks 12, 13)
    decode_a = make_seq(0, list(range(100, 110)), 6, 9, [7, 3, 5])
    decode_b = make_seq(1, [1, 2, 3, 4, 5], 4, 4, [2, 8])
    partial = make_seq(2, list(range(200, 210)), 10, 0, [10, 11])
    last_chunk = make_seq(3, list(range(300, 307)), 7, 4, [12, 13])
    return ScheduledBatch(seqs=[decode_a, decode_b, partial, last_chunk], num_new_tokens=[1, 1, 6, 3])


def test_step_inputs_for_mixed_prefill_chunks_and_decodes():
    inputs, sampling = build_step_inputs(mixed_batch(), BLOCK_SIZE)
    assert sampling == [0, 1, 3]
    assert inputs.input_ids.tolist() == [109, 5, 200, 201, 202, 203, 204, 205, 304, 305, 306]
    assert inputs.positions.tolist() == [9, 4, 0, 1, 2, 3, 4, 5, 4, 5, 6]
    # slot = block_table[pos // 4] * 4 + pos % 4
    assert inputs.slot_mapping.tolist() == [5 * 4 + 1, 8 * 4 + 0, 40, 41, 42, 43, 44, 45, 52, 53, 54]
    assert inputs.query_start_loc.tolist() == [0, 1, 2, 8, 11]
    assert inputs.seq_lens.tolist() == [10, 5, 6, 7]
    assert inputs.logits_indices.tolist() == [0, 1, 10]
    assert inputs.block_tables.tolist() == [[7, 3, 5], [2, 8, 0], [10, 11, 0], [12, 13, 0]]
    dtypes = {name: getattr(inputs, name).dtype for name in ("input_ids", "positions", "slot_mapping", "logits_indices")}
    assert set(dtypes.values()) == {torch.int64}
    assert {inputs.block_tables.dtype, inputs.query_start_loc.dtype, inputs.seq_lens.dtype} == {torch.int32}


def test_execute_returns_sampling_sequences_in_batch_order():
    executor = FakeExecutor()
    runner = ModelExecutor(executor)
    assert (runner.vocab_size, runner.num_blocks, runner.block_size) == (VOCAB, 64, BLOCK_SIZE)
    out = runner.execute(mixed_batch())
    assert out.seq_ids == [0, 1, 3]
    assert out.sampled_token_ids == [(109 + 1) % VOCAB, 6, (306 + 1) % VOCAB]
    assert out.logprobs == [None, None, None] and out.errors == {}
    assert len(executor.calls) == 1
    runner.shutdown()
    assert executor.shut_down


def test_only_partial_chunks_still_run_the_forward_and_sample_nothing():
    executor = FakeExecutor()
    seq = make_seq(0, list(range(10)), 10, 0, [1, 2, 3])
    out = ModelExecutor(executor).execute(ScheduledBatch([seq], [8]))
    assert out.seq_ids == [] and out.sampled_token_ids == []
    assert executor.calls[0].logits_indices.tolist() == []
    assert executor.calls[0].slot_mapping.tolist() == [4, 5, 6, 7, 8, 9, 10, 11]


def test_empty_batch_does_not_call_the_executor():
    executor = FakeExecutor()
    out = ModelExecutor(executor).execute(ScheduledBatch([], []))
    assert out.seq_ids == [] and executor.calls == []


def test_logprobs_and_row_errors_flow_into_step_output():
    executor = FakeExecutor()
    ok = make_seq(0, [1, 2], 2, 1, [0], logprobs=2)
    bad = make_seq(1, [3, 4], 2, 1, [1], logit_bias=((VOCAB, 1.0),))
    out = ModelExecutor(executor).execute(ScheduledBatch([ok, bad], [1, 1]))
    assert out.seq_ids == [0] and out.sampled_token_ids == [3]
    assert out.logprobs[0].token_id == 3 and [t for t, _ in out.logprobs[0].top][0] == 3
    assert list(out.errors) == [1]


def test_executor_errors_propagate():
    runner = ModelExecutor(FakeExecutor(fail=True))
    with pytest.raises(RuntimeError, match="exploded"):
        runner.execute(mixed_batch())


@pytest.mark.parametrize(
    "computed, count, blocks",
    [(0, 9, [1, 2]), (5, 6, [1, 2, 3]), (0, 0, [1])],  # block table too short, past the end, empty chunk
)
def test_inconsistent_batch_is_refused(computed, count, blocks):
    seq = make_seq(0, list(range(10)), 10, computed, blocks)
    with pytest.raises(ValueError, match="sequence 0"):
        build_step_inputs(ScheduledBatch([seq], [count]), BLOCK_SIZE)


# ---------------------------------------------------------------------- over the real tiny model
@pytest.fixture(scope="module")
def real_runner(tiny_checkpoint):
    from engine.loading.checkpoint import resolve_checkpoint
    from engine.config import EngineConfig
    from engine.executor.worker_group import WorkerGroup
    from tests.conftest import TINY_DESCRIPTOR

    spec = resolve_checkpoint(tiny_checkpoint, model_id="tiny", llama_model=TINY_DESCRIPTOR)
    config = EngineConfig(dtype="float64", block_size_tokens=BLOCK_SIZE, max_batch_size=4)
    runner = ModelExecutor(WorkerGroup(spec, config, max_seq_len=64))
    yield runner
    runner.shutdown()


def test_chunked_generation_through_real_executor_equals_one_shot_prefills(real_runner):
    """Greedy tokens from 4-token prefill chunks then decodes, batched beside another sequence,
    equal those of a one-shot prefill of each prefix on fresh blocks (float64: no near ties)."""
    next_block = iter(range(real_runner.num_blocks))
    logprobs_by_seq: dict[int, list[float]] = {}
    g = torch.Generator().manual_seed(3)
    vocab = real_runner.vocab_size

    def new_seq(seq_id: int, prompt: list[int]) -> Sequence:
        return Sequence(seq_id, f"r{seq_id}", list(prompt), len(prompt), SamplingParams(temperature=0, logprobs=1))

    def step(pairs: list[tuple[Sequence, int]]):
        for seq, n in pairs:
            while len(seq.block_table) * BLOCK_SIZE < seq.num_computed_tokens + n:
                seq.block_table.append(next(next_block))
        batch = ScheduledBatch([s for s, _ in pairs], [n for _, n in pairs])
        out = real_runner.execute(batch)
        assert out.errors == {}
        for seq, n in pairs:  # what the scheduler does after a step
            seq.num_computed_tokens += n
        for seq_id, token, logprob in zip(out.seq_ids, out.sampled_token_ids, out.logprobs):
            seq = next(s for s, _ in pairs if s.seq_id == seq_id)
            seq.token_ids.append(token)
            logprobs_by_seq.setdefault(seq_id, []).append(logprob.logprob)
        return out

    prompt = torch.randint(0, vocab, (11,), generator=g).tolist()
    chunked = new_seq(0, prompt)
    other = new_seq(1, torch.randint(0, vocab, (5,), generator=g).tolist())
    step([(other, 5)])
    assert step([(other, 1), (chunked, 4)]).seq_ids == [1]  # partial chunk: no token
    step([(other, 1), (chunked, 4)])
    step([(chunked, 3), (other, 1)])  # last chunk samples the first output token
    for _ in range(5):
        step([(other, 1), (chunked, 1)])
    generated = chunked.output_token_ids
    assert len(generated) == 6

    for j in range(len(generated)):
        one_shot = new_seq(100 + j, prompt + generated[:j])
        out = step([(one_shot, one_shot.num_tokens)])
        assert out.sampled_token_ids == [generated[j]]
        assert logprobs_by_seq[100 + j][0] == pytest.approx(logprobs_by_seq[0][j], abs=1e-5)


@pytest.mark.parametrize("images, lora", [(False, False), (True, False), (False, True), (True, True)])
def test_step_protocol_round_trips_image_rows_and_lora_ids(images, lora):
    """What rank 0 broadcasts is what followers rebuild, with image rows and adapter ids alone or together."""
    from engine.executor.parallel import _pack, _unpack, payload_len

    cpu = torch.device("cpu")
    inputs = StepInputs(
        input_ids=torch.tensor([5, 6, 7, 8]), positions=torch.tensor([0, 1, 2, 0]), slot_mapping=torch.tensor([0, 1, 2, 16]),
        block_tables=torch.tensor([[0, -1], [1, -1]], dtype=torch.int32), query_start_loc=torch.tensor([0, 3, 4], dtype=torch.int32),
        seq_lens=torch.tensor([3, 1], dtype=torch.int32), logits_indices=torch.tensor([2, 3]),
        image_rows=torch.tensor([1, 2]) if images else None, image_embeds=torch.ones(2, 6) if images else None,
        lora_ids=torch.tensor([0, 3]) if lora else None,
    )
    header, payload = _pack(inputs, cpu)
    assert payload_len(header.tolist()) == payload.numel()
    back = _unpack(header.tolist(), payload)
    for name in ("input_ids", "positions", "slot_mapping", "block_tables", "query_start_loc", "seq_lens", "logits_indices",
                 "image_rows", "lora_ids"):
        want, got = getattr(inputs, name), getattr(back, name)
        assert (want is None and got is None) or torch.equal(want.to(torch.int64), got.to(torch.int64)), name
    assert header.tolist()[5:7] == ([2, 6] if images else [0, 0])


def every_row(inputs: StepInputs) -> bool:
    return inputs.logits_indices.tolist() == list(range(inputs.num_tokens))


@pytest.mark.parametrize("case", ["decodes", "mixed", "partial chunk", "one-token partial chunk", "last chunk", "drafts"])
def test_takes_every_row_says_whether_the_logits_rows_are_every_row_in_order(case):
    """The forward skips its gather exactly when the flag is set: it must be set only when the gather
    would be the identity (and is set for pure-decode steps, the ones it is for)."""
    batches = {
        "decodes": ScheduledBatch([make_seq(0, [1, 2, 3], 2, 2, [4]), make_seq(1, [5] * 6, 3, 5, [6, 7])], [1, 1]),
        "mixed": mixed_batch(),
        "partial chunk": ScheduledBatch([make_seq(0, list(range(10)), 10, 0, [1, 2, 3])], [8]),
        # a one-token chunk short of its prompt's end (no logits row) beside a decode: every row a decode's shape
        "one-token partial chunk": ScheduledBatch([make_seq(0, list(range(6)), 6, 3, [1, 2]), make_seq(1, [1, 2, 3], 2, 2, [4])], [1, 1]),
        "last chunk": ScheduledBatch([make_seq(0, list(range(6)), 6, 2, [1, 2])], [4]),
        "drafts": ScheduledBatch([make_seq(0, [1, 2, 3], 2, 2, [4, 5])], [1]),
    }
    batch = batches[case]
    if case == "drafts":
        batch.seqs[0].spec_token_ids = [7, 8]
    inputs, _ = build_step_inputs(batch, BLOCK_SIZE)
    assert inputs.takes_every_row == every_row(inputs)
    assert inputs.takes_every_row == (case == "decodes")
    if inputs.takes_every_row:  # replaced indices (another order, more rows) are gathered again
        assert not dataclasses.replace(inputs, logits_indices=inputs.logits_indices.flip(0)).takes_every_row


@pytest.mark.parametrize("case", ["decodes", "mixed", "one-token partial chunk", "drafts", "lora", "prompt logprobs"])
def test_decode_bounds_mark_only_pure_decode_steps_with_their_tensors_ranges(case):
    """StepInputs.decode_bounds (the CPU backend's checks without torch) is set for a pure-decode
    step alone, its ranges those of the tensors it describes; a step whose logits rows the executor
    replaces (prompt logprobs) or that has LoRA rows is not described by any."""
    executor = FakeExecutor()
    seqs = {
        "decodes": [make_seq(0, [1, 2, 3], 2, 2, [4]), make_seq(1, [5] * 6, 3, 5, [6, 7])],
        "mixed": mixed_batch().seqs,
        "one-token partial chunk": [make_seq(0, list(range(6)), 6, 3, [1, 2]), make_seq(1, [1, 2, 3], 2, 2, [4])],
        "drafts": [make_seq(0, [1, 2, 3], 2, 2, [4, 5])],
        "lora": [make_seq(0, [1, 2, 3], 2, 2, [4]), make_seq(1, [5] * 6, 3, 5, [6, 7])],
        "prompt logprobs": [make_seq(0, list(range(6)), 6, 3, [1, 2], prompt_logprobs=1), make_seq(1, [1, 2, 3], 2, 2, [4])],
    }[case]
    counts = mixed_batch().num_new_tokens if case == "mixed" else [1] * len(seqs)
    if case == "drafts":
        seqs[0].spec_token_ids = [7, 8]
    if case == "lora":
        seqs[1].lora_id = 3
    ModelExecutor(executor).execute(ScheduledBatch(seqs, counts))
    inputs = executor.calls[0]
    bounds = inputs.decode_bounds
    assert (bounds is not None and bounds.describes(inputs)) == (case == "decodes")
    if case == "decodes":
        def span(t: torch.Tensor) -> tuple[int, int]:
            return int(t.min()), int(t.max())

        assert (bounds.positions, bounds.slots, bounds.block_ids, bounds.seq_lens) == tuple(
            span(t) for t in (inputs.positions, inputs.slot_mapping, inputs.block_tables, inputs.seq_lens))


def test_prompt_logprob_rows_make_the_step_gather_its_logits_rows():
    """A pure-decode-shaped step whose one-token chunk scores a prompt token: its logits rows
    (sampling rows, then the scored rows) are every row, but out of order."""
    executor = FakeExecutor()
    chunk = make_seq(0, list(range(6)), 6, 3, [1, 2], prompt_logprobs=1)  # scores prompt token 4 from row 0
    decode = make_seq(1, [1, 2, 3], 2, 2, [4])
    ModelExecutor(executor).execute(ScheduledBatch([chunk, decode], [1, 1]))
    inputs = executor.calls[0]
    assert inputs.logits_indices.tolist() == [1, 0]
    assert not inputs.takes_every_row


def test_a_step_moved_to_another_device_still_takes_every_row():
    decodes = ScheduledBatch([make_seq(0, [1, 2, 3], 2, 2, [4]), make_seq(1, [5] * 6, 3, 5, [6, 7])], [1, 1])
    inputs, _ = build_step_inputs(decodes, BLOCK_SIZE)
    moved = inputs.to(torch.device("meta"))
    assert moved is not inputs and moved.logits_indices.device.type == "meta" and moved.takes_every_row
    mixed, _ = build_step_inputs(mixed_batch(), BLOCK_SIZE)
    assert not mixed.to(torch.device("meta")).takes_every_row
