"""Train and export the embedded default model of onnx-genrt (CPU only, deterministic).

Stages (``--stages``, default all, in this order):

* ``corpus``    the Python stdlib's own *.py source, held-out validation split by file
* ``tokenizer`` byte-level BPE (``<|endoftext|>`` = id 0: eos, pad, document separator)
* ``base``      Qwen2ForCausalLM + MTP head trained jointly (CE_next + w1*CE_mtp + w2*CE_mtp2)
* ``draft``     a smaller Qwen2ForCausalLM with the same tokenizer (CE + distillation)
* ``export``    ORT-GenAI builder (base with hidden_states, draft) + torch.onnx MTP export
* ``verify``    ORT / ORT-GenAI checks, greedy samples, MTP and draft acceptance

Checkpoints go to ``--scratch`` (outside the repo); the package folder is ``--out``.
Example: ``python scripts/train_default_model.py`` (about 100 minutes on one CPU thread).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import shutil
import subprocess
import sys
import sysconfig
import time
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("RAYON_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from default_model_mtp import MTPConfig, MTPExport, MTPHead  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
EOT = "<|endoftext|>"
STAGES = ("corpus", "tokenizer", "base", "draft", "export", "verify")
SKIP_PARTS = {"test", "tests", "idlelib", "site-packages"}
MAX_BYTES = 25_000_000


def log(msg: str) -> None:
    """Print a timestamped progress line."""
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ----------------------------------------------------------------------------- corpus


def stdlib_files() -> tuple[Path, list[Path]]:
    """Sorted stdlib *.py files, without tests, idlelib and site-packages."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [
        f
        for f in root.rglob("*.py")
        if not SKIP_PARTS.intersection(f.relative_to(root).parts) and f.is_file()
    ]
    return root, sorted(files, key=lambda f: f.relative_to(root).as_posix())


def build_corpus(scratch: Path, val_every: int) -> dict[str, list[str]]:
    """Read the corpus; every ``val_every``-th file (sorted order) is validation."""
    root, files = stdlib_files()
    split: dict[str, list[str]] = {"train": [], "val": []}
    texts: dict[str, str] = {}
    for i, f in enumerate(files):
        rel = f.relative_to(root).as_posix()
        texts[rel] = f.read_bytes().decode("utf-8", errors="replace")
        split["val" if i % val_every == val_every // 2 else "train"].append(rel)
    manifest = {"stdlib": str(root), "python": sys.version.split()[0], **split}
    (scratch / "corpus.json").write_text(json.dumps(manifest, indent=1))
    corpus = {k: [texts[r] for r in v] for k, v in split.items()}
    nbytes = {k: sum(len(t.encode()) for t in v) for k, v in corpus.items()}
    log(
        f"corpus: {root} train {len(split['train'])} files {nbytes['train']} B, "
        f"val {len(split['val'])} files {nbytes['val']} B"
    )
    return corpus


# ----------------------------------------------------------------------------- tokenizer


def train_tokenizer(train_texts: list[str], vocab_size: int, folder: Path) -> None:
    """Train a byte-level BPE tokenizer and save tokenizer.json + tokenizer_config.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(train_texts, trainer=trainer, length=len(train_texts))
    assert tok.token_to_id(EOT) == 0
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    cfg = {
        "tokenizer_class": "GPT2Tokenizer",
        "bos_token": EOT,
        "eos_token": EOT,
        "pad_token": EOT,
        "unk_token": EOT,
        "add_bos_token": False,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1024,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    log(f"tokenizer: vocab {tok.get_vocab_size()} saved to {folder}")


def encode_corpus(corpus: dict[str, list[str]], tok_dir: Path, scratch: Path) -> None:
    """Encode each split as one stream: doc tokens followed by <|endoftext|>."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    for split, texts in corpus.items():
        ids: list[int] = []
        for enc in tok.encode_batch(texts):
            ids.extend(enc.ids)
            ids.append(0)
        arr = torch.tensor(ids, dtype=torch.int32)
        torch.save(arr, scratch / f"tokens_{split}.pt")
        log(f"tokens {split}: {arr.numel()}")


# ----------------------------------------------------------------------------- training


def qwen2_config(vocab: int, hidden: int, layers: int, heads: int, kv: int, inter: int):
    """A small Qwen2 config with tied embeddings."""
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        max_position_embeddings=1024,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
        attn_implementation="sdpa",
    )


def lr_at(step: int, total: int, lr: float, warmup: int) -> float:
    """Linear warmup then cosine decay to 10% of ``lr``."""
    if step < warmup:
        return lr * (step + 1) / warmup
    p = (step - warmup) / max(1, total - warmup)
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, p))))


def make_optimizer(params: list[torch.nn.Parameter], lr: float) -> torch.optim.Optimizer:
    """AdamW with weight decay on matrices only."""
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8)


def val_windows(val: torch.Tensor, length: int, count: int) -> torch.Tensor:
    """``count`` fixed windows [count, length] spread evenly over the validation stream."""
    n = min(count, val.numel() // length)
    starts = torch.linspace(0, val.numel() - length, n).long().tolist()
    return torch.stack([val[s : s + length] for s in starts]).long()


def run_training(
    name: str,
    modules: list[torch.nn.Module],
    loss_fn: Callable[[torch.Tensor], tuple[torch.Tensor, dict[str, float]]],
    eval_fn: Callable[[], dict[str, float]],
    train: torch.Tensor,
    args: argparse.Namespace,
    steps: int,
    minutes: float,
    window: int,
) -> dict[str, float]:
    """Seeded AdamW loop over random windows; ``minutes`` > 0 sizes ``steps`` by timing."""
    params = [p for m in modules for p in m.parameters()]
    opt = make_optimizer(params, args.lr)
    gen = torch.Generator().manual_seed(args.seed + 1)

    def batch() -> torch.Tensor:
        starts = torch.randint(0, train.numel() - window, (args.batch,), generator=gen)
        return torch.stack([train[s : s + window] for s in starts.tolist()]).long()

    def one_step(step: int, total: int) -> dict[str, float]:
        for g in opt.param_groups:
            g["lr"] = lr_at(step, total, args.lr, args.warmup)
        loss, parts = loss_fn(batch())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        return parts

    if minutes > 0:
        # Time a few steps on throw-away copies, then restore every bit of state.
        saved = [copy.deepcopy(m.state_dict()) for m in modules]
        opt_state, gen_state = copy.deepcopy(opt.state_dict()), gen.get_state()
        one_step(0, 100)
        t0 = time.perf_counter()
        for i in range(3):
            one_step(i + 1, 100)
        dt = (time.perf_counter() - t0) / 3
        for m, s in zip(modules, saved, strict=True):
            m.load_state_dict(s)
        opt.load_state_dict(opt_state)
        gen.set_state(gen_state)
        steps = max(10, int(minutes * 60 / dt))
        log(
            f"{name}: {dt:.3f} s/step ({args.batch * window / dt:.0f} tok/s) -> "
            f"{steps} steps for {minutes} min (reproduce with --{name}-steps {steps})"
        )
    t0 = time.perf_counter()
    hist: dict[str, float] = {}
    for step in range(steps):
        parts = one_step(step, steps)
        for k, v in parts.items():
            hist[k] = 0.98 * hist.get(k, v) + 0.02 * v
        last = step == steps - 1
        if step % args.log_every == 0 or last:
            el = time.perf_counter() - t0
            tps = (step + 1) * args.batch * window / el
            msg = " ".join(f"{k} {v:.3f}" for k, v in hist.items())
            log(
                f"{name} step {step + 1}/{steps} {msg} lr {opt.param_groups[0]['lr']:.2e} "
                f"{tps:.0f} tok/s {el / 60:.1f} min"
            )
        if (step + 1) % args.eval_every == 0 or last:
            with torch.no_grad():
                for m in modules:
                    m.eval()
                ev = eval_fn()
                for m in modules:
                    m.train()
            log(f"{name} eval @ {step + 1}: " + " ".join(f"{k} {v:.3f}" for k, v in ev.items()))
    ev["steps"] = steps
    ev["train_seconds"] = time.perf_counter() - t0
    return ev


def mtp_losses(
    base: torch.nn.Module, mtp: MTPHead, x: torch.Tensor, seq: int
) -> dict[str, torch.Tensor]:
    """CE for next token, MTP depth 1 (t+2) and chained MTP depth 2 (t+3)."""
    inp = x[:, :seq]
    h = base.model(input_ids=inp).last_hidden_state  # post final norm == builder hidden_states
    emb = base.get_input_embeddings()
    w = base.lm_head.weight
    ce = F.cross_entropy(F.linear(h, w).flatten(0, 1), x[:, 1 : seq + 1].flatten())
    h1 = mtp(h, emb(x[:, 1 : seq + 1]))
    ce1 = F.cross_entropy(F.linear(h1, w).flatten(0, 1), x[:, 2 : seq + 2].flatten())
    h2 = mtp(h1, emb(x[:, 2 : seq + 2]))
    ce2 = F.cross_entropy(F.linear(h2, w).flatten(0, 1), x[:, 3 : seq + 3].flatten())
    return {"ce": ce, "mtp1": ce1, "mtp2": ce2}


def train_base(args: argparse.Namespace, vocab: int) -> dict[str, float]:
    """Train base + MTP jointly; save HF checkpoint and MTP head to the scratch folder."""
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(args.seed)
    cfg = qwen2_config(vocab, args.hidden, args.layers, args.heads, args.kv_heads, args.inter)
    base = Qwen2ForCausalLM(cfg).float().train()
    mtp = MTPHead(MTPConfig(args.hidden, args.mtp_inter, cfg.rms_norm_eps)).train()
    nparams = sum(p.numel() for p in base.parameters())
    log(
        f"base: {nparams / 1e6:.2f}M params, mtp {sum(p.numel() for p in mtp.parameters()) / 1e6:.2f}M"
    )
    train = torch.load(args.scratch / "tokens_train.pt")
    val = val_windows(torch.load(args.scratch / "tokens_val.pt"), args.seq + 3, args.val_windows)
    w1, w2 = args.mtp_weight, args.mtp2_weight

    def loss_fn(x: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        ls = mtp_losses(base, mtp, x, args.seq)
        loss = ls["ce"] + w1 * ls["mtp1"] + (w2 * ls["mtp2"] if w2 > 0 else 0.0)
        return loss, {k: v.item() for k, v in ls.items()}

    def eval_fn() -> dict[str, float]:
        tot: dict[str, float] = {}
        for i in range(0, len(val), args.batch):
            for k, v in mtp_losses(base, mtp, val[i : i + args.batch], args.seq).items():
                tot[k] = tot.get(k, 0.0) + v.item() * len(val[i : i + args.batch])
        return {f"val_{k}": v / len(val) for k, v in tot.items()}

    res = run_training(
        "base", [base, mtp], loss_fn, eval_fn, train, args,
        args.base_steps, args.base_minutes, args.seq + 3,
    )  # fmt: skip
    out = args.scratch / "base_hf"
    base.save_pretrained(out)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(args.scratch / "tokenizer" / f, out / f)
    mtp.round_to_fp16()  # the exported file stores fp16 matrices
    mtp.save(args.scratch / "mtp")
    log(f"saved {out} and {args.scratch / 'mtp'}")
    return res


def train_draft(args: argparse.Namespace, vocab: int) -> dict[str, float]:
    """Train the draft model with CE mixed with distillation from the trained base."""
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(args.seed + 7)
    cfg = qwen2_config(
        vocab, args.draft_hidden, args.draft_layers, args.draft_heads, args.draft_kv_heads,
        args.draft_inter,
    )  # fmt: skip
    draft = Qwen2ForCausalLM(cfg).float().train()
    log(f"draft: {sum(p.numel() for p in draft.parameters()) / 1e6:.2f}M params")
    teacher = None
    if args.draft_distill > 0:
        teacher = Qwen2ForCausalLM.from_pretrained(args.scratch / "base_hf").float().eval()
        teacher.requires_grad_(False)
    train = torch.load(args.scratch / "tokens_train.pt")
    val = val_windows(torch.load(args.scratch / "tokens_val.pt"), args.seq + 1, args.val_windows)
    a = args.draft_distill

    def loss_fn(x: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        logits = draft(input_ids=x[:, :-1]).logits.flatten(0, 1)
        ce = F.cross_entropy(logits, x[:, 1:].flatten())
        if teacher is None:
            return ce, {"ce": ce.item()}
        with torch.no_grad():
            t = F.log_softmax(teacher(input_ids=x[:, :-1]).logits.flatten(0, 1), -1)
        kl = F.kl_div(F.log_softmax(logits, -1), t, log_target=True, reduction="batchmean")
        return (1 - a) * ce + a * kl, {"ce": ce.item(), "kl": kl.item()}

    def eval_fn() -> dict[str, float]:
        tot, agree, n = 0.0, 0, 0
        for i in range(0, len(val), args.batch):
            x = val[i : i + args.batch]
            logits = draft(input_ids=x[:, :-1]).logits
            tot += F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten()).item() * len(x)
            if teacher is not None:
                tl = teacher(input_ids=x[:, :-1]).logits
                agree += (logits.argmax(-1) == tl.argmax(-1)).sum().item()
                n += tl.shape[0] * tl.shape[1]
        res = {"val_ce": tot / len(val)}
        if n:
            res["argmax_agree"] = agree / n
        return res

    res = run_training(
        "draft", [draft], loss_fn, eval_fn, train, args,
        args.draft_steps, args.draft_minutes, args.seq + 1,
    )  # fmt: skip
    out = args.scratch / "draft_hf"
    draft.save_pretrained(out)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(args.scratch / "tokenizer" / f, out / f)
    log(f"saved {out}")
    return res


# ----------------------------------------------------------------------------- export


def run_builder(hf: Path, out: Path, cache: Path, precision: str, hidden_states: bool) -> None:
    """Run the ORT-GenAI model builder on a saved HF checkpoint."""
    cmd = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf),
           "-o", str(out), "-p", precision, "-e", "cpu", "-c", str(cache)]  # fmt: skip
    if hidden_states:
        cmd += ["--extra_options", "include_hidden_states=true"]
    log("builder: " + " ".join(cmd))
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        print(r.stdout[-4000:], r.stderr[-4000:])
        raise SystemExit(f"builder failed for {hf}")


def fix_genai_config(folder: Path, tok_dir: Path, hidden_states: bool) -> None:
    """Point eos/pad/bos at <|endoftext|>, name the hidden_states output, use our tokenizer."""
    path = folder / "genai_config.json"
    cfg = json.loads(path.read_text())
    for k in ("bos_token_id", "eos_token_id", "pad_token_id"):
        cfg["model"][k] = 0
    cfg["model"]["context_length"] = 1024
    cfg["search"]["max_length"] = 1024
    if hidden_states:  # a key onnxruntime-genai knows (its own MTP models write it)
        cfg["model"]["decoder"]["outputs"]["hidden_states"] = "hidden_states"
    path.write_text(json.dumps(cfg, indent=4) + "\n")
    for f in folder.iterdir():
        if f.name not in ("genai_config.json", "model.onnx", "model.onnx.data") and f.is_file():
            f.unlink()
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tok_dir / f, folder / f)


def export_mtp(scratch: Path, path: Path) -> None:
    """Export the MTP head (fp16-stored weights cast to fp32) with torch.onnx.export."""
    import onnx
    from transformers import Qwen2ForCausalLM

    base = Qwen2ForCausalLM.from_pretrained(scratch / "base_hf").float().eval()
    head = MTPHead.load(scratch / "mtp")
    wrapper = MTPExport(head, base.get_input_embeddings().weight).eval()
    hs = torch.randn(2, 5, head.cfg.hidden_size)
    ids = torch.randint(0, base.config.vocab_size, (2, 5))
    path.parent.mkdir(parents=True, exist_ok=True)
    batch, seq = torch.export.Dim("batch"), torch.export.Dim("sequence")
    prog = torch.onnx.export(
        wrapper,
        (hs, ids),
        dynamo=True,
        input_names=["hidden_states", "input_ids"],
        output_names=["logits", "mtp_hidden_states"],
        dynamic_shapes={"hidden_states": {0: batch, 1: seq}, "input_ids": {0: batch, 1: seq}},
        opset_version=18,
        optimize=True,
    )
    model = prog.model_proto
    for name, dims in (
        ("hidden_states", ["batch", "sequence"]),
        ("input_ids", ["batch", "sequence"]),
    ):
        vi = next(i for i in model.graph.input if i.name == name)
        for d, n in zip(vi.type.tensor_type.shape.dim[: len(dims)], dims, strict=True):
            d.dim_param = n
    onnx.checker.check_model(model)
    onnx.save_model(model, str(path))
    dtypes = sorted({onnx.TensorProto.DataType.Name(t.data_type) for t in model.graph.initializer})
    ops = sorted({n.op_type for n in model.graph.node})
    log(f"mtp export: {path} ({path.stat().st_size / 1e6:.2f} MB) initializers {dtypes} ops {ops}")


def folder_bytes(folder: Path) -> int:
    """Total size of every file under ``folder``."""
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def export_all(args: argparse.Namespace) -> None:
    """Build base (hidden_states) and draft with the ORT-GenAI builder, export the MTP."""
    out, scratch = args.out, args.scratch
    tok_dir = scratch / "tokenizer"
    stage = scratch / "export"
    shutil.rmtree(stage, ignore_errors=True)
    precision = args.precision
    run_builder(scratch / "base_hf", stage, scratch / "hf_cache", precision, True)
    run_builder(scratch / "draft_hf", stage / "draft", scratch / "hf_cache", "fp32", False)
    spec = {
        "mtp": {
            "filename": "mtp/model.onnx",
            "hidden_states": "hidden_states",
            "inputs": {"hidden_states": "hidden_states", "input_ids": "input_ids"},
            "outputs": {"logits": "logits", "hidden_states": "mtp_hidden_states"},
            # drafts per step: k=3 beat k=4 on CPU and on the H200 with all drafts verified
            # (docs/performance.md)
            "k": 3,
        },
        "draft": {"path": "draft"},
    }
    fix_genai_config(stage, tok_dir, True)
    fix_genai_config(stage / "draft", tok_dir, False)
    # onnxruntime-genai 0.18 rejects unknown keys in genai_config.json (and owns a
    # "speculative" section of its own), so onnx-genrt reads the proposers from
    # speculative.json beside it.
    (stage / "speculative.json").write_text(json.dumps(spec, indent=4) + "\n")
    export_mtp(scratch, stage / "mtp" / "model.onnx")
    size = folder_bytes(stage)
    if size > MAX_BYTES and precision == "fp32":
        log(f"fp32 folder is {size / 1e6:.1f} MB > 25 MB: rebuilding the base as int4")
        args.precision = "int4"
        return export_all(args)
    if size > MAX_BYTES:
        raise SystemExit(f"exported folder is {size} bytes > {MAX_BYTES}")
    (stage / "README.md").write_text(
        "Default model of onnx-genrt, made by scripts/train_default_model.py (see scripts/README.md).\n"
        "Trained from scratch on the Python standard library's source "
        f"(CPython {sys.version.split()[0]}).\n"
        "Base: Qwen2 (ORT-GenAI builder, outputs logits + hidden_states); mtp/: MTP head; "
        "draft/: small Qwen2 draft model.\n"
    )
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(stage, out)
    log(f"exported to {out}: {folder_bytes(out)} bytes")


# ----------------------------------------------------------------------------- verify


def _ort_forward(sess, ids: np.ndarray, head_size: int) -> dict[str, np.ndarray]:
    """One prefill call of a builder model (empty KV cache)."""
    feeds: dict[str, np.ndarray] = {"input_ids": ids, "attention_mask": np.ones_like(ids)}
    for i in sess.get_inputs():
        if i.name.startswith("past_key_values"):
            feeds[i.name] = np.zeros((ids.shape[0], i.shape[1], 0, head_size), np.float32)
    return dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds), strict=True))


def _og_greedy(folder: Path, prompt: str, new_tokens: int) -> tuple[str, list[int]]:
    """Greedy generation with onnxruntime_genai on the exported folder."""
    import onnxruntime_genai as og

    model = og.Model(str(folder))
    tok = og.Tokenizer(model)
    ids = tok.encode(prompt)
    params = og.GeneratorParams(model)
    params.set_search_options(do_sample=False, max_length=len(ids) + new_tokens)
    gen = og.Generator(model, params)
    gen.append_tokens(ids)
    while not gen.is_done():
        gen.generate_next_token()
    seq = list(gen.get_sequence(0))
    return tok.decode(seq), seq


def verify(args: argparse.Namespace) -> dict:
    """Check the exported folder against torch and measure acceptance rates."""
    import onnxruntime as ort
    import onnxruntime_genai as og
    from tokenizers import Tokenizer
    from transformers import Qwen2ForCausalLM

    out, scratch = args.out, args.scratch
    rep: dict = {}
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.inter_op_num_threads = 1
    base_s = ort.InferenceSession(str(out / "model.onnx"), so)
    mtp_s = ort.InferenceSession(str(out / "mtp" / "model.onnx"), so)
    draft_s = ort.InferenceSession(str(out / "draft" / "model.onnx"), so)
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    bh = json.loads((out / "genai_config.json").read_text())["model"]["decoder"]["head_size"]
    dh = json.loads((out / "draft" / "genai_config.json").read_text())["model"]["decoder"][
        "head_size"
    ]
    hf = Qwen2ForCausalLM.from_pretrained(scratch / "base_hf").float().eval()
    head = MTPHead.load(scratch / "mtp")

    # (a) ORT vs torch on a validation prompt.
    val = torch.load(scratch / "tokens_val.pt").long()
    ids = val[:128].view(1, -1).numpy()
    o = _ort_forward(base_s, ids, bh)
    cap: dict[str, torch.Tensor] = {}
    hf.model.norm.register_forward_hook(lambda m, i, r: cap.update(pre=i[0], post=r))
    with torch.no_grad():
        ref = hf(input_ids=torch.from_numpy(ids))
    rep["base_logits_maxabs"] = float(np.abs(o["logits"] - ref.logits.numpy()).max())
    rep["hidden_vs_post_norm_maxabs"] = float(
        np.abs(o["hidden_states"] - cap["post"].numpy()).max()
    )
    rep["hidden_vs_pre_norm_maxabs"] = float(np.abs(o["hidden_states"] - cap["pre"].numpy()).max())
    nxt = val[1:129].view(1, -1).numpy()
    mo_out = mtp_s.run(None, {"hidden_states": o["hidden_states"], "input_ids": nxt})
    mo = dict(zip(["logits", "mtp_hidden_states"], mo_out, strict=True))
    with torch.no_grad():
        e = hf.get_input_embeddings()(torch.from_numpy(nxt))
        h1 = head(torch.from_numpy(o["hidden_states"]), e)
        w = hf.lm_head.weight
        t_logits = F.linear(h1, w).numpy()
        e16 = F.embedding(torch.from_numpy(nxt), w.half().float())
        h16 = head(torch.from_numpy(o["hidden_states"]), e16)
        t16 = F.linear(h16, w.half().float()).numpy()
    rep["mtp_logits_maxabs_vs_torch"] = float(np.abs(mo["logits"] - t_logits).max())
    rep["mtp_logits_maxabs_vs_torch_fp16_embed"] = float(np.abs(mo["logits"] - t16).max())
    rep["mtp_hidden_maxabs_vs_torch_fp16_embed"] = float(
        np.abs(mo["mtp_hidden_states"] - h16.numpy()).max()
    )
    d = _ort_forward(draft_s, ids, dh)
    rep["draft_logits_shape"] = list(d["logits"].shape)

    # ORT-GenAI tokenizer agrees with tokenizers on validation text.
    model = og.Model(str(out))
    og_tok = og.Tokenizer(model)
    sample = tok.decode(val[:2000].tolist(), skip_special_tokens=False).split(EOT)[0]
    rep["og_tokenizer_matches"] = list(og_tok.encode(sample)) == tok.encode(sample).ids
    del model

    # (b) greedy samples through onnxruntime_genai.
    rep["samples"] = {p: _og_greedy(out, p, args.sample_tokens)[0] for p in ("def ", "import os\n")}
    rep["draft_sample"] = _og_greedy(out / "draft", "def ", 60)[0]

    # (c, d) acceptance on validation windows (all through the exported ONNX files).
    seq = args.seq
    wins = val_windows(val, seq, args.accept_windows).numpy()
    n1 = n1g = a1 = a1g = n2g = a2g = nd = ad = 0
    for x in wins:
        x = x[None]
        bo = _ort_forward(base_s, x, bh)
        g = bo["logits"][0].argmax(-1)  # g[t]: base greedy token after x[..t]
        hs = bo["hidden_states"]
        m1l, m1h = mtp_s.run(None, {"hidden_states": hs[:, :-1], "input_ids": x[:, 1:]})
        m1 = m1l[0].argmax(-1)  # predicts x[t+2] from h_t and x[t+1]
        m2l, _ = mtp_s.run(None, {"hidden_states": m1h[:, :-1], "input_ids": x[:, 2:]})
        m2 = m2l[0].argmax(-1)  # predicts x[t+3]
        xs = x[0]
        ok1 = m1 == g[1:]  # vs base greedy at t+2 given the true x[t+1]
        greedy1 = xs[1:] == g[:-1]  # true next token is the greedy one
        n1 += ok1.size
        a1 += int(ok1.sum())
        n1g += int(greedy1.sum())
        a1g += int((ok1 & greedy1).sum())
        # depth 2 on positions where the text follows the greedy path for two tokens
        # and depth 1 was accepted (then the drafted token equals x[t+2]).
        path2 = greedy1[:-1] & (xs[2:] == g[1:-1]) & ok1[:-1]
        n2g += int(path2.sum())
        a2g += int((path2 & (m2 == g[2:])).sum())
        dg = _ort_forward(draft_s, x, dh)["logits"][0].argmax(-1)
        nd += dg.size
        ad += int((dg == g).sum())
    rep["positions"] = int(n1)
    rep["mtp_depth1_accept"] = a1 / n1
    rep["mtp_depth1_accept_on_greedy_path"] = a1g / max(1, n1g)
    rep["greedy_path_positions"] = int(n1g)
    rep["mtp_depth2_accept_given_depth1_on_greedy_path"] = a2g / max(1, n2g)
    rep["depth2_positions"] = int(n2g)
    rep["draft_accept"] = ad / nd
    rep["folder_bytes"] = folder_bytes(out)
    rep["files"] = {
        str(f.relative_to(out)): f.stat().st_size for f in sorted(out.rglob("*")) if f.is_file()
    }
    return rep


# ----------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line flags."""
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--stages", default=",".join(STAGES), help="comma list of " + ",".join(STAGES))
    p.add_argument("--scratch", type=Path, default=Path("/work/scratch/default_model"))
    p.add_argument("--out", type=Path, default=REPO / "onnx_genrt" / "models" / "default")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--val-every", type=int, default=40, help="every Nth file is validation")
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--inter", type=int, default=768)
    p.add_argument("--mtp-inter", type=int, default=512)
    p.add_argument("--mtp-weight", type=float, default=0.3, help="weight of CE_mtp (depth 1)")
    p.add_argument("--mtp2-weight", type=float, default=0.15, help="weight of chained depth 2")
    p.add_argument("--base-steps", type=int, default=2400)
    p.add_argument("--base-minutes", type=float, default=0.0, help=">0: size steps by timing")
    p.add_argument("--draft-hidden", type=int, default=128)
    p.add_argument("--draft-layers", type=int, default=2)
    p.add_argument("--draft-heads", type=int, default=4)
    p.add_argument("--draft-kv-heads", type=int, default=2)
    p.add_argument("--draft-inter", type=int, default=384)
    p.add_argument("--draft-distill", type=float, default=0.5, help="KL-to-base weight (0: CE)")
    p.add_argument("--draft-steps", type=int, default=700)
    p.add_argument("--draft-minutes", type=float, default=0.0, help=">0: size steps by timing")
    p.add_argument("--precision", choices=("fp32", "int4"), default="fp32")
    p.add_argument("--log-every", type=int, default=25)
    p.add_argument("--eval-every", type=int, default=200)
    p.add_argument("--val-windows", type=int, default=32)
    p.add_argument("--accept-windows", type=int, default=32)
    p.add_argument("--sample-tokens", type=int, default=100)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    """Run the requested stages."""
    args = parse_args(argv)
    stages = [s for s in args.stages.split(",") if s]
    unknown = set(stages) - set(STAGES)
    if unknown:
        raise SystemExit(f"unknown stages {sorted(unknown)}")
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    args.scratch.mkdir(parents=True, exist_ok=True)
    times_path = args.scratch / "times.json"
    times = json.loads(times_path.read_text()) if times_path.exists() else {}
    results: dict = {}
    corpus = None
    for stage in STAGES:
        if stage not in stages:
            continue
        t0 = time.perf_counter()
        log(f"== stage {stage}")
        if stage in ("corpus", "tokenizer"):
            corpus = corpus or build_corpus(args.scratch, args.val_every)
        if stage == "tokenizer":
            train_tokenizer(corpus["train"], args.vocab, args.scratch / "tokenizer")
            encode_corpus(corpus, args.scratch / "tokenizer", args.scratch)
        if stage in ("base", "draft"):
            from tokenizers import Tokenizer

            vocab = Tokenizer.from_file(
                str(args.scratch / "tokenizer" / "tokenizer.json")
            ).get_vocab_size()
        if stage == "base":
            results["base"] = train_base(args, vocab)
        elif stage == "draft":
            results["draft"] = train_draft(args, vocab)
        elif stage == "export":
            export_all(args)
        elif stage == "verify":
            results["verify"] = verify(args)
            print(json.dumps(results["verify"], indent=1))
        times[stage] = time.perf_counter() - t0
        times_path.write_text(json.dumps(times, indent=1))
        log(f"== stage {stage} done in {times[stage] / 60:.1f} min")
    for k, v in results.items():
        (args.scratch / f"result_{k}.json").write_text(json.dumps(v, indent=1))
    train_keys = ("corpus", "tokenizer", "base", "draft")
    log(
        f"training wall time (corpus+tokenizer+base+draft): "
        f"{sum(times.get(k, 0) for k in train_keys) / 60:.1f} min; all stages {times}"
    )


if __name__ == "__main__":
    main()
