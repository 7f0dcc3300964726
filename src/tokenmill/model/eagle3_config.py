"""The configuration of an EAGLE-3 drafter checkpoint, read from its config.json (no torch here).

A published EAGLE-3 drafter (yuhuili/EAGLE3-LLaMA3.1-Instruct-8B, SpecForge's and AngelSlim's
Llama-style drafters) ships a Llama config.json with:

- `architectures`: ["LlamaForCausalLMEagle3"] (the EAGLE repo, SpecForge) or
  ["Eagle3LlamaForCausalLM"] (vLLM's class name, which some checkpoints carry);
- `num_hidden_layers`: 1 (one decoder layer, the checkpoint's `midlayer`);
- `hidden_size`, `num_attention_heads`, `num_key_value_heads`, `intermediate_size`,
  `rms_norm_eps`, `rope_theta` / `rope_scaling`, `max_position_embeddings`: the drafter's own
  layer. Its RoPE is the drafter's, not the target's: a config without `rope_theta` means
  transformers' default 10000, as vLLM and SGLang read it;
- `vocab_size`: the target's vocabulary; `draft_vocab_size`: the drafter's lm_head rows (32000
  for the Llama-3.1 drafter; absent = vocab_size, no mapping);
- optional `target_hidden_size` (the target's hidden size when it differs from the drafter's:
  fc then takes 3 x target_hidden_size);
- optional `eagle_aux_hidden_state_layer_ids` (top level, or in an `eagle_config` dict): which
  target hidden states feed fc. We read them as vLLM does: id i is the residual stream entering
  target layer i, which is transformers' `output_hidden_states[i]` (0 = the embeddings). SGLang
  reads the same key as the output of layer i (it adds 1); checkpoints that name the key differ
  in which they meant. Absent (the Llama-3.1 drafter): (2, L // 2, L - 3) for a target of L
  layers, vLLM's and SGLang's default, i.e. (2, 16, 29) for Llama-3.1-8B;
- optional `norm_before_residual` (vLLM): the layer's residual is hidden_norm(h), not h.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tokenmill.errors import UnsupportedModelError
from tokenmill.model.arch import ArchConfig

EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
NUM_AUX_HIDDEN_STATES = 3  # low, middle and high target layers, fused by fc


@dataclass(frozen=True, slots=True)
class Eagle3Config:
    # The drafter's decoder layer as a one-layer Llama (its hidden_size, heads, RoPE, eps).
    arch: ArchConfig
    draft_vocab_size: int
    target_vocab_size: int
    target_hidden_size: int
    # Target layers whose entering residual stream feeds fc, in the order fc concatenates them
    # (ascending: the order the target's layer loop meets them).
    aux_layer_ids: tuple[int, ...]
    norm_before_residual: bool = False

    @property
    def hidden_size(self) -> int:
        return self.arch.hidden_size

    @property
    def fc_input_size(self) -> int:
        return NUM_AUX_HIDDEN_STATES * self.target_hidden_size

    @staticmethod
    def from_hf_config(cfg: dict[str, Any], target: ArchConfig) -> Eagle3Config:
        """Parse a drafter's config.json for `target`; UnsupportedModelError names what does not fit."""
        architectures = cfg.get("architectures") or []
        if not architectures or architectures[0] not in EAGLE3_ARCHITECTURES:
            raise UnsupportedModelError(
                f"not an EAGLE-3 drafter checkpoint: architectures={architectures}; expected one of "
                f"{', '.join(EAGLE3_ARCHITECTURES)} (a speculators-format 'Eagle3Speculator' checkpoint "
                "is not supported)"
            )
        eagle_config = cfg.get("eagle_config") or {}
        if eagle_config.get("use_aux_hidden_state") is False:
            raise UnsupportedModelError(
                "eagle_config.use_aux_hidden_state=false (an EAGLE-1-style head without fc) is not "
                "supported; expected an EAGLE-3 drafter that fuses 3 target hidden states"
            )
        # The drafter's layer is a Llama layer: parse it as one (RoPE, head_dim, eps, bias checks).
        arch = ArchConfig.from_hf_config({**cfg, "architectures": ["LlamaForCausalLM"]})
        if arch.num_layers != 1:
            raise UnsupportedModelError(
                f"EAGLE-3 drafter with num_hidden_layers={arch.num_layers}; expected 1 (one midlayer)"
            )
        if arch.attention_bias or arch.o_proj_bias:
            raise UnsupportedModelError("an EAGLE-3 drafter with attention_bias is not supported; expected none")
        if arch.vocab_size != target.vocab_size:
            raise UnsupportedModelError(
                f"the drafter's vocab_size {arch.vocab_size} differs from the target's {target.vocab_size}; "
                "expected a drafter trained for this target"
            )
        draft_vocab = int(cfg.get("draft_vocab_size") or arch.vocab_size)
        if not 0 < draft_vocab <= arch.vocab_size:
            raise UnsupportedModelError(
                f"draft_vocab_size={draft_vocab}; expected 1 .. vocab_size ({arch.vocab_size})"
            )
        target_hidden = int(cfg.get("target_hidden_size") or arch.hidden_size)
        if target_hidden != target.hidden_size:
            raise UnsupportedModelError(
                f"the drafter expects target hidden states of width {target_hidden}; the target's "
                f"hidden_size is {target.hidden_size}"
            )
        if arch.hidden_size != target.hidden_size:
            # The drafter embeds its input tokens with the target's embedding table.
            raise UnsupportedModelError(
                f"the drafter's hidden_size {arch.hidden_size} differs from the target's "
                f"{target.hidden_size}; a drafter sharing the target's embedding needs them equal"
            )
        ids = cfg.get("eagle_aux_hidden_state_layer_ids") or eagle_config.get("eagle_aux_hidden_state_layer_ids")
        return Eagle3Config(
            arch=arch,
            draft_vocab_size=draft_vocab,
            target_vocab_size=target.vocab_size,
            target_hidden_size=target_hidden,
            aux_layer_ids=aux_layer_ids(ids, target.num_layers),
            norm_before_residual=bool(cfg.get("norm_before_residual", False)),
        )


def default_aux_layer_ids(num_target_layers: int) -> tuple[int, ...]:
    """EAGLE-3's default: the residual streams entering layers 2, L // 2 and L - 3."""
    return (2, num_target_layers // 2, num_target_layers - 3)


def aux_layer_ids(configured: list[int] | None, num_target_layers: int) -> tuple[int, ...]:
    """The checked, ascending aux layer ids: `configured` (a checkpoint's list) or the default."""
    ids = tuple(int(i) for i in configured) if configured else default_aux_layer_ids(num_target_layers)
    if len(ids) != NUM_AUX_HIDDEN_STATES:
        raise UnsupportedModelError(
            f"eagle_aux_hidden_state_layer_ids {list(ids)} names {len(ids)} layers; expected "
            f"{NUM_AUX_HIDDEN_STATES} (fc fuses 3 target hidden states)"
        )
    if len(set(ids)) != len(ids) or not all(0 <= i < num_target_layers for i in ids):
        raise UnsupportedModelError(
            f"aux hidden-state layers {list(ids)} for a target of {num_target_layers} layers; expected "
            f"{NUM_AUX_HIDDEN_STATES} distinct layer indices in 0 .. {num_target_layers - 1}"
        )
    return tuple(sorted(ids))
