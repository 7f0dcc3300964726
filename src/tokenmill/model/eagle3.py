"""The EAGLE-3 drafter: one Llama-style decoder layer that reads the target's hidden states.

Checkpoint layout (the published Llama-3.1-8B drafter, yuhuili/EAGLE3-LLaMA3.1-Instruct-8B, as the
EAGLE repo's eagle/model/cnets.py saves it and vLLM's / SGLang's llama_eagle3.py load it; sizes for
that drafter: H = 4096, heads 32 x 128, KV heads 8, I = 14336, V = 128256, Vd = 32000):

| tensor                                      | shape              | what                          |
| fc.weight                                   | [H, 3 * Ht]        | fuses 3 target hidden states  |
| midlayer.hidden_norm.weight                 | [H]                | RMSNorm of the hidden input   |
| midlayer.input_layernorm.weight             | [H]                | RMSNorm of the token embedding|
| midlayer.self_attn.q_proj.weight            | [heads * hd, 2H]   | q/k/v read [embedding, hidden]|
| midlayer.self_attn.k_proj.weight            | [kv_heads * hd, 2H]|                               |
| midlayer.self_attn.v_proj.weight            | [kv_heads * hd, 2H]|                               |
| midlayer.self_attn.o_proj.weight            | [H, heads * hd]    |                               |
| midlayer.post_attention_layernorm.weight    | [H]                |                               |
| midlayer.mlp.{gate,up}_proj.weight          | [I, H]             | SwiGLU                        |
| midlayer.mlp.down_proj.weight               | [H, I]             |                               |
| norm.weight                                 | [H]                | final RMSNorm before lm_head  |
| lm_head.weight                              | [Vd, H]            | logits over the draft vocab   |
| d2t                                         | [Vd] int64         | target id = draft id + d2t[id]|
| t2d                                         | [V] bool           | target ids in the draft vocab |

Ht = target_hidden_size (= H for the Llama drafters). `embed_tokens.weight` [V, H] is usually
absent: the drafter embeds with the target's table (passed in). When a checkpoint carries one it
must equal the target's (anything else is refused, naming it). `midlayer.self_attn.rotary_emb.inv_freq`
(older saves) is ignored: RoPE comes from the drafter's config (model/eagle3_config.py).

The math of one step, for T tokens (row t: token x_t at position p_t, hidden input h_t):

    h      = fc(h_t) when h_t is [T, 3 Ht] (the target's fused features), else h_t ([T, H]: the
             drafter's own previous hidden_out, for draft steps 2..k)
    a      = cat(input_layernorm(embed(x_t)), hidden_norm(h))       [T, 2H], embedding first
    r      = h (or hidden_norm(h) with norm_before_residual)
    r      = r + o_proj(attention(q/k/v(a), RoPE at p_t, paged KV cache))
    out    = r + mlp(post_attention_layernorm(r))                  hidden_out, pre-norm
    logits = lm_head(norm(out))                                    [T, Vd]

hidden_out (pre-norm) is what the next draft step takes as its hidden input; the final norm is
only for the logits. Greedy drafts take argmax over the draft vocab, then map it to a target id.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.attention.backend import AttentionBackend, AttentionMetadata
from tokenmill.config import KernelConfig
from tokenmill.model.eagle3_config import Eagle3Config
from tokenmill.model.layers.attention import SelfAttention
from tokenmill.model.layers.layer_ops import select_layer_ops
from tokenmill.model.layers.linear import ReplicatedLinear, process_weights_after_loading
from tokenmill.model.layers.linear_method import LinearMethod
from tokenmill.model.layers.linear_select import select_linear_method
from tokenmill.model.layers.mlp import SwiGLUMLP
from tokenmill.model.layers.rmsnorm import RMSNorm
from tokenmill.model.layers.rotary import RotaryEmbedding
from tokenmill.model.llama import CausalLM
from tokenmill.model.loader.hf_config import read_hf_config, safetensors_files
from tokenmill.model.loader.pt_loader import iter_pt_weights
from tokenmill.model.loader.safetensors_loader import iter_safetensors_weights


class Eagle3StepOutput(NamedTuple):
    hidden_out: torch.Tensor  # [T, H] pre-norm: the next draft step's hidden input
    normed: torch.Tensor  # [T, H] norm(hidden_out): what compute_draft_logits takes


class Eagle3Drafter(nn.Module):
    def __init__(
        self,
        config: Eagle3Config,
        embed_tokens: torch.Tensor,  # the target's [V, H] embedding table, shared (not copied)
        attn_backend: AttentionBackend,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        max_positions: int | None = None,
        linear_method: LinearMethod | None = None,
    ) -> None:
        """Parameters are allocated uninitialized; call load_weights next (load_eagle3_drafter does).
        `max_positions` bounds the RoPE table: the target's max_model_len (the drafter runs at the
        target's positions, whatever its own max_position_embeddings says)."""
        super().__init__()
        dtype = dtype or torch.float32
        arch = config.arch
        H = arch.hidden_size
        if tuple(embed_tokens.shape) != (config.target_vocab_size, H):
            raise ValueError(
                f"the shared embedding table is {tuple(embed_tokens.shape)}; expected "
                f"({config.target_vocab_size}, {H}) (the target's vocab x the drafter's hidden size)"
            )
        self.config = config
        self.arch = arch
        self.attn_backend = attn_backend
        self.ops = select_layer_ops(device or "cpu")
        self.eps = arch.rms_norm_eps
        place = {"device": device, "dtype": dtype}
        # A plain attribute, not a registered parameter: the target owns it (and its state_dict).
        object.__setattr__(self, "embed_tokens", embed_tokens)
        self.fc = ReplicatedLinear(config.fc_input_size, H, method=linear_method, **place)
        self.hidden_norm = RMSNorm(H, self.eps, **place)
        self.input_layernorm = RMSNorm(H, self.eps, **place)
        self.self_attn = SelfAttention(
            arch, attn_backend, self.ops, linear_method=linear_method, qkv_input_size=2 * H, **place
        )
        self.post_attention_layernorm = RMSNorm(H, self.eps, **place)
        self.mlp = SwiGLUMLP(H, arch.intermediate_size, self.ops, linear_method=linear_method, **place)
        self.norm = RMSNorm(H, self.eps, **place)
        self.lm_head = ReplicatedLinear(H, config.draft_vocab_size, method=linear_method, **place)
        # target id of each draft id (arange + the checkpoint's d2t offsets); identity until loaded.
        self.register_buffer(
            "draft_to_target", torch.arange(config.draft_vocab_size, dtype=torch.int64, device=device)
        )
        self.rotary = RotaryEmbedding(
            arch.head_dim, max_positions or arch.max_position_embeddings, arch.rope_theta,
            arch.rope_scaling, device=device, dtype=dtype,
        )  # fmt: skip

    # -- the step -------------------------------------------------------------------------------

    def combine_hidden_states(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """fc of the target's aux hidden states concatenated [T, 3 Ht] -> [T, H]."""
        return self.fc(aux_hidden)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64, target-vocab ids
        positions: torch.Tensor,  # [T] int64
        hidden_in: torch.Tensor,  # [T, 3 Ht] the target's fused aux states, or [T, H] hidden_out
        kv_cache: torch.Tensor,  # the drafter's one layer [2, num_blocks, block_size, kv_heads, head_dim]
        attn_metadata: AttentionMetadata,
    ) -> Eagle3StepOutput:
        """One drafter pass over a flattened batch (see attention/backend.py); K/V of every row is
        stored at attn_metadata.slot_mapping. Eager only: RoPE is never fused into attention."""
        width = hidden_in.shape[-1]
        if width == self.fc.input_size:
            h = self.fc(hidden_in)
        elif width == self.arch.hidden_size:
            h = hidden_in.clone()  # becomes the residual stream, which the ops update in place
        else:
            raise ValueError(
                f"hidden_in has width {width}; expected {self.fc.input_size} (3 fused target hidden "
                f"states) or {self.arch.hidden_size} (the drafter's own hidden_out)"
            )
        ops, eps = self.ops, self.eps
        embeds = F.embedding(input_ids, self.embed_tokens)
        normed_hidden = ops.add_rms_norm(h, self.hidden_norm.weight, eps, None)
        # (normed_hidden may become the residual: the cat below copies it before the adds update it)
        residual = normed_hidden if self.config.norm_before_residual else h
        attn_in = torch.cat((ops.add_rms_norm(embeds, self.input_layernorm.weight, eps, None), normed_hidden), -1)
        rope = ops.rope_inputs(self.rotary, positions)
        attn_out = self.self_attn(attn_in, rope, kv_cache, attn_metadata, False)
        mlp_out = self.mlp(ops.add_rms_norm(residual, self.post_attention_layernorm.weight, eps, attn_out))
        normed = ops.add_rms_norm(residual, self.norm.weight, eps, mlp_out)
        return Eagle3StepOutput(hidden_out=residual, normed=normed)

    def compute_draft_logits(self, normed: torch.Tensor) -> torch.Tensor:
        """[N, H] (Eagle3StepOutput.normed rows) -> float32 logits over the draft vocab [N, Vd]."""
        return self.lm_head(normed, out_dtype=torch.float32)

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocab ids -> target-vocab ids (through d2t)."""
        return self.draft_to_target[draft_ids]

    def logits_in_target_vocab(self, draft_logits: torch.Tensor) -> torch.Tensor:
        """[N, Vd] draft logits -> [N, V] over the target vocab, -inf at target ids outside the draft
        vocab (a sampled draft's distribution q as the rejection sampler compares it with p)."""
        out = draft_logits.new_full((draft_logits.shape[0], self.config.target_vocab_size), float("-inf"))
        out[:, self.draft_to_target] = draft_logits
        return out

    def greedy_draft_tokens(self, normed: torch.Tensor) -> torch.Tensor:
        """Greedy drafts [N] in the target vocab: argmax over the draft vocab, then mapped."""
        return self.to_target_ids(self.compute_draft_logits(normed).argmax(dim=-1))

    # -- loading --------------------------------------------------------------------------------

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy the published layout's tensors in (see the module docstring). ValueError names a
        missing tensor, an unexpected one, or one of the wrong shape."""
        loaded: set[str] = set()
        d2t: torch.Tensor | None = None
        t2d: torch.Tensor | None = None
        for name, tensor in weights:
            try:
                if name == "d2t":
                    d2t = self._checked(tensor, (self.config.draft_vocab_size,))
                elif name == "t2d":
                    t2d = self._checked(tensor, (self.config.target_vocab_size,))
                elif name == "embed_tokens.weight":
                    self._check_shared_embedding(tensor)
                elif name.endswith("rotary_emb.inv_freq"):
                    continue  # recomputed from the config
                else:
                    self._load_one(name, tensor)
            except ValueError as err:
                raise ValueError(f"EAGLE-3 drafter tensor {name}: {err}") from None
            loaded.add(name)
        missing = sorted(_EXPECTED_TENSORS - loaded)
        if self.config.draft_vocab_size != self.config.target_vocab_size and "d2t" not in loaded:
            missing.append("d2t")
        if missing:
            raise ValueError(f"EAGLE-3 drafter checkpoint is missing tensors: {', '.join(missing)}")
        if d2t is not None:
            self._set_draft_to_target(d2t, t2d)

    def _load_one(self, name: str, tensor: torch.Tensor) -> None:
        target = _CHECKPOINT_TARGETS.get(name)
        if target is None:
            raise ValueError("unexpected tensor: not part of the EAGLE-3 drafter layout (see model/eagle3.py)")
        module_path, param_name, shard_id = target
        module = self.get_submodule(module_path)
        if hasattr(module, "weight_loader"):  # linear layers check shapes and take their shard
            module.weight_loader(param_name, tensor, shard_id)
        else:
            param = getattr(module, param_name)
            param.data.copy_(self._checked(tensor, tuple(param.shape)))

    @staticmethod
    def _checked(tensor: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        if tuple(tensor.shape) != shape:
            raise ValueError(f"shape {tuple(tensor.shape)} does not match the drafter's {shape}")
        return tensor

    def _check_shared_embedding(self, tensor: torch.Tensor) -> None:
        self._checked(tensor, tuple(self.embed_tokens.shape))
        if not torch.equal(tensor.to(self.embed_tokens.device, self.embed_tokens.dtype), self.embed_tokens):
            raise ValueError(
                "differs from the target's embedding table; this drafter shares the target's "
                "embeddings and does not load its own"
            )

    def _set_draft_to_target(self, d2t: torch.Tensor, t2d: torch.Tensor | None) -> None:
        if d2t.dtype.is_floating_point:
            raise ValueError(f"EAGLE-3 drafter tensor d2t has dtype {d2t.dtype}; expected integer offsets")
        target_ids = torch.arange(len(d2t), dtype=torch.int64) + d2t.to("cpu", torch.int64)
        vocab = self.config.target_vocab_size
        if target_ids.min() < 0 or target_ids.max() >= vocab:
            raise ValueError(
                f"EAGLE-3 drafter tensor d2t maps draft ids to target ids {int(target_ids.min())} .. "
                f"{int(target_ids.max())}; expected ids in 0 .. {vocab - 1}"
            )
        if t2d is not None:
            in_draft = torch.zeros(vocab, dtype=torch.bool)
            in_draft[target_ids] = True
            if not torch.equal(in_draft, t2d.to("cpu", torch.bool)):
                raise ValueError(
                    "EAGLE-3 drafter tensors d2t and t2d disagree: t2d must mark exactly the target "
                    "ids that d2t maps the draft vocab to"
                )
        self.draft_to_target.copy_(target_ids)


# Published tensor name -> (our module, its parameter, shard of a merged layer).
_CHECKPOINT_TARGETS: dict[str, tuple[str, str, str | int | None]] = {
    "fc.weight": ("fc", "weight", None),
    "midlayer.hidden_norm.weight": ("hidden_norm", "weight", None),
    "midlayer.input_layernorm.weight": ("input_layernorm", "weight", None),
    "midlayer.self_attn.q_proj.weight": ("self_attn.qkv_proj", "weight", "q"),
    "midlayer.self_attn.k_proj.weight": ("self_attn.qkv_proj", "weight", "k"),
    "midlayer.self_attn.v_proj.weight": ("self_attn.qkv_proj", "weight", "v"),
    "midlayer.self_attn.o_proj.weight": ("self_attn.o_proj", "weight", None),
    "midlayer.post_attention_layernorm.weight": ("post_attention_layernorm", "weight", None),
    "midlayer.mlp.gate_proj.weight": ("mlp.gate_up_proj", "weight", 0),
    "midlayer.mlp.up_proj.weight": ("mlp.gate_up_proj", "weight", 1),
    "midlayer.mlp.down_proj.weight": ("mlp.down_proj", "weight", None),
    "norm.weight": ("norm", "weight", None),
    "lm_head.weight": ("lm_head", "weight", None),
}
_EXPECTED_TENSORS = frozenset(_CHECKPOINT_TARGETS)


def iter_drafter_weights(path: Path, device: torch.device) -> Iterable[tuple[str, torch.Tensor]]:
    """The drafter's tensors: its safetensors files, else its pytorch_model.bin (the EAGLE repo
    publishes .bin files; read with the weights-only unpickler, model/loader/pt_loader.py)."""
    if safetensors_files(path):
        return iter_safetensors_weights(path, device)
    return iter_pt_weights(path)


def load_eagle3_drafter(
    path: str | Path,
    target_model: CausalLM,
    device: torch.device | str,
    dtype: torch.dtype,
    attn_backend: AttentionBackend,
    *,
    kernel: KernelConfig | None = None,
) -> Eagle3Drafter:
    """Build the drafter in `path` (config.json + weights) for `target_model`, sharing its
    embedding table, on `device` in `dtype`, with its weights loaded and processed for the
    device's 16-bit linear method. `attn_backend` must match the drafter's heads (often the
    target's: Llama-3.1-8B and its drafter both have 32 x 128 heads and 8 KV heads)."""
    path = Path(path)
    device = torch.device(device)
    config = Eagle3Config.from_hf_config(read_hf_config(path), target_model.arch)
    arch = config.arch
    if (attn_backend.num_heads, attn_backend.num_kv_heads, attn_backend.head_dim) != (
        arch.num_heads, arch.num_kv_heads, arch.head_dim,
    ):  # fmt: skip
        raise ValueError(
            f"the attention backend serves {attn_backend.num_heads} heads / {attn_backend.num_kv_heads} "
            f"KV heads of {attn_backend.head_dim}; the drafter has {arch.num_heads} / {arch.num_kv_heads} "
            f"of {arch.head_dim}"
        )
    linear_method = select_linear_method(device, dtype, kernel or KernelConfig())
    drafter = Eagle3Drafter(
        config, target_model.embed_tokens, attn_backend, device=device, dtype=dtype,
        max_positions=target_model.max_positions, linear_method=linear_method,
    )  # fmt: skip
    drafter.load_weights(iter_drafter_weights(path, device))
    process_weights_after_loading(drafter)
    return drafter.eval()
