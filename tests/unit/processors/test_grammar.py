"""spec_decode.processors.grammar on the embedded model's tokenizer: guide checks naming the field, masks that walk to
valid documents, rows at every draft position equal to the one-position rows of the same prefix, resync after a
rollback, an eviction or a rollback past the bound, refused drafts and stop ids ending the walk, and regex masks that
allow only matching strings."""

import json
import re

import pytest
import torch

from spec_decode.engine.model_loading import load_tokenizer, resolve_model_path
from spec_decode.processors.grammar import MAX_GUIDE_CHARS, GrammarCache, check_guide
from spec_decode.settings import InvalidInputError

V = 49152
PAD = 64  # the small cache's logits are wider than the tokenizer (padded vocabulary)
EOS = 2  # <|im_end|>, the tokenizer's EOS
OTHER_STOP = 0  # <|endoftext|>: a second end id of the request
SCHEMA = json.dumps({
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 5}, "age": {"type": "integer"},
                   "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2}},
    "required": ["name", "age"],
    "additionalProperties": False,
})
DOC = '{"name": "Ada", "age": 36, "tags": ["ml", "cs"]}'
EMAIL = r"[a-z]+@[a-z]+\.com"
# every prefix of a string the regex can still complete
EMAIL_PREFIX = re.compile(r"(?:[a-z]+(?:@(?:[a-z]+(?:\.(?:c(?:om?)?)?)?)?)?)?")


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(resolve_model_path("default"))


@pytest.fixture(scope="module")
def cache(tok):
    return GrammarCache(tok, V)


@pytest.fixture(scope="module")
def small(tok):
    """One matcher, rollback of at most 2 tokens, V + PAD logits columns."""
    return GrammarCache(tok, V + PAD, max_sequences=1, max_rollback=2)


@pytest.fixture(scope="module")
def doc_ids(tok):
    return tok.encode(DOC, add_special_tokens=False)


_next_seq = iter(range(1000, 10**6))


def fresh(cache, guide_type, guide, output, drafts=(), stops=(EOS,)):
    """Rows from a sequence id never seen before (a fresh matcher)."""
    return cache.masks(next(_next_seq), guide_type, guide, list(output), list(drafts), stops)


def _valid(doc) -> bool:
    """SCHEMA's rules written out."""
    if not isinstance(doc, dict) or not {"name", "age"} <= set(doc) <= {"name", "age", "tags"}:
        return False
    tags = doc.get("tags", [])
    return (isinstance(doc["name"], str) and len(doc["name"]) <= 5 and type(doc["age"]) is int
            and isinstance(tags, list) and len(tags) <= 2 and all(isinstance(t, str) and len(t) <= 3 for t in tags))


@pytest.mark.parametrize("guide_type, guide, field, words", [
    ("xml", "{}", "guided_decoding_guide_type", "is not one of json, json_schema, regex, ebnf_grammar"),
    ("JSON", "", "guided_decoding_guide_type", "is not one of"),
    ("json_schema", "{bad", "guided_decoding_guide", "not valid JSON"),
    ("json_schema", "", "guided_decoding_guide", "must not be empty for json_schema"),
    ("json_schema", "  ", "guided_decoding_guide", "must not be empty for json_schema"),
    ("json_schema", "[1, 2]", "guided_decoding_guide", "must be a JSON object"),
    ("json_schema", '{"type": "foo"}', "guided_decoding_guide", "foo"),
    ("json", "{bad", "guided_decoding_guide", "not valid JSON"),
    ("regex", "[a-z", "guided_decoding_guide", "unclosed character class"),
    ("regex", "(?=a)b", "guided_decoding_guide", "look-around"),
    ("regex", "", "guided_decoding_guide", "must not be empty for regex"),
    ("ebnf_grammar", "", "guided_decoding_guide", "must not be empty for ebnf_grammar"),
    ("ebnf_grammar", "start: missing_rule", "guided_decoding_guide", "missing_rule"),
    ("json", "x" * (MAX_GUIDE_CHARS + 1), "guided_decoding_guide", f"at most {MAX_GUIDE_CHARS} characters"),
])
def test_check_guide_refuses_naming_the_field(guide_type, guide, field, words):
    with pytest.raises(InvalidInputError) as e:
        check_guide(guide_type, guide)
    assert e.value.field == field
    assert words in e.value.detail
    assert "<state>" not in e.value.detail and "\n" not in e.value.detail and len(e.value.detail) <= 200


@pytest.mark.parametrize("guide_type, guide", [
    ("json", ""), ("json", SCHEMA), ("json_schema", SCHEMA), ("json_schema", "{}"), ("regex", EMAIL),
    ("ebnf_grammar", 'root ::= "yes" | "no"'), ("ebnf_grammar", 'start: "yes" | "no"'),
])
def test_check_guide_accepts(guide_type, guide):
    check_guide(guide_type, guide)


def test_masks_refuses_a_bad_guide_and_refused_output(cache, tok):
    with pytest.raises(InvalidInputError) as e:
        cache.masks(1, "regex", "[a-z", [], [], (EOS,))
    assert e.value.field == "guided_decoding_guide"
    with pytest.raises(ValueError, match="refused"):
        cache.masks(1, "json_schema", SCHEMA, tok.encode("[1]", add_special_tokens=False), [], (EOS,))
    assert 1 not in iter(cache._seqs)  # a refused sequence keeps no matcher


def test_greedy_lowest_id_walk_yields_a_valid_document(cache, tok):
    out: list[int] = []
    for _ in range(200):
        row = cache.masks(7, "json_schema", SCHEMA, out, [], (EOS,))[0]
        t = int(torch.nonzero(row)[0, 0])
        if t == EOS:
            break
        out.append(t)
    else:
        pytest.fail("the walk did not end")
    text = tok.decode(out)
    assert _valid(json.loads(text)), text


def test_scripted_document_is_allowed_and_ends_only_at_its_end(cache, doc_ids):
    rows = cache.masks(8, "json_schema", SCHEMA, [], doc_ids, (EOS, OTHER_STOP))
    assert rows.shape == (len(doc_ids) + 1, V) and rows.dtype == torch.bool
    for j, t in enumerate(doc_ids):
        assert rows[j, t], j
        assert not rows[j, EOS] and not rows[j, OTHER_STOP], j
    assert torch.nonzero(rows[-1])[:, 0].tolist() == [OTHER_STOP, EOS]  # closed: only the stop ids


def test_any_json_object(cache, tok, doc_ids):
    rows = fresh(cache, "json", "", [], doc_ids)
    assert all(bool(rows[j, t]) for j, t in enumerate(doc_ids))
    assert not rows[0, tok.convert_tokens_to_ids("1")] and rows[0, tok.convert_tokens_to_ids("{")]


def test_each_draft_row_equals_the_row_of_its_own_prefix(cache, doc_ids):
    bad = doc_ids[0]  # '{"': refused inside the document, except in a string (then the next draft may be)
    refusals = 0
    for n in (0, 3, 9, len(doc_ids) - 4):
        for drafts in (doc_ids[n:n + 4], doc_ids[n:n + 1] + [bad] + doc_ids[n + 2:n + 4]):
            rows = cache.masks(9, "json_schema", SCHEMA, doc_ids[:n], drafts, (EOS,))
            walk = doc_ids[:n] + drafts
            refused = next((j for j, t in enumerate(drafts) if not rows[j, t]), None)
            for j in range(len(drafts) + 1):
                if refused is not None and j > refused:  # after a refused draft: copies of its row
                    assert torch.equal(rows[j], rows[refused])
                else:
                    assert torch.equal(rows[j], fresh(cache, "json_schema", SCHEMA, walk[:n + j])[0]), (n, j)
            refusals += refused is not None
    assert refusals >= 3  # the bad draft (or a document token after it) was refused at most splits


def test_refused_draft_ends_the_walk(cache, tok, doc_ids):
    bad = tok.convert_tokens_to_ids("}")  # inside a key: only "name", "age" or "tags" may follow '{"name": "Ada", "'
    drafts = [doc_ids[8], bad, doc_ids[9], doc_ids[10]]
    rows = cache.masks(10, "json_schema", SCHEMA, doc_ids[:8], drafts, (EOS,))
    assert rows[0, drafts[0]] and not rows[1, bad]
    assert torch.equal(rows[2], rows[1]) and torch.equal(rows[3], rows[1]) and torch.equal(rows[4], rows[1])
    assert torch.equal(rows[:2], fresh(cache, "json_schema", SCHEMA, doc_ids[:8], drafts[:1]))
    again = cache.masks(10, "json_schema", SCHEMA, doc_ids[:9], doc_ids[9:12], (EOS,))  # the next step resyncs
    assert torch.equal(again, fresh(cache, "json_schema", SCHEMA, doc_ids[:9], doc_ids[9:12]))


def test_rollback_to_a_shorter_output_gives_fresh_rows(cache, doc_ids):
    cache.masks(11, "json_schema", SCHEMA, doc_ids[:12], doc_ids[12:16], (EOS,))
    for n in (7, 10, 0):
        rows = cache.masks(11, "json_schema", SCHEMA, doc_ids[:n], doc_ids[n:n + 3], (EOS,))
        assert torch.equal(rows, fresh(cache, "json_schema", SCHEMA, doc_ids[:n], doc_ids[n:n + 3])), n


def test_stop_ids_allowed_exactly_where_the_grammar_can_end(cache, tok):
    a, b, c = tok.convert_tokens_to_ids(["a", "b", "c"])
    stops = (OTHER_STOP,)  # the tokenizer's EOS is not an end id of this request: never allowed
    rows = cache.masks(12, "regex", "a(bc)?", [], [a, b, c], stops)
    assert [bool(r[OTHER_STOP]) for r in rows] == [False, True, False, True]
    assert not rows[:, EOS].any()
    assert rows[0, a] and not rows[0, b] and rows[1, b] and rows[2, c]
    assert torch.nonzero(rows[3])[:, 0].tolist() == [OTHER_STOP]  # matched whole: only the stop ids
    # a stop id in the drafts or the output ends the walk: the rows after it copy the row before it
    rows = cache.masks(12, "regex", "a(bc)?", [], [a, OTHER_STOP, b], stops)
    assert torch.equal(rows[2], rows[1]) and torch.equal(rows[3], rows[1])
    rows = cache.masks(12, "regex", "a(bc)?", [a, OTHER_STOP], [b], stops)
    assert torch.equal(rows[0], fresh(cache, "regex", "a(bc)?", [a], stops=stops)[0])
    assert torch.equal(rows[1], rows[0])


def test_a_finished_grammar_without_stop_ids_still_allows_a_token(cache, tok):
    a = tok.convert_tokens_to_ids("a")
    row = cache.masks(13, "regex", "a", [a], [], ())[0]
    assert torch.nonzero(row)[:, 0].tolist() == [EOS]


def test_eviction_and_rollback_past_the_bound_rebuild_identical_rows(cache, small, doc_ids):
    def same(rows, n, drafts):
        ref = fresh(cache, "json_schema", SCHEMA, doc_ids[:n], drafts)
        assert rows.shape == (len(drafts) + 1, V + PAD)
        assert torch.equal(rows[:, :V], ref) and not rows[:, V:].any()  # padded ids are never allowed

    same(small.masks(1, "json_schema", SCHEMA, doc_ids[:6], doc_ids[6:9], (EOS,)), 6, doc_ids[6:9])
    small.masks(2, "regex", EMAIL, [], [], (EOS,))  # evicts sequence 1
    assert len(small) == 1 and 1 not in iter(small._seqs)
    same(small.masks(1, "json_schema", SCHEMA, doc_ids[:8], doc_ids[8:10], (EOS,)), 8, doc_ids[8:10])
    same(small.masks(1, "json_schema", SCHEMA, doc_ids[:3], doc_ids[3:5], (EOS,)), 3, doc_ids[3:5])  # 7 back > 2
    same(small.masks(1, "json_schema", SCHEMA, doc_ids[:4], doc_ids[4:6], (EOS,)), 4, doc_ids[4:6])  # 1 back
    small.release(1)
    assert len(small) == 0


def test_regex_masks_allow_only_strings_that_match(cache, tok):
    text = "abc@xyz.com"
    ids = tok.encode(text, add_special_tokens=False)
    rows = cache.masks(14, "regex", EMAIL, [], ids, (EOS,))
    decoded: dict[int, str] = {}
    prefix = ""
    for j, row in enumerate(rows):
        allowed = torch.nonzero(row)[:, 0].tolist()
        assert (EOS in allowed) == bool(re.fullmatch(EMAIL, prefix)), prefix
        for t in allowed:
            if t != EOS:
                s = decoded.setdefault(t, tok.decode([t]))
                assert EMAIL_PREFIX.fullmatch(prefix + s), (prefix, s)
        if j < len(ids):
            assert ids[j] in allowed
            prefix += tok.decode([ids[j]])
    assert prefix == text
    assert rows[0, tok.convert_tokens_to_ids("a")] and not rows[0, tok.convert_tokens_to_ids("@")]
