"""spec_decode.processors.core: every processor applied at each draft position over exactly that position's prefix
(the row of a k+1-position step equals the one-position result for prompt + output + drafts[:j]), the formulas
against a direct reference, and the spec's wire form and range checks."""

import math

import pytest
import torch

from spec_decode.processors import ProcessorSpec, parse_spec, process_logits, step_logprobs, token_logprobs
from spec_decode.settings import InvalidInputError

V = 40


def _reference(logits: torch.Tensor, spec: ProcessorSpec, ids: list[int]) -> torch.Tensor:
    """One position's processed logits, token by token (vLLM's formulas written out)."""
    out = logits.float().clone()
    prompt, output = ids[:spec.prompt_len], ids[spec.prompt_len:]
    for t in range(V):
        c = output.count(t)
        if t in prompt or c:
            r = spec.repetition_penalty
            out[t] = out[t] / r if out[t] > 0 else out[t] * r
        out[t] -= spec.frequency_penalty * c + spec.presence_penalty * (c > 0)
    if len(output) < spec.min_tokens:
        for t in spec.stop_ids:
            out[t] = -math.inf
    for w in spec.bad_words:
        if len(w) == 1 or tuple(output[len(output) - len(w) + 1:]) == w[:-1] and len(output) >= len(w) - 1:
            out[w[-1]] = -math.inf
    return out


SPECS = [
    ProcessorSpec(4, repetition_penalty=1.7),
    ProcessorSpec(4, presence_penalty=0.8, frequency_penalty=-0.6),
    ProcessorSpec(4, min_tokens=6, stop_ids=(0, 3)),
    ProcessorSpec(4, bad_words=((7,), (5, 9), (11, 12, 13))),
    ProcessorSpec(4, repetition_penalty=0.6, presence_penalty=1.2, frequency_penalty=0.4, min_tokens=5,
                  stop_ids=(0,), bad_words=((12, 13), (2,))),
]


@pytest.mark.parametrize("spec", SPECS)
def test_each_draft_position_is_processed_over_its_own_prefix(spec):
    g = torch.Generator().manual_seed(0)
    ids = [1, 5, 12, 8, 12, 11, 12]  # prompt of 4, output of 3 (ends in 11, 12: a bad word's prefix)
    drafts = [13, 5, 9, 12]
    logits = torch.randn(len(drafts) + 1, V, generator=g) * 3
    rows = process_logits(logits, spec, ids, drafts)
    for j in range(len(drafts) + 1):
        alone = process_logits(logits[j:j + 1], spec, ids + drafts[:j])[0]
        torch.testing.assert_close(rows[j], alone)
        torch.testing.assert_close(rows[j], _reference(logits[j], spec, ids + drafts[:j]))


def test_min_tokens_forbids_the_end_ids_exactly_until_its_index():
    spec = ProcessorSpec(2, min_tokens=3, stop_ids=(0, 1))
    logits = torch.zeros(5, 6)
    rows = process_logits(logits, spec, [4, 5, 2], [3, 3, 3, 3])  # output so far 1, then 2, 3, 4, 5 at rows 0..4
    forbidden = [bool(torch.isinf(r[0])) and bool(torch.isinf(r[1])) for r in rows]
    assert forbidden == [True, True, False, False, False]  # EOS allowed at output index 3 (the 4th token) on


def test_a_bad_word_whose_prefix_ends_in_a_draft_is_forbidden_after_it():
    spec = ProcessorSpec(1, bad_words=((5, 6),))
    rows = process_logits(torch.zeros(3, 8), spec, [2], [5, 4])
    assert torch.isinf(rows[1, 6]) and not torch.isinf(rows[0, 6]) and not torch.isinf(rows[2, 6])


def test_a_pruned_vocabulary_gets_the_processing_of_its_target_ids():
    spec = SPECS[-1]
    g = torch.Generator().manual_seed(1)
    ids, drafts = [1, 5, 12, 8, 12, 2], [0, 13]
    full = torch.randn(3, V, generator=g)
    cols = torch.tensor([13, 2, 12, 0, 30, 5])
    want = process_logits(full, spec, ids, drafts)[:, cols]
    torch.testing.assert_close(process_logits(full[:, cols], spec, ids, drafts, column_ids=cols), want)


def test_a_row_every_processor_forbids_keeps_its_end_ids():
    spec = ProcessorSpec(1, min_tokens=5, stop_ids=(2,), bad_words=((0,), (1,), (3,)))
    out = process_logits(torch.zeros(1, 4), spec, [1])
    assert torch.isfinite(out[0, 2]) and torch.isinf(out[0, [0, 1, 3]]).all()


def test_no_processor_leaves_the_logits_untouched():
    logits = torch.randn(2, 5)
    assert process_logits(logits, ProcessorSpec(1, top_logprobs=3, logprobs=True), [1], [2]) is logits


def test_the_spec_travels_as_json_and_is_checked():
    spec = SPECS[-1]
    assert parse_spec(spec.wire_text) == spec and parse_spec("") is None
    with pytest.raises(InvalidInputError, match="logits_processors"):
        ProcessorSpec.from_json('{"prompt_len": 1, "bogus": 2}')
    with pytest.raises(InvalidInputError, match="logits_processors"):
        ProcessorSpec.from_json("[1")


@pytest.mark.parametrize("field, value", [("repetition_penalty", 0.0), ("repetition_penalty", -1.0),
                                          ("presence_penalty", 2.5), ("frequency_penalty", -3.0),
                                          ("min_tokens", -1), ("top_logprobs", 21), ("prompt_logprobs", 21),
                                          ("repetition_penalty", float("nan"))])
def test_values_out_of_range_are_refused_naming_the_field(field, value):
    with pytest.raises(InvalidInputError, match=field):
        ProcessorSpec(1, **{field: value})


def test_token_logprobs_gives_ranks_and_sorted_alternatives():
    g = torch.Generator().manual_seed(2)
    rows = torch.log_softmax(torch.randn(3, 10, generator=g), -1)
    ids = [int(rows[0].argmax()), int(rows[1].argsort(descending=True)[3]), 0]
    out = token_logprobs(rows, ids, 4)
    assert out.ranks[:2] == [1, 4]
    assert out.ranks[2] == 1 + int((rows[2] > rows[2, 0]).sum())
    for j in range(3):
        assert out.top_log_probs[j] == sorted(out.top_log_probs[j], reverse=True)
        assert out.top_ids[j][0] == int(rows[j].argmax())
        assert math.isclose(out.log_probs[j], float(rows[j, ids[j]]), rel_tol=1e-6)
    probs = torch.softmax(torch.randn(2, 10, generator=g), -1)
    proc = step_logprobs(probs, None, [1], 2)  # processed mode: the log of the sampled distribution
    assert math.isclose(proc.log_probs[0], math.log(float(probs[0, 1])), rel_tol=1e-5)
