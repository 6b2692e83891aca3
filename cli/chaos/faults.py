"""The faults ``lanes chaos`` applies, each under its own load, each judged by a ledger.

Every fault sends requests, breaks something for real, waits (bounded) until each request
has ended, and returns the tally plus what it measured. A request with no terminal frame
when its fault's time is up is *lost*; the promise is that none is.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from dataclasses import dataclass, field

from lanes.bench.common import cpu_s
from lanes.cli.chaos.load import Ledger, LoadClient, Tally, until
from lanes.cli.chaos.rig import Rig

#: How long a fault waits for its requests to end before counting the rest as lost.
END_TIMEOUT_S = 90.0


@dataclass
class FaultReport:
    name: str
    tally: Tally
    #: Measurements and facts of this fault (seconds, ms, counts), for the table's last column.
    notes: dict[str, float | int | str] = field(default_factory=dict)
    #: Whether the load reached the state the fault needs (answers streaming) before it struck;
    #: a fault that struck an idle system proves nothing (the run then fails, as for a loss).
    exercised: bool = True



async def _send(client: LoadClient, tag: str, count: int, max_tokens: int) -> list[str]:
    ids = [f"{tag}-{i}" for i in range(count)]
    for rid in ids:
        await client.chat(rid, max_tokens)
    return ids


async def _wait_ended(ledger: Ledger, ids: list[str]) -> None:
    await until(lambda: not ledger.open_ids(ids), END_TIMEOUT_S)


def _streaming(ledger: Ledger, ids: list[str], min_deltas: int = 2) -> int:
    return sum(len(ledger[rid].seqs) >= min_deltas and ledger[rid].end is None for rid in ids)


async def _holders(rig: Rig, ids: list[str]) -> dict[str, list[str]]:
    """Worker id -> the running requests it holds (from the request hashes)."""
    held: dict[str, list[str]] = {}
    for rid, (state, worker) in (await rig.request_states(ids)).items():
        if state == "running" and worker:
            held.setdefault(worker, []).append(rid)
    return held


async def worker_kill(rig: Rig) -> FaultReport:
    """SIGKILL the busiest worker mid-answer; a replacement is started once the fault is over.

    The load fills under two thirds of the slots, so the survivors have room for the dead
    worker's requests and the measured recovery is the lease + reaper path, not a wait in line.
    """
    cluster = rig.cluster
    ledger = Ledger()
    client = await LoadClient.connect(cluster.edge_urls["edge_a"], ledger)
    num_workers = cluster.num_workers()
    count = (num_workers - 1) * rig.slots_per_worker - 1
    ids = await _send(client, "wk", count, max_tokens=150)
    exercised = await until(lambda: _streaming(ledger, ids, 3) >= count * 2 // 3, 30)
    held = await _holders(rig, ids)
    victim = max(held, key=lambda w: len(held[w]))
    killed_at = time.monotonic()
    cluster.kill(victim.removeprefix(f"{cluster.prefix}-"))
    await asyncio.sleep(0.3)  # what the dead worker had published is delivered by now
    before = {rid: len(ledger[rid].seqs) for rid in held[victim]}
    await _wait_ended(ledger, ids)
    await client.close()
    recovered = sorted(ledger[rid].delta_arrivals[n] - killed_at for rid, n in before.items()
                       if len(ledger[rid].delta_arrivals) > n)
    rig.start_worker(f"{victim.removeprefix(cluster.prefix + '-')}r")
    notes: dict[str, float | int | str] = {"killed_holding": len(before)}
    if recovered:
        notes |= {"recovery_first_s": round(recovered[0], 2), "recovery_last_s": round(recovered[-1], 2)}
    return FaultReport("worker kill -9", ledger.tally(ids), notes, exercised)


async def client_cancel(rig: Rig) -> FaultReport:
    """Cancel queued and running requests; a second client disconnects for good."""
    cluster = rig.cluster
    ledger = Ledger()
    stays = await LoadClient.connect(cluster.edge_urls["edge_a"], ledger)
    leaves = await LoadClient.connect(cluster.edge_urls["edge_b"], ledger)
    ids = await _send(stays, "cc", 40, max_tokens=300)
    gone = await _send(leaves, "cd", 10, max_tokens=300)
    exercised = await until(lambda: _streaming(ledger, ids + gone) >= 20
                            and all(ledger[r].accepted for r in ids + gone), 30)
    to_cancel = ids[::2]
    running = {rid for rid in to_cancel if ledger[rid].seqs}
    sent_at: dict[str, float] = {}
    for rid in to_cancel:
        sent_at[rid] = time.monotonic()
        await stays.cancel(rid)
    for rid in gone:
        ledger[rid].departed = True
    await leaves.close()
    await _wait_ended(ledger, ids)
    await _confirm_departed_cancelled(rig, ledger, gone)
    await stays.close()
    abort_ms = [(ledger[r].ended_at - sent_at[r]) * 1000 for r in running if ledger[r].ended_at]
    notes: dict[str, float | int | str] = {"cancelled_running": len(running),
                                           "cancelled_queued": len(to_cancel) - len(running),
                                           "disconnected": len(gone)}
    if abort_ms:
        notes |= {"cancel_to_done_p50_ms": round(statistics.median(abort_ms), 1),
                  "cancel_to_done_max_ms": round(max(abort_ms), 1)}
    return FaultReport("client cancel/disconnect", ledger.tally(ids + gone), notes, exercised)


async def _confirm_departed_cancelled(rig: Rig, ledger: Ledger, ids: list[str]) -> None:
    """A departed client's requests count as cancelled only if Redis says so (else lost)."""
    states: dict[str, tuple[str, str]] = {}
    for _ in range(50):
        states = await rig.request_states(ids)
        if all(state == "cancelled" for state, _ in states.values()):
            break
        await asyncio.sleep(0.1)
    for rid, (state, _) in states.items():
        ledger[rid].departed_cancelled = state == "cancelled"


async def edge_kill(rig: Rig) -> FaultReport:
    """SIGKILL the client's edge mid-answer; it resumes every request on the other edge."""
    cluster = rig.cluster
    ledger = Ledger()
    first = await LoadClient.connect(cluster.edge_urls["edge_a"], ledger)
    ids = await _send(first, "ek", 40, max_tokens=200)
    exercised = await until(lambda: all(ledger[r].accepted for r in ids) and _streaming(ledger, ids) >= 15, 30)
    cluster.kill("edge_a")
    await asyncio.wait_for(first.reader, 10)
    await asyncio.sleep(0.3)  # answers go on, and some end, while no edge listens
    second = await LoadClient.connect(cluster.edge_urls["edge_b"], ledger)
    resumed = ledger.open_ids(ids)
    resumed_at = time.monotonic()
    for rid in resumed:
        await second.resume(rid)
    await _wait_ended(ledger, ids)
    await second.close()
    await asyncio.to_thread(cluster.start_edge, "edge_a")  # back for the next faults (new port, same id)
    last_end = max((ledger[r].ended_at or resumed_at) for r in resumed) if resumed else resumed_at
    return FaultReport("edge kill -9 + resume", ledger.tally(ids),
                       {"resumed": len(resumed), "all_ended_after_resume_s": round(last_end - resumed_at, 2)},
                       exercised and bool(resumed))


async def overload(rig: Rig, capacity: int) -> FaultReport:
    """A burst of ~10x the slots at once over several connections and both edges."""
    cluster = rig.cluster
    ledger = Ledger()
    num_clients, total = 8, 10 * capacity
    urls = [cluster.edge_urls["edge_a"], cluster.edge_urls["edge_b"]]
    clients = [await LoadClient.connect(urls[i % 2], ledger) for i in range(num_clients)]
    batches = await asyncio.gather(*(_send(c, f"ov{i}", total // num_clients, max_tokens=40)
                                     for i, c in enumerate(clients)))
    ids = [rid for batch in batches for rid in batch]
    started = time.monotonic()
    await _wait_ended(ledger, ids)
    drained_s = time.monotonic() - started
    for c in clients:
        await c.close()
    return FaultReport("overload burst 10x", ledger.tally(ids),
                       {"burst": len(ids), "slots": capacity, "drained_s": round(drained_s, 2)})


async def redis_restart(rig: Rig, num_workers: int, outage_s: float = 2.0) -> FaultReport:
    """Stop redis-server under load, start it again (empty) on the same port."""
    cluster = rig.cluster
    ledger = Ledger()
    client = await LoadClient.connect(cluster.edge_urls["edge_a"], ledger)
    ids = await _send(client, "rr", 20, max_tokens=300)
    exercised = await until(lambda: _streaming(ledger, ids) >= 10, 30)
    cluster.stop_redis()
    cpu_before = {name: cpu_s(p.pid) for name, p in cluster.procs.items() if p.poll() is None}
    during = await _send(client, "rd", 5, max_tokens=20)  # expect ``unavailable`` at once
    await asyncio.sleep(outage_s)
    cpu_share = {n: (cpu_s(cluster.procs[n].pid) - c) / outage_s for n, c in cpu_before.items()
                 if cluster.procs[n].poll() is None}
    crashed = cluster.crashed()
    cluster.start_redis()
    restarted_at = time.monotonic()
    await _wait_ended(ledger, ids + during)
    in_flight_ended_s = time.monotonic() - restarted_at
    try:
        await rig.wait_workers(num_workers, 30)
    except (TimeoutError, RuntimeError):
        pass  # the requests below then show it
    after = await _send(client, "ra", 10, max_tokens=40)
    await _wait_ended(ledger, after)
    await client.close()
    return FaultReport("redis restart", ledger.tally(ids + during + after), {
        "outage_s": outage_s, "max_cpu_share_down": round(max(cpu_share.values(), default=0.0), 3),
        "crashed": ",".join(crashed) or "none", "in_flight_ended_after_restart_s": round(in_flight_ended_s, 2),
    }, exercised)


async def run_all(rig: Rig, num_workers: int) -> list[FaultReport]:
    """Start the processes, then every fault in turn (Redis last: it empties the state)."""
    cluster = rig.cluster
    cluster.start_scheduler()
    for name in ("edge_a", "edge_b"):
        await asyncio.to_thread(cluster.start_edge, name)
    for i in range(num_workers):
        rig.start_worker(f"w{i}")
    await rig.wait_workers(num_workers)
    capacity = num_workers * rig.slots_per_worker
    reports = [await worker_kill(rig)]
    await rig.wait_workers(num_workers)
    reports.append(await client_cancel(rig))
    reports.append(await edge_kill(rig))
    reports.append(await overload(rig, capacity))
    reports.append(await redis_restart(rig, num_workers))
    return reports

