"""Rounds in flight: the flags' host reads, the launch pattern of `block_in_flight` against the
rounds' own flags, and graph-mode decoding in flight against rounds one by one (GPU)."""

import pytest
import torch

from dlmc.graphs.in_flight import SLOTS, FlagReads, block_in_flight, may_queue_ahead


def test_flag_reads_give_each_queued_rounds_flags():
    done, masks = torch.zeros((), dtype=torch.bool), torch.ones((), dtype=torch.bool)
    reads = FlagReads(done, masks)
    first = reads.queue()
    done.fill_(True)
    masks.fill_(False)
    second = reads.queue()
    done.fill_(False)
    assert reads.read(first) == (False, True) and reads.read(second) == (True, False)
    slots = [reads.queue() for _ in range(SLOTS)]
    with pytest.raises(RuntimeError, match=f"more than {SLOTS} flag reads queued"):
        reads.queue()
    assert reads.read(slots[0]) == (False, False)
    reads.drop()  # the three unread slots are free again
    assert len({reads.queue() for _ in range(SLOTS)}) == SLOTS


class Block:
    """A block whose rounds set (done, masks_left) from a script; records what was queued
    while which round was unread."""

    def __init__(self, flags):
        self.flags, self.launched = flags, 0
        self.done, self.masks = torch.zeros((), dtype=torch.bool), torch.ones((), dtype=torch.bool)
        self.reads = FlagReads(self.done, self.masks)
        self.in_flight = []  # unread rounds when each round was launched

    def launch(self):
        if bool(self.done):
            raise AssertionError("a round was launched after the block ended")
        self.in_flight.append(len(self.reads.pending))
        done, masks = self.flags[self.launched]
        self.done.fill_(done)
        self.masks.fill_(masks)
        self.launched += 1


@pytest.mark.parametrize("ahead", [True, False])
def test_block_in_flight_queues_ahead_only_while_masks_are_left(ahead):
    # 4 filling rounds (masks left after rounds 1-3), then 2 post-fill rounds, the last ends it.
    flags = [(False, True)] * 3 + [(False, False), (False, False), (True, False)]
    block = Block(flags)
    n, cancelled = block_in_flight(block.reads, block.launch, block.launch, ahead)
    assert (n, cancelled, block.launched) == (6, False, 6)
    # Rounds 2-5 are each launched while the round before is unread (masks were left before
    # it, so it could not end the block); round 6 only after round 5 is read (no masks were
    # left after round 4: round 5 might have ended it).
    expected = [0, 1, 1, 1, 1, 0] if ahead else [0] * 6
    assert block.in_flight == expected
    assert not block.reads.pending


def test_block_in_flight_frees_slots_a_raising_decode_left():
    block = Block([(False, True), (False, True), (False, False), (True, False)])
    for _ in range(SLOTS):  # an earlier decode that raised with its reads unread
        block.reads.queue()
    assert block_in_flight(block.reads, block.launch, block.launch, True) == (4, False)


def test_block_in_flight_one_round_block_and_cancel():
    block = Block([(False, False), (True, False)])  # round 1 fills it, round 2 ends it
    assert block_in_flight(block.reads, block.launch, block.launch, True) == (2, False)
    block = Block([(False, True)] * 8)
    calls = []
    n, cancelled = block_in_flight(block.reads, block.launch, block.launch, True,
                                   cancel=lambda: calls.append(1) or len(calls) > 2)
    assert cancelled and n == block.launched == 3 and not block.reads.pending


def test_may_queue_ahead_needs_the_joint_rule_and_a_post_fill_round():
    assert may_queue_ahead("joint", 16) and may_queue_ahead("joint", 1)
    assert not may_queue_ahead("joint", 0) and not may_queue_ahead("threshold", 16)


@pytest.mark.gpu
@pytest.mark.parametrize(("checkpoint", "sampling"), [
    ("bf16", {}), ("nvfp4", {}),
    ("nvfp4", {"temperature": 0.8, "seed": 7}),  # whole rounds on eagerly drawn noise
    ("nvfp4", {"temperature": 0.8, "top_p": 0.9, "seed": 7}),  # captured forward + eager decision
])
def test_graph_rounds_in_flight_equal_rounds_one_by_one_on_cuda(tiny_dir, nvfp4_dir, checkpoint,
                                                                sampling):
    """Graph mode with rounds in flight gives the tokens and counts of rounds one by one,
    greedy and sampled (the same launches in the same order: the same draws)."""
    from dlmc import LLM

    model_dir = tiny_dir if checkpoint == "bf16" else nvfp4_dir
    kwargs = {"prompt_token_ids": list(range(50, 111)), "max_new_tokens": 96, **sampling}
    results = {}
    for lookahead in (False, True):
        llm = LLM(model_dir, device="cuda", dtype="bf16", mode="graph", lookahead=lookahead)
        results[lookahead] = llm.generate(**kwargs)
    assert results[True].token_ids == results[False].token_ids
    assert results[True].num_forwards == results[False].num_forwards
    assert results[True].num_forwards > results[True].blocks
