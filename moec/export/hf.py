"""Export a trained moec checkpoint as a ``transformers`` MoE model (``save_pretrained`` layout).

:func:`export_hf` reads the model tensors of a moec checkpoint (a run directory's newest
committed checkpoint that verifies, or a ``checkpoints/step_N`` folder that does: DCP, global
EP = 1 shapes; read without running code from the folder, :mod:`moec.runtime.safe_read`),
picks the Hugging Face MoE architecture that computes what the moec program computes, maps the
tensors onto it, and writes ``config.json`` + ``model.safetensors`` with
``PreTrainedModel.save_pretrained`` (transformers 5 stores the experts fused as 3-D
``experts.gate_up_proj`` / ``experts.down_proj`` parameters and writes them back in the hub's
per-expert layout, e.g. Mixtral's ``block_sparse_moe.experts.{e}.w1/w2/w3``, which every
transformers 4.x/5.x and the serving engines read).

What it needs besides the checkpoint: the plan (``run.json`` of the run, or given) and the
source model's architecture (shapes alone do not say the head count, rope or norm settings):
by default the model configuration ``run.json`` recorded (read as data: a transformers
model's config, or the config of moec's bundled Llama, which maps onto transformers' Llama),
else the model given (a module or a ``moec train --model`` spec) or a ``config.json``. The
output folder defaults to ``RUN/hf``.

Architectures (source ``model_type`` -> target)::

    llama, mistral   -> mixtral      (no shared expert, no dense blocks, normalized weights)
                     -> qwen2_moe    (otherwise: q/k/v without bias, see the shared expert below)
    qwen2            -> qwen2_moe
    qwen3            -> qwen3_moe    (no shared expert)
    olmo2            -> flex_olmo    (OLMo-2's post-norm blocks; OLMoE is pre-norm, so no
                                      OLMo-2 maps onto it; no shared expert, no dense blocks)

Dense first blocks (``moe.dense_first``) become ``mlp_only_layers`` (Qwen2-MoE, Qwen3-MoE;
``decoder_sparse_step`` 1); Mixtral and FlexOlmo have every block sparse. moec's shared expert
is the dense FFN added to the routed output; Qwen2-MoE multiplies its shared expert by
``sigmoid(shared_expert_gate(x))``: the gate is exported as zeros (sigmoid 0 = 1/2) and the
shared down projection doubled, which is exact (powers of two). A Llama/Mistral plan that
needs Qwen2-MoE without a shared expert gets a shared expert of width 0 (its output is 0).
Router: ``router_weight`` [N, D] is the HF ``gate.weight``; experts ``w_up`` [N, D, 2H] with
columns [gate | up] become ``gate_up_proj`` [N, 2H, D], ``w_down`` [N, H, D] ``down_proj``
[N, D, H]; every other tensor keeps its HF name.

Refused (:class:`ExportError`, naming what cannot be expressed): sigmoid gating (every target
takes a softmax over the experts before top-k), a non-zero
selection bias (``moe.balance: aux_free``: no target adds a bias to the scores it takes the
top-k of; a zero bias, e.g. at step 0, chooses as plain top-k and is left out), expert biases
and ungated (plain) expert activations (HF experts are bias-free GLUs), a shared expert or
dense first blocks where the target has none (Qwen3-MoE, FlexOlmo), un-normalized weights on a
target that always normalizes, a source config field the target lacks at a non-neutral value
(e.g. Llama ``attention_bias``, a Mistral sliding window on Qwen2-MoE), families with no HF MoE
counterpart (GPT-2, Phi, GPT-NeoX, Gemma, moec's bundled GPT-2), and a source the export
cannot rebuild the architecture of (a model neither from transformers nor bundled, without
``config``). The family is checked first, so a refusal names it before any tensor is read.

moec's bundled :class:`~moec.models.Llama` computes what transformers' ``LlamaForCausalLM``
computes (pre-norm RMSNorm blocks, rotate-half RoPE, grouped-query attention, a SwiGLU FFN):
its config maps field by field (``dim`` -> ``hidden_size``, ...) and its tensors by name
(``layers.N.attn`` -> ``model.layers.N.self_attn``, ...); per-block FFN widths
(``ffn_hidden_per_layer``) have no Llama config field and are refused.

Besides the model, ``out`` gets ``moec_export.json``: the checkpoint read, the architecture
and the notes below that apply.

Where the exported model differs from the moec program (the forward is equal otherwise):

- Capacity: moec drops a token's route when its expert's buffer (``capacity_factor``) is full;
  HF routes dropless. Outputs agree on inputs where moec drops nothing (a non-binding capacity
  or ``capacity_factor: null``) and differ on the dropped routes otherwise.
- Normalization of the top-k weights: moec ``normalize_weights`` = HF ``norm_topk_prob``
  (Mixtral always normalizes, so only ``true`` maps onto it).
- Gating: softmax over all N experts before top-k in both; moec's sigmoid gating has no target.
- Training-only terms: moec's load-balancing coefficient becomes ``router_aux_loss_coef`` (HF
  computes the Switch-style loss over the whole batch; moec's ``moe.balance`` may differ; 0
  under ``aux_free``, which trains no such loss), ``output_router_logits`` is off; the router
  z-loss has no HF counterpart and is not exported. Neither changes the forward.
"""

from __future__ import annotations

import dataclasses
import json
import re
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.api import CheckpointException

from moec.errors import MoecError
from moec.export import DTYPE_NAMES
from moec.plan import MoEPlan, Plan
from moec.runtime import run_files, run_identity, safe_read
from moec.runtime.checkpoint_store import MANIFEST, CheckpointStore
from moec.runtime.safe_read import METADATA

DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}
"""``--dtype`` names; default: the checkpoint's (float32 master weights)."""


class ExportError(MoecError, ValueError):
    """A checkpoint that cannot be exported: no HF architecture expresses its program, or what
    the export needs (checkpoint, plan, source config) is missing or does not match."""


@dataclasses.dataclass(frozen=True)
class Target:
    """One HF MoE architecture and what it can express."""

    model_type: str
    config_class: str
    model_class: str
    experts_key: str
    """Config field of the routed experts' count."""
    width_key: str
    """Config field of one routed expert's hidden width."""
    shared: bool
    """Has a (gated) shared expert."""
    dense_layers: bool
    """Has ``mlp_only_layers``."""
    norm_topk: bool
    """Has ``norm_topk_prob`` (else the top-k weights are always normalized)."""


MIXTRAL = Target(
    "mixtral",
    "MixtralConfig",
    "MixtralForCausalLM",
    "num_local_experts",
    "intermediate_size",
    shared=False,
    dense_layers=False,
    norm_topk=False,
)
QWEN2_MOE = Target(
    "qwen2_moe",
    "Qwen2MoeConfig",
    "Qwen2MoeForCausalLM",
    "num_experts",
    "moe_intermediate_size",
    shared=True,
    dense_layers=True,
    norm_topk=True,
)
QWEN3_MOE = Target(
    "qwen3_moe",
    "Qwen3MoeConfig",
    "Qwen3MoeForCausalLM",
    "num_experts",
    "moe_intermediate_size",
    shared=False,
    dense_layers=True,
    norm_topk=True,
)
FLEX_OLMO = Target(
    "flex_olmo",
    "FlexOlmoConfig",
    "FlexOlmoForCausalLM",
    "num_experts",
    "intermediate_size",
    shared=False,
    dense_layers=False,
    norm_topk=True,
)

FAMILIES: dict[str, tuple[Target, ...]] = {
    "llama": (MIXTRAL, QWEN2_MOE),
    "mistral": (MIXTRAL, QWEN2_MOE),
    "qwen2": (QWEN2_MOE,),
    "qwen3": (QWEN3_MOE,),
    "olmo2": (FLEX_OLMO,),
}
"""Source ``model_type`` -> the targets that may express it, preferred first."""

_TARGET_TYPES = dict.fromkeys(t.model_type for targets in FAMILIES.values() for t in targets)

_LLAMA_ATTENTION = {"llama", "mistral"}
"""Sources whose q/k/v have no bias (Qwen2-MoE then gets ``qkv_bias: False``)."""

_MANAGED = {"architectures", "transformers_version", "dtype", "intermediate_size"}
"""Config fields the export sets itself rather than copies from the source."""


def _neutral(field: str, value: Any, config: Any) -> bool:
    """Whether a source config field that the target lacks leaves the forward as the target
    computes it."""
    if field == "pretraining_tp":  # a tensor-parallel inference knob, not a function change
        return True
    if field in ("attention_bias", "mlp_bias", "use_sliding_window"):
        return not value
    if field == "head_dim":
        return value is None or value == config.hidden_size // config.num_attention_heads
    if field == "sliding_window":
        return value is None or not getattr(config, "use_sliding_window", True)
    if field == "layer_types":
        return value is None or all(t == "full_attention" for t in value)
    if field == "max_window_layers":
        return not getattr(config, "use_sliding_window", False)
    return False


@dataclasses.dataclass
class Layout:
    """What the checkpoint's tensors hold, by block."""

    num_layers: int
    moe_layers: list[int]
    num_experts: int
    expert_width: int
    dense_width: int | None
    """Width of the dense FFNs (first blocks, or the shared expert)."""
    shared: bool


@dataclasses.dataclass
class ExportResult:
    out: Path
    checkpoint: Path
    architecture: str
    """The written model class (``MixtralForCausalLM``)."""
    notes: list[str]
    """Where the exported model's semantics differ from the moec program."""


@dataclasses.dataclass(frozen=True)
class Source:
    """The source model's architecture as a transformers config, and how its checkpoint's
    tensor names map onto that config's model."""

    config: Any
    """A ``PretrainedConfig`` of one of :data:`FAMILIES`."""
    anchor: str = "model.embed_tokens.weight"
    """The token embedding's name in the checkpoint, below its wrapper prefix."""
    rename: Callable[[str], str] | None = None
    """Checkpoint name -> transformers name (None: the names are transformers' already)."""


# --- finding the checkpoint, plan and source config ---------------------------------------------


def resolve_checkpoint(
    path: str | Path, report: Callable[[str], None] = print
) -> tuple[Path, Path | None]:
    """(checkpoint folder, run directory or None) for a run directory (its newest committed
    checkpoint that verifies) or a checkpoint folder (``checkpoints/step_N``, which must
    verify: see :mod:`moec.runtime.checkpoint_store`)."""
    path = Path(path)
    if not path.exists():
        raise ExportError(f"{path} does not exist: give a moec run directory or a checkpoint")
    if (path / MANIFEST).is_file() or (path / METADATA).is_file():
        problem = CheckpointStore(path.parent, keep=1 << 30).verify(path)
        if problem is not None:
            raise ExportError(
                f"{path} is not a committed checkpoint that matches its {MANIFEST} ({problem}): "
                "export one that verifies (give the run directory to take its newest)"
            )
        run_dir = path.parent.parent
        return path, run_dir if (run_dir / run_identity.RUN_FILE).is_file() else None
    store = CheckpointStore(path / run_identity.CHECKPOINTS, keep=1 << 30, report=report)
    if not store.root.is_dir():
        raise ExportError(
            f"{path} is neither a moec run directory (no {run_identity.CHECKPOINTS}/ folder) "
            "nor a checkpoint (no .metadata): give RUN_DIR or RUN_DIR/checkpoints/step_N"
        )
    newest = store.newest_verified()
    if newest is None:
        raise ExportError(
            f"{path}: no committed checkpoint in {store.root} matches its manifest (the "
            "reasons are above, if any): train the run to a checkpoint first"
        )
    return newest.path, path


def resolve_plan(plan: Plan | dict | str | Path | None, run_dir: Path | None) -> Plan:
    """The plan given, or the one ``run_dir/run.json`` recorded (read as data: the export
    compiles nothing, so code the recorded plan names, ``moe.activations``, never runs)."""
    if isinstance(plan, Plan):
        return plan
    if isinstance(plan, dict):
        return Plan.from_dict(plan)
    if plan is not None:
        return Plan.load(plan)
    recorded = None if run_dir is None else run_identity.read(run_dir)
    if recorded is None or "plan" not in recorded:
        raise ExportError(
            "the checkpoint has no run.json two folders up to read its plan from: give the "
            "plan it was trained with (--plan plan.yaml)"
        )
    return Plan.from_dict(recorded["plan"])


def resolve_source(
    model: torch.nn.Module | str | None,
    config: Any,
    run_dir: Path | None,
) -> Source:
    """The source model's architecture: ``model``'s (a module, or a model spec of
    :mod:`moec.models.zoo` built on the meta device), or ``config`` (a ``PretrainedConfig``, a
    ``config.json`` or a folder holding one), checked against the run's recorded model; with
    neither, the configuration ``run.json`` recorded."""
    recorded = None if run_dir is None else (run_identity.read(run_dir) or {}).get("model")
    if model is not None:
        if isinstance(model, str):
            from moec.models.zoo import load_model

            with torch.device("meta"):
                model = load_model(model)[0]
        given = run_identity.model_spec(model)
        if recorded is not None and run_identity.compared(given) != run_identity.compared(recorded):
            raise ExportError(
                f"the model given ({run_identity.compared(given)}) is not the one the run in "
                f"{run_dir} trained ({run_identity.compared(recorded)}): give the run's --model"
            )
        return _source_of(given["class"], getattr(model, "config", None) or given.get("config"))
    if config is not None:
        return Source(_given_config(config, recorded, run_dir))
    if recorded is None:
        raise ExportError(
            "the checkpoint has no run.json two folders up to read its model from: give "
            "--model MODEL (as for moec train) or --config PATH (its config.json, e.g. the "
            "--init-from folder)"
        )
    return _source_of(recorded.get("class", "?"), recorded.get(run_identity.CONFIG), run_dir)


def _source_of(qualified: str, config: Any, run_dir: Path | None = None) -> Source:
    """The :class:`Source` of a model of class ``qualified`` with configuration ``config`` (a
    ``PretrainedConfig`` or as ``run.json`` records it)."""
    from transformers import AutoConfig, PretrainedConfig

    where = "the model given" if run_dir is None else f"the run in {run_dir}"
    if qualified == BUNDLED_GPT2:
        raise ExportError(
            f"{where} is moec's bundled GPT-2, and no HF MoE architecture has GPT-2's blocks "
            "(LayerNorm, learned positions, biased ungated GELU FFNs): export supports sources "
            f"of the families {', '.join(sorted(FAMILIES))} and moec's bundled Llama"
        )
    if qualified != BUNDLED_LLAMA and not qualified.startswith("transformers."):
        raise ExportError(
            f"{where} is a {qualified}, neither a transformers model nor moec's bundled "
            "Llama, so its architecture has no HF config to start from: give --config PATH, "
            "the config.json of a transformers model it equals"
        )
    if config is None:
        raise ExportError(
            f"{where} ({qualified}) has no recorded configuration (a run of an earlier moec): "
            "give --model MODEL (as for moec train) or --config PATH"
        )
    if qualified == BUNDLED_LLAMA:
        return Source(_bundled_llama_config(config), "embed.weight", _bundled_llama_name)
    if not isinstance(config, PretrainedConfig):
        try:
            config = AutoConfig.for_model(**config)
        except Exception as exc:  # data from a run folder: whatever transformers refuses
            # (KeyError, TypeError, ValueError, huggingface_hub's field validation errors)
            raise ExportError(
                f"the configuration {where} recorded cannot be read as a transformers config "
                f"({exc}): give --config PATH"
            ) from exc
    return Source(config)


def _given_config(config: Any, recorded: dict[str, Any] | None, run_dir: Path | None) -> Any:
    """``--config``: a ``PretrainedConfig``, a ``config.json`` or a folder with one, checked
    against the family of the run's recorded model."""
    from transformers import AutoConfig, PretrainedConfig

    if not isinstance(config, PretrainedConfig):
        path = Path(config)
        if path.is_file():
            path = path.parent if path.name == "config.json" else path
            if not (path / "config.json").is_file():
                raise ExportError(f"--config {config}: name a config.json or a folder with one")
        try:
            config = AutoConfig.from_pretrained(str(path))
        except (OSError, ValueError) as exc:
            raise ExportError(f"--config {config}: cannot be read ({exc})") from exc
    if recorded is not None:
        family = _family_of_class(recorded.get("class", ""))
        if family is not None and family != config.model_type:
            raise ExportError(
                f"--config is a {config.model_type!r} config but the run in {run_dir} trained "
                f"{recorded['class']}: give that model's config"
            )
    return config


# --- moec's bundled Llama as transformers' Llama -------------------------------------------------

BUNDLED_LLAMA = "moec.models.llama.Llama"
BUNDLED_GPT2 = "moec.models.gpt2.GPT2"

_BUNDLED_LLAMA_NAMES = (
    (r"embed\.weight", "model.embed_tokens.weight"),
    (r"norm\.weight", "model.norm.weight"),
    (r"lm_head\.weight", "lm_head.weight"),
    (r"layers\.(\d+)\.attn_norm\.weight", r"model.layers.\1.input_layernorm.weight"),
    (r"layers\.(\d+)\.attn\.([qkvo]_proj\.weight)", r"model.layers.\1.self_attn.\2"),
    (r"layers\.(\d+)\.ffn_norm\.weight", r"model.layers.\1.post_attention_layernorm.weight"),
    (r"layers\.(\d+)\.ffn\.(.+)", r"model.layers.\1.mlp.\2"),
)
"""moec.models.Llama's parameter names -> LlamaForCausalLM's (the FFN's MoE tensors too)."""


def _bundled_llama_name(name: str) -> str:
    for pattern, replacement in _BUNDLED_LLAMA_NAMES:
        if re.fullmatch(pattern, name):
            return re.sub(pattern, replacement, name)
    raise ExportError(
        f"the checkpoint's tensor {name!r} is not one of moec's bundled Llama: the checkpoint "
        "is not of the model its run.json records"
    )


def _bundled_llama_config(cfg: dict[str, Any]) -> Any:
    """transformers' ``LlamaConfig`` of moec's bundled Llama of config ``cfg`` (see module)."""
    import transformers

    try:
        widths = set(cfg.get("ffn_hidden_per_layer") or [cfg["ffn_hidden"]])
        if len(widths) > 1:
            raise ExportError(
                f"moec's bundled Llama has per-block FFN widths (ffn_hidden_per_layer = "
                f"{cfg['ffn_hidden_per_layer']}), which no HF Llama config holds (one "
                "intermediate_size for every block)"
            )
        return transformers.LlamaConfig(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["dim"],
            intermediate_size=widths.pop(),
            num_hidden_layers=cfg["n_layers"],
            num_attention_heads=cfg["n_heads"],
            num_key_value_heads=cfg["n_kv_heads"],
            max_position_embeddings=cfg["max_seq_len"],
            rope_parameters={"rope_type": "default", "rope_theta": cfg["rope_theta"]},
            rms_norm_eps=cfg["norm_eps"],
            tie_word_embeddings=cfg["tie_embeddings"],
            hidden_act="silu",
            attention_bias=False,
            mlp_bias=False,
            use_cache=False,
        )
    except KeyError as exc:
        raise ExportError(
            f"the recorded configuration of moec's bundled Llama has no field {exc} (written "
            "by another moec version): give --config PATH"
        ) from exc


def _family_of_class(qualified: str) -> str | None:
    """``llama`` for ``transformers.models.llama.modeling_llama.LlamaForCausalLM``."""
    parts = qualified.split(".")
    if len(parts) > 3 and parts[0] == "transformers" and parts[1] == "models":
        return parts[2]
    return None


# --- reading the checkpoint ---------------------------------------------------------------------

_ANCHOR = Source.anchor
"""Every supported family's token embedding (transformers' name)."""


def read_model_tensors(checkpoint: Path, source: Source | None = None) -> dict[str, torch.Tensor]:
    """The model's tensors in ``checkpoint`` by their names in the source HF model (the
    ``model.`` of the DCP state dict and of moec's loss wrapper removed, ``source``'s names
    mapped onto transformers'); read without running code from the folder
    (:mod:`moec.runtime.safe_read`)."""
    source = source or Source(None)
    anchor = source.anchor
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    try:
        metadata = safe_read.read_metadata(checkpoint)
    except (Exception, CheckpointException) as exc:
        raise ExportError(
            f"{checkpoint}: not a readable DCP checkpoint ({safe_read.failure_reason(exc)})"
        ) from exc
    entries = {
        k: v
        for k, v in metadata.state_dict_metadata.items()
        if k.startswith("model.") and isinstance(v, TensorStorageMetadata)
    }
    anchors = [k for k in entries if k.endswith("." + anchor)]
    if len(anchors) != 1:
        raise ExportError(
            f"{checkpoint}: expected one token embedding '*{anchor}' among the model's "
            f"tensors, found {anchors or 'none'}: the checkpoint is not of the model its "
            "config describes; give the run's --model or --config"
        )
    prefix = anchors[0][: -len(anchor)]
    state = {
        key: torch.empty(meta.size, dtype=meta.properties.dtype)
        for key, meta in entries.items()
        if key.startswith(prefix)
    }
    try:
        safe_read.dcp_load(state, checkpoint)
    except (Exception, CheckpointException) as exc:
        raise ExportError(
            f"{checkpoint}: its tensors cannot be read ({safe_read.failure_reason(exc)})"
        ) from exc
    rename = source.rename or (lambda name: name)
    return {rename(key[len(prefix) :]): value for key, value in state.items()}


# --- choosing the target and mapping the tensors ------------------------------------------------


def _layer(i: int, name: str) -> str:
    return f"model.layers.{i}.mlp.{name}"


def layout_of(tensors: dict[str, torch.Tensor], config: Any, moe: MoEPlan) -> Layout:
    """Which blocks are MoE, their widths, and whether a shared expert is there; refuses what
    HF experts cannot hold (biases, ungated activations) and a checkpoint that does not
    match the plan or config."""
    layers = config.num_hidden_layers
    moe_layers = [i for i in range(layers) if _layer(i, "moe.w_up") in tensors]
    expected = list(range(moe.dense_first, layers))
    if moe_layers != expected:
        raise ExportError(
            f"the checkpoint has MoE blocks {moe_layers}, the plan (moe.dense_first="
            f"{moe.dense_first}, {layers} blocks in the config) says {expected}: give the "
            "plan and config the run was trained with"
        )
    _refuse_selection_bias(tensors, moe_layers)
    first = moe_layers[0]
    for bias in ("moe.b_up", "moe.b_down"):
        if _layer(first, bias) in tensors:
            raise ExportError(
                f"the routed experts have biases ({_layer(first, bias)}): HF MoE experts "
                "are bias-free, no HF architecture expresses them"
            )
    n, dim, up = tensors[_layer(first, "moe.w_up")].shape
    width = tensors[_layer(first, "moe.w_down")].shape[1]
    if up != 2 * width:
        raise ExportError(
            f"the experts' activation is ungated (w_up {up} columns for width {width}): HF "
            f"MoE experts are gated ({config.hidden_act}(x W_gate) * x W_up); export needs a "
            "gated FFN such as SwiGLU"
        )
    if n != moe.num_experts:
        raise ExportError(
            f"the checkpoint has {n} experts, the plan moe.num_experts says "
            f"{moe.num_experts}: give the run's plan"
        )
    dense = _layer(first if moe.shared_expert else 0, "down_proj.weight")
    dense_width = tensors[dense].shape[1] if dense in tensors else None
    if (moe.shared_expert or moe.dense_first) and dense_width is None:
        raise ExportError(
            f"{dense}: not in the checkpoint, which the plan's shared expert or "
            "dense first blocks need"
        )
    return Layout(layers, moe_layers, n, width, dense_width, moe.shared_expert)


def _refuse_selection_bias(tensors: dict[str, torch.Tensor], moe_layers: list[int]) -> None:
    """Refuse routers that choose their experts with a non-zero selection bias (``moe.balance:
    aux_free``); a zero bias chooses as plain top-k does, and is left out of the export."""
    for i in moe_layers:
        bias = tensors.get(_layer(i, "moe.expert_bias"))
        if bias is not None and bias.any():
            raise ExportError(
                f"the routers choose their experts with a selection bias "
                f"({_layer(i, 'moe.expert_bias')} is non-zero; moe.balance: aux_free): none "
                f"of the HF targets ({', '.join(_TARGET_TYPES)}) adds a bias to the router's "
                "scores before top-k, so the exported model would route differently"
            )


def family_of(config: Any) -> str:
    """The source's family, one of :data:`FAMILIES` (refused otherwise, naming it)."""
    family = getattr(config, "model_type", None)
    if family not in FAMILIES:
        raise ExportError(
            f"no HF MoE architecture for a {family!r} source: export supports the families "
            f"{', '.join(sorted(FAMILIES))} (Llama/Mistral -> Mixtral or Qwen2-MoE, Qwen2 -> "
            "Qwen2-MoE, Qwen3 -> Qwen3-MoE, OLMo-2 -> FlexOlmo)"
        )
    return family


def choose_target(config: Any, moe: MoEPlan, layout: Layout) -> Target:
    """The first target of the source's family that expresses the plan (see module)."""
    family = family_of(config)
    if moe.gating != "softmax":
        raise ExportError(
            f"moe.gating={moe.gating!r}: every HF target of {family} takes a softmax over the "
            "experts before top-k; no HF architecture expresses this plan's sigmoid gating "
            f"on a {family} block"
        )
    problems = []
    for target in FAMILIES[family]:
        missing = []
        if layout.shared and not target.shared:
            missing.append("has no shared expert")
        if moe.dense_first and not target.dense_layers:
            missing.append(f"has no dense first blocks (moe.dense_first={moe.dense_first})")
        if not moe.normalize_weights and not target.norm_topk:
            missing.append("always normalizes the top-k weights (moe.normalize_weights is false)")
        if not missing:
            return target
        problems.append(f"{target.model_class} {' and '.join(missing)}")
    raise ExportError(
        f"no HF architecture expresses this plan on a {family} source: " + "; ".join(problems)
    )


def target_config(config: Any, target: Target, moe: MoEPlan, layout: Layout, dtype: Any) -> Any:
    """The target's config: the source's architecture fields, the MoE fields of the plan."""
    import transformers

    config_class = getattr(transformers, target.config_class)
    fields = {f.name for f in dataclasses.fields(config_class)}
    source_fields = [f.name for f in dataclasses.fields(type(config))]
    kwargs: dict[str, Any] = {}
    for name in source_fields:
        value = getattr(config, name)
        if name in _MANAGED:
            continue
        if name in fields:
            kwargs[name] = value
        elif not _neutral(name, value, config):
            raise ExportError(
                f"the source config's {name}={value!r} has no counterpart in "
                f"{target.config_class}: no HF architecture expresses this {config.model_type} "
                "model with this plan"
            )
    kwargs.update(
        {
            target.experts_key: layout.num_experts,
            target.width_key: layout.expert_width,
            "num_experts_per_tok": moe.top_k,
            "router_aux_loss_coef": moe.trained_lbl_coef,
            "output_router_logits": False,
            "architectures": [target.model_class],
            "dtype": dtype,
        }
    )
    if target.norm_topk:
        kwargs["norm_topk_prob"] = moe.normalize_weights
    if target is MIXTRAL:
        kwargs["router_jitter_noise"] = 0.0
    if target.dense_layers:
        kwargs["intermediate_size"] = layout.dense_width or layout.expert_width
        kwargs["mlp_only_layers"] = list(range(moe.dense_first))
        kwargs["decoder_sparse_step"] = 1
    if target is QWEN2_MOE:
        kwargs["shared_expert_intermediate_size"] = layout.dense_width if layout.shared else 0
        kwargs["qkv_bias"] = config.model_type not in _LLAMA_ATTENTION
        if config.model_type in _LLAMA_ATTENTION:  # Mistral's window on every layer, explicitly
            window = getattr(config, "sliding_window", None)
            kind = "full_attention" if window is None else "sliding_attention"
            kwargs["use_sliding_window"] = window is not None
            kwargs["sliding_window"] = window
            kwargs["max_window_layers"] = layout.num_layers
            kwargs["layer_types"] = [kind] * layout.num_layers
    return config_class(**kwargs)


def target_tensors(
    tensors: dict[str, torch.Tensor], target: Target, layout: Layout, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """The target model's state dict (HF module names, transformers 5's fused experts)."""
    out = {}
    for name, value in tensors.items():
        if ".mlp.moe." in name:
            continue
        out[name] = value
    for i in layout.moe_layers:
        moe = {k: tensors[_layer(i, f"moe.{k}")] for k in ("router_weight", "w_up", "w_down")}
        out[_layer(i, "gate.weight")] = moe["router_weight"]
        # [N, D, 2H] (in, out; columns [gate | up]) -> [N, 2H, D] (out, in; rows gate then up)
        out[_layer(i, "experts.gate_up_proj")] = moe["w_up"].transpose(1, 2)
        out[_layer(i, "experts.down_proj")] = moe["w_down"].transpose(1, 2)
        if target is not QWEN2_MOE:
            continue
        dim = moe["router_weight"].shape[1]
        shared = {p: out.pop(_layer(i, f"{p}.weight"), None) for p in _PROJ}
        width = layout.dense_width if layout.shared else 0
        zeros = {"gate_proj": (width, dim), "up_proj": (width, dim), "down_proj": (dim, width)}
        for proj, value in shared.items():
            value = torch.zeros(zeros[proj]) if value is None else value
            # sigmoid(0) = 1/2 halves the shared expert: double its output projection
            out[_layer(i, f"shared_expert.{proj}.weight")] = (
                value * 2 if proj == "down_proj" else value
            )
        out[_layer(i, "shared_expert_gate.weight")] = torch.zeros(1, dim)
    return {k: v.to(dtype).contiguous() for k, v in out.items()}


_PROJ = ("gate_proj", "up_proj", "down_proj")


def semantic_notes(target: Target, moe: MoEPlan) -> list[str]:
    """Where the exported model's semantics differ from the moec program (see module)."""
    notes = []
    if moe.capacity_factor is not None:
        notes.append(
            f"capacity: moec drops routes beyond capacity_factor={moe.capacity_factor}; "
            f"{target.model_class} routes dropless, so outputs agree only where moec dropped "
            "nothing"
        )
    if moe.z_loss_coef:
        notes.append(
            f"router z-loss (z_loss_coef={moe.z_loss_coef}): no HF counterpart, not exported "
            "(training only)"
        )
    if moe.trained_lbl_coef:
        notes.append(
            f"load balancing: router_aux_loss_coef={moe.lbl_coef} (HF's Switch-style loss, "
            "used only with output_router_logits; training only)"
        )
    if target is QWEN2_MOE and moe.shared_expert:
        notes.append(
            "shared expert: exported with a zero shared_expert_gate (sigmoid 1/2) and a "
            "doubled down projection, equal to moec's ungated sum; the gate trains from there"
        )
    elif target is QWEN2_MOE:
        notes.append("no shared expert: Qwen2-MoE's shared expert is exported with width 0")
    return notes


# --- the export ---------------------------------------------------------------------------------


DEFAULT_OUT = "hf"
"""The output folder in the run directory where none is given."""


def export_hf(
    source: str | Path,
    out: str | Path | None = None,
    *,
    model: torch.nn.Module | str | None = None,
    config: Any = None,
    plan: Plan | dict | str | Path | None = None,
    dtype: str | torch.dtype | None = None,
    overwrite: bool = False,
    report: Callable[[str], None] = print,
) -> ExportResult:
    """Write the checkpoint ``source`` (a run directory or ``checkpoints/step_N``) to ``out``
    as a transformers MoE model (see module); ``model`` or ``config`` gives the source model's
    architecture (default: the run's recorded one), ``plan`` defaults to the run's, ``dtype``
    to the checkpoint's, ``out`` to ``RUN/hf``."""
    import transformers

    checkpoint, run_dir = resolve_checkpoint(source, report)
    out = _out_folder(out, run_dir, checkpoint)
    if (out / "config.json").exists() and not overwrite:
        raise ExportError(
            f"{out} holds a model already (config.json): choose another "
            "--to, or replace it with --force"
        )
    the_plan = resolve_plan(plan, run_dir)
    model_source = resolve_source(model, config, run_dir)
    source_config = model_source.config
    family_of(source_config)  # before any tensor is read
    tensors = read_model_tensors(checkpoint, model_source)
    layout = layout_of(tensors, source_config, the_plan.moe)
    target = choose_target(source_config, the_plan.moe, layout)
    torch_dtype = _dtype(dtype, tensors)
    hf_config = target_config(source_config, target, the_plan.moe, layout, torch_dtype)
    state = target_tensors(tensors, target, layout, torch_dtype)
    if hf_config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    with torch.device("meta"), warnings.catch_warnings():
        # a Qwen2-MoE shared expert of width 0 has zero-element weights: nothing to initialize
        warnings.filterwarnings("ignore", message="Initializing zero-element tensors")
        hf_model = getattr(transformers, target.model_class)(hf_config)
    expected = set(hf_model.state_dict())
    if hf_config.tie_word_embeddings:
        expected.discard("lm_head.weight")
    if set(state) != expected:
        raise ExportError(
            f"{target.model_class} (transformers {transformers.__version__}) has parameters "
            f"the checkpoint does not: {sorted(expected - set(state))[:5]}; the checkpoint has "
            f"ones it does not: {sorted(set(state) - expected)[:5]}"
        )
    try:
        hf_model.load_state_dict(state, strict=False, assign=True)
    except RuntimeError as exc:
        raise ExportError(f"the checkpoint does not fit {target.model_class}: {exc}") from exc
    if hf_config.tie_word_embeddings:
        hf_model.tie_weights()
    out.mkdir(parents=True, exist_ok=True)
    hf_model.save_pretrained(str(out))
    notes = semantic_notes(target, the_plan.moe)
    run_files.write_text(
        out / "moec_export.json",
        json.dumps(
            {"checkpoint": str(checkpoint), "architecture": target.model_class, "notes": notes},
            indent=2,
        ),
    )
    return ExportResult(out, checkpoint, target.model_class, notes)


def _out_folder(out: str | Path | None, run_dir: Path | None, checkpoint: Path) -> Path:
    """``out``, or :data:`DEFAULT_OUT` in the run directory."""
    if out is not None:
        return Path(out)
    if run_dir is None:
        raise ExportError(
            f"{checkpoint} is not in a run directory to write {DEFAULT_OUT}/ into: give --to DIR"
        )
    return run_dir / DEFAULT_OUT


def _dtype(dtype: str | torch.dtype | None, tensors: dict[str, torch.Tensor]) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is None:
        return tensors[_ANCHOR].dtype
    if dtype not in DTYPES:
        raise ExportError(f"--dtype {dtype!r}: use one of {', '.join(DTYPES)}")
    return DTYPES[dtype]
