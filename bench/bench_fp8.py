"""fp8.py's speed and numerics: FP8 against bf16 for one linear, for a GPT-2 step, and for a short training run.

    python bench/bench_fp8.py --device cuda       # GPU (cc ≥ 8.9): throughput and step-time ratios; else numerics
    python bench/bench_fp8.py                     # CPU: the numerics
    python bench/bench_fp8.py --train 100         # + the `small` preset trained per mode against bf16, same init
    python bench/bench_fp8.py --smoke             # the GPU code path at toy sizes, wherever you are (CPU: _scaled_mm)

On a GPU with FP8 tensor cores it prints:
  * the GEMM alone at 4096³: torch.mm in bf16 against torch._scaled_mm e4m3×e4m3 → bf16 (TFLOP/s, ratio);
  * the linear, forward + backward, at M = K = N = 4096 (6·M·K·N FLOPs): nn.Linear under bf16 autocast
    against Fp8Linear (current and delayed), eager and under torch.compile (which fuses the amax, scale,
    clamp and cast passes that eager runs one by one); target: FP8 ≥ 1.4× bf16;
  * the `gpt2` preset's forward + backward step time, bf16 against FP8 (only ~60% of its FLOPs are in the
    block linears: the head, attention and the element-wise work stay in bf16, so ≤ ~1.4× is the ceiling).
Elsewhere there are no FP8 tensor cores: the FP8 linear is emulated (quantise, dequantise, fp32 GEMM), slower
than bf16 by construction, so timing it would measure the emulation. It prints the numerics instead: SQNR
against the bf16 linear per mode (output, input and weight gradients) and the saturated fractions.
Every variant starts from the same weights; timed variants alternate (bench/common.alternate).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

from accounting import observers  # noqa: E402
import fp8  # noqa: E402
from precision import fp8_scaling  # noqa: E402
import report.axes  # noqa: E402
from common import add_device_argument, alternate  # noqa: E402
from model import GPT, config_from_preset  # noqa: E402


def sqnr(ref, x) -> float:
    ref, x = ref.detach().double(), x.detach().double()
    return float(10 * torch.log10(ref.pow(2).sum() / (ref - x).pow(2).sum().clamp_min(1e-300)))


def numerics(device, n: int = 1024) -> None:
    """SQNR (dB) of each FP8 recipe against the bf16 linear, and the fraction of saturated values."""
    print(f"numerics (vs the bf16 linear, M=K=N={n}, N(0,1) inputs and gradients, nn.Linear init):")
    x = torch.randn(n, n, device=device) * 3
    for fmt in (fp8_scaling.E4M3, fp8_scaling.E5M2):
        scale = fp8_scaling.scale_from_amax(fp8_scaling.amax_of(x), fmt.max)
        q, _ = fp8_scaling.quantize(x, fmt, scale)
        round_trip = sqnr(x, fp8_scaling.dequantize(q, scale, torch.float32))
        print(f"  cast round trip {fmt.name}: {round_trip:.1f} dB (target ≥ 25)")
    print(f"  {'mode':<10} {'output':>8} {'dX':>8} {'dW':>8}   saturated in the last step (input, weight, grad)")
    for mode in fp8.MODES:
        torch.manual_seed(0)
        plain, reference = nn.Linear(n, n, device=device), nn.Linear(n, n, device=device)
        reference.load_state_dict(plain.state_dict())
        layer = fp8.Fp8Linear(plain, fp8.Recipe(mode), "bench")
        handle = fp8.Fp8Handle(fp8.Recipe(mode), {"bench": layer})
        handle.observe(observers.SaturationCount())  # what the clamps cut, as the trainer's accounting counts it
        for step in range(3):  # delayed: steps 2 and 3 use the history; step 3's input is 2× larger
            x = torch.randn(8, n // 8, n, device=device) * (2.0 if step == 2 else 1.0)
            x = x.requires_grad_()
            x_ref = x.detach().clone().requires_grad_()
            grad = torch.randn(8, n // 8, n, device=device)
            plain.weight.grad = reference.weight.grad = None
            handle.observer.take("bench")  # forget the earlier steps: the fractions below are the last step's
            with torch.autocast(device.type, torch.bfloat16):
                y, y_ref = layer(x), reference(x_ref)
            y.backward(grad)
            y_ref.backward(grad)
            handle.after_grad_sync()
        fractions = [f"{share:.2f}%" for share in handle.observer.take("bench")]
        print(f"  {mode:<10} {sqnr(y_ref, y):7.1f} {sqnr(x_ref.grad, x.grad):8.1f} "
              f"{sqnr(reference.weight.grad, plain.weight.grad):8.1f}   {', '.join(fractions)}")
    print("  (targets: output ≥ 18 dB, dW ≥ 17 dB, torchao's; delayed saturates when a tensor outgrows its"
          " history: the last step's input is 2× the earlier ones)")


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def gemm_throughput(device, n: int, steps: int) -> None:
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    qa, qb = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)
    one = torch.ones((), device=device)

    def bf16():
        torch.mm(a, b.t())
        _sync(device)

    def e4m3():
        torch._scaled_mm(qa, qb.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
        _sync(device)

    times = alternate({"bf16": bf16, "fp8": e4m3}, steps=steps, warmup=3)
    flops = 2 * n**3
    print(f"GEMM {n}³ alone: bf16 torch.mm {flops / times['bf16'] / 1e12:.0f} TFLOP/s, e4m3 torch._scaled_mm"
          f" {flops / times['fp8'] / 1e12:.0f} TFLOP/s: {times['bf16'] / times['fp8']:.2f}×")


def linear_throughput(device, n: int, steps: int, compile_too: bool) -> None:
    """Forward + backward of one linear (6·M·K·N FLOPs), bf16 autocast against FP8, eager and compiled."""
    torch.manual_seed(0)
    x = torch.randn(n, n, device=device, dtype=torch.bfloat16, requires_grad=True)  # a bf16 activation
    grad = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    variants = {"bf16": nn.Linear(n, n, bias=False, device=device)}
    for mode in ("current", "delayed"):
        layer = fp8.Fp8Linear(nn.Linear(n, n, bias=False, device=device), fp8.Recipe(mode), mode)
        with torch.autocast(device.type, torch.bfloat16):
            layer(x).backward(grad)  # one step, rolled: delayed then quantises with its history's scales
        fp8.Fp8Handle(layer.recipe, {mode: layer}).after_grad_sync()
        variants[mode] = layer
    if compile_too:
        variants.update({f"{name}+compile": torch.compile(layer) for name, layer in list(variants.items())})

    def run(layer):
        def fn():
            with torch.autocast(device.type, torch.bfloat16):
                y = layer(x)
            y.backward(grad)
            x.grad = None
            for p in layer.parameters():
                p.grad = None
            _sync(device)
        return fn

    times = alternate({name: run(layer) for name, layer in variants.items()}, steps=steps, warmup=3)
    flops = 6 * n**3
    print(f"linear {n}³ forward + backward (bf16 autocast vs FP8):")
    for name, seconds in times.items():
        base = times["bf16+compile" if name.endswith("compile") else "bf16"]
        print(f"  {name:<18} {seconds * 1e3:8.3f} ms  {flops / seconds / 1e12:6.0f} TFLOP/s"
              f"  {base / seconds:.2f}× bf16")


def gpt2_step_ratio(device, batch: int, steps: int, compile_too: bool, preset: str = "gpt2",
                    seq: int | None = None) -> None:
    config = config_from_preset(preset)
    seq = seq or config.block_size
    idx = torch.randint(0, config.vocab_size, (batch, seq), device=device)
    models, handles = {"bf16": GPT(config, seed=0, device=device)}, {}
    for mode in ("current", "delayed"):
        models[mode] = GPT(config, seed=0, device=device)
        handle = handles[mode] = fp8.convert(models[mode], fp8.Recipe(mode))
        with torch.autocast(device.type, torch.bfloat16):
            _, loss_sum, count = models[mode](idx, idx)
        (loss_sum / count).backward()
        handle.after_grad_sync()  # delayed: from here on the scales come from the history
        models[mode].zero_grad(set_to_none=True)
    if compile_too:
        models.update({f"{name}+compile": torch.compile(m) for name, m in list(models.items())})

    def run(model):
        def fn():
            with torch.autocast(device.type, torch.bfloat16):
                _, loss_sum, count = model(idx, idx)
            (loss_sum / count).backward()
            for p in model.parameters():
                p.grad = None
            _sync(device)
        return fn

    peaks = {}
    for name, model in models.items():  # peak memory of one step: FP8 saves the linears' inputs in 1 byte
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            run(model)()
            peaks[name] = torch.cuda.max_memory_allocated(device)
    times = alternate({name: run(m) for name, m in models.items()}, steps=steps, warmup=3)
    print(f"{preset} forward + backward, batch {batch} × {seq} tokens, bf16 autocast (the head, attention and"
          f" loss stay bf16):")
    for name, seconds in times.items():
        base = times["bf16+compile" if name.endswith("compile") else "bf16"]
        memory = f"  peak {peaks[name] / 2**30:.2f} GiB" if name in peaks else ""
        print(f"  {name:<18} {seconds * 1e3:9.1f} ms per step  {base / seconds:.2f}× bf16{memory}")
    saved = fp8.saved_input_bytes(handles["current"].facts().in_features.values(), batch * seq, 2)["saved"]
    print(f"  predicted: FP8 saved inputs {saved / 2**30:.2f} GiB less per micro-batch (Σ M·K_j, bf16 → FP8)")


def train_small(device, steps: int, batch: int, seq: int, eval_batches: int, lr: float = 1e-3) -> None:
    """The `small` preset from one init on the same batches: bf16 autocast, then each FP8 recipe."""
    import data
    from optim import LRSchedule, build_adamw

    corpus = data.prepare_corpus(None, "byte", os.path.join("out", "cache"), log=lambda *a, **k: None)
    train_tokens, val_tokens = data.TokenFile(corpus.train_path), data.TokenFile(corpus.val_path)
    sampler = data.BatchSampler(len(train_tokens), seq, batch, seed=1337)
    val_sampler = data.EvalSampler(len(val_tokens), seq, batch)
    schedule = LRSchedule(lr, warmup_steps=max(1, steps // 20), decay_steps=steps, min_lr=lr / 10)
    config = config_from_preset("small")
    print(f"train `small` ({config.n_layer}×{config.n_embd}) for {steps} steps, batch {batch} × {seq}, AdamW"
          f" lr {lr} cosine, clip 1.0, bf16 autocast (but fp32), on {device.type}, the same init and batches;"
          f" train loss = mean of the last 10 steps")
    results = {}
    for mode in ("bf16", "fp32", *fp8.MODES):  # fp32 against bf16: how far two precisions drift apart anyway
        model = GPT(config, seed=0, device=device)
        handle = fp8.convert(model, fp8.Recipe(mode)) if mode in fp8.MODES else None
        autocast = torch.autocast(device.type, torch.bfloat16, enabled=mode != "fp32")
        optimizer = build_adamw(model.parameters(), lr)
        losses, skipped, start = [], 0, time.perf_counter()
        for step in range(steps):
            x, y = sampler.get_batch(train_tokens, step, 0, 1, batch, 0)
            with autocast:
                _, loss_sum, count = model(x.to(device), y.to(device))
            (loss_sum / count).backward()
            nonfinite = handle.after_grad_sync() if handle is not None else 0
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            if nonfinite:
                skipped += 1
            else:
                for group in optimizer.param_groups:
                    group["lr"] = schedule(step)
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(float(loss_sum.detach() / count))
        seconds = (time.perf_counter() - start) / steps
        model.eval()
        total = count_total = 0.0
        with torch.no_grad():
            for index in range(min(eval_batches, val_sampler.num_batches)):
                x, y = val_sampler.get_batch(val_tokens, index, 0, 1, batch, 0)
                with autocast:
                    _, loss_sum, count = model(x.to(device), y.to(device))
                total, count_total = total + float(loss_sum), count_total + float(count)
        results[mode] = (sum(losses[-10:]) / len(losses[-10:]), total / count_total)
        base = results["bf16"]
        print(f"  {mode:<10} train {results[mode][0]:.4f} ({100 * (results[mode][0] / base[0] - 1):+.2f}%)"
              f"  val {results[mode][1]:.4f} ({100 * (results[mode][1] / base[1] - 1):+.2f}%) vs bf16"
              f"  {seconds:.2f} s/step"
              f"{f', {skipped} steps skipped' if skipped else ''}")
        if handle is not None:
            print("    " + "\n    ".join(report.axes.axis_lines(handle, "step", None)))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=4096, help="the linear's M = K = N")
    p.add_argument("--steps", type=int, default=20, help="timed repetitions per variant")
    p.add_argument("--batch", type=int, default=8, help="gpt2 step: sequences of 1024 tokens")
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile variants")
    p.add_argument("--train", type=int, default=0, help="also train `small` this many steps per mode")
    p.add_argument("--train-batch", type=int, default=8)
    p.add_argument("--train-seq", type=int, default=256)
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument("--smoke", action="store_true", help="run the GPU code path at toy sizes (checks it runs)")
    add_device_argument(p)
    args = p.parse_args()
    device = torch.device(args.device)
    torch.manual_seed(0)
    numerics(device, n=256 if args.smoke else 1024)
    if fp8_scaling.has_fp8_tensor_cores(device) or args.smoke:
        n, steps = (64, 2) if args.smoke else (args.n, args.steps)
        compile_too = not args.no_compile and not args.smoke
        gemm_throughput(device, n, steps)
        if args.smoke and device.type == "cpu":  # the _scaled_mm path, which torch also runs on CPU
            original = fp8_scaling.has_fp8_tensor_cores
            fp8_scaling.has_fp8_tensor_cores = lambda dev: True
        linear_throughput(device, n, steps, compile_too)
        if args.smoke:
            gpt2_step_ratio(device, 1, steps, compile_too, preset="tiny", seq=16)
            if device.type == "cpu":
                fp8_scaling.has_fp8_tensor_cores = original
        else:
            gpt2_step_ratio(device, args.batch, max(5, steps // 2), compile_too)
    else:
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "this CPU"
        print(f"no throughput numbers: {name} has no FP8 tensor cores (compute capability ≥ 8.9 needed), so FP8"
              f" is emulated here (quantise, dequantise, fp32 GEMM): slower than bf16 by construction. The"
              f" numerics above are what FP8 changes; run on an H100/H200/L40/RTX 4090 for the speed.")
    if args.train:
        train_small(device, args.train, args.train_batch, args.train_seq, args.eval_batches)


if __name__ == "__main__":
    main()
