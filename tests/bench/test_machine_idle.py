"""The benches' reading of how busy the machine is: other processes' CPU is the machine's less this process's."""
from __future__ import annotations

from bench.lib.machine_idle import machine_cpu, others_cpu_s


def test_other_processes_cpu_is_the_machines_less_this_ones_and_never_negative() -> None:
    assert others_cpu_s((100.0, 10.0), (104.0, 11.5)) == 2.5
    assert others_cpu_s((100.0, 10.0), (101.0, 12.0)) == 0.0  # clock ticks: this process's count can lead


def test_a_busy_loop_here_counts_as_this_process_not_as_others() -> None:
    a = machine_cpu()
    x = 0
    for i in range(3_000_000):
        x += i
    b = machine_cpu()
    assert b[0] >= a[0] and b[1] > a[1]
