#!/usr/bin/env python
"""Train the ``demo`` preset: a small Llama that writes English about Python.

Random weights print noise, and noise hides bugs (a broken KV cache looks the same as a working
one). This script trains a ~4M-parameter Llama-architecture model, with its own byte-level BPE
tokenizer, on text that ships with Python itself (the prose of the standard library's
``pydoc_data`` topics, ~240 kB of its ~470 kB), within a wall-clock budget on CPU, and writes a complete HF checkpoint (safetensors
in bfloat16, under 10 MB) to ``autodeploy/models/demo``.

    python scripts/train_demo_model.py                 # ~12 minutes on 2 cores
    python scripts/train_demo_model.py --minutes 1 --out /tmp/demo   # a quick smoke run
"""

import argparse
import json
import math
import os
import random
import re
import sys
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from autodeploy.models.tokenizer import pydoc_corpus, save_tokenizer, special_token_ids, train_bpe_tokenizer  # noqa: E402

_MARKUP = re.compile(r"[|+]-{3,}|^[=*\-~^]{4,}$|::=")


def prose_corpus() -> list:
    """The pydoc topics without what greedy decoding would get stuck in: indented code and
    grammar blocks, tables and underlines. Paragraphs are unwrapped to single lines."""
    docs = []
    for text in pydoc_corpus():
        kept = [
            line for line in text.splitlines()
            if not line.startswith("   ") and not _MARKUP.search(line) and not line.strip().startswith("|")
        ]
        paragraphs = [" ".join(p.split()) for p in re.split(r"\n\s*\n", "\n".join(kept))]
        docs.append("\n\n".join(p for p in paragraphs if p))
    return docs

CONFIG = dict(
    hidden_size=256,
    intermediate_size=704,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    vocab_size=4096,
    max_position_embeddings=512,
    rope_theta=10000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
)


def encode_corpus(tok, docs) -> torch.Tensor:
    """All topics, each as BOS + text + EOS, concatenated into one token stream."""
    eos = tok.token_to_id("</s>")
    ids = []
    for text in docs:
        ids.extend(tok.encode(text).ids + [eos])  # encode adds the BOS
    return torch.tensor(ids, dtype=torch.long)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.path.join(REPO, "autodeploy", "models", "demo"))
    parser.add_argument("--minutes", type=float, default=12.0, help="wall-clock training budget")
    parser.add_argument("--steps", type=int, default=None, help="fixed number of steps (overrides --minutes)")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    args = parser.parse_args()

    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(args.seed)
    random.seed(args.seed)
    torch.set_num_threads(args.threads)
    start = time.time()

    docs = prose_corpus()
    tok = train_bpe_tokenizer(CONFIG["vocab_size"], docs)
    data = encode_corpus(tok, docs)
    ids = special_token_ids(tok)
    print(f"corpus: {len(data)} tokens, vocab {tok.get_vocab_size()}", flush=True)

    config = LlamaConfig(**CONFIG, **ids)
    model = LlamaForCausalLM(config)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params / 1e6:.2f}M parameters", flush=True)

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    seq = args.seq_len

    def batch() -> torch.Tensor:
        starts = torch.randint(0, len(data) - seq - 1, (args.batch_size,))
        return torch.stack([data[s : s + seq + 1] for s in starts.tolist()])

    def train_step(step: int, total: int) -> float:
        warmup = max(1, total // 20)
        lr = args.lr * min(1.0, (step + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / total)))
        for group in opt.param_groups:
            group["lr"] = lr
        x = batch()
        logits = model(input_ids=x[:, :-1], use_cache=False).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return loss.item()

    model.train()
    budget = args.minutes * 60 - (time.time() - start) - 20  # keep time to save and sample
    probe = time.time()
    losses = [train_step(0, 1000)]
    step_time = time.time() - probe
    total = args.steps or max(2, int(budget / max(step_time, 1e-3)))
    print(f"{step_time:.2f} s/step -> {total} steps", flush=True)
    for step in range(1, total):
        losses.append(train_step(step, total))
        if step % 25 == 0 or step == total - 1:
            avg = sum(losses[-25:]) / len(losses[-25:])
            print(f"step {step}/{total} loss {avg:.3f} ({time.time() - start:.0f} s)", flush=True)
    model.eval()

    os.makedirs(args.out, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(args.out)
    GenerationConfig(do_sample=False, max_new_tokens=64, **ids).save_pretrained(args.out)
    save_tokenizer(tok, args.out, model_max_length=CONFIG["max_position_embeddings"])
    with open(os.path.join(args.out, "TRAINING.json"), "w") as f:
        json.dump({"steps": total, "final_loss": sum(losses[-25:]) / len(losses[-25:]), "parameters": n_params,
                   "seq_len": seq, "batch_size": args.batch_size, "lr": args.lr, "seed": args.seed,
                   "minutes": round((time.time() - start) / 60, 2), "corpus_tokens": len(data),
                   "torch": torch.__version__}, f, indent=2)

    prompt = torch.tensor([tok.encode("The for statement").ids])
    with torch.no_grad():
        out = model.float().generate(prompt, max_new_tokens=40, do_sample=False)
    print("sample:", tok.decode(out[0].tolist(), skip_special_tokens=True), flush=True)
    size = sum(os.path.getsize(os.path.join(args.out, f)) for f in os.listdir(args.out))
    print(f"wrote {args.out} ({size / 2**20:.1f} MiB) in {(time.time() - start) / 60:.1f} min", flush=True)


if __name__ == "__main__":
    main()
