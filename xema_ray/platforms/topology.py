"""Worker ordering by interconnect: put NVLink-connected GPUs at adjacent ranks.

The dispatcher places an SP-2 batch on an aligned pair of ranks (0-1, 2-3, ...), so ordering the
workers of a group so that each aligned pair is an NVLink pair (the reference box bridges GPUs in
pairs) keeps SP traffic off PCIe. Pure logic here; the CUDA platform reads the links from NVML.
"""

from __future__ import annotations


def pair_order(devices: list[str], links: dict[str, set[str]]) -> list[int]:
    """Worker indices reordered so linked devices sit at ranks (2k, 2k+1) where possible.

    Args:
        devices: a device id per worker (e.g. PCI bus ids), in bundle order.
        links: device id -> ids it has a direct NVLink to.

    Example:
        >>> pair_order(["a", "b", "c", "d"], {"a": {"c"}, "c": {"a"}, "b": {"d"}, "d": {"b"}})
        [0, 2, 1, 3]
    """
    if len(set(devices)) != len(devices):
        raise ValueError(f"device ids must be distinct, got {devices}")
    order: list[int] = []
    unpaired: list[int] = []
    used: set[int] = set()
    for i, dev in enumerate(devices):
        if i in used:
            continue
        used.add(i)
        mate = next((j for j in range(i + 1, len(devices))
                     if j not in used and devices[j] in links.get(dev, set())), None)
        if mate is None:
            unpaired.append(i)
        else:
            used.add(mate)
            order += [i, mate]
    return order + unpaired
