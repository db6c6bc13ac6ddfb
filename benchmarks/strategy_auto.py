"""strategy=auto's pick against every layout the search finds feasible, all measured on this machine.

For each configuration (4 processes, one thread each; the default tiny Llama unless said):
- tiny: the default model and batch;
- budget: `hardware.memory_gb` set below what DDP needs (a model too large for one process's budget: the
  layouts that replicate the optimizer states do not fit);
- moe: `model=tiny_moe model.n_experts=4` (ep is searched);
- long: a 1,024-token sequence under a 0.06 GB budget that only layouts splitting the sequence or the model meet.

the planner ranks the layouts that fit on this machine's calibrated profile (trainer/planner/profiles.py; the
first configuration calibrates this machine once when no profile is cached) exactly as `strategy=auto` does
(`auto.ranked_layouts`, `auto.choose`). Measured are: every feasible parallel layout (strategy, tp, pp, cp,
ep, data-parallel flavour), each at the schedule, activation-checkpointing policy and micro-batch the planner
predicts best for it (the `--max-layouts` best predicted of them: a measurement costs 5-20 s here), plus the top
`--trials` predicted layouts whatever they are. Each is trained for `--warmup` + `--steps` steps
(`trainer.planner.trials.measure`: the median over the timed steps of the slowest rank's step time) in a
torchrun launch of 4 processes that measures `--per-launch` candidates plus the auto pick, in the order
A B C ... then ... C B A (two rounds, so that a drift of the shared machine's load touches every layout
alike). A launch holds few trials because each trial leaves its mesh's gloo groups and threads behind, which
torch does not free, and a long launch slows down as they pile up (in one launch of 58 trials a layout's
second round ran up to 1.8x its first). Every candidate is measured against the auto pick of its own launch:
its figure is (its mean over the two rounds / the pick's mean in that launch) x the pick's mean over all the
configuration's launches, so launches run under different loads still compare (the table's "rounds" are a
candidate's two rounds, and for the pick its mean in each launch).

The pick with `plan.trials=0` is the best predicted; with `plan.trials=K` the fastest measured of the K best
predicted (what trainer/planner/trials.py does in a run, here from the same measurements). Each is reported as
its measured step time over the fastest measured layout's (target: within 10%). The last line is one JSON
object.

    python benchmarks/strategy_auto.py [--only tiny,budget,moe,long] [--steps 6] [--warmup 1] [--trials 3]
        [--max-layouts 0] [--per-launch 8]     # defaults: every feasible layout, 6 timed steps (48 min here)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

COMMON = ["trainer.devices=4", "trainer.num_threads=1", "trainer.peak_flops=1e12", "data.max_bytes=300000",
          "trainer.hang_timeout_s=0", "trainer.log_every=1", "lr_schedule.warmup_steps=1", "trainer.val_batches=1"]
CONFIGS = {
    "tiny": ["trainer.seq_len=128", "trainer.global_batch_size=16"],
    "budget": ["trainer.seq_len=128", "trainer.global_batch_size=16", "hardware.memory_gb=0.06",
               "hardware.reserved_gb=0"],
    "moe": ["model=tiny_moe", "model.n_experts=4", "trainer.seq_len=128", "trainer.global_batch_size=16"],
    "long": ["trainer.seq_len=1024", "model.max_seq_len=1024", "trainer.global_batch_size=4",
             "hardware.memory_gb=0.06", "hardware.reserved_gb=0"],
}
TARGET = 0.10


def feasible(name: str, overrides: list[str], trials: int, max_layouts: int) -> dict[str, Any]:
    """The planner's side: the auto pick, the top `trials`, and one candidate per feasible parallel layout."""
    from trainer.cli import on_workers
    from trainer.config import compose
    from trainer.planner import auto
    from trainer.planner.search import describe, layout_overrides

    request = auto.parse_request(["strategy=auto", *COMMON, *overrides])
    cfg = compose([*request.base, "mode=plan"])
    hardware, options, profile = auto.profile_for_run(request, cfg, on_workers)
    choice = auto.choose(request, hardware, options, mode="train", trials=trials, profile=profile)
    _, _, _, _, ranked = auto.ranked_layouts(request, hardware, options)
    rows: dict[tuple[str, ...], dict[str, Any]] = {}
    groups: set[tuple[Any, ...]] = set()
    for layout, estimates in ranked:
        group = (layout.strategy, layout.tp, layout.pp, layout.cp, layout.ep, layout.dp_flavour)
        changes = layout_overrides(layout)
        if changes not in choice.trials and (group in groups or len(groups) >= max_layouts):
            continue
        if not auto.validates(request, changes, "train"):
            continue
        groups.add(group)
        rows[tuple(changes)] = {"description": describe(layout), "changes": changes,
                                "overrides": [*request.base, *changes],
                                "predicted_s": estimates[0].timing.step_time_s,
                                "memory_gb": max(e.device["total"] for e in estimates) / 1e9}
    parallel = {(lay.strategy, lay.tp, lay.pp, lay.cp, lay.ep, lay.dp_flavour) for lay, _ in ranked}
    return {"name": name, "profile": profile, "capacity_gb": choice.capacity_gb, "fitting": choice.fitting,
            "parallel_layouts": len(parallel),
            "auto": choice.layout_overrides, "auto_description": choice.chosen, "trials": choice.trials,
            "candidates": list(rows.values())}


def worker(spec_path: Path) -> None:
    """One torchrun worker: measure every candidate of every configuration, two rounds in opposite orders."""
    import torch.distributed as dist

    from trainer.config import compose
    from trainer.launch import configure_worker_logging
    from trainer.planner.trials import measure, shortened

    spec = json.loads(spec_path.read_text())
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    out = Path(spec["out"])
    configure_worker_logging(rank, out)
    jobs = [(c, i) for c, config in enumerate(spec["configs"]) for i in range(len(config["candidates"]))]
    measured: dict[str, list[float]] = {}
    for order in (jobs, list(reversed(jobs))):
        for c, i in order:
            candidate = spec["configs"][c]["candidates"][i]
            box = [compose(candidate["overrides"]) if rank == 0 else None]
            dist.broadcast_object_list(box, src=0)
            cfg = shortened(box[0], spec["warmup"], spec["steps"])
            started = time.perf_counter()
            step = measure(cfg, out / f"{c}-{i}", spec["warmup"])
            measured.setdefault(f"{c}-{i}", []).append(step)
            if rank == 0:
                print(f"[{spec['configs'][c]['name']}] {candidate['description']}: {step * 1e3:.1f} ms per step "
                      f"({time.perf_counter() - started:.1f} s)", file=sys.stderr, flush=True)
    if rank == 0:
        (out / "measured.json").write_text(json.dumps(measured))
    dist.destroy_process_group()


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def measure_config(config: dict[str, Any], args: argparse.Namespace) -> None:
    """Measure every candidate of `config` in launches of `args.per_launch` plus the auto pick (the reference);
    sets each candidate's `measured_rounds_s`, `reference_rounds_s` (the pick's, same launch) and `measured_s`."""
    rows = config["candidates"]
    reference = next(i for i, row in enumerate(rows) if row["changes"] == config["auto"])
    others = [i for i in range(len(rows)) if i != reference]
    per_launch = args.per_launch or len(others) or 1
    references: list[float] = []
    for start in range(0, max(len(others), 1), per_launch):
        chunk = [reference, *others[start:start + per_launch]]
        with tempfile.TemporaryDirectory(prefix="strategy_auto-") as tmp:
            spec = Path(tmp) / "spec.json"
            spec.write_text(json.dumps({"out": tmp, "steps": args.steps, "warmup": args.warmup,
                                        "configs": [{**config, "candidates": [rows[i] for i in chunk]}]}))
            command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4",
                       __file__, f"--worker={spec}"]
            done = subprocess.run(command, env={**os.environ, "PYTHONPATH": str(REPO)})
            if done.returncode != 0:
                sys.exit(done.returncode)
            measured = json.loads((Path(tmp) / "measured.json").read_text())
        reference_rounds = measured["0-0"]
        references.append(_mean(reference_rounds))
        for position, i in enumerate(chunk):
            if i != reference:
                rows[i]["measured_rounds_s"] = measured[f"0-{position}"]
                rows[i]["reference_rounds_s"] = reference_rounds
    reference_s = _mean(references)
    rows[reference]["measured_rounds_s"] = references
    rows[reference]["reference_rounds_s"] = references
    for row in rows:
        row["measured_s"] = reference_s * _mean(row["measured_rounds_s"]) / _mean(row["reference_rounds_s"])


def report(configs: list[dict[str, Any]], trials: int) -> dict[str, Any]:
    results = {}
    for config in configs:
        rows = config["candidates"]
        fastest = min(rows, key=lambda r: r["measured_s"])
        by_changes = {tuple(r["changes"]): r for r in rows}
        pick = by_changes[tuple(config["auto"])]
        top = [by_changes[tuple(t)] for t in config["trials"]]
        with_trials = min(top, key=lambda r: r["measured_s"]) if top else pick
        print(f"\n{config['name']}: {config['fitting']} layouts fit ({config['capacity_gb']:.3f} GB usable per rank) in "
              f"{config['parallel_layouts']} parallel layouts (strategy, tp, pp, cp, ep, dp flavour), {len(rows)} "
              f"measured; profile: {config['profile']}")
        print(f"{'layout':<62}{'pred ms':>9}{'meas ms':>9}{'rounds':>12}{'pick rounds':>14}{'vs fastest':>11}  pick")
        for row in sorted(rows, key=lambda r: r["measured_s"]):
            marks = [m for m, r in (("auto", pick), (f"auto+trials={trials}", with_trials)) if r is row]
            rounds = ", ".join(f"{t * 1e3:.0f}" for t in row["measured_rounds_s"])
            pick_rounds = ", ".join(f"{t * 1e3:.0f}" for t in row["reference_rounds_s"])
            print(f"{row['description']:<62}{row['predicted_s'] * 1e3:>9.1f}{row['measured_s'] * 1e3:>9.1f}"
                  f"{rounds:>12}{pick_rounds:>14}{row['measured_s'] / fastest['measured_s']:>11.3f}  {' '.join(marks)}")
        results[config["name"]] = {
            "fitting": config["fitting"], "parallel_layouts": config["parallel_layouts"],
            "measured_layouts": len(rows), "profile": config["profile"],
            "auto": pick["description"], "auto_ratio": pick["measured_s"] / fastest["measured_s"],
            "auto_trials": with_trials["description"],
            "auto_trials_ratio": with_trials["measured_s"] / fastest["measured_s"],
            "fastest": fastest["description"], "fastest_s": fastest["measured_s"],
            "auto_within_target": pick["measured_s"] <= (1 + TARGET) * fastest["measured_s"],
            "auto_trials_within_target": with_trials["measured_s"] <= (1 + TARGET) * fastest["measured_s"],
            "auto_memory_gb": pick["memory_gb"], "capacity_gb": config["capacity_gb"],
            "rows": [{k: r[k] for k in ("description", "changes", "predicted_s", "measured_s", "measured_rounds_s",
                                        "reference_rounds_s", "memory_gb")} for r in rows],
        }
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=",".join(CONFIGS), help="comma-separated names of " + ", ".join(CONFIGS))
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--max-layouts", type=int, default=0,
                        help="parallel layouts measured per configuration, best predicted first (0: all)")
    parser.add_argument("--per-launch", type=int, default=8,
                        help="candidates per torchrun launch, each beside the auto pick (0: all in one launch)")
    parser.add_argument("--worker", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        worker(args.worker)
        return
    os.environ["OMP_NUM_THREADS"] = "1"
    configs = [feasible(name, CONFIGS[name], args.trials, args.max_layouts or 10**6)
               for name in args.only.split(",")]
    for config in configs:
        measure_config(config, args)
    results = report(configs, args.trials)
    load = os.getloadavg()
    print(f"\nload average after the runs (1, 5, 15 min): {load[0]:.1f} {load[1]:.1f} {load[2]:.1f} on "
          f"{os.cpu_count()} cores")
    for name, row in results.items():
        print(f"{name:<8} auto {row['auto_ratio']:.3f} x fastest, auto+trials {row['auto_trials_ratio']:.3f} x "
              f"fastest ({row['measured_layouts']} layouts measured)")
    print(json.dumps({"configs": results, "target": TARGET, "trials": args.trials, "steps": args.steps,
                      "warmup": args.warmup, "per_launch": args.per_launch, "load_average": load}, default=str))


if __name__ == "__main__":
    main()
