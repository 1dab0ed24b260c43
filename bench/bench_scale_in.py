"""The scale-in question, predicted: the best layout on half the GPUs, without and with host-memory offload, against
the full-size plan (planner/search.py's --plan-search, run four times; parallel/offload.py's --offload).

    python bench/bench_scale_in.py --world 64 --preset gpt3-13b --global-batch 512 --hw-memory-gib 80
    python bench/bench_scale_in.py --smoke    # the tiny preset on 8 and 4 GPUs of a 0.6 MiB device: seconds

Every flag but --world and --smoke is plan.py's and goes to each search as given (--hw-host-link-gbps,
--hw-host-adam-gbps and --hw-host-memory-gib only to the offloaded ones: they need --offload). The searches:
--world N without offload (the full-size plan), then N/2 without offload, with --offload optimizer and with
--offload optimizer+master; the global batch stays (the same job on fewer GPUs, as TRANSIT measures it), so each
GPU of the half-size runs carries twice the tokens. One table: GPUs, offload, the best layout, its predicted step,
tokens/s per GPU, its peak device memory, the host memory of a node (offload's: G × the fullest stage's host
bytes, time_model.host_per_node), the update's time (the host's, exposed, with offload) and its tokens/s per GPU
over the full-size plan's. A search that finds no layout that fits says so, with the smallest peak it sized.

Why a bench and not a flag: the answer composes four searches of flags that exist; `--offload auto` would be a
value of a run's flag that no run can take. Accounting for this file: it allocates nothing and sends nothing.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from cli import flags  # noqa: E402
import mfu  # noqa: E402
import planner.formulas  # noqa: E402
import planner.search  # noqa: E402
from planner import hardware  # noqa: E402
from planner.time_model import host_per_node, layout_name  # noqa: E402

SMOKE = ["--preset", "tiny", "--dtype", "bf16", "--seq-len", "64", "--global-batch", "16", "--hw-memory-gib",
         str(0.6 * 2**20 / 2**30)]  # 0.6 MiB: on 4 GPUs no layout of the tiny model fits without offload
HOST_FLAGS = ("--hw-host-link-gbps", "--hw-host-adam-gbps", "--hw-host-memory-gib")
OFFLOADS = (None, "optimizer", "optimizer+master")


def without_host_flags(argv: list) -> list:
    """The command line less the host link's and the host update's figures (and their values)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg.split("=")[0] in HOST_FLAGS:
            skip = "=" not in arg
        else:
            out.append(arg)
    return out


def best_of(argv: list, world: int, offload: str | None) -> dict:
    """The search's best layout of `world` GPUs with `offload` (None: all on the device), as a table row's figures;
    "fits" False with the smallest peak sized where none fits."""
    argv = [*argv, "--offload", offload] if offload else without_host_flags(argv)
    args = flags.build_parser("plan.py").parse_args([*argv, "--plan-search", "--world", str(world)])
    hw = hardware.from_flags(args, args.dtype if args.dtype != "auto" else "bf16")
    done = planner.search.search(argv, world, hw, top=1)
    row = dict(world=world, offload=offload or "none", fits=bool(done.best))
    if not done.best:
        row["smallest"] = done.smallest[0] if done.smallest else None
        return row
    prediction, peak, settings = done.best[0][:3]
    tokens = settings.args.global_batch * settings.seq_len
    host = host_per_node(planner.formulas.stage_roles(settings), hw, world)
    return dict(row, layout=layout_name(settings), step=prediction.step, per_gpu=tokens / prediction.step / world,
                peak=peak, host_node=host, update=prediction.update)


def scale_in(argv: list, world: int) -> list:
    """The four rows: world without offload, then world/2 without, with optimizer, with optimizer+master; each with
    `ratio`, its tokens/s per GPU over the first's."""
    rows = [best_of(argv, world, None)] + [best_of(argv, world // 2, offload) for offload in OFFLOADS]
    full = rows[0].get("per_gpu")
    for row in rows:
        row["ratio"] = row["per_gpu"] / full if full and row["fits"] else None
    return rows


def table(rows: list) -> list:
    lines = ["| GPUs | offload | best layout | step (s) | tokens/s per GPU | peak memory per GPU | host memory per node"
             " | update (s) | per-GPU throughput / full-size |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if not r["fits"]:
            smallest = f"smallest peak {mfu.format_bytes(r['smallest'])}" if r.get("smallest") else "none sized"
            lines.append(f"| {r['world']} | {r['offload']} | no layout fits ({smallest}) | | | | | | |")
            continue
        ratio = f"{r['ratio']:.3f}" if r["ratio"] is not None else "(no full-size plan)"
        lines.append(f"| {r['world']} | {r['offload']} | {r['layout']} | {r['step']:.3f} | {r['per_gpu']:,.0f} |"
                     f" {mfu.format_bytes(r['peak'])} | {mfu.format_bytes(r['host_node'])} | {r['update']:.3f} |"
                     f" {ratio} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world", type=int, default=8, help="the full-size plan's GPUs (default 8); half of them next")
    parser.add_argument("--smoke", action="store_true", help="the tiny preset on 8 and 4 GPUs (default: off)")
    known, rest = parser.parse_known_args()
    argv = SMOKE if known.smoke else rest
    if known.world < 2 or known.world % 2:
        parser.error(f"--world must be even and at least 2, got {known.world}")
    for line in table(scale_in(argv, known.world)):
        print(line)


if __name__ == "__main__":
    main()
