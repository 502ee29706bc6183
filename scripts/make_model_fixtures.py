"""Writes the PyTorch reference fixtures in tests/fixtures/models/ that ivme's own model
implementations are checked against (loss, logits and every parameter's gradient).

Run it through scripts/make-model-fixtures.sh, which provides the virtual environment. By hand
only, never in CI. For every family it builds a tiny, randomly initialised Hugging Face model in
float32 with eager attention and no dropout, runs one masked batch with labels, calls backward,
and writes:

    <out>/<family>/config.json            the model's config, as save_pretrained writes it
    <out>/<family>/model.safetensors      the weights, as save_pretrained writes them
    <out>/<family>/reference.safetensors  inputs, logits, loss and grad.<parameter name>

and then <out>/README.md with the versions used and the conventions.
Usage: make_model_fixtures.py [--out DIR] [--only llama,bert]
"""

import argparse
import json
import math
import os
import re
import shutil
import sys

import numpy as np
import safetensors
import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import load_file, save_file

VOCAB = 64
BATCH, SEQ = 2, 9
PAD_ID = 0  # the padded positions hold this id; real tokens are drawn from [FIRST_REAL_ID, VOCAB)
MASK_ID = 3  # BERT's [MASK] stand-in
FIRST_REAL_ID = 4
PADDED = 2  # the second sequence is right-padded with this many positions
EXTRA_IGNORED = (0, 5)  # (sequence, position) whose label is -100 though it is not padding
BERT_MASKED = ([1, 4, 7], [2, 3, 5])  # masked positions per sequence (all inside the real tokens)
INIT_STD = 0.2
NORM_NOISE = 0.2  # norm weights become (their init) + N(0, NORM_NOISE^2): around 1 (or 0 for 1 + w norms)
BIAS_NOISE = 0.1  # every bias becomes N(0, BIAS_NOISE^2) instead of zeros
MODEL_BUDGET = 100 * 1024  # bytes per model.safetensors
TOTAL_BUDGET = 2 * 1024 * 1024  # bytes for everything under <out>
SEED = 0
INPUT_SEED = 1234


def decoder_common(**extra):
    """The tiny shape shared by the decoder families."""
    kwargs = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=64,
        initializer_range=INIT_STD,
        attention_dropout=0.0,
        pad_token_id=PAD_ID,
        bos_token_id=1,
        eos_token_id=2,
    )
    kwargs.update(extra)
    return kwargs


LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}

# name -> (config class, model class, config kwargs, kind, notes for the README)
FAMILIES = {
    "llama": (
        "LlamaConfig",
        "LlamaForCausalLM",
        decoder_common(rms_norm_eps=1e-5, tie_word_embeddings=False, rope_parameters=dict(LLAMA3_ROPE)),
        "causal",
        "GQA 4/2, untied lm_head, llama3 RoPE scaling.",
    ),
    "llama_tied": (
        "LlamaConfig",
        "LlamaForCausalLM",
        decoder_common(
            rms_norm_eps=1e-5,
            tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        ),
        "causal",
        "As llama, with lm_head tied to embed_tokens and plain RoPE.",
    ),
    "mistral": (
        "MistralConfig",
        "MistralForCausalLM",
        decoder_common(
            rms_norm_eps=1e-5,
            tie_word_embeddings=False,
            sliding_window=4,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        ),
        "causal",
        "Sliding window 4 in every layer.",
    ),
    "qwen2": (
        "Qwen2Config",
        "Qwen2ForCausalLM",
        decoder_common(
            rms_norm_eps=1e-6,
            tie_word_embeddings=True,
            use_sliding_window=False,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        ),
        "causal",
        "Biases on q/k/v (not o), tied lm_head, no sliding window.",
    ),
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        decoder_common(
            rms_norm_eps=1e-6,
            tie_word_embeddings=True,
            hidden_activation="gelu_pytorch_tanh",
            query_pre_attn_scalar=8,
            attn_logit_softcapping=50.0,
            final_logit_softcapping=30.0,
            sliding_window=4,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        ),
        "causal",
        "RMSNorm scales by (1 + weight); embeddings times sqrt(hidden); four norms per layer; "
        "attention and final logit soft-capping; sliding window 4 on layer 0 only (layer_types). "
        "The attention scores stay small, so attention soft-capping moves the logits only a little "
        "(see below): compare logits to about 1e-4 or tighter to catch its absence.",
    ),
    "phi3": (
        "Phi3Config",
        "Phi3ForCausalLM",
        {
            # Phi3Config has no head_dim field: it is hidden_size / num_attention_heads = 8.
            **{k: v for k, v in decoder_common().items() if k != "head_dim"},
            "rms_norm_eps": 1e-5,
            "tie_word_embeddings": False,
            "resid_pdrop": 0.0,
            "embd_pdrop": 0.0,
            "original_max_position_embeddings": 64,
            "sliding_window": None,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        },
        "causal",
        "Fused qkv_proj (rows: q, then k, then v) and gate_up_proj (rows: gate, then up); no RoPE scaling.",
    ),
    "bert": (
        "BertConfig",
        "BertForMaskedLM",
        dict(
            vocab_size=VOCAB,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=48,
            hidden_act="gelu",
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            max_position_embeddings=64,
            type_vocab_size=2,
            initializer_range=INIT_STD,
            pad_token_id=PAD_ID,
        ),
        "mlm",
        "Post-norm encoder, absolute position and token type embeddings, MLM head "
        "(dense + gelu + LayerNorm + decoder tied to the word embeddings, with its own bias). "
        "The attention key biases' gradients are ~0 (about 1e-8: softmax ignores a constant added "
        "to a query's scores), so compare gradients with an absolute tolerance too.",
    ),
}


def build(family, overrides=None):
    config_cls, model_cls, kwargs, _, _ = FAMILIES[family]
    kwargs = json.loads(json.dumps(kwargs))  # deep copy
    kwargs.update(overrides or {})
    config = getattr(transformers, config_cls)(attn_implementation="eager", **kwargs)
    model = getattr(transformers, model_cls)(config).to(torch.float32)
    assert model.config._attn_implementation == "eager", model.config._attn_implementation
    return model


def check_no_dropout(model):
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Dropout):
            assert module.p == 0.0, f"dropout {name} has p={module.p}"
    for key, value in model.config.to_dict().items():
        if ("dropout" in key or "pdrop" in key) and isinstance(value, (int, float)):
            assert value == 0, f"config.{key} = {value}"


@torch.no_grad()
def perturb(model, generator):
    """Moves norm weights away from their init and gives every bias random values, so that a
    missing norm weight, norm bias or linear bias shows up in the logits and gradients."""
    for module in model.modules():
        if "Norm" in type(module).__name__ and getattr(module, "weight", None) is not None:
            w = module.weight
            w.add_(NORM_NOISE * torch.randn(w.shape, generator=generator))
    for name, p in model.named_parameters():
        if name.endswith("bias"):
            p.copy_(BIAS_NOISE * torch.randn(p.shape, generator=generator))


def make_inputs(kind):
    g = torch.Generator().manual_seed(INPUT_SEED)
    input_ids = torch.randint(FIRST_REAL_ID, VOCAB, (BATCH, SEQ), generator=g, dtype=torch.int64)
    attention_mask = torch.ones(BATCH, SEQ, dtype=torch.int64)
    attention_mask[1, SEQ - PADDED :] = 0
    input_ids[1, SEQ - PADDED :] = PAD_ID
    if kind == "causal":
        labels = input_ids.clone()
        labels[attention_mask == 0] = -100
        labels[EXTRA_IGNORED] = -100
    else:
        labels = torch.full_like(input_ids, -100)
        for seq, positions in enumerate(BERT_MASKED):
            for pos in positions:
                assert attention_mask[seq, pos] == 1
                labels[seq, pos] = input_ids[seq, pos]
                input_ids[seq, pos] = MASK_ID
    inputs = {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}
    if kind == "mlm":
        inputs["token_type_ids"] = torch.zeros(BATCH, SEQ, dtype=torch.int64)
    return inputs


def forward(model, inputs, kind, with_mask=True, with_labels=True):
    args = {"input_ids": inputs["input_ids"]}
    if with_mask:
        args["attention_mask"] = inputs["attention_mask"]
    if with_labels:
        args["labels"] = inputs["labels"]
    if kind == "mlm":
        args["token_type_ids"] = inputs["token_type_ids"]
    else:
        args["use_cache"] = False
    return model(**args)


def manual_loss(logits, labels, kind):
    if kind == "causal":
        logits, labels = logits[:, :-1], labels[:, 1:]
    return F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), ignore_index=-100)


def max_diff_real(a, b, mask):
    """Largest |a - b| over the positions the attention mask keeps."""
    keep = mask.bool()
    return (a[keep] - b[keep]).abs().max().item()


def variant_diff(family, model, inputs, kind, overrides):
    """Logits' largest change (over real positions) when the config is changed by `overrides`
    and the same weights are loaded."""
    other = build(family, overrides)
    other.load_state_dict(model.state_dict())
    other.train(model.training)
    with torch.no_grad():
        a = forward(model, inputs, kind, with_labels=False).logits
        b = forward(other, inputs, kind, with_labels=False).logits
    return max_diff_real(a, b, inputs["attention_mask"])


def family_checks(family, model, inputs, kind, logits, logits_nomask):
    """Checks that the features each fixture is meant to exercise change its numbers; returns
    lines for the README."""
    notes = []
    mask = inputs["attention_mask"]
    if kind == "causal":
        # Right padding only hides keys after the real tokens, which causality hides anyway.
        d = max_diff_real(logits, logits_nomask, mask)
        assert d < 1e-5, f"{family}: right padding changed real positions' logits by {d}"
    else:
        d = max_diff_real(logits, logits_nomask, mask)
        assert d > 1e-3, f"{family}: the attention mask had no effect ({d})"
        notes.append(f"`logits_nomask` differs from `logits` by up to {d:.3g} on real positions.")

    if family == "llama":
        dim = model.config.head_dim
        plain = 1.0 / (10000.0 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        scaled = model.model.rotary_emb.inv_freq.detach().float()
        changed = [i for i in range(len(plain)) if not torch.isclose(plain[i], scaled[i], rtol=1e-6)]
        assert changed, "llama3 scaling changed no frequency"
        rows = ", ".join(
            f"i={i}: {plain[i].item():.6g} -> {scaled[i].item():.6g}" for i in range(len(plain))
        )
        wavelengths = ", ".join(f"{2 * math.pi / f:.4g}" for f in plain.tolist())
        notes.append(
            f"llama3 RoPE scaling, inverse frequencies (head_dim {dim}): {rows}. "
            f"Unscaled wavelengths are {wavelengths}; with original_max_position_embeddings 16 "
            "those above 16 (low_freq_factor 1) are divided by factor 8, those below 4 "
            "(high_freq_factor 4) are kept, and those between are interpolated. "
            f"Changed indices: {changed}."
        )
        d = variant_diff(family, model, inputs, kind, {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}})
        assert d > 1e-3, f"llama: rope scaling had no effect on logits ({d})"
        notes.append(f"Without the scaling the logits change by up to {d:.3g}.")
    if family == "mistral":
        d = variant_diff(family, model, inputs, kind, {"sliding_window": None})
        assert d > 1e-3, f"mistral: sliding window had no effect ({d})"
        notes.append(f"With sliding_window None instead of 4 the logits change by up to {d:.3g}.")
    if family == "qwen2":
        assert model.config.sliding_window is None, model.config.sliding_window
        assert all(t == "full_attention" for t in model.config.layer_types), model.config.layer_types
    if family == "gemma2":
        assert model.config.layer_types == ["sliding_attention", "full_attention"], model.config.layer_types
        for overrides, what in (
            ({"sliding_window": 64}, "sliding_window 64 (no effect at 9 tokens) instead of 4"),
            ({"attn_logit_softcapping": None}, "no attention soft-capping"),
            ({"final_logit_softcapping": None}, "no final soft-capping"),
        ):
            d = variant_diff(family, model, inputs, kind, overrides)
            assert d > 1e-4, f"gemma2: {what} made no difference ({d})"
            notes.append(f"With {what} the logits change by up to {d:.3g}.")
        notes.append(
            f"Logits before final soft-capping reach |x| <= {30.0 * torch.atanh(logits.abs().max() / 30.0).item():.3g}."
        )
    return notes


def collapse_layers(names):
    out = []
    for n in names:
        n = re.sub(r"\.(layers|layer)\.\d+\.", r".\1.{i}.", n)
        if n not in out:
            out.append(n)
    return out


def make_family(family, out_dir, versions):
    _, model_cls, _, kind, note = FAMILIES[family]
    torch.manual_seed(SEED)
    model = build(family)
    perturb(model, torch.Generator().manual_seed(SEED + 1))
    check_no_dropout(model)
    model.train()  # no dropout is active (checked), so train mode computes the same as eval
    for name, p in model.named_parameters():
        assert p.dtype == torch.float32 and p.requires_grad, name

    inputs = make_inputs(kind)
    model.zero_grad(set_to_none=True)
    out = forward(model, inputs, kind)
    loss, logits = out.loss, out.logits
    assert logits.dtype == torch.float32 and logits.shape == (BATCH, SEQ, VOCAB), logits.shape
    ref = manual_loss(logits.detach(), inputs["labels"], kind)
    assert torch.allclose(loss.detach(), ref, rtol=1e-6, atol=1e-6), (loss.item(), ref.item())
    loss.backward()
    with torch.no_grad():
        logits_nomask = forward(model, inputs, kind, with_mask=False, with_labels=False).logits

    tensors = {k: v.contiguous() for k, v in inputs.items()}
    tensors["logits"] = logits.detach().contiguous()
    tensors["logits_nomask"] = logits_nomask.detach().contiguous()
    tensors["loss"] = loss.detach().reshape(1).contiguous()
    names = []
    for name, p in model.named_parameters():
        assert p.grad is not None, f"{family}: no gradient for {name}"
        assert torch.isfinite(p.grad).all(), name
        tensors[f"grad.{name}"] = p.grad.detach().float().contiguous()
        names.append(name)
    notes = family_checks(family, model, inputs, kind, tensors["logits"], tensors["logits_nomask"])

    target = os.path.join(out_dir, family)
    if os.path.isdir(target):
        shutil.rmtree(target)
    os.makedirs(target)
    model.save_pretrained(target, safe_serialization=True)
    gen = os.path.join(target, "generation_config.json")
    if os.path.exists(gen):
        os.remove(gen)  # not needed; keeps the folder to the three files
    metadata = {
        "family": family,
        "model_class": model_cls,
        "torch": versions["torch"],
        "transformers": versions["transformers"],
        "label_shift": "inside the model (causal LM)" if kind == "causal" else "none (masked LM)",
        "ignore_index": "-100",
    }
    save_file(tensors, os.path.join(target, "reference.safetensors"), metadata=metadata)
    for f in os.listdir(target):
        os.chmod(os.path.join(target, f), 0o644)

    size = os.path.getsize(os.path.join(target, "model.safetensors"))
    assert size < MODEL_BUDGET, f"{family}: model.safetensors is {size} bytes"
    saved = sorted(load_file(os.path.join(target, "model.safetensors")).keys())
    n_params = sum(p.numel() for p in model.parameters())
    print(f"{family:11s} {model_cls:18s} params {n_params:6d}  loss {loss.item():.6f}  model.safetensors {size} B")
    for line in notes:
        print(f"            {line}")
    return {
        "family": family,
        "class": model_cls,
        "kind": kind,
        "params": n_params,
        "loss": loss.item(),
        "names": names,
        "saved": saved,
        "note": note,
        "checks": notes,
    }


def dir_size(path):
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def write_readme(out_dir, results, versions):
    lines = [
        "# Reference fixtures for the model implementations",
        "",
        "Made by `scripts/make-model-fixtures.sh` (which runs `scripts/make_model_fixtures.py` in",
        "the virtual environment `scripts/bench-pytorch.sh` also uses). Nothing here is written by",
        "hand, this file included. To regenerate, from the repository root:",
        "",
        "    scripts/make-model-fixtures.sh",
        "",
        "It needs PyPI (torch is several GB), so a person runs it; CI only reads these files.",
        "",
        "Made with: " + ", ".join(f"{k} {v}" for k, v in versions.items()) + ".",
        "",
        "## Files",
        "",
        "Each folder holds a tiny, randomly initialised model:",
        "",
        "- `config.json`, `model.safetensors`: as `save_pretrained(safe_serialization=True)` writes",
        "  them. Tied weights are stored once (under the embedding's name), as transformers does.",
        "  transformers 5 writes RoPE settings as `rope_parameters` (holding `rope_type`,",
        "  `rope_theta` and any scaling keys), not as top-level `rope_theta` / `rope_scaling`.",
        "- `reference.safetensors`:",
        f"  - `input_ids`, `attention_mask`, `labels`: i64, shape ({BATCH}, {SEQ}).",
        "    BERT also has `token_type_ids` (all zeros).",
        f"  - `logits`: f32 ({BATCH}, {SEQ}, {VOCAB}), the output with `attention_mask`.",
        "  - `logits_nomask`: f32, the output with no attention mask (padded positions then count",
        "    as tokens of id 0).",
        "  - `loss`: f32, shape (1,): the model's own loss, `model(input_ids,",
        "    attention_mask=..., labels=labels).loss` (BERT: with `token_type_ids` too).",
        "  - `grad.<name>`: f32, the gradient of `loss` for every name in",
        "    `model.named_parameters()` (tied weights appear once, with both uses' gradients).",
        "  - metadata: family, model class, versions.",
        "",
        "## Conventions",
        "",
        "- float32 throughout, `attn_implementation=\"eager\"`, every dropout probability 0 (so",
        "  the models ran in `train()` mode, which then computes the same as `eval()`).",
        f"- Shapes: hidden 32, 2 layers, 4 attention heads (2 key/value heads for the decoders),",
        f"  head_dim 8, intermediate 48, vocab {VOCAB}, max positions 64.",
        f"- Weights: transformers' own init with `initializer_range` {INIT_STD} (seed {SEED}); then",
        f"  every norm weight gets N(0, {NORM_NOISE}^2) added (so around 1, or around 0 for Gemma 2's",
        f"  `1 + weight` RMSNorm) and every bias (norms', linears', BERT's decoder bias) is",
        f"  replaced by N(0, {BIAS_NOISE}^2), so that a dropped norm weight or bias changes the numbers.",
        f"- Padding: the second sequence is RIGHT-padded: its last {PADDED} positions have",
        f"  `attention_mask` 0 and id {PAD_ID} (`pad_token_id`, so the embedding has `padding_idx`",
        f"  {PAD_ID}; its row was zeroed by the init). Real tokens are drawn from",
        f"  [{FIRST_REAL_ID}, {VOCAB}), so id {PAD_ID} only occurs at padded positions, whose outputs",
        "  reach no loss: ignoring `padding_idx` gives the same gradients.",
        "- Labels use ignore index -100. The loss is the mean cross-entropy over the labels that are",
        "  not -100.",
        "- Causal LMs: `labels` equals `input_ids` except -100 at the padded positions and at",
        f"  position {EXTRA_IGNORED[1]} of sequence {EXTRA_IGNORED[0]}. The label shift happens INSIDE",
        "  transformers: `logits[:, t]` is scored against `labels[:, t + 1]`, the last position",
        "  predicts nothing and `labels[:, 0]` is never used. So the loss here is",
        "  `cross_entropy(logits[:, :-1], labels[:, 1:], ignore_index=-100)` averaged over the",
        "  kept targets; the script asserts that identity.",
        f"- BERT (masked LM, no shift): positions {list(BERT_MASKED[0])} of sequence 0 and",
        f"  {list(BERT_MASKED[1])} of sequence 1 hold the [MASK] id {MASK_ID} in `input_ids`, their",
        "  original ids in `labels`; every other label is -100.",
        "- Sliding windows (transformers' mask): query position q sees key k when",
        "  `q - window < k <= q`, i.e. the window counts the query itself.",
        "",
        "## Families",
        "",
        "| folder | class | parameters | loss |",
        "|---|---|---|---|",
    ]
    for r in results:
        lines.append(f"| `{r['family']}` | `{r['class']}` | {r['params']} | {r['loss']:.6f} |")
    lines.append("")
    for r in results:
        lines.append(f"### {r['family']}")
        lines.append("")
        lines.append(r["note"])
        for c in r["checks"]:
            lines.append(f"- {c}")
        lines.append("")
        lines.append("Parameters (`model.named_parameters()` order; `{i}` is the layer index):")
        lines.append("")
        for n in collapse_layers(r["names"]):
            lines.append(f"    {n}")
        only_saved = sorted(set(r["saved"]) - set(r["names"]))
        missing = sorted(set(r["names"]) - set(r["saved"]))
        if only_saved or missing:
            lines.append("")
            lines.append(f"`model.safetensors` differs: extra keys {only_saved}, missing {missing}.")
        lines.append("")
    with open(os.path.join(out_dir, "README.md"), "w") as f:
        f.write("\n".join(lines).rstrip() + "\n")


def main():
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.path.join(repo, "tests", "fixtures", "models"))
    parser.add_argument("--only", default="", help="comma-separated families (default: all; README only with all)")
    args = parser.parse_args()
    families = [f for f in args.only.split(",") if f] or list(FAMILIES)
    unknown = [f for f in families if f not in FAMILIES]
    if unknown:
        sys.exit(f"unknown families {unknown}; known: {list(FAMILIES)}")

    torch.use_deterministic_algorithms(True)
    transformers.utils.logging.disable_progress_bar()
    versions = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "safetensors": safetensors.__version__,
        "numpy": np.__version__,
    }
    print(", ".join(f"{k} {v}" for k, v in versions.items()))
    os.makedirs(args.out, exist_ok=True)
    results = [make_family(f, args.out, versions) for f in families]
    if len(families) == len(FAMILIES):
        write_readme(args.out, results, versions)
    total = dir_size(args.out)
    print(f"total under {args.out}: {total} bytes")
    assert total < TOTAL_BUDGET, f"fixtures take {total} bytes, over the {TOTAL_BUDGET} budget"


if __name__ == "__main__":
    main()
