"""Tiny random HuggingFace models, one per MLP family (no downloads), and an op counter.

``build(family)`` returns ``(model, inputs, n_mlp)``: an fp32 model in eval mode, a dict of forward kwargs and
the number of MLP blocks it holds. Dropout probabilities are zeroed so a training step is deterministic.
"""

from __future__ import annotations

import torch

H, I, V, L, HEADS = 32, 64, 128, 2, 4


def _configs():
    import transformers as T

    llama_like = dict(
        vocab_size=V, hidden_size=H, intermediate_size=I, num_hidden_layers=L, num_attention_heads=HEADS,
        num_key_value_heads=2, max_position_embeddings=64,
    )
    return {
        # family: (config, n_mlp, model class name)
        "llama": (T.LlamaConfig(**llama_like), L, "AutoModelForCausalLM"),
        "mistral": (T.MistralConfig(**llama_like), L, "AutoModelForCausalLM"),
        "qwen2": (T.Qwen2Config(**llama_like), L, "AutoModelForCausalLM"),
        "qwen3": (T.Qwen3Config(**llama_like, head_dim=8), L, "AutoModelForCausalLM"),
        "gemma": (T.GemmaConfig(**llama_like, head_dim=8), L, "AutoModelForCausalLM"),
        "gemma2": (T.Gemma2Config(**llama_like, head_dim=8), L, "AutoModelForCausalLM"),
        "phi3": (T.Phi3Config(**llama_like, pad_token_id=0), L, "AutoModelForCausalLM"),
        "gpt_neox": (
            T.GPTNeoXConfig(vocab_size=V, hidden_size=H, intermediate_size=I, num_hidden_layers=L,
                            num_attention_heads=HEADS, max_position_embeddings=64),
            L, "AutoModelForCausalLM",
        ),
        "gpt2": (
            T.GPT2Config(vocab_size=V, n_embd=H, n_layer=L, n_head=HEADS, n_positions=64,
                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
            L, "AutoModelForCausalLM",
        ),
        "bert": (
            T.BertConfig(vocab_size=V, hidden_size=H, intermediate_size=I, num_hidden_layers=L,
                         num_attention_heads=HEADS, max_position_embeddings=64,
                         hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0),
            L, "AutoModel",
        ),
        "opt": (
            T.OPTConfig(vocab_size=V, hidden_size=H, ffn_dim=I, num_hidden_layers=L, num_attention_heads=HEADS,
                        word_embed_proj_dim=H, max_position_embeddings=64, dropout=0.0, attention_dropout=0.0),
            L, "AutoModelForCausalLM",
        ),
        "starcoder2": (
            T.Starcoder2Config(**llama_like, residual_dropout=0.0, embedding_dropout=0.0), L, "AutoModelForCausalLM",
        ),
        "falcon": (
            T.FalconConfig(vocab_size=V, hidden_size=H, num_hidden_layers=L, num_attention_heads=HEADS,
                           hidden_dropout=0.0, attention_dropout=0.0),
            L, "AutoModelForCausalLM",
        ),
        "bloom": (
            T.BloomConfig(vocab_size=V, hidden_size=H, n_layer=L, n_head=HEADS, hidden_dropout=0.0,
                          attention_dropout=0.0),
            L, "AutoModelForCausalLM",
        ),
        "gptj": (
            T.GPTJConfig(vocab_size=V, n_embd=H, n_layer=L, n_head=HEADS, rotary_dim=4, n_positions=64,
                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
            L, "AutoModelForCausalLM",
        ),
        # multi-head latent attention and a MoE layer whose shared experts are one gated MLP beside the routed
        # experts (mlp_fuser::moe_mlp): layer 0 dense, layer 1 MoE
        "deepseek_v3": (
            T.DeepseekV3Config(**{**llama_like, "num_key_value_heads": HEADS}, q_lora_rank=16, kv_lora_rank=16,
                               qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, n_routed_experts=4,
                               num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1,
                               moe_intermediate_size=32, n_shared_experts=1),
            L, "AutoModelForCausalLM",
        ),
        "mt5": (
            T.MT5Config(vocab_size=V, d_model=H, d_kv=8, d_ff=I, num_layers=1, num_decoder_layers=1, num_heads=HEADS,
                        dropout_rate=0.0, feed_forward_proj="gated-gelu", decoder_start_token_id=0),
            2, "AutoModelForSeq2SeqLM",
        ),
        "t5": (
            T.T5Config(vocab_size=V, d_model=H, d_kv=8, d_ff=I, num_layers=1, num_decoder_layers=1, num_heads=HEADS,
                       dropout_rate=0.0, feed_forward_proj="relu", decoder_start_token_id=0),
            2, "AutoModelForSeq2SeqLM",
        ),
    }


FAMILIES = ["llama", "mistral", "qwen2", "gemma", "phi3", "gpt_neox", "gpt2", "bert", "opt"]
EXTRA_FAMILIES = ["qwen3", "gemma2", "starcoder2", "falcon", "bloom", "gptj", "deepseek_v3", "mt5", "t5"]


def build(family: str, batch: int = 2, seq: int = 7, seed: int = 0):
    import transformers as T

    cfg, n_mlp, cls = _configs()[family]
    cfg._attn_implementation = "sdpa" if family not in ("gpt2", "bloom", "gptj", "falcon") else "eager"
    torch.manual_seed(seed)
    model = getattr(T, cls).from_config(cfg).float().eval()
    g = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(1, V, (batch, seq), generator=g)
    inputs = {"input_ids": ids}
    if cls == "AutoModelForSeq2SeqLM":
        inputs["decoder_input_ids"] = torch.randint(1, V, (batch, seq - 2), generator=g)
    return model, inputs, n_mlp


_FUSED_OPS = frozenset({"mlp_fuser::mlp", "mlp_fuser::gated_mlp"})


def count_ops(fn, ops: frozenset | None = _FUSED_OPS) -> int:
    """Calls of the fused MLP ops (``mlp_fuser::mlp``, ``mlp_fuser::gated_mlp``; ``ops=None``: every ``mlp_fuser::``
    op, the backward's too) during ``fn()``, counted with torch.profiler. A call that redispatches to itself (the
    autocast kernel casts, then calls the op again) is one call: only outermost events count."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()

    def nested(e):
        p = e.cpu_parent
        while p is not None:
            if p.name.startswith("mlp_fuser::"):
                return True
            p = p.cpu_parent
        return False

    return sum(1 for e in prof.events() if (e.name in ops if ops is not None else e.name.startswith("mlp_fuser::"))
               and not nested(e))


def main_output(out) -> torch.Tensor:
    """The tensor to compare: logits, or the last hidden state of a bare encoder."""
    return out.logits if getattr(out, "logits", None) is not None else out.last_hidden_state
