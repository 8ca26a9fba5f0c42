"""spec_decode.engine.model_loading: where the served models come from; spec_decode.engine.draft_vocab: a pruned
vocabulary."""

import pytest
import torch

from spec_decode.engine.draft_vocab import DraftVocab, load_draft_vocab
from spec_decode.settings import InvalidInputError


def test_auto_draft_path_is_the_distilled_draft_only_when_built(tmp_path, monkeypatch):
    from spec_decode.proposers.draft_lm import default_draft_dir, resolve_draft_path

    monkeypatch.setenv("SPEC_DECODE_CACHE", str(tmp_path))
    assert resolve_draft_path("auto") is None  # not built: the server serves model-free proposers
    d = default_draft_dir()
    d.mkdir(parents=True)
    (d / "config.json").write_text("{}")
    assert resolve_draft_path("auto") is None  # unfinished (no train_draft.json report)
    (d / "train_draft.json").write_text("{}")
    assert resolve_draft_path("auto") == d
    assert resolve_draft_path("") is None
    with pytest.raises(FileNotFoundError):
        resolve_draft_path(str(tmp_path / "missing"))


def test_a_pruned_vocabulary_maps_ids_round_trips_and_refuses_ids_outside_the_target(tmp_path):
    vocab = DraftVocab([7, 3, 9], target_vocab_size=12)
    assert len(vocab) == 3 and vocab.unk_index == 3
    assert vocab.map_ids([3, 9, 5, 7]) == [1, 2, 3, 0]  # 5 is not kept: the "outside the set" row
    with pytest.raises(InvalidInputError, match=r"'token_ids': token ids must lie in \[0, 12\)"):
        vocab.map_ids([3, 12])
    with pytest.raises(InvalidInputError, match="token ids"):
        vocab.map_ids([-1])
    vocab.save(tmp_path)
    again = load_draft_vocab(tmp_path)
    assert torch.equal(again.token_ids, vocab.token_ids) and again.target_vocab_size == 12
    assert load_draft_vocab(tmp_path / "none") is None
    with pytest.raises(ValueError, match="distinct"):
        DraftVocab([1, 1], 4)
