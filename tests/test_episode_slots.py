"""`EpisodeSlots`: `max_concurrency` over every step rolling out at once (each on its own thread and event loop),
an earlier step's episodes before a later step's, first come first served within a step, and no slot lost to a
cancelled episode."""

import asyncio
import threading
import time

import pytest

from drmas_graph.errors import ConfigError
from drmas_graph.train.loop._rollouts import EpisodeSlots


class Occupancy:
    """Counts holders of a slot: the most at once, and the order they got it in."""

    def __init__(self) -> None:
        self.lock, self.now, self.most, self.order = threading.Lock(), 0, 0, []

    async def hold(self, slots: EpisodeSlots, key, name: str, seconds: float) -> None:
        async with slots.slot(key):
            with self.lock:
                self.now += 1
                self.most = max(self.most, self.now)
                self.order.append(name)
            await asyncio.sleep(seconds)
            with self.lock:
                self.now -= 1


def step_thread(slots, occ, key, episodes, seconds):
    """A step's rollouts as `run_episodes` runs them: its own thread and event loop, opened, then closed. `seconds`:
    how long each episode holds its slot (one number for all, or one per episode)."""
    hold = list(seconds) if isinstance(seconds, (list, tuple)) else [seconds] * episodes

    async def main():
        await asyncio.gather(*(occ.hold(slots, key, f"{key}.{i}", hold[i]) for i in range(episodes)))

    def run():
        slots.open(key, episodes)
        try:
            asyncio.run(main())
        finally:
            slots.close(key)

    return threading.Thread(target=run)


def run_all(threads, stagger=0.0):
    for t in threads:
        t.start()
        time.sleep(stagger)
    for t in threads:
        t.join(timeout=60)
        assert not t.is_alive()


def test_slots_bound_the_episodes_of_every_event_loop_together():
    slots, occ = EpisodeSlots(3), Occupancy()
    run_all([step_thread(slots, occ, s, 8, 0.02) for s in range(3)])
    assert len(occ.order) == 24 and occ.most == 3  # a semaphore per loop would let 9 in at once
    assert slots.free == 3 and not slots._calls


def test_an_announced_step_gets_every_slot_it_needs_before_a_later_step_gets_any():
    """Step 1's thread starts first, yet waits: step 0 was announced before it (as the pipeline does, in step
    order), so free slots are kept for step 0's episodes until each of them has one. (Episode 0.1 holds its slot
    longest: were 0.0 and 0.1 to end in the same loop iteration, 0.2's slot, granted first, could reach its loop
    after step 1 took the other one, and the order recorded here would race.)"""
    slots, occ = EpisodeSlots(2), Occupancy()
    slots.announce(0)
    slots.announce(1)
    late = step_thread(slots, occ, 1, 3, 0.0)
    late.start()
    time.sleep(0.2)
    assert occ.order == [] and slots.free == 2  # held for step 0
    run_all([step_thread(slots, occ, 0, 3, [0.05, 0.3, 0.05])])
    late.join(timeout=60)
    assert occ.order == ["0.0", "0.1", "0.2", "1.0", "1.1", "1.2"] and occ.most == 2
    assert slots.free == 2 and not slots._calls


def test_a_step_that_fails_before_its_rollouts_start_no_longer_holds_later_steps():
    slots, occ = EpisodeSlots(1), Occupancy()
    slots.announce(0)
    slots.announce(1)
    later = step_thread(slots, occ, 1, 2, 0.0)
    later.start()
    time.sleep(0.1)
    assert occ.order == []
    slots.close(0)  # step 0's collect raised before `run_episodes`
    later.join(timeout=60)
    assert occ.order == ["1.0", "1.1"] and slots.free == 1


def test_a_cancelled_waiter_gives_up_its_place_and_a_slot_is_never_lost():
    slots = EpisodeSlots(1)
    got = []

    async def main():
        async def take(name, seconds):
            async with slots.slot("s"):
                got.append(name)
                await asyncio.sleep(seconds)

        holder = asyncio.create_task(take("holder", 0.2))
        await asyncio.sleep(0.01)
        waiter = asyncio.create_task(take("cancelled", 0.0))
        after = asyncio.create_task(take("after", 0.0))
        await asyncio.sleep(0.01)
        waiter.cancel()  # queued: it leaves the queue
        await asyncio.gather(holder, after, return_exceptions=True)
        assert waiter.cancelled()
        # a slot handed over while its waiter is being cancelled is passed on, not lost
        blocker = asyncio.create_task(take("blocker", 0.05))
        await asyncio.sleep(0.01)
        racing = asyncio.create_task(take("racing", 0.0))
        await asyncio.sleep(0.01)
        await blocker  # releases: the slot is on its way to `racing` ...
        racing.cancel()  # ... which is cancelled before it runs
        await asyncio.gather(racing, return_exceptions=True)
        async with slots.slot("s"):
            got.append("last")

    slots.open("s", 6)
    asyncio.run(asyncio.wait_for(main(), 10))
    assert got[:2] == ["holder", "after"] and got[-1] == "last" and "cancelled" not in got
    assert slots.free == 1 and not slots._calls  # 6 episodes: each granted or cancelled


def test_a_closed_event_loops_waiter_is_skipped():
    slots = EpisodeSlots(1)
    slots.open("s", 3)
    held, release = threading.Event(), threading.Event()

    async def holder():
        async with slots.slot("s"):
            held.set()
            while not release.is_set():
                await asyncio.sleep(0.01)

    t = threading.Thread(target=asyncio.run, args=(holder(),))
    t.start()
    held.wait(10)
    dead = asyncio.new_event_loop()
    dead_waiter = dead.create_future()
    slots._calls["s"].waiting.append((dead, dead_waiter))  # an episode whose event loop ended while it waited
    dead.close()
    release.set()
    t.join(10)
    assert slots.free == 1 and slots._calls["s"].left == 1  # the slot came back; one episode still to come


def test_slots_refuse_a_bound_below_one():
    with pytest.raises(ConfigError, match="max_concurrency"):
        EpisodeSlots(0)
