"""spec_decode.generation: stop conditions inside an accepted run, streaming text, statistics, k from step to step
(real tokenizer)."""

import pytest

from spec_decode.generation import Generation
from spec_decode.protocol import StepResult
from spec_decode.request import GenerationRequest
from spec_decode.scheduler.k_schedule import HeuristicK
from spec_decode.settings import InvalidInputError
from tests.helpers import plain_stop_cut


def _gen(tok, **kw):
    req = GenerationRequest("p", kw.pop("max_tokens", 100), speculative_method="ngram", **kw)
    return Generation(1, tok("hello")["input_ids"], req, tok, [tok.eos_token_id], 2048, 0)


def _run(gen, ids, per_step=5):
    """Feed ``ids`` in steps of ``per_step`` tokens (all drafts 'accepted') until the generation finishes."""
    chunks, i = [], 0
    while not gen.finished and i < len(ids):
        chunks.append(gen.commit(StepResult(ids[i : i + per_step], per_step - 1)))
        i += per_step
    return chunks


def test_max_tokens_inside_an_accepted_run(real_tokenizer):
    ids = real_tokenizer(" one two three four five six seven eight nine ten")["input_ids"]
    gen = _gen(real_tokenizer, max_tokens=7)
    chunks = _run(gen, ids)
    assert gen.output_ids == ids[:7] and sum(len(c.token_ids) for c in chunks) == 7
    assert gen.finish_reason == "length" and chunks[-1].finished
    assert gen.stats.emitted_tokens == 7 and gen.stats.accepted_tokens == 4 + 2  # step 2 keeps 2 of its 4 accepted


def test_end_id_inside_an_accepted_run_is_not_emitted(real_tokenizer):
    ids = real_tokenizer(" alpha beta gamma delta epsilon zeta eta theta")["input_ids"]
    gen = _gen(real_tokenizer, end_id=ids[6])
    chunks = _run(gen, ids)
    assert gen.output_ids == ids[:6] and gen.finish_reason == "stop"
    assert "".join(c.text for c in chunks) == real_tokenizer.decode(ids[:6])


def test_eos_stops_unless_ignore_eos(real_tokenizer):
    ids = real_tokenizer(" alpha beta gamma delta")["input_ids"]
    ids = ids[:2] + [real_tokenizer.eos_token_id] + ids[2:]
    gen = _gen(real_tokenizer)
    _run(gen, ids)
    assert gen.output_ids == ids[:2] and gen.finish_reason == "stop"
    gen = _gen(real_tokenizer, ignore_eos=True, max_tokens=len(ids))
    _run(gen, ids)
    assert gen.output_ids == ids and gen.finish_reason == "length"


def test_stop_word_cuts_text_and_nothing_after_is_sent(real_tokenizer):
    text = " red green blue STOP yellow purple"
    ids = real_tokenizer(text)["input_ids"]
    gen = _gen(real_tokenizer, stop_words=[" STOP"])
    chunks = _run(gen, ids, per_step=4)
    out = "".join(c.text for c in chunks)
    assert out == " red green blue" and gen.finish_reason == "stop"
    assert "yellow" not in real_tokenizer.decode(gen.output_ids)


def test_stop_word_prefix_is_held_back_until_resolved(real_tokenizer):
    ids = real_tokenizer(" a\n b\n\n c")["input_ids"]
    gen = _gen(real_tokenizer, stop_words=["\n\n"])
    chunks = _run(gen, ids, per_step=1)
    assert "".join(c.text for c in chunks) == " a\n b"
    assert all("\n\n" not in c.text for c in chunks)


def test_utf8_never_broken_across_chunks(real_tokenizer):
    text = " caf\u00e9 \U0001F600\U0001F680 na\u00efve \u4f60\u597d"
    ids = real_tokenizer(text)["input_ids"]
    gen = _gen(real_tokenizer)
    chunks = _run(gen, ids, per_step=1)
    assert all("\ufffd" not in c.text for c in chunks)
    assert "".join(c.text for c in chunks) == real_tokenizer.decode(ids)


def test_prompt_too_long_raises(real_tokenizer):
    req = GenerationRequest("p", 4)
    with pytest.raises(InvalidInputError, match="max_model_len") as e:
        Generation(1, list(range(10)), req, real_tokenizer, [], 10, 0)
    assert e.value.field == "text_input"


def test_next_step_clamps_k_to_max_model_len_not_max_tokens(real_tokenizer):
    req = GenerationRequest("p", 3, num_draft_tokens=8, speculative_method="draft")
    gen = Generation(1, [1, 2], req, real_tokenizer, [], 2048, 0)
    assert gen.next_step().num_draft_tokens == 8  # max_tokens trims afterwards; the steps do not depend on it
    assert Generation(1, [1, 2], req, real_tokenizer, [], 6, 0).next_step().num_draft_tokens == 3
    req = GenerationRequest("p", 3, num_draft_tokens=8, speculative_method="none")
    assert Generation(1, [1, 2], req, real_tokenizer, [], 2048, 0).next_step().num_draft_tokens == 0


def test_heuristic_k_schedule_follows_acceptance(real_tokenizer):
    """transformers' "heuristic" schedule: +2 after a fully accepted step (bounded), -1 after a rejection (>= 1);
    steps that drafted fewer than k tokens leave k alone; the constant schedule never changes k."""
    prompt = real_tokenizer("hello")["input_ids"]
    req = GenerationRequest("p", 100, speculative_method="ngram", num_draft_tokens=4)
    gen = Generation(1, prompt, req, real_tokenizer, [], 2048, 0, HeuristicK(8))
    ks = []
    for accepted, drafted in [(4, 4), (6, 6), (8, 8), (2, 8), (0, 7), (0, 0), (1, 2)]:
        k = gen.next_step().num_draft_tokens
        ks.append(k)
        assert drafted <= k
        gen.commit(StepResult([100 + j for j in range(accepted + 1)], drafted))
    assert ks == [4, 6, 8, 8, 7, 6, 6]
    assert gen.next_step().num_draft_tokens == 6  # the last step drafted 2 < 6: unchanged
    const = Generation(2, prompt, req, real_tokenizer, [], 2048, 0)
    const.commit(StepResult([1, 2, 3, 4, 5], 4))
    assert const.next_step().num_draft_tokens == 4


def _stream(gen, ids, sizes, lps):
    """Feed ``ids`` (with log-probs ``lps``) in steps of the given sizes (cycled) until the generation finishes;
    returns (streamed text, streamed ids, streamed log-probs)."""
    text, out, out_lps, i, s = "", [], [], 0, 0
    while not gen.finished and i < len(ids):
        n = sizes[s % len(sizes)]
        c = gen.commit(StepResult(ids[i : i + n], n - 1, log_probs=lps[i : i + n]))
        text, out, out_lps = text + c.text, out + c.token_ids, out_lps + c.log_probs
        i, s = i + n, s + 1
    return text, out, out_lps


@pytest.mark.parametrize("seed", range(40))
def test_stop_word_cut_is_the_same_for_every_step_split(real_tokenizer, seed):
    """Issue 41 (vLLM #21987): a random token stream over a few words (a stop word among them, often repeated, and
    an emoji split over tokens) with random stop words and min_tokens: the stream fed in steps of 1, of k, and of
    random sizes gives the same text, ids, log-probs and finish reason, and they are the plain decoder's cut (the
    first occurrence completed at or after the min_tokens-th token; none completed earlier)."""
    import random

    rng = random.Random(seed)
    tok = real_tokenizer
    pieces = [" fig", ",", " fig,", " apple", "fig", "\n\n", " \U0001F600", " st", "op", " stop", " f", "ig"]
    ids = [t for _ in range(40) for t in tok(rng.choice(pieces), add_special_tokens=False)["input_ids"]]
    lps = [-0.01 * (j + 1) for j in range(len(ids))]
    stop_words = rng.sample([" fig", "fig,", ", f", " stop", "\n\n", "\U0001F600", "ig ap"], rng.randint(1, 3))
    min_tokens = rng.choice([0, 1, 4, 6, 9, 15])
    prompt = tok("hello")["input_ids"]

    def run(sizes):
        req = GenerationRequest("p", 1000, speculative_method="ngram", stop_words=stop_words, min_tokens=min_tokens,
                                return_log_probs=True)
        gen = Generation(1, prompt, req, tok, [tok.eos_token_id], 4096, 0)
        text, out, out_lps = _stream(gen, ids, sizes, lps)
        return text, out, out_lps, gen.finish_reason

    ones = run([1])
    for sizes in ([4], [8], [rng.randint(1, 9) for _ in range(30)]):
        assert run(sizes) == ones, (sizes, stop_words, min_tokens)
    ref = plain_stop_cut(tok, prompt, ids, stop_words, min_tokens)
    text, out, out_lps, reason = ones
    if ref is None:
        assert out == ids and reason is None
    else:
        n, cut = ref
        assert (text, out, reason) == (cut, ids[:n], "stop")
        assert out_lps == lps[:n]
        assert n >= min_tokens


def test_stop_word_completed_before_min_tokens_is_not_a_stop(real_tokenizer):
    """The bug report's case: "fig, fig, fig, ..." with stop word "fig" and min_tokens 4: occurrences completed
    before the 4th token are kept in the text; the first one completed at or after it ends the request, text cut
    before it (not an earlier one, so no "fig" is left at the end of the text)."""
    tok = real_tokenizer
    ids = tok("fig, fig, fig, fig, fig, fig, fig", add_special_tokens=False)["input_ids"]
    for k in (1, 4, 8):
        for min_tokens in (4, 6, 9):
            req = GenerationRequest("p", 100, speculative_method="ngram", stop_words=["fig"], min_tokens=min_tokens)
            gen = Generation(1, tok("hello")["input_ids"], req, tok, [], 2048, 0)
            text, out, _ = _stream(gen, ids, [k], [0.0] * len(ids))
            n = len(out)
            assert n >= min_tokens and gen.finish_reason == "stop"
            assert tok.decode(ids[:n]).endswith("fig") and not tok.decode(ids[: n - 1]).endswith("fig")
            assert text == tok.decode(ids[:n])[: -len("fig")] and not text.endswith("fig")
