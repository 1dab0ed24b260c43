"""The 4-bit all-reduce with error feedback (parallel/lowbit.py, Echo) against the exact one: bytes, time, error, loss.

    python bench/bench_lowbit.py                      # all three parts (the loss part: several minutes)
    python bench/bench_lowbit.py --part collective    # or depth, loss; --smoke: seconds, every part tiny

collective  lowbit.all_reduce (NVFP4 codes, feedback on) and dist.all_reduce in fp32 and in bf16 on the same tensors
            at several sizes, on --world gloo ranks, timed alternately (median): the bytes a rank sends, traced by
            accounting/tracer.py next to the prediction (lowbit.call_messages), the time, the relative error of the
            sum. On a CPU the win is bytes, not time (the codec is Python-driven tensor work, gloo moves bytes fast).
depth       the relative error of the residual stream after L blocks of a TP model (T = 2, width 64, at init, random
            tokens) for L up to 96 (gpt3-175b's depth, the deepest preset), 4-bit without and with feedback against
            the exact path, forward (the stream before ln_f) and backward (the gradient at the embedding's output);
            beside it the pure stream: 2L calls of random addends summed, the accumulation the feedback telescopes.
loss        train.py itself (train.main on 2 forked ranks, --tp 2) on the built-in corpus: the exact all-reduce,
            --tp-comm-bits 4 --comm-feedback off, --tp-comm-bits 4: the same init, the same batches; the loss curve,
            the final train and val loss and their gap to the exact run against the paper's < 0.9% (after 10B tokens).
"""

import argparse
import multiprocessing
import os
import re
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import train  # noqa: E402
import tensor_parallel  # noqa: E402
from accounting.tracer import CommTracer  # noqa: E402
from common import add_device_argument, alternate, launch, rank_device, train_on_forked_ranks  # noqa: E402
from mfu import format_bytes, wire_bytes  # noqa: E402
from model import GPT, config_from_preset  # noqa: E402
from parallel import lowbit  # noqa: E402

STEP = re.compile(r"^step +(\d+)/\d+ \| loss ([\d.]+) (?:\| val ([\d.]+) )?\|")
DEPTHS = (1, 2, 4, 8, 16, 32, 64, 96)
PAPER_GAP = 0.009  # Echo's final loss over 16-bit's after 10B tokens: < 0.9%


def _returning(rank, world, fn, results, *args):
    out = fn(rank, world, *args)
    if rank == 0:
        results.put(out)  # floats only: a tensor's shared memory would not outlive the rank


def _spawn(fn, world: int, device: str, *args):
    """fn(rank, world, *args) on `world` ranks (common.launch: forked gloo ranks on CPU, one GPU each with NCCL under
    --device cuda); rank 0's return value."""
    results = multiprocessing.get_context("spawn" if device == "cuda" else "fork").SimpleQueue()
    launch(_returning, world, fn, results, *args, device=device, start_method="fork")
    return results.get()


# ---------------------------------------------------------------------------------------------------------
# collective: bytes, time, error at several sizes
# ---------------------------------------------------------------------------------------------------------


def _collective(rank, world, sizes, steps):
    group, rows, device = dist.group.WORLD, [], rank_device()
    for n in sizes:
        torch.manual_seed(rank)
        x = torch.randn(n).to(device)
        exact = x.clone()
        dist.all_reduce(exact)
        feedback = {"error": None}

        def quantised():
            feedback["error"] = lowbit.all_reduce(x, group, lowbit.NVFP4, feedback["error"])[1]

        calls = {"all_reduce fp32": lambda: dist.all_reduce(x.clone()),
                 "all_reduce bf16": lambda: dist.all_reduce(x.to(torch.bfloat16)),
                 "4-bit (lowbit)": quantised}
        seconds = alternate(calls, steps, warmup=1)
        traced = {}
        for name, call in calls.items():
            tracer = CommTracer()
            with tracer:
                call()
            traced[name] = tracer.total().wire_bytes
        predicted = sum(wire_bytes(op, payload, world) for (op, _), (_, payload) in
                        lowbit.call_messages(n, 4, lowbit.NVFP4, "world", world).items())
        summed, _ = lowbit.all_reduce(x, group)
        error = float((summed - exact).norm() / exact.norm())
        rows.append((n, seconds, traced, predicted, error))
    return rows


def collective_table(world: int, sizes: list, steps: int, device: str) -> None:
    rows = _spawn(_collective, world, device, sizes, steps)
    where = "GPUs (NCCL)" if device == "cuda" else "gloo ranks, one thread each"
    print(f"collective: {world} {where}, median of {steps} alternating calls; bytes sent per rank"
          f" traced by the tracer (4-bit: predicted by lowbit.call_messages beside it); error: ‖Σ̂ − Σ‖/‖Σ‖")
    print(f"  {'elements':>10}  {'fp32 all_reduce':>22}  {'bf16 all_reduce':>22}  {'4-bit (NVFP4 + fb)':>22}"
          f"  {'4-bit predicted':>15}  {'/bf16 bytes':>11}  {'/bf16 time':>10}  {'error':>7}")
    for n, seconds, traced, predicted, error in rows:
        cells = [f"{format_bytes(traced[k]):>11} {seconds[k] * 1e3:8.2f} ms" for k in seconds]
        mark = "" if abs(predicted - traced["4-bit (lowbit)"]) < 0.5 else "  <- WRONG: traced differs"
        print(f"  {n:>10,}  {cells[0]:>22}  {cells[1]:>22}  {cells[2]:>22}  {format_bytes(predicted):>15}"
              f"  {traced['4-bit (lowbit)'] / traced['all_reduce bf16']:>11.3f}"
              f"  {seconds['4-bit (lowbit)'] / seconds['all_reduce bf16']:>10.2f}  {error:>7.4f}{mark}")


# ---------------------------------------------------------------------------------------------------------
# depth: the error after L blocks, without and with feedback
# ---------------------------------------------------------------------------------------------------------


def _depth(rank, world, depths, batch, seq):
    group, rows, device = dist.group.WORLD, [], rank_device()
    for layers in depths:
        config = config_from_preset("tiny", n_layer=layers, block_size=seq)
        model = GPT(config, seed=0, device=device)
        handle = tensor_parallel.parallelize(model, group)
        idx = torch.randint(0, config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(1)).to(device)
        direction = torch.randn(batch, seq, config.n_embd, generator=torch.Generator().manual_seed(2)).to(device)
        out = {}
        for name, reduction in (("exact", None), ("4-bit", lowbit.TensorParallelReduction(lowbit.NVFP4, world, False)),
                                ("4-bit + feedback", lowbit.TensorParallelReduction(lowbit.NVFP4, world, True))):
            handle.reduce_with(reduction)
            x0 = model.embed(idx, torch.arange(seq, device=device)).detach().requires_grad_()
            h = model.forward_blocks(x0)
            (h * direction).sum().backward()
            out[name] = (h.detach(), x0.grad)
        exact_h, exact_g = out["exact"]
        errors = {name: tuple(map(float, ((h - exact_h).norm() / exact_h.norm(), (h - exact_h).norm(),
                                          (g - exact_g).norm() / exact_g.norm(), (g - exact_g).norm())))
                  for name, (h, g) in out.items() if name != "exact"}
        rows.append((layers, errors, _stream(group, 2 * layers, batch * seq * config.n_embd)))
    return rows


def _stream(group, calls: int, n: int) -> dict:
    """2L calls of random addends (the same size each) summed into one stream: its relative error, per mode."""
    torch.manual_seed(3 + dist.get_rank())
    exact, plain, fed, error = 0, 0, 0, None
    for _ in range(calls):
        x = torch.randn(n).to(rank_device())
        total = x.clone()
        dist.all_reduce(total, group=group)
        exact, plain = exact + total, plain + lowbit.all_reduce(x, group)[0]
        out, error = lowbit.all_reduce(x, group, feedback=error)
        fed = fed + out
    return {name: (float((sum_ - exact).norm() / exact.norm()), float((sum_ - exact).norm()))
            for name, sum_ in (("4-bit", plain), ("4-bit + feedback", fed))}


def depth_table(depths: list, batch: int, seq: int, device: str) -> None:
    rows = _spawn(_depth, 2, device, depths, batch, seq)
    print(f"depth: T=2 {'GPUs' if device == 'cuda' else 'gloo ranks'}, `tiny` widths (h=64, 4 heads) with"
          f" n_layer = L, GPT-2 init, {batch}×{seq} random tokens, against the exact all-reduce: forward, the")
    print("  stream before ln_f (2L + 1 g's); backward, the gradient at the embedding's output (2L f's, a fixed random"
          " direction at the top); stream: 2L random addends of b·s·h each summed, no model between the calls.")
    print(f"  Each: ‖error‖/‖exact‖, then ×: ‖error‖ over its value at L = {rows[0][0]} (the growth with depth)."
          " 4-bit: no feedback; fb: with feedback")
    heads = [f"{where} {mode}" for where in ("fwd", "bwd", "stream") for mode in ("4-bit", "fb")]
    print(f"  {'L':>3}  " + "  ".join(f"{head:>16}" for head in heads))
    first = rows[0]
    for layers, errors, stream in rows:
        cells = []
        for index, (mode_errors, base) in enumerate(((errors, first[1]), (errors, first[1]), (stream, first[2]))):
            for mode in ("4-bit", "4-bit + feedback"):
                pick = (0, 2, 0)[index]  # forward's, backward's, the stream's (relative, absolute) pair
                relative, absolute = float(mode_errors[mode][pick]), float(mode_errors[mode][pick + 1])
                cells.append(f"{relative:>7.4f} ×{absolute / float(base[mode][pick + 1]):>6.2f}")
        print(f"  {layers:>3}  " + "  ".join(f"{cell:>16}" for cell in cells))


# ---------------------------------------------------------------------------------------------------------
# loss: train.py with the exact all-reduce, 4-bit without and with feedback
# ---------------------------------------------------------------------------------------------------------


def train_run(world: int, argv: list, out_dir: str, label: str) -> dict:
    """train.main on `world` forked ranks; its step lines parsed: {step: loss}, the final val loss."""
    text = train_on_forked_ranks(train.main, world, argv, out_dir, label)
    losses, val = {}, None
    for line in text.splitlines():
        match = STEP.match(line)
        if match:
            losses[int(match.group(1))] = float(match.group(2))
            val = float(match.group(3)) if match.group(3) else val
    return dict(losses=losses, val=val)


def loss_table(preset: str, steps: int, batch: int, eval_batches: int, seed: int, window: int) -> None:
    runs = {"exact (fp32 all_reduce)": [], "4-bit, no feedback": ["--tp-comm-bits", "4", "--comm-feedback", "off"],
            "4-bit + feedback": ["--tp-comm-bits", "4"]}
    with tempfile.TemporaryDirectory(prefix="bench-lowbit-") as tmp:
        common = ["--preset", preset, "--tp", "2", "--steps", str(steps), "--global-batch", str(batch), "--seed",
                  str(seed), "--dtype", "fp32", "--eval-every", "0", "--eval-batches", str(eval_batches),
                  "--log-every", "1", "--sample-tokens", "0", "--peak-tflops", "1", "--out-dir", os.path.join(tmp, "o")]
        results = {label: train_run(2, [*common, *extra], tmp, f"run{i}") for i, (label, extra) in
                   enumerate(runs.items())}
    exact = results["exact (fp32 all_reduce)"]
    marks = sorted({0, *range(steps // 5, steps, max(1, steps // 5)), steps - 1})
    print(f"loss: train.py --preset {preset} --tp 2 --steps {steps} --global-batch {batch} --dtype fp32 (built-in"
          f" corpus, seed {seed}, the same init and batches); train loss at steps {marks[:-1]}, the mean of the last"
          f" {window} steps' losses, the final val loss ({eval_batches} batches); gap = (4-bit − exact)/exact")
    print(f"  {'run':<24} " + " ".join(f"{'@' + str(s):>7}" for s in marks[:-1])
          + f"  {'last ' + str(window):>8}  {'gap':>7}  {'val':>7}  {'gap':>7}")
    base = sum(exact["losses"][s] for s in range(steps - window, steps)) / window
    for label, r in results.items():
        mean = sum(r["losses"][s] for s in range(steps - window, steps)) / window
        print(f"  {label:<24} " + " ".join(f"{r['losses'][s]:>7.4f}" for s in marks[:-1])
              + f"  {mean:>8.4f}  {(mean - base) / base:>+7.2%}  {r['val']:>7.4f}"
              f"  {(r['val'] - exact['val']) / exact['val']:>+7.2%}")
    print(f"  paper (Echo, 10B tokens of pre-training): final loss within {PAPER_GAP:.1%} of 16-bit")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", choices=["all", "collective", "depth", "loss"], default="all")
    p.add_argument("--world", type=int, default=2, help="collective: ranks")
    p.add_argument("--sizes", default="4096,65536,1048576,4194304", help="collective: elements, comma-separated")
    p.add_argument("--steps", type=int, default=9, help="collective: timed calls per variant")
    p.add_argument("--depths", default=",".join(map(str, DEPTHS)), help="depth: values of L, comma-separated")
    p.add_argument("--preset", default="mini", help="loss: the model")
    p.add_argument("--train-steps", type=int, default=300, help="loss: optimizer steps")
    p.add_argument("--global-batch", type=int, default=16, help="loss: sequences a step")
    p.add_argument("--eval-batches", type=int, default=8, help="loss: validation batches at the end")
    p.add_argument("--window", type=int, default=50, help="loss: the last steps whose mean is compared")
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--smoke", action="store_true", help="seconds: every part tiny")
    add_device_argument(p)  # collective and depth; the loss runs are train.py's own choice
    a = p.parse_args(argv)
    if a.smoke:
        a.sizes, a.steps, a.depths, a.preset, a.train_steps, a.global_batch, a.eval_batches, a.window = (
            "4096", 1, "1,2", "tiny", 3, 4, 1, 2)
    parts = ["collective", "depth", "loss"] if a.part == "all" else [a.part]
    if "collective" in parts:
        collective_table(a.world, [int(n) for n in a.sizes.split(",")], a.steps, a.device)
    if "depth" in parts:
        depth_table([int(n) for n in a.depths.split(",")], 2 if a.smoke else 4, 16 if a.smoke else 64, a.device)
    if "loss" in parts:
        loss_table(a.preset, a.train_steps, a.global_batch, a.eval_batches, a.seed, min(a.window, a.train_steps))
    print(f"4-bit bytes over bf16's, 2^22 elements on 2 ranks: {lowbit.ratio_to(2**22, 2, 2):.4f} (4.5/16 ="
          f" {4.5 / 16:.4f}, and 32 bits a chunk)")


if __name__ == "__main__":
    main()
