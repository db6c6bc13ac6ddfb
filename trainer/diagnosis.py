"""From every rank's hang report (`<run dir>/hang/rank_R.json`) to one paragraph naming who waits where.

A pure function of the reports (tests feed it hand-made ones): the watchdog of rank 0 calls it once every
rank has written its report, or when the others' reports are late (a rank that cannot write is named).

Reading rules:
- a pipeline receive that never finished is matched with the peer's send of the same step and index
  among that step's operations towards that peer (the micro-batch when a rank holds one stage): no such
  send means the peer never sent it;
- collectives are matched per process group by the group's sequence number, the same on every member:
  the members whose last number is the group's highest wait in that collective, the members behind never
  entered it;
- a rank not named by those rules whose flight recorder holds a collective that has not completed (a
  DDP bucket all-reduce issued from autograd's hooks, an FSDP reduce-scatter: the Python stack shows the
  backward, not the collective) waits in the oldest such one that has members of its group that wrote no
  report or never issued it, for those members (an entry without such members tells nothing, nor does one
  of a group whose members are unknown, such as an asynchronous checkpoint's background write: the next
  older entry is read);
- every rank not named by those rules is "not in a collective", with where its main thread is;
- ranks that wrote no report are named last, with what rank 0 found out about their process (`absent`:
  stopped, gone, on another host).
"""

from __future__ import annotations

from typing import Any


def format_ranks(ranks: list[int]) -> str:
    """[0, 1, 2] -> "ranks 0-2"; [0, 2] -> "ranks 0 and 2"; [3] -> "rank 3"."""
    ranks = sorted(set(ranks))
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    if ranks == list(range(ranks[0], ranks[-1] + 1)) and len(ranks) > 2:
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return "ranks " + ", ".join(str(r) for r in ranks[:-1]) + f" and {ranks[-1]}"


def _where(report: dict[str, Any]) -> str:
    return f"it is in {report['location']}"


def _pending_recv(report: dict[str, Any]) -> dict[str, Any] | None:
    pending = [r for r in report.get("p2p", []) if r.get("finished_ns") is None and r["op"] == "recv"]
    return min(pending, key=lambda r: r["created_ns"]) if pending else None


def _has_send(report: dict[str, Any], to: int, step: int, index: int) -> bool:
    return any(r["op"] == "send" and r["peer"] == to and r["step"] == step and r["index"] == index
               for r in report.get("p2p", []))


def _pending_collectives(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The collectives of the rank's flight recorder that have not completed, oldest first (see the rules
    above)."""
    pending = [e for e in report.get("collectives", []) if e.get("pending") and not e.get("p2p")]
    return sorted(pending, key=lambda e: (e.get("created_ns") or 0, e["seq"]))


def diagnose(reports: dict[int, dict[str, Any]], world_size: int, timeout_s: float, hang_dir: str = "",
             absent: dict[int, str] | None = None) -> str:
    """One paragraph: what each stuck rank waits for, and who never got there (and where it is).
    `absent`: for ranks without a report, what is known of their process ("its process 812 is stopped")."""
    any_report = next(iter(reports.values()), {})
    step = max((r.get("step", 0) for r in reports.values()), default=0)
    phase = any_report.get("phase", "a training step")
    parts: list[str] = []
    named: set[int] = set()
    missing = [rank for rank in range(world_size) if rank not in reports]

    # 1. pipeline receives that never finished
    in_p2p = {rank for rank in reports if _pending_recv(reports[rank]) is not None}
    for rank in sorted(reports):
        recv = _pending_recv(reports[rank])
        if recv is None:
            continue
        peer = recv["peer"]
        what = "activations" if reports[rank].get("pp_stage", 0) > (reports.get(peer, {}).get("pp_stage", -1)) \
            else "gradients"
        text = (f"rank {rank} is in the pipeline receive ({what}) from rank {peer} for micro-batch "
                f"{recv['index']} of step {recv['step']} ({recv['group']} group)")
        if peer in reports and not _has_send(reports[peer], rank, recv["step"], recv["index"]):
            text += f", which rank {peer} never sent"
        parts.append(text)
        named.add(rank)

    # 2. collectives, per process group, by sequence number
    last: dict[str, dict[int, dict[str, Any]]] = {}
    members: dict[str, list[int]] = {}
    labels: dict[str, str] = {}
    for rank, report in reports.items():
        for pg, info in report.get("groups", {}).items():
            members[pg] = info["ranks"]
            labels[pg] = info["name"]
        for entry in report.get("collectives", []):
            if entry.get("p2p"):
                continue
            current = last.setdefault(entry["pg"], {}).get(rank)
            if current is None or entry["seq"] >= current["seq"]:
                last[entry["pg"]][rank] = entry
    for pg, by_rank in sorted(last.items(), key=lambda item: -len(members.get(item[0], item[1]))):
        group_ranks = [rank for rank in members.get(pg, sorted(by_rank)) if rank in reports]
        if len(group_ranks) < 2:
            continue
        seq_of = {rank: by_rank[rank]["seq"] if rank in by_rank else 0 for rank in group_ranks}
        lowest = min(seq_of.values())
        if lowest == max(seq_of.values()):
            continue  # every member entered the group's last collective
        label = labels.get(pg, by_rank[next(iter(by_rank))]["group"])
        # Every member but the furthest behind waits in its last collective of the group; those behind
        # never entered the next one (the one the member just ahead of them waits in).
        for level in sorted(set(seq_of.values()), reverse=True):
            if level == lowest:
                break
            waiting = [rank for rank in group_ranks if seq_of[rank] == level and rank not in in_p2p]
            if waiting:
                verb = "waits" if len(waiting) == 1 else "wait"
                parts.append(f"{format_ranks(waiting)} {verb} in {by_rank[waiting[0]]['op']} #{level} of the "
                             f"{label} group")
                named.update(waiting)
        pending = min((by_rank[rank] for rank in group_ranks if seq_of[rank] > lowest), key=lambda e: e["seq"])
        behind = [rank for rank in group_ranks if seq_of[rank] == lowest]
        for rank in behind:
            text = f"rank {rank} never entered {pending['op']} #{pending['seq']} of the {label} group"
            notes = [f"its last in that group is #{seq_of[rank]}"] if seq_of[rank] else []
            if rank in in_p2p:
                notes.append("it is in the pipeline receive above")
            if notes:
                text += f" ({'; '.join(notes)})"
            if rank not in in_p2p and rank not in named:
                text += f": {_where(reports[rank])}"
            parts.append(text)
            named.add(rank)

    # 3. collectives that have not completed, for members that wrote no report or never issued them
    waiting_in: dict[tuple[str, int, str], list[int]] = {}
    waits_for: dict[tuple[str, int, str], set[int]] = {}
    for rank in sorted(reports):
        if rank in named or rank in in_p2p:
            continue
        for entry in _pending_collectives(reports[rank]):
            pg = entry["pg"]
            others = [m for m in members.get(pg, []) if m != rank]
            behind = [m for m in others if m not in reports
                      or (last.get(pg, {}).get(m) or {"seq": 0})["seq"] < entry["seq"]]
            if behind:  # else every member issued it (or the members are unknown): it tells nothing
                break
        else:
            continue
        key = (pg, entry["seq"], entry["op"])
        waiting_in.setdefault(key, []).append(rank)
        waits_for.setdefault(key, set()).update(behind)
        labels.setdefault(pg, entry["group"])
        named.add(rank)
    for (pg, seq, op), waiting in waiting_in.items():
        behind = sorted(waits_for[(pg, seq, op)])
        silent = [m for m in behind if m not in reports]
        late = [m for m in behind if m in reports]
        who = [format_ranks(late)] if late else []
        if silent:
            who.append(f"{format_ranks(silent)}, which wrote no report")
        verb = "waits" if len(waiting) == 1 else "wait"
        label = labels[pg]
        parts.append(f"{format_ranks(waiting)} {verb} in {op} #{seq} of the {label} group for {' and '.join(who)}")
        for rank in late:
            if rank not in named:
                last_seq = (last.get(pg, {}).get(rank) or {"seq": 0})["seq"]
                notes = f" (its last in that group is #{last_seq})" if last_seq else ""
                parts.append(f"rank {rank} never entered {op} #{seq} of the {label} group{notes}: "
                             f"{_where(reports[rank])}")
                named.add(rank)

    # 4. the rest
    for rank in sorted(reports):
        if rank not in named:
            parts.append(f"rank {rank} is not in a collective: {_where(reports[rank])}")
    absent = absent or {}
    unexplained = [rank for rank in missing if not absent.get(rank)]
    if unexplained:
        parts.append(f"{format_ranks(unexplained)} wrote no report (dead, or stuck without releasing the GIL)")
    for rank in missing:
        if absent.get(rank):
            parts.append(f"rank {rank} wrote no report: {absent[rank]}")
    where = f" Stacks and last collectives of each rank: {hang_dir}/rank_R.txt." if hang_dir else ""
    during = phase if phase.startswith("step") else f"{phase} (step {step})"
    return (f"hang: no progress within {timeout_s:g} s during {during}: " + "; ".join(parts)
            + "." + where)
