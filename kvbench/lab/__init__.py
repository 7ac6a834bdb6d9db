"""``kvbench lab``: a small fabric of network namespaces to prove fabric features against shaped rates (root).

``net`` builds and removes it (N node namespaces, each with R veth NICs ``rail0``..``rail<R-1>`` into R rail
bridges of a switch namespace, tbf on both ends of every link; ``--spine`` routes between the rails through
bridges shaped at its rate) and records it so ``down`` finds it; ``place`` launches a kvbench run with its
ranks in the nodes' namespaces; ``cmd`` is the command line (up, run, down, status).

Public API: ``net.up``, ``net.down``, ``net.Lab``, ``net.labs``, ``place.command``, ``cmd.main``.
"""
from __future__ import annotations

from kvbench.lab.cmd import main

__all__ = ["main"]
