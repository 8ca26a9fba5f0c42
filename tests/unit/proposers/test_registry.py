"""spec_decode.proposers.registry: what the registry drives, and a new proposer added as CONTRIBUTING.md's "Adding a
proposer" section shows (its example is run here as written)."""

import re
from pathlib import Path

import numpy as np
import pytest
import torch

from spec_decode.proposers import registry
from spec_decode.scheduler.k_schedule import ConstantK, HeuristicK

CONTRIBUTING = Path(__file__).resolve().parents[3] / "CONTRIBUTING.md"


def _contributing_example() -> dict:
    """CONTRIBUTING.md's example proposer module, executed: name -> object."""
    text = CONTRIBUTING.read_text()
    section = text[text.index("## Adding a proposer"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    namespace: dict = {"__name__": "readme_example"}
    exec(compile(code, "CONTRIBUTING.md (Adding a proposer)", "exec"), namespace)  # noqa: S102 - our own docs
    return namespace


def test_methods_follow_the_registry_and_the_draft_lm_is_offered_only_with_a_model():
    """The built-in methods in their order (a proposer added later comes after them)."""
    assert registry.METHODS == ("none", *registry.PROPOSERS)
    assert registry.METHODS == ("none", "draft", "ngram", "suffix", "eagle", "eagle3", "medusa", "mlp_speculator",
                                "arctic", "hybrid")
    # offered: what draft_model serves with its parameters; the model-free ones always, the others when configured
    none = {"draft_model_path": "", "speculator_path": ""}
    assert registry.offered_methods(none) == ("none", "ngram", "suffix", "hybrid")
    assert "draft" in registry.offered_methods({**none, "draft_model_path": "default"})
    assert registry.offered_methods(none, draft_lm=True) == ("none", "draft", "ngram", "suffix", "hybrid")
    assert isinstance(registry.k_schedule("none", "heuristic", 8), ConstantK)  # plain decoding: k stays 0
    assert isinstance(registry.k_schedule("ngram", "heuristic", 8), HeuristicK)
    assert isinstance(registry.k_schedule("suffix", "constant", 8), ConstantK)


def test_each_head_of_speculator_path_is_offered_as_its_layout_s_method(tiny_heads, tmp_path):
    none = {"draft_model_path": "", "speculator_path": ""}
    everything = ",".join(str(f) for f in tiny_heads.values())
    assert registry.offered_methods({**none, "speculator_path": everything}) == tuple(
        m for m in registry.METHODS if m != "draft")
    assert registry.offered_methods({**none, "speculator_path": str(tiny_heads["eagle3"])}) == (
        "none", "ngram", "suffix", "eagle3", "hybrid")
    assert registry.offered_methods({**none, "speculator_path": f"{tmp_path / 'x'}"}) == (
        "none", "ngram", "suffix", "hybrid")  # an unreadable folder: not offered (draft_model's load says why)


def test_build_proposers_serves_each_registered_class_from_its_settings():
    served = registry.build_proposers({"draft_model_path": "", "ngram_min": "2", "ngram_max": "3",
                                       "suffix_backend": "python", "hybrid_fallback": "auto"})
    assert "draft" not in served and list(served)[:3] == ["ngram", "suffix", "hybrid"]  # "" means no draft LM
    assert (served["ngram"].min_n, served["ngram"].max_n) == (2, 3)
    assert served["hybrid"].suffix is served["suffix"] and served["hybrid"].fallback is served["ngram"]
    with pytest.raises(ValueError, match="'hybrid_fallback': 'draft' is not served here"):
        registry.build_proposers({"draft_model_path": "", "hybrid_fallback": "draft"})
    with pytest.raises(ValueError, match="config parameter 'ngram_max'"):
        registry.build_proposers({"draft_model_path": "", "ngram_min": "3", "ngram_max": "2"})


@pytest.fixture
def with_echo(monkeypatch):
    """CONTRIBUTING.md's example proposer in the registry, as its one line there would put it."""
    echo = _contributing_example()["EchoProposer"]
    monkeypatch.setattr(registry, "PROPOSERS", {**registry.PROPOSERS, echo.name: echo})
    monkeypatch.setattr(registry, "METHODS", (*registry.METHODS, echo.name))
    return echo


def test_a_new_proposer_is_served_with_its_config_parameter_and_offered_to_clients(with_echo, tiny_lm, tmp_path,
                                                                                  real_tokenizer):
    """CONTRIBUTING.md's example, registered: draft_model builds it from echo_period, a round's rows that name it go to
    one propose call, generate offers and accepts it, and greedy output through the served backends is still the
    target's own greedy output."""
    from spec_decode.generation import Generation
    from spec_decode.request import GenerationRequest
    from spec_decode.serving.draft_model import DraftBackend
    from spec_decode.serving.generate_inputs import RequestLimits, parse_request
    from spec_decode.serving.local_ensemble import LocalEnsemble
    from spec_decode.serving.target_model import TargetBackend
    from spec_decode.serving.verifier_model import VerifierBackend
    from spec_decode.settings import GenerateSettings

    assert "echo_period" in registry.config_parameters()
    methods = registry.offered_methods({"draft_model_path": "", "speculator_path": ""})
    assert methods[-1] == "echo"
    req = parse_request({"text_input": np.array([b"hi"], object), "max_tokens": np.array([24], np.int32),
                         "speculative_method": np.array([b"echo"], object)}, RequestLimits(GenerateSettings(), methods))
    assert req.speculative_method == "echo"

    tiny_lm.save_pretrained(tmp_path / "tiny")
    draft = DraftBackend({"draft_model_path": "", "suffix_backend": "python", "echo_period": "2"})
    assert draft.proposers["echo"].period == 2
    calls = []
    propose = draft.proposers["echo"].propose
    draft.proposers["echo"].propose = lambda rs: calls.append(len(rs)) or propose(rs)
    ensemble = LocalEnsemble(draft, TargetBackend({"model_path": str(tmp_path / "tiny"), "device": "cpu"}),
                             VerifierBackend({"backend": "torch", "num_threads": "0"}))
    prompts = [[5, 17, 3, 5, 17], [40, 41, 40, 41, 40, 41]]
    gens = [Generation(i + 1, p, GenerationRequest("x", 24, speculative_method="echo"), real_tokenizer, [], 256, 0)
            for i, p in enumerate(prompts)]
    while not all(g.finished for g in gens):
        live = [g for g in gens if not g.finished]
        for g, result in zip(live, ensemble.run_round([g.next_step() for g in live])):
            g.commit(result)
    ensemble.release([g.next_step() for g in gens])
    assert calls and set(calls) <= {1, 2} and 2 in calls  # one propose call per round for both sequences
    for p, g in zip(prompts, gens):
        with torch.inference_mode():
            ref = tiny_lm.generate(torch.tensor([p]), max_new_tokens=24, do_sample=False, eos_token_id=None,
                                   pad_token_id=0)[0, len(p):].tolist()
        assert g.output_ids == ref
        assert g.stats.draft_tokens > 0


def test_the_example_settings_check_their_parameter(with_echo):
    with pytest.raises(ValueError, match="config parameter 'echo_period'"):
        with_echo.Settings.from_params({"echo_period": "0"})
