"""NUMA-aware placement: pin the prefill job to the CPUs of its GPU's NUMA node.

On a multi-socket host, a GPU hangs off one socket's PCIe root; host-side work (the
tokenizer, snapshot encoding, the copies to and from the GPU) is faster on that
socket's cores and memory. Linux says which node a PCI device belongs to in
``/sys/bus/pci/devices/<address>/numa_node`` and which CPUs a node has in
``/sys/devices/system/node/node<N>/cpulist``. Where either is missing (a laptop, a
container without /sys, one socket, no GPU) this is a no-op.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

log = logging.getLogger(__name__)


def parse_cpulist(text: str) -> set[int]:
    """Parse a kernel CPU list such as ``0-3,8,10-11``."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        if "-" in part:
            lo, hi = part.split("-", 1)
            cpus.update(range(int(lo), int(hi) + 1))
        else:
            cpus.add(int(part))
    return cpus


def node_cpus(pci_address: str, sysfs: Path = Path("/sys")) -> set[int] | None:
    """CPUs of the NUMA node a PCI device belongs to, or ``None`` when /sys does not say."""
    node_file = sysfs / "bus" / "pci" / "devices" / pci_address.lower() / "numa_node"
    try:
        node = int(node_file.read_text().strip())
    except (OSError, ValueError):
        return None
    if node < 0:  # -1: the platform has no NUMA information for the device
        return None
    try:
        cpus = parse_cpulist((sysfs / "devices" / "system" / "node" / f"node{node}" / "cpulist").read_text())
    except (OSError, ValueError):
        return None
    return cpus or None


def gpu_pci_address(device: torch.device) -> str | None:
    """The PCI address (``0000:3b:00.0``) of a CUDA device, when torch reports it."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(device.index or 0)
    bus = getattr(props, "pci_bus_id", None)
    if bus is None:
        return None
    return f"{getattr(props, 'pci_domain_id', 0):04x}:{bus:02x}:{getattr(props, 'pci_device_id', 0):02x}.0"


def pin_to_device(device: torch.device, sysfs: Path = Path("/sys")) -> set[int] | None:
    """Restrict this process to the CPUs of ``device``'s NUMA node; returns them, or ``None`` (no-op).

    Only CPUs this process may already use are kept, so a container's cpuset is honoured.
    """
    address = gpu_pci_address(device)
    if address is None:
        return None
    cpus = node_cpus(address, sysfs)
    if not cpus or not hasattr(os, "sched_setaffinity"):
        return None
    allowed = os.sched_getaffinity(0) & cpus
    if not allowed or allowed == os.sched_getaffinity(0):
        return None
    os.sched_setaffinity(0, allowed)
    log.info("pinned to the %d CPU(s) of %s's NUMA node", len(allowed), address)
    return allowed
