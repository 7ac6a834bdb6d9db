"""Stand-ins for hardware interfaces this machine does not have, holding kvbench to the real interfaces' rules."""
