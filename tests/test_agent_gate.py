"""The gate an agent's I/O threads pass before each block the storage writes of a save's files
(``ckptd.agent.gate.Gate``; a "file" below is one such call): the rate limit's pace and the
stop that hands a save over to the peer holding its copy."""

from __future__ import annotations

import threading

import pytest
from agent_procs import wait_until

from ckptd.agent.gate import Gate
from ckptd.writer.job import Interrupted as Stopped


def test_without_a_rate_every_file_passes_and_is_counted():
    g = Gate()
    for n in (3, 5, 7):
        g(n)
    assert g.started == 15 and not g.stopped


def test_a_stop_ends_a_file_s_wait_for_its_turn_and_every_later_file():
    g = Gate(rate=1.0)  # one byte per second: the second file's turn is 10 s away
    g(10)  # the first file goes at once
    outcome: list[BaseException | None] = []

    def second() -> None:
        try:
            g(4)
            outcome.append(None)
        except BaseException as e:  # noqa: BLE001 - inspected below
            outcome.append(e)

    t = threading.Thread(target=second)
    t.start()
    wait_until(lambda: g._booked == 14, 30, "the second file to wait for its turn")
    g.stop()
    t.join(60)  # a bound for a failure only: the stop ends the wait
    assert not t.is_alive()
    assert len(outcome) == 1 and isinstance(outcome[0], Stopped)
    with pytest.raises(Stopped):
        g(1)
    assert g.started == 10  # only what passed: the stopped files are not counted
    assert g.stopped


def test_a_file_whose_turn_has_come_passes_a_paced_gate():
    g = Gate(rate=1e12)  # every turn is due at once
    g(1 << 20)
    g(1 << 20)
    assert g.started == 2 << 20
