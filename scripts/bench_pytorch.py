#!/usr/bin/env python3
"""The llama benchmarks' step in PyTorch, with and without Hugging Face Accelerate.

The same sizes, step and timing as models/examples/bench_llama.rs (1 process, 2 threads) and
bench_llama_ddp.rs (2 processes x 1 thread, DDP over gloo, started by torchrun): 2 micro-batches
of seeded random tokens, the loss on every position's logits against a random target each
(transformers' LlamaForCausalLM, every parameter trained, as ivme's models::llama::Llama is),
global-norm clipping at 1.0, torch.optim.AdamW (lr 3e-4); one warm-up step, then the timed
steps. Every (system, size) measurement runs in a process (or torchrun job) of its own; rounds
alternate the order; medians. Each measurement also reports rank 0's peak resident memory
(ru_maxrss) in MiB.

Never part of CI and never a dependency of the crates: it runs only where
`python3 -c "import torch, transformers, accelerate"` works (scripts/bench-pytorch.sh makes a
virtual environment for it).

    python3 scripts/bench_pytorch.py [--rounds 3] [--sizes T,S,M] [--processes 1|2] [--bf16]
    python3 scripts/bench_pytorch.py matmuls SIZE   # the step's linear-layer products alone
"""

import argparse
import os
import statistics
import subprocess
import sys
import time

SIZES = {
    # name: hidden, layers, heads, kv heads, mlp, vocab, batch, tokens, timed steps
    "T": (64, 2, 4, 2, 128, 256, 16, 32, 30),
    "S": (256, 4, 8, 4, 688, 4096, 8, 64, 8),
    "M": (512, 6, 8, 4, 1376, 8192, 4, 128, 4),
    "L": (768, 12, 12, 4, 2048, 16384, 2, 128, 2),
}
LR = 3e-4


def one(system, size, bf16=False):
    """One measurement; prints ms per step (rank 0 only under torchrun)."""
    import torch
    import torch.distributed as dist
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, layers, heads, kv, mlp, vocab, batch, tokens, steps = SIZES[size]
    world = int(os.environ.get("WORLD_SIZE", "1"))
    torch.set_num_threads(2 if world == 1 else 1)
    torch.manual_seed(17)
    cfg = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=mlp,
        vocab_size=vocab,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=tokens,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(cfg)
    gen = torch.Generator().manual_seed(7)
    data = [
        (
            torch.randint(0, vocab, (batch, tokens), generator=gen),
            torch.randint(0, vocab, (batch, tokens), generator=gen),
        )
        for _ in range(2)
    ]
    opt = torch.optim.AdamW(model.parameters(), lr=LR)

    def loss_of(m, x, y):
        # --bf16: mixed precision as ivme's bf16 is (f32 weights and optimizer, bf16 compute).
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            logits = m(input_ids=x).logits
        return torch.nn.functional.cross_entropy(logits.float().reshape(-1, vocab), y.reshape(-1))

    if system == "accelerate":
        from accelerate import Accelerator

        acc = Accelerator(gradient_accumulation_steps=2, cpu=True)
        model, opt = acc.prepare(model, opt)

        def step():
            for x, y in data:
                with acc.accumulate(model):
                    loss = loss_of(model, x, y)
                    acc.backward(loss)
                    if acc.sync_gradients:
                        acc.clip_grad_norm_(model.parameters(), 1.0)
                    opt.step()
                    opt.zero_grad()

        barrier = acc.wait_for_everyone
        rank = acc.process_index
    else:
        if world > 1:
            dist.init_process_group("gloo")
            model = torch.nn.parallel.DistributedDataParallel(model)
            barrier, rank = dist.barrier, dist.get_rank()
        else:
            barrier, rank = (lambda: None), 0

        def step():
            for i, (x, y) in enumerate(data):
                # A competent DDP loop syncs only on the window's last micro-batch.
                quiet = world > 1 and i == 0
                ctx = model.no_sync() if quiet else _Nothing()
                with ctx:
                    (loss_of(model, x, y) / 2).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()

    step()
    barrier()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    barrier()
    ms = (time.perf_counter() - start) * 1e3 / steps
    if rank == 0:
        import resource

        print(ms, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    if world > 1 and system != "accelerate":
        dist.destroy_process_group()


def matmuls(size):
    """The step's linear-layer matrix products alone (as bench_llama's `one matmuls`): for each
    of 2 micro-batches, every projection's and the head's forward x@W.T and backward dY@W,
    dY.T@x, f32, 2 threads; prints ms per step."""
    import torch

    hidden, layers, heads, kv, mlp, vocab, batch, tokens, steps = SIZES[size]
    torch.set_num_threads(2)
    rows, kvw = batch * tokens, hidden // heads * kv
    shapes = [(hidden, hidden), (hidden, kvw), (hidden, kvw), (hidden, hidden),
              (hidden, mlp), (hidden, mlp), (mlp, hidden)] * layers + [(hidden, vocab)]
    ts = [(torch.randn(rows, i), torch.randn(o, i) * 0.02, torch.randn(rows, o)) for i, o in shapes]

    def step():
        for _ in range(2):
            for x, w, dy in ts:
                x @ w.T
                dy @ w
                dy.T @ x

    step()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    print((time.perf_counter() - start) * 1e3 / steps, 0)


class _Nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def job(system, size, processes, bf16):
    """One measurement in a process (or torchrun job) of its own: rank 0's ms per step and
    peak MiB."""
    me = os.path.abspath(__file__)
    if processes == 1:
        cmd = [sys.executable, me, "one", system, size]
    else:
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(processes),
            "--master_port", "29533", me, "one", system, size,
        ]
    if bf16:
        cmd.append("bf16")
    env = dict(os.environ, OMP_NUM_THREADS="2" if processes == 1 else "1")
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    for line in out.stdout.splitlines():
        try:
            ms, peak = (float(w) for w in line.split())
            return ms, peak
        except ValueError:
            continue
    raise SystemExit(f"{' '.join(cmd)} printed no time:\n{out.stdout}\n{out.stderr}")


def main():
    if len(sys.argv) > 2 and sys.argv[1] == "matmuls":
        matmuls(sys.argv[2])
        return
    if len(sys.argv) > 1 and sys.argv[1] == "one":
        one(sys.argv[2], sys.argv[3], len(sys.argv) > 4 and sys.argv[4] == "bf16")
        return
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--sizes", default="T,S,M")
    p.add_argument("--processes", type=int, default=1)
    p.add_argument("--bf16", action="store_true")
    a = p.parse_args()
    import accelerate
    import torch
    import transformers

    print(
        f"PyTorch {torch.__version__}, transformers {transformers.__version__}, Accelerate "
        f"{accelerate.__version__}; llama step on {a.processes} process(es), {a.rounds} rounds "
        f"(medians), {'bf16 autocast' if a.bf16 else 'f32'}, each system in a process or job of its own"
    )
    print("| size | PyTorch ms/step | PyTorch + Accelerate ms/step | PyTorch peak MiB | + Accelerate peak MiB |")
    print("|---|---|---|---|---|")
    for size in a.sizes.split(","):
        times = {"torch": [], "accelerate": []}
        peaks = {"torch": 0.0, "accelerate": 0.0}
        for r in range(a.rounds):
            order = ["torch", "accelerate"] if r % 2 == 0 else ["accelerate", "torch"]
            for system in order:
                ms, peak = job(system, size, a.processes, a.bf16)
                times[system].append(ms)
                peaks[system] = max(peaks[system], peak)
        t, acc = statistics.median(times["torch"]), statistics.median(times["accelerate"])
        print(
            f"| {size} | {t:.1f} | {acc:.1f} | {peaks['torch']:.0f} | {peaks['accelerate']:.0f} |"
        )


if __name__ == "__main__":
    main()
