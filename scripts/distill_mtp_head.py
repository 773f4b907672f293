"""Fine-tune the default model's MTP head on the base model's own greedy text (self-distillation).

Speculative decoding emits exactly the greedy tokens, so a draft head pays in proportion to
how often it predicts *what the base model will say*, not what the corpus says. The head was
trained jointly with the base on the corpus (``train_default_model.py``); this script keeps
the base frozen and fine-tunes only the head on sequences the base generated greedily from
prompts cut out of the training files (the held-out validation files and the bench's
prompts are not used), then writes the new weights into the head's ONNX file in place (same
graph, same fp16 storage). The verdict is the acceptance of MTP drafts on held-out prompts,
measured with the runtime itself before and after.

    python scripts/distill_mtp_head.py                     # distill, evaluate, write
    python scripts/distill_mtp_head.py --evaluate-only     # acceptance of the current head

Needs torch (the test extra) and onnxruntime; CPU only, deterministic for a seed.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import torch
import torch.nn.functional as F
from onnx import numpy_helper

sys.path.insert(0, str(Path(__file__).resolve().parent))
from default_model_mtp import MTPConfig, MTPHead  # noqa: E402
from train_default_model import stdlib_files  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
MODEL = REPO / "onnx_genrt" / "models" / "default"
# The head's parameters by their names in the exported ONNX file (matrices stored as fp16).
NORMS = ("hidden_norm", "embed_norm", "mlp_norm", "final_norm")
MATRICES = ("proj", "gate_proj", "up_proj", "down_proj")
# Prompts the bench, README and tests use: never distilled on.
HELD_OUT_PROMPTS = (
    "    def __init__(self",
    "def ",
    "import os\n",
    "class Node:\n",
    "    for i in range(",
    "if __name__ == '__main__':\n",
    "    return ",
    "    with open(path) as f:\n",
)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def load_head(path: Path) -> tuple[MTPHead, torch.Tensor, onnx.ModelProto]:
    """The head as a torch module, the tied embedding (fp16 values) and the ONNX model."""
    model = onnx.load(str(path))
    inits = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    embed = torch.from_numpy(inits["embed_fp16"].astype(np.float32))
    inter = inits["gate_proj_fp16"].shape[0]
    head = MTPHead(MTPConfig(hidden_size=embed.shape[1], intermediate_size=inter))
    with torch.no_grad():
        for name in NORMS:
            getattr(head, name).weight.copy_(torch.from_numpy(inits[f"head.{name}.weight"]))
        for name in MATRICES:
            w = inits[f"{name}_fp16"].astype(np.float32)
            getattr(head, name).weight.copy_(torch.from_numpy(w))
    return head, embed, model


def write_head(model: onnx.ModelProto, head: MTPHead, path: Path) -> None:
    """Replace the head's initializers in ``model`` (same names, dtypes, shapes) and save."""
    values: dict[str, np.ndarray] = {}
    for name in NORMS:
        values[f"head.{name}.weight"] = getattr(head, name).weight.detach().numpy()
    for name in MATRICES:
        values[f"{name}_fp16"] = getattr(head, name).weight.detach().numpy()
    for init in model.graph.initializer:
        if init.name in values:
            old = numpy_helper.to_array(init)
            new = values[init.name].astype(old.dtype)
            if new.shape != old.shape:
                raise SystemExit(f"{init.name}: shape {new.shape} != {old.shape}")
            init.CopyFrom(numpy_helper.from_array(new, init.name))
    onnx.checker.check_model(model)
    onnx.save_model(model, str(path))


def training_prompts(tokenizer, count: int, val_every: int, seed: int) -> list[list[int]]:
    """Windows of 8-48 tokens from the training files (every ``val_every``-th file, the
    validation split of ``train_default_model.py``, is left out)."""
    root, files = stdlib_files()
    train = [f for i, f in enumerate(files) if i % val_every != 0]
    rng = random.Random(seed)
    prompts: list[list[int]] = []
    while len(prompts) < count:
        text = rng.choice(train).read_text(encoding="utf-8", errors="replace")
        ids = tokenizer.encode(text)
        length = rng.randint(8, 48)
        if len(ids) <= length + 1:
            continue
        start = rng.randrange(0, len(ids) - length)
        window = ids[start : start + length]
        if tokenizer.decode(window) in HELD_OUT_PROMPTS:
            continue
        prompts.append(window)
    return prompts


def eval_prompts(tokenizer, count: int, val_every: int, seed: int) -> list[list[int]]:
    """The held-out prompts and windows from the validation files."""
    root, files = stdlib_files()
    val = [f for i, f in enumerate(files) if i % val_every == 0]
    rng = random.Random(seed + 1)
    out = [tokenizer.encode(p) for p in HELD_OUT_PROMPTS]
    while len(out) < count:
        ids = tokenizer.encode(rng.choice(val).read_text(encoding="utf-8", errors="replace"))
        if len(ids) > 40:
            start = rng.randrange(0, len(ids) - 32)
            out.append(ids[start : start + rng.randint(8, 32)])
    return out


def greedy_sequences(model, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """Each prompt followed by the base model's greedy continuation (the runtime's CPU path)."""
    from onnx_genrt.engine import Generator, GeneratorParams

    seqs = []
    for i, ids in enumerate(prompts):
        params = GeneratorParams(model)
        params.set_search_options(max_length=len(ids) + new_tokens)
        with Generator(model, params) as gen:
            gen.eos = set()
            gen.append_tokens(ids)
            while not gen.is_done():
                gen.generate_next_token()
            seqs.append(list(gen.tokens))
        if (i + 1) % 50 == 0:
            log(f"generated {i + 1}/{len(prompts)} sequences")
    return seqs


def hidden_states(folder: Path, seqs: list[list[int]], head_size: int, kv_heads: int):
    """The base's final hidden states for every position of each sequence (onnxruntime)."""
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    sess = ort.InferenceSession(str(folder / "model.onnx"), opts, ["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    past = {
        i.name: np.zeros((1, kv_heads, 0, head_size), np.float32)
        for i in sess.get_inputs()
        if i.name.startswith("past_key_values")
    }
    out = []
    for ids in seqs:
        x = np.asarray([ids], np.int64)
        res = sess.run(None, {**past, "input_ids": x, "attention_mask": np.ones_like(x)})
        out.append(res[names.index("hidden_states")][0])
    return out


def examples(seqs, hiddens, prompt_lengths, depth: int):
    """(h_t, x_{t+1}, targets x_{t+2..t+1+depth}) for each position of the generated part."""
    hs, nxt, tgt = [], [], []
    for ids, h, p in zip(seqs, hiddens, prompt_lengths, strict=True):
        for t in range(p - 1, len(ids) - 1 - depth):
            hs.append(h[t])
            nxt.append(ids[t + 1])
            tgt.append(ids[t + 2 : t + 2 + depth])
    return (
        torch.from_numpy(np.stack(hs).astype(np.float32)),
        torch.tensor(nxt, dtype=torch.long),
        torch.tensor(tgt, dtype=torch.long),
    )


def chained_logits(head: MTPHead, embed: torch.Tensor, h, nxt, tgt, depth: int):
    """Logits of each chained depth, feeding the head its own hidden state and the true
    (greedy) token, as the speculative chain does when the drafts so far are right."""
    out = []
    token = nxt
    for d in range(depth):
        h = head(h, F.embedding(token, embed))
        out.append(h @ embed.t())
        token = tgt[:, d]
    return out


def distill(head, embed, data, depth: int, steps: int, batch: int, lr: float, seed: int):
    torch.manual_seed(seed)
    h, nxt, tgt = data
    weights = [1.0, 0.7, 0.5, 0.35][:depth]
    opt = torch.optim.AdamW(head.parameters(), lr=lr, weight_decay=0.0)
    head.train()
    for step in range(steps):
        idx = torch.randint(0, h.shape[0], (batch,))
        logits = chained_logits(head, embed, h[idx], nxt[idx], tgt[idx], depth)
        loss = sum(
            w * F.cross_entropy(lg, tgt[idx, d])
            for d, (w, lg) in enumerate(zip(weights, logits, strict=True))
        )
        for group in opt.param_groups:
            group["lr"] = lr * min(1.0, (step + 1) / 50) * 0.5 * (1 + np.cos(np.pi * step / steps))
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 200 == 0 or step == steps - 1:
            with torch.no_grad():
                acc = [
                    (lg.argmax(-1) == tgt[idx, d]).float().mean().item()
                    for d, lg in enumerate(logits)
                ]
            log(f"step {step}: loss {loss.item():.3f}, top-1 by depth {[round(a, 3) for a in acc]}")
    head.eval()
    head.round_to_fp16()


def acceptance(folder: Path, prompts: list[list[int]], new_tokens: int, k: int) -> dict:
    """MTP acceptance with the runtime (greedy, CPU) over ``prompts``."""
    from onnx_genrt.engine import GeneratorParams, Model
    from onnx_genrt.engine.api import make_proposer
    from onnx_genrt.engine.speculative import SpeculativeGenerator

    model = Model(folder, "cpu")
    proposed = accepted = steps = tokens = 0
    readme = None
    for ids in prompts:
        params = GeneratorParams(model)
        params.set_search_options(max_length=len(ids) + new_tokens)
        gen = SpeculativeGenerator(
            model, params, make_proposer(model, "mtp", len(ids) + new_tokens), k
        )
        gen.eos = set()
        gen.append_tokens(ids)
        while not gen.is_done():
            gen.generate_next_token()
        s = gen.spec
        proposed, accepted, steps = (
            proposed + s.proposed,
            accepted + s.accepted,
            steps + s.verify_steps,
        )
        tokens += len(gen.tokens) - len(ids)
        if readme is None:
            readme = round(s.mean_accepted, 3)
        gen.close()
    return {
        "acceptance": round(accepted / max(proposed, 1), 4),
        "tokens_per_verify": round(tokens / max(steps, 1), 3),
        "readme_prompt_mean_accepted": readme,
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=MODEL, help="model folder (default: embedded)")
    p.add_argument("--prompts", type=int, default=400, help="training prompts")
    p.add_argument("--new-tokens", type=int, default=96, help="greedy tokens per prompt")
    p.add_argument("--eval-prompts", type=int, default=24)
    p.add_argument("--depth", type=int, default=3, help="chained depths trained (k)")
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--val-every", type=int, default=40, help="as train_default_model.py")
    p.add_argument("--evaluate-only", action="store_true")
    p.add_argument("--dry-run", action="store_true", help="distill and evaluate, write nothing")
    args = p.parse_args(argv)
    torch.set_num_threads(1)

    from onnx_genrt.engine import Model

    folder = args.model.resolve()
    path = folder / "mtp" / "model.onnx"
    model = Model(folder, "cpu")
    tok = model.tokenizer
    evals = eval_prompts(tok, args.eval_prompts, args.val_every, args.seed)
    before = acceptance(folder, evals, args.new_tokens, args.depth)
    log(f"before: {before}")
    if args.evaluate_only:
        return
    prompts = training_prompts(tok, args.prompts, args.val_every, args.seed)
    seqs = greedy_sequences(model, prompts, args.new_tokens)
    cfg = model.config
    hiddens = hidden_states(folder, seqs, cfg.head_size, cfg.num_kv_heads)
    data = examples(seqs, hiddens, [len(x) for x in prompts], args.depth)
    log(f"{data[0].shape[0]} training positions from {len(seqs)} sequences")
    head, embed, onnx_model = load_head(path)
    distill(head, embed, data, args.depth, args.steps, args.batch, args.lr, args.seed)
    if args.dry_run:
        return
    write_head(onnx_model, head, path)
    after = acceptance(folder, evals, args.new_tokens, args.depth)
    log(f"after: {after} (before: {before}); wrote {path}")


if __name__ == "__main__":
    main()
