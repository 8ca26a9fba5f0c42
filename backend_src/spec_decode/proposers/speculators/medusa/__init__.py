"""Published Medusa heads (``speculative_method=medusa``): the head (:mod:`.model`), its two published layouts
(:mod:`.config`: what a folder says, :mod:`.published`: reading it), and the proposer (:mod:`.proposer`).

Medusa (Cai et al. 2024, FasterDecoding/Medusa) puts n small heads on the target's last hidden state h_t (after the
final norm, the state whose LM head gives token t+1); head i predicts token t+2+i. Head i is L residual blocks
``x <- x + SiLU(W x + b)`` followed by a projection to the vocabulary. In this server's terms
(:class:`~.proposer.MedusaProposer`) the state that predicted the last committed token drafts the next ones: head i
drafts slot i.

Two layouts are published (:func:`~.published.load_medusa` tells them apart from ``config.json``):

* FasterDecoding's (``medusa/model/medusa_model.py``, ``medusa/train``): ``config.json`` with ``medusa_num_heads``,
  ``medusa_num_layers``, ``base_model_name_or_path``; weights ``medusa_lm_head.safetensors`` or ``medusa_lm_head.pt``,
  the ``state_dict`` of an ``nn.ModuleList`` of ``nn.Sequential(ResBlock x L, Linear(H, V, bias=False))``: names
  ``{i}.{j}.linear.weight`` / ``{i}.{j}.linear.bias`` and ``{i}.{L}.weight``. (Its heads repeat one ResBlock L times,
  so its files hold L copies of the same block; each copy is read as its own block, which is the same maths.)
  Its variants (:func:`~.published._load_faster_decoding`): a file with more heads than ``medusa_num_heads`` says
  serves them all (``FasterDecoding/medusa-vicuna-7b-v1.3``); ``version: "2"`` (``medusa/train/train_legacy.py``, TGI's
  ``MedusaHeadV2``) holds the blocks only, projected by the target's LM head; a Medusa-2 full model
  (``FasterDecoding/medusa-1.0-*``) serves the ``medusa_head.*`` weights out of its shards.
* vLLM's conversion (``vllm/model_executor/models/medusa.py``, ``vllm/transformers_utils/configs/medusa.py``):
  ``config.json`` with ``architectures: [MedusaModel]`` / ``model_type: medusa``, ``num_heads``,
  ``num_hidden_layers``, ``hidden_size``, ``vocab_size``, optional ``truncated_vocab_size`` (with a ``token_map``
  weight), ``original_lm_head``, ``medusa_fc_bias``, ``logit_scale``; names ``blocks.{i}.layers.{j}.weight`` /
  ``.bias`` and ``lm_heads.{i}.weight`` (a ``medusa_heads.`` prefix is dropped, as vLLM does).
"""

from .config import MedusaConfig, check_medusa_config, check_medusa_fit, medusa_weight_sizes
from .model import MedusaHead
from .proposer import MedusaProposer
from .published import load_medusa

__all__ = ["MedusaConfig", "MedusaHead", "MedusaProposer", "check_medusa_config", "check_medusa_fit", "load_medusa",
           "medusa_weight_sizes"]
